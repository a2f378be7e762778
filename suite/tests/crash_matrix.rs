//! Issue 15 §9, the crash half: a server process killed with SIGKILL at each step of a request,
//! on PostgreSQL, SQLite, Redis and a Redis Cluster, with `LeaseExpiry::Reclaim` and `Reconcile`. A fresh process on the
//! same store then retries the key until the answer is definite. Effects are counted at a sink
//! file that both processes append to, so an effect made just before the kill still counts.
//!
//! Without a test harness: the binary is both the matrix (no arguments) and the server it kills
//! (`CRASH_CHILD` set), so no helper example is needed. It prints its table and exits non-zero
//! if a cell fails.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use tower_idempotency::store::AnyStore;
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, IdempotencyStore, LeaseExpiry};

/// Where the server is killed.
const STEPS: [&str; 6] = [
    "before_claim",
    "after_claim",
    "before_effect_started",
    "after_effect",
    "before_record",
    "after_record",
];

const LEASE: Duration = Duration::from_millis(600);

fn main() {
    if let Ok(step) = std::env::var("CRASH_CHILD") {
        return child(&step);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let failures = runtime.block_on(matrix());
    if failures > 0 {
        eprintln!("crash matrix: {failures} cells failed");
        std::process::exit(1);
    }
}

// ---- the server that is killed -------------------------------------------------------------

/// Stops the process where it stands: says where on stdout, then waits for the SIGKILL.
fn stop_here(step: &str, at: &str) {
    if step == at {
        println!("AT {at}");
        let _ = std::io::stdout().flush();
        loop {
            std::thread::sleep(Duration::from_secs(60));
        }
    }
}

/// The route: marks its effect started, makes it (one line in the sink file), answers 201.
fn app<St: IdempotencyStore>(
    store: St,
    expiry: LeaseExpiry,
    sink: PathBuf,
    step: Arc<str>,
) -> Router {
    let layer = IdempotencyLayer::new(store)
        .single_tenant()
        .lease(LEASE)
        .on_lease_expiry(expiry);
    Router::new().route(
        "/op",
        post(move |ctx: IdempotencyContext| async move {
            stop_here(&step, "before_effect_started");
            if ctx.effect_started().await.is_err() {
                return (StatusCode::SERVICE_UNAVAILABLE, "no milestone".to_owned());
            }
            let n = effect(&sink);
            stop_here(&step, "after_effect");
            (StatusCode::CREATED, format!("effect {n}"))
        })
        .layer(layer),
    )
}

/// Appends one effect to the sink; the count so far.
fn effect(sink: &Path) -> usize {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(sink)
        .expect("sink");
    file.write_all(b"effect\n").expect("write the effect");
    effects(sink)
}

fn effects(sink: &Path) -> usize {
    std::fs::read_to_string(sink).map_or(0, |s| s.lines().count())
}

fn expiry(name: &str) -> LeaseExpiry {
    if name == "reconcile" {
        LeaseExpiry::Reconcile
    } else {
        LeaseExpiry::Reclaim
    }
}

fn child(step: &str) {
    let env = |name: &str| std::env::var(name).expect(name);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let store = AnyStore::connect(&env("CRASH_STORE")).await.expect("store");
        // The steps around the claim and the record are the fault injector's.
        let mut store = common::faulty::Faulty::new(store);
        let stop_at: Arc<str> = step.into();
        store.at_step = Some(Arc::new(move |at| stop_here(&stop_at, at)));
        let app = app(
            store,
            expiry(&env("CRASH_EXPIRY")),
            env("CRASH_SINK").into(),
            step.into(),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        println!("LISTENING {}", listener.local_addr().expect("addr"));
        let _ = std::io::stdout().flush();
        axum::serve(listener, app).await.expect("serve");
    });
}

// ---- the matrix ------------------------------------------------------------------------------

struct Server {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
    addr: SocketAddr,
}

impl Server {
    fn start(step: &str, store: &str, expiry: &str, sink: &Path) -> Self {
        let mut child = Command::new(std::env::current_exe().expect("this binary"))
            .env("CRASH_CHILD", step)
            .env("CRASH_STORE", store)
            .env("CRASH_EXPIRY", expiry)
            .env("CRASH_SINK", sink)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the server");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let banner = lines
            .recv_timeout(Duration::from_secs(30))
            .expect("the server's banner");
        let addr = banner
            .strip_prefix("LISTENING ")
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no address in {banner:?}"));
        Self { child, lines, addr }
    }

