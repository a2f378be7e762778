//! gRPC against a model of the contract, on every store: seeded random sequences of unary
//! calls from a real tonic client over real TCP (several workers at once, each with keys of its
//! own), every answer compared with what an independent reading of DESIGN §1 (steps 5–9, the
//! gRPC column of step 6), §3 (the default policy's definitive gRPC codes, `Everything`) and
//! the TTL predicts, and every execution counted at the sink.
//!
//! The handler is written by hand at the HTTP level, so it can answer every shape a server
//! may send: a message then trailers, a trailers-only answer (status in the HEADERS frame), an
//! empty message, a message followed by an error status; each with a percent-encoded UTF-8
//! `grpc-message`, `grpc-status-details-bin`, binary `-bin` metadata, a repeated entry, and
//! per-call metadata that a replay must never carry. Every execution's answer is unique (its
//! serial number is in the message and in the metadata), so a replay of another execution's
//! (or another key's) answer is seen. The durable stores keep all of it through their codec;
//! the hostile scenarios compare raw HTTP/2 (and gRPC-Web) answers byte for byte.
#![allow(missing_docs)]

use crate::common;

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use common::{Rng, grpc_frame_flagged as frame, gunzip, gzip};
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use tokio::net::TcpListener;
use tonic::codec::CompressionEncoding;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Endpoint, Server};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower_idempotency::{CachePolicy, IdempotencyLayer, IdempotencyStore};

// ---------------------------------------------------------------------------------------------
// Messages

