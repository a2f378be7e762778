//! Adversarial review: store faults under the gRPC, gRPC-Web and JSON-RPC (JSON and SSE)
//! dialects, over real sockets, executions counted at the sink (the handler).
//!
//! Each case arms a store wrapper ([`Chaos`]) that fails, or stalls for longer than the
//! lease, the n-th operation of one kind the pipeline makes (the read before the claim, the
//! claim, a renewal, the record, the "outcome unknown" mark, the release, a history append),
//! sends one call (R1), a concurrent retry while R1's handler runs (R2), a retry after R1
//! answered (R3), all on the faulty server, then retries on a second server over the same
//! store without faults (a healthy view) until the key settles, and checks:
//!
//! - the handler ran exactly once (twice when its first run failed with a retryable status and
//!   its key was given back), and never for a call that was refused (fail closed);
//! - a call whose handler ran and answered is told that answer (never an error, never lost);
//! - a call that did not run gets the recorded answer (a replay) or a "retry later" refusal
//!   (store unavailable, in flight, outcome unknown) in its own dialect: a gRPC status with the
//!   layer's `google.rpc.Status` details, a JSON-RPC error object addressed to its own `id`,
//!   never problem+json nor an HTTP error page;
//! - nothing hangs (every call is bounded) and nothing in the crate panics;
//! - after settling, every retry is a replay of the one successful run.
//!
//! A second family hangs up (drops the call) while a store operation is slow, on
//! run-to-completion and cancel-on-disconnect routes.

mod common;

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, header};
use axum::response::Response;
use axum::routing::post;
use bytes::Bytes;
use http::HeaderValue;
use http::uri::PathAndQuery;
use http_body::Frame;
use http_body_util::StreamBody;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use tokio::net::TcpListener;
use tonic::Status;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Endpoint, Server};
use tonic_prost::ProstCodec;
use tower_idempotency::jsonrpc::JsonRpc;
use tower_idempotency::store::{
    Claim, ClaimRequest, FencingToken, HistoryEvent, Milestone, Record, RecordStatus, ScopedKey,
    StoreError, StoredResponse,
};
use tower_idempotency::{IdempotencyLayer, IdempotencyStore, RouteConfig};

// ---- timing ----------------------------------------------------------------------------------

/// The lease of the failure matrix: short, so a stalled store op outlasts it.
const LEASE: Duration = Duration::from_millis(400);
/// How long the handler works in the failure matrix: longer than a lease, so renewals matter.
const WORK: Duration = Duration::from_millis(1000);
/// How long a stalled store operation takes: longer than the lease.
const STALL: Duration = Duration::from_millis(1500);
/// Any single call taking longer than this is a hang.
const CALL_PATIENCE: Duration = Duration::from_secs(12);

// ---- panics in the crate ---------------------------------------------------------------------

/// Every panic whose location is not in this test file (the crate's, or a dependency's).
fn foreign_panics() -> &'static Mutex<Vec<String>> {
    static PANICS: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    static HOOK: OnceLock<()> = OnceLock::new();
    HOOK.get_or_init(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let at = info
                .location()
                .map(|l| format!("{}:{}", l.file(), l.line()))
                .unwrap_or_default();
            if !at.contains("dialect_faults_review") {
                let message = info
                    .payload()
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| info.payload().downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                if let Some(panics) = PANICS.get() {
                    panics
                        .lock()
                        .expect("lock")
                        .push(format!("{at}: {message}"));
                }
            }
            previous(info);
        }));
    });
    PANICS.get_or_init(Mutex::default)
}

// ---- the store -------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// The operation fails (store unavailable), changing nothing.
    Fail,
    /// The operation is slow to arrive: it waits [`STALL`], then happens.
    StallBefore,
    /// The operation happens, then its answer is slow to come back ([`STALL`]).
    StallAfter,
}

#[derive(Clone, Copy, Debug)]
struct Fault {
    kind: &'static str,
    nth: usize,
    mode: Mode,
}

const fn fault(kind: &'static str, nth: usize, mode: Mode) -> Fault {
    Fault { kind, nth, mode }
}

#[derive(Default)]
struct ChaosState {
    counts: Mutex<HashMap<&'static str, usize>>,
    faults: Mutex<Vec<Fault>>,
    armed: AtomicBool,
    /// What happened, in order: every counted operation, and the faults that fired.
    log: Mutex<Vec<String>>,
    stall: Mutex<Option<Duration>>,
}

/// A store that fails or stalls the n-th operation of a kind, counted across every request
/// made through it (the read before the claim, the claim, renewals, the record, the release,
/// the "outcome unknown" mark, history appends). Its inner store is shared with a healthy
/// view that has no faults.
#[derive(Clone)]
struct Chaos<S> {
    inner: Arc<S>,
    state: Arc<ChaosState>,
    /// Whether the in-process fast paths (`claim_now`, `completed_now`) of the inner store are
    /// offered (MemoryStore has them).
    now_reads: bool,
}

impl<S> Chaos<S> {
    fn new(inner: Arc<S>, now_reads: bool, faults: Vec<Fault>) -> Self {
        let state = ChaosState::default();
        *state.faults.lock().expect("lock") = faults;
        state.armed.store(true, Ordering::SeqCst);
        Self {
            inner,
            state: Arc::new(state),
            now_reads,
        }
    }

    fn fired(&self) -> Vec<String> {
        self.state
            .log
            .lock()
            .expect("lock")
            .iter()
            .filter(|l| l.contains(" <- "))
            .cloned()
            .collect()
    }

    fn log(&self) -> Vec<String> {
        self.state.log.lock().expect("lock").clone()
    }

