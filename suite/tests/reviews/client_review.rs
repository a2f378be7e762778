#![allow(missing_docs)]
//! A fresh review of the client layer (DESIGN §9): each test attacks one promise of §9 or of
//! `src/client/mod.rs`'s module docs.

use crate::common;

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use bytes::Bytes;
use common::{Effects, gzip, serve};
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tower::ServiceExt;
use tower_idempotency::client::{
    CallReport, ClientError, Ended, IdempotentClient, IdempotentClientLayer, OperationKey,
};
use tower_idempotency::{IdempotencyLayer, MemoryStore};

fn key(step: &str) -> OperationKey {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    OperationKey::step(&format!("rev-{nanos}"), step).expect("key")
}

fn on<S>(layer: IdempotentClientLayer, s: S) -> IdempotentClient<S> {
    tower::Layer::layer(&layer, s)
}

type Answer = http::Response<Full<Bytes>>;

/// An inner "HTTP client" whose n-th attempt (from 0) is answered by `script(n)`; counts.
fn scripted(
    count: Arc<AtomicUsize>,
    script: impl Fn(usize) -> Answer + Send + Sync + 'static,
) -> impl tower::Service<
    http::Request<Full<Bytes>>,
    Response = Answer,
    Error = Infallible,
    Future = impl Send,
> + Clone
+ Send
+ 'static {
    let script = Arc::new(script);
    tower::service_fn(move |_req: http::Request<Full<Bytes>>| {
        let n = count.fetch_add(1, Ordering::SeqCst);
        let res = script(n);
        async move { Ok::<_, Infallible>(res) }
    })
}

fn answer(status: u16, headers: &[(&str, &str)], body: impl Into<Bytes>) -> Answer {
    let mut res = http::Response::new(Full::new(body.into()));
    *res.status_mut() = StatusCode::from_u16(status).expect("status");
    for (n, v) in headers {
        res.headers_mut().append(
            http::HeaderName::from_bytes(n.as_bytes()).expect("name"),
            v.parse().expect("value"),
        );
    }
    res
}

fn keyed(key: &OperationKey) -> http::Request<Full<Bytes>> {
    let mut req = http::Request::post("http://x/pay")
        .body(Full::new(Bytes::from_static(b"{\"amount\":1}")))
        .expect("req");
    req.extensions_mut().insert(key.clone());
    req
}

// ---------------------------------------------------------------------------------------
// The deadline bounds everything.
// ---------------------------------------------------------------------------------------

/// §9 "the deadline must bound everything": a request body that never ends (a streaming
/// upload, a tonic client-streaming call whose stream waits on the answer) is read before the
/// deadline's clock starts, so the call never ends at all.
#[tokio::test]
async fn s9_a_request_body_that_never_ends_is_bounded_by_the_deadline() {
    let count = Arc::new(AtomicUsize::new(0));
    let svc = on(
        IdempotentClientLayer::new().deadline(Duration::from_secs(1)),
        scripted(count.clone(), |_| answer(201, &[], "ok")),
    );
    let body = StreamBody::new(futures_util::stream::pending::<
        Result<Frame<Bytes>, Infallible>,
    >());
    let mut req = http::Request::post("http://x/upload")
        .body(body)
        .expect("req");
    req.extensions_mut().insert(key("stall"));
    let r = tokio::time::timeout(Duration::from_secs(30), svc.oneshot(req)).await;
    assert!(
        r.is_ok(),
        "a call with a 1 s deadline was still pending after 30 s"
    );
    assert_eq!(count.load(Ordering::SeqCst), 0);
}

