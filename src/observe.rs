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
//! | `idempotency_lease_lost_total` | holders that lost their lease while running (taken over, or set aside), once per holder |
//! | `idempotency_stale_writes_total` | writes refused because the writer's lease was taken over |
//! | `idempotency_pending_writes` (gauge) | writes after a run that failed and are being tried again (a record, a give-back), each holding its key in flight until it lands; one that stays up means a store that takes claims but not these writes |

/// Declares the events, each with its counter's name, in one list: the enum, every event, and
/// each one's key built and hashed at compile time (`counter!` with a name that is not a
/// literal builds and hashes its key on every call, about 150 instructions).
macro_rules! events {
    ($($event:ident => $name:literal,)*) => {
        /// Something worth counting.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub(crate) enum Event {
            $($event,)*
        }

        impl Event {
            /// Every event.
            #[cfg(test)]
            const ALL: &[Self] = &[$(Self::$event,)*];

            /// The event's counter key.
            fn key(self) -> &'static metrics::Key {
                match self {
                    $(Self::$event => {
                        static KEY: metrics::Key = metrics::Key::from_static_name($name);
                        &KEY
                    })*
                }
            }
        }
    };
}

events! {
    Attempt => "idempotency_attempts_total",
    Execution => "idempotency_executions_total",
    Replay => "idempotency_replays_total",
    Conflict => "idempotency_conflicts_total",
    Mismatch => "idempotency_mismatches_total",
    KeyRejected => "idempotency_key_rejections_total",
    BodyRejected => "idempotency_body_rejections_total",
    StoreError => "idempotency_store_errors_total",
    Release => "idempotency_releases_total",
    Unknown => "idempotency_outcome_unknown_total",
    MovedToReconciliation => "idempotency_moved_to_reconciliation_total",
    ReconciledApplied => "idempotency_reconciled_applied_total",
    ReconciledNotApplied => "idempotency_reconciled_not_applied_total",
    LeaseLost => "idempotency_lease_lost_total",
    StaleWrite => "idempotency_stale_writes_total",
    ReconcileFailed => "idempotency_reconcile_failures_total",
    Unreadable => "idempotency_unreadable_records_total",
}

/// Counts `event`. The recorder is asked each time, so one installed later (or a thread's
/// local one) counts at once.
pub(crate) fn count(event: Event) {
    static METADATA: metrics::Metadata<'static> =
        metrics::Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));
    metrics::with_recorder(|recorder| recorder.register_counter(event.key(), &METADATA))
        .increment(1);
}

/// Whether the request's `INFO` span could be seen: a `tracing` subscriber takes `INFO` (the
/// level `tracing` keeps as the most any subscriber wants, `OFF` until one is set), or `log`
/// takes `INFO` (`tracing` writes an `INFO` span to `log` when its `log` feature is on, which
/// the SQL stores' `sqlx` turns on, and `log` lets that level through).
///
/// When neither holds, every operation on a span does nothing but still costs its checks
/// (about 440 instructions per request with the `log` feature), so the request gets
/// [`tracing::Span::none`], which skips them. Decided when the request arrives, as `tracing`
/// decides whether subscribers see a span: a request already in flight when `log`'s level is
/// raised writes nothing more of its span to `log` (a disabled span would have followed the
/// new level), and every request after it is written.
pub(crate) fn spans_heard() -> bool {
    use tracing::level_filters::{LevelFilter, STATIC_MAX_LEVEL};
    let info = tracing::Level::INFO;
    (info <= STATIC_MAX_LEVEL && info <= LevelFilter::current())
        || log::Level::Info <= log::max_level()
}

/// A write after a run being tried again on a task of its own, counted in
/// `idempotency_pending_writes` from [`PendingWrite::begin`] until it is dropped (landed, given
/// up, or its task dropped with the runtime). The gauge it raised is the one it lowers, so a
/// recorder installed meanwhile is not left one below.
pub(crate) struct PendingWrite(metrics::Gauge);

impl PendingWrite {
    /// Counts one more pending write.
    pub(crate) fn begin() -> Self {
        let gauge = metrics::gauge!("idempotency_pending_writes");
        gauge.increment(1.0);
        Self(gauge)
    }
}

impl Drop for PendingWrite {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
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

    /// DESIGN §6: each event counts under its own name, one of the counters this module's
    /// table documents.
    #[test]
    fn each_event_counts_under_a_documented_name_of_its_own() {
        let documented = include_str!("observe.rs");
        let mut names: Vec<&str> = Event::ALL.iter().map(|e| e.key().name()).collect();
        for name in &names {
            assert!(
                documented.contains(&format!("//! | `{name}` |")),
                "{name} is not in the table"
            );
        }
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Event::ALL.len(), "two events share a name");
    }
}
