//! Issue 19 §4 (gRPC-Web): a gRPC-Web call's outcome is the status in its body's trailer frame,
//! its trailers pass the deny list, a replay is framed for each retry's `Accept` (binary or
//! text), and the middleware's own refusals are gRPC-Web. A real tonic server behind
//! `tonic_web::GrpcWebLayer` (inside the idempotency layer, which so sees gRPC-Web), a real
//! tonic client through `tonic_web::GrpcWebClientLayer` over HTTP/1.1, and raw requests for
//! the text variant, decoded here by a base64 reader of the test's own.

use crate::common;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use common::Effects;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue};
use http_body::Frame;
use http_body_util::StreamBody;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower_idempotency::scope::SingleTenant;
use tower_idempotency::{CachePolicy, IdempotencyLayer, IdempotencyStore, MemoryStore, ScopedKey};

#[derive(Clone, PartialEq, prost::Message)]
struct Note {
    #[prost(string, tag = "1")]
    text: String,
}

/// OK, with trailers of its own (credentials, per-call ids) beside the status.
const SECRET: &str = "/web.Web/Secret";
/// UNAVAILABLE in its trailers on a key's first run, OK after.
const FLAKY: &str = "/web.Web/Flaky";
/// UNAVAILABLE as a trailers-only answer (status in the headers) on the first run, OK after.
const FLAKY_HEAD: &str = "/web.Web/FlakyHead";
/// 2 KiB answers on a route that keeps 256 bytes: OK, and UNAVAILABLE.
const LARGE_OK: &str = "/web.Web/LargeOk";
const LARGE_UNAVAILABLE: &str = "/web.Web/LargeUnavailable";

/// A gRPC service written by hand: one message, then trailers.
#[derive(Clone, Default)]
struct Web {
    effects: Effects,
}

impl tonic::server::NamedService for Web {
    const NAME: &'static str = "web.Web";
}

fn note(text: String) -> Vec<u8> {
    let message = prost::Message::encode_to_vec(&Note { text });
    let mut frame = vec![0u8];
    frame.extend((message.len() as u32).to_be_bytes());
    frame.extend(message);
    frame
}

impl<B: Send + 'static> tower::Service<http::Request<B>> for Web {
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
            if path == FLAKY_HEAD && n == 1 {
                return Ok(Status::unavailable("the ledger is down").into_http());
            }
            let mut trailers = HeaderMap::new();
            let mut put = |name: &'static str, value: String| {
                trailers.insert(name, HeaderValue::from_str(&value).expect("value"));
            };
            let status = match path.as_str() {
                LARGE_UNAVAILABLE => "14",
                FLAKY if n == 1 => "14",
                _ => "0",
            };
            put("grpc-status", status.into());
            if status == "14" {
                put("grpc-message", "the ledger is down".into());
            }
            put("set-cookie", format!("session=call-{n}"));
            put("authorization", format!("Bearer call-{n}"));
            put("x-request-id", format!("req-{n}"));
            put("grpc-trace-bin", "AAAA".into());
            put("x-operation", "note-taken".into());
            let text = match path.as_str() {
                LARGE_OK | LARGE_UNAVAILABLE => format!("large {n} ").repeat(300),
                _ => format!("note {n}"),
            };
            let message = note(text);
            let (first, second) = message.split_at(message.len() / 2);
            let frames = vec![
                Ok::<_, Infallible>(Frame::data(Bytes::copy_from_slice(first))),
                Ok(Frame::data(Bytes::copy_from_slice(second))),
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

fn layer(store: MemoryStore, policy: CachePolicy) -> IdempotencyLayer<MemoryStore, SingleTenant> {
    IdempotencyLayer::new_for_grpc(store)
        .single_tenant()
        .cache_policy(policy)
        .grpc_method(SECRET, |m| m)
        .grpc_method(FLAKY, |m| m)
        .grpc_method(FLAKY_HEAD, |m| m)
        .grpc_method(LARGE_OK, |m| m.response_limit(256))
        .grpc_method(LARGE_UNAVAILABLE, |m| m.response_limit(256))
}

/// The idempotency layer outside tonic-web's: it sees the calls as browsers send them.
async fn serve(store: MemoryStore, policy: CachePolicy, web: Web) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let layers = tower::ServiceBuilder::new()
        .layer(layer(store, policy))
        .layer(tonic_web::GrpcWebLayer::new())
        .into_inner();
    let server = Server::builder()
        .accept_http1(true)
        .layer(layers)
        .add_service(web)
        .serve_with_incoming(TcpIncoming::from(listener));
    tokio::spawn(async move { server.await.expect("grpc server") });
    addr
}

