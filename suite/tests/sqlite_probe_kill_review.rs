//! Review: a red-team attack on `SqliteStore::connect`'s per-connection check (`writable`, the
//! pool's `after_connect` hook in `src/store/sqlite.rs`): every connection the lazy pool (max 8,
//! acquire time-out 5 s) opens runs `BEGIN IMMEDIATE; PRAGMA user_version = <same>; ROLLBACK`,
//! waiting for SQLite's write lock under the 5 s busy timeout. Here processes die by SIGKILL
//! while their new connections' probes hold that lock (between `BEGIN IMMEDIATE` and
//! `ROLLBACK`) or wait for it:
//!
//! 1. a "churner" child that connects, forces eight new connections at once (eight probes)
//!    and closes its pool, in a tight loop, SIGKILLed dozens of times at random moments while
//!    two server children (one batching) serve a stream of keys;
//! 2. the same churner with its probes made to queue behind a write lock the `sqlite3` CLI
//!    holds, SIGKILLed while they wait and just after the CLI lets go (while one holds it);
//! 3. a server child SIGKILLed while its fresh lazy pool opens (and probes) connections under
//!    a burst of keys, round after round, each round's keys retried on the next server.
//!
//! Expected (DESIGN §1.5–§1.6, §4, §5, §7.6, §7.9): SQLite's WAL drops the unfinished
//! transaction and the dead process's locks; the others go on (no stuck lock: a witness
//! commit after every kill lands; no lost commit: every witness row is there, `user_version`
//! is unchanged, the file passes `integrity_check`), no key runs twice (counted at a sink file
//! every process appends to), no key is stranded in flight or set aside without a run under
//! way in a killed process, and a fresh `connect` + `check` + a new key work afterwards.
//!
//! Kill moments come from a seeded generator (the seed is printed). Nothing measures time:
//! every wait is bounded, and the assertions count effects and read records.

mod common;

use std::collections::HashMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use common::child::Proc;
use common::raw::unique;
use common::sqlite_cli::HeldCli;
use common::sqlite_files::{Cleanup, url_of};
use common::{client, problem_type, serve, sqlite_path};
use tower_idempotency::store::{Batching, SqliteStore};
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, LeaseExpiry};

const CHILD: &str = "SQLITE_PROBE_KILL_CHILD";

/// What `prepare` writes in the file's header; every probe writes it back unchanged.
const VERSION: i64 = 7;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// `f` within `secs` seconds, or the test fails naming `what` (a hang).
async fn bounded<F: std::future::Future>(what: &str, secs: u64, f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .unwrap_or_else(|_| panic!("{what} hung for {secs} s"))
}

/// A seeded xorshift generator: kill moments that a printed seed reproduces.
struct Rng(u64);

impl Rng {
    fn new(test: &str) -> Self {
        let seed = std::env::var("PK_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
            })
            | 1;
        eprintln!("{test}: seed {seed} (PK_SEED={seed} repeats the kill moments)");
        Self(seed)
    }

    /// A number in `0..=max`.
    fn upto(&mut self, max: u64) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D) % (max + 1)
    }
}

// ---- the effect sink ------------------------------------------------------------------------

/// One effect of `key` by this process: `key|pid`, one line appended with one `write` (atomic
/// under `O_APPEND`) before the handler answers; a SIGKILL after it keeps it.
fn effect(sink: &Path, key: &str) {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(sink)
        .expect("sink");
    file.write_all(format!("{key}|{}\n", std::process::id()).as_bytes())
        .expect("write the effect");
}

/// Each key's effects: the ids of the processes that made them.
fn effects(sink: &Path) -> HashMap<String, Vec<String>> {
    let mut made: HashMap<String, Vec<String>> = HashMap::new();
    for line in std::fs::read_to_string(sink).unwrap_or_default().lines() {
        let (key, pid) = line.rsplit_once('|').unwrap_or((line, "?"));
        made.entry(key.to_owned()).or_default().push(pid.to_owned());
    }
    made
}

// ---- the server and the churner (children, or in this process) -------------------------------

/// `POST /op`: marks the effect started (through the layer: a durable milestone), makes it at
/// the sink, works for the `work=<ms>` its body asks, answers 201 `key|pid|body`.
fn app(store: SqliteStore, sink: PathBuf, lease: Duration, expiry: LeaseExpiry) -> Router {
    let layer = IdempotencyLayer::new(store)
        .single_tenant()
        .lease(lease)
        .on_lease_expiry(expiry);
    Router::new().route(
        "/op",
        post(move |ctx: IdempotencyContext, body: String| {
            let sink = sink.clone();
            async move {
                if let Err(e) = ctx.effect_started().await {
                    return (
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("own: milestone {e}"),
                    );
                }
                effect(&sink, ctx.key());
                let work = body
                    .strip_prefix("work=")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                if work > 0 {
                    tokio::time::sleep(ms(work)).await;
                }
                (
                    StatusCode::CREATED,
                    format!("{}|{}|{body}", ctx.key(), std::process::id()),
                )
            }
        })
        .layer(layer),
    )
}

