//! Issue 22, the server's half: each guarded route measures how long its executions take and
//! publishes that processing window: in a `409 in-flight`'s `Retry-After` (the time the holder
//! has left by the window, not its whole lease) and through
//! `IdempotencyLayer::processing_windows` (for tool descriptions), per route.

use crate::common;

use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use common::{Effects, serve};
use tower_idempotency::{IdempotencyLayer, MemoryStore, WindowsService};

fn layer() -> IdempotencyLayer<MemoryStore, tower_idempotency::scope::SingleTenant> {
    IdempotencyLayer::new(MemoryStore::new())
        .single_tenant()
        .lease(Duration::from_secs(30))
        .for_path("/fast", |route| route.ttl(Duration::from_secs(3600)))
}

fn app(
    layer: IdempotencyLayer<MemoryStore, tower_idempotency::scope::SingleTenant>,
    effects: Effects,
) -> Router {
    let (slow, fast) = (effects.clone(), effects);
    Router::new()
        .route(
            "/slow",
            post(move || async move {
                tokio::time::sleep(Duration::from_millis(1200)).await;
                slow.hit();
                StatusCode::CREATED
            }),
        )
        .route(
            "/fast",
            post(move || async move {
                fast.hit();
                StatusCode::CREATED
            }),
        )
        .layer(layer)
}

async fn post_key(addr: std::net::SocketAddr, path: &str, key: &str) -> reqwest::Response {
    common::client()
        .post(format!("http://{addr}{path}"))
        .header("idempotency-key", key)
        .send()
        .await
        .expect("request")
}

/// A duplicate of a running request is told to come back when the holder should be done by
/// the route's window: before any execution was measured, the whole lease (30 s); after, what
/// is left of the window (a 1.2 s handler: 1 or 2 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s22_retry_after_follows_the_processing_window() {
    let effects = Effects::default();
    let layer = layer();
    let addr = serve(app(layer.clone(), effects.clone())).await;

    let retry_after = |res: &reqwest::Response| -> u64 {
        res.headers()["retry-after"]
            .to_str()
            .expect("ascii")
            .parse()
            .expect("seconds")
    };
    let first = tokio::spawn(post_key(addr, "/slow", "w-0"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let unmeasured = post_key(addr, "/slow", "w-0").await;
    assert_eq!(unmeasured.status(), StatusCode::CONFLICT);
    assert!(retry_after(&unmeasured) >= 29, "no window yet: the lease");
    first.await.expect("task");
    for i in 1..3 {
        post_key(addr, "/slow", &format!("w-{i}")).await;
    }

    let first = tokio::spawn(post_key(addr, "/slow", "w-9"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let measured = post_key(addr, "/slow", "w-9").await;
    assert_eq!(measured.status(), StatusCode::CONFLICT);
    let seconds = retry_after(&measured);
    assert!(
        (1..=2).contains(&seconds),
        "what is left of a 1.2 s window, not the 30 s lease: {seconds}"
    );
    first.await.expect("task");
    assert_eq!(effects.count(), 4);
}

/// The windows are published per route, with each route's TTL, for tool descriptions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s22_each_route_publishes_its_window_and_ttl() {
    let effects = Effects::default();
    let layer = layer();
    let addr = serve(app(layer.clone(), effects.clone())).await;
    let before = layer.processing_windows();
    assert_eq!(before.len(), 2, "the defaults and /fast");
    assert!(before.iter().all(|w| w.p99.is_none() && w.executions == 0));
    for i in 0..3 {
        post_key(addr, "/slow", &format!("s-{i}")).await;
        post_key(addr, "/fast", &format!("f-{i}")).await;
    }
    let windows = layer.processing_windows();
    let slow = &windows[0];
    let fast = &windows[1];
    assert_eq!(slow.route, None, "/slow runs under the defaults");
    assert_eq!(fast.route.as_deref(), Some("/fast"));
    assert_eq!((slow.executions, fast.executions), (3, 3));
    assert!(slow.p99.expect("measured") >= Duration::from_millis(1200));
    assert!(fast.p99.expect("measured") < Duration::from_millis(1200));
    assert_eq!(slow.ttl, Duration::from_secs(24 * 3600));
    assert_eq!(fast.ttl, Duration::from_secs(3600));
    assert!(slow.min_deadline() >= Duration::from_secs(2));
    let text = slow.describe();
    assert!(
        text.contains("deadline over") && text.contains("1 d"),
        "{text}"
    );
    // Replays are not executions.
    post_key(addr, "/fast", "f-0").await;
    assert_eq!(layer.processing_windows()[1].executions, 3);
    assert_eq!(effects.count(), 6);
}

/// The windows as a document a caller reads before calling (`WindowsService`): a client that
/// reads it builds its layer `for_window`, and a timeout under the window is refused before
/// anything is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s22_callers_read_the_windows_before_calling() {
    use tower_idempotency::ProcessingWindow;
    use tower_idempotency::client::{ClientError, IdempotentClientLayer};

    let effects = Effects::default();
    let layer = layer();
    let app = app(layer.clone(), effects.clone())
        .route_service("/.well-known/idempotency", WindowsService::new(&layer));
    let addr = serve(app).await;
    for i in 0..3 {
        post_key(addr, "/slow", &format!("d-{i}")).await;
    }
    let url = format!("http://{addr}/.well-known/idempotency");
    let res = common::client().get(&url).send().await.expect("document");
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["content-type"], "application/json");
    let document: serde_json::Value = res.json().await.expect("json");
    let windows: Vec<ProcessingWindow> = document["windows"]
        .as_array()
        .expect("a list")
        .iter()
        .map(|w| ProcessingWindow::from_json(w).expect("a window"))
        .collect();
    assert_eq!(
        windows,
        layer.processing_windows(),
        "what the server measured"
    );
    let slow = &windows[0];
    assert_eq!(slow.executions, 3);
    assert!(slow.min_deadline() >= Duration::from_secs(2), "{slow:?}");

    // A client that gives attempts a second against a route that takes 1.2 s is refused.
    let short = IdempotentClientLayer::for_window(slow).attempt_timeout(Duration::from_secs(1));
    assert!(matches!(
        short.check(),
        Err(ClientError::DeadlineTooShort { .. })
    ));
    let enough = IdempotentClientLayer::for_window(slow).attempt_timeout(slow.min_deadline() * 2);
    assert!(enough.check().is_ok());

    // Read-only: other methods are refused; HEAD has no body.
    let post = common::client().post(&url).send().await.expect("post");
    assert_eq!(post.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(post.headers()["allow"], "GET, HEAD");
    let head = common::client().head(&url).send().await.expect("head");
    assert_eq!(head.status(), StatusCode::OK);
    assert!(head.bytes().await.expect("body").is_empty());
    assert_eq!(effects.count(), 3);
}
