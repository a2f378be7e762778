//! Claims, replays and what a store hands back: one winner, exact bytes, fingerprints, keys.

use std::sync::Arc;

use bytes::Bytes;

use super::{
    LONG, PAST_SHORT, SHORT, acquire, assert_fenced, claim, completed, existing, fingerprint,
    request, response, spawn_in_pass, unique_key,
};
use crate::store::{
    Claim, ClaimRequest, FencingToken, IdempotencyStore, LeaseExpiry, RecordStatus, ScopedKey,
    StoredResponse,
};

/// A fresh key is acquired (attempt 1); claiming it again returns the in-progress record with
/// its live lease.
pub async fn claim_then_existing<S: IdempotencyStore>(store: &S) {
    let key = unique_key("fresh");
    let req = request(&key, 1, LONG, LONG);
    let lease = acquire(store, &req, "a fresh key").await;
    assert_eq!(lease.attempt, 1, "the first attempt is number 1");
    let (record, now) = existing(store, &req, "a claimed key").await;
    assert_eq!(record.status, RecordStatus::InProgress);
    assert_eq!(record.lease_token, lease.token);
    assert_eq!(record.fingerprint, fingerprint(1));
    assert!(
        record.lease_until > now,
        "the lease is live on the store's clock"
    );
}

/// Many concurrent claims of one key: exactly one wins.
pub async fn claim_race_has_one_winner<S: IdempotencyStore>(store: &Arc<S>) {
    let key = unique_key("race");
    let tasks: Vec<_> = (0..32)
        .map(|turn| {
            let store = store.clone();
            let req = request(&key, 1, LONG, LONG);
            spawn_in_pass(turn, async move { claim(&*store, &req).await })
        })
        .collect();
    let mut winners = 0;
    for task in tasks {
        match task.await.expect("claim task") {
            Ok(Claim::Acquired(_)) => winners += 1,
            Ok(Claim::Existing { .. } | Claim::Completed { .. }) => {}
            Err(e) => panic!("a racing claim failed: {e}"),
        }
    }
    assert_eq!(winners, 1, "exactly one concurrent claim may win");
}

/// A claim with another fingerprint returns the record with the first fingerprint, in progress
/// and completed alike, and takes nothing over.
pub async fn fingerprint_mismatch_is_reported<S: IdempotencyStore>(store: &S) {
    let key = unique_key("mismatch");
    let lease = acquire(store, &request(&key, 1, LONG, LONG), "a fresh key").await;
    let other = request(&key, 2, LONG, LONG);
    let (record, _) = existing(store, &other, "another fingerprint while in progress").await;
    assert_eq!(record.fingerprint, fingerprint(1));
    store
        .complete(&key, lease.token, &response(), LONG)
        .await
        .expect("complete");
    let (first, _) = completed(store, &other, "another fingerprint once completed").await;
    assert_eq!(first, fingerprint(1));
}

/// A completed record returns its response exactly: status, repeated and binary headers, every
/// byte of the body, trailers.
pub async fn complete_then_replay_exactly<S: IdempotencyStore>(store: &S) {
    let key = unique_key("complete");
    let req = request(&key, 1, LONG, LONG);
    let lease = acquire(store, &req, "a fresh key").await;
    store
        .complete(&key, lease.token, &response(), LONG)
        .await
        .expect("complete");
    let (_, replayed) = completed(store, &req, "a completed key").await;
    assert_eq!(replayed, response(), "the response round-trips exactly");
    let looked_up = store.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(looked_up.response, Some(response()));
    // A marker for a response too large to keep also round-trips.
    let key = unique_key("marker");
    let req = request(&key, 1, LONG, LONG);
    let lease = acquire(store, &req, "a fresh key").await;
    let marker = StoredResponse {
        body: None,
        trailers: None,
        ..response()
    };
    store
        .complete(&key, lease.token, &marker, LONG)
        .await
        .expect("complete");
    let (_, replayed) = completed(store, &req, "a completed key").await;
    assert_eq!(replayed, marker);
}

