//! Review of 8c5442f (`observe::spans_heard`), the `log` side: this suite's `sqlx` turns on
//! `tracing`'s `log` feature, so with no `tracing` dispatcher ever set, the request's span is
//! written to `log` as far as `log` lets its records through. Its own process (no test here sets
//! a dispatcher; `log`'s logger and level are global, so the tests take turns on one lock).
//!
//! The logger here is a well-behaved one: it takes what `log::max_level()` lets through.

mod common;

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Path;
use axum::routing::post;
use common::{Effects, FlakyStore, client, guard, serve, until};
use http_body_util::BodyExt;
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, MemoryStore};

/// Every record `log` let through: (level, target, message).
static SEEN: Mutex<Vec<(log::Level, String, String)>> = Mutex::new(Vec::new());
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
static INSTALL: Once = Once::new();

struct Keep;

impl log::Log for Keep {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            SEEN.lock().expect("lock").push((
                record.level(),
                record.target().to_owned(),
                record.args().to_string(),
            ));
        }
    }

    fn flush(&self) {}
}

static KEEP: Keep = Keep;

/// This test's turn: the logger installed, the level at `level`, nothing seen yet.
async fn turn(level: log::LevelFilter) -> tokio::sync::MutexGuard<'static, ()> {
    let guard = TURN.lock().await;
    assert!(
        !tracing::dispatcher::has_been_set(),
        "these tests need a process without a tracing dispatcher"
    );
    INSTALL.call_once(|| log::set_logger(&KEEP).expect("the only logger"));
    log::set_max_level(level);
    SEEN.lock().expect("lock").clear();
    guard
}

/// The records about the layer's span (its creation, records, enter, exit, close) since the
/// last call.
fn span_records() -> Vec<(log::Level, String, String)> {
    std::mem::take(&mut *SEEN.lock().expect("lock"))
        .into_iter()
        .filter(|(_, _, message)| message.contains("idempotency;"))
        .collect()
}

fn all_records() -> Vec<(log::Level, String, String)> {
    std::mem::take(&mut *SEEN.lock().expect("lock"))
}