    fn fault_for(&self, kind: &'static str, n: usize) -> Option<Mode> {
        if !self.state.armed.load(Ordering::SeqCst) {
            return None;
        }
        self.state
            .faults
            .lock()
            .expect("lock")
            .iter()
            .find(|f| f.kind == kind && f.nth == n)
            .map(|f| f.mode)
    }

    /// The fault the next operation of `kind` would meet, without counting it.
    fn peek(&self, kind: &'static str) -> Option<Mode> {
        let n = self
            .state
            .counts
            .lock()
            .expect("lock")
            .get(kind)
            .copied()
            .unwrap_or(0)
            + 1;
        self.fault_for(kind, n)
    }

    /// Counts an operation of `kind`; the fault it meets, if any.
    fn next(&self, kind: &'static str) -> Option<Mode> {
        let n = {
            let mut counts = self.state.counts.lock().expect("lock");
            let n = counts.entry(kind).or_insert(0);
            *n += 1;
            *n
        };
        let mode = self.fault_for(kind, n);
        let line = match mode {
            Some(mode) => format!("{kind}#{n} <- {mode:?}"),
            None => format!("{kind}#{n}"),
        };
        self.state.log.lock().expect("lock").push(line);
        mode
    }

    async fn around<T>(
        &self,
        kind: &'static str,
        op: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let stall = self.state.stall.lock().expect("lock").unwrap_or(STALL);
        match self.next(kind) {
            None => op.await,
            Some(Mode::Fail) => Err(injected(kind)),
            Some(Mode::StallBefore) => {
                tokio::time::sleep(stall).await;
                op.await
            }
            Some(Mode::StallAfter) => {
                let out = op.await;
                tokio::time::sleep(stall).await;
                out
            }
        }
    }
}

fn injected(what: &str) -> StoreError {
    StoreError::unavailable(std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        format!("{what}: store unavailable (injected)"),
    ))
}

impl<S: IdempotencyStore> IdempotencyStore for Chaos<S> {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        self.around("claim", self.inner.claim(request)).await
    }

    fn claim_now(&self, request: &ClaimRequest) -> Option<Result<Claim, StoreError>> {
        if !self.now_reads {
            return None;
        }
        // A stalled claim cannot be made at once: it goes the awaited way.
        if matches!(
            self.peek("claim"),
            Some(Mode::StallBefore | Mode::StallAfter)
        ) {
            return None;
        }
        match self.next("claim") {
            Some(Mode::Fail) => Some(Err(injected("claim"))),
            _ => self.inner.claim_now(request),
        }
    }

    fn recorded_fingerprint_now(
        &self,
        key: &ScopedKey,
    ) -> Option<tower_idempotency::fingerprint::Fingerprint> {
        if !self.now_reads {
            return None;
        }
        self.inner.recorded_fingerprint_now(key)
    }

    fn completed_now(&self, key: &ScopedKey) -> Option<Result<Claim, StoreError>> {
        if !self.now_reads {
            return None;
        }
        match self.next("read") {
            Some(Mode::Fail) => Some(Err(injected("read"))),
            _ => self.inner.completed_now(key),
        }
    }

    async fn renew(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<SystemTime, StoreError> {
        self.around("renew", self.inner.renew(key, token, lease))
            .await
    }

    async fn complete(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.around("complete", self.inner.complete(key, token, response, ttl))
            .await
    }

    async fn release(
        &self,
        key: &ScopedKey,
        token: FencingToken,
    ) -> Result<RecordStatus, StoreError> {
        self.around("release", self.inner.release(key, token)).await
    }

    async fn mark_uncertain(&self, key: &ScopedKey, token: FencingToken) -> Result<(), StoreError> {
        self.around("uncertain", self.inner.mark_uncertain(key, token))
            .await
    }

    async fn lookup(&self, key: &ScopedKey) -> Result<Option<Record>, StoreError> {
        self.around("lookup", self.inner.lookup(key)).await
    }

    async fn record_milestone(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        milestone: &Milestone,
    ) -> Result<(), StoreError> {
        self.around(
            "milestone",
            self.inner.record_milestone(key, token, milestone),
        )
        .await
    }

    async fn append_history(&self, key: &ScopedKey, event: HistoryEvent) -> Result<(), StoreError> {
        self.around("history", self.inner.append_history(key, event))
            .await
    }

    crate::common::forward::forward_store!(inner: remove, purge_expired, list_uncertain, count_uncertain, resolve, wait_for_change);
}

// ---- the sink --------------------------------------------------------------------------------

/// The tool behind every dialect: counts runs where they happen.
#[derive(Default)]
struct Tool {
    /// Runs begun.
    started: AtomicUsize,
    /// Runs that finished their work (the effect).
    done: AtomicUsize,
    work_ms: AtomicU64,
    /// The first run fails with a retryable status (gRPC UNAVAILABLE, HTTP 503).
    fail_first: AtomicBool,
    /// Answer JSON-RPC calls as an event stream.
    sse: AtomicBool,
    /// (call label, run number, failed) per finished run.
    ran: Mutex<Vec<(String, usize, bool)>>,
}

impl Tool {
    fn new(work: Duration, fail_first: bool, sse: bool) -> Arc<Self> {
        let tool = Self::default();
        tool.work_ms
            .store(work.as_millis() as u64, Ordering::SeqCst);
        tool.fail_first.store(fail_first, Ordering::SeqCst);
        tool.sse.store(sse, Ordering::SeqCst);
        Arc::new(tool)
    }

