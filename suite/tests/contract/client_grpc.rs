//! Issue 22, the client layer on a tonic `Channel`: a real tonic client whose channel is
//! wrapped in `IdempotentClientLayer`, against a tonic server behind `IdempotencyLayer`, over
//! loopback TCP. The layer reads gRPC statuses from the trailers, the middleware's own from
//! their `ErrorInfo` reason, waits as their `RetryInfo` says, and its typed stops reach the
//! tonic caller as the source of the `Status`. Effects are counted in the handler.

use crate::common;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use common::Effects;
use common::faulty::Faulty;
use common::proxy::Proxy;
use http::uri::PathAndQuery;
use http_body_util::Full;
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower_idempotency::client::{
    CallReport, ClientError, Ended, IdempotentClient, IdempotentClientLayer, OperationKey,
};
use tower_idempotency::scope::SingleTenant;
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, MemoryStore};

#[derive(Clone, PartialEq, prost::Message)]
struct Step {
    #[prost(string, tag = "1")]
    op: String,
    #[prost(uint64, tag = "2")]
    work_ms: u64,
    /// What the handler does besides its work: see [`Mode`].
    #[prost(uint32, tag = "3")]
    mode: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Done {
    #[prost(string, tag = "1")]
    op: String,
    #[prost(uint64, tag = "2")]
    effect: u64,
}

/// What the handler does besides its work.
#[derive(Clone, Copy)]
#[repr(u32)]
enum Mode {
    /// Its effect, then OK.
    Plain = 0,
    /// Its effect, then the connection is cut before the answer leaves: processed, unheard.
    LoseReply = 1,
    /// Marks the effect started, then fails with INTERNAL: whether it happened is unknown.
    Uncertain = 2,
    /// No effect: NOT_FOUND, the operation's own definite answer.
    NotFound = 3,
}

const RUN: &str = "/steps.Steps/Run";

#[derive(Clone, Default)]
struct Steps {
    effects: Effects,
    proxy: Arc<OnceLock<Proxy>>,
}

impl tonic::server::NamedService for Steps {
    const NAME: &'static str = "steps.Steps";
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<B> tower::Service<http::Request<B>> for Steps
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
        let handler = Run(self.clone());
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Done, Step>::default());
            Ok(match req.uri().path() {
                RUN => grpc.unary(handler, req).await,
                _ => Status::unimplemented("no such method").into_http(),
            })
        })
    }
}

struct Run(Steps);

impl tonic::server::UnaryService<Step> for Run {
    type Response = Done;
    type Future = BoxFuture<Result<tonic::Response<Done>, Status>>;

    fn call(&mut self, request: tonic::Request<Step>) -> Self::Future {
        let steps = self.0.clone();
        let context = request.extensions().get::<IdempotencyContext>().cloned();
        Box::pin(async move {
            let step = request.into_inner();
            tokio::time::sleep(Duration::from_millis(step.work_ms)).await;
            match step.mode {
                m if m == Mode::NotFound as u32 => {
                    return Err(Status::not_found(format!("no account for {}", step.op)));
                }
                m if m == Mode::Uncertain as u32 => {
                    let context = context.expect("a guarded call");
                    context.effect_started().await.expect("milestone");
                    steps.effects.hit();
                    return Err(Status::internal("the ledger hung up mid-write"));
                }
                _ => {}
            }
            let effect = steps.effects.hit() as u64;
            if step.mode == Mode::LoseReply as u32 {
                let proxy = steps.proxy.get().expect("a proxy");
                proxy.cut();
                tokio::time::sleep(Duration::from_millis(50)).await;
                proxy.restore();
            }
            Ok(tonic::Response::new(Done {
                op: step.op,
                effect,
            }))
        })
    }
}

/// The tonic server behind the idempotency layer, and a proxy in front of it.
async fn serve(store: Faulty<MemoryStore>, steps: Steps, lease: Duration) -> Proxy {
    let layer: IdempotencyLayer<_, SingleTenant> = IdempotencyLayer::new_for_grpc(store)
        .single_tenant()
        .lease(lease)
        .grpc_method(RUN, |m| m);
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = Server::builder()
        .layer(layer)
        .add_service(steps.clone())
        .serve_with_incoming(TcpIncoming::from(listener));
    tokio::spawn(async move { server.await.expect("grpc server") });
    let proxy = Proxy::start(addr).await;
    let _ = steps.proxy.set(proxy.clone());
    proxy
}

/// What the layer hands the channel: tonic's body around the bytes it keeps.
type ToTonic = fn(http::Request<Full<Bytes>>) -> http::Request<tonic::body::Body>;
/// A channel behind the client layer.
type Guarded = IdempotentClient<tower::util::MapRequest<Channel, ToTonic>>;

/// A tonic client whose channel is wrapped in the client layer: the layer takes any body and
/// hands the channel one of tonic's.
fn guarded(channel: Channel, layer: IdempotentClientLayer) -> tonic::client::Grpc<Guarded> {
    let to_tonic: ToTonic = |r| r.map(tonic::body::Body::new);
    let service = tower::ServiceBuilder::new()
        .layer(layer)
        .map_request(to_tonic)
        .service(channel);
    tonic::client::Grpc::new(service)
}

fn channel(addr: SocketAddr) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect_lazy()
}

fn quick() -> IdempotentClientLayer {
    IdempotentClientLayer::new()
        .deadline(Duration::from_secs(20))
        .backoff(Duration::from_millis(10), Duration::from_millis(20))
}

