//! Issue 15: once per key under every fault. Each test attacks one class of failure over real
//! sockets (and a real PostgreSQL or SQLite where a store is involved) and counts effects at the
//! sink: a store that fails as the outcome is recorded, a handler that blocks its thread, a
//! body that fails after its head, a client that hangs up during the claim, a late holder after
//! a resolution, a full memory store, a claim behind a held row lock, long table names.

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::faulty::Faulty;
use common::{Effects, TestClock, client, problem, problem_type, serve};
use tokio::sync::Notify;
use tower_idempotency::reconcile::{Reconciliation, resolve_by_hand};
use tower_idempotency::scope::SingleTenant;
use tower_idempotency::store::{RecordStatus, ScopedKey, StoredResponse};
use tower_idempotency::{
    IdempotencyContext, IdempotencyLayer, IdempotencyStore, LeaseExpiry, MemoryStore,
};

fn unique(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{name}-{nanos}")
}

async fn post_key(addr: SocketAddr, key: &str) -> reqwest::Response {
    client()
        .post(format!("http://{addr}/op"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(r#"{"amount":10}"#)
        .send()
        .await
        .expect("request")
}

/// A handler that marks its effect started (when `milestone`), then makes it: one effect per
/// run, counted at the sink, answered 201.
fn effect_route<St: IdempotencyStore>(
    layer: IdempotencyLayer<St, SingleTenant>,
    effects: Effects,
    milestone: bool,
) -> Router {
    Router::new().route(
        "/op",
        post(move |ctx: IdempotencyContext| async move {
            if milestone && ctx.effect_started().await.is_err() {
                return (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "no milestone, no effect".to_owned(),
                );
            }
            let n = effects.hit();
            (StatusCode::CREATED, format!("effect {n}"))
        })
        .layer(layer),
    )
}

/// Sends the scenario's request and gives up waiting after `patience`, as a client whose own
/// timeout fires; whether it did give up.
async fn hang_up_after(addr: SocketAddr, key: &str, patience: Duration) -> bool {
    reqwest::Client::builder()
        .timeout(patience)
        .build()
        .expect("client")
        .post(format!("http://{addr}/op"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(r#"{"amount":10}"#)
        .send()
        .await
        .is_err()
}

// ---- 1. Recording failures ----------------------------------------------------------------

/// The store goes down for 200 ms just as the outcome is recorded; lease 500 ms; the retry comes
/// after 800 ms. The holder keeps its lease and retries the write: the retry is a replay.
async fn short_outage_is_recorded<St: IdempotencyStore>(store: St) {
    let store = Arc::new(Faulty::new(store));
    *store.down_on_complete.lock().expect("lock") = Some(Duration::from_millis(200));
    let effects = Effects::default();
    let layer = IdempotencyLayer::from_arc(store.clone())
        .single_tenant()
        .lease(Duration::from_millis(500));
    let addr = serve(effect_route(layer, effects.clone(), false)).await;
    let key = unique("short-outage");

    let first = post_key(addr, &key).await;
    assert_eq!(
        first.status(),
        StatusCode::CREATED,
        "the live answer is sent"
    );
    let first_body = first.bytes().await.expect("body");
    tokio::time::sleep(Duration::from_millis(800)).await;
    let retry = post_key(addr, &key).await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotency-replayed"], "true");
    assert_eq!(retry.bytes().await.expect("body"), first_body);
    assert_eq!(effects.count(), 1, "0 second executions");
}

/// The same over a real cut of the PostgreSQL connection: every pooled connection dies as the
/// handler returns and none can be opened for 200 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s15_1_a_cut_database_connection_at_record_time_ends_recorded() {
    let Some(pool) = common::postgres_pool().await else {
        return;
    };
    drop(pool);
    // The test server, wherever `TOWER_IDEMPOTENCY_POSTGRES_URL` puts it, through the proxy.
    let options: sqlx::postgres::PgConnectOptions =
        common::postgres_url().parse().expect("a PostgreSQL URL");
    let upstream = tokio::net::lookup_host((options.get_host(), options.get_port()))
        .await
        .expect("resolve")
        .next()
        .expect("an address");
    let proxy = common::proxy::Proxy::start(upstream).await;
    let options = options
        .host(&proxy.addr.ip().to_string())
        .port(proxy.addr.port());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(options)
        .await
        .expect("pool through the proxy");
    let store = tower_idempotency::store::PostgresStore::new(pool)
        .with_table("faults_cut")
        .expect("table");
    store.migrate().await.expect("migrate");
    let effects = Effects::default();
    let layer = IdempotencyLayer::new(store)
        .single_tenant()
        .lease(Duration::from_millis(500));
    let (sink, cut) = (effects.clone(), proxy.clone());
    let app = Router::new().route(
        "/op",
        post(move || async move {
            let n = sink.hit();
            cut.cut();
            let back = cut.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(200)).await;
                back.restore();
            });
            (StatusCode::CREATED, format!("effect {n}"))
        })
        .layer(layer),
    );
    let addr = serve(app).await;
    let key = unique("cut");
    let first = post_key(addr, &key).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    tokio::time::sleep(Duration::from_millis(800)).await;
    let retry = post_key(addr, &key).await;
    assert_eq!(
        retry.status(),
        StatusCode::CREATED,
        "replayed after the cut"
    );
    assert_eq!(retry.headers()["idempotency-replayed"], "true");
    assert_eq!(effects.count(), 1);
}

/// An outage longer than the lease behaves as a crash of the holder: with `Reconcile` (or a
/// recorded milestone) the key is never run a second time; once the store is back the
/// holder's own outcome lands and replays, or the key reads "outcome unknown".
async fn long_outage_never_runs_twice(expiry: LeaseExpiry, milestone: bool) {
    let store = Arc::new(Faulty::new(MemoryStore::new()));
    let effects = Effects::default();
    let layer = IdempotencyLayer::from_arc(store.clone())
        .single_tenant()
        .lease(Duration::from_millis(300))
        .on_lease_expiry(expiry);
    let addr = serve(effect_route(layer, effects.clone(), milestone)).await;
    let key = unique("long-outage");
    *store.down_on_complete.lock().expect("lock") = Some(Duration::from_millis(1200));
    let first = post_key(addr, &key).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    // During the outage: 503, nothing runs.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        post_key(addr, &key).await.status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    tokio::time::sleep(Duration::from_millis(1200)).await;
    for _ in 0..20 {
        let res = post_key(addr, &key).await;
        match res.status() {
            StatusCode::CREATED => {
                assert_eq!(
                    res.headers()["idempotency-replayed"],
                    "true",
                    "never a second run"
                );
                break;
            }
            StatusCode::CONFLICT => {
                let p = problem(res).await;
                let t = p["type"].as_str().unwrap_or_default().to_owned();
                assert!(
                    t == problem_type("outcome-unknown") || t == problem_type("in-flight"),
                    "{p}"
                );
            }
            other => panic!("unexpected {other}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(effects.count(), 1, "one effect, however long the outage");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s15_1_an_outage_longer_than_the_lease_never_runs_twice_with_reconcile() {
    long_outage_never_runs_twice(LeaseExpiry::Reconcile, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s15_1_an_outage_longer_than_the_lease_never_runs_twice_after_a_milestone() {
    long_outage_never_runs_twice(LeaseExpiry::Reclaim, true).await;
}

// ---- 2. Renewal cannot be starved -----------------------------------------------------------

/// A handler that blocks its thread for five leases: the keeper renews from another worker, so
/// a retry in the middle is answered 409 and the one after is a replay.
async fn blocking_handler_keeps_its_lease<St: IdempotencyStore>(store: St) {
    let effects = Effects::default();
    let sink = effects.clone();
    let layer = IdempotencyLayer::new(store)
        .single_tenant()
        .lease(Duration::from_millis(300));
    let app = Router::new().route(
        "/op",
        post(move || async move {
            // Synchronous work on the runtime's thread: the handler's task cannot be polled.
            std::thread::sleep(Duration::from_millis(1500));
            (StatusCode::CREATED, format!("effect {}", sink.hit()))
        })
        .layer(layer),
    );
    let addr = serve(app).await;
    let key = unique("blocking");
    let k = key.clone();
    let first = tokio::spawn(async move { post_key(addr, &k).await.status() });
    tokio::time::sleep(Duration::from_millis(800)).await;
    let mid = post_key(addr, &key).await;
    assert_eq!(
        mid.status(),
        StatusCode::CONFLICT,
        "the holder still holds the key"
    );
    assert_eq!(problem(mid).await["type"], problem_type("in-flight"));
    assert_eq!(first.await.expect("first"), StatusCode::CREATED);
    let after = post_key(addr, &key).await;
    assert_eq!(after.headers()["idempotency-replayed"], "true");
    assert_eq!(effects.count(), 1);
}

// ---- 3. After the response head, the effect happened -----------------------------------------

fn broken_body_route<St: IdempotencyStore>(
    layer: IdempotencyLayer<St, SingleTenant>,
    effects: Effects,
) -> Router {
    Router::new().route(
        "/op",
        post(move || async move {
            effects.hit();
            let chunks: Vec<Result<&'static str, std::io::Error>> = vec![
                Ok("{\"partial\":"),
                Err(std::io::Error::other("the downstream stream broke")),
            ];
            let body = Body::from_stream(futures_util::stream::iter(chunks));
            Response::builder()
                .status(StatusCode::CREATED)
                .header("content-type", "application/json")
                .body(body)
                .expect("response")
                .into_response()
        })
        .layer(layer),
    )
}

#[tokio::test]
async fn s15_3_a_body_that_fails_after_the_head_is_never_run_again() {
    let effects = Effects::default();
    let store = MemoryStore::new();
    let addr = serve(broken_body_route(
        IdempotencyLayer::new(store.clone()).single_tenant(),
        effects.clone(),
    ))
    .await;
    let key = unique("broken-body");
    let first = post_key(addr, &key).await;
    assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let p = problem(first).await;
    assert_eq!(p["type"], problem_type("execution-failed"));
    assert_eq!(p["state"], "completed", "{p}");
    assert_eq!(p["safe_new_key"], true);
    assert!(
        p["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("will not run again"),
        "{p}"
    );
    for _ in 0..3 {
        let retry = post_key(addr, &key).await;
        assert_eq!(retry.status(), StatusCode::CONFLICT);
        assert_eq!(retry.headers()["idempotency-replayed"], "true");
        let p = problem(retry).await;
        assert_eq!(p["type"], problem_type("response-not-stored"));
        assert!(
            p["detail"]
                .as_str()
                .unwrap_or_default()
                .contains("body failed"),
            "the problem says why: {p}"
        );
    }
    assert_eq!(effects.count(), 1, "the handler answered once: never again");
    let record = store
        .lookup(&ScopedKey::new("", &key))
        .await
        .expect("lookup")
        .expect("record");
    assert_eq!(record.status, RecordStatus::Completed);
}

// ---- 4. A hang-up during the claim leaves nothing stuck --------------------------------------

/// The claim commits, then its answer is slow: the client gives up meanwhile. The won claim is
/// given back (nothing ran), so the next retry runs at once instead of waiting out the lease.
async fn hang_up_during_claim<St: IdempotencyStore>(store: St) {
    hang_up_during_claim_with(store, false).await;
}

/// The same, with the store failing the first give-back (the claim is operation 1, the
/// release 2): the give-back is tried again, so a key that nothing ran under ends released,
/// never in flight for a lease and then set aside for reconciliation on this `Reconcile` route.
async fn hang_up_during_claim_first_give_back_fails<St: IdempotencyStore>(store: St) {
    hang_up_during_claim_with(store, true).await;
}

async fn hang_up_during_claim_with<St: IdempotencyStore>(store: St, fail_first_release: bool) {
    let store = Arc::new(Faulty::new(store));
    if fail_first_release {
        store.fail_at.store(2, Ordering::SeqCst);
    }
    *store.pause_after_claim.lock().expect("lock") = Some(Duration::from_millis(300));
    let effects = Effects::default();
    let layer = IdempotencyLayer::from_arc(store.clone())
        .single_tenant()
        .lease(Duration::from_secs(60))
        .on_lease_expiry(LeaseExpiry::Reconcile);
    let addr = serve(effect_route(layer, effects.clone(), false)).await;
    let key = unique("hang-up");
    let gave_up = hang_up_after(addr, &key, Duration::from_millis(100)).await;
    assert!(gave_up, "the client hung up during the claim");
    tokio::time::sleep(Duration::from_millis(700)).await;
    let record = store
        .lookup(&ScopedKey::new("", &key))
        .await
        .expect("lookup")
        .expect("the record");
    assert_eq!(
        record.status,
        RecordStatus::Released,
        "nothing ran: the claim is given back"
    );
    assert_eq!(effects.count(), 0);
    let releases = store.log().iter().filter(|op| **op == "release").count();
    let expected = if fail_first_release { 2 } else { 1 };
    assert_eq!(
        releases, expected,
        "a failed give-back is tried again, once it lands no more"
    );
    *store.pause_after_claim.lock().expect("lock") = None;
    let retry = post_key(addr, &key).await;
    assert_eq!(
        retry.status(),
        StatusCode::CREATED,
        "the retry runs, not 409"
    );
    assert_eq!(effects.count(), 1);
}

/// On a `Reconcile` route with a 400 ms lease: a claim answered late (300 ms), dropped by its
/// client's hang-up, and the store down for three leases, so that its give-back cannot land
/// within the lease. The store is left down.
async fn outage_after_a_dropped_late_claim<St: IdempotencyStore>(
    store: St,
    name: &str,
) -> (Arc<Faulty<St>>, SocketAddr, String, Effects) {
    let store = Arc::new(Faulty::new(store));
    let lease = Duration::from_millis(400);
    *store.pause_after_claim.lock().expect("lock") = Some(Duration::from_millis(300));
    let effects = Effects::default();
    let layer = IdempotencyLayer::from_arc(store.clone())
        .single_tenant()
        .lease(lease)
        .on_lease_expiry(LeaseExpiry::Reconcile);
    let addr = serve(effect_route(layer, effects.clone(), false)).await;
    let key = unique(&format!("give-back-{name}"));
    let gave_up = hang_up_after(addr, &key, Duration::from_millis(100)).await;
    assert!(gave_up, "the client hung up during the claim");
    store.down.store(true, Ordering::SeqCst);
    *store.pause_after_claim.lock().expect("lock") = None;
    tokio::time::sleep(lease * 3).await;
    (store, addr, key, effects)
}

/// DESIGN §1.6 (a 503 means nothing ran: retry with the same key) and §4: a claim answered
/// late is dropped by its request (the client hung up), and the store then fails every write
/// for three leases, so the give-back of that claim cannot land within its lease. On this
/// `Reconcile` route a retry after the lease would set the key aside (it cannot know that
/// nothing ran); the holder, which knows, must go on giving the key back once the store
/// recovers, so the key runs (once) instead of answering `outcome-unknown` for ever. Its
/// give-back used to stop when the lease ended (a review found the key stranded under SQLite
/// pool exhaustion).
async fn give_back_outlasting_the_lease<St: IdempotencyStore>(store: St) {
    let (store, addr, key, effects) = outage_after_a_dropped_late_claim(store, "past-lease").await;
    store.down.store(false, Ordering::SeqCst);
    let mut answers = Vec::new();
    let last = common::guard("the key runs again", async {
        loop {
            let answer = post_key(addr, &key).await;
            let status = answer.status();
            answers.push(status.as_u16());
            if status != StatusCode::CONFLICT && status != StatusCode::SERVICE_UNAVAILABLE {
                return status;
            }
            assert!(answers.len() < 100, "still refused: {answers:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    assert_eq!(last, StatusCode::CREATED, "answers: {answers:?}");
    assert_eq!(
        effects.count(),
        1,
        "run once, the claim nothing ran under given back"
    );
}

/// A give-back past its lease that cannot read the record (every `lookup` fails, writes land)
/// still releases the key it holds: a release is fenced, so it cannot undo a takeover. A
/// give-back that released only after a read answered left the key in flight under its dead
/// claim for as long as reads failed, and a retry on this `Reconcile` route then set it aside.
/// Read from the inner store: the release lands while lookups through the layer's store fail;
/// then the retry runs once.
async fn give_back_past_the_lease_without_reads<St: IdempotencyStore>(store: St) {
    let (store, addr, key, effects) = outage_after_a_dropped_late_claim(store, "no-reads").await;
    store.fail_lookup.store(true, Ordering::SeqCst);
    store.down.store(false, Ordering::SeqCst);
    let scoped = ScopedKey::new("", &key);
    common::guard("the key given back without a read", async {
        loop {
            let record = store.inner.lookup(&scoped).await.expect("lookup");
            match record {
                Some(r) if r.status == RecordStatus::InProgress => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                other => {
                    assert!(
                        other
                            .as_ref()
                            .is_none_or(|r| r.status == RecordStatus::Released),
                        "given back, never set aside: {other:?}"
                    );
                    return;
                }
            }
        }
    })
    .await;
    store.fail_lookup.store(false, Ordering::SeqCst);
    let answer = post_key(addr, &key).await;
    assert_eq!(answer.status(), StatusCode::CREATED);
    assert_eq!(effects.count(), 1, "run once, by the retry");
}

/// On a route that cancels on disconnect, a hang-up while the handler runs gives the key back,
/// and a give-back the store fails once is tried again: the retry runs at once (attempt 2), as
/// the route promises, instead of finding the key in flight for the rest of a 30 s lease.
#[tokio::test]
async fn s15_3_a_cancelled_runs_failed_give_back_is_tried_again() {
    let store = Faulty::new(MemoryStore::new());
    // The claim is operation 1, the give-back 2 (no renewal is due within a 30 s lease).
    store.fail_at.store(2, Ordering::SeqCst);
    let effects = Effects::default();
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = effects.clone();
    let app = Router::new().route(
        "/op",
        post(move |ctx: IdempotencyContext| async move {
            // The first run outlives its client; the retry is quick.
            if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_secs(20)).await;
            }
            let n = counter.hit();
            (
                StatusCode::CREATED,
                format!("effect {n} (attempt {})", ctx.attempt()),
            )
        })
        .layer(
            IdempotencyLayer::new(store.clone())
                .single_tenant()
                .lease(Duration::from_secs(30))
                .cancel_on_disconnect(true),
        ),
    );
    let addr = serve(app).await;
    let key = unique("cancel-give-back");
    assert!(
        hang_up_after(addr, &key, Duration::from_millis(200)).await,
        "the client hung up while the handler ran"
    );
    let mut answered = None;
    for _ in 0..200 {
        let res = post_key(addr, &key).await;
        if res.status() == StatusCode::CREATED {
            answered = Some(res.text().await.expect("body"));
            break;
        }
        assert_eq!(
            res.status(),
            StatusCode::CONFLICT,
            "only until the give-back lands"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        answered
            .expect("the key was given back within the lease")
            .as_str(),
        "effect 1 (attempt 2)"
    );
    let releases = store.log().iter().filter(|op| **op == "release").count();
    assert_eq!(
        releases, 2,
        "the failed give-back, then the one that landed"
    );
    assert_eq!(
        effects.count(),
        1,
        "the cancelled run never made its effect"
    );
}

/// On a route that cancels on disconnect, a hang-up while the handler runs gives the key back;
/// one after the handler answered (here: while its outcome is being written) must not: the
/// effect happened, so the outcome is recorded all the same and replayed.
#[tokio::test]
async fn s15_3_a_hang_up_after_the_handler_answered_never_cancels_its_record() {
    let store = Faulty::new(MemoryStore::new());
    *store.pause_before_complete.lock().expect("lock") = Some(Duration::from_millis(400));
    let effects = Effects::default();
    let layer = IdempotencyLayer::new(store.clone())
        .single_tenant()
        .cancel_on_disconnect(true);
    let addr = serve(effect_route(layer, effects.clone(), false)).await;
    let key = unique("cancel-after-answer");
    let gave_up = hang_up_after(addr, &key, Duration::from_millis(150)).await;
    assert!(gave_up, "the client hung up while the outcome was written");
    tokio::time::sleep(Duration::from_millis(700)).await;
    *store.pause_before_complete.lock().expect("lock") = None;
    let retry = post_key(addr, &key).await;
    assert_eq!(
        retry.headers()["idempotency-replayed"],
        "true",
        "recorded, not released"
    );
    assert_eq!(effects.count(), 1);
}

/// DESIGN §4 on a layer whose routes hold leases of different lengths: the keeper sleeps a
/// sixth of the shortest lease it has seen, up to a second. Asleep for a long lease's tick when
/// a 300 ms lease came in, it renewed that lease only when it woke, after the lease had run out
/// and a retry had taken the key over: a second run. A shorter lease now wakes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_short_lease_after_a_long_one_is_renewed_in_time() {
    let started = Effects::default();
    let effects = Effects::default();
    let handler = {
        let (started, effects) = (started.clone(), effects.clone());
        move || {
            let (started, effects) = (started.clone(), effects.clone());
            async move {
                started.hit();
                tokio::time::sleep(Duration::from_millis(1_200)).await;
                (StatusCode::CREATED, format!("effect {}", effects.hit()))
            }
        }
    };
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .single_tenant()
        .for_path("/long", |route| route.lease(Duration::from_secs(3_600)))
        .for_path("/op", |route| route.lease(Duration::from_millis(300)));
    let app = Router::new()
        .route("/long", post(handler.clone()))
        .route("/op", post(handler))
        .layer(layer);
    let addr = serve(app).await;
    let send = move |path: &'static str, key: String| async move {
        client()
            .post(format!("http://{addr}{path}"))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .expect("request")
    };
    // The long lease first: the keeper starts and sleeps its tick (a second).
    let long = tokio::spawn(send("/long", unique("long-lease")));
    while started.count() < 1 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let key = unique("short-lease");
    let first = tokio::spawn(send("/op", key.clone()));
    while started.count() < 2 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // A lease and a half later, still well inside the keeper's old tick.
    tokio::time::sleep(Duration::from_millis(450)).await;
    let retry = send("/op", key.clone()).await;
    assert_eq!(
        retry.status(),
        StatusCode::CONFLICT,
        "the short lease was kept: the retry finds it in flight"
    );
    assert_eq!(first.await.expect("task").status(), StatusCode::CREATED);
    assert_eq!(long.await.expect("task").status(), StatusCode::CREATED);
    assert_eq!(started.count(), 2, "no run but the two first ones");
    assert_eq!(effects.count(), 2);
}

/// DESIGN §4: the lease is kept renewed from before the handler starts until its outcome is
/// recorded. The answer is in hand but the store takes four leases to write it. Each try is
/// given half a lease (a stuck connection must not hold the key for ever), then the key is
/// marked uncertain and the write tried again, under the same lease: a retry meanwhile gets 409,
/// never a lapsed lease to take over, and once the store is quick again replays the one
/// effect's answer.
#[tokio::test]
async fn s4_the_lease_is_held_while_the_outcome_is_written() {
    let store = Faulty::new(MemoryStore::new());
    *store.pause_before_complete.lock().expect("lock") = Some(Duration::from_millis(1_200));
    let effects = Effects::default();
    let layer = IdempotencyLayer::new(store.clone())
        .single_tenant()
        .lease(Duration::from_millis(300));
    let addr = serve(effect_route(layer, effects.clone(), false)).await;
    let key = unique("held-while-written");
    let first = tokio::spawn({
        let key = key.clone();
        async move { post_key(addr, &key).await }
    });
    // Past two leases, while the outcome is still being written.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let retry = post_key(addr, &key).await;
    assert_eq!(retry.status(), StatusCode::CONFLICT, "still in flight");
    assert_eq!(effects.count(), 1, "the retry did not take the key over");
    let first = tokio::time::timeout(Duration::from_secs(20), first)
        .await
        .expect("the first request answers")
        .expect("task");
    assert_eq!(first.status(), StatusCode::CREATED);
    *store.pause_before_complete.lock().expect("lock") = None;
    let mut landed = false;
    for _ in 0..400 {
        let record = store
            .lookup(&ScopedKey::new("", &key))
            .await
            .expect("lookup")
            .expect("the record");
        if record.status == RecordStatus::Completed {
            landed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        landed,
        "the outcome is recorded once the store is quick again"
    );
    let replay = post_key(addr, &key).await;
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(replay.text().await.expect("body"), "effect 1");
    assert_eq!(effects.count(), 1);
}

/// DESIGN §4: a record the store refuses as `Busy` (its row locked elsewhere, as a custom store
/// may answer) is kept and tried again like any failed write; only a fenced write is final. On
/// the first write and on a retry of a failed one, the record lands, the key is never left in
/// flight to lapse, and a retry after several leases replays the one effect.
#[tokio::test]
async fn s4_a_record_refused_busy_is_tried_again() {
    use common::rig::Act;
    // The first write refused busy; or the first failing and its retry refused busy.
    record_refused(&[vec![Act::Busy], vec![Act::Fail, Act::Busy]]).await;
}

/// DESIGN §4: a record refused as `Fenced` while the record is still the holder's, in flight
/// under its token (a store or a proxy that broke the trait's word), is not taken as final:
/// the holder reads the record, finds it its own, and keeps writing. Were the outcome dropped,
/// the key would lapse and a retry would run the handler again.
#[tokio::test]
async fn s4_a_record_fenced_by_mistake_is_tried_again() {
    use common::rig::Act;
    record_refused(&[vec![Act::Fenced], vec![Act::Fail, Act::Fenced]]).await;
}

/// DESIGN §4 (the holder keeps its lease while it runs): a renewal refused as `Fenced` while the
/// record is still in flight under the holder's token (a store or a proxy that broke the
/// trait's word) does not end the holding. Given up, the lease would lapse under the running
/// handler, and on a route that reclaims, a retry would take the key over and run it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_renewal_fenced_by_mistake_keeps_the_lease() {
    use common::rig::{self, Act, Rig};
    let store = Rig::new(MemoryStore::new());
    store.on("renew", 1, Act::Fenced);
    store.on("renew", 2, Act::Fenced);
    let effects = Effects::default();
    let addr = rig::server(
        &store,
        rig::Route::plain(Duration::from_millis(300)),
        rig::sleep_then_effect(&effects, Duration::from_millis(1_200), false),
    )
    .await;
    let key = rig::unique("renew-fenced");
    let k = key.clone();
    let holder = tokio::spawn(async move { rig::ask(addr, &k).await });
    // Past several leases: had the lease been given up, this retry would take the key over.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let during = rig::ask(addr, &key).await;
    assert!(during.in_flight(), "{during:?}\n{}", store.log());
    let first = holder.await.expect("holder");
    assert!(first.is_live(), "{first:?}\n{}", store.log());
    assert!(store.logged("renew", "Fenced") >= 1, "{}", store.log());
    let after = rig::ask(addr, &key).await;
    assert!(after.is_replay_of(&first.body), "{after:?}");
    assert_eq!(effects.count(), 1, "one effect");
}

/// Each plan refuses the record writes it lists, in order; the record lands all the same, and
/// a retry several leases later replays the one effect.
async fn record_refused(plans: &[Vec<common::rig::Act>]) {
    use common::rig::{self, Rig};
    for plan in plans {
        let store = Rig::new(MemoryStore::new());
        for (n, act) in plan.iter().enumerate() {
            store.on("complete", n + 1, *act);
        }
        let effects = Effects::default();
        let addr = rig::server(
            &store,
            rig::Route::plain(Duration::from_millis(400)),
            rig::sleep_then_effect(&effects, Duration::ZERO, false),
        )
        .await;
        let key = rig::unique("record-busy");
        let first = rig::ask(addr, &key).await;
        assert!(first.is_live(), "{plan:?}: {first:?}");
        let landed = rig::eventually(async || {
            rig::record_of(&store, &key)
                .await
                .is_some_and(|r| r.status == RecordStatus::Completed)
        })
        .await;
        assert!(landed, "{plan:?}: the record lands\n{}", store.log());
        assert_eq!(store.count("complete"), plan.len() + 1, "{plan:?}");
        // Past several leases: had the key been left in flight, a retry would take it over.
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        let retry = rig::ask(addr, &key).await;
        assert!(
            retry.is_replay_of(&first.body),
            "{plan:?}: {retry:?}\n{}",
            store.log()
        );
        assert_eq!(effects.count(), 1, "{plan:?}: one effect");
    }
}

/// DESIGN §4: the holder's renewals fail while its handler runs, so a retry past the lease sets
/// the key aside (a route that reconciles); the handler then answers 503, which gives the key
/// back. The release is fenced, and the holder, which marked no effect started, gives the
/// set-aside key back itself (resolved "not applied"), with no second release sent first: it
/// would only be fenced again. The next retry runs it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_fenced_release_goes_straight_to_the_set_aside_give_back() {
    use common::rig::{self, Act, Rig};
    let store = Rig::new(MemoryStore::new());
    store.always("renew", Act::Fail);
    let effects = Effects::default();
    let addr = rig::server(
        &store,
        rig::Route::plain(Duration::from_millis(300)).reconcile(),
        rig::fail_first(
            &effects,
            Duration::from_millis(700),
            StatusCode::SERVICE_UNAVAILABLE,
        ),
    )
    .await;
    let key = rig::unique("fenced-release");
    let k = key.clone();
    let holder = tokio::spawn(async move { rig::ask(addr, &k).await });
    tokio::time::sleep(Duration::from_millis(450)).await;
    let during = rig::ask(addr, &key).await;
    assert_eq!(during.problem, "outcome-unknown", "{during:?}");
    let first = holder.await.expect("holder");
    assert_eq!(first.status, 503, "{first:?}");
    let given = rig::eventually(async || {
        rig::status_of(&store, &key).await != Some(RecordStatus::NeedsReconciliation)
    })
    .await;
    assert!(given, "the holder gives the key back\n{}", store.log());
    assert_eq!(store.logged("release", "fenced"), 1, "{}", store.log());
    assert_eq!(store.count("release"), 1, "one release\n{}", store.log());
    store.always("renew", Act::Pass);
    let next = rig::ask(addr, &key).await;
    assert!(next.is_live(), "{next:?}\n{}", store.log());
    assert_eq!(effects.count(), 1, "one effect");
}

// ---- 5. A resolved outcome is final -----------------------------------------------------------

/// The holder's renewals fail, so its lease runs out while it runs; a retry finds the key
/// uncertain; an operator resolves it as applied; then the holder finishes. Its late write is
/// fenced out: retries replay the operator's response.
async fn resolution_is_final<St: IdempotencyStore>(store: St) {
    let store = Arc::new(Faulty::new(store));
    store.fail_renew.store(true, Ordering::SeqCst);
    let effects = Effects::default();
    let go = Arc::new(Notify::new());
    let (sink, gate) = (effects.clone(), go.clone());
    let layer = IdempotencyLayer::from_arc(store.clone())
        .single_tenant()
        .lease(Duration::from_millis(300))
        .on_lease_expiry(LeaseExpiry::Reconcile);
    let app = Router::new().route(
        "/op",
        post(move || async move {
            gate.notified().await;
            (
                StatusCode::CREATED,
                format!("holder's effect {}", sink.hit()),
            )
        })
        .layer(layer),
    );
    let addr = serve(app).await;
    let key = unique("resolved");
    let k = key.clone();
    let holder = tokio::spawn(async move { post_key(addr, &k).await.status() });
    tokio::time::sleep(Duration::from_millis(600)).await;
    let retry = post_key(addr, &key).await;
    assert_eq!(
        problem(retry).await["type"],
        problem_type("outcome-unknown")
    );

    let scoped = ScopedKey::new("", &key);
    let resolved = StoredResponse {
        status: StatusCode::CREATED,
        headers: Default::default(),
        body: Some(bytes::Bytes::from_static(b"resolved by an operator")),
        trailers: None,
    };
    resolve_by_hand(
        &*store,
        &scoped,
        Reconciliation::Applied(Box::new(resolved)),
        Duration::from_secs(60),
        "checked downstream",
    )
    .await
    .expect("resolve");
    go.notify_one();
    assert_eq!(holder.await.expect("holder"), StatusCode::CREATED);
    tokio::time::sleep(Duration::from_millis(200)).await;
    for _ in 0..2 {
        let replay = post_key(addr, &key).await;
        assert_eq!(replay.headers()["idempotency-replayed"], "true");
        assert_eq!(
            replay.bytes().await.expect("body"),
            "resolved by an operator",
            "the resolution stands"
        );
    }
    assert_eq!(effects.count(), 1);
}

// ---- 6 and 8. Bounded memory, and a store that keeps its promises ---------------------------

/// `MemoryStore::new()` is bounded: unique keys with 1 MiB answers fill its default 256 MiB,
/// then new keys get 503 and nothing runs, while every recorded key still replays.
#[tokio::test]
async fn s15_6_the_default_memory_store_is_bounded_and_full_answers_503() {
    let effects = Effects::default();
    let sink = effects.clone();
    let layer = IdempotencyLayer::new(MemoryStore::new()).single_tenant();
    let app = Router::new().route(
        "/op",
        post(move || async move {
            sink.hit();
            // Just under the 1 MiB record limit, head included (every stored byte counts).
            vec![b'x'; (1 << 20) - 4096]
        })
        .layer(layer),
    );
    let addr = serve(app).await;
    let run = unique("bounded");
    let mut created = 0;
    let mut refused = None;
    for i in 0..400 {
        let res = post_key(addr, &format!("{run}-{i}")).await;
        if res.status() == StatusCode::SERVICE_UNAVAILABLE {
            let p = problem(res).await;
            assert_eq!(p["type"], problem_type("store-unavailable"));
            refused = Some(i);
            break;
        }
        assert_eq!(res.status(), StatusCode::OK);
        created += 1;
    }
    let refused = refused.expect("the default store must refuse before 400 MiB");
    assert!(
        (200..=260).contains(&created),
        "{created} responses of about 1 MiB fit the 256 MiB default"
    );
    assert_eq!(effects.count(), created, "the refused key ran nothing");
    assert_eq!(
        post_key(addr, &format!("{run}-{refused}")).await.status(),
        503
    );
    let first = post_key(addr, &format!("{run}-0")).await;
    assert_eq!(
        first.headers()["idempotency-replayed"],
        "true",
        "nothing evicted"
    );
    assert_eq!(effects.count(), created);
}

/// An SSE answer that never ends is bounded: once it passes the response limit it is recorded
/// as not stored, so a retry meanwhile is told the outcome (not "in flight" for ever), and the
/// copy stops growing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s15_6_a_never_ending_event_stream_is_recorded_once_past_the_limit() {
    use futures_util::StreamExt;
    let effects = Effects::default();
    let sink = effects.clone();
    let store = MemoryStore::new();
    let layer = IdempotencyLayer::new(store.clone())
        .single_tenant()
        .response_limit(2048)
        .jsonrpc(tower_idempotency::jsonrpc::JsonRpc::new());
    let app = Router::new().route(
        "/mcp",
        post(move || async move {
            sink.hit();
            let progress = "data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{\"progress\":1}}\n\n";
            let endless = futures_util::stream::repeat(progress).then(|event| async move {
                tokio::time::sleep(Duration::from_millis(2)).await;
                Ok::<_, std::io::Error>(event)
            });
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(endless))
                .expect("response")
        })
        .layer(layer),
    );
    let addr = serve(app).await;
    let key = unique("endless");
    let call = |id: u32| {
        client()
            .post(format!("http://{addr}/mcp"))
            .header("idempotency-key", &key)
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(format!(
                r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"t","arguments":{{}}}}}}"#
            ))
            .send()
    };
    let mut live = call(1).await.expect("the stream starts");
    assert_eq!(live.status(), StatusCode::OK);
    let mut read = 0;
    while read < 4096 {
        read += live.chunk().await.expect("chunk").expect("more").len();
    }
    let retry: serde_json::Value = call(2).await.expect("retry").json().await.expect("json");
    assert_eq!(retry["id"], 2);
    assert_eq!(
        retry["error"]["code"], -31007,
        "not stored, not in flight: {retry}"
    );
    let record = store
        .lookup(&ScopedKey::new("\u{0}tools/call", &key))
        .await
        .expect("lookup")
        .expect("record");
    assert_eq!(record.status, RecordStatus::Completed);
    assert_eq!(effects.count(), 1);
    drop(live);
}

/// A full store whose records have all expired is not full: every shard is swept, not only
/// the claiming one's.
#[tokio::test]
async fn s15_8_a_store_of_expired_records_is_not_full() {
    let clock = TestClock::default();
    let store = clock.store().max_records(64);
    let effects = Effects::default();
    let layer = IdempotencyLayer::new(store)
        .single_tenant()
        .ttl(Duration::from_secs(1));
    let addr = serve(effect_route(layer, effects.clone(), false)).await;
    let run = unique("expired-full");
    for i in 0..64 {
        assert_eq!(post_key(addr, &format!("{run}-a{i}")).await.status(), 201);
    }
    assert_eq!(
        post_key(addr, &format!("{run}-over")).await.status(),
        503,
        "64 live records fill it"
    );
    clock.advance(Duration::from_secs(2));
    for i in 0..64 {
        let res = post_key(addr, &format!("{run}-b{i}")).await;
        assert_eq!(res.status(), 201, "key {i}: expired records make room");
    }
    assert_eq!(effects.count(), 128);
}

// ---- 7. A claim never queues behind a lock ----------------------------------------------------

/// What happens meanwhile, while a handler holds its record's row in its own transaction.
#[derive(Clone, Copy, PartialEq)]
enum Meanwhile {
    /// Twelve retries of the held key.
    Retries,
    /// The same, on a route that writes every refusal into the key's history.
    RetriesNoted,
    /// Nothing but time: the holder's lease (300 ms) is due for renewal several times.
    Renewals,
    /// Another replica starts and runs `migrate()`.
    Migrate,
}

/// The handler records its milestone inside its own transaction and holds it. Whatever happens
/// meanwhile, no statement of the store queues behind that lock holding a connection: retries
/// of the held key are answered 409, and an unrelated key runs, on a pool of `pool`.
async fn held_row_lock(table: &str, pool: u32, meanwhile: Meanwhile) {
    let Some(_) = common::postgres_pool().await else {
        return;
    };
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(pool)
        .acquire_timeout(Duration::from_secs(3))
        .connect(&common::postgres_url())
        .await
        .expect("pool");
    let store = tower_idempotency::store::PostgresStore::new(pool)
        .with_table(table)
        .expect("table");
    store.migrate().await.expect("migrate");
    let effects = Effects::default();
    let (locked, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let key = unique("locked");
    let held = Arc::new(key.clone());
    let (sink, l, r, s) = (
        effects.clone(),
        locked.clone(),
        release.clone(),
        store.clone(),
    );
    let mut layer = IdempotencyLayer::new(store.clone()).single_tenant();
    if meanwhile == Meanwhile::RetriesNoted {
        layer = layer.record_refusals(true);
    }
    if meanwhile == Meanwhile::Renewals {
        layer = layer.lease(Duration::from_millis(300));
    }
    let app = Router::new().route(
        "/op",
        post(move |ctx: IdempotencyContext| async move {
            if ctx.key() != held.as_str() {
                return (StatusCode::CREATED, format!("effect {}", sink.hit()));
            }
            let mut tx = s.pool().begin().await.expect("begin");
            s.record_milestone_in(
                &mut tx,
                ctx.scoped_key(),
                ctx.fencing_token(),
                &tower_idempotency::store::Milestone::EffectStarted,
            )
            .await
            .expect("milestone");
            let n = sink.hit();
            l.notify_one();
            r.notified().await;
            tx.commit().await.expect("commit");
            (StatusCode::CREATED, format!("effect {n}"))
        })
        .layer(layer),
    );
    let addr = serve(app).await;
    let k = key.clone();
    let holder = tokio::spawn(async move { post_key(addr, &k).await.status() });
    locked.notified().await;

    // Deadlock detection only: a statement queued behind the lock waits for a commit that
    // comes after everything below.
    let detect = Duration::from_secs(20);
    let mut migrating = None;
    match meanwhile {
        Meanwhile::Retries | Meanwhile::RetriesNoted => {
            let retries = tokio::time::timeout(detect, async {
                let tasks: Vec<_> = (0..12)
                    .map(|_| {
                        let key = key.clone();
                        tokio::spawn(async move { post_key(addr, &key).await })
                    })
                    .collect();
                let mut answers = Vec::new();
                for t in tasks {
                    answers.push(t.await.expect("retry"));
                }
                answers
            })
            .await
            .expect("retries queued behind the handler's transaction");
            for res in retries {
                assert_eq!(res.status(), StatusCode::CONFLICT);
                assert_eq!(problem(res).await["type"], problem_type("in-flight"));
            }
        }
        Meanwhile::Renewals => tokio::time::sleep(Duration::from_millis(1000)).await,
        Meanwhile::Migrate => {
            let replica = store.clone();
            migrating = Some(tokio::spawn(async move { replica.migrate().await }));
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
    let other = tokio::time::timeout(detect, post_key(addr, &unique("unrelated")))
        .await
        .expect("an unrelated key queued behind the handler's transaction");
    assert_eq!(
        other.status(),
        StatusCode::CREATED,
        "an unrelated key still runs"
    );
    release.notify_one();
    assert_eq!(holder.await.expect("holder"), StatusCode::CREATED);
    if let Some(migrating) = migrating {
        migrating
            .await
            .expect("join")
            .expect("an up-to-date migrate succeeds");
    }
    assert_eq!(
        effects.count(),
        2,
        "the held key once, the unrelated key once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s15_7_a_claim_never_queues_behind_a_held_row_lock() {
    held_row_lock("faults_locked", 4, Meanwhile::Retries).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s15_7_a_noted_refusal_never_queues_behind_a_held_row_lock() {
    held_row_lock("faults_locked_noted", 4, Meanwhile::RetriesNoted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s15_7_a_renewal_never_holds_a_connection_behind_a_held_row_lock() {
    held_row_lock("faults_locked_renewals", 2, Meanwhile::Renewals).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s15_7_a_migrating_replica_never_stalls_claims() {
    held_row_lock("faults_locked_migrate", 4, Meanwhile::Migrate).await;
}

/// Replicas migrating a new table together (a first deploy, or a test binary's first run on a
/// fresh database): each finds it missing and waits for the migration lock. The one that
/// takes the lock second must find the table made, not run the DDL again: its `ALTER TABLE`
/// queued behind a transaction that already held a record (a handler's), and that
/// transaction's own claim queued behind the `ALTER`: CI hung on it. Here the first replica's
/// migration is done while the second waits for the lock, then a transaction holds a record:
/// the second migration finishes at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s15_7_a_replica_that_waited_to_migrate_finds_the_table_made() {
    let Some(pool) = common::postgres_pool().await else {
        return;
    };
    let table = "faults_migrate_race";
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS \"{table}\""
    )))
    .execute(&pool)
    .await
    .expect("drop");
    // The migration lock, held as the first replica would while it migrates.
    let mut first = pool.acquire().await.expect("connection");
    sqlx::query("SELECT pg_advisory_lock(hashtext('tower_idempotency_migrate'))")
        .execute(&mut *first)
        .await
        .expect("lock");
    let store = tower_idempotency::store::PostgresStore::new(pool.clone())
        .with_table(table)
        .expect("table");
    let second = tokio::spawn({
        let store = store.clone();
        async move { store.migrate().await }
    });
    // The second replica found the table missing and now waits for the lock.
    let waiting = async {
        loop {
            let waits: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
            )
            .fetch_one(&pool)
            .await
            .expect("pg_locks");
            if waits > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), waiting)
        .await
        .expect("the second migration waits for the lock");
    // The first replica makes the table (as its migration would), and a request holds a
    // record in a transaction of its own.
    for statement in store.migration_sql() {
        sqlx::query(sqlx::AssertSqlSafe(statement.to_owned()))
            .execute(&mut *first)
            .await
            .expect("migration");
    }
    let mut held = pool.begin().await.expect("begin");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{table}\" (scope, key, fingerprint, status, lease_token, lease_until, \
         attempts, created_at, updated_at, expires_at) VALUES ('\\x'::bytea, '\\x6b'::bytea, \
         '\\x00'::bytea, 'in_progress', 1, now(), 1, now(), now(), now())"
    )))
    .execute(&mut *held)
    .await
    .expect("a record held in a transaction");
    sqlx::query("SELECT pg_advisory_unlock(hashtext('tower_idempotency_migrate'))")
        .execute(&mut *first)
        .await
        .expect("unlock");
    let migrated = tokio::time::timeout(Duration::from_secs(20), second).await;
    held.rollback().await.expect("rollback");
    migrated
        .expect("the second migration finds the table made instead of queueing its DDL")
        .expect("task")
        .expect("migrate");
}

/// A 63-byte table name (PostgreSQL's limit) still gets both its indexes, named apart from the
/// table.
#[tokio::test]
async fn s15_8_a_63_byte_table_name_gets_its_indexes() {
    let Some(pool) = common::postgres_pool().await else {
        return;
    };
    let table = format!("faults_{}", "t".repeat(56));
    assert_eq!(table.len(), 63);
    // A table left by an earlier run would already have its indexes.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS \"{table}\""
    )))
    .execute(&pool)
    .await
    .expect("drop");
    let store = tower_idempotency::store::PostgresStore::new(pool.clone())
        .with_table(&table)
        .expect("a 63-byte name is valid");
    store.migrate().await.expect("migrate");
    store.migrate().await.expect("migrate again: idempotent");
    let indexes: Vec<String> =
        sqlx::query_scalar("SELECT indexname::text FROM pg_indexes WHERE tablename = $1")
            .bind(&table)
            .fetch_all(&pool)
            .await
            .expect("indexes");
    assert_eq!(
        indexes.len(),
        4,
        "primary key and three indexes: {indexes:?}"
    );
    assert!(
        indexes
            .iter()
            .all(|name| name != &table && name.len() <= 63)
    );
}

