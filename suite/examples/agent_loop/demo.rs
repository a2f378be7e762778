//! The agent loop of issue 22, shared by the example (`--demo`, 10 000 operations) and the
//! test `agent_loop_kills` (a smaller run): an orchestrator runs workflow steps against a tool
//! server process on PostgreSQL, with faults on both sides, and counts effects at the sink (a
//! PostgreSQL table the handler inserts into).
//!
//! - **The server** is this same binary with `AGENT_LOOP_SERVE` set. Its handler takes 10-60 ms,
//!   or 1.8-2.4 s for one step in 250 (past the clients' first attempt timeout); its store goes
//!   down for 150 ms every 1.7 s (503s); on marked steps it stops after the effect and asks to
//!   be killed, and the orchestrator SIGKILLs it and starts a new process on the same port.
//!   Its route reconciles expired leases (`LeaseExpiry::Reconcile`): a step that was running
//!   in a killed process is `409 outcome-unknown` until a reconciliation settles it.
//! - **Between them** a proxy loses one reply in fifteen after the server sent it.
//! - **Ours**: `IdempotentClientLayer` with one key per step (`OperationKey::step`), attempts
//!   that outlast the published window. An `OutcomeUnknown` step waits for a reconciliation
//!   pass (a `Sweeper` whose reconciler looks for the step's row at the sink), then is asked
//!   again under its key.
//! - **Naive, new key**: a new key per attempt. **Naive, short deadline**: one key per call,
//!   but a deadline under the window; a call that gives up is planned again with a new key, as
//!   an agent that lost its tool call would.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower::ServiceExt;
use tower_idempotency::client::{ClientError, IdempotentClientLayer, OperationKey};
use tower_idempotency::reconcile::{Reconciler, Reconciliation, Sweeper};
use tower_idempotency::store::{PostgresStore, Record, StoredResponse};
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, LeaseExpiry};

use crate::faulty::Faulty;

/// How big a run is.
#[derive(Debug, Clone, Copy)]
pub struct Size {
    /// Steps per client.
    pub operations: usize,
    /// Steps in flight per client.
    pub concurrency: usize,
    /// One of ours in this many is a step the server is killed in.
    pub kill_every: usize,
}

/// What a run found.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Per client: (name, operations, effects at the sink, duplicates, steps without an answer).
    pub clients: Vec<(&'static str, usize, usize, usize, usize)>,
    /// Server processes killed.
    pub kills: usize,
    /// Our steps that came back `OutcomeUnknown` and were settled by a reconciliation.
    pub settled: usize,
    /// Replies the proxy lost.
    pub lost: usize,
    /// What went wrong with ours, if anything.
    pub failures: Vec<String>,
}

impl Outcome {
    /// Ours: every step once, each with its answer.
    pub fn ours_exact(&self) -> bool {
        self.failures.is_empty()
            && self
                .clients
                .first()
                .is_some_and(|&(_, ops, effects, dups, open)| {
                    effects == ops && dups == 0 && open == 0
                })
    }

    /// The table the demo prints.
    pub fn table(&self) -> String {
        let mut out = format!(
            "{:<22} {:>10} {:>8} {:>10} {:>12}\n",
            "client", "operations", "effects", "duplicates", "no answer"
        );
        for (name, ops, effects, dups, open) in &self.clients {
            out += &format!("{name:<22} {ops:>10} {effects:>8} {dups:>10} {open:>12}\n");
        }
        out += &format!(
            "faults: {} server processes killed mid-request, {} replies lost; {} of our steps \
             were outcome-unknown and settled by reconciliation\n",
            self.kills, self.lost, self.settled
        );
        out
    }
}

/// The environment variable that makes this binary the tool server.
const SERVE: &str = "AGENT_LOOP_SERVE";
const LEASE: Duration = Duration::from_secs(2);

