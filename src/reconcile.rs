//! Settling "did the effect happen?": the [`Reconciler`] you write, and the [`Sweeper`] that
//! runs it, with TTL purging, on an interval.
//!
//! A key ends up uncertain when an attempt recorded
//! [`effect_started`](crate::IdempotencyContext::effect_started) and then failed or died, when
//! the response could not be recorded after the handler ran, or when a route reconciles every
//! expired lease ([`LeaseExpiry::Reconcile`](crate::LeaseExpiry::Reconcile)). Retries of such a
//! key get `409 outcome-unknown` (gRPC `ABORTED`, reason `OUTCOME_UNKNOWN`) until it is settled:
//! by the sweeper asking your reconciler, or by hand with [`resolve_by_hand`].
//!
//! A key whose response could not be recorded is marked uncertain at once, its effect marked
//! started (its handler answered, so whatever effect it has took place), and its holder keeps
//! retrying the write. It can therefore be listed, and resolved, while that holder is still
//! alive; the holder's write lands only if nobody has resolved the key first. A resolution is
//! final: it takes a new fencing token, and the holder's later write is refused. A reconciler
//! that answers [`Reconciliation::Unknown`] for a record changed within the last few of its
//! route's leases (one retried write may take up to four) leaves such a holder time to
//! finish. Likewise, a holder whose key was set aside
//! although it had marked no effect started gives the key back itself (as not applied).
//!
//! ```no_run
//! use std::time::Duration;
//! use tower_idempotency::MemoryStore;
//! use tower_idempotency::reconcile::{Reconciler, Reconciliation, Sweeper};
//! use tower_idempotency::store::Record;
//!
//! struct Payments;
//!
//! impl Reconciler for Payments {
//!     async fn reconcile(&self, record: &Record) -> Reconciliation {
//!         // Ask the provider about `record.downstream_id`, or about the derived key.
//!         Reconciliation::Unknown
//!     }
//! }
//!
//! # async fn run() {
//! let store = MemoryStore::new();
//! let sweeper = Sweeper::new(store.clone(), Payments).interval(Duration::from_secs(30));
//! let handle = sweeper.spawn();
//! # }
//! ```

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::observe::{self, Event};
use crate::store::{
    IdempotencyStore, Record, Resolution, ScopedKey, StoreError, StoredResponse, UncertainCursor,
    UncertainQuery,
};
use crate::unwind::CatchUnwind;

/// What a reconciler found out about an uncertain record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reconciliation {
    /// The effect happened; retries get this response from now on.
    Applied(Box<StoredResponse>),
    /// The effect did not happen; the key may run again.
    NotApplied,
    /// Still unknown: the record stays for the next pass, or for a person.
    Unknown,
}

/// Looks an uncertain operation up downstream: by
/// [`downstream_id`](Record::downstream_id) if the handler recorded one, or by the derived key
/// it passed to the provider ([`IdempotencyContext::downstream_key`](crate::IdempotencyContext::downstream_key),
/// recomputable with [`downstream_key`]).
pub trait Reconciler: Send + Sync + 'static {
    /// Whether the effect of `record` happened.
    fn reconcile(&self, record: &Record) -> impl Future<Output = Reconciliation> + Send;
}

/// The key a handler was given as [`IdempotencyContext::downstream_key`](crate::IdempotencyContext::downstream_key),
/// recomputed from a record's key.
pub fn downstream_key(key: &ScopedKey) -> String {
    crate::context::derive_downstream_key(key)
}

/// What one sweep did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SweepReport {
    /// Records resolved as applied (now completed).
    pub applied: usize,
    /// Records resolved as not applied (released).
    pub not_applied: usize,
    /// Records still unknown after asking.
    pub unknown: usize,
    /// Records that changed while they were being reconciled (their resolve was fenced).
    pub raced: usize,
    /// Records whose reconciliation failed: the reconciler panicked or did not answer in
    /// time, or the store refused the resolution. Each stays for the next pass.
    pub failed: usize,
    /// Records that cannot be read (a corrupt row): skipped, logged with their key, left in
    /// the store for an operator.
    pub unreadable: usize,
    /// Expired records purged.
    pub purged: u64,
    /// Records awaiting reconciliation after the pass, in all.
    pub awaiting: u64,
}