// ---- 9. The fault matrix ----------------------------------------------------------------------

/// How the matrix's handler behaves.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Handler {
    /// Answers at once.
    Plain,
    /// Marks its effect started first; without the milestone it makes no effect (503).
    Milestone,
    /// Marks its effect started and takes longer than a third of its lease, so its lease is
    /// renewed while it runs.
    Slow,
}

fn matrix_route<St: IdempotencyStore>(
    layer: IdempotencyLayer<St, SingleTenant>,
    effects: Effects,
    handler: Handler,
) -> Router {
    Router::new().route(
        "/op",
        post(move |ctx: IdempotencyContext| async move {
            if handler != Handler::Plain && ctx.effect_started().await.is_err() {
                return (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "no milestone, no effect".to_owned(),
                );
            }
            if handler == Handler::Slow {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            (StatusCode::CREATED, format!("effect {}", effects.hit()))
        })
        .layer(layer),
    )
}

/// What one answer was, for the table.
async fn answer_of(res: reqwest::Response) -> (String, bool) {
    let status = res.status();
    let replayed = res
        .headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let is_problem = res
        .headers()
        .get("content-type")
        .is_some_and(|v| v == "application/problem+json");
    let text = if is_problem {
        let p: serde_json::Value = res.json().await.unwrap_or_default();
        let t = p["type"].as_str().unwrap_or_default();
        t.rsplit(':').next().unwrap_or_default().to_owned()
    } else {
        format!(
            "{}{}",
            if replayed { "replay " } else { "run " },
            status.as_u16()
        )
    };
    let pending = text == "store-unavailable" || text == "in-flight";
    (text, !pending)
}

/// One cell: the k-th counted store operation fails once; then retries with the same key until
/// the answer is definite, and one more. Returns (the failed operation, effects, answers).
async fn cell<St: IdempotencyStore + Clone>(
    store: &St,
    policy: tower_idempotency::CachePolicy,
    handler: Handler,
    k: usize,
) -> (String, usize, Vec<String>) {
    let faulty = Faulty::new(store.clone());
    faulty.fail_at.store(k, Ordering::SeqCst);
    let effects = Effects::default();
    let layer = IdempotencyLayer::new(faulty.clone())
        .single_tenant()
        .lease(Duration::from_millis(300))
        .cache_policy(policy);
    let addr = serve(matrix_route(layer, effects.clone(), handler)).await;
    let key = unique("matrix");
    let mut answers = Vec::new();
    let (first, _) = answer_of(post_key(addr, &key).await).await;
    answers.push(first);
    let mut definite = 0;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(60)).await;
        let (answer, is_definite) = answer_of(post_key(addr, &key).await).await;
        answers.push(answer);
        if is_definite {
            definite += 1;
            if definite == 2 {
                break;
            }
        }
    }
    let failed = faulty
        .log()
        .get(k - 1)
        .map_or("(none)".to_owned(), |op| (*op).to_owned());
    (failed, effects.count(), answers)
}

