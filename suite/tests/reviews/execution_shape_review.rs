//! Review of the hand-written execution future (`execute/run.rs`: the lease held, the window
//! timed and `inner.call` made when the run is built; panics caught in `call` and in the
//! handler's future; the synchronous `next` / `stored` decisions and the boxed rare paths) and
//! of the thread buffers that are taken rather than borrowed (`reuse.rs`).
//!
//! Every test tries to make the layer run a handler twice, lose an answered outcome, leave a key
//! stuck, or answer something undocumented. Effects are counted where they happen (the handler,
//! the service's `call`), never inferred from answers.

use crate::common;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::error_handling::HandleErrorLayer;
use axum::routing::post;
use bytes::Bytes;
use common::{
    Effects, FlakyStore, grpc_frame, guard, gzip, problem_type,
    raw::{Raw, raw_post, unique},
    serve, until,
};
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Barrier, Semaphore};
use tower_idempotency::jsonrpc::JsonRpc;
use tower_idempotency::scope::SingleTenant;
use tower_idempotency::store::ScopedKey;
use tower_idempotency::{Fingerprint, IdempotencyLayer, IdempotencyStore, MemoryStore};

/// A key no earlier run has used.
async fn post_op(addr: SocketAddr, key: &str) -> Raw {
    raw_post(
        addr,
        "/op",
        &[("idempotency-key", key), ("content-type", "text/plain")],
        b"go",
    )
    .await
}

/// Sends the request and hangs up after `patience`, as a client whose own timeout fires.
async fn hang_up_after(addr: SocketAddr, key: &str, patience: Duration) {
    let gave_up = reqwest::Client::builder()
        .timeout(patience)
        .pool_max_idle_per_host(0)
        .build()
        .expect("client")
        .post(format!("http://{addr}/op"))
        .header("idempotency-key", key)
        .header("content-type", "text/plain")
        .body("go")
        .send()
        .await
        .is_err();
    assert!(gave_up, "the client was meant to hang up before an answer");
}