/// An inner service that is never ready, or whose readiness fails: the deadline ends the
/// call, nothing is counted as sent.
#[tokio::test]
async fn s9_an_inner_service_never_ready_or_failing_readiness_is_bounded() {
    #[derive(Clone)]
    struct Stuck(bool, Arc<AtomicUsize>);
    impl tower::Service<http::Request<Full<Bytes>>> for Stuck {
        type Response = Answer;
        type Error = std::io::Error;
        type Future = std::future::Ready<Result<Answer, std::io::Error>>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), std::io::Error>> {
            match self.0 {
                true => Poll::Ready(Err(std::io::Error::other("closed"))),
                false => Poll::Pending,
            }
        }
        fn call(&mut self, _: http::Request<Full<Bytes>>) -> Self::Future {
            self.1.fetch_add(1, Ordering::SeqCst);
            std::future::ready(Ok(answer(201, &[], "ok")))
        }
    }
    for failing in [false, true] {
        let calls = Arc::new(AtomicUsize::new(0));
        let layer = IdempotentClientLayer::new()
            .deadline(Duration::from_secs(2))
            .backoff(Duration::from_millis(50), Duration::from_millis(200));
        let svc = on(layer, Stuck(failing, calls.clone()));
        let r = tokio::time::timeout(Duration::from_secs(30), svc.oneshot(keyed(&key("nr"))))
            .await
            .expect("bounded by the deadline");
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        match (failing, r) {
            (false, Err(ClientError::DeadlineExceeded { attempts: 0, .. })) => {}
            (true, Err(ClientError::Transport(_))) => {}
            (f, other) => panic!("failing={f}: {other:?}"),
        }
    }
}

/// A server that keeps asking for more time than the deadline leaves (`503`, `Retry-After` of
/// an hour): the call asks once more at half the time left, then stops, and never presses the
/// server with attempts packed before the deadline.
#[tokio::test]
async fn s9_a_wait_past_the_deadline_is_cut_once() {
    let count = Arc::new(AtomicUsize::new(0));
    let inner = scripted(count.clone(), |_| {
        answer(503, &[("retry-after", "3600")], "come back in an hour")
    });
    let layer = IdempotentClientLayer::new()
        .deadline(Duration::from_secs(2))
        .backoff(Duration::from_millis(20), Duration::from_millis(50));
    let r = tokio::time::timeout(
        Duration::from_secs(30),
        on(layer, inner).oneshot(keyed(&key("cut"))),
    )
    .await
    .expect("ended");
    assert!(
        matches!(r, Err(ClientError::DeadlineExceeded { attempts: 2, .. })),
        "{r:?}"
    );
    assert_eq!(
        count.load(Ordering::SeqCst),
        2,
        "the first attempt and one more"
    );
}

/// A server answering `409 in-flight` for ever, with every hostile `Retry-After` form: the call
/// ends with `DeadlineExceeded` within the deadline, and never spins.
#[tokio::test]
async fn s9_in_flight_for_ever_with_hostile_retry_after_is_bounded() {
    let forms: &[&[&str]] = &[
        &["Wed, 21 Oct 2015 07:28:00 GMT"],
        &["-1"],
        &["1.5"],
        &["0"],
        &["99999999999999999999999999"],
        &["18446744073709551615"],
        &["0", "100000"],
        &[""],
        &["  3 "],
    ];
    for form in forms {
        let count = Arc::new(AtomicUsize::new(0));
        let form: Vec<String> = form.iter().map(|s| (*s).to_owned()).collect();
        let f2 = form.clone();
        let inner = scripted(count.clone(), move |_| {
            let mut h = vec![("content-type", "application/problem+json")];
            for v in &f2 {
                h.push(("retry-after", v.as_str()));
            }
            answer(
                409,
                &h,
                r#"{"type":"urn:tower-idempotency:problem:in-flight","state":"in_progress"}"#,
            )
        });
        let layer = IdempotentClientLayer::new()
            .deadline(Duration::from_secs(1))
            .backoff(Duration::from_millis(100), Duration::from_secs(1));
        let svc = on(layer, inner);
        let r = tokio::time::timeout(Duration::from_secs(30), svc.oneshot(keyed(&key("if"))))
            .await
            .unwrap_or_else(|_| panic!("{form:?}: never ended"));
        let n = count.load(Ordering::SeqCst);
        assert!(
            matches!(r, Err(ClientError::DeadlineExceeded { .. })),
            "{form:?}: {r:?}"
        );
        assert!((1..=30).contains(&n), "{form:?}: {n} attempts in 1 s");
    }
}

// ---------------------------------------------------------------------------------------
// Every attempt the same.
// ---------------------------------------------------------------------------------------

