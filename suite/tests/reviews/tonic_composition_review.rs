//! Review: the layer in realistic tonic deployments, set up by a careless integrator and
//! attacked by an adversary. A hand-written tonic service (prost messages, no `protoc`), real
//! tonic clients over loopback TCP, and tonic's own building blocks around the layer:
//! `Server::builder().layer(..)` vs a per-service `ServiceBuilder`, interceptors
//! (`InterceptedService` / `InterceptorLayer`) that set the principal from metadata, tower's
//! timeout, load shedding and concurrency limits, tonic's server timeout, client deadlines and
//! cancellations, gzip on one side only, metadata-only differences, messages near tonic's
//! 4 MiB decode limit, and unguarded neighbours (health checks, a server stream). Every run of
//! the handler is counted where it happens, in the handler. Each test names the DESIGN § (or
//! README section) it probes.

use crate::common;

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use common::Effects;
use http::uri::PathAndQuery;
use http_body_util::{BodyExt, Full};
use prost::Message;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Barrier;
use tonic::codec::CompressionEncoding;
use tonic::service::InterceptorLayer;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower::ServiceBuilder;
use tower_idempotency::{
    IdempotencyContext, IdempotencyLayer, IdempotencyStore, MemoryStore, ScopedKey,
    store::RecordStatus,
};

const CREATE: &str = "/tickets.Tickets/CreateTicket";
const CHECK: &str = "/grpc.health.v1.Health/Check";
const WATCH: &str = "/grpc.health.v1.Health/Watch";

// ---- messages -------------------------------------------------------------------------------

#[derive(Clone, PartialEq, Message)]
struct Create {
    #[prost(string, tag = "1")]
    title: String,
    /// How long the handler works (after counting its start, before counting its effect).
    #[prost(uint64, tag = "2")]
    work_ms: u64,
    /// A gRPC code to fail with on the key's first attempt (0: succeed).
    #[prost(int32, tag = "3")]
    fail_first: i32,
    #[prost(bytes = "vec", tag = "4")]
    payload: Vec<u8>,
    /// Answer with the payload echoed back.
    #[prost(bool, tag = "5")]
    echo: bool,
    /// Call `ctx.effect_started()` before working.
    #[prost(bool, tag = "6")]
    mark_effect: bool,
}

#[derive(Clone, PartialEq, Message)]
struct Ticket {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(string, tag = "2")]
    title: String,
    /// The principal the interceptor set, as the handler saw it.
    #[prost(string, tag = "3")]
    principal: String,
    /// The `x-amount` metadata, as the handler saw it.
    #[prost(string, tag = "4")]
    amount: String,
    #[prost(uint64, tag = "5")]
    size: u64,
    #[prost(bytes = "vec", tag = "6")]
    payload: Vec<u8>,
}

#[derive(Clone, PartialEq, Message)]
struct HealthCheckRequest {
    #[prost(string, tag = "1")]
    service: String,
}

#[derive(Clone, PartialEq, Message)]
struct HealthCheckResponse {
    #[prost(int32, tag = "1")]
    status: i32,
}

// google.rpc.Status and the details the middleware sends.
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

/// The middleware's `ErrorInfo` reason in a status, or `None` when the status is not its own.
fn reason(status: &Status) -> Option<String> {
    let rpc = RpcStatus::decode(status.details()).ok()?;
    rpc.details
        .iter()
        .find(|any| any.type_url == "type.googleapis.com/google.rpc.ErrorInfo")
        .and_then(|any| ErrorInfo::decode(&any.value[..]).ok())
        .filter(|info| info.domain == "tower-idempotency")
        .map(|info| info.reason)
}

fn replayed_meta(meta: &tonic::metadata::MetadataMap) -> bool {
    meta.get("idempotency-replayed")
        .is_some_and(|v| v == "true")
}

// ---- the ticket service ---------------------------------------------------------------------

#[derive(Clone, Debug)]
struct Principal(String);

/// The ticket service, hand-written as tonic's generated servers are.
#[derive(Clone, Default)]
struct Tickets {
    /// Runs that started.
    started: Effects,
    /// Runs that finished their work (the effect).
    effects: Effects,
    /// Finished runs per title.
    per_title: Arc<Mutex<HashMap<String, usize>>>,
    accept_gzip: bool,
    send_gzip: bool,
    max_decode: Option<usize>,
}

impl Tickets {
    fn of(&self, title: &str) -> usize {
        self.per_title
            .lock()
            .expect("lock")
            .get(title)
            .copied()
            .unwrap_or(0)
    }
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
        let this = self.clone();
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Ticket, Create>::default());
            if this.accept_gzip {
                grpc = grpc.accept_compressed(CompressionEncoding::Gzip);
            }
            if this.send_gzip {
                grpc = grpc.send_compressed(CompressionEncoding::Gzip);
            }
            if let Some(limit) = this.max_decode {
                grpc = grpc.max_decoding_message_size(limit);
            }
            Ok(match req.uri().path() {
                CREATE => grpc.unary(Handler(this), req).await,
                _ => Status::unimplemented("no such method").into_http(),
            })
        })
    }
}

struct Handler(Tickets);

impl tonic::server::UnaryService<Create> for Handler {
    type Response = Ticket;
    type Future = BoxFuture<Result<tonic::Response<Ticket>, Status>>;

    fn call(&mut self, request: tonic::Request<Create>) -> Self::Future {
        let tickets = self.0.clone();
        let ctx = request.extensions().get::<IdempotencyContext>().cloned();
        let principal = request
            .extensions()
            .get::<Principal>()
            .map(|p| p.0.clone())
            .unwrap_or_default();
        let amount = request
            .metadata()
            .get("x-amount")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        Box::pin(async move {
            let input = request.into_inner();
            tickets.started.hit();
            if input.mark_effect {
                ctx.as_ref()
                    .expect("a guarded call has its context")
                    .effect_started()
                    .await
                    .map_err(|e| Status::unavailable(e.to_string()))?;
            }
            tokio::time::sleep(Duration::from_millis(input.work_ms)).await;
            let n = tickets.effects.hit() as u64;
            *tickets
                .per_title
                .lock()
                .expect("lock")
                .entry(input.title.clone())
                .or_default() += 1;
            let attempt = ctx.as_ref().map(IdempotencyContext::attempt);
            if input.fail_first != 0 && attempt == Some(1) {
                let mut metadata = tonic::metadata::MetadataMap::new();
                metadata.insert("x-failed-run", n.to_string().parse().expect("ascii"));
                return Err(Status::with_metadata(
                    Code::from_i32(input.fail_first),
                    format!("run {n} failed"),
                    metadata,
                ));
            }
            let size = input.payload.len() as u64;
            let mut response = tonic::Response::new(Ticket {
                id: n,
                title: input.title,
                principal,
                amount,
                size,
                payload: if input.echo {
                    input.payload
                } else {
                    Vec::new()
                },
            });
            response
                .metadata_mut()
                .insert("x-ticket-id", n.to_string().parse().expect("ascii"));
            Ok(response)
        })
    }
}

// ---- a health service, as tonic-health mounts one -----------------------------------------

#[derive(Clone, Default)]
struct Health {
    checks: Effects,
    watches: Effects,
}

impl tonic::server::NamedService for Health {
    const NAME: &'static str = "grpc.health.v1.Health";
}

impl<B> tower::Service<http::Request<B>> for Health
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
        let this = self.clone();
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<
                HealthCheckResponse,
                HealthCheckRequest,
            >::default());
            Ok(match req.uri().path() {
                CHECK => grpc.unary(Check(this), req).await,
                WATCH => grpc.server_streaming(Watch(this), req).await,
                _ => Status::unimplemented("no such method").into_http(),
            })
        })
    }
}

struct Check(Health);

impl tonic::server::UnaryService<HealthCheckRequest> for Check {
    type Response = HealthCheckResponse;
    type Future = BoxFuture<Result<tonic::Response<HealthCheckResponse>, Status>>;

    fn call(&mut self, request: tonic::Request<HealthCheckRequest>) -> Self::Future {
        let n = self.0.checks.hit();
        let guarded = request.extensions().get::<IdempotencyContext>().is_some();
        Box::pin(async move {
            assert!(!guarded, "a health check must never be guarded");
            Ok(tonic::Response::new(HealthCheckResponse {
                status: n as i32,
            }))
        })
    }
}

struct Watch(Health);

type WatchStream =
    futures_util::stream::Iter<std::vec::IntoIter<Result<HealthCheckResponse, Status>>>;

impl tonic::server::ServerStreamingService<HealthCheckRequest> for Watch {
    type Response = HealthCheckResponse;
    type ResponseStream = WatchStream;
    type Future = BoxFuture<Result<tonic::Response<WatchStream>, Status>>;

    fn call(&mut self, _: tonic::Request<HealthCheckRequest>) -> Self::Future {
        let n = self.0.watches.hit() as i32;
        Box::pin(async move {
            let items: Vec<Result<HealthCheckResponse, Status>> = (0..3)
                .map(|i| Ok(HealthCheckResponse { status: n * 10 + i }))
                .collect();
            Ok(tonic::Response::new(futures_util::stream::iter(items)))
        })
    }
}

// ---- the auth interceptor -------------------------------------------------------------------

