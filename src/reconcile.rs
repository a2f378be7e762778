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
use std::sync::Arc;
use std::time::Duration;

use crate::observe::{self, Event};
use crate::store::{IdempotencyStore, Record, Resolution, ScopedKey, StoreError, StoredResponse};

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
pub struct SweepReport {
    /// Records resolved as applied (now completed).
    pub applied: usize,
    /// Records resolved as not applied (released).
    pub not_applied: usize,
    /// Records still unknown after asking.
    pub unknown: usize,
    /// Records that changed while they were being reconciled (their resolve was fenced).
    pub raced: usize,
    /// Expired records purged.
    pub purged: u64,
}

/// Reconciles uncertain records and purges expired ones, on an interval.
#[derive(Debug)]
pub struct Sweeper<St, R> {
    store: Arc<St>,
    reconciler: Arc<R>,
    interval: Duration,
    batch: usize,
    ttl: Duration,
}

impl<St: IdempotencyStore, R: Reconciler> Sweeper<St, R> {
    /// A sweeper over `store` asking `reconciler`; every 60 s, 100 records a pass, resolved
    /// responses kept 24 h.
    pub fn new(store: St, reconciler: R) -> Self {
        Self {
            store: Arc::new(store),
            reconciler: Arc::new(reconciler),
            interval: Duration::from_secs(60),
            batch: 100,
            ttl: Duration::from_secs(24 * 60 * 60),
        }
    }

    /// Time between passes.
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// Most records reconciled per pass.
    pub fn batch(mut self, batch: usize) -> Self {
        self.batch = batch;
        self
    }

    /// How long a response resolved as applied is replayed.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// One pass: reconcile up to a batch of uncertain records, then purge expired ones.
    pub async fn run_once(&self) -> Result<SweepReport, StoreError> {
        let mut report = SweepReport::default();
        let uncertain = self.store.list_uncertain(self.batch).await?;
        observe::awaiting_reconciliation(uncertain.len());
        for record in &uncertain {
            let resolution = match self.reconciler.reconcile(record).await {
                Reconciliation::Applied(response) => Resolution::Applied(response),
                Reconciliation::NotApplied => Resolution::NotApplied,
                Reconciliation::Unknown => {
                    report.unknown += 1;
                    continue;
                }
            };
            match self
                .store
                .resolve(&record.key, record.lease_token, &resolution, self.ttl)
                .await
            {
                Ok(()) => count(&resolution, &mut report),
                Err(StoreError::Fenced) => report.raced += 1,
                Err(error) => return Err(error),
            }
        }
        report.purged = self.store.purge_expired().await?;
        Ok(report)
    }

    /// Runs passes on the interval until the returned task is aborted; a failed pass is logged
    /// and the next one tries again.
    pub fn spawn(self) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(self.interval);
            loop {
                ticker.tick().await;
                match self.run_once().await {
                    Ok(report) => tracing::debug!(?report, "idempotency sweep"),
                    Err(error) => tracing::warn!(%error, "idempotency sweep failed"),
                }
            }
        })
    }
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
/// response retries will get, `NotApplied` lets the key run again. Refused with
/// [`StoreError::Fenced`] if the key is not uncertain (a live holder, or already settled).
pub async fn resolve_by_hand<St: IdempotencyStore>(
    store: &St,
    key: &ScopedKey,
    resolution: Reconciliation,
    ttl: Duration,
) -> Result<(), StoreError> {
    let record = store.lookup(key).await?.ok_or(StoreError::Fenced)?;
    let resolution = match resolution {
        Reconciliation::Applied(response) => Resolution::Applied(response),
        Reconciliation::NotApplied => Resolution::NotApplied,
        Reconciliation::Unknown => return Ok(()),
    };
    store
        .resolve(key, record.lease_token, &resolution, ttl)
        .await?;
    count(&resolution, &mut SweepReport::default());
    Ok(())
}