/// [`IdempotencyStore::completed_now`], where the store answers it, answers a completed,
/// unexpired record exactly as a claim does (the fingerprint with its hint, the response) and
/// nothing else: no record, one in flight, released or awaiting reconciliation, or expired.
/// [`IdempotencyStore::recorded_fingerprint_now`] answers the same records with the same
/// fingerprint (and may answer an expired one). Neither claims: a claim after them still finds
/// the record as it was.
pub async fn completed_now_answers_only_what_a_claim_would<S: IdempotencyStore>(store: &S) {
    let rule = "completed_now";
    let read = |key: &ScopedKey, expired: bool| {
        let fingerprint = store.recorded_fingerprint_now(key);
        let read = match store.completed_now(key) {
            None => None,
            Some(Ok(Claim::Completed {
                fingerprint,
                response,
            })) => Some((fingerprint, *response)),
            Some(other) => {
                panic!("{rule}: a completed record is answered as Completed, got {other:?}")
            }
        };
        if read.is_some() || !expired {
            assert_eq!(
                fingerprint.map(|f| (f, f.body_as_sent())),
                read.as_ref().map(|(f, _)| (*f, f.body_as_sent())),
                "recorded_fingerprint_now: the record completed_now reads, its fingerprint and \
                 hint"
            );
        }
        read
    };
    let key = unique_key("completed-now");
    assert!(read(&key, false).is_none(), "{rule}: no record, no answer");
    let mut req = request(&key, 1, LONG, LONG);
    req.fingerprint = req.fingerprint.with_body_as_sent(true);
    let lease = acquire(store, &req, "a fresh key").await;
    assert!(
        read(&key, false).is_none(),
        "{rule}: a record in flight is claimed, not read"
    );
    store
        .complete(&key, lease.token, &response(), LONG)
        .await
        .expect("complete");
    let answered = match read(&key, false) {
        // A store that cannot answer without I/O never does.
        None => {
            assert!(read(&unique_key("absent"), false).is_none());
            return;
        }
        Some(answered) => answered,
    };
    let (fingerprint, replayed) = completed(store, &req, "a completed key").await;
    assert_eq!(answered.0, fingerprint, "{rule}: the claim's fingerprint");
    assert!(
        answered.0.body_as_sent(),
        "{rule}: the fingerprint's hint is kept with the record"
    );
    assert_eq!(answered.1, replayed, "{rule}: the claim's response");
    assert_eq!(replayed, response());
    // Without the hint, none comes back.
    let plain = unique_key("completed-now-plain");
    let plain_req = request(&plain, 2, LONG, LONG);
    let lease = acquire(store, &plain_req, "a fresh key").await;
    store
        .complete(&plain, lease.token, &response(), LONG)
        .await
        .expect("complete");
    let (fingerprint, _) = read(&plain, false).expect("a completed record is answered");
    assert_eq!(fingerprint, plain_req.fingerprint);
    assert!(!fingerprint.body_as_sent(), "{rule}: no hint, none kept");
    // Released, uncertain: claimed as usual.
    let released = unique_key("completed-now-released");
    let lease = acquire(store, &request(&released, 1, LONG, LONG), "a fresh key").await;
    store
        .release(&released, lease.token)
        .await
        .expect("release");
    assert!(
        read(&released, false).is_none(),
        "{rule}: a released record is claimed"
    );
    let unsure = unique_key("completed-now-uncertain");
    let lease = acquire(store, &request(&unsure, 1, LONG, LONG), "a fresh key").await;
    store
        .mark_uncertain(&unsure, lease.token)
        .await
        .expect("mark_uncertain");
    assert!(
        read(&unsure, false).is_none(),
        "{rule}: an uncertain record is claimed"
    );
    // Expired: absent, and the next claim runs.
    let expiring = unique_key("completed-now-expired");
    let expiring_req = request(&expiring, 1, SHORT, LONG);
    let lease = acquire(store, &expiring_req, "a fresh key").await;
    store
        .complete(&expiring, lease.token, &response(), SHORT)
        .await
        .expect("complete");
    assert!(
        read(&expiring, false).is_some(),
        "{rule}: completed, not yet expired"
    );
    tokio::time::sleep(PAST_SHORT).await;
    assert!(
        read(&expiring, true).is_none(),
        "{rule}: an expired record is absent"
    );
    let again = acquire(store, &expiring_req, "an expired record").await;
    assert_eq!(again.attempt, 1);
}