    fn wait_for(&self, what: &str) -> bool {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(line) if line == what => return true,
                Ok(_) => {}
                Err(_) => return false,
            }
        }
        false
    }

    /// SIGKILL: no destructor, no graceful shutdown, nothing recorded on the way out.
    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn post_key(addr: SocketAddr, key: &str) -> Result<reqwest::Response, reqwest::Error> {
    common::client()
        .post(format!("http://{addr}/op"))
        .header("idempotency-key", key)
        .body("{}")
        .header("content-type", "application/json")
        .send()
        .await
}

/// One answer as the table shows it, and whether it is definite.
async fn answer_of(res: reqwest::Response) -> (String, bool) {
    let replayed = res
        .headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let status = res.status().as_u16();
    if res
        .headers()
        .get("content-type")
        .is_some_and(|v| v == "application/problem+json")
    {
        let p: serde_json::Value = res.json().await.unwrap_or_default();
        let slug = p["type"]
            .as_str()
            .and_then(|t| t.rsplit(':').next())
            .unwrap_or_default()
            .to_owned();
        let pending = slug == "in-flight" || slug == "store-unavailable";
        return (slug, !pending);
    }
    let how = if replayed { "replay" } else { "run" };
    (format!("{how} {status}"), true)
}

/// One cell: kill the server at `step`, then retry from a fresh process until definite.
async fn cell(store_url: &str, expiry_name: &str, step: &str) -> Result<String, String> {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let key = format!("crash-{step}-{expiry_name}-{nanos}");
    let sink = std::env::temp_dir().join(format!("tower-idempotency-{key}.effects"));
    let server = Server::start(step, store_url, expiry_name, &sink);
    let addr = server.addr;
    let k = key.clone();
    let first = tokio::spawn(async move { post_key(addr, &k).await });
    if !server.wait_for(&format!("AT {step}")) {
        server.kill();
        return Err(format!("the server never reached {step}"));
    }
    server.kill();
    let _ = first.await;
    let before = effects(&sink);

    // A fresh process: this one, on its own connection to the same store.
    let store = AnyStore::connect(store_url)
        .await
        .map_err(|e| e.to_string())?;
    let fresh = common::serve(app(store, expiry(expiry_name), sink.clone(), "none".into())).await;
    tokio::time::sleep(LEASE + Duration::from_millis(300)).await;
    let mut answers = Vec::new();
    let mut definite = 0;
    for _ in 0..30 {
        let res = post_key(fresh, &key).await.map_err(|e| e.to_string())?;
        let (answer, is_definite) = answer_of(res).await;
        answers.push(answer);
        if is_definite {
            definite += 1;
            if definite == 2 {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after = effects(&sink);
    let _ = std::fs::remove_file(&sink);
    let row = format!(
        "effects {before} then {after}; answers {}",
        answers.join(", ")
    );
    if after > 1 {
        return Err(format!("{row}: a second run"));
    }
    if before == 1 && answers.iter().any(|a| a.starts_with("run")) {
        return Err(format!("{row}: ran again after the effect"));
    }
    let last = answers.last().map(String::as_str).unwrap_or_default();
    if !(last.starts_with("replay") || last == "outcome-unknown") {
        return Err(format!("{row}: no definite end"));
    }
    Ok(row)
}

async fn matrix() -> usize {
    let mut stores = Vec::new();
    let path = common::sqlite_path("crash-matrix");
    stores.push(("sqlite", format!("sqlite://{}", path.display())));
    // The probe first: a server that is missing (or silent) is a skip, or a failure under CI.
    if common::postgres_pool().await.is_some() {
        match AnyStore::connect(&common::postgres_url()).await {
            Ok(_) => stores.push(("postgres", common::postgres_url())),
            Err(e) => common::unreachable(&format!("PostgreSQL at {}", common::postgres_url()), &e),
        }
    }
    if common::redis("crash-matrix").await.is_some() {
        stores.push(("redis", common::redis_url()));
    }
    if common::redis_cluster("crash-matrix").await.is_some() {
        let node = common::redis_cluster_url();
        let hosts = node.split_once("://").map_or(node.as_str(), |(_, h)| h);
        stores.push(("redis-cluster", format!("redis+cluster://{hosts}")));
    }
    let mut failures = 0;
    println!("crash matrix (SIGKILL at each step, then retries from a fresh process):");
    for (store_name, url) in &stores {
        for expiry_name in ["reclaim", "reconcile"] {
            for step in STEPS {
                let name = format!("{store_name}/{expiry_name}/{step}");
                match cell(url, expiry_name, step).await {
                    Ok(row) => println!("  ok   {name:<42} {row}"),
                    Err(why) => {
                        failures += 1;
                        println!("  FAIL {name:<42} {why}");
                    }
                }
            }
        }
    }
    let _ = std::fs::remove_file(&path);
    failures
}
