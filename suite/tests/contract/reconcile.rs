//! DESIGN §4 and §7 tests 7 and 8: milestones, uncertain outcomes and their reconciliation,
//! proven by counting effects at a downstream fake that deduplicates by the derived key.

use crate::common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use common::{FlakyStore, TestClock, client, problem, problem_type, serve};
use tower_idempotency::reconcile::{
    Reconciler, Reconciliation, Sweeper, downstream_key, resolve_by_hand,
};
use tower_idempotency::store::{
    Claim, ClaimRequest, Fingerprint, Milestone, Record, RecordStatus, ScopedKey, StoredResponse,
};
use tower_idempotency::{
    IdempotencyContext, IdempotencyLayer, IdempotencyStore, LeaseExpiry, MemoryStore,
};

/// A payment provider that honours its own idempotency keys: it counts every network
/// invocation, and applies one effect (a charge) per distinct key.
#[derive(Clone, Default)]
struct Provider(Arc<Mutex<ProviderState>>);

#[derive(Default)]
struct ProviderState {
    invocations: usize,
    charges: HashMap<String, u64>,
}

impl Provider {
    fn charge(&self, key: &str) -> u64 {
        let mut state = self.0.lock().expect("lock");
        state.invocations += 1;
        let next = state.charges.len() as u64 + 1;
        *state.charges.entry(key.to_owned()).or_insert(next)
    }

    fn lookup(&self, key: &str) -> Option<u64> {
        self.0.lock().expect("lock").charges.get(key).copied()
    }

    fn effects(&self) -> usize {
        self.0.lock().expect("lock").charges.len()
    }

    fn invocations(&self) -> usize {
        self.0.lock().expect("lock").invocations
    }
}

/// The answer for a charge: what the handler sends and what reconciliation records.
fn receipt(charge: u64) -> (StatusCode, HeaderMap, Bytes) {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    (
        StatusCode::CREATED,
        headers,
        Bytes::from(format!("{{\"charge\":{charge}}}")),
    )
}

/// Asks the provider about the derived key the handler used.
struct ProviderReconciler(Provider);

impl Reconciler for ProviderReconciler {
    async fn reconcile(&self, record: &Record) -> Reconciliation {
        match self.0.lookup(&downstream_key(&record.key)) {
            Some(charge) => {
                let (status, headers, body) = receipt(charge);
                Reconciliation::Applied(Box::new(StoredResponse {
                    status,
                    headers,
                    body: Some(body),
                    trailers: None,
                }))
            }
            None => Reconciliation::NotApplied,
        }
    }
}

/// Where a fault strikes in one execution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    /// The handler fails after declaring the effect started, before calling the provider.
    BeforeCall,
    /// The provider charges, but its reply is lost.
    ReplyLost,
    /// The provider charges and the handler answers, but recording the response fails.
    RecordFails,
}

#[derive(Clone)]
struct Payments {
    provider: Provider,
    store: FlakyStore,
    /// The fault for each request, in order of arrival (None once the script runs out).
    script: Arc<Mutex<HashMap<String, Vec<Fault>>>>,
    /// How often each fault struck.
    struck: Arc<Mutex<HashMap<&'static str, usize>>>,
}