    /// One run: `Ok(n)` (the n-th finished run) or `Err(n)` (it failed).
    async fn work(&self, call: String) -> Result<usize, usize> {
        self.started.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(self.work_ms.load(Ordering::SeqCst))).await;
        let n = self.done.fetch_add(1, Ordering::SeqCst) + 1;
        let failed = n == 1 && self.fail_first.load(Ordering::SeqCst);
        self.ran.lock().expect("lock").push((call, n, failed));
        if failed { Err(n) } else { Ok(n) }
    }

    fn started(&self) -> usize {
        self.started.load(Ordering::SeqCst)
    }

    fn done(&self) -> usize {
        self.done.load(Ordering::SeqCst)
    }

    fn ran(&self) -> Vec<(String, usize, bool)> {
        self.ran.lock().expect("lock").clone()
    }
}

// ---- gRPC and gRPC-Web -----------------------------------------------------------------------

#[derive(Clone, PartialEq, prost::Message)]
struct Note {
    #[prost(string, tag = "1")]
    text: String,
}

const METHOD: &str = "/chaos.Chaos/Do";

fn note_frame(text: String) -> Vec<u8> {
    common::grpc_frame(&prost::Message::encode_to_vec(&Note { text }))
}

/// A unary gRPC service written by hand: one message, then `grpc-status: 0`.
#[derive(Clone)]
struct Svc(Arc<Tool>);

impl tonic::server::NamedService for Svc {
    const NAME: &'static str = "chaos.Chaos";
}

impl<B: Send + 'static> tower::Service<http::Request<B>> for Svc {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let tool = self.0.clone();
        let call = req
            .headers()
            .get("x-call")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        Box::pin(async move {
            let n = match tool.work(call).await {
                Ok(n) => n,
                Err(_) => return Ok(Status::unavailable("the ledger is down").into_http()),
            };
            let mut trailers = http::HeaderMap::new();
            trailers.insert("grpc-status", HeaderValue::from_static("0"));
            let frames = vec![
                Ok::<_, Infallible>(Frame::data(Bytes::from(note_frame(format!("run {n}"))))),
                Ok(Frame::trailers(trailers)),
            ];
            let body = StreamBody::new(futures_util::stream::iter(frames));
            let mut res = http::Response::new(tonic::body::Body::new(body));
            res.headers_mut().insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/grpc"),
            );
            Ok(res)
        })
    }
}

/// Route settings for a case.
#[derive(Clone, Copy)]
struct Cfg {
    lease: Duration,
    cancel: bool,
}

impl Cfg {
    fn apply(self, route: RouteConfig) -> RouteConfig {
        route
            .lease(self.lease)
            .record_refusals(true)
            .cancel_on_disconnect(self.cancel)
    }
}

async fn grpc_server<St: IdempotencyStore>(
    store: Arc<St>,
    tool: Arc<Tool>,
    web: bool,
    cfg: Cfg,
) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let layer = IdempotencyLayer::from_arc(store)
        .single_tenant()
        .grpc_method(METHOD, move |m| cfg.apply(m));
    if web {
        let layers = tower::ServiceBuilder::new()
            .layer(layer)
            .layer(tonic_web::GrpcWebLayer::new())
            .into_inner();
        let server = Server::builder()
            .accept_http1(true)
            .layer(layers)
            .add_service(Svc(tool))
            .serve_with_incoming(TcpIncoming::from(listener));
        tokio::spawn(async move { server.await.expect("grpc-web server") });
    } else {
        let server = Server::builder()
            .layer(layer)
            .add_service(Svc(tool))
            .serve_with_incoming(TcpIncoming::from(listener));
        tokio::spawn(async move { server.await.expect("grpc server") });
    }
    addr
}

fn grpc_request(key: &str, id: u64) -> tonic::Request<Note> {
    let mut request = tonic::Request::new(Note {
        text: "take a note".into(),
    });
    request
        .metadata_mut()
        .insert("idempotency-key", key.parse().expect("ascii"));
    request
        .metadata_mut()
        .insert("x-call", format!("c{id}").parse().expect("ascii"));
    request
}

async fn grpc_call(addr: SocketAddr, key: &str, id: u64) -> Result<tonic::Response<Note>, Status> {
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .map_err(|e| Status::unknown(format!("connect: {e}")))?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| Status::unknown(format!("ready: {e}")))?;
    grpc.unary(
        grpc_request(key, id),
        PathAndQuery::from_static(METHOD),
        ProstCodec::default(),
    )
    .await
}

async fn web_call(addr: SocketAddr, key: &str, id: u64) -> Result<tonic::Response<Note>, Status> {
    let http = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http::<tonic_web::GrpcWebCall<tonic::body::Body>>();
    let service = tower::ServiceBuilder::new()
        .layer(tonic_web::GrpcWebClientLayer::new())
        .service(http);
    let origin = format!("http://{addr}").parse().expect("origin");
    let mut grpc = tonic::client::Grpc::with_origin(service, origin);
    grpc.ready()
        .await
        .map_err(|e| Status::unknown(format!("ready: {e}")))?;
    grpc.unary(
        grpc_request(key, id),
        PathAndQuery::from_static(METHOD),
        ProstCodec::default(),
    )
    .await
}

// ---- JSON-RPC --------------------------------------------------------------------------------

fn jsonrpc_app<St: IdempotencyStore>(store: Arc<St>, tool: Arc<Tool>, cfg: Cfg) -> Router {
    Router::new()
        .route(
            "/mcp",
            post(move |headers: HeaderMap, body: Bytes| {
                let tool = tool.clone();
                async move { mcp_tool(tool, headers, body).await }
            }),
        )
        .layer(
            IdempotencyLayer::from_arc(store)
                .single_tenant()
                .defaults(move |r| cfg.apply(r))
                .jsonrpc(JsonRpc::new()),
        )
}

