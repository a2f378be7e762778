//! Issue 22, the client half attacked: hostile answers, extreme settings, and the middleware's
//! own refusals in every dialect. A fresh review wrote these against the first version; each
//! failed there as its comment tells (the code named is that version's), and holds now.

use crate::common;

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use bytes::Bytes;
use common::{Effects, gzip, serve};
use http_body::Frame;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::ServiceExt;
use tower_idempotency::client::{
    CallBody, CallReport, ClientError, Ended, IdempotentClientLayer, OperationKey,
};
use tower_idempotency::jsonrpc::JsonRpc;
use tower_idempotency::{CachePolicy, IdempotencyLayer, MemoryStore};

fn key(step: &str) -> OperationKey {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    OperationKey::step(&format!("review-{nanos}"), step).expect("key")
}

fn keyed(uri: &str, body: &'static [u8], key: &OperationKey) -> http::Request<Full<Bytes>> {
    let mut req = http::Request::post(uri)
        .body(Full::new(Bytes::from_static(body)))
        .expect("request");
    req.extensions_mut().insert(key.clone());
    req
}

/// An inner "HTTP client" that answers every attempt with `status` and `headers`, counting
/// attempts.
fn canned(
    status: u16,
    headers: &'static [(&'static str, &'static str)],
    attempts: Arc<AtomicUsize>,
) -> impl tower::Service<
    http::Request<Full<Bytes>>,
    Response = http::Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl Send,
> + Clone
+ Send
+ 'static {
    tower::service_fn(move |_req: http::Request<Full<Bytes>>| {
        attempts.fetch_add(1, Ordering::SeqCst);
        async move {
            let mut res = http::Response::new(Full::new(Bytes::from_static(b"x")));
            *res.status_mut() = StatusCode::from_u16(status).expect("status");
            for (n, v) in headers {
                res.headers_mut().insert(*n, v.parse().expect("value"));
            }
            Ok::<_, Infallible>(res)
        }
    })
}

/// Runs `f` in its own task, so a panic in the layer is reported as a finding, not as an
/// abort of the test's own future.
async fn no_panic<T: Send + 'static>(
    what: &str,
    f: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    match tokio::spawn(f).await {
        Ok(v) => v,
        Err(e) if e.is_panic() => {
            let p = e.into_panic();
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            panic!("({what}): the client layer panicked: {msg}");
        }
        Err(e) => panic!("join: {e}"),
    }
}

// ------------------------------------------------------------------------------------------
// 1. A hostile Retry-After panics the caller's task.
// ------------------------------------------------------------------------------------------

/// A 503 with `Retry-After: 18446744073709551615` (any value past ~2^63 s): the layer adds the
/// jittered pause to `Instant::now()` (mod.rs, `tokio::time::Instant::now() + pause`), which
/// overflows and panics. It should give up with `DeadlineExceeded` (the wait is past the
/// deadline), as it does for `Retry-After: 1000000000000`.
#[tokio::test]
async fn s22_huge_retry_after_must_not_panic() {
    // Sanity: 10^12 s is handled (the wait is past the deadline: a typed stop).
    let attempts = Arc::new(AtomicUsize::new(0));
    let svc = IdempotentClientLayer::new()
        .deadline(Duration::from_secs(2))
        .layer_on(canned(503, &[("retry-after", "1000000000000")], attempts));
    let r = svc.oneshot(keyed("http://x/", b"a", &key("ra12"))).await;
    assert!(
        matches!(r, Err(ClientError::DeadlineExceeded { .. })),
        "{r:?}"
    );

    let attempts = Arc::new(AtomicUsize::new(0));
    let svc = IdempotentClientLayer::new()
        .deadline(Duration::from_secs(2))
        .layer_on(canned(
            503,
            &[("retry-after", "18446744073709551615")],
            attempts,
        ));
    let k = key("ramax");
    let r = no_panic("Retry-After: u64::MAX", async move {
        svc.oneshot(keyed("http://x/", b"a", &k)).await.map(|_| ())
    })
    .await;
    assert!(
        matches!(r, Err(ClientError::DeadlineExceeded { .. })),
        "{r:?}"
    );
}

trait LayerOn {
    fn layer_on<S>(&self, s: S) -> tower_idempotency::client::IdempotentClient<S>;
}
impl LayerOn for IdempotentClientLayer {
    fn layer_on<S>(&self, s: S) -> tower_idempotency::client::IdempotentClient<S> {
        tower::Layer::layer(self, s)
    }
}

// ------------------------------------------------------------------------------------------
// 2. Configuration values that panic: `deadline(Duration::MAX)`, `backoff(Duration::MAX, _)`.
// ------------------------------------------------------------------------------------------

