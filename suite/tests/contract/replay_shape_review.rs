//! Review of the replay shape (`Claim::Completed`), the restructured execution future, the
//! compile-time metric keys, the one-pass p99 and the media type read once: every test tries
//! to make the layer run an effect twice, replay something other than what was first sent, or
//! count under the wrong name. Effects are counted in the handler (the sink), never inferred
//! from answers. Every store the crate ships is attacked where the change touched it.

use crate::common;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use bytes::Bytes;
use common::raw::{Raw, raw_post, unique};
use common::{Effects, FlakyStore, grpc_frame, guard, problem_type, serve, until};
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody};
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Barrier, Notify};
use tower::ServiceExt;
use tower_idempotency::jsonrpc::JsonRpc;
use tower_idempotency::store::{
    Claim, ClaimRequest, Record, RecordStatus, Resolution, ScopedKey, StoreError, StoredResponse,
};
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, IdempotencyStore, MemoryStore};

/// A key no earlier run (PostgreSQL and Redis keep rows) has used.
/// Headers a replay does not repeat by design: framing, per-response values, the marker.
const NOT_REPLAYED: &[&str] = &[
    "date",
    "set-cookie",
    "content-length",
    "transfer-encoding",
    "connection",
    "trailer",
    "idempotency-replayed",
];

/// Every header of `raw` a replay must repeat, each name's values in order.
fn replayable(raw: &Raw) -> BTreeMap<String, Vec<Vec<u8>>> {
    let mut out: BTreeMap<String, Vec<Vec<u8>>> = BTreeMap::new();
    for (name, value) in &raw.headers {
        if !NOT_REPLAYED.contains(&name.as_str()) {
            out.entry(name.clone()).or_default().push(value.clone());
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// A store wrapper written against the public trait: counts claims and lookups, and can answer
// completed records the way an older (or broken) third-party store would.
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq)]
enum Shape {
    /// Whatever the inner store answers.
    AsIs,
    /// A completed record reported whole, as `Claim::Existing` (a store written before
    /// `Claim::Completed`).
    Whole,
    /// A completed record reported whole but without its response.
    NoResponse,
}

#[derive(Clone)]
struct Shaped<S> {
    inner: S,
    shape: Shape,
    claims: Arc<AtomicUsize>,
    lookups: Arc<AtomicUsize>,
    completed_answers: Arc<AtomicUsize>,
}

impl<S> Shaped<S> {
    fn new(inner: S, shape: Shape) -> Self {
        Self {
            inner,
            shape,
            claims: Arc::default(),
            lookups: Arc::default(),
            completed_answers: Arc::default(),
        }
    }

    fn claims(&self) -> usize {
        self.claims.load(Ordering::SeqCst)
    }

    fn lookups(&self) -> usize {
        self.lookups.load(Ordering::SeqCst)
    }
}

impl<S: IdempotencyStore> IdempotencyStore for Shaped<S> {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        let claim = self.inner.claim(request).await;
        // Counted once answered: a batching store holds a claim until its batch reaches the
        // database, and a test that opens a gate once every claim is counted must not open it
        // while one is still queued (it would find the outcome recorded, not in flight).
        self.claims.fetch_add(1, Ordering::SeqCst);
        let claim = claim?;
        let Claim::Completed { .. } = &claim else {
            return Ok(claim);
        };
        self.completed_answers.fetch_add(1, Ordering::SeqCst);
        if self.shape == Shape::AsIs {
            return Ok(claim);
        }
        let mut record = self
            .inner
            .lookup(&request.key)
            .await?
            .expect("a completed record can be looked up");
        assert_eq!(record.status, RecordStatus::Completed);
        if self.shape == Shape::NoResponse {
            record.response = None;
        }
        Ok(Claim::Existing {
            record: Box::new(record),
            now: SystemTime::now(),
        })
    }

    async fn lookup(&self, key: &ScopedKey) -> Result<Option<Record>, StoreError> {
        self.lookups.fetch_add(1, Ordering::SeqCst);
        self.inner.lookup(key).await
    }

    crate::common::forward::forward_store!(inner: renew, complete, release, mark_uncertain, remove, purge_expired, record_milestone, list_uncertain, count_uncertain, resolve, append_history, wait_for_change);
}

// ---------------------------------------------------------------------------------------------
// 1. A completed key replays exactly, over real TCP, on every store.
// ---------------------------------------------------------------------------------------------

/// A binary header value (obs-text and a space), as a replay must return it byte for byte.
const BIN: &[u8] = b"\x80\xfe\xff bin";

/// 512 binary bytes, every byte value twice.
fn payload() -> Vec<u8> {
    (0..=255u8).chain((0..=255u8).rev()).collect()
}

/// The handler's trailers on run `n`.
fn exact_trailers(n: usize) -> HeaderMap {
    let mut t = HeaderMap::new();
    t.insert(
        "x-digest",
        HeaderValue::from_static("sha-256=:q83vEjRWeJA=:"),
    );
    t.append("x-multi", HeaderValue::from_static("one"));
    t.append("x-multi", HeaderValue::from_static("two"));
    t.insert("x-run", HeaderValue::from(n));
    t
}

/// 201 with every shape a replay must keep: repeated and binary headers, a location naming
/// the run, a cookie that must not come back, a binary body in two frames, and trailers (the
/// `Trailer` header names them, so HTTP/1.1 may carry them).
fn exact_response(n: usize) -> Response<Body> {
    let data = payload();
    let (a, b) = data.split_at(100);
    let frames = vec![
        Ok::<_, Infallible>(Frame::data(Bytes::copy_from_slice(a))),
        Ok(Frame::data(Bytes::copy_from_slice(b))),
        Ok(Frame::trailers(exact_trailers(n))),
    ];
    let mut res = Response::new(Body::new(StreamBody::new(futures_util::stream::iter(
        frames,
    ))));
    *res.status_mut() = StatusCode::CREATED;
    let h = res.headers_mut();
    h.insert(
        "content-type",
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(
        "location",
        HeaderValue::from_str(&format!("/things/{n}")).expect("v"),
    );
    h.append("link", HeaderValue::from_static("</a>; rel=a"));
    h.append("link", HeaderValue::from_static("</b>; rel=b"));
    h.insert(
        "x-bin",
        HeaderValue::from_bytes(BIN).expect("obs-text is a valid value"),
    );
    h.insert("etag", HeaderValue::from_static("\"v1\""));
    h.insert(
        "set-cookie",
        HeaderValue::from_str(&format!("session=run-{n}")).expect("v"),
    );
    h.insert(
        "trailer",
        HeaderValue::from_static("x-digest, x-multi, x-run"),
    );
    res
}

fn exact_app<St: IdempotencyStore>(
    layer: IdempotencyLayer<St, tower_idempotency::scope::SingleTenant>,
    effects: Effects,
) -> Router {
    Router::new()
        .route(
            "/exact",
            post(move |_body: Bytes| async move { exact_response(effects.hit()) }),
        )
        .layer(layer)
}

fn exact_headers(key: &str) -> Vec<(&str, &str)> {
    vec![
        ("idempotency-key", key),
        ("content-type", "application/octet-stream"),
    ]
}

/// The replay of a first answer: same status, every replayable header (repeats in order,
/// binary bytes exact), same body bytes, the marker, no cookie.
fn assert_replays(tag: &str, first: &Raw, replay: &Raw) {
    assert_eq!(replay.status, first.status, "{tag}: status");
    assert!(replay.replayed(), "{tag}: the replay marker: {replay:?}");
    assert_eq!(replayable(replay), replayable(first), "{tag}: headers");
    assert!(
        replay.one("set-cookie").is_none(),
        "{tag}: a cookie replayed"
    );
    assert_eq!(replay.body, first.body, "{tag}: body bytes");
}

/// DESIGN §1 (step 6 "completed, same fingerprint -> stored response"; "Replays return the
/// original bytes and status ... repeated headers stay repeated, never Set-Cookie"), §7.1
/// (effect count 1), §7.2 (422 for another request, state completed), §7.3 (32 concurrent
/// retries): attacks `Claim::Completed` as each store builds it (MemoryStore from one shared
/// copy, SQL and Redis through `Claim::existing`).
async fn exact_replay<St: IdempotencyStore + Clone>(store: St, tag: &str) {
    let effects = Effects::default();
    let app = exact_app(
        IdempotencyLayer::new(store).single_tenant(),
        effects.clone(),
    );
    let addr = serve(app.clone()).await;
    let key = unique("exact");
    let body = b"order 7";

    let first = raw_post(addr, "/exact", &exact_headers(&key), body).await;
    assert_eq!(first.status, 201, "{tag}: {first:?}");
    assert_eq!(first.body, payload(), "{tag}: the live body");
    assert_eq!(
        first.one("x-bin"),
        Some(BIN),
        "{tag}: the live binary header"
    );
    assert_eq!(first.one("location"), Some(&b"/things/1"[..]));
    assert!(!first.replayed());

    let replay = raw_post(addr, "/exact", &exact_headers(&key), body).await;
    assert_replays(tag, &first, &replay);
    assert_eq!(replay.one("x-bin"), Some(BIN), "{tag}: binary header bytes");
    assert_eq!(
        replay.all("link"),
        vec![&b"</a>; rel=a"[..], &b"</b>; rel=b"[..]],
        "{tag}: repeated headers stay repeated, in order"
    );
    assert_eq!(effects.count(), 1, "{tag}: a replay ran the handler");

    // The trailers, read in process (no HTTP/1.1 framing in the way): the first run's.
    let in_process = guard(
        "an in-process replay",
        app.clone().oneshot(
            http::Request::post("/exact")
                .header("idempotency-key", key.as_str())
                .header("content-type", "application/octet-stream")
                .body(Body::from(&body[..]))
                .expect("request"),
        ),
    )
    .await
    .expect("infallible");
    assert_eq!(in_process.status(), StatusCode::CREATED, "{tag}");
    assert_eq!(in_process.headers()["idempotency-replayed"], "true");
    let collected = guard("the replay's body", in_process.into_body().collect())
        .await
        .expect("body");
    let trailers = collected.trailers().cloned();
    assert_eq!(collected.to_bytes(), payload(), "{tag}: in-process body");
    assert_eq!(
        trailers,
        Some(exact_trailers(1)),
        "{tag}: the replay's trailers are the first run's, exactly"
    );

    // Another request under the completed key: 422, state completed, nothing run.
    let other = raw_post(addr, "/exact", &exact_headers(&key), b"order 8").await;
    assert_eq!(other.status, 422, "{tag}: {other:?}");
    let p = other.json();
    assert_eq!(p["type"], problem_type("fingerprint-mismatch"), "{tag}");
    assert_eq!(p["state"], "completed", "{tag}");
    assert_eq!(effects.count(), 1, "{tag}: a mismatch ran the handler");

    // 32 retries on 32 connections at once: identical bytes, still one effect.
    let barrier = Arc::new(Barrier::new(32));
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let (barrier, key) = (barrier.clone(), key.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                raw_post(addr, "/exact", &exact_headers(&key), b"order 7").await
            })
        })
        .collect();
    for (i, task) in tasks.into_iter().enumerate() {
        let answer = guard("a concurrent retry", task).await.expect("task");
        assert_replays(&format!("{tag}: concurrent retry {i}"), &first, &answer);
    }
    assert_eq!(
        effects.count(),
        1,
        "{tag}: a concurrent retry ran the handler"
    );
}