async fn mcp_tool(tool: Arc<Tool>, headers: HeaderMap, body: Bytes) -> Response {
    let call = headers
        .get("x-call")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let id = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v.get("id").cloned())
        .unwrap_or(Value::Null);
    let sse = tool.sse.load(Ordering::SeqCst);
    let (status, message) = match tool.work(call).await {
        Ok(n) => (
            200,
            format!(
                r#"{{"jsonrpc":"2.0","id":{id},"result":{{"content":[{{"type":"text","text":"run {n}"}}]}}}}"#
            ),
        ),
        Err(_) => (
            503,
            format!(
                r#"{{"jsonrpc":"2.0","id":{id},"error":{{"code":-32603,"message":"ledger down"}}}}"#
            ),
        ),
    };
    let (content_type, text) = if sse {
        let progress = r#"{"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken":"p","progress":1}}"#;
        (
            "text/event-stream",
            format!("data: {progress}\n\ndata: {message}\n\n"),
        )
    } else {
        ("application/json", message)
    };
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, content_type)
        .body(Body::from(text))
        .expect("response")
}

async fn jsonrpc_call(addr: SocketAddr, key: &str, id: u64) -> Got {
    let body = format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"t","arguments":{{"x":1}}}}}}"#
    );
    let sent = common::client()
        .post(format!("http://{addr}/mcp"))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("idempotency-key", key)
        .header("x-call", format!("c{id}"))
        .body(body)
        .send()
        .await;
    let res = match sent {
        Ok(res) => res,
        Err(e) => return Got::Broken(format!("transport: {e}")),
    };
    let status = res.status().as_u16();
    let replayed = res
        .headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let content_type = res
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let text = match res.text().await {
        Ok(text) => text,
        Err(e) => return Got::Broken(format!("body: {e}")),
    };
    read_jsonrpc(status, &content_type, &text, id, replayed)
}

/// A JSON-RPC answer as an MCP client reads it: the message addressed to call `id`.
fn read_jsonrpc(status: u16, content_type: &str, text: &str, id: u64, replayed: bool) -> Got {
    let what = || format!("{status} {content_type}: {text}");
    let messages: Vec<Value> = if content_type.starts_with("application/json") {
        match serde_json::from_str(text) {
            Ok(v) => vec![v],
            Err(_) => return Got::Broken(format!("not JSON: {}", what())),
        }
    } else if content_type.starts_with("text/event-stream") {
        text.lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .filter_map(|d| serde_json::from_str(d.trim()).ok())
            .collect()
    } else {
        return Got::Broken(format!("not a JSON-RPC answer: {}", what()));
    };
    let Some(message) = messages.into_iter().find(|m| m.get("id").is_some()) else {
        return Got::Broken(format!("no response message: {}", what()));
    };
    if message["jsonrpc"] != "2.0" || message["id"] != id {
        return Got::Broken(format!("not addressed to id {id}: {}", what()));
    }
    if let Some(result) = message.get("result") {
        let text = result["content"][0]["text"].as_str().unwrap_or_default();
        return Got::Ran {
            text: text.to_owned(),
            replayed,
        };
    }
    let code = message["error"]["code"].as_i64().unwrap_or(0);
    match code {
        -32603 => Got::HandlerFailed,
        -31001 => Got::Refused(Kind::InFlight),
        -31003 => Got::Refused(Kind::Unknown),
        -31004 => Got::Refused(Kind::Unavailable),
        -31012..=-31000 if message["error"]["data"].is_object() => Got::Refused(Kind::Other(code)),
        _ => Got::Broken(format!("unexpected error object: {}", what())),
    }
}

// ---- dialects --------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dial {
    Grpc,
    GrpcWeb,
    JsonRpc,
    JsonRpcSse,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Unavailable,
    InFlight,
    Unknown,
    /// Any other refusal of the layer (gRPC code, or JSON-RPC code).
    Other(i64),
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Got {
    /// The tool's answer (live, or a replay).
    Ran { text: String, replayed: bool },
    /// The layer's refusal, in the dialect.
    Refused(Kind),
    /// The tool's own retryable failure, passed through.
    HandlerFailed,
    /// What the dialect's client cannot take as an answer: a transport error, an HTTP error
    /// page, problem+json on a JSON-RPC route, a status without the layer's details, a hang.
    Broken(String),
}

impl Got {
    fn retry_later(&self) -> bool {
        matches!(self, Got::Refused(Kind::InFlight | Kind::Unknown))
    }
}

fn read_grpc(result: Result<tonic::Response<Note>, Status>) -> Got {
    match result {
        Ok(res) => Got::Ran {
            replayed: res
                .metadata()
                .get("idempotency-replayed")
                .is_some_and(|v| v == "true"),
            text: res.into_inner().text,
        },
        Err(status) if status.message() == "the ledger is down" => Got::HandlerFailed,
        Err(status) => {
            let details = status.details();
            let has = |reason: &[u8]| details.windows(reason.len()).any(|w| w == reason);
            if details.is_empty() {
                return Got::Broken(format!("a status without the layer's details: {status:?}"));
            }
            match status.code() {
                tonic::Code::Unavailable if has(b"STORE_UNAVAILABLE") => {
                    Got::Refused(Kind::Unavailable)
                }
                tonic::Code::Aborted if has(b"IN_FLIGHT") => Got::Refused(Kind::InFlight),
                tonic::Code::Aborted if has(b"OUTCOME_UNKNOWN") => Got::Refused(Kind::Unknown),
                code => Got::Refused(Kind::Other(code as i64)),
            }
        }
    }
}

