//! DESIGN §6: every outcome is counted under its own metric name.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use common::{Effects, FlakyStore, client, serve};
use tower_idempotency::IdempotencyLayer;

use common::counts::Counts;

#[tokio::test]
async fn s6_each_outcome_has_its_own_counter() {
    let counts = Counts::default();
    metrics::set_global_recorder(counts.clone()).expect("the only recorder in this binary");

    let effects = Effects::default();
    let counter = effects.clone();
    let store = FlakyStore::default();
    let app = Router::new()
        .route(
            "/pay",
            post(move |body: String| async move {
                counter.hit();
                if body == "fail" {
                    (StatusCode::INTERNAL_SERVER_ERROR, "no")
                } else {
                    (StatusCode::OK, "paid")
                }
            }),
        )
        .layer(IdempotencyLayer::new(store.clone()).single_tenant());
    let addr = serve(app).await;
    let pay = |key: Option<&'static str>, body: &'static str| {
        let mut req = client().post(format!("http://{addr}/pay")).body(body);
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        req.send()
    };

    assert_eq!(
        pay(Some("a"), "10").await.expect("r").status(),
        StatusCode::OK
    );
    assert_eq!(
        pay(Some("a"), "10").await.expect("r").status(),
        StatusCode::OK
    );
    assert_eq!(
        pay(Some("a"), "11").await.expect("r").status(),
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(
        pay(None, "10").await.expect("r").status(),
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        pay(Some("b"), "fail").await.expect("r").status(),
        StatusCode::INTERNAL_SERVER_ERROR
    );
    store.down.store(true, Ordering::SeqCst);
    assert_eq!(
        pay(Some("c"), "10").await.expect("r").status(),
        StatusCode::SERVICE_UNAVAILABLE
    );

    assert_eq!(counts.get("idempotency_attempts_total"), 5);
    assert_eq!(counts.get("idempotency_executions_total"), 2);
    assert_eq!(counts.get("idempotency_replays_total"), 1);
    assert_eq!(counts.get("idempotency_mismatches_total"), 1);
    assert_eq!(counts.get("idempotency_key_rejections_total"), 1);
    assert_eq!(counts.get("idempotency_releases_total"), 1);
    assert_eq!(counts.get("idempotency_store_errors_total"), 1);
    assert_eq!(counts.get("idempotency_conflicts_total"), 0);
    assert_eq!(
        effects.count() as u64,
        counts.get("idempotency_executions_total")
    );

    uncertain_outcomes_move_their_own_counters(&counts).await;
    a_write_tried_again_is_a_pending_write_until_it_lands(&counts).await;
}

/// DESIGN §6: a holder whose record does not land keeps its key in flight while it tries
/// again; `idempotency_pending_writes` shows it from the first failure until the write lands,
/// so an operator sees keys that would otherwise answer 409 with nothing listed anywhere.
async fn a_write_tried_again_is_a_pending_write_until_it_lands(counts: &Counts) {
    use std::time::Duration;

    let store = FlakyStore::default();
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/record",
            post(move || async move {
                sink.hit();
                (StatusCode::CREATED, "made")
            }),
        )
        .layer(IdempotencyLayer::new(store.clone()).single_tenant());
    let addr = serve(app).await;
    let send = || {
        client()
            .post(format!("http://{addr}/record"))
            .header("idempotency-key", "w-pending")
            .send()
    };
    let settled = |want: u64| async move {
        for _ in 0..1000 {
            if counts.get("idempotency_pending_writes") == want {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    };
    assert_eq!(counts.get("idempotency_pending_writes"), 0);
    store.fail_complete.store(true, Ordering::SeqCst);
    assert_eq!(send().await.expect("r").status(), StatusCode::CREATED);
    assert!(settled(1).await, "the failed record is pending");
    assert_eq!(
        send().await.expect("r").status(),
        StatusCode::CONFLICT,
        "its key is in flight meanwhile"
    );
    assert_eq!(counts.get("idempotency_pending_writes"), 1);
    store.fail_complete.store(false, Ordering::SeqCst);
    assert!(settled(0).await, "the write landed: nothing pending");
    let replay = send().await.expect("r");
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(effects.count(), 1);
}

/// DESIGN §4 and §6: the safety counters, scenario by scenario (run after the first phase, in
/// the same test, because the recorder is global).
async fn uncertain_outcomes_move_their_own_counters(counts: &Counts) {
    use std::time::Duration;
    use tower_idempotency::reconcile::{Reconciler, Reconciliation, Sweeper};
    use tower_idempotency::store::{Claim, ClaimRequest, LeaseExpiry, Record, ScopedKey};
    use tower_idempotency::{IdempotencyContext, IdempotencyStore};

    let store = FlakyStore::default();
    let gate = Arc::new(tokio::sync::Notify::new());
    let g = gate.clone();
    let app = Router::new()
        .route(
            "/effect",
            post(move |ctx: IdempotencyContext, body: String| {
                let g = g.clone();
                async move {
                    ctx.effect_started().await.expect("milestone");
                    if body == "wait" {
                        g.notified().await;
                    }
                    if body == "fail" {
                        return (StatusCode::BAD_GATEWAY, "reply lost");
                    }
                    (StatusCode::OK, "done")
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(store.clone())
                .single_tenant()
                .lease(Duration::from_millis(300)),
        );
    let addr = serve(app).await;
    let send = |key: &'static str, body: &'static str| {
        client()
            .post(format!("http://{addr}/effect"))
            .header("idempotency-key", key)
            .body(body)
            .send()
    };
    let delta = |name: &str, before: u64| counts.get(name) - before;

    // A failure after the effect started moves the key to reconciliation, not back to claimable.
    let moved = counts.get("idempotency_moved_to_reconciliation_total");
    let releases = counts.get("idempotency_releases_total");
    assert_eq!(
        send("m-fail", "fail").await.expect("r").status(),
        StatusCode::BAD_GATEWAY
    );
    assert_eq!(delta("idempotency_moved_to_reconciliation_total", moved), 1);
    assert_eq!(delta("idempotency_releases_total", releases), 0);

    // Its retries are refused as unknown.
    let unknown = counts.get("idempotency_outcome_unknown_total");
    assert_eq!(
        send("m-fail", "fail").await.expect("r").status(),
        StatusCode::CONFLICT
    );
    assert_eq!(delta("idempotency_outcome_unknown_total", unknown), 1);

    // The sweeper sees it awaiting, and a reconciler that finds nothing releases it.
    struct NothingHappened;
    impl Reconciler for NothingHappened {
        async fn reconcile(&self, _: &Record) -> Reconciliation {
            Reconciliation::NotApplied
        }
    }
    let not_applied = counts.get("idempotency_reconciled_not_applied_total");
    let report = Sweeper::new(store.clone(), NothingHappened)
        .run_once()
        .await
        .expect("sweep");
    assert_eq!(report.not_applied, 1);
    assert_eq!(
        counts.get("idempotency_awaiting_reconciliation"),
        report.awaiting,
        "the gauge is the true count after the pass (issue 18 §5)"
    );
    assert_eq!(report.awaiting, 0, "the one awaiting was settled");
    // One the reconciler cannot settle: the gauge counts it.
    struct CannotTell;
    impl Reconciler for CannotTell {
        async fn reconcile(&self, _: &Record) -> Reconciliation {
            Reconciliation::Unknown
        }
    }
    assert_eq!(
        send("m-fail-2", "fail").await.expect("r").status(),
        StatusCode::BAD_GATEWAY
    );
    let report = Sweeper::new(store.clone(), CannotTell)
        .run_once()
        .await
        .expect("sweep");
    assert_eq!((report.unknown, report.awaiting), (1, 1), "{report:?}");
    assert_eq!(counts.get("idempotency_awaiting_reconciliation"), 1);
    assert_eq!(
        delta("idempotency_reconciled_not_applied_total", not_applied),
        1
    );

    // A stale holder: its key is taken over while it runs, so its renewals and its completion
    // are refused, and counted.
    let lost = counts.get("idempotency_lease_lost_total");
    let stale = counts.get("idempotency_stale_writes_total");
    let first = tokio::spawn(send("m-stale", "wait"));
    let key = ScopedKey::new("", "m-stale");
    let mut record = None;
    for _ in 0..200 {
        record = store.lookup(&key).await.expect("lookup");
        if record.as_ref().is_some_and(|r| r.effect_started) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let record = record.expect("the first holder claimed");
    store.remove(&key).await.expect("remove");
    let takeover = ClaimRequest {
        key: key.clone(),
        fingerprint: record.fingerprint,
        lease: Duration::from_secs(60),
        ttl: Duration::from_secs(60),
        on_lease_expiry: LeaseExpiry::Reclaim,
    };
    assert!(matches!(
        store.claim(&takeover).await,
        Ok(Claim::Acquired(_))
    ));
    for _ in 0..500 {
        if delta("idempotency_lease_lost_total", lost) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        delta("idempotency_lease_lost_total", lost),
        1,
        "the renewal was refused"
    );
    gate.notify_one();
    assert_eq!(
        first.await.expect("task").expect("r").status(),
        StatusCode::OK
    );
    assert_eq!(
        delta("idempotency_stale_writes_total", stale),
        1,
        "the completion was refused"
    );
    let now = store.lookup(&key).await.expect("lookup").expect("record");
    assert_ne!(
        now.lease_token, record.lease_token,
        "the new holder's record stands"
    );

    // A run cancelled by its client hanging up after it marked its effect started is set
    // aside, not given back (DESIGN §4), and counted as such.
    let cancelling = Router::new()
        .route(
            "/cancel",
            post(|ctx: IdempotencyContext| async move {
                ctx.effect_started().await.expect("milestone");
                std::future::pending::<()>().await;
            }),
        )
        .layer(
            IdempotencyLayer::new(store.clone())
                .single_tenant()
                .cancel_on_disconnect(true),
        );
    let cancel_addr = serve(cancelling).await;
    let moved = counts.get("idempotency_moved_to_reconciliation_total");
    let releases = counts.get("idempotency_releases_total");
    let hung_up = client()
        .post(format!("http://{cancel_addr}/cancel"))
        .header("idempotency-key", "m-cancelled")
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(hung_up.is_err(), "the client gave up");
    let key = ScopedKey::new("", "m-cancelled");
    let mut status = None;
    for _ in 0..500 {
        status = store.lookup(&key).await.expect("lookup").map(|r| r.status);
        if status == Some(tower_idempotency::store::RecordStatus::NeedsReconciliation) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        status,
        Some(tower_idempotency::store::RecordStatus::NeedsReconciliation)
    );
    assert_eq!(delta("idempotency_moved_to_reconciliation_total", moved), 1);
    assert_eq!(delta("idempotency_releases_total", releases), 0);
}
