//! Throughput and latency over loopback HTTP: a bare axum handler against the same handler
//! behind the layer, on each store and on the replay path. 64 keep-alive connections send 1 KiB
//! JSON bodies for a fixed time per scenario; every row is a ratio against the bare handler
//! measured in the same run. The MemoryStore rows are repeated against a handler that parses
//! its body, the least a real one does.
//!
//! The MemoryStore scenarios run in interleaved rounds (each round runs every scenario once, in
//! a rotating order) and each round's ratio is taken against that round's bare handler: load
//! from elsewhere on a shared host then moves both sides of a ratio alike. Their rows give the
//! median over rounds and the range of the ratio.
//!
//! The servers run on a runtime of their own (two workers), the load generator on another, so
//! the kernel's per-thread accounting gives the server's CPU time per request: a measure that
//! does not depend on how the two cores were shared with the load generator. Four busy threads
//! on two cores lengthen the latency tail (p99) for every row alike.
//!
//! Two more rows put the targets in proportion: the same handler behind the floor
//! (`support/floor.rs`), the least an idempotency middleware can do (buffer, SHA-256, a map
//! under a mutex, buffer the response), with unique keys and replays; the layer's MemoryStore
//! rows are then shown once more, as ratios to the floor's. Two more rows run the floor with
//! fingerprinting made free (`FloorLayer::unhashed`: the request kept and compared), to show
//! which targets SHA-256 alone puts out of reach.
//!
//! `cargo bench -p suite --bench http` (PostgreSQL from `TOWER_IDEMPOTENCY_POSTGRES_URL`,
//! default `postgres://postgres@127.0.0.1:5432/test`, Redis from `TOWER_IDEMPOTENCY_REDIS_URL`,
//! default `redis://127.0.0.1:6379`; their rows are skipped if they are down).
//! `BENCH_SECONDS` sets the time per scenario and round (default 5 for the SQL stores, 1 for a
//! MemoryStore round), `BENCH_ROUNDS` the number of rounds (default 11); `BENCH_ONLY=memory`
//! stops after the MemoryStore rows.

#[path = "support/floor.rs"]
mod floor;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tower_idempotency::store::{AnyStore, Batching, PostgresStore, RedisStore, SqliteStore};
use tower_idempotency::{IdempotencyLayer, IdempotencyStore, MemoryStore};

const CONNECTIONS: usize = 64;

fn handler_app() -> Router {
    Router::new().route(
        "/tools/create_ticket",
        post(|body: Bytes| async move {
            axum::Json(serde_json::json!({ "ticket": 1, "received": body.len() }))
        }),
    )
}

/// A handler that does a little of what real ones do: it parses its JSON body.
fn parsing_app() -> Router {
    Router::new().route(
        "/tools/create_ticket",
        post(
            |axum::Json(ticket): axum::Json<serde_json::Value>| async move {
                let title = ticket["title"].as_str().map_or(0, str::len);
                axum::Json(serde_json::json!({ "ticket": 1, "title": title }))
            },
        ),
    )
}

/// The servers' own runtime (two workers, as the machine has two cores), apart from the load
/// generator's: what its threads spend is what the requests cost the server.
fn server_runtime() -> &'static tokio::runtime::Runtime {
    static SERVER: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    SERVER.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(SERVER_THREADS)
            .enable_all()
            .build()
            .expect("server runtime")
    })
}

const SERVER_THREADS: &str = "bench-server";

/// CPU time the server runtime's threads have used so far, from the kernel's per-thread
/// accounting (`/proc/self/task/*/schedstat`, in nanoseconds); `None` where it is missing.
fn server_cpu() -> Option<Duration> {
    let mut total = 0u64;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let path = task.ok()?.path();
        let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        if comm.trim_end() != SERVER_THREADS {
            continue;
        }
        let stat = std::fs::read_to_string(path.join("schedstat")).ok()?;
        total += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(Duration::from_nanos(total))
}

