//! Helpers shared by the contract tests: a real server on 127.0.0.1:0, a real client, an effect
//! sink, a store that fails on demand, and a clock that tests move.
#![allow(dead_code, unreachable_pub, missing_docs)]

pub mod batching;
pub mod child;
pub mod counts;
pub mod faulty;
pub mod forward;
pub mod memory;
pub mod model;
pub mod own_redis;
pub mod pg_rig;
pub mod proxy;
pub mod raw;
pub mod resp;
pub mod rig;
pub mod runtimes;
pub mod schemes;
pub mod sink;
pub mod sqlite_cli;
pub mod sqlite_files;
pub mod statements;
pub mod valve;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use axum::Router;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower_idempotency::MemoryStore;

/// `bytes` gzip-compressed, as a client or a handler that compresses sends them.
pub fn gzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(bytes).expect("gzip");
    encoder.finish().expect("gzip")
}

/// `bytes` gzip-decompressed.
pub fn gunzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Read;
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(bytes)
        .read_to_end(&mut out)
        .expect("gunzip");
    out
}

/// The longest any single step may take before a test calls it a hang.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// `f`, failing the test if it takes longer than [`PATIENCE`].
pub async fn guard<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(PATIENCE, f)
        .await
        .unwrap_or_else(|_| panic!("{what} hung for {PATIENCE:?}"))
}

