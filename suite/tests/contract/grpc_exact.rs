//! Issue 19 §1, §2 and §4 (its first point), with a real tonic client against a hand-written
//! service that ends its calls with trailers of its own: trailers pass the deny list, their
//! bytes count against the record limit, and a call that never says how it ended is UNKNOWN.

use crate::common;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use common::Effects;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue};
use http_body::Frame;
use http_body_util::StreamBody;
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Endpoint, Server};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower_idempotency::scope::SingleTenant;
use tower_idempotency::{IdempotencyLayer, MemoryStore};

#[derive(Clone, PartialEq, prost::Message)]
struct Empty {}

const SECRET: &str = "/trail.Trail/Secret";
const BIG: &str = "/trail.Trail/Big";
const NO_STATUS: &str = "/trail.Trail/NoStatus";
const LARGE_OK: &str = "/trail.Trail/LargeOk";
const LARGE_UNAVAILABLE: &str = "/trail.Trail/LargeUnavailable";
const STREAMY: &str = "/trail.Trail/Streamy";

/// A service that answers one empty message and then trailers of its own choosing.
#[derive(Clone, Default)]
struct Trail {
    effects: Effects,
}

impl tonic::server::NamedService for Trail {
    const NAME: &'static str = "trail.Trail";
}

fn trailers(path: &str, n: usize) -> HeaderMap {
    let mut t = HeaderMap::new();
    let mut put = |name: &'static str, value: String| {
        t.insert(name, HeaderValue::from_str(&value).expect("value"));
    };
    match path {
        SECRET => {
            put("grpc-status", "0".into());
            put("set-cookie", format!("session=call-{n}"));
            put("authorization", format!("Bearer call-{n}"));
            put("x-request-id", format!("req-{n}"));
            put("traceparent", format!("00-{n:032x}-00f067aa0ba902b7-01"));
            put("grpc-trace-bin", "AAAA".into());
            put("x-operation", "ticket-created".into());
        }
        BIG => {
            put("grpc-status", "0".into());
            put("x-big", "b".repeat(4096));
        }
        LARGE_OK | STREAMY => put("grpc-status", "0".into()),
        LARGE_UNAVAILABLE => {
            put("grpc-status", "14".into());
            put("grpc-message", "the ledger is down".into());
        }
        _ => put("x-no-status", "the server forgot".into()),
    }
    t
}