/// "No deadline" written as `Duration::MAX` panics on the first call
/// (`started + config.deadline` in mod.rs), even when the server answers 201 at once.
#[tokio::test]
async fn s22_deadline_duration_max_must_not_panic() {
    let attempts = Arc::new(AtomicUsize::new(0));
    let svc = IdempotentClientLayer::new()
        .deadline(Duration::MAX)
        .layer_on(canned(201, &[], attempts.clone()));
    let k = key("dmax");
    let r = no_panic("deadline(Duration::MAX)", async move {
        svc.oneshot(keyed("http://x/", b"a", &k))
            .await
            .map(|r| r.status())
    })
    .await;
    assert_eq!(r.expect("answer"), StatusCode::CREATED);
}

/// A huge first backoff panics at the first retry: `backoff * 2` (mod.rs) overflows before
/// the deadline is even checked. It should stop with `DeadlineExceeded`.
#[tokio::test]
async fn s22_backoff_duration_max_must_not_panic() {
    let attempts = Arc::new(AtomicUsize::new(0));
    let svc = IdempotentClientLayer::new()
        .deadline(Duration::from_secs(1))
        .backoff(Duration::MAX, Duration::MAX)
        .layer_on(canned(503, &[], attempts.clone()));
    let k = key("bmax");
    let r = no_panic("backoff(Duration::MAX, Duration::MAX)", async move {
        svc.oneshot(keyed("http://x/", b"a", &k)).await.map(|_| ())
    })
    .await;
    assert!(
        matches!(r, Err(ClientError::DeadlineExceeded { .. })),
        "{r:?}"
    );
}

// ------------------------------------------------------------------------------------------
// 3. A recorded 503 (CachePolicy::Everything) is never accepted: lost answer, wrong error.
// ------------------------------------------------------------------------------------------

/// Under `CachePolicy::Everything` the server records the handler's 503 and replays it
/// (`Idempotency-Replayed: true`) for ever. The client's verdict checks `503` before
/// `replayed` (retry.rs, `(StatusCode::SERVICE_UNAVAILABLE, _) => Retry`), so it retries a
/// recorded answer until the deadline and reports `DeadlineExceeded` ("the operation may have
/// run; retry later with the same key"), which can never succeed. A 500 in the same situation
/// is accepted as the replayed answer; the 503 should be too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s22_recorded_503_replay_is_the_answer() {
    let effects = Effects::default();
    let app = Router::new()
        .route(
            "/pay",
            post({
                let effects = effects.clone();
                move || async move {
                    effects.hit();
                    (StatusCode::SERVICE_UNAVAILABLE, "bank said no, partially")
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .cache_policy(CachePolicy::Everything),
        );
    let addr = serve(app).await;
    let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let layer = IdempotentClientLayer::new()
        .deadline(Duration::from_secs(3))
        .backoff(Duration::from_millis(20), Duration::from_millis(50));
    let client = tower::ServiceBuilder::new().layer(layer).service(http);
    let r = client
        .oneshot(keyed(&format!("http://{addr}/pay"), b"p", &key("e503")))
        .await;
    assert_eq!(effects.count(), 1, "recorded: it ran once");
    let res = r.unwrap_or_else(|e| {
        panic!("a recorded, replayed 503 should be the call's answer; got {e:?}")
    });
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    let report = res.extensions().get::<CallReport>().expect("report");
    assert_eq!(report.ended, Ended::Replayed);
}

// ------------------------------------------------------------------------------------------
// 4. gRPC: the middleware's own BODY_TOO_LARGE (RESOURCE_EXHAUSTED) is retried to the deadline.
// ------------------------------------------------------------------------------------------

fn grpc_request(message_len: usize, key: &OperationKey) -> http::Request<Full<Bytes>> {
    let mut framed = vec![0u8];
    framed.extend_from_slice(&(message_len as u32).to_be_bytes());
    framed.extend(std::iter::repeat_n(7u8, message_len));
    let mut req = http::Request::post("http://x/steps.Steps/Run")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Full::new(Bytes::from(framed)))
        .expect("request");
    req.extensions_mut().insert(key.clone());
    req
}

/// A gRPC call whose message is over the route's body limit: the server refuses it, nothing
/// claimed or run, with `RESOURCE_EXHAUSTED` / reason `BODY_TOO_LARGE`: deterministic, every
/// retry gets the same. The HTTP twin (413) is `Done` at once. The gRPC verdict (grpc.rs:
/// `code if !is_definitive(code) && !replayed => Retry`) retries it until the deadline and the
/// caller gets `DeadlineExceeded` ("the operation may have run") instead of the server's
/// status.
#[tokio::test]
async fn s22_grpc_body_too_large_is_the_answer_not_a_retry_loop() {
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        tower::service_fn(move |_req: http::Request<_>| {
            runs.fetch_add(1, Ordering::SeqCst);
            async move {
                let res = http::Response::builder()
                    .header("content-type", "application/grpc")
                    .header("grpc-status", "0")
                    .body(Full::new(Bytes::new()))
                    .expect("res");
                Ok::<_, Infallible>(res)
            }
        })
    };
    let server = tower::Layer::layer(
        &IdempotencyLayer::new_for_grpc(MemoryStore::new())
            .single_tenant()
            .grpc_method("/steps.Steps/Run", |m| m.body_limit(64)),
        handler,
    );
    let attempts = Arc::new(AtomicUsize::new(0));
    let counted = {
        let attempts = attempts.clone();
        tower::ServiceBuilder::new()
            .map_request(move |r: http::Request<Full<Bytes>>| {
                attempts.fetch_add(1, Ordering::SeqCst);
                r
            })
            .service(server)
    };
    let svc = IdempotentClientLayer::new()
        .deadline(Duration::from_secs(2))
        .backoff(Duration::from_millis(10), Duration::from_millis(20))
        .layer_on(counted);
    // Within the limit: runs.
    let ok = svc
        .clone()
        .oneshot(grpc_request(8, &key("small")))
        .await
        .expect("small");
    assert_eq!(ok.headers()["grpc-status"], "0");
    attempts.store(0, Ordering::SeqCst);
    let started = std::time::Instant::now();
    let r = svc.oneshot(grpc_request(1000, &key("big"))).await;
    let took = started.elapsed();
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the big one never ran");
    match r {
        Ok(res) => {
            let status = res
                .headers()
                .get("grpc-status")
                .or_else(|| res.body().trailers().and_then(|t| t.get("grpc-status")));
            assert_eq!(status.map(|v| v.as_bytes()), Some(&b"8"[..]));
            assert_eq!(attempts.load(Ordering::SeqCst), 1);
        }
        Err(e) => panic!(
            "a deterministic BODY_TOO_LARGE refusal was retried {} times over {took:?} \
             and ended as {e:?} (\"{e}\")",
            attempts.load(Ordering::SeqCst)
        ),
    }
}

