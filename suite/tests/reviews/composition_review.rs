//! Review: the layer composed with common tower / tower-http / axum middleware, outside and
//! inside it, by a careless integrator. Every effect is counted at the sink (in the handler),
//! never by counting responses. Each test names the DESIGN § it probes.

use crate::common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::error_handling::HandleErrorLayer;
use axum::extract::Request;
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use common::{Effects, client, gunzip, gzip, problem, problem_type, serve};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::{BoxError, ServiceBuilder};
use tower_idempotency::{
    CachePolicy, IdempotencyContext, IdempotencyLayer, IdempotencyStore, MemoryStore,
};

// ---- helpers -------------------------------------------------------------------------------

async fn send(
    addr: SocketAddr,
    path: &str,
    key: Option<&str>,
    headers: &[(&str, &str)],
    body: impl Into<reqwest::Body>,
) -> reqwest::Response {
    let mut req = client().post(format!("http://{addr}{path}")).body(body);
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    req.send().await.expect("request")
}

fn replayed(res: &reqwest::Response) -> bool {
    res.headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true")
}

fn header<'a>(res: &'a reqwest::Response, name: &str) -> Option<&'a str> {
    res.headers().get(name).and_then(|v| v.to_str().ok())
}

/// The problem slug of a problem+json answer, or the status and media type when it is not one.
async fn slug(res: reqwest::Response) -> String {
    let status = res.status();
    let ct = header(&res, "content-type").unwrap_or("").to_owned();
    if ct != "application/problem+json" {
        return format!("{status} {ct}");
    }
    let p = problem(res).await;
    p["type"]
        .as_str()
        .unwrap_or("")
        .trim_start_matches("urn:tower-idempotency:problem:")
        .to_owned()
}

/// Serves `app` with its handlers turned into routes once: axum 0.8 otherwise builds a
/// handler route's layers per connection (`Router` as a make-service calls `with_state` per
/// connection), so a `ConcurrencyLimit` or `Buffer` would be one per connection.
async fn serve_eager(app: Router) -> SocketAddr {
    serve(app.with_state(())).await
}

fn unique(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{name}-{nanos}")
}

/// A long text answer every compression predicate compresses.
fn long_text(n: usize) -> String {
    let mut s = String::new();
    for i in 0..200 {
        s.push_str(&format!("ticket {n} line {i}: the printer is on fire;\n"));
    }
    s
}

// ---- 1. Compression ----------------------------------------------------------------------

/// §3 ("a replay never carries a content encoding the retrying client did not accept") and
/// §1 step 9: `CompressionLayer` OUTSIDE the layer compresses first answers and replays per
/// call, so a retry with another `Accept-Encoding` reads its replay.
#[tokio::test]
async fn s3_compression_outside_replays_per_retrys_accept_encoding() {
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/t",
            post(move || async move { (StatusCode::CREATED, long_text(sink.hit())) }),
        )
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant())
        .layer(tower_http::compression::CompressionLayer::new());
    let addr = serve(app).await;
    let first = send(
        addr,
        "/t",
        Some("c-out"),
        &[("accept-encoding", "gzip")],
        "{}",
    )
    .await;
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(header(&first, "content-encoding"), Some("gzip"));
    let first_plain = gunzip(&first.bytes().await.expect("body"));
    assert_eq!(first_plain, long_text(1).into_bytes());

    // A retry that accepts nothing gets identity bytes, no Content-Encoding, a right length.
    let plain = send(addr, "/t", Some("c-out"), &[], "{}").await;
    assert_eq!(plain.status(), StatusCode::CREATED);
    assert!(replayed(&plain));
    assert_eq!(header(&plain, "content-encoding"), None);
    let declared = header(&plain, "content-length").map(|v| v.parse::<usize>().expect("len"));
    let bytes = plain.bytes().await.expect("body");
    if let Some(len) = declared {
        assert_eq!(len, bytes.len(), "Content-Length of the replay");
    }
    assert_eq!(bytes.as_ref(), first_plain.as_slice());

    // `identity` explicitly, and gzip again.
    let id = send(
        addr,
        "/t",
        Some("c-out"),
        &[("accept-encoding", "identity")],
        "{}",
    )
    .await;
    assert_eq!(header(&id, "content-encoding"), None);
    assert_eq!(
        id.bytes().await.expect("body").as_ref(),
        first_plain.as_slice()
    );
    let gz = send(
        addr,
        "/t",
        Some("c-out"),
        &[("accept-encoding", "gzip")],
        "{}",
    )
    .await;
    assert!(replayed(&gz));
    assert_eq!(header(&gz, "content-encoding"), Some("gzip"));
    assert_eq!(gunzip(&gz.bytes().await.expect("body")), first_plain);
    assert_eq!(effects.count(), 1);
}

/// README "Compression" / §3: `CompressionLayer` INSIDE the layer sees `Accept-Encoding:
/// identity`, so the answer is recorded uncompressed and every retry can read it; the first
/// caller gets it uncompressed too (documented).
#[tokio::test]
async fn s3_compression_inside_records_identity_for_every_retry() {
    let effects = Effects::default();
    let sink = effects.clone();
    let seen: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let saw = seen.clone();
    let app = Router::new()
        .route(
            "/t",
            post(move |headers: HeaderMap| async move {
                saw.lock().expect("lock").push(
                    headers
                        .get("accept-encoding")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("<none>")
                        .to_owned(),
                );
                long_text(sink.hit())
            }),
        )
        .route_layer(tower_http::compression::CompressionLayer::new())
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    let first = send(
        addr,
        "/t",
        Some("c-in"),
        &[("accept-encoding", "gzip")],
        "{}",
    )
    .await;
    assert_eq!(first.status(), StatusCode::OK);
    let first_ce = header(&first, "content-encoding").map(str::to_owned);
    let first_bytes = first.bytes().await.expect("body");
    assert_eq!(
        first_ce, None,
        "recorded uncompressed (README: Compression)"
    );
    assert_eq!(first_bytes.as_ref(), long_text(1).as_bytes());
    for accept in [None, Some("identity"), Some("gzip"), Some("br;q=1, *;q=0")] {
        let headers: Vec<(&str, &str)> =
            accept.map(|a| ("accept-encoding", a)).into_iter().collect();
        let retry = send(addr, "/t", Some("c-in"), &headers, "{}").await;
        assert_eq!(retry.status(), StatusCode::OK, "{accept:?}");
        assert!(replayed(&retry), "{accept:?}");
        assert_eq!(header(&retry, "content-encoding"), None, "{accept:?}");
        assert_eq!(
            retry.bytes().await.expect("body"),
            first_bytes,
            "{accept:?}"
        );
    }
    assert_eq!(effects.count(), 1);
    assert_eq!(seen.lock().expect("lock").as_slice(), &["identity"]);
}

