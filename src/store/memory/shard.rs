//! One of the memory store's shards: its records in a slab, found by key through a table of
//! slab indices, and found by expiry through an index of what is due, so that purging visits
//! what expires and not everything stored.

use std::collections::BTreeSet;

use hashbrown::HashTable;

use super::super::{RecordStatus, ScopedKey};
use super::due::Due;
use super::entry::Entry;
use super::hash::{KeyHash, spread};

/// Records per slab chunk: 56 KiB each, so growing never copies records (but the first
/// chunk's) and a chunk not yet filled is not yet resident.
const CHUNK: usize = 512;

/// Expiry ticks are this many milliseconds: coarse enough that a tick fits 32 bits for two
/// years, fine enough that a record goes within a tick of its TTL.
pub(super) const TICK_MS: u64 = 16;

/// A shard. No lock is taken inside: the store holds the shard's lock around every call.
#[derive(Default)]
pub(super) struct Shard {
    /// Slab indices, placed by their key's hash: a slot is four bytes.
    table: HashTable<u32>,
    slab: Slab,
    /// Records by expiry tick, soonest first: settled ones, and those in progress whose TTL
    /// outlasts their lease. An entry may be
    /// stale (its record changed or went since): it is checked against the record when it
    /// comes due, never trusted.
    due: Due,
    /// The records the index does not cover, checked by every purge: those in progress under
    /// a lease longer than their TTL or with an outcome only a reconciliation can tell (at most
    /// as many as requests in flight), and those whose expiry no tick can say.
    polled: HashTable<u32>,
    /// The records only a reconciliation can settle once their holder is gone (see
    /// `watched`), by last change and key: listing them costs the page, not the shard.
    pub(super) watch: BTreeSet<(u64, ScopedKey)>,
    /// Claims made in this shard, for [`POLL_EVERY`](super::POLL_EVERY).
    pub(super) claims: u64,
    /// Due entries no longer live (their record went, moved, or was queued sooner since), at
    /// most: when they outnumber the live ones, the index is rebuilt without them.
    stale: usize,
    /// Where a claim puts the records it purges, kept so that purging allocates nothing.
    pub(super) freed: Vec<Entry>,
}

/// Records in chunks that never move, with a free list: a record costs its size and nothing
/// more (no allocator header, no rounding), and a slot freed is the next one used.
#[derive(Default)]
struct Slab {
    chunks: Vec<Vec<Option<Entry>>>,
    free: Vec<u32>,
    len: usize,
}

impl Slab {
    fn get(&self, i: u32) -> Option<&Entry> {
        let i = i as usize;
        self.chunks.get(i / CHUNK)?.get(i % CHUNK)?.as_ref()
    }

    fn get_mut(&mut self, i: u32) -> Option<&mut Entry> {
        let i = i as usize;
        self.chunks.get_mut(i / CHUNK)?.get_mut(i % CHUNK)?.as_mut()
    }

    fn insert(&mut self, entry: Entry) -> u32 {
        self.len += 1;
        if let Some(i) = self.free.pop()
            && let Some(slot) = self.chunks[i as usize / CHUNK].get_mut(i as usize % CHUNK)
        {
            *slot = Some(entry);
            return i;
        }
        let room = self.chunks.last().is_some_and(|c| c.len() < CHUNK);
        if !room {
            // The first chunk grows as it fills (a small store stays small); later ones are
            // whole from the start, so no record is ever copied to grow them.
            self.chunks.push(match self.chunks.is_empty() {
                true => Vec::new(),
                false => Vec::with_capacity(CHUNK),
            });
        }
        let n = self.chunks.len() - 1;
        let chunk = &mut self.chunks[n];
        chunk.push(Some(entry));
        // Indices fit 32 bits: a shard holds far fewer than four billion records.
        (n * CHUNK + chunk.len() - 1) as u32
    }

