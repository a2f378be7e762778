//! Review: a red-team attack on `SqliteStore::connect`'s pool as changed by c365b5a and
//! 9d88e73: opened lazily (no connection at `connect`), at most 8 connections, acquires timed
//! out after 5 s, and every new connection checked by a rolled-back write (`BEGIN IMMEDIATE;
//! PRAGMA user_version = <same>; ROLLBACK`) that waits for SQLite's write lock under the 5 s
//! busy timeout and is refused (reopened with back-off until the acquire time-out) otherwise.
//!
//! Attacks: the application exhausting the pool with its own transactions
//! (`record_milestone_in` / `complete_in`) held up to past both time-outs; hundreds of
//! concurrent unique keys over fresh (lazy) pools, batching or not, in several processes on
//! one file; a write lock held by another process (the `sqlite3` CLI) for 4 s, 6 s and 12 s
//! while a never-used pool gets its first requests and a warm one renews and records; and
//! `connect` itself (in this process and in a child server) while the lock is held past the
//! busy timeout.
//!
//! Found: a claim that came back late under pool exhaustion, refused 503 (nothing ran), was
//! given back only until its lease ended; a retry on the `Reconcile` route then set the key
//! aside and every later one was told `outcome-unknown` for ever (the first test, two runs in
//! three). A give-back now goes on until it lands or the key is no longer its holder's
//! (`faults.rs` `s15_4_a_give_back_failing_past_the_lease_*` shows it on every store).
//!
//! Effects are counted at a sink file every process appends to (and, for handlers writing in
//! their own transaction, as rows of the business table committed with the milestone), never
//! from the answers. Counts of 503s are printed as information; nothing measures time.

mod common;

use std::collections::HashMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::routing::post;
use common::child::Proc;
use common::raw::unique;
use common::sink::{effect, effects};
use common::sqlite_cli::HeldCli;
use common::sqlite_files::{Cleanup, url_of};
use common::{client, guard, serve, sqlite_path};
use tokio::sync::Barrier;
use tower_idempotency::store::{Batching, Milestone, SqliteStore, StoredResponse};
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, LeaseExpiry};

const CHILD: &str = "SQLITE_POOL_ATTACK_CHILD";

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

// ---- the effect sink ------------------------------------------------------------------------

/// Rows of the business table, per key (committed with the handler's milestone).
async fn business_rows(db: &str) -> HashMap<String, usize> {
    let store = SqliteStore::connect(db).await.expect("connect to count");
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT key, count(*) FROM app_effects GROUP BY key")
            .fetch_all(store.pool())
            .await
            .expect("count the business rows");
    store.pool().close().await;
    rows.into_iter().map(|(k, n)| (k, n as usize)).collect()
}

/// Each record not completed: key, status, attempts, effect started, history.
async fn histories(db: &str) -> Vec<(String, String, i64, i64, String)> {
    let store = SqliteStore::connect(db).await.expect("connect to read");
    let rows: Vec<(Vec<u8>, String, i64, i64, String)> = sqlx::query_as(
        "SELECT key, status, attempts, effect_started, history FROM idempotency_records \
         WHERE status <> 'completed'",
    )
    .fetch_all(store.pool())
    .await
    .expect("read the records");
    store.pool().close().await;
    rows.into_iter()
        .map(|(k, s, a, e, h)| (String::from_utf8_lossy(&k).into_owned(), s, a, e, h))
        .collect()
}

// ---- the server (in this process or a child) -------------------------------------------------

#[derive(Clone, Copy)]
struct Settings {
    lease: Duration,
    expiry: LeaseExpiry,
    /// The handler writes its milestone, its business row and its result in its own
    /// transaction on the store's pool, held for the request's `work`.
    own_tx: bool,
}

/// The work a request asks for: its body is `work=<ms>` (or anything else: none).
fn work_of(body: &str) -> Duration {
    ms(body
        .strip_prefix("work=")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0))
}

