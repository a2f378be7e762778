//! DESIGN §1 (gRPC column), §3 (gRPC codes) and §7 in gRPC form: a real tonic server and a
//! real tonic client over loopback TCP, effects counted in the handler. The service is written
//! by hand with prost messages: no `protoc`.

use crate::common;

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::routing::post;
use bytes::{BufMut, Bytes, BytesMut};
use common::{Effects, FlakyStore, client, serve};
use http::HeaderMap;
use http::uri::PathAndQuery;
use http_body_util::{BodyExt, Full};
use prost::Message;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Barrier;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower_idempotency::scope::SingleTenant;
use tower_idempotency::{
    CachePolicy, IdempotencyContext, IdempotencyLayer, IdempotencyStore, MemoryStore,
};

const CREATE: &str = "/tickets.Tickets/CreateTicket";
const GET: &str = "/tickets.Tickets/GetTicket";

#[derive(Clone, PartialEq, Message)]
struct CreateTicket {
    #[prost(string, tag = "1")]
    title: String,
    /// How long the handler works before answering.
    #[prost(uint64, tag = "2")]
    work_ms: u64,
    /// A gRPC code to fail with on the key's first attempt (0: succeed).
    #[prost(int32, tag = "3")]
    fail_first: i32,
}

#[derive(Clone, PartialEq, Message)]
struct Ticket {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(string, tag = "2")]
    title: String,
}

// google.rpc.Status and the two details the middleware sends, to decode its answers.
#[derive(Clone, PartialEq, Message)]
struct RpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
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
    #[prost(string, tag = "2")]
    domain: String,
    #[prost(map = "string, string", tag = "3")]
    metadata: HashMap<String, String>,
}

#[derive(Clone, PartialEq, Message)]
struct RetryInfo {
    #[prost(message, optional, tag = "1")]
    retry_delay: Option<ProtoDuration>,
}

#[derive(Clone, PartialEq, Message)]
struct ProtoDuration {
    #[prost(int64, tag = "1")]
    seconds: i64,
    #[prost(int32, tag = "2")]
    nanos: i32,
}

/// The ticket service, hand-written the way tonic's generated servers are.
#[derive(Clone, Default)]
struct Tickets {
    effects: Effects,
}

impl tonic::server::NamedService for Tickets {
    const NAME: &'static str = "tickets.Tickets";
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<B> tower::Service<http::Request<B>> for Tickets
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
        let handler = Create(self.clone());
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Ticket, CreateTicket>::default());
            Ok(match req.uri().path() {
                CREATE | GET => grpc.unary(handler, req).await,
                _ => Status::unimplemented("no such method").into_http(),
            })
        })
    }
}

struct Create(Tickets);

impl tonic::server::UnaryService<CreateTicket> for Create {
    type Response = Ticket;
    type Future = BoxFuture<Result<tonic::Response<Ticket>, Status>>;

    fn call(&mut self, request: tonic::Request<CreateTicket>) -> Self::Future {
        let effects = self.0.effects.clone();
        // The layer hands guarded calls their context, through tonic's request extensions.
        let attempt = request
            .extensions()
            .get::<IdempotencyContext>()
            .map(IdempotencyContext::attempt);
        Box::pin(async move {
            let input = request.into_inner();
            tokio::time::sleep(Duration::from_millis(input.work_ms)).await;
            let n = effects.hit() as u64;
            if input.fail_first != 0 && attempt == Some(1) {
                let mut metadata = tonic::metadata::MetadataMap::new();
                metadata.insert("x-ticket-error", "first-attempt".parse().expect("ascii"));
                return Err(Status::with_details_and_metadata(
                    Code::from_i32(input.fail_first),
                    format!("attempt {n} failed"),
                    Bytes::from_static(b"\x08\x01opaque details"),
                    metadata,
                ));
            }
            let mut response = tonic::Response::new(Ticket {
                id: n,
                title: input.title,
            });
            response
                .metadata_mut()
                .insert("x-ticket-id", n.to_string().parse().expect("ascii"));
            Ok(response)
        })
    }
}

async fn serve_grpc<St: IdempotencyStore>(
    layer: IdempotencyLayer<St, SingleTenant>,
    tickets: Tickets,
) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = Server::builder()
        .layer(layer)
        .add_service(tickets)
        .serve_with_incoming(TcpIncoming::from(listener));
    tokio::spawn(async move { server.await.expect("grpc server") });
    addr
}