common::on_every_store!(exact_replay);

// ---------------------------------------------------------------------------------------------
// 2. gRPC over HTTP/2: trailers replayed exactly through every store's `Claim::Completed`.
// ---------------------------------------------------------------------------------------------

const LEDGER_POST: &str = "/zz.Ledger/Post";
/// A 4 KiB message on a method that keeps 256 bytes.
const LEDGER_LARGE: &str = "/zz.Ledger/Large";
/// A message frame, then the body panics: no trailers ever come.
const LEDGER_BROKEN: &str = "/zz.Ledger/Broken";

#[derive(Clone, Default)]
struct Ledger {
    effects: Effects,
}

impl tonic::server::NamedService for Ledger {
    const NAME: &'static str = "zz.Ledger";
}

fn ledger_trailers(n: usize) -> HeaderMap {
    let mut t = HeaderMap::new();
    t.insert("grpc-status", HeaderValue::from_static("0"));
    t.insert("x-entry", HeaderValue::from(n));
    t.append("x-tags", HeaderValue::from_static("a"));
    t.append("x-tags", HeaderValue::from_static("b"));
    t.insert("set-cookie", HeaderValue::from_static("session=secret"));
    t
}

impl<B: Send + 'static> tower::Service<http::Request<B>> for Ledger {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let n = self.effects.hit();
        let path = req.uri().path().to_owned();
        Box::pin(async move {
            if path == LEDGER_BROKEN {
                let mut res =
                    http::Response::new(tonic::body::Body::new(PanicAfterFirst { sent: false }));
                res.headers_mut()
                    .insert("content-type", HeaderValue::from_static("application/grpc"));
                return Ok(res);
            }
            // An arbitrary binary message (the layer never decodes it).
            let message = match path.as_str() {
                LEDGER_LARGE => grpc_frame(&vec![b'L'; 4096]),
                _ => grpc_frame(&(0..=255u8).collect::<Vec<_>>()),
            };
            let (a, b) = message.split_at(7);
            let frames = vec![
                Ok::<_, Infallible>(Frame::data(Bytes::copy_from_slice(a))),
                Ok(Frame::data(Bytes::copy_from_slice(b))),
                Ok(Frame::trailers(ledger_trailers(n))),
            ];
            let body = StreamBody::new(futures_util::stream::iter(frames));
            let mut res = http::Response::new(tonic::body::Body::new(body));
            let h = res.headers_mut();
            h.insert("content-type", HeaderValue::from_static("application/grpc"));
            h.append("x-meta", HeaderValue::from_static("first"));
            h.append("x-meta", HeaderValue::from_static("second"));
            h.insert("x-raw", HeaderValue::from_bytes(BIN).expect("v"));
            Ok(res)
        })
    }
}

async fn serve_ledger<St: IdempotencyStore>(store: St, ledger: Ledger) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let layer = IdempotencyLayer::new_for_grpc(store)
        .single_tenant()
        .grpc_method(LEDGER_POST, |m| m)
        .grpc_method(LEDGER_LARGE, |m| m.response_limit(256))
        .grpc_method(LEDGER_BROKEN, |m| m);
    let server = tonic::transport::Server::builder()
        .layer(layer)
        .add_service(ledger)
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    tokio::spawn(async move { server.await.expect("grpc server") });
    addr
}

/// One unary call over a fresh HTTP/2 connection: status, headers, body, trailers as sent.
async fn h2_call(
    addr: SocketAddr,
    key: &str,
    message: &[u8],
) -> (StatusCode, HeaderMap, Bytes, Option<HeaderMap>) {
    h2_call_to(addr, LEDGER_POST, key, message).await
}