/// `authorization: Bearer <user>.<version>` sets the principal `<user>` (a refreshed token
/// changes the version, not the user); a token starting with `bad` is refused.
fn auth(mut req: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
    let token = req
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_owned);
    match token {
        Some(token) if !token.starts_with("bad") => {
            let user = token.split('.').next().unwrap_or_default().to_owned();
            req.extensions_mut().insert(Principal(user));
            Ok(req)
        }
        _ => Err(Status::unauthenticated("token refused")),
    }
}

type Auth = fn(tonic::Request<()>) -> Result<tonic::Request<()>, Status>;
const AUTH: Auth = auth;

// ---- helpers ---------------------------------------------------------------------------------

async fn incoming() -> (TcpIncoming, SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    (TcpIncoming::from(listener), addr)
}

/// A new channel: its own HTTP/2 connection, as an independent retry would have.
async fn channel(addr: SocketAddr) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect")
}

/// How one call is made.
#[derive(Clone, Default)]
struct Opts {
    key: Option<String>,
    token: Option<String>,
    metadata: Vec<(&'static str, String)>,
    binary: Vec<(&'static str, Vec<u8>)>,
    timeout: Option<Duration>,
    send_gzip: bool,
    accept_gzip: bool,
    max_decode: Option<usize>,
    path: Option<&'static str>,
}

fn keyed(key: &str) -> Opts {
    Opts {
        key: Some(key.to_owned()),
        ..Opts::default()
    }
}

fn as_user(key: &str, token: &str) -> Opts {
    Opts {
        key: Some(key.to_owned()),
        token: Some(token.to_owned()),
        ..Opts::default()
    }
}

fn title(title: &str) -> Create {
    Create {
        title: title.to_owned(),
        ..Create::default()
    }
}

fn slow(title: &str, work_ms: u64) -> Create {
    Create {
        title: title.to_owned(),
        work_ms,
        ..Create::default()
    }
}

fn request(message: Create, opts: &Opts) -> tonic::Request<Create> {
    let mut request = tonic::Request::new(message);
    if let Some(key) = &opts.key {
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse().expect("ascii key"));
    }
    if let Some(token) = &opts.token {
        request.metadata_mut().insert(
            "authorization",
            format!("Bearer {token}").parse().expect("ascii"),
        );
    }
    for (name, value) in &opts.metadata {
        request
            .metadata_mut()
            .insert(*name, value.parse().expect("ascii"));
    }
    for (name, value) in &opts.binary {
        request
            .metadata_mut()
            .insert_bin(*name, tonic::metadata::MetadataValue::from_bytes(value));
    }
    if let Some(timeout) = opts.timeout {
        request.set_timeout(timeout);
    }
    request
}

async fn call_on(
    ch: Channel,
    message: Create,
    opts: &Opts,
) -> Result<tonic::Response<Ticket>, Status> {
    let mut grpc = tonic::client::Grpc::new(ch);
    if opts.send_gzip {
        grpc = grpc.send_compressed(CompressionEncoding::Gzip);
    }
    if opts.accept_gzip {
        grpc = grpc.accept_compressed(CompressionEncoding::Gzip);
    }
    if let Some(limit) = opts.max_decode {
        grpc = grpc.max_decoding_message_size(limit);
    }
    grpc.ready().await.expect("ready");
    let path = PathAndQuery::from_str(opts.path.unwrap_or(CREATE)).expect("path");
    grpc.unary(request(message, opts), path, ProstCodec::default())
        .await
}

async fn call(
    addr: SocketAddr,
    message: Create,
    opts: &Opts,
) -> Result<tonic::Response<Ticket>, Status> {
    common::guard("a tonic call", call_on(channel(addr).await, message, opts)).await
}

/// Calls until the answer is not `ABORTED IN_FLIGHT` (the first run still going), at most
/// `rounds` times, 50 ms apart.
async fn settle(
    addr: SocketAddr,
    message: Create,
    opts: &Opts,
    rounds: usize,
) -> Result<tonic::Response<Ticket>, Status> {
    let mut last = None;
    for _ in 0..rounds {
        match call(addr, message.clone(), opts).await {
            Err(status)
                if status.code() == Code::Aborted
                    && reason(&status).as_deref() == Some("IN_FLIGHT") =>
            {
                last = Some(status);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => return other,
        }
    }
    Err(last.expect("at least one round"))
}

fn ticket_id<T>(res: &tonic::Response<T>) -> Option<String> {
    res.metadata()
        .get("x-ticket-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

fn single_tenant<St: IdempotencyStore>(
    store: St,
) -> IdempotencyLayer<St, tower_idempotency::scope::SingleTenant> {
    IdempotencyLayer::new_for_grpc(store)
        .single_tenant()
        .grpc_method(CREATE, |m| m)
}

// ---- §1 step 2: interceptors and scopes ------------------------------------------------------

/// §1 step 2 ("Two principals using the same key can never see each other's records"), README
/// "a request that reaches the layer without what its scope needs ... 500 scope-missing": a
/// careless integrator puts the layer on `Server::builder()` and the auth interceptor on the
/// service (`InterceptedService`), so the interceptor runs INSIDE the layer and the principal
/// is not set when the layer looks. Every keyed call must be refused (INTERNAL,
/// SCOPE_MISSING) before anything runs: never two principals in one shared scope. The same with
/// the interceptor as a server-wide layer added after the idempotency layer.
#[tokio::test]
async fn s1_2_interceptor_inside_the_layer_refuses_never_shares_a_scope() {
    // (a) server-wide layer, per-service InterceptedService.
    let tickets = Tickets::default();
    let store = MemoryStore::new();
    let (inc, addr_a) = incoming().await;
    let layer = IdempotencyLayer::new_for_grpc(store.clone())
        .scope_by_principal(|p: &Principal| p.0.clone())
        .grpc_method(CREATE, |m| m);
    tokio::spawn(
        Server::builder()
            .layer(layer.clone())
            .add_service(InterceptedService::new(tickets.clone(), AUTH))
            .serve_with_incoming(inc),
    );
    // (b) both server-wide, in the wrong order: the idempotency layer first (outermost).
    let (inc, addr_b) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(layer.clone())
            .layer(InterceptorLayer::new(AUTH))
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    // (c) one service, ServiceBuilder in the wrong order.
    let (inc, addr_c) = incoming().await;
    let svc = ServiceBuilder::new()
        .layer(layer)
        .layer(InterceptorLayer::new(AUTH))
        .service(tickets.clone());
    tokio::spawn(Server::builder().add_service(svc).serve_with_incoming(inc));

    for addr in [addr_a, addr_b, addr_c] {
        for user in ["alice.1", "bob.1", "alice.1"] {
            let status = call(addr, title("shared"), &as_user("k-inside", user))
                .await
                .expect_err("no scope: refused");
            assert_eq!(status.code(), Code::Internal, "{addr} {user}: {status:?}");
            assert_eq!(
                reason(&status).as_deref(),
                Some("SCOPE_MISSING"),
                "{status:?}"
            );
        }
    }
    assert_eq!(
        tickets.started.count(),
        0,
        "nothing ran under a missing scope"
    );
    assert_eq!(store.len(), 0, "nothing was claimed");
}

/// §1 step 2, the right order, three ways (interceptor layer before the idempotency layer on
/// `Server::builder()`, a per-service `ServiceBuilder`, and `InterceptedService` around a
/// per-service layer): alice and bob use one key with one message; each runs once and only
/// ever gets their own answer back, also with a refreshed token (scope by principal, not by
/// credential).
#[tokio::test]
async fn s1_2_interceptor_outside_the_layer_isolates_principals() {
    let mk = |store: MemoryStore| {
        IdempotencyLayer::new_for_grpc(store)
            .scope_by_principal(|p: &Principal| p.0.clone())
            .grpc_method(CREATE, |m| m)
    };
    let mut addrs = Vec::new();
    let mut all = Vec::new();
    {
        let tickets = Tickets::default();
        let (inc, addr) = incoming().await;
        tokio::spawn(
            Server::builder()
                .layer(InterceptorLayer::new(AUTH))
                .layer(mk(MemoryStore::new()))
                .add_service(tickets.clone())
                .serve_with_incoming(inc),
        );
        addrs.push(addr);
        all.push(tickets);
    }
    {
        let tickets = Tickets::default();
        let (inc, addr) = incoming().await;
        let svc = ServiceBuilder::new()
            .layer(InterceptorLayer::new(AUTH))
            .layer(mk(MemoryStore::new()))
            .service(tickets.clone());
        tokio::spawn(Server::builder().add_service(svc).serve_with_incoming(inc));
        addrs.push(addr);
        all.push(tickets);
    }
    {
        let tickets = Tickets::default();
        let (inc, addr) = incoming().await;
        let svc = InterceptedService::new(
            tower::Layer::layer(&mk(MemoryStore::new()), tickets.clone()),
            AUTH,
        );
        tokio::spawn(Server::builder().add_service(svc).serve_with_incoming(inc));
        addrs.push(addr);
        all.push(tickets);
    }
    for (addr, tickets) in addrs.into_iter().zip(all) {
        let alice = call(addr, title("same"), &as_user("k-iso", "alice.1"))
            .await
            .expect("alice runs");
        let bob = call(addr, title("same"), &as_user("k-iso", "bob.1"))
            .await
            .expect("bob runs");
        assert!(!replayed_meta(alice.metadata()) && !replayed_meta(bob.metadata()));
        assert_eq!(alice.get_ref().principal, "alice");
        assert_eq!(
            bob.get_ref().principal,
            "bob",
            "bob never gets alice's answer"
        );
        let alice_again = call(addr, title("same"), &as_user("k-iso", "alice.2"))
            .await
            .expect("alice's retry with a refreshed token");
        assert!(replayed_meta(alice_again.metadata()));
        assert_eq!(alice_again.get_ref(), alice.get_ref());
        assert_eq!(ticket_id(&alice_again), ticket_id(&alice));
        let bob_again = call(addr, title("same"), &as_user("k-iso", "bob.7"))
            .await
            .expect("bob's retry");
        assert!(replayed_meta(bob_again.metadata()));
        assert_eq!(bob_again.get_ref(), bob.get_ref());
        assert_eq!(tickets.effects.count(), 2, "one run per principal");
    }
}

/// §1 step 1-2, an auth interceptor outside the layer that refuses (UNAUTHENTICATED) never
/// lets the call reach the layer: the key is not consumed, and the caller's retry with a good
/// token runs (and then replays).
#[tokio::test]
async fn s3_an_auth_refusal_outside_the_layer_consumes_no_key() {
    let tickets = Tickets::default();
    let store = MemoryStore::new();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(InterceptorLayer::new(AUTH))
            .layer(
                IdempotencyLayer::new_for_grpc(store.clone())
                    .scope_by_principal(|p: &Principal| p.0.clone())
                    .grpc_method(CREATE, |m| m),
            )
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    let refused = call(addr, title("t"), &as_user("k-auth", "bad-token"))
        .await
        .expect_err("refused");
    assert_eq!(refused.code(), Code::Unauthenticated);
    assert_eq!(store.len(), 0, "a refused call claims nothing");
    let ran = call(addr, title("t"), &as_user("k-auth", "alice.1"))
        .await
        .expect("the retry with a good token runs");
    assert!(!replayed_meta(ran.metadata()));
    let again = call(addr, title("t"), &as_user("k-auth", "alice.1"))
        .await
        .expect("replay");
    assert!(replayed_meta(again.metadata()));
    assert_eq!(tickets.effects.count(), 1);
}

/// SHARP EDGE, DESIGN §3 (UNAUTHENTICATED is definitive) + README "Outcomes are classified by
/// grpc-status": a server-wide layer scoped by a tenant header with the auth interceptor on
/// the service (inside the layer). A call with an expired token gets UNAUTHENTICATED from the
/// interceptor, which the layer records as the key's outcome; the client refreshes its token
/// and retries with the same key and is replayed UNAUTHENTICATED until the TTL, although
/// nothing ever ran. Asserted as documented; never a run, never another tenant's answer.
#[tokio::test]
async fn s3_an_auth_refusal_inside_the_layer_is_recorded_sharp_edge() {
    let tickets = Tickets::default();
    let store = MemoryStore::new();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(
                IdempotencyLayer::new_for_grpc(store.clone())
                    .scope_by_header(http::HeaderName::from_static("x-tenant"))
                    .grpc_method(CREATE, |m| m),
            )
            .add_service(InterceptedService::new(tickets.clone(), AUTH))
            .serve_with_incoming(inc),
    );
    let with = |token: &str| Opts {
        metadata: vec![("x-tenant", "acme".to_owned())],
        ..as_user("k-expired", token)
    };
    let first = call(addr, title("t"), &with("bad-expired"))
        .await
        .expect_err("refused");
    assert_eq!(first.code(), Code::Unauthenticated);
    let retry = call(addr, title("t"), &with("alice.2")).await;
    let retry = retry.expect_err("documented: the recorded UNAUTHENTICATED is replayed");
    assert_eq!(retry.code(), Code::Unauthenticated);
    assert_eq!(retry.message(), first.message());
    assert!(replayed_meta(retry.metadata()), "{retry:?}");
    assert_eq!(tickets.started.count(), 0, "nothing ever ran");
}

// ---- §3 under tower's timeout, shedding and limits -----------------------------------------

/// §3 "UNAVAILABLE/.../RESOURCE_EXHAUSTED ... release the claim": tower's `LoadShed` over a
/// `ConcurrencyLimit(1)` INSIDE the layer (`Server::builder().layer(idem).layer(shed)
/// .layer(limit)`). A second key arriving while the first runs is shed (tonic maps
/// `Overloaded` to RESOURCE_EXHAUSTED); that refusal is not the key's outcome, so its retry
/// runs, once. Nothing is left in flight.
#[tokio::test]
async fn s3_load_shed_inside_the_layer_releases_the_key() {
    let tickets = Tickets::default();
    let store = MemoryStore::new();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(single_tenant(store.clone()))
            .layer(tower::load_shed::LoadShedLayer::new())
            .layer(tower::limit::ConcurrencyLimitLayer::new(1))
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    let busy = tokio::spawn(async move { call(addr, slow("busy", 700), &keyed("k-busy")).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let shed = call(addr, title("shed"), &keyed("k-shed"))
        .await
        .expect_err("shed while the limit is taken");
    assert!(
        matches!(shed.code(), Code::ResourceExhausted | Code::Unavailable),
        "{shed:?}"
    );
    assert_eq!(tickets.of("shed"), 0);
    busy.await.expect("task").expect("the busy call");
    let ran = call(addr, title("shed"), &keyed("k-shed"))
        .await
        .expect("the shed key was given back: the retry runs");
    assert!(
        !replayed_meta(ran.metadata()),
        "the shed refusal was not recorded"
    );
    let again = call(addr, title("shed"), &keyed("k-shed"))
        .await
        .expect("replay");
    assert!(replayed_meta(again.metadata()));
    assert_eq!(ticket_id(&again), ticket_id(&ran));
    assert_eq!((tickets.of("shed"), tickets.of("busy")), (1, 1));
}

/// §1 step 5-7: tonic's own `load_shed(true)` + `concurrency_limit_per_connection(1)` sit
/// outside every user layer: a call shed on a busy connection never reaches the layer, so it
/// claims nothing and its retry (on the same connection, once free) runs once.
#[tokio::test]
async fn s1_tonics_own_load_shedding_claims_nothing() {
    let tickets = Tickets::default();
    let store = MemoryStore::new();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .load_shed(true)
            .concurrency_limit_per_connection(1)
            .layer(single_tenant(store.clone()))
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    let ch = channel(addr).await;
    let busy = {
        let ch = ch.clone();
        tokio::spawn(async move { call_on(ch, slow("busy", 600), &keyed("k-conn-busy")).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let shed = call_on(ch.clone(), title("second"), &keyed("k-conn-2"))
        .await
        .expect_err("shed by tonic");
    assert_eq!(shed.code(), Code::ResourceExhausted, "{shed:?}");
    assert_eq!(reason(&shed), None, "tonic's refusal, not the layer's");
    assert!(
        store
            .lookup(&ScopedKey::new("", "k-conn-2"))
            .await
            .expect("lookup")
            .is_none(),
        "the shed call never claimed its key"
    );
    busy.await.expect("task").expect("busy call");
    let ran = call_on(ch, title("second"), &keyed("k-conn-2"))
        .await
        .expect("runs");
    assert!(!replayed_meta(ran.metadata()));
    assert_eq!(tickets.of("second"), 1);
}

/// §3: the codes a server answers when it is overloaded, timed out or confused
/// (RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED, ABORTED, UNKNOWN, INTERNAL) are never
/// a definitive answer under the default policy: the retry runs again and gets the real
/// answer, never the error replayed.
#[tokio::test]
async fn s3_technical_failure_codes_are_released_under_definitive_only() {
    let tickets = Tickets::default();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(single_tenant(MemoryStore::new()))
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    for code in [
        Code::ResourceExhausted,
        Code::Unavailable,
        Code::DeadlineExceeded,
        Code::Aborted,
        Code::Unknown,
        Code::Internal,
    ] {
        let name = format!("fail-{}", code as i32);
        let msg = Create {
            title: name.clone(),
            fail_first: code as i32,
            ..Create::default()
        };
        let first = call(addr, msg.clone(), &keyed(&name))
            .await
            .expect_err("the first attempt fails");
        assert_eq!(first.code(), code);
        let retry = call(addr, msg.clone(), &keyed(&name)).await;
        let retry = retry.unwrap_or_else(|s| panic!("{code:?} must not be recorded: {s:?}"));
        assert!(!replayed_meta(retry.metadata()));
        assert_eq!(tickets.of(&name), 2, "{code:?}");
    }
}

/// §4 + README "Inside it, a timeout ... a handler cut short after its effect would run again
/// unless it marked ctx.effect_started() first": `tower::timeout` INSIDE the layer, around a
/// tonic service, cutting a handler short. With the milestone marked, the key must await
/// reconciliation (ABORTED OUTCOME_UNKNOWN), never run again; without it the key is given back
/// and the retry runs again (documented sharp edge, asserted as documented).
#[tokio::test]
async fn s4_an_inner_tower_timeout_after_effect_started_never_reruns() {
    let tickets = Tickets::default();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(single_tenant(MemoryStore::new()))
            .layer(tower::timeout::TimeoutLayer::new(Duration::from_millis(
                150,
            )))
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    let marked = Create {
        title: "marked".into(),
        work_ms: 600,
        mark_effect: true,
        ..Create::default()
    };
    let first = call(addr, marked.clone(), &keyed("k-marked"))
        .await
        .expect_err("the inner timeout cuts the handler short");
    assert_ne!(first.code(), Code::Ok);
    assert_eq!(tickets.started.count(), 1);
    tokio::time::sleep(Duration::from_millis(700)).await;
    for _ in 0..2 {
        let retry = call(addr, marked.clone(), &keyed("k-marked"))
            .await
            .expect_err("outcome unknown");
        assert_eq!(retry.code(), Code::Aborted, "{retry:?}");
        assert_eq!(reason(&retry).as_deref(), Some("OUTCOME_UNKNOWN"));
    }
    assert_eq!(
        tickets.started.count(),
        1,
        "a started effect never runs again"
    );

    // Without the milestone: documented, the key is given back and the retry runs again.
    let unmarked = slow("unmarked", 600);
    call(addr, unmarked.clone(), &keyed("k-unmarked"))
        .await
        .expect_err("cut short");
    tokio::time::sleep(Duration::from_millis(100)).await;
    call(addr, unmarked, &keyed("k-unmarked"))
        .await
        .expect_err("cut short again: it ran again, as documented");
    assert_eq!(tickets.started.count(), 3);
}

// ---- §1 step 7: deadlines, tonic's server timeout, cancellations ---------------------------

/// §1 step 7, §7.5 on SQLite with a real file: tonic's server-side `timeout` (outside every
/// user layer), a client `grpc-timeout` shorter than the handler, and a client that drops its
/// call mid-handler. Each first caller gets an error, the handler runs to completion exactly
/// once, and every retry gets in-flight or the recorded answer, never a second run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_7_deadlines_and_cancels_run_to_completion_sqlite() {
    let (store, _path) = common::sqlite("tonic-deadlines").await;
    let tickets = Tickets::default();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .timeout(Duration::from_millis(150))
            .layer(single_tenant(store.clone()))
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    // (a) tonic's server timeout.
    let a = call(addr, slow("server-timeout", 700), &keyed("k-srv"))
        .await
        .expect_err("the server's timeout answers first");
    assert!(
        matches!(a.code(), Code::Cancelled | Code::DeadlineExceeded),
        "{a:?}"
    );
    // (b) the client's grpc-timeout.
    let b_opts = Opts {
        timeout: Some(Duration::from_millis(100)),
        ..keyed("k-deadline")
    };
    let b = call(addr, slow("client-deadline", 700), &b_opts)
        .await
        .expect_err("the client's deadline passes first");
    assert!(
        matches!(b.code(), Code::Cancelled | Code::DeadlineExceeded),
        "{b:?}"
    );
    // (c) a client that drops its call mid-handler.
    let dropped =
        tokio::spawn(async move { call(addr, slow("dropped", 700), &keyed("k-drop")).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    dropped.abort();
    let _ = dropped.await;

    // Retries with no deadline of their own: the server's 150 ms still applies, so a
    // retry that would run again would also be cut short; it must get in-flight or the replay.
    for (key, name) in [
        ("k-srv", "server-timeout"),
        ("k-deadline", "client-deadline"),
        ("k-drop", "dropped"),
    ] {
        let res = settle(addr, slow(name, 700), &keyed(key), 100)
            .await
            .unwrap_or_else(|s| panic!("{key}: never answered from the record: {s:?}"));
        assert!(replayed_meta(res.metadata()), "{key}");
        assert_eq!(res.get_ref().title, name);
        assert_eq!(tickets.of(name), 1, "{key}: ran to completion, once");
        let record = store
            .lookup(&ScopedKey::new("", key))
            .await
            .expect("lookup")
            .expect("a record");
        assert_eq!(record.status, RecordStatus::Completed);
        assert_eq!(record.attempts, 1, "{key}");
    }
    assert_eq!(tickets.started.count(), 3);
}

/// §1 step 5/7 + README "the client hangs up while the claim is in flight: ... the key is
/// given back": deadlines of 1 to 8 ms, shorter than a SQLite claim can take, cut calls short
/// at every point of the pipeline (buffering, claim, spawn). No key may be stranded in flight,
/// no handler may run twice, and each key ends with exactly one run and its replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_5_deadlines_shorter_than_the_claim_strand_no_key_sqlite() {
    const KEYS: usize = 24;
    let (store, _path) = common::sqlite("tonic-short-deadlines").await;
    let tickets = Tickets::default();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(
                IdempotencyLayer::new_for_grpc(store.clone())
                    .single_tenant()
                    .grpc_method(CREATE, |m| m.lease(Duration::from_secs(120))),
            )
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    let mut tasks = Vec::new();
    for i in 0..KEYS {
        tasks.push(tokio::spawn(async move {
            let opts = Opts {
                timeout: Some(Duration::from_millis(1 + 8 * i as u64)),
                ..keyed(&format!("k-short-{i}"))
            };
            call(addr, slow(&format!("short-{i}"), 5), &opts).await
        }));
    }
    let mut cut = 0;
    for task in tasks {
        if task.await.expect("task").is_err() {
            cut += 1;
        }
    }
    eprintln!(
        "short deadlines: {cut} of {KEYS} first calls cut short, {} handlers started",
        tickets.started.count()
    );
    // Every key must settle (completed, or given back) well within its 120 s lease.
    let mut stranded = Vec::new();
    for i in 0..KEYS {
        let key = ScopedKey::new("", format!("k-short-{i}"));
        let mut settled = false;
        for _ in 0..200 {
            match store.lookup(&key).await.expect("lookup") {
                Some(r) if r.status == RecordStatus::InProgress => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                _ => {
                    settled = true;
                    break;
                }
            }
        }
        if !settled {
            stranded.push(i);
        }
    }
    assert!(stranded.is_empty(), "keys left in flight: {stranded:?}");
    for i in 0..KEYS {
        let name = format!("short-{i}");
        assert!(
            tickets.of(&name) <= 1,
            "{name} ran {} times",
            tickets.of(&name)
        );
        let res = call(addr, slow(&name, 5), &keyed(&format!("k-short-{i}")))
            .await
            .unwrap_or_else(|s| panic!("{name}: {s:?}"));
        let again = call(addr, slow(&name, 5), &keyed(&format!("k-short-{i}")))
            .await
            .expect("replay");
        assert!(replayed_meta(again.metadata()), "{name}");
        assert_eq!(again.get_ref(), res.get_ref());
        assert_eq!(tickets.of(&name), 1, "{name}");
    }
}

/// §1 step 6 (wait for the first) + §1 step 7: a retry on a `wait_for_in_flight` route whose
/// own `grpc-timeout` fires while it waits is dropped by tonic; that costs nothing: the first
/// run completes once, and a later retry gets its replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_6_a_waiting_retry_cut_by_its_deadline_strands_nothing() {
    let tickets = Tickets::default();
    let store = MemoryStore::new();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(
                IdempotencyLayer::new_for_grpc(store.clone())
                    .single_tenant()
                    .grpc_method(CREATE, |m| m.wait_for_in_flight(Duration::from_secs(5))),
            )
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    let first =
        tokio::spawn(async move { call(addr, slow("waited", 600), &keyed("k-wait")).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let waiter = Opts {
        timeout: Some(Duration::from_millis(100)),
        ..keyed("k-wait")
    };
    let cut = call(addr, slow("waited", 600), &waiter)
        .await
        .expect_err("its deadline fires while it waits");
    assert!(
        matches!(cut.code(), Code::Cancelled | Code::DeadlineExceeded),
        "{cut:?}"
    );
    let first = first.await.expect("task").expect("the first call");
    let replay = call(addr, slow("waited", 600), &keyed("k-wait"))
        .await
        .expect("replay");
    assert!(replayed_meta(replay.metadata()));
    assert_eq!(replay.get_ref(), first.get_ref());
    assert_eq!(tickets.of("waited"), 1);
}

// ---- §7.3 / §7.9: many clients, one key -------------------------------------------------------

/// §7.3 with principals: 8 of alice's and 8 of bob's tonic clients send one key at once
/// (barrier, separate connections) through the interceptor then the layer. Exactly one run per
/// principal; every successful answer is the caller's own principal's (one ticket id each).
async fn burst_two_principals<St: IdempotencyStore>(store: St) {
    const N: usize = 16;
    let tickets = Tickets::default();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(InterceptorLayer::new(AUTH))
            .layer(
                IdempotencyLayer::new_for_grpc(store)
                    .scope_by_principal(|p: &Principal| p.0.clone())
                    .grpc_method(CREATE, |m| m),
            )
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    let barrier = Arc::new(Barrier::new(N));
    let tasks: Vec<_> = (0..N)
        .map(|i| {
            let barrier = barrier.clone();
            let user = if i % 2 == 0 { "alice" } else { "bob" };
            tokio::spawn(async move {
                let ch = channel(addr).await;
                barrier.wait().await;
                let res = call_on(
                    ch,
                    slow("burst", 300),
                    &as_user("k-burst", &format!("{user}.{i}")),
                )
                .await;
                (user, res)
            })
        })
        .collect();
    let mut ids: HashMap<&str, Vec<String>> = HashMap::new();
    let mut ran = 0;
    for task in tasks {
        let (user, res) = task.await.expect("task");
        match res {
            Ok(res) => {
                assert_eq!(res.get_ref().principal, user, "another principal's answer");
                if !replayed_meta(res.metadata()) {
                    ran += 1;
                }
                ids.entry(user)
                    .or_default()
                    .push(ticket_id(&res).expect("id"));
            }
            Err(status) => {
                assert_eq!(status.code(), Code::Aborted, "{status:?}");
                assert_eq!(reason(&status).as_deref(), Some("IN_FLIGHT"));
            }
        }
    }
    assert_eq!(ran, 2, "one run per principal");
    for (user, ids) in &ids {
        assert!(ids.windows(2).all(|w| w[0] == w[1]), "{user}: {ids:?}");
    }
    assert_eq!(
        tickets.effects.count(),
        2,
        "exactly one effect per principal at the sink"
    );
    // Late retries replay each principal's own answer.
    for user in ["alice", "bob"] {
        let res = call(
            addr,
            slow("burst", 300),
            &as_user("k-burst", &format!("{user}.9")),
        )
        .await
        .expect("replay");
        assert!(replayed_meta(res.metadata()));
        assert_eq!(res.get_ref().principal, user);
    }
    assert_eq!(tickets.effects.count(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_3_concurrent_principals_one_key_memory() {
    burst_two_principals(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_3_concurrent_principals_one_key_sqlite() {
    let (store, _path) = common::sqlite("tonic-burst").await;
    burst_two_principals(store).await;
}

/// §7.9 on one host: two tonic server replicas on one SQLite file, 16 clients at once with one
/// key, half to each. Exactly one run; the others get its replay or in-flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_9_two_tonic_replicas_on_one_sqlite_file_run_once() {
    const N: usize = 16;
    let (store_a, path) = common::sqlite("tonic-replicas").await;
    let store_b = tower_idempotency::SqliteStore::connect(&format!("sqlite://{}", path.display()))
        .await
        .expect("second process's store");
    let tickets = Tickets::default();
    let mut addrs = Vec::new();
    for store in [store_a, store_b] {
        let (inc, addr) = incoming().await;
        tokio::spawn(
            Server::builder()
                .layer(single_tenant(store))
                .add_service(tickets.clone())
                .serve_with_incoming(inc),
        );
        addrs.push(addr);
    }
    let barrier = Arc::new(Barrier::new(N));
    let tasks: Vec<_> = (0..N)
        .map(|i| {
            let barrier = barrier.clone();
            let addr = addrs[i % 2];
            tokio::spawn(async move {
                let ch = channel(addr).await;
                barrier.wait().await;
                call_on(ch, slow("replicas", 300), &keyed("k-replicas")).await
            })
        })
        .collect();
    let mut ids = Vec::new();
    for task in tasks {
        match task.await.expect("task") {
            Ok(res) => ids.push(ticket_id(&res).expect("id")),
            Err(status) => {
                assert_eq!(status.code(), Code::Aborted, "{status:?}");
                assert_eq!(reason(&status).as_deref(), Some("IN_FLIGHT"));
            }
        }
    }
    assert!(!ids.is_empty());
    assert!(ids.windows(2).all(|w| w[0] == w[1]), "{ids:?}");
    assert_eq!(tickets.effects.count(), 1, "one run across both replicas");
    for addr in addrs {
        let res = settle(addr, slow("replicas", 300), &keyed("k-replicas"), 100)
            .await
            .expect("replay");
        assert!(replayed_meta(res.metadata()));
    }
    assert_eq!(tickets.effects.count(), 1);
}

// ---- §1 step 4: what the fingerprint counts -------------------------------------------------

/// SHARP EDGE, README gRPC "The fingerprint is the method path and the request's message
/// frames as sent": metadata does not count. A handler that reads an amount from metadata is
/// replayed the first amount's answer to a retry carrying another amount (asserted as
/// documented).
#[tokio::test]
async fn s1_4_metadata_does_not_count_by_default_sharp_edge() {
    let tickets = Tickets::default();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(single_tenant(MemoryStore::new()))
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    let with = |amount: &str| Opts {
        metadata: vec![("x-amount", amount.to_owned())],
        ..keyed("k-amount")
    };
    let first = call(addr, title("pay"), &with("100")).await.expect("first");
    assert_eq!(first.get_ref().amount, "100");
    let other = call(addr, title("pay"), &with("999"))
        .await
        .expect("replayed");
    assert!(replayed_meta(other.metadata()));
    assert_eq!(
        other.get_ref().amount,
        "100",
        "documented: the first amount's answer"
    );
    assert_eq!(tickets.effects.count(), 1);
}

/// §1 step 4 "selected request headers are included (configurable list)", README
/// "Headers added with fingerprint_header count": on a gRPC server, a metadata entry named
/// with `fingerprint_header` must count: a retry with another amount is FAILED_PRECONDITION,
/// never the first amount's answer; the same amount replays. Binary metadata (`-bin`) too.
#[tokio::test]
async fn s1_4_fingerprint_header_counts_grpc_metadata() {
    let tickets = Tickets::default();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(
                single_tenant(MemoryStore::new())
                    .fingerprint_header(http::HeaderName::from_static("x-amount"))
                    .fingerprint_header(http::HeaderName::from_static("x-sig-bin")),
            )
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    let with = |key: &str, amount: &str| Opts {
        metadata: vec![("x-amount", amount.to_owned())],
        ..keyed(key)
    };
    call(addr, title("pay"), &with("k-fp", "100"))
        .await
        .expect("first");
    let changed = call(addr, title("pay"), &with("k-fp", "999"))
        .await
        .expect_err("another amount is another request");
    assert_eq!(changed.code(), Code::FailedPrecondition, "{changed:?}");
    assert_eq!(reason(&changed).as_deref(), Some("FINGERPRINT_MISMATCH"));
    let same = call(addr, title("pay"), &with("k-fp", "100"))
        .await
        .expect("replay");
    assert!(replayed_meta(same.metadata()));

    let sig = |key: &str, value: &[u8]| Opts {
        binary: vec![("x-sig-bin", value.to_vec())],
        ..keyed(key)
    };
    call(addr, title("signed"), &sig("k-sig", b"\x00\x01sig-a"))
        .await
        .expect("first");
    let same = call(addr, title("signed"), &sig("k-sig", b"\x00\x01sig-a"))
        .await
        .expect("same signature replays");
    assert!(replayed_meta(same.metadata()));
    let other = call(addr, title("signed"), &sig("k-sig", b"\x00\x01sig-b"))
        .await
        .expect_err("another signature is another request");
    assert_eq!(other.code(), Code::FailedPrecondition);
    assert_eq!((tickets.of("pay"), tickets.of("signed")), (1, 1));
}

/// One call over a raw HTTP/2 connection with the given extra headers: (`grpc-status`, whether
/// replayed).
async fn raw_call(
    addr: SocketAddr,
    key: &str,
    message: &Create,
    extra: &[(&str, &str)],
) -> (String, bool) {
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
    let mut request = http::Request::post(format!("http://{addr}{CREATE}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("idempotency-key", key);
    for (name, value) in extra {
        request = request.header(*name, *value);
    }
    let request = request.body(Full::new(frame.freeze())).expect("request");
    let (parts, body) = sender
        .send_request(request)
        .await
        .expect("response")
        .into_parts();
    let collected = body.collect().await.expect("body");
    let status = parts
        .headers
        .get("grpc-status")
        .or_else(|| collected.trailers().and_then(|t| t.get("grpc-status")))
        .map(|v| v.to_str().expect("ascii").to_owned())
        .unwrap_or_default();
    let replayed = parts
        .headers
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    (status, replayed)
}

/// §1 step 4 on `-bin` metadata named with `fingerprint_header`: gRPC says a binary value may
/// be sent padded or unpadded (`YWI` and `YWI=` are the same bytes). Whatever the layer makes
/// of the two spellings, a retry must never run the handler a second time: a replay or
/// FAILED_PRECONDITION. (Which one is reported as a sharp edge.)
#[tokio::test]
async fn s1_4_binary_metadata_padding_never_runs_twice() {
    let tickets = Tickets::default();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(
                single_tenant(MemoryStore::new())
                    .fingerprint_header(http::HeaderName::from_static("x-sig-bin")),
            )
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    let msg = title("padded");
    let (first, replayed) = raw_call(addr, "k-pad", &msg, &[("x-sig-bin", "YWI")]).await;
    assert_eq!((first.as_str(), replayed), ("0", false));
    let (second, replayed) = raw_call(addr, "k-pad", &msg, &[("x-sig-bin", "YWI=")]).await;
    assert!(
        (second == "0" && replayed) || second == "9",
        "padded retry: grpc-status {second}, replayed {replayed}"
    );
    // README: fingerprint headers count "as HTTP field values": `YWI` and `YWI=` differ as
    // text, so the retry is another request (documented; a sharp edge for gRPC, whose spec
    // makes them the same bytes).
    assert_eq!((second.as_str(), replayed), ("9", false));
    eprintln!("padded vs unpadded -bin value: grpc-status {second}, replayed {replayed}");
    assert_eq!(tickets.effects.count(), 1);
}

/// §1 step 4 on the method path: tonic dispatches `/pkg.Svc/Method?x=1` to `Method` (it reads
/// the path alone), so the layer must guard it as that method: one key, one run, whatever
/// query an adversarial client adds. A query that differs from the first call's may be a
/// mismatch, never a second run, never an unguarded run.
#[tokio::test]
async fn s1_4_a_query_on_a_guarded_method_is_still_guarded() {
    let tickets = Tickets::default();
    let store = MemoryStore::new();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(single_tenant(store.clone()))
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    let q = |key: &str, path: &'static str| Opts {
        path: Some(path),
        ..keyed(key)
    };
    let first = call(
        addr,
        title("q"),
        &q("k-q", "/tickets.Tickets/CreateTicket?x=1"),
    )
    .await
    .expect("first");
    assert!(!replayed_meta(first.metadata()));
    let second = call(
        addr,
        title("q"),
        &q("k-q", "/tickets.Tickets/CreateTicket?x=1"),
    )
    .await
    .expect("replay");
    assert!(
        replayed_meta(second.metadata()),
        "a query must not unguard the method"
    );
    let plain = call(addr, title("q"), &keyed("k-q")).await;
    match plain {
        Ok(res) => assert!(replayed_meta(res.metadata())),
        Err(status) => assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}"),
    }
    // Without a key, the query must not slip past `require_key`.
    let unkeyed = call(
        addr,
        title("q-nokey"),
        &Opts {
            path: Some("/tickets.Tickets/CreateTicket?x=2"),
            ..Opts::default()
        },
    )
    .await
    .expect_err("key required");
    assert_eq!(unkeyed.code(), Code::InvalidArgument);
    assert_eq!(tickets.of("q"), 1);
    assert_eq!(tickets.of("q-nokey"), 0);
}

// ---- §1 step 3 / §3: message sizes ---------------------------------------------------------

/// README gRPC table / `grpc` module docs (BODY_TOO_LARGE is RESOURCE_EXHAUSTED): a 2 MiB
/// message, well under tonic's 4 MiB decode limit, on a layer left at its 1 MiB default body
/// limit. Refused before anything is claimed (sharp edge: the README's gRPC table does not
/// list it), and the key stays free for a call that fits.
#[tokio::test]
async fn s1_3_a_message_over_the_layers_body_limit_claims_nothing() {
    let tickets = Tickets::default();
    let store = MemoryStore::new();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(single_tenant(store.clone()))
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    let big = Create {
        title: "big".into(),
        payload: vec![7; 2 << 20],
        ..Create::default()
    };
    let refused = call(addr, big, &keyed("k-big"))
        .await
        .expect_err("over the layer's body limit");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert_eq!(reason(&refused).as_deref(), Some("BODY_TOO_LARGE"));
    assert_eq!(store.len(), 0);
    let ran = call(addr, title("small"), &keyed("k-big"))
        .await
        .expect("the key is free");
    assert!(!replayed_meta(ran.metadata()));
    assert_eq!(tickets.started.count(), 1);
}

/// §1 step 3, README Configuration (a layer-wide setting given after `grpc_method` still
/// reaches the method): a server that raised tonic's `max_decoding_message_size` to 8 MiB and
/// the layer's `body_limit` to 6 MiB guards a 5 MiB message: one run, a replay byte-equal to
/// the first answer. An answer over the record limit (the 5 MiB echoed back) is never run
/// again: the retry is told it was not stored (FAILED_PRECONDITION RESPONSE_NOT_STORED).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_3_raised_limits_guard_a_large_message_once() {
    let tickets = Tickets {
        max_decode: Some(8 << 20),
        ..Tickets::default()
    };
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(single_tenant(MemoryStore::new()).body_limit(6 << 20))
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    let big = Create {
        title: "five".into(),
        payload: (0..(5u32 << 20)).map(|i| (i % 251) as u8).collect(),
        ..Create::default()
    };
    let first = call(addr, big.clone(), &keyed("k-five"))
        .await
        .expect("runs");
    assert_eq!(first.get_ref().size, 5 << 20);
    let again = call(addr, big.clone(), &keyed("k-five"))
        .await
        .expect("replay");
    assert!(replayed_meta(again.metadata()));
    assert_eq!(again.get_ref(), first.get_ref());
    assert_eq!(tickets.of("five"), 1);

    let echo = Create {
        title: "echo".into(),
        echo: true,
        ..big
    };
    let opts = Opts {
        max_decode: Some(8 << 20),
        ..keyed("k-echo")
    };
    let first = call(addr, echo.clone(), &opts)
        .await
        .expect("runs, answered whole");
    assert_eq!(first.get_ref().payload.len(), 5 << 20);
    let retry = call(addr, echo, &opts).await.expect_err("not stored");
    assert_eq!(retry.code(), Code::FailedPrecondition, "{retry:?}");
    assert_eq!(reason(&retry).as_deref(), Some("RESPONSE_NOT_STORED"));
    assert_eq!(tickets.of("echo"), 1, "never run again");
}

/// SHARP EDGE, DESIGN §3 (OUT_OF_RANGE is definitive): the layer's body limit raised to 8 MiB
/// but tonic's decode limit left at 4 MiB. A 5 MiB message is refused by tonic's decoder
/// (OUT_OF_RANGE) inside the layer, which records it as the key's outcome: retries are
/// replayed OUT_OF_RANGE (until the TTL, even once the operator raises tonic's limit), though
/// the handler never ran. Asserted as documented.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_tonics_decode_limit_out_of_range_is_recorded_sharp_edge() {
    let tickets = Tickets::default();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(single_tenant(MemoryStore::new()).body_limit(8 << 20))
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    let big = Create {
        title: "too-big".into(),
        payload: vec![1; 5 << 20],
        ..Create::default()
    };
    let first = call(addr, big.clone(), &keyed("k-oor"))
        .await
        .expect_err("tonic refuses");
    assert_eq!(first.code(), Code::OutOfRange, "{first:?}");
    let retry = call(addr, big, &keyed("k-oor"))
        .await
        .expect_err("replayed");
    assert_eq!(retry.code(), Code::OutOfRange);
    assert_eq!(retry.message(), first.message());
    assert!(
        replayed_meta(retry.metadata()),
        "documented: recorded as definitive"
    );
    assert_eq!(tickets.started.count(), 0);
}

// ---- §3 compression on one side only --------------------------------------------------------

/// SHARP EDGE, DESIGN §3 (UNIMPLEMENTED is definitive) + README "A compressed request is
/// fingerprinted as sent": a client that gzips its request to a server without gzip gets
/// tonic's UNIMPLEMENTED, recorded as the key's outcome though nothing ran; its retry with
/// the same bytes is replayed UNIMPLEMENTED, and the fix (sending uncompressed) under the same
/// key is another request (FAILED_PRECONDITION). Never a run. Asserted as documented.
#[tokio::test]
async fn s3_gzip_to_a_server_without_gzip_burns_the_key_sharp_edge() {
    let tickets = Tickets::default();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(single_tenant(MemoryStore::new()))
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    let gz = Opts {
        send_gzip: true,
        ..keyed("k-gz")
    };
    let first = call(addr, title("gz"), &gz)
        .await
        .expect_err("gzip unsupported");
    assert_eq!(first.code(), Code::Unimplemented, "{first:?}");
    let retry = call(addr, title("gz"), &gz).await.expect_err("replayed");
    assert_eq!(retry.code(), Code::Unimplemented);
    assert!(replayed_meta(retry.metadata()));
    let plain = call(addr, title("gz"), &keyed("k-gz"))
        .await
        .expect_err("another request");
    assert_eq!(plain.code(), Code::FailedPrecondition, "{plain:?}");
    assert_eq!(tickets.started.count(), 0);
}

/// §3 "A replay never carries a content encoding the retrying client did not accept", with a
/// server that compresses every answer it may (`send_compressed(Gzip)`) and accepts gzip: a
/// gzip client's compressed request runs once; a retry from the same client accepting only
/// identity reads its replay, equal to the first answer; a third accepting gzip again too.
#[tokio::test]
async fn s3_a_compressing_server_replays_to_every_accept_encoding() {
    let tickets = Tickets {
        accept_gzip: true,
        send_gzip: true,
        ..Tickets::default()
    };
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(single_tenant(MemoryStore::new()))
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    let msg = Create {
        title: "zip".into(),
        payload: vec![b'z'; 4096],
        echo: true,
        ..Create::default()
    };
    let gz = Opts {
        send_gzip: true,
        accept_gzip: true,
        ..keyed("k-zip")
    };
    let first = call(addr, msg.clone(), &gz).await.expect("first");
    let identity = Opts {
        send_gzip: true,
        accept_gzip: false,
        ..keyed("k-zip")
    };
    let replay = call(addr, msg.clone(), &identity)
        .await
        .expect("a retry that reads identity only reads the replay");
    assert!(replayed_meta(replay.metadata()));
    assert_eq!(replay.get_ref(), first.get_ref());
    let replay = call(addr, msg, &gz).await.expect("and a gzip one");
    assert!(replayed_meta(replay.metadata()));
    assert_eq!(replay.get_ref(), first.get_ref());
    assert_eq!(tickets.of("zip"), 1);
}

// ---- unguarded neighbours --------------------------------------------------------------------

/// README gRPC "unnamed methods (reads, streams) pass through untouched": a health service
/// (unary Check, server-streaming Watch) mounted next to the guarded service, called by a
/// client whose interceptor puts an `idempotency-key` on every call. Each call runs, none is
/// marked replayed, nothing is claimed; the guarded method on the same server still is.
#[tokio::test]
async fn s1_health_and_streaming_neighbours_pass_through_untouched() {
    let tickets = Tickets::default();
    let health = Health::default();
    let store = MemoryStore::new();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(InterceptorLayer::new(AUTH))
            .layer(
                IdempotencyLayer::new_for_grpc(store.clone())
                    .scope_by_principal(|p: &Principal| p.0.clone())
                    .grpc_method(CREATE, |m| m),
            )
            .add_service(tickets.clone())
            .add_service(health.clone())
            .serve_with_incoming(inc),
    );
    let keyed_everywhere = |mut req: tonic::Request<()>| -> Result<tonic::Request<()>, Status> {
        req.metadata_mut()
            .insert("idempotency-key", "k-everywhere".parse().expect("ascii"));
        req.metadata_mut()
            .insert("authorization", "Bearer alice.1".parse().expect("ascii"));
        Ok(req)
    };
    let mut statuses = Vec::new();
    for _ in 0..3 {
        let ch = InterceptedService::new(channel(addr).await, keyed_everywhere);
        let mut grpc = tonic::client::Grpc::new(ch);
        grpc.ready().await.expect("ready");
        let res = grpc
            .unary(
                tonic::Request::new(HealthCheckRequest {
                    service: "tickets.Tickets".into(),
                }),
                PathAndQuery::from_static(CHECK),
                ProstCodec::<_, HealthCheckResponse>::default(),
            )
            .await
            .expect("check");
        assert!(!replayed_meta(res.metadata()));
        statuses.push(res.into_inner().status);
        grpc.ready().await.expect("ready");
        let stream = grpc
            .server_streaming(
                tonic::Request::new(HealthCheckRequest::default()),
                PathAndQuery::from_static(WATCH),
                ProstCodec::<_, HealthCheckResponse>::default(),
            )
            .await
            .expect("watch");
        assert!(!replayed_meta(stream.metadata()));
        let mut stream = stream.into_inner();
        let mut got = Vec::new();
        while let Some(item) = stream.message().await.expect("stream item") {
            got.push(item.status);
        }
        assert_eq!(got.len(), 3, "the whole stream, every time");
    }
    assert_eq!(statuses, vec![1, 2, 3], "every check ran");
    assert_eq!((health.checks.count(), health.watches.count()), (3, 3));
    assert_eq!(store.len(), 0, "nothing was claimed for the neighbours");
    // The guarded method on the same server, with the same key, still runs once.
    for _ in 0..2 {
        call(addr, title("guarded"), &as_user("k-everywhere", "alice.1"))
            .await
            .expect("guarded");
    }
    assert_eq!(tickets.of("guarded"), 1);
}

// ---- a bidi neighbour, as server reflection is ------------------------------------------------

const REFLECT: &str = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo";

#[derive(Clone, Default)]
struct Reflection {
    streams: Effects,
}

impl tonic::server::NamedService for Reflection {
    const NAME: &'static str = "grpc.reflection.v1.ServerReflection";
}

type EchoStream = futures_util::stream::Map<
    tonic::Streaming<HealthCheckRequest>,
    fn(Result<HealthCheckRequest, Status>) -> Result<HealthCheckResponse, Status>,
>;

fn echo_len(item: Result<HealthCheckRequest, Status>) -> Result<HealthCheckResponse, Status> {
    item.map(|m| HealthCheckResponse {
        status: m.service.len() as i32,
    })
}

struct Reflect(Reflection);

impl tonic::server::StreamingService<HealthCheckRequest> for Reflect {
    type Response = HealthCheckResponse;
    type ResponseStream = EchoStream;
    type Future = BoxFuture<Result<tonic::Response<EchoStream>, Status>>;

    fn call(
        &mut self,
        request: tonic::Request<tonic::Streaming<HealthCheckRequest>>,
    ) -> Self::Future {
        self.0.streams.hit();
        Box::pin(async move {
            use futures_util::StreamExt;
            let echo: fn(_) -> _ = echo_len;
            Ok(tonic::Response::new(request.into_inner().map(echo)))
        })
    }
}

impl<B> tower::Service<http::Request<B>> for Reflection
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
        let this = self.clone();
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<
                HealthCheckResponse,
                HealthCheckRequest,
            >::default());
            Ok(match req.uri().path() {
                REFLECT => grpc.streaming(Reflect(this), req).await,
                _ => Status::unimplemented("no such method").into_http(),
            })
        })
    }
}

/// README gRPC "unnamed methods (reads, streams) pass through untouched": a bidi neighbour
/// (server reflection's shape) called with an `idempotency-key` by a client that waits for
/// each reply before it sends more. It must be neither buffered (the client would hang) nor
/// refused: each message is answered as it comes, and nothing is claimed.
#[tokio::test]
async fn s1_a_keyed_bidi_neighbour_is_neither_buffered_nor_refused() {
    let reflection = Reflection::default();
    let store = MemoryStore::new();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(single_tenant(store.clone()))
            .add_service(Tickets::default())
            .add_service(reflection.clone())
            .serve_with_incoming(inc),
    );
    let (tx, rx) = tokio::sync::mpsc::channel::<HealthCheckRequest>(4);
    let outbound =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let mut grpc = tonic::client::Grpc::new(channel(addr).await);
    grpc.ready().await.expect("ready");
    let mut request = tonic::Request::new(outbound);
    request
        .metadata_mut()
        .insert("idempotency-key", "k-bidi".parse().expect("ascii"));
    tx.send(HealthCheckRequest {
        service: "abc".into(),
    })
    .await
    .expect("send");
    let response = common::guard(
        "the bidi call's head",
        grpc.streaming(
            request,
            PathAndQuery::from_static(REFLECT),
            ProstCodec::<_, HealthCheckResponse>::default(),
        ),
    )
    .await
    .expect("not refused");
    assert!(!replayed_meta(response.metadata()));
    let mut inbound = response.into_inner();
    let first = common::guard("the first reply", inbound.message())
        .await
        .expect("reply")
        .expect("one");
    assert_eq!(first.status, 3);
    tx.send(HealthCheckRequest {
        service: "abcdefg".into(),
    })
    .await
    .expect("send");
    let second = common::guard("the second reply", inbound.message())
        .await
        .expect("reply")
        .expect("two");
    assert_eq!(second.status, 7);
    drop(tx);
    assert!(
        common::guard("the end", inbound.message())
            .await
            .expect("end")
            .is_none()
    );
    assert_eq!(reflection.streams.count(), 1);
    assert_eq!(store.len(), 0);
}

// ---- nested layers -----------------------------------------------------------------------------

/// README Configuration "An inner layer under an outer one ... Their scopes must agree": a
/// careless integrator keeps an app-wide `single_tenant()` layer on `Server::builder()` (for
/// some legacy method) and adds a per-service layer scoped by principal behind the auth
/// interceptor. The outer claim is under one shared scope: alice and bob with one key must
/// never share an answer: the inner layer refuses (INTERNAL SCOPE_MISSING), nothing runs, and
/// the outer key is not left in flight.
#[tokio::test]
async fn s1_2_a_single_tenant_layer_over_a_principal_layer_never_shares() {
    let tickets = Tickets::default();
    let outer_store = MemoryStore::new();
    let (inc, addr) = incoming().await;
    let inner = ServiceBuilder::new()
        .layer(InterceptorLayer::new(AUTH))
        .layer(
            IdempotencyLayer::new_for_grpc(MemoryStore::new())
                .scope_by_principal(|p: &Principal| p.0.clone())
                .grpc_method(CREATE, |m| m),
        )
        .service(tickets.clone());
    tokio::spawn(
        Server::builder()
            .layer(single_tenant(outer_store.clone()))
            .add_service(inner)
            .serve_with_incoming(inc),
    );
    for user in ["alice.1", "bob.1", "alice.2"] {
        let status = call(addr, title("nested"), &as_user("k-nested", user))
            .await
            .expect_err("the inner layer's scope is not the outer's: refused");
        assert_eq!(status.code(), Code::Internal, "{user}: {status:?}");
        assert_eq!(
            reason(&status).as_deref(),
            Some("SCOPE_MISSING"),
            "{status:?}"
        );
    }
    assert_eq!(
        tickets.started.count(),
        0,
        "nothing runs under conflicting scopes"
    );
    let record = outer_store
        .lookup(&ScopedKey::new("", "k-nested"))
        .await
        .expect("lookup");
    assert!(
        record
            .as_ref()
            .is_none_or(|r| r.status != RecordStatus::InProgress),
        "the outer claim is not left in flight: {record:?}"
    );
}

/// SHARP EDGE, README gRPC "unnamed methods ... pass through untouched": a `grpc_method` path
/// with a typo in its case (`/tickets.tickets/CreateTicket`) names no method tonic routes to,
/// so the real method is silently unguarded: a keyed retry runs again. The layer cannot tell
/// a typo from an unguarded read; asserted as documented.
#[tokio::test]
async fn s1_a_misspelled_grpc_method_is_silently_unguarded_sharp_edge() {
    let tickets = Tickets::default();
    let store = MemoryStore::new();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(
                IdempotencyLayer::new_for_grpc(store.clone())
                    .single_tenant()
                    .grpc_method("/tickets.tickets/CreateTicket", |m| m),
            )
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    for _ in 0..2 {
        let res = call(addr, title("typo"), &keyed("k-typo"))
            .await
            .expect("runs");
        assert!(!replayed_meta(res.metadata()));
    }
    assert_eq!(
        tickets.of("typo"),
        2,
        "documented: an unnamed method is not guarded"
    );
    assert_eq!(store.len(), 0);
}

// ---- batching and waiting on SQLite -------------------------------------------------------------

/// §5 (batched SQL stores: "a won claim whose caller left is given back") + README "the client
/// hangs up while the claim is in flight": the short-deadline storm of
/// `s1_5_deadlines_shorter_than_the_claim_strand_no_key_sqlite` against a SQLite store with
/// batching on, 32 keys at once so claims share batches. No key stranded, none run twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_deadlines_shorter_than_a_batched_claim_strand_no_key_sqlite() {
    const KEYS: usize = 32;
    let (store, _path) = common::sqlite("tonic-batched-deadlines").await;
    let store = store.with_batching(tower_idempotency::store::Batching::default());
    let tickets = Tickets::default();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(
                IdempotencyLayer::new_for_grpc(store.clone())
                    .single_tenant()
                    .grpc_method(CREATE, |m| m.lease(Duration::from_secs(120))),
            )
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    let barrier = Arc::new(Barrier::new(KEYS));
    let tasks: Vec<_> = (0..KEYS)
        .map(|i| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                let ch = channel(addr).await;
                let opts = Opts {
                    timeout: Some(Duration::from_millis(1 + 6 * i as u64)),
                    ..keyed(&format!("k-batch-{i}"))
                };
                barrier.wait().await;
                call_on(ch, slow(&format!("batch-{i}"), 5), &opts).await
            })
        })
        .collect();
    let mut cut = 0;
    for task in tasks {
        if task.await.expect("task").is_err() {
            cut += 1;
        }
    }
    eprintln!(
        "batched: {cut} of {KEYS} first calls cut short, {} handlers started",
        tickets.started.count()
    );
    let mut stranded = Vec::new();
    for i in 0..KEYS {
        let key = ScopedKey::new("", format!("k-batch-{i}"));
        let mut settled = false;
        for _ in 0..200 {
            match store.lookup(&key).await.expect("lookup") {
                Some(r) if r.status == RecordStatus::InProgress => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                _ => {
                    settled = true;
                    break;
                }
            }
        }
        if !settled {
            stranded.push(i);
        }
    }
    assert!(stranded.is_empty(), "keys left in flight: {stranded:?}");
    for i in 0..KEYS {
        let name = format!("batch-{i}");
        let key = format!("k-batch-{i}");
        let res = call(addr, slow(&name, 5), &keyed(&key))
            .await
            .unwrap_or_else(|s| panic!("{name}: {s:?}"));
        let again = call(addr, slow(&name, 5), &keyed(&key))
            .await
            .expect("replay");
        assert!(replayed_meta(again.metadata()), "{name}");
        assert_eq!(again.get_ref(), res.get_ref());
        assert_eq!(tickets.of(&name), 1, "{name}");
    }
}