/// Retries until the answer is no longer a 409 in flight (the release or record landed).
async fn settle(addr: SocketAddr, key: &str) -> Raw {
    for _ in 0..1000 {
        let answer = post_op(addr, key).await;
        let in_flight = answer.status == 409
            && serde_json::from_slice::<Value>(&answer.body)
                .is_ok_and(|p| p["type"] == problem_type("in-flight"));
        if !in_flight {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the key stayed in flight");
}

// ---------------------------------------------------------------------------------------------
// A gate that handlers and bodies wait on.
// ---------------------------------------------------------------------------------------------

#[derive(Clone)]
struct Gate(Arc<Semaphore>);

impl Gate {
    fn new() -> Self {
        Self(Arc::new(Semaphore::new(0)))
    }

    fn open(&self) {
        self.0.add_permits(1 << 20);
    }

    fn wait(&self) -> impl Future<Output = ()> + Send + 'static {
        let s = self.0.clone();
        async move {
            let _ = s.acquire().await;
        }
    }
}

/// One step of a scripted response body.
enum Step {
    Data(Bytes),
    Wait(Pin<Box<dyn Future<Output = ()> + Send>>),
    Trailers(HeaderMap),
    Fail,
}

/// A response body that plays its steps in order.
struct Scripted(VecDeque<Step>);

impl http_body::Body for Scripted {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        loop {
            match self.0.front_mut() {
                None => return Poll::Ready(None),
                Some(Step::Wait(wait)) => {
                    std::task::ready!(wait.as_mut().poll(cx));
                    self.0.pop_front();
                }
                Some(_) => {
                    return Poll::Ready(match self.0.pop_front() {
                        Some(Step::Data(data)) => Some(Ok(Frame::data(data))),
                        Some(Step::Trailers(t)) => Some(Ok(Frame::trailers(t))),
                        Some(Step::Fail) => Some(Err(std::io::Error::other(
                            "injected failure of the response body",
                        ))),
                        _ => unreachable!(),
                    });
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A tower service (not an axum handler) behind the layer: what its `call` and its future do
// is scripted per call, and counted where it happens.
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq)]
enum Act {
    /// Answers 201 at once.
    Answer,
    /// `call` itself panics.
    PanicInCall,
    /// The future yields once, then panics.
    PanicInPoll,
    /// The future answers `Err`.
    Fail,
    /// The future answers 201, then panics when it is dropped.
    PanicOnDrop,
    /// The future waits for the gate, then answers 201.
    Slow,
    /// Answers its head at once; its body waits for the gate.
    SlowBody,
}

#[derive(Clone)]
struct Svc {
    /// Every `call`.
    calls: Effects,
    /// Every answer produced (the effect is done).
    answered: Effects,
    acts: Arc<Mutex<VecDeque<Act>>>,
    gate: Gate,
}

impl Svc {
    fn new(acts: impl IntoIterator<Item = Act>) -> Self {
        Self {
            calls: Effects::default(),
            answered: Effects::default(),
            acts: Arc::new(Mutex::new(acts.into_iter().collect())),
            gate: Gate::new(),
        }
    }
}

fn created(text: String) -> http::Response<Body> {
    let mut res = http::Response::new(Body::from(text));
    *res.status_mut() = StatusCode::CREATED;
    res.headers_mut()
        .insert("content-type", HeaderValue::from_static("text/plain"));
    res
}

/// A future that answers once, then panics when it is dropped after answering.
struct PanicsOnDrop {
    answer: Option<http::Response<Body>>,
    answered: Effects,
}

impl Future for PanicsOnDrop {
    type Output = Result<http::Response<Body>, std::io::Error>;

    fn poll(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Self::Output> {
        let answer = self.answer.take().expect("polled once");
        self.answered.hit();
        Poll::Ready(Ok(answer))
    }
}

impl Drop for PanicsOnDrop {
    fn drop(&mut self) {
        if self.answer.is_none() && !std::thread::panicking() {
            panic!("injected panic dropping the handler's future after it answered");
        }
    }
}

type SvcFuture = Pin<Box<dyn Future<Output = Result<http::Response<Body>, std::io::Error>> + Send>>;

impl<B> tower::Service<http::Request<B>> for Svc {
    type Response = http::Response<Body>;
    type Error = std::io::Error;
    type Future = SvcFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _req: http::Request<B>) -> Self::Future {
        let n = self.calls.hit();
        let act = self
            .acts
            .lock()
            .expect("lock")
            .pop_front()
            .unwrap_or(Act::Answer);
        let answered = self.answered.clone();
        let gate = self.gate.clone();
        match act {
            Act::Answer => Box::pin(async move {
                answered.hit();
                Ok(created(format!("effect {n}")))
            }),
            Act::PanicInCall => panic!("injected panic in Service::call"),
            Act::PanicInPoll => Box::pin(async move {
                tokio::task::yield_now().await;
                panic!("injected panic in the handler's future");
            }),
            Act::Fail => Box::pin(async move { Err(std::io::Error::other("injected error")) }),
            Act::PanicOnDrop => Box::pin(PanicsOnDrop {
                answer: Some(created(format!("effect {n}"))),
                answered,
            }),
            Act::Slow => Box::pin(async move {
                gate.wait().await;
                answered.hit();
                Ok(created(format!("effect {n}")))
            }),
            Act::SlowBody => Box::pin(async move {
                answered.hit();
                let body = Scripted(VecDeque::from([
                    Step::Data(Bytes::from(format!("effect {n}, part 1; "))),
                    Step::Wait(Box::pin(gate.wait())),
                    Step::Data(Bytes::from_static(b"part 2")),
                ]));
                let mut res = http::Response::new(Body::new(body));
                *res.status_mut() = StatusCode::CREATED;
                Ok(res)
            }),
        }
    }
}

fn layer<St: IdempotencyStore>(store: St, cancel: bool) -> IdempotencyLayer<St, SingleTenant> {
    IdempotencyLayer::new(store)
        .single_tenant()
        .cancel_on_disconnect(cancel)
}

/// `/op`: the layer over `svc`; a service error becomes a 502 outside the layer.
fn svc_app<St: IdempotencyStore>(layer: IdempotencyLayer<St, SingleTenant>, svc: Svc) -> Router {
    let guarded = tower::ServiceBuilder::new()
        .layer(HandleErrorLayer::new(|error: std::io::Error| async move {
            (StatusCode::BAD_GATEWAY, format!("service error: {error}"))
        }))
        .layer(layer)
        .service(svc);
    Router::new().route_service("/op", guarded)
}

fn assert_execution_failed(answer: &Raw, what: &str) {
    assert_eq!(answer.status, 500, "{what}: {answer:?}");
    assert_eq!(
        answer.json()["type"],
        problem_type("execution-failed"),
        "{what}: {answer:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// 1. Panics and service errors, on run-to-completion and cancelling routes.
// ---------------------------------------------------------------------------------------------

/// DESIGN §3 (panics release the claim) and the new `Run::new`: a `call` that panics is caught
/// where the run is built; the client gets `execution-failed`, the key is given back (the
/// retry runs, not a 409), and the retry's outcome is replayed after that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_call_releases_the_key_on_both_kinds_of_route() {
    for cancel in [false, true] {
        let svc = Svc::new([Act::PanicInCall]);
        let addr = serve(svc_app(layer(MemoryStore::new(), cancel), svc.clone())).await;
        let key = unique("panic-in-call");
        let first = post_op(addr, &key).await;
        assert_execution_failed(&first, &format!("cancel={cancel}"));
        assert_eq!(svc.calls.count(), 1);
        let retry = settle(addr, &key).await;
        assert_eq!(retry.status, 201, "cancel={cancel}: released: {retry:?}");
        assert_eq!(retry.text(), "effect 2");
        let replay = post_op(addr, &key).await;
        assert!(replay.replayed(), "cancel={cancel}: {replay:?}");
        assert_eq!(replay.text(), "effect 2");
        assert_eq!(svc.calls.count(), 2, "cancel={cancel}: one call per run");
        assert_eq!(svc.answered.count(), 1, "cancel={cancel}");
    }
}

/// The same for a future that panics after its first poll (caught in `Run::poll`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_the_handlers_future_releases_the_key_on_both_kinds_of_route() {
    for cancel in [false, true] {
        let svc = Svc::new([Act::PanicInPoll]);
        let addr = serve(svc_app(layer(MemoryStore::new(), cancel), svc.clone())).await;
        let key = unique("panic-in-poll");
        let first = post_op(addr, &key).await;
        assert_execution_failed(&first, &format!("cancel={cancel}"));
        let retry = settle(addr, &key).await;
        assert_eq!(retry.status, 201, "cancel={cancel}: released: {retry:?}");
        assert_eq!(retry.text(), "effect 2");
        let replay = post_op(addr, &key).await;
        assert!(replay.replayed(), "cancel={cancel}: {replay:?}");
        assert_eq!(svc.calls.count(), 2, "cancel={cancel}");
        assert_eq!(svc.answered.count(), 1, "cancel={cancel}");
    }
}

/// An inner `Err` gives the key back (DESIGN §3) and reaches the client as the service's own
/// error (here turned into a 502 outside the layer), on both kinds of route; the retry runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_error_releases_the_key_on_both_kinds_of_route() {
    for cancel in [false, true] {
        let svc = Svc::new([Act::Fail]);
        let addr = serve(svc_app(layer(MemoryStore::new(), cancel), svc.clone())).await;
        let key = unique("service-error");
        let first = post_op(addr, &key).await;
        assert_eq!(first.status, 502, "cancel={cancel}: {first:?}");
        assert!(
            first.text().contains("injected error"),
            "cancel={cancel}: the service's error: {first:?}"
        );
        let retry = settle(addr, &key).await;
        assert_eq!(retry.status, 201, "cancel={cancel}: released: {retry:?}");
        assert_eq!(svc.calls.count(), 2, "cancel={cancel}");
        assert_eq!(svc.answered.count(), 1, "cancel={cancel}");
    }
}

/// The handler's future answered, then panicked as it was dropped. The first hand-written run
/// dropped it outside `catch_unwind` (this test found it: the connection dropped without an
/// answer, the key left in flight for a whole lease, or released and run again on a cancelling
/// route); `execute::run::Call` now drops it inside the caught poll. The client must get a
/// documented answer, and the key must not be left in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_future_that_panics_when_dropped_still_gets_a_documented_answer() {
    for cancel in [false, true] {
        let svc = Svc::new([Act::PanicOnDrop]);
        let addr = serve(svc_app(layer(MemoryStore::new(), cancel), svc.clone())).await;
        let key = unique("panic-on-drop");
        let first = post_op(addr, &key).await;
        assert_eq!(
            svc.answered.count(),
            1,
            "cancel={cancel}: the handler answered"
        );
        let retry = post_op(addr, &key).await;
        assert!(
            first.status != 0 && retry.status != 409,
            "cancel={cancel}: the panic escaped the run: the first request got {} (0: the \
             connection was dropped without an answer), and its retry {retry:?} (409: the key \
             was left in flight until its lease runs out, then taken over: a second run)",
            first.status
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Hang-ups.
// ---------------------------------------------------------------------------------------------

/// `cancel_on_disconnect`: a hang-up before the handler answers cancels it and gives the key
/// back; the retry runs (the cancelled future never answers, even once the gate opens).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hang_up_before_the_answer_on_a_cancelling_route_cancels_and_releases() {
    let svc = Svc::new([Act::Slow, Act::Answer]);
    let addr = serve(svc_app(layer(MemoryStore::new(), true), svc.clone())).await;
    let key = unique("cancel-before");
    hang_up_after(addr, &key, Duration::from_millis(300)).await;
    let retry = settle(addr, &key).await;
    assert_eq!(retry.status, 201, "released: {retry:?}");
    assert_eq!(retry.text(), "effect 2");
    svc.gate.open();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        svc.answered.count(),
        1,
        "the cancelled handler went on after the hang-up"
    );
    let replay = post_op(addr, &key).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.text(), "effect 2");
}

/// `cancel_on_disconnect`: the handler answered its head, its body is still being read when
/// the client hangs up. The answer means the effect happened: the body is read on to its end
/// on a task of its own and recorded; the retry replays it whole, never a second run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hang_up_while_the_body_is_read_on_a_cancelling_route_still_records() {
    let svc = Svc::new([Act::SlowBody]);
    let addr = serve(svc_app(layer(MemoryStore::new(), true), svc.clone())).await;
    let key = unique("cancel-after-head");
    hang_up_after(addr, &key, Duration::from_millis(300)).await;
    assert_eq!(svc.answered.count(), 1, "the head was answered");
    svc.gate.open();
    let replay = settle(addr, &key).await;
    assert_eq!(replay.status, 201, "recorded, not released: {replay:?}");
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.text(), "effect 1, part 1; part 2");
    assert_eq!(svc.calls.count(), 1, "a second run");
}