impl<B: Send + 'static> tower::Service<http::Request<B>> for Trail {
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
            // One message, then the trailers. The large ones carry 2 KiB in an unknown
            // field (which an empty message skips), in two frames.
            let large = path == LARGE_OK || path == LARGE_UNAVAILABLE;
            let message = if large {
                let mut m = vec![0u8, 0, 0, 0x08, 0x03, 0x0a, 0x80, 0x10];
                m.extend(std::iter::repeat_n(b'm', 2048));
                m
            } else {
                vec![0, 0, 0, 0, 0]
            };
            let (first, second) = message.split_at(message.len() / 2);
            let frames = vec![
                Ok::<_, Infallible>(Frame::data(Bytes::copy_from_slice(first))),
                Ok(Frame::data(Bytes::copy_from_slice(second))),
                Ok(Frame::trailers(trailers(&path, n))),
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

async fn serve(layer: IdempotencyLayer<MemoryStore, SingleTenant>, trail: Trail) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = Server::builder()
        .layer(layer)
        .add_service(trail)
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

async fn call(
    addr: SocketAddr,
    path: &'static str,
    key: &str,
) -> Result<tonic::Response<Empty>, Status> {
    let mut grpc = client(addr).await;
    let mut request = tonic::Request::new(Empty {});
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

fn layer(store: MemoryStore) -> IdempotencyLayer<MemoryStore, SingleTenant> {
    IdempotencyLayer::new_for_grpc(store)
        .single_tenant()
        .grpc_method(SECRET, |m| m)
        .grpc_method(BIG, |m| m.response_limit(1024))
        .grpc_method(NO_STATUS, |m| m)
        .grpc_method(LARGE_OK, |m| m.response_limit(256))
        .grpc_method(LARGE_UNAVAILABLE, |m| m.response_limit(256))
        .grpc_method(STREAMY, |m| m)
}

/// §1: the first caller gets its trailers as sent; the record and every retry keep only what
/// the deny list allows: no cookie, no credentials, no request id or trace context.
#[tokio::test]
async fn s19_1_trailers_pass_the_deny_list() {
    let store = MemoryStore::new();
    let trail = Trail::default();
    let addr = serve(layer(store.clone()), trail.clone()).await;
    let first = call(addr, SECRET, "t-1").await.expect("first");
    assert_eq!(
        first.metadata().get("set-cookie").map(|v| v.to_str().ok()),
        Some(Some("session=call-1"))
    );
    let replay = call(addr, SECRET, "t-1").await.expect("replay");
    let meta = replay.metadata();
    assert!(meta.contains_key("idempotency-replayed"), "{meta:?}");
    for denied in [
        "set-cookie",
        "authorization",
        "x-request-id",
        "traceparent",
        "grpc-trace-bin",
    ] {
        assert!(
            !meta.contains_key(denied),
            "{denied} reached a retry: {meta:?}"
        );
    }
    assert_eq!(
        meta.get("x-operation").and_then(|v| v.to_str().ok()),
        Some("ticket-created"),
        "what describes the operation is kept"
    );
    assert_eq!(trail.effects.count(), 1);
    // Nor does the store hold them.
    let record = tower_idempotency::IdempotencyStore::lookup(
        &store,
        &tower_idempotency::ScopedKey::new("", "t-1"),
    )
    .await
    .expect("lookup")
    .expect("the record (single tenant: an empty scope)");
    let stored = record
        .response
        .expect("recorded")
        .trailers
        .unwrap_or_default();
    assert!(!stored.contains_key("set-cookie") && !stored.contains_key("authorization"));
    assert!(stored.contains_key("x-operation"));
}

/// §2: trailer bytes count against the record limit: 4 KiB of trailers on a route that keeps
/// 1 KiB is recorded as completed without its response, never stored whole.
#[tokio::test]
async fn s19_2_trailer_bytes_count_against_the_limit() {
    let trail = Trail::default();
    let addr = serve(layer(MemoryStore::new()), trail.clone()).await;
    let first = call(addr, BIG, "b-1")
        .await
        .expect("the first caller gets it all");
    assert_eq!(first.metadata().get("x-big").map(|v| v.len()), Some(4096));
    let retry = call(addr, BIG, "b-1").await.expect_err("not stored");
    assert_eq!(retry.code(), Code::FailedPrecondition, "{retry:?}");
    assert_eq!(trail.effects.count(), 1, "completed: never run again");
}

/// §4: an answer that never says how the call ended is UNKNOWN, not a success: under the
/// default policy the key is given back, and the retry runs.
#[tokio::test]
async fn s19_4_no_grpc_status_is_unknown_not_success() {
    let trail = Trail::default();
    let addr = serve(layer(MemoryStore::new()), trail.clone()).await;
    let first = call(addr, NO_STATUS, "n-1").await;
    assert!(
        first.is_err(),
        "tonic reads a missing status as an error: {first:?}"
    );
    let retry = call(addr, NO_STATUS, "n-1").await;
    assert!(retry.is_err());
    assert_eq!(
        trail.effects.count(),
        2,
        "released, not replayed as a success"
    );
}

/// §4: an answer too large to keep is classified by its final status before the key is
/// consumed: an UNAVAILABLE gives the key back (the retry runs), an OK consumes it (the retry
/// is told the response was not stored); either way the first caller gets it all.
#[tokio::test]
async fn s19_4_an_oversized_answer_is_classified_by_its_final_status() {
    let trail = Trail::default();
    let addr = serve(layer(MemoryStore::new()), trail.clone()).await;
    let failed = call(addr, LARGE_UNAVAILABLE, "l-1")
        .await
        .expect_err("unavailable");
    assert_eq!(failed.code(), Code::Unavailable);
    assert_eq!(failed.message(), "the ledger is down");
    let again = call(addr, LARGE_UNAVAILABLE, "l-1")
        .await
        .expect_err("runs again");
    assert_eq!(again.code(), Code::Unavailable);
    assert_eq!(trail.effects.count(), 2, "released: the retry ran");

    call(addr, LARGE_OK, "l-2")
        .await
        .expect("the first caller gets the whole answer");
    let retry = call(addr, LARGE_OK, "l-2").await.expect_err("not stored");
    assert_eq!(retry.code(), Code::FailedPrecondition, "{retry:?}");
    assert_eq!(trail.effects.count(), 3, "consumed: never run again");
}

/// A client-streaming call of `messages`, then (`hold_open`) a stream that never ends, as a
/// bidi client waiting for a reply before it sends more.
async fn stream_call(addr: SocketAddr, key: &str, messages: usize, hold_open: bool) -> Status {
    let mut grpc = client(addr).await;
    let sent = futures_util::stream::iter(std::iter::repeat_n(Empty {}, messages));
    let outbound: Pin<Box<dyn futures_util::Stream<Item = Empty> + Send>> = match hold_open {
        true => Box::pin(futures_util::StreamExt::chain(
            sent,
            futures_util::stream::pending(),
        )),
        false => Box::pin(sent),
    };
    let mut request = tonic::Request::new(outbound);
    request
        .metadata_mut()
        .insert("idempotency-key", key.parse().expect("ascii"));
    // A bound on the test only, far past the layer's own: a hang fails it, not the suite.
    let call = grpc.client_streaming::<_, Empty, Empty, _>(
        request,
        PathAndQuery::from_static(STREAMY),
        ProstCodec::default(),
    );
    match tokio::time::timeout(std::time::Duration::from_secs(30), call).await {
        Ok(Err(status)) => status,
        Ok(Ok(_)) => panic!("a streaming call ran under the layer"),
        Err(_) => panic!("the streaming call hung"),
    }
}

/// §5: a streaming call to a guarded method is refused before anything is claimed or run,
/// never buffered until a client that waits for a reply gives up: a second message is refused
/// at once, a stream held open after its first message soon after.
#[tokio::test]
async fn s19_5_streaming_calls_are_refused_never_hang() {
    let trail = Trail::default();
    let addr = serve(layer(MemoryStore::new()), trail.clone()).await;
    let two = stream_call(addr, "s-1", 2, false).await;
    assert_eq!(two.code(), Code::InvalidArgument, "{two:?}");
    assert!(
        two.message().contains("second message"),
        "{}",
        two.message()
    );
    let open = stream_call(addr, "s-2", 1, true).await;
    assert_eq!(open.code(), Code::InvalidArgument, "{open:?}");
    assert!(open.message().contains("stayed open"), "{}", open.message());
    assert_eq!(trail.effects.count(), 0, "nothing ran");
    // A unary call to the same method is guarded as ever.
    call(addr, STREAMY, "s-3").await.expect("unary");
    call(addr, STREAMY, "s-3").await.expect("replay");
    assert_eq!(trail.effects.count(), 1);
}

/// Review finding: a stream that sends no message at all (a bidi client waiting for the
/// server to speak first) is refused too, never left to hang.
#[tokio::test]
async fn s19_5_a_stream_that_sends_nothing_is_refused() {
    let trail = Trail::default();
    let addr = serve(layer(MemoryStore::new()), trail.clone()).await;
    let silent = stream_call(addr, "s-9", 0, true).await;
    assert_eq!(silent.code(), Code::InvalidArgument, "{silent:?}");
    assert!(
        silent.message().contains("sent no message"),
        "{}",
        silent.message()
    );
    assert_eq!(trail.effects.count(), 0);
}

/// Review finding: gRPC-Web carries its status in a frame of its body, not in trailers: an OK
/// answer is recorded and replayed, not taken for one that never said how it ended.
#[tokio::test]
async fn s19_4_grpc_web_answers_are_not_taken_for_missing_statuses() {
    let effects = Effects::default();
    let sink = effects.clone();
    let app = axum::Router::new()
        .route(
            "/w.W/Call",
            axum::routing::post(move || async move {
                sink.hit();
                let mut body = vec![0u8, 0, 0, 0, 0];
                let trailer = b"grpc-status:0\r\n";
                body.push(0x80);
                body.extend((trailer.len() as u32).to_be_bytes());
                body.extend(trailer);
                ([("content-type", "application/grpc-web+proto")], body)
            }),
        )
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = common::serve(app).await;
    for i in 0..3 {
        let res = common::client()
            .post(format!("http://{addr}/w.W/Call"))
            .header("content-type", "application/grpc-web+proto")
            .header("idempotency-key", "w-1")
            .body(vec![0u8, 0, 0, 0, 0])
            .send()
            .await
            .expect("call");
        assert_eq!(res.status(), http::StatusCode::OK);
        assert_eq!(
            res.headers().contains_key("idempotency-replayed"),
            i > 0,
            "call {i}"
        );
    }
    assert_eq!(effects.count(), 1);
}

/// Review finding: a client that hangs up on an answer too large to keep stops it, as it
/// would without the layer: the inner stream is dropped, and the key is recorded by its head.
#[tokio::test]
async fn s19_4_a_hang_up_stops_an_oversized_stream() {
    use std::sync::atomic::{AtomicBool, Ordering};
    struct Dropped(Arc<AtomicBool>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let dropped = Arc::new(AtomicBool::new(false));
    let flag = dropped.clone();
    let app = axum::Router::new()
        .route(
            "/s.S/Endless",
            axum::routing::post(move || {
                let guard = Dropped(flag.clone());
                async move {
                    let frames = futures_util::stream::unfold(guard, |guard| async move {
                        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                        let mut message = vec![0u8, 0, 0, 4, 0];
                        message.extend(std::iter::repeat_n(b'm', 1024));
                        Some((Ok::<_, Infallible>(Bytes::from(message)), guard))
                    });
                    (
                        [("content-type", "application/grpc")],
                        axum::body::Body::from_stream(frames),
                    )
                }
            }),
        )
        .route_layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .response_limit(256),
        );
    let addr = common::serve(app).await;
    let mut res = common::client()
        .post(format!("http://{addr}/s.S/Endless"))
        .header("content-type", "application/grpc")
        .header("idempotency-key", "e-1")
        .body(vec![0u8, 0, 0, 0, 0])
        .send()
        .await
        .expect("call");
    for _ in 0..3 {
        res.chunk().await.expect("a frame").expect("more");
    }
    drop(res);
    // Bounded for the test only: the stream must go once the client has.
    for _ in 0..200 {
        if dropped.load(Ordering::SeqCst) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    assert!(
        dropped.load(Ordering::SeqCst),
        "the inner stream is dropped after the hang-up"
    );
}

/// §5, hostile framing: a unary call whose message comes a byte per frame (its 5-byte prefix
/// split too), then ends its stream, is one message: guarded and replayed, never refused as
/// a stream. Sent raw over HTTP/2, as no client library would cut it.
#[tokio::test]
async fn s19_5_a_message_cut_into_single_bytes_is_still_unary() {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let trail = Trail::default();
    let addr = serve(layer(MemoryStore::new()), trail.clone()).await;
    let send = || async move {
        let io = TokioIo::new(tokio::net::TcpStream::connect(addr).await.expect("connect"));
        let (mut sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                .await
                .expect("h2");
        tokio::spawn(connection);
        // An empty message with an unknown field of 3 bytes: 5 + 5 bytes, one per frame.
        let message: Vec<u8> = vec![0, 0, 0, 0, 5, 0x0a, 3, b'a', b'b', b'c'];
        let frames = message
            .into_iter()
            .map(|b| Ok::<_, Infallible>(Frame::data(Bytes::from(vec![b]))));
        let body = StreamBody::new(futures_util::stream::iter(frames.collect::<Vec<_>>()));
        let request = http::Request::post(format!("http://{addr}{STREAMY}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("idempotency-key", "bytes-1")
            .body(body)
            .expect("request");
        let response = sender.send_request(request).await.expect("answer");
        let replayed = response.headers().contains_key("idempotency-replayed");
        let status = response.headers().get("grpc-status").cloned();
        let collected = http_body_util::BodyExt::collect(response.into_body())
            .await
            .expect("body");
        let trailer_status = collected
            .trailers()
            .and_then(|t| t.get("grpc-status").cloned());
        (replayed, status.or(trailer_status))
    };
    let (replayed, status) = send().await;
    assert_eq!(
        status.as_ref().map(|s| s.as_bytes()),
        Some(&b"0"[..]),
        "run, not refused"
    );
    assert!(!replayed);
    let (replayed, status) = send().await;
    assert_eq!(status.as_ref().map(|s| s.as_bytes()), Some(&b"0"[..]));
    assert!(replayed, "the same call again is a replay");
    assert_eq!(trail.effects.count(), 1);
}

/// Review finding: a record kept before a name joined the deny list (an older version, or
/// other settings) still holds that trailer: a replay filters trailers again, with the
/// current list.
#[tokio::test]
async fn s19_1_a_replay_filters_trailers_kept_under_another_deny_list() {
    let store = MemoryStore::new();
    let trail = Trail::default();
    let before = serve(layer(store.clone()), trail.clone()).await;
    let first = call(before, SECRET, "d-1").await.expect("first");
    assert!(first.metadata().contains_key("x-operation"));
    let kept = call(before, SECRET, "d-1").await.expect("replay as kept");
    assert!(
        kept.metadata().contains_key("x-operation"),
        "kept under the old list"
    );

    let stricter = layer(store.clone()).deny_header(http::HeaderName::from_static("x-operation"));
    let after = serve(stricter, trail.clone()).await;
    let replay = call(after, SECRET, "d-1").await.expect("replay");
    assert!(replay.metadata().contains_key("idempotency-replayed"));
    assert!(
        !replay.metadata().contains_key("x-operation"),
        "{:?}",
        replay.metadata()
    );
    assert_eq!(trail.effects.count(), 1);
}