/// `POST /op`. Plain: marks the effect started (through the layer), makes it at the sink,
/// works, answers 201 with the key, this process's id and the body. Own transaction: begins a
/// transaction on `store.pool()`, writes the `EffectStarted` milestone and a business row in
/// it, holds it for the work, writes the result with `complete_in`, commits, then makes the
/// effect at the sink. A failure of the handler's own is a 503 whose body starts `own:`.
fn app(store: SqliteStore, sink: PathBuf, s: Settings) -> Router {
    let layer = IdempotencyLayer::new(store.clone())
        .single_tenant()
        .lease(s.lease)
        .on_lease_expiry(s.expiry);
    Router::new().route(
        "/op",
        post(move |ctx: IdempotencyContext, body: String| {
            let (store, sink) = (store.clone(), sink.clone());
            async move {
                let work = work_of(&body);
                let answer = format!("{}|{}|{body}", ctx.key(), std::process::id());
                if s.own_tx {
                    return own_transaction(&store, &ctx, &sink, work, answer).await;
                }
                if let Err(e) = ctx.effect_started().await {
                    return (
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("own: milestone {e}"),
                    );
                }
                effect(&sink, ctx.key());
                if !work.is_zero() {
                    tokio::time::sleep(work).await;
                }
                (StatusCode::CREATED, answer)
            }
        })
        .layer(layer),
    )
}

async fn own_transaction(
    store: &SqliteStore,
    ctx: &IdempotencyContext,
    sink: &Path,
    work: Duration,
    answer: String,
) -> (StatusCode, String) {
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        (StatusCode::SERVICE_UNAVAILABLE, format!("own: {what} {e}"))
    };
    let mut tx = match store.pool().begin().await {
        Ok(tx) => tx,
        Err(e) => return fail("begin", &e),
    };
    if let Err(e) = store
        .record_milestone_in(
            &mut tx,
            ctx.scoped_key(),
            ctx.fencing_token(),
            &Milestone::EffectStarted,
        )
        .await
    {
        return fail("milestone", &e);
    }
    if let Err(e) = sqlx::query("INSERT INTO app_effects (key) VALUES (?1)")
        .bind(ctx.key())
        .execute(&mut *tx)
        .await
    {
        return fail("business row", &e);
    }
    if !work.is_zero() {
        tokio::time::sleep(work).await;
    }
    let mut headers = HeaderMap::new();
    headers.insert(
        "content-type",
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    let stored = StoredResponse {
        status: StatusCode::CREATED,
        headers,
        body: Some(answer.clone().into()),
        trailers: None,
    };
    if let Err(e) = store
        .complete_in(
            &mut tx,
            ctx.scoped_key(),
            ctx.fencing_token(),
            &stored,
            Duration::from_secs(24 * 3600),
        )
        .await
    {
        return fail("complete_in", &e);
    }
    if let Err(e) = tx.commit().await {
        return fail("commit", &e);
    }
    effect(sink, ctx.key());
    (StatusCode::CREATED, answer)
}

fn env_ms(name: &str, default: u64) -> Duration {
    ms(std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default))
}

