//! Leases and fencing: a lease renewed or taken over, a stale holder's writes refused,
//! milestones.

use super::{
    LONG, PAST_SHORT, SHORT, acquire, all_uncertain, assert_fenced, completed, existing, request,
    response, unique_key,
};
use crate::store::{
    ClaimRequest, FencingToken, IdempotencyStore, LeaseExpiry, Milestone, RecordStatus,
};

/// When a lease runs out the next claim takes over, and the old holder can no longer renew,
/// complete, release or mark uncertain.
pub async fn fenced_writes_are_refused_after_takeover<S: IdempotencyStore>(store: &S) {
    let key = unique_key("fenced");
    let short = request(&key, 1, SHORT, LONG);
    let stale = acquire(store, &short, "a fresh key").await;
    tokio::time::sleep(PAST_SHORT).await;
    let current = acquire(store, &request(&key, 1, LONG, LONG), "an expired lease").await;
    assert_eq!(current.attempt, 2);
    assert_ne!(current.token, stale.token);
    assert_fenced(store.renew(&key, stale.token, LONG).await, "renew");
    assert_fenced(
        store.complete(&key, stale.token, &response(), LONG).await,
        "complete",
    );
    assert_fenced(store.release(&key, stale.token).await, "release");
    assert_fenced(
        store.mark_uncertain(&key, stale.token).await,
        "mark_uncertain",
    );
    store
        .complete(&key, current.token, &response(), LONG)
        .await
        .expect("the current holder completes");
}

/// With [`LeaseExpiry::Reconcile`] an expired lease moves the record to
/// `needs_reconciliation` instead of being taken over: whichever route asks for it, the
/// holder's or the claimer's (two instances configured differently, as in a rolling deploy,
/// never rerun what either sends to reconciliation).
pub async fn expired_lease_with_reconcile_needs_reconciliation<S: IdempotencyStore>(store: &S) {
    let routes = [
        (LeaseExpiry::Reconcile, LeaseExpiry::Reconcile),
        (LeaseExpiry::Reconcile, LeaseExpiry::Reclaim),
        (LeaseExpiry::Reclaim, LeaseExpiry::Reconcile),
    ];
    for (holder, claimer) in routes {
        let key = unique_key("reconcile");
        let req = |on_lease_expiry| ClaimRequest {
            on_lease_expiry,
            ..request(&key, 1, SHORT, LONG)
        };
        let lease = acquire(store, &req(holder), "a fresh key").await;
        tokio::time::sleep(PAST_SHORT).await;
        let (record, _) = existing(
            store,
            &req(claimer),
            &format!("an expired lease held on {holder:?}, claimed on {claimer:?}"),
        )
        .await;
        assert_eq!(
            (record.status, record.attempts),
            (RecordStatus::NeedsReconciliation, 1),
            "held on {holder:?}, claimed on {claimer:?}: nothing was taken over"
        );
        assert_fenced(
            store.release(&key, lease.token).await.map(drop),
            "release after the move to reconciliation",
        );
        // The slow holder that really ran settles the uncertainty with its outcome.
        store
            .complete(&key, lease.token, &response(), LONG)
            .await
            .expect("the holder completes its record awaiting reconciliation");
        completed(store, &req(claimer), "a settled key").await;
    }
}

/// A renewed lease is not taken over when its first length passes, and a renewal never
/// shortens it: renewals may overlap, and one sent earlier may land later.
pub async fn renew_keeps_the_lease_alive<S: IdempotencyStore>(store: &S) {
    let key = unique_key("renew");
    let req = request(&key, 1, SHORT, LONG);
    let lease = acquire(store, &req, "a fresh key").await;
    let until = store.renew(&key, lease.token, LONG).await.expect("renew");
    assert!(until > lease.until, "renewal moves the lease's end");
    let again = store.renew(&key, lease.token, SHORT).await.expect("renew");
    assert!(again >= until, "a shorter renewal keeps the longer end");
    tokio::time::sleep(PAST_SHORT).await;
    let (record, _) = existing(store, &req, "a renewed lease").await;
    assert_eq!(record.status, RecordStatus::InProgress);
    assert_eq!(record.lease_token, lease.token);
}