/// The child: `serve` (a server on `PK_DB` until killed) or `churn` (new connections on
/// `PK_DB`, probed, in a loop until killed).
async fn child_main(mode: String) {
    let url = std::env::var("PK_DB").expect("PK_DB");
    if mode == "churn" {
        return churn(&url).await;
    }
    let mut store = SqliteStore::connect(&url).await.expect("connect");
    if std::env::var("PK_BATCH").is_ok_and(|v| v == "1") {
        store = store.with_batching(Batching::default());
    }
    let lease = ms(std::env::var("PK_LEASE_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30_000));
    let sink = PathBuf::from(std::env::var("PK_SINK").expect("PK_SINK"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    println!("LISTENING {}", listener.local_addr().expect("addr"));
    let _ = std::io::stdout().flush();
    let expiry = if std::env::var("PK_RECONCILE").is_ok_and(|v| v == "1") {
        LeaseExpiry::Reconcile
    } else {
        LeaseExpiry::Reclaim
    };
    axum::serve(listener, app(store, sink, lease, expiry))
        .await
        .expect("serve");
}

/// Connects (the first connection's probe), forces eight new connections at once (eight
/// probes, contending for the write lock with each other and every other process), closes
/// the pool, again and again. Each round is logged to `PK_LOG`: `B` before it connects, `E`
/// once its connections are all open (or refused): a log ending in `B` was killed while its
/// probes ran or waited.
async fn churn(url: &str) {
    let log = PathBuf::from(std::env::var("PK_LOG").expect("PK_LOG"));
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("the churner's log");
    // Ready at once, or (`PK_READY=round`) once a first round is done: killed then, it dies
    // in the loop's steady state.
    let mut ready = std::env::var("PK_READY").is_ok_and(|v| v == "round");
    if !ready {
        println!("CHURNING");
        let _ = std::io::stdout().flush();
    }
    loop {
        let _ = log.write_all(b"B\n");
        let Ok(store) = SqliteStore::connect(url).await else {
            let _ = log.write_all(b"X\n");
            continue;
        };
        let _ = log.write_all(b"C\n");
        let mut opening = tokio::task::JoinSet::new();
        for _ in 0..8 {
            let pool = store.pool().clone();
            opening.spawn(async move { pool.acquire().await });
        }
        let mut held = Vec::new();
        while let Some(done) = opening.join_next().await {
            if let Ok(Ok(connection)) = done {
                held.push(connection);
            }
        }
        let _ = log.write_all(format!("E {}\n", held.len()).as_bytes());
        drop(held);
        store.pool().close().await;
        if std::mem::take(&mut ready) {
            println!("CHURNING");
            let _ = std::io::stdout().flush();
        }
    }
}

fn child_mode() -> Option<String> {
    std::env::var(CHILD).ok()
}

fn server_env(
    db: &str,
    sink: &Path,
    lease: Duration,
    batch: bool,
    expiry: LeaseExpiry,
) -> Vec<(&'static str, String)> {
    let reconcile = expiry == LeaseExpiry::Reconcile;
    vec![
        ("PK_DB", db.to_owned()),
        ("PK_SINK", sink.display().to_string()),
        ("PK_LEASE_MS", lease.as_millis().to_string()),
        ("PK_BATCH", if batch { "1" } else { "0" }.to_owned()),
        ("PK_RECONCILE", if reconcile { "1" } else { "0" }.to_owned()),
    ]
}

/// A server child on a `Reclaim` route, waited for (its banner).
fn server(test: &str, db: &str, sink: &Path, lease: Duration, batch: bool) -> Proc {
    server_on(test, db, sink, lease, batch, LeaseExpiry::Reclaim)
}

/// A server child on a route that does `expiry` with a lapsed lease, waited for.
fn server_on(
    test: &str,
    db: &str,
    sink: &Path,
    lease: Duration,
    batch: bool,
    expiry: LeaseExpiry,
) -> Proc {
    let env = server_env(db, sink, lease, batch, expiry);
    Proc::spawn(test, CHILD, "serve", &env, &[]).listening()
}

/// A churner child logging to `log`, waited for until it churns: at once, or (`steady`) once
/// its first round is done.
fn churner(test: &str, db: &str, log: &Path, steady: bool) -> Proc {
    let child = Proc::spawn(
        test,
        CHILD,
        "churn",
        &[
            ("PK_DB", db.to_owned()),
            ("PK_LOG", log.display().to_string()),
            (
                "PK_READY",
                if steady { "round" } else { "start" }.to_owned(),
            ),
        ],
        &[],
    );
    child.wait_for("CHURNING").expect("the churner starts");
    child
}

/// A migrated file with `user_version` = [`VERSION`] and a witness table, and no connection
/// left open on it.
async fn prepare(db: &str) {
    let store = SqliteStore::connect(db).await.expect("connect");
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE IF NOT EXISTS witness (n INTEGER NOT NULL)")
        .execute(store.pool())
        .await
        .expect("the witness table");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "PRAGMA user_version = {VERSION}"
    )))
    .execute(store.pool())
    .await
    .expect("a version");
    store.pool().close().await;
}

/// One witness commit (row `n`) on `store`'s pool: a commit from another process that must
/// land after a kill (no stuck lock) and stay (no lost commit). Its error, if any.
async fn witness(store: &SqliteStore, n: i64) -> Option<String> {
    match bounded(
        "a witness commit",
        30,
        sqlx::query("INSERT INTO witness (n) VALUES (?1)")
            .bind(n)
            .execute(store.pool()),
    )
    .await
    {
        Ok(_) => None,
        Err(e) => Some(format!("witness commit {n} failed: {e}")),
    }
}

/// What the file holds at the end: faults in its header (`user_version` still [`VERSION`]),
/// its integrity, and its witness rows (`0..witnesses`, each once).
async fn file_faults(db: &str, witnesses: i64) -> Vec<String> {
    let store = bounded("connect to inspect", 30, SqliteStore::connect(db))
        .await
        .expect("connect to inspect");
    let mut faults = Vec::new();
    let version: i64 = sqlx::query_scalar("PRAGMA user_version")
        .fetch_one(store.pool())
        .await
        .expect("read the version");
    if version != VERSION {
        faults.push(format!(
            "user_version is {version}, not {VERSION}: a probe's write was kept"
        ));
    }
    let integrity: Vec<String> = sqlx::query_scalar("PRAGMA integrity_check")
        .fetch_all(store.pool())
        .await
        .expect("integrity_check");
    if integrity != ["ok"] {
        faults.push(format!("integrity_check: {integrity:?}"));
    }
    let rows: Vec<i64> = sqlx::query_scalar("SELECT n FROM witness ORDER BY n")
        .fetch_all(store.pool())
        .await
        .expect("read the witnesses");
    let expected: Vec<i64> = (0..witnesses).collect();
    if rows != expected {
        faults.push(format!(
            "witness rows {rows:?}, committed {expected:?}: a commit was lost or doubled"
        ));
    }
    store.pool().close().await;
    faults
}

/// Each record: key -> (status, effect started, attempts, history).
async fn records(db: &str) -> HashMap<String, (String, i64, i64, String)> {
    let store = bounded("connect to read", 30, SqliteStore::connect(db))
        .await
        .expect("connect to read");
    let rows: Vec<(Vec<u8>, String, i64, i64, String)> = sqlx::query_as(
        "SELECT key, status, effect_started, attempts, history FROM idempotency_records",
    )
    .fetch_all(store.pool())
    .await
    .expect("read the records");
    store.pool().close().await;
    rows.into_iter()
        .map(|(k, s, e, a, h)| (String::from_utf8_lossy(&k).into_owned(), (s, e, a, h)))
        .collect()
}

/// A fresh store on the file: `connect`, `check`, and a new key served in this process runs
/// once and replays. Its faults.
async fn fresh_store_faults(db: &str, sink: &Path, run: &str) -> Vec<String> {
    let mut faults = Vec::new();
    let store = bounded("a fresh connect", 30, SqliteStore::connect(db))
        .await
        .expect("a fresh connect after the kills");
    if let Err(e) = bounded("check", 30, store.check()).await {
        faults.push(format!("check after the kills: {e}"));
    }
    let addr = serve(app(
        store,
        sink.to_path_buf(),
        Duration::from_secs(30),
        LeaseExpiry::Reclaim,
    ))
    .await;
    let key = format!("{run}-after-the-kills");
    let first = bounded("a new key", 30, send(addr, &key, "new")).await;
    let again = bounded("its retry", 30, send(addr, &key, "new")).await;
    if first.status != 201 || first.replayed {
        faults.push(format!("a new key after the kills: {first:?}"));
    }
    if again.status != 201 || !again.replayed || again.body != first.body {
        faults.push(format!(
            "its retry after the kills: {again:?} (first {first:?})"
        ));
    }
    let made = effects(sink).get(&key).map_or(0, Vec::len);
    if made != 1 {
        faults.push(format!("a new key after the kills ran {made} times"));
    }
    faults
}

// ---- an sqlite3 CLI holding the write lock ----------------------------------------------------

// ---- the client -------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct Answer {
    /// 0: no answer (the server died).
    status: u16,
    replayed: bool,
    problem: Option<String>,
    body: String,
}

