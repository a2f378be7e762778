//! An "agent tools" server whose write endpoint is safe to retry.
//!
//! ```text
//! cargo run --example quickstart                 # serve on 127.0.0.1:3000 (ADDR=host:port)
//! cargo run --example quickstart -- --demo       # run the contract against itself, print a table
//! cargo run --example quickstart --all-features -- --store sqlite://tickets.db
//! cargo run --example quickstart --all-features -- --store postgres://postgres@127.0.0.1/test
//! cargo run --example quickstart --all-features -- --store redis://127.0.0.1:6379
//! ```
//!
//! The store comes from `--store URL`, else the `IDEMPOTENCY_STORE` environment variable, else
//! `memory://`.
//!
//! Try it:
//!
//! ```text
//! curl -i -X POST localhost:3000/tools/create_ticket -H 'Authorization: Bearer agent-1' \
//!      -H 'Idempotency-Key: k1' -H 'Content-Type: application/json' -d '{"title":"printer on fire"}'
//! curl localhost:3000/effects        # tickets actually created
//! ```
//!
//! Keys are scoped by the calling agent (the principal the auth layer sets), not by its token:
//! a retry with a refreshed token still replays, and two agents using the same key never see
//! each other's tickets.
//! ```

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Json, Router};
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tower_idempotency::store::AnyStore;
use tower_idempotency::{IdempotencyContext, IdempotencyLayer};

/// Who is calling: set by `authenticate`, read by the idempotency layer's scope.
#[derive(Clone)]
struct Agent(String);

/// A stand-in for your auth layer: `Authorization: Bearer <agent>` names the agent (a real app
/// verifies a token here and looks its owner up). No credentials, no entry: 401.
async fn authenticate(mut req: Request, next: Next) -> Result<Response, StatusCode> {
    let agent = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .filter(|agent| !agent.is_empty())
        .ok_or(StatusCode::UNAUTHORIZED)?
        .to_owned();
    req.extensions_mut().insert(Agent(agent));
    Ok(next.run(req).await)
}

/// The side effect we must not repeat: tickets created.
#[derive(Clone, Default)]
struct Tickets(Arc<AtomicU64>);