/// Milestones land on the holder's record and are refused from a stale holder.
pub async fn milestones_are_fenced_and_durable<S: IdempotencyStore>(store: &S) {
    let key = unique_key("milestone");
    let lease = acquire(store, &request(&key, 1, LONG, LONG), "a fresh key").await;
    store
        .record_milestone(&key, lease.token, &Milestone::EffectStarted)
        .await
        .expect("effect started");
    store
        .record_milestone(
            &key,
            lease.token,
            &Milestone::DownstreamId("pay_123".into()),
        )
        .await
        .expect("downstream id");
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    assert!(record.effect_started, "the milestone is durable");
    // A failure after the effect started cannot give the key back: nobody knows what happened.
    let status = store.release(&key, lease.token).await.expect("release");
    assert_eq!(status, RecordStatus::NeedsReconciliation);
    assert_eq!(record.downstream_id.as_deref(), Some("pay_123"));
    let stale = FencingToken::new(lease.token.get() ^ 1);
    assert_fenced(
        store
            .record_milestone(&key, stale, &Milestone::EffectStarted)
            .await,
        "record_milestone",
    );

    // Unsettled records never expire: a shared table keeps none of them.
    store.remove(&key).await.expect("remove");
}

/// A new attempt starts without an earlier attempt's downstream id, whether it takes over a
/// lapsed lease or claims a released key: a reconciler reading the record of the new attempt
/// must never check the old attempt's operation downstream.
pub async fn a_new_attempt_starts_without_the_last_ones_downstream_id<S: IdempotencyStore>(
    store: &S,
) {
    let key = unique_key("downstream-id");
    let first = acquire(store, &request(&key, 1, SHORT, LONG), "a fresh key").await;
    store
        .record_milestone(&key, first.token, &Milestone::DownstreamId("ch_1".into()))
        .await
        .expect("downstream id");
    tokio::time::sleep(PAST_SHORT).await;
    let second = acquire(store, &request(&key, 1, LONG, LONG), "a lapsed lease").await;
    assert_eq!(second.attempt, 2);
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(record.downstream_id, None, "taken over: not the first's id");
    store
        .record_milestone(&key, second.token, &Milestone::DownstreamId("ch_2".into()))
        .await
        .expect("downstream id");
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(record.downstream_id.as_deref(), Some("ch_2"));
    store.release(&key, second.token).await.expect("release");
    let third = acquire(store, &request(&key, 1, LONG, LONG), "a released key").await;
    assert_eq!(third.attempt, 3);
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(
        record.downstream_id, None,
        "claimed again: not the second's id"
    );
    store.remove(&key).await.expect("remove");
}

/// A holder that recorded `EffectStarted` and died is never taken over, even on a
/// [`LeaseExpiry::Reclaim`] route: its record needs reconciliation.
pub async fn effect_started_turns_an_expired_lease_into_reconciliation<S: IdempotencyStore>(
    store: &S,
) {
    let key = unique_key("started");
    let req = request(&key, 1, SHORT, LONG);
    let lease = acquire(store, &req, "a fresh key").await;
    store
        .record_milestone(&key, lease.token, &Milestone::EffectStarted)
        .await
        .expect("effect started");
    tokio::time::sleep(PAST_SHORT).await;
    let (record, _) = existing(store, &req, "an expired lease after EffectStarted").await;
    assert_eq!(record.status, RecordStatus::NeedsReconciliation);
    assert_eq!(record.attempts, 1, "no second attempt was allowed");

    // Unsettled records never expire: a shared table keeps none of them.
    store.remove(&key).await.expect("remove");
}

/// Issue 18 §4: on a route that reconciles expired leases, a dead holder's record never
/// expires into a second run, even without a milestone: past its TTL a claim finds it awaiting
/// reconciliation, attempt 1.
pub async fn reconciling_routes_never_expire_into_a_second_run<S: IdempotencyStore>(store: &S) {
    let key = unique_key("reconciling-no-milestone");
    let req = ClaimRequest {
        on_lease_expiry: LeaseExpiry::Reconcile,
        ..request(&key, 1, SHORT, SHORT)
    };
    acquire(store, &req, "a fresh key").await;
    tokio::time::sleep(PAST_SHORT).await;
    store.purge_expired().await.expect("purge");
    let (record, _) = existing(store, &req, "a dead holder's key on a reconciling route").await;
    assert_eq!(record.status, RecordStatus::NeedsReconciliation);
    assert_eq!(record.attempts, 1, "never claimed as new");
    assert!(
        all_uncertain(store, 10_000)
            .await
            .iter()
            .any(|r| r.key == key)
    );

    // Unsettled records never expire: a shared table keeps none of them.
    store.remove(&key).await.expect("remove");
}