/// A layer guarding CreateTicket only, as a server-wide tonic layer would be set up.
fn layer<St: IdempotencyStore>(store: St) -> IdempotencyLayer<St, SingleTenant> {
    IdempotencyLayer::new_for_grpc(store)
        .single_tenant()
        .grpc_method(CREATE, |m| m)
}

/// A new channel: its own HTTP/2 connection, as an independent retry would have.
async fn channel(addr: SocketAddr) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect")
}

async fn call(
    addr: SocketAddr,
    path: &'static str,
    key: Option<&str>,
    message: CreateTicket,
    deadline: Option<Duration>,
) -> Result<tonic::Response<Ticket>, Status> {
    let mut grpc = tonic::client::Grpc::new(channel(addr).await);
    grpc.ready().await.expect("ready");
    let mut request = tonic::Request::new(message);
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse().expect("ascii key"));
    }
    if let Some(deadline) = deadline {
        request.set_timeout(deadline);
    }
    grpc.unary(
        request,
        PathAndQuery::from_static(path),
        ProstCodec::default(),
    )
    .await
}

fn ticket(title: &str) -> CreateTicket {
    CreateTicket {
        title: title.to_owned(),
        ..Default::default()
    }
}

fn replayed<T>(response: &tonic::Response<T>) -> bool {
    response
        .metadata()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true")
}

/// The ErrorInfo (and RetryInfo, if any) in a status from the middleware.
fn details(status: &Status) -> (ErrorInfo, Option<Duration>) {
    let rpc = RpcStatus::decode(status.details()).expect("google.rpc.Status in the details");
    assert_eq!(rpc.code, status.code() as i32);
    let mut info = None;
    let mut retry = None;
    for any in rpc.details {
        match any.type_url.as_str() {
            "type.googleapis.com/google.rpc.ErrorInfo" => {
                info = Some(ErrorInfo::decode(&any.value[..]).expect("ErrorInfo"));
            }
            "type.googleapis.com/google.rpc.RetryInfo" => {
                let delay = RetryInfo::decode(&any.value[..])
                    .expect("RetryInfo")
                    .retry_delay;
                retry = delay.map(|d| Duration::new(d.seconds as u64, d.nanos as u32));
            }
            other => panic!("unexpected detail {other}"),
        }
    }
    let info = info.expect("an ErrorInfo detail");
    assert_eq!(info.domain, "tower-idempotency");
    (info, retry)
}

#[tokio::test]
async fn s7_1_grpc_same_key_twice_runs_once_and_replays() {
    let tickets = Tickets::default();
    let addr = serve_grpc(layer(MemoryStore::new()), tickets.clone()).await;

    let first = call(addr, CREATE, Some("g-1"), ticket("printer"), None)
        .await
        .expect("first");
    assert!(!replayed(&first));
    let second = call(addr, CREATE, Some("g-1"), ticket("printer"), None)
        .await
        .expect("second");
    assert!(
        replayed(&second),
        "the replay carries idempotency-replayed: true"
    );
    assert_eq!(
        second.metadata().get("x-ticket-id"),
        first.metadata().get("x-ticket-id")
    );
    assert_eq!(second.into_inner(), first.into_inner());
    assert_eq!(tickets.effects.count(), 1);
}