/// Reconciles uncertain records and purges expired ones, on an interval.
///
/// One record costs one record: a reconciler that panics, fails or hangs on it (past
/// [`record_timeout`](Self::record_timeout)) is counted and logged, and the pass goes on; a
/// record that cannot be read is skipped and reported; purging runs on every pass whatever the
/// reconciliation did; and a spawned sweeper survives a pass that panics.
///
/// Passes page through the uncertain records in order and carry on where the last one stopped,
/// starting over once they reach the end: records the reconciler cannot settle yet come round
/// again, but never keep newer ones waiting (a cursor rather than a per-record retry time: no
/// schema of its own, and each record is asked once per round, however many are stuck).
#[derive(Debug)]
pub struct Sweeper<St, R> {
    store: Arc<St>,
    reconciler: Arc<R>,
    interval: Duration,
    batch: usize,
    ttl: Duration,
    record_timeout: Duration,
    /// Where the next pass starts (`None`: at the beginning).
    cursor: Mutex<Option<UncertainCursor>>,
}

impl<St: IdempotencyStore, R: Reconciler> Sweeper<St, R> {
    /// A sweeper over `store` asking `reconciler`; every 60 s, 100 records a pass, 30 s per
    /// record, resolved responses kept 24 h.
    pub fn new(store: St, reconciler: R) -> Self {
        Self {
            store: Arc::new(store),
            reconciler: Arc::new(reconciler),
            interval: Duration::from_secs(60),
            batch: 100,
            ttl: Duration::from_secs(24 * 60 * 60),
            record_timeout: Duration::from_secs(30),
            cursor: Mutex::new(None),
        }
    }

    /// Time between passes.
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// Most records reconciled per pass.
    pub fn batch(mut self, batch: usize) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// How long a response resolved as applied is replayed, and the least a record resolved
    /// as not applied is kept from then (default 24 hours). The sweeper's resolutions carry
    /// no note: one clears the note of an earlier resolution by hand. At most
    /// [`LONGEST`](crate::LONGEST), as a route's.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl.min(crate::LONGEST);
        self
    }

    /// How long the reconciler may take over one record before it is given up on for this
    /// pass (default 30 s).
    pub fn record_timeout(mut self, timeout: Duration) -> Self {
        self.record_timeout = timeout;
        self
    }

    /// One pass: reconcile the next page of uncertain records, then purge expired ones. The
    /// purge runs even when the listing fails; that failure is then the pass's error.
    pub async fn run_once(&self) -> Result<SweepReport, StoreError> {
        let mut report = SweepReport::default();
        let reconciled = self.reconcile_page(&mut report).await;
        let purged = self.store.purge_expired().await;
        if let Ok(purged) = &purged {
            report.purged = *purged;
        }
        match self.store.count_uncertain().await {
            Ok(count) => {
                report.awaiting = count.count;
                observe::uncertain(count.count, count.oldest);
            }
            Err(error) => tracing::warn!(%error, "could not count the uncertain records"),
        }
        reconciled?;
        purged?;
        Ok(report)
    }

    /// Reconciles the page after the cursor, and moves the cursor on.
    async fn reconcile_page(&self, report: &mut SweepReport) -> Result<(), StoreError> {
        let after = lock(&self.cursor).clone();
        let resumed = after.is_some();
        let query = match after.clone() {
            Some(cursor) => UncertainQuery::after(cursor, self.batch),
            None => UncertainQuery::first(self.batch),
        };
        let mut page = self.store.list_uncertain(&query).await?;
        if resumed && page.records.is_empty() && page.unreadable.is_empty() && page.next.is_none() {
            // The last round ended exactly on a full page: start the next one now, not a
            // pass later. (An empty page that goes on held records settled meanwhile.)
            page = self
                .store
                .list_uncertain(&UncertainQuery::first(self.batch))
                .await?;
        }
        // At the end of the listing, the next pass starts over; so does it when the page did
        // not move the cursor on (a row whose place cannot be told), so no row holds it.
        let stalled = page.next.is_some() && page.next == after;
        *lock(&self.cursor) = if stalled { None } else { page.next.clone() };
        for unreadable in &page.unreadable {
            observe::count(Event::Unreadable);
            tracing::error!(
                key = ?unreadable.key,
                error = %unreadable.error,
                "an uncertain record cannot be read: skipped, and kept for an operator"
            );
        }
        report.unreadable += page.unreadable.len();
        for record in &page.records {
            self.reconcile(record, report).await;
        }
        Ok(())
    }

    /// Asks about one record and settles it; whatever goes wrong costs this record alone.
    async fn reconcile(&self, record: &Record, report: &mut SweepReport) {
        // The call itself inside the catch: a reconciler may do work (and panic) before its
        // future exists.
        let asking = CatchUnwind {
            inner: async { self.reconciler.reconcile(record).await },
        };
        let found = match tokio::time::timeout(self.record_timeout, asking).await {
            Ok(Ok(found)) => found,
            Ok(Err(_panic)) => {
                return self.failed(record, report, "the reconciler panicked on it");
            }
            Err(_elapsed) => {
                return self.failed(record, report, "the reconciler did not answer in time");
            }
        };
        let resolution = match found {
            Reconciliation::Applied(response) => Resolution::Applied(response),
            Reconciliation::NotApplied => Resolution::NotApplied,
            Reconciliation::Unknown => {
                report.unknown += 1;
                return;
            }
        };
        match self
            .store
            .resolve(&record.key, record.lease_token, &resolution, self.ttl, None)
            .await
        {
            Ok(()) => count(&resolution, report),
            Err(StoreError::Fenced) => report.raced += 1,
            Err(error) => {
                let why = format!("the store refused its resolution: {error}");
                self.failed(record, report, &why);
            }
        }
    }

    fn failed(&self, record: &Record, report: &mut SweepReport, why: &str) {
        report.failed += 1;
        observe::count(Event::ReconcileFailed);
        tracing::error!(key = ?record.key, "could not reconcile a record: {why}; it stays for the next pass");
    }

    /// Runs passes on the interval until the returned task is aborted. A failed pass is logged
    /// and the next one tries again; a pass that panics (in the store) is logged too, and does
    /// not end the sweeper.
    pub fn spawn(self) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(self.interval);
            loop {
                ticker.tick().await;
                let pass = CatchUnwind {
                    inner: self.run_once(),
                };
                match pass.await {
                    Ok(Ok(report)) => tracing::debug!(?report, "idempotency sweep"),
                    Ok(Err(error)) => tracing::warn!(%error, "idempotency sweep failed"),
                    Err(_panic) => {
                        tracing::error!("an idempotency sweep panicked; the next runs as usual")
                    }
                }
            }
        })
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A cursor is replaced whole: a poisoned one is still a cursor.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn count(resolution: &Resolution, report: &mut SweepReport) {
    match resolution {
        Resolution::Applied(_) => {
            observe::count(Event::ReconciledApplied);
            report.applied += 1;
        }
        Resolution::NotApplied => {
            observe::count(Event::ReconciledNotApplied);
            report.not_applied += 1;
        }
    }
}

