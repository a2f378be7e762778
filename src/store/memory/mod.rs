//! The embedded, in-process store.

mod claim;
mod due;
mod entry;
mod hash;
mod listing;
mod purge;
mod shard;

use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use super::history::{HISTORY_LIMIT, HISTORY_REFUSALS};
use super::{
    Claim, ClaimRequest, FencingToken, Fingerprint, HistoryEvent, IdempotencyStore, InFlight,
    Milestone, Record, RecordStatus, Resolution, ScopedKey, StoreError, StoredResponse,
    UncertainCount, UncertainPage, UncertainQuery,
};
use entry::{Entry, span, time};
use hash::KeyHash;
use shard::Shard;

const SHARDS: usize = 64;

/// The next store's [`Inner::id`].
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// The last key this thread hashed, the store it was hashed for, and the hash.
///
/// The key is kept as a copy of its bytes, not as a clone: a clone would keep the key's
/// allocation alive after its record and its request are gone, and with it the heap around
/// it, which the allocator could then not give back to the system (the memory bench measured
/// 4 MiB kept resident after a purge of a million records).
struct Hashed {
    store: u64,
    hash: u64,
    /// Where the key begins in `bytes` (the scope's length).
    split: usize,
    len: usize,
    /// Scope and key joined, as [`ScopedKey`] keeps them.
    bytes: [u8; REMEMBERED],
}

/// The longest scoped key (scope and key together) a thread remembers: the longest key a
/// request may send (255 bytes) fits beside a scope of as many. A longer one is hashed on each
/// of its request's store calls.
const REMEMBERED: usize = 512;

impl Hashed {
    /// The remembered hash, if `joined` (split at `split`) is the key it was taken of, in
    /// the store `store`.
    fn of(&self, store: u64, joined: &str, split: usize) -> Option<u64> {
        let same = self.store == store
            && self.split == split
            && self.bytes.get(..self.len) == Some(joined.as_bytes());
        same.then_some(self.hash)
    }

    /// Remembers `hash` as the hash of `joined` (split at `split`) in the store `store`;
    /// `joined` is at most [`REMEMBERED`] bytes long.
    fn remember(&mut self, store: u64, hash: u64, joined: &str, split: usize) {
        self.store = store;
        self.hash = hash;
        self.split = split;
        self.len = joined.len();
        self.bytes[..joined.len()].copy_from_slice(joined.as_bytes());
    }
}

thread_local! {
    /// A request's read, claim and completion ask for its key's hash in turn, mostly on one
    /// thread: a keyed SipHash (about 280 instructions) computed once instead of three times.
    static LAST_HASHED: std::cell::RefCell<Option<Hashed>> =
        const { std::cell::RefCell::new(None) };
}
/// A purge takes this many due records per hold of a shard's lock, and frees them after
/// letting go: a request that meets a purge waits for a slice, not for the shard.
const SLICE: usize = 64;
/// Each claim purges up to this many of its shard's due records: more than it adds, so
/// purging is spread over requests as records expire (no request waits for a walk of a shard,
/// nor for a purger's slice, nor shares a core with a purger's burst) and memory stays bounded
/// when nobody calls [`IdempotencyStore::purge_expired`].
const CLAIM_PURGES: usize = 2;
/// Every this many claims a shard also looks at its polled records (in progress under a lease
/// longer than their TTL), whose holders may have left without a word.
const POLL_EVERY: u64 = 1024;

/// Where the store reads the time.
enum Clock {
    /// The wall clock read once (as time since the epoch), then `Instant`: what every read
    /// costs is one `Instant::now`.
    Monotonic {
        since_epoch: std::time::Duration,
        start: std::time::Instant,
    },
    /// The same, on tokio's `Instant`: the clock of the runtime that reads it (see
    /// [`MemoryStore::on_tokio_clock`]).
    Tokio {
        since_epoch: std::time::Duration,
        start: tokio::time::Instant,
    },
    /// A clock the application (a test) moves.
    Given(Arc<dyn Fn() -> SystemTime + Send + Sync>),
}