/// Polls `done` every 5 ms until it holds ([`guard`]ed).
pub async fn until(what: &str, mut done: impl FnMut() -> bool) {
    guard(what, async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
}

/// One uncompressed gRPC message frame (flag 0, big-endian length, payload).
pub fn grpc_frame(payload: &[u8]) -> Vec<u8> {
    grpc_frame_flagged(0, payload)
}

/// One gRPC-framed message with its first byte given: 1 for a compressed message, `0x80`
/// for gRPC-Web's trailer frame.
pub fn grpc_frame_flagged(flag: u8, payload: &[u8]) -> Vec<u8> {
    let mut frame = vec![flag];
    frame.extend((payload.len() as u32).to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// Serves `app` on an ephemeral loopback port; the server lives as long as the test runtime.
pub async fn serve(app: Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        axum::serve(listener, app).await.expect("serve");
    });
    addr
}

/// The `code` of a JSON-RPC error in `text` (0: none), read from the text itself: a refusal
/// echoes an id as sent, such as `1e400`, which no JSON reader here takes.
pub fn jsonrpc_code(text: &str) -> i64 {
    let Some(at) = text.find(r#""code":"#) else {
        return 0;
    };
    let rest = &text[at + 7..];
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    rest[..end].trim().parse().unwrap_or_default()
}

/// A client that opens a fresh connection for every request, and gives up after 30 s so a bug
/// that leaves a request hanging fails the test instead of stalling the suite.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

/// Counts side effects where they happen: in the handler, after the work is done.
#[derive(Clone, Default)]
pub struct Effects(Arc<AtomicUsize>);

impl Effects {
    pub fn hit(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }

    pub fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// A clock for `MemoryStore::with_clock` that tests move forward.
#[derive(Clone, Default)]
pub struct TestClock(Arc<AtomicU64>);

impl TestClock {
    pub fn advance(&self, by: Duration) {
        self.0.fetch_add(by.as_millis() as u64, Ordering::SeqCst);
    }

    pub fn store(&self) -> MemoryStore {
        let offset = self.0.clone();
        MemoryStore::with_clock(move || {
            SystemTime::now() + Duration::from_millis(offset.load(Ordering::SeqCst))
        })
    }
}

/// The memory store behind the fault injector, as most contract tests use it.
pub type FlakyStore = faulty::Faulty<MemoryStore>;

/// Sends raw bytes over a new TCP connection and returns the status code of the answer:
/// for requests no well-behaved client would send (chunked bodies, odd headers).
pub async fn raw_status(addr: SocketAddr, request: &[u8]) -> u16 {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(request).await.expect("write");
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    // Read until the status line is complete; the server may close early on bad input.
    while !buf.windows(2).any(|w| w == b"\r\n") {
        let n = stream.read(&mut chunk).await.expect("read");
        assert!(n > 0, "connection closed before a status line");
        buf.extend_from_slice(&chunk[..n]);
    }
    let line = String::from_utf8_lossy(&buf);
    line.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status code")
}

/// The JSON body of a problem answer, after checking its media type.
pub async fn problem(res: reqwest::Response) -> serde_json::Value {
    assert_eq!(
        res.headers()["content-type"],
        "application/problem+json",
        "not a problem answer"
    );
    let bytes = res.bytes().await.expect("body");
    serde_json::from_slice(&bytes).expect("problem JSON")
}

pub fn problem_type(slug: &str) -> String {
    format!("urn:tower-idempotency:problem:{slug}")
}

/// Where the PostgreSQL tests connect: `TOWER_IDEMPOTENCY_POSTGRES_URL`, or the local default.
pub fn postgres_url() -> String {
    std::env::var("TOWER_IDEMPOTENCY_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A missing server fails the run under CI and skips, visibly, elsewhere: the line goes
/// straight to the terminal (libtest captures only `print!`, so a passing test's captured
/// output would hide it), and into the run's skip log that `tests/zz_skipped.rs` counts in
/// one line at the end.
pub fn unreachable(what: &str, error: &dyn std::fmt::Display) {
    if under_ci() {
        panic!("{what} is required under CI=true but unreachable: {error}");
    }
    let test = match std::thread::current().name() {
        Some(name) if name != "main" => format!("{}::{name}", binary_name()),
        _ => binary_name(),
    };
    let line = format!("SKIPPED {test}: {what} is unreachable ({error}); CI=true makes this fail");
    let _ = std::io::Write::write_all(&mut std::io::stderr(), format!("\n{line}\n").as_bytes());
    skip_log::record(&line);
}

/// Whether this is a CI run: `CI` set to anything but empty, `0` or `false` (CI systems say
/// `true`, `1` or `yes`).
pub fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| {
        let v = v.trim();
        !(v.is_empty() || v == "0" || v.eq_ignore_ascii_case("false"))
    })
}

fn binary_name() -> String {
    std::env::args()
        .next()
        .and_then(|exe| {
            std::path::Path::new(&exe)
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
        })
        // Cargo names a test binary `{target}-{hash}`.
        .map(|stem| {
            stem.rsplit_once('-')
                .map_or(stem.clone(), |(t, _)| t.to_owned())
        })
        .unwrap_or_default()
}

/// The skips of one `cargo test` run: every test binary of a run is a child of the same
/// cargo process, so lines are kept per parent process id.
pub mod skip_log {
    use std::io::Write;
    use std::path::PathBuf;

    fn path() -> PathBuf {
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("skipped-tests.log")
    }

    /// Adds one skip of this run.
    pub fn record(line: &str) {
        let parent = std::os::unix::process::parent_id();
        if let Ok(mut file) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path())
        {
            // One `write` per line: appends of a line this short do not interleave.
            let _ = file.write_all(format!("{parent}\t{line}\n").as_bytes());
        }
    }

    /// This run's skips, and forgets every run's.
    pub fn take() -> Vec<String> {
        let parent = std::os::unix::process::parent_id().to_string();
        let text = std::fs::read_to_string(path()).unwrap_or_default();
        let _ = std::fs::remove_file(path());
        text.lines()
            .filter_map(|line| line.split_once('\t'))
            .filter(|(run, _)| *run == parent)
            .map(|(_, line)| line.to_owned())
            .collect()
    }
}

/// Whether the test PostgreSQL answers, asked once per test binary with a short time-out:
/// a missing server costs one probe, not a pool's time-out per test.
async fn postgres_reachable() -> Result<(), String> {
    static PROBE: tokio::sync::OnceCell<Result<(), String>> = tokio::sync::OnceCell::const_new();
    PROBE
        .get_or_init(|| async {
            let url = postgres_url();
            let options: sqlx::postgres::PgConnectOptions =
                url.parse().map_err(|e: sqlx::Error| e.to_string())?;
            let connect = <sqlx::PgConnection as sqlx::Connection>::connect_with(&options);
            match tokio::time::timeout(Duration::from_secs(2), connect).await {
                Ok(Ok(connection)) => {
                    let _ = sqlx::Connection::close(connection).await;
                    Ok(())
                }
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("no answer in 2 s".to_owned()),
            }
        })
        .await
        .clone()
}

/// A pool on the test database, or `None` (after saying so) when there is no server.
pub async fn postgres_pool() -> Option<sqlx::PgPool> {
    let url = postgres_url();
    if let Err(e) = postgres_reachable().await {
        unreachable(&format!("PostgreSQL at {url}"), &e);
        return None;
    }
    match sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(3))
        .connect(&url)
        .await
    {
        Ok(pool) => Some(pool),
        Err(e) => {
            unreachable(&format!("PostgreSQL at {url}"), &e);
            None
        }
    }
}

