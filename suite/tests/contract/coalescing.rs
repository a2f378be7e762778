//! Issue 21, coalescing: on a route that waits for in-flight keys (`wait_for_in_flight`), the
//! duplicates that arrive while the first runs wait for its outcome, woken by the store when
//! the record moves on (MemoryStore in process, RedisStore by pub/sub; a store that does not
//! implement it polls), and answer with its replay. Effects are counted in the handler.

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use common::faulty::Faulty;
use common::{Effects, problem, problem_type, serve};
use tokio::sync::Barrier;
use tower_idempotency::{IdempotencyLayer, IdempotencyStore, MemoryStore};

/// A write endpoint that works `ms` milliseconds (from the query), and panics on its first
/// run when asked to (`panic=1`): a holder that fails and gives the key back.
fn app<St: IdempotencyStore>(store: St, effects: Effects, wait: Duration) -> Router {
    Router::new()
        .route(
            "/refunds",
            post(move |query: axum::extract::RawQuery| async move {
                let query = query.0.unwrap_or_default();
                let ms = query
                    .split('&')
                    .find_map(|p| p.strip_prefix("ms=")?.parse().ok())
                    .unwrap_or(0);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                let n = effects.hit();
                if query.contains("panic=1") && n == 1 {
                    panic!("the first run fails");
                }
                (StatusCode::CREATED, format!("refund {n}"))
            }),
        )
        .layer(
            IdempotencyLayer::new(store)
                .single_tenant()
                .wait_for_in_flight(wait),
        )
}

fn unique(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{name}-{nanos}")
}

/// `n` requests with one key spread over `replicas`, the first alone and the rest released
/// together while it runs; each answer's status, whether it is a replay, and its body.
async fn duplicates(
    replicas: &[SocketAddr],
    key: &str,
    n: usize,
    query: &str,
) -> Vec<(StatusCode, bool, String)> {
    let send = |addr: SocketAddr, client: reqwest::Client| {
        let request = client
            .post(format!("http://{addr}/refunds?{query}"))
            .header("idempotency-key", key)
            .body("refund order 7");
        async move {
            let res = request.send().await.expect("request");
            let replayed = res.headers().contains_key("idempotency-replayed");
            (res.status(), replayed, res.text().await.expect("body"))
        }
    };
    let first = tokio::spawn(send(replicas[0], common::client()));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let barrier = Arc::new(Barrier::new(n - 1));
    let clients: Vec<reqwest::Client> = (0..8).map(|_| common::client()).collect();
    let rest: Vec<_> = (1..n)
        .map(|i| {
            let answer = send(replicas[i % replicas.len()], clients[i % 8].clone());
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                answer.await
            })
        })
        .collect();
    let mut answers = vec![first.await.expect("first")];
    for task in rest {
        answers.push(task.await.expect("duplicate"));
    }
    answers
}

/// Every duplicate gets the first's bytes as a replay, and the handler ran once.
fn assert_coalesced(answers: &[(StatusCode, bool, String)], effects: &Effects) {
    assert_eq!(effects.count(), 1, "one run for every request");
    let (status, replayed, body) = &answers[0];
    assert_eq!((*status, *replayed), (StatusCode::CREATED, false));
    for (i, answer) in answers.iter().enumerate().skip(1) {
        assert_eq!(
            answer,
            &(StatusCode::CREATED, true, body.clone()),
            "duplicate {i} waited and replayed the first's answer"
        );
    }
}

/// 200 duplicates of a running request on MemoryStore wait for it and replay its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_waiters_replay_the_first_on_memory() {
    let effects = Effects::default();
    let store = MemoryStore::new();
    let addr = serve(app(store, effects.clone(), Duration::from_secs(20))).await;
    let answers = duplicates(&[addr], &unique("memory"), 200, "ms=500").await;
    assert_coalesced(&answers, &effects);
}

/// A store that does not implement `wait_for_change` (the test wrapper keeps the trait's
/// polling default) coalesces all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_a_store_without_wakeups_polls_and_coalesces() {
    let effects = Effects::default();
    let store = Faulty::new(MemoryStore::new());
    let addr = serve(app(store, effects.clone(), Duration::from_secs(20))).await;
    let answers = duplicates(&[addr], &unique("polling"), 50, "ms=500").await;
    assert_coalesced(&answers, &effects);
}

/// 200 duplicates across three replicas sharing one Redis, woken by pub/sub: one run, every
/// duplicate gets its bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_waiters_across_three_replicas_replay_the_first_on_redis() {
    let effects = Effects::default();
    let prefix = common::redis_prefix("coalesce");
    let mut replicas = Vec::new();
    for _ in 0..3 {
        let Some(store) = common::redis("coalesce").await else {
            return;
        };
        let store = store.with_prefix(&prefix).expect("prefix");
        replicas.push(serve(app(store, effects.clone(), Duration::from_secs(20))).await);
    }
    let answers = duplicates(&replicas, &unique("redis"), 200, "ms=500").await;
    assert_coalesced(&answers, &effects);
}