impl Answer {
    fn is(&self, slug: &str) -> bool {
        self.problem.as_deref() == Some(problem_type(slug).as_str())
    }

    /// Nothing definite yet: in flight, refused by the store, or no answer.
    fn pending(&self) -> bool {
        self.is("in-flight") || self.status == 503 || self.status == 0
    }

    /// The pid in a 201's body `key|pid|body`.
    fn pid(&self) -> Option<&str> {
        self.body.split('|').nth(1)
    }

    fn kind(&self) -> String {
        match (&self.problem, self.status) {
            (Some(p), s) => format!("{s} {}", p.rsplit(':').next().unwrap_or(p)),
            (None, 201) if self.replayed => "201 replayed".to_owned(),
            (None, 201) => "201 live".to_owned(),
            (None, 0) => "no answer".to_owned(),
            (None, s) => format!("{s} other: {}", &self.body[..self.body.len().min(80)]),
        }
    }
}

async fn send(addr: SocketAddr, key: &str, body: &str) -> Answer {
    let res = match client()
        .post(format!("http://{addr}/op"))
        .header("idempotency-key", key)
        .header("content-type", "text/plain")
        .body(body.to_owned())
        .send()
        .await
    {
        Ok(res) => res,
        Err(e) => {
            return Answer {
                status: 0,
                replayed: false,
                problem: None,
                body: format!("no answer: {e}"),
            };
        }
    };
    let status = res.status().as_u16();
    let replayed = res
        .headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let is_problem = res
        .headers()
        .get("content-type")
        .is_some_and(|v| v == "application/problem+json");
    let body = match res.text().await {
        Ok(body) => body,
        Err(e) => {
            return Answer {
                status: 0,
                replayed: false,
                problem: None,
                body: format!("no body: {e}"),
            };
        }
    };
    let problem = is_problem
        .then(|| serde_json::from_str::<serde_json::Value>(&body).ok())
        .flatten()
        .and_then(|v| v["type"].as_str().map(str::to_owned));
    Answer {
        status,
        replayed,
        problem,
        body,
    }
}