/// With `log` at TRACE (more than INFO), on a multi-thread runtime with sixteen concurrent
/// requests: each request's span is written with its own fields and outcome.
///
/// Catches: a reversed comparison (`log::max_level() <= Info`: false at DEBUG and TRACE); a
/// `spans_heard` that only asks `tracing` (`LevelFilter::current()` is OFF in this process).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn log_at_trace_writes_each_concurrent_request_s_span() {
    let _turn = turn(log::LevelFilter::Trace).await;
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/t/{n}",
            post(move |Path(n): Path<u64>| {
                let sink = sink.clone();
                async move {
                    tokio::task::yield_now().await;
                    sink.hit();
                    format!("done {n}")
                }
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    let tasks: Vec<_> = (0..16u64)
        .map(|n| {
            tokio::spawn(async move {
                client()
                    .post(format!("http://{addr}/t/{n}"))
                    .header("idempotency-key", format!("k-{n}"))
                    .body("1")
                    .send()
                    .await
                    .expect("request")
                    .status()
            })
        })
        .collect();
    for task in tasks {
        assert_eq!(guard("a request", task).await.expect("task"), 200);
    }
    let seen = span_records();
    for n in 0..16 {
        let path = format!("path=\"/t/{n}\"");
        assert_eq!(
            seen.iter()
                .filter(|(_, _, m)| m.contains("method=POST") && m.contains(&path))
                .count(),
            1,
            "the span of /t/{n} is written once: {seen:?}"
        );
    }
    assert_eq!(
        seen.iter()
            .filter(|(_, _, m)| m.contains("outcome=\"executed\""))
            .count(),
        16,
        "{seen:?}"
    );
    assert!(
        seen.iter()
            .any(|(level, target, m)| *level == log::Level::Trace
                && target == "tracing::span::active"
                && m.starts_with("-> idempotency;")),
        "entered at TRACE: {seen:?}"
    );
    assert_eq!(effects.count(), 16);
}

/// `log` at WARN: the layer's ERROR event when the store fails still reaches `log`, nothing of
/// the INFO span does (as before the change).
#[tokio::test]
async fn log_at_warn_gets_the_error_and_no_span() {
    let _turn = turn(log::LevelFilter::Warn).await;
    let store = FlakyStore::default();
    let app = Router::new()
        .route("/t", post(|| async { "done" }))
        .layer(IdempotencyLayer::new(store.clone()).single_tenant());
    let addr = serve(app).await;
    store.down.store(true, Ordering::SeqCst);
    let res = client()
        .post(format!("http://{addr}/t"))
        .header("idempotency-key", "w")
        .body("1")
        .send()
        .await
        .expect("request");
    assert_eq!(res.status(), 503);
    let seen = all_records();
    assert!(
        seen.iter()
            .any(|(level, _, m)| *level == log::Level::Error && m.contains("claim failed")),
        "{seen:?}"
    );
    assert!(
        !seen.iter().any(|(_, _, m)| m.contains("idempotency;")),
        "{seen:?}"
    );
}

/// A router guarded by the layer, with a probe outside it that counts the layer's `call`s
/// once they returned (so the layer has decided on the request's span by then), and a route
/// whose execution the test holds.
struct Held {
    router: Router,
    calls: Effects,
    started: Effects,
    effects: Effects,
    go: Arc<Notify>,
}

fn held(wait_for_in_flight: Duration) -> Held {
    let (calls, started, effects, go) = (
        Effects::default(),
        Effects::default(),
        Effects::default(),
        Arc::new(Notify::new()),
    );
    let router = Router::new()
        .route(
            "/op",
            post({
                let (started, effects, go) = (started.clone(), effects.clone(), go.clone());
                move || {
                    let (started, effects, go) = (started.clone(), effects.clone(), go.clone());
                    async move {
                        started.hit();
                        go.notified().await;
                        effects.hit();
                        "done"
                    }
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .wait_for_in_flight(wait_for_in_flight),
        )
        .layer(tower::util::MapFutureLayer::new({
            let calls = calls.clone();
            move |future| {
                // Runs once the inner (the layer's) `call` returned.
                calls.hit();
                future
            }
        }));
    Held {
        router,
        calls,
        started,
        effects,
        go,
    }
}

fn op(key: &str) -> http::Request<Body> {
    http::Request::post("/op")
        .header("idempotency-key", key)
        .body(Body::from("1"))
        .expect("request")
}

async fn answer(
    router: Router,
    req: http::Request<Body>,
) -> Result<(http::StatusCode, http::HeaderMap), Infallible> {
    let res = router.oneshot(req).await?;
    let (parts, body) = res.into_parts();
    body.collect().await.expect("body");
    Ok((parts.status, parts.headers))
}

/// `log` is raised from OFF to INFO while a duplicate waits for the first request
/// (`wait_for_in_flight`). Whether a request's span can be seen is decided when the request
/// arrives (`observe::spans_heard`), as `tracing` decides for a span made while no subscriber
/// takes it: the two requests already in flight keep no span, and nothing is asked of them
/// here. What the raise must reach is every request that arrives after it: a third request for
/// the same key replays, and its span's fields and `outcome = "replayed"` are in `log`.
///
/// Catches: a decision cached past the request (at the layer's build, or at its first request),
/// which would leave the third request without a span.
#[tokio::test]
async fn log_raised_while_requests_wait_reaches_the_requests_after_it() {
    let _turn = turn(log::LevelFilter::Off).await;
    let app = held(Duration::from_secs(20));
    let first = tokio::spawn(answer(app.router.clone(), op("k")));
    until("the first to start", || app.started.count() == 1).await;
    let second = tokio::spawn(answer(app.router.clone(), op("k")));
    until("the duplicate's call", || app.calls.count() == 2).await;
    log::set_max_level(log::LevelFilter::Info);
    app.go.notify_one();
    let (status, _) = guard("the first", first)
        .await
        .expect("task")
        .expect("infallible");
    assert_eq!(status, 200);
    let (status, headers) = guard("the duplicate", second)
        .await
        .expect("task")
        .expect("infallible");
    assert_eq!(status, 200);
    assert_eq!(
        headers
            .get("idempotency-replayed")
            .map(|v| v.to_str().expect("ascii")),
        Some("true")
    );
    span_records();
    let (status, headers) = answer(app.router.clone(), op("k"))
        .await
        .expect("infallible");
    assert_eq!(status, 200);
    assert_eq!(
        headers
            .get("idempotency-replayed")
            .map(|v| v.to_str().expect("ascii")),
        Some("true")
    );
    assert_eq!(app.effects.count(), 1);
    let seen = span_records();
    assert!(
        seen.iter()
            .any(|(level, _, m)| *level == log::Level::Info && m.contains("path=\"/op\"")),
        "the third request's span fields, after log let INFO through: {seen:?}"
    );
    assert!(
        seen.iter()
            .any(|(level, _, m)| *level == log::Level::Info && m.contains("outcome=\"replayed\"")),
        "the third request's replay, after log let INFO through: {seen:?}"
    );
}

/// `log` is raised from OFF to TRACE while an execution runs: the execution in flight keeps no
/// span (decided when it arrived), and the next request's span is written whole, its close at
/// TRACE included.
///
/// Catches: the decision cached past the request; a `log` check that compares against the
/// wrong level (TRACE lets INFO through).
#[tokio::test]
async fn log_raised_while_an_execution_runs_reaches_the_next_request_whole() {
    let _turn = turn(log::LevelFilter::Off).await;
    let app = held(Duration::ZERO);
    let first = tokio::spawn(answer(app.router.clone(), op("k")));
    until("the execution to start", || app.started.count() == 1).await;
    assert_eq!(app.calls.count(), 1);
    log::set_max_level(log::LevelFilter::Trace);
    app.go.notify_one();
    let (status, _) = guard("the execution", first)
        .await
        .expect("task")
        .expect("infallible");
    assert_eq!(status, 200);
    span_records();
    let next = tokio::spawn(answer(app.router.clone(), op("k2")));
    until("the next execution to start", || app.started.count() == 2).await;
    app.go.notify_one();
    let (status, _) = guard("the next", next)
        .await
        .expect("task")
        .expect("infallible");
    assert_eq!(status, 200);
    assert_eq!(app.effects.count(), 2);
    let seen = span_records();
    assert!(
        seen.iter()
            .any(|(_, target, m)| target == "tracing::span" && m.starts_with("-- idempotency;")),
        "the next request's span close, at TRACE: {seen:?}"
    );
    assert!(
        seen.iter()
            .any(|(_, _, m)| m.contains("outcome=\"executed\"")),
        "the next request's outcome: {seen:?}"
    );
}