/// A raw TCP server that records every request's bytes; the first connection is closed after
/// the request is read (no answer), the second gets a 201. Both attempts must be
/// byte-identical and carry the operation's key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s9_every_attempt_is_byte_identical_at_a_recording_server() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let seen: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    {
        let seen = seen.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut sock, _)) = listener.accept().await else {
                    return;
                };
                let seen = seen.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        let n = sock.read(&mut chunk).await.unwrap_or(0);
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        if let Some(end) = common::raw::find(&buf, b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                            let len: usize = head
                                .lines()
                                .find_map(|l| l.strip_prefix("content-length:"))
                                .and_then(|v| v.trim().parse().ok())
                                .unwrap_or(0);
                            if buf.len() >= end + 4 + len {
                                break;
                            }
                        }
                    }
                    let first = {
                        let mut s = seen.lock().expect("lock");
                        s.push(buf);
                        s.len() == 1
                    };
                    if first {
                        drop(sock);
                    } else {
                        let _ = sock
                            .write_all(b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok")
                            .await;
                    }
                });
            }
        });
    }
    let http: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let layer = IdempotentClientLayer::new()
        .deadline(Duration::from_secs(20))
        .backoff(Duration::from_millis(10), Duration::from_millis(20));
    let k = key("same");
    let mut req = http::Request::post(format!("http://{addr}/pay?x=1"))
        .header("content-type", "application/json")
        .header("x-trace", "a")
        .header("x-trace", "b")
        .header("idempotency-key", "a-key-the-caller-set-by-mistake")
        .body(Full::new(Bytes::from_static(
            b"{\"amount\":1,\"to\":\"x\"}",
        )))
        .expect("req");
    req.extensions_mut().insert(k.clone());
    let res = on(layer, http).oneshot(req).await.expect("answer");
    assert_eq!(res.status(), StatusCode::CREATED);
    let seen = seen.lock().expect("lock").clone();
    assert_eq!(seen.len(), 2, "one lost, one answered");
    assert_eq!(
        String::from_utf8_lossy(&seen[0]),
        String::from_utf8_lossy(&seen[1]),
        "attempts differ"
    );
    let text = String::from_utf8_lossy(&seen[0]).to_ascii_lowercase();
    assert_eq!(
        text.matches("idempotency-key:").count(),
        1,
        "exactly one key header: {text}"
    );
    assert!(
        text.contains(&format!(
            "idempotency-key: {}",
            k.as_str().to_ascii_lowercase()
        )),
        "{text}"
    );
}

// ---------------------------------------------------------------------------------------
// Answers misjudged.
// ---------------------------------------------------------------------------------------

/// A proxy's `503` error page (HTML, larger than a small `max_answer_bytes`) means nothing
/// ran: it should be retried. The layer reads the body before judging the status and ends the
/// call with `AnswerTooLarge` ("the operation has most likely taken effect").
#[tokio::test]
async fn s9_a_large_503_error_page_is_retried_not_answer_too_large() {
    let count = Arc::new(AtomicUsize::new(0));
    let page = Bytes::from(vec![b'x'; 64 * 1024]);
    let inner = scripted(count.clone(), move |n| match n {
        0 => answer(503, &[("content-type", "text/html")], page.clone()),
        _ => answer(201, &[], "ok"),
    });
    let layer = IdempotentClientLayer::new()
        .max_answer_bytes(16 * 1024)
        .backoff(Duration::from_millis(10), Duration::from_millis(20));
    let r = on(layer, inner).oneshot(keyed(&key("page"))).await;
    match r {
        Ok(res) => {
            assert_eq!(res.status(), StatusCode::CREATED);
            assert_eq!(count.load(Ordering::SeqCst), 2);
        }
        Err(e) => panic!(
            "a 503 (nothing ran) ended the call after {} attempt(s) as {e:?}",
            count.load(Ordering::SeqCst)
        ),
    }
}