// ------------------------------------------------------------------------------------------
// 5. JSON-RPC routes: the middleware's in-flight refusal is taken for the operation's answer.
// ------------------------------------------------------------------------------------------

/// On a route in JSON-RPC mode (an MCP server behind `IdempotencyLayer::jsonrpc`), the server
/// accepts the key in the `Idempotency-Key` header, which is exactly what the client layer
/// sends. Its refusals are JSON-RPC errors (`application/json`, HTTP 409 for in-flight, code
/// -31001), not `application/problem+json`, so the client's verdict (retry.rs `problem_slug`)
/// sees "a 409 of the application's own": an attempt that times out, then meets its own first
/// attempt still running, returns the in-flight refusal as the call's answer
/// (`Ended::Answered`), not the operation's result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s22_jsonrpc_in_flight_refusal_is_not_the_answer() {
    let effects = Effects::default();
    let app = Router::new()
        .route(
            "/mcp",
            post({
                let effects = effects.clone();
                move |body: Bytes| async move {
                    tokio::time::sleep(Duration::from_millis(1200)).await;
                    let n = effects.hit();
                    let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
                    axum::Json(serde_json::json!({
                        "jsonrpc": "2.0", "id": v["id"],
                        "result": {"content": [{"type": "text", "text": format!("ticket {n}")}]}
                    }))
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .lease(Duration::from_secs(10))
                .jsonrpc(JsonRpc::new()),
        );
    let addr = serve(app).await;
    let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let layer = IdempotentClientLayer::new()
        .attempt_timeout(Duration::from_millis(300))
        .deadline(Duration::from_secs(15))
        .backoff(Duration::from_millis(50), Duration::from_millis(100));
    let client = tower::ServiceBuilder::new().layer(layer).service(http);
    let call = br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"create_ticket","arguments":{"t":"x"}}}"#;
    let mut req = http::Request::post(format!("http://{addr}/mcp"))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(Full::new(Bytes::from_static(call)))
        .expect("req");
    req.extensions_mut().insert(key("mcp"));
    let res = client.oneshot(req).await.expect("an answer");
    let status = res.status();
    let report = res
        .extensions()
        .get::<CallReport>()
        .cloned()
        .expect("report");
    let body = String::from_utf8_lossy(&res.into_body().bytes()).into_owned();
    assert_eq!(
        status,
        StatusCode::OK,
        "the call ended with the middleware's in-flight refusal as its answer \
         ({report:?}): {body}"
    );
    assert!(body.contains("ticket 1"), "{body}");
    assert_eq!(effects.count(), 1);
}

// ------------------------------------------------------------------------------------------
// 6. The answer's body is read without any bound.
// ------------------------------------------------------------------------------------------

/// A body that yields `chunk` over and over, up to `cap` bytes, then stays open for ever;
/// counts what was pulled.
struct Endless {
    chunk: Bytes,
    pulled: Arc<AtomicU64>,
    cap: u64,
}