/// §3 / README: an inner middleware that gzips every answer regardless of `Accept-Encoding`:
/// a retry that does not accept gzip must never get gzip bytes without their header; it gets
/// 406 `encoding-not-accepted` and nothing runs again.
#[tokio::test]
async fn s3_inner_middleware_that_always_gzips_never_replays_unreadable_bytes() {
    async fn always_gzip(req: Request, next: Next) -> Response {
        let res = next.run(req).await;
        let (mut parts, body) = res.into_parts();
        let bytes = axum::body::to_bytes(body, usize::MAX).await.expect("body");
        parts.headers.remove("content-length");
        parts
            .headers
            .insert("content-encoding", "gzip".parse().expect("value"));
        Response::from_parts(parts, Body::from(gzip(&bytes)))
    }
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route("/t", post(move || async move { long_text(sink.hit()) }))
        .route_layer(middleware::from_fn(always_gzip))
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    let first = send(addr, "/t", Some("g"), &[("accept-encoding", "gzip")], "{}").await;
    assert_eq!(header(&first, "content-encoding"), Some("gzip"));
    let first = first.bytes().await.expect("body");
    let plain = send(addr, "/t", Some("g"), &[], "{}").await;
    let status = plain.status();
    let ce = header(&plain, "content-encoding").map(str::to_owned);
    let body = plain.bytes().await.expect("body");
    assert!(
        status == StatusCode::NOT_ACCEPTABLE || ce.as_deref() == Some("gzip") && body == first,
        "a retry that accepts no gzip got {status} {ce:?}"
    );
    assert_ne!(
        (ce.as_deref(), body.as_ref()),
        (None, first.as_ref()),
        "gzip bytes replayed without their Content-Encoding"
    );
    let gz = send(addr, "/t", Some("g"), &[("accept-encoding", "gzip")], "{}").await;
    assert!(replayed(&gz));
    assert_eq!(gz.bytes().await.expect("body"), first);
    assert_eq!(effects.count(), 1);
}

// ---- 2. Request decompression ----------------------------------------------------------