async fn serve(app: Router) -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let addr = listener.local_addr().expect("addr");
    server_runtime().spawn(async move {
        let listener = TcpListener::from_std(listener).expect("listener");
        axum::serve(listener, app).await.expect("serve")
    });
    addr
}

/// A 1 KiB JSON body.
fn body() -> Bytes {
    let title = "x".repeat(1024 - 60);
    Bytes::from(
        serde_json::to_vec(&serde_json::json!({ "title": title, "priority": 2 })).expect("json"),
    )
}

#[derive(Clone, Copy, PartialEq)]
enum Keys {
    None,
    /// A new key per request: every request claims, runs and records.
    Unique,
    /// Each connection repeats one key: after its first request, every request is a replay.
    Repeated,
}

struct Result {
    rps: f64,
    /// Server CPU time per request.
    cpu: Option<Duration>,
    p50: Duration,
    p99: Duration,
    errors: usize,
}

/// Connections per scenario: `BENCH_CONNECTIONS`, default 64.
fn connections() -> usize {
    setting("BENCH_CONNECTIONS").unwrap_or(CONNECTIONS).max(1)
}

async fn load(addr: SocketAddr, keys: Keys, seconds: u64, run: &str) -> Result {
    let body = body();
    let cpu_before = server_cpu();
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let start = Instant::now();
    let tasks: Vec<_> = (0..connections())
        .map(|c| {
            let (body, run) = (body.clone(), run.to_owned());
            tokio::spawn(async move {
                let stream = TcpStream::connect(addr).await.expect("connect");
                stream.set_nodelay(true).expect("nodelay");
                let (mut sender, conn) =
                    hyper::client::conn::http1::handshake(TokioIo::new(stream))
                        .await
                        .expect("handshake");
                tokio::spawn(conn);
                let mut latencies = Vec::with_capacity(100_000);
                let mut errors = 0;
                let mut i = 0u64;
                while Instant::now() < deadline {
                    let mut request =
                        http::Request::post(format!("http://{addr}/tools/create_ticket"))
                            .header("content-type", "application/json");
                    match keys {
                        Keys::None => {}
                        Keys::Unique => {
                            request = request.header("idempotency-key", format!("{run}-{c}-{i}"))
                        }
                        Keys::Repeated => {
                            request = request.header("idempotency-key", format!("{run}-{c}"))
                        }
                    }
                    let request = request.body(Full::new(body.clone())).expect("request");
                    let t = Instant::now();
                    sender.ready().await.expect("ready");
                    match sender.send_request(request).await {
                        Ok(res) => {
                            let ok = res.status().is_success();
                            res.into_body().collect().await.expect("body");
                            if ok {
                                latencies.push(t.elapsed())
                            } else {
                                errors += 1
                            }
                        }
                        Err(_) => errors += 1,
                    }
                    i += 1;
                }
                (latencies, errors)
            })
        })
        .collect();
    let mut all = Vec::new();
    let mut errors = 0;
    for task in tasks {
        let (latencies, e) = task.await.expect("load task");
        all.extend(latencies);
        errors += e;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let served = (all.len() + errors).max(1) as u32;
    let cpu = server_cpu()
        .zip(cpu_before)
        .map(|(after, before)| after.saturating_sub(before) / served);
    all.sort();
    let pick = |q: f64| {
        all.get(((all.len() as f64 * q) as usize).min(all.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    };
    Result {
        rps: all.len() as f64 / elapsed,
        cpu,
        p50: pick(0.50),
        p99: pick(0.99),
        errors,
    }
}

async fn scenario<St: IdempotencyStore>(store: St, keys: Keys, seconds: u64, run: &str) -> Result {
    scenario_on(handler_app(), store, keys, seconds, run).await
}

async fn scenario_on<St: IdempotencyStore>(
    app: Router,
    store: St,
    keys: Keys,
    seconds: u64,
    run: &str,
) -> Result {
    let addr = serve(app.layer(IdempotencyLayer::new(store).single_tenant())).await;
    load(addr, keys, seconds, run).await
}

/// One row: `r` and its ratio to `base`.
fn print_row(name: &str, r: &Result, base: &Result) {
    println!(
        "{:<36} {:>10.0} {:>9} {:>9} {:>7.2}x {:>7}",
        name,
        r.rps,
        r.p50.as_micros(),
        r.p99.as_micros(),
        r.rps / base.rps,
        r.errors
    );
}

/// A number from the environment.
fn setting<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|s| s.parse().ok())
}

/// The median of `values` (sorted in place).
fn median<T: Copy + PartialOrd>(values: &mut [T]) -> T {
    values.sort_by(|a, b| a.partial_cmp(b).expect("comparable"));
    values[values.len() / 2]
}

/// Throughput over `base`'s, round by round.
fn ratios(rounds: &[Result], base: &[Result]) -> Vec<f64> {
    rounds
        .iter()
        .zip(base)
        .map(|(r, b)| r.rps / b.rps)
        .collect()
}

/// One interleaved row: medians over rounds, and the ratio to `base` taken round by round.
fn print_rounds(name: &str, rounds: &[Result], base: &[Result]) {
    let mut rps: Vec<f64> = rounds.iter().map(|r| r.rps).collect();
    let mut p50: Vec<Duration> = rounds.iter().map(|r| r.p50).collect();
    let mut p99: Vec<Duration> = rounds.iter().map(|r| r.p99).collect();
    let mut ratios = ratios(rounds, base);
    let micros = |d: Duration| d.as_secs_f64() * 1e6;
    let mut cpu: Vec<f64> = rounds.iter().filter_map(|r| r.cpu.map(micros)).collect();
    // What the server spent per request beyond the bare handler, round by round.
    let mut added: Vec<f64> = rounds
        .iter()
        .zip(base)
        .filter_map(|(r, b)| Some(micros(r.cpu?) - micros(b.cpu?)))
        .collect();
    let errors: usize = rounds.iter().map(|r| r.errors).sum();
    let ratio = median(&mut ratios);
    let (cpu, added) = match (cpu.is_empty(), added.is_empty()) {
        (false, false) => (
            format!("{:.1}", median(&mut cpu)),
            format!("{:+.1}", median(&mut added)),
        ),
        _ => ("-".to_owned(), "-".to_owned()),
    };
    println!(
        "{:<36} {:>8.0} {:>7} {:>7} {:>6.2}x {:>10} {:>9} {:>8} {:>6}",
        name,
        median(&mut rps),
        median(&mut p50).as_micros(),
        median(&mut p99).as_micros(),
        ratio,
        format!("{:.2}-{:.2}", ratios[0], ratios[ratios.len() - 1]),
        cpu,
        added,
        errors,
    );
}

/// The MemoryStore scenarios, each on its own server: (row name, address, keys).
struct Interleaved {
    scenarios: Vec<(&'static str, SocketAddr, Keys)>,
    rounds: Vec<Vec<Result>>,
}

impl Interleaved {
    async fn run(
        scenarios: Vec<(&'static str, SocketAddr, Keys)>,
        rounds: usize,
        seconds: u64,
        run: &str,
    ) -> Self {
        let mut results: Vec<Vec<Result>> = scenarios.iter().map(|_| Vec::new()).collect();
        for round in 0..rounds {
            for i in 0..scenarios.len() {
                // Rotate the order, so no scenario always follows the same one.
                let i = (i + round) % scenarios.len();
                let (_, addr, keys) = scenarios[i];
                // Repeated keys stay the same across rounds (replays from the first request
                // on); unique ones are new every round.
                let tag = match keys {
                    Keys::Unique => format!("{run}-{i}-{round}"),
                    _ => format!("{run}-{i}"),
                };
                results[i].push(load(addr, keys, seconds, &tag).await);
            }
        }
        Self {
            scenarios,
            rounds: results,
        }
    }

    /// Prints scenario `i`'s row against scenario `base`.
    fn print(&self, i: usize, base: usize) {
        self.print_as(self.scenarios[i].0, i, base);
    }

    /// [`print`](Self::print) under another name.
    fn print_as(&self, name: &str, i: usize, base: usize) {
        print_rounds(name, &self.rounds[i], &self.rounds[base]);
    }

    /// Scenario `i`'s throughput over scenario `base`'s: the median over rounds.
    fn ratio(&self, i: usize, base: usize) -> f64 {
        median(&mut ratios(&self.rounds[i], &self.rounds[base]))
    }
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run());
}

async fn run() {
    // `BENCH_SERVE=1`: serve the bare handler on 127.0.0.1:3001, the layer on MemoryStore on
    // :3002 and the floor on :3003 until killed, for an external load generator (see BENCHMARKS.md).
    if std::env::var("BENCH_SERVE").is_ok() {
        let apps = [
            (3001, handler_app()),
            (
                3002,
                handler_app().layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant()),
            ),
            (3003, handler_app().layer(floor::FloorLayer::new())),
        ];
        for (port, app) in apps {
            let listener = TcpListener::bind(("127.0.0.1", port))
                .await
                .unwrap_or_else(|e| panic!("bind {port}: {e}"));
            tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
        }
        println!("bare on http://127.0.0.1:3001, layer + MemoryStore on :3002, the floor on :3003");
        std::future::pending::<()>().await;
    }
    if std::env::var("BENCH_ONLY").is_ok_and(|v| v == "batching") {
        batching().await;
        return;
    }
    let rounds: usize = setting("BENCH_ROUNDS").unwrap_or(11).max(1);
    let round_seconds: u64 = setting("BENCH_SECONDS").unwrap_or(1);
    let seconds: u64 = setting("BENCH_SECONDS").unwrap_or(5);
    let run_id = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
        .to_string();
    println!(
        "{} cores, {} connections, 1 KiB JSON bodies",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        connections()
    );
    println!(
        "MemoryStore: {rounds} interleaved rounds of {round_seconds} s per scenario; \
         medians over rounds, and the range of the ratio"
    );
    println!(
        "server µs: the server runtime's CPU time per request; +µs: beyond the bare handler's"
    );
    println!(
        "\n{:<36} {:>8} {:>7} {:>7} {:>7} {:>10} {:>9} {:>8} {:>6}",
        "scenario", "req/s", "p50 µs", "p99 µs", "vs bare", "range", "server µs", "+µs", "errors"
    );

    // Each handler bare, then behind the layer with unique keys and with replays.
    let mut scenarios = Vec::new();
    for (bare, app) in [
        ("bare handler", handler_app as fn() -> Router),
        ("bare parsing handler", parsing_app),
    ] {
        scenarios.push((bare, serve(app()).await, Keys::None));
        for (name, keys) in [
            ("layer + MemoryStore, unique keys", Keys::Unique),
            ("layer + MemoryStore, replays", Keys::Repeated),
        ] {
            // Unbounded, as the floor is: eleven rounds write over a million keys, past the
            // default bound, and a full store answers 503 instead of serving.
            let store = MemoryStore::new()
                .max_records(usize::MAX)
                .max_bytes(usize::MAX);
            let layered = app().layer(IdempotencyLayer::new(store).single_tenant());
            scenarios.push((name, serve(layered).await, keys));
        }
    }
    for (name, keys, floor) in [
        (
            "floor middleware, unique keys",
            Keys::Unique,
            floor::FloorLayer::new as fn() -> _,
        ),
        (
            "floor middleware, replays",
            Keys::Repeated,
            floor::FloorLayer::new,
        ),
        (
            "floor, unhashed, unique keys",
            Keys::Unique,
            floor::FloorLayer::unhashed,
        ),
        (
            "floor, unhashed, replays",
            Keys::Repeated,
            floor::FloorLayer::unhashed,
        ),
    ] {
        scenarios.push((name, serve(handler_app().layer(floor())).await, keys));
    }
    let bare_addr = scenarios[0].1;
    // Warm up the machine and the connection path before the baseline.
    load(bare_addr, Keys::None, 1, "warm").await;
    let memory = Interleaved::run(scenarios, rounds, round_seconds, &format!("{run_id}-m")).await;
    for i in 0..3 {
        memory.print(i, 0);
    }
    println!("\nagainst a handler that parses its JSON body (ratios to its bare row):");
    for i in 3..6 {
        memory.print(i, 3);
    }
    println!(
        "\nthe floor: the least an idempotency middleware can do (ratios to the bare handler):"
    );
    for i in 6..8 {
        memory.print(i, 0);
    }
    println!("the floor with fingerprinting made free (the request kept and compared):");
    for i in 8..10 {
        memory.print(i, 0);
    }
    println!("\nthe layer against the floor (ratios to the floor's row; +µs beyond its CPU):");
    memory.print_as("layer + MemoryStore, unique keys", 1, 6);
    memory.print_as("layer + MemoryStore, replays", 2, 7);
    println!();
    for (what, i, floor, unhashed, target) in
        [("unique keys", 1, 6, 8, 0.92), ("replays", 2, 7, 9, 1.0)]
    {
        let ratio = memory.ratio(i, 0);
        println!(
            "target: layer + MemoryStore, {what}, at least {target:.2}x bare: {ratio:.2}x, {} \
             (the floor: {:.2}x; unhashed: {:.2}x)",
            if ratio >= target { "met" } else { "missed" },
            memory.ratio(floor, 0),
            memory.ratio(unhashed, 0)
        );
    }

    if std::env::var("BENCH_ONLY").is_ok_and(|v| v == "memory") {
        return;
    }
    println!("\nDurable stores: one run of {seconds} s each, against a bare run just before them:");
    println!(
        "\n{:<36} {:>10} {:>9} {:>9} {:>8} {:>7}",
        "scenario", "req/s", "p50 µs", "p99 µs", "vs bare", "errors"
    );
    let bare = load(bare_addr, Keys::None, seconds, "bare").await;
    let row = |name: &str, r: &Result| print_row(name, r, &bare);
    row("bare handler", &bare);
    let path = std::env::temp_dir().join(format!("tower-idempotency-bench-{run_id}.db"));
    let sqlite = SqliteStore::connect(&format!("sqlite://{}", path.display()))
        .await
        .expect("sqlite");
    sqlite.migrate().await.expect("migrate");
    let r = scenario(sqlite, Keys::Unique, seconds, &format!("{run_id}-s")).await;
    row("layer + SqliteStore, unique keys", &r);
    let _ = std::fs::remove_file(&path);

    match postgres_store("tower_idempotency_bench").await {
        Ok(store) => {
            let r = scenario(store.clone(), Keys::Unique, seconds, &format!("{run_id}-p")).await;
            row("layer + PostgresStore, unique keys", &r);
            let r = scenario(store, Keys::Repeated, seconds, &format!("{run_id}-pr")).await;
            row("layer + PostgresStore, replays", &r);
        }
        Err(e) => println!(
            "{:<36} skipped: PostgreSQL unreachable ({e})",
            "layer + PostgresStore"
        ),
    }

    let url = std::env::var("TOWER_IDEMPOTENCY_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    match RedisStore::connect(&url).await {
        Ok(store) => {
            let store = store
                .with_prefix(&format!("bench-{run_id}"))
                .expect("prefix");
            let r = scenario(store.clone(), Keys::Unique, seconds, &format!("{run_id}-r")).await;
            row("layer + RedisStore, unique keys", &r);
            let r = scenario(store, Keys::Repeated, seconds, &format!("{run_id}-rr")).await;
            row("layer + RedisStore, replays", &r);
        }
        Err(e) => println!(
            "{:<36} skipped: Redis unreachable ({e})",
            "layer + RedisStore"
        ),
    }
    batching().await;
}

/// A PostgresStore on a pool of 32 in `table`, emptied (`TOWER_IDEMPOTENCY_POSTGRES_URL`,
/// default `postgres://postgres@127.0.0.1:5432/test`).
async fn postgres_store(table: &str) -> std::result::Result<PostgresStore, sqlx::Error> {
    let url = std::env::var("TOWER_IDEMPOTENCY_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(32)
        .connect(&url)
        .await?;
    let store = PostgresStore::new(pool).with_table(table).expect("table");
    store.migrate().await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("TRUNCATE {table}")))
        .execute(store.pool())
        .await?;
    Ok(store)
}