    fn take(&mut self, i: u32) -> Option<Entry> {
        let entry = self
            .chunks
            .get_mut(i as usize / CHUNK)?
            .get_mut(i as usize % CHUNK)?
            .take()?;
        self.len -= 1;
        if self.len == 0 {
            // Empty: give the chunks back, as a purge that empties the store promises.
            *self = Slab::default();
        } else {
            self.free.push(i);
        }
        Some(entry)
    }
}

/// Where the table places a record's slot (a slot naming no record is never rehashed: the
/// table only holds live records' indices).
fn slot_of(entry: Option<&Entry>) -> u64 {
    entry.map_or(0, |e| e.key_hash().slot())
}

impl Shard {
    pub(super) fn find(&self, hash: KeyHash, key: &ScopedKey) -> Option<u32> {
        let slab = &self.slab;
        self.table
            .find(hash.slot(), |&i| slab.get(i).is_some_and(|e| e.is(key)))
            .copied()
    }

    /// Capacities of the shard's table, due index and polled set, and its slab chunks, for tests.
    #[cfg(test)]
    pub(super) fn held(&self) -> (usize, usize, usize, usize) {
        (
            self.table.capacity(),
            self.slab.chunks.len(),
            self.due.capacity(),
            self.polled.capacity(),
        )
    }

    /// `key`'s record.
    pub(super) fn entry(&self, hash: KeyHash, key: &ScopedKey) -> Option<&Entry> {
        self.slab.get(self.find(hash, key)?)
    }

    /// Keeps the watch index in step with one record's change: `before` and `after` are what
    /// `watched` said of it.
    pub(super) fn rewatch(&mut self, key: &ScopedKey, before: Option<u64>, after: Option<u64>) {
        if before == after {
            return;
        }
        if let Some(at) = before {
            self.watch.remove(&(at, key.clone()));
        }
        if let Some(at) = after {
            self.watch.insert((at, key.clone()));
        }
    }

    pub(super) fn get(&self, i: u32) -> Option<&Entry> {
        self.slab.get(i)
    }

    pub(super) fn get_mut(&mut self, i: u32) -> Option<&mut Entry> {
        self.slab.get_mut(i)
    }

    /// Adds a record (under the hash it carries); its slab index.
    pub(super) fn insert(&mut self, entry: Entry) -> u32 {
        let hash = entry.key_hash();
        let i = self.slab.insert(entry);
        let slab = &self.slab;
        // Growing the table re-places every key by the hash its record carries.
        self.table
            .insert_unique(hash.slot(), i, |&j| slot_of(slab.get(j)));
        i
    }

    /// Removes record `i`; the record.
    pub(super) fn remove(&mut self, i: u32) -> Option<Entry> {
        let hash = self.slab.get(i)?.key_hash();
        if let Ok(slot) = self.table.find_entry(hash.slot(), |&j| j == i) {
            slot.remove();
        }
        let entry = self.slab.take(i)?;
        if entry.polled() {
            self.unpoll(i);
        }
        if entry.queued().is_some() {
            self.stale += 1;
            self.forget_stale();
        }
        if self.slab.len == 0 {
            // Empty: give back the table and the indexes too.
            self.table = HashTable::new();
            self.due = Due::default();
            self.stale = 0;
            self.polled = HashTable::new();
        }
        Some(entry)
    }

    fn unpoll(&mut self, i: u32) {
        if let Ok(slot) = self.polled.find_entry(spread(i), |&j| j == i) {
            slot.remove();
        }
    }