/// One call of the tool, bounded (a hang is `Broken`).
async fn call(dial: Dial, addr: SocketAddr, key: &str, id: u64) -> Got {
    let made = async {
        match dial {
            Dial::Grpc => read_grpc(grpc_call(addr, key, id).await),
            Dial::GrpcWeb => read_grpc(web_call(addr, key, id).await),
            Dial::JsonRpc | Dial::JsonRpcSse => jsonrpc_call(addr, key, id).await,
        }
    };
    match tokio::time::timeout(CALL_PATIENCE, made).await {
        Ok(got) => got,
        Err(_) => Got::Broken(format!("hung for {CALL_PATIENCE:?}")),
    }
}

/// The same call, dropped after `patience` (a client hanging up); whether it was dropped.
async fn hang_up(dial: Dial, addr: SocketAddr, key: &str, id: u64, patience: Duration) -> bool {
    tokio::time::timeout(patience, call(dial, addr, key, id))
        .await
        .is_err()
}

/// The faulty server and the healthy view, one tool behind both.
async fn servers<St: IdempotencyStore>(
    dial: Dial,
    faulty: Arc<Chaos<St>>,
    tool: &Arc<Tool>,
    cfg: Cfg,
) -> (SocketAddr, SocketAddr) {
    let healthy = faulty.inner.clone();
    match dial {
        Dial::Grpc | Dial::GrpcWeb => {
            let web = dial == Dial::GrpcWeb;
            (
                grpc_server(faulty, tool.clone(), web, cfg).await,
                grpc_server(healthy, tool.clone(), web, cfg).await,
            )
        }
        Dial::JsonRpc | Dial::JsonRpcSse => (
            common::serve(jsonrpc_app(faulty, tool.clone(), cfg)).await,
            common::serve(jsonrpc_app(healthy, tool.clone(), cfg)).await,
        ),
    }
}

fn unique(name: &str) -> String {
    common::raw::unique(name)
}

