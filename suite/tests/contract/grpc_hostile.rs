//! Issue 19, attacked: plain gRPC over HTTP/2: what a record keeps when the
//! answer is over the limit, how a malformed `grpc-status` is classified, and codings edge
//! cases. Real tonic server, real tonic client, raw HTTP/2 where no client would send it.

use crate::common;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use common::{Effects, gzip};
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
use tower_idempotency::{IdempotencyLayer, IdempotencyStore, MemoryStore, ScopedKey};

#[derive(Clone, PartialEq, prost::Message)]
struct Empty {}

/// An empty message, then 4 KiB of trailers (limit 1 KiB): the body fits, the trailers not.
const BIG_TRAILERS: &str = "/rev.Rev/BigTrailers";
/// 120 KB of trailers on a 1 KiB route: the issue's own example.
const HUGE_TRAILERS: &str = "/rev.Rev/HugeTrailers";
/// 2 KiB of message (limit 256: streamed on), then 100 KB of trailers.
const LARGE_BODY_HUGE_TRAILERS: &str = "/rev.Rev/LargeBodyHugeTrailers";
/// grpc-status values that are not a status code as gRPC reads one.
const MALFORMED: &str = "/rev.Rev/Malformed";
/// A message frame and `grpc-encoding: identity` said out loud.
const IDENTITY_SAID: &str = "/rev.Rev/IdentitySaid";
/// gzip whatever the call accepts.
const ALWAYS_GZIP: &str = "/rev.Rev/AlwaysGzip";

#[derive(Clone, Default)]
struct Rev {
    effects: Effects,
    malformed: std::sync::Arc<std::sync::Mutex<String>>,
}

impl tonic::server::NamedService for Rev {
    const NAME: &'static str = "rev.Rev";
}

impl<B: Send + 'static> tower::Service<http::Request<B>> for Rev {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let n = self.effects.hit();
        let path = req.uri().path().to_owned();
        let malformed = self.malformed.lock().expect("lock").clone();
        Box::pin(async move {
            let mut t = HeaderMap::new();
            let mut head = HeaderMap::new();
            let mut message = vec![0u8, 0, 0, 0, 0];
            match path.as_str() {
                BIG_TRAILERS => {
                    t.insert("grpc-status", HeaderValue::from_static("0"));
                    t.insert(
                        "x-big",
                        HeaderValue::from_str(&"b".repeat(4096)).expect("v"),
                    );
                }
                HUGE_TRAILERS => {
                    t.insert("grpc-status", HeaderValue::from_static("0"));
                    for i in 0..30 {
                        t.append(
                            "x-huge",
                            HeaderValue::from_str(&format!("{i}{}", "h".repeat(4000))).expect("v"),
                        );
                    }
                }
                LARGE_BODY_HUGE_TRAILERS => {
                    message = vec![0u8, 0, 0, 0x08, 0x03, 0x0a, 0x80, 0x10];
                    message.extend(std::iter::repeat_n(b'm', 2048));
                    t.insert("grpc-status", HeaderValue::from_static("0"));
                    for i in 0..25 {
                        t.append(
                            "x-huge",
                            HeaderValue::from_str(&format!("{i}{}", "h".repeat(4000))).expect("v"),
                        );
                    }
                }
                MALFORMED => {
                    t.insert("grpc-status", HeaderValue::from_str(&malformed).expect("v"));
                }
                IDENTITY_SAID => {
                    head.insert("grpc-encoding", HeaderValue::from_static("identity"));
                    t.insert("grpc-status", HeaderValue::from_static("0"));
                }
                ALWAYS_GZIP => {
                    let zipped = gzip(&[]);
                    message = vec![1u8];
                    message.extend((zipped.len() as u32).to_be_bytes());
                    message.extend(zipped);
                    head.insert("grpc-encoding", HeaderValue::from_static("gzip"));
                    t.insert("grpc-status", HeaderValue::from_static("0"));
                }
                _ => {
                    t.insert("grpc-status", HeaderValue::from_static("12"));
                }
            }
            let _ = n;
            let frames = vec![
                Ok::<_, Infallible>(Frame::data(Bytes::from(message))),
                Ok(Frame::trailers(t)),
            ];
            let body = StreamBody::new(futures_util::stream::iter(frames));
            let mut res = http::Response::new(tonic::body::Body::new(body));
            *res.headers_mut() = head;
            res.headers_mut().insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/grpc"),
            );
            Ok(res)
        })
    }
}