    /// Puts record `i` where a purge will find it, after a change: in the due index by its
    /// expiry, or in the polled set while in progress under a lease longer than its TTL (or
    /// with an outcome only a reconciliation can tell). A record has one due entry at or
    /// before its expiry, not one per change: a later expiry (a retry, a renewal, a second
    /// completion) keeps the entry, which moves on when it comes due early; only an earlier one
    /// adds an entry.
    pub(super) fn reindex(&mut self, i: u32, base: u64) {
        let Some(entry) = self.slab.get_mut(i) else {
            return;
        };
        let (status, expires_at) = (entry.status, entry.expires_at);
        let tick = tick(expires_at, base);
        let (poll, queue) = match status {
            // Queued at its expiry while its TTL outlasts its lease, as it will once settled
            // (a completion then expires later, and keeps the entry). A lease that outlasts
            // the TTL would leave its entry behind a completion for the lease's length, and a
            // record that can only be reconciled never expires in progress: those are polled.
            RecordStatus::InProgress => {
                let queued = tick.is_some()
                    && expires_at > entry.lease_until
                    && !entry.effect_started()
                    && !entry.reconcile_on_expiry();
                (!queued, queued)
            }
            RecordStatus::Completed | RecordStatus::Released => (tick.is_none(), tick.is_some()),
            // Never expires; the write that settles it indexes it.
            RecordStatus::NeedsReconciliation => (false, false),
        };
        let was_polled = entry.polled();
        entry.set_polled(poll);
        // Its live entry stands while it is at or before the expiry; a sooner expiry takes a
        // new one.
        let was_queued = entry.queued();
        let queue = queue && was_queued.is_none_or(|at| tick.is_some_and(|tick| tick < at));
        if let Some(tick) = tick.filter(|_| queue) {
            entry.set_queued(Some(tick));
            self.due.push(tick, i);
            if was_queued.is_some() {
                self.stale += 1;
            }
        }
        match (was_polled, poll) {
            (false, true) => {
                self.polled.insert_unique(spread(i), i, |&j| spread(j));
            }
            (true, false) => self.unpoll(i),
            _ => {}
        }
        self.forget_stale();
    }

    /// Takes up to `n` due entries (tick at most `until`) off the index, as (tick, index):
    /// the records to be looked at. Stale entries are among them.
    pub(super) fn pop_due(&mut self, until: u32, n: usize, out: &mut Vec<(u32, u32)>) {
        while out.len() < n {
            match self.due.pop(until) {
                Some(entry) => out.push(entry),
                None => break,
            }
        }
    }

    /// The soonest due entry (tick at most `until`), taken off the index.
    pub(super) fn next_due(&mut self, until: u32) -> Option<(u32, u32)> {
        self.due.pop(until)
    }

    /// Whether an entry is due by `until`.
    pub(super) fn due_by(&self, until: u32) -> bool {
        self.due.any_by(until)
    }

    /// The polled records, to be looked at.
    pub(super) fn polled(&self) -> Vec<u32> {
        self.polled.iter().copied().collect()
    }

    /// Gives back what a shard far below its peak keeps, `n` records' worth of work per call
    /// (the caller holds the lock for one call): moves records out of the slab's last chunk
    /// into free slots below it, gives back the chunk once it is empty, and shrinks the table
    /// and the indexes. Whether there is more to do.
    pub(super) fn compact(&mut self, n: usize) -> bool {
        let chunks = self.slab.chunks.len();
        if chunks <= 1 || self.slab.len * 4 > chunks * CHUNK {
            self.shrink();
            return false;
        }
        let last = chunks - 1;
        let floor = last * CHUNK;
        let mut moved = 0;
        // Free slots inside the last chunk go with it.
        let mut spare = Vec::new();
        while moved < n {
            let Some(j) = self.slab.chunks[last].iter().rposition(Option::is_some) else {
                break;
            };
            let Some(i) = self.free_below(floor, &mut spare) else {
                break;
            };
            let j = (floor + j) as u32;
            self.relocate(j, i);
            // Free again, should the chunk stay (new records filling the shard meanwhile).
            spare.push(j);
            moved += 1;
        }
        self.slab.free.extend(spare);
        if self.slab.chunks[last].iter().all(Option::is_none) {
            self.slab.chunks.pop();
            self.slab.free.retain(|&i| (i as usize) < floor);
            self.slab.free.shrink_to_fit();
            self.slab.chunks.shrink_to_fit();
            return true;
        }
        moved > 0
    }