/// `OperationKey::step` is `{run}:{step}`, and both parts may contain `:`: two different
/// workflow steps derive the same key, and the second gets the first's replay (or 422).
#[test]
fn s9_operation_keys_of_different_steps_differ() {
    let a = OperationKey::step("order:7", "refund").expect("a");
    let b = OperationKey::step("order", "7:refund").expect("b");
    assert_ne!(a, b, "two different (run, step) pairs share the key {a}");
}

/// Hostile characters and lengths are refused as typed errors, before anything is sent.
#[test]
fn s9_hostile_operation_keys_are_refused() {
    for bad in ["a\r\nx-evil: 1", "a\0b", "é", "a b", "a,b", ""] {
        assert!(OperationKey::new(bad).is_err(), "{bad:?} accepted");
    }
    assert!(OperationKey::new("k".repeat(256)).is_err());
    assert!(OperationKey::step(&"r".repeat(200), &"s".repeat(60)).is_err());
    assert!(OperationKey::new("k".repeat(255)).is_ok());
}

/// A handler whose response body fails after it answered: the server records the outcome as
/// done ("it will not run again", 500 `execution-failed`, `state: completed`). That answer is
/// recorded, so by the module docs ("What is not [retried]: … any answer the server
/// recorded") it is not retried; count requests at the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s9_a_recorded_execution_failure_is_not_retried() {
    let effects = Effects::default();
    let requests = Arc::new(AtomicUsize::new(0));
    let app = {
        let effects = effects.clone();
        let requests = requests.clone();
        Router::new()
            .route(
                "/pay",
                post(move || {
                    let effects = effects.clone();
                    async move {
                        effects.hit();
                        let stream = futures_util::stream::iter(vec![
                            Ok::<_, std::io::Error>(Bytes::from_static(b"part")),
                            Err(std::io::Error::other("broke")),
                        ]);
                        (StatusCode::CREATED, axum::body::Body::from_stream(stream))
                    }
                }),
            )
            .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant())
            .layer(axum::middleware::from_fn(
                move |req: axum::extract::Request, next: axum::middleware::Next| {
                    requests.fetch_add(1, Ordering::SeqCst);
                    next.run(req)
                },
            ))
    };
    let addr = serve(app).await;
    let http: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let layer = IdempotentClientLayer::new()
        .deadline(Duration::from_secs(10))
        .backoff(Duration::from_millis(10), Duration::from_millis(20));
    let mut req = http::Request::post(format!("http://{addr}/pay"))
        .body(Full::new(Bytes::from_static(b"x")))
        .expect("req");
    req.extensions_mut().insert(key("broken"));
    let r = on(layer, http).oneshot(req).await;
    let summary = match &r {
        Ok(res) => format!(
            "{} {:?}",
            res.status(),
            res.extensions().get::<CallReport>()
        ),
        Err(e) => format!("{e:?}"),
    };
    assert_eq!(effects.count(), 1, "ran once");
    assert_eq!(
        requests.load(Ordering::SeqCst),
        1,
        "a recorded answer was retried; the call ended as {summary}"
    );
}

/// `app` behind a response-compression layer (as tower-http's `CompressionLayer`, outside the
/// idempotency layer): every answer to a request that accepts gzip is gzipped.
fn gzipped(app: Router) -> Router {
    app.layer(axum::middleware::from_fn(
        |req: axum::extract::Request, next: axum::middleware::Next| async move {
            let gz = req
                .headers()
                .get("accept-encoding")
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.contains("gzip"));
            let res = next.run(req).await;
            if !gz {
                return res;
            }
            let (mut parts, body) = res.into_parts();
            let bytes = body.collect().await.expect("body").to_bytes();
            parts.headers.remove(http::header::CONTENT_LENGTH);
            parts.headers.insert(
                http::header::CONTENT_ENCODING,
                http::HeaderValue::from_static("gzip"),
            );
            axum::response::Response::from_parts(parts, axum::body::Body::from(gzip(&bytes)))
        },
    ))
}