/// Sends `key` to `addrs` in turn until the answer is definite, for up to `within`; every
/// answer seen.
async fn drive(addrs: Vec<SocketAddr>, key: String, body: String, within: Duration) -> Vec<Answer> {
    let deadline = tokio::time::Instant::now() + within;
    let mut seen = Vec::new();
    for addr in addrs.iter().cycle() {
        let answer = send(*addr, &key, &body).await;
        let done = !answer.pending() || tokio::time::Instant::now() >= deadline;
        seen.push(answer);
        if done {
            break;
        }
        tokio::time::sleep(ms(20)).await;
    }
    seen
}

/// A key, its body, and the task driving it to a definite answer.
type Driven = (String, String, tokio::task::JoinHandle<Vec<Answer>>);

/// A stream of new keys to `addrs` (three every 15 ms, each driven until definite) until
/// `stop`: each key and its driver.
fn stream_of_keys(
    addrs: Vec<SocketAddr>,
    run: String,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<Driven>> {
    tokio::spawn(async move {
        let mut keys = Vec::new();
        let mut n = 0usize;
        while !stop.load(Ordering::SeqCst) && n < 600 {
            for _ in 0..3 {
                let key = format!("{run}-{n}");
                let body = format!("work={}", n % 7);
                let mut order = addrs.clone();
                order.rotate_left(n % addrs.len());
                let driver = tokio::spawn(drive(
                    order,
                    key.clone(),
                    body.clone(),
                    Duration::from_secs(30),
                ));
                keys.push((key, body, driver));
                n += 1;
            }
            tokio::time::sleep(ms(15)).await;
        }
        keys
    })
}

/// Faults of keys served by servers that were never killed: each key ran exactly once (at
/// the sink); every answer is 201 with its key, 409 in flight or a 503 problem; every 201 of
/// a key carries one body, made by the process that made its effect; and afterwards each
/// server answers it with a 201 replay of that body.
async fn ledger_faults(
    keys: &[(String, String, Vec<Answer>)],
    addrs: &[SocketAddr],
    sink: &Path,
) -> (Vec<String>, std::collections::BTreeMap<String, usize>) {
    let made = effects(sink);
    let mut faults = Vec::new();
    let mut kinds = std::collections::BTreeMap::new();
    for (key, body, answers) in keys {
        for a in answers {
            *kinds.entry(a.kind()).or_insert(0) += 1;
        }
        let pids = made.get(key).cloned().unwrap_or_default();
        if pids.len() != 1 {
            faults.push(format!("{key}: ran {} times ({pids:?})", pids.len()));
        }
        for a in answers {
            let allowed = match a.status {
                201 => a.body.starts_with(&format!("{key}|")),
                409 => a.is("in-flight"),
                503 => a.problem.is_some(),
                _ => false,
            };
            if !allowed {
                faults.push(format!("{key}: answer not allowed: {a:?}"));
            }
        }
        let mut bodies: Vec<&str> = answers
            .iter()
            .filter(|a| a.status == 201)
            .map(|a| a.body.as_str())
            .collect();
        bodies.sort_unstable();
        bodies.dedup();
        if bodies.len() > 1 {
            faults.push(format!("{key}: 201s with different bodies: {bodies:?}"));
        }
        for addr in addrs {
            let last = drive(
                vec![*addr],
                key.clone(),
                body.clone(),
                Duration::from_secs(10),
            )
            .await;
            let last = last.last().expect("an answer");
            let one_run = bodies.first().copied();
            let ok = last.status == 201
                && last.replayed
                && one_run.is_none_or(|b| b == last.body)
                && pids.len() == 1
                && last.pid() == Some(pids[0].as_str());
            if !ok {
                faults.push(format!(
                    "{key}: afterwards {addr} answers {last:?}; its 201s {bodies:?}, its runs {pids:?}"
                ));
            }
        }
    }
    (faults, kinds)
}

// ---- 1. a churner SIGKILLed mid-probe, dozens of times -----------------------------------------

/// DESIGN §5 (SQLite: durable, shared by the processes of one host), §1.5–§1.6, §7.9: two
/// server children on one file (one batching) serve a stream of keys (each retried until
/// definite) while a churner child (connect, eight new connections at once, each probed with
/// `BEGIN IMMEDIATE; PRAGMA user_version = <same>; ROLLBACK`, close, again) is SIGKILLed 48
/// times, each 0–20 ms after it starts. After each kill this process commits a witness row.
/// Expected: every witness commit lands and stays, `user_version` unchanged, the file intact;
/// every key ran exactly once at the sink and replays its one run on both servers; a fresh
/// `connect` + `check` + new key work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_a_churner_killed_mid_probe_dozens_of_times_strands_no_lock_and_runs_each_key_once() {
    if let Some(mode) = child_mode() {
        return child_main(mode).await;
    }
    let test =
        "s5_a_churner_killed_mid_probe_dozens_of_times_strands_no_lock_and_runs_each_key_once";
    let path = sqlite_path("probe-kill-churn");
    let _cleanup = Cleanup::db(&path).and(path.with_extension("churn"));
    let (db, sink) = (url_of(&path), path.with_extension("sink"));
    let logs = path.with_extension("churn");
    std::fs::create_dir_all(&logs).expect("the churners' logs");
    prepare(&db).await;
    let mut rng = Rng::new(test);
    let lease = Duration::from_secs(30);
    let a = server(test, &db, &sink, lease, false);
    let b = server(test, &db, &sink, lease, true);
    let addrs = vec![a.addr(), b.addr()];
    let witness_store = SqliteStore::connect(&db)
        .await
        .expect("the witness's store");
    let run = unique("churn");
    let stop = Arc::new(AtomicBool::new(false));
    let stream = stream_of_keys(addrs.clone(), run.clone(), stop.clone());
    let mut faults = Vec::new();
    const KILLS: i64 = 48;
    for i in 0..KILLS {
        // Every other one killed in its loop's steady state, the others from its start.
        let victim = churner(test, &db, &logs.join(format!("{i}.log")), i % 2 == 0);
        tokio::time::sleep(ms(rng.upto(20))).await;
        drop(victim); // SIGKILL
        faults.extend(witness(&witness_store, i).await);
    }
    let beside = Beside {
        test,
        db: &db,
        sink: &sink,
        logs: &logs,
        addrs: &addrs,
        run: &run,
    };
    beside
        .finish(&stop, stream, witness_store, KILLS, faults)
        .await;
}