    /// A free slot below `floor`, off the free list; those at or above it go to `spare`.
    fn free_below(&mut self, floor: usize, spare: &mut Vec<u32>) -> Option<u32> {
        while let Some(i) = self.slab.free.pop() {
            if (i as usize) < floor {
                return Some(i);
            }
            spare.push(i);
        }
        None
    }

    /// Moves record `j` to free slot `i`, and every index that names it with it.
    fn relocate(&mut self, j: u32, i: u32) {
        let Some(entry) = self.slab.chunks[j as usize / CHUNK][j as usize % CHUNK].take() else {
            return;
        };
        if let Ok(mut slot) = self.table.find_entry(entry.key_hash().slot(), |&x| x == j) {
            *slot.get_mut() = i;
        }
        let (polled, queued) = (entry.polled(), entry.queued());
        self.slab.chunks[i as usize / CHUNK][i as usize % CHUNK] = Some(entry);
        if polled {
            self.unpoll(j);
            self.polled.insert_unique(spread(i), i, |&x| spread(x));
        }
        // Entries naming `j` are stale now; the record is queued anew, at the same tick.
        if let Some(at) = queued {
            self.due.push(at, i);
            self.stale += 1;
        }
    }

    /// Shrinks the table and the due index when they would halve (rehashing is a walk of
    /// the shard's keys).
    fn shrink(&mut self) {
        if self.slab.len > 0 && self.slab.len * 4 <= self.table.capacity() {
            let slab = &self.slab;
            self.table.shrink_to_fit(|&j| slot_of(slab.get(j)));
        }
        self.due.shrink();
        if self.polled.len() * 4 <= self.polled.capacity() {
            self.polled.shrink_to_fit(|&x| spread(x));
        }
    }

    /// Re-adds record `i`'s due entry at `tick`: it came due before the record expired (its
    /// expiry moved later since).
    pub(super) fn requeue(&mut self, i: u32, tick: u32) {
        if let Some(entry) = self.slab.get_mut(i) {
            entry.set_queued(Some(tick));
            self.due.push(tick, i);
        }
    }

    /// Whether a due entry just popped is record `i`'s live one; a stale one is counted off.
    pub(super) fn live(&mut self, at: u32, i: u32) -> bool {
        let live = self.slab.get(i).is_some_and(|e| e.queued() == Some(at));
        if !live {
            self.stale = self.stale.saturating_sub(1);
        }
        live
    }

    /// Rebuilds the due index without its stale entries once they outnumber the live ones:
    /// a walk of the index, paid for by as many changes that each made one entry stale.
    fn forget_stale(&mut self) {
        if self.stale > 1024 && self.stale * 2 > self.due.len() {
            let slab = &self.slab;
            self.due
                .retain(|at, i| slab.get(i).is_some_and(|e| e.queued() == Some(at)));
            self.stale = 0;
        }
    }

    /// Moves record `i` to the polled set: its due entry came due before it expired, so its
    /// expiry is one no tick can date (a clock stepped back past the store's start).
    pub(super) fn poll(&mut self, i: u32) {
        if let Some(entry) = self.slab.get_mut(i)
            && !entry.polled()
        {
            entry.set_queued(None);
            entry.set_polled(true);
            self.polled.insert_unique(spread(i), i, |&j| spread(j));
        }
    }
}

/// The tick a record expiring at `at` (ms) is due at, counted from `base`: rounded up, so a
/// record is never looked at before it expires. `None` beyond what 32 bits hold.
pub(super) fn tick(at: u64, base: u64) -> Option<u32> {
    u32::try_from(at.saturating_sub(base).div_ceil(TICK_MS)).ok()
}

/// The last tick that has fully passed at `now`.
pub(super) fn now_tick(now: u64, base: u64) -> u32 {
    u32::try_from(now.saturating_sub(base) / TICK_MS).unwrap_or(u32::MAX)
}
