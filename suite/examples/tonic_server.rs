//! A tonic gRPC server whose `CreateTicket` is safe to retry; `GetTicket` is left unguarded.
//!
//! ```text
//! cargo run -p suite --example tonic_server     # serve on 127.0.0.1:50051
//! cargo run -p suite --example tonic_server -- --demo  # call itself, print what happened
//! ```
//!
//! The service is written by hand with prost messages, the way tonic's generated code is, so
//! the example needs no `protoc`. With generated code it is the same one line:
//! `Server::builder().layer(layer).add_service(TicketsServer::new(service))`.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::uri::PathAndQuery;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Endpoint, Server};
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, MemoryStore};

const CREATE: &str = "/tickets.Tickets/CreateTicket";
const GET: &str = "/tickets.Tickets/GetTicket";

/// The request message.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CreateTicket {
    /// What the ticket is about.
    #[prost(string, tag = "1")]
    pub title: String,
}

/// The response message.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Ticket {
    /// The ticket number.
    #[prost(uint64, tag = "1")]
    pub id: u64,
    /// What it is about.
    #[prost(string, tag = "2")]
    pub title: String,
}

/// The service: every `CreateTicket` that runs creates a ticket.
#[derive(Clone, Default)]
struct Tickets {
    created: Arc<AtomicU64>,
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
        let handler = Handler(self.clone());
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Ticket, CreateTicket>::default());
            Ok(match req.uri().path() {
                CREATE | GET => grpc.unary(handler, req).await,
                _ => Status::unimplemented("no such method").into_http(),
            })
        })
    }
}

struct Handler(Tickets);

impl tonic::server::UnaryService<CreateTicket> for Handler {
    type Response = Ticket;
    type Future = BoxFuture<Result<Response<Ticket>, Status>>;

    fn call(&mut self, request: Request<CreateTicket>) -> Self::Future {
        let created = self.0.created.clone();
        let attempt = request
            .extensions()
            .get::<IdempotencyContext>()
            .map_or(0, IdempotencyContext::attempt);
        Box::pin(async move {
            let title = request.into_inner().title;
            let id = created.fetch_add(1, Ordering::SeqCst) + 1;
            println!("  [effect] ticket #{id} {title:?} (attempt {attempt})");
            Ok(Response::new(Ticket { id, title }))
        })
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    // Without a subscriber the layer's logs (a store it cannot reach, a record it cannot
    // write) go nowhere.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let demo = std::env::args().any(|a| a == "--demo");
    let addr = if demo {
        "127.0.0.1:0"
    } else {
        "127.0.0.1:50051"
    };
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!("cannot listen on {addr}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let Ok(local) = listener.local_addr() else {
        return ExitCode::FAILURE;
    };
    let tickets = Tickets::default();
    // One layer for the whole server: CreateTicket needs a key, everything else passes.
    let layer = IdempotencyLayer::new_for_grpc(MemoryStore::new())
        .single_tenant()
        .grpc_method(CREATE, |m| m);
    let server = Server::builder()
        .layer(layer)
        .add_service(tickets.clone())
        .serve_with_incoming(TcpIncoming::from(listener));
    if !demo {
        println!("tickets gRPC service on http://{local}");
        return match server.await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("server failed: {e}");
                ExitCode::FAILURE
            }
        };
    }
    tokio::spawn(server);
    match run_demo(local, &tickets).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("demo failed: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn create(
    addr: SocketAddr,
    key: Option<&str>,
    title: &str,
) -> Result<Result<Response<Ticket>, Status>, Box<dyn std::error::Error>> {
    let channel = Endpoint::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await?;
    let mut request = Request::new(CreateTicket {
        title: title.to_owned(),
    });
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse()?);
    }
    Ok(grpc
        .unary(
            request,
            PathAndQuery::from_static(CREATE),
            ProstCodec::default(),
        )
        .await)
}

/// The answer in a few words for the table: the ticket, or the gRPC status code.
fn describe(result: &Result<Response<Ticket>, Status>) -> String {
    match result {
        Ok(res) => {
            let replayed = res.metadata().get("idempotency-replayed").is_some();
            let ticket = res.get_ref();
            format!(
                "OK ticket #{}{}",
                ticket.id,
                if replayed { " (replayed)" } else { "" }
            )
        }
        Err(status) => format!("{:?}", status.code()),
    }
}

async fn run_demo(addr: SocketAddr, tickets: &Tickets) -> Result<bool, Box<dyn std::error::Error>> {
    let first = create(addr, Some("demo-1"), "printer on fire").await?;
    let retry = create(addr, Some("demo-1"), "printer on fire").await?;
    let changed = create(addr, Some("demo-1"), "a different ticket").await?;
    let missing = create(addr, None, "no key").await?;
    let rows = [
        ("first call", describe(&first), first.is_ok()),
        (
            "retry, same key",
            describe(&retry),
            retry
                .as_ref()
                .is_ok_and(|r| r.metadata().contains_key("idempotency-replayed")),
        ),
        (
            "same key, changed message",
            describe(&changed),
            changed
                .as_ref()
                .is_err_and(|s| s.code() == tonic::Code::FailedPrecondition),
        ),
        (
            "no key",
            describe(&missing),
            missing
                .as_ref()
                .is_err_and(|s| s.code() == tonic::Code::InvalidArgument),
        ),
    ];
    let created = tickets.created.load(Ordering::SeqCst);
    let mut all = created == 1;
    println!("\n{:<28} {:<26} result", "call", "answer");
    for (scenario, got, ok) in &rows {
        all &= ok;
        println!(
            "{scenario:<28} {got:<26} {}",
            if *ok { "ok" } else { "WRONG" }
        );
    }
    // The statuses' messages, which say what to do, below the table rather than across it.
    for (scenario, result) in [
        ("same key, changed message", &changed),
        ("no key", &missing),
    ] {
        if let Err(status) = result {
            println!("\n{scenario}: {}", status.message());
        }
    }
    println!("\ntickets created: {created} (expected 1)");
    Ok(all)
}
