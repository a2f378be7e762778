//! Issue 19 §3: a replay never reaches a client in a content coding it cannot decode. A guarded
//! request reaches its handler asking for identity, so what is recorded is uncompressed; an
//! answer compressed all the same is replayed only to retries that accept its coding, and any
//! other retry is told so (406 / FAILED_PRECONDITION), never run again. Proven with tonic's
//! gzip switched on and off, and over plain HTTP.

use crate::common;

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use common::{Effects, gzip};
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue};
use http_body::Frame;
use http_body_util::StreamBody;
use prost::Message;
use tokio::net::TcpListener;
use tonic::codec::CompressionEncoding;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Endpoint, Server};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower_idempotency::scope::SingleTenant;
use tower_idempotency::{IdempotencyLayer, IdempotencyStore, MemoryStore, ScopedKey};

/// Compressible on purpose: gzip makes it much smaller.
#[derive(Clone, PartialEq, Message)]
struct Text {
    #[prost(string, tag = "1")]
    text: String,
}

const ECHO: &str = "/codings.Codings/Echo";
/// Answers gzip whatever the call accepts, as a misbehaving server would.
const ALWAYS_GZIP: &str = "/codings.Codings/AlwaysGzip";

/// Counts its runs and notes the `grpc-accept-encoding` each run was sent.
#[derive(Clone, Default)]
struct Codings {
    effects: Effects,
    accepted: Arc<Mutex<Vec<Option<String>>>>,
}

impl tonic::server::NamedService for Codings {
    const NAME: &'static str = "codings.Codings";
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

fn answer(n: usize) -> Text {
    Text {
        text: format!("answer {n} ").repeat(200),
    }
}

impl<B> tower::Service<http::Request<B>> for Codings
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let accepted = req
            .headers()
            .get("grpc-accept-encoding")
            .map(|v| v.to_str().unwrap_or("?").to_owned());
        self.accepted.lock().expect("lock").push(accepted);
        let this = self.clone();
        Box::pin(async move {
            if req.uri().path() == ALWAYS_GZIP {
                let n = this.effects.hit();
                let message = gzip(&answer(n).encode_to_vec());
                let mut frame = BytesMut::new();
                frame.put_u8(1);
                frame.put_u32(message.len() as u32);
                frame.put_slice(&message);
                let mut trailers = HeaderMap::new();
                trailers.insert("grpc-status", HeaderValue::from_static("0"));
                let frames = vec![
                    Ok::<_, Infallible>(Frame::data(frame.freeze())),
                    Ok(Frame::trailers(trailers)),
                ];
                let mut res = http::Response::new(tonic::body::Body::new(StreamBody::new(
                    futures_util::stream::iter(frames),
                )));
                let headers = res.headers_mut();
                headers.insert("content-type", HeaderValue::from_static("application/grpc"));
                headers.insert("grpc-encoding", HeaderValue::from_static("gzip"));
                return Ok(res);
            }
            // tonic's own compression, both ways: it compresses an answer when the call
            // lists gzip in grpc-accept-encoding.
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Text, Text>::default())
                .accept_compressed(CompressionEncoding::Gzip)
                .send_compressed(CompressionEncoding::Gzip);
            Ok(grpc.unary(Echo(this), req).await)
        })
    }
}

struct Echo(Codings);

impl tonic::server::UnaryService<Text> for Echo {
    type Response = Text;
    type Future = BoxFuture<Result<tonic::Response<Text>, Status>>;

    fn call(&mut self, _: tonic::Request<Text>) -> Self::Future {
        let n = self.0.effects.hit();
        Box::pin(async move { Ok(tonic::Response::new(answer(n))) })
    }
}

async fn serve(store: MemoryStore, service: Codings) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let layer: IdempotencyLayer<MemoryStore, SingleTenant> = IdempotencyLayer::new_for_grpc(store)
        .single_tenant()
        .grpc_method(ECHO, |m| m)
        .grpc_method(ALWAYS_GZIP, |m| m);
    let server = Server::builder()
        .layer(layer)
        .add_service(service)
        .serve_with_incoming(TcpIncoming::from(listener));
    tokio::spawn(async move { server.await.expect("grpc server") });
    addr
}

/// How a client speaks: whether it sends gzip, and whether it reads it.
#[derive(Clone, Copy, Debug)]
struct Client {
    sends_gzip: bool,
    reads_gzip: bool,
}

const IDENTITY: Client = Client {
    sends_gzip: false,
    reads_gzip: false,
};
const READS_GZIP: Client = Client {
    sends_gzip: false,
    reads_gzip: true,
};
const SENDS_GZIP: Client = Client {
    sends_gzip: true,
    reads_gzip: true,
};