/// After a release the next claim takes the key over with a new token and `attempts + 1`.
pub async fn release_lets_the_next_claim_take_over<S: IdempotencyStore>(store: &S) {
    let key = unique_key("release");
    let req = request(&key, 1, LONG, LONG);
    let first = acquire(store, &req, "a fresh key").await;
    let status = store.release(&key, first.token).await.expect("release");
    assert_eq!(status, RecordStatus::Released);
    let second = acquire(store, &req, "a released key").await;
    assert_eq!(second.attempt, 2, "a takeover counts the attempt");
    assert_ne!(second.token, first.token, "a takeover gets a new token");
    assert_fenced(store.release(&key, first.token).await, "release");
}

/// A released key, or one whose outcome is unknown, is answered as it stands to a request
/// with another fingerprint (rule 2: the caller refuses it, 422), never taken over by it; only
/// the same request takes a released key over.
pub async fn another_request_never_takes_over_a_released_or_uncertain_key<S: IdempotencyStore>(
    store: &S,
) {
    let rule = "a record with another fingerprint is answered, not taken over";
    let released = unique_key("released-other");
    let lease = acquire(store, &request(&released, 1, LONG, LONG), "a fresh key").await;
    store
        .release(&released, lease.token)
        .await
        .expect("release");
    let (record, _) = existing(store, &request(&released, 2, LONG, LONG), rule).await;
    assert_eq!(record.fingerprint, fingerprint(1), "{rule}: released");
    assert_eq!(record.status, RecordStatus::Released, "{rule}: released");

    let uncertain = unique_key("uncertain-other");
    let lease = acquire(store, &request(&uncertain, 1, LONG, LONG), "a fresh key").await;
    store
        .mark_uncertain(&uncertain, lease.token)
        .await
        .expect("mark_uncertain");
    let (record, _) = existing(store, &request(&uncertain, 2, LONG, LONG), rule).await;
    assert_eq!(record.fingerprint, fingerprint(1), "{rule}: uncertain");
    assert_eq!(
        record.status,
        RecordStatus::NeedsReconciliation,
        "{rule}: uncertain"
    );

    let again = acquire(
        store,
        &request(&released, 1, LONG, LONG),
        "the same request takes a released key over",
    )
    .await;
    assert_eq!(again.attempt, 2, "a takeover counts the attempt");
}

/// `lookup` returns the record, `remove` deletes it and says whether it existed.
pub async fn lookup_and_remove<S: IdempotencyStore>(store: &S) {
    let key = unique_key("remove");
    assert!(store.lookup(&key).await.expect("lookup").is_none());
    acquire(store, &request(&key, 1, LONG, LONG), "a fresh key").await;
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(record.key, key);
    assert!(
        store.remove(&key).await.expect("remove"),
        "remove reports a deletion"
    );
    assert!(
        !store.remove(&key).await.expect("remove"),
        "nothing left to remove"
    );
    acquire(store, &request(&key, 1, LONG, LONG), "a removed key").await;
}

