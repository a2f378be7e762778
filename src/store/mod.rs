//! Step 5 of the pipeline: where records live, and the one atomic claim every backend makes.
//!
//! A store keeps one [`Record`] per [`ScopedKey`]. Its whole contract is in
//! [`IdempotencyStore`]: every method is one atomic operation on the store's side, every time
//! is read from the store's own clock, and every write after the claim is *fenced* by the
//! [`FencingToken`] the claim handed out, so a holder whose lease was taken over can no longer
//! write.

mod any;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
mod batch;
mod codec;
mod history;
#[cfg(feature = "test-kit")]
pub mod kit;
#[cfg(feature = "memory")]
mod memory;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
mod reserve;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
mod sql;
#[cfg(feature = "sqlite")]
mod sqlite;
#[cfg(any(feature = "postgres", feature = "redis"))]
mod subscription;
pub(crate) mod uncertain;
#[cfg(any(feature = "postgres", feature = "redis", feature = "sqlite"))]
mod unheard;
mod waiting;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, StatusCode};

pub use crate::fingerprint::Fingerprint;
pub use crate::key::ScopedKey;
pub use any::{AnyStore, ConnectError};
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub use batch::Batching;
pub use codec::CorruptRecord;
#[cfg(feature = "console")]
pub(crate) use codec::is_corrupt;
pub use history::{HISTORY_LIMIT, HISTORY_REFUSALS, HistoryEntry, HistoryEvent};
#[cfg(feature = "memory")]
pub use memory::MemoryStore;
#[cfg(feature = "postgres")]
pub use postgres::PostgresStore;
#[cfg(feature = "redis")]
pub use redis::{RedisCheckError, RedisStore};
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub use sql::{CheckError, InvalidIdentifier};
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteStore;
pub use uncertain::{UncertainCount, UncertainCursor, UncertainPage, UncertainQuery, Unreadable};
pub use waiting::InFlight;
#[cfg(any(feature = "memory", feature = "redis", feature = "postgres"))]
pub(crate) use waiting::Waiters;
pub(crate) use waiting::{poll, poll_backoff};

/// An error boxed for transport across store backends.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The token that proves a writer still holds a record's lease.
///
/// Every successful claim gets a token no earlier claim of that key had; writes carrying any
/// other token are refused with [`StoreError::Fenced`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FencingToken(u64);

impl FencingToken {
    /// A token from its stored value.
    pub const fn new(value: u64) -> Self {
        Self(value)
    }

    /// The stored value.
    pub const fn get(self) -> u64 {
        self.0
    }
}

/// Where a record stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RecordStatus {
    /// A holder is running the operation under a lease.
    InProgress,
    /// The outcome is recorded and is replayed to every retry until the record expires.
    Completed,
    /// The attempt ended with a retryable failure; the next claim with the same fingerprint
    /// takes the key over.
    Released,
    /// Nobody knows whether the effect happened: retries are refused until it is reconciled.
    NeedsReconciliation,
}

impl RecordStatus {
    /// The name used in problem details, logs and SQL columns.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::InProgress => "in_progress",
            Self::Completed => "completed",
            Self::Released => "released",
            Self::NeedsReconciliation => "needs_reconciliation",
        }
    }
}

impl fmt::Display for RecordStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A recorded response: what every replay returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The original status code.
    pub status: StatusCode,
    /// The headers that may be replayed (sensitive and per-request ones already removed).
    pub headers: HeaderMap,
    /// The body bytes, or `None` when the body was larger than the route's response limit:
    /// the key stays consumed and replays answer with a `response-not-stored` problem.
    pub body: Option<Bytes>,
    /// Trailers, when the response had any (gRPC).
    pub trailers: Option<HeaderMap>,
}

