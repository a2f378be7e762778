//! Review: the gRPC and gRPC-Web paths attacked with a hand-written tonic service, a real
//! tonic client and raw HTTP/2 and HTTP/1.1 requests where no client library would frame a call
//! that way. Every run of the handler is counted at the service (`Effects`); each test names
//! the DESIGN section it attacks.

use crate::common;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use common::{Effects, grpc_frame, grpc_frame_flagged, until};
use futures_util::StreamExt;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use hyper_util::rt::{TokioExecutor, TokioIo};
use prost::Message;
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Endpoint, Server};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower_idempotency::scope::SingleTenant;
use tower_idempotency::{IdempotencyLayer, IdempotencyStore, MemoryStore, ScopedKey};

#[derive(Clone, PartialEq, Message)]
struct Note {
    #[prost(string, tag = "1")]
    text: String,
}

/// Server streaming: one message, then the body fails.
const STREAM_ERR: &str = "/x.X/StreamErr";
/// Server streaming: one message, then the body panics.
const STREAM_PANIC: &str = "/x.X/StreamPanic";
/// A message over the route's response limit, then the body fails.
const BIG_ERR: &str = "/x.X/BigErr";
/// A message over the route's response limit, then the body panics.
const BIG_PANIC: &str = "/x.X/BigPanic";
/// Three messages, repeated initial metadata, repeated and binary trailers.
const STREAM3: &str = "/x.X/Stream3";
/// Trailers-only NOT_FOUND with `grpc-status-details-bin`.
const DETAILS: &str = "/x.X/Details";
/// Trailers-only with the `grpc-status` the request's `x-status` names.
const HEAD: &str = "/x.X/Head";
/// One message naming the run, then OK.
const ECHO: &str = "/x.X/Echo";
/// Waits for the test's go-ahead, then OK.
const SLOW: &str = "/x.X/Slow";
/// Not configured: must pass through.
const UNGUARDED: &str = "/x.X/Unguarded";
/// gRPC-Web: a trailer frame with a repeated line.
const WEB_REPEAT: &str = "/x.X/WebRepeat";
/// gRPC-Web: a trailer frame with secrets in odd case.
const WEB_SECRET: &str = "/x.X/WebSecret";
/// gRPC-Web: one message naming the run, framed for the request's `Accept`.
const WEB_ECHO: &str = "/x.X/WebEcho";
/// gRPC-Web in binary, compressed as a whole (`Content-Encoding: gzip`) all the same.
const WEB_GZIP: &str = "/x.X/WebGzip";
/// OK, on a route whose custom classifier panics.
const CLASSIFIER_PANIC: &str = "/x.X/ClassifierPanic";

fn note(text: &str) -> Vec<u8> {
    grpc_frame(&Note { text: text.into() }.encode_to_vec())
}

fn big() -> Vec<u8> {
    note(&"b".repeat(200))
}

