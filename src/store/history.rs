//! A key's history: every attempt and what became of it, for incident review.
//!
//! Stores keep it in the record and append to it in the same statement as the write it
//! describes, so it costs no round trip. Refusals (replays, conflicts, mismatches) are written
//! only on routes that ask for them ([`RouteConfig::record_refusals`](crate::RouteConfig::record_refusals)):
//! each costs a write on what is otherwise a read.

use std::fmt;

/// A key's history keeps at most this many entries: claims, milestones and outcomes are
/// written until it holds them; beyond, each new event takes the place of the last entry. So
/// the first attempts of a key retried without end stay readable, its latest event (its
/// outcome) is always there, and no record grows without bound.
pub const HISTORY_LIMIT: usize = 256;

/// What requests were told (replays, conflicts, mismatches, outcome unknown) is written only
/// while the history holds fewer entries than this: a key replayed a million times keeps a
/// few dozen such entries, and every store's record stays small.
pub const HISTORY_REFUSALS: usize = 64;
use std::time::SystemTime;

use super::FencingToken;

/// What happened to a key at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HistoryEvent {
    /// An attempt claimed the key (the first, or a takeover).
    Claimed,
    /// The attempt declared its external effect started.
    EffectStarted,
    /// The attempt recorded the effect's downstream id.
    DownstreamId,
    /// The attempt's outcome was recorded.
    Completed,
    /// The attempt failed retryably and gave the key back.
    Released,
    /// The attempt's outcome became unknown.
    NeedsReconciliation,
    /// The attempt's lease ran out with nobody to renew it.
    LeaseExpired,
    /// Reconciliation found the effect applied.
    ReconciledApplied,
    /// Reconciliation found the effect not applied.
    ReconciledNotApplied,
    /// A retry got the recorded outcome.
    Replayed,
    /// A retry arrived while the attempt was running.
    Conflict,
    /// The key was used for a different request.
    Mismatch,
    /// A retry was refused because the outcome is unknown.
    OutcomeUnknown,
}

const EVENTS: [(HistoryEvent, &str); 13] = [
    (HistoryEvent::Claimed, "claimed"),
    (HistoryEvent::EffectStarted, "effect_started"),
    (HistoryEvent::DownstreamId, "downstream_id"),
    (HistoryEvent::Completed, "completed"),
    (HistoryEvent::Released, "released"),
    (HistoryEvent::NeedsReconciliation, "needs_reconciliation"),
    (HistoryEvent::LeaseExpired, "lease_expired"),
    (HistoryEvent::ReconciledApplied, "reconciled_applied"),
    (HistoryEvent::ReconciledNotApplied, "reconciled_not_applied"),
    (HistoryEvent::Replayed, "replayed"),
    (HistoryEvent::Conflict, "conflict"),
    (HistoryEvent::Mismatch, "mismatch"),
    (HistoryEvent::OutcomeUnknown, "outcome_unknown"),
];

impl HistoryEvent {
    /// The event's stored name.
    pub fn as_str(self) -> &'static str {
        EVENTS
            .iter()
            .find(|(e, _)| *e == self)
            .map_or("unknown", |(_, name)| name)
    }

    fn parse(name: &str) -> Option<Self> {
        EVENTS.iter().find(|(_, n)| *n == name).map(|(e, _)| *e)
    }
}

impl fmt::Display for HistoryEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One line of a key's history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistoryEntry {
    /// The attempt it concerns, from 1.
    pub attempt: u32,
    /// That attempt's token (its attempt id, as [`IdempotencyContext::attempt_id`](crate::IdempotencyContext::attempt_id) prints it in hex).
    pub token: FencingToken,
    /// When, on the store's clock.
    pub at: SystemTime,
    /// What happened.
    pub event: HistoryEvent,
}

impl HistoryEntry {
    /// The entry in its stored text form, `attempt token millis event;`.
    pub fn to_text(&self) -> String {
        let ms = self
            .at
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        format!(
            "{} {} {ms} {};",
            self.attempt,
            self.token.get() as i64,
            self.event
        )
    }

    /// Parses a stored history; entries it cannot read are skipped.
    pub fn parse_all(text: &str) -> Vec<Self> {
        text.split(';')
            .filter_map(|entry| {
                let mut parts = entry.split_whitespace();
                let attempt = parts.next()?.parse().ok()?;
                let token: i64 = parts.next()?.parse().ok()?;
                let ms: u64 = parts.next()?.parse().ok()?;
                let event = HistoryEvent::parse(parts.next()?)?;
                Some(Self {
                    attempt,
                    token: FencingToken::new(token as u64),
                    at: SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(ms),
                    event,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_through_text() {
        let at = SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(1_700_000_000_123);
        let entries: Vec<_> = EVENTS
            .iter()
            .enumerate()
            .map(|(i, (event, _))| HistoryEntry {
                attempt: i as u32 + 1,
                token: FencingToken::new(u64::MAX >> 1),
                at,
                event: *event,
            })
            .collect();
        let text: String = entries.iter().map(HistoryEntry::to_text).collect();
        assert_eq!(HistoryEntry::parse_all(&text), entries);
        assert_eq!(
            HistoryEntry::parse_all("garbage; 1 2 3 claimed;"),
            vec![HistoryEntry {
                attempt: 1,
                token: FencingToken::new(2),
                at: SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(3),
                event: HistoryEvent::Claimed,
            }]
        );
    }
}