/// The child: connects (lazily, as a fresh process does) and serves `/op` until killed.
async fn child_main() {
    let url = std::env::var("SP_DB").expect("SP_DB");
    let mut store = SqliteStore::connect(&url).await.expect("connect");
    println!("CONNECTED");
    let _ = std::io::stdout().flush();
    if std::env::var("SP_BATCH").is_ok_and(|v| v == "1") {
        store = store.with_batching(Batching::default());
    }
    let settings = Settings {
        lease: env_ms("SP_LEASE_MS", 30_000),
        expiry: if std::env::var("SP_RECONCILE").is_ok_and(|v| v == "1") {
            LeaseExpiry::Reconcile
        } else {
            LeaseExpiry::Reclaim
        },
        own_tx: std::env::var("SP_OWN_TX").is_ok_and(|v| v == "1"),
    };
    let sink = PathBuf::from(std::env::var("SP_SINK").expect("SP_SINK"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    println!("LISTENING {}", listener.local_addr().expect("addr"));
    let _ = std::io::stdout().flush();
    axum::serve(listener, app(store, sink, settings))
        .await
        .expect("serve");
}

fn child_mode() -> bool {
    std::env::var(CHILD).is_ok()
}

/// Runs `test` of this binary as a child server with `env`; does not wait for it.
fn spawn(test: &str, env: &[(&str, String)]) -> Proc {
    Proc::spawn(test, CHILD, "serve", env, &[])
}

/// [`spawn`], waiting (up to 60 s) for the server's banner.
fn start(test: &str, env: &[(&str, String)]) -> Proc {
    spawn(test, env).listening()
}

fn child_env(db: &str, sink: &Path, s: Settings, batch: bool) -> Vec<(&'static str, String)> {
    vec![
        ("SP_DB", db.to_owned()),
        ("SP_SINK", sink.display().to_string()),
        ("SP_LEASE_MS", s.lease.as_millis().to_string()),
        (
            "SP_RECONCILE",
            if s.expiry == LeaseExpiry::Reconcile {
                "1"
            } else {
                "0"
            }
            .to_owned(),
        ),
        ("SP_OWN_TX", if s.own_tx { "1" } else { "0" }.to_owned()),
        ("SP_BATCH", if batch { "1" } else { "0" }.to_owned()),
    ]
}

/// A migrated file with the business table, and no connection left open on it.
async fn prepare(db: &str) {
    let store = SqliteStore::connect(db).await.expect("connect");
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE IF NOT EXISTS app_effects (key TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .expect("the business table");
    store.pool().close().await;
}

// ---- the client -------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct Answer {
    status: u16,
    replayed: bool,
    problem: Option<String>,
    body: String,
}

impl Answer {
    fn pending(&self) -> bool {
        self.status == 409 || self.status == 503
    }

    /// What the layer may answer (DESIGN §1.6): 201 (live or replayed), a 409 or 503
    /// problem; or the handler's own refusal (`own:`, its transaction failed: nothing done).
    fn acceptable(&self, key: &str) -> bool {
        match self.status {
            201 => self.body.starts_with(&format!("{key}|")),
            409 => self.problem.is_some(),
            503 => self.problem.is_some() || self.body.starts_with("own:"),
            _ => false,
        }
    }

    fn kind(&self) -> String {
        match (&self.problem, self.status) {
            (Some(p), s) => format!("{s} {}", p.rsplit(':').next().unwrap_or(p)),
            (None, 201) if self.replayed => "201 replayed".to_owned(),
            (None, 201) => "201 live".to_owned(),
            (None, s) if self.body.starts_with("own:") => {
                format!(
                    "{s} {}",
                    self.body.split(' ').take(2).collect::<Vec<_>>().join(" ")
                )
            }
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
    let body = res.text().await.unwrap_or_default();
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

/// Retries `key` until the answer is definite (not 409, not 503), for up to `within`; every
/// answer seen.
async fn settle(addr: SocketAddr, key: &str, body: &str, within: Duration) -> Vec<Answer> {
    let deadline = tokio::time::Instant::now() + within;
    let mut seen = Vec::new();
    loop {
        let answer = send(addr, key, body).await;
        let done = !answer.pending() || tokio::time::Instant::now() >= deadline;
        seen.push(answer);
        if done {
            return seen;
        }
        tokio::time::sleep(ms(100)).await;
    }
}

/// Retries of `key` to `addr` every `every` until `stop`; every answer.
fn retrier(
    addr: SocketAddr,
    key: String,
    body: String,
    every: Duration,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<Answer>> {
    tokio::spawn(async move {
        let mut seen = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            seen.push(send(addr, &key, &body).await);
            tokio::time::sleep(every).await;
        }
        seen
    })
}

/// Everything seen for the keys of a test, and the checks every test makes at its end.
#[derive(Default)]
struct Ledger {
    answers: HashMap<String, Vec<Answer>>,
}

impl Ledger {
    fn add(&mut self, key: &str, answers: impl IntoIterator<Item = Answer>) {
        self.answers
            .entry(key.to_owned())
            .or_default()
            .extend(answers);
    }

    fn kinds(&self) -> std::collections::BTreeMap<String, usize> {
        let mut kinds = std::collections::BTreeMap::new();
        for a in self.answers.values().flatten() {
            *kinds.entry(a.kind()).or_default() += 1;
        }
        kinds
    }

    /// Every key ran exactly once (sink, and business rows where `rows` is given); every
    /// answer is one the layer may give; every 201 of a key carries one and the same body
    /// (the one run's); each key's last answer (after the load ended) is a 201.
    fn check(&self, name: &str, sink: &Path, rows: Option<&HashMap<String, usize>>) {
        let counted = effects(sink);
        let mut faults = Vec::new();
        for (key, answers) in &self.answers {
            let n = counted.get(key).copied().unwrap_or(0);
            if n != 1 {
                faults.push(format!("{key}: ran {n} times"));
            }
            if let Some(rows) = rows {
                let r = rows.get(key).copied().unwrap_or(0);
                if r != n {
                    faults.push(format!(
                        "{key}: {r} business rows committed, {n} at the sink"
                    ));
                }
            }
            for a in answers {
                if !a.acceptable(key) {
                    faults.push(format!("{key}: answer not allowed: {a:?}"));
                }
            }
            let mut bodies: Vec<&str> = answers
                .iter()
                .filter(|a| a.status == 201)
                .map(|a| a.body.as_str())
                .collect();
            bodies.dedup();
            bodies.sort_unstable();
            bodies.dedup();
            if bodies.len() > 1 {
                faults.push(format!("{key}: 201s with different bodies: {bodies:?}"));
            }
            match answers.last() {
                Some(last) if last.status == 201 => {}
                last => faults.push(format!(
                    "{key}: stranded, its last answer after the load ended: {last:?}; its \
                     answers in order: {:?}",
                    answers.iter().map(Answer::kind).collect::<Vec<_>>()
                )),
            }
        }
        eprintln!("{name}: answers by kind: {:?}", self.kinds());
        assert!(
            faults.is_empty(),
            "{name}: {} faults:\n{}\nanswers by kind: {:?}",
            faults.len(),
            faults.join("\n"),
            self.kinds()
        );
    }
}

// ---- 1. the application's own transactions exhaust the pool ------------------------------------

/// DESIGN §4 (a handler records its milestone and its result in its own sqlx transaction on
/// the store's pool; the holder keeps its lease while it lives; a resolved outcome is final)
/// and §1.6. Server A (this process, a fresh lazy pool of 8) gets 12 keys at once whose
/// handlers each hold a transaction on `store.pool()` (milestone, business row, `complete_in`)
/// for 800 ms, two of them for 6 s (past the busy timeout and the acquire time-out); a child
/// server B on the same file gets 4 more such keys. Lease 600 ms, `Reconcile`. Meanwhile
/// every key is retried on the other server every 250 ms. Then every key is settled on both
/// servers. Expected: each key's effect (sink and committed business rows) exactly once,
/// every answer 201 / 409 problem / 503 problem (or the handler's own refusal), every 201 of
/// a key the same body, and each key ends 201.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_app_transactions_exhausting_the_pool_never_run_a_key_twice_nor_strand_one() {
    if child_mode() {
        return child_main().await;
    }
    let test = "s4_app_transactions_exhausting_the_pool_never_run_a_key_twice_nor_strand_one";
    let path = sqlite_path("pool-attack-own-tx");
    let _cleanup = Cleanup::db(&path);
    let (db, sink) = (url_of(&path), path.with_extension("sink"));
    prepare(&db).await;
    let s = Settings {
        lease: ms(600),
        expiry: LeaseExpiry::Reconcile,
        own_tx: true,
    };
    let store = SqliteStore::connect(&db).await.expect("connect");
    let a = serve(app(store, sink.clone(), s)).await;
    let b = start(test, &child_env(&db, &sink, s, false));
    let b = b.addr();
    let run = unique("own-tx");
    let keys: Vec<(String, SocketAddr, SocketAddr, String)> = (0..16)
        .map(|i| {
            let (home, other) = if i < 12 { (a, b) } else { (b, a) };
            let work = if i == 0 || i == 12 { 6000 } else { 800 };
            (format!("{run}-{i}"), home, other, format!("work={work}"))
        })
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let barrier = Arc::new(Barrier::new(keys.len()));
    let firsts: Vec<_> = keys
        .iter()
        .map(|(key, home, _, body)| {
            let (key, home, body, barrier) = (key.clone(), *home, body.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                send(home, &key, &body).await
            })
        })
        .collect();
    tokio::time::sleep(ms(300)).await;
    let retries: Vec<_> = keys
        .iter()
        .map(|(key, _, other, body)| {
            retrier(*other, key.clone(), body.clone(), ms(250), stop.clone())
        })
        .collect();
    let mut ledger = Ledger::default();
    for ((key, ..), first) in keys.iter().zip(firsts) {
        let answer = guard("a first request", first).await.expect("task");
        ledger.add(key, [answer]);
    }
    stop.store(true, Ordering::SeqCst);
    for ((key, ..), r) in keys.iter().zip(retries) {
        let answers = guard("a retrier", r).await.expect("task");
        ledger.add(key, answers);
    }
    for (key, home, other, body) in &keys {
        for addr in [*other, *home] {
            let answers = settle(addr, key, body, Duration::from_secs(40)).await;
            ledger.add(key, answers);
        }
    }
    let rows = business_rows(&db).await;
    let records = histories(&db).await;
    eprintln!("{test}: records not completed: {records:#?}");
    ledger.check(test, &sink, Some(&rows));
}

// ---- 2. hundreds of concurrent keys over fresh lazy pools, four servers, one file -------------

/// DESIGN §7.3/§7.9 and §1.5: four servers on one file, each on a fresh lazy pool (two in
/// this process, one of them batching; two child processes, one batching): 128 keys, each
/// sent at once to two different servers (256 requests released by one barrier), the
/// handler marking its effect started and working 20 ms. Then each key is settled on a third
/// server. Expected: each key's effect exactly once, every answer 201 / 409 / 503 problem,
/// every 201 of a key the same body, each key ends 201. (503s are printed, not asserted.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_9_hundreds_of_keys_over_fresh_lazy_pools_in_four_servers_run_each_once() {
    if child_mode() {
        return child_main().await;
    }
    let test = "s7_9_hundreds_of_keys_over_fresh_lazy_pools_in_four_servers_run_each_once";
    let path = sqlite_path("pool-attack-crowd");
    let _cleanup = Cleanup::db(&path);
    let (db, sink) = (url_of(&path), path.with_extension("sink"));
    prepare(&db).await;
    let s = Settings {
        lease: Duration::from_secs(30),
        expiry: LeaseExpiry::Reclaim,
        own_tx: false,
    };
    let plain = SqliteStore::connect(&db).await.expect("connect");
    let batched = SqliteStore::connect(&db)
        .await
        .expect("connect")
        .with_batching(Batching::default());
    let c1 = start(test, &child_env(&db, &sink, s, false));
    let c2 = start(test, &child_env(&db, &sink, s, true));
    let servers = [
        serve(app(plain, sink.clone(), s)).await,
        serve(app(batched, sink.clone(), s)).await,
        c1.addr(),
        c2.addr(),
    ];
    let run = unique("crowd");
    let keys: Vec<String> = (0..128).map(|i| format!("{run}-{i}")).collect();
    let barrier = Arc::new(Barrier::new(keys.len() * 2));
    let mut tasks = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        for j in 0..2 {
            let addr = servers[(i + j) % 4];
            let (key, barrier) = (key.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                let answer = send(addr, &key, "work=20").await;
                (key, answer)
            }));
        }
    }
    let mut ledger = Ledger::default();
    for t in tasks {
        let (key, answer) = guard("a crowd request", t).await.expect("task");
        ledger.add(&key, [answer]);
    }
    let first_503 = ledger
        .answers
        .values()
        .flatten()
        .filter(|a| a.status == 503)
        .count();
    eprintln!("{test}: {first_503} of 256 crowd requests answered 503");
    for (i, key) in keys.iter().enumerate() {
        let answers = settle(
            servers[(i + 2) % 4],
            key,
            "work=20",
            Duration::from_secs(30),
        )
        .await;
        ledger.add(key, answers);
    }
    ledger.check(test, &sink, None);
}