fn layer(store: MemoryStore) -> IdempotencyLayer<MemoryStore, SingleTenant> {
    IdempotencyLayer::new_for_grpc(store)
        .single_tenant()
        .grpc_method(BIG_TRAILERS, |m| m.response_limit(1024))
        .grpc_method(HUGE_TRAILERS, |m| m.response_limit(1024))
        .grpc_method(LARGE_BODY_HUGE_TRAILERS, |m| m.response_limit(256))
        .grpc_method(MALFORMED, |m| m)
        .grpc_method(IDENTITY_SAID, |m| m)
        .grpc_method(ALWAYS_GZIP, |m| m)
}

async fn serve(store: MemoryStore, rev: Rev) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = Server::builder()
        .layer(layer(store))
        .add_service(rev)
        .serve_with_incoming(TcpIncoming::from(listener));
    tokio::spawn(async move { server.await.expect("grpc server") });
    addr
}

async fn call(
    addr: SocketAddr,
    path: &'static str,
    key: &str,
) -> Result<tonic::Response<Empty>, Status> {
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
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

/// A raw HTTP/2 call: head, body and trailers of the answer.
async fn h2_call(
    addr: SocketAddr,
    path: &str,
    key: &str,
    extra: &[(&'static str, &'static str)],
) -> (http::response::Parts, Bytes, Option<HeaderMap>) {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let io = TokioIo::new(tokio::net::TcpStream::connect(addr).await.expect("connect"));
    let (mut sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .max_header_list_size(4 << 20)
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
        .body(http_body_util::Full::new(Bytes::from_static(&[
            0, 0, 0, 0, 0,
        ])))
        .expect("request");
    let response = sender.send_request(request).await.expect("answer");
    let (parts, body) = response.into_parts();
    let collected = http_body_util::BodyExt::collect(body).await.expect("body");
    let trailers = collected.trailers().cloned();
    (parts, collected.to_bytes(), trailers)
}

fn weight(headers: &HeaderMap) -> usize {
    headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len())
        .sum()
}

async fn stored(store: &MemoryStore, key: &str) -> tower_idempotency::store::StoredResponse {
    store
        .lookup(&ScopedKey::new("", key))
        .await
        .expect("lookup")
        .expect("record")
        .response
        .expect("recorded")
}

/// §2: "every stored byte counts". A 4 KiB trailer on a 1 KiB route is recorded as not
/// stored — but are the 4 KiB of trailers kept in the record all the same?
#[tokio::test]
async fn s19_2_trailers_over_the_limit_are_not_stored_when_the_body_fits() {
    let store = MemoryStore::new();
    let rev = Rev::default();
    let addr = serve(store.clone(), rev.clone()).await;
    call(addr, BIG_TRAILERS, "big-1").await.expect("first");
    let record = stored(&store, "big-1").await;
    assert!(record.body.is_none(), "recorded without its response");
    let kept = record.trailers.as_ref().map_or(0, weight) + weight(&record.headers);
    assert!(
        kept <= 1024,
        "the record keeps {kept} bytes of head and trailers on a 1 KiB route: {:?}",
        record
            .trailers
            .as_ref()
            .map(|t| t.keys().collect::<Vec<_>>())
    );
}

/// §2, the issue's own example: 120 KB of trailers on a 1 KiB route.
#[tokio::test]
async fn s19_2_the_issues_120_kb_of_trailers_are_not_stored() {
    let store = MemoryStore::new();
    let rev = Rev::default();
    let addr = serve(store.clone(), rev.clone()).await;
    // tonic's client may refuse 120 KB of trailers; the raw client does not.
    let (_, _, trailers) = h2_call(addr, HUGE_TRAILERS, "huge-1", &[]).await;
    assert!(trailers.is_some_and(|t| t.contains_key("x-huge")));
    let record = stored(&store, "huge-1").await;
    let kept = record.trailers.as_ref().map_or(0, weight);
    assert!(
        kept <= 1024,
        "a 1 KiB route stored {kept} bytes of trailers"
    );
}

/// §2 on the streamed path: a body over the limit, then 100 KB of trailers.
#[tokio::test]
async fn s19_2_trailers_of_an_oversized_answer_are_not_stored() {
    let store = MemoryStore::new();
    let rev = Rev::default();
    let addr = serve(store.clone(), rev.clone()).await;
    let (_, body, trailers) = h2_call(addr, LARGE_BODY_HUGE_TRAILERS, "lh-1", &[]).await;
    assert!(body.len() > 2048);
    assert!(trailers.is_some_and(|t| t.contains_key("x-huge")));
    let record = stored(&store, "lh-1").await;
    assert!(record.body.is_none());
    let kept = record.trailers.as_ref().map_or(0, weight);
    assert!(
        kept <= 256,
        "a 256-byte route stored {kept} bytes of trailers"
    );
}

/// §4: a `grpc-status` that is not a status code is no success for a gRPC client (tonic reads
/// it as UNKNOWN). Under DefinitiveOnly it must not consume the key.
#[tokio::test]
async fn s19_4_a_malformed_grpc_status_is_unknown_not_success() {
    let mut wrong = Vec::new();
    for value in ["abc", "+0", " 0", "00", "0x0", "014", "2147483648"] {
        let rev = Rev::default();
        *rev.malformed.lock().expect("lock") = value.to_owned();
        let addr = serve(MemoryStore::new(), rev.clone()).await;
        let first = call(addr, MALFORMED, "m-1").await;
        let client_saw = first.as_ref().err().map(|s| s.code());
        let second = call(addr, MALFORMED, "m-1").await;
        let replayed = second
            .as_ref()
            .map(|r| r.metadata().contains_key("idempotency-replayed"))
            .unwrap_or(false);
        eprintln!(
            "grpc-status {value:?}: the client saw {client_saw:?}; second call {:?}, replayed \
             {replayed}, effects {}",
            second.as_ref().err().map(|s| s.code()),
            rev.effects.count()
        );
        if client_saw == Some(Code::Unknown) && rev.effects.count() != 2 {
            wrong.push(value);
        }
    }
    assert!(
        wrong.is_empty(),
        "grpc-status {wrong:?}: tonic reads UNKNOWN, the layer recorded it as definitive"
    );
}

/// §3: a record that says `grpc-encoding: identity` reaches any retry; a gzip record reaches a
/// retry that lists gzip however it spells the list (spaces, case), and no other.
#[tokio::test]
async fn s19_3_coding_lists_are_read_as_lists() {
    let rev = Rev::default();
    let addr = serve(MemoryStore::new(), rev.clone()).await;
    let (head, _, t) = h2_call(addr, IDENTITY_SAID, "i-1", &[]).await;
    assert_eq!(
        t.as_ref()
            .and_then(|t| t.get("grpc-status"))
            .map(|v| v.as_bytes()),
        Some(&b"0"[..]),
        "{head:?}"
    );
    let (head, body, t) = h2_call(addr, IDENTITY_SAID, "i-1", &[]).await;
    assert_eq!(head.headers["idempotency-replayed"], "true");
    assert_eq!(&body[..], &[0, 0, 0, 0, 0]);
    assert_eq!(t.expect("trailers")["grpc-status"], "0");

    let (head, _, _) = h2_call(
        addr,
        ALWAYS_GZIP,
        "g-1",
        &[("grpc-accept-encoding", "gzip")],
    )
    .await;
    assert_eq!(head.headers["grpc-encoding"], "gzip");
    for (list, accepted) in [
        (" identity , GZIP ", true),
        ("deflate,gzip", true),
        ("identity", false),
        ("gzipx", false),
        ("", false),
    ] {
        let (head, body, t) = h2_call(
            addr,
            ALWAYS_GZIP,
            "g-1",
            &[(
                "grpc-accept-encoding",
                Box::leak(list.to_owned().into_boxed_str()),
            )],
        )
        .await;
        let status = head
            .headers
            .get("grpc-status")
            .or(t.as_ref().and_then(|t| t.get("grpc-status")))
            .map(|v| v.to_str().expect("ascii").to_owned());
        match accepted {
            true => {
                assert_eq!(status.as_deref(), Some("0"), "{list:?}");
                assert_eq!(body.first(), Some(&1), "{list:?}");
            }
            false => assert_eq!(status.as_deref(), Some("9"), "{list:?}"),
        }
    }
    assert_eq!(rev.effects.count(), 2);
}