#[tokio::test]
async fn s7_2_grpc_changed_message_is_failed_precondition() {
    let tickets = Tickets::default();
    let addr = serve_grpc(layer(MemoryStore::new()), tickets.clone()).await;

    call(addr, CREATE, Some("g-2"), ticket("a"), None)
        .await
        .expect("first");
    let changed = call(addr, CREATE, Some("g-2"), ticket("b"), None)
        .await
        .expect_err("mismatch");
    assert_eq!(changed.code(), Code::FailedPrecondition);
    // Issue 20 §10: the message speaks gRPC (a call has no path or query to change).
    assert!(
        changed.message().contains("method or request message")
            && !changed.message().contains("query"),
        "{}",
        changed.message()
    );
    let (info, retry) = details(&changed);
    assert_eq!(info.reason, "FINGERPRINT_MISMATCH");
    assert_eq!(info.metadata["state"], "completed");
    assert_eq!(info.metadata["safe_new_key"], "true");
    assert_eq!(retry, None);
    let same = call(addr, CREATE, Some("g-2"), ticket("a"), None)
        .await
        .expect("replay");
    assert!(replayed(&same));
    assert_eq!(tickets.effects.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_3_grpc_concurrent_burst_has_one_effect() {
    const N: usize = 32;
    let tickets = Tickets::default();
    let addr = serve_grpc(layer(MemoryStore::new()), tickets.clone()).await;
    let barrier = Arc::new(Barrier::new(N));
    let tasks: Vec<_> = (0..N)
        .map(|_| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                let ch = channel(addr).await;
                let mut grpc = tonic::client::Grpc::new(ch);
                grpc.ready().await.expect("ready");
                let mut request = tonic::Request::new(CreateTicket {
                    title: "burst".into(),
                    work_ms: 200,
                    fail_first: 0,
                });
                request
                    .metadata_mut()
                    .insert("idempotency-key", "g-burst".parse().expect("key"));
                barrier.wait().await;
                grpc.unary(
                    request,
                    PathAndQuery::from_static(CREATE),
                    ProstCodec::<_, Ticket>::default(),
                )
                .await
            })
        })
        .collect();
    let (mut ran, mut replays, mut aborted) = (0, 0, 0);
    for task in tasks {
        match task.await.expect("task") {
            Ok(res) if replayed(&res) => replays += 1,
            Ok(_) => ran += 1,
            Err(status) if status.code() == Code::Aborted => {
                let (info, retry) = details(&status);
                assert_eq!(info.reason, "IN_FLIGHT");
                assert!(retry.is_some(), "in flight carries a RetryInfo");
                aborted += 1;
            }
            Err(status) => panic!("unexpected {status:?}"),
        }
    }
    assert_eq!(ran, 1);
    assert_eq!(ran + replays + aborted, N);
    assert_eq!(tickets.effects.count(), 1, "exactly one effect at the sink");
}