/// One call on a connection of its own, as an independent retry would make it.
async fn call(
    addr: SocketAddr,
    path: &'static str,
    key: &str,
    how: Client,
) -> Result<tonic::Response<Text>, Status> {
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let mut grpc = tonic::client::Grpc::new(channel);
    if how.sends_gzip {
        grpc = grpc.send_compressed(CompressionEncoding::Gzip);
    }
    if how.reads_gzip {
        grpc = grpc.accept_compressed(CompressionEncoding::Gzip);
    }
    grpc.ready().await.expect("ready");
    let mut request = tonic::Request::new(Text {
        text: "compress me ".repeat(100),
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

/// §3: the first call accepts gzip, the handler is asked for identity, the record is
/// uncompressed, and a retry that reads identity alone gets the replay: one effect, the same
/// answer for every client.
#[tokio::test]
async fn s19_3_gzip_and_identity_clients_share_a_key() {
    let store = MemoryStore::new();
    let service = Codings::default();
    let addr = serve(store.clone(), service.clone()).await;
    let first = call(addr, ECHO, "c-1", READS_GZIP).await.expect("first");
    assert_eq!(first.get_ref(), &answer(1));
    assert_eq!(
        service.accepted.lock().expect("lock").as_slice(),
        &[None],
        "the handler was asked for identity"
    );
    for how in [IDENTITY, READS_GZIP, IDENTITY] {
        let replay = call(addr, ECHO, "c-1", how).await.expect("replay");
        assert!(replay.metadata().contains_key("idempotency-replayed"));
        assert_eq!(replay.get_ref(), &answer(1), "{how:?}");
    }
    let record = store
        .lookup(&ScopedKey::new("", "c-1"))
        .await
        .expect("lookup")
        .expect("record");
    let stored = record.response.expect("recorded");
    assert!(
        !stored.headers.contains_key("grpc-encoding"),
        "{:?}",
        stored.headers
    );
    assert_eq!(stored.body.as_ref().map(|b| b[0]), Some(0), "uncompressed");
    assert_eq!(service.effects.count(), 1);

    // Without the layer tonic would have compressed it: the control that makes the above mean
    // something.
    let bare_addr = {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = Server::builder()
            .add_service(Codings::default())
            .serve_with_incoming(TcpIncoming::from(listener));
        tokio::spawn(async move { server.await.expect("grpc server") });
        addr
    };
    let encoding = {
        use hyper_util::rt::{TokioExecutor, TokioIo};
        let io = TokioIo::new(
            tokio::net::TcpStream::connect(bare_addr)
                .await
                .expect("connect"),
        );
        let (mut sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                .await
                .expect("h2");
        tokio::spawn(connection);
        let request = http::Request::post(format!("http://{bare_addr}{ECHO}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("grpc-accept-encoding", "gzip")
            .body(http_body_util::Full::new(Bytes::from_static(&[
                0, 0, 0, 0, 0,
            ])))
            .expect("request");
        let response = sender.send_request(request).await.expect("answer");
        response.headers().get("grpc-encoding").cloned()
    };
    assert_eq!(encoding.as_ref().map(|v| v.as_bytes()), Some(&b"gzip"[..]));
}

/// §3: a call whose request is compressed is guarded like any other (its fingerprint is its
/// bytes as sent); the same client's retry replays, and one that sends the same message
/// uncompressed is a different request.
#[tokio::test]
async fn s19_3_a_compressed_request_is_guarded_by_its_bytes() {
    let service = Codings::default();
    let addr = serve(MemoryStore::new(), service.clone()).await;
    call(addr, ECHO, "c-2", SENDS_GZIP).await.expect("first");
    let replay = call(addr, ECHO, "c-2", SENDS_GZIP).await.expect("replay");
    assert!(replay.metadata().contains_key("idempotency-replayed"));
    let other = call(addr, ECHO, "c-2", READS_GZIP)
        .await
        .expect_err("other bytes");
    assert_eq!(other.code(), Code::FailedPrecondition, "{other:?}");
    assert_eq!(service.effects.count(), 1);
}

/// §3: an answer compressed whatever the call asked for is replayed to a retry that reads
/// gzip, and refused, by name and never run again, to one that reads identity alone (tonic
/// would fail to decode it).
#[tokio::test]
async fn s19_3_a_compressed_record_reaches_only_retries_that_read_it() {
    let service = Codings::default();
    let addr = serve(MemoryStore::new(), service.clone()).await;
    let first = call(addr, ALWAYS_GZIP, "c-3", READS_GZIP)
        .await
        .expect("first");
    assert_eq!(first.get_ref(), &answer(1));
    let refused = call(addr, ALWAYS_GZIP, "c-3", IDENTITY)
        .await
        .expect_err("a coding it cannot read");
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(
        refused.message().contains("\"gzip\""),
        "{}",
        refused.message()
    );
    let details = String::from_utf8_lossy(refused.details()).into_owned();
    assert!(details.contains("ENCODING_NOT_ACCEPTED"), "{details}");
    let replay = call(addr, ALWAYS_GZIP, "c-3", READS_GZIP)
        .await
        .expect("replay");
    assert_eq!(replay.get_ref(), &answer(1));
    assert_eq!(service.effects.count(), 1);
}

/// §3 over HTTP: the handler is asked for identity; an answer it compresses all the same is
/// replayed to retries whose `Accept-Encoding` takes it (none sent counts, RFC 9110), and a
/// retry that refuses it gets 406 `encoding-not-accepted`, naming the coding.
#[tokio::test]
async fn s19_3_http_records_identity_and_replays_only_what_a_retry_accepts() {
    let effects = Effects::default();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let (sink, saw) = (effects.clone(), seen.clone());
    let app = axum::Router::new()
        .route(
            "/compressed",
            axum::routing::post(move |headers: http::HeaderMap| async move {
                sink.hit();
                let accept = headers
                    .get("accept-encoding")
                    .map(|v| v.to_str().unwrap_or("?").to_owned())
                    .unwrap_or_default();
                saw.lock().expect("lock").push(accept);
                (
                    [("content-encoding", "gzip"), ("content-type", "text/plain")],
                    gzip(b"refund 42 issued"),
                )
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = common::serve(app).await;
    let send = |accept: Option<&'static str>| {
        let mut req = common::client()
            .post(format!("http://{addr}/compressed"))
            .header("idempotency-key", "h-1");
        if let Some(accept) = accept {
            req = req.header("accept-encoding", accept);
        }
        req.send()
    };
    let first = send(Some("gzip, br")).await.expect("first");
    assert_eq!(first.headers()["content-encoding"], "gzip");
    let body = first.bytes().await.expect("body");
    assert_eq!(&body[..], &gzip(b"refund 42 issued")[..]);
    assert_eq!(seen.lock().expect("lock").as_slice(), &["identity"]);

    let refused = send(Some("identity")).await.expect("retry");
    assert_eq!(refused.status(), 406);
    let problem: serde_json::Value = refused.json().await.expect("problem");
    assert_eq!(
        problem["type"],
        "urn:tower-idempotency:problem:encoding-not-accepted"
    );
    assert_eq!(problem["state"], "completed");
    assert!(
        problem["detail"]
            .as_str()
            .is_some_and(|d| d.contains("gzip"))
    );

    for accept in [Some("gzip"), None, Some("*")] {
        let replay = send(accept).await.expect("replay");
        assert_eq!(replay.status(), 200, "{accept:?}");
        assert_eq!(replay.headers()["idempotency-replayed"], "true");
        assert_eq!(&replay.bytes().await.expect("body")[..], &body[..]);
    }
    assert_eq!(effects.count(), 1);
}

/// §3: the refusal's `google.rpc` details, decoded: the reason and the key's state.
#[tokio::test]
async fn s19_3_the_refusal_says_the_outcome_is_recorded() {
    #[derive(Clone, PartialEq, Message)]
    struct RpcStatus {
        #[prost(int32, tag = "1")]
        code: i32,
        #[prost(message, repeated, tag = "3")]
        details: Vec<Any>,
    }
    #[derive(Clone, PartialEq, Message)]
    struct Any {
        #[prost(string, tag = "1")]
        type_url: String,
        #[prost(bytes = "vec", tag = "2")]
        value: Vec<u8>,
    }
    #[derive(Clone, PartialEq, Message)]
    struct ErrorInfo {
        #[prost(string, tag = "1")]
        reason: String,
        #[prost(map = "string, string", tag = "3")]
        metadata: HashMap<String, String>,
    }
    let service = Codings::default();
    let addr = serve(MemoryStore::new(), service.clone()).await;
    call(addr, ALWAYS_GZIP, "c-4", READS_GZIP)
        .await
        .expect("first");
    let refused = call(addr, ALWAYS_GZIP, "c-4", IDENTITY)
        .await
        .expect_err("refused");
    let status = RpcStatus::decode(refused.details()).expect("google.rpc.Status");
    assert_eq!(status.code, Code::FailedPrecondition as i32);
    let info = status
        .details
        .iter()
        .find(|d| d.type_url.ends_with("ErrorInfo"))
        .map(|d| ErrorInfo::decode(&d.value[..]).expect("ErrorInfo"))
        .expect("ErrorInfo");
    assert_eq!(info.reason, "ENCODING_NOT_ACCEPTED");
    assert_eq!(info.metadata["state"], "completed");
    assert_eq!(service.effects.count(), 1);
}