/// [`h2_call`] to the method at `path`; a stream reset counts as an answer without trailers.
async fn h2_call_to(
    addr: SocketAddr,
    path: &str,
    key: &str,
    message: &[u8],
) -> (StatusCode, HeaderMap, Bytes, Option<HeaderMap>) {
    guard("an HTTP/2 call", async {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (mut sender, connection) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(stream),
        )
        .await
        .expect("h2 handshake");
        tokio::spawn(connection);
        let request = http::Request::post(format!("http://{addr}{path}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from(grpc_frame(message))))
            .expect("request");
        let res = sender.send_request(request).await.expect("response");
        let (parts, body) = res.into_parts();
        match body.collect().await {
            Ok(collected) => {
                let trailers = collected.trailers().cloned();
                (parts.status, parts.headers, collected.to_bytes(), trailers)
            }
            Err(_reset) => (parts.status, parts.headers, Bytes::new(), None),
        }
    })
    .await
}

fn without(mut headers: HeaderMap, names: &[&str]) -> HeaderMap {
    for name in names {
        headers.remove(*name);
    }
    headers
}

/// DESIGN §1 step 6 ("stored response + trailers, idempotency-replayed metadata"), §3 (the
/// deny list applies to trailers), §7.1: a gRPC answer's trailers come back exactly from each
/// store's `Claim::Completed`; another message is refused, not run.
async fn grpc_replay_with_trailers<St: IdempotencyStore + Clone>(store: St, tag: &str) {
    let ledger = Ledger::default();
    let addr = serve_ledger(store, ledger.clone()).await;
    let key = unique("grpc");
    let (status, headers, body, trailers) = h2_call(addr, &key, b"entry").await;
    assert_eq!(status, StatusCode::OK, "{tag}");
    let trailers = trailers.expect("the live trailers");
    assert_eq!(trailers["grpc-status"], "0", "{tag}");
    let (status2, headers2, body2, trailers2) = h2_call(addr, &key, b"entry").await;
    assert_eq!(status2, status, "{tag}");
    assert_eq!(
        headers2["idempotency-replayed"], "true",
        "{tag}: {headers2:?}"
    );
    let framing = ["date", "content-length", "idempotency-replayed"];
    assert_eq!(
        without(headers2.clone(), &framing),
        without(headers, &framing),
        "{tag}: headers"
    );
    assert_eq!(headers2["x-raw"].as_bytes(), BIN, "{tag}: binary metadata");
    assert_eq!(body2, body, "{tag}: message bytes");
    let trailers2 = trailers2.expect("the replay's trailers");
    assert_eq!(
        without(trailers2.clone(), &[]),
        without(trailers, &["set-cookie"]),
        "{tag}: trailers, the cookie withheld"
    );
    assert_eq!(
        trailers2.get_all("x-tags").iter().collect::<Vec<_>>(),
        ["a", "b"],
        "{tag}: repeated trailers stay repeated"
    );
    assert_eq!(
        ledger.effects.count(),
        1,
        "{tag}: the replay ran the method"
    );

    let (status3, headers3, _, trailers3) = h2_call(addr, &key, b"another entry").await;
    assert_eq!(status3, StatusCode::OK, "{tag}: gRPC answers 200");
    let code = headers3
        .get("grpc-status")
        .or_else(|| trailers3.as_ref().and_then(|t| t.get("grpc-status")))
        .expect("a grpc-status");
    assert!(
        code == "3" || code == "9",
        "{tag}: INVALID_ARGUMENT or FAILED_PRECONDITION for a changed message, got {code:?}"
    );
    assert_eq!(
        ledger.effects.count(),
        1,
        "{tag}: a changed message ran the method"
    );
}

common::on_every_store!(grpc_replay_with_trailers);

/// The gRPC status of an answer: its head's (trailers-only) or its trailers'.
fn grpc_status(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> Option<String> {
    headers
        .get("grpc-status")
        .or_else(|| trailers.and_then(|t| t.get("grpc-status")))
        .map(|v| v.to_str().expect("ascii").to_owned())
}

/// DESIGN §3 ("A response over the cache size limit is never silently re-executed: the key
/// stays consumed (a marker record is kept) and replays get a documented answer"): a gRPC
/// answer too large to keep is streamed on (`tail`), recorded without its message by its
/// final status, and every store answers the marker as `Claim::Completed` with no body.
async fn a_grpc_answer_too_large_to_keep_is_never_run_again<St: IdempotencyStore + Clone>(
    store: St,
    tag: &str,
) {
    let ledger = Ledger::default();
    let addr = serve_ledger(store, ledger.clone()).await;
    let key = unique("grpc-large");
    let (status, headers, body, trailers) = h2_call_to(addr, LEDGER_LARGE, &key, b"e").await;
    assert_eq!(status, StatusCode::OK, "{tag}");
    assert_eq!(body.len(), 5 + 4096, "{tag}: the live message is whole");
    assert_eq!(
        grpc_status(&headers, trailers.as_ref()).as_deref(),
        Some("0")
    );
    for i in 0..3 {
        let (_, headers, body, trailers) = h2_call_to(addr, LEDGER_LARGE, &key, b"e").await;
        assert!(
            headers.contains_key("idempotency-replayed"),
            "{tag}: retry {i} is a replay: {headers:?}"
        );
        assert_ne!(
            grpc_status(&headers, trailers.as_ref()).as_deref(),
            Some("0"),
            "{tag}: retry {i}: a record without its message is not an OK"
        );
        assert!(body.is_empty(), "{tag}: retry {i}: no fabricated message");
    }
    assert_eq!(ledger.effects.count(), 1, "{tag}: a large answer ran twice");
}

common::on_every_store!(a_grpc_answer_too_large_to_keep_is_never_run_again);

/// DESIGN §3: "Once the inner service has returned a response head, the effect is taken as
/// done: a failure of the response body afterwards never releases the key; the record is kept
/// as 'completed, response not available' ... and retries never re-run it." A unary gRPC
/// method returned its head (and its message frame), then its body panicked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_body_that_fails_after_the_head_is_never_run_again() {
    let ledger = Ledger::default();
    let addr = serve_ledger(MemoryStore::new(), ledger.clone()).await;
    let key = unique("grpc-broken");
    let first = h2_call_to(addr, LEDGER_BROKEN, &key, b"e").await;
    let retry = h2_call_to(addr, LEDGER_BROKEN, &key, b"e").await;
    assert_eq!(
        ledger.effects.count(),
        1,
        "the method answered its head, then its body failed: run again (first {:?} {:?}, \
         retry {:?} {:?})",
        first.1,
        first.3,
        retry.1,
        retry.3
    );
}

// ---------------------------------------------------------------------------------------------
// 3. Routes that wait: the woken read (`ClaimToEnd::new` -> `Claim::existing`) ends in a
//    replay, never a second run.
// ---------------------------------------------------------------------------------------------

/// What the gated handler answers after the gate opens.
#[derive(Clone, Copy, PartialEq)]
enum Ending {
    /// The exact 201 of `exact_response`.
    Exact,
    /// A body far over the route's response limit.
    Oversized,
    /// Effect started, then a 500: the key awaits reconciliation.
    Uncertain,
}

/// A handler that enters, waits for the gate, then ends as told; `/gated` waits for in-flight
/// keys up to 30 s.
fn gated_app<St: IdempotencyStore>(
    store: St,
    entered: Effects,
    effects: Effects,
    gate: Arc<Notify>,
    ending: Ending,
) -> Router {
    Router::new()
        .route(
            "/gated",
            post(move |ctx: IdempotencyContext, _body: Bytes| async move {
                entered.hit();
                if ending == Ending::Uncertain {
                    ctx.effect_started().await.expect("milestone");
                }
                gate.notified().await;
                let n = effects.hit();
                match ending {
                    Ending::Exact => exact_response(n),
                    Ending::Oversized => {
                        let mut res = Response::new(Body::from(vec![b'z'; 8192]));
                        *res.status_mut() = StatusCode::CREATED;
                        res
                    }
                    Ending::Uncertain => {
                        let mut res = Response::new(Body::from("downstream lost"));
                        *res.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                        res
                    }
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(store)
                .single_tenant()
                .wait_for_in_flight(Duration::from_secs(30))
                .response_limit(1024),
        )
}

/// The first request holds the key; 8 retries wait on it (each has claimed and seen it in
/// flight); the gate opens. Returns the first answer, the waiters' answers, and the store.
async fn first_and_waiters<St: IdempotencyStore + Clone>(
    store: St,
    ending: Ending,
    effects: &Effects,
) -> (Raw, Vec<Raw>, Shaped<St>) {
    let store = Shaped::new(store, Shape::AsIs);
    let (entered, gate) = (Effects::default(), Arc::new(Notify::new()));
    let app = gated_app(
        store.clone(),
        entered.clone(),
        effects.clone(),
        gate.clone(),
        ending,
    );
    let addr = serve(app).await;
    let key = unique("woken");
    let headers = |key: &str| {
        vec![
            ("idempotency-key", key.to_owned()),
            ("content-type", "application/octet-stream".to_owned()),
        ]
    };
    let send = move |key: String| async move {
        let h = headers(&key);
        let h: Vec<(&str, &str)> = h.iter().map(|(n, v)| (*n, v.as_str())).collect();
        raw_post(addr, "/gated", &h, b"gated order").await
    };
    let first = tokio::spawn(send(key.clone()));
    until("the first request enters its handler", || {
        entered.count() == 1
    })
    .await;
    let claims_before = store.claims();
    let waiters: Vec<_> = (0..8).map(|_| tokio::spawn(send(key.clone()))).collect();
    // Each waiter has claimed once and found the key in flight.
    until("the waiters to see the key in flight", || {
        store.claims() >= claims_before + 8
    })
    .await;
    gate.notify_one();
    let first = guard("the first request", first).await.expect("task");
    let mut answers = Vec::new();
    for waiter in waiters {
        answers.push(guard("a waiter", waiter).await.expect("task"));
    }
    (first, answers, store)
}

/// DESIGN §1 step 6 (the in-flight row: "or, if the route opts in, wait for the first to
/// finish and replay it"), §7.3: waiters woken by the store read the record (`Claim::existing`
/// in `ClaimToEnd::new`) and replay the first answer exactly; one effect.
async fn woken_waiters_replay_exactly<St: IdempotencyStore + Clone>(store: St, tag: &str) {
    let effects = Effects::default();
    let (first, waiters, store) = first_and_waiters(store, Ending::Exact, &effects).await;
    assert_eq!(first.status, 201, "{tag}: {first:?}");
    assert!(!first.replayed());
    for (i, waiter) in waiters.iter().enumerate() {
        assert_replays(&format!("{tag}: waiter {i}"), &first, waiter);
        assert_eq!(waiter.one("x-bin"), Some(BIN), "{tag}: waiter {i}");
    }
    assert_eq!(effects.count(), 1, "{tag}: a waiter ran the handler");
    assert!(
        store.lookups() >= 1,
        "{tag}: no waiter took the woken read (lookups {})",
        store.lookups()
    );
}

common::on_every_store!(woken_waiters_replay_exactly);

/// DESIGN §3 ("A response over the cache size limit is never silently re-executed: the key
/// stays consumed ... replays get a documented answer, never a second run"), through the woken
/// read: a record whose response body is `None` is still `Completed`.
async fn woken_waiters_of_an_oversized_answer_never_run<St: IdempotencyStore + Clone>(
    store: St,
    tag: &str,
) {
    let effects = Effects::default();
    let (first, waiters, _) = first_and_waiters(store, Ending::Oversized, &effects).await;
    assert_eq!(first.status, 201, "{tag}");
    assert_eq!(first.body.len(), 8192, "{tag}: the live answer is whole");
    for (i, waiter) in waiters.iter().enumerate() {
        let p = not_stored(waiter, &format!("{tag}: waiter {i}"));
        assert_eq!(p["state"], "completed", "{tag}: {i}");
    }
    assert_eq!(effects.count(), 1, "{tag}: an oversized answer ran twice");
}

common::on_every_store!(woken_waiters_of_an_oversized_answer_never_run);

/// DESIGN §3/§4: a failure after the effect started goes to `needs_reconciliation`; woken
/// waiters are told "outcome unknown", never run.
async fn woken_waiters_of_an_unknown_outcome_never_run<St: IdempotencyStore + Clone>(
    store: St,
    tag: &str,
) {
    let effects = Effects::default();
    let (first, waiters, _) = first_and_waiters(store, Ending::Uncertain, &effects).await;
    assert_eq!(first.status, 500, "{tag}");
    for (i, waiter) in waiters.iter().enumerate() {
        assert_eq!(waiter.status, 409, "{tag}: waiter {i}: {waiter:?}");
        assert_eq!(
            waiter.json()["type"],
            problem_type("outcome-unknown"),
            "{tag}: waiter {i}"
        );
    }
    assert_eq!(effects.count(), 1, "{tag}: an unknown outcome ran twice");
}

common::on_every_store!(woken_waiters_of_an_unknown_outcome_never_run);

// ---------------------------------------------------------------------------------------------
// 4. Third-party stores that answer completed records the old way, or brokenly.
// ---------------------------------------------------------------------------------------------

/// DESIGN §5 ("One trait, one behaviour") and the commit's promise: a store that still
/// reports a completed record whole (`Claim::Existing`) still replays it exactly, and a
/// changed request under it is 422 with state completed.
async fn whole_record_stores_still_replay<St: IdempotencyStore + Clone>(store: St, tag: &str) {
    let store = Shaped::new(store, Shape::Whole);
    let effects = Effects::default();
    let addr = serve(exact_app(
        IdempotencyLayer::new(store.clone()).single_tenant(),
        effects.clone(),
    ))
    .await;
    let key = unique("whole");
    let first = raw_post(addr, "/exact", &exact_headers(&key), b"a").await;
    assert_eq!(first.status, 201, "{tag}");
    for i in 0..3 {
        let replay = raw_post(addr, "/exact", &exact_headers(&key), b"a").await;
        assert_replays(&format!("{tag}: whole-record replay {i}"), &first, &replay);
    }
    assert!(
        store.completed_answers.load(Ordering::SeqCst) >= 3,
        "{tag}: the wrapper converted its answers"
    );
    let other = raw_post(addr, "/exact", &exact_headers(&key), b"b").await;
    assert_eq!(other.status, 422, "{tag}: {other:?}");
    assert_eq!(other.json()["state"], "completed", "{tag}");
    assert_eq!(effects.count(), 1, "{tag}");
}

common::on_every_store!(whole_record_stores_still_replay);

/// The response a reconciler (or an operator) settles an uncertain key with: every shape a
/// replay must keep.
fn resolved_response() -> StoredResponse {
    let mut headers = HeaderMap::new();
    headers.insert(
        "content-type",
        HeaderValue::from_static("application/octet-stream"),
    );
    headers.append("link", HeaderValue::from_static("</r1>; rel=a"));
    headers.append("link", HeaderValue::from_static("</r2>; rel=b"));
    headers.insert("x-bin", HeaderValue::from_bytes(BIN).expect("v"));
    let mut trailers = HeaderMap::new();
    trailers.insert("x-settled", HeaderValue::from_static("by-hand"));
    StoredResponse {
        status: StatusCode::ACCEPTED,
        headers,
        body: Some(Bytes::from(payload())),
        trailers: Some(trailers),
    }
}

/// DESIGN §4 ("A Reconciler ... resolves records ... into completed (with a response)"; "A
/// resolved outcome is final"), §1 step 6: an uncertain key resolved as applied is a
/// completed record, answered by every store as `Claim::Completed`: retries replay the
/// resolution exactly (status, repeated and binary headers, body, trailers), and never run.
async fn a_key_resolved_as_applied_replays_the_resolution<St: IdempotencyStore + Clone>(
    store: St,
    tag: &str,
) {
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/charge",
            post(move |ctx: IdempotencyContext, _b: Bytes| async move {
                ctx.effect_started().await.expect("milestone");
                sink.hit();
                (StatusCode::BAD_GATEWAY, "the provider timed out")
            }),
        )
        .layer(IdempotencyLayer::new(store.clone()).single_tenant());
    let addr = serve(app.clone()).await;
    let key = unique("resolved");
    let headers = [
        ("idempotency-key", key.as_str()),
        ("content-type", "text/plain"),
    ];
    assert_eq!(
        raw_post(addr, "/charge", &headers, b"100").await.status,
        502
    );
    let unknown = raw_post(addr, "/charge", &headers, b"100").await;
    assert_eq!(
        unknown.json()["type"],
        problem_type("outcome-unknown"),
        "{tag}"
    );

    let scoped = ScopedKey::new("", key.as_str());
    let record = store
        .lookup(&scoped)
        .await
        .expect("lookup")
        .expect("the uncertain record");
    assert_eq!(record.status, RecordStatus::NeedsReconciliation, "{tag}");
    store
        .resolve(
            &scoped,
            record.lease_token,
            &Resolution::Applied(Box::new(resolved_response())),
            Duration::from_secs(3600),
            Some("the provider has the charge"),
        )
        .await
        .expect("resolve");

    let replay = raw_post(addr, "/charge", &headers, b"100").await;
    assert_eq!(replay.status, 202, "{tag}: {replay:?}");
    assert!(replay.replayed(), "{tag}");
    assert_eq!(replay.one("x-bin"), Some(BIN), "{tag}");
    assert_eq!(
        replay.all("link"),
        vec![&b"</r1>; rel=a"[..], &b"</r2>; rel=b"[..]],
        "{tag}"
    );
    assert_eq!(replay.body, payload(), "{tag}");
    let in_process = guard(
        "an in-process replay",
        app.oneshot(
            http::Request::post("/charge")
                .header("idempotency-key", key.as_str())
                .header("content-type", "text/plain")
                .body(Body::from("100"))
                .expect("request"),
        ),
    )
    .await
    .expect("infallible");
    let collected = guard("the body", in_process.into_body().collect())
        .await
        .expect("body");
    assert_eq!(
        collected.trailers().cloned(),
        resolved_response().trailers,
        "{tag}: the resolution's trailers"
    );
    let other = raw_post(addr, "/charge", &headers, b"200").await;
    assert_eq!(other.status, 422, "{tag}");
    assert_eq!(other.json()["state"], "completed", "{tag}");
    assert_eq!(effects.count(), 1, "{tag}: a resolved key ran again");
}

common::on_every_store!(a_key_resolved_as_applied_replays_the_resolution);

/// DESIGN §1 step 6 and §3: a store that reports a completed record without its response (a
/// record damaged by hand, or written by another tool) cannot be replayed; the layer refuses,
/// and never runs the handler again. It answered 503 `store-unavailable` with
/// `safe_new_key: true` until session 33, though that key failed alike until it expired and a
/// new key would have run the operation again: now 409 `response-not-stored`, keep the key
/// (`s33_foreign_records_review`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completed_record_without_a_response_fails_closed() {
    let store = Shaped::new(MemoryStore::new(), Shape::NoResponse);
    let effects = Effects::default();
    let addr = serve(exact_app(
        IdempotencyLayer::new(store.clone()).single_tenant(),
        effects.clone(),
    ))
    .await;
    let key = unique("no-response");
    assert_eq!(
        raw_post(addr, "/exact", &exact_headers(&key), b"a")
            .await
            .status,
        201
    );
    for i in 0..5 {
        let retry = raw_post(addr, "/exact", &exact_headers(&key), b"a").await;
        assert_eq!(retry.status, 409, "retry {i}: {retry:?}");
        let p = retry.json();
        assert_eq!(p["type"], problem_type("response-not-stored"), "retry {i}");
        assert_eq!(p["state"], "completed", "retry {i}");
        assert_eq!(
            p["safe_new_key"], false,
            "how it ended is unknown: a new key could run it again"
        );
    }
    // Fingerprints are compared first: a changed request is still the 422.
    let other = raw_post(addr, "/exact", &exact_headers(&key), b"b").await;
    assert_eq!(other.status, 422, "{other:?}");
    assert_eq!(
        effects.count(),
        1,
        "a record without a response ran the handler"
    );
}

// ---------------------------------------------------------------------------------------------
// 5. The execution paths of the restructured future (`finish`, `record`, the boxed paths).
// ---------------------------------------------------------------------------------------------

/// A body that sends one chunk, then panics.
struct PanicAfterFirst {
    sent: bool,
}

impl http_body::Body for PanicAfterFirst {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if !self.sent {
            self.sent = true;
            return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"partial ")))));
        }
        panic!("injected panic in the response body");
    }
}