/// One call from tonic's gRPC-Web client (binary, HTTP/1.1).
async fn call(
    addr: SocketAddr,
    path: &'static str,
    key: &str,
) -> Result<tonic::Response<Note>, Status> {
    let http = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build_http::<tonic_web::GrpcWebCall<tonic::body::Body>>();
    let service = tower::ServiceBuilder::new()
        .layer(tonic_web::GrpcWebClientLayer::new())
        .service(http);
    let origin = format!("http://{addr}").parse().expect("origin");
    let mut grpc = tonic::client::Grpc::with_origin(service, origin);
    grpc.ready().await.expect("ready");
    let mut request = tonic::Request::new(Note {
        text: "take a note".into(),
    });
    request
        .metadata_mut()
        .insert("idempotency-key", key.parse().expect("ascii"));
    grpc.unary(
        request,
        PathAndQuery::from_static(path),
        ProstCodec::default(),
    )
    .await
}

/// A raw gRPC-Web call in text: the answer's content type and its body, decoded.
async fn call_text(addr: SocketAddr, path: &str, key: &str, accept: &str) -> (String, Vec<u8>) {
    let message = note("take a note".into());
    let res = common::client()
        .post(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc-web-text")
        .header("accept", accept)
        .header("x-grpc-web", "1")
        .header("idempotency-key", key)
        .body(encode_base64(&message))
        .send()
        .await
        .expect("call");
    assert_eq!(res.status(), 200);
    let content_type = res.headers()["content-type"]
        .to_str()
        .expect("ascii")
        .to_owned();
    let body = res.bytes().await.expect("body");
    let binary = match content_type.starts_with("application/grpc-web-text") {
        true => decode_base64(&body),
        false => body.to_vec(),
    };
    (content_type, binary)
}

/// The test's own base64, independent of the crate's: padded groups, padding anywhere.
fn encode_base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in bytes.chunks(3) {
        let b = [c[0], *c.get(1).unwrap_or(&0), *c.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= c.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn decode_base64(text: &[u8]) -> Vec<u8> {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    assert_eq!(text.len() % 4, 0, "whole groups");
    let mut out = Vec::new();
    for group in text.chunks(4) {
        let real: Vec<u32> = group
            .iter()
            .take_while(|&&c| c != b'=')
            .map(|c| A.iter().position(|a| a == c).expect("base64") as u32)
            .collect();
        let n = real.iter().fold(0u32, |n, v| (n << 6) | v) << (6 * (4 - real.len()));
        out.extend_from_slice(&n.to_be_bytes()[1..real.len()]);
    }
    out
}

/// The frames of a gRPC-Web body: its messages' payloads, and its trailer lines.
fn frames(body: &[u8]) -> (Vec<Vec<u8>>, Vec<String>) {
    let (mut messages, mut trailers) = (Vec::new(), Vec::new());
    let mut rest = body;
    while !rest.is_empty() {
        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        let payload = &rest[5..5 + len];
        match rest[0] {
            0 => messages.push(payload.to_vec()),
            0x80 => {
                let text = String::from_utf8(payload.to_vec()).expect("lines");
                trailers.extend(
                    text.split("\r\n")
                        .filter(|l| !l.is_empty())
                        .map(str::to_owned),
                );
            }
            flag => panic!("flag {flag}"),
        }
        rest = &rest[5 + len..];
    }
    (messages, trailers)
}

/// A trailer frame's UNAVAILABLE is no definitive answer: under the default policy the key
/// is given back and the retry runs; its OK is recorded and replayed. The same for a status in
/// the headers of a trailers-only answer.
#[tokio::test]
async fn s19_4_web_status_in_the_trailer_frame_is_the_outcome() {
    for path in [FLAKY, FLAKY_HEAD] {
        let web = Web::default();
        let addr = serve(MemoryStore::new(), CachePolicy::DefinitiveOnly, web.clone()).await;
        let failed = call(addr, path, "f-1").await.expect_err("unavailable");
        assert_eq!(failed.code(), Code::Unavailable, "{path}: {failed:?}");
        let ok = call(addr, path, "f-1").await.expect("runs again");
        assert_eq!(ok.get_ref().text, "note 2", "{path}");
        let replay = call(addr, path, "f-1").await.expect("replay");
        assert_eq!(replay.get_ref().text, "note 2", "{path}");
        assert!(replay.metadata().contains_key("idempotency-replayed"));
        assert_eq!(
            web.effects.count(),
            2,
            "{path}: released once, then recorded"
        );
    }
}

/// The trailer frame passes the deny list: no cookie, credentials, request id or trace
/// context reaches a retry or the store; what describes the operation is kept.
#[tokio::test]
async fn s19_4_web_trailers_pass_the_deny_list() {
    let store = MemoryStore::new();
    let web = Web::default();
    let addr = serve(store.clone(), CachePolicy::DefinitiveOnly, web.clone()).await;
    let first = call(addr, SECRET, "s-1").await.expect("first");
    assert_eq!(
        first.metadata().get("set-cookie").map(|v| v.to_str().ok()),
        Some(Some("session=call-1")),
        "the first caller gets its own trailers"
    );
    let replay = call(addr, SECRET, "s-1").await.expect("replay");
    let meta = replay.metadata();
    assert_eq!(replay.get_ref().text, "note 1");
    for denied in [
        "set-cookie",
        "authorization",
        "x-request-id",
        "grpc-trace-bin",
    ] {
        assert!(
            !meta.contains_key(denied),
            "{denied} reached a retry: {meta:?}"
        );
    }
    assert_eq!(
        meta.get("x-operation").and_then(|v| v.to_str().ok()),
        Some("note-taken")
    );
    let record = store
        .lookup(&ScopedKey::new("", "s-1"))
        .await
        .expect("lookup")
        .expect("record");
    let stored = record.response.expect("recorded");
    let body = stored.body.expect("body");
    assert!(
        !body.windows(10).any(|w| w == b"set-cookie"),
        "the trailer frame is not kept in the body"
    );
    let trailers = stored.trailers.expect("trailers");
    assert_eq!(trailers["grpc-status"], "0");
    assert!(!trailers.contains_key("set-cookie") && !trailers.contains_key("authorization"));
    assert_eq!(web.effects.count(), 1);
}

/// Text or binary is each call's own choice (its `Accept`): a key first answered in text is
/// replayed in binary to a retry that asks for binary, and in text again to one that asks for
/// text, the same message and status each time.
#[tokio::test]
async fn s19_4_web_replays_follow_each_retrys_accept() {
    let web = Web::default();
    let addr = serve(MemoryStore::new(), CachePolicy::DefinitiveOnly, web.clone()).await;
    let text = "application/grpc-web-text";
    let (first_type, first) = call_text(addr, SECRET, "t-1", text).await;
    assert!(first_type.starts_with(text), "{first_type}");
    let (messages, trailers) = frames(&first);
    assert!(
        trailers.iter().any(|t| t.starts_with("set-cookie")),
        "{trailers:?}"
    );
    for accept in ["application/grpc-web+proto", text, "application/grpc-web"] {
        let (content_type, body) = call_text(addr, SECRET, "t-1", accept).await;
        let expected = match accept == text {
            true => "application/grpc-web-text+proto",
            false => "application/grpc-web+proto",
        };
        assert_eq!(content_type, expected);
        let (replayed, replay_trailers) = frames(&body);
        assert_eq!(replayed, messages, "{accept}");
        assert!(
            replay_trailers.contains(&"grpc-status:0".to_owned()),
            "{replay_trailers:?}"
        );
        assert!(
            !replay_trailers.iter().any(|t| t.starts_with("set-cookie")),
            "{replay_trailers:?}"
        );
    }
    assert_eq!(web.effects.count(), 1);
}

/// The middleware's own refusals reach a gRPC-Web client as statuses it reads, in the
/// content type it asked for.
#[tokio::test]
async fn s19_4_web_refusals_are_grpc_web() {
    let web = Web::default();
    let addr = serve(MemoryStore::new(), CachePolicy::DefinitiveOnly, web.clone()).await;
    let long = "k".repeat(300);
    let refused = call(addr, SECRET, &long).await.expect_err("invalid key");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    for (accept, content_type) in [
        ("application/grpc-web", "application/grpc-web+proto"),
        (
            "application/grpc-web-text",
            "application/grpc-web-text+proto",
        ),
    ] {
        let res = common::client()
            .post(format!("http://{addr}{SECRET}"))
            .header("content-type", "application/grpc-web")
            .header("accept", accept)
            .header("idempotency-key", &long)
            .body(note("x".into()))
            .send()
            .await
            .expect("call");
        assert_eq!(res.headers()["content-type"], content_type);
        assert_eq!(res.headers()["grpc-status"], "3");
    }
    assert_eq!(web.effects.count(), 0);
}

/// An answer too large to keep is classified by its trailer frame, read as it passes: an
/// UNAVAILABLE gives the key back (binary and text), an OK consumes it and the retry is told
/// the response was not stored, with its gRPC status, in gRPC-Web.
#[tokio::test]
async fn s19_4_an_oversized_web_answer_is_classified_by_its_trailer_frame() {
    let web = Web::default();
    let addr = serve(MemoryStore::new(), CachePolicy::DefinitiveOnly, web.clone()).await;
    for _ in 0..2 {
        let failed = call(addr, LARGE_UNAVAILABLE, "l-1")
            .await
            .expect_err("unavailable");
        assert_eq!(failed.code(), Code::Unavailable);
    }
    assert_eq!(web.effects.count(), 2, "released: the retry ran");
    for _ in 0..2 {
        let (_, body) =
            call_text(addr, LARGE_UNAVAILABLE, "l-2", "application/grpc-web-text").await;
        let (messages, trailers) = frames(&body);
        assert_eq!(messages.len(), 1, "the first caller gets it all");
        assert!(
            trailers.contains(&"grpc-status:14".to_owned()),
            "{trailers:?}"
        );
    }
    assert_eq!(web.effects.count(), 4, "released in text too");

    let first = call(addr, LARGE_OK, "l-3").await.expect("the whole answer");
    assert!(first.get_ref().text.starts_with("large 5 "));
    let retry = call(addr, LARGE_OK, "l-3").await.expect_err("not stored");
    assert_eq!(retry.code(), Code::FailedPrecondition, "{retry:?}");
    assert!(
        retry.message().contains("gRPC status 0"),
        "{}",
        retry.message()
    );
    assert_eq!(web.effects.count(), 5, "consumed: never run again");
}

/// A body that claims gRPC-Web and is not (an unknown frame flag) says nothing readable about
/// how the call ended: UNKNOWN. Under the default policy the key is given back; under
/// Everything it is recorded without the bytes, and the retry is told so, in gRPC-Web.
#[tokio::test]
async fn s19_4_a_body_that_is_not_grpc_web_is_unknown() {
    for everything in [false, true] {
        let policy = match everything {
            true => CachePolicy::Everything,
            false => CachePolicy::DefinitiveOnly,
        };
        let effects = Effects::default();
        let sink = effects.clone();
        let app = axum::Router::new()
            .route(
                "/w.W/Broken",
                axum::routing::post(move || async move {
                    sink.hit();
                    let body = vec![7u8, 0, 0, 0, 1, b'x'];
                    ([("content-type", "application/grpc-web+proto")], body)
                }),
            )
            .route_layer(
                IdempotencyLayer::new(MemoryStore::new())
                    .single_tenant()
                    .cache_policy(policy),
            );
        let addr = common::serve(app).await;
        let send = || {
            common::client()
                .post(format!("http://{addr}/w.W/Broken"))
                .header("content-type", "application/grpc-web+proto")
                .header("idempotency-key", "b-1")
                .body(vec![0u8, 0, 0, 0, 0])
                .send()
        };
        let first = send().await.expect("first");
        assert_eq!(
            &first.bytes().await.expect("body")[..],
            &[7u8, 0, 0, 0, 1, b'x']
        );
        let retry = send().await.expect("retry");
        match everything {
            false => assert_eq!(effects.count(), 2, "released"),
            true => {
                assert_eq!(effects.count(), 1, "recorded, never run again");
                assert_eq!(retry.headers()["grpc-status"], "9");
                assert_eq!(
                    retry.headers()["content-type"],
                    "application/grpc-web+proto"
                );
                let message = retry.headers()["grpc-message"].to_str().expect("ascii");
                assert!(
                    message.contains("gRPC%20status%202") || message.contains("gRPC status 2"),
                    "{message}"
                );
            }
        }
    }
}