/// §1 step 6 (wait for the first, then replay it) + §7.3 on SQLite (which polls): 16 tonic
/// clients at once with one key on a `wait_for_in_flight` route. Exactly one run, and every
/// caller gets that run's answer (no in-flight refusals within the wait, no second run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_3_waiting_burst_on_sqlite_gets_one_answer() {
    const N: usize = 16;
    let (store, _path) = common::sqlite("tonic-wait-burst").await;
    let tickets = Tickets::default();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(
                IdempotencyLayer::new_for_grpc(store)
                    .single_tenant()
                    .grpc_method(CREATE, |m| m.wait_for_in_flight(Duration::from_secs(20))),
            )
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    let barrier = Arc::new(Barrier::new(N));
    let tasks: Vec<_> = (0..N)
        .map(|_| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                let ch = channel(addr).await;
                barrier.wait().await;
                call_on(ch, slow("waiting", 400), &keyed("k-waiting")).await
            })
        })
        .collect();
    let mut ids = Vec::new();
    for task in tasks {
        let res = task
            .await
            .expect("task")
            .expect("every waiter gets the answer");
        ids.push((ticket_id(&res).expect("id"), res.into_inner()));
    }
    assert!(ids.windows(2).all(|w| w[0] == w[1]), "{ids:?}");
    assert_eq!(tickets.of("waiting"), 1);
}