/// What a store holds for one scoped key (DESIGN §2).
#[derive(Debug, Clone)]
pub struct Record {
    /// The key and its scope.
    pub key: ScopedKey,
    /// The fingerprint of the request that first claimed the key.
    pub fingerprint: Fingerprint,
    /// Where the record stands.
    pub status: RecordStatus,
    /// The token of the current (or last) holder.
    pub lease_token: FencingToken,
    /// When the holder's lease runs out, on the store's clock.
    pub lease_until: SystemTime,
    /// How many attempts have claimed this key.
    pub attempts: u32,
    /// Whether a holder declared that its external effect began, or its handler answered and
    /// the outcome could not be recorded ([`IdempotencyStore::mark_uncertain`]). A resolution
    /// as not applied clears it: the next attempt starts with no effect of its own.
    pub effect_started: bool,
    /// An identifier of the effect downstream (a payment id, a ticket number), as the
    /// current attempt recorded it: a new attempt (a takeover, a released key claimed again)
    /// starts without one, so an earlier attempt's id is never read as its effect's.
    pub downstream_id: Option<String>,
    /// The recorded response of a completed record.
    pub response: Option<StoredResponse>,
    /// When the record was first created.
    pub created_at: SystemTime,
    /// When the record last changed.
    pub updated_at: SystemTime,
    /// When the record stops counting and may be purged.
    pub expires_at: SystemTime,
    /// What happened to the key, oldest first.
    pub history: Vec<HistoryEntry>,
    /// Why the record was last resolved by hand, as its resolver wrote it (the operator
    /// console asks for it), shown with the resolution's history entry. `None` once a later
    /// resolution came without a note (a [`Sweeper`](crate::reconcile::Sweeper)'s).
    pub resolution_note: Option<String>,
}

/// A durable fact a holder records about its execution before going on.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Milestone {
    /// The external effect has begun: from now on a lost lease means "outcome unknown".
    EffectStarted,
    /// The effect's identifier downstream (a payment id, a ticket number), for reconciliation.
    DownstreamId(String),
}

/// How a record whose outcome was unknown is settled.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Resolution {
    /// The effect happened; this is the response retries get from now on.
    Applied(Box<StoredResponse>),
    /// The effect did not happen; the key may run again.
    NotApplied,
}

/// What to do with an in-progress record whose lease ran out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum LeaseExpiry {
    /// A new claim takes the key over (new token, `attempts + 1`), unless the holder recorded
    /// that its effect started: then the record goes to `needs_reconciliation`.
    #[default]
    Reclaim,
    /// The record always goes to `needs_reconciliation`: for effects whose start cannot be
    /// observed.
    Reconcile,
}

/// A request to claim a key.
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    /// The key and its scope.
    pub key: ScopedKey,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// How long the claim holds before others may act on it.
    pub lease: Duration,
    /// How long the record lives; renewed from the completion time when the outcome is stored.
    pub ttl: Duration,
    /// What to do if the existing record's lease has run out.
    pub on_lease_expiry: LeaseExpiry,
}

#[cfg(all(test, feature = "memory"))]
impl ClaimRequest {
    /// A claim of `key` with a minute's lease and TTL, for unit tests.
    pub(crate) fn a_minute(key: &ScopedKey) -> Self {
        Self {
            key: key.clone(),
            fingerprint: Fingerprint::from_bytes([7; 32]),
            lease: Duration::from_secs(60),
            ttl: Duration::from_secs(60),
            on_lease_expiry: LeaseExpiry::Reclaim,
        }
    }
}

/// The lease a claim won.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// The token that fences every later write.
    pub token: FencingToken,
    /// The attempt number, from 1.
    pub attempt: u32,
    /// When the lease runs out, on the store's clock.
    pub until: SystemTime,
}