/// A churn test's run beside its servers, as its end needs it.
struct Beside<'a> {
    test: &'a str,
    db: &'a str,
    sink: &'a Path,
    logs: &'a Path,
    addrs: &'a [SocketAddr],
    run: &'a str,
}

impl Beside<'_> {
    /// Stops the stream of keys and waits for every key's driver; then gathers the faults of
    /// the keys (their ledger), of the records (each completed), of the file (`witnesses`
    /// commits) and of a fresh store; fails the test on any, or when no kill landed while a
    /// churner's probes ran.
    async fn finish(
        &self,
        stop: &AtomicBool,
        stream: tokio::task::JoinHandle<Vec<Driven>>,
        witness_store: SqliteStore,
        witnesses: i64,
        mut faults: Vec<String>,
    ) {
        let Self {
            test,
            db,
            sink,
            logs,
            addrs,
            run,
        } = *self;
        stop.store(true, Ordering::SeqCst);
        let stream = bounded("the stream of keys", 60, stream)
            .await
            .expect("the stream");
        let mut keys = Vec::new();
        for (key, body, driver) in stream {
            let answers = bounded("a key's driver", 60, driver).await.expect("driver");
            keys.push((key, body, answers));
        }
        witness_store.pool().close().await;
        let mid_probe = churn_logs(logs);
        eprintln!(
            "{test}: {} keys; {witnesses} kills: {mid_probe:?}",
            keys.len()
        );
        let (key_faults, kinds) = ledger_faults(&keys, addrs, sink).await;
        eprintln!("{test}: answers by kind: {kinds:?}");
        faults.extend(key_faults);
        let not_completed: Vec<_> = records(db)
            .await
            .into_iter()
            .filter(|(_, r)| r.0 != "completed")
            .collect();
        if !not_completed.is_empty() {
            faults.push(format!("records not completed: {not_completed:?}"));
        }
        faults.extend(file_faults(db, witnesses).await);
        faults.extend(fresh_store_faults(db, sink, run).await);
        assert!(
            mid_probe.mid_probe() > 0,
            "{test}: no kill landed while a churner's probes ran (the attack missed)"
        );
        assert!(
            faults.is_empty(),
            "{test}: {} faults:\n{}",
            faults.len(),
            faults.join("\n")
        );
    }
}

/// What the churners' logs say: rounds completed in all; churners killed in `connect` (last
/// line `B`: opening its first connection or probing it), killed while their pool opened and
/// probed connections (last line `C`), killed elsewhere (closing, between rounds); and
/// connections opened (probed) in all.
#[derive(Debug, Default)]
struct Churned {
    rounds: usize,
    killed_connecting: usize,
    killed_opening_pool: usize,
    killed_elsewhere: usize,
    probed: usize,
}

