//! Issue 22, the caller's half: `IdempotentClientLayer` on hyper-util's client, against a real
//! server behind the layer over TCP. Effects are counted in the handler.

use crate::common;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use bytes::Bytes;
use common::faulty::Faulty;
use common::{Effects, serve};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::ServiceExt;
use tower_idempotency::client::{
    CallReport, ClientError, Ended, IdempotentClientLayer, OperationKey,
};
use tower_idempotency::{IdempotencyLayer, IdempotencyStore, LeaseExpiry, MemoryStore};

/// A refund endpoint: works `ms` (from the query), fails with 500 on its first run when asked
/// (`fail=1`), hangs on its first run when asked (`hang=1`).
fn app<St: IdempotencyStore>(store: St, effects: Effects, lease: Duration) -> Router {
    let runs = Effects::default();
    Router::new()
        .route(
            "/refunds",
            post(move |query: axum::extract::RawQuery, body: Bytes| {
                let (effects, runs) = (effects.clone(), runs.clone());
                async move {
                    let query = query.0.unwrap_or_default();
                    let ms = query
                        .split('&')
                        .find_map(|p| p.strip_prefix("ms=")?.parse().ok())
                        .unwrap_or(0);
                    let run = runs.hit();
                    if query.contains("hang=1") && run == 1 {
                        std::future::pending::<()>().await;
                    }
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    if query.contains("fail=1") && run == 1 {
                        return (StatusCode::INTERNAL_SERVER_ERROR, "ledger down".to_owned());
                    }
                    let n = effects.hit();
                    (
                        StatusCode::CREATED,
                        format!("refund {n} of {} bytes", body.len()),
                    )
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(store)
                .single_tenant()
                .lease(lease)
                .on_lease_expiry(LeaseExpiry::Reconcile),
        )
}

type Http = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

fn http() -> Http {
    Client::builder(TokioExecutor::new()).build_http()
}

fn request(
    addr: SocketAddr,
    query: &str,
    key: Option<&OperationKey>,
    body: &'static [u8],
) -> http::Request<Full<Bytes>> {
    let mut req = http::Request::post(format!("http://{addr}/refunds?{query}"))
        .body(Full::new(Bytes::from_static(body)))
        .expect("request");
    if let Some(key) = key {
        req.extensions_mut().insert(key.clone());
    }
    req
}

async fn call(
    layer: &IdempotentClientLayer,
    req: http::Request<Full<Bytes>>,
) -> Result<(StatusCode, String, CallReport), ClientError> {
    let client = tower::ServiceBuilder::new()
        .layer(layer.clone())
        .service(http());
    let res = client.oneshot(req).await?;
    let report = res
        .extensions()
        .get::<CallReport>()
        .cloned()
        .expect("report");
    let status = res.status();
    let body = http_body_util::BodyExt::collect(res.into_body())
        .await
        .expect("body")
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned(), report))
}

fn key(step: &str) -> OperationKey {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    OperationKey::step(&format!("run-{nanos}"), step).expect("key")
}

/// An attempt that times out while the server works is retried under the same key: the retry
/// waits out the 409 in-flight and gets the replay. One effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s22_a_timed_out_attempt_waits_and_replays_under_the_same_key() {
    let effects = Effects::default();
    let addr = serve(app(
        MemoryStore::new(),
        effects.clone(),
        Duration::from_secs(2),
    ))
    .await;
    let layer = IdempotentClientLayer::new()
        .attempt_timeout(Duration::from_millis(300))
        .deadline(Duration::from_secs(20));
    let key = key("slow");
    let (status, body, report) = call(&layer, request(addr, "ms=800", Some(&key), b"order 7"))
        .await
        .expect("answer");
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(body, "refund 1 of 7 bytes");
    assert_eq!(report.ended, Ended::Replayed);
    assert!(report.attempts >= 2, "{report:?}");
    assert_eq!(report.key, key.as_str());
    assert_eq!(effects.count(), 1);
}