/// The answer to a claim: either the caller now holds the key, or here is what stands.
///
/// A completed record is answered as [`Completed`](Self::Completed), with only what a replay
/// reads: every retry of a finished request takes this path, so a store need not load (nor the
/// layer decode and drop) the rest of the record. [`Claim::existing`] picks the variant for a
/// store that reads whole records.
#[derive(Debug, Clone)]
pub enum Claim {
    /// The key was absent, expired, released or reclaimable: the caller holds it now.
    Acquired(Lease),
    /// The record is completed: the caller replays `response` if its fingerprint is
    /// `fingerprint`, and refuses the request (422) otherwise.
    Completed {
        /// The fingerprint of the request that first claimed the key.
        fingerprint: Fingerprint,
        /// The recorded response.
        response: Box<StoredResponse>,
    },
    /// Someone else's record that is not completed (in progress, released, awaiting
    /// reconciliation), with the store's clock at the time it was read (to compute the
    /// remaining lease without trusting this node's clock).
    Existing {
        /// The record as it stood. Its `history` may be left out (empty) unless it is in
        /// progress or released: a claim needs it only to tell how long a holder has run.
        /// [`lookup`](IdempotencyStore::lookup) returns the whole record.
        record: Box<Record>,
        /// The store's clock when it read the record.
        now: SystemTime,
    },
}

impl Claim {
    /// What a claim that found `record` (read at `now` on the store's clock) answers:
    /// [`Completed`](Self::Completed) for a completed record with its response, otherwise
    /// [`Existing`](Self::Existing). A completed record without a response cannot be
    /// replayed: it is answered as `Existing`, which the layer reports as a store failure.
    pub fn existing(record: Record, now: SystemTime) -> Self {
        match record.into_replay() {
            Ok((fingerprint, response)) => Self::Completed {
                fingerprint,
                response: Box::new(response),
            },
            Err(record) => Self::Existing {
                record: Box::new(record),
                now,
            },
        }
    }
}

impl Record {
    /// What a replay reads, the fingerprint and the response, of a record completed with its
    /// response; any other record as it is.
    #[expect(
        clippy::result_large_err,
        reason = "matched at once by its two callers, as the record itself was before"
    )]
    pub(crate) fn into_replay(self) -> Result<(Fingerprint, StoredResponse), Self> {
        match self {
            Record {
                status: RecordStatus::Completed,
                response: Some(response),
                fingerprint,
                ..
            } => Ok((fingerprint, response)),
            record => Err(record),
        }
    }
}

/// Why a store operation failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum StoreError {
    /// The writer's token is not the record's current one, or the record is not in progress:
    /// its lease was taken over, so its write was refused.
    Fenced,
    /// The store cannot take more records right now.
    Full,
    /// The key's record is locked by a transaction that did not let go at once (a handler
    /// recording its milestone inside its own transaction): its holder is in flight. A claim
    /// answers this at once instead of queueing behind the lock.
    Busy,
    /// The store could not be reached or failed.
    Unavailable(BoxError),
}

impl StoreError {
    /// A store failure from any error.
    pub fn unavailable(err: impl Into<BoxError>) -> Self {
        Self::Unavailable(err.into())
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Fenced => f.write_str("the lease was taken over; the write was refused"),
            Self::Full => f.write_str("the store is full"),
            Self::Busy => f.write_str("the record is locked by a transaction in flight"),
            Self::Unavailable(e) => write!(f, "the store is unavailable: {e}"),
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Unavailable(e) => Some(e.as_ref()),
            _ => None,
        }
    }
}