impl Churned {
    /// Kills that landed while a churner's probes ran or waited (or its first connection
    /// opened).
    fn mid_probe(&self) -> usize {
        self.killed_connecting + self.killed_opening_pool
    }
}

fn churn_logs(dir: &Path) -> Churned {
    let mut c = Churned::default();
    for entry in std::fs::read_dir(dir).expect("the logs").flatten() {
        let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
        for line in text.lines() {
            if let Some(("E", n)) = line.split_once(' ') {
                c.rounds += 1;
                c.probed += 1 + n.parse::<usize>().unwrap_or(0);
            }
        }
        match text.lines().last() {
            Some("B") => c.killed_connecting += 1,
            Some("C") => c.killed_opening_pool += 1,
            _ => c.killed_elsewhere += 1,
        }
    }
    c
}

// ---- 2. the churner's probes queued behind a CLI lock, killed waiting and holding -------------

/// DESIGN §5, §1.6, §7.10: the `sqlite3` CLI takes the write lock; a churner child starts, so
/// its first connection's probe (and then its pool's eight) waits for the lock in SQLite's
/// busy handler, as do a server child's (batching) claims and completions for a stream of
/// keys. 16 rounds: in even rounds the churner is SIGKILLed 0–20 ms in, while its probes wait,
/// then the CLI lets go; in odd rounds the CLI lets go first and the churner is SIGKILLed 0–30
/// ms later, while its probes take the lock in turn (one of them holding it between `BEGIN
/// IMMEDIATE` and `ROLLBACK`). After each round this process commits a witness row.
/// Expected: every witness commit lands and stays, the header and the file intact, every key
/// ran exactly once and replays its one run; a fresh `connect` + `check` + new key work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_a_churner_killed_while_its_probes_queue_or_hold_the_lock_strands_nothing() {
    if let Some(mode) = child_mode() {
        return child_main(mode).await;
    }
    let test = "s5_a_churner_killed_while_its_probes_queue_or_hold_the_lock_strands_nothing";
    let path = sqlite_path("probe-kill-queue");
    let _cleanup = Cleanup::db(&path).and(path.with_extension("churn"));
    let (db, sink) = (url_of(&path), path.with_extension("sink"));
    let logs = path.with_extension("churn");
    std::fs::create_dir_all(&logs).expect("the churners' logs");
    prepare(&db).await;
    let mut rng = Rng::new(test);
    let s = server(test, &db, &sink, Duration::from_secs(30), true);
    let addrs = vec![s.addr()];
    let witness_store = SqliteStore::connect(&db)
        .await
        .expect("the witness's store");
    let run = unique("queue");
    let stop = Arc::new(AtomicBool::new(false));
    let stream = stream_of_keys(addrs.clone(), run.clone(), stop.clone());
    let mut faults = Vec::new();
    const ROUNDS: i64 = 16;
    for i in 0..ROUNDS {
        let Some(cli) = HeldCli::hold(&path) else {
            return;
        };
        let victim = churner(test, &db, &logs.join(format!("{i}.log")), false);
        if i % 2 == 0 {
            tokio::time::sleep(ms(rng.upto(20))).await;
            drop(victim); // SIGKILL, its probes waiting for the lock
            cli.release();
        } else {
            tokio::time::sleep(ms(rng.upto(20))).await;
            cli.release();
            tokio::time::sleep(ms(rng.upto(30))).await;
            drop(victim); // SIGKILL, its probes taking the lock in turn
        }
        faults.extend(witness(&witness_store, i).await);
    }
    let beside = Beside {
        test,
        db: &db,
        sink: &sink,
        logs: &logs,
        addrs: &addrs,
        run: &run,
    };
    beside
        .finish(&stop, stream, witness_store, ROUNDS, faults)
        .await;
}

// ---- 2b. churners alone on the file, killing one while the other waits ----------------------