/// A store that is down answers 503 and runs nothing: the client retries until it is back,
/// and the operation runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s22_503_is_retried_and_the_operation_runs_once() {
    let effects = Effects::default();
    let store = Faulty::new(MemoryStore::new());
    let addr = serve(app(store.clone(), effects.clone(), Duration::from_secs(30))).await;
    store.down_for(Duration::from_millis(600));
    let layer = IdempotentClientLayer::new()
        .backoff(Duration::from_millis(50), Duration::from_millis(200))
        .deadline(Duration::from_secs(20));
    let (status, _, report) = call(&layer, request(addr, "", Some(&key("down")), b"x"))
        .await
        .expect("answer");
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(report.ended, Ended::Answered);
    assert!(report.attempts >= 2, "{report:?}");
    assert_eq!(effects.count(), 1);
}

/// A 500 the server gave the key back for (the default policy) is retried under the same key;
/// the retry runs it, and that answer is the call's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s22_a_released_failure_is_retried_under_the_same_key() {
    let effects = Effects::default();
    let addr = serve(app(
        MemoryStore::new(),
        effects.clone(),
        Duration::from_secs(30),
    ))
    .await;
    let layer =
        IdempotentClientLayer::new().backoff(Duration::from_millis(20), Duration::from_millis(50));
    let (status, body, report) = call(&layer, request(addr, "fail=1", Some(&key("fail")), b"x"))
        .await
        .expect("answer");
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::CREATED, "refund 1 of 1 bytes")
    );
    assert_eq!(report.attempts, 2);
    assert_eq!(
        effects.count(),
        1,
        "the failed run made no effect; the retry made one"
    );
}

/// A key used for another request stops the call at once with a typed error: a bug, not a
/// failure to retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s22_a_reused_key_stops_at_once() {
    let effects = Effects::default();
    let addr = serve(app(
        MemoryStore::new(),
        effects.clone(),
        Duration::from_secs(30),
    ))
    .await;
    let layer = IdempotentClientLayer::new();
    let key = key("reused");
    call(&layer, request(addr, "", Some(&key), b"order 7"))
        .await
        .expect("first");
    let error = call(&layer, request(addr, "", Some(&key), b"order 8"))
        .await
        .expect_err("another request under the same key");
    assert!(matches!(error, ClientError::KeyReused { .. }), "{error}");
    assert_eq!(effects.count(), 1);
}

/// An outcome nobody knows (the holder died on a route that reconciles) is a typed error for
/// reconciliation, never retried automatically.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s22_outcome_unknown_is_typed_not_retried() {
    let effects = Effects::default();
    let store = Faulty::new(MemoryStore::new());
    store.fail_renew.store(true, Ordering::SeqCst);
    let addr = serve(app(store, effects.clone(), Duration::from_millis(300))).await;
    let key = key("unknown");
    // The first attempt's handler hangs and its lease runs out unrenewed: a dead holder.
    let impatient = IdempotentClientLayer::new()
        .attempt_timeout(Duration::from_millis(100))
        .deadline(Duration::from_millis(150));
    let _ = call(&impatient, request(addr, "hang=1", Some(&key), b"x")).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let layer = IdempotentClientLayer::new().deadline(Duration::from_secs(10));
    let error = call(&layer, request(addr, "hang=1", Some(&key), b"x"))
        .await
        .expect_err("unknown");
    assert!(
        matches!(error, ClientError::OutcomeUnknown { .. }),
        "{error}"
    );
    assert_eq!(effects.count(), 0, "nothing ran a second time");
}

/// A request without an operation key is refused before anything is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s22_a_request_without_an_operation_key_is_refused() {
    let effects = Effects::default();
    let addr = serve(app(
        MemoryStore::new(),
        effects.clone(),
        Duration::from_secs(30),
    ))
    .await;
    let error = call(&IdempotentClientLayer::new(), request(addr, "", None, b"x"))
        .await
        .expect_err("no key");
    assert!(matches!(error, ClientError::NoOperationKey), "{error}");
    assert_eq!(effects.count(), 0);
}