/// Retries `key` on `addr` until it is no longer in flight nor unknown: the first such answer
/// (and every answer met, for the report).
async fn settle(dial: Dial, addr: SocketAddr, key: &str, first_id: u64) -> (Got, Vec<Got>) {
    let mut seen = Vec::new();
    for i in 0..60u64 {
        let got = call(dial, addr, key, first_id + i).await;
        seen.push(got.clone());
        if !got.retry_later() {
            return (got, seen);
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    (
        Got::Broken("never settled (in flight / unknown for 9 s)".into()),
        seen,
    )
}

// ---- the failure matrix ----------------------------------------------------------------------

#[derive(Clone, Debug)]
struct Case {
    faults: Vec<Fault>,
    /// The tool's first run fails (retryable), so the key is released.
    fail_first: bool,
    /// Which call (1: R1, 2: R2, 3: R3) a failed claim must refuse with "unavailable".
    refused: Option<usize>,
}

fn case(faults: &[Fault]) -> Case {
    Case {
        faults: faults.to_vec(),
        fail_first: false,
        refused: None,
    }
}

fn label(case: &Case) -> String {
    let faults: Vec<String> = case
        .faults
        .iter()
        .map(|f| format!("{}#{}:{:?}", f.kind, f.nth, f.mode))
        .collect();
    format!(
        "[{}{}]",
        faults.join("+"),
        if case.fail_first {
            " first run fails"
        } else {
            ""
        }
    )
}

/// Runs one case; the violations found.
async fn run_case<St: IdempotencyStore>(
    dial: Dial,
    inner: Arc<St>,
    now_reads: bool,
    case: Case,
) -> Vec<String> {
    let name = label(&case);
    let chaos = Arc::new(Chaos::new(inner, now_reads, case.faults.clone()));
    let tool = Tool::new(WORK, case.fail_first, dial == Dial::JsonRpcSse);
    let cfg = Cfg {
        lease: LEASE,
        cancel: false,
    };
    let (faulty, healthy) = servers(dial, chaos.clone(), &tool, cfg).await;
    let key = unique("dfr");

    // R1, then R2 while R1's handler works (past its first lease), then R3 after R1 answered.
    let r1 = tokio::spawn({
        let key = key.clone();
        async move { call(dial, faulty, &key, 1).await }
    });
    tokio::time::sleep(LEASE * 3 / 2).await;
    let r2 = call(dial, faulty, &key, 2).await;
    let r1 = r1.await.expect("R1 task");
    let r3 = call(dial, faulty, &key, 3).await;
    // The faults stay armed (each fires once): what still runs on the faulty server's side (a
    // recorder retrying the write) meets them; the retries go to the healthy view.
    let (settled, seen) = settle(dial, healthy, &key, 100).await;
    // Whatever runs in the background (a recorder, a late run) has time to land.
    tokio::time::sleep(LEASE * 3).await;
    let last = call(dial, healthy, &key, 900).await;

    let mut bad = Vec::new();
    let ran = tool.ran();
    let successes: Vec<&(String, usize, bool)> = ran.iter().filter(|r| !r.2).collect();
    let expected_runs = 1 + usize::from(case.fail_first);
    let story = format!(
        "R1={r1:?} R2={r2:?} R3={r3:?} settle={seen:?} last={last:?} runs={ran:?} \
         store ops={:?}",
        chaos.log()
    );
    // Each armed fault met the operation it names (else the case tested nothing); the read
    // before the claim, a third claim and a second history append are made only by some
    // dialects and stores.
    let fired = chaos.fired();
    for f in &case.faults {
        let optional = matches!((f.kind, f.nth), ("read", _) | ("claim", 3) | ("history", 2));
        let mark = format!("{}#{} <- ", f.kind, f.nth);
        if !optional && !fired.iter().any(|l| l.starts_with(&mark)) {
            bad.push(format!(
                "{dial:?} {name}: (test) the fault never fired: {story}"
            ));
        }
    }
    if tool.done() != expected_runs || tool.started() != expected_runs {
        bad.push(format!(
            "{dial:?} {name}: the handler ran {} times (began {}) for one key, DESIGN allows \
             {expected_runs}: {story}",
            tool.done(),
            tool.started()
        ));
        // What follows from a second run (replays of the second answer) is not reported again.
        return bad;
    }
    let Some(success) = successes.first() else {
        bad.push(format!("{dial:?} {name}: no successful run: {story}"));
        return bad;
    };
    let success_text = format!("run {}", success.1);
    for (i, got) in [(1usize, &r1), (2, &r2), (3, &r3)] {
        let label = format!("c{i}");
        let mine = ran.iter().find(|r| r.0 == label);
        let ok = match (mine, got) {
            (_, Got::Broken(why)) => Err(format!("unreadable in its dialect: {why}")),
            // Its run failed: it is told the tool's failure.
            (Some((_, _, true)), Got::HandlerFailed) => Ok(()),
            // Its run answered: it is told that answer, live.
            (
                Some((_, n, false)),
                Got::Ran {
                    text,
                    replayed: false,
                },
            ) if *text == format!("run {n}") => Ok(()),
            (Some(_), other) => Err(format!("its handler ran but it was told {other:?}")),
            (
                None,
                Got::Ran {
                    text,
                    replayed: true,
                },
            ) if *text == success_text => Ok(()),
            (None, Got::Refused(Kind::Unavailable | Kind::InFlight | Kind::Unknown)) => Ok(()),
            (None, other) => Err(format!("nothing ran for it, yet it was told {other:?}")),
        };
        if let Err(why) = ok {
            bad.push(format!("{dial:?} {name}: R{i} {why}: {story}"));
        }
        if case.refused == Some(i) && *got != Got::Refused(Kind::Unavailable) {
            bad.push(format!(
                "{dial:?} {name}: R{i}'s claim failed, so it must be refused as store \
                 unavailable (fail closed), got {got:?}: {story}"
            ));
        }
    }
    for got in &seen {
        if let Got::Broken(why) = got {
            bad.push(format!(
                "{dial:?} {name}: a retry on the healthy view got {why}: {story}"
            ));
        }
    }
    match &last {
        Got::Ran {
            text,
            replayed: true,
        } if *text == success_text => {}
        other => bad.push(format!(
            "{dial:?} {name}: after settling, a retry must replay {success_text:?}, got \
             {other:?}: {story}"
        )),
    }
    let _ = settled;
    bad
}

/// Every failed operation the pipeline makes, one case each.
fn failure_cases() -> Vec<Case> {
    use Mode::Fail;
    let mut cases = vec![
        case(&[]),
        Case {
            refused: Some(1),
            ..case(&[fault("claim", 1, Fail)])
        },
        Case {
            refused: Some(2),
            ..case(&[fault("claim", 2, Fail)])
        },
        case(&[fault("claim", 3, Fail)]),
        case(&[fault("read", 1, Fail)]),
        case(&[fault("renew", 1, Fail)]),
        case(&[fault("renew", 2, Fail)]),
        case(&[fault("renew", 1, Fail), fault("renew", 2, Fail)]),
        case(&[fault("complete", 1, Fail)]),
        case(&[fault("complete", 1, Fail), fault("uncertain", 1, Fail)]),
        case(&[fault("complete", 1, Fail), fault("complete", 2, Fail)]),
        case(&[fault("history", 1, Fail)]),
        case(&[fault("history", 2, Fail)]),
    ];
    for faults in [
        vec![fault("release", 1, Fail)],
        vec![fault("claim", 3, Fail)],
        vec![fault("history", 1, Fail)],
    ] {
        cases.push(Case {
            fail_first: true,
            ..case(&faults)
        });
    }
    cases
}

/// Every operation the pipeline makes, stalled for longer than the lease, one case each (but
/// the renewal's and the first claim's answer: see the two lists after this one).
fn stall_cases() -> Vec<Case> {
    let mut cases = vec![case(&[fault("claim", 1, Mode::StallBefore)])];
    for mode in [Mode::StallBefore, Mode::StallAfter] {
        for kind in ["complete", "history"] {
            cases.push(case(&[fault(kind, 1, mode)]));
        }
        cases.push(case(&[fault("claim", 2, mode)]));
        cases.push(case(&[
            fault("complete", 1, Mode::Fail),
            fault("uncertain", 1, mode),
        ]));
        cases.push(Case {
            fail_first: true,
            ..case(&[fault("release", 1, mode)])
        });
    }
    cases
}

/// One renewal stalls for longer than the lease while the handler works (the store answers
/// everything else at once): DESIGN §4 says the holder keeps its lease for as long as its
/// process lives, so the retry that comes meanwhile must be told "in flight", never run.
fn stalled_renewal_cases() -> Vec<Case> {
    vec![
        case(&[fault("renew", 1, Mode::StallBefore)]),
        case(&[fault("renew", 1, Mode::StallAfter)]),
    ]
}

/// The first claim commits at once, but its answer reaches the layer only after the lease it
/// granted has run out; a retry meanwhile takes the expired lease over and runs. DESIGN §1:
/// one key, at most one execution; the late holder must not run under a lease already lost.
fn late_claim_answer_cases() -> Vec<Case> {
    vec![case(&[fault("claim", 1, Mode::StallAfter)])]
}

async fn matrix<St: IdempotencyStore>(
    dial: Dial,
    cases: Vec<Case>,
    store: impl Fn() -> Arc<St>,
    now_reads: bool,
) {
    let panics_before = foreign_panics().lock().expect("lock").len();
    let runs: Vec<_> = cases
        .into_iter()
        .map(|case| tokio::spawn(run_case(dial, store(), now_reads, case)))
        .collect();
    let mut bad = Vec::new();
    for run in runs {
        match run.await {
            Ok(found) => bad.extend(found),
            Err(e) => bad.push(format!("{dial:?}: a case panicked: {e}")),
        }
    }
    let panics = foreign_panics().lock().expect("lock").clone();
    if panics.len() > panics_before {
        bad.push(format!("{dial:?}: panics outside the test: {panics:?}"));
    }
    assert!(
        bad.is_empty(),
        "{} violation(s):\n{}",
        bad.len(),
        bad.join("\n\n")
    );
}

fn memory() -> Arc<tower_idempotency::MemoryStore> {
    Arc::new(tower_idempotency::MemoryStore::new())
}

macro_rules! failure_matrix {
    ($($name:ident => $dial:expr, $cases:expr;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            foreign_panics();
            matrix($dial, $cases, memory, true).await;
        }
    )*};
}

failure_matrix! {
    grpc_each_failed_store_operation => Dial::Grpc, failure_cases();
    grpc_web_each_failed_store_operation => Dial::GrpcWeb, failure_cases();
    jsonrpc_json_each_failed_store_operation => Dial::JsonRpc, failure_cases();
    jsonrpc_sse_each_failed_store_operation => Dial::JsonRpcSse, failure_cases();
    grpc_each_stalled_store_operation => Dial::Grpc, stall_cases();
    grpc_web_each_stalled_store_operation => Dial::GrpcWeb, stall_cases();
    jsonrpc_json_each_stalled_store_operation => Dial::JsonRpc, stall_cases();
    jsonrpc_sse_each_stalled_store_operation => Dial::JsonRpcSse, stall_cases();
    grpc_a_stalled_renewal_never_lets_a_retry_run_again => Dial::Grpc, stalled_renewal_cases();
    grpc_web_a_stalled_renewal_never_lets_a_retry_run_again => Dial::GrpcWeb, stalled_renewal_cases();
    jsonrpc_json_a_stalled_renewal_never_lets_a_retry_run_again => Dial::JsonRpc, stalled_renewal_cases();
    jsonrpc_sse_a_stalled_renewal_never_lets_a_retry_run_again => Dial::JsonRpcSse, stalled_renewal_cases();
    grpc_a_claim_answered_after_its_lease_never_runs_twice => Dial::Grpc, late_claim_answer_cases();
    grpc_web_a_claim_answered_after_its_lease_never_runs_twice => Dial::GrpcWeb, late_claim_answer_cases();
    jsonrpc_json_a_claim_answered_after_its_lease_never_runs_twice => Dial::JsonRpc, late_claim_answer_cases();
    jsonrpc_sse_a_claim_answered_after_its_lease_never_runs_twice => Dial::JsonRpcSse, late_claim_answer_cases();
}

/// The failure matrix on a durable store (SQLite on a real file): no in-process fast paths, so
/// every retry claims.
async fn sqlite_matrix(dial: Dial) {
    foreign_panics();
    let (store, path) = common::sqlite(&format!("dfr-{dial:?}")).await;
    let store = Arc::new(store);
    matrix(dial, failure_cases(), || store.clone(), false).await;
    let _ = std::fs::remove_file(path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_each_failed_store_operation_sqlite() {
    sqlite_matrix(Dial::Grpc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jsonrpc_sse_each_failed_store_operation_sqlite() {
    sqlite_matrix(Dial::JsonRpcSse).await;
}

// ---- hang-ups --------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum Point {
    /// The claim is slow to arrive (nothing claimed yet when the client leaves).
    ClaimSlowToArrive,
    /// The claim committed, its answer is slow (the key is won when the client leaves).
    ClaimSlowToAnswer,
    /// The handler works (no store fault).
    Handler,
    /// The handler works and its record then fails once.
    HandlerThenRecordFails,
    /// The handler answered; its record is slow.
    RecordSlow,
    /// The handler failed (retryable); giving the key back is slow.
    ReleaseSlow,
    /// The handler works; on a cancelling route, giving the key back fails.
    HandlerThenReleaseFails,
}

struct HangUp {
    point: Point,
    faults: Vec<Fault>,
    work: Duration,
    patience: Duration,
    fail_first: bool,
}

fn hang_ups() -> Vec<HangUp> {
    use Mode::*;
    let ms = Duration::from_millis;
    let h = |point, faults: &[Fault], work, patience, fail_first| HangUp {
        point,
        faults: faults.to_vec(),
        work: ms(work),
        patience: ms(patience),
        fail_first,
    };
    vec![
        h(
            Point::ClaimSlowToArrive,
            &[fault("claim", 1, StallBefore)],
            100,
            200,
            false,
        ),
        h(
            Point::ClaimSlowToAnswer,
            &[fault("claim", 1, StallAfter)],
            100,
            200,
            false,
        ),
        h(Point::Handler, &[], 900, 250, false),
        h(
            Point::HandlerThenRecordFails,
            &[fault("complete", 1, Fail)],
            900,
            250,
            false,
        ),
        h(
            Point::RecordSlow,
            &[fault("complete", 1, StallBefore)],
            100,
            450,
            false,
        ),
        h(
            Point::ReleaseSlow,
            &[fault("release", 1, StallBefore)],
            100,
            450,
            true,
        ),
        h(
            Point::HandlerThenReleaseFails,
            &[fault("release", 1, Fail)],
            900,
            250,
            false,
        ),
    ]
}

/// One hang-up: the client leaves at `patience`, then a retry on the healthy view settles.
async fn run_hang_up(dial: Dial, cancel: bool, hang: HangUp) -> Vec<String> {
    let name = format!(
        "{:?} on a {} route",
        hang.point,
        if cancel {
            "cancel-on-disconnect"
        } else {
            "run-to-completion"
        }
    );
    let lease = Duration::from_millis(1500);
    let chaos = Arc::new(Chaos::new(memory(), true, hang.faults.clone()));
    *chaos.state.stall.lock().expect("lock") = Some(Duration::from_millis(800));
    let tool = Tool::new(hang.work, hang.fail_first, dial == Dial::JsonRpcSse);
    let (faulty, healthy) = servers(dial, chaos.clone(), &tool, Cfg { lease, cancel }).await;
    let key = unique("dfr-hangup");
    let left = hang_up(dial, faulty, &key, 1, hang.patience).await;
    // The slow operation, the work and any background record end meanwhile.
    tokio::time::sleep(Duration::from_millis(1400)).await;
    let (settled, seen) = settle(dial, healthy, &key, 100).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let last = call(dial, healthy, &key, 900).await;

    let ran = tool.ran();
    let story = format!(
        "left={left} settle={seen:?} last={last:?} began={} runs={ran:?} store ops={:?}",
        tool.started(),
        chaos.log()
    );
    let mut bad = Vec::new();
    if !left {
        bad.push(format!(
            "{dial:?} {name}: the client did not hang up (test timing): {story}"
        ));
        return bad;
    }
    // What DESIGN says: (runs begun, runs finished, whether the first retry replays).
    let (began, finished, replays) = match (hang.point, cancel) {
        // Nothing ran under the client that left: its claim is given back; the retry runs.
        (Point::ClaimSlowToArrive | Point::ClaimSlowToAnswer, _) => (1, 1, false),
        // Run to completion: recorded, replayed.
        (Point::Handler | Point::HandlerThenRecordFails, false) => (1, 1, true),
        (Point::HandlerThenReleaseFails, false) => (1, 1, true),
        // Cancelled with the client: given back, the retry runs.
        (Point::Handler | Point::HandlerThenRecordFails, true) => (2, 1, false),
        // Given back only once its lease ran out (the release failed): the retry then runs.
        (Point::HandlerThenReleaseFails, true) => (2, 1, false),
        // The handler answered before the client left: recorded all the same.
        (Point::RecordSlow, _) => (1, 1, true),
        // The handler failed: given back; the retry runs.
        (Point::ReleaseSlow, _) => (2, 2, false),
    };
    if tool.started() != began || tool.done() != finished {
        bad.push(format!(
            "{dial:?} {name}: runs began {} finished {}, DESIGN says {began} and {finished}: \
             {story}",
            tool.started(),
            tool.done()
        ));
    }
    let success = ran.iter().find(|r| !r.2).map(|r| format!("run {}", r.1));
    match (&settled, success.as_deref()) {
        (Got::Ran { text, replayed }, Some(success)) if text == success && *replayed == replays => {
        }
        (got, success) => bad.push(format!(
            "{dial:?} {name}: the settling retry must {} {success:?}, got {got:?}: {story}",
            if replays { "replay" } else { "run and answer" }
        )),
    }
    for got in &seen {
        if let Got::Broken(why) = got {
            bad.push(format!("{dial:?} {name}: a retry got {why}: {story}"));
        }
    }
    match (&last, success.as_deref()) {
        (
            Got::Ran {
                text,
                replayed: true,
            },
            Some(success),
        ) if text == success => {}
        (other, _) => bad.push(format!(
            "{dial:?} {name}: a later retry must replay {success:?}, got {other:?}: {story}"
        )),
    }
    bad
}

async fn hang_up_matrix(dial: Dial) {
    let panics_before = foreign_panics().lock().expect("lock").len();
    let mut runs = Vec::new();
    for cancel in [false, true] {
        for hang in hang_ups() {
            runs.push(tokio::spawn(run_hang_up(dial, cancel, hang)));
        }
    }
    let mut bad = Vec::new();
    for run in runs {
        match run.await {
            Ok(found) => bad.extend(found),
            Err(e) => bad.push(format!("{dial:?}: a case panicked: {e}")),
        }
    }
    let panics = foreign_panics().lock().expect("lock").clone();
    if panics.len() > panics_before {
        bad.push(format!("{dial:?}: panics outside the test: {panics:?}"));
    }
    assert!(
        bad.is_empty(),
        "{} violation(s):\n{}",
        bad.len(),
        bad.join("\n\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_hang_ups_while_the_store_is_slow() {
    hang_up_matrix(Dial::Grpc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_web_hang_ups_while_the_store_is_slow() {
    hang_up_matrix(Dial::GrpcWeb).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jsonrpc_json_hang_ups_while_the_store_is_slow() {
    hang_up_matrix(Dial::JsonRpc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jsonrpc_sse_hang_ups_while_the_store_is_slow() {
    hang_up_matrix(Dial::JsonRpcSse).await;
}