/// Run to completion (the default): a hang-up before the handler answers cancels nothing;
/// its outcome is recorded and replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hang_up_on_a_run_to_completion_route_never_cancels_the_handler() {
    for act in [Act::Slow, Act::SlowBody] {
        let svc = Svc::new([act]);
        let addr = serve(svc_app(layer(MemoryStore::new(), false), svc.clone())).await;
        let key = unique("run-to-completion");
        hang_up_after(addr, &key, Duration::from_millis(300)).await;
        svc.gate.open();
        until("the handler answered", || svc.answered.count() == 1).await;
        let replay = settle(addr, &key).await;
        assert_eq!(replay.status, 201, "{act:?}: {replay:?}");
        assert!(replay.replayed(), "{act:?}: {replay:?}");
        assert!(replay.text().starts_with("effect 1"), "{act:?}: {replay:?}");
        assert_eq!(svc.calls.count(), 1, "{act:?}: a second run");
    }
}

/// DESIGN §7.3 on both kinds of route: eight duplicates released through a barrier while the
/// first is held in its handler; exactly one call, every other answer a 409; then a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_run_once_on_both_kinds_of_route() {
    for cancel in [false, true] {
        let svc = Svc::new([Act::Slow]);
        let addr = serve(svc_app(layer(MemoryStore::new(), cancel), svc.clone())).await;
        let key = unique("duplicates");
        let barrier = Arc::new(Barrier::new(8));
        let done = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let (barrier, done, key) = (barrier.clone(), done.clone(), key.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                let answer = post_op(addr, &key).await;
                done.fetch_add(1, Ordering::SeqCst);
                answer
            }));
        }
        until("seven duplicates answered", || {
            done.load(Ordering::SeqCst) == 7
        })
        .await;
        assert_eq!(svc.calls.count(), 1, "cancel={cancel}");
        svc.gate.open();
        let mut statuses = Vec::new();
        for task in tasks {
            statuses.push(task.await.expect("task").status);
        }
        statuses.sort_unstable();
        assert_eq!(
            statuses,
            [201, 409, 409, 409, 409, 409, 409, 409],
            "cancel={cancel}"
        );
        let replay = post_op(addr, &key).await;
        assert!(replay.replayed(), "cancel={cancel}: {replay:?}");
        assert_eq!(svc.calls.count(), 1, "cancel={cancel}: a second run");
    }
}