fn postgres_url() -> String {
    std::env::var("TOWER_IDEMPOTENCY_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// If this process is the tool server, serves until it is killed and returns `true`.
pub fn serve_if_asked() -> bool {
    let Ok(addr) = std::env::var(SERVE) else {
        return false;
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(serve(addr));
    true
}

/// A deterministic stream of numbers: the same faults in every run.
fn noise(i: u64) -> u64 {
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^ (x >> 29)
}

fn step_number(op: &str) -> u64 {
    op.rsplit('-')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

async fn serve(addr: String) {
    let tables = std::env::var("AGENT_LOOP_TABLES").expect("AGENT_LOOP_TABLES");
    let (records, sink) = tables.split_once(',').expect("records,sink");
    let kill_every: u64 = std::env::var("AGENT_LOOP_KILL_EVERY")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(u64::MAX);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(&postgres_url())
        .await
        .expect("PostgreSQL");
    let store = PostgresStore::new(pool.clone())
        .with_table(records)
        .expect("table");
    let store = Faulty::new(store);
    // The store is away 150 ms in every 1.7 s: claims answer 503 and nothing runs.
    let outages = store.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(1_550)).await;
            outages.down_for(Duration::from_millis(150));
        }
    });
    let insert = format!("INSERT INTO {sink} (op) VALUES ($1)");
    let app = Router::new()
        .route(
            "/steps",
            post(move |context: IdempotencyContext, body: Bytes| {
                let (pool, insert) = (pool.clone(), insert.clone());
                async move {
                    let op = String::from_utf8_lossy(&body).into_owned();
                    let n = step_number(&op);
                    let r = noise(n ^ op.len() as u64);
                    let ms = match r % 250 {
                        0 => 1_800 + r % 600,
                        _ => 10 + r % 50,
                    };
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    if let Err(e) = sqlx::query(sqlx::AssertSqlSafe(insert.as_str()))
                        .bind(&op)
                        .execute(&pool)
                        .await
                    {
                        return (StatusCode::SERVICE_UNAVAILABLE, format!("sink: {e}"));
                    }
                    // A marked step of ours: the effect is made, the answer never leaves.
                    if op.starts_with("ours-")
                        && n % kill_every == kill_every / 2
                        && context.attempt() == 1
                    {
                        println!("KILL {op}");
                        std::future::pending::<()>().await;
                    }
                    (StatusCode::CREATED, format!("done {op}"))
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(store)
                .single_tenant()
                .lease(LEASE)
                .on_lease_expiry(LeaseExpiry::Reconcile),
        );
    let listener = TcpListener::bind(&addr).await.expect("bind the server");
    println!("READY");
    axum::serve(listener, app).await.expect("serve");
}

/// The server processes: one at a time on one port, killed when one asks, then started again.
struct Server {
    addr: SocketAddr,
    tables: String,
    kill_every: usize,
    kills: AtomicUsize,
    current: Mutex<Option<Child>>,
    stopping: std::sync::atomic::AtomicBool,
}

impl Server {
    /// Starts a server process and returns its output once it listens.
    fn start(&self) -> std::io::Lines<BufReader<std::process::ChildStdout>> {
        let mut child = Command::new(std::env::current_exe().expect("this binary"))
            .env(SERVE, self.addr.to_string())
            .env("AGENT_LOOP_TABLES", &self.tables)
            .env("AGENT_LOOP_KILL_EVERY", self.kill_every.to_string())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the server");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        *self.current.lock().expect("lock") = Some(child);
        for line in lines.by_ref() {
            if line.expect("server output") == "READY" {
                break;
            }
        }
        lines
    }

    /// Runs servers until [`stop`](Self::stop): each is killed (SIGKILL: nothing recorded on
    /// the way out) when it asks, and the next started at once.
    fn supervise(self: Arc<Self>, ready: std::sync::mpsc::Sender<()>) {
        let mut lines = self.start();
        let _ = ready.send(());
        loop {
            let asked = lines
                .by_ref()
                .map_while(Result::ok)
                .any(|line| line.starts_with("KILL"));
            if let Some(mut child) = self.current.lock().expect("lock").take() {
                let _ = child.kill();
                let _ = child.wait();
            }
            if !asked || self.stopping.load(Ordering::SeqCst) {
                return;
            }
            self.kills.fetch_add(1, Ordering::SeqCst);
            lines = self.start();
        }
    }

    fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        if let Some(mut child) = self.current.lock().expect("lock").take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A proxy that loses one reply in fifteen after the server sent it, and closes the
/// connection: processed, and never heard. Counts what it lost.
async fn lossy_proxy(upstream: SocketAddr, lost: Arc<AtomicUsize>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let replies = Arc::new(AtomicUsize::new(0));
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let (lost, replies) = (lost.clone(), replies.clone());
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    return;
                };
                let (mut client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                let up = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
                });
                // The answers here are small: one read is one reply.
                let mut buf = vec![0u8; 16 * 1024];
                while let Ok(n) = server_read.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    if replies.fetch_add(1, Ordering::Relaxed) % 15 == 7 {
                        lost.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                    if client_write.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                up.abort();
            });
        }
    });
    addr
}