/// §1 step 4 / README "hashed as sent": `RequestDecompressionLayer` OUTSIDE. The layer sees the
/// decoded body (the coding header is gone), so two different decoded bodies are never merged,
/// and a gzip bomb is stopped by the layer's streamed limit, nothing claimed.
#[tokio::test]
async fn s1_4_request_decompression_outside_never_merges_different_bodies() {
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/t",
            post(move |body: String| async move { format!("run {} of {body}", sink.hit()) }),
        )
        .route_layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .body_limit(4096),
        )
        .layer(tower_http::decompression::RequestDecompressionLayer::new());
    let addr = serve(app).await;
    let gz = [
        ("content-encoding", "gzip"),
        ("content-type", "application/json"),
    ];
    let json = [("content-type", "application/json")];
    let a = send(addr, "/t", Some("d1"), &gz, gzip(br#"{"amount":1}"#)).await;
    assert_eq!(a.status(), StatusCode::OK);
    let a_text = a.text().await.expect("body");
    assert_eq!(a_text, r#"run 1 of {"amount":1}"#);
    let b = send(addr, "/t", Some("d1"), &gz, gzip(br#"{"amount":2}"#)).await;
    assert_eq!(b.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(slug(b).await, "fingerprint-mismatch");
    // Sent plain, the same decoded body: the layer cannot see the coding any more.
    let plain = send(addr, "/t", Some("d1"), &json, r#"{"amount":1}"#).await;
    let plain_status = plain.status();
    let plain_replayed = replayed(&plain);
    let plain_text = plain.text().await.expect("body");
    assert!(
        plain_replayed && plain_text == a_text || plain_status == StatusCode::UNPROCESSABLE_ENTITY,
        "{plain_status} {plain_text}"
    );
    assert_eq!(effects.count(), 1);

    // A 64 KiB bomb in ~100 bytes: over the layer's 4 KiB, counted as decoded.
    let bomb = gzip(&vec![b' '; 64 * 1024]);
    assert!(bomb.len() < 4096);
    let res = send(addr, "/t", Some("bomb"), &gz, bomb).await;
    assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(slug(res).await, "body-too-large");
    // Broken gzip: a typed refusal, never a run, never a 5xx.
    let res = send(
        addr,
        "/t",
        Some("bomb"),
        &gz,
        b"\x1f\x8b\x08\x00garbage".to_vec(),
    )
    .await;
    let status = res.status();
    let s = slug(res).await;
    assert!(
        status.is_client_error(),
        "broken gzip answered {status} {s}"
    );
    // Neither consumed the key.
    let ok = send(addr, "/t", Some("bomb"), &gz, gzip(br#"{"amount":3}"#)).await;
    assert_eq!(ok.status(), StatusCode::OK);
    assert!(!replayed(&ok));
    assert_eq!(effects.count(), 2);
}

/// README ("a body sent with a Content-Encoding is hashed as sent, never decoded"):
/// `RequestDecompressionLayer` INSIDE. A gzip JSON body is not refused as malformed JSON, the
/// handler gets it decoded, the same bytes replay, the same JSON sent plain is another request.
#[tokio::test]
async fn s1_4_request_decompression_inside_hashes_the_coded_body_as_sent() {
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/t",
            post(
                move |axum::Json(v): axum::Json<serde_json::Value>| async move {
                    format!("run {} amount {}", sink.hit(), v["amount"])
                },
            ),
        )
        .route_layer(tower_http::decompression::RequestDecompressionLayer::new())
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    let gz = [
        ("content-encoding", "gzip"),
        ("content-type", "application/json"),
    ];
    let body = gzip(br#"{"amount": 5, "to": "x"}"#);
    let first = send(addr, "/t", Some("di"), &gz, body.clone()).await;
    assert_eq!(
        first.status(),
        StatusCode::OK,
        "gzip JSON must reach the handler"
    );
    assert_eq!(first.text().await.expect("body"), "run 1 amount 5");
    let again = send(addr, "/t", Some("di"), &gz, body).await;
    assert!(replayed(&again));
    assert_eq!(again.text().await.expect("body"), "run 1 amount 5");
    let plain = send(
        addr,
        "/t",
        Some("di"),
        &[("content-type", "application/json")],
        r#"{"amount": 5, "to": "x"}"#,
    )
    .await;
    assert_eq!(
        plain.status(),
        StatusCode::UNPROCESSABLE_ENTITY,
        "hashed as sent"
    );
    assert_eq!(effects.count(), 1);
}

// ---- 3. Timeouts -------------------------------------------------------------------------

fn slow_once(effects: &Effects, calls: &Arc<AtomicUsize>, sleep_ms: u64) -> Router {
    let (sink, calls) = (effects.clone(), calls.clone());
    Router::new().route(
        "/t",
        post(move || async move {
            if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(sleep_ms)).await;
            }
            (StatusCode::CREATED, format!("done {}", sink.hit()))
        }),
    )
}

/// §1 step 7 and §7.5: tower-http `TimeoutLayer` OUTSIDE drops the layer's future mid-handler
/// (as a hang-up does). The handler runs to completion, a mid-flight retry gets 409, a later
/// one the replay, one effect.
async fn outer_timeout_runs_to_completion<St: IdempotencyStore>(store: St) {
    let effects = Effects::default();
    let calls = Arc::new(AtomicUsize::new(0));
    #[allow(deprecated)]
    let app = slow_once(&effects, &calls, 600)
        .route_layer(IdempotencyLayer::new(store).single_tenant())
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            Duration::from_millis(150),
        ));
    let addr = serve(app).await;
    let key = unique("ot");
    let first = send(addr, "/t", Some(&key), &[], "{}").await;
    assert_eq!(first.status(), StatusCode::REQUEST_TIMEOUT);
    let mid = send(addr, "/t", Some(&key), &[], "{}").await;
    assert_eq!(mid.status(), StatusCode::CONFLICT);
    assert!(mid.headers().get("retry-after").is_some());
    assert_eq!(slug(mid).await, "in-flight");
    tokio::time::sleep(Duration::from_millis(900)).await;
    let later = send(addr, "/t", Some(&key), &[], "{}").await;
    assert_eq!(later.status(), StatusCode::CREATED);
    assert!(replayed(&later));
    assert_eq!(later.text().await.expect("body"), "done 1");
    assert_eq!(effects.count(), 1);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_7_outer_timeout_runs_to_completion_memory() {
    outer_timeout_runs_to_completion(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_7_outer_timeout_runs_to_completion_sqlite() {
    let (store, path) = common::sqlite("composition-outer-timeout").await;
    outer_timeout_runs_to_completion(store).await;
    let _ = std::fs::remove_file(path);
}

/// README `cancel_on_disconnect(true)`: an outer timeout that drops the future cancels the
/// handler and gives the key back; the retry runs (not a key stranded in flight for a lease).
#[tokio::test]
async fn s1_7_outer_timeout_with_cancel_on_disconnect_releases_the_key() {
    let effects = Effects::default();
    let calls = Arc::new(AtomicUsize::new(0));
    #[allow(deprecated)]
    let app = slow_once(&effects, &calls, 600)
        .route_layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .cancel_on_disconnect(true),
        )
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            Duration::from_millis(150),
        ));
    let addr = serve(app).await;
    let first = send(addr, "/t", Some("cd"), &[], "{}").await;
    assert_eq!(first.status(), StatusCode::REQUEST_TIMEOUT);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let retry = send(addr, "/t", Some("cd"), &[], "{}").await;
    let status = retry.status();
    assert_eq!(status, StatusCode::CREATED, "{}", slug(retry).await);
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(
        effects.count(),
        1,
        "the cancelled run never reached its effect"
    );
    let replay = send(addr, "/t", Some("cd"), &[], "{}").await;
    assert!(replayed(&replay));
    assert_eq!(replay.text().await.expect("body"), "done 1");
}

/// Handler for the inner-timeout tests: the effect happens, then the handler stalls past the
/// inner timeout and is dropped (a 408 comes back through the layer).
fn effect_then_stall(effects: &Effects, calls: &Arc<AtomicUsize>, milestone: bool) -> Router {
    let (sink, calls) = (effects.clone(), calls.clone());
    Router::new().route(
        "/t",
        post(move |ctx: IdempotencyContext| async move {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            if milestone {
                ctx.effect_started().await.expect("milestone");
            }
            sink.hit();
            if n == 0 {
                tokio::time::sleep(Duration::from_millis(2000)).await;
            }
            (StatusCode::CREATED, format!("done {}", n + 1))
        }),
    )
}

/// §3 + §4: tower-http `TimeoutLayer` INSIDE (between the layer and the handler) drops the
/// handler after `effect_started()` and answers 408. 408 is a technical failure, and with the
/// milestone the record must go to `needs_reconciliation`: retries get `outcome-unknown`,
/// `safe_new_key: false`, never a second effect.
async fn inner_timeout_after_milestone<St: IdempotencyStore>(store: St) {
    let effects = Effects::default();
    let calls = Arc::new(AtomicUsize::new(0));
    let app = effect_then_stall(&effects, &calls, true)
        .route_layer(tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            Duration::from_millis(200),
        ))
        .route_layer(IdempotencyLayer::new(store).single_tenant());
    let addr = serve(app).await;
    let key = unique("it");
    let first = send(addr, "/t", Some(&key), &[], "{}").await;
    assert_eq!(first.status(), StatusCode::REQUEST_TIMEOUT);
    assert_eq!(effects.count(), 1);
    for _ in 0..2 {
        let retry = send(addr, "/t", Some(&key), &[], "{}").await;
        assert_eq!(retry.status(), StatusCode::CONFLICT);
        let p = problem(retry).await;
        assert_eq!(p["type"], problem_type("outcome-unknown"));
        assert_eq!(p["safe_new_key"], false);
    }
    assert_eq!(effects.count(), 1, "an effect marked started ran twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_inner_timeout_after_effect_started_awaits_reconciliation_memory() {
    inner_timeout_after_milestone(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_inner_timeout_after_effect_started_awaits_reconciliation_sqlite() {
    let (store, path) = common::sqlite("composition-inner-timeout").await;
    inner_timeout_after_milestone(store).await;
    let _ = std::fs::remove_file(path);
}

/// §3 (documented sharp edge): an inner `TimeoutLayer` that drops the handler AFTER its effect
/// but before any milestone answers 408, which `DefinitiveOnly` releases, so a retry runs the
/// effect again. Also with `external_effects(true)` (it only speaks of dead holders). The layer
/// cannot tell a cancelled handler from one that answered 408.
#[tokio::test]
async fn s3_inner_timeout_without_milestone_releases_the_key_sharp_edge() {
    let effects = Effects::default();
    let calls = Arc::new(AtomicUsize::new(0));
    let app = effect_then_stall(&effects, &calls, false)
        .route_layer(tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            Duration::from_millis(200),
        ))
        .route_layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .external_effects(true),
        );
    let addr = serve(app).await;
    let first = send(addr, "/t", Some("it-no"), &[], "{}").await;
    assert_eq!(first.status(), StatusCode::REQUEST_TIMEOUT);
    let retry = send(addr, "/t", Some("it-no"), &[], "{}").await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(!replayed(&retry));
    assert_eq!(effects.count(), 2, "documented: 408 releases the key");
}

/// §3 ("Errors of the inner service ... are never recorded", `Everything` too): `tower::timeout`
/// INSIDE the layer returns `Err(Elapsed)` through it (a `HandleErrorLayer` outside turns it
/// into a 504). Under `Everything` the error must not be recorded; with a milestone it must
/// go to reconciliation.
#[tokio::test]
async fn s3_inner_tower_timeout_error_is_never_recorded_under_everything() {
    for milestone in [false, true] {
        let effects = Effects::default();
        let calls = Arc::new(AtomicUsize::new(0));
        let app = effect_then_stall(&effects, &calls, milestone).route_layer(
            ServiceBuilder::new()
                .layer(HandleErrorLayer::new(|e: BoxError| async move {
                    (StatusCode::GATEWAY_TIMEOUT, format!("outer: {e}"))
                }))
                .layer(
                    IdempotencyLayer::new(MemoryStore::new())
                        .single_tenant()
                        .cache_policy(CachePolicy::Everything),
                )
                .layer(tower::timeout::TimeoutLayer::new(Duration::from_millis(
                    200,
                ))),
        );
        let addr = serve(app).await;
        let first = send(addr, "/t", Some("tt"), &[], "{}").await;
        assert_eq!(
            first.status(),
            StatusCode::GATEWAY_TIMEOUT,
            "milestone {milestone}"
        );
        let retry = send(addr, "/t", Some("tt"), &[], "{}").await;
        if milestone {
            assert_eq!(retry.status(), StatusCode::CONFLICT);
            assert_eq!(slug(retry).await, "outcome-unknown");
            assert_eq!(effects.count(), 1);
        } else {
            assert_eq!(
                retry.status(),
                StatusCode::CREATED,
                "an inner Err was recorded"
            );
            assert!(!replayed(&retry));
            assert_eq!(effects.count(), 2);
        }
    }
}

// ---- 4. Panics ---------------------------------------------------------------------------

fn panics_once(effects: &Effects, calls: &Arc<AtomicUsize>, milestone: bool) -> Router {
    let (sink, calls) = (effects.clone(), calls.clone());
    Router::new().route(
        "/t",
        post(move |ctx: IdempotencyContext| async move {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            if n == 0 {
                if milestone {
                    ctx.effect_started().await.expect("milestone");
                    sink.hit();
                }
                tokio::task::yield_now().await;
                panic!("handler bug");
            }
            (StatusCode::CREATED, format!("done {}", sink.hit()))
        }),
    )
}

/// README table ("handler panicked: 500 execution-failed, key released") with `CatchPanicLayer`
/// OUTSIDE, in both execution modes (spawned, and `cancel_on_disconnect` on the request's own
/// future): the layer answers the panic itself and gives the key back.
#[tokio::test]
async fn s3_catch_panic_outside_the_layer_sees_a_released_key() {
    for cancel in [false, true] {
        let effects = Effects::default();
        let calls = Arc::new(AtomicUsize::new(0));
        let app = panics_once(&effects, &calls, false)
            .route_layer(
                IdempotencyLayer::new(MemoryStore::new())
                    .single_tenant()
                    .cancel_on_disconnect(cancel),
            )
            .layer(tower_http::catch_panic::CatchPanicLayer::new());
        let addr = serve(app).await;
        let first = send(addr, "/t", Some("p"), &[], "{}").await;
        assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(slug(first).await, "execution-failed", "cancel {cancel}");
        tokio::time::sleep(Duration::from_millis(50)).await;
        let retry = send(addr, "/t", Some("p"), &[], "{}").await;
        assert_eq!(retry.status(), StatusCode::CREATED, "cancel {cancel}");
        assert_eq!(effects.count(), 1);
    }
}

/// §3 + §4: `CatchPanicLayer` INSIDE turns a panic after `effect_started()` into a 500 response;
/// under `DefinitiveOnly` with the milestone the key must await reconciliation, never run again.
#[tokio::test]
async fn s4_catch_panic_inside_after_effect_started_awaits_reconciliation() {
    let effects = Effects::default();
    let calls = Arc::new(AtomicUsize::new(0));
    let app = panics_once(&effects, &calls, true)
        .route_layer(tower_http::catch_panic::CatchPanicLayer::new())
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    let first = send(addr, "/t", Some("pm"), &[], "{}").await;
    assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let retry = send(addr, "/t", Some("pm"), &[], "{}").await;
    assert_eq!(retry.status(), StatusCode::CONFLICT);
    assert_eq!(slug(retry).await, "outcome-unknown");
    assert_eq!(effects.count(), 1);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// §3 (sharp edge): `CatchPanicLayer` INSIDE under `Everything` fabricates a 500 the layer cannot
/// tell from a real one: it is recorded and replayed ("panics are never recorded" holds only
/// for panics the layer sees). Never a second run either way.
#[tokio::test]
async fn s3_catch_panic_inside_under_everything_replays_the_fabricated_500() {
    let effects = Effects::default();
    let calls = Arc::new(AtomicUsize::new(0));
    let app = panics_once(&effects, &calls, false)
        .route_layer(tower_http::catch_panic::CatchPanicLayer::new())
        .route_layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .cache_policy(CachePolicy::Everything),
        );
    let addr = serve(app).await;
    let first = send(addr, "/t", Some("pe"), &[], "{}").await;
    assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let first_body = first.bytes().await.expect("body");
    let retry = send(addr, "/t", Some("pe"), &[], "{}").await;
    assert_eq!(retry.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        replayed(&retry),
        "the CatchPanic 500 is recorded under Everything"
    );
    assert_eq!(retry.bytes().await.expect("body"), first_body);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

// ---- 5. Load shedding, concurrency limits, buffers ---------------------------------------

fn slow_handler(effects: &Effects, gate_ms: u64) -> Router {
    let sink = effects.clone();
    Router::new().route(
        "/t",
        post(move |body: String| async move {
            tokio::time::sleep(Duration::from_millis(gate_ms)).await;
            (StatusCode::CREATED, format!("{body} -> {}", sink.hit()))
        }),
    )
}

/// §3: `LoadShed` + `ConcurrencyLimit(1)` INSIDE the layer. An overloaded answer is not a
/// definitive outcome: as a 503 response (HandleError inside) it is released under
/// `DefinitiveOnly`; as an inner `Err` (HandleError outside) it is never recorded, even under
/// `Everything`. The shed request's retry runs.
#[tokio::test]
async fn s3_load_shed_inside_is_not_a_definitive_outcome() {
    for (policy, error_outside) in [
        (CachePolicy::DefinitiveOnly, false),
        (CachePolicy::DefinitiveOnly, true),
        (CachePolicy::Everything, true),
    ] {
        let effects = Effects::default();
        let layer = IdempotencyLayer::new(MemoryStore::new())
            .single_tenant()
            .cache_policy(policy);
        let app = if error_outside {
            slow_handler(&effects, 400).route_layer(
                ServiceBuilder::new()
                    .layer(HandleErrorLayer::new(|_: BoxError| async {
                        StatusCode::SERVICE_UNAVAILABLE
                    }))
                    .layer(layer)
                    .layer(tower::load_shed::LoadShedLayer::new())
                    .layer(tower::limit::ConcurrencyLimitLayer::new(1)),
            )
        } else {
            slow_handler(&effects, 400).route_layer(
                ServiceBuilder::new()
                    .layer(layer)
                    .layer(HandleErrorLayer::new(|_: BoxError| async {
                        StatusCode::SERVICE_UNAVAILABLE
                    }))
                    .layer(tower::load_shed::LoadShedLayer::new())
                    .layer(tower::limit::ConcurrencyLimitLayer::new(1)),
            )
        };
        let addr = serve_eager(app).await;
        let a = tokio::spawn(async move { send(addr, "/t", Some("a"), &[], "a").await.status() });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let b = send(addr, "/t", Some("b"), &[], "b").await;
        assert_eq!(
            b.status(),
            StatusCode::SERVICE_UNAVAILABLE,
            "{error_outside}"
        );
        assert_eq!(a.await.expect("a"), StatusCode::CREATED);
        let b = send(addr, "/t", Some("b"), &[], "b").await;
        assert_eq!(
            b.status(),
            StatusCode::CREATED,
            "shed request recorded ({error_outside})"
        );
        assert!(!replayed(&b));
        assert_eq!(effects.count(), 2);
    }
}

/// §1 step 5: `LoadShed` + `ConcurrencyLimit(1)` OUTSIDE the layer: a shed request reached no
/// claim, so its key (even the running request's key) is not consumed or blocked.
#[tokio::test]
async fn s1_5_load_shed_outside_claims_nothing() {
    let effects = Effects::default();
    let app = slow_handler(&effects, 400)
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant())
        .layer(
            ServiceBuilder::new()
                .layer(HandleErrorLayer::new(|_: BoxError| async {
                    StatusCode::SERVICE_UNAVAILABLE
                }))
                .layer(tower::load_shed::LoadShedLayer::new())
                .layer(tower::limit::ConcurrencyLimitLayer::new(1)),
        );
    let addr = serve_eager(app).await;
    let a = tokio::spawn(async move { send(addr, "/t", Some("a"), &[], "a").await.status() });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let b = send(addr, "/t", Some("b"), &[], "b").await;
    assert_eq!(b.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_ne!(header(&b, "content-type"), Some("application/problem+json"));
    let dup = send(addr, "/t", Some("a"), &[], "a").await;
    assert_eq!(
        dup.status(),
        StatusCode::SERVICE_UNAVAILABLE,
        "shed before the layer"
    );
    assert_eq!(a.await.expect("a"), StatusCode::CREATED);
    let b = send(addr, "/t", Some("b"), &[], "b").await;
    assert_eq!(b.status(), StatusCode::CREATED);
    assert!(!replayed(&b));
    let dup = send(addr, "/t", Some("a"), &[], "a").await;
    assert!(replayed(&dup));
    assert_eq!(effects.count(), 2);
}

/// §7.3: N concurrent same-key requests released through a barrier, with `Buffer` and
/// `ConcurrencyLimit` inside or outside the layer: exactly one effect, every other answer a
/// replay or a 409 in-flight; with `wait_for_in_flight`, every answer the replay.
async fn concurrent_same_key<St: IdempotencyStore>(store: St, inside: bool, wait: bool) {
    const N: usize = 24;
    let effects = Effects::default();
    let mut layer = IdempotencyLayer::new(store).single_tenant();
    if wait {
        layer = layer.wait_for_in_flight(Duration::from_secs(20));
    }
    let limits = || {
        ServiceBuilder::new()
            .layer(HandleErrorLayer::new(|e: BoxError| async move {
                (StatusCode::SERVICE_UNAVAILABLE, e.to_string())
            }))
            .layer(tower::buffer::BufferLayer::new(64))
            .layer(tower::limit::ConcurrencyLimitLayer::new(4))
    };
    let app = if inside {
        slow_handler(&effects, 300)
            .route_layer(limits())
            .route_layer(layer)
    } else {
        slow_handler(&effects, 300)
            .route_layer(layer)
            .layer(limits())
    };
    let addr = serve_eager(app).await;
    let key = unique("burst");
    let barrier = Arc::new(tokio::sync::Barrier::new(N));
    let mut tasks = Vec::new();
    for _ in 0..N {
        let (barrier, key) = (barrier.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let res = send(addr, "/t", Some(&key), &[], "same").await;
            let status = res.status();
            let rep = replayed(&res);
            let body = if status == StatusCode::CONFLICT {
                slug(res).await
            } else {
                res.text().await.expect("body")
            };
            (status, rep, body)
        }));
    }
    let mut firsts = 0;
    let mut wrong = Vec::new();
    for t in tasks {
        let (status, rep, body) = t.await.expect("task");
        match status {
            StatusCode::CREATED if body == "same -> 1" => {
                if !rep {
                    firsts += 1;
                }
            }
            StatusCode::CONFLICT if !wait && body == "in-flight" => {}
            _ => wrong.push((status, rep, body)),
        }
    }
    assert!(wrong.is_empty(), "inside {inside} wait {wait}: {wrong:?}");
    assert_eq!(firsts, 1);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(effects.count(), 1, "inside {inside} wait {wait}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_3_burst_through_buffer_and_limit_memory() {
    for (inside, wait) in [(true, false), (false, false), (true, true), (false, true)] {
        concurrent_same_key(MemoryStore::new(), inside, wait).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_3_burst_through_buffer_and_limit_sqlite() {
    let (store, path) = common::sqlite("composition-burst").await;
    for (inside, wait) in [(true, false), (false, false), (true, true), (false, true)] {
        concurrent_same_key(store.clone(), inside, wait).await;
    }
    let _ = std::fs::remove_file(path);
}

// ---- 6. Auth order, scope --------------------------------------------------------------

#[derive(Clone)]
struct User(String);

async fn auth(mut req: Request, next: Next) -> Response {
    let user = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|t| User(format!("user-{t}")));
    match user {
        Some(user) => {
            req.extensions_mut().insert(user);
            next.run(req).await
        }
        None => StatusCode::UNAUTHORIZED.into_response(),
    }
}

fn whose(effects: &Effects) -> Router {
    let sink = effects.clone();
    Router::new().route(
        "/t",
        post(move |req: Request| async move {
            let who = req
                .extensions()
                .get::<User>()
                .map_or("nobody".to_owned(), |u| u.0.clone());
            (
                StatusCode::CREATED,
                format!("charge {} for {who}", sink.hit()),
            )
        }),
    )
}

/// §1 step 2: an auth layer placed INSIDE the idempotency layer (added before it, with
/// `route_layer` or `layer`): the principal is not there yet, so 500 `scope-missing` and
/// nothing runs, for every caller: never a shared scope.
#[tokio::test]
async fn s1_2_auth_inside_the_layer_refuses_never_shares_a_scope() {
    let effects = Effects::default();
    let layer =
        || IdempotencyLayer::new(MemoryStore::new()).scope_by_principal(|u: &User| u.0.clone());
    let apps = [
        whose(&effects)
            .route_layer(middleware::from_fn(auth))
            .route_layer(layer()),
        whose(&effects)
            .layer(middleware::from_fn(auth))
            .layer(layer()),
        whose(&effects)
            .route_layer(middleware::from_fn(auth))
            .layer(layer()),
    ];
    for app in apps {
        let addr = serve(app).await;
        for token in ["alice", "bob"] {
            let bearer = format!("Bearer {token}");
            let res = send(addr, "/t", Some("k"), &[("authorization", &bearer)], "{}").await;
            assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
            assert_eq!(slug(res).await, "scope-missing");
        }
    }
    assert_eq!(effects.count(), 0);

    // Right order (auth added after, so outside): two callers, one key, two charges.
    let app = whose(&effects)
        .route_layer(layer())
        .layer(middleware::from_fn(auth));
    let addr = serve(app).await;
    let a = send(
        addr,
        "/t",
        Some("k"),
        &[("authorization", "Bearer alice")],
        "{}",
    )
    .await;
    assert_eq!(a.text().await.expect("body"), "charge 1 for user-alice");
    let b = send(
        addr,
        "/t",
        Some("k"),
        &[("authorization", "Bearer bob")],
        "{}",
    )
    .await;
    assert!(!replayed(&b));
    assert_eq!(b.text().await.expect("body"), "charge 2 for user-bob");
    let a = send(
        addr,
        "/t",
        Some("k"),
        &[("authorization", "Bearer alice")],
        "{}",
    )
    .await;
    assert!(replayed(&a));
    assert_eq!(a.text().await.expect("body"), "charge 1 for user-alice");
    let anon = send(addr, "/t", Some("k"), &[], "{}").await;
    assert_eq!(anon.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(effects.count(), 2);
}

// ---- 7. Body limits ----------------------------------------------------------------------

/// Sends a chunked POST over raw TCP and returns the status and the whole answer.
async fn chunked_answer(addr: SocketAddr, key: &str, chunks: usize, chunk: usize) -> (u16, String) {
    let mut req = format!(
        "POST /t HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\ncontent-type: text/plain\r\n\
         transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    )
    .into_bytes();
    for _ in 0..chunks {
        req.extend(format!("{chunk:x}\r\n").as_bytes());
        req.extend(std::iter::repeat_n(b'a', chunk));
        req.extend(b"\r\n");
    }
    req.extend(b"0\r\n\r\n");
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    // The server may answer and close before reading it all.
    let _ = stream.write_all(&req).await;
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut buf)).await;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, text)
}

async fn chunked(addr: SocketAddr, key: &str, chunks: usize, chunk: usize) -> u16 {
    chunked_answer(addr, key, chunks, chunk).await.0
}

fn outer_limited(effects: &Effects) -> Router {
    let sink = effects.clone();
    Router::new()
        .route(
            "/t",
            post(move |body: String| async move {
                format!("{} bytes, run {}", body.len(), sink.hit())
            }),
        )
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant())
        .layer(tower_http::limit::RequestBodyLimitLayer::new(1024))
}

/// §1 step 3: `RequestBodyLimitLayer` OUTSIDE, smaller than the layer's limit. A body over it
/// (declared or streamed) is refused before or while the layer buffers: a 4xx, nothing runs,
/// and the key is not consumed.
#[tokio::test]
async fn s1_3_outer_body_limit_refuses_without_consuming_the_key() {
    let effects = Effects::default();
    let addr = serve(outer_limited(&effects)).await;
    let declared = send(addr, "/t", Some("bl"), &[], vec![b'a'; 4096]).await;
    assert_eq!(declared.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let (streamed, answer) = chunked_answer(addr, "bl", 8, 512).await;
    assert!((400..500).contains(&streamed), "{answer}");
    let small = send(addr, "/t", Some("bl"), &[], vec![b'a'; 10]).await;
    assert_eq!(small.status(), StatusCode::OK);
    assert!(!replayed(&small));
    assert_eq!(small.text().await.expect("body"), "10 bytes, run 1");
    assert_eq!(effects.count(), 1);
}

/// README table ("body over the limit (Content-Length or streamed): 413 `body-too-large`"):
/// the same app without the idempotency layer answers a streamed body over its
/// `RequestBodyLimitLayer` with 413 (axum maps the `LengthLimitError`); with the layer in the
/// stack it must stay a 413, not become a 400 that tells the client its body is broken.
#[tokio::test]
async fn s1_3_outer_body_limit_streamed_over_it_stays_413() {
    let effects = Effects::default();
    // Baseline: the same app without the idempotency layer.
    let sink = effects.clone();
    let bare = Router::new()
        .route(
            "/t",
            post(move |body: String| async move { format!("{} {}", body.len(), sink.hit()) }),
        )
        .layer(tower_http::limit::RequestBodyLimitLayer::new(1024));
    let bare = serve(bare).await;
    assert_eq!(chunked(bare, "x", 8, 512).await, 413, "baseline");
    let addr = serve(outer_limited(&effects)).await;
    let (status, answer) = chunked_answer(addr, "bl2", 8, 512).await;
    assert_eq!(status, 413, "streamed body over the outer limit: {answer}");
    assert_eq!(effects.count(), 0);
}

/// §3 (sharp edge): a body limit INSIDE the layer, smaller than the layer's own: the layer
/// claims, the inner limit answers 413, a 4xx `DefinitiveOnly` records: the key is spent on a
/// request the handler never saw (the same body replays 413, a smaller one is a 422).
/// Streamed the same, via axum's `DefaultBodyLimit`.
#[tokio::test]
async fn s3_inner_body_limit_413_is_recorded_sharp_edge() {
    let effects = Effects::default();
    let sink = effects.clone();
    let app =
        Router::new()
            .route(
                "/t",
                post(move |body: String| async move {
                    format!("{} bytes, run {}", body.len(), sink.hit())
                }),
            )
            .route_layer(tower_http::limit::RequestBodyLimitLayer::new(1024))
            .route_layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    let big = send(addr, "/t", Some("ib"), &[], vec![b'a'; 4096]).await;
    assert_eq!(big.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let again = send(addr, "/t", Some("ib"), &[], vec![b'a'; 4096]).await;
    assert_eq!(again.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert!(replayed(&again), "an inner 413 is a recorded 4xx");
    let small = send(addr, "/t", Some("ib"), &[], vec![b'a'; 10]).await;
    assert_eq!(small.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(effects.count(), 0);

    let app = Router::new()
        .route(
            "/t",
            post(move |body: String| async move { format!("{} bytes", body.len()) }),
        )
        .layer(axum::extract::DefaultBodyLimit::max(1024))
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    assert_eq!(chunked(addr, "dbl", 8, 512).await, 413);
    assert_eq!(chunked(addr, "dbl", 8, 512).await, 413);
}

// ---- 8. Methods, routing, nesting --------------------------------------------------------

/// §1 step 1: HEAD, GET, OPTIONS (a CORS preflight) with a key pass through untouched; the key
/// stays free for the POST.
#[tokio::test]
async fn s1_1_head_options_and_preflight_with_a_key_pass_through() {
    let effects = Effects::default();
    let (g, o, p) = (effects.clone(), effects.clone(), effects.clone());
    let app = Router::new()
        .route(
            "/t",
            get(move || async move { format!("get {}", g.hit()) })
                .options(move || async move { format!("options {}", o.hit()) })
                .post(move || async move { (StatusCode::CREATED, format!("post {}", p.hit())) }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    let c = client();
    let url = format!("http://{addr}/t");
    for _ in 0..2 {
        let res = c
            .get(&url)
            .header("idempotency-key", "m")
            .send()
            .await
            .expect("get");
        assert_eq!(res.status(), StatusCode::OK);
        assert!(res.headers().get("idempotency-replayed").is_none());
        let res = c
            .head(&url)
            .header("idempotency-key", "m")
            .send()
            .await
            .expect("head");
        assert_eq!(res.status(), StatusCode::OK);
        let res = c
            .request(http::Method::OPTIONS, &url)
            .header("idempotency-key", "m")
            .header("origin", "http://evil.example")
            .header("access-control-request-method", "POST")
            .header("access-control-request-headers", "idempotency-key")
            .send()
            .await
            .expect("options");
        assert_eq!(res.status(), StatusCode::OK);
        assert!(res.headers().get("idempotency-replayed").is_none());
    }
    let before = effects.count();
    assert_eq!(before, 6, "GET, HEAD and OPTIONS each ran");
    let res = send(addr, "/t", Some("m"), &[], "{}").await;
    assert_eq!(res.status(), StatusCode::CREATED);
    assert!(!replayed(&res));
    let res = send(addr, "/t", Some("m"), &[], "{}").await;
    assert!(replayed(&res));
    assert_eq!(effects.count(), before + 1);
}

/// §1 step 4 ("a `nest` prefix that axum strips still counts"): one guarded sub-router nested
/// at two prefixes, one store: the same key and body under the other prefix is another
/// request (422), never the first's answer.
#[tokio::test]
async fn s1_4_one_guarded_router_nested_twice_never_crosses_prefixes() {
    let effects = Effects::default();
    let sink = effects.clone();
    let inner = Router::new()
        .route(
            "/charge",
            post(move |uri: axum::http::Uri| async move {
                (StatusCode::CREATED, format!("{uri} {}", sink.hit()))
            }),
        )
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let app = Router::new()
        .nest("/tenant-a", inner.clone())
        .nest("/tenant-b", inner);
    let addr = serve(app).await;
    let a = send(addr, "/tenant-a/charge", Some("n"), &[], "{}").await;
    assert_eq!(a.status(), StatusCode::CREATED);
    let b = send(addr, "/tenant-b/charge", Some("n"), &[], "{}").await;
    assert!(!replayed(&b), "tenant-b got tenant-a's answer");
    assert_eq!(b.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let a = send(addr, "/tenant-a/charge", Some("n"), &[], "{}").await;
    assert!(replayed(&a));
    assert_eq!(effects.count(), 1);
}

/// README ("`Router::layer` would ... record the 404 of a keyed POST to an unknown path") and
/// §1 step 1: with `layer`, a keyed 404 and 405 are recorded (documented); with `route_layer`,
/// they are not guarded and the key stays free.
#[tokio::test]
async fn s1_1_layer_records_404_405_route_layer_does_not() {
    let effects = Effects::default();
    let app = |effects: &Effects, route: bool| {
        let (p, g) = (effects.clone(), effects.clone());
        let r = Router::new()
            .route(
                "/t",
                post(move || async move { (StatusCode::CREATED, format!("post {}", p.hit())) }),
            )
            .route(
                "/read",
                get(move || async move { format!("get {}", g.hit()) }),
            );
        let layer = IdempotencyLayer::new(MemoryStore::new()).single_tenant();
        if route {
            r.route_layer(layer)
        } else {
            r.layer(layer)
        }
    };
    // `layer`: recorded.
    let addr = serve(app(&effects, false)).await;
    let nf = send(addr, "/nope", Some("x"), &[], "{}").await;
    assert_eq!(nf.status(), StatusCode::NOT_FOUND);
    let nf = send(addr, "/nope", Some("x"), &[], "{}").await;
    assert_eq!(nf.status(), StatusCode::NOT_FOUND);
    assert!(
        replayed(&nf),
        "documented: Router::layer records a keyed 404"
    );
    // `route_layer`: the router's 404 is not guarded; the key stays free.
    let addr = serve(app(&effects, true)).await;
    let res = send(addr, "/nope", Some("y"), &[], "{}").await;
    assert_eq!(res.status(), StatusCode::NOT_FOUND);
    let res = send(addr, "/nope", Some("y"), &[], "{}").await;
    assert!(res.headers().get("idempotency-replayed").is_none());
    let ok = send(addr, "/t", Some("y"), &[], "{}").await;
    assert_eq!(ok.status(), StatusCode::CREATED);
    assert!(!replayed(&ok));
    // Sharp edge: the 405 of a keyed POST to a GET-only route goes through a `route_layer`ed
    // layer (axum layers the method router's 405 fallback), is a 4xx, and is recorded: the
    // same key then used on the right path is a 422.
    let res = send(addr, "/read", Some("z"), &[], "{}").await;
    assert_eq!(res.status(), StatusCode::METHOD_NOT_ALLOWED);
    let res = send(addr, "/read", Some("z"), &[], "{}").await;
    assert_eq!(res.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert!(replayed(&res), "a keyed 405 under route_layer is recorded");
    let res = send(addr, "/t", Some("z"), &[], "{}").await;
    assert_eq!(res.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(effects.count(), 1);
}

// ---- 9. Middleware that rewrites ---------------------------------------------------------

/// §1 step 3 and "replays return the original bytes ... never `Set-Cookie`": a `from_fn` INSIDE
/// rewrites the request body and decorates the response; replays equal the first answer but
/// for the cookie; a different original body is still a 422 though the rewrite would make the
/// handler see the same bytes.
#[tokio::test]
async fn s1_3_inner_rewriting_middleware_replays_what_the_first_caller_got() {
    async fn rewrite(req: Request, next: Next) -> Response {
        let (parts, body) = req.into_parts();
        let bytes = axum::body::to_bytes(body, usize::MAX).await.expect("body");
        let upper = String::from_utf8_lossy(&bytes).to_uppercase();
        let mut res = next
            .run(Request::from_parts(parts, Body::from(upper)))
            .await;
        res.headers_mut()
            .insert("x-rewritten", "yes".parse().expect("value"));
        res.headers_mut()
            .insert("set-cookie", "session=secret".parse().expect("value"));
        res
    }
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/t",
            post(move |body: String| async move {
                (StatusCode::CREATED, format!("{body} {}", sink.hit()))
            }),
        )
        .route_layer(middleware::from_fn(rewrite))
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    let first = send(addr, "/t", Some("rw"), &[], "abc").await;
    assert_eq!(header(&first, "set-cookie"), Some("session=secret"));
    assert_eq!(first.text().await.expect("body"), "ABC 1");
    let again = send(addr, "/t", Some("rw"), &[], "abc").await;
    assert!(replayed(&again));
    assert_eq!(header(&again, "x-rewritten"), Some("yes"));
    assert_eq!(header(&again, "set-cookie"), None);
    assert_eq!(again.text().await.expect("body"), "ABC 1");
    let other = send(addr, "/t", Some("rw"), &[], "ABC").await;
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(effects.count(), 1);
}

// ---- 10. Streamed answers ----------------------------------------------------------------

fn streaming(effects: &Effects, panic_at: Option<usize>) -> Router {
    let sink = effects.clone();
    Router::new().route(
        "/t",
        post(move || async move {
            sink.hit();
            let stream = futures_util::stream::unfold(0usize, move |i| async move {
                if i == 5 {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(60)).await;
                if Some(i) == panic_at {
                    panic!("body bug");
                }
                Some((
                    Ok::<_, Infallible>(bytes::Bytes::from(format!("chunk {i};"))),
                    i + 1,
                ))
            });
            (StatusCode::CREATED, Body::from_stream(stream))
        }),
    )
}

/// Reads the head of a POST over raw TCP, then hangs up mid-body.
async fn hang_up_after_head(addr: SocketAddr, key: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!(
        "POST /t HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\naccept-encoding: gzip\r\n\
         content-length: 2\r\n\r\n{{}}"
    );
    stream.write_all(req.as_bytes()).await.expect("write");
    let mut buf = vec![0u8; 4096];
    let n = stream.read(&mut buf).await.expect("read");
    drop(stream);
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// §1 step 7 and §3: a client hangs up after the head of a streamed answer (with a
/// `CompressionLayer` outside, too): the answer is still read to its end and recorded, or kept
/// as not stored; never a second run, never in flight forever.
#[tokio::test]
async fn s1_7_hang_up_mid_stream_is_recorded_not_stranded() {
    for compress in [false, true] {
        let effects = Effects::default();
        let mut app = streaming(&effects, None).route_layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .lease(Duration::from_millis(300)),
        );
        if compress {
            app = app.layer(tower_http::compression::CompressionLayer::new());
        }
        let addr = serve(app).await;
        let head = hang_up_after_head(addr, "s").await;
        assert!(head.starts_with("HTTP/1.1 201"), "{head}");
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let retry = send(addr, "/t", Some("s"), &[], "{}").await;
        let status = retry.status();
        if status == StatusCode::CREATED {
            assert!(replayed(&retry));
            assert_eq!(
                retry.text().await.expect("body"),
                "chunk 0;chunk 1;chunk 2;chunk 3;chunk 4;",
                "compress {compress}"
            );
        } else {
            assert_eq!(
                slug(retry).await,
                "response-not-stored",
                "compress {compress}"
            );
        }
        assert_eq!(effects.count(), 1, "compress {compress}");
    }
}

/// §3 ("a failure of the response body afterwards never releases the key") and the "stranded"
/// worst case: a response body that PANICS mid-stream (not an error: an unwinding poll, on
/// hyper's connection task). The key must end definite (completed without a response), not in
/// flight forever under a keeper that renews a dead holder's lease, and never run twice.
#[tokio::test]
async fn s3_a_panicking_response_body_does_not_strand_the_key() {
    let effects = Effects::default();
    let app = streaming(&effects, Some(2)).route_layer(
        IdempotencyLayer::new(MemoryStore::new())
            .single_tenant()
            .lease(Duration::from_millis(300)),
    );
    let addr = serve(app).await;
    let first = client()
        .post(format!("http://{addr}/t"))
        .header("idempotency-key", "bp")
        .body("{}")
        .send()
        .await;
    if let Ok(first) = first {
        let _ = first.bytes().await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut seen = Vec::new();
    for _ in 0..3 {
        let retry = send(addr, "/t", Some("bp"), &[], "{}").await;
        let status = retry.status();
        let s = slug(retry).await;
        seen.push(format!("{status} {s}"));
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    assert!(
        !seen.iter().any(|s| s.contains("in-flight")),
        "key stranded in flight after a body panic: {seen:?}"
    );
    assert_eq!(effects.count(), 1, "{seen:?}");
}

/// §3: `ResponseBodyTimeoutLayer` INSIDE cuts a stalled body after the head: completed, not
/// stored; retries get `response-not-stored` (`safe_new_key: true`: the outcome is definite,
/// as `http_contract.rs` asserts), never a second run.
#[tokio::test]
async fn s3_inner_response_body_timeout_keeps_the_key_consumed() {
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/t",
            post(move || async move {
                sink.hit();
                let stream = futures_util::stream::unfold(0usize, |i| async move {
                    if i == 1 {
                        tokio::time::sleep(Duration::from_secs(5)).await;
                    }
                    (i < 3).then(|| (Ok::<_, Infallible>(bytes::Bytes::from("x")), i + 1))
                });
                (StatusCode::CREATED, Body::from_stream(stream))
            }),
        )
        .route_layer(tower_http::timeout::ResponseBodyTimeoutLayer::new(
            Duration::from_millis(200),
        ))
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    let first = send(addr, "/t", Some("rbt"), &[], "{}").await;
    let _ = first.bytes().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let retry = send(addr, "/t", Some("rbt"), &[], "{}").await;
    assert_eq!(retry.status(), StatusCode::CONFLICT);
    let p = problem(retry).await;
    assert_eq!(p["type"], problem_type("response-not-stored"));
    assert_eq!(p["safe_new_key"], true);
    assert_eq!(effects.count(), 1);
}

// ---- 11. Waiters under an outer timeout, nested layers -----------------------------------

/// §1 step 6 (`wait_for_in_flight`) under an outer `TimeoutLayer` shorter than the wait: the
/// waiting retry's future is dropped mid-wait (408 from the timeout); nothing is stranded,
/// the holder's outcome is recorded and replayed, one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_6_a_waiter_dropped_by_an_outer_timeout_strands_nothing() {
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/t",
            post(move || async move {
                tokio::time::sleep(Duration::from_millis(1500)).await;
                (StatusCode::CREATED, format!("done {}", sink.hit()))
            }),
        )
        .route_layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .wait_for_in_flight(Duration::from_secs(10)),
        )
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            Duration::from_millis(200),
        ));
    let addr = serve(app).await;
    let first = send(addr, "/t", Some("w"), &[], "{}").await;
    assert_eq!(first.status(), StatusCode::REQUEST_TIMEOUT);
    for _ in 0..2 {
        let waiter = send(addr, "/t", Some("w"), &[], "{}").await;
        assert_eq!(
            waiter.status(),
            StatusCode::REQUEST_TIMEOUT,
            "still waiting"
        );
    }
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let later = send(addr, "/t", Some("w"), &[], "{}").await;
    assert_eq!(later.status(), StatusCode::CREATED);
    assert!(replayed(&later));
    assert_eq!(later.text().await.expect("body"), "done 1");
    assert_eq!(effects.count(), 1);
}

/// README ("An inner layer under an outer one ... passes through: one claim per request, under
/// the outer layer's scope") with §1 step 2: a careless app puts a `single_tenant()` layer on
/// the whole router and a principal-scoped one on a route. The outer layer claims first, so the
/// route's principal scoping would silently not apply, and two principals with one key would
/// share one answer. The inner layer refuses instead (500 `scope-missing`, nothing run, the
/// outer's key given back, so the same key runs once the app is mended); layers that agree on
/// the scope run as one.
#[tokio::test]
async fn s1_2_nested_layers_with_different_scopes_refuse_and_agreeing_ones_run_once() {
    let effects = Effects::default();
    let app = whose(&effects)
        .route_layer(
            IdempotencyLayer::new(MemoryStore::new()).scope_by_principal(|u: &User| u.0.clone()),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant())
        .layer(middleware::from_fn(auth));
    let addr = serve(app).await;
    for who in ["alice", "bob", "alice"] {
        let bearer = format!("Bearer {who}");
        let res = send(addr, "/t", Some("nk"), &[("authorization", &bearer)], "{}").await;
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR, "{who}");
        assert!(!replayed(&res), "{who}");
        let body = problem(res).await;
        assert_eq!(body["type"], problem_type("scope-missing"), "{who}: {body}");
    }
    assert_eq!(effects.count(), 0, "nothing ran under the outer scope");

    // The same layers, agreeing: one claim each, per principal.
    let effects = Effects::default();
    let scoped =
        || IdempotencyLayer::new(MemoryStore::new()).scope_by_principal(|u: &User| u.0.clone());
    let app = whose(&effects)
        .route_layer(scoped())
        .layer(scoped())
        .layer(middleware::from_fn(auth));
    let addr = serve(app).await;
    let mut bodies = Vec::new();
    for who in ["alice", "bob", "alice", "bob"] {
        let bearer = format!("Bearer {who}");
        let res = send(addr, "/t", Some("nk"), &[("authorization", &bearer)], "{}").await;
        assert_eq!(res.status(), StatusCode::CREATED, "{who}");
        bodies.push(res.text().await.expect("body"));
    }
    assert_eq!(effects.count(), 2, "{bodies:?}");
    assert_eq!(bodies[0], bodies[2], "alice replayed her own");
    assert_eq!(bodies[1], bodies[3], "bob replayed his own");
    assert!(
        bodies[0].contains("alice") && bodies[1].contains("bob"),
        "{bodies:?}"
    );
}