/// The embedded store: one process, no dependencies, bounded memory.
///
/// Records live in 64 independently locked shards, so concurrent requests on different keys
/// rarely contend and no lock is held across an `.await`. Each shard indexes its settled
/// records by expiry, so purging visits what expires, not what is stored:
/// [`purge_expired`](IdempotencyStore::purge_expired) (which a
/// [`Sweeper`](crate::reconcile::Sweeper) calls on every pass) takes expired records a slice at
/// a time and frees them after letting go of the lock, and each claim takes up to two of its
/// shard's expired records, more than it adds, so purging is spread over requests as records
/// expire. Records under a live lease never
/// expire, so in-flight keys are never evicted. The store is bounded by default, in
/// records ([`max_records`](Self::max_records)) and in bytes ([`max_bytes`](Self::max_bytes)):
/// a claim of a new key that does not fit fails with [`StoreError::Full`] (answered 503,
/// nothing runs) instead of growing without limit or evicting live and completed records.
/// Leases and TTLs run on a monotonic clock.
///
/// Cloning is cheap and shares the records. Records do not survive the process: use a durable
/// store when a restart must not forget in-flight or completed keys.
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    shards: Vec<Padded<Mutex<Shard>>>,
    hasher: RandomState,
    /// This store among all made in the process: whose hash [`LAST_HASHED`] remembers.
    id: u64,
    clock: Clock,
    /// The clock at the store's creation (ms): expiry ticks count from it.
    base: u64,
    max_records: AtomicUsize,
    max_bytes: AtomicUsize,
    /// Written by claims; apart from what every operation reads.
    counts: Padded<Counts>,
    /// Requests waiting for in-flight keys, woken as their records move on.
    waiters: super::Waiters<ScopedKey>,
}

struct Counts {
    next_token: AtomicU64,
    len: AtomicUsize,
    /// What the records weigh (see [`Entry::weight`]).
    bytes: AtomicUsize,
}

/// A value on cache lines of its own (two, as x86 fetches them in pairs): what one thread
/// writes does not evict what another reads nearby, as with neighbouring shards' locks.
#[repr(align(128))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

/// `clock`'s time, in milliseconds since the Unix epoch.
fn read(clock: &Clock) -> u64 {
    match clock {
        Clock::Monotonic { since_epoch, start } => {
            (*since_epoch + start.elapsed()).as_millis() as u64
        }
        Clock::Tokio { since_epoch, start } => {
            let elapsed = tokio::time::Instant::now().saturating_duration_since(*start);
            (*since_epoch + elapsed).as_millis() as u64
        }
        Clock::Given(clock) => ms(clock()),
    }
}