/// The routes of the execution-path attacks, each counting its runs where they happen.
fn paths_app<St: IdempotencyStore>(store: St, effects: Effects) -> Router {
    let (e1, e2, e3, e4, e5) = (
        effects.clone(),
        effects.clone(),
        effects.clone(),
        effects.clone(),
        effects,
    );
    Router::new()
        .route(
            "/body-panics",
            post(move |_b: Bytes| async move {
                e1.hit();
                let mut res = Response::new(Body::new(PanicAfterFirst { sent: false }));
                *res.status_mut() = StatusCode::CREATED;
                res
            }),
        )
        .route(
            "/body-panics-500",
            post(move |_b: Bytes| async move {
                e2.hit();
                let mut res = Response::new(Body::new(PanicAfterFirst { sent: false }));
                *res.status_mut() = StatusCode::BAD_GATEWAY;
                res
            }),
        )
        .route(
            "/too-large",
            post(move |_b: Bytes| async move {
                let n = e3.hit();
                (StatusCode::CREATED, format!("run {n} ").repeat(2000))
            }),
        )
        .route(
            "/head-too-large",
            post(move |_b: Bytes| async move {
                let n = e4.hit();
                // A short body whose head alone is over the limit: read whole, recorded
                // without it (`fits: false`).
                (
                    StatusCode::CREATED,
                    [("x-big", "h".repeat(600))],
                    format!("small {n}"),
                )
            }),
        )
        .route(
            "/panics-after-effect",
            post(move |ctx: IdempotencyContext, _b: Bytes| async move {
                ctx.effect_started().await.expect("milestone");
                e5.hit();
                if e5.count() > 0 {
                    panic!("injected panic after the effect started");
                }
                "unreachable"
            }),
        )
        .layer(
            IdempotencyLayer::new(store)
                .single_tenant()
                .response_limit(512),
        )
}