/// Issue 15 §9: for every k up to the operations one request performs (and one past them),
/// both policies and three handlers, effects ≤ 1, and once the handler completed every later
/// answer is a replay or "outcome unknown", never a second run; since the store is healthy
/// after its one fault, every cell ends in a replay. Prints its table.
async fn fault_matrix<St: IdempotencyStore + Clone>(store: St) {
    let name = std::any::type_name::<St>()
        .rsplit("::")
        .next()
        .unwrap_or_default();
    use tower_idempotency::CachePolicy;
    let mut rows = Vec::new();
    for (policy_name, policy) in [
        ("definitive", CachePolicy::DefinitiveOnly),
        ("everything", CachePolicy::Everything),
    ] {
        for handler in [Handler::Plain, Handler::Milestone, Handler::Slow] {
            // How many operations one request performs, unfailed.
            let dry = Faulty::new(store.clone());
            let layer = IdempotencyLayer::new(dry.clone())
                .single_tenant()
                .lease(Duration::from_millis(300))
                .cache_policy(policy.clone());
            let addr = serve(matrix_route(layer, Effects::default(), handler)).await;
            post_key(addr, &unique("dry")).await;
            let ops = dry.log().len();
            assert!(ops >= 2, "a request claims and records: {:?}", dry.log());
            for k in 1..=ops + 1 {
                let (failed, effects, answers) = cell(&store, policy.clone(), handler, k).await;
                let cell = format!("{name}/{policy_name}/{handler:?}/k={k} ({failed})");
                rows.push(format!(
                    "{cell:<52} effects={effects} answers={}",
                    answers.join(", ")
                ));
                assert!(effects <= 1, "{cell}: {effects} effects; {answers:?}");
                // Once an answer came from a completed run, nothing runs again.
                if let Some(done) = answers.iter().position(|a| a == "run 201") {
                    for later in &answers[done + 1..] {
                        assert!(
                            later.starts_with("replay")
                                || later == "outcome-unknown"
                                || later == "in-flight"
                                || later == "store-unavailable",
                            "{cell}: a completed key answered {later}; {answers:?}"
                        );
                    }
                }
                // One transient fault, then a healthy store: the holder's retried record
                // lands, so no key is left "outcome unknown".
                let last = answers.last().map(String::as_str).unwrap_or_default();
                assert!(
                    last.starts_with("replay"),
                    "{cell}: no replay at the end; {answers:?}"
                );
            }
        }
    }
    println!("fault matrix on {name}:\n{}", rows.join("\n"));
}

