//! Step 6 of the pipeline: from what the claim found to what happens next.

use std::time::Duration;

use crate::fingerprint::{Fingerprint, Scheme};
use crate::observe::{self, Event};
use crate::problem::{Problem, ProblemKind};
use crate::store::{Claim, InFlight, Lease, RecordStatus, StoredResponse};

/// What a request does after its claim.
#[derive(Debug)]
pub(crate) enum Decision {
    /// The claim was won: run the inner service under this lease.
    Run(Lease),
    /// The outcome is recorded: replay it.
    Replay(StoredResponse),
    /// Answer without running anything.
    Refuse(Problem),
    /// Another request holds the key (`InProgress`, the problem to answer): what was seen of
    /// its record, for a request that waits for it (none when the record was locked).
    InFlight(Problem, Option<InFlight>),
}

/// DESIGN §1 step 6, in its order: a fingerprint mismatch is reported before any in-flight
/// state, so a client that changed its request learns that first.
/// `covers` names what the fingerprint covers, in the dialect's words, for a mismatch;
/// `window`, the route's processing window (the p99 of its executions), for how long an
/// in-flight holder has left; `schemes`, the fingerprint schemes of the layer's routes.
pub(crate) fn decide(
    claim: Claim,
    fingerprint: &Fingerprint,
    covers: &str,
    window: Option<Duration>,
    schemes: &[Scheme],
) -> Decision {
    let (record, now) = match claim {
        Claim::Acquired(lease) => return Decision::Run(lease),
        Claim::Completed {
            fingerprint: recorded,
            response,
        } => return completed(&recorded, *response, fingerprint, covers, schemes),
        // A store should answer a completed record as `Claim::Completed`; one it reported
        // whole replays all the same.
        Claim::Existing { record, now } => match record.into_replay() {
            Ok((recorded, response)) => {
                return completed(&recorded, response, fingerprint, covers, schemes);
            }
            Err(record) => (record, now),
        },
    };
    let state = record.status.as_str();
    if !record.fingerprint.same_input(fingerprint) {
        return mismatch(
            covers,
            record.status,
            &record.fingerprint,
            fingerprint,
            schemes,
        );
    }
    match record.status {
        // Completed without a response (see `Claim::existing`): a record damaged or written by
        // another tool. It will not run again, and nothing says how it ended: a new key could
        // run it a second time, and this one fails alike until the record expires.
        RecordStatus::Completed => Decision::Refuse(
            Problem::new(
                ProblemKind::ResponseNotStored,
                "the operation completed, but the store holds no response for it (the record \
                 is damaged, or was written by another tool), so it cannot be replayed; it \
                 will not run again",
            )
            .state(state)
            .keep_key(),
        ),
        RecordStatus::NeedsReconciliation => {
            observe::count(Event::Unknown);
            Decision::Refuse(
                Problem::new(
                    ProblemKind::OutcomeUnknown,
                    "an earlier attempt with this key may or may not have taken effect; it awaits \
                     reconciliation. Do not retry with a new key until it is resolved",
                )
                .state(state),
            )
        }
        // A store takes a released record over on claim; seeing one means another request
        // just did, so it is in flight.
        // Counted as a conflict where it is answered (a request that waits and then replays
        // was not refused).
        RecordStatus::InProgress | RecordStatus::Released => {
            let seen = InFlight {
                token: record.lease_token,
                lease_until: record.lease_until,
                now,
            };
            // Come back when the holder should be done by the route's window, not when its
            // whole lease would run out; never later than that.
            // When the holder began: its earliest entry, its claim (or, in a history that is
            // full and wrote over the claim, the event that took its place, a little later).
            // Another attempt's claim would make the holder look long gone; with no entry of
            // its own, the lease is what is known.
            let claimed = record
                .history
                .iter()
                .find(|e| e.token == record.lease_token);
            let left = match (window, claimed) {
                (Some(window), Some(claimed)) => {
                    let running = now.duration_since(claimed.at).unwrap_or_default();
                    window.saturating_sub(running).min(seen.lease_left())
                }
                _ => seen.lease_left(),
            };
            Decision::InFlight(
                Problem::new(
                    ProblemKind::InFlight,
                    "a request with this idempotency key is still being processed; retry with \
                     the same key after the indicated delay",
                )
                .state(state)
                .retry_after(ceil_secs(left)),
                Some(seen),
            )
        }
    }
}