impl http_body::Body for Endless {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let pulled = self.pulled.load(Ordering::SeqCst);
        if pulled >= self.cap {
            return Poll::Pending;
        }
        self.pulled
            .fetch_add(self.chunk.len() as u64, Ordering::SeqCst);
        Poll::Ready(Some(Ok(Frame::data(self.chunk.clone()))))
    }
}

/// A server (or anything in between) that answers with an endless body: the layer collects
/// it whole into memory (mod.rs `body.collect()`), with no size limit and no setting for one,
/// until the attempt timeout or the deadline. Here 4 GiB are pulled into one call's buffer
/// (the same 16 MiB chunk cloned, so the test itself stays cheap; a real server's bytes would
/// be real memory). A client should stop reading past some bound.
#[tokio::test]
async fn s22_answer_body_is_read_without_bound() {
    let pulled = Arc::new(AtomicU64::new(0));
    let chunk = Bytes::from(vec![b'z'; 16 << 20]);
    let inner = {
        let pulled = pulled.clone();
        tower::service_fn(move |_req: http::Request<Full<Bytes>>| {
            let body = Endless {
                chunk: chunk.clone(),
                pulled: pulled.clone(),
                cap: 4 << 30,
            };
            async move { Ok::<_, Infallible>(http::Response::new(body)) }
        })
    };
    let svc = IdempotentClientLayer::new()
        .attempt_timeout(Duration::from_millis(500))
        .deadline(Duration::from_millis(700))
        .layer_on(inner);
    let r = svc.oneshot(keyed("http://x/", b"a", &key("endless"))).await;
    assert!(
        matches!(&r, Err(ClientError::AnswerTooLarge { limit, .. }) if *limit == 16 << 20),
        "{r:?}"
    );
    let gib = pulled.load(Ordering::SeqCst) as f64 / f64::from(1u32 << 30);
    assert!(
        gib < 0.25,
        "the layer pulled {gib:.2} GiB of one answer into memory before giving up \
         ({r:?})"
    );
}

// ------------------------------------------------------------------------------------------
// 7. Minor: `Retry-After: 0` from a proxy makes a hot loop; request extensions are dropped.
// ------------------------------------------------------------------------------------------

/// A 503 with `Retry-After: 0` (a load balancer, a proxy: the middleware itself never sends
/// 0) is obeyed literally: no backoff at all, so a 500 ms deadline sends thousands of
/// attempts to a server that is already unavailable. The configured backoff should be a
/// floor.
#[tokio::test]
async fn s22_retry_after_zero_is_not_a_hot_loop() {
    let attempts = Arc::new(AtomicUsize::new(0));
    let svc = IdempotentClientLayer::new()
        .deadline(Duration::from_millis(500))
        .backoff(Duration::from_millis(100), Duration::from_millis(200))
        .layer_on(canned(503, &[("retry-after", "0")], attempts.clone()));
    let r = svc.oneshot(keyed("http://x/", b"a", &key("ra0"))).await;
    assert!(
        matches!(r, Err(ClientError::DeadlineExceeded { .. })),
        "{r:?}"
    );
    let n = attempts.load(Ordering::SeqCst);
    assert!(
        n <= 10,
        "{n} attempts in 500 ms against a 503 with Retry-After: 0 (backoff 100 ms)"
    );
}

#[derive(Clone, Debug)]
struct Marker;

/// Every attempt is rebuilt from method, URI, version and headers: the request's extensions
/// (the `OperationKey` itself, tonic's `GrpcMethod`, hyper's `Protocol`/header-case maps, a
/// tracing context, anything an inner layer reads) never reach the inner service.
#[tokio::test]
async fn s22_request_extensions_reach_the_inner_service() {
    let seen = Arc::new(AtomicUsize::new(0));
    let inner = {
        let seen = seen.clone();
        tower::service_fn(move |req: http::Request<Full<Bytes>>| {
            if req.extensions().get::<Marker>().is_some() {
                seen.fetch_add(1, Ordering::SeqCst);
            }
            async { Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::new()))) }
        })
    };
    let svc = IdempotentClientLayer::new().layer_on(inner);
    let mut req = keyed("http://x/", b"a", &key("ext"));
    req.extensions_mut().insert(Marker);
    let _: http::Response<CallBody> = svc.oneshot(req).await.expect("answer");
    assert_eq!(
        seen.load(Ordering::SeqCst),
        1,
        "the request's extensions were dropped before the inner service"
    );
}

// ------------------------------------------------------------------------------------------
// 8. gRPC-Web: an answer compressed as a whole is recorded by the server, but the client
//    can never read its status: it retries the recorded answer to the deadline.
// ------------------------------------------------------------------------------------------