/// DESIGN §5 (SQLite: durable, survives restarts, shared by the processes of one host), §7.6:
/// two churner children are the only openers of the file most of the time (so one's probe
/// holds the write lock while the other's wait, and a closing pool may be the last connection,
/// which checkpoints the WAL). 32 rounds: one of them (in turn) is SIGKILLed 0–20 ms after it
/// starts or after its first round, and started again; then this process commits a witness row
/// on a store of its own, connected and closed each time. Every eighth round a server child
/// (batching every other time) runs four new keys to their 201 and is SIGKILLed idle, its
/// commits in the WAL. Expected: every witness commit lands and stays, the header unchanged,
/// the file intact; each key ran once and, on a server started at the end, replays its one
/// run; a fresh `connect` + `check` + new key work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_churners_alone_on_the_file_killed_mid_probe_lose_no_commit() {
    if let Some(mode) = child_mode() {
        return child_main(mode).await;
    }
    let test = "s5_churners_alone_on_the_file_killed_mid_probe_lose_no_commit";
    let path = sqlite_path("probe-kill-alone");
    let _cleanup = Cleanup::db(&path).and(path.with_extension("churn"));
    let (db, sink) = (url_of(&path), path.with_extension("sink"));
    let logs = path.with_extension("churn");
    std::fs::create_dir_all(&logs).expect("the churners' logs");
    prepare(&db).await;
    let mut rng = Rng::new(test);
    let run = unique("alone");
    let lease = Duration::from_secs(30);
    let mut faults = Vec::new();
    let mut keys: Vec<(String, String, Vec<Answer>)> = Vec::new();
    let mut pair = [
        Some(churner(test, &db, &logs.join("first.log"), false)),
        Some(churner(test, &db, &logs.join("second.log"), false)),
    ];
    const ROUNDS: i64 = 32;
    for i in 0..ROUNDS {
        let steady = i % 4 < 2;
        let slot = (i % 2) as usize;
        let next = churner(test, &db, &logs.join(format!("{i}.log")), steady);
        tokio::time::sleep(ms(rng.upto(20))).await;
        // SIGKILL the older one of this slot (the other churner runs on), keep the new one.
        drop(pair[slot].replace(next));
        let store = bounded("a witness's connect", 30, SqliteStore::connect(&db))
            .await
            .expect("a witness's connect");
        faults.extend(witness(&store, i).await);
        bounded("closing the witness", 30, store.pool().close()).await;
        if i % 8 == 7 {
            let s = server(test, &db, &sink, lease, i % 16 == 15);
            for j in 0..4 {
                let key = format!("{run}-{i}-{j}");
                let body = format!("work={j}");
                let seen = drive(
                    vec![s.addr()],
                    key.clone(),
                    body.clone(),
                    Duration::from_secs(20),
                )
                .await;
                keys.push((key, body, seen));
            }
            drop(s); // SIGKILL, idle
        }
    }
    drop(pair);
    let mid_probe = churn_logs(&logs);
    eprintln!("{test}: {ROUNDS} kills (and two at the end): {mid_probe:?}");
    let last = server(test, &db, &sink, lease, false);
    let (key_faults, kinds) = ledger_faults(&keys, &[last.addr()], &sink).await;
    eprintln!("{test}: answers by kind: {kinds:?}");
    faults.extend(key_faults);
    drop(last);
    faults.extend(file_faults(&db, ROUNDS).await);
    faults.extend(fresh_store_faults(&db, &sink, &run).await);
    assert!(
        mid_probe.mid_probe() > 0,
        "{test}: no kill landed while a churner's probes ran (the attack missed)"
    );
    assert!(
        faults.is_empty(),
        "{test}: {} faults:\n{}",
        faults.len(),
        faults.join("\n")
    );
}

// ---- 3. a server SIGKILLed while its lazy pool opens connections under load -------------------