/// Settles an uncertain step by looking for its row at the sink.
struct SinkReconciler {
    pool: sqlx::PgPool,
    sink: String,
}

impl Reconciler for SinkReconciler {
    async fn reconcile(&self, record: &Record) -> Reconciliation {
        // Keys are `{run}:{op}`, or `{run}:{op}#{n}` for the naive clients.
        let key = record.key.key();
        let op = key.split_once(':').map_or(key, |(_, op)| op);
        let op = op.split('#').next().unwrap_or(op);
        let found: Result<i64, _> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {} WHERE op = $1",
            self.sink
        )))
        .bind(op)
        .fetch_one(&self.pool)
        .await;
        match found {
            Ok(0) => Reconciliation::NotApplied,
            Ok(_) => {
                let mut headers = HeaderMap::new();
                headers.insert(
                    http::header::CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; charset=utf-8"),
                );
                Reconciliation::Applied(Box::new(StoredResponse {
                    status: StatusCode::CREATED,
                    headers,
                    body: Some(Bytes::from(format!("done {op}"))),
                    trailers: None,
                }))
            }
            Err(_) => Reconciliation::Unknown,
        }
    }
}

type Http = Client<HttpConnector, Full<Bytes>>;

fn request(addr: SocketAddr, op: &str) -> http::Request<Full<Bytes>> {
    http::Request::post(format!("http://{addr}/steps"))
        .body(Full::new(Bytes::from(op.to_owned())))
        .expect("request")
}

