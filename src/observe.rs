//! Metrics (DESIGN §6): one counter per kind of event, through the `metrics` facade.
//!
//! | counter | counts |
//! |---|---|
//! | `idempotency_attempts_total` | guarded requests that carried a valid key |
//! | `idempotency_executions_total` | runs of the inner service (effects) |
//! | `idempotency_replays_total` | recorded outcomes replayed |
//! | `idempotency_conflicts_total` | requests refused because the key was in flight |
//! | `idempotency_mismatches_total` | keys reused with a different request |
//! | `idempotency_key_rejections_total` | missing or invalid keys |
//! | `idempotency_body_rejections_total` | bodies too large, malformed or unreadable |
//! | `idempotency_store_errors_total` | store operations that failed |
//! | `idempotency_releases_total` | claims released after a retryable failure |
//! | `idempotency_outcome_unknown_total` | requests refused because the key's outcome is unknown |
//! | `idempotency_moved_to_reconciliation_total` | records that became `needs_reconciliation` (effect started, then failure; response write failed) |
//! | `idempotency_reconciled_applied_total` | uncertain records resolved as applied |
//! | `idempotency_reconciled_not_applied_total` | uncertain records resolved as not applied |
//! | `idempotency_awaiting_reconciliation` (gauge) | records awaiting reconciliation, in all, as the sweeper's last pass counted them |
//! | `idempotency_oldest_uncertain_seconds` (gauge) | how long the oldest of them has waited since it last changed (0 when none) |
//! | `idempotency_reconcile_failures_total` | records whose reconciliation failed (the reconciler panicked or timed out, or the store refused the resolution) |
//! | `idempotency_unreadable_records_total` | uncertain records the sweeper could not read (corrupt rows, skipped and kept) |
//! | `idempotency_lease_lost_total` | holders that lost their lease while running |
//! | `idempotency_stale_writes_total` | writes refused because the writer's lease was taken over |

/// Something worth counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    Attempt,
    Execution,
    Replay,
    Conflict,
    Mismatch,
    KeyRejected,
    BodyRejected,
    StoreError,
    Release,
    Unknown,
    MovedToReconciliation,
    ReconciledApplied,
    ReconciledNotApplied,
    LeaseLost,
    StaleWrite,
    ReconcileFailed,
    Unreadable,
}

impl Event {
    pub(crate) const fn name(self) -> &'static str {
        match self {
            Self::Attempt => "idempotency_attempts_total",
            Self::Execution => "idempotency_executions_total",
            Self::Replay => "idempotency_replays_total",
            Self::Conflict => "idempotency_conflicts_total",
            Self::Mismatch => "idempotency_mismatches_total",
            Self::KeyRejected => "idempotency_key_rejections_total",
            Self::BodyRejected => "idempotency_body_rejections_total",
            Self::StoreError => "idempotency_store_errors_total",
            Self::Release => "idempotency_releases_total",
            Self::Unknown => "idempotency_outcome_unknown_total",
            Self::MovedToReconciliation => "idempotency_moved_to_reconciliation_total",
            Self::ReconciledApplied => "idempotency_reconciled_applied_total",
            Self::ReconciledNotApplied => "idempotency_reconciled_not_applied_total",
            Self::LeaseLost => "idempotency_lease_lost_total",
            Self::StaleWrite => "idempotency_stale_writes_total",
            Self::ReconcileFailed => "idempotency_reconcile_failures_total",
            Self::Unreadable => "idempotency_unreadable_records_total",
        }
    }
}

impl Event {
    /// The event's counter key, built and hashed at compile time: `counter!` with a name that
    /// is not a literal builds and hashes its key on every call (about 150 instructions).
    fn key(self) -> &'static metrics::Key {
        macro_rules! keys {
            ($($event:ident),* $(,)?) => {
                match self {
                    $(Self::$event => {
                        static KEY: metrics::Key =
                            metrics::Key::from_static_name(Event::$event.name());
                        &KEY
                    })*
                }
            };
        }
        keys!(
            Attempt,
            Execution,
            Replay,
            Conflict,
            Mismatch,
            KeyRejected,
            BodyRejected,
            StoreError,
            Release,
            Unknown,
            MovedToReconciliation,
            ReconciledApplied,
            ReconciledNotApplied,
            LeaseLost,
            StaleWrite,
            ReconcileFailed,
            Unreadable,
        )
    }
}

/// Counts `event`. The recorder is asked each time, so one installed later (or a thread's
/// local one) counts at once.
pub(crate) fn count(event: Event) {
    static METADATA: metrics::Metadata<'static> =
        metrics::Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));
    metrics::with_recorder(|recorder| recorder.register_counter(event.key(), &METADATA))
        .increment(1);
}

/// Sets the gauges of records awaiting reconciliation: how many, and how long the oldest has
/// waited.
pub(crate) fn uncertain(count: u64, oldest: Option<std::time::SystemTime>) {
    metrics::gauge!("idempotency_awaiting_reconciliation").set(count as f64);
    let waited = oldest
        .and_then(|at| std::time::SystemTime::now().duration_since(at).ok())
        .map_or(0.0, |d| d.as_secs_f64());
    metrics::gauge!("idempotency_oldest_uncertain_seconds").set(waited);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DESIGN §6: each event counts under its own name.
    #[test]
    fn each_event_counts_under_its_own_name() {
        let all = [
            Event::Attempt,
            Event::Execution,
            Event::Replay,
            Event::Conflict,
            Event::Mismatch,
            Event::KeyRejected,
            Event::BodyRejected,
            Event::StoreError,
            Event::Release,
            Event::Unknown,
            Event::MovedToReconciliation,
            Event::ReconciledApplied,
            Event::ReconciledNotApplied,
            Event::LeaseLost,
            Event::StaleWrite,
            Event::ReconcileFailed,
            Event::Unreadable,
        ];
        for event in all {
            assert_eq!(event.key().name(), event.name(), "{event:?}");
        }
    }
}