/// §1 step 3 ("over it -> 413, nothing claimed") and step 7: a client that drops a 5 MiB call
/// while it is still uploading (or just after). Nothing may be left in flight, the handler
/// runs at most once, and the retry ends with one run and its replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_3_a_call_dropped_mid_upload_strands_nothing() {
    let tickets = Tickets {
        max_decode: Some(8 << 20),
        ..Tickets::default()
    };
    let store = MemoryStore::new();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(single_tenant(store.clone()).body_limit(6 << 20))
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    let big = Create {
        title: "upload".into(),
        payload: vec![3; 5 << 20],
        work_ms: 200,
        ..Create::default()
    };
    for (i, after_ms) in [1u64, 5, 20, 60].into_iter().enumerate() {
        let key = format!("k-upload-{i}");
        let msg = Create {
            title: format!("upload-{i}"),
            ..big.clone()
        };
        let (m, k) = (msg.clone(), key.clone());
        let task = tokio::spawn(async move { call(addr, m, &keyed(&k)).await });
        tokio::time::sleep(Duration::from_millis(after_ms)).await;
        task.abort();
        let _ = task.await;
        let res = settle(addr, msg.clone(), &keyed(&key), 200)
            .await
            .unwrap_or_else(|s| panic!("{key}: {s:?}"));
        let again = call(addr, msg.clone(), &keyed(&key)).await.expect("replay");
        assert!(replayed_meta(again.metadata()), "{key}");
        assert_eq!(again.get_ref(), res.get_ref());
        assert_eq!(tickets.of(&msg.title), 1, "{key}");
    }
}