#[tokio::test]
async fn s7_5_grpc_deadline_does_not_cancel_the_handler_and_the_retry_replays() {
    let tickets = Tickets::default();
    let addr = serve_grpc(layer(MemoryStore::new()), tickets.clone()).await;
    let slow = CreateTicket {
        title: "slow".into(),
        work_ms: 800,
        fail_first: 0,
    };

    let timed_out = call(
        addr,
        CREATE,
        Some("g-5"),
        slow.clone(),
        Some(Duration::from_millis(150)),
    )
    .await
    .expect_err("the client's deadline passes first");
    assert!(
        matches!(timed_out.code(), Code::Cancelled | Code::DeadlineExceeded),
        "{timed_out:?}"
    );
    let mid = call(addr, CREATE, Some("g-5"), slow.clone(), None)
        .await
        .expect_err("in flight");
    assert_eq!(mid.code(), Code::Aborted);
    let (info, retry) = details(&mid);
    assert_eq!(info.reason, "IN_FLIGHT");
    assert_eq!(info.metadata["safe_new_key"], "false");
    let retry = retry.expect("RetryInfo with the remaining lease");
    assert!(
        retry >= Duration::from_secs(1) && retry <= Duration::from_secs(30),
        "{retry:?}"
    );
    assert_eq!(tickets.effects.count(), 0);

    let mut replay = None;
    for _ in 0..100 {
        match call(addr, CREATE, Some("g-5"), slow.clone(), None).await {
            Ok(res) => {
                replay = Some(res);
                break;
            }
            Err(status) => assert_eq!(status.code(), Code::Aborted),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let replay = replay.expect("the handler finished and was recorded");
    assert!(replayed(&replay));
    assert_eq!(replay.into_inner().title, "slow");
    assert_eq!(
        tickets.effects.count(),
        1,
        "the deadline cancelled nothing and nothing ran twice"
    );
}

#[tokio::test]
async fn s7_10_grpc_store_down_is_unavailable_and_recovers() {
    let tickets = Tickets::default();
    let store = FlakyStore::default();
    let addr = serve_grpc(layer(store.clone()), tickets.clone()).await;

    store.down.store(true, Ordering::SeqCst);
    let down = call(addr, CREATE, Some("g-10"), ticket("x"), None)
        .await
        .expect_err("down");
    assert_eq!(down.code(), Code::Unavailable);
    let (info, retry) = details(&down);
    assert_eq!(info.reason, "STORE_UNAVAILABLE");
    assert_eq!(retry, Some(Duration::from_secs(1)));
    assert_eq!(tickets.effects.count(), 0);

    store.down.store(false, Ordering::SeqCst);
    call(addr, CREATE, Some("g-10"), ticket("x"), None)
        .await
        .expect("recovered");
    let again = call(addr, CREATE, Some("g-10"), ticket("x"), None)
        .await
        .expect("replay");
    assert!(replayed(&again));
    assert_eq!(tickets.effects.count(), 1);
}

fn failing(code: Code) -> CreateTicket {
    CreateTicket {
        title: "failing".into(),
        work_ms: 0,
        fail_first: code as i32,
    }
}

#[tokio::test]
async fn s3_grpc_internal_is_released_under_definitive_only() {
    let tickets = Tickets::default();
    let addr = serve_grpc(layer(MemoryStore::new()), tickets.clone()).await;
    let first = call(addr, CREATE, Some("g-int"), failing(Code::Internal), None).await;
    assert_eq!(first.expect_err("internal").code(), Code::Internal);
    let retry = call(addr, CREATE, Some("g-int"), failing(Code::Internal), None).await;
    let retry = retry.expect("the INTERNAL was not recorded: the retry ran and succeeded");
    assert!(!replayed(&retry));
    assert_eq!(tickets.effects.count(), 2);
}

#[tokio::test]
async fn s3_grpc_internal_is_replayed_under_everything() {
    let tickets = Tickets::default();
    let everything = IdempotencyLayer::new_for_grpc(MemoryStore::new())
        .single_tenant()
        .grpc_method(CREATE, |m| m.cache_policy(CachePolicy::Everything));
    let addr = serve_grpc(everything, tickets.clone()).await;
    for _ in 0..2 {
        let status = call(addr, CREATE, Some("g-ev"), failing(Code::Internal), None)
            .await
            .expect_err("internal, then its replay");
        assert_eq!(status.code(), Code::Internal);
        assert_eq!(status.message(), "attempt 1 failed");
    }
    assert_eq!(tickets.effects.count(), 1);
}

#[tokio::test]
async fn s3_grpc_invalid_argument_is_recorded_under_definitive_only() {
    let tickets = Tickets::default();
    let addr = serve_grpc(layer(MemoryStore::new()), tickets.clone()).await;
    for _ in 0..2 {
        let status = call(
            addr,
            CREATE,
            Some("g-inv"),
            failing(Code::InvalidArgument),
            None,
        )
        .await
        .expect_err("invalid argument, then its replay");
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(status.message(), "attempt 1 failed");
        assert_eq!(status.details(), b"\x08\x01opaque details");
    }
    assert_eq!(tickets.effects.count(), 1);
}

/// One call over a raw HTTP/2 connection: headers, body bytes and trailers exactly as sent.
async fn raw_call(
    addr: SocketAddr,
    key: &str,
    message: &CreateTicket,
) -> (HeaderMap, Bytes, Option<HeaderMap>) {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .expect("h2 handshake");
    tokio::spawn(connection);
    let encoded = message.encode_to_vec();
    let mut frame = BytesMut::new();
    frame.put_u8(0);
    frame.put_u32(encoded.len() as u32);
    frame.put_slice(&encoded);
    let request = http::Request::post(format!("http://{addr}{CREATE}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("idempotency-key", key)
        .body(Full::new(frame.freeze()))
        .expect("request");
    let (parts, body) = sender
        .send_request(request)
        .await
        .expect("response")
        .into_parts();
    let collected = body.collect().await.expect("body");
    let trailers = collected.trailers().cloned();
    (parts.headers, collected.to_bytes(), trailers)
}

fn without_volatile(mut headers: HeaderMap) -> HeaderMap {
    headers.remove("date");
    headers.remove("idempotency-replayed");
    headers
}

#[tokio::test]
async fn replayed_grpc_headers_frames_and_trailers_are_byte_identical() {
    let tickets = Tickets::default();
    let addr = serve_grpc(layer(MemoryStore::new()), tickets.clone()).await;

    // A normal response: headers, data frames, then trailers.
    let (h1, b1, t1) = raw_call(addr, "g-raw", &ticket("raw")).await;
    let (h2, b2, t2) = raw_call(addr, "g-raw", &ticket("raw")).await;
    assert_eq!(h2["idempotency-replayed"], "true");
    assert_eq!(without_volatile(h2), without_volatile(h1));
    assert_eq!(b2, b1);
    assert!(!b1.is_empty());
    let t1 = t1.expect("trailers on the first response");
    assert_eq!(t1["grpc-status"], "0");
    assert_eq!(t2, Some(t1), "trailers replayed exactly");

    // A trailers-only error: grpc-status, message, details and custom metadata in the headers.
    let (h1, b1, t1) = raw_call(addr, "g-raw-err", &failing(Code::NotFound)).await;
    let (h2, b2, t2) = raw_call(addr, "g-raw-err", &failing(Code::NotFound)).await;
    assert_eq!(h1["grpc-status"], "5");
    assert_eq!(h1["x-ticket-error"], "first-attempt");
    assert!(h1.contains_key("grpc-status-details-bin"));
    assert_eq!(h2["idempotency-replayed"], "true");
    assert_eq!(without_volatile(h2), without_volatile(h1));
    assert!(
        b1.is_empty() && b2.is_empty(),
        "trailers-only stays trailers-only"
    );
    assert_eq!((t1, t2), (None, None));
    assert_eq!(tickets.effects.count(), 2);
}

#[tokio::test]
async fn grpc_key_rules_and_unguarded_methods() {
    let tickets = Tickets::default();
    let addr = serve_grpc(layer(MemoryStore::new()), tickets.clone()).await;

    let missing = call(addr, CREATE, None, ticket("x"), None)
        .await
        .expect_err("missing key");
    assert_eq!(missing.code(), Code::InvalidArgument);
    assert_eq!(details(&missing).0.reason, "KEY_MISSING");
    let long = "k".repeat(256);
    let invalid = call(addr, CREATE, Some(&long), ticket("x"), None)
        .await
        .expect_err("long key");
    assert_eq!(invalid.code(), Code::InvalidArgument);
    assert_eq!(details(&invalid).0.reason, "KEY_INVALID");
    assert_eq!(tickets.effects.count(), 0);

    // GetTicket is not configured: it passes through, key or not, every time.
    for key in [None, Some("g-get"), Some("g-get")] {
        let res = call(addr, GET, key, ticket("read"), None)
            .await
            .expect("get");
        assert!(!replayed(&res));
    }
    assert_eq!(tickets.effects.count(), 3);
}

#[tokio::test]
async fn grpc_per_service_layer_keeps_the_service_name() {
    use tower::Layer;
    let tickets = Tickets::default();
    let service = IdempotencyLayer::new_for_grpc(MemoryStore::new())
        .single_tenant()
        .grpc_method(CREATE, |m| m)
        .layer(tickets.clone());
    fn name<S: tonic::server::NamedService>(_: &S) -> &'static str {
        S::NAME
    }
    assert_eq!(name(&service), "tickets.Tickets");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(
        Server::builder()
            .add_service(service)
            .serve_with_incoming(TcpIncoming::from(listener)),
    );
    call(addr, CREATE, Some("g-svc"), ticket("svc"), None)
        .await
        .expect("first");
    let again = call(addr, CREATE, Some("g-svc"), ticket("svc"), None)
        .await
        .expect("replay");
    assert!(replayed(&again));
    assert_eq!(tickets.effects.count(), 1);
}

#[tokio::test]
async fn axum_and_tonic_in_one_process_share_one_store() {
    let store = MemoryStore::new();
    let tickets = Tickets::default();
    let grpc = serve_grpc(layer(store.clone()), tickets.clone()).await;
    let http_effects = Effects::default();
    let counter = http_effects.clone();
    let http = serve(
        axum::Router::new()
            .route(
                "/tickets",
                post(move || async move { format!("http {}", counter.hit()) }),
            )
            .layer(IdempotencyLayer::new(store.clone()).single_tenant()),
    )
    .await;

    let res = client()
        .post(format!("http://{http}/tickets"))
        .header("idempotency-key", "shared")
        .send()
        .await
        .expect("http");
    assert_eq!(res.status(), 200);
    // The same key over gRPC finds the record HTTP left: another request, so a mismatch.
    let status = call(grpc, CREATE, Some("shared"), ticket("x"), None)
        .await
        .expect_err("mismatch");
    assert_eq!(status.code(), Code::FailedPrecondition);
    call(grpc, CREATE, Some("grpc-only"), ticket("x"), None)
        .await
        .expect("grpc");
    assert_eq!(store.len(), 2, "one store holds both protocols' records");
    assert_eq!((http_effects.count(), tickets.effects.count()), (1, 1));
}