/// Milliseconds since the Unix epoch.
fn ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("records", &self.inner.counts.len.load(Ordering::Relaxed))
            .field(
                "max_records",
                &self.inner.max_records.load(Ordering::Relaxed),
            )
            .finish()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// The default bound on the number of records: a million.
    pub const DEFAULT_MAX_RECORDS: usize = 1_000_000;
    /// The default bound on what records weigh (keys, responses and the records themselves):
    /// 256 MiB.
    pub const DEFAULT_MAX_BYTES: usize = 256 << 20;

    /// An empty store on a monotonic clock, bounded by [`DEFAULT_MAX_RECORDS`](Self::DEFAULT_MAX_RECORDS)
    /// and [`DEFAULT_MAX_BYTES`](Self::DEFAULT_MAX_BYTES).
    ///
    /// Leases and TTLs are measured on a monotonic clock that starts at the wall-clock time of
    /// this call: a wall-clock step (NTP, an operator) can neither hand a live lease to a retry
    /// nor expire records early. Times reported in records read as wall-clock times. In
    /// tests that pause tokio's clock, use [`on_tokio_clock`](Self::on_tokio_clock).
    pub fn new() -> Self {
        Self::monotonic_since(SystemTime::now())
    }

    /// A store whose clock reads `base` at creation and then moves with `Instant`: the wall
    /// clock is read once, never again.
    fn monotonic_since(base: SystemTime) -> Self {
        let since_epoch = base
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        let start = std::time::Instant::now();
        Self::on(Clock::Monotonic { since_epoch, start })
    }

    /// An empty store, with the default bounds, whose leases and TTLs follow tokio's clock:
    /// for an application's tests that pause it (`#[tokio::test(start_paused = true)]`,
    /// `tokio::time::pause`). There, [`new`](Self::new)'s leases run out in real time while
    /// the lease keeper's timers stand still (tokio does not move a paused clock while
    /// `spawn_blocking` work runs), and a retry may take over a live holder's key; on tokio's
    /// clock they stand still together, and `advance` expires records.
    ///
    /// Tokio's clock is the calling runtime's: share such a store only among runtimes whose
    /// clocks agree (never a paused one and a running one), and advance a paused clock in
    /// steps shorter than a lease while a holder runs (one jump past it is a process frozen
    /// past its lease: a retry may take the key over before the keeper's renewal runs).
    /// Without a paused clock it is [`new`](Self::new).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let store = tower_idempotency::MemoryStore::on_tokio_clock();
    /// # drop(store);
    /// # }
    /// ```
    pub fn on_tokio_clock() -> Self {
        let since_epoch = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        let start = tokio::time::Instant::now();
        Self::on(Clock::Tokio { since_epoch, start })
    }

    /// An empty store reading time from `clock` (tests move time forward with it), with the
    /// default bounds.
    pub fn with_clock(clock: impl Fn() -> SystemTime + Send + Sync + 'static) -> Self {
        Self::on(Clock::Given(Arc::new(clock)))
    }

    fn on(clock: Clock) -> Self {
        let seed = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        let base = read(&clock);
        Self {
            inner: Arc::new(Inner {
                shards: (0..SHARDS).map(|_| Padded(Mutex::default())).collect(),
                hasher: RandomState::new(),
                id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                clock,
                base,
                max_records: AtomicUsize::new(Self::DEFAULT_MAX_RECORDS),
                max_bytes: AtomicUsize::new(Self::DEFAULT_MAX_BYTES),
                counts: Padded(Counts {
                    next_token: AtomicU64::new(seed),
                    len: AtomicUsize::new(0),
                    bytes: AtomicUsize::new(0),
                }),
                waiters: super::Waiters::default(),
            }),
        }
    }

    /// Caps the number of records held (default [`DEFAULT_MAX_RECORDS`](Self::DEFAULT_MAX_RECORDS)).
    /// The bound is shared by every clone of this store.
    ///
    /// When the store is full, a claim of a new key first purges expired records (in every
    /// shard); if live records still fill it, the claim fails with [`StoreError::Full`] and the
    /// request is answered like one to an unavailable store (503, nothing runs). Live and
    /// completed records are never evicted to make room.
    pub fn max_records(self, max: usize) -> Self {
        self.inner.max_records.store(max, Ordering::Relaxed);
        self
    }

    /// Caps what the records weigh: their keys, recorded responses, histories and own size
    /// (default [`DEFAULT_MAX_BYTES`](Self::DEFAULT_MAX_BYTES)). Claims of new keys are
    /// refused as for [`max_records`](Self::max_records) once the weight reaches it. A key the
    /// store holds goes on as if it had room: requests in flight record their outcomes (at
    /// most their response limit each), a released key is taken over by its retry, and what
    /// happens to a key is written in its history, which stops growing at
    /// [`HISTORY_LIMIT`](crate::store::HISTORY_LIMIT) entries. So the weight may pass the
    /// bound by what those add to the records held. Claims of new keys in
    /// different shards check the weight at once, so each may add its new record (its key
    /// and own size) past the bound: one per shard at most. [`max_records`](Self::max_records)
    /// holds exactly.
    pub fn max_bytes(self, max: usize) -> Self {
        self.inner.max_bytes.store(max, Ordering::Relaxed);
        self
    }

    /// What the records weigh now, in bytes (see [`max_bytes`](Self::max_bytes)).
    pub fn bytes(&self) -> usize {
        self.inner.counts.bytes.load(Ordering::Relaxed)
    }

    /// Counts one record more if the store has room for it: fewer records than
    /// [`max_records`](Self::max_records), and lighter than [`max_bytes`](Self::max_bytes).
    fn take_room(&self) -> bool {
        if self.bytes() >= self.inner.max_bytes.load(Ordering::Relaxed) {
            return false;
        }
        let max = self.inner.max_records.load(Ordering::Relaxed);
        self.inner
            .counts
            .len
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok()
    }

    fn weigh(&self, before: usize, after: usize) {
        let bytes = &self.inner.counts.bytes;
        if after >= before {
            bytes.fetch_add(after - before, Ordering::Relaxed);
        } else {
            bytes.fetch_sub(before - after, Ordering::Relaxed);
        }
    }

    /// How many records the store holds, expired ones not yet purged included.
    pub fn len(&self) -> usize {
        self.inner.counts.len.load(Ordering::Relaxed)
    }

    /// Whether the store holds no records.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The key's hash, and its shard locked.
    fn shard(&self, key: &ScopedKey) -> (KeyHash, MutexGuard<'_, Shard>) {
        let hash = self.hash_of(key);
        // The shard's table places and tags slots by the low 32 bits (spread), so the shard
        // comes from bits above them: within a shard, those bits still vary.
        let i = (hash >> 40) as usize % SHARDS;
        (KeyHash::of(hash), lock(&self.inner.shards[i]))
    }

    /// The keyed hash of `key`, remembered for the last key this thread hashed (see
    /// [`LAST_HASHED`]).
    fn hash_of(&self, key: &ScopedKey) -> u64 {
        let id = self.inner.id;
        let (joined, split) = key.joined();
        let remembered = LAST_HASHED.try_with(|last| {
            // Never a panic: not while this thread's locals are torn down (a dropped future
            // giving its key back), nor if somehow asked again while answering.
            let mut last = last.try_borrow_mut().ok()?;
            if let Some(hash) = last.as_ref().and_then(|last| last.of(id, joined, split)) {
                return Some(hash);
            }
            let hash = self.inner.hasher.hash_one(key);
            if joined.len() <= REMEMBERED {
                last.get_or_insert_with(|| Hashed {
                    store: id,
                    hash,
                    split,
                    len: 0,
                    bytes: [0; REMEMBERED],
                })
                .remember(id, hash, joined, split);
            }
            Some(hash)
        });
        match remembered {
            Ok(Some(hash)) => hash,
            _ => self.inner.hasher.hash_one(key),
        }
    }

    /// The key's hash as its shard keeps it.
    fn key_hash(&self, key: &ScopedKey) -> KeyHash {
        KeyHash::of(self.inner.hasher.hash_one(key))
    }

    /// The store's clock, in milliseconds.
    fn now(&self) -> u64 {
        read(&self.inner.clock)
    }

    fn token(&self) -> FencingToken {
        FencingToken(self.inner.counts.next_token.fetch_add(1, Ordering::Relaxed))
    }

    /// Applies a fenced write: `f` runs only on the caller's in-progress record.
    fn fenced<T>(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        f: impl FnOnce(&mut Entry, u64) -> T,
    ) -> Result<T, StoreError> {
        self.write_if(key, token, |r, _| r.status == RecordStatus::InProgress, f)
    }

    /// Applies `f` to the record if it carries `token` and `allowed` says it may be written;
    /// otherwise the write is refused as fenced.
    fn write_if<T>(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        allowed: impl FnOnce(&Entry, u64) -> bool,
        f: impl FnOnce(&mut Entry, u64) -> T,
    ) -> Result<T, StoreError> {
        let now = self.now();
        let (hash, mut shard) = self.shard(key);
        let Some(i) = shard.find(hash, key) else {
            return Err(StoreError::Fenced);
        };
        let Some(r) = shard
            .get_mut(i)
            .filter(|r| r.lease_token == token && allowed(r, now))
        else {
            return Err(StoreError::Fenced);
        };
        let watched_before = watched(r);
        let status_before = r.status;
        // Before the touch: writing out an implied history weighs too.
        let before = r.weight();
        r.touch(now);
        let out = f(r, now);
        self.weigh(before, r.weight());
        let moved_on = r.status != status_before || r.lease_token != token;
        let watched_after = watched(r);
        shard.reindex(i, self.inner.base);
        shard.rewatch(key, watched_before, watched_after);
        drop(shard);
        // A renewal or a milestone wakes no one: the record is still in flight.
        if moved_on {
            self.inner.waiters.wake(key);
        }
        Ok(out)
    }
}