// ---- 3. another process holds the write lock for 4 s, 6 s, 12 s -----------------------------

/// DESIGN §7.10 (store down: fail closed, recovery when it returns), §4 (the holder keeps its
/// lease while it lives and retries its record; on a `Reconcile` route a lapsed lease is
/// never run again) and §1.6. Three servers on one file, lease 600 ms, `Reconcile`: X in
/// this process on a pool never used (no connection when the lock is taken), Y in this
/// process with one warm connection and 8 handlers in flight (effect started and made,
/// answering `hold / 2` into the lock), and a child Z. The CLI takes the write lock for
/// `hold`; meanwhile 8 new keys go to X and 8 to Y (each pool must open connections whose
/// check meets the lock), and Y's in-flight keys are retried on Z every 300 ms (their leases
/// lapse: renewals cannot write). The CLI lets go; every key is then settled on Z, X and Y.
/// Expected: each key's effect exactly once, every answer allowed, each key ends 201 with
/// its one run's body.
async fn cli_lock_on_lazy_pools(test: &str, hold: Duration) {
    let path = sqlite_path(&format!("pool-attack-cli-{}", hold.as_millis()));
    let _cleanup = Cleanup::db(&path);
    let (db, sink) = (url_of(&path), path.with_extension("sink"));
    prepare(&db).await;
    let s = Settings {
        lease: ms(600),
        expiry: LeaseExpiry::Reconcile,
        own_tx: false,
    };
    let x = serve(app(
        SqliteStore::connect(&db).await.expect("connect X"),
        sink.clone(),
        s,
    ))
    .await;
    let y = serve(app(
        SqliteStore::connect(&db).await.expect("connect Y"),
        sink.clone(),
        s,
    ))
    .await;
    let z = start(test, &child_env(&db, &sink, s, false));
    let z = z.addr();
    let run = unique("cli");
    let warm = format!("{run}-warm");
    let mut ledger = Ledger::default();
    ledger.add(&warm, [send(y, &warm, "w").await]);

    // Eight handlers in flight on Y, answering half-way through the hold.
    let flight_body = format!("work={}", hold.as_millis() / 2 + 300);
    let flying: Vec<String> = (0..8).map(|i| format!("{run}-flying-{i}")).collect();
    let firsts: Vec<_> = flying
        .iter()
        .map(|key| {
            let (key, body) = (key.clone(), flight_body.clone());
            tokio::spawn(async move { send(y, &key, &body).await })
        })
        .collect();
    {
        let (sink, flying) = (sink.clone(), flying.clone());
        common::until("the in-flight handlers make their effects", move || {
            let e = effects(&sink);
            flying.iter().all(|k| e.contains_key(k))
        })
        .await;
    }
    let Some(cli) = HeldCli::hold(&path) else {
        return;
    };
    let stop = Arc::new(AtomicBool::new(false));
    let retries: Vec<_> = flying
        .iter()
        .map(|key| retrier(z, key.clone(), flight_body.clone(), ms(300), stop.clone()))
        .collect();
    let fresh: Vec<(String, SocketAddr)> = (0..16)
        .map(|i| (format!("{run}-new-{i}"), if i < 8 { x } else { y }))
        .collect();
    let news: Vec<_> = fresh
        .iter()
        .map(|(key, addr)| {
            let (key, addr) = (key.clone(), *addr);
            tokio::spawn(async move { send(addr, &key, "new").await })
        })
        .collect();
    tokio::time::sleep(hold).await;
    cli.release();
    let mut under_lock = Vec::new();
    for ((key, _), t) in fresh.iter().zip(news) {
        let answer = guard("a new key under the lock", t).await.expect("task");
        under_lock.push(answer.kind());
        ledger.add(key, [answer]);
    }
    eprintln!("{test}: new keys sent under the lock: {under_lock:?}");
    for (key, t) in flying.iter().zip(firsts) {
        let answer = guard("an in-flight request", t).await.expect("task");
        ledger.add(key, [answer]);
    }
    stop.store(true, Ordering::SeqCst);
    for (key, r) in flying.iter().zip(retries) {
        let answers = guard("a retrier", r).await.expect("task");
        ledger.add(key, answers);
    }
    for key in &flying {
        for addr in [z, x, y] {
            let answers = settle(addr, key, &flight_body, Duration::from_secs(40)).await;
            ledger.add(key, answers);
        }
    }
    for (key, _) in &fresh {
        for addr in [z, x, y] {
            let answers = settle(addr, key, "new", Duration::from_secs(40)).await;
            ledger.add(key, answers);
        }
    }
    ledger.check(test, &sink, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_10_a_cli_lock_of_4s_on_lazy_pools_runs_each_key_once_and_strands_none() {
    if child_mode() {
        return child_main().await;
    }
    cli_lock_on_lazy_pools(
        "s7_10_a_cli_lock_of_4s_on_lazy_pools_runs_each_key_once_and_strands_none",
        ms(4000),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_10_a_cli_lock_of_6s_on_lazy_pools_runs_each_key_once_and_strands_none() {
    if child_mode() {
        return child_main().await;
    }
    cli_lock_on_lazy_pools(
        "s7_10_a_cli_lock_of_6s_on_lazy_pools_runs_each_key_once_and_strands_none",
        ms(6000),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_10_a_cli_lock_of_12s_on_lazy_pools_runs_each_key_once_and_strands_none() {
    if child_mode() {
        return child_main().await;
    }
    cli_lock_on_lazy_pools(
        "s7_10_a_cli_lock_of_12s_on_lazy_pools_runs_each_key_once_and_strands_none",
        ms(12_000),
    )
    .await;
}

// ---- 4. connect while another process holds the lock past the busy timeout -------------------

/// §1.6 / §7.10: the CLI holds the write lock; meanwhile `SqliteStore::connect` runs in this
/// process and a child server starts (connecting) on the same file. Both must connect (the
/// first connection's check is busy past 5 s, which `connect` lets pass); requests sent while
/// the lock is still held are refused 503, never run. Once the CLI lets go (12 s after it took
/// the lock), each server runs new keys once, and the other replays them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_6_connect_under_a_lock_held_past_the_busy_timeout_then_serves() {
    if child_mode() {
        return child_main().await;
    }
    let test = "s1_6_connect_under_a_lock_held_past_the_busy_timeout_then_serves";
    let path = sqlite_path("pool-attack-connect");
    let _cleanup = Cleanup::db(&path);
    let (db, sink) = (url_of(&path), path.with_extension("sink"));
    prepare(&db).await;
    let s = Settings {
        lease: Duration::from_secs(30),
        expiry: LeaseExpiry::Reconcile,
        own_tx: false,
    };
    let Some(cli) = HeldCli::hold(&path) else {
        return;
    };
    let locked_at = tokio::time::Instant::now();
    let child = spawn(test, &child_env(&db, &sink, s, true));
    let store = guard("connect under the lock", SqliteStore::connect(&db))
        .await
        .expect("connect while another process holds the write lock past the busy timeout");
    let a = serve(app(store, sink.clone(), s)).await;
    let child = child.listening();
    let b = child.addr();
    let run = unique("connect");
    let mut ledger = Ledger::default();
    // While the lock is held (if it still is): refused, nothing run.
    let during: Vec<String> = (0..4).map(|i| format!("{run}-during-{i}")).collect();
    let sent: Vec<_> = during
        .iter()
        .enumerate()
        .map(|(i, key)| {
            let (key, addr) = (key.clone(), if i % 2 == 0 { a } else { b });
            tokio::spawn(async move { send(addr, &key, "d").await })
        })
        .collect();
    let mut during_kinds = Vec::new();
    for (key, t) in during.iter().zip(sent) {
        let answer = guard("a request under the lock", t).await.expect("task");
        during_kinds.push(answer.kind());
        ledger.add(key, [answer]);
    }
    eprintln!("{test}: answered while the lock was (perhaps still) held: {during_kinds:?}");
    let left = Duration::from_secs(12).saturating_sub(locked_at.elapsed());
    tokio::time::sleep(left).await;
    cli.release();
    let after: Vec<String> = (0..8).map(|i| format!("{run}-after-{i}")).collect();
    for (i, key) in during.iter().chain(&after).enumerate() {
        let (first, second) = if i % 2 == 0 { (a, b) } else { (b, a) };
        let body = if key.contains("during") { "d" } else { "a" };
        for addr in [first, second] {
            let answers = settle(addr, key, body, Duration::from_secs(30)).await;
            ledger.add(key, answers);
        }
    }
    ledger.check(test, &sink, None);
}