/// Settles one uncertain key by hand (an operator who checked downstream): `Applied` records the
/// response retries will get for `ttl` (at most [`LONGEST`](crate::LONGEST), as a route's),
/// `NotApplied` lets the key run again (the record stays at least `ttl`, for review); `reason`
/// is kept with the record
/// ([`Record::resolution_note`]). Refused with [`StoreError::Fenced`] if the key is not
/// uncertain (a live holder, or already settled).
pub async fn resolve_by_hand<St: IdempotencyStore>(
    store: &St,
    key: &ScopedKey,
    resolution: Reconciliation,
    ttl: Duration,
    reason: &str,
) -> Result<(), StoreError> {
    let record = store.lookup(key).await?.ok_or(StoreError::Fenced)?;
    resolve_at(store, key, record.lease_token, resolution, ttl, reason).await
}

/// [`resolve_by_hand`] of the attempt that holds `token`: refused ([`StoreError::Fenced`]) if
/// the record has moved on since (another attempt, or settled), as a form loaded before a
/// retry must not settle the retry.
pub(crate) async fn resolve_at<St: IdempotencyStore>(
    store: &St,
    key: &ScopedKey,
    token: crate::store::FencingToken,
    resolution: Reconciliation,
    ttl: Duration,
    reason: &str,
) -> Result<(), StoreError> {
    let resolution = match resolution {
        Reconciliation::Applied(response) => Resolution::Applied(response),
        Reconciliation::NotApplied => Resolution::NotApplied,
        Reconciliation::Unknown => return Ok(()),
    };
    // A store cannot keep a record forever (`now() + interval` overflows in SQL): every
    // resolution of such a TTL would fail.
    let ttl = ttl.min(crate::LONGEST);
    store
        .resolve(key, token, &resolution, ttl, Some(reason))
        .await?;
    tracing::info!(?key, reason, "resolved by hand");
    count(&resolution, &mut SweepReport::default());
    Ok(())
}