/// Runs `one` for steps `0..operations`, `concurrency` at a time; collects what each returns.
async fn orchestrate<F, Fut, T>(size: Size, one: F) -> Vec<T>
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = T> + Send,
    T: Send + 'static,
{
    let next = Arc::new(AtomicUsize::new(0));
    let results = Arc::new(Mutex::new(Vec::new()));
    let workers: Vec<_> = (0..size.concurrency)
        .map(|_| {
            let (next, results, one) = (next.clone(), results.clone(), one.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= size.operations {
                        return;
                    }
                    let result = one(i).await;
                    results.lock().expect("lock").push(result);
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.expect("worker");
    }
    std::mem::take(&mut *results.lock().expect("lock"))
}

/// How one of our steps ended before any reconciliation.
enum Ours {
    Answered,
    Unknown(usize),
    Failed(String),
}

/// One of our steps: its key for every attempt and every call; a call that runs out of time
/// is made again under the same key.
async fn ours_step(
    http: Http,
    layer: IdempotentClientLayer,
    proxy: SocketAddr,
    run: String,
    i: usize,
) -> Ours {
    let op = format!("ours-{i}");
    let key = OperationKey::step(&run, &op).expect("key");
    for _ in 0..5 {
        let client = tower::ServiceBuilder::new()
            .layer(layer.clone())
            .service(http.clone());
        let mut req = request(proxy, &op);
        req.extensions_mut().insert(key.clone());
        match client.oneshot(req).await {
            // Its own answer, not another step's.
            Ok(res) if res.status() == StatusCode::CREATED => {
                return match res.body().bytes() == format!("done {op}") {
                    true => Ours::Answered,
                    false => Ours::Failed(format!("{op}: answered {:?}", res.body().bytes())),
                };
            }
            Ok(res) => return Ours::Failed(format!("{op}: {}", res.status())),
            Err(ClientError::OutcomeUnknown { .. }) => return Ours::Unknown(i),
            // No definite answer in time: the same key again, never a new one.
            Err(ClientError::DeadlineExceeded { .. } | ClientError::Transport(_)) => continue,
            Err(error) => return Ours::Failed(format!("{op}: {error}")),
        }
    }
    Ours::Failed(format!("{op}: no answer after five calls"))
}

/// The naive client with a new key per attempt: whether the step got an answer.
async fn naive_new_key(http: Http, proxy: SocketAddr, run: String, i: usize) -> bool {
    let op = format!("newkey-{i}");
    for attempt in 0..6 {
        let mut req = request(proxy, &op);
        let key = format!("{run}:{op}#{attempt}");
        req.headers_mut()
            .insert("idempotency-key", key.parse().expect("ascii"));
        let sent = tokio::time::timeout(Duration::from_millis(1_500), http.request(req)).await;
        if let Ok(Ok(res)) = sent
            && res.status() == StatusCode::CREATED
        {
            let _ = res.into_body().collect().await;
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// The naive client with a deadline under the window: one key per call, and a call that gives
/// up is planned again under a new key.
async fn naive_short_deadline(http: Http, proxy: SocketAddr, run: String, i: usize) -> bool {
    let op = format!("short-{i}");
    // Built without `for_window`: nothing checks the deadline against the window.
    let layer = IdempotentClientLayer::new()
        .attempt_timeout(Duration::from_millis(400))
        .deadline(Duration::from_secs(1))
        .backoff(Duration::from_millis(20), Duration::from_millis(200));
    for plan in 0..3 {
        let client = tower::ServiceBuilder::new()
            .layer(layer.clone())
            .service(http.clone());
        let mut req = request(proxy, &op);
        req.extensions_mut()
            .insert(OperationKey::new(format!("{run}:{op}#{plan}")).expect("key"));
        if let Ok(res) = client.oneshot(req).await
            && res.status() == StatusCode::CREATED
        {
            return true;
        }
    }
    false
}

/// Runs the loop: the three clients side by side against one server, its kills and faults.
pub async fn run(size: Size) -> Result<Outcome, String> {
    let url = postgres_url();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(3))
        .connect(&url)
        .await
        .map_err(|e| format!("PostgreSQL at {url} is unreachable: {e}"))?;
    let suffix = format!(
        "{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis())
    );
    let (records, sink) = (
        format!("agent_loop_records_{suffix}"),
        format!("agent_loop_sink_{suffix}"),
    );
    let store = PostgresStore::new(pool.clone())
        .with_table(&records)
        .map_err(|e| e.to_string())?;
    store.migrate().await.map_err(|e| e.to_string())?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {sink} (op text NOT NULL)"
    )))
    .execute(&pool)
    .await
    .map_err(|e| e.to_string())?;

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?;
    let server = Arc::new(Server {
        addr: port,
        tables: format!("{records},{sink}"),
        kill_every: size.kill_every,
        kills: AtomicUsize::new(0),
        current: Mutex::new(None),
        stopping: Default::default(),
    });
    let (ready, started) = std::sync::mpsc::channel();
    let supervisor = {
        let server = server.clone();
        std::thread::spawn(move || server.supervise(ready))
    };
    tokio::task::spawn_blocking(move || started.recv())
        .await
        .map_err(|e| e.to_string())?
        .map_err(|_| "the server did not start".to_owned())?;
    let lost = Arc::new(AtomicUsize::new(0));
    let proxy = lossy_proxy(port, lost.clone()).await;
    let http: Http = Client::builder(TokioExecutor::new()).build_http();
    let run = format!("run-{suffix}");

    let layer = IdempotentClientLayer::new()
        .attempt_timeout(Duration::from_millis(1_500))
        .deadline(Duration::from_secs(30))
        .backoff(Duration::from_millis(20), Duration::from_millis(500));
    let ours = orchestrate(size, {
        let (http, layer, run) = (http.clone(), layer.clone(), run.clone());
        move |i| ours_step(http.clone(), layer.clone(), proxy, run.clone(), i)
    });
    let newkey = orchestrate(size, {
        let (http, run) = (http.clone(), run.clone());
        move |i| naive_new_key(http.clone(), proxy, run.clone(), i)
    });
    let short = orchestrate(size, {
        let (http, run) = (http.clone(), run.clone());
        move |i| naive_short_deadline(http.clone(), proxy, run.clone(), i)
    });
    let (ours, newkey, short) = tokio::join!(ours, newkey, short);

    // The unknowns: a reconciliation looks each up at the sink, then each is asked again
    // under its key and gets its definite answer.
    let mut outcome = Outcome::default();
    let unknown: Vec<usize> = ours
        .iter()
        .filter_map(|o| match o {
            Ours::Unknown(i) => Some(*i),
            _ => None,
        })
        .collect();
    outcome.failures = ours
        .iter()
        .filter_map(|o| match o {
            Ours::Failed(why) => Some(why.clone()),
            _ => None,
        })
        .collect();
    let sweeper = Sweeper::new(
        store.clone(),
        SinkReconciler {
            pool: pool.clone(),
            sink: sink.clone(),
        },
    );
    let mut open = HashSet::new();
    for &i in &unknown {
        for pass in 0.. {
            sweeper.run_once().await.map_err(|e| e.to_string())?;
            match ours_step(http.clone(), layer.clone(), proxy, run.clone(), i).await {
                Ours::Answered => break,
                Ours::Unknown(_) if pass < 20 => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Ours::Unknown(_) => {
                    open.insert(i);
                    break;
                }
                Ours::Failed(why) => {
                    outcome.failures.push(why);
                    break;
                }
            }
        }
    }
    outcome.settled = unknown.len() - open.len();
    server.stop();
    let _ = supervisor.join();
    outcome.kills = server.kills.load(Ordering::SeqCst);
    outcome.lost = lost.load(Ordering::Relaxed);

    // At the sink.
    let rows: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT op, count(*) FROM {sink} GROUP BY op"
    )))
    .fetch_all(&pool)
    .await
    .map_err(|e| e.to_string())?;
    let mut tally: HashMap<&str, (usize, usize)> = HashMap::new();
    for (op, n) in &rows {
        let client = op.split('-').next().unwrap_or("");
        let entry = tally.entry(client).or_default();
        entry.0 += 1;
        entry.1 += usize::try_from(*n).unwrap_or(0) - 1;
    }
    let answered = |results: &[bool]| results.iter().filter(|&&a| !a).count();
    let ours_open = ours.iter().filter(|o| !matches!(o, Ours::Answered)).count() - outcome.settled;
    for (name, prefix, open) in [
        ("ours (one key a step)", "ours", ours_open),
        ("naive: new key a try", "newkey", answered(&newkey)),
        ("naive: short deadline", "short", answered(&short)),
    ] {
        let (effects, dups) = tally.get(prefix).copied().unwrap_or_default();
        outcome
            .clients
            .push((name, size.operations, effects, dups, open));
    }
    for table in [&records, &sink] {
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
            .execute(&pool)
            .await;
    }
    Ok(outcome)
}