/// A server behind a response-compression layer (tower-http's `CompressionLayer` and the
/// like, outside the idempotency layer) and a caller that accepts gzip: the `409 in-flight`
/// problem document arrives gzipped, the layer cannot read its `type`, and takes the refusal
/// for the operation's answer (`Ended::Answered`, status 409) instead of waiting for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s9_a_compressed_in_flight_refusal_is_not_the_answer() {
    let effects = Effects::default();
    let app = {
        let effects = effects.clone();
        Router::new()
            .route(
                "/pay",
                post(move || {
                    let effects = effects.clone();
                    async move {
                        tokio::time::sleep(Duration::from_millis(800)).await;
                        let n = effects.hit();
                        (StatusCode::CREATED, format!("paid {n}"))
                    }
                }),
            )
            .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant())
    };
    let addr = serve(gzipped(app)).await;
    let http: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let layer = IdempotentClientLayer::new()
        .attempt_timeout(Duration::from_millis(300))
        .deadline(Duration::from_secs(20))
        .backoff(Duration::from_millis(20), Duration::from_millis(50));
    let mut req = http::Request::post(format!("http://{addr}/pay"))
        .header("accept-encoding", "gzip")
        .body(Full::new(Bytes::from_static(b"x")))
        .expect("req");
    req.extensions_mut().insert(key("gz"));
    let res = on(layer, http).oneshot(req).await.expect("an answer");
    let report = res
        .extensions()
        .get::<CallReport>()
        .cloned()
        .expect("report");
    assert_eq!(
        res.status(),
        StatusCode::CREATED,
        "the gzipped 409 in-flight refusal was returned as the answer: {report:?}"
    );
    assert_eq!(report.ended, Ended::Replayed);
    assert_eq!(effects.count(), 1);
}

/// DESIGN §9 (what is retried) and §3 (a `409` is not a definitive outcome: the server gives
/// its key back): the same compression, and the application's own `409` (a conflict of its
/// own, with an effect before it), under the default policy. The client cannot read the
/// gzipped body, and used to take every encoded `409` for the layer's "in flight": it asked
/// again until the deadline, and each attempt ran the handler again. The layer's "in flight"
/// always says when to ask again (`Retry-After`); this one does not, so it is the answer,
/// after one run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s9_a_compressed_409_of_the_application_is_its_answer_after_one_run() {
    let effects = Effects::default();
    let app = {
        let effects = effects.clone();
        Router::new()
            .route(
                "/pay",
                post(move || {
                    let effects = effects.clone();
                    async move {
                        effects.hit();
                        (StatusCode::CONFLICT, "the order was changed meanwhile")
                    }
                }),
            )
            .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant())
    };
    let addr = serve(gzipped(app)).await;
    let http: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let layer = IdempotentClientLayer::new()
        .deadline(Duration::from_secs(3))
        .backoff(Duration::from_millis(20), Duration::from_millis(50));
    let mut req = http::Request::post(format!("http://{addr}/pay"))
        .header("accept-encoding", "gzip")
        .body(Full::new(Bytes::from_static(b"x")))
        .expect("req");
    req.extensions_mut().insert(key("gz-own-409"));
    let res = on(layer, http).oneshot(req).await;
    assert_eq!(effects.count(), 1, "the handler ran again: {res:?}");
    let res = res.expect("its answer");
    assert_eq!(res.status(), StatusCode::CONFLICT);
    let report = res.extensions().get::<CallReport>().expect("report");
    assert_eq!((report.attempts, report.ended), (1, Ended::Answered));
}