fn web_frame(flag: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![flag];
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// The server documents and tests (`grpc_web_hostile::s19_3`) that a gRPC-Web answer with
/// `Content-Encoding: gzip` over its whole body is recorded ("taken as done") and replayed.
/// The client's gRPC verdict (grpc.rs) cannot split a compressed body, finds no status, and
/// for a 200 answers `Retry` without looking at `replayed`: the first (recorded) answer is
/// retried, and so is every replay, until the deadline. The caller gets `DeadlineExceeded`
/// for an operation that completed once, and never its answer.
#[tokio::test]
async fn s22_grpc_web_gzipped_recorded_answer_is_the_answer() {
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        tower::service_fn(move |_req: http::Request<_>| {
            runs.fetch_add(1, Ordering::SeqCst);
            async move {
                let mut plain = web_frame(0, b"done");
                plain.extend(web_frame(0x80, b"grpc-status:0\r\n"));
                let res = http::Response::builder()
                    .header("content-type", "application/grpc-web+proto")
                    .header("content-encoding", "gzip")
                    .body(Full::new(Bytes::from(gzip(&plain))))
                    .expect("res");
                Ok::<_, Infallible>(res)
            }
        })
    };
    let server = tower::Layer::layer(
        &IdempotencyLayer::new_for_grpc(MemoryStore::new())
            .single_tenant()
            .grpc_method("/s.S/M", |m| m),
        handler,
    );
    let attempts = Arc::new(AtomicUsize::new(0));
    let counted = {
        let attempts = attempts.clone();
        tower::ServiceBuilder::new()
            .map_request(move |r: http::Request<Full<Bytes>>| {
                attempts.fetch_add(1, Ordering::SeqCst);
                r
            })
            .service(server)
    };
    let svc = IdempotentClientLayer::new()
        .deadline(Duration::from_secs(2))
        .backoff(Duration::from_millis(10), Duration::from_millis(20))
        .layer_on(counted);
    let mut req = http::Request::post("http://x/s.S/M")
        .header("content-type", "application/grpc-web+proto")
        .header("accept-encoding", "gzip")
        .body(Full::new(Bytes::from(web_frame(0, b"hi"))))
        .expect("req");
    req.extensions_mut().insert(key("gzweb"));
    let r = svc.oneshot(req).await;
    assert_eq!(runs.load(Ordering::SeqCst), 1, "it ran once");
    if let Err(e) = r {
        panic!(
            "a recorded gzipped gRPC-Web answer was retried {} times and ended as {e:?}",
            attempts.load(Ordering::SeqCst)
        );
    }
}

// ------------------------------------------------------------------------------------------
// 9. Minor: `attempts` (and `idempotency_client_attempts_total`) count attempts never sent.
// ------------------------------------------------------------------------------------------