/// Issue 18 §4 (found by the review of issue 15): uncertainty never expires into a second run.
/// The response write fails, the key is left "outcome unknown"; a day later (past the TTL) the
/// retry is still told so, and the handler does not run again.
#[tokio::test]
async fn s18_4_an_unknown_outcome_outlives_its_ttl() {
    let clock = TestClock::default();
    let store = Faulty::new(clock.store());
    store.fail_complete.store(true, Ordering::SeqCst);
    let effects = Effects::default();
    let layer = IdempotencyLayer::new(store.clone())
        .single_tenant()
        .lease(Duration::from_millis(300))
        .ttl(Duration::from_secs(60))
        .on_lease_expiry(LeaseExpiry::Reconcile);
    let addr = serve(effect_route(layer, effects.clone(), true)).await;
    let key = unique("unknown-ttl");
    assert_eq!(post_key(addr, &key).await.status(), StatusCode::CREATED);
    let retry = post_key(addr, &key).await;
    assert_eq!(
        problem(retry).await["type"],
        problem_type("outcome-unknown")
    );
    clock.advance(Duration::from_secs(24 * 3600));
    store.inner.purge_expired().await.expect("purge");
    let later = post_key(addr, &key).await;
    assert_eq!(
        problem(later).await["type"],
        problem_type("outcome-unknown"),
        "past the TTL, still unknown: never a second run"
    );
    assert_eq!(effects.count(), 1);
}

