//! Purging: expired records taken out a slice at a time, by the sweeper, by a claim that
//! needs room, and by the tick under way.

use std::sync::atomic::Ordering;

use super::entry::Entry;
use super::shard::{Shard, now_tick, tick};
use super::{CLAIM_PURGES, MemoryStore, POLL_EVERY, SHARDS, SLICE, expired, free, lock};
use crate::store::RecordStatus;

impl MemoryStore {
    /// Purges every shard, one lock at a time and a slice per hold; returns how many records
    /// went.
    pub(super) fn sweep_all(&self, now: u64) -> u64 {
        (0..SHARDS).map(|i| self.purge_shard(i, now)).sum()
    }

    /// Takes what expired since the tick under way began: a sweep by whole ticks leaves it
    /// (records are due at their expiry's tick, rounded up), and a full store needs the room.
    /// One hold of each shard's lock for the tick's records; those not expired keep their
    /// entries.
    pub(super) fn sweep_tick_under_way(&self, now: u64) {
        let base = self.inner.base;
        let Some(under_way) = tick(now, base).filter(|&t| t > now_tick(now, base)) else {
            return;
        };
        let (mut popped, mut freed) = (Vec::new(), Vec::new());
        for shard in &self.inner.shards {
            {
                let mut shard = lock(shard);
                popped.clear();
                shard.pop_due(under_way, usize::MAX, &mut popped);
                for &(at, i) in &popped {
                    if !self.take_if_expired(&mut shard, i, now, &mut freed) && shard.live(at, i) {
                        shard.requeue(i, at);
                    }
                }
            }
            free(&mut freed);
        }
    }

    /// Purges one shard of what expired by `now`: its records in progress (few: as many as
    /// requests in flight), then its due records, [`SLICE`] per hold of the lock, freed after
    /// letting go of it; then gives back memory the shard no longer needs.
    pub(super) fn purge_shard(&self, i: usize, now: u64) -> u64 {
        let until = now_tick(now, self.inner.base);
        let mut freed = Vec::new();
        {
            let mut shard = lock(&self.inner.shards[i]);
            self.look_at_polled(&mut shard, now, &mut freed);
        }
        let mut removed = free(&mut freed);
        let mut popped = Vec::with_capacity(SLICE);
        loop {
            popped.clear();
            {
                let mut shard = lock(&self.inner.shards[i]);
                shard.pop_due(until, SLICE, &mut popped);
                self.look_at_due(&mut shard, &popped, now, &mut freed);
            }
            removed += free(&mut freed);
            if popped.len() < SLICE {
                break;
            }
        }
        // Far below its peak, the shard gives memory back, a slice at a time too.
        while lock(&self.inner.shards[i]).compact(SLICE) {}
        removed
    }

    /// Takes record `i` out of its shard and off the store's counts. The counts change here,
    /// under the shard's lock, so that a claim that finds the store full and then sweeps
    /// every shard sees all the room taken out before it got each lock (counted after, another
    /// thread's sweep left it refusing a claim there was room for).
    pub(super) fn take_out(&self, shard: &mut Shard, i: u32) -> Option<Entry> {
        let entry = shard.remove(i)?;
        self.inner.counts.len.fetch_sub(1, Ordering::Relaxed);
        self.weigh(entry.weight(), 0);
        Some(entry)
    }

    /// Takes record `i` out of its shard ([`take_out`](Self::take_out)) if it expired by
    /// `now`, into `freed`: freed after the shard's lock is let go ([`free`]).
    pub(super) fn take_if_expired(
        &self,
        shard: &mut Shard,
        i: u32,
        now: u64,
        freed: &mut Vec<Entry>,
    ) -> bool {
        if !shard.get(i).is_some_and(|e| expired(e, now)) {
            return false;
        }
        // Expired records are never watched (those never expire), so the watch index is
        // untouched.
        freed.extend(self.take_out(shard, i));
        true
    }

    /// Looks at the records due entries named: expired ones go, one whose expiry moved later
    /// is queued at it, stale entries are dropped.
    pub(super) fn look_at_due(
        &self,
        shard: &mut Shard,
        popped: &[(u32, u32)],
        now: u64,
        freed: &mut Vec<Entry>,
    ) {
        for &(at, i) in popped {
            if self.take_if_expired(shard, i, now, freed) {
                continue;
            }
            // Not this record's entry (it was removed, its slot reused), or one it no longer
            // needs.
            if !shard.live(at, i) {
                continue;
            }
            let Some(entry) = shard.get_mut(i) else {
                continue;
            };
            if entry.polled() || entry.status == RecordStatus::NeedsReconciliation {
                // The polled set has it, or the write that settles it queues it anew.
                entry.set_queued(None);
                continue;
            }
            match tick(entry.expires_at, self.inner.base) {
                // Its expiry moved later since it was queued: the entry moves with it.
                Some(due) if due > at => shard.requeue(i, due),
                // Due and not expired: a clock stepped back past the store's start, where
                // ticks cannot date it. It is polled from then on.
                _ => shard.poll(i),
            }
        }
    }

    /// Looks at the shard's polled records: expired ones go, settled ones a tick can now
    /// date go back to the due index.
    pub(super) fn look_at_polled(&self, shard: &mut Shard, now: u64, freed: &mut Vec<Entry>) {
        for i in shard.polled() {
            if !self.take_if_expired(shard, i, now, freed) {
                shard.reindex(i, self.inner.base);
            }
        }
    }

    /// A claim's share of purging, under its shard's lock: a few due records, and now and
    /// then the records in progress.
    pub(super) fn purge_for_claim(&self, shard: &mut Shard, now: u64) {
        shard.claims += 1;
        let poll = shard.claims.is_multiple_of(POLL_EVERY);
        let until = now_tick(now, self.inner.base);
        if !poll && !shard.due_by(until) {
            return;
        }
        // The shard's own buffer: a claim that purges allocates nothing to do it.
        let mut freed = std::mem::take(&mut shard.freed);
        if poll {
            self.look_at_polled(shard, now, &mut freed);
        }
        for _ in 0..CLAIM_PURGES {
            let Some(due) = shard.next_due(until) else {
                break;
            };
            self.look_at_due(shard, &[due], now, &mut freed);
        }
        free(&mut freed);
        shard.freed = freed;
    }
}