/// `ClientError::DeadlineExceeded::attempts` and `CallReport::attempts` are documented as
/// "Attempts sent". The layer counts an attempt before the inner service is even ready, so an
/// inner `ConcurrencyLimit` that is saturated makes every "attempt" a wait for a permit that
/// is abandoned at the attempt timeout: the error reports attempts that were never sent.
#[tokio::test]
async fn s22_attempts_counts_only_attempts_sent() {
    let sent = Arc::new(AtomicUsize::new(0));
    let slow = {
        let sent = sent.clone();
        tower::service_fn(move |_req: http::Request<Full<Bytes>>| {
            sent.fetch_add(1, Ordering::SeqCst);
            async {
                tokio::time::sleep(Duration::from_secs(3)).await;
                Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::new())))
            }
        })
    };
    let limited = tower::ServiceBuilder::new()
        .concurrency_limit(1)
        .service(slow);
    // Occupy the only permit for 3 s.
    let busy = {
        let limited = limited.clone();
        tokio::spawn(async move {
            let _ = limited
                .oneshot(http::Request::new(Full::new(Bytes::new())))
                .await;
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let svc = IdempotentClientLayer::new()
        .attempt_timeout(Duration::from_millis(200))
        .deadline(Duration::from_secs(1))
        .backoff(Duration::from_millis(10), Duration::from_millis(20))
        .layer_on(limited);
    let r = svc.oneshot(keyed("http://x/", b"a", &key("cl"))).await;
    busy.abort();
    let really_sent = sent.load(Ordering::SeqCst) - 1;
    match r {
        Err(ClientError::DeadlineExceeded { attempts, .. }) => assert_eq!(
            attempts as usize, really_sent,
            "DeadlineExceeded reports {attempts} attempts sent; {really_sent} were"
        ),
        other => panic!("{other:?}"),
    }
}

/// A zero timeout, with or without a window, can only give up: it is refused before anything
/// is sent.
#[tokio::test]
async fn s22_zero_timeouts_are_refused_before_sending() {
    for layer in [
        IdempotentClientLayer::new().deadline(Duration::ZERO),
        IdempotentClientLayer::new().attempt_timeout(Duration::ZERO),
    ] {
        assert!(
            matches!(layer.check(), Err(ClientError::DeadlineTooShort { timeout, .. }) if timeout.is_zero())
        );
        let attempts = Arc::new(AtomicUsize::new(0));
        let svc = layer.layer_on(canned(201, &[], attempts.clone()));
        let r = svc.oneshot(keyed("http://x/", b"a", &key("zero"))).await;
        assert!(
            matches!(r, Err(ClientError::DeadlineTooShort { .. })),
            "{r:?}"
        );
        assert_eq!(attempts.load(Ordering::SeqCst), 0, "nothing sent");
    }
}

// ------------------------------------------------------------------------------------------
// Session 51's review of the client.
// ------------------------------------------------------------------------------------------

/// DESIGN §9 (honouring `Retry-After`; bad input never a panic): a `Retry-After` whose quarter
/// passes half of `u64` nanoseconds (about 3.7e10 to 7.4e10 s) overflowed the jitter's spread
/// (`quarter * 2`), a panic in a debug build and a wrapped pause in a release one. The cases of
/// `s22_huge_retry_after_must_not_panic` fall on either side of that band.
#[tokio::test]
async fn s9_a_retry_after_in_the_jitters_overflow_band_is_a_typed_stop() {
    for seconds in ["40000000000", "50000000000", "73000000000"] {
        let attempts = Arc::new(AtomicUsize::new(0));
        let value: &'static str = Box::leak(seconds.to_owned().into_boxed_str());
        let headers: &'static [(&'static str, &'static str)] =
            Box::leak(vec![("retry-after", value)].into_boxed_slice());
        let svc = IdempotentClientLayer::new()
            .deadline(Duration::from_secs(2))
            .layer_on(canned(503, headers, attempts.clone()));
        let k = key("ra-band");
        let r = no_panic(seconds, async move {
            svc.oneshot(keyed("http://x/", b"a", &k)).await.map(|_| ())
        })
        .await;
        assert!(
            matches!(r, Err(ClientError::DeadlineExceeded { .. })),
            "{seconds}: {r:?}"
        );
        assert!(attempts.load(Ordering::SeqCst) <= 2, "{seconds}");
    }
}

/// DESIGN §9: a backoff configured as zero is taken as `MIN_BACKOFF`, never as attempts sent
/// back to back against a server that is unavailable (with a proxy's `Retry-After: 0`,
/// nothing else paces them). On a runtime whose clock is paused (an application's tests), a
/// zero pause never lets the clock move: the call never reached its deadline and spun for
/// good. Here the inner service gives up spinning after 10 000 attempts with a 201, which the
/// old code reached.
#[tokio::test(start_paused = true)]
async fn s9_a_zero_backoff_still_pauses_between_attempts() {
    assert!(tower_idempotency::client::MIN_BACKOFF > Duration::ZERO);
    let attempts = Arc::new(AtomicUsize::new(0));
    let inner = {
        let attempts = attempts.clone();
        tower::service_fn(move |_req: http::Request<Full<Bytes>>| {
            let n = attempts.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                let status = if n >= 10_000 { 201 } else { 503 };
                let res = http::Response::builder()
                    .status(status)
                    .header("retry-after", "0")
                    .body(Full::new(Bytes::new()))
                    .expect("response");
                Ok::<_, Infallible>(res)
            }
        })
    };
    let svc = IdempotentClientLayer::new()
        .deadline(Duration::from_millis(300))
        .backoff(Duration::ZERO, Duration::ZERO)
        .layer_on(inner);
    let r = svc.oneshot(keyed("http://x/", b"a", &key("zero"))).await;
    let n = attempts.load(Ordering::SeqCst);
    assert!(
        matches!(r, Err(ClientError::DeadlineExceeded { .. })),
        "after {n} attempts: {r:?}"
    );
    // At least 0.75 ms apart (the jitter takes off a quarter at most).
    assert!(
        n <= 300 * 4 / 3 + 2,
        "{n} attempts in 300 ms with a zero backoff"
    );
}

/// DESIGN §9 (409 in flight is waited on; a recorded answer is the answer): a `409 in-flight`
/// problem that comes back marked as a replay was recorded (a gateway behind the layer passed
/// a downstream's on, under a policy that records everything). Waiting on it would only get it
/// again, every attempt until the deadline, on every call for the key's TTL: it is the answer,
/// at once.
#[tokio::test]
async fn s9_a_replayed_in_flight_problem_is_the_answer_not_a_wait() {
    let attempts = Arc::new(AtomicUsize::new(0));
    let inner = {
        let attempts = attempts.clone();
        tower::service_fn(move |_req: http::Request<Full<Bytes>>| {
            attempts.fetch_add(1, Ordering::SeqCst);
            async move {
                let body = r#"{"type":"urn:tower-idempotency:problem:in-flight","status":409}"#;
                let res = http::Response::builder()
                    .status(409)
                    .header("content-type", "application/problem+json")
                    .header("idempotency-replayed", "true")
                    .header("retry-after", "1")
                    .body(Full::new(Bytes::from_static(body.as_bytes())))
                    .expect("response");
                Ok::<_, Infallible>(res)
            }
        })
    };
    let svc = IdempotentClientLayer::new()
        .deadline(Duration::from_secs(5))
        .layer_on(inner);
    let res = svc
        .oneshot(keyed("http://x/", b"a", &key("replayed-409")))
        .await
        .expect("the recorded answer");
    assert_eq!(res.status(), StatusCode::CONFLICT);
    let report = res
        .extensions()
        .get::<CallReport>()
        .expect("report")
        .clone();
    assert_eq!((report.attempts, report.ended), (1, Ended::Replayed));
    assert_eq!(attempts.load(Ordering::SeqCst), 1);
}

/// DESIGN §9 and the client's `max_answer_bytes`: a gRPC answer larger than the limit is judged
/// by its head, and a gRPC head (200, no status: a trailers-only answer would carry one) says
/// the call answered, not that nothing ran. Before, the verdict found no status (the trailers
/// came after the body it stopped reading) and retried: the server replayed the same answer,
/// too large again, until the deadline. Now `AnswerTooLarge` after one attempt, and the
/// handler ran once.
#[tokio::test]
async fn s9_a_grpc_answer_over_the_limit_is_too_large_not_retried() {
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        tower::service_fn(move |_req: http::Request<_>| {
            runs.fetch_add(1, Ordering::SeqCst);
            async move {
                let mut framed = vec![0u8];
                framed.extend_from_slice(&2048u32.to_be_bytes());
                framed.extend(std::iter::repeat_n(9u8, 2048));
                let mut trailers = http::HeaderMap::new();
                trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
                let frames = vec![
                    Ok::<_, Infallible>(Frame::data(Bytes::from(framed))),
                    Ok(Frame::trailers(trailers)),
                ];
                let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
                let res = http::Response::builder()
                    .header("content-type", "application/grpc")
                    .body(body)
                    .expect("res");
                Ok::<_, Infallible>(res)
            }
        })
    };
    let server = tower::Layer::layer(
        &IdempotencyLayer::new_for_grpc(MemoryStore::new())
            .single_tenant()
            .grpc_method("/steps.Steps/Run", |m| m),
        handler,
    );
    let attempts = Arc::new(AtomicUsize::new(0));
    let counted = {
        let attempts = attempts.clone();
        tower::ServiceBuilder::new()
            .map_request(move |r: http::Request<Full<Bytes>>| {
                attempts.fetch_add(1, Ordering::SeqCst);
                r
            })
            .service(server)
    };
    let svc = IdempotentClientLayer::new()
        .deadline(Duration::from_secs(2))
        .max_answer_bytes(1024)
        .backoff(Duration::from_millis(10), Duration::from_millis(20))
        .layer_on(counted);
    let r = svc.oneshot(grpc_request(8, &key("grpc-large"))).await;
    assert!(
        matches!(r, Err(ClientError::AnswerTooLarge { limit: 1024, .. })),
        "{r:?} after {} attempts",
        attempts.load(Ordering::SeqCst)
    );
    assert_eq!(attempts.load(Ordering::SeqCst), 1);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// DESIGN §9 (a caller's deadline; tonic's `grpc-timeout`): a gRPC call's own timeout bounds
/// the whole call, retries and waits included, and every attempt is sent with the time left.
/// Before, the header went out unchanged on every attempt (each told the server it had the
/// whole timeout again) and the call ran to the layer's own deadline, 60 s, for a caller who
/// asked for 300 ms. Paused clock: the times are the runtime's, exact.
#[tokio::test(start_paused = true)]
async fn s9_a_grpc_timeout_bounds_the_whole_call() {
    let sent = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let inner = {
        let sent = sent.clone();
        tower::service_fn(move |req: http::Request<Full<Bytes>>| {
            let timeout = req
                .headers()
                .get("grpc-timeout")
                .map(|v| v.to_str().expect("ascii").to_owned());
            sent.lock().expect("lock").push(timeout.unwrap_or_default());
            async move {
                // UNAVAILABLE, trailers-only: retried under the same key.
                let res = http::Response::builder()
                    .header("content-type", "application/grpc")
                    .header("grpc-status", "14")
                    .body(Full::new(Bytes::new()))
                    .expect("res");
                Ok::<_, Infallible>(res)
            }
        })
    };
    let svc = IdempotentClientLayer::new()
        .backoff(Duration::from_millis(40), Duration::from_millis(40))
        .layer_on(inner);
    let mut req = grpc_request(8, &key("grpc-timeout"));
    req.headers_mut()
        .insert("grpc-timeout", http::HeaderValue::from_static("300m"));
    let started = tokio::time::Instant::now();
    let r = svc.oneshot(req).await;
    let took = started.elapsed();
    assert!(
        matches!(r, Err(ClientError::DeadlineExceeded { .. })),
        "{r:?}"
    );
    assert!(took <= Duration::from_millis(300), "the call took {took:?}");
    let sent = sent.lock().expect("lock").clone();
    assert!(sent.len() >= 3, "{sent:?}");
    let millis: Vec<u64> = sent
        .iter()
        .map(|v| {
            v.strip_suffix('m')
                .expect("in ms")
                .parse()
                .expect("a number")
        })
        .collect();
    assert_eq!(millis[0], 300, "{sent:?}");
    assert!(
        millis.windows(2).all(|w| w[1] < w[0]),
        "each attempt is sent the time left: {sent:?}"
    );
}

/// DESIGN §9 (every attempt sends the same bytes): a request body with trailers cannot be sent
/// again as it was (every attempt is sent without them), so it is refused before anything is
/// sent, not silently sent without them.
#[tokio::test]
async fn s9_a_request_with_trailers_is_refused_not_cut() {
    let attempts = Arc::new(AtomicUsize::new(0));
    let svc = IdempotentClientLayer::new().layer_on(canned(201, &[], attempts.clone()));
    let mut trailers = http::HeaderMap::new();
    trailers.insert("x-checksum", http::HeaderValue::from_static("abc"));
    let frames = vec![
        Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"{}"))),
        Ok(Frame::trailers(trailers)),
    ];
    let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
    let mut req = http::Request::post("http://x/")
        .body(body)
        .expect("request");
    req.extensions_mut().insert(key("trailers"));
    let r = svc.oneshot(req).await;
    assert!(matches!(r, Err(ClientError::Body(_))), "{r:?}");
    assert_eq!(attempts.load(Ordering::SeqCst), 0, "nothing sent");
}