/// The storage contract every backend implements (memory, SQLite, PostgreSQL, Redis, yours).
///
/// Every method is one atomic operation; times come from the store's own clock.
///
/// [`claim`](Self::claim) decides, atomically, in this order:
/// 1. no record, or one past its `expires_at` -> a fresh record, `in_progress`, attempt 1
///    (a store keeps `expires_at` at or after `lease_until`, so a live lease never expires).
///    A record whose outcome is unknown (`needs_reconciliation`, or `in_progress` with its
///    effect marked started) never expires: it stays until it is resolved, so uncertainty
///    never turns into a second run;
/// 2. a record with another fingerprint -> `Completed` if it is completed, else `Existing`
///    (the caller compares fingerprints and answers 422);
/// 3. `completed` -> `Completed`; `needs_reconciliation` -> `Existing`;
/// 4. `released` -> taken over: new token, `attempts + 1`, `in_progress`;
/// 5. `in_progress` with a live lease -> `Existing`;
/// 6. `in_progress` with an expired lease -> taken over as in 4 when the request says
///    [`LeaseExpiry::Reclaim`] and no effect was marked started; otherwise the record moves to
///    `needs_reconciliation` and is returned as `Existing`.
///
/// Writes after the claim (`renew`, `complete`, `release`, `mark_uncertain`, `record_milestone`)
/// succeed only while the record is `in_progress` with the caller's token, and fail with
/// [`StoreError::Fenced`] otherwise. `complete` also succeeds when the record still carries the
/// caller's token but is `completed` (the holder completed it in its own transaction) or
/// `needs_reconciliation` (the holder's earlier write failed, or its lease ran out on a
/// `Reconcile` route: the holder that ran settles the uncertainty with its outcome).
/// [`resolve`](Self::resolve) gives the record a new token, so after a resolution the old
/// holder is fenced out: a resolved outcome is final.
pub trait IdempotencyStore: Send + Sync + 'static {
    /// Claims `request.key`, or returns what stands (see the trait docs for the rules).
    fn claim(
        &self,
        request: &ClaimRequest,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// [`claim`](Self::claim) answered at once, by a store that needs no I/O to claim (the
    /// in-process `MemoryStore`); `None`, the default, says to await `claim` instead.
    ///
    /// Where it answers, it decides exactly as `claim` would, under the same atomicity. The
    /// layer asks it first: a claim made at once needs no boxed future seen to its end in case
    /// the request is dropped mid-claim, since nothing can drop it midway.
    fn claim_now(&self, request: &ClaimRequest) -> Option<Result<Claim, StoreError>> {
        let _ = request;
        None
    }

    /// The fingerprint of `key`'s record if it is completed, with its hint (whether the body
    /// was hashed as sent: see [`Fingerprint`]), read at once; `None` for any other record, for
    /// none, and from a store that cannot answer without I/O (the default). Whether the record
    /// has expired may be left unchecked.
    ///
    /// The layer asks it before it fingerprints a request, for the hint alone: a retry whose
    /// body is the recorded one, byte for byte, is then recognised without being read again.
    /// A store that answers it keeps the hint with the record. Nothing is decided from it: the
    /// layer decides from [`completed_now`](Self::completed_now) or a claim, made after the
    /// fingerprint as DESIGN §1 orders them.
    fn recorded_fingerprint_now(&self, key: &ScopedKey) -> Option<Fingerprint> {
        let _ = key;
        None
    }

    /// What [`claim`](Self::claim) would answer for `key` if its record is completed and not
    /// expired ([`Claim::Completed`]), read at once and without claiming; `None` for any other
    /// record, for none, and from a store that cannot answer without I/O (the default). The
    /// layer then claims as usual.
    ///
    /// A claim that finds a completed record changes nothing, so a read answers it as well: the
    /// layer asks this in place of a claim where
    /// [`recorded_fingerprint_now`](Self::recorded_fingerprint_now) found a completed record.
    fn completed_now(&self, key: &ScopedKey) -> Option<Result<Claim, StoreError>> {
        let _ = key;
        None
    }

    /// Extends the holder's lease to `lease` from now (and `expires_at` with it, if needed),
    /// never shortening it; returns the new end. Renewals of one lease may overlap (the layer
    /// starts the next when one is slow to come back), and one sent earlier may land later:
    /// it must not move the end back.
    fn renew(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        lease: Duration,
    ) -> impl Future<Output = Result<SystemTime, StoreError>> + Send;

    /// Records the outcome: the record becomes `completed` and lives for `ttl` from now (see
    /// the trait docs for when the holder may still write it).
    fn complete(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Gives the key back after a retryable failure: the record becomes `released`, unless a
    /// holder recorded [`Milestone::EffectStarted`], in which case nobody knows what happened and
    /// it becomes `needs_reconciliation`. Returns the status it ended in. Deciding on the stored
    /// milestone, not the caller's memory, keeps this right when the milestone was written in
    /// the handler's own transaction.
    fn release(
        &self,
        key: &ScopedKey,
        token: FencingToken,
    ) -> impl Future<Output = Result<RecordStatus, StoreError>> + Send;

    /// Declares the outcome unknown: the record becomes `needs_reconciliation`, its effect
    /// marked started. The layer calls it when a handler has answered and its outcome could
    /// not be recorded: whatever effect the handler has took place, so a reconciler or an
    /// operator reading the record must not take it for an attempt that did nothing.
    fn mark_uncertain(
        &self,
        key: &ScopedKey,
        token: FencingToken,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The record for `key`, if one exists and has not expired.
    fn lookup(
        &self,
        key: &ScopedKey,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send;

    /// Deletes the record for `key`, whatever its state; returns whether one existed.
    fn remove(&self, key: &ScopedKey) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Deletes every record past its `expires_at`; returns how many. A live lease keeps a record
    /// unexpired, so in-flight records are never purged. A store whose records expire on the
    /// server by themselves (Redis TTLs) has nothing left to delete and returns 0.
    fn purge_expired(&self) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Records a milestone on the holder's in-progress record (fenced like every write).
    fn record_milestone(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        milestone: &Milestone,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// A page of the records whose outcome is unknown and that only a reconciliation can
    /// settle: `needs_reconciliation`, and `in_progress` ones whose holder died (its lease ran
    /// out) after marking its effect started or on a route that reconciles expired leases
    /// ([`LeaseExpiry::Reconcile`]). A dead holder's record that the next claim simply takes
    /// over is not listed. Oldest change first, starting after `query.after`; its cost is the
    /// page's, not the store's: each store keeps the index it needs.
    ///
    /// Records changed in the same instant are listed in an order of their keys that the
    /// store keeps, the same in every listing and reversed for newest first, so pages never
    /// skip or repeat one: scope, then key, in [`MemoryStore`] and the SQL
    /// stores; a key's stored name in `RedisStore`, where the scope's length comes first. A
    /// record changed while a walk pages through the listing moves to its new place, and may
    /// be listed again later in that walk.
    ///
    /// A record that cannot be read is not an error of the listing: it is reported in
    /// [`UncertainPage::unreadable`] and left in place.
    fn list_uncertain(
        &self,
        query: &UncertainQuery,
    ) -> impl Future<Output = Result<UncertainPage, StoreError>> + Send;

    /// How many records [`list_uncertain`](Self::list_uncertain) would list in all, and the
    /// oldest last change among them.
    fn count_uncertain(&self) -> impl Future<Output = Result<UncertainCount, StoreError>> + Send;

    /// Settles an uncertain record (see [`list_uncertain`](Self::list_uncertain)) whose current
    /// token is `token`: [`Resolution::Applied`] completes it with a response living `ttl`,
    /// [`Resolution::NotApplied`] releases it (its effect no longer marked started) and keeps
    /// it, history and all, at least `ttl` from now (a record may wait for its reconciliation past the expiry its claim set);
    /// either way the record takes a new token, so the holder it overrules can no longer
    /// write. Anything else (a live holder, another token, a settled record) is refused with
    /// [`StoreError::Fenced`].
    ///
    /// `note` (why, for a resolution by hand) is kept with the record, in the same write, as its
    /// [`Record::resolution_note`]; `None` clears the note of an earlier resolution. A record
    /// claimed afresh once expired carries no note.
    fn resolve(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        resolution: &Resolution,
        ttl: Duration,
        note: Option<&str>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Appends `event` to the history of the unexpired record for `key`, as its current
    /// attempt; does nothing if there is none, or if its history already holds
    /// [`HISTORY_REFUSALS`] entries. Unfenced: it records what a request saw.
    ///
    /// Every other write appends its own event while the history holds fewer than
    /// [`HISTORY_LIMIT`] entries, so no record's history grows without bound.
    fn append_history(
        &self,
        key: &ScopedKey,
        event: HistoryEvent,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Waits until the record of `key`, seen in flight as `seen`, may have moved on
    /// (completed, released, uncertain, removed, taken over), for at most `within`: the
    /// caller (a request on a route that waits for in-flight keys) then claims again.
    /// `round` counts the caller's waits on this key, from 0. Returning early is always
    /// allowed; returning late is not.
    ///
    /// The default polls: it sleeps 10 ms, doubling each round up to 250 ms, so a store that
    /// does not implement this still works. A store that learns of changes wakes its waiters
    /// instead (in process for `MemoryStore`, by pub/sub for `RedisStore`), and at the
    /// holder's lease end, when a claim may take the key over: a waiter then makes a bounded
    /// number of store operations however long the first request runs.
    fn wait_for_change(
        &self,
        key: &ScopedKey,
        seen: &InFlight,
        round: u32,
        within: Duration,
    ) -> impl Future<Output = ()> + Send {
        let _ = (key, seen);
        waiting::poll(round, within)
    }
}

impl<S: IdempotencyStore> IdempotencyStore for Arc<S> {
    fn claim(
        &self,
        request: &ClaimRequest,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        (**self).claim(request)
    }

    fn claim_now(&self, request: &ClaimRequest) -> Option<Result<Claim, StoreError>> {
        (**self).claim_now(request)
    }

    fn recorded_fingerprint_now(&self, key: &ScopedKey) -> Option<Fingerprint> {
        (**self).recorded_fingerprint_now(key)
    }

    fn completed_now(&self, key: &ScopedKey) -> Option<Result<Claim, StoreError>> {
        (**self).completed_now(key)
    }

    fn renew(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        lease: Duration,
    ) -> impl Future<Output = Result<SystemTime, StoreError>> + Send {
        (**self).renew(key, token, lease)
    }

    fn complete(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        (**self).complete(key, token, response, ttl)
    }

    fn release(
        &self,
        key: &ScopedKey,
        token: FencingToken,
    ) -> impl Future<Output = Result<RecordStatus, StoreError>> + Send {
        (**self).release(key, token)
    }

    fn mark_uncertain(
        &self,
        key: &ScopedKey,
        token: FencingToken,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        (**self).mark_uncertain(key, token)
    }

    fn lookup(
        &self,
        key: &ScopedKey,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send {
        (**self).lookup(key)
    }

    fn remove(&self, key: &ScopedKey) -> impl Future<Output = Result<bool, StoreError>> + Send {
        (**self).remove(key)
    }

    fn purge_expired(&self) -> impl Future<Output = Result<u64, StoreError>> + Send {
        (**self).purge_expired()
    }

    fn record_milestone(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        milestone: &Milestone,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        (**self).record_milestone(key, token, milestone)
    }

    fn list_uncertain(
        &self,
        query: &UncertainQuery,
    ) -> impl Future<Output = Result<UncertainPage, StoreError>> + Send {
        (**self).list_uncertain(query)
    }

    fn count_uncertain(&self) -> impl Future<Output = Result<UncertainCount, StoreError>> + Send {
        (**self).count_uncertain()
    }

    fn resolve(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        resolution: &Resolution,
        ttl: Duration,
        note: Option<&str>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        (**self).resolve(key, token, resolution, ttl, note)
    }

    fn append_history(
        &self,
        key: &ScopedKey,
        event: HistoryEvent,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        (**self).append_history(key, event)
    }

    fn wait_for_change(
        &self,
        key: &ScopedKey,
        seen: &InFlight,
        round: u32,
        within: Duration,
    ) -> impl Future<Output = ()> + Send {
        (**self).wait_for_change(key, seen, round, within)
    }
}
