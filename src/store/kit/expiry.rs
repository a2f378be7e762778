//! Time to live: expired records read as absent and purged, unsettled ones kept.

use std::sync::Arc;
use std::time::Duration;

use super::{
    LONG, PAST_SHORT, SHORT, acquire, all_uncertain, claim, existing, fingerprint, request,
    response, spawn_in_pass, unique_key,
};
use crate::store::{Claim, IdempotencyStore, Milestone, RecordStatus, ScopedKey, StoreError};

/// A completed record past its TTL counts as absent (a new claim is attempt 1) and is purged.
pub async fn ttl_expiry_counts_as_absent_and_is_purged<S: IdempotencyStore>(store: &S) {
    let key = unique_key("ttl");
    let req = request(&key, 1, SHORT, LONG);
    let lease = acquire(store, &req, "a fresh key").await;
    store
        .complete(&key, lease.token, &response(), SHORT)
        .await
        .expect("complete");
    // A second completed record that only purging removes.
    let purged = unique_key("purged");
    let purged_lease = acquire(store, &request(&purged, 1, SHORT, LONG), "a fresh key").await;
    store
        .complete(&purged, purged_lease.token, &response(), SHORT)
        .await
        .expect("complete");
    // And one in flight under a long lease, which must survive the purge.
    let in_flight = unique_key("in-flight");
    acquire(store, &request(&in_flight, 1, LONG, SHORT), "a fresh key").await;
    tokio::time::sleep(PAST_SHORT).await;

    assert!(
        store.lookup(&key).await.expect("lookup").is_none(),
        "lookup hides expired records"
    );
    let again = acquire(store, &req, "an expired record").await;
    assert_eq!(again.attempt, 1, "an expired record counts as absent");
    // Purged, or gone by itself (a store whose records expire on the server, as Redis's do):
    // either way nothing of it is left for `remove` to delete.
    store.purge_expired().await.expect("purge");
    assert!(store.lookup(&purged).await.expect("lookup").is_none());
    assert!(
        !store.remove(&purged).await.expect("remove"),
        "expired records are purged"
    );
    let survivor = store.lookup(&in_flight).await.expect("lookup");
    assert!(
        survivor.is_some_and(|r| r.status == RecordStatus::InProgress),
        "a record under a live lease is never purged"
    );
}

/// Purges race claims of the very keys they would remove, completed records past their TTL:
/// every claim acquires its key afresh (attempt 1, whatever the expired record's fingerprint),
/// and what it acquired stands after the purges and any purge after them, so its holder
/// completes under it. A purge that deleted a key just claimed would leave its holder fenced
/// out and let a retry run the operation again. (A store whose records expire on the server,
/// as Redis's do, has nothing to purge: there the claims race nothing.) A claim answered
/// `Busy` (a row held by the purge past the store's wait) is asked again, as the layer does.
pub async fn purging_races_claims_of_expired_keys_and_loses_none<S: IdempotencyStore>(
    store: &Arc<S>,
) {
    const KEYS: usize = 16;
    const PURGES: usize = 2;
    for round in 0..2 {
        let keys: Vec<ScopedKey> = (0..KEYS).map(|_| unique_key("purge-race")).collect();
        for key in &keys {
            let lease = acquire(&**store, &request(key, 1, SHORT, LONG), "a fresh key").await;
            store
                .complete(key, lease.token, &response(), SHORT)
                .await
                .expect("complete");
        }
        tokio::time::sleep(PAST_SHORT).await;
        let barrier = Arc::new(tokio::sync::Barrier::new(KEYS + PURGES));
        let purges: Vec<_> = (0..PURGES)
            .map(|_| {
                let (store, barrier) = (store.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    store.purge_expired().await
                })
            })
            .collect();
        let claims: Vec<_> = keys
            .iter()
            .enumerate()
            .map(|(turn, key)| {
                let (store, barrier) = (store.clone(), barrier.clone());
                let req = request(key, 2, LONG, LONG);
                spawn_in_pass(turn, async move {
                    barrier.wait().await;
                    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                    loop {
                        match claim(&*store, &req).await {
                            Err(StoreError::Busy) if tokio::time::Instant::now() < deadline => {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                            }
                            answer => break answer,
                        }
                    }
                })
            })
            .collect();
        for purge in purges {
            purge.await.expect("purge task").expect("purge");
        }
        let mut leases = Vec::new();
        for task in claims {
            match task.await.expect("claim task") {
                Ok(Claim::Acquired(lease)) => {
                    assert_eq!(
                        lease.attempt, 1,
                        "round {round}: an expired record counts as absent, purged or not"
                    );
                    leases.push(lease);
                }
                other => panic!(
                    "round {round}: a claim of an expired key raced by a purge must acquire it, \
                     got {other:?}"
                ),
            }
        }
        store.purge_expired().await.expect("purge");
        for (key, lease) in keys.iter().zip(&leases) {
            let Some(record) = store.lookup(key).await.expect("lookup") else {
                panic!("round {round}: a key claimed while a purge ran was lost");
            };
            assert_eq!(
                (record.status, record.lease_token, record.fingerprint),
                (RecordStatus::InProgress, lease.token, fingerprint(2)),
                "round {round}: the claim made while a purge ran is the record that stands"
            );
            store
                .complete(key, lease.token, &response(), LONG)
                .await
                .expect("the claimer completes under the lease it was given");
        }
    }
}

/// Issue 18 §4: uncertainty never expires into a second run. A record awaiting
/// reconciliation, or one whose holder died after its effect started, outlives its TTL: a
/// claim after it finds the record (attempt 1, its history), never a fresh key, and neither a
/// purge nor a lookup loses it. A settled record past its TTL is absent, as before.
pub async fn unsettled_records_never_expire<S: IdempotencyStore>(store: &S) {
    let marked = unique_key("unsettled-marked");
    let lease = acquire(store, &request(&marked, 1, SHORT, SHORT), "a fresh key").await;
    store
        .mark_uncertain(&marked, lease.token)
        .await
        .expect("mark_uncertain");
    let started = unique_key("unsettled-started");
    let lease = acquire(store, &request(&started, 1, SHORT, SHORT), "a fresh key").await;
    store
        .record_milestone(&started, lease.token, &Milestone::EffectStarted)
        .await
        .expect("milestone");
    let settled = unique_key("settled");
    let lease = acquire(store, &request(&settled, 1, SHORT, SHORT), "a fresh key").await;
    store
        .complete(&settled, lease.token, &response(), SHORT)
        .await
        .expect("complete");
    tokio::time::sleep(PAST_SHORT).await;
    store.purge_expired().await.expect("purge");
    for key in [&marked, &started] {
        let (record, _) = existing(store, &request(key, 1, SHORT, SHORT), "an unsettled key").await;
        assert_eq!(
            record.status,
            RecordStatus::NeedsReconciliation,
            "past its TTL, still awaiting reconciliation: {key:?}"
        );
        assert_eq!(record.attempts, 1, "never claimed as new");
        assert!(store.lookup(key).await.expect("lookup").is_some());
    }
    let listed = all_uncertain(store, 10_000).await;
    assert!(
        listed.iter().any(|r| r.key == marked),
        "still listed for reconciliation"
    );
    assert!(
        store.lookup(&settled).await.expect("lookup").is_none(),
        "a settled record expires"
    );

    // Unsettled records never expire: a shared table keeps none of them.
    store.remove(&marked).await.expect("remove");
    store.remove(&started).await.expect("remove");
}