/// `google.rpc.Status { code: 5, message: "no such ticket" }`.
fn details_bytes() -> Vec<u8> {
    let mut out = vec![0x08, 0x05, 0x12, 14];
    out.extend_from_slice(b"no such ticket");
    out
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

fn b64(bytes: &[u8], pad: bool) -> String {
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..=chunk.len() {
            out.push(B64[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
        if pad {
            for _ in chunk.len()..3 {
                out.push('=');
            }
        }
    }
    out
}

fn unb64(text: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0u32);
    for &c in text {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => {
                // Padding ends a group.
                acc = 0;
                bits = 0;
                continue;
            }
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    out
}

/// A gRPC-Web body's message payloads and its trailer frame's lines.
fn web_parts(body: &[u8]) -> (Vec<Vec<u8>>, Vec<String>) {
    let (mut messages, mut lines) = (Vec::new(), Vec::new());
    let mut rest = body;
    while rest.len() >= 5 {
        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        let payload = &rest[5..(5 + len).min(rest.len())];
        if rest[0] & 0x80 != 0 {
            for line in String::from_utf8_lossy(payload).split("\r\n") {
                if !line.is_empty() {
                    lines.push(line.to_owned());
                }
            }
        } else {
            messages.push(payload.to_vec());
        }
        rest = &rest[(5 + len).min(rest.len())..];
    }
    (messages, lines)
}

type Framed = Result<Frame<Bytes>, std::io::Error>;

fn data(bytes: Vec<u8>) -> Framed {
    Ok(Frame::data(Bytes::from(bytes)))
}

fn broke() -> Framed {
    Err(std::io::Error::other("the response stream broke"))
}

fn ok_trailers() -> Framed {
    let mut t = HeaderMap::new();
    t.insert("grpc-status", HeaderValue::from_static("0"));
    Ok(Frame::trailers(t))
}

fn grpc_response(body: tonic::body::Body) -> http::Response<tonic::body::Body> {
    let mut res = http::Response::new(body);
    res.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    res
}

fn grpc(frames: Vec<Framed>) -> http::Response<tonic::body::Body> {
    let body = StreamBody::new(futures_util::stream::iter(frames));
    grpc_response(tonic::body::Body::new(body))
}

/// `frames`, then a body that panics when polled for more.
fn grpc_then_panic(frames: Vec<Framed>) -> http::Response<tonic::body::Body> {
    let stream = futures_util::stream::iter(frames).chain(futures_util::stream::poll_fn(
        |_| -> Poll<Option<Framed>> { panic!("the response stream panicked") },
    ));
    grpc_response(tonic::body::Body::new(StreamBody::new(stream)))
}

fn trailers_only(pairs: &[(&'static str, HeaderValue)]) -> http::Response<tonic::body::Body> {
    let mut res = grpc_response(tonic::body::Body::empty());
    for (name, value) in pairs {
        res.headers_mut().append(*name, value.clone());
    }
    res
}

/// A gRPC-Web answer written by hand: messages and a trailer frame, in base64 when the
/// request's `Accept` asks for text.
fn web(
    request: &HeaderMap,
    messages: Vec<Vec<u8>>,
    trailer: &[u8],
) -> http::Response<tonic::body::Body> {
    let text = request.get("accept").is_some_and(|v| {
        v == "application/grpc-web-text" || v == "application/grpc-web-text+proto"
    });
    let mut body: Vec<u8> = messages.concat();
    body.extend(grpc_frame_flagged(0x80, trailer));
    let (body, content_type) = match text {
        true => (
            b64(&body, true).into_bytes(),
            "application/grpc-web-text+proto",
        ),
        false => (body, "application/grpc-web+proto"),
    };
    let mut res = http::Response::new(tonic::body::Body::new(http_body_util::Full::new(
        Bytes::from(body),
    )));
    res.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(content_type),
    );
    res
}

#[derive(Clone, Default)]
struct Svc {
    effects: Effects,
    done: Arc<AtomicUsize>,
    gate: Arc<tokio::sync::Notify>,
    accepts: Arc<Mutex<Vec<Option<String>>>>,
}

impl tonic::server::NamedService for Svc {
    const NAME: &'static str = "x.X";
}

impl<B: Send + 'static> tower::Service<http::Request<B>> for Svc {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let n = self.effects.hit();
        let path = req.uri().path().to_owned();
        let head = req.headers().clone();
        let this = self.clone();
        Box::pin(async move {
            let res = match path.as_str() {
                STREAM_ERR => grpc(vec![data(note("one")), broke()]),
                STREAM_PANIC => grpc_then_panic(vec![data(note("one"))]),
                BIG_ERR => grpc(vec![data(big()), broke()]),
                BIG_PANIC => grpc_then_panic(vec![data(big())]),
                STREAM3 => {
                    let mut t = HeaderMap::new();
                    t.insert("grpc-status", HeaderValue::from_static("0"));
                    t.append("x-tag", HeaderValue::from_static("a"));
                    t.append("x-tag", HeaderValue::from_static("b"));
                    t.insert("x-blob-bin", HeaderValue::from_static("AAECAw"));
                    let mut res = grpc(vec![
                        data(note("m1")),
                        data(note("m2")),
                        data(note("m3")),
                        Ok(Frame::trailers(t)),
                    ]);
                    res.headers_mut()
                        .append("x-h", HeaderValue::from_static("1"));
                    res.headers_mut()
                        .append("x-h", HeaderValue::from_static("2"));
                    res
                }
                DETAILS => trailers_only(&[
                    ("grpc-status", HeaderValue::from_static("5")),
                    (
                        "grpc-message",
                        HeaderValue::from_static("no%20such%20ticket"),
                    ),
                    (
                        "grpc-status-details-bin",
                        HeaderValue::from_str(&b64(&details_bytes(), false)).expect("b64"),
                    ),
                ]),
                HEAD => trailers_only(&[(
                    "grpc-status",
                    head.get("x-status")
                        .cloned()
                        .unwrap_or(HeaderValue::from_static("0")),
                )]),
                ECHO => grpc(vec![data(note(&format!("run-{n}"))), ok_trailers()]),
                SLOW => {
                    this.gate.notified().await;
                    this.done.fetch_add(1, Ordering::SeqCst);
                    grpc(vec![data(note("slow")), ok_trailers()])
                }
                UNGUARDED => {
                    let seen = head
                        .get("grpc-accept-encoding")
                        .map(|v| v.to_str().unwrap_or("?").to_owned());
                    this.accepts.lock().expect("lock").push(seen);
                    grpc(vec![data(note(&format!("run-{n}"))), ok_trailers()])
                }
                WEB_REPEAT => web(
                    &head,
                    vec![note("w")],
                    b"grpc-status:0\r\nx-tag:a\r\nx-tag:b\r\n",
                ),
                WEB_SECRET => web(
                    &head,
                    vec![note("w")],
                    b"Grpc-Status: 0\r\nSET-COOKIE: s=1\r\nAuthorization: Bearer t\r\n\
                      X-Request-Id: r-1\r\nGrpc-Trace-Bin: AAAA\r\nX-Op: kept\r\n",
                ),
                WEB_ECHO => web(&head, vec![note(&format!("run-{n}"))], b"grpc-status:0\r\n"),
                WEB_GZIP => {
                    let mut body = note(&format!("run-{n}"));
                    body.extend(grpc_frame_flagged(0x80, b"grpc-status:0\r\n"));
                    let mut res = http::Response::new(tonic::body::Body::new(
                        http_body_util::Full::new(Bytes::from(common::gzip(&body))),
                    ));
                    res.headers_mut().insert(
                        http::header::CONTENT_TYPE,
                        HeaderValue::from_static("application/grpc-web+proto"),
                    );
                    res.headers_mut().insert(
                        http::header::CONTENT_ENCODING,
                        HeaderValue::from_static("gzip"),
                    );
                    res
                }
                CLASSIFIER_PANIC => grpc(vec![data(note(&format!("run-{n}"))), ok_trailers()]),
                _ => trailers_only(&[("grpc-status", HeaderValue::from_static("12"))]),
            };
            Ok(res)
        })
    }
}

fn layer<St: IdempotencyStore>(store: St) -> IdempotencyLayer<St, SingleTenant> {
    let short = Duration::from_millis(150);
    IdempotencyLayer::new_for_grpc(store)
        .single_tenant()
        .grpc_method(STREAM_ERR, move |m| m.lease(short))
        .grpc_method(STREAM_PANIC, move |m| m.lease(short))
        .grpc_method(BIG_ERR, move |m| m.response_limit(64).lease(short))
        .grpc_method(BIG_PANIC, move |m| m.response_limit(64).lease(short))
        .grpc_method(STREAM3, |m| m)
        .grpc_method(DETAILS, |m| m)
        .grpc_method(HEAD, |m| m)
        .grpc_method(ECHO, |m| m)
        .grpc_method(SLOW, |m| m)
        .grpc_method(WEB_REPEAT, |m| m)
        .grpc_method(WEB_SECRET, |m| m)
        .grpc_method(WEB_ECHO, |m| m)
        .grpc_method(WEB_GZIP, |m| m)
        .grpc_method(CLASSIFIER_PANIC, move |m| {
            m.lease(short)
                .cache_policy(tower_idempotency::CachePolicy::custom(|_| {
                    panic!("the custom classifier panicked")
                }))
        })
}

/// The service behind the layer on a tonic server that takes HTTP/2 and HTTP/1.1.
async fn serve<St: IdempotencyStore>(store: St, svc: Svc) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = Server::builder()
        .accept_http1(true)
        .layer(layer(store))
        .add_service(svc)
        .serve_with_incoming(TcpIncoming::from(listener));
    tokio::spawn(async move { server.await.expect("grpc server") });
    addr
}

/// A tonic client on a connection of its own, as an independent retry would have.
async fn client(addr: SocketAddr) -> tonic::client::Grpc<tonic::transport::Channel> {
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    grpc
}

fn keyed(key: &str, text: &str) -> tonic::Request<Note> {
    let mut request = tonic::Request::new(Note { text: text.into() });
    request
        .metadata_mut()
        .insert("idempotency-key", key.parse().expect("ascii"));
    request
}

async fn unary(
    addr: SocketAddr,
    path: &'static str,
    key: &str,
    text: &str,
) -> Result<tonic::Response<Note>, Status> {
    let mut grpc = client(addr).await;
    let codec: ProstCodec<Note, Note> = ProstCodec::default();
    grpc.unary(keyed(key, text), PathAndQuery::from_static(path), codec)
        .await
}

/// A server-streaming call read to its end: its messages, trailers, and whether it was
/// marked as a replay.
struct Streamed {
    messages: Vec<String>,
    trailers: Option<tonic::metadata::MetadataMap>,
    replayed: bool,
}

async fn server_stream(
    addr: SocketAddr,
    path: &'static str,
    key: &str,
    text: &str,
) -> Result<Streamed, Status> {
    let mut grpc = client(addr).await;
    let codec: ProstCodec<Note, Note> = ProstCodec::default();
    let response = grpc
        .server_streaming(keyed(key, text), PathAndQuery::from_static(path), codec)
        .await?;
    let replayed = response
        .metadata()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let mut stream = response.into_inner();
    let mut messages = Vec::new();
    while let Some(message) = stream.message().await? {
        messages.push(message.text);
    }
    let trailers = stream.trailers().await?;
    Ok(Streamed {
        messages,
        trailers,
        replayed,
    })
}

/// A raw HTTP/2 answer.
struct Raw {
    parts: http::response::Parts,
    body: Bytes,
    trailers: Option<HeaderMap>,
}

impl Raw {
    /// The `grpc-status` as a client reads it: the head's, else the trailers'.
    fn status(&self) -> Option<String> {
        self.parts
            .headers
            .get("grpc-status")
            .or_else(|| self.trailers.as_ref().and_then(|t| t.get("grpc-status")))
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    }

    fn replayed(&self) -> bool {
        self.parts
            .headers
            .get("idempotency-replayed")
            .is_some_and(|v| v == "true")
    }
}

fn grpc_head(content_type: &'static str, key: &str) -> Vec<(&'static str, HeaderValue)> {
    vec![
        ("content-type", HeaderValue::from_static(content_type)),
        ("te", HeaderValue::from_static("trailers")),
        ("idempotency-key", HeaderValue::from_str(key).expect("key")),
    ]
}

/// One call over a raw HTTP/2 connection of its own: the head exactly as given (repeated
/// names appended), the body as the given DATA frames.
async fn h2(
    addr: SocketAddr,
    path: &str,
    head: Vec<(&'static str, HeaderValue)>,
    chunks: Vec<Vec<u8>>,
) -> Raw {
    let io = TokioIo::new(tokio::net::TcpStream::connect(addr).await.expect("connect"));
    let (mut sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .handshake(io)
        .await
        .expect("h2");
    tokio::spawn(connection);
    let frames: Vec<Result<Frame<Bytes>, Infallible>> = chunks
        .into_iter()
        .map(|c| Ok(Frame::data(Bytes::from(c))))
        .collect();
    let body = StreamBody::new(futures_util::stream::iter(frames));
    let mut request = http::Request::post(format!("http://{addr}{path}"))
        .body(body)
        .expect("request");
    for (name, value) in head {
        request.headers_mut().append(name, value);
    }
    let response = sender.send_request(request).await.expect("answer");
    let (parts, body) = response.into_parts();
    let (body, trailers) = match body.collect().await {
        Ok(collected) => {
            let trailers = collected.trailers().cloned();
            (collected.to_bytes(), trailers)
        }
        Err(_) => (Bytes::new(), None),
    };
    Raw {
        parts,
        body,
        trailers,
    }
}

/// One gRPC-Web call over a raw HTTP/1.1 connection of its own.
async fn h1(
    addr: SocketAddr,
    path: &str,
    head: &[(&'static str, &str)],
    body: Vec<u8>,
) -> (http::response::Parts, Bytes) {
    let io = TokioIo::new(tokio::net::TcpStream::connect(addr).await.expect("connect"));
    let (mut sender, connection) = hyper::client::conn::http1::handshake(io).await.expect("h1");
    tokio::spawn(connection);
    let mut request = http::Request::post(path)
        .header("host", addr.to_string())
        .body(http_body_util::Full::new(Bytes::from(body)))
        .expect("request");
    for (name, value) in head {
        request
            .headers_mut()
            .append(*name, HeaderValue::from_str(value).expect("value"));
    }
    let response = sender.send_request(request).await.expect("answer");
    let (parts, body) = response.into_parts();
    let body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    (parts, body)
}

/// A binary gRPC-Web call of `note("q")` under `key`.
async fn web_binary(addr: SocketAddr, path: &str, key: &str) -> (http::response::Parts, Bytes) {
    h1(
        addr,
        path,
        &[
            ("content-type", "application/grpc-web+proto"),
            ("accept", "application/grpc-web+proto"),
            ("x-grpc-web", "1"),
            ("idempotency-key", key),
        ],
        note("q"),
    )
    .await
}

/// Past a 150 ms lease, with room for the keeper and the store.
async fn past_the_lease() {
    tokio::time::sleep(Duration::from_millis(800)).await;
}

/// §3 "Once the inner service has returned a response head, the effect is taken as done: a
/// failure of the response body afterwards never releases the key": a server-streaming answer
/// whose body fails after its first message is never run again, even once its lease is long
/// gone; the retry is told the response was not stored (FAILED_PRECONDITION).
#[tokio::test]
async fn s3_a_stream_that_fails_after_its_first_message_is_never_run_again() {
    let svc = Svc::default();
    let addr = serve(MemoryStore::new(), svc.clone()).await;
    let first = server_stream(addr, STREAM_ERR, "se-1", "q").await;
    assert!(first.is_err(), "the first caller sees the failure");
    past_the_lease().await;
    let retry = server_stream(addr, STREAM_ERR, "se-1", "q").await;
    assert_eq!(
        svc.effects.count(),
        1,
        "the handler ran again after its head was returned"
    );
    assert_eq!(
        retry.err().map(|s| s.code()),
        Some(Code::FailedPrecondition),
        "the retry is told the outcome is recorded without its response"
    );
}

/// §3, the same with a body that panics after its first message (within the response limit):
/// the handler answered, so the key is never given back.
#[tokio::test]
async fn s3_a_stream_that_panics_after_its_first_message_is_never_run_again() {
    let svc = Svc::default();
    let addr = serve(MemoryStore::new(), svc.clone()).await;
    let _ = server_stream(addr, STREAM_PANIC, "sp-1", "q").await;
    past_the_lease().await;
    let retry = server_stream(addr, STREAM_PANIC, "sp-1", "q").await;
    assert_eq!(
        svc.effects.count(),
        1,
        "the handler ran again after its head was returned"
    );
    assert_eq!(
        retry.err().map(|s| s.code()),
        Some(Code::FailedPrecondition)
    );
}

/// §3 on the streamed path (an answer over the route's response limit, forwarded as it comes):
/// a body that fails after its first (oversized) message never releases the key.
#[tokio::test]
async fn s3_an_oversized_stream_that_fails_midway_is_never_run_again() {
    let svc = Svc::default();
    let addr = serve(MemoryStore::new(), svc.clone()).await;
    let _ = server_stream(addr, BIG_ERR, "be-1", "q").await;
    past_the_lease().await;
    let retry = server_stream(addr, BIG_ERR, "be-1", "q").await;
    assert_eq!(
        svc.effects.count(),
        1,
        "the handler ran again after its head was returned"
    );
    assert_eq!(
        retry.err().map(|s| s.code()),
        Some(Code::FailedPrecondition)
    );
}

/// §3 on the streamed path, with a body that panics after its first (oversized) message: the
/// head was returned and one message delivered, so the effect is done and a retry after the
/// lease must never run the handler a second time (§1: "one operation key produces at most
/// one execution of the handler").
#[tokio::test]
async fn s3_an_oversized_stream_that_panics_midway_is_never_run_again() {
    let svc = Svc::default();
    let addr = serve(MemoryStore::new(), svc.clone()).await;
    let _ = server_stream(addr, BIG_PANIC, "bp-1", "q").await;
    past_the_lease().await;
    let retry = server_stream(addr, BIG_PANIC, "bp-1", "q").await;
    let seen = match &retry {
        Ok(s) => format!("OK, {} messages, replayed {}", s.messages.len(), s.replayed),
        Err(s) => format!("{:?}", s.code()),
    };
    assert_eq!(
        svc.effects.count(),
        1,
        "the handler ran again after its head and first message were sent (retry saw {seen})"
    );
}

/// §1 replays ("stored response + trailers"; "repeated headers stay repeated") for a
/// server-streaming answer, on `store`: the raw replay's body bytes (message boundaries) and
/// trailers equal the live answer's, repeated initial metadata and trailers stay repeated in
/// order, binary trailers stay byte-exact, and tonic's streaming client reads the three
/// messages and the trailers from the replay.
async fn streaming_replay_is_exact<St: IdempotencyStore>(store: St, key: &str) {
    let svc = Svc::default();
    let addr = serve(store, svc.clone()).await;
    let live = h2(
        addr,
        STREAM3,
        grpc_head("application/grpc", key),
        vec![note("q")],
    )
    .await;
    let replay = h2(
        addr,
        STREAM3,
        grpc_head("application/grpc", key),
        vec![note("q")],
    )
    .await;
    assert_eq!(live.status().as_deref(), Some("0"));
    assert!(!live.replayed());
    assert!(replay.replayed(), "the replay is marked");
    assert_eq!(replay.body, live.body, "message frames differ");
    assert_eq!(replay.trailers, live.trailers, "trailers differ");
    for raw in [&live, &replay] {
        let h: Vec<_> = raw.parts.headers.get_all("x-h").iter().collect();
        assert_eq!(h, ["1", "2"], "repeated initial metadata");
        let t = raw.trailers.as_ref().expect("trailers");
        let tags: Vec<_> = t.get_all("x-tag").iter().collect();
        assert_eq!(tags, ["a", "b"], "repeated trailers");
    }
    let read = server_stream(addr, STREAM3, key, "q")
        .await
        .expect("a replay tonic reads");
    assert!(read.replayed);
    assert_eq!(read.messages, ["m1", "m2", "m3"]);
    let trailers = read.trailers.expect("trailers");
    let tags: Vec<_> = trailers
        .get_all("x-tag")
        .iter()
        .map(|v| v.to_str().expect("ascii").to_owned())
        .collect();
    assert_eq!(tags, ["a", "b"]);
    assert_eq!(
        trailers
            .get_bin("x-blob-bin")
            .expect("binary trailer")
            .to_bytes()
            .expect("base64")
            .as_ref(),
        &[0u8, 1, 2, 3]
    );
    assert_eq!(svc.effects.count(), 1);
}

/// §1 replays of a server-streaming answer are exact (MemoryStore).
#[tokio::test]
async fn s1_server_streaming_replays_are_exact_memory() {
    streaming_replay_is_exact(MemoryStore::new(), "s3-mem").await;
}

/// §1 replays of a server-streaming answer are exact (PostgreSQL: the record's codec keeps
/// repeats, order and binary metadata).
#[tokio::test]
async fn s1_server_streaming_replays_are_exact_postgres() {
    let Some(store) = common::postgres("grpc_exactness_review").await else {
        return;
    };
    let key = format!("s3-pg-{}", std::process::id());
    streaming_replay_is_exact(store, &key).await;
}

/// §1 replays of a server-streaming answer are exact (Redis).
#[tokio::test]
async fn s1_server_streaming_replays_are_exact_redis() {
    let Some(store) = common::redis("grpc_exactness_review").await else {
        return;
    };
    streaming_replay_is_exact(store, "s3-redis").await;
}

/// §1 "Errors travel as google.rpc.Status" / §3: a definitive status in a trailers-only head
/// with `grpc-status-details-bin` is recorded and replayed intact: same code, message and
/// details bytes; one run.
#[tokio::test]
async fn s3_a_status_with_details_is_replayed_intact() {
    let svc = Svc::default();
    let addr = serve(MemoryStore::new(), svc.clone()).await;
    let first = unary(addr, DETAILS, "d-1", "q")
        .await
        .expect_err("NOT_FOUND");
    let retry = unary(addr, DETAILS, "d-1", "q")
        .await
        .expect_err("NOT_FOUND");
    assert_eq!(first.code(), Code::NotFound);
    assert_eq!(retry.code(), Code::NotFound);
    assert_eq!(retry.message(), first.message());
    assert_eq!(first.details(), details_bytes().as_slice());
    assert_eq!(retry.details(), first.details(), "details bytes differ");
    assert_eq!(
        retry
            .metadata()
            .get("idempotency-replayed")
            .map(|v| v.to_str().expect("ascii").to_owned())
            .as_deref(),
        Some("true")
    );
    assert_eq!(svc.effects.count(), 1);
}

/// §3 "gRPC outcomes are classified by the final grpc-status wherever it travels": a
/// trailers-only head whose `grpc-status` is not a code (`2a`, `-1`, `17`, `05`) is UNKNOWN to
/// every gRPC client, never a definitive answer: under DefinitiveOnly the key is released and a
/// retry re-attempts. A well-formed definitive code in the head (`5`) is recorded.
#[tokio::test]
async fn s3_a_malformed_status_in_a_trailers_only_head_is_unknown() {
    let svc = Svc::default();
    let addr = serve(MemoryStore::new(), svc.clone()).await;
    let mut wrong = Vec::new();
    for (i, value) in ["2a", "-1", "17", "05", "5"].into_iter().enumerate() {
        let key = format!("hs-{i}");
        let before = svc.effects.count();
        for _ in 0..2 {
            let mut head = grpc_head("application/grpc", &key);
            head.push(("x-status", HeaderValue::from_static(value)));
            let raw = h2(addr, HEAD, head, vec![note("q")]).await;
            assert_eq!(raw.status().as_deref(), Some(value));
        }
        let runs = svc.effects.count() - before;
        let expected = if value == "5" { 1 } else { 2 };
        if runs != expected {
            wrong.push(format!(
                "grpc-status {value:?}: {runs} runs, expected {expected}"
            ));
        }
    }
    assert!(wrong.is_empty(), "{wrong:?}");
}

/// §1 step 1 for gRPC metadata: what is not exactly one valid `idempotency-key` entry is
/// refused INVALID_ARGUMENT before anything runs: the key sent twice (two operations), the key
/// only as binary metadata (`idempotency-key-bin`, not the key's entry), and a key with bytes
/// outside visible ASCII (which tonic's own metadata API would reject).
#[tokio::test]
async fn s1_key_metadata_that_is_not_one_valid_key_is_refused() {
    let svc = Svc::default();
    let addr = serve(MemoryStore::new(), svc.clone()).await;
    let base = vec![
        ("content-type", HeaderValue::from_static("application/grpc")),
        ("te", HeaderValue::from_static("trailers")),
    ];
    let cases: Vec<(&str, Vec<(&'static str, HeaderValue)>)> = vec![
        (
            "twice",
            vec![
                ("idempotency-key", HeaderValue::from_static("k-1")),
                ("idempotency-key", HeaderValue::from_static("k-2")),
            ],
        ),
        (
            "binary only",
            vec![("idempotency-key-bin", HeaderValue::from_static("a2V5"))],
        ),
        (
            "non-ASCII",
            vec![(
                "idempotency-key",
                HeaderValue::from_bytes(b"k\xc3\xa9y").expect("obs-text"),
            )],
        ),
    ];
    let mut wrong = Vec::new();
    for (what, extra) in cases {
        let mut head = base.clone();
        head.extend(extra);
        let raw = h2(addr, ECHO, head, vec![note("q")]).await;
        if raw.status().as_deref() != Some("3") {
            wrong.push(format!("{what}: grpc-status {:?}", raw.status()));
        }
    }
    assert!(wrong.is_empty(), "{wrong:?}");
    assert_eq!(svc.effects.count(), 0, "a refused call ran");
}

/// §1 step 3 for a unary call, hostile framing: a length prefix shorter than the message that
/// follows, and a well-formed message followed by stray bytes, are not one message: refused
/// before anything is claimed or run; the key stays free for the real call.
#[tokio::test]
async fn s1_a_lying_length_prefix_or_trailing_bytes_are_refused_unclaimed() {
    let svc = Svc::default();
    let addr = serve(MemoryStore::new(), svc.clone()).await;
    let payload = Note { text: "abc".into() }.encode_to_vec();
    let mut short_prefix = vec![0u8, 0, 0, 0, 3];
    short_prefix.extend_from_slice(&payload);
    let mut trailing = note("abc");
    trailing.extend_from_slice(&[0xff, 0xff]);
    for (what, body) in [("short prefix", short_prefix), ("trailing bytes", trailing)] {
        let raw = h2(
            addr,
            ECHO,
            grpc_head("application/grpc", "lp-1"),
            vec![body],
        )
        .await;
        assert_eq!(raw.status().as_deref(), Some("3"), "{what}");
    }
    assert_eq!(svc.effects.count(), 0, "a malformed unary call ran");
    let real = h2(
        addr,
        ECHO,
        grpc_head("application/grpc", "lp-1"),
        vec![note("abc")],
    )
    .await;
    assert_eq!(
        real.status().as_deref(),
        Some("0"),
        "the key was left claimed"
    );
    assert!(!real.replayed());
    assert_eq!(svc.effects.count(), 1);
}

/// §1 step 6 (gRPC column): a gRPC call is answered in gRPC. A media type's type and subtype
/// are case-insensitive (RFC 9110 §8.3.1), and tonic serves `Application/GRPC` like
/// `application/grpc`; a second call under the same key with another message must get
/// FAILED_PRECONDITION (or INVALID_ARGUMENT) as a gRPC status, never an HTTP 422
/// problem+json body a gRPC client cannot read.
#[tokio::test]
async fn s1_a_grpc_media_type_in_another_case_is_still_answered_in_grpc() {
    let svc = Svc::default();
    let addr = serve(MemoryStore::new(), svc.clone()).await;
    let first = h2(
        addr,
        ECHO,
        grpc_head("Application/GRPC", "uc-1"),
        vec![note("a")],
    )
    .await;
    assert_eq!(first.status().as_deref(), Some("0"));
    let other = h2(
        addr,
        ECHO,
        grpc_head("Application/GRPC", "uc-1"),
        vec![note("b")],
    )
    .await;
    let content_type = other
        .parts
        .headers
        .get("content-type")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    assert_eq!(svc.effects.count(), 1, "the changed call ran");
    assert!(
        other.parts.status == 200 && matches!(other.status().as_deref(), Some("9" | "3")),
        "a gRPC call reusing its key for another message got HTTP {} {content_type:?}, \
         grpc-status {:?}",
        other.parts.status,
        other.status()
    );
}

/// §1 step 7 "the inner service runs to completion even if the caller disconnects": a tonic
/// call cancelled by its client while the handler runs; the handler completes, and the retry
/// gets its answer replayed, never a second run.
#[tokio::test]
async fn s1_a_cancelled_call_runs_to_completion_and_its_retry_replays() {
    let svc = Svc::default();
    let addr = serve(MemoryStore::new(), svc.clone()).await;
    let call = tokio::spawn(async move { unary(addr, SLOW, "c-1", "q").await });
    until("the handler starts", || svc.effects.count() == 1).await;
    call.abort();
    let _ = call.await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    svc.gate.notify_one();
    until("the handler completes", || {
        svc.done.load(Ordering::SeqCst) == 1
    })
    .await;
    let mut answer = unary(addr, SLOW, "c-1", "q").await;
    for _ in 0..100 {
        match &answer {
            Err(status) if status.code() == Code::Aborted => {
                tokio::time::sleep(Duration::from_millis(20)).await;
                answer = unary(addr, SLOW, "c-1", "q").await;
            }
            _ => break,
        }
    }
    let answer = answer.expect("the replay");
    assert_eq!(answer.get_ref().text, "slow");
    assert!(answer.metadata().contains_key("idempotency-replayed"));
    assert_eq!(svc.effects.count(), 1);
}

/// §1 "tonic gRPC servers (one layer, per-method configuration)": a method not configured
/// passes through untouched even with a key: every call runs, none is marked, and its
/// `grpc-accept-encoding` reaches the handler (only guarded calls are asked for identity).
#[tokio::test]
async fn s1_an_unconfigured_method_passes_through_untouched() {
    let svc = Svc::default();
    let addr = serve(MemoryStore::new(), svc.clone()).await;
    for _ in 0..2 {
        let mut head = grpc_head("application/grpc", "un-1");
        head.push(("grpc-accept-encoding", HeaderValue::from_static("gzip")));
        let raw = h2(addr, UNGUARDED, head, vec![note("q")]).await;
        assert_eq!(raw.status().as_deref(), Some("0"));
        assert!(!raw.parts.headers.contains_key("idempotency-replayed"));
    }
    assert_eq!(svc.effects.count(), 2);
    assert_eq!(
        *svc.accepts.lock().expect("lock"),
        [Some("gzip".to_owned()), Some("gzip".to_owned())]
    );
}

/// §3 "Sensitive response headers and trailers ... are never stored" for gRPC-Web, whose
/// trailers are lines in the body's trailer frame, written in any case (`SET-COOKIE`,
/// `Authorization`, `X-Request-Id`, per-call `Grpc-Trace-Bin`): none reaches the record or the
/// replay's trailer frame; the operation's own metadata (`X-Op`) and status do.
#[tokio::test]
async fn s3_grpc_web_secret_trailer_lines_in_any_case_are_never_stored() {
    let svc = Svc::default();
    let store = MemoryStore::new();
    let addr = serve(store.clone(), svc.clone()).await;
    let (_, live) = web_binary(addr, WEB_SECRET, "ws-1").await;
    let (_, live_lines) = web_parts(&live);
    assert!(
        live_lines.iter().any(|l| l.starts_with("SET-COOKIE")),
        "the first caller gets its answer as sent: {live_lines:?}"
    );
    let (head, replay) = web_binary(addr, WEB_SECRET, "ws-1").await;
    assert_eq!(
        head.headers
            .get("idempotency-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    let (messages, lines) = web_parts(&replay);
    assert_eq!(messages.len(), 1);
    let lower: Vec<String> = lines.iter().map(|l| l.to_ascii_lowercase()).collect();
    for secret in [
        "set-cookie",
        "authorization",
        "x-request-id",
        "grpc-trace-bin",
    ] {
        assert!(
            !lower.iter().any(|l| l.starts_with(secret)),
            "{secret} replayed: {lines:?}"
        );
    }
    assert!(lower.iter().any(|l| l.starts_with("x-op:")), "{lines:?}");
    assert!(
        lower.iter().any(|l| l.replace(' ', "") == "grpc-status:0"),
        "{lines:?}"
    );
    let record = store
        .lookup(&ScopedKey::new("", "ws-1"))
        .await
        .expect("lookup")
        .expect("record");
    let response = record.response.expect("recorded");
    let trailers = response.trailers.expect("trailers kept");
    for secret in [
        "set-cookie",
        "authorization",
        "x-request-id",
        "grpc-trace-bin",
    ] {
        assert!(!trailers.contains_key(secret), "{secret} stored");
        assert!(!response.headers.contains_key(secret), "{secret} stored");
    }
    assert_eq!(svc.effects.count(), 1);
}

/// §1 "repeated headers stay repeated" for gRPC-Web: a trailer frame naming `x-tag` twice is
/// replayed with both lines, in order, as the first caller received it.
#[tokio::test]
async fn s1_grpc_web_repeated_trailer_lines_stay_repeated() {
    let svc = Svc::default();
    let addr = serve(MemoryStore::new(), svc.clone()).await;
    let (_, live) = web_binary(addr, WEB_REPEAT, "wr-1").await;
    let (_, live_lines) = web_parts(&live);
    let (head, replay) = web_binary(addr, WEB_REPEAT, "wr-1").await;
    assert!(head.headers.contains_key("idempotency-replayed"));
    let (_, lines) = web_parts(&replay);
    let tags = |lines: &[String]| -> Vec<String> {
        lines
            .iter()
            .filter(|l| l.to_ascii_lowercase().starts_with("x-tag:"))
            .map(|l| l["x-tag:".len()..].trim().to_owned())
            .collect()
    };
    assert_eq!(tags(&live_lines), ["a", "b"], "the live answer");
    assert_eq!(
        tags(&lines),
        ["a", "b"],
        "the replay's trailer frame lost a repeated line: {lines:?}"
    );
    assert_eq!(svc.effects.count(), 1);
}

/// §1/§3 gRPC-Web: a client that switches framing between retries (binary, then text with the
/// same message in base64, then binary asking for a text answer) never makes a second run:
/// each retry gets a replay it can read in the framing it asked for, or FAILED_PRECONDITION
/// (the bytes as sent differ) — never another execution, never a body in the wrong framing.
#[tokio::test]
async fn s3_a_grpc_web_client_switching_framing_never_runs_twice() {
    let svc = Svc::default();
    let addr = serve(MemoryStore::new(), svc.clone()).await;
    let (_, live) = web_binary(addr, WEB_ECHO, "wm-1").await;
    let (live_messages, _) = web_parts(&live);
    assert_eq!(live_messages.len(), 1);

    // Text in, text out: the same message in base64.
    let (head, body) = h1(
        addr,
        WEB_ECHO,
        &[
            ("content-type", "application/grpc-web-text"),
            ("accept", "application/grpc-web-text"),
            ("x-grpc-web", "1"),
            ("idempotency-key", "wm-1"),
        ],
        b64(&note("q"), true).into_bytes(),
    )
    .await;
    let status = head
        .headers
        .get("grpc-status")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    if status.as_deref() != Some("9") {
        assert!(
            head.headers.contains_key("idempotency-replayed"),
            "text retry: neither a replay nor FAILED_PRECONDITION: {head:?}"
        );
        assert!(
            head.headers["content-type"]
                .to_str()
                .expect("ascii")
                .starts_with("application/grpc-web-text")
        );
        let (messages, lines) = web_parts(&unb64(&body));
        assert_eq!(messages, live_messages);
        assert!(lines.iter().any(|l| l.replace(' ', "") == "grpc-status:0"));
    }

    // Binary in (the bytes first sent), text out.
    let (head, body) = h1(
        addr,
        WEB_ECHO,
        &[
            ("content-type", "application/grpc-web+proto"),
            ("accept", "application/grpc-web-text"),
            ("x-grpc-web", "1"),
            ("idempotency-key", "wm-1"),
        ],
        note("q"),
    )
    .await;
    assert!(head.headers.contains_key("idempotency-replayed"));
    assert!(
        head.headers["content-type"]
            .to_str()
            .expect("ascii")
            .starts_with("application/grpc-web-text"),
        "{head:?}"
    );
    let (messages, lines) = web_parts(&unb64(&body));
    assert_eq!(
        messages, live_messages,
        "the replay decodes to the live message"
    );
    assert!(lines.iter().any(|l| l.replace(' ', "") == "grpc-status:0"));
    assert_eq!(svc.effects.count(), 1);
}

/// §3 "A custom classifier may be supplied" + "Once the inner service has returned a response
/// head, the effect is taken as done": the handler answered OK, then the route's custom
/// classifier panicked while the layer classified the answer. The handler's effect happened;
/// whatever the layer answers, a retry long after the lease must not run the handler again
/// (it may be told the outcome is unknown, or not stored, but never get a second execution).
#[tokio::test]
async fn s3_a_panicking_custom_classifier_never_lets_the_handler_run_twice() {
    let svc = Svc::default();
    let addr = serve(MemoryStore::new(), svc.clone()).await;
    let _ = tokio::time::timeout(
        Duration::from_secs(10),
        unary(addr, CLASSIFIER_PANIC, "cp-1", "q"),
    )
    .await;
    assert_eq!(svc.effects.count(), 1);
    past_the_lease().await;
    let retry = tokio::time::timeout(
        Duration::from_secs(10),
        unary(addr, CLASSIFIER_PANIC, "cp-1", "q"),
    )
    .await;
    let seen = match &retry {
        Ok(Ok(_)) => "OK".to_owned(),
        Ok(Err(s)) => format!("{:?}", s.code()),
        Err(_) => "no answer".to_owned(),
    };
    assert_eq!(
        svc.effects.count(),
        1,
        "the handler ran again after it had answered (retry saw {seen})"
    );
}

/// §3 "A replay never carries a content encoding the retrying client did not accept" and the
/// gRPC module's "gRPC-Web calls ... replayed in the framing (binary or text) each retry's
/// `Accept` asks for": a gRPC-Web answer compressed as a whole (binary, `Content-Encoding:
/// gzip`) is replayed to a retry that accepts gzip but asks for text. The retry must get text
/// (or a refusal it can read), never a binary body labelled as what it did not ask for.
#[tokio::test]
async fn s3_an_opaque_grpc_web_answer_is_never_replayed_in_the_wrong_framing() {
    let svc = Svc::default();
    let addr = serve(MemoryStore::new(), svc.clone()).await;
    let (first, _) = h1(
        addr,
        WEB_GZIP,
        &[
            ("content-type", "application/grpc-web+proto"),
            ("accept", "application/grpc-web+proto"),
            ("accept-encoding", "gzip"),
            ("x-grpc-web", "1"),
            ("idempotency-key", "wg-1"),
        ],
        note("q"),
    )
    .await;
    assert_eq!(first.status, 200);
    let (head, _) = h1(
        addr,
        WEB_GZIP,
        &[
            ("content-type", "application/grpc-web+proto"),
            ("accept", "application/grpc-web-text"),
            ("accept-encoding", "gzip"),
            ("x-grpc-web", "1"),
            ("idempotency-key", "wg-1"),
        ],
        note("q"),
    )
    .await;
    assert_eq!(svc.effects.count(), 1);
    let content_type = head
        .headers
        .get("content-type")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    let refused = head.headers.contains_key("grpc-status")
        && head.headers.get("content-length").is_none_or(|v| v == "0");
    assert!(
        refused || content_type.starts_with("application/grpc-web-text"),
        "a retry asking for gRPC-Web text got {content_type:?} (grpc-status {:?})",
        head.headers.get("grpc-status")
    );
}