async fn create_ticket(
    State(tickets): State<Tickets>,
    ctx: IdempotencyContext,
    Json(input): Json<Value>,
) -> (StatusCode, [(&'static str, String); 1], Json<Value>) {
    // Pretend to work for a while, as a real ticketing backend would.
    let work = input["work_ms"].as_u64().unwrap_or(50);
    tokio::time::sleep(Duration::from_millis(work)).await;
    let id = tickets.0.fetch_add(1, Ordering::SeqCst) + 1;
    println!(
        "  [effect] ticket #{id} created (key {:?}, attempt {})",
        ctx.key(),
        ctx.attempt()
    );
    (
        StatusCode::CREATED,
        [("location", format!("/tickets/{id}"))],
        Json(json!({ "ticket": id, "title": input["title"] })),
    )
}

fn app(tickets: Tickets, store: AnyStore) -> Router {
    Router::new()
        .route("/tools/create_ticket", post(create_ticket))
        // `route_layer`: only the routes above are guarded. Keys are scoped by the agent.
        .route_layer(
            IdempotencyLayer::new(store).scope_by_principal(|agent: &Agent| agent.0.clone()),
        )
        // Added after, so it runs first: the principal is set before the layer reads it.
        .route_layer(middleware::from_fn(authenticate))
        .route(
            "/effects",
            get(|State(t): State<Tickets>| async move {
                Json(json!({ "tickets": t.0.load(Ordering::SeqCst) }))
            }),
        )
        .with_state(tickets)
}

#[tokio::main]
async fn main() -> ExitCode {
    // Without a subscriber the layer's logs (a store it cannot reach, a record it cannot
    // write) go nowhere: install one first. `RUST_LOG`-style filtering needs the
    // `env-filter` feature; this prints INFO and above.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().collect();
    let demo = args.iter().any(|a| a == "--demo");
    let url = args
        .iter()
        .position(|a| a == "--store")
        .and_then(|i| args.get(i + 1).cloned())
        .or_else(|| std::env::var("IDEMPOTENCY_STORE").ok())
        .unwrap_or_else(|| "memory://".to_owned());
    let store = match AnyStore::connect(&url).await {
        Ok(store) => store,
        Err(e) => {
            // The error names the store without its password, and why it failed.
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let addr = if demo {
        "127.0.0.1:0".to_owned()
    } else {
        std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned())
    };
    let listener = match tokio::net::TcpListener::bind(&addr).await {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!("cannot listen on {addr}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let local = listener.local_addr().expect("bound address");
    let tickets = Tickets::default();
    let server = axum::serve(listener, app(tickets.clone(), store));
    if !demo {
        println!(
            "agent tools on http://{local} (POST /tools/create_ticket, GET /effects), store {}",
            // Never the password: logs and terminals are shared.
            AnyStore::redacted_url(&url)
        );
        return match server.await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("server failed: {e}");
                ExitCode::FAILURE
            }
        };
    }
    tokio::spawn(async move { server.await });
    if demo_run(local, &tickets).await {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

struct Row {
    scenario: &'static str,
    expected: &'static str,
    got: String,
    effects: u64,
    ok: bool,
}

async fn call(addr: SocketAddr, key: String, body: Value) -> (u16, bool) {
    // A fresh connection per call, as independent retries would be.
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("the demo server accepts");
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("HTTP/1.1 handshake");
    tokio::spawn(connection);
    let request = axum::http::Request::post("/tools/create_ticket")
        .header(header::HOST, addr.to_string())
        .header(header::AUTHORIZATION, "Bearer demo-agent")
        .header(header::CONTENT_TYPE, "application/json")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("a valid request");
    let res = sender
        .send_request(request)
        .await
        .expect("the demo server answers");
    (
        res.status().as_u16(),
        res.headers().contains_key("idempotency-replayed"),
    )
}

async fn demo_run(addr: SocketAddr, tickets: &Tickets) -> bool {
    // Keys unique to this run, so a durable store's records from earlier runs do not answer.
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let key = |name: &str| format!("demo-{run}-{name}");
    let effects = || tickets.0.load(Ordering::SeqCst);
    let mut rows = Vec::new();
    let mut row = |scenario, expected, got: String, ok, effects| {
        rows.push(Row {
            scenario,
            expected,
            got,
            effects,
            ok,
        });
    };

    let body = json!({ "title": "printer on fire" });
    let (status, replayed) = call(addr, key("1"), body.clone()).await;
    row(
        "first call",
        "201, 1 effect",
        format!("{status}{}", if replayed { " replayed" } else { "" }),
        status == 201 && !replayed && effects() == 1,
        effects(),
    );

    let (status, replayed) = call(addr, key("1"), body.clone()).await;
    row(
        "retry, same key",
        "201 replayed, still 1",
        format!("{status}{}", if replayed { " replayed" } else { "" }),
        status == 201 && replayed && effects() == 1,
        effects(),
    );

    let (status, _) = call(addr, key("1"), json!({ "title": "a different ticket" })).await;
    row(
        "same key, changed body",
        "422, still 1",
        status.to_string(),
        status == 422 && effects() == 1,
        effects(),
    );

    let before = effects();
    let burst: Vec<_> = (0..32)
        .map(|_| {
            tokio::spawn(call(
                addr,
                key("burst"),
                json!({ "title": "burst", "work_ms": 300 }),
            ))
        })
        .collect();
    let mut answers = std::collections::BTreeMap::new();
    for task in burst {
        let (status, replayed) = task.await.expect("burst call");
        *answers
            .entry(format!("{status}{}", if replayed { "r" } else { "" }))
            .or_insert(0) += 1;
    }
    let ran = answers.get("201").copied().unwrap_or(0);
    row(
        "32 concurrent, one key",
        "one 201, rest 409/replay",
        format!("{answers:?}"),
        ran == 1 && effects() == before + 1,
        effects(),
    );

    let before = effects();
    let slow = json!({ "title": "slow", "work_ms": 1000 });
    let first = tokio::spawn(call(addr, key("slow"), slow.clone()));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (mid, _) = call(addr, key("slow"), slow.clone()).await;
    let (done, _) = first.await.expect("slow call");
    let (after, replayed) = call(addr, key("slow"), slow).await;
    row(
        "mid-flight retry",
        "409, then 201 replayed",
        format!(
            "{mid}, then {after}{}",
            if replayed { " replayed" } else { "" }
        ),
        mid == 409 && done == 201 && after == 201 && replayed && effects() == before + 1,
        effects(),
    );

    println!(
        "\n{:<24} {:<26} {:<40} {:>7}  result",
        "scenario", "expected", "got", "effects"
    );
    let mut all = true;
    for r in &rows {
        all &= r.ok;
        println!(
            "{:<24} {:<26} {:<40} {:>7}  {}",
            r.scenario,
            r.expected,
            r.got,
            r.effects,
            if r.ok { "ok" } else { "WRONG" }
        );
    }
    println!(
        "\n{}",
        if all {
            "every row as expected"
        } else {
            "SOME ROWS ARE WRONG"
        }
    );
    all
}