impl IdempotencyStore for MemoryStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        self.claim_at_once(req)
    }

    /// Always at once: a claim here is a few operations under one shard's lock.
    fn claim_now(&self, req: &ClaimRequest) -> Option<Result<Claim, StoreError>> {
        Some(self.claim_at_once(req))
    }

    /// Expired or not: only a hint, and the clock is not read for it.
    fn recorded_fingerprint_now(&self, key: &ScopedKey) -> Option<Fingerprint> {
        let (hash, shard) = self.shard(key);
        shard
            .entry(hash, key)
            .filter(|r| r.status == RecordStatus::Completed)
            .map(Entry::fingerprint)
    }

    /// A read under the key's shard lock: what a claim of a completed record answers, and
    /// all it does (a claim that finds one changes nothing).
    fn completed_now(&self, key: &ScopedKey) -> Option<Result<Claim, StoreError>> {
        let (hash, shard) = self.shard(key);
        let r = shard
            .entry(hash, key)
            .filter(|r| r.status == RecordStatus::Completed)?;
        // The clock only for a record to answer: a new key reads none here.
        let now = self.now();
        (!expired(r, now)).then(|| r.to_claim(key, now))
    }

    async fn renew(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<SystemTime, StoreError> {
        self.fenced(key, token, |r, now| {
            // Never shorter: renewals may overlap (see `hold`), and one sent earlier may land
            // later.
            r.lease_until = r.lease_until.max(now + span(lease));
            r.expires_at = r.expires_at.max(r.lease_until);
            time(r.lease_until)
        })
    }

    async fn complete(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        // The holder may complete again what it already completed, and settle with the truth
        // what it marked uncertain when an earlier write failed (a resolution bumps the token).
        let may = |r: &Entry, _| {
            matches!(
                r.status,
                RecordStatus::InProgress
                    | RecordStatus::Completed
                    | RecordStatus::NeedsReconciliation
            )
        };
        self.write_if(key, token, may, |r, now| {
            r.status = RecordStatus::Completed;
            r.set_response(response);
            r.expires_at = now + span(ttl);
            log(r, now, HistoryEvent::Completed);
        })
    }

    async fn release(
        &self,
        key: &ScopedKey,
        token: FencingToken,
    ) -> Result<RecordStatus, StoreError> {
        self.fenced(key, token, |r, now| {
            let (status, event) = if r.effect_started() {
                (
                    RecordStatus::NeedsReconciliation,
                    HistoryEvent::NeedsReconciliation,
                )
            } else {
                (RecordStatus::Released, HistoryEvent::Released)
            };
            r.status = status;
            log(r, now, event);
            status
        })
    }

    async fn mark_uncertain(&self, key: &ScopedKey, token: FencingToken) -> Result<(), StoreError> {
        self.fenced(key, token, |r, now| {
            r.status = RecordStatus::NeedsReconciliation;
            // The handler answered (only the layer's failed record marks so): its effect
            // took place.
            r.start_effect();
            log(r, now, HistoryEvent::NeedsReconciliation);
        })
    }

    async fn lookup(&self, key: &ScopedKey) -> Result<Option<Record>, StoreError> {
        let now = self.now();
        let (hash, shard) = self.shard(key);
        shard
            .entry(hash, key)
            .filter(|r| !expired(r, now))
            .map(|r| r.to_record(key))
            .transpose()
    }

    async fn remove(&self, key: &ScopedKey) -> Result<bool, StoreError> {
        let (hash, mut shard) = self.shard(key);
        let removed = shard
            .find(hash, key)
            .and_then(|i| self.take_out(&mut shard, i));
        if let Some(entry) = &removed {
            shard.rewatch(key, watched(entry), None);
            drop(shard);
            self.inner.waiters.wake(key);
        }
        Ok(removed.is_some())
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        Ok(self.sweep_all(self.now()))
    }

    async fn record_milestone(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        milestone: &Milestone,
    ) -> Result<(), StoreError> {
        self.fenced(key, token, |r, now| match milestone {
            Milestone::EffectStarted => {
                r.start_effect();
                log(r, now, HistoryEvent::EffectStarted);
            }
            Milestone::DownstreamId(id) => {
                r.set_downstream_id(id.as_str());
                log(r, now, HistoryEvent::DownstreamId);
            }
        })
    }

    async fn list_uncertain(&self, query: &UncertainQuery) -> Result<UncertainPage, StoreError> {
        let now = self.now();
        let found = self.uncertain_found(query, now);
        Ok(self.uncertain_page(&found, query.limit, now))
    }

    async fn count_uncertain(&self) -> Result<UncertainCount, StoreError> {
        let now = self.now();
        let mut count = UncertainCount::default();
        for shard in &self.inner.shards {
            let shard = lock(shard);
            for (at, key) in &shard.watch {
                if shard
                    .entry(self.key_hash(key), key)
                    .is_some_and(|r| uncertain(r, now))
                {
                    count.count += 1;
                    let at = time(*at);
                    count.oldest = Some(count.oldest.map_or(at, |oldest| oldest.min(at)));
                }
            }
        }
        Ok(count)
    }

    async fn resolve(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        resolution: &Resolution,
        ttl: Duration,
        note: Option<&str>,
    ) -> Result<(), StoreError> {
        // A resolution is final: a new token fences out the holder it overrules.
        let fresh = self.token();
        self.write_if(key, token, uncertain, |r, now| {
            // This resolution's note, or none: never an earlier resolution's.
            r.set_resolution_note(note);
            match resolution {
                Resolution::Applied(response) => {
                    r.set_token(fresh);
                    r.status = RecordStatus::Completed;
                    r.set_response(response);
                    r.expires_at = now + span(ttl);
                    log(r, now, HistoryEvent::ReconciledApplied);
                }
                Resolution::NotApplied => {
                    r.set_token(fresh);
                    r.status = RecordStatus::Released;
                    // The next attempt starts with no effect of its own.
                    r.clear_effect();
                    // Kept for `ttl` from now, with its history and note, even if it waited
                    // for its reconciliation past the expiry its claim set.
                    r.expires_at = r.expires_at.max(now + span(ttl));
                    log(r, now, HistoryEvent::ReconciledNotApplied);
                }
            }
        })
    }

    async fn append_history(&self, key: &ScopedKey, event: HistoryEvent) -> Result<(), StoreError> {
        let now = self.now();
        let (hash, mut shard) = self.shard(key);
        if let Some(r) = shard.find(hash, key).and_then(|i| shard.get_mut(i))
            && !expired(r, now)
        {
            let before = r.weight();
            log_capped(r, now, event, HISTORY_REFUSALS);
            let after = r.weight();
            self.weigh(before, after);
        }
        Ok(())
    }

    /// Woken in process by the write that moves the record on, or at the holder's lease end.
    async fn wait_for_change(
        &self,
        key: &ScopedKey,
        seen: &InFlight,
        _round: u32,
        within: Duration,
    ) {
        let moved_on = async {
            let now = self.now();
            let (hash, shard) = self.shard(key);
            shard.entry(hash, key).is_none_or(|r| {
                expired(r, now)
                    || r.status != RecordStatus::InProgress
                    || r.lease_token != seen.token
            })
        };
        self.inner.waiters.wait(key, seen, within, moved_on).await;
    }
}

