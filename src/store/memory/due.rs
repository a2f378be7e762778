//! The records a shard must look at, by the tick they come due at: a queue for entries that
//! arrive in order and a heap for the rest.
//!
//! Records mostly come due in the order they settle (one TTL for a route), so most entries
//! append to the queue and leave from its front: a purge reads memory in order instead of
//! walking a heap's levels, each a cache miss at millions of records. An entry due sooner than
//! the queue's last (a shorter TTL) goes to the heap, and a pop takes whichever front is sooner.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

/// Entries packed as `tick << 32 | slab index`, so ordering by value orders by tick.
#[derive(Default)]
pub(super) struct Due {
    queue: VecDeque<u64>,
    heap: BinaryHeap<Reverse<u64>>,
}

impl Due {
    pub(super) fn push(&mut self, tick: u32, i: u32) {
        let packed = u64::from(tick) << 32 | u64::from(i);
        match self.queue.back() {
            Some(&last) if last >> 32 > u64::from(tick) => self.heap.push(Reverse(packed)),
            _ => self.queue.push_back(packed),
        }
    }

    /// The soonest entry, if its tick is at most `until`, taken off the index.
    pub(super) fn pop(&mut self, until: u32) -> Option<(u32, u32)> {
        let from_queue = match (self.queue.front(), self.heap.peek()) {
            (Some(&q), Some(Reverse(h))) => q <= *h,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (None, None) => return None,
        };
        let soonest = match from_queue {
            true => *self.queue.front()?,
            false => self.heap.peek()?.0,
        };
        if (soonest >> 32) as u32 > until {
            return None;
        }
        match from_queue {
            true => self.queue.pop_front(),
            false => self.heap.pop().map(|Reverse(p)| p),
        };
        Some(((soonest >> 32) as u32, soonest as u32))
    }

    pub(super) fn len(&self) -> usize {
        self.queue.len() + self.heap.len()
    }

    /// Keeps only the entries `(tick, index)` for which `keep` holds.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(u32, u32) -> bool) {
        let mut keep = |packed: u64| keep((packed >> 32) as u32, packed as u32);
        self.queue.retain(|&p| keep(p));
        let mut heap = std::mem::take(&mut self.heap).into_vec();
        heap.retain(|Reverse(p)| keep(*p));
        self.heap = BinaryHeap::from(heap);
    }

    /// Whether an entry is due by `until`.
    pub(super) fn any_by(&self, until: u32) -> bool {
        let by = |packed: u64| (packed >> 32) as u32 <= until;
        self.queue.front().is_some_and(|&q| by(q)) || self.heap.peek().is_some_and(|h| by(h.0))
    }

    /// Gives back what each half holds beyond four times its entries.
    pub(super) fn shrink(&mut self) {
        if self.queue.len() * 4 <= self.queue.capacity() {
            self.queue.shrink_to_fit();
        }
        if self.heap.len() * 4 <= self.heap.capacity() {
            self.heap.shrink_to_fit();
        }
    }

    #[cfg(test)]
    pub(super) fn capacity(&self) -> usize {
        self.queue.capacity() + self.heap.capacity()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Entries leave soonest first, from the queue or the heap, whatever order they came in,
    /// and only once due.
    #[test]
    fn s5_entries_leave_soonest_first_and_only_when_due() {
        let mut due = Due::default();
        let ticks = [5u32, 7, 7, 3, 9, 1, 8, 8, 2, 10, 6, 4];
        for (i, &t) in ticks.iter().enumerate() {
            due.push(t, i as u32);
        }
        assert!(!due.any_by(0));
        assert_eq!(due.pop(0), None, "nothing is due before its tick");
        let mut out = Vec::new();
        while let Some((tick, i)) = due.pop(u32::MAX) {
            assert_eq!(ticks[i as usize], tick);
            out.push(tick);
        }
        let mut sorted = ticks.to_vec();
        sorted.sort_unstable();
        assert_eq!(out, sorted);
        due.push(4, 0);
        due.push(6, 1);
        assert_eq!(due.pop(5), Some((4, 0)));
        assert_eq!(due.pop(5), None);
        assert!(due.any_by(6));
    }
}