/// The same on the Redis Cluster (one subscription to a node hears the whole cluster).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_waiters_replay_the_first_on_a_redis_cluster() {
    let effects = Effects::default();
    let prefix = common::redis_prefix("coalesce-cluster");
    let mut replicas = Vec::new();
    for _ in 0..3 {
        let Some(store) = common::redis_cluster("coalesce").await else {
            return;
        };
        let store = store.with_prefix(&prefix).expect("prefix");
        replicas.push(serve(app(store, effects.clone(), Duration::from_secs(20))).await);
    }
    let answers = duplicates(&replicas, &unique("cluster"), 60, "ms=500").await;
    assert_coalesced(&answers, &effects);
}

/// A waiter whose wait passes before the first finishes gets the usual 409 with
/// `Retry-After`; the first's answer is unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_a_wait_that_passes_ends_in_409() {
    let effects = Effects::default();
    let addr = serve(app(
        MemoryStore::new(),
        effects.clone(),
        Duration::from_millis(200),
    ))
    .await;
    let answers = duplicates(&[addr], &unique("short"), 5, "ms=1500").await;
    assert_eq!(answers[0].0, StatusCode::CREATED);
    for answer in &answers[1..] {
        assert_eq!(answer.0, StatusCode::CONFLICT, "{answer:?}");
    }
    let res = common::client()
        .post(format!("http://{addr}/refunds?ms=1500"))
        .header("idempotency-key", "never-started")
        .body("refund order 7")
        .send();
    // A fresh key is not waited on: it runs.
    assert_eq!(res.await.expect("request").status(), StatusCode::CREATED);
    let first = common::client()
        .post(format!("http://{addr}/refunds?ms=1500"))
        .header("idempotency-key", "held")
        .body("refund order 7")
        .send();
    let first = tokio::spawn(first);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let waited = common::client()
        .post(format!("http://{addr}/refunds?ms=1500"))
        .header("idempotency-key", "held")
        .body("refund order 7")
        .send()
        .await
        .expect("request");
    assert_eq!(waited.status(), StatusCode::CONFLICT);
    assert!(waited.headers().contains_key("retry-after"));
    assert_eq!(problem(waited).await["type"], problem_type("in-flight"));
    assert_eq!(
        first.await.expect("task").expect("first").status(),
        StatusCode::CREATED
    );
}

/// A holder that fails gives the key back: exactly one waiter takes it over and runs, the
/// others replay that run's answer, never a third run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_a_released_key_lets_exactly_one_waiter_run() {
    for name in ["memory", "redis"] {
        let effects = Effects::default();
        let addr = match name == "memory" {
            true => {
                serve(app(
                    MemoryStore::new(),
                    effects.clone(),
                    Duration::from_secs(20),
                ))
                .await
            }
            false => {
                let Some(store) = common::redis("released").await else {
                    return;
                };
                serve(app(store, effects.clone(), Duration::from_secs(20))).await
            }
        };
        let answers = duplicates(&[addr], &unique(name), 50, "ms=300&panic=1").await;
        assert_eq!(
            answers[0].0,
            StatusCode::INTERNAL_SERVER_ERROR,
            "{name}: the first failed"
        );
        assert_eq!(effects.count(), 2, "{name}: one takeover, never two");
        let runs = answers[1..].iter().filter(|a| !a.1).count();
        assert_eq!(runs, 1, "{name}: one waiter ran");
        let body = answers[1..]
            .iter()
            .find(|a| !a.1)
            .map(|a| a.2.clone())
            .expect("the run");
        assert_eq!(body, "refund 2");
        for answer in &answers[1..] {
            assert_eq!(
                (answer.0, &answer.2),
                (StatusCode::CREATED, &body),
                "{name}"
            );
        }
    }
}

/// Waiting clients that hang up cost nothing: they stop waiting, and the first's outcome is
/// recorded and replayed as ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_waiters_that_hang_up_cost_nothing() {
    let effects = Effects::default();
    let store = MemoryStore::new();
    let addr = serve(app(store, effects.clone(), Duration::from_secs(20))).await;
    let key = unique("hang-up");
    let first = tokio::spawn(
        common::client()
            .post(format!("http://{addr}/refunds?ms=800"))
            .header("idempotency-key", &key)
            .body("refund order 7")
            .send(),
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(100))
        .build()
        .expect("client");
    // All at once, while the first runs: each gives up after 100 ms of waiting.
    let gone: Vec<_> = (0..50)
        .map(|_| {
            tokio::spawn(
                impatient
                    .post(format!("http://{addr}/refunds?ms=800"))
                    .header("idempotency-key", &key)
                    .body("refund order 7")
                    .send(),
            )
        })
        .collect();
    for waiter in gone {
        let answer = waiter.await.expect("task");
        assert!(answer.is_err(), "the impatient client gave up: {answer:?}");
    }
    let first = first.await.expect("task").expect("first");
    assert_eq!(first.status(), StatusCode::CREATED);
    let replay = common::client()
        .post(format!("http://{addr}/refunds?ms=800"))
        .header("idempotency-key", &key)
        .body("refund order 7")
        .send()
        .await
        .expect("replay");
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(effects.count(), 1);
}