/// Scopes and keys with any characters (NUL, control, non-ASCII) are kept apart and read back
/// exactly.
pub async fn keys_round_trip_exactly<S: IdempotencyStore>(store: &S) {
    let base = unique_key("bytes");
    let odd = ScopedKey::new(
        format!("{}\0\u{1}\u{1f600}", base.scope()),
        format!("{}\0\r\n\u{7f}\u{e9}", base.key()),
    );
    let plain = ScopedKey::new(base.scope(), base.key());
    let lease = acquire(store, &request(&odd, 1, LONG, LONG), "an unusual key").await;
    acquire(
        store,
        &request(&plain, 2, LONG, LONG),
        "a key that differs only in its tail",
    )
    .await;
    store
        .complete(&odd, lease.token, &response(), LONG)
        .await
        .expect("complete");
    let record = store.lookup(&odd).await.expect("lookup").expect("record");
    assert_eq!(record.key, odd, "scope and key round-trip exactly");
    assert_eq!(record.fingerprint, fingerprint(1));
    let other = store.lookup(&plain).await.expect("lookup").expect("record");
    assert_eq!(
        other.fingerprint,
        fingerprint(2),
        "the two keys are distinct records"
    );
}

/// Claims and completions of many keys at once, in every state a claim can find (fresh,
/// completed, in progress, released, another fingerprint, one key twice), each get the answer
/// they would get alone: a store that sends concurrent operations together (batches) must not
/// cross one key's answer with another's, nor let one key's state decide another's.
pub async fn concurrent_operations_each_get_their_own_answer<S: IdempotencyStore>(store: &Arc<S>) {
    let body = |key: &ScopedKey| {
        let mut r = response();
        r.body = Some(Bytes::from(format!("the answer for {}", key.key())));
        r
    };
    // The standing records, made one at a time.
    let done = unique_key("together-done");
    let lease = acquire(&**store, &request(&done, 1, LONG, LONG), "a fresh key").await;
    store
        .complete(&done, lease.token, &body(&done), LONG)
        .await
        .expect("complete");
    let busy = unique_key("together-busy");
    let busy_lease = acquire(&**store, &request(&busy, 1, LONG, LONG), "a fresh key").await;
    let released = unique_key("together-released");
    let lease = acquire(&**store, &request(&released, 1, LONG, LONG), "a fresh key").await;
    store
        .release(&released, lease.token)
        .await
        .expect("release");
    let twice = unique_key("together-twice");
    let fresh: Vec<ScopedKey> = (0..24).map(|_| unique_key("together-fresh")).collect();
    // And the states that time makes: a lease run out (taken over, or on a reconciling route
    // awaiting reconciliation), a record past its TTL (absent).
    let lapsed = unique_key("together-lapsed");
    acquire(&**store, &request(&lapsed, 1, SHORT, LONG), "a fresh key").await;
    let reconcile = |key: &ScopedKey| ClaimRequest {
        on_lease_expiry: LeaseExpiry::Reconcile,
        ..request(key, 1, SHORT, LONG)
    };
    let unknown = unique_key("together-unknown");
    acquire(&**store, &reconcile(&unknown), "a fresh key").await;
    let expired = unique_key("together-expired");
    let lease = acquire(&**store, &request(&expired, 1, SHORT, LONG), "a fresh key").await;
    store
        .complete(&expired, lease.token, &body(&expired), SHORT)
        .await
        .expect("complete");
    tokio::time::sleep(PAST_SHORT).await;

    // Then every claim at once.
    let mut claims: Vec<(ClaimRequest, &str)> = vec![
        (request(&done, 1, LONG, LONG), "done"),
        (request(&done, 2, LONG, LONG), "done, another fingerprint"),
        (request(&busy, 1, LONG, LONG), "busy"),
        (request(&released, 1, LONG, LONG), "released"),
        (request(&twice, 1, LONG, LONG), "twice"),
        (request(&twice, 1, LONG, LONG), "twice"),
        (request(&lapsed, 1, LONG, LONG), "lapsed"),
        (reconcile(&unknown), "unknown"),
        (request(&expired, 2, LONG, LONG), "expired"),
    ];
    claims.extend(fresh.iter().map(|k| (request(k, 3, LONG, LONG), "fresh")));
    let tasks: Vec<_> = claims
        .iter()
        .enumerate()
        .map(|(turn, (req, _))| {
            let (store, req) = (store.clone(), req.clone());
            spawn_in_pass(turn, async move { claim(&*store, &req).await })
        })
        .collect();
    let mut leases = Vec::new();
    let mut twice_won = 0;
    for ((req, what), task) in claims.iter().zip(tasks) {
        let claimed = task.await.expect("claim task");
        match (*what, claimed) {
            ("fresh", Ok(Claim::Acquired(lease))) => {
                assert_eq!(lease.attempt, 1, "a fresh key is attempt 1");
                leases.push((req.key.clone(), lease));
            }
            ("lapsed", Ok(Claim::Acquired(lease))) => {
                assert_eq!(
                    lease.attempt, 2,
                    "a lapsed lease is taken over as attempt 2"
                );
            }
            ("unknown", Ok(Claim::Existing { record, .. })) => {
                assert_eq!(record.key, unknown, "a claim gets its own key's record");
                assert_eq!(record.status, RecordStatus::NeedsReconciliation);
                assert_eq!(record.attempts, 1, "nothing was taken over");
            }
            ("expired", Ok(Claim::Acquired(lease))) => {
                assert_eq!(lease.attempt, 1, "a record past its TTL counts as absent");
            }
            ("released", Ok(Claim::Acquired(lease))) => {
                assert_eq!(
                    lease.attempt, 2,
                    "a released key is taken over as attempt 2"
                );
            }
            ("twice", Ok(Claim::Acquired(_))) => twice_won += 1,
            ("twice", Ok(Claim::Existing { record, .. })) => {
                assert_eq!(record.key, req.key, "the record of the key claimed");
                assert_eq!(record.status, RecordStatus::InProgress);
            }
            (
                "done" | "done, another fingerprint",
                Ok(Claim::Completed {
                    fingerprint: first,
                    response,
                }),
            ) => {
                assert_eq!(first, fingerprint(1), "the first fingerprint stands");
                assert_eq!(response.body, body(&done).body, "its own key's answer");
            }
            ("busy", Ok(Claim::Existing { record, .. })) => {
                assert_eq!(record.key, busy, "a claim gets its own key's record");
                assert_eq!(record.status, RecordStatus::InProgress);
                assert_eq!(
                    record.lease_token, busy_lease.token,
                    "the holder keeps its lease"
                );
            }
            (what, other) => panic!("a concurrent claim ({what}) answered {other:?}"),
        }
    }
    assert_eq!(twice_won, 1, "one of two concurrent claims of a key wins");
    assert_eq!(leases.len(), fresh.len(), "every fresh key is acquired");

    // Every completion at once, and one with a stale token among them.
    let mut tasks: Vec<_> = leases
        .iter()
        .map(|(key, lease)| {
            let (store, key, token, answer) = (store.clone(), key.clone(), lease.token, body(key));
            tokio::spawn(async move { store.complete(&key, token, &answer, LONG).await })
        })
        .collect();
    let stale = {
        let (store, busy) = (store.clone(), busy.clone());
        let token = FencingToken::new(busy_lease.token.get() ^ 1);
        tokio::spawn(async move { store.complete(&busy, token, &response(), LONG).await })
    };
    for task in tasks.drain(..) {
        task.await
            .expect("complete task")
            .expect("a holder's completion is written");
    }
    assert_fenced(
        stale.await.expect("complete task"),
        "a completion among others",
    );
    for (key, _) in &leases {
        let (_, replayed) = completed(&**store, &request(key, 3, LONG, LONG), "a replay").await;
        assert_eq!(
            replayed.body,
            body(key).body,
            "each key keeps its own answer"
        );
    }
    let (record, _) = existing(&**store, &request(&busy, 1, LONG, LONG), "still busy").await;
    assert_eq!(
        record.status,
        RecordStatus::InProgress,
        "a fenced completion changed nothing"
    );
}