// ---- Every scenario above, on every store ----------------------------------------------------

/// Runs each scenario on a fresh `MemoryStore`, a SQLite file, a PostgreSQL table and a Redis
/// prefix of its own.
macro_rules! on_every_store {
    ($($name:ident => $scenario:ident, $table:literal;)*) => {$(
        mod $name {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_memory() {
                $scenario(MemoryStore::new()).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_sqlite() {
                $scenario(common::sqlite($table).await.0).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_postgres() {
                let Some(store) = common::postgres($table).await else {
                    return;
                };
                $scenario(store).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_redis() {
                let Some(store) = common::redis($table).await else {
                    return;
                };
                $scenario(store).await;
            }
        }
    )*};
}

on_every_store! {
    s15_1_a_short_outage_at_record_time_ends_recorded => short_outage_is_recorded, "faults_records";
    s15_2_a_handler_blocking_its_thread_keeps_its_lease => blocking_handler_keeps_its_lease, "faults_blocking";
    s15_4_a_hang_up_during_the_claim_leaves_nothing_stuck => hang_up_during_claim, "faults_hangup";
    s15_4_a_failed_give_back_is_tried_again => hang_up_during_claim_first_give_back_fails, "faults_give_back";
    s15_4_a_give_back_failing_past_the_lease_never_strands_the_key => give_back_outlasting_the_lease, "faults_give_back_lease";
    s15_4_a_give_back_past_the_lease_releases_without_reads => give_back_past_the_lease_without_reads, "faults_give_back_no_reads";
    s15_5_a_resolved_outcome_is_final => resolution_is_final, "faults_resolved";
    s15_9_the_fault_matrix => fault_matrix, "faults_matrix";
}