async fn charge(State(app): State<Payments>, ctx: IdempotencyContext) -> Response {
    let fault = app
        .script
        .lock()
        .expect("lock")
        .get_mut(ctx.key())
        .and_then(|faults| (!faults.is_empty()).then(|| faults.remove(0)))
        .unwrap_or(Fault::None);
    *app.struck
        .lock()
        .expect("lock")
        .entry(match fault {
            Fault::None => "none",
            Fault::BeforeCall => "before_call",
            Fault::ReplyLost => "reply_lost",
            Fault::RecordFails => "record_fails",
        })
        .or_default() += 1;
    if ctx.effect_started().await.is_err() {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    if fault == Fault::BeforeCall {
        return (StatusCode::BAD_GATEWAY, "provider unreachable").into_response();
    }
    let charge = app.provider.charge(&ctx.downstream_key());
    match fault {
        Fault::ReplyLost => (StatusCode::GATEWAY_TIMEOUT, "provider reply lost").into_response(),
        Fault::RecordFails => {
            app.store
                .fail_complete_once
                .lock()
                .expect("lock")
                .insert(ctx.key().to_owned());
            receipt(charge).into_response()
        }
        _ => receipt(charge).into_response(),
    }
}

async fn payments_server(store: FlakyStore, provider: Provider) -> (SocketAddr, Payments) {
    let app = Payments {
        provider,
        store: store.clone(),
        script: Arc::default(),
        struck: Arc::default(),
    };
    let router = Router::new()
        .route("/charge", post(charge))
        .with_state(app.clone())
        .layer(IdempotencyLayer::new(store).single_tenant());
    (serve(router).await, app)
}

async fn pay(addr: SocketAddr, key: &str) -> reqwest::Response {
    client()
        .post(format!("http://{addr}/charge"))
        .header("idempotency-key", key)
        .body("amount=100")
        .send()
        .await
        .expect("request")
}

#[tokio::test]
async fn s7_7_response_write_fails_then_reconciliation_replays_the_real_response() {
    let provider = Provider::default();
    let store = FlakyStore::default();
    let (addr, app) = payments_server(store.clone(), provider.clone()).await;
    app.script
        .lock()
        .expect("lock")
        .insert("k-77".into(), vec![Fault::RecordFails]);

    let first = pay(addr, "k-77").await;
    assert_eq!(
        first.status(),
        StatusCode::CREATED,
        "the client still gets the real answer"
    );
    let first_body = first.bytes().await.expect("body");
    for _ in 0..3 {
        let retry = pay(addr, "k-77").await;
        assert_eq!(retry.status(), StatusCode::CONFLICT);
        assert_eq!(
            problem(retry).await["type"],
            problem_type("outcome-unknown")
        );
    }
    assert_eq!(
        provider.invocations(),
        1,
        "never executed again while unknown"
    );

    let sweeper = Sweeper::new(store.clone(), ProviderReconciler(provider.clone()));
    let report = sweeper.run_once().await.expect("sweep");
    assert_eq!(report.applied, 1);
    let replay = pay(addr, "k-77").await;
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(
        replay.bytes().await.expect("body"),
        first_body,
        "the real response"
    );
    assert_eq!((provider.invocations(), provider.effects()), (1, 1));
}

/// A small deterministic generator, so a failing seed can be replayed.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn fault(&mut self) -> Fault {
        match self.next() % 8 {
            0 => Fault::BeforeCall,
            1 => Fault::ReplyLost,
            2 => Fault::RecordFails,
            _ => Fault::None,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_8_randomized_faults_on_both_sides_of_the_provider_never_duplicate_or_lose() {
    const KEYS: usize = 300;
    let seed = std::env::var("FAULT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x9E37_79B9_7F4A_7C15u64);
    println!("fault seed {seed} (set FAULT_SEED to replay)");
    let mut rng = XorShift(seed);
    let provider = Provider::default();
    let store = FlakyStore::default();
    let (addr, app) = payments_server(store.clone(), provider.clone()).await;
    let keys: Vec<String> = (0..KEYS).map(|i| format!("pay-{i}")).collect();
    {
        let mut script = app.script.lock().expect("lock");
        for key in &keys {
            let faults = (0..rng.next() % 4).map(|_| rng.fault()).collect();
            script.insert(key.clone(), faults);
        }
    }
    let sweeper = Arc::new(Sweeper::new(
        store.clone(),
        ProviderReconciler(provider.clone()),
    ));

    let workers: Vec<_> = keys
        .chunks(KEYS / 6)
        .map(|chunk| {
            let (chunk, sweeper) = (chunk.to_vec(), sweeper.clone());
            tokio::spawn(async move {
                let mut answers = Vec::new();
                for key in chunk {
                    // The client retries with the same key until it has a definite answer.
                    let mut answer = None;
                    for _ in 0..30 {
                        let res = pay(addr, &key).await;
                        let status = res.status();
                        if status == StatusCode::CREATED {
                            answer = Some(res.bytes().await.expect("body"));
                            break;
                        }
                        if status == StatusCode::CONFLICT {
                            // Outcome unknown: what an operator's sweeper would settle.
                            sweeper.run_once().await.expect("sweep");
                        }
                    }
                    answers.push((key, answer));
                }
                answers
            })
        })
        .collect();

    let mut answered = 0;
    for worker in workers {
        for (key, answer) in worker.await.expect("worker") {
            let charge = provider
                .lookup(&downstream_key(&ScopedKey::new("", key.clone())))
                .unwrap_or_else(|| panic!("{key} was never charged"));
            let body = answer.unwrap_or_else(|| panic!("{key} never got a definite answer"));
            assert_eq!(
                body,
                receipt(charge).2,
                "{key}: the answer is its own charge"
            );
            let record = store
                .lookup(&ScopedKey::new("", key.clone()))
                .await
                .expect("lookup");
            let status = record.map(|r| r.status);
            assert!(
                matches!(
                    status,
                    Some(RecordStatus::Completed | RecordStatus::NeedsReconciliation)
                ),
                "{key} ended {status:?}: none silently lost"
            );
            answered += 1;
        }
    }
    assert_eq!(answered, KEYS);
    let struck = app.struck.lock().expect("lock").clone();
    println!("faults struck: {struck:?}");
    for fault in ["before_call", "reply_lost", "record_fails"] {
        assert!(
            struck.get(fault).copied().unwrap_or(0) >= 10,
            "too few {fault}: {struck:?}"
        );
    }
    assert_eq!(provider.effects(), KEYS, "effects == distinct keys");
    // Stronger than the provider's own dedup: once an effect may have happened, no attempt
    // calls the provider again; only attempts that failed before calling it are retried.
    assert_eq!(provider.invocations(), KEYS, "one provider call per key");
}

/// A server on its own runtime and thread, so the test can kill it, renewals and all, the way a
/// process dies: the returned sender's message shuts the runtime down mid-handler.
fn doomed_server(
    store: MemoryStore,
    provider: Provider,
    started: bool,
) -> (SocketAddr, std::sync::mpsc::Sender<()>) {
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (kill_tx, kill_rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let addr = runtime.block_on(async move {
            let app = Router::new()
                .route(
                    "/charge",
                    post(move |ctx: IdempotencyContext| async move {
                        if started {
                            ctx.effect_started().await.expect("milestone");
                        }
                        provider.charge(&ctx.downstream_key());
                        // Then the process hangs until it is killed.
                        std::future::pending::<()>().await;
                        StatusCode::CREATED
                    }),
                )
                .layer(
                    IdempotencyLayer::new(store)
                        .single_tenant()
                        .lease(Duration::from_secs(10)),
                );
            serve(app).await
        });
        addr_tx.send(addr).expect("send addr");
        let _ = kill_rx.recv();
        runtime.shutdown_background();
    });
    (addr_rx.recv().expect("addr"), kill_tx)
}

async fn killed_holder(
    started: bool,
    external_effects: bool,
) -> (MemoryStore, TestClock, Provider, SocketAddr) {
    let clock = TestClock::default();
    let store = clock.store();
    let provider = Provider::default();
    let (dead, kill) = doomed_server(store.clone(), provider.clone(), started);
    // Fire the request and wait until the holder is mid-handler.
    let pending = tokio::spawn(pay(dead, "k-killed"));
    for _ in 0..200 {
        if provider.invocations() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(provider.invocations(), 1);
    kill.send(()).expect("kill"); // the process dies: no renewal, no recording
    tokio::time::sleep(Duration::from_millis(100)).await;
    pending.abort();
    // A live process on the same store answers from now on.
    let provider_live = provider.clone();
    let live = serve(
        Router::new()
            .route(
                "/charge",
                post(move |ctx: IdempotencyContext| async move {
                    let charge = provider_live.charge(&ctx.downstream_key());
                    receipt(charge)
                }),
            )
            .layer(
                IdempotencyLayer::new(store.clone())
                    .single_tenant()
                    .lease(Duration::from_secs(10))
                    .external_effects(external_effects),
            ),
    )
    .await;
    assert_eq!(
        pay(live, "k-killed").await.status(),
        StatusCode::CONFLICT,
        "lease still live"
    );
    clock.advance(Duration::from_secs(11));
    (store, clock, provider, live)
}

#[tokio::test]
async fn s4_holder_killed_after_effect_started_needs_reconciliation_never_a_rerun() {
    let (store, _clock, provider, live) = killed_holder(true, false).await;
    for _ in 0..3 {
        let res = pay(live, "k-killed").await;
        assert_eq!(res.status(), StatusCode::CONFLICT);
        let p = problem(res).await;
        assert_eq!(p["type"], problem_type("outcome-unknown"));
        assert_eq!(p["safe_new_key"], false);
    }
    assert_eq!(provider.invocations(), 1, "never a second execution");
    let record = store
        .lookup(&ScopedKey::new("", "k-killed"))
        .await
        .expect("lookup")
        .expect("record");
    assert_eq!(record.status, RecordStatus::NeedsReconciliation);

    // An operator who checked the provider settles it by hand; the retry then replays.
    let charge = provider
        .lookup(&downstream_key(&record.key))
        .expect("charged");
    let (status, headers, body) = receipt(charge);
    let response = StoredResponse {
        status,
        headers,
        body: Some(body.clone()),
        trailers: None,
    };
    resolve_by_hand(
        &store,
        &record.key,
        Reconciliation::Applied(Box::new(response)),
        Duration::from_secs(60),
        "checked downstream",
    )
    .await
    .expect("resolve");
    let replay = pay(live, "k-killed").await;
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(replay.bytes().await.expect("body"), body);
    assert_eq!(provider.invocations(), 1);
}

#[tokio::test]
async fn s4_holder_killed_before_effect_started_is_taken_over_once() {
    let (_store, _clock, provider, live) = killed_holder(false, false).await;
    let res = pay(live, "k-killed").await;
    assert_eq!(
        res.status(),
        StatusCode::CREATED,
        "a reclaim route takes the dead holder's key"
    );
    let again = pay(live, "k-killed").await;
    assert_eq!(again.headers()["idempotency-replayed"], "true");
    assert_eq!(
        provider.invocations(),
        2,
        "the dead attempt and exactly one takeover"
    );
    assert_eq!(
        provider.effects(),
        1,
        "the provider's own key kept the effect single"
    );
}

fn order_receipt() -> StoredResponse {
    let (status, headers, body) = receipt(42);
    StoredResponse {
        status,
        headers,
        body: Some(body),
        trailers: None,
    }
}

/// One business transaction: it inserts an order and records the milestone and the result with
/// it, then commits or rolls back; order, milestone and result must stand or fall together.
/// A macro because the two databases' connection types differ.
macro_rules! business_transaction {
    ($store:expr, $commit:expr, $order:expr, $insert:literal, $count:literal) => {{
        let (store, commit, order): (_, bool, &str) = (&$store, $commit, $order);
        let key = ScopedKey::new("tx", format!("tx-{order}"));
        let _ = store.remove(&key).await;
        let claim = ClaimRequest {
            key: key.clone(),
            fingerprint: Fingerprint::from_bytes([7; 32]),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(300),
            on_lease_expiry: LeaseExpiry::Reclaim,
        };
        let Ok(Claim::Acquired(lease)) = store.claim(&claim).await else {
            panic!("claim")
        };
        let mut tx = store.pool().begin().await.expect("begin");
        sqlx::query($insert)
            .bind(order)
            .execute(&mut *tx)
            .await
            .expect("insert");
        store
            .record_milestone_in(&mut tx, &key, lease.token, &Milestone::EffectStarted)
            .await
            .expect("milestone");
        store
            .complete_in(
                &mut tx,
                &key,
                lease.token,
                &order_receipt(),
                Duration::from_secs(60),
            )
            .await
            .expect("complete");
        if commit {
            tx.commit().await.expect("commit");
        } else {
            tx.rollback().await.expect("rollback");
        }
        let record = store.lookup(&key).await.expect("lookup").expect("record");
        let rows: i64 = sqlx::query_scalar($count)
            .bind(order)
            .fetch_one(store.pool())
            .await
            .expect("count");
        if commit {
            assert_eq!(rows, 1);
            assert!(
                record.effect_started,
                "the milestone committed with the business write"
            );
            assert_eq!(
                record.status,
                RecordStatus::Completed,
                "and so did the result"
            );
            assert_eq!(record.response, Some(order_receipt()));
            // The layer records the live response afterwards, with the same token: allowed.
            store
                .complete(&key, lease.token, &order_receipt(), Duration::from_secs(60))
                .await
                .expect("the holder completes again");
        } else {
            assert_eq!(rows, 0);
            assert!(
                !record.effect_started,
                "the milestone rolled back with the business write"
            );
            assert_eq!(
                record.status,
                RecordStatus::InProgress,
                "and so did the result"
            );
            assert_eq!(record.response, None);
        }
    }};
}

#[tokio::test]
async fn s4_transactional_milestone_and_result_on_sqlite_commit_and_roll_back_with_the_business_write()
 {
    let (store, _) = common::sqlite("tx").await;
    sqlx::query("CREATE TABLE orders (key TEXT PRIMARY KEY)")
        .execute(store.pool())
        .await
        .expect("orders table");
    for commit in [true, false] {
        let order = format!("order-{commit}");
        // A write that escaped the transaction would wait on its lock: fail, do not hang.
        tokio::time::timeout(Duration::from_secs(30), async {
            business_transaction!(
                store,
                commit,
                &order,
                "INSERT INTO orders (key) VALUES (?1)",
                "SELECT COUNT(*) FROM orders WHERE key = ?1"
            );
        })
        .await
        .expect("the business transaction finished");
    }
}

#[tokio::test]
async fn s4_transactional_milestone_and_result_on_postgres_commit_and_roll_back_with_the_business_write()
 {
    let Some(store) = common::postgres("tower_idempotency_tx").await else {
        return;
    };
    sqlx::query("CREATE TABLE IF NOT EXISTS tower_idempotency_orders (key text PRIMARY KEY)")
        .execute(store.pool())
        .await
        .expect("orders table");
    for commit in [true, false] {
        let order = format!("order-{commit}-{}", std::process::id());
        sqlx::query("DELETE FROM tower_idempotency_orders WHERE key = $1")
            .bind(&order)
            .execute(store.pool())
            .await
            .expect("clean");
        // A write that escaped the transaction would wait on its lock: fail, do not hang.
        tokio::time::timeout(Duration::from_secs(30), async {
            business_transaction!(
                store,
                commit,
                &order,
                "INSERT INTO tower_idempotency_orders (key) VALUES ($1)",
                "SELECT COUNT(*) FROM tower_idempotency_orders WHERE key = $1"
            );
        })
        .await
        .expect("the business transaction finished");
    }
}

#[tokio::test]
async fn s4_a_route_with_external_effects_never_takes_a_dead_holders_key_over() {
    let (store, _clock, provider, live) = killed_holder(false, true).await;
    let res = pay(live, "k-killed").await;
    assert_eq!(res.status(), StatusCode::CONFLICT);
    assert_eq!(problem(res).await["type"], problem_type("outcome-unknown"));
    assert_eq!(
        provider.invocations(),
        1,
        "no takeover without knowing what happened"
    );
    let record = store
        .lookup(&ScopedKey::new("", "k-killed"))
        .await
        .expect("lookup");
    assert_eq!(
        record.map(|r| r.status),
        Some(RecordStatus::NeedsReconciliation)
    );
}

#[tokio::test]
async fn s6_the_key_history_records_attempts_and_refusals_for_review() {
    use tower_idempotency::store::HistoryEvent;
    let store = MemoryStore::new();
    let calls = Provider::default();
    let p = calls.clone();
    let app = Router::new()
        .route(
            "/charge",
            post(move |ctx: IdempotencyContext, body: String| async move {
                if body == "slow" {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                receipt(p.charge(&ctx.downstream_key()))
            }),
        )
        .layer(
            IdempotencyLayer::new(store.clone())
                .single_tenant()
                .record_refusals(true),
        );
    let addr = serve(app).await;
    let send = |body: &'static str| {
        client()
            .post(format!("http://{addr}/charge"))
            .header("idempotency-key", "k-history")
            .body(body)
            .send()
    };
    let first = tokio::spawn(send("slow"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        send("slow").await.expect("r").status(),
        StatusCode::CONFLICT
    );
    assert_eq!(
        first.await.expect("task").expect("r").status(),
        StatusCode::CREATED
    );
    assert_eq!(send("slow").await.expect("r").status(), StatusCode::CREATED);
    assert_eq!(
        send("other").await.expect("r").status(),
        StatusCode::UNPROCESSABLE_ENTITY
    );

    let record = store
        .lookup(&ScopedKey::new("", "k-history"))
        .await
        .expect("lookup")
        .expect("record");
    let events: Vec<_> = record.history.iter().map(|e| e.event).collect();
    assert_eq!(
        events,
        [
            HistoryEvent::Claimed,
            HistoryEvent::Conflict,
            HistoryEvent::Completed,
            HistoryEvent::Replayed,
            HistoryEvent::Mismatch,
        ]
    );
    assert!(
        record
            .history
            .iter()
            .all(|e| e.attempt == 1 && e.token == record.lease_token)
    );
    assert_eq!(calls.invocations(), 1);
}