/// Locks a shard. A panic while holding one cannot leave a record half-written (every update
/// is a single assignment), so a poisoned lock is safe to keep using.
fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    shard
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Appends `event` to the record's history as its current attempt.
fn log(r: &mut Entry, now: u64, event: HistoryEvent) {
    log_capped(r, now, event, HISTORY_LIMIT);
}

fn log_capped(r: &mut Entry, now: u64, event: HistoryEvent, cap: usize) {
    r.log(now, event, cap);
}

/// Frees records taken out of a shard ([`MemoryStore::take_out`]), outside its lock: they
/// are off the counts already. How many.
fn free(freed: &mut Vec<Entry>) -> u64 {
    let n = freed.len();
    freed.clear();
    n as u64
}

/// Whether a record counts as absent: past its TTL, and its outcome not unknown. A record
/// awaiting reconciliation, or whose holder marked its effect started, never expires into a
/// new run; it stays until resolved (DESIGN §4).
fn expired(r: &Entry, now: u64) -> bool {
    r.expires_at <= now
        && match r.status {
            RecordStatus::Completed | RecordStatus::Released => true,
            RecordStatus::InProgress => !r.effect_started() && !r.reconcile_on_expiry(),
            RecordStatus::NeedsReconciliation => false,
        }
}

/// When a record last changed, if only a reconciliation can settle it once its holder is
/// gone: awaiting reconciliation, or in progress with its effect started or on a route that
/// reconciles expired leases. Such a record never expires, so the watch index loses it only
/// to a write.
fn watched(r: &Entry) -> Option<u64> {
    let watch = match r.status {
        RecordStatus::NeedsReconciliation => true,
        RecordStatus::InProgress => r.effect_started() || r.reconcile_on_expiry(),
        RecordStatus::Completed | RecordStatus::Released => false,
    };
    watch.then_some(r.updated_at())
}

/// Whether only a reconciliation can settle the record now: marked uncertain, or watched and
/// its holder's lease ran out.
fn uncertain(r: &Entry, now: u64) -> bool {
    r.status == RecordStatus::NeedsReconciliation
        || (r.status == RecordStatus::InProgress && r.lease_until <= now && watched(r).is_some())
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod unit;