// ---------------------------------------------------------------------------------------
// gRPC.
// ---------------------------------------------------------------------------------------

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn field_bytes(out: &mut Vec<u8>, tag: u64, bytes: &[u8]) {
    varint(out, tag << 3 | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn field_varint(out: &mut Vec<u8>, tag: u64, v: u64) {
    varint(out, tag << 3);
    varint(out, v);
}

fn any(type_url: &str, value: &[u8]) -> Vec<u8> {
    let mut a = Vec::new();
    field_bytes(&mut a, 1, type_url.as_bytes());
    field_bytes(&mut a, 2, value);
    a
}

fn b64(bytes: &[u8]) -> String {
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk.len();
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let v = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..=n {
            out.push(A[((v >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

/// `grpc-status-details-bin` for a middleware status with `reason` and a `RetryInfo` delay of
/// `seconds` (encoded as protobuf's int64: a negative one is a 10-byte varint).
fn details(code: u64, reason: &str, seconds: Option<i64>) -> String {
    let mut info = Vec::new();
    field_bytes(&mut info, 1, reason.as_bytes());
    field_bytes(&mut info, 2, b"tower-idempotency");
    let mut status = Vec::new();
    field_varint(&mut status, 1, code);
    field_bytes(&mut status, 2, b"refused");
    field_bytes(
        &mut status,
        3,
        &any("type.googleapis.com/google.rpc.ErrorInfo", &info),
    );
    if let Some(s) = seconds {
        let mut d = Vec::new();
        field_varint(&mut d, 1, s as u64);
        let mut ri = Vec::new();
        field_bytes(&mut ri, 1, &d);
        field_bytes(
            &mut status,
            3,
            &any("type.googleapis.com/google.rpc.RetryInfo", &ri),
        );
    }
    b64(&status)
}

fn grpc_keyed(key: &OperationKey) -> http::Request<Full<Bytes>> {
    let mut req = http::Request::post("http://x/s.S/M")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Full::new(Bytes::from(common::grpc_frame(b"hi"))))
        .expect("req");
    req.extensions_mut().insert(key.clone());
    req
}

/// An `OUTCOME_UNKNOWN` status (ABORTED) whose details also carry a `RetryInfo` with an
/// absurd delay (negative, or past protobuf's range): the outcome is still unknown, and the
/// call must stop with `ClientError::OutcomeUnknown`, never retry it automatically.
#[tokio::test]
async fn s9_grpc_outcome_unknown_with_an_absurd_retry_info_is_still_typed() {
    for seconds in [-1i64, 400_000_000_000, i64::MAX] {
        let count = Arc::new(AtomicUsize::new(0));
        let d = details(10, "OUTCOME_UNKNOWN", Some(seconds));
        let inner = scripted(count.clone(), move |_| {
            answer(
                200,
                &[
                    ("content-type", "application/grpc"),
                    ("grpc-status", "10"),
                    ("grpc-status-details-bin", d.as_str()),
                ],
                Bytes::new(),
            )
        });
        let layer = IdempotentClientLayer::new()
            .deadline(Duration::from_secs(1))
            .backoff(Duration::from_millis(100), Duration::from_millis(200));
        let r = on(layer, inner).oneshot(grpc_keyed(&key("gou"))).await;
        let n = count.load(Ordering::SeqCst);
        assert!(
            matches!(r, Err(ClientError::OutcomeUnknown { .. })),
            "RetryInfo {seconds}s: OUTCOME_UNKNOWN ended as {r:?} after {n} attempts"
        );
        assert_eq!(n, 1, "never retried");
    }
}

/// `IN_FLIGHT` with an absurd `RetryInfo` is still a wait (counted in `waits`), bounded by the
/// deadline.
#[tokio::test]
async fn s9_grpc_in_flight_with_absurd_retry_info_is_bounded_and_a_wait() {
    for seconds in [0i64, 1, 315_576_000_000, -5] {
        let count = Arc::new(AtomicUsize::new(0));
        let d = details(10, "IN_FLIGHT", Some(seconds));
        let inner = scripted(count.clone(), move |n| match n {
            0 => answer(
                200,
                &[
                    ("content-type", "application/grpc"),
                    ("grpc-status", "10"),
                    ("grpc-status-details-bin", d.as_str()),
                ],
                Bytes::new(),
            ),
            _ => answer(
                200,
                &[
                    ("content-type", "application/grpc"),
                    ("grpc-status", "0"),
                    ("idempotency-replayed", "true"),
                ],
                Bytes::from(common::grpc_frame(b"done")),
            ),
        });
        let layer = IdempotentClientLayer::new()
            .deadline(Duration::from_secs(5))
            .backoff(Duration::from_millis(100), Duration::from_millis(200));
        let r = tokio::time::timeout(
            Duration::from_secs(3600),
            on(layer, inner).oneshot(grpc_keyed(&key("gif"))),
        )
        .await
        .expect("bounded");
        match r {
            Ok(res) => {
                let report = res
                    .extensions()
                    .get::<CallReport>()
                    .cloned()
                    .expect("report");
                assert_eq!(report.waits, 1, "RetryInfo {seconds}: {report:?}");
            }
            // Past the deadline: a definite give-up, no spin.
            Err(ClientError::DeadlineExceeded { attempts: 1, .. }) if seconds >= 5 => {}
            Err(e) => panic!("RetryInfo {seconds}: {e:?}"),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Concurrency and cancellation, against the real layer.
// ---------------------------------------------------------------------------------------

fn slow_app(effects: Effects) -> Router {
    Router::new()
        .route(
            "/pay",
            post(move |body: Bytes| {
                let effects = effects.clone();
                async move {
                    tokio::time::sleep(Duration::from_millis(400)).await;
                    let n = effects.hit();
                    (StatusCode::CREATED, format!("paid {n} for {}", body.len()))
                }
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant())
}

fn post_to(
    addr: std::net::SocketAddr,
    body: &'static [u8],
    k: &OperationKey,
) -> http::Request<Full<Bytes>> {
    let mut req = http::Request::post(format!("http://{addr}/pay"))
        .body(Full::new(Bytes::from_static(body)))
        .expect("req");
    req.extensions_mut().insert(k.clone());
    req
}

type Http = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// `slow_app` served, a plain HTTP client, and a client layer with a 20 s deadline and short
/// backoffs.
async fn slow_server(effects: &Effects) -> (std::net::SocketAddr, Http, IdempotentClientLayer) {
    let addr = serve(slow_app(effects.clone())).await;
    let http: Http = Client::builder(TokioExecutor::new()).build_http();
    let layer = IdempotentClientLayer::new()
        .deadline(Duration::from_secs(20))
        .backoff(Duration::from_millis(20), Duration::from_millis(50));
    (addr, http, layer)
}

/// A call dropped mid-attempt, then made again under the same key: the server finishes the
/// first run, the second call waits for it and gets its replay; one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s9_a_call_dropped_mid_attempt_then_repeated_makes_one_effect() {
    let effects = Effects::default();
    let (addr, http, layer) = slow_server(&effects).await;
    let k = key("dropped");
    let first = tokio::spawn(on(layer.clone(), http.clone()).oneshot(post_to(addr, b"abc", &k)));
    tokio::time::sleep(Duration::from_millis(100)).await;
    first.abort();
    let _ = first.await;
    // What the server tells a retry now (a probe, same key and body).
    let probe =
        common::raw::raw_post(addr, "/pay", &[("idempotency-key", k.as_str())], b"abc").await;
    let retry_after = probe
        .one("retry-after")
        .map(|v| String::from_utf8_lossy(v).into_owned());
    let res = on(layer, http)
        .oneshot(post_to(addr, b"abc", &k))
        .await
        .unwrap_or_else(|e| {
            panic!(
                "20 s deadline, the run ends ~300 ms later; a probe got {} with Retry-After \
                 {retry_after:?}; the call ended as {e:?}",
                probe.status
            )
        });
    let report = res
        .extensions()
        .get::<CallReport>()
        .cloned()
        .expect("report");
    let body = res.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(&body[..], b"paid 1 for 3");
    assert_eq!(report.ended, Ended::Replayed);
    assert_eq!(effects.count(), 1);
}

/// One OperationKey used by two calls at once with different bodies (a caller bug): one
/// runs, the other stops with `KeyReused`; never a second effect, never a wait to the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s9_one_key_two_different_calls_at_once() {
    let effects = Effects::default();
    let (addr, http, layer) = slow_server(&effects).await;
    let k = key("twice");
    let a = on(layer.clone(), http.clone()).oneshot(post_to(addr, b"aaa", &k));
    let b = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        on(layer.clone(), http.clone())
            .oneshot(post_to(addr, b"bbbb", &k))
            .await
    };
    let (a, b) = tokio::join!(a, b);
    let a = a.expect("the first runs");
    assert_eq!(a.status(), StatusCode::CREATED);
    assert!(matches!(b, Err(ClientError::KeyReused { .. })), "{b:?}");
    assert_eq!(effects.count(), 1);
}