/// Issue 23 §4: the durable stores batched against today's path, unique keys at 64
/// connections, in interleaved rounds (`BENCH_ROUNDS`, default 5, of `BENCH_SECONDS`, default
/// 2); `BENCH_ONLY=batching` runs only these rows.
async fn batching() {
    let rounds: usize = setting("BENCH_ROUNDS").unwrap_or(5).max(1);
    let seconds: u64 = setting("BENCH_SECONDS").unwrap_or(2);
    let run_id = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
        .to_string();
    let layered = |store| handler_app().layer(IdempotencyLayer::new(store).single_tenant());
    let mut scenarios = vec![("bare handler", serve(handler_app()).await, Keys::None)];

    let path = std::env::temp_dir().join(format!("tower-idempotency-batching-{run_id}.db"));
    let sqlite = SqliteStore::connect(&format!("sqlite://{}", path.display()))
        .await
        .expect("sqlite");
    sqlite.migrate().await.expect("migrate");
    let batched = sqlite.clone().with_batching(Batching::default());
    scenarios.push((
        "SqliteStore, today's path",
        serve(layered(AnyStore::Sqlite(sqlite))).await,
        Keys::Unique,
    ));
    scenarios.push((
        "SqliteStore, batched",
        serve(layered(AnyStore::Sqlite(batched))).await,
        Keys::Unique,
    ));

    match postgres_store("tower_idempotency_bench_batching").await {
        Ok(store) => {
            let batched = store.clone().with_batching(Batching::default());
            scenarios.push((
                "PostgresStore, today's path",
                serve(layered(AnyStore::Postgres(store))).await,
                Keys::Unique,
            ));
            scenarios.push((
                "PostgresStore, batched",
                serve(layered(AnyStore::Postgres(batched))).await,
                Keys::Unique,
            ));
        }
        Err(e) => println!("PostgreSQL rows skipped: unreachable ({e})"),
    }
    println!(
        "\nBatched durable stores (issue 23 §4): unique keys, {} connections, \
         {rounds} interleaved rounds of {seconds} s; the batched rows' ratios are to today's path",
        connections()
    );
    println!(
        "\n{:<36} {:>8} {:>7} {:>7} {:>7} {:>10} {:>9} {:>8} {:>6}",
        "scenario", "req/s", "p50 µs", "p99 µs", "vs base", "range", "server µs", "+µs", "errors"
    );
    let warm = scenarios[0].1;
    load(warm, Keys::None, 1, "warm").await;
    let measured = Interleaved::run(scenarios, rounds, seconds, &format!("{run_id}-b")).await;
    measured.print(0, 0);
    for plain in (1..measured.scenarios.len()).step_by(2) {
        measured.print(plain, 0);
        measured.print(plain + 1, plain);
    }
    println!();
    for plain in (1..measured.scenarios.len()).step_by(2) {
        let ratio = measured.ratio(plain + 1, plain);
        let p99 = |i: usize| {
            let mut p99: Vec<Duration> = measured.rounds[i].iter().map(|r| r.p99).collect();
            median(&mut p99)
        };
        let (before, after) = (p99(plain), p99(plain + 1));
        let name = measured.scenarios[plain + 1].0;
        let (after, before) = (after.as_micros(), before.as_micros());
        if connections() == CONNECTIONS {
            println!(
                "target: {name}, at least 2x today's throughput at {CONNECTIONS} connections, \
                 p99 no worse: {ratio:.2}x, p99 {after} µs against {before} µs, {}",
                if ratio >= 2.0 && after <= before {
                    "met"
                } else {
                    "missed"
                }
            );
        } else {
            // Fewer connections: batches are small or single, and nothing should be lost.
            println!(
                "{name} at {} connections: {ratio:.2}x today's throughput, p99 {after} µs \
                 against {before} µs",
                connections()
            );
        }
    }
    let _ = std::fs::remove_file(&path);
}