/// The fingerprint to claim the key again with, when the claim found a record this request
/// may take (released, or in flight under a lease run out) whose fingerprint another scheme
/// made from the same input: another version of this crate, or a replica whose fingerprint
/// settings differ only in what this request does not have (a canonicaliser for another media
/// type). A store compares all 32 bytes, so it takes over (or sets aside, on a route that
/// reconciles) only a record of the claim's own bytes: without this, such a key was answered
/// "in flight" until its record expired, a day by default, after every rolling deploy that
/// changed a route's settings or the crate. The record keeps the bytes it was claimed with, so
/// a later request of other input is told of a mismatch across schemes (`safe_new_key: false`).
pub(crate) fn adopt(claim: &Claim, fingerprint: &Fingerprint) -> Option<Fingerprint> {
    let Claim::Existing { record, now } = claim else {
        return None;
    };
    let claimable = match record.status {
        RecordStatus::Released => true,
        RecordStatus::InProgress => record.lease_until <= *now,
        RecordStatus::Completed | RecordStatus::NeedsReconciliation => false,
    };
    let theirs = &record.fingerprint;
    (claimable && theirs != fingerprint && theirs.same_input(fingerprint))
        .then(|| theirs.with_body_as_sent(fingerprint.body_as_sent()))
}

/// A completed record's answer: its response for the request that recorded it, a mismatch
/// for any other.
fn completed(
    recorded: &Fingerprint,
    response: StoredResponse,
    fingerprint: &Fingerprint,
    covers: &str,
    schemes: &[Scheme],
) -> Decision {
    if !recorded.same_input(fingerprint) {
        return mismatch(
            covers,
            RecordStatus::Completed,
            recorded,
            fingerprint,
            schemes,
        );
    }
    observe::count(Event::Replay);
    Decision::Replay(response)
}

/// The key was first used with another request: refused before anything runs. Where the
/// record's fingerprint was made another way than any of this layer's routes makes one
/// (another version of this crate, or a replica with other fingerprint settings), whether
/// this is that request cannot be told: a new key could run it a second time, so the client is
/// not told to use one.
fn mismatch(
    covers: &str,
    status: RecordStatus,
    recorded: &Fingerprint,
    fingerprint: &Fingerprint,
    schemes: &[Scheme],
) -> Decision {
    observe::count(Event::Mismatch);
    let ours = recorded.scheme() == fingerprint.scheme() || schemes.contains(&recorded.scheme());
    let problem = if ours {
        Problem::new(
            ProblemKind::FingerprintMismatch,
            format!(
                "this idempotency key was first used with a different request ({covers}); \
                 nothing was run. Use a new key for a new request"
            ),
        )
    } else {
        Problem::new(
            ProblemKind::FingerprintMismatch,
            "this idempotency key was first used under other fingerprint settings (the \
             server's configuration or version has changed since), so whether this is the same \
             request cannot be told; nothing was run. If it is a retry, do not send it again \
             with a new key: it may already have taken effect",
        )
        .keep_key()
    };
    Decision::Refuse(problem.state(status.as_str()))
}

/// A claim that found the key's record locked by a transaction in flight: answered as in
/// flight, without waiting for the lock.
pub(crate) fn busy() -> Decision {
    Decision::InFlight(
        Problem::new(
            ProblemKind::InFlight,
            "a request with this idempotency key is still being processed; retry with the same \
             key after the indicated delay",
        )
        .state(RecordStatus::InProgress.as_str())
        .retry_after(1),
        None,
    )
}