/// §7.3 with tonic's multiplexing: 24 calls with one key at once on ONE channel (one HTTP/2
/// connection, as most tonic clients share a `Channel`), released through a barrier. Exactly
/// one run; every other answer is its replay or in-flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_3_one_key_multiplexed_on_one_channel_runs_once() {
    const N: usize = 24;
    let tickets = Tickets::default();
    let (store, _path) = common::sqlite("tonic-multiplexed").await;
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(single_tenant(store))
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    let ch = channel(addr).await;
    let barrier = Arc::new(Barrier::new(N));
    let tasks: Vec<_> = (0..N)
        .map(|_| {
            let (barrier, ch) = (barrier.clone(), ch.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                call_on(ch, slow("mux", 300), &keyed("k-mux")).await
            })
        })
        .collect();
    let mut ids = Vec::new();
    for task in tasks {
        match task.await.expect("task") {
            Ok(res) => ids.push(ticket_id(&res).expect("id")),
            Err(status) => {
                assert_eq!(status.code(), Code::Aborted, "{status:?}");
                assert_eq!(reason(&status).as_deref(), Some("IN_FLIGHT"));
            }
        }
    }
    assert!(ids.windows(2).all(|w| w[0] == w[1]), "{ids:?}");
    assert_eq!(tickets.of("mux"), 1);
}