/// Checks that `answer` is the 409 of an outcome recorded without its response; its problem.
fn not_stored(answer: &Raw, what: &str) -> Value {
    assert_eq!(answer.status, 409, "{what}: {answer:?}");
    let problem = answer.json();
    assert_eq!(
        problem["type"],
        problem_type("response-not-stored"),
        "{what}"
    );
    problem
}

async fn post_path(addr: SocketAddr, path: &str, key: &str) -> Raw {
    raw_post(
        addr,
        path,
        &[("idempotency-key", key), ("content-type", "text/plain")],
        b"go",
    )
    .await
}

/// DESIGN §3 ("Once the inner service has returned a response head, the effect is taken as
/// done: a failure of the response body afterwards never releases the key; the record is kept
/// as 'completed, response not available' ... retries never re-run it"; "Panics ... never
/// cache a fabricated body"): the boxed `record_lost` path, and the `body: None` record
/// through every store's `Claim::Completed`.
async fn a_body_that_panics_is_never_run_again<St: IdempotencyStore + Clone>(store: St, tag: &str) {
    let effects = Effects::default();
    let addr = serve(paths_app(store, effects.clone())).await;
    let key = unique("body-panics");
    let first = post_path(addr, "/body-panics", &key).await;
    assert_eq!(first.status, 500, "{tag}: {first:?}");
    let p = first.json();
    assert_eq!(p["type"], problem_type("execution-failed"), "{tag}");
    assert_eq!(
        p["state"], "completed",
        "{tag}: the effect is taken as done"
    );
    for i in 0..3 {
        let retry = post_path(addr, "/body-panics", &key).await;
        assert!(retry.replayed(), "{tag}: retry {i}: a replay of the record");
        not_stored(&retry, &format!("{tag}: retry {i}"));
        assert!(
            !String::from_utf8_lossy(&retry.body).contains("partial"),
            "{tag}: a fabricated body was replayed"
        );
    }
    assert_eq!(effects.count(), 1, "{tag}: a panicking body ran twice");

    // A 5xx head whose body panics: not recorded under DefinitiveOnly, so the key is given
    // back and the retry runs (once more, and only once more).
    let key = unique("body-panics-500");
    let first = post_path(addr, "/body-panics-500", &key).await;
    assert_eq!(first.status, 500, "{tag}: {first:?}");
    assert_ne!(first.json()["state"], "completed", "{tag}");
    let before = effects.count();
    let retry = post_path(addr, "/body-panics-500", &key).await;
    assert_eq!(retry.status, 500, "{tag}: {retry:?}");
    assert_eq!(
        effects.count(),
        before + 1,
        "{tag}: the released key runs again"
    );
}

common::on_every_store!(a_body_that_panics_is_never_run_again);

/// DESIGN §3 ("every stored byte (headers and trailers too) counts toward the limit"; "A
/// response over the cache size limit is never silently re-executed"): a body streamed past
/// the limit (`TooLarge`, the boxed `record`) and a small body under a head over the limit
/// (`Complete` with `fits: false`, the boxed `record_without_body`), on every store.
async fn answers_too_large_to_keep_are_never_run_again<St: IdempotencyStore + Clone>(
    store: St,
    tag: &str,
) {
    let effects = Effects::default();
    let addr = serve(paths_app(store, effects.clone())).await;

    let key = unique("too-large");
    let first = post_path(addr, "/too-large", &key).await;
    assert_eq!(first.status, 201, "{tag}");
    assert_eq!(
        first.body,
        "run 1 ".repeat(2000).into_bytes(),
        "{tag}: the live answer is whole"
    );
    let retry = post_path(addr, "/too-large", &key).await;
    assert!(retry.replayed(), "{tag}");
    not_stored(&retry, tag);

    let key = unique("head-too-large");
    let first = post_path(addr, "/head-too-large", &key).await;
    assert_eq!(first.status, 201, "{tag}: {first:?}");
    assert_eq!(first.body, b"small 2", "{tag}: the live body is whole");
    assert_eq!(
        first.one("x-big").map(<[u8]>::len),
        Some(600),
        "{tag}: the live head is whole"
    );
    let retry = post_path(addr, "/head-too-large", &key).await;
    not_stored(&retry, tag);
    assert_eq!(
        effects.count(),
        2,
        "{tag}: an answer too large to keep ran twice"
    );
}

common::on_every_store!(answers_too_large_to_keep_are_never_run_again);

/// DESIGN §3 (panics release the claim "unless the handler marked the effect as started
/// (§4), then the record goes to needs_reconciliation"): the `finish` panic path, with a
/// milestone, on every store.
async fn a_panic_after_the_effect_started_is_unknown<St: IdempotencyStore + Clone>(
    store: St,
    tag: &str,
) {
    let effects = Effects::default();
    let addr = serve(paths_app(store, effects.clone())).await;
    let key = unique("panic-after-effect");
    let first = post_path(addr, "/panics-after-effect", &key).await;
    assert_eq!(first.status, 500, "{tag}: {first:?}");
    assert_eq!(
        first.json()["state"],
        "needs_reconciliation",
        "{tag}: the answer names the state"
    );
    for i in 0..3 {
        let retry = post_path(addr, "/panics-after-effect", &key).await;
        assert_eq!(retry.status, 409, "{tag}: retry {i}: {retry:?}");
        assert_eq!(
            retry.json()["type"],
            problem_type("outcome-unknown"),
            "{tag}"
        );
    }
    assert_eq!(effects.count(), 1, "{tag}: an uncertain effect ran twice");
}

common::on_every_store!(a_panic_after_the_effect_started_is_unknown);