/// Whole seconds, rounded up, at least 1: `Retry-After: 0` would invite a busy loop.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs()
        .saturating_add(u64::from(d.subsec_nanos() > 0))
        .max(1)
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use http::{HeaderMap, StatusCode};

    use super::*;
    use crate::store::{FencingToken, Record, ScopedKey};

    fn response() -> StoredResponse {
        StoredResponse {
            status: StatusCode::CREATED,
            headers: HeaderMap::new(),
            body: Some(bytes::Bytes::from_static(b"{}")),
            trailers: None,
        }
    }

    fn record(status: RecordStatus, response: Option<StoredResponse>) -> Record {
        let at = SystemTime::UNIX_EPOCH;
        Record {
            key: ScopedKey::new("", "k"),
            fingerprint: Fingerprint::from_bytes([1; 32]),
            status,
            lease_token: FencingToken::new(1),
            lease_until: at,
            attempts: 1,
            effect_started: false,
            downstream_id: None,
            response,
            created_at: at,
            updated_at: at,
            expires_at: at,
            history: Vec::new(),
            resolution_note: None,
        }
    }

    /// DESIGN §1 step 6, issue 23 §2: a completed record answered with only its fingerprint
    /// and response replays to the same request and is a mismatch to another, reported as
    /// completed; `Claim::existing` picks that answer for a completed record and keeps every
    /// other (and a completed one without a response) whole.
    #[test]
    fn a_completed_claim_replays_or_is_a_mismatch() {
        let same = Fingerprint::from_bytes([1; 32]);
        let other = Fingerprint::from_bytes([2; 32]);
        let now = SystemTime::UNIX_EPOCH;
        let claim = Claim::existing(record(RecordStatus::Completed, Some(response())), now);
        assert!(matches!(claim, Claim::Completed { .. }), "{claim:?}");
        match decide(claim.clone(), &same, "the body", None, &[]) {
            Decision::Replay(replayed) => assert_eq!(replayed, response()),
            other => panic!("{other:?}"),
        }
        match decide(claim, &other, "the body", None, &[]) {
            Decision::Refuse(problem) => {
                assert_eq!(problem.kind, ProblemKind::FingerprintMismatch);
                assert_eq!(problem.state, "completed");
            }
            other => panic!("{other:?}"),
        }
        for status in [RecordStatus::InProgress, RecordStatus::NeedsReconciliation] {
            let claim = Claim::existing(record(status, None), now);
            assert!(matches!(claim, Claim::Existing { .. }), "{claim:?}");
        }
        let claim = Claim::existing(record(RecordStatus::Completed, None), now);
        match decide(claim, &same, "the body", None, &[]) {
            // Nothing to replay, and nothing says how it ended: the key stays, not retried.
            Decision::Refuse(problem) => {
                assert_eq!(problem.kind, ProblemKind::ResponseNotStored);
                assert!(!problem.safe_new_key(), "a new key could run it again");
            }
            other => panic!("{other:?}"),
        }
    }

    /// §1 step 6: a mismatch under the same fingerprint scheme, or under another scheme of
    /// this layer's own routes, tells the client to use a new key for its new request; one
    /// under a scheme none of its routes makes (a replica configured otherwise, or another
    /// version) cannot tell a retry from a new request, so it does not.
    #[test]
    fn a_mismatch_across_schemes_keeps_the_key() {
        let now = SystemTime::UNIX_EPOCH;
        // The record's fingerprint is `[1; 32]`: its scheme is `[1; 4]`.
        let mut same_scheme = [2; 32];
        same_scheme[..4].copy_from_slice(&[1; 4]);
        for (status, response) in [
            (RecordStatus::Completed, Some(response())),
            (RecordStatus::InProgress, None),
        ] {
            for (other, schemes, safe) in [
                (Fingerprint::from_bytes(same_scheme), &[][..], true),
                (
                    Fingerprint::from_bytes([2; 32]),
                    &[[1; 4], [2; 4]][..],
                    true,
                ),
                (
                    Fingerprint::from_bytes([2; 32]),
                    &[[2; 4], [3; 4]][..],
                    false,
                ),
                (Fingerprint::from_bytes([2; 32]), &[][..], false),
            ] {
                let claim = Claim::existing(record(status, response.clone()), now);
                match decide(claim, &other, "the body", None, schemes) {
                    Decision::Refuse(problem) => {
                        assert_eq!(problem.kind, ProblemKind::FingerprintMismatch);
                        assert_eq!(
                            problem.safe_new_key(),
                            safe,
                            "{status:?}, {other:?}, {schemes:?}"
                        );
                    }
                    other => panic!("{other:?}"),
                }
            }
        }
    }

    /// §2 (a released record is claimable again) and §4 (a lapsed lease is taken over or set
    /// aside) across fingerprint schemes: a record another scheme made from the same input is
    /// adopted (claimed again with its bytes, the hint kept) only where a claim may take it;
    /// never a live lease, an outcome, a record of other input, or the claim's own bytes.
    #[test]
    fn another_schemes_claimable_record_of_the_same_input_is_adopted() {
        let live = SystemTime::UNIX_EPOCH;
        let later = live + Duration::from_secs(1);
        // The record's fingerprint is `[1; 32]`: the same input under another scheme.
        let mut same_input = [1; 32];
        same_input[..4].copy_from_slice(&[9; 4]);
        let ours = Fingerprint::from_bytes(same_input).with_body_as_sent(true);
        let theirs = Fingerprint::from_bytes([1; 32]);
        for (status, now, adopted) in [
            (RecordStatus::Released, live, true),
            (RecordStatus::InProgress, live, true),
            (
                RecordStatus::InProgress,
                live - Duration::from_millis(1),
                false,
            ),
            (RecordStatus::NeedsReconciliation, later, false),
        ] {
            let claim = Claim::existing(record(status, None), now);
            let got = adopt(&claim, &ours);
            assert_eq!(got.is_some(), adopted, "{status:?} at {now:?}");
            if let Some(got) = got {
                assert_eq!(got, theirs);
                assert!(got.body_as_sent(), "the hint is the request's");
            }
            // Its own bytes, or other input: the store's answer stands.
            assert!(adopt(&claim, &theirs).is_none());
            assert!(adopt(&claim, &Fingerprint::from_bytes([2; 32])).is_none());
        }
        let completed = Claim::existing(record(RecordStatus::Completed, Some(response())), later);
        assert!(adopt(&completed, &ours).is_none());
        let won = Lease {
            token: FencingToken::new(2),
            attempt: 1,
            until: later,
        };
        assert!(adopt(&Claim::Acquired(won), &ours).is_none());
    }

    /// A store written before `Claim::Completed` that reports a completed record whole still
    /// has it replayed.
    #[test]
    fn a_completed_record_reported_whole_still_replays() {
        let claim = Claim::Existing {
            record: Box::new(record(RecordStatus::Completed, Some(response()))),
            now: SystemTime::UNIX_EPOCH,
        };
        match decide(
            claim.clone(),
            &Fingerprint::from_bytes([1; 32]),
            "the body",
            None,
            &[],
        ) {
            Decision::Replay(replayed) => assert_eq!(replayed, response()),
            other => panic!("{other:?}"),
        }
        match decide(
            claim,
            &Fingerprint::from_bytes([2; 32]),
            "the body",
            None,
            &[],
        ) {
            Decision::Refuse(problem) => {
                assert_eq!(problem.kind, ProblemKind::FingerprintMismatch);
                assert_eq!(problem.state, "completed");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn retry_after_rounds_up_and_is_never_zero() {
        assert_eq!(ceil_secs(Duration::ZERO), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1)), 1);
        assert_eq!(ceil_secs(Duration::from_millis(29_001)), 30);
        assert_eq!(ceil_secs(Duration::from_secs(30)), 30);
        assert_eq!(ceil_secs(Duration::MAX), u64::MAX, "never overflows");
    }
}