async fn run(
    addr: SocketAddr,
    layer: IdempotentClientLayer,
    key: Option<&str>,
    step: Step,
) -> Result<tonic::Response<Done>, Status> {
    let mut grpc = guarded(channel(addr), layer);
    grpc.ready()
        .await
        .map_err(|e| Status::from_error(e.into()))?;
    let mut request = tonic::Request::new(step);
    if let Some(key) = key {
        request
            .extensions_mut()
            .insert(OperationKey::step("run-7", key).expect("key"));
    }
    grpc.unary(
        request,
        PathAndQuery::from_static(RUN),
        ProstCodec::default(),
    )
    .await
}

fn step(op: &str, work_ms: u64, mode: Mode) -> Step {
    Step {
        op: op.to_owned(),
        work_ms,
        mode: mode as u32,
    }
}

fn report<T>(response: &tonic::Response<T>) -> CallReport {
    response
        .extensions()
        .get::<CallReport>()
        .cloned()
        .expect("the layer reports every call")
}

#[tokio::test]
async fn s22_a_tonic_call_whose_reply_is_lost_is_retried_under_its_key_and_replayed() {
    let steps = Steps::default();
    let proxy = serve(Faulty::default(), steps.clone(), Duration::from_secs(5)).await;
    let response = run(
        proxy.addr,
        quick(),
        Some("lost"),
        step("lost", 10, Mode::LoseReply),
    )
    .await
    .expect("the answer, in the end");
    let report = report(&response);
    assert_eq!(steps.effects.count(), 1, "processed once");
    assert_eq!(response.get_ref().effect, 1);
    assert!(report.attempts >= 2, "the first reply was lost: {report:?}");
    assert_eq!(report.ended, Ended::Replayed, "{report:?}");
    assert_eq!(report.key, "run-7:lost");
}

#[tokio::test]
async fn s22_a_tonic_retry_of_a_running_call_waits_as_retry_info_says() {
    let steps = Steps::default();
    let proxy = serve(Faulty::default(), steps.clone(), Duration::from_secs(2)).await;
    // Attempts give up at 300 ms on a call that takes 1 500: the retries find it running.
    let layer = quick().attempt_timeout(Duration::from_millis(300));
    let response = run(
        proxy.addr,
        layer,
        Some("slow"),
        step("slow", 1_500, Mode::Plain),
    )
    .await
    .expect("the answer, in the end");
    let report = report(&response);
    assert_eq!(steps.effects.count(), 1, "run once");
    assert!(report.waits >= 1, "told to wait: {report:?}");
    // Backing off by 10-20 ms would have sent dozens of attempts in the 1.5 s; RetryInfo's
    // delay (the holder's remaining time, whole seconds) sends a handful.
    assert!(report.attempts <= 4, "RetryInfo honoured: {report:?}");
    assert_eq!(report.ended, Ended::Replayed);
}

#[tokio::test]
async fn s22_tonic_calls_through_store_outages_are_retried_under_their_key() {
    let steps = Steps::default();
    let store = Faulty::default();
    let proxy = serve(store.clone(), steps.clone(), Duration::from_secs(5)).await;
    store.down_for(Duration::from_millis(300));
    let response = run(
        proxy.addr,
        quick(),
        Some("outage"),
        step("outage", 5, Mode::Plain),
    )
    .await
    .expect("an answer once the store is back");
    let report = report(&response);
    assert!(report.attempts >= 2, "UNAVAILABLE was retried: {report:?}");
    assert_eq!(report.ended, Ended::Answered);
    assert_eq!(steps.effects.count(), 1);
}

fn client_error(status: &Status) -> &ClientError {
    ClientError::find_in(status).unwrap_or_else(|| panic!("a ClientError in {status:?}"))
}

#[tokio::test]
async fn s22_tonic_calls_stop_where_a_retry_would_be_wrong() {
    let steps = Steps::default();
    let proxy = serve(Faulty::default(), steps.clone(), Duration::from_secs(5)).await;

    // The key reused for another message: FAILED_PRECONDITION from the server, a typed stop.
    run(
        proxy.addr,
        quick(),
        Some("reused"),
        step("reused", 1, Mode::Plain),
    )
    .await
    .expect("first use");
    let status = run(
        proxy.addr,
        quick(),
        Some("reused"),
        step("other", 1, Mode::Plain),
    )
    .await
    .expect_err("another message under the key");
    assert!(
        matches!(client_error(&status), ClientError::KeyReused { key } if key == "run-7:reused"),
        "{status:?}"
    );
    assert_eq!(steps.effects.count(), 1);

    // The effect started, then INTERNAL: retried once under the key, which is now uncertain:
    // the caller gets OutcomeUnknown, not a second effect.
    let status = run(
        proxy.addr,
        quick(),
        Some("unsure"),
        step("unsure", 1, Mode::Uncertain),
    )
    .await
    .expect_err("unknown");
    assert!(
        matches!(client_error(&status), ClientError::OutcomeUnknown { .. }),
        "{status:?}"
    );
    assert_eq!(steps.effects.count(), 2, "the uncertain effect, once");

    // The operation's own definite answer reaches the caller as its status, after one attempt.
    let status = run(
        proxy.addr,
        quick(),
        Some("missing"),
        step("missing", 1, Mode::NotFound),
    )
    .await
    .expect_err("NOT_FOUND");
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert!(ClientError::find_in(&status).is_none());

    // No operation key: nothing sent.
    let status = run(proxy.addr, quick(), None, step("keyless", 1, Mode::Plain))
        .await
        .expect_err("refused");
    assert!(matches!(client_error(&status), ClientError::NoOperationKey));
    assert_eq!(steps.effects.count(), 2, "neither ran");
}