// ---------------------------------------------------------------------------------------------
// 3. The processing window gets one sample per execution, however it ends.
// ---------------------------------------------------------------------------------------------

fn executions<St: IdempotencyStore>(layer: &IdempotencyLayer<St, SingleTenant>) -> u64 {
    layer
        .processing_windows()
        .into_iter()
        .find(|w| w.route.is_none())
        .expect("the defaults' window")
        .executions
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_execution_gives_the_window_exactly_one_sample() {
    for cancel in [false, true] {
        let svc = Svc::new([
            Act::Answer,
            Act::PanicInCall,
            Act::PanicInPoll,
            Act::Fail,
            Act::Slow,
        ]);
        let layer = layer(MemoryStore::new(), cancel);
        let addr = serve(svc_app(layer.clone(), svc.clone())).await;
        assert_eq!(executions(&layer), 0);
        let mut expected = 0;
        for what in ["answer", "panic in call", "panic in poll", "error"] {
            let answer = post_op(addr, &unique(&what.replace(' ', "-"))).await;
            assert_ne!(answer.status, 400, "{what}: {answer:?}");
            expected += 1;
            until(what, || executions(&layer) >= expected).await;
            assert_eq!(executions(&layer), expected, "cancel={cancel}: {what}");
        }
        // A client that hangs up while the handler runs: cancelled or run on, still one.
        hang_up_after(addr, &unique("hang-up"), Duration::from_millis(300)).await;
        svc.gate.open();
        expected += 1;
        until("the hung-up execution", || executions(&layer) >= expected).await;
        // A replay is no execution.
        let key = unique("replayed");
        post_op(addr, &key).await;
        post_op(addr, &key).await;
        expected += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(executions(&layer), expected, "cancel={cancel}");
    }
}

// ---------------------------------------------------------------------------------------------
// 4. The rare paths: the lease is held until they record; a failed record lands later.
// ---------------------------------------------------------------------------------------------

/// The JSON-RPC tool of the rare-path routes: a JSON answer, an SSE stream, an interim stream
/// (no final response), or a stream that breaks before its final response.
async fn tool(
    axum::extract::State(effects): axum::extract::State<Effects>,
    body: Bytes,
) -> Response<Body> {
    let message: Value = serde_json::from_slice(&body).expect("JSON");
    let n = effects.hit();
    let response = format!(
        r#"{{"jsonrpc":"2.0","id":{},"result":{{"content":[{{"type":"text","text":"ticket {n}"}}]}}}}"#,
        message["id"]
    );
    let progress = r#"{"jsonrpc":"2.0","method":"notifications/progress","params":{"progress":1}}"#;
    let mode = message["params"]["arguments"]["mode"]
        .as_str()
        .unwrap_or("");
    let (body, sse) = match mode {
        "sse" => (
            Body::from(format!("data: {progress}\n\ndata: {response}\n\n")),
            true,
        ),
        "interim" => {
            let interim = format!(
                r#"{{"jsonrpc":"2.0","id":{},"result":{{"resultType":"input_required","inputRequests":{{}}}}}}"#,
                message["id"]
            );
            (
                Body::from(format!("data: {progress}\n\ndata: {interim}\n\n")),
                true,
            )
        }
        // A stream that ends without the response nor an interim result: the server took the
        // call (its response went elsewhere, as on a resumed MCP stream).
        "unseen" => (Body::from(format!("data: {progress}\n\n")), true),
        "sse-broken" => (
            Body::new(Scripted(VecDeque::from([
                Step::Data(Bytes::from(format!("data: {progress}\n\n"))),
                Step::Fail,
            ]))),
            true,
        ),
        _ => (Body::from(response), false),
    };
    let mut res = Response::new(body);
    res.headers_mut().insert(
        "content-type",
        HeaderValue::from_static(if sse {
            "text/event-stream"
        } else {
            "application/json"
        }),
    );
    res
}

fn tool_call(id: Value, mode: &str) -> Vec<u8> {
    json!({
        "jsonrpc": "2.0",
        "id": id,
        "method": "tools/call",
        "params": {"name": "create_ticket", "arguments": {"mode": mode}}
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

fn web_frame(flag: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![flag];
    out.extend((payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// The rare-path routes, each counting its runs in `effects`.
fn rare_app<St: IdempotencyStore>(
    layer: IdempotencyLayer<St, SingleTenant>,
    effects: Effects,
) -> Router {
    let web = |kind: &'static str, effects: Effects| {
        post(move |_b: Bytes| async move {
            let n = effects.hit();
            let mut body = web_frame(0, format!("note {n}").as_bytes());
            body.extend(web_frame(0x80, b"grpc-status:0\r\nx-op:done\r\n"));
            let body = match kind {
                "gzip" => gzip(&body),
                "malformed" => b"\x00\x00\x00\x00\xffnot grpc-web at all".to_vec(),
                _ => body,
            };
            let mut res = Response::new(Body::from(body));
            res.headers_mut().insert(
                "content-type",
                HeaderValue::from_static("application/grpc-web+proto"),
            );
            if kind == "gzip" {
                res.headers_mut()
                    .insert("content-encoding", HeaderValue::from_static("gzip"));
            }
            res
        })
    };
    let (e1, e2, e3, e4) = (
        effects.clone(),
        effects.clone(),
        effects.clone(),
        effects.clone(),
    );
    Router::new()
        .route(
            "/too-large",
            post(move |_b: Bytes| async move {
                let n = e1.hit();
                (StatusCode::CREATED, format!("run {n} ").repeat(400))
            }),
        )
        .route(
            "/head-too-large",
            post(move |_b: Bytes| async move {
                let n = e2.hit();
                (
                    StatusCode::CREATED,
                    [("x-big", "h".repeat(600))],
                    format!("small {n}"),
                )
            }),
        )
        .route(
            "/broken",
            post(move |_b: Bytes| async move {
                e3.hit();
                let body = Scripted(VecDeque::from([
                    Step::Data(Bytes::from_static(b"partial ")),
                    Step::Fail,
                ]));
                let mut res = Response::new(Body::new(body));
                *res.status_mut() = StatusCode::CREATED;
                res
            }),
        )
        .route("/w.W/Ok", web("ok", e4.clone()))
        .route("/w.W/Gzip", web("gzip", e4.clone()))
        .route("/w.W/Malformed", web("malformed", e4))
        .route("/mcp", post(tool).with_state(effects))
        .layer(
            layer
                .response_limit(512)
                .for_path("/mcp", |route| route.jsonrpc(JsonRpc::new())),
        )
}

/// Sends the request of `path` (JSON-RPC on `/mcp`, gRPC-Web on `/w.W/*`, text otherwise).
async fn rare_request(addr: SocketAddr, path: &str, key: &str, id: u32) -> Raw {
    if let Some(mode) = path.strip_prefix("/mcp#") {
        return rpc(addr, key, &tool_call(json!(id), mode)).await;
    }
    if path.starts_with("/w.W/") {
        let message = web_frame(0, b"take a note");
        return raw_post(
            addr,
            path,
            &[
                ("idempotency-key", key),
                ("content-type", "application/grpc-web+proto"),
                ("x-grpc-web", "1"),
                ("accept-encoding", "gzip"),
            ],
            &message,
        )
        .await;
    }
    raw_post(
        addr,
        path,
        &[("idempotency-key", key), ("content-type", "text/plain")],
        b"go",
    )
    .await
}

/// DESIGN §4: the lease is held from before the handler starts until its outcome is recorded.
/// On every rare path (boxed in `next` / `record`), the store takes four leases to write the
/// record: a retry meanwhile must find the key in flight, never a lapsed lease to take over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_is_held_until_every_rare_path_records() {
    let store = FlakyStore::default();
    *store.pause_before_complete.lock().expect("lock") = Some(Duration::from_millis(1_200));
    let effects = Effects::default();
    let layer = IdempotencyLayer::new(store.clone())
        .single_tenant()
        .lease(Duration::from_millis(300));
    let addr = serve(rare_app(layer, effects.clone())).await;
    let paths = [
        "/too-large",
        "/head-too-large",
        "/broken",
        "/w.W/Ok",
        "/w.W/Gzip",
        "/mcp#json",
        "/mcp#sse",
    ];
    for path in paths {
        let before = effects.count();
        let key = unique("rare-lease");
        let first = tokio::spawn({
            let key = key.clone();
            async move { rare_request(addr, path, &key, 1).await }
        });
        until("the handler ran", || effects.count() == before + 1).await;
        // Past two leases, while the record is still being written.
        tokio::time::sleep(Duration::from_millis(700)).await;
        let during = rare_request(addr, path, &key, 2).await;
        assert_eq!(
            effects.count(),
            before + 1,
            "{path}: a retry while the record was written ran the handler again: {during:?}"
        );
        guard("the first answer", first).await.expect("task");
        // Let every background write (a streamed answer's) land.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let after = rare_request(addr, path, &key, 3).await;
        assert_eq!(
            effects.count(),
            before + 1,
            "{path}: a retry after the record ran the handler again: {after:?}"
        );
    }
}

/// DESIGN §4 / §7.7: a record the store refuses is retried until it lands, on the rare paths
/// too (the boxed `record_rare`), and on a cancelling route (recorded on a task of its own):
/// retries see 409 meanwhile and then the record, never a second run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_record_on_a_rare_path_lands_later() {
    for cancel in [false, true] {
        let store = FlakyStore::default();
        let effects = Effects::default();
        let layer = IdempotencyLayer::new(store.clone())
            .single_tenant()
            .cancel_on_disconnect(cancel);
        let addr = serve(rare_app(layer, effects.clone())).await;
        for path in [
            "/head-too-large",
            "/too-large",
            "/w.W/Ok",
            "/w.W/Gzip",
            "/mcp#json",
            "/mcp#sse",
        ] {
            let before = effects.count();
            let key = unique("refused");
            store
                .fail_complete_once
                .lock()
                .expect("lock")
                .insert(key.clone());
            let first = rare_request(addr, path, &key, 1).await;
            assert!(
                (200..300).contains(&first.status),
                "cancel={cancel} {path}: the live answer is sent: {first:?}"
            );
            let mut last = None;
            for i in 0..500 {
                let retry = rare_request(addr, path, &key, 10 + i).await;
                let in_flight = retry.status == 409
                    && retry.json()["type"] == problem_type("in-flight")
                    || retry.text().contains("in-flight") && !retry.replayed();
                if !in_flight {
                    last = Some(retry);
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let last = last.expect("the record landed");
            assert_eq!(
                effects.count(),
                before + 1,
                "cancel={cancel} {path}: a refused record ran the handler twice: {last:?}"
            );
            assert!(
                store.fail_complete_once.lock().expect("lock").is_empty(),
                "cancel={cancel} {path}: the fault was never hit"
            );
        }
    }
}

/// gRPC-Web and JSON-RPC streams on a cancelling route (their records are made on the
/// detached task): an opaque (compressed) answer is never run twice; a malformed one is
/// UNKNOWN and given back; an interim stream is never stored (the retry runs); a stream that
/// breaks, or ends, before its final response is taken as done (never run again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dialect_rare_paths_keep_or_release_the_key_as_documented() {
    for cancel in [false, true] {
        let effects = Effects::default();
        let addr = serve(rare_app(layer(MemoryStore::new(), cancel), effects.clone())).await;
        // (path, runs after two requests)
        for (path, runs) in [
            ("/w.W/Gzip", 1),
            ("/w.W/Malformed", 2),
            ("/mcp#interim", 2),
            ("/mcp#unseen", 1),
            ("/mcp#sse-broken", 1),
            ("/mcp#sse", 1),
            ("/broken", 1),
        ] {
            let before = effects.count();
            let key = unique("dialect");
            rare_request(addr, path, &key, 1).await;
            // Streams are recorded on their own task: wait until the key has settled.
            let mut second = None;
            for i in 0..500 {
                let retry = rare_request(addr, path, &key, 2 + i).await;
                let in_flight = retry.text().contains("in-flight") && !retry.replayed();
                if !in_flight {
                    second = Some(retry);
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let second = second.expect("settled");
            assert_eq!(
                effects.count() - before,
                runs,
                "cancel={cancel} {path}: second answer {second:?}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 5. gRPC: trailers recorded and replayed exactly; answers too large to keep (`tail`) and
//    answers whose trailers make them too large (`fits: false`).
// ---------------------------------------------------------------------------------------------

const SMALL: &str = "/zz.Exec/Small";
const LARGE: &str = "/zz.Exec/Large";
const LARGE_INTERNAL: &str = "/zz.Exec/LargeInternal";
const BIG_TRAILERS: &str = "/zz.Exec/BigTrailers";
const BIG_TRAILERS_UNAVAILABLE: &str = "/zz.Exec/BigTrailersUnavailable";
const LARGE_GATED: &str = "/zz.Exec/LargeGated";

#[derive(Clone)]
struct Exec {
    effects: Effects,
    gate: Gate,
}

impl tonic::server::NamedService for Exec {
    const NAME: &'static str = "zz.Exec";
}

fn status_trailers(status: &'static str, n: usize) -> HeaderMap {
    let mut t = HeaderMap::new();
    t.insert("grpc-status", HeaderValue::from_static(status));
    t.insert("x-entry", HeaderValue::from(n));
    t.append("x-tags", HeaderValue::from_static("a"));
    t.append("x-tags", HeaderValue::from_static("b"));
    t
}

impl<B: Send + 'static> tower::Service<http::Request<B>> for Exec {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let n = self.effects.hit();
        let path = req.uri().path().to_owned();
        let gate = self.gate.clone();
        Box::pin(async move {
            let steps = match path.as_str() {
                LARGE | LARGE_INTERNAL => {
                    let status = if path == LARGE { "0" } else { "13" };
                    vec![
                        Step::Data(Bytes::from(grpc_frame(&vec![b'L'; 4096]))),
                        Step::Trailers(status_trailers(status, n)),
                    ]
                }
                BIG_TRAILERS | BIG_TRAILERS_UNAVAILABLE => {
                    let status = if path == BIG_TRAILERS { "0" } else { "14" };
                    let mut t = status_trailers(status, n);
                    t.insert("x-big", HeaderValue::from_str(&"t".repeat(600)).expect("v"));
                    vec![
                        Step::Data(Bytes::from(grpc_frame(format!("small {n}").as_bytes()))),
                        Step::Trailers(t),
                    ]
                }
                LARGE_GATED => {
                    let message = grpc_frame(&vec![b'G'; 1000]);
                    let (a, b) = message.split_at(400);
                    vec![
                        Step::Data(Bytes::copy_from_slice(a)),
                        Step::Wait(Box::pin(gate.wait())),
                        Step::Data(Bytes::copy_from_slice(b)),
                        Step::Trailers(status_trailers("0", n)),
                    ]
                }
                _ => {
                    let message = grpc_frame(format!("small {n}").as_bytes());
                    let (a, b) = message.split_at(3);
                    vec![
                        Step::Data(Bytes::copy_from_slice(a)),
                        Step::Data(Bytes::copy_from_slice(b)),
                        Step::Trailers(status_trailers("0", n)),
                    ]
                }
            };
            let mut res =
                http::Response::new(tonic::body::Body::new(Scripted(VecDeque::from(steps))));
            res.headers_mut()
                .insert("content-type", HeaderValue::from_static("application/grpc"));
            Ok(res)
        })
    }
}

async fn serve_exec<St: IdempotencyStore>(store: St, exec: Exec, cancel: bool) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let layer = IdempotencyLayer::new_for_grpc(store)
        .single_tenant()
        .cancel_on_disconnect(cancel)
        .grpc_method(SMALL, |m| m)
        .grpc_method(LARGE, |m| m.response_limit(512))
        .grpc_method(LARGE_INTERNAL, |m| m.response_limit(512))
        .grpc_method(BIG_TRAILERS, |m| m.response_limit(512))
        .grpc_method(BIG_TRAILERS_UNAVAILABLE, |m| m.response_limit(512))
        .grpc_method(LARGE_GATED, |m| m.response_limit(256));
    let server = tonic::transport::Server::builder()
        .layer(layer)
        .add_service(exec)
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    tokio::spawn(async move { server.await.expect("grpc server") });
    addr
}

type Call = (StatusCode, HeaderMap, Bytes, Option<HeaderMap>);

async fn h2_call(addr: SocketAddr, path: &str, key: &str) -> Call {
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
            .body(Full::new(Bytes::from(grpc_frame(b"e"))))
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

fn grpc_status(call: &Call) -> Option<String> {
    call.1
        .get("grpc-status")
        .or_else(|| call.3.as_ref().and_then(|t| t.get("grpc-status")))
        .map(|v| v.to_str().expect("ascii").to_owned())
}

fn replayed(call: &Call) -> bool {
    call.1
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true")
}

/// Trailers (boxed now in the capture) are recorded and replayed exactly: same message, same
/// grpc-status, same repeated trailer values, on both kinds of route.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_trailers_are_replayed_exactly() {
    for cancel in [false, true] {
        let exec = Exec {
            effects: Effects::default(),
            gate: Gate::new(),
        };
        let addr = serve_exec(MemoryStore::new(), exec.clone(), cancel).await;
        let key = unique("grpc-small");
        let first = h2_call(addr, SMALL, &key).await;
        assert_eq!(grpc_status(&first).as_deref(), Some("0"), "cancel={cancel}");
        let replay = h2_call(addr, SMALL, &key).await;
        assert!(replayed(&replay), "cancel={cancel}: {:?}", replay.1);
        assert_eq!(replay.2, first.2, "cancel={cancel}: the message");
        let (t1, t2) = (
            first.3.clone().expect("live trailers"),
            replay.3.clone().expect("replayed trailers"),
        );
        for name in ["grpc-status", "x-entry", "x-tags"] {
            let a: Vec<_> = t1.get_all(name).iter().collect();
            let b: Vec<_> = t2.get_all(name).iter().collect();
            assert_eq!(a, b, "cancel={cancel}: trailer {name}");
        }
        assert_eq!(exec.effects.count(), 1, "cancel={cancel}");
    }
}

/// DESIGN §3: an answer over the limit is recorded without its response, by its final status
/// (gRPC: in the trailers): OK keeps the key consumed (never a second run, the retry gets a
/// documented non-OK answer, no fabricated message); INTERNAL / UNAVAILABLE give it back.
/// Both the forwarded `tail` (message over the limit) and `fits: false` (trailers over it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_answers_too_large_to_keep_are_classified_by_their_trailers() {
    for cancel in [false, true] {
        for (path, status, runs) in [
            (LARGE, "0", 1),
            (LARGE_INTERNAL, "13", 2),
            (BIG_TRAILERS, "0", 1),
            (BIG_TRAILERS_UNAVAILABLE, "14", 2),
        ] {
            let exec = Exec {
                effects: Effects::default(),
                gate: Gate::new(),
            };
            let addr = serve_exec(MemoryStore::new(), exec.clone(), cancel).await;
            let key = unique("grpc-large");
            let first = h2_call(addr, path, &key).await;
            assert_eq!(
                grpc_status(&first).as_deref(),
                Some(status),
                "cancel={cancel} {path}: the live status"
            );
            assert!(
                first.2.len() > 5,
                "cancel={cancel} {path}: the live message"
            );
            if path == BIG_TRAILERS {
                let t = first.3.as_ref().expect("trailers");
                assert_eq!(
                    t["x-big"].len(),
                    600,
                    "cancel={cancel}: the live trailers whole"
                );
            }
            // The tail records on its task before the status is sent; the retry may still
            // see the key in flight for a moment.
            let mut retry = h2_call(addr, path, &key).await;
            for _ in 0..200 {
                if grpc_status(&retry).as_deref() != Some("10") || replayed(&retry) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
                retry = h2_call(addr, path, &key).await;
            }
            assert_eq!(
                exec.effects.count(),
                runs,
                "cancel={cancel} {path}: retry {:?} {:?}",
                retry.1,
                retry.3
            );
            if runs == 1 {
                assert!(replayed(&retry), "cancel={cancel} {path}: {:?}", retry.1);
                assert_ne!(
                    grpc_status(&retry).as_deref(),
                    Some("0"),
                    "cancel={cancel} {path}: a record without its message is no OK"
                );
                assert!(
                    retry.2.is_empty(),
                    "cancel={cancel} {path}: fabricated message"
                );
            }
        }
    }
}

/// A gRPC answer too large to keep is forwarded by `tail`; the client reads its head and
/// hangs up mid-stream. The method answered its head: its effect is taken as done (DESIGN §3,
/// "a failure of the response body afterwards never releases the key"), so a retry must not
/// run it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_hang_up_mid_stream_of_a_large_answer_never_runs_it_again() {
    let exec = Exec {
        effects: Effects::default(),
        gate: Gate::new(),
    };
    let addr = serve_exec(MemoryStore::new(), exec.clone(), false).await;
    let key = unique("grpc-hang-up");
    guard("the head, then a hang-up", async {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (mut sender, connection) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(stream),
        )
        .await
        .expect("h2 handshake");
        let connection = tokio::spawn(connection);
        let request = http::Request::post(format!("http://{addr}{LARGE_GATED}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("idempotency-key", key.as_str())
            .body(Full::new(Bytes::from(grpc_frame(b"e"))))
            .expect("request");
        let res = sender.send_request(request).await.expect("response");
        assert_eq!(res.status(), StatusCode::OK);
        drop(res);
        drop(sender);
        connection.abort();
    })
    .await;
    assert_eq!(exec.effects.count(), 1);
    // Give the server a moment to see the hang-up, then let the rest of the answer come.
    tokio::time::sleep(Duration::from_millis(200)).await;
    exec.gate.open();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let retry = h2_call(addr, LARGE_GATED, &key).await;
    assert_eq!(
        exec.effects.count(),
        1,
        "a method that answered its head ran again after a hang-up mid-stream: retry {:?} {:?}",
        retry.1,
        retry.3
    );
}

// ---------------------------------------------------------------------------------------------
// 6. Thread buffers (reuse.rs): keys, fingerprints and canonical JSON made from thread-local
//    destructors and after documents that outgrow what a thread keeps.
// ---------------------------------------------------------------------------------------------

fn json_parts() -> http::request::Parts {
    http::Request::post("/orders")
        .header("content-type", "application/json")
        .body(())
        .expect("request")
        .into_parts()
        .0
}

/// A document with many nodes (over what a thread keeps room for) and over 64 KiB.
fn huge_document() -> Vec<u8> {
    let items: Vec<Value> = (0..20_000)
        .map(|i| json!({"z": i, "a": [i, "x"]}))
        .collect();
    serde_json::to_vec(&json!({"items": items, "b": 1})).expect("json")
}

/// Everything the buffers feed, computed in one go.
type Computed = (
    (String, String),
    Fingerprint,
    Option<Vec<u8>>,
    Fingerprint,
    Option<Vec<u8>>,
    bool,
);

fn compute_all() -> Computed {
    let long_scope = "s".repeat(3000);
    let key = ScopedKey::new(&long_scope, "k-1");
    let small_key = ScopedKey::new("tenant", "k-2");
    assert_eq!(key.scope(), long_scope);
    let parts = json_parts();
    let huge = huge_document();
    let fp_huge = Fingerprint::of(&parts, &huge).expect("fingerprint");
    let canonical_huge = tower_idempotency::fingerprint::canonical_json(&huge).expect("canonical");
    // A malformed and a non-canonical document in between must leave nothing behind.
    let malformed = tower_idempotency::fingerprint::canonical_json(br#"{"a": [1, 2"#).is_err();
    let _ = tower_idempotency::fingerprint::canonical_json(br#"{"a":1,"a":2}"#);
    let fp_small = Fingerprint::of(&parts, br#"{ "b": 1, "a": [true, null, "\u00e9"] }"#)
        .expect("fingerprint");
    let canonical_small =
        tower_idempotency::fingerprint::canonical_json(br#"{ "z": 1, "a": {"y": 2, "b": 3} }"#)
            .expect("canonical");
    (
        (small_key.scope().to_owned(), small_key.key().to_owned()),
        fp_huge,
        canonical_huge,
        fp_small,
        canonical_small,
        malformed,
    )
}

type Seen = Result<Computed, String>;

struct InDestructor(Option<std::sync::mpsc::Sender<Seen>>);

impl Drop for InDestructor {
    fn drop(&mut self) {
        let seen = std::panic::catch_unwind(compute_all).map_err(|panic| {
            panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default()
        });
        if let Some(tx) = self.0.take() {
            let _ = tx.send(seen);
        }
    }
}

thread_local! {
    static FIRST_USE: std::cell::RefCell<InDestructor> =
        const { std::cell::RefCell::new(InDestructor(None)) };
    static AFTER_USE: std::cell::RefCell<InDestructor> =
        const { std::cell::RefCell::new(InDestructor(None)) };
}

/// A thread whose first use of the crate's buffers is in a thread-local's destructor, and one
/// whose buffers were destroyed before that destructor runs: both compute exactly what a
/// normal thread computes, large documents and failed ones included, without a panic.
#[test]
fn keys_and_fingerprints_made_in_thread_local_destructors_are_exact() {
    let expected = compute_all();
    // Twice on this thread: what the kept buffers hold never leaks into the next call.
    assert_eq!(compute_all(), expected, "the same thread, buffers reused");
    for first_use in [true, false] {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            if first_use {
                FIRST_USE.with_borrow_mut(|d| d.0 = Some(tx));
            } else {
                AFTER_USE.with_borrow_mut(|d| d.0 = Some(tx));
                // The crate's buffers are first used after `AFTER_USE`: destroyed before it.
                let _ = compute_all();
            }
        })
        .join()
        .expect("the thread ends");
        let seen = rx
            .recv()
            .expect("the destructor ran and reported")
            .unwrap_or_else(|panic| panic!("first_use={first_use}: panicked: {panic}"));
        assert_eq!(seen, expected, "first_use={first_use}");
    }
}

/// Through the layer, on one worker thread (so every request meets the same thread buffers):
/// a huge JSON body, a malformed one, then the same small body with its members reordered
/// must still be recognised as the same request (a replay), and a changed one as different.
#[tokio::test(flavor = "current_thread")]
async fn fingerprints_through_the_layer_survive_huge_and_malformed_bodies_on_one_thread() {
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new().route(
        "/op",
        post(move |_b: Bytes| async move { format!("effect {}", sink.hit()) }).layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .body_limit(4 << 20),
        ),
    );
    let addr = serve(app).await;
    let json_post = |key: String, body: Vec<u8>| async move {
        raw_post(
            addr,
            "/op",
            &[
                ("idempotency-key", &key),
                ("content-type", "application/json"),
            ],
            &body,
        )
        .await
    };
    let key = unique("reordered");
    let first = json_post(key.clone(), br#"{"a":1,"b":[1,2,{"c":"d"}]}"#.to_vec()).await;
    assert_eq!(first.status, 200, "{first:?}");
    let huge = json_post(unique("huge"), huge_document()).await;
    assert_eq!(huge.status, 200, "{huge:?}");
    let malformed = json_post(unique("malformed"), br#"{"a": [1, 2"#.to_vec()).await;
    assert_eq!(malformed.status, 400, "{malformed:?}");
    let reordered = json_post(
        key.clone(),
        br#"{ "b": [1, 2, {"c": "d"}], "a": 1 }"#.to_vec(),
    )
    .await;
    assert!(
        reordered.replayed(),
        "the same request, reordered: {reordered:?}"
    );
    assert_eq!(reordered.body, first.body);
    let changed = json_post(key, br#"{"a":2,"b":[1,2,{"c":"d"}]}"#.to_vec()).await;
    assert_eq!(changed.status, 422, "{changed:?}");
    assert_eq!(effects.count(), 2, "the first and the huge one ran");
}