/// DESIGN §4 ("when recording the outcome fails, the holder keeps renewing and retrying the
/// write ... instead of letting the lease lapse"), §7.7: the second store operation (the
/// `complete`) fails once; the live answer is still whole, retries get 409 until the write
/// lands, then the exact replay; one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_complete_is_retried_and_then_replayed_exactly() {
    let store = FlakyStore::default();
    // claim is operation 1, complete operation 2 (an instant handler: no renewal between).
    store.fail_at.store(2, Ordering::SeqCst);
    let effects = Effects::default();
    let addr = serve(exact_app(
        IdempotencyLayer::new(store.clone()).single_tenant(),
        effects.clone(),
    ))
    .await;
    let key = unique("complete-fails");
    let first = raw_post(addr, "/exact", &exact_headers(&key), b"a").await;
    assert_eq!(first.status, 201, "the live answer: {first:?}");
    assert_eq!(first.body, payload());
    assert_eq!(
        store.log().get(1).copied(),
        Some("complete"),
        "the fault hit the record: {:?}",
        store.log()
    );
    let mut replay = None;
    for _ in 0..500 {
        let retry = raw_post(addr, "/exact", &exact_headers(&key), b"a").await;
        if retry.status != 409 {
            replay = Some(retry);
            break;
        }
        assert_ne!(
            retry.json()["safe_new_key"],
            true,
            "an unrecorded outcome is no reason to move on"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let replay = replay.expect("the background write landed");
    assert_replays("after a failed complete", &first, &replay);
    assert_eq!(effects.count(), 1, "a failed record ran the handler twice");
}

/// DESIGN §1 step 7 and the route option that cancels on disconnect: once the handler has
/// answered, the outcome is recorded on a task of its own (`tokio::spawn(self.finish(..))`),
/// so a client hanging up while the record is being written cancels nothing: the retry
/// replays, one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hang_up_while_recording_on_a_cancelling_route_still_records() {
    let store = FlakyStore::default();
    *store.pause_before_complete.lock().expect("lock") = Some(Duration::from_millis(800));
    let effects = Effects::default();
    let app = exact_app(
        IdempotencyLayer::new(store.clone())
            .single_tenant()
            .cancel_on_disconnect(true),
        effects.clone(),
    );
    let addr = serve(app).await;
    let key = unique("cancel-recording");
    let hung_up = common::client()
        .post(format!("http://{addr}/exact"))
        .header("idempotency-key", key.as_str())
        .header("content-type", "application/octet-stream")
        .body("a")
        .timeout(Duration::from_millis(200))
        .send()
        .await;
    assert!(
        hung_up.is_err(),
        "the client gave up before the record landed"
    );
    until("the handler ran", || effects.count() == 1).await;
    let mut replay = None;
    for _ in 0..500 {
        let retry = raw_post(addr, "/exact", &exact_headers(&key), b"a").await;
        if retry.status != 409 {
            replay = Some(retry);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let replay = replay.expect("the outcome was recorded");
    assert_eq!(replay.status, 201, "{replay:?}");
    assert!(replay.replayed(), "a replay, not a second run: {replay:?}");
    assert_eq!(replay.body, payload());
    assert_eq!(replay.one("location"), Some(&b"/things/1"[..]));
    assert_eq!(effects.count(), 1, "the hang-up cost a second run");
}

/// DESIGN §1 step 7 (routes that cancel on disconnect give the key back) and §4 (a started
/// effect is uncertain): a client that hangs up while a handler that marked its effect
/// started is still running leaves "outcome unknown", never a second run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hang_up_after_the_effect_started_on_a_cancelling_route_is_unknown() {
    let started = Effects::default();
    let finished = Effects::default();
    let (s, f) = (started.clone(), finished.clone());
    let app = Router::new()
        .route(
            "/slow",
            post(move |ctx: IdempotencyContext, _b: Bytes| async move {
                ctx.effect_started().await.expect("milestone");
                s.hit();
                tokio::time::sleep(Duration::from_secs(5)).await;
                f.hit();
                "done"
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .cancel_on_disconnect(true),
        );
    let addr = serve(app).await;
    let key = unique("cancel-started");
    let hung_up = common::client()
        .post(format!("http://{addr}/slow"))
        .header("idempotency-key", key.as_str())
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(hung_up.is_err());
    until("the effect started", || started.count() == 1).await;
    let mut last = None;
    for _ in 0..100 {
        let retry = raw_post(addr, "/slow", &[("idempotency-key", key.as_str())], b"").await;
        let p = retry.json();
        if p["type"] == problem_type("outcome-unknown") {
            last = Some(retry);
            break;
        }
        assert_eq!(retry.status, 409, "{retry:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let last = last.expect("the key ended as outcome unknown");
    assert_eq!(last.status, 409);
    assert_eq!(started.count(), 1, "the effect ran twice");
    assert_eq!(finished.count(), 0, "the cancelled handler finished");
}

// ---------------------------------------------------------------------------------------------
// 6. JSON-RPC (the boxed `record_call`, and the tee of an SSE answer) on every store.
// ---------------------------------------------------------------------------------------------

async fn tool(
    axum::extract::State(effects): axum::extract::State<Effects>,
    body: Bytes,
) -> Response<Body> {
    let message: Value = serde_json::from_slice(&body).expect("JSON");
    let n = effects.hit();
    let text = Value::from(format!(
        "ticket {n}: {}",
        message["params"]["arguments"]["title"]
    ));
    // Written by hand: bytes the layer must embed as written (`1.50`, member order), never
    // re-serialised.
    let response = format!(
        r#"{{"jsonrpc":"2.0","id":{},"result":{{"isError":false,"exact":1.50,"content":[{{"type":"text","text":{text}}}]}}}}"#,
        message["id"]
    );
    let arguments = &message["params"]["arguments"];
    if arguments["broken"] == true {
        let mut res = Response::new(Body::new(PanicAfterFirst { sent: false }));
        res.headers_mut()
            .insert("content-type", HeaderValue::from_static("application/json"));
        return res;
    }
    if let Some(size) = arguments["pad"].as_u64() {
        let padded = response.replacen(
            r#""exact":1.50"#,
            &format!(r#""exact":1.50,"pad":"{}""#, "p".repeat(size as usize)),
            1,
        );
        let mut res = Response::new(Body::from(padded));
        res.headers_mut()
            .insert("content-type", HeaderValue::from_static("application/json"));
        return res;
    }
    if arguments["sse"] == true {
        let stream = format!(
            "data: {{\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{{\"progress\":1}}}}\n\ndata: {response}\n\n"
        );
        let mut res = Response::new(Body::from(stream));
        res.headers_mut().insert(
            "content-type",
            HeaderValue::from_static("text/event-stream"),
        );
        return res;
    }
    let mut res = Response::new(Body::from(response));
    res.headers_mut()
        .insert("content-type", HeaderValue::from_static("application/json"));
    res
}

fn tool_call(id: Value, progress: &str, arguments: Value) -> Vec<u8> {
    json!({
        "jsonrpc": "2.0",
        "id": id,
        "method": "tools/call",
        "params": {"name": "create_ticket", "arguments": arguments, "_meta": {"progressToken": progress}}
    })
    .to_string()
    .into_bytes()
}

async fn rpc(addr: SocketAddr, key: &str, message: &[u8]) -> Raw {
    raw_post(
        addr,
        "/mcp",
        &[
            ("idempotency-key", key),
            ("content-type", "application/json"),
            ("accept", "application/json, text/event-stream"),
        ],
        message,
    )
    .await
}

/// The JSON-RPC response of an answer: the body, or an SSE stream's last `data:` line.
fn rpc_message(raw: &Raw) -> Value {
    let text = String::from_utf8_lossy(&raw.body).into_owned();
    let data = text
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("data: "))
        .map(str::to_owned);
    serde_json::from_str(data.as_deref().unwrap_or(&text)).expect("a JSON-RPC message")
}

/// DESIGN §8 ("a replay carries the new request's id exactly as it was sent, and the recorded
/// result bytes unchanged"; "SSE responses are teed while they stream and replayed as their
/// final JSON-RPC response"; mismatches are JSON-RPC errors with the problem facts in
/// error.data), on every store: the boxed `record_call` and the tee's `record_call`.
async fn jsonrpc_calls_replay_under_the_new_id<St: IdempotencyStore + Clone>(store: St, tag: &str) {
    let effects = Effects::default();
    let addr = serve(tool_app(store, effects.clone())).await;

    for sse in [false, true] {
        let key = unique(&format!("rpc-{sse}"));
        let args = json!({"title": "printer", "sse": sse});
        let first = rpc(addr, &key, &tool_call(json!(1), "p-1", args.clone())).await;
        assert_eq!(first.status, 200, "{tag} sse={sse}: {first:?}");
        let first_message = rpc_message(&first);
        assert!(
            String::from_utf8_lossy(&first.body).contains("\"exact\":1.50"),
            "{tag} sse={sse}: the live bytes as the tool wrote them"
        );
        let runs = effects.count();
        let replay = rpc(
            addr,
            &key,
            &tool_call(json!("retry-2"), "p-2", args.clone()),
        )
        .await;
        assert_eq!(replay.status, 200, "{tag} sse={sse}: {replay:?}");
        assert!(replay.replayed(), "{tag} sse={sse}");
        let replayed = replay.json();
        assert_eq!(replayed["id"], "retry-2", "{tag} sse={sse}: the new id");
        assert_eq!(
            replayed["result"], first_message["result"],
            "{tag} sse={sse}: the recorded result"
        );
        assert!(
            String::from_utf8_lossy(&replay.body).contains("\"exact\":1.50"),
            "{tag} sse={sse}: the result's bytes unchanged: {}",
            String::from_utf8_lossy(&replay.body)
        );
        assert_eq!(
            effects.count(),
            runs,
            "{tag} sse={sse}: a replay ran the tool"
        );

        let changed = rpc(
            addr,
            &key,
            &tool_call(json!(3), "p-3", json!({"title": "scanner", "sse": sse})),
        )
        .await;
        let error = changed.json();
        assert_eq!(error["id"], 3, "{tag} sse={sse}: {error}");
        assert_eq!(error["error"]["code"], -31002, "{tag} sse={sse}: {error}");
        assert_eq!(
            error["error"]["data"]["state"], "completed",
            "{tag} sse={sse}: {error}"
        );
        assert_eq!(effects.count(), runs, "{tag} sse={sse}: a changed call ran");
    }
    assert_eq!(effects.count(), 2, "{tag}: one run per key");
}

common::on_every_store!(jsonrpc_calls_replay_under_the_new_id);

fn tool_app<St: IdempotencyStore>(store: St, effects: Effects) -> Router {
    Router::new()
        .route("/mcp", post(tool))
        .with_state(effects)
        .layer(
            IdempotencyLayer::new(store)
                .single_tenant()
                .jsonrpc(JsonRpc::new())
                .response_limit(2048),
        )
}

/// DESIGN §3 (a body that fails after the head: "the effect is taken as done ... retries
/// never re-run it"; over the limit: "the key stays consumed ... never a second run") and §8
/// (errors are JSON-RPC error objects that echo the request's id): the boxed `record_lost`
/// and `record` paths of a JSON-RPC call, on every store. Where the outcome travels in the
/// lost body, the head says nothing: the call is taken as done.
async fn jsonrpc_calls_whose_answer_is_lost_or_too_large_never_run_again<
    St: IdempotencyStore + Clone,
>(
    store: St,
    tag: &str,
) {
    let effects = Effects::default();
    let addr = serve(tool_app(store, effects.clone())).await;

    let key = unique("rpc-broken");
    let args = json!({"title": "printer", "broken": true});
    let first = rpc(addr, &key, &tool_call(json!(1), "p", args.clone())).await;
    let error = first.json();
    assert_eq!(error["id"], 1, "{tag}: {error}");
    assert_eq!(
        error["error"]["code"], -31006,
        "{tag}: execution failed: {error}"
    );
    assert_eq!(
        error["error"]["data"]["state"], "completed",
        "{tag}: {error}"
    );
    for id in 2..5 {
        let retry = rpc(addr, &key, &tool_call(json!(id), "p", args.clone())).await;
        let error = retry.json();
        assert_eq!(error["id"], id, "{tag}: the retry's own id: {error}");
        assert_eq!(error["error"]["code"], -31007, "{tag}: not stored: {error}");
    }
    assert_eq!(
        effects.count(),
        1,
        "{tag}: a call whose answer broke ran twice"
    );

    let key = unique("rpc-large");
    let args = json!({"title": "printer", "pad": 5000});
    let first = rpc(addr, &key, &tool_call(json!(1), "p", args.clone())).await;
    assert_eq!(first.status, 200, "{tag}");
    assert!(first.body.len() > 5000, "{tag}: the live answer is whole");
    assert_eq!(rpc_message(&first)["id"], 1);
    let retry = rpc(addr, &key, &tool_call(json!("again"), "p", args)).await;
    let error = retry.json();
    assert_eq!(error["id"], "again", "{tag}: {error}");
    assert_eq!(error["error"]["code"], -31007, "{tag}: not stored: {error}");
    assert_eq!(
        effects.count(),
        2,
        "{tag}: a call too large to keep ran twice"
    );
}

common::on_every_store!(jsonrpc_calls_whose_answer_is_lost_or_too_large_never_run_again);

// ---------------------------------------------------------------------------------------------
// 7. gRPC-Web (the boxed `record_copied` and `record_opaque`) on every store.
// ---------------------------------------------------------------------------------------------

fn web_frame(flag: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![flag];
    out.extend((payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(bytes).expect("gzip");
    encoder.finish().expect("gzip")
}

/// `/w.W/Call` answers a gRPC-Web body: a message and a trailer frame with `status`; with
/// `gzip`, the whole body is compressed at the HTTP level.
fn web_app<St: IdempotencyStore>(
    store: St,
    effects: Effects,
    status: &'static str,
    gzipped: bool,
) -> Router {
    Router::new()
        .route(
            "/w.W/Call",
            post(move |_b: Bytes| async move {
                let n = effects.hit();
                let mut body = web_frame(0, format!("note {n}").as_bytes());
                body.extend(web_frame(
                    0x80,
                    format!("grpc-status:{status}\r\nx-op:done-{n}\r\n").as_bytes(),
                ));
                let body = if gzipped { gzip(&body) } else { body };
                let mut res = Response::new(Body::from(body));
                res.headers_mut().insert(
                    "content-type",
                    HeaderValue::from_static("application/grpc-web+proto"),
                );
                if gzipped {
                    res.headers_mut()
                        .insert("content-encoding", HeaderValue::from_static("gzip"));
                }
                res
            }),
        )
        .route_layer(IdempotencyLayer::new(store).single_tenant())
}

async fn web_call(addr: SocketAddr, key: &str, accept_encoding: Option<&str>) -> Raw {
    let message = web_frame(0, b"take a note");
    let mut headers = vec![
        ("idempotency-key", key),
        ("content-type", "application/grpc-web+proto"),
        ("x-grpc-web", "1"),
    ];
    if let Some(ae) = accept_encoding {
        headers.push(("accept-encoding", ae));
    }
    raw_post(addr, "/w.W/Call", &headers, &message).await
}

/// Issue 19 §4 / DESIGN §3 ("gRPC outcomes are classified by the final grpc-status wherever
/// it travels (a gRPC-Web body frame)"): an OK gRPC-Web answer is recorded in gRPC form and
/// replayed in the live framing, byte for byte; an UNAVAILABLE one is given back and runs
/// again; a gzipped one (opaque) is recorded, never run twice.
async fn grpc_web_answers_through_every_store<St: IdempotencyStore + Clone>(store: St, tag: &str) {
    // OK: replayed exactly.
    let effects = Effects::default();
    let addr = serve(web_app(store.clone(), effects.clone(), "0", false)).await;
    let key = unique("web-ok");
    let first = web_call(addr, &key, None).await;
    assert_eq!(first.status, 200, "{tag}: {first:?}");
    let replay = web_call(addr, &key, None).await;
    assert_eq!(replay.status, 200, "{tag}: {replay:?}");
    assert!(replay.replayed(), "{tag}: {replay:?}");
    assert_eq!(
        replay.body, first.body,
        "{tag}: the live framing, byte for byte"
    );
    assert_eq!(effects.count(), 1, "{tag}: an OK gRPC-Web answer ran twice");

    // UNAVAILABLE: released, the retry runs, and its OK... is still UNAVAILABLE here (the
    // handler always answers 14), so each retry runs: exactly one run per attempt.
    let effects = Effects::default();
    let addr = serve(web_app(store.clone(), effects.clone(), "14", false)).await;
    let key = unique("web-unavailable");
    web_call(addr, &key, None).await;
    web_call(addr, &key, None).await;
    assert_eq!(
        effects.count(),
        2,
        "{tag}: UNAVAILABLE is no definitive answer"
    );

    // Compressed as a whole: its status cannot be read, so it is taken as done.
    let effects = Effects::default();
    let addr = serve(web_app(store, effects.clone(), "0", true)).await;
    let key = unique("web-gzip");
    let first = web_call(addr, &key, Some("gzip")).await;
    assert_eq!(first.status, 200, "{tag}: {first:?}");
    let retry = web_call(addr, &key, Some("gzip")).await;
    assert!(retry.replayed(), "{tag}: the retry is a replay: {retry:?}");
    assert_eq!(
        retry.body, first.body,
        "{tag}: the compressed bytes, as sent"
    );
    assert_eq!(effects.count(), 1, "{tag}: an opaque answer ran twice");
}

common::on_every_store!(grpc_web_answers_through_every_store);

// ---------------------------------------------------------------------------------------------
// 8. Metrics: compile-time keys, the recorder asked on every count.
// ---------------------------------------------------------------------------------------------

use common::counts::Counts;

/// DESIGN §6 (counters for attempts, executions, replays served, in-flight conflicts,
/// payload mismatches, missing/invalid keys, each under its own name) and the commit's
/// promise ("a recorder installed later, or a thread's local one, counts at once"): a local
/// recorder installed after the layer is built and has served (on this thread: the runtime
/// is current-thread) sees every event under its documented name, and nothing else.
#[tokio::test(flavor = "current_thread")]
async fn a_local_recorder_installed_after_the_layer_counts_every_event() {
    let effects = Effects::default();
    let layer = IdempotencyLayer::new(MemoryStore::new()).single_tenant();
    let addr = serve(exact_app(layer, effects.clone())).await;
    // Served before any recorder: counted nowhere.
    let warm = unique("metrics-warm");
    raw_post(addr, "/exact", &exact_headers(&warm), b"w").await;

    let counts = Counts::default();
    let _local = metrics::set_default_local_recorder(&counts);
    let key = unique("metrics");
    assert_eq!(
        raw_post(addr, "/exact", &exact_headers(&key), b"a")
            .await
            .status,
        201
    );
    assert_eq!(
        raw_post(addr, "/exact", &exact_headers(&key), b"a")
            .await
            .status,
        201
    );
    assert_eq!(
        raw_post(addr, "/exact", &exact_headers(&key), b"a")
            .await
            .status,
        201
    );
    assert_eq!(
        raw_post(addr, "/exact", &exact_headers(&key), b"b")
            .await
            .status,
        422
    );
    assert_eq!(
        raw_post(addr, "/exact", &exact_headers(&warm), b"w")
            .await
            .status,
        201
    );
    assert_eq!(
        raw_post(addr, "/exact", &[("content-type", "text/plain")], b"a")
            .await
            .status,
        400
    );

    assert_eq!(
        counts.get("idempotency_attempts_total"),
        5,
        "{:?}",
        counts.names()
    );
    assert_eq!(counts.get("idempotency_executions_total"), 1);
    assert_eq!(counts.get("idempotency_replays_total"), 3);
    assert_eq!(counts.get("idempotency_mismatches_total"), 1);
    assert_eq!(counts.get("idempotency_key_rejections_total"), 1);
    assert_eq!(counts.get("idempotency_conflicts_total"), 0);
    assert_eq!(effects.count(), 2, "the warm-up and the one run");
    let documented = [
        "idempotency_attempts_total",
        "idempotency_executions_total",
        "idempotency_replays_total",
        "idempotency_mismatches_total",
        "idempotency_key_rejections_total",
    ];
    for name in counts.names() {
        assert!(
            documented.contains(&name.as_str()),
            "an undocumented counter {name}"
        );
    }
}

/// DESIGN §6 ("replays served", "in-flight conflicts") and observe.rs's table
/// (`idempotency_conflicts_total`: "requests refused because the key was in flight"): a
/// retry on a route that waits, woken into a replay, was served a replay and refused
/// nothing. Counted on a local recorder (current-thread runtime).
#[tokio::test(flavor = "current_thread")]
async fn a_waiter_woken_into_a_replay_counts_one_replay_and_no_conflict() {
    let (entered, effects, gate) = (
        Effects::default(),
        Effects::default(),
        Arc::new(Notify::new()),
    );
    let app = gated_app(
        MemoryStore::new(),
        entered.clone(),
        effects.clone(),
        gate.clone(),
        Ending::Exact,
    );
    let addr = serve(app).await;
    let counts = Counts::default();
    let _local = metrics::set_default_local_recorder(&counts);
    let key = unique("metrics-waiter");
    let first = {
        let key = key.clone();
        tokio::spawn(async move {
            raw_post(
                addr,
                "/gated",
                &[
                    ("idempotency-key", key.as_str()),
                    ("content-type", "application/octet-stream"),
                ],
                b"g",
            )
            .await
        })
    };
    until("the first request enters", || entered.count() == 1).await;
    let waiter = {
        let key = key.clone();
        tokio::spawn(async move {
            raw_post(
                addr,
                "/gated",
                &[
                    ("idempotency-key", key.as_str()),
                    ("content-type", "application/octet-stream"),
                ],
                b"g",
            )
            .await
        })
    };
    // Give the waiter time to claim and start waiting (not an assertion on time).
    until("the waiter to have claimed", || {
        counts.get("idempotency_attempts_total") == 2
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    gate.notify_one();
    assert_eq!(guard("first", first).await.expect("task").status, 201);
    let waited = guard("waiter", waiter).await.expect("task");
    assert!(waited.replayed(), "{waited:?}");
    assert_eq!(effects.count(), 1);
    assert_eq!(counts.get("idempotency_executions_total"), 1);
    assert_eq!(
        counts.get("idempotency_replays_total"),
        1,
        "one replay served"
    );
    assert_eq!(
        counts.get("idempotency_conflicts_total"),
        0,
        "the waiter was served a replay, not refused as in flight"
    );
}

/// DESIGN §6 ("counters kept separately for ... in-flight conflicts"; observe.rs: "requests
/// refused because the key was in flight"): one waiting request on a store that polls (the
/// trait's default `wait_for_change`) is one request, however many rounds it polls. It may
/// count as at most one conflict, never one per round.
#[tokio::test(flavor = "current_thread")]
async fn a_polling_waiter_counts_as_at_most_one_conflict() {
    let (entered, effects, gate) = (
        Effects::default(),
        Effects::default(),
        Arc::new(Notify::new()),
    );
    // `wake` off: `wait_for_change` polls (10 ms, doubling), as a store without wake-ups.
    let store = FlakyStore::default();
    let app = gated_app(
        store,
        entered.clone(),
        effects.clone(),
        gate.clone(),
        Ending::Exact,
    );
    let addr = serve(app).await;
    let counts = Counts::default();
    let _local = metrics::set_default_local_recorder(&counts);
    let key = unique("metrics-poller");
    let send = |key: String| async move {
        raw_post(
            addr,
            "/gated",
            &[
                ("idempotency-key", key.as_str()),
                ("content-type", "application/octet-stream"),
            ],
            b"g",
        )
        .await
    };
    let first = tokio::spawn(send(key.clone()));
    until("the first request enters", || entered.count() == 1).await;
    let waiter = tokio::spawn(send(key.clone()));
    // Let the waiter poll a few rounds (10 + 20 + 40 + 80 + 160 ms) before the first ends.
    until("the waiter to have polled", || {
        counts.get("idempotency_attempts_total") == 2
    })
    .await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    gate.notify_one();
    assert_eq!(guard("first", first).await.expect("task").status, 201);
    let waited = guard("waiter", waiter).await.expect("task");
    assert!(waited.replayed(), "{waited:?}");
    assert_eq!(effects.count(), 1);
    assert_eq!(counts.get("idempotency_attempts_total"), 2);
    assert_eq!(counts.get("idempotency_replays_total"), 1);
    let conflicts = counts.get("idempotency_conflicts_total");
    assert!(
        conflicts <= 1,
        "one waiting request counted as {conflicts} in-flight conflicts (one per poll round)"
    );
}

// ---------------------------------------------------------------------------------------------
// 9. The processing window (one-pass p99) as the layer publishes it.
// ---------------------------------------------------------------------------------------------

/// DESIGN §9 ("publishes a processing window (p99 of recent executions)"): with fewer than
/// 100 executions the nearest-rank p99 is the slowest; replays are not executions. Lower
/// bounds only (a sleep lasts at least its length).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_published_window_is_the_slowest_of_a_few_executions() {
    let effects = Effects::default();
    let e = effects.clone();
    let layer = IdempotencyLayer::new(MemoryStore::new()).single_tenant();
    let app = Router::new()
        .route(
            "/w",
            post(move |body: String| async move {
                if body == "slow" {
                    tokio::time::sleep(Duration::from_millis(400)).await;
                }
                e.hit();
                "ok"
            }),
        )
        .layer(layer.clone());
    let addr = serve(app).await;
    // 20 executions, the sixth slow: the p99 last recomputed at 16 includes it.
    for i in 0..20 {
        let body: &[u8] = if i == 5 { b"slow" } else { b"fast" };
        let key = unique(&format!("w-{i}"));
        let res = raw_post(addr, "/w", &[("idempotency-key", key.as_str())], body).await;
        assert_eq!(res.status, 200);
        // And a replay each: never an execution.
        let res = raw_post(addr, "/w", &[("idempotency-key", key.as_str())], body).await;
        assert!(res.replayed());
    }
    assert_eq!(effects.count(), 20);
    let window = layer
        .processing_windows()
        .into_iter()
        .next()
        .expect("the defaults' window");
    assert_eq!(
        window.executions, 20,
        "replays are not executions: {window:?}"
    );
    let p99 = window.p99.expect("a p99 after 20 executions");
    assert!(
        p99 >= Duration::from_millis(400),
        "the p99 of 20 samples is the slowest (>= 400 ms), got {p99:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// 10. The media type read once.
// ---------------------------------------------------------------------------------------------

/// DESIGN §1 step 4 ("JSON bodies (application/json, *+json) canonicalised ... media-type
/// parameters count"; the fingerprint module: `charset=utf-8` of JSON changes nothing, a
/// media type is case-insensitive): the media type read once by a byte search for ';'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_media_type_decides_what_is_the_same_request() {
    let effects = Effects::default();
    let e = effects.clone();
    let app = Router::new()
        .route(
            "/m",
            post(move |_b: Bytes| async move { format!("run {}", e.hit()) }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    let send = |key: String, ct: &'static str, body: &'static [u8]| async move {
        raw_post(
            addr,
            "/m",
            &[("idempotency-key", key.as_str()), ("content-type", ct)],
            body,
        )
        .await
    };

    // The same JSON request, spelled differently: one run.
    let key = unique("json");
    let first = send(key.clone(), "application/json", br#"{"a":1,"b":[2,3]}"#).await;
    assert_eq!(first.status, 200);
    for (ct, body) in [
        ("APPLICATION/JSON", &br#"{"b":[2,3],"a":1}"#[..]),
        (
            "application/json; charset=utf-8",
            br#"{ "b": [2, 3], "a": 1 }"#,
        ),
        ("Application/Json;charset=UTF-8", br#"{"a":1,"b":[2,3]}"#),
        (
            "  application/json  ;charset=utf-8",
            br#"{"a":1,"b":[2,3]}"#,
        ),
    ] {
        let res = send(key.clone(), ct, body).await;
        assert_eq!(res.status, 200, "{ct}: {res:?}");
        assert!(res.replayed(), "{ct}: the same request replays");
        assert_eq!(res.body, first.body, "{ct}");
    }
    // +json is JSON too.
    let key = unique("merge-patch");
    send(
        key.clone(),
        "application/merge-patch+json",
        br#"{"x":1,"y":2}"#,
    )
    .await;
    let res = send(
        key.clone(),
        "application/merge-patch+json; charset=utf-8",
        br#"{"y":2,"x":1}"#,
    )
    .await;
    assert!(res.replayed(), "+json canonicalised: {res:?}");

    // Different requests: 422, never a replay of the other's answer.
    let key = unique("text");
    send(key.clone(), "text/plain", b"caf\xe9").await;
    for (ct, body) in [
        ("text/plain; charset=latin1", &b"caf\xe9"[..]),
        ("text/csv", b"caf\xe9"),
    ] {
        let res = send(key.clone(), ct, body).await;
        assert_eq!(res.status, 422, "{ct}: another request: {res:?}");
    }
    // A quoted ';' inside a parameter does not end the media type early for either side.
    let key = unique("quoted");
    send(key.clone(), r#"text/plain; x="a;b""#, b"q").await;
    let res = send(key.clone(), r#"text/plain; x="a;c""#, b"q").await;
    assert_eq!(res.status, 422, "parameters count: {res:?}");
    let res = send(key.clone(), r#"text/plain; x="a;b""#, b"q").await;
    assert!(res.replayed(), "the same parameters replay: {res:?}");
    assert_eq!(effects.count(), 4, "one run per distinct request");
}
