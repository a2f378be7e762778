//! The operator console, mounted behind the application's own auth.
//!
//! ```text
//! cargo run -p suite --example operator_console -- --demo          # a few uncertain keys, then serve
//! cargo run -p suite --example operator_console -- --demo --once   # the same, print the listing, exit
//! ```
//!
//! `--demo` opens a SQLite store in a temporary file, runs a payments route whose handler starts
//! its effect and then fails (so each key ends up awaiting reconciliation), and serves the
//! console on 127.0.0.1:3001 (ADDR=host:port) under `/ops/idempotency`. Its auth is a stand-in:
//! a token (OPS_TOKEN, or one printed at start-up) given once at `/login?token=…` sets a
//! cookie. A real application puts its own authentication and authorisation there: the console
//! shows stored responses and settles outcomes by hand, and has no login of its own.

use std::net::SocketAddr;
use std::process::ExitCode;

use axum::Router;
use axum::extract::Request;
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use tower_idempotency::console::Console;
use tower_idempotency::store::{SqliteStore, UncertainQuery};
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, IdempotencyStore};

/// The stand-in for your auth: the operator's token, as a cookie.
async fn operators_only(token: String, req: Request, next: Next) -> Response {
    let cookie = format!("ops-token={token}");
    let signed_in = req
        .headers()
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.split(';').any(|c| c.trim() == cookie));
    if signed_in {
        next.run(req).await
    } else {
        (StatusCode::UNAUTHORIZED, "sign in at /login?token=…").into_response()
    }
}

async fn login(token: String, req: Request) -> Response {
    let given = req
        .uri()
        .query()
        .and_then(|q| form_urlencoded::parse(q.as_bytes()).find(|(n, _)| n == "token"))
        .map(|(_, v)| v.into_owned());
    if given.as_deref() != Some(token.as_str()) {
        return (StatusCode::UNAUTHORIZED, "wrong token").into_response();
    }
    let mut res = Redirect::to("/ops/idempotency").into_response();
    let cookie = format!("ops-token={token}; Path=/; HttpOnly; SameSite=Strict");
    if let Ok(value) = cookie.parse() {
        res.headers_mut().insert(header::SET_COOKIE, value);
    }
    res
}

fn app(store: SqliteStore, token: String) -> Router {
    let charge = post(|ctx: IdempotencyContext, body: String| async move {
        // The effect starts, then the provider never answers: outcome unknown.
        if ctx.effect_started().await.is_err() {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                "store unavailable".to_owned(),
            );
        }
        (
            StatusCode::BAD_GATEWAY,
            format!("provider timed out charging {body}"),
        )
    });
    let guard = token.clone();
    let console = Console::new(store.clone())
        .router()
        .layer(middleware::from_fn(move |req: Request, next: Next| {
            operators_only(guard.clone(), req, next)
        }));
    Router::new()
        .route("/charge", charge)
        .route_layer(IdempotencyLayer::new(store).single_tenant())
        .route("/login", get(move |req: Request| login(token.clone(), req)))
        .nest("/ops/idempotency", console)
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(tracing_subscriber::filter::LevelFilter::WARN)
        .init();
    let args: Vec<String> = std::env::args().collect();
    if !args.iter().any(|a| a == "--demo") {
        eprintln!("run with --demo (see the file's header)");
        return ExitCode::FAILURE;
    }
    let once = args.iter().any(|a| a == "--once");
    let path = std::env::temp_dir().join(format!("operator-console-{}.db", std::process::id()));
    let store = match SqliteStore::connect(&format!("sqlite://{}", path.display())).await {
        Ok(store) => store,
        Err(e) => {
            eprintln!("cannot open the demo store: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = store.migrate().await {
        eprintln!("cannot migrate the demo store: {e}");
        return ExitCode::FAILURE;
    }
    let token = std::env::var("OPS_TOKEN").unwrap_or_else(|_| {
        // Two 64-bit values from std's randomly seeded hasher: a stand-in, not a password
        // scheme.
        use std::hash::BuildHasher;
        let random = || std::collections::hash_map::RandomState::new().hash_one(0u8);
        format!("{:016x}{:016x}", random(), random())
    });
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3001".to_owned());
    let addr = if once { "127.0.0.1:0".to_owned() } else { addr };
    let listener = match tokio::net::TcpListener::bind(&addr).await {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!("cannot listen on {addr}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let Ok(local) = listener.local_addr() else {
        return ExitCode::FAILURE;
    };
    let server = axum::serve(listener, app(store.clone(), token.clone()));
    let serving = tokio::spawn(async move { server.await });
    for (key, amount) in [
        ("order-1001", "12 EUR"),
        ("order-1002", "7 EUR"),
        ("order-1003", "40 EUR"),
    ] {
        if let Err(e) = charge(local, key, amount).await {
            eprintln!("demo call failed: {e}");
            return ExitCode::FAILURE;
        }
    }
    let page = match store.list_uncertain(&UncertainQuery::first(50)).await {
        Ok(page) => page,
        Err(e) => {
            eprintln!("cannot list: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("{:<14} {:<22} {:>8}", "key", "status", "attempts");
    for record in &page.records {
        println!(
            "{:<14} {:<22} {:>8}",
            record.key.key(),
            record.status.as_str(),
            record.attempts
        );
    }
    if page.records.len() != 3 {
        eprintln!("WRONG: expected 3 keys awaiting reconciliation");
        return ExitCode::FAILURE;
    }
    if once {
        drop(store);
        remove_demo_files(&path);
        return ExitCode::SUCCESS;
    }
    println!("\nconsole: http://{local}/login?token={token}  (the stand-in auth sets a cookie)");
    match serving.await {
        Ok(Ok(())) => ExitCode::SUCCESS,
        _ => ExitCode::FAILURE,
    }
}

/// One keyed call of the payments route, over HTTP/1.1.
async fn charge(
    addr: SocketAddr,
    key: &str,
    amount: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let status = reqwest::Client::new()
        .post(format!("http://{addr}/charge"))
        .header("idempotency-key", key)
        .body(amount.to_owned())
        .send()
        .await?
        .status();
    if status != StatusCode::BAD_GATEWAY {
        return Err(format!("{key}: expected 502, got {status}").into());
    }
    Ok(())
}

/// The demo database and SQLite's files beside it.
fn remove_demo_files(path: &std::path::Path) {
    for suffix in ["", "-wal", "-shm"] {
        let mut file = path.as_os_str().to_owned();
        file.push(suffix);
        let _ = std::fs::remove_file(file);
    }
}