#[derive(Clone, PartialEq, Eq, Hash, prost::Message)]
struct Order {
    #[prost(string, tag = "1")]
    item: String,
    #[prost(uint32, tag = "2")]
    qty: u32,
    /// The gRPC code of the answer once the first `fail_first` executions of the key are past.
    #[prost(uint32, tag = "3")]
    outcome: u32,
    /// How many of the key's first executions answer `transient` instead.
    #[prost(uint32, tag = "4")]
    fail_first: u32,
    #[prost(uint32, tag = "5")]
    transient: u32,
    /// How the answer is framed (see [`Shape`]).
    #[prost(uint32, tag = "6")]
    shape: u32,
    #[prost(uint32, tag = "7")]
    delay_ms: u32,
    #[prost(bytes = "vec", tag = "8")]
    blob: Vec<u8>,
    /// Compress the answer's message with gzip, whatever the call accepts (a handler that
    /// ignores `grpc-accept-encoding`).
    #[prost(bool, tag = "9")]
    gzip_reply: bool,
    /// Per-call binary metadata (trace context, tags, server stats) in the head as well.
    #[prost(bool, tag = "10")]
    trace_in_head: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Receipt {
    #[prost(uint64, tag = "1")]
    exec: u64,
    #[prost(string, tag = "2")]
    item: String,
    #[prost(uint32, tag = "3")]
    qty: u32,
    #[prost(bytes = "vec", tag = "4")]
    blob: Vec<u8>,
}

/// Message then trailers (a non-OK answer: trailers alone, after the head).
const NORMAL: u32 = 0;
/// A non-OK answer as trailers-only: its status and metadata in the HEADERS frame, no body.
const TRAILERS_ONLY: u32 = 1;
/// A zero-length message, then trailers.
const EMPTY_MESSAGE: u32 = 2;
/// A message, then trailers, whatever the status.
const MESSAGE_THEN_STATUS: u32 = 3;

const ORDER: &str = "/shop.Shop/Order";
/// `ttl(SHORT_TTL)`.
const SHORT: &str = "/shop.Shop/Short";
/// `CachePolicy::Everything`.
const STRIPE: &str = "/shop.Shop/Stripe";
const SHORT_TTL: Duration = Duration::from_millis(1200);

fn definitive(path: &str, code: u32) -> bool {
    path == STRIPE || matches!(code, 0 | 3 | 5 | 6 | 7 | 9 | 11 | 12 | 16)
}

// ---------------------------------------------------------------------------------------------
// The test's own encodings (independent of the crate's)

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

fn b64(bytes: &[u8], pad: bool) -> String {
    let mut out = String::new();
    for c in bytes.chunks(3) {
        let b = [c[0], *c.get(1).unwrap_or(&0), *c.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= c.len() {
                out.push(B64[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else if pad {
                out.push('=');
            }
        }
    }
    out
}

fn unb64(text: &[u8]) -> Vec<u8> {
    let vals: Vec<u32> = text
        .iter()
        .filter(|&&c| c != b'=')
        .map(|c| B64.iter().position(|a| a == c).expect("base64") as u32)
        .collect();
    let mut out = Vec::new();
    for g in vals.chunks(4) {
        let n = g.iter().fold(0u32, |n, v| (n << 6) | v) << (6 * (4 - g.len()));
        out.extend_from_slice(&n.to_be_bytes()[1..g.len()]);
    }
    out
}

/// gRPC's percent-encoding of `grpc-message`: every byte outside printable ASCII, and `%`.
fn pct(text: &str) -> String {
    let mut out = String::new();
    for &b in text.as_bytes() {
        if (0x20..0x7f).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// What execution `n` says about the call, per field.
fn status_text(n: u64, item: &str) -> String {
    format!("échec n°{n} — 100% {item}\t✓")
}
fn status_details(n: u64) -> Vec<u8> {
    let mut d = vec![0x00, 0xff, 0x80, 0x0a];
    d.extend(format!("details-{n}").bytes());
    d
}
fn tail_bin(n: u64) -> Vec<u8> {
    let mut d = vec![n as u8, 0x00, 0xff, 0xfe];
    d.extend(b"tail");
    d
}
fn head_bin(n: u64) -> Vec<u8> {
    vec![0xfa, n as u8, 0x01]
}

// ---------------------------------------------------------------------------------------------
// The handler and its sink

#[derive(Default)]
struct SinkState {
    serial: u64,
    per_key: HashMap<String, u32>,
    /// Execution serial -> (key, the key's attempt number at the sink, the order it ran).
    execs: HashMap<u64, (String, u32, Order)>,
}

/// Counts executions where they happen: per key (as the handler reads its metadata).
#[derive(Clone, Default)]
struct Sink(Arc<Mutex<SinkState>>);

impl Sink {
    fn runs(&self, key: &str) -> u32 {
        self.0
            .lock()
            .expect("sink")
            .per_key
            .get(key)
            .copied()
            .unwrap_or(0)
    }
    fn exec(&self, n: u64) -> Option<(String, u32, Order)> {
        self.0.lock().expect("sink").execs.get(&n).cloned()
    }
    fn hit(&self, key: &str, order: &Order) -> (u64, u32) {
        let mut s = self.0.lock().expect("sink");
        s.serial += 1;
        let n = s.serial;
        let count = s.per_key.entry(key.to_owned()).or_insert(0);
        *count += 1;
        let attempt = *count;
        s.execs.insert(n, (key.to_owned(), attempt, order.clone()));
        (n, attempt)
    }
}

#[derive(Clone, Default)]
struct Shop {
    sink: Sink,
}

impl tonic::server::NamedService for Shop {
    const NAME: &'static str = "shop.Shop";
}

/// The code an order's `attempt`-th execution answers.
fn code_of(order: &Order, attempt: u32) -> u32 {
    if attempt <= order.fail_first {
        order.transient
    } else {
        order.outcome
    }
}

/// The answer's status and metadata, as (name, value) in the order sent: the outcome, then
/// metadata of the operation (kept), then per-call metadata (never replayed).
fn status_block(n: u64, code: u32, order: &Order, head: bool) -> Vec<(&'static str, String)> {
    let mut v = vec![("grpc-status", code.to_string())];
    if code != 0 {
        v.push(("grpc-message", pct(&status_text(n, &order.item))));
        v.push(("grpc-status-details-bin", b64(&status_details(n), false)));
    }
    v.push(("x-tail", format!("exec-{n}")));
    v.push(("x-tail-bin", b64(&tail_bin(n), false)));
    v.push(("x-dup", format!("a-{n}")));
    v.push(("x-dup", format!("b-{n}")));
    v.push(("x-request-id", format!("req-{n}")));
    v.push(("set-cookie", format!("session={n}")));
    // In the trailers only: in a trailers-only head it is `trace_in_head`'s (one finding at
    // a time; see `per_call_metadata_in_the_head_is_never_replayed`).
    if !head {
        v.push(("grpc-trace-bin", b64(&[1, 2, n as u8], false)));
    }
    v
}

/// Per-call binary metadata a server may send in its head: never kept for a retry.
const PER_CALL_BIN: [&str; 3] = ["grpc-trace-bin", "grpc-tags-bin", "grpc-server-stats-bin"];

/// Names a replay must never carry.
const PER_CALL: [&str; 3] = ["x-request-id", "set-cookie", "grpc-trace-bin"];

fn put(map: &mut HeaderMap, block: &[(&'static str, String)]) {
    for (name, value) in block {
        map.append(*name, HeaderValue::from_str(value).expect("value"));
    }
}

fn answer(n: u64, code: u32, order: &Order) -> http::Response<tonic::body::Body> {
    let mut head = HeaderMap::new();
    head.insert("content-type", HeaderValue::from_static("application/grpc"));
    head.insert(
        "x-head",
        HeaderValue::from_str(&format!("exec-{n}")).expect("v"),
    );
    head.insert(
        "x-head-bin",
        HeaderValue::from_str(&b64(&head_bin(n), false)).expect("v"),
    );
    if order.gzip_reply {
        head.insert("grpc-encoding", HeaderValue::from_static("gzip"));
    }
    let block = status_block(n, code, order, order.shape == TRAILERS_ONLY && code != 0);
    if order.trace_in_head {
        for name in PER_CALL_BIN {
            head.append(
                name,
                HeaderValue::from_str(&b64(&[9, n as u8], false)).expect("v"),
            );
        }
    }
    let receipt = prost::Message::encode_to_vec(&Receipt {
        exec: n,
        item: order.item.clone(),
        qty: order.qty,
        blob: order.blob.clone(),
    });
    let message = match order.gzip_reply {
        true => frame(1, &gzip(&receipt)),
        false => frame(0, &receipt),
    };
    let (body, trailers): (Option<Vec<u8>>, Option<HeaderMap>) = match order.shape {
        TRAILERS_ONLY if code != 0 => {
            put(&mut head, &block);
            (None, None)
        }
        EMPTY_MESSAGE => (Some(frame(0, &[])), Some(HeaderMap::new())),
        MESSAGE_THEN_STATUS => (Some(message), Some(HeaderMap::new())),
        _ if code == 0 => (Some(message), Some(HeaderMap::new())),
        _ => (None, Some(HeaderMap::new())),
    };
    let trailers = trailers.map(|mut t| {
        put(&mut t, &block);
        t
    });
    let mut frames = Vec::new();
    if let Some(body) = body {
        // In two DATA frames.
        let (a, b) = body.split_at(body.len() / 2);
        frames.push(Ok::<_, Infallible>(Frame::data(Bytes::copy_from_slice(a))));
        frames.push(Ok(Frame::data(Bytes::copy_from_slice(b))));
    }
    if let Some(t) = trailers {
        frames.push(Ok(Frame::trailers(t)));
    }
    let body = match frames.is_empty() {
        true => tonic::body::Body::empty(),
        false => tonic::body::Body::new(StreamBody::new(futures_util::stream::iter(frames))),
    };
    let mut res = http::Response::new(body);
    *res.headers_mut() = head;
    res
}

impl<B> tower::Service<http::Request<B>> for Shop
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let sink = self.sink.clone();
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let key = parts
                .headers
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned();
            let Ok(bytes) = body.collect().await.map(|c| c.to_bytes()) else {
                return Ok(Status::internal("unreadable request").into_http());
            };
            if bytes.len() < 5 {
                return Ok(Status::internal("no message").into_http());
            }
            let payload = match bytes[0] {
                1 => {
                    assert_eq!(
                        parts.headers.get("grpc-encoding").map(|v| v.as_bytes()),
                        Some(&b"gzip"[..])
                    );
                    gunzip(&bytes[5..])
                }
                _ => bytes[5..].to_vec(),
            };
            let order: Order = match prost::Message::decode(&payload[..]) {
                Ok(order) => order,
                Err(_) => return Ok(Status::internal("undecodable").into_http()),
            };
            tokio::time::sleep(Duration::from_millis(u64::from(order.delay_ms))).await;
            let (n, attempt) = sink.hit(&key, &order);
            Ok(answer(n, code_of(&order, attempt), &order))
        })
    }
}

fn layer<St: IdempotencyStore>(
    store: St,
) -> IdempotencyLayer<St, tower_idempotency::scope::SingleTenant> {
    IdempotencyLayer::new_for_grpc(store)
        .single_tenant()
        .grpc_method(ORDER, |m| m)
        .grpc_method(SHORT, |m| m.ttl(SHORT_TTL))
        .grpc_method(STRIPE, |m| m.cache_policy(CachePolicy::Everything))
}

/// The layer outside tonic-web's (it sees gRPC-Web calls as browsers send them), on a server
/// that takes HTTP/2 (gRPC) and HTTP/1.1 (gRPC-Web).
async fn serve<St: IdempotencyStore>(store: St, shop: Shop) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let layers = tower::ServiceBuilder::new()
        .layer(layer(store))
        .layer(tonic_web::GrpcWebLayer::new())
        .into_inner();
    let server = Server::builder()
        .accept_http1(true)
        .layer(layers)
        .add_service(shop)
        .serve_with_incoming(TcpIncoming::from(listener));
    tokio::spawn(async move { server.await.expect("grpc server") });
    addr
}

fn nonce() -> u128 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// A hang is a failure, not a stalled suite.
async fn bounded<F: Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .unwrap_or_else(|_| panic!("{what} hung for 20 s"))
}

// ---------------------------------------------------------------------------------------------
// The client's view of an answer

/// A call as a client sends it.
#[derive(Clone, Debug)]
struct Call {
    path: &'static str,
    key: String,
    order: Order,
    gzip_sent: bool,
    accept_gzip: bool,
}

/// What the client saw, reduced to what the model predicts: status, message and details, the
/// decoded message, and the metadata the test cares about as sent (binary values as their
/// base64 text: a replay must not re-encode them).
#[derive(Clone, Debug, PartialEq)]
struct Seen {
    code: i32,
    message: String,
    details: Vec<u8>,
    body: Option<Receipt>,
    meta: BTreeMap<String, Vec<Vec<u8>>>,
}

const WATCHED: [&str; 11] = [
    "x-head",
    "x-head-bin",
    "x-tail",
    "x-tail-bin",
    "x-dup",
    "x-request-id",
    "set-cookie",
    "grpc-trace-bin",
    "grpc-encoding",
    "idempotency-replayed",
    "grpc-status",
];

fn watched(map: &tonic::metadata::MetadataMap) -> BTreeMap<String, Vec<Vec<u8>>> {
    let mut out: BTreeMap<String, Vec<Vec<u8>>> = BTreeMap::new();
    let h = map.clone().into_headers();
    for name in WATCHED {
        for v in h.get_all(name) {
            out.entry(name.to_owned())
                .or_default()
                .push(v.as_bytes().to_vec());
        }
    }
    out
}

impl Seen {
    fn of(result: Result<tonic::Response<Receipt>, Status>) -> Self {
        match result {
            Ok(res) => {
                let mut meta = watched(res.metadata());
                // A trailer, not what the model predicts of OK answers.
                meta.remove("grpc-status");
                Seen {
                    code: 0,
                    message: String::new(),
                    details: Vec::new(),
                    body: Some(res.into_inner()),
                    meta,
                }
            }
            Err(s) => Seen {
                code: s.code() as i32,
                message: s.message().to_owned(),
                details: s.details().to_vec(),
                body: None,
                meta: watched(s.metadata()),
            },
        }
    }

    fn one(&self, name: &str) -> Option<&[u8]> {
        self.meta
            .get(name)
            .and_then(|v| v.first())
            .map(Vec::as_slice)
    }

    /// The execution this answer says it came from (`x-tail: exec-N`).
    fn exec(&self) -> Option<u64> {
        std::str::from_utf8(self.one("x-tail")?)
            .ok()?
            .strip_prefix("exec-")?
            .parse()
            .ok()
    }

    fn refusal(&self, code: Code, reason: &str) -> bool {
        let has = |needle: &[u8]| self.details.windows(needle.len()).any(|w| w == needle);
        self.code == code as i32 && has(reason.as_bytes()) && has(b"tower-idempotency")
    }

    fn replayed(&self) -> bool {
        self.one("idempotency-replayed") == Some(b"true")
    }
}

/// Whether tonic hands the client the answer's head metadata beside its status: for an OK
/// answer, and an error whose status came before any message (tonic merges the head then).
fn head_visible(code: u32, order: &Order) -> bool {
    code == 0 || !matches!(order.shape, EMPTY_MESSAGE | MESSAGE_THEN_STATUS)
}

/// The model: what the client must see of execution `n` answering `code` to `order`, live
/// (everything the handler sent) or replayed (without per-call metadata, marked).
fn expected(n: u64, code: u32, order: &Order, replay: bool) -> Seen {
    let mut meta: BTreeMap<String, Vec<Vec<u8>>> = BTreeMap::new();
    let mut add = |name: &str, value: Vec<u8>| meta.entry(name.to_owned()).or_default().push(value);
    let visible = head_visible(code, order);
    if visible {
        add("x-head", format!("exec-{n}").into_bytes());
        add("x-head-bin", b64(&head_bin(n), false).into_bytes());
        if order.gzip_reply {
            add("grpc-encoding", b"gzip".to_vec());
        }
        if replay {
            add("idempotency-replayed", b"true".to_vec());
        }
    }
    for (name, value) in status_block(n, code, order, order.shape == TRAILERS_ONLY && code != 0) {
        if matches!(
            name,
            "grpc-status" | "grpc-message" | "grpc-status-details-bin"
        ) {
            continue;
        }
        if replay && PER_CALL.contains(&name) {
            continue;
        }
        add(name, value.into_bytes());
    }
    let body = (code == 0).then(|| match order.shape {
        EMPTY_MESSAGE => Receipt::default(),
        _ => Receipt {
            exec: n,
            item: order.item.clone(),
            qty: order.qty,
            blob: order.blob.clone(),
        },
    });
    Seen {
        code: code as i32,
        message: match code {
            0 => String::new(),
            _ => status_text(n, &order.item),
        },
        details: match code {
            0 => Vec::new(),
            _ => status_details(n),
        },
        body,
        meta,
    }
}

async fn channel(addr: SocketAddr) -> tonic::transport::Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect")
}

/// One call on a connection of its own, as an independent retry would have.
async fn send(addr: SocketAddr, call: &Call) -> Seen {
    let result = bounded(&format!("{call:?}"), async {
        let mut grpc = tonic::client::Grpc::new(channel(addr).await);
        if call.gzip_sent {
            grpc = grpc.send_compressed(CompressionEncoding::Gzip);
        }
        if call.accept_gzip {
            grpc = grpc.accept_compressed(CompressionEncoding::Gzip);
        }
        grpc.ready().await.expect("ready");
        let mut request = tonic::Request::new(call.order.clone());
        request
            .metadata_mut()
            .insert("idempotency-key", call.key.parse().expect("ascii"));
        grpc.unary(
            request,
            PathAndQuery::from_static(call.path),
            ProstCodec::<Order, Receipt>::default(),
        )
        .await
    })
    .await;
    Seen::of(result)
}

// ---------------------------------------------------------------------------------------------
// The model

/// The request's identity in the model's fingerprint: method, message bytes as framed
/// (compressed or not).
type Fp = (&'static str, bool, Vec<u8>);

fn fp(call: &Call) -> Fp {
    (
        call.path,
        call.gzip_sent,
        prost::Message::encode_to_vec(&call.order),
    )
}

#[derive(Clone, Debug)]
struct Rec {
    fp: Fp,
    /// What every replay must be.
    replay: Seen,
    gzip_reply: bool,
    ttl: Option<Duration>,
    /// The completing call's send and answer instants (the record was written between them).
    sent: Instant,
    answered: Instant,
    n: u64,
}

#[derive(Default, Debug)]
struct KeyModel {
    runs: u32,
    rec: Option<Rec>,
    /// The request a released key stays bound to (DESIGN §1 step 6: "any state, different
    /// fingerprint" is refused; only the same request takes a released key over).
    bound: Option<Fp>,
}

/// A key released for `bound`'s request, asked for another: refused, nothing run.
fn refused_as_bound(model: &KeyModel, call: &Call) -> bool {
    model.rec.is_none() && model.bound.as_ref().is_some_and(|b| *b != fp(call))
}

enum Alive<'a> {
    No,
    Yes(&'a Rec),
    Maybe,
}

/// Whether the record can be seen at a claim made between `from` and `to`.
fn alive(rec: &Option<Rec>, from: Instant, to: Instant) -> Alive<'_> {
    let Some(rec) = rec else { return Alive::No };
    let Some(ttl) = rec.ttl else {
        return Alive::Yes(rec);
    };
    let slack = Duration::from_millis(150);
    if from > rec.answered + ttl + slack {
        Alive::No
    } else if to + slack < rec.sent + ttl {
        Alive::Yes(rec)
    } else {
        Alive::Maybe
    }
}

/// What a call must get from a live record `rec`.
fn from_record(rec: &Rec, call: &Call, seen: &Seen, ctx: &str) {
    if fp(call) != rec.fp {
        assert!(
            seen.refusal(Code::FailedPrecondition, "FINGERPRINT_MISMATCH"),
            "{ctx}: another request under a recorded key must be refused FAILED_PRECONDITION, \
             got {seen:#?}"
        );
    } else if rec.gzip_reply && !call.accept_gzip {
        assert!(
            seen.refusal(Code::FailedPrecondition, "ENCODING_NOT_ACCEPTED"),
            "{ctx}: a gzip answer replayed to a call that does not accept gzip: {seen:#?}"
        );
    } else {
        assert_eq!(
            seen, &rec.replay,
            "{ctx}: a replay must be the recorded answer of execution {} exactly",
            rec.n
        );
    }
}

/// Checks that `seen` is the live answer of an execution of `call` that the sink saw as the
/// key's `attempt`-th; returns that execution.
fn check_live(sink: &Sink, call: &Call, seen: &Seen, ctx: &str) -> (u64, u32) {
    let n = seen
        .exec()
        .unwrap_or_else(|| panic!("{ctx}: an answer from no execution: {seen:#?}"));
    let (key, attempt, order) = sink
        .exec(n)
        .unwrap_or_else(|| panic!("{ctx}: execution {n} never ran at the sink: {seen:#?}"));
    assert_eq!(
        key, call.key,
        "{ctx}: the answer of another key's execution {n}"
    );
    assert_eq!(
        order, call.order,
        "{ctx}: the answer of another request's execution {n}"
    );
    assert!(
        !seen.replayed(),
        "{ctx}: a live answer marked as a replay: {seen:#?}"
    );
    let code = code_of(&call.order, attempt);
    assert_eq!(
        seen,
        &expected(n, code, &call.order, false),
        "{ctx}: the live answer of execution {n} (attempt {attempt}) is not what the handler sent"
    );
    (n, attempt)
}

fn record_of(call: &Call, n: u64, code: u32, sent: Instant, answered: Instant) -> Option<Rec> {
    definitive(call.path, code).then(|| Rec {
        fp: fp(call),
        replay: expected(n, code, &call.order, true),
        gzip_reply: call.order.gzip_reply,
        ttl: (call.path == SHORT).then_some(SHORT_TTL),
        sent,
        answered,
        n,
    })
}

/// One call, checked against the model of its key.
async fn single(addr: SocketAddr, sink: &Sink, model: &mut KeyModel, call: &Call, ctx: &str) {
    let sent = Instant::now();
    let seen = send(addr, call).await;
    let answered = Instant::now();
    let runs = sink.runs(&call.key);
    if std::env::var("MODEL_TRACE").is_ok() {
        eprintln!(
            "{ctx} single {call:?} -> code {} exec {:?} runs {runs}",
            seen.code,
            seen.exec()
        );
    }
    let delta = runs - model.runs;
    let ctx = format!("{ctx} {call:?}");
    if refused_as_bound(model, call) {
        assert_eq!(
            delta, 0,
            "{ctx}: another request took over a released key: {seen:#?}"
        );
        assert!(
            seen.refusal(Code::FailedPrecondition, "FINGERPRINT_MISMATCH"),
            "{ctx}: another request under a released key: {seen:#?}"
        );
        return;
    }
    if matches!(alive(&model.rec, sent, answered), Alive::No) && model.rec.is_some() {
        // Expired: the key is absent, bound to nothing.
        model.rec = None;
        model.bound = None;
    }
    let ran = match alive(&model.rec, sent, answered) {
        Alive::No => true,
        Alive::Yes(_) => false,
        Alive::Maybe => delta == 1,
    };
    if !ran {
        let rec = model.rec.as_ref().expect("a record");
        assert_eq!(
            delta, 0,
            "{ctx}: ran again under a live record of execution {}",
            rec.n
        );
        from_record(rec, call, &seen, &ctx);
        return;
    }
    assert_eq!(
        delta, 1,
        "{ctx}: a call with no live record must run exactly once: {seen:#?}"
    );
    let (n, attempt) = check_live(sink, call, &seen, &ctx);
    assert_eq!(attempt, runs, "{ctx}");
    model.runs = runs;
    model.rec = record_of(call, n, code_of(&call.order, attempt), sent, answered);
    model.bound = model.rec.is_none().then(|| fp(call));
}

/// The same call three times at once, on three connections (§7.3).
async fn burst(addr: SocketAddr, sink: &Sink, model: &mut KeyModel, call: &Call, ctx: &str) {
    let sent = Instant::now();
    let all = futures_util::future::join_all((0..3).map(|_| send(addr, call))).await;
    let answered = Instant::now();
    let runs = sink.runs(&call.key);
    if std::env::var("MODEL_TRACE").is_ok() {
        let codes: Vec<_> = all.iter().map(|s| (s.code, s.exec())).collect();
        eprintln!("{ctx} burst {call:?} -> {codes:?} runs {runs}");
    }
    let ctx = format!("{ctx} burst {call:?}");
    if refused_as_bound(model, call) {
        assert_eq!(
            runs, model.runs,
            "{ctx}: another request took over a released key"
        );
        for seen in &all {
            assert!(
                seen.refusal(Code::FailedPrecondition, "FINGERPRINT_MISMATCH"),
                "{ctx}: another request under a released key: {seen:#?}"
            );
        }
        return;
    }
    match alive(&model.rec, sent, answered) {
        Alive::Yes(rec) => {
            assert_eq!(runs, model.runs, "{ctx}: ran under a live record");
            for seen in &all {
                from_record(rec, call, seen, &ctx);
            }
            return;
        }
        Alive::Maybe => unreachable!("bursts are never sent near an expiry"),
        Alive::No => {}
    }
    let before = model.runs;
    assert!(runs > before, "{ctx}: nobody ran: {all:#?}");
    // Attempts before..runs: only the last may be definitive, none may follow it.
    for attempt in before + 1..runs {
        assert!(
            !definitive(call.path, code_of(&call.order, attempt)),
            "{ctx}: attempt {attempt} answered definitively and the key ran again \
             ({runs} runs at the sink): {all:#?}"
        );
    }
    let last = code_of(&call.order, runs);
    let mut live = Vec::new();
    let mut replays = Vec::new();
    for seen in &all {
        if seen.refusal(Code::Aborted, "IN_FLIGHT") {
            continue;
        }
        // Per-call metadata travels in the trailers, seen in every shape: a live answer has
        // it, a replay never.
        if seen.replayed() || seen.one("x-request-id").is_none() {
            replays.push(seen.clone());
            continue;
        }
        live.push(check_live(sink, call, seen, &ctx));
    }
    let mut ns: Vec<u64> = live.iter().map(|(n, _)| *n).collect();
    ns.sort_unstable();
    ns.dedup();
    assert_eq!(
        ns.len() as u32,
        runs - before,
        "{ctx}: every execution's answer reaches its caller, once: {all:#?}"
    );
    model.runs = runs;
    model.rec = None;
    if definitive(call.path, last) {
        let (n, _) = *live.iter().find(|(_, a)| *a == runs).unwrap_or_else(|| {
            panic!("{ctx}: the definitive execution's answer was lost: {all:#?}")
        });
        model.rec = record_of(call, n, last, sent, answered);
    }
    model.bound = model.rec.is_none().then(|| fp(call));
    for seen in replays {
        let rec = model
            .rec
            .as_ref()
            .unwrap_or_else(|| panic!("{ctx}: a replay with nothing recorded: {seen:#?}"));
        from_record(rec, call, &seen, &ctx);
    }
}

/// The orders a worker draws from, and variants one field or one byte away.
fn orders(rng: &mut Rng) -> Vec<Order> {
    let items = ["book", "bóok", "b\u{0}ok", "✓ pen"];
    let codes = [0, 0, 3, 5, 9, 14, 13, 10, 2];
    let transients = [14, 13, 10, 2, 4, 8];
    let mut out = Vec::new();
    for _ in 0..6 {
        let mut blob: Vec<u8> = (0..rng.next(4)).map(|_| rng.next(256) as u8).collect();
        if rng.next(3) == 0 {
            blob.push(0xff);
        }
        out.push(Order {
            item: items[rng.next(items.len() as u64) as usize].to_owned(),
            qty: 1 + rng.next(3) as u32,
            outcome: codes[rng.next(codes.len() as u64) as usize],
            fail_first: if rng.next(3) == 0 {
                1 + rng.next(2) as u32
            } else {
                0
            },
            transient: transients[rng.next(transients.len() as u64) as usize],
            shape: rng.next(4) as u32,
            delay_ms: 0,
            blob,
            gzip_reply: rng.next(6) == 0,
            trace_in_head: false,
        });
    }
    out
}

fn variant(rng: &mut Rng, base: &Order) -> Order {
    let mut o = base.clone();
    match rng.next(5) {
        0 => o.qty += 1,
        1 => match o.blob.last_mut() {
            Some(b) => *b ^= 1,
            None => o.blob.push(0),
        },
        2 => o.shape = (o.shape + 1) % 4,
        3 => o.outcome = if o.outcome == 0 { 14 } else { 0 },
        _ => o.item.push('!'),
    }
    o
}

async fn worker(addr: SocketAddr, sink: Sink, seed: u64, run: String, steps: usize) {
    let mut rng = Rng::new(seed);
    let pool = orders(&mut rng);
    let mut keys: Vec<String> = (0..3).map(|i| format!("{run}-w{seed}-k{i}")).collect();
    let mut models: HashMap<String, KeyModel> = HashMap::new();
    let mut last: HashMap<String, Call> = HashMap::new();
    let mut sleeps = 0;
    for step in 0..steps {
        let ctx = format!("seed {seed} step {step}");
        if sleeps < 1 && step > steps / 2 && rng.next(12) == 0 {
            sleeps += 1;
            tokio::time::sleep(SHORT_TTL + Duration::from_millis(300)).await;
            continue;
        }
        // Mostly the keys in use; now and then a new one (a new operation).
        if rng.next(6) == 0 {
            keys.push(format!("{run}-w{seed}-k{}", keys.len()));
        }
        let recent = &keys[keys.len().saturating_sub(4)..];
        let key = recent[rng.next(recent.len() as u64) as usize].clone();
        let model = models.entry(key.clone()).or_default();
        let mut call = match last.get(&key) {
            // A retry of the key's last request, as sent.
            Some(prev) if rng.next(10) < 8 => prev.clone(),
            // Another request under the key: one field or one byte away.
            Some(prev) if rng.next(2) == 0 => {
                let mut c = prev.clone();
                c.order = variant(&mut rng, &prev.order);
                c
            }
            _ => Call {
                path: [ORDER, ORDER, SHORT, STRIPE][rng.next(4) as usize],
                key: key.clone(),
                order: pool[rng.next(pool.len() as u64) as usize].clone(),
                gzip_sent: rng.next(4) == 0,
                accept_gzip: false,
            },
        };
        if rng.next(20) == 0 {
            call.path = [ORDER, SHORT, STRIPE][rng.next(3) as usize];
        }
        if rng.next(12) == 0 {
            call.gzip_sent = !call.gzip_sent;
        }
        call.accept_gzip = rng.next(2) == 0;
        let now = Instant::now();
        let state = alive(&model.rec, now, now + Duration::from_secs(2));
        let sure_replay = matches!(state, Alive::Yes(_));
        // A handler that compresses whatever the call accepts: a call that may run accepts.
        if call.order.gzip_reply && !sure_replay {
            call.accept_gzip = true;
        }
        let quiet = !matches!(state, Alive::Maybe);
        if quiet && rng.next(5) == 0 {
            call.order.delay_ms = 40;
            burst(addr, &sink, model, &call, &ctx).await;
        } else {
            single(addr, &sink, model, &call, &ctx).await;
        }
        // A refused request is not what the key's retries send: they send what it holds.
        let holds = |f: &Fp| *f == fp(&call);
        if model.rec.as_ref().is_some_and(|r| holds(&r.fp))
            || model.bound.as_ref().is_some_and(holds)
        {
            last.insert(key, call);
        }
    }
}

async fn model<St: IdempotencyStore + Clone>(store: St, name: &str) {
    let sink = Sink::default();
    let addr = serve(store, Shop { sink: sink.clone() }).await;
    let run = format!("m{}", nonce());
    let base = 0x5eed_0000 + name.len() as u64 * 7919;
    let workers = (0..3).map(|w| {
        let (sink, run) = (sink.clone(), run.clone());
        tokio::spawn(worker(
            addr,
            sink,
            base ^ (w + 1u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            run,
            80,
        ))
    });
    for w in futures_util::future::join_all(workers).await {
        if let Err(e) = w {
            std::panic::resume_unwind(e.into_panic());
        }
    }
}

common::on_every_store!(model);

// ---------------------------------------------------------------------------------------------
// Hostile framing, byte for byte over raw HTTP/2

struct Raw {
    parts: http::response::Parts,
    body: Bytes,
    trailers: Option<HeaderMap>,
}

async fn h2(addr: SocketAddr, path: &str, key: &str, body: Vec<u8>, extra: &[(&str, &str)]) -> Raw {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    bounded("a raw HTTP/2 call", async {
        let io = TokioIo::new(tokio::net::TcpStream::connect(addr).await.expect("connect"));
        let (mut sender, connection) =
            hyper::client::conn::http2::Builder::new(TokioExecutor::new())
                .handshake(io)
                .await
                .expect("h2");
        tokio::spawn(connection);
        let mut request = http::Request::post(format!("http://{addr}{path}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("idempotency-key", key);
        for (name, value) in extra {
            request = request.header(*name, *value);
        }
        let request = request
            .body(http_body_util::Full::new(Bytes::from(body)))
            .expect("request");
        let response = sender.send_request(request).await.expect("answer");
        let (parts, body) = response.into_parts();
        let collected = body.collect().await.expect("body");
        let trailers = collected.trailers().cloned();
        Raw {
            parts,
            body: collected.to_bytes(),
            trailers,
        }
    })
    .await
}

/// A map without what changes per response (`date`), the replay mark and per-call entries.
fn without_per_call(map: &HeaderMap) -> HeaderMap {
    let mut m = map.clone();
    for name in PER_CALL
        .iter()
        .chain(&["date", "idempotency-replayed", "content-length"])
    {
        m.remove(*name);
    }
    m
}

fn ordered(map: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    map.iter()
        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect()
}

/// Every shape of answer, recorded by the store and replayed over raw HTTP/2: the same
/// status, head, message bytes and trailers (repeats in order, percent-encoded UTF-8 and
/// binary values as sent), with per-call entries gone, in the same frames (a trailers-only
/// answer stays trailers-only); the handler ran once.
async fn raw_replays_are_exact<St: IdempotencyStore + Clone>(store: St, name: &str) {
    let sink = Sink::default();
    let addr = serve(store, Shop { sink: sink.clone() }).await;
    let run = format!("raw{}", nonce());
    let cases = [
        (NORMAL, 0, "ok"),
        (NORMAL, 3, "invalid argument in trailers"),
        (TRAILERS_ONLY, 5, "not found, trailers-only"),
        (TRAILERS_ONLY, 16, "unauthenticated, trailers-only"),
        (EMPTY_MESSAGE, 0, "empty message"),
        (EMPTY_MESSAGE, 9, "empty message, failed precondition"),
        (MESSAGE_THEN_STATUS, 6, "message then already exists"),
    ];
    for (i, (shape, code, what)) in cases.into_iter().enumerate() {
        let key = format!("{run}-{i}");
        let order = Order {
            item: "é✓%".into(),
            qty: 7,
            outcome: code,
            shape,
            blob: vec![0, 0xff, 0x80],
            ..Order::default()
        };
        let body = frame(0, &prost::Message::encode_to_vec(&order));
        let first = h2(addr, ORDER, &key, body.clone(), &[]).await;
        let again = h2(addr, ORDER, &key, body.clone(), &[]).await;
        let ctx = format!("{name}: {what}");
        assert_eq!(sink.runs(&key), 1, "{ctx}: the handler ran again");
        assert_eq!(first.parts.status, again.parts.status, "{ctx}");
        assert_eq!(
            again
                .parts
                .headers
                .get("idempotency-replayed")
                .map(|v| v.as_bytes()),
            Some(&b"true"[..]),
            "{ctx}: {:?}",
            again.parts.headers
        );
        assert_eq!(
            ordered(&without_per_call(&again.parts.headers)),
            ordered(&without_per_call(&first.parts.headers)),
            "{ctx}: the replay's head"
        );
        for denied in PER_CALL {
            assert!(
                !again.parts.headers.contains_key(denied),
                "{ctx}: {denied} of another call in the replay's head: {:?}",
                again.parts.headers
            );
        }
        assert_eq!(again.body, first.body, "{ctx}: the message bytes");
        assert_eq!(
            again.trailers.is_some(),
            first.trailers.is_some(),
            "{ctx}: trailers-only must stay trailers-only (and the reverse): first {:?}, replay {:?}",
            first.trailers,
            again.trailers
        );
        if let (Some(a), Some(f)) = (&again.trailers, &first.trailers) {
            assert_eq!(
                ordered(&without_per_call(a)),
                ordered(&without_per_call(f)),
                "{ctx}: the replay's trailers"
            );
            for denied in PER_CALL {
                assert!(!a.contains_key(denied), "{ctx}: {denied} replayed: {a:?}");
            }
        }
        // And as tonic reads it.
        let call = Call {
            path: ORDER,
            key: key.clone(),
            order: order.clone(),
            gzip_sent: false,
            accept_gzip: false,
        };
        let seen = send(addr, &call).await;
        assert_eq!(
            seen,
            expected(1 + i as u64, code, &order, true),
            "{ctx}: tonic's view"
        );
        assert_eq!(sink.runs(&key), 1, "{ctx}");
    }
}

common::on_every_store!(raw_replays_are_exact);

/// gzip both ways: a compressed request replays only to the same compressed request (the
/// uncompressed one is another fingerprint, refused); an answer the handler compressed anyway
/// is replayed to retries that accept gzip, refused (never run) to the others; the handler
/// never sees `grpc-accept-encoding` on a guarded call.
async fn gzip_both_ways<St: IdempotencyStore + Clone>(store: St, name: &str) {
    let sink = Sink::default();
    let addr = serve(store, Shop { sink: sink.clone() }).await;
    let run = format!("gz{}", nonce());
    for (i, (outcome, shape)) in [
        (0, NORMAL),
        (3, NORMAL),
        (0, EMPTY_MESSAGE),
        (5, TRAILERS_ONLY),
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("{run}-{i}");
        let order = Order {
            item: "zip ".repeat(40),
            qty: 3,
            outcome,
            shape,
            gzip_reply: true,
            ..Order::default()
        };
        let call = |gzip_sent, accept_gzip| Call {
            path: ORDER,
            key: key.clone(),
            order: order.clone(),
            gzip_sent,
            accept_gzip,
        };
        let ctx = format!("{name}: outcome {outcome} shape {shape}");
        let first = send(addr, &call(true, true)).await;
        let n = first.exec().unwrap_or_else(|| panic!("{ctx}: {first:#?}"));
        assert_eq!(first, expected(n, outcome, &order, false), "{ctx}: live");
        let replay = send(addr, &call(true, true)).await;
        assert_eq!(replay, expected(n, outcome, &order, true), "{ctx}: replay");
        let refused = send(addr, &call(true, false)).await;
        assert!(
            refused.refusal(Code::FailedPrecondition, "ENCODING_NOT_ACCEPTED"),
            "{ctx}: a gzip answer to a call that does not accept it: {refused:#?}"
        );
        let plain = send(addr, &call(false, true)).await;
        assert!(
            plain.refusal(Code::FailedPrecondition, "FINGERPRINT_MISMATCH"),
            "{ctx}: the same message uncompressed is another request (documented): {plain:#?}"
        );
        assert_eq!(sink.runs(&key), 1, "{ctx}: ran again");
    }
}

common::on_every_store!(gzip_both_ways);

// ---------------------------------------------------------------------------------------------
// gRPC-Web, binary and text, through the durable codecs

/// A gRPC-Web answer as the client reads it: content type, message frames, and the status
/// and metadata (head entries and trailer-frame lines) by name, values in order.
#[derive(Debug, PartialEq)]
struct Web {
    content_type: String,
    messages: Vec<Vec<u8>>,
    status: BTreeMap<String, Vec<Vec<u8>>>,
}

async fn web_call(addr: SocketAddr, key: &str, order: &Order, text_in: bool, accept: &str) -> Web {
    let message = frame(0, &prost::Message::encode_to_vec(order));
    let (content_type, body) = match text_in {
        true => (
            "application/grpc-web-text",
            b64(&message, true).into_bytes(),
        ),
        false => ("application/grpc-web+proto", message),
    };
    let res = bounded("a gRPC-Web call", async {
        common::client()
            .post(format!("http://{addr}{ORDER}"))
            .header("content-type", content_type)
            .header("accept", accept)
            .header("x-grpc-web", "1")
            .header("idempotency-key", key)
            .body(body)
            .send()
            .await
            .expect("call")
    })
    .await;
    assert_eq!(res.status(), 200);
    let head = res.headers().clone();
    let content_type = head["content-type"].to_str().expect("ascii").to_owned();
    let raw = res.bytes().await.expect("body");
    let binary = match content_type.starts_with("application/grpc-web-text") {
        true => unb64(&raw),
        false => raw.to_vec(),
    };
    let mut status: BTreeMap<String, Vec<Vec<u8>>> = BTreeMap::new();
    for name in WATCHED
        .iter()
        .chain(&["grpc-message", "grpc-status-details-bin"])
    {
        if *name == "idempotency-replayed" {
            continue;
        }
        for v in head.get_all(*name) {
            status
                .entry((*name).to_owned())
                .or_default()
                .push(v.as_bytes().to_vec());
        }
    }
    let mut messages = Vec::new();
    let mut rest = &binary[..];
    while rest.len() >= 5 {
        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        let payload = &rest[5..5 + len];
        if rest[0] & 0x80 != 0 {
            for line in payload.split(|&b| b == b'\n') {
                let line = line.strip_suffix(b"\r").unwrap_or(line);
                if line.is_empty() {
                    continue;
                }
                let at = line
                    .iter()
                    .position(|&b| b == b':')
                    .expect("a trailer line");
                let name = String::from_utf8_lossy(&line[..at]).to_ascii_lowercase();
                let value = line[at + 1..].trim_ascii().to_vec();
                // Of a name given twice in the trailer frame, the last value: as tonic-web's
                // client reads it (and as the crate documents it records it).
                status.insert(name, vec![value]);
            }
        } else {
            messages.push(payload.to_vec());
        }
        rest = &rest[5 + len..];
    }
    assert!(rest.is_empty(), "a gRPC-Web body cut mid-frame: {binary:?}");
    Web {
        content_type,
        messages,
        status,
    }
}

fn web_without_per_call(mut web: Web) -> Web {
    for name in PER_CALL.iter().chain(&["date"]) {
        web.status.remove(*name);
    }
    web.content_type = web.content_type.replace("-text", "");
    web
}

/// Recorded from gRPC-Web (binary, and text), replayed in binary and in text: the same
/// messages, the same status, message, details and metadata as sent (percent-encoding and
/// binary values untouched), without per-call entries; a non-definitive status runs again.
async fn grpc_web_replays<St: IdempotencyStore + Clone>(store: St, name: &str) {
    let sink = Sink::default();
    let addr = serve(store, Shop { sink: sink.clone() }).await;
    let run = format!("web{}", nonce());
    let binary = "application/grpc-web+proto";
    let text = "application/grpc-web-text";
    let cases = [
        (NORMAL, 0, false),
        (NORMAL, 3, true),
        (TRAILERS_ONLY, 5, false),
        (EMPTY_MESSAGE, 0, true),
        (MESSAGE_THEN_STATUS, 7, false),
    ];
    for (i, (shape, code, text_in)) in cases.into_iter().enumerate() {
        let key = format!("{run}-{i}");
        let order = Order {
            item: "wéb %41".into(),
            qty: 2,
            outcome: code,
            shape,
            blob: vec![0xff, 0, 1],
            ..Order::default()
        };
        let ctx = format!("{name}: shape {shape} code {code} text request {text_in}");
        let first = web_call(addr, &key, &order, text_in, binary).await;
        assert_eq!(
            first.status.get("grpc-status").map(|v| v.as_slice()),
            Some(&[code.to_string().into_bytes()][..]),
            "{ctx}: {first:?}"
        );
        assert!(
            first.status.contains_key("x-request-id"),
            "{ctx}: live: {first:?}"
        );
        let want = web_without_per_call(first);
        for accept in [binary, text, binary] {
            let replay = web_call(addr, &key, &order, text_in, accept).await;
            assert_eq!(
                replay.content_type.starts_with("application/grpc-web-text"),
                accept == text,
                "{ctx}: framed for the retry's Accept"
            );
            for denied in PER_CALL {
                assert!(
                    !replay.status.contains_key(denied),
                    "{ctx}: {denied}: {replay:?}"
                );
            }
            assert_eq!(
                web_without_per_call(replay),
                want,
                "{ctx}: replay in {accept}"
            );
        }
        assert_eq!(sink.runs(&key), 1, "{ctx}: ran again");
    }
    // UNAVAILABLE in the trailer frame is not an answer: the retry runs.
    let key = format!("{run}-flaky");
    let order = Order {
        item: "flaky".into(),
        outcome: 14,
        ..Order::default()
    };
    let first = web_call(addr, &key, &order, false, text).await;
    let again = web_call(addr, &key, &order, false, binary).await;
    assert_eq!(
        sink.runs(&key),
        2,
        "{name}: UNAVAILABLE must release: {first:?} {again:?}"
    );
}

common::on_every_store!(grpc_web_replays);

/// §3: under the default policy UNAVAILABLE, INTERNAL, ABORTED and UNKNOWN are not answers:
/// whatever frames carry them (trailers after no message, trailers-only, after an empty
/// message, after a message), the key is released: the same call runs again (and its OK is
/// then recorded and replayed), while another request under the key is refused (§1 step 6,
/// "any state, different fingerprint"), nothing run.
async fn transient_outcomes_release<St: IdempotencyStore + Clone>(store: St, name: &str) {
    let sink = Sink::default();
    let addr = serve(store, Shop { sink: sink.clone() }).await;
    let run = format!("tr{}", nonce());
    let mut wrong = Vec::new();
    for shape in [NORMAL, TRAILERS_ONLY, EMPTY_MESSAGE, MESSAGE_THEN_STATUS] {
        for code in [14u32, 13, 10, 2, 4, 8] {
            let key = format!("{run}-{shape}-{code}");
            let order = Order {
                item: "retry me".into(),
                outcome: 0,
                fail_first: 1,
                transient: code,
                shape,
                ..Order::default()
            };
            let call = Call {
                path: ORDER,
                key: key.clone(),
                order: order.clone(),
                gzip_sent: false,
                accept_gzip: false,
            };
            let first = send(addr, &call).await;
            let mut other = call.clone();
            other.order.qty = 9;
            let refused = send(addr, &other).await;
            let again = send(addr, &call).await;
            let replay = send(addr, &call).await;
            let runs = sink.runs(&key);
            let ok = runs == 2
                && first.code == code as i32
                && refused.refusal(Code::FailedPrecondition, "FINGERPRINT_MISMATCH")
                && again.code == 0
                && !again.replayed()
                && replay.replayed()
                && replay.exec() == again.exec();
            if !ok {
                wrong.push(format!(
                    "shape {shape} code {code}: runs {runs} (want 2); answers {} / {} / {} / {} (replayed {})",
                    first.code,
                    refused.code,
                    again.code,
                    replay.code,
                    replay.replayed(),
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "{name}: non-definitive outcomes:\n{}",
        wrong.join("\n")
    );
}

common::on_every_store!(transient_outcomes_release);

/// Per-call metadata (trace context, census tags, server stats: what the crate's own
/// `PER_CALL` list names "never kept for a retry") sent in the answer's HEADERS frame: in a
/// trailers-only answer that frame *is* the trailers, and in any answer it describes the call
/// that ran, not the operation. A replay must never carry another call's trace context
/// (DESIGN §1: replays never carry per-request ids; `traceparent` is denied the same way).
async fn per_call_metadata_in_the_head_is_never_replayed<St: IdempotencyStore + Clone>(
    store: St,
    name: &str,
) {
    let sink = Sink::default();
    let addr = serve(store, Shop { sink: sink.clone() }).await;
    let run = format!("pc{}", nonce());
    let mut wrong = Vec::new();
    for (shape, code, what) in [
        (TRAILERS_ONLY, 5, "trailers-only NOT_FOUND"),
        (TRAILERS_ONLY, 3, "trailers-only INVALID_ARGUMENT"),
        (NORMAL, 0, "OK, in the initial metadata"),
    ] {
        let key = format!("{run}-{shape}-{code}");
        let order = Order {
            item: "traced".into(),
            outcome: code,
            shape,
            trace_in_head: true,
            ..Order::default()
        };
        let body = frame(0, &prost::Message::encode_to_vec(&order));
        let first = h2(addr, ORDER, &key, body.clone(), &[]).await;
        let again = h2(addr, ORDER, &key, body, &[]).await;
        assert_eq!(sink.runs(&key), 1, "{name}: {what}: ran again");
        if std::env::var("MODEL_TRACE").is_ok() {
            eprintln!(
                "{what}: first {:?} {:?}\nagain {:?} {:?}",
                first.parts.headers, first.trailers, again.parts.headers, again.trailers
            );
        }
        assert!(
            PER_CALL_BIN
                .iter()
                .all(|n| first.parts.headers.contains_key(*n)),
            "{name}: {what}: the live answer has them all"
        );
        let leaked: Vec<String> = PER_CALL_BIN
            .iter()
            .filter_map(|n| {
                again
                    .parts
                    .headers
                    .get(*n)
                    .map(|v| format!("{n}: {}", String::from_utf8_lossy(v.as_bytes())))
            })
            .collect();
        if !leaked.is_empty() {
            wrong.push(format!(
                "{what}: the replay carries the first call's {leaked:?}"
            ));
        }
    }
    assert!(wrong.is_empty(), "{name}:\n{}", wrong.join("\n"));
}

common::on_every_store!(per_call_metadata_in_the_head_is_never_replayed);