/// Store operations per waiter are bounded, whatever the first's run time: woken, a waiter
/// claims once, waits, and reads the recorded outcome for its replay; polling, it claims again
/// at every backoff step. Counted at the store, over a first that runs 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_a_woken_waiter_claims_once_however_long_the_first_runs() {
    const WAITERS: usize = 20;
    let mut claims = Vec::new();
    for wake in [true, false] {
        let effects = Effects::default();
        let store = Faulty::new(MemoryStore::new());
        store.wake.store(wake, std::sync::atomic::Ordering::SeqCst);
        let addr = serve(app(store.clone(), effects.clone(), Duration::from_secs(20))).await;
        let answers = duplicates(&[addr], &unique("count"), WAITERS + 1, "ms=2000").await;
        assert_coalesced(&answers, &effects);
        let n = store.log().iter().filter(|op| **op == "claim").count();
        claims.push(n);
    }
    let (woken, polling) = (claims[0], claims[1]);
    assert!(
        woken <= 1 + WAITERS + 2,
        "woken: {woken} claims for 1 first and {WAITERS} waiters"
    );
    assert!(
        polling > 4 * WAITERS,
        "the polling control claims at every step: {polling}"
    );
}

/// Starts a store's change subscription (it opens on the first wait) and gives it time to
/// connect, as a server that has run a while has it: the first waits otherwise poll.
async fn listening<St: IdempotencyStore>(store: &St) {
    let now = std::time::SystemTime::now();
    let seen = tower_idempotency::store::InFlight {
        token: tower_idempotency::store::FencingToken::new(1),
        lease_until: now,
        now,
    };
    let nobody = tower_idempotency::ScopedKey::new("", "nobody");
    store
        .wait_for_change(&nobody, &seen, 0, Duration::from_millis(1))
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
}

/// 200 duplicates across three replicas sharing one PostgreSQL, woken by LISTEN/NOTIFY: one
/// run, every duplicate gets its bytes, and each waiter claims once (counted at the store):
/// the replay is read, not claimed, so the waiters never queue on the row's lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_waiters_across_three_replicas_replay_the_first_on_postgres() {
    let effects = Effects::default();
    let mut replicas = Vec::new();
    let mut stores = Vec::new();
    for _ in 0..3 {
        // Each replica has its own pool and its own LISTEN connection.
        let Some(store) = common::postgres("tower_idempotency_coalescing").await else {
            return;
        };
        let store = Faulty::new(store);
        store.wake.store(true, std::sync::atomic::Ordering::SeqCst);
        listening(&store).await;
        stores.push(store.clone());
        replicas.push(serve(app(store, effects.clone(), Duration::from_secs(20))).await);
    }
    let answers = duplicates(&replicas, &unique("postgres"), 200, "ms=1500").await;
    assert_coalesced(&answers, &effects);
    let claims: usize = stores
        .iter()
        .map(|s| s.log().iter().filter(|op| **op == "claim").count())
        .sum();
    assert!(
        claims <= 1 + 199 + 6,
        "woken: {claims} claims for 1 first and 199 waiters"
    );
}

/// A holder that dies (its handler hangs and its lease is never renewed, as a crashed
/// process's is not) lets its waiters take over at its lease end, per the lease rules:
/// exactly one of them runs, the others replay that run; never two runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_a_dead_holder_lets_exactly_one_waiter_take_over() {
    let effects = Effects::default();
    let store = Faulty::new(MemoryStore::new());
    store.wake.store(true, std::sync::atomic::Ordering::SeqCst);
    store
        .fail_renew
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let sink = effects.clone();
    let runs = Effects::default();
    let started = runs.clone();
    let app = Router::new()
        .route(
            "/refunds",
            post(move || async move {
                // The first run hangs before its effect, as a process that died there.
                if started.hit() == 1 {
                    std::future::pending::<()>().await;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
                let n = sink.hit();
                (StatusCode::CREATED, format!("refund {n}"))
            }),
        )
        .layer(
            IdempotencyLayer::new(store)
                .single_tenant()
                .lease(Duration::from_millis(400))
                .wait_for_in_flight(Duration::from_secs(20)),
        );
    let addr = serve(app).await;
    let key = unique("dead");
    let send = || {
        common::client()
            .post(format!("http://{addr}/refunds"))
            .header("idempotency-key", &key)
            .body("refund order 7")
            .send()
    };
    let _holder = tokio::spawn(send());
    tokio::time::sleep(Duration::from_millis(100)).await;
    let waiters: Vec<_> = (0..30).map(|_| tokio::spawn(send())).collect();
    let mut bodies = Vec::new();
    for waiter in waiters {
        let res = waiter.await.expect("task").expect("answer");
        assert_eq!(res.status(), StatusCode::CREATED);
        bodies.push(res.text().await.expect("body"));
    }
    assert_eq!(effects.count(), 1, "one takeover ran, never two");
    assert_eq!(runs.count(), 2, "the dead holder's run and one takeover");
    assert!(bodies.iter().all(|b| b == "refund 1"), "{bodies:?}");
}