/// The deadline rule: a timeout that does not outlast the route's published window is
/// refused, and nothing is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s22_timeouts_shorter_than_the_window_are_refused() {
    let effects = Effects::default();
    let server = IdempotencyLayer::new(MemoryStore::new()).single_tenant();
    let addr = serve(
        Router::new()
            .route(
                "/refunds",
                post({
                    let effects = effects.clone();
                    move || async move {
                        tokio::time::sleep(Duration::from_millis(1500)).await;
                        effects.hit();
                        StatusCode::CREATED
                    }
                }),
            )
            .layer(server.clone()),
    )
    .await;
    let measured = IdempotentClientLayer::new().deadline(Duration::from_secs(20));
    call(&measured, request(addr, "", Some(&key("measure")), b"x"))
        .await
        .expect("first");
    let window = server.processing_windows().remove(0);
    assert_eq!(window.min_deadline(), Duration::from_secs(2));
    let too_short =
        IdempotentClientLayer::for_window(&window).attempt_timeout(Duration::from_secs(1));
    assert!(matches!(
        too_short.check(),
        Err(ClientError::DeadlineTooShort { .. })
    ));
    let error = call(&too_short, request(addr, "", Some(&key("short")), b"x"))
        .await
        .expect_err("refused");
    assert!(
        matches!(error, ClientError::DeadlineTooShort { .. }),
        "{error}"
    );
    assert_eq!(effects.count(), 1, "nothing sent");
    let enough = IdempotentClientLayer::for_window(&window).attempt_timeout(Duration::from_secs(3));
    assert!(enough.check().is_ok());
}

/// reqwest: its `Client` is a tower `Service` of its own `reqwest::Request`, and it has no hook
/// for a request-level layer (`connector_layer` wraps connections). The layer goes around a
/// few lines that turn http's request into reqwest's and reqwest's response into http's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s22_reqwest_through_its_tower_service() {
    let effects = Effects::default();
    let addr = serve(app(
        MemoryStore::new(),
        effects.clone(),
        Duration::from_secs(2),
    ))
    .await;
    let reqwest_client = reqwest::Client::new();
    let http = tower::service_fn(move |req: http::Request<Full<Bytes>>| {
        let client = reqwest_client.clone();
        async move {
            let req = reqwest::Request::try_from(req.map(reqwest::Body::wrap))?;
            let res = client.execute(req).await?;
            Ok::<_, reqwest::Error>(http::Response::from(res))
        }
    });
    let layer = IdempotentClientLayer::new()
        .attempt_timeout(Duration::from_millis(300))
        .deadline(Duration::from_secs(20));
    let client = tower::ServiceBuilder::new().layer(layer).service(http);
    let key = key("reqwest");
    // The first attempt times out (the handler takes 800 ms); the retry waits and replays.
    let res = client
        .oneshot(request(addr, "ms=800", Some(&key), b"order 9"))
        .await
        .expect("answer");
    let report = res
        .extensions()
        .get::<CallReport>()
        .cloned()
        .expect("report");
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(
        res.into_body().bytes(),
        Bytes::from_static(b"refund 1 of 7 bytes")
    );
    assert_eq!(report.ended, Ended::Replayed, "{report:?}");
    assert_eq!(effects.count(), 1);
}

/// Eight callers of one operation at once, through a barrier, each with the client layer and
/// the same key: the server runs it once, the others wait out `409 in-flight` under that key
/// and get its answer. Effects counted in the handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s22_concurrent_callers_of_one_operation_make_one_effect() {
    let effects = Effects::default();
    let addr = serve(app(
        MemoryStore::new(),
        effects.clone(),
        Duration::from_secs(2),
    ))
    .await;
    let layer = IdempotentClientLayer::new()
        .deadline(Duration::from_secs(20))
        .backoff(Duration::from_millis(20), Duration::from_millis(100));
    let key = key("together");
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(8));
    let callers: Vec<_> = (0..8)
        .map(|_| {
            let (layer, key, barrier) = (layer.clone(), key.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                call(&layer, request(addr, "ms=300", Some(&key), b"order 8")).await
            })
        })
        .collect();
    let mut answered = 0;
    for caller in callers {
        let (status, body, report) = caller.await.expect("task").expect("answer");
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(
            body, "refund 1 of 7 bytes",
            "every caller gets the one outcome"
        );
        answered += usize::from(report.ended == Ended::Answered);
    }
    assert_eq!(answered, 1, "one ran it, the others replayed it");
    assert_eq!(effects.count(), 1);
}