/// SHARP EDGE, §1 step 3 / `RouteConfig::body_limit` ("the largest request body buffered"):
/// an integrator who sets the layer's `body_limit` to tonic's 4 MiB decode limit "to match"
/// has a layer that counts the 5-byte frame prefix: a message of exactly 4 MiB, which tonic
/// accepts, is over the layer's limit. Whatever the answer, nothing may run twice or be
/// claimed by a refusal. Asserted as documented: refused (RESOURCE_EXHAUSTED BODY_TOO_LARGE),
/// nothing claimed; five bytes less runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_3_a_body_limit_equal_to_tonics_decode_limit() {
    let tickets = Tickets::default();
    let store = MemoryStore::new();
    let (inc, addr) = incoming().await;
    tokio::spawn(
        Server::builder()
            .layer(single_tenant(store.clone()).body_limit(4 << 20))
            .add_service(tickets.clone())
            .serve_with_incoming(inc),
    );
    // A message whose encoding is exactly 4 MiB: field 4 (2 bytes of tag, 4 of length).
    let payload_len = (4 << 20) - 1 - 4;
    let msg = Create {
        payload: vec![9; payload_len],
        ..Create::default()
    };
    assert_eq!(msg.encoded_len(), 4 << 20);
    let refused = call(addr, msg.clone(), &keyed("k-edge"))
        .await
        .expect_err("documented: the limit counts the frame prefix, so this is over it");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert_eq!(reason(&refused).as_deref(), Some("BODY_TOO_LARGE"));
    assert_eq!(store.len(), 0, "a refusal claims nothing");
    assert_eq!(tickets.started.count(), 0);
    // Five bytes less fits.
    let fits = Create {
        payload: vec![9; payload_len - 5],
        ..Create::default()
    };
    call(addr, fits.clone(), &keyed("k-edge"))
        .await
        .expect("fits: runs");
    let again = call(addr, fits, &keyed("k-edge")).await.expect("replay");
    assert!(replayed_meta(again.metadata()));
    assert_eq!(tickets.started.count(), 1);
}