/// A migrated PostgresStore in its own table (so tests never see each other's rows).
pub async fn postgres(table: &str) -> Option<tower_idempotency::store::PostgresStore> {
    let store = tower_idempotency::store::PostgresStore::new(postgres_pool().await?)
        .with_table(table)
        .expect("a valid table name");
    store.migrate().await.expect("migrate");
    Some(store)
}

/// A fresh SQLite file path in the temp directory.
pub fn sqlite_path(name: &str) -> std::path::PathBuf {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    std::env::temp_dir().join(format!(
        "tower-idempotency-{name}-{}-{nanos}.db",
        std::process::id()
    ))
}

/// A migrated SqliteStore on its own file.
pub async fn sqlite(name: &str) -> (tower_idempotency::store::SqliteStore, std::path::PathBuf) {
    let path = sqlite_path(name);
    let store =
        tower_idempotency::store::SqliteStore::connect(&format!("sqlite://{}", path.display()))
            .await
            .expect("open sqlite");
    store.migrate().await.expect("migrate");
    (store, path)
}

/// Where the Redis tests connect: `TOWER_IDEMPOTENCY_REDIS_URL`, or the local default.
pub fn redis_url() -> String {
    std::env::var("TOWER_IDEMPOTENCY_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A node of the test Redis Cluster (`bash .ci/redis-cluster` starts one on 7000-7002):
/// `TOWER_IDEMPOTENCY_REDIS_CLUSTER`, or the local default.
pub fn redis_cluster_url() -> String {
    std::env::var("TOWER_IDEMPOTENCY_REDIS_CLUSTER")
        .unwrap_or_else(|_| "redis://127.0.0.1:7000".to_owned())
}

/// A prefix no other test, nor an earlier run, has used.
pub fn redis_prefix(name: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("test-{name}-{}-{nanos}", std::process::id())
}

/// A RedisStore on the test server under a prefix of its own, or `None` (after saying so)
/// when there is no server.
pub async fn redis(name: &str) -> Option<tower_idempotency::store::RedisStore> {
    let url = redis_url();
    let connect = tower_idempotency::store::RedisStore::connect(&url);
    match tokio::time::timeout(Duration::from_secs(3), connect).await {
        Ok(Ok(store)) => Some(store.with_prefix(&redis_prefix(name)).expect("prefix")),
        Ok(Err(e)) => {
            unreachable(&format!("Redis at {url}"), &e);
            None
        }
        Err(_) => {
            unreachable(&format!("Redis at {url}"), &"no answer in 3 s");
            None
        }
    }
}

/// A RedisStore on the test cluster under a prefix of its own, or `None` (after saying so)
/// when there is no cluster.
pub async fn redis_cluster(name: &str) -> Option<tower_idempotency::store::RedisStore> {
    let url = redis_cluster_url();
    let nodes = [url.as_str()];
    let connect = tower_idempotency::store::RedisStore::connect_cluster(&nodes);
    match tokio::time::timeout(Duration::from_secs(3), connect).await {
        Ok(Ok(store)) => Some(store.with_prefix(&redis_prefix(name)).expect("prefix")),
        Ok(Err(e)) => {
            unreachable(
                &format!("the Redis Cluster at {url} (bash .ci/redis-cluster)"),
                &e,
            );
            None
        }
        Err(_) => {
            unreachable(
                &format!("the Redis Cluster at {url} (bash .ci/redis-cluster)"),
                &"no answer in 3 s",
            );
            None
        }
    }
}

/// Runs `scenario(store, name)` on every store the crate ships, one test each: MemoryStore,
/// SQLite on a real file (plain and batching), PostgreSQL (plain and batching; one table,
/// each scenario's keys its own) and Redis (under a prefix of its own). A missing server skips
/// visibly (CI fails).
#[allow(unused_macros)]
macro_rules! on_every_store {
    ($scenario:ident) => {
        mod $scenario {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn memory() {
                super::$scenario(tower_idempotency::MemoryStore::new(), "memory").await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                let (store, path) = $crate::common::sqlite(stringify!($scenario)).await;
                super::$scenario(store, "sqlite").await;
                let _ = std::fs::remove_file(path);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite_batching() {
                let (store, path) = $crate::common::sqlite(stringify!($scenario)).await;
                let store = store.with_batching(tower_idempotency::store::Batching::default());
                super::$scenario(store, "sqlite+batching").await;
                let _ = std::fs::remove_file(path);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                let Some(store) = $crate::common::postgres("tower_idempotency_every_store").await
                else {
                    return;
                };
                super::$scenario(store, "postgres").await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres_batching() {
                let Some(store) = $crate::common::postgres("tower_idempotency_every_store").await
                else {
                    return;
                };
                let store = store.with_batching(tower_idempotency::store::Batching::default());
                super::$scenario(store, "postgres+batching").await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn redis() {
                let Some(store) = $crate::common::redis(stringify!($scenario)).await else {
                    return;
                };
                super::$scenario(store, "redis").await;
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use on_every_store;

/// A PostgreSQL store on a table made afresh (dropped, then migrated): uncertain records never
/// expire, so an earlier run's would be listed and counted. `None` (after saying so) when
/// there is no server.
pub async fn fresh_postgres(table: &str) -> Option<tower_idempotency::store::PostgresStore> {
    let pool = postgres_pool().await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
        .execute(&pool)
        .await
        .expect("drop the table");
    postgres(table).await
}

/// Runs `scenario(Arc<store>, name)` on all seven store set-ups, one test each: MemoryStore,
/// SQLite on a real file (plain and batching), PostgreSQL (plain and batching, each on a table
/// of its own made afresh: `$table` and `$table_b`), Redis and Redis Cluster (each under a
/// prefix of its own). For scenarios that list or count every record of their store. A
/// missing server skips visibly (CI fails).
#[allow(unused_macros)]
macro_rules! on_every_store_afresh {
    ($scenario:ident, $table:literal) => {
        mod $scenario {
            use std::sync::Arc;

            use tower_idempotency::store::Batching;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn memory() {
                super::$scenario(Arc::new(tower_idempotency::MemoryStore::new()), "memory").await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                let (store, path) = $crate::common::sqlite($table).await;
                super::$scenario(Arc::new(store), "sqlite").await;
                let _ = std::fs::remove_file(path);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite_batched() {
                let (store, path) = $crate::common::sqlite(concat!($table, "_b")).await;
                let store = store.with_batching(Batching::default());
                super::$scenario(Arc::new(store), "sqlite-batched").await;
                let _ = std::fs::remove_file(path);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                let Some(store) = $crate::common::fresh_postgres($table).await else {
                    return;
                };
                super::$scenario(Arc::new(store), "postgres").await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres_batched() {
                let Some(store) = $crate::common::fresh_postgres(concat!($table, "_b")).await
                else {
                    return;
                };
                let store = store.with_batching(Batching::default());
                super::$scenario(Arc::new(store), "postgres-batched").await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn redis() {
                let Some(store) = $crate::common::redis($table).await else {
                    return;
                };
                super::$scenario(Arc::new(store), "redis").await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn redis_cluster() {
                let Some(store) = $crate::common::redis_cluster($table).await else {
                    return;
                };
                super::$scenario(Arc::new(store), "redis-cluster").await;
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use on_every_store_afresh;

/// A small deterministic generator (xorshift): reproducible "random" cases without a crate.
pub struct Rng(pub u64);

impl Rng {
    /// Seeded; never the all-zero state xorshift cannot leave.
    pub fn new(seed: u64) -> Self {
        Self(seed | 1)
    }

    /// The next number below `n`.
    pub fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Runs the test `test` of this test binary again in a child process with `var` set (the
/// test then does its child's half), and fails unless the child passed and printed
/// `TEARDOWN-CHILD-OK`: for what must happen while a process's threads end. `module` is the
/// test's `module_path!()`: in a binary of many modules (`tests/reviews`) a test is named by
/// its module.
pub fn run_child(module: &str, test: &str, var: &str) {
    let exe = std::env::current_exe().expect("exe");
    let name = match module.split_once("::") {
        Some((_, inner)) => format!("{inner}::{test}"),
        None => test.to_owned(),
    };
    let out = std::process::Command::new(exe)
        .args([name.as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .env(var, "1")
        .output()
        .expect("child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("TEARDOWN-CHILD-OK") && stdout.contains("1 passed"),
        "child failed: {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
}