/// DESIGN §9 (the deadline rule), for gRPC:
/// - a `grpc-timeout` is the call's deadline, so under `for_window` one that does not
///   outlast the window, or a zero, is refused before anything is sent;
/// - with an attempt timeout, each attempt still carries the call's time left, not the
///   attempt's (a run the server lets finish may pass its deadline on downstream).
#[tokio::test(start_paused = true)]
async fn s9_grpc_timeouts_follow_the_deadline_rule() {
    // A route that has run nothing yet: its window is its lease (30 s).
    let window = IdempotencyLayer::new(MemoryStore::new())
        .processing_windows()
        .remove(0);
    let floor = window.min_deadline();
    let sent = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let inner = |status: &'static str| {
        let sent = sent.clone();
        tower::service_fn(move |req: http::Request<Full<Bytes>>| {
            let timeout = req
                .headers()
                .get("grpc-timeout")
                .map(|v| v.to_str().expect("ascii").to_owned());
            sent.lock().expect("lock").push(timeout.unwrap_or_default());
            async move {
                let res = http::Response::builder()
                    .header("content-type", "application/grpc")
                    .header("grpc-status", status)
                    .body(Full::new(Bytes::new()))
                    .expect("res");
                Ok::<_, Infallible>(res)
            }
        })
    };
    for short in [floor, Duration::ZERO] {
        let svc = IdempotentClientLayer::for_window(&window).layer_on(inner("0"));
        let mut req = grpc_request(8, &key("grpc-short"));
        let value = format!("{}m", short.as_millis());
        req.headers_mut().insert(
            "grpc-timeout",
            http::HeaderValue::from_str(&value).expect("v"),
        );
        let r = svc.oneshot(req).await;
        assert!(
            matches!(r, Err(ClientError::DeadlineTooShort { .. })),
            "{value}: {r:?}"
        );
    }
    assert!(sent.lock().expect("lock").is_empty(), "nothing sent");

    // UNAVAILABLE, answered at once and retried, with a 100 ms attempt timeout in a 2 s call:
    // every attempt is told the call's time left, never the attempt's 100 ms.
    let svc = IdempotentClientLayer::new()
        .attempt_timeout(Duration::from_millis(100))
        .backoff(Duration::from_millis(500), Duration::from_millis(500))
        .layer_on(inner("14"));
    let mut req = grpc_request(8, &key("grpc-left"));
    req.headers_mut()
        .insert("grpc-timeout", http::HeaderValue::from_static("2S"));
    let r = svc.oneshot(req).await;
    assert!(
        matches!(r, Err(ClientError::DeadlineExceeded { .. })),
        "{r:?}"
    );
    let millis: Vec<u64> = sent
        .lock()
        .expect("lock")
        .drain(..)
        .map(|v| v.strip_suffix('m').expect("ms").parse().expect("n"))
        .collect();
    assert_eq!(millis.first(), Some(&2000), "{millis:?}");
    assert!(millis.len() >= 2 && millis[1] > 100, "{millis:?}");
}