/// DESIGN §7.6 (crash after claim: in flight, never new), §4 (a lapsed lease is taken over
/// only if no effect started and the route reclaims; otherwise set aside), §1.6: eight rounds,
/// each a fresh server child (lazy pool, lease 500 ms, `expiry`, every other pair batching)
/// given a burst of 24 new keys plus every earlier key not yet definite, all at once (so its
/// pool opens and probes up to eight connections while claims contend), SIGKILLed 0–150 ms
/// after the burst is sent, or 0–20 ms after its first effect. Then a last server settles
/// every key. Expected: no key ran twice (sink); every key ends 201 (with the body of its one
/// run, made by the process the sink names) or `outcome-unknown` only where its record shows a
/// run under way in a killed process (an effect started, or, on `Reconcile`, a claim whose
/// lease expired); no record stays in flight; the file intact; a fresh `connect` + `check` +
/// new key work.
async fn server_killed_while_its_pool_probes(test: &str, expiry: LeaseExpiry) {
    let path = sqlite_path("probe-kill-server");
    let _cleanup = Cleanup::db(&path).and(path.with_extension("churn"));
    let (db, sink) = (url_of(&path), path.with_extension("sink"));
    prepare(&db).await;
    let mut rng = Rng::new(test);
    let lease = ms(500);
    let run = unique("server");
    let mut answers: HashMap<String, Vec<Answer>> = HashMap::new();
    let mut keys: Vec<String> = Vec::new();
    let body_of = |key: &str| format!("work={}", key.len() % 5 * 5);
    const ROUNDS: usize = 8;
    for r in 0..ROUNDS {
        let made_before: usize = effects(&sink).values().map(Vec::len).sum();
        let victim = server_on(test, &db, &sink, lease, r % 4 >= 2, expiry);
        let addr = victim.addr();
        let pending: Vec<String> = keys
            .iter()
            .filter(|k| {
                answers
                    .get(*k)
                    .and_then(|a| a.last())
                    .is_none_or(Answer::pending)
            })
            .cloned()
            .collect();
        let fresh: Vec<String> = (0..24).map(|i| format!("{run}-{r}-{i}")).collect();
        keys.extend(fresh.iter().cloned());
        let burst: Vec<_> = pending
            .into_iter()
            .chain(fresh)
            .map(|key| {
                let body = body_of(&key);
                tokio::spawn(async move {
                    let answer = send(addr, &key, &body).await;
                    (key, answer)
                })
            })
            .collect();
        if r % 2 == 0 {
            // While its first connections open and probe, or its first claims run.
            tokio::time::sleep(ms(rng.upto(150))).await;
        } else {
            // Once it has made a first effect: its pool is up, more connections still opening.
            let sink = sink.clone();
            common::until("the victim's first effect", move || {
                effects(&sink).values().map(Vec::len).sum::<usize>() > made_before
            })
            .await;
            tokio::time::sleep(ms(rng.upto(20))).await;
        }
        drop(victim); // SIGKILL
        for task in burst {
            let (key, answer) = bounded("a request to a killed server", 40, task)
                .await
                .expect("task");
            answers.entry(key).or_default().push(answer);
        }
    }
    let last = server_on(test, &db, &sink, lease, false, expiry);
    let settling: Vec<_> = keys
        .iter()
        .map(|key| {
            let (addr, key, body) = (last.addr(), key.clone(), body_of(key));
            tokio::spawn(async move {
                let seen = drive(vec![addr], key.clone(), body, Duration::from_secs(15)).await;
                (key, seen)
            })
        })
        .collect();
    for task in settling {
        let (key, seen) = bounded("settling a key", 40, task).await.expect("task");
        answers.entry(key).or_default().extend(seen);
    }
    let made = effects(&sink);
    let stored = records(&db).await;
    let mut faults = Vec::new();
    let mut ends: std::collections::BTreeMap<&str, usize> = Default::default();
    for key in &keys {
        let seen = &answers[key];
        let pids = made.get(key).cloned().unwrap_or_default();
        let record = stored.get(key);
        if pids.len() > 1 {
            faults.push(format!(
                "{key}: ran {} times ({pids:?}); record {record:?}",
                pids.len()
            ));
        }
        for a in seen {
            let allowed = match a.status {
                0 => true,
                201 => a.body.starts_with(&format!("{key}|")),
                409 => a.is("in-flight") || a.is("outcome-unknown"),
                503 => a.problem.is_some(),
                _ => false,
            };
            if !allowed {
                faults.push(format!("{key}: answer not allowed: {a:?}"));
            }
        }
        let mut bodies: Vec<&str> = seen
            .iter()
            .filter(|a| a.status == 201)
            .map(|a| a.body.as_str())
            .collect();
        bodies.sort_unstable();
        bodies.dedup();
        if bodies.len() > 1 {
            faults.push(format!("{key}: 201s with different bodies: {bodies:?}"));
        }
        let end = seen.last().expect("an answer");
        if end.status == 201 {
            *ends
                .entry(if pids.len() == 1 && end.replayed {
                    "201 replayed"
                } else {
                    "201 live"
                })
                .or_default() += 1;
            if pids.len() != 1 || end.pid() != Some(pids[0].as_str()) {
                faults.push(format!(
                    "{key}: ends {end:?} but its runs at the sink are {pids:?}"
                ));
            }
        } else if end.is("outcome-unknown") {
            *ends
                .entry(if pids.is_empty() {
                    "outcome-unknown, effect not made"
                } else {
                    "outcome-unknown, effect made"
                })
                .or_default() += 1;
            // A run under way in a killed process: its effect started, or (a route that
            // reconciles every lapsed lease) its claim's lease expired.
            let started = record.is_some_and(|r| {
                r.0 == "needs_reconciliation"
                    && (r.1 == 1
                        || (expiry == LeaseExpiry::Reconcile && r.3.contains("lease_expired")))
            });
            if !started {
                faults.push(format!(
                    "{key}: set aside (outcome-unknown) though no run was under way: record \
                     {record:?}, runs {pids:?}"
                ));
            }
        } else {
            faults.push(format!(
                "{key}: not settled: ends {end:?}; answers {:?}; record {record:?}",
                seen.iter().map(Answer::kind).collect::<Vec<_>>()
            ));
        }
        if pids.len() == 1 && record.is_some_and(|r| r.0 == "completed") && end.status != 201 {
            faults.push(format!(
                "{key}: completed but ends {end:?}; record {record:?}"
            ));
        }
    }
    let in_flight: Vec<_> = stored
        .iter()
        .filter(|(_, r)| r.0 == "in_progress")
        .collect();
    if !in_flight.is_empty() {
        faults.push(format!("records still in flight: {in_flight:?}"));
    }
    drop(last);
    faults.extend(file_faults(&db, 0).await);
    faults.extend(fresh_store_faults(&db, &sink, &run).await);
    eprintln!("{test}: {} keys; how they ended: {ends:?}", keys.len());
    assert!(
        faults.is_empty(),
        "{test}: {} faults:\n{}",
        faults.len(),
        faults.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_6_a_server_killed_while_its_pool_probes_under_load_runs_no_key_twice() {
    if let Some(mode) = child_mode() {
        return child_main(mode).await;
    }
    server_killed_while_its_pool_probes(
        "s7_6_a_server_killed_while_its_pool_probes_under_load_runs_no_key_twice",
        LeaseExpiry::Reclaim,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_6_a_reconcile_server_killed_while_its_pool_probes_sets_aside_only_claimed_keys() {
    if let Some(mode) = child_mode() {
        return child_main(mode).await;
    }
    server_killed_while_its_pool_probes(
        "s7_6_a_reconcile_server_killed_while_its_pool_probes_sets_aside_only_claimed_keys",
        LeaseExpiry::Reconcile,
    )
    .await;
}
