//! DESIGN §7 tests 6, 9 and 10 on the durable stores: replicas sharing PostgreSQL or a SQLite
//! file, a holder killed with SIGKILL mid-handler, restarts, an outage of the database
//! connection, and round trips counted on the wire.

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use common::proxy::Proxy;
use common::{Effects, client, problem, problem_type, serve};
use serde_json::{Value, json};
use tokio::sync::Barrier;
use tower_idempotency::store::{PostgresStore, RecordStatus, ScopedKey, SqliteStore};
use tower_idempotency::{IdempotencyLayer, IdempotencyStore};

/// The caller, as the quickstart's auth layer names it: keys are scoped by it, so a process
/// of this test and the quickstart's process see the same records.
#[derive(Clone)]
struct Agent(String);

async fn authenticate(
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let agent = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default()
        .to_owned();
    req.extensions_mut().insert(Agent(agent));
    next.run(req).await
}

/// The quickstart's ticket route, counting effects in this process.
fn tickets<St: IdempotencyStore>(store: St, effects: Effects) -> Router {
    Router::new()
        .route(
            "/tools/create_ticket",
            post(move |body: String| async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let n = effects.hit();
                (StatusCode::CREATED, format!("ticket {n} for {body}"))
            }),
        )
        .layer(IdempotencyLayer::new(store).scope_by_principal(|agent: &Agent| agent.0.clone()))
        .layer(axum::middleware::from_fn(authenticate))
}

const AGENT: &str = "durable-agent";

async fn create(addr: SocketAddr, key: &str, body: &Value) -> reqwest::Response {
    client()
        .post(format!("http://{addr}/tools/create_ticket"))
        .bearer_auth(AGENT)
        .header("idempotency-key", key)
        .json(body)
        .send()
        .await
        .expect("request")
}

fn unique(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{name}-{nanos}")
}

/// 64 concurrent requests with one key, spread over `replicas`, released by a barrier.
async fn burst(replicas: &[SocketAddr], key: &str) -> (usize, usize) {
    const N: usize = 64;
    let barrier = Arc::new(Barrier::new(N));
    let tasks: Vec<_> = (0..N)
        .map(|i| {
            let (addr, barrier, key) = (
                replicas[i % replicas.len()],
                barrier.clone(),
                key.to_owned(),
            );
            tokio::spawn(async move {
                let request = client()
                    .post(format!("http://{addr}/tools/create_ticket"))
                    .bearer_auth(AGENT)
                    .header("idempotency-key", key)
                    .json(&json!({ "title": "burst" }));
                barrier.wait().await;
                request.send().await.expect("request").status()
            })
        })
        .collect();
    let (mut created, mut other) = (0, 0);
    for task in tasks {
        match task.await.expect("task") {
            StatusCode::CREATED => created += 1,
            StatusCode::CONFLICT => other += 1,
            status => panic!("unexpected {status}"),
        }
    }
    (created, other)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_9_three_replicas_on_one_postgres_run_a_key_once() {
    let table = "tower_idempotency_replicas";
    let effects = Effects::default();
    let mut replicas = Vec::new();
    for _ in 0..3 {
        // Each replica has its own pool, as separate processes would.
        let Some(store) = common::postgres(table).await else {
            return;
        };
        replicas.push(serve(tickets(store, effects.clone())).await);
    }
    let key = unique("replicas");
    let (created, other) = burst(&replicas, &key).await;
    // Replays are 201 too: the sink, not the answers, says how often it ran.
    assert_eq!(created + other, 64);
    assert_eq!(
        effects.count(),
        1,
        "exactly one effect across three replicas"
    );
    for addr in &replicas {
        let res = create(*addr, &key, &json!({ "title": "burst" })).await;
        assert_eq!(res.headers()["idempotency-replayed"], "true");
    }
    assert_eq!(effects.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_9_two_pools_on_one_sqlite_file_run_a_key_once() {
    let (first, path) = common::sqlite("replicas").await;
    let url = format!("sqlite://{}", path.display());
    let second = SqliteStore::connect(&url).await.expect("second pool");
    let effects = Effects::default();
    let replicas = [
        serve(tickets(first, effects.clone())).await,
        serve(tickets(second, effects.clone())).await,
    ];
    let (created, other) = burst(&replicas, "sqlite-burst").await;
    assert_eq!(created + other, 64);
    assert_eq!(effects.count(), 1, "exactly one effect across two pools");
}

/// The quickstart example, serving on an ephemeral port on `store_url`.
struct QuickstartProcess {
    child: Child,
    addr: SocketAddr,
}

impl QuickstartProcess {
    fn start(store_url: &str) -> Self {
        // Test binaries live in target/<profile>/deps; `cargo test` builds examples beside it.
        let exe = std::env::current_exe().expect("test binary path");
        let quickstart = exe
            .parent()
            .and_then(|deps| deps.parent())
            .map(|profile| profile.join("examples").join("quickstart"))
            .expect("target directory");
        assert!(
            quickstart.exists(),
            "build the quickstart example first: {}",
            quickstart.display()
        );
        let mut child = Command::new(quickstart)
            .args(["--store", store_url])
            .env("ADDR", "127.0.0.1:0")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn quickstart");
        let stdout = child.stdout.take().expect("stdout");
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        reader.read_line(&mut line).expect("banner");
        // Keep reading what the server prints, so its writes never meet a closed pipe.
        std::thread::spawn(move || std::io::copy(&mut reader, &mut std::io::sink()));
        let addr = line
            .split("http://")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no address in the banner {line:?}"));
        Self { child, addr }
    }

    /// SIGKILL: no destructor, no graceful shutdown, nothing recorded on the way out.
    fn kill(self) {
        drop(self);
    }
}

impl Drop for QuickstartProcess {
    // Also on a failed assertion: a leaked server would outlive the test run.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn crash_after_claim<St: IdempotencyStore + Clone>(store: St, store_url: &str) {
    let key = unique("crash");
    let body = json!({ "title": "crash", "work_ms": 600_000 });
    let holder = QuickstartProcess::start(store_url);
    let addr = holder.addr;
    let (k, b) = (key.clone(), body.clone());
    let pending = tokio::spawn(async move { create(addr, &k, &b).await });
    // Wait until the holder has claimed the key and is inside its (endless) handler.
    let scoped = ScopedKey::new(format!("principal:{AGENT}"), key.clone());
    let mut claimed = false;
    for _ in 0..300 {
        if let Some(record) = store.lookup(&scoped).await.expect("lookup") {
            assert_eq!(record.status, RecordStatus::InProgress);
            claimed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(claimed, "the holder never claimed the key");
    holder.kill();
    let _ = pending.await;

    // A fresh process (this one, with its own pool) sees the key in flight, never as new.
    let effects = Effects::default();
    let fresh = serve(tickets(store.clone(), effects.clone())).await;
    for _ in 0..3 {
        let res = create(fresh, &key, &body).await;
        assert_eq!(res.status(), StatusCode::CONFLICT);
        assert_eq!(problem(res).await["type"], problem_type("in-flight"));
    }
    assert_eq!(
        effects.count(),
        0,
        "the crashed key never runs again while its lease holds"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_6_crash_after_claim_on_postgres() {
    let Some(store) = common::postgres(PostgresStore::DEFAULT_TABLE).await else {
        return;
    };
    crash_after_claim(store, &common::postgres_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_6_crash_after_claim_on_sqlite() {
    let (store, path) = common::sqlite("crash").await;
    crash_after_claim(store, &format!("sqlite://{}", path.display())).await;
}

async fn restart_replays(store_url: &str) {
    let key = unique("restart");
    let body = json!({ "title": "survives restarts", "work_ms": 10 });
    let before = QuickstartProcess::start(store_url);
    let first = create(before.addr, &key, &body).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let first_body = first.bytes().await.expect("body");
    before.kill();

    let after = QuickstartProcess::start(store_url);
    let replay = create(after.addr, &key, &body).await;
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(replay.headers()["location"], "/tickets/1");
    assert_eq!(replay.bytes().await.expect("body"), first_body);
    let effects: Value = client()
        .get(format!("http://{}/effects", after.addr))
        .send()
        .await
        .expect("effects")
        .json()
        .await
        .expect("json");
    assert_eq!(effects["tickets"], 0, "the restarted process ran nothing");
    after.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_replays_from_postgres() {
    if common::postgres(PostgresStore::DEFAULT_TABLE)
        .await
        .is_none()
    {
        return;
    }
    restart_replays(&common::postgres_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_replays_from_sqlite() {
    let path = common::sqlite_path("restart");
    restart_replays(&format!("sqlite://{}", path.display())).await;
}

/// §2 across versions: a response stored by 0.1 (format `TIR1`, fixed-width lengths) or by
/// the format after it (`TIR2`, varints, names spelled out) still replays byte for byte,
/// without running the handler, after the format moved on (`TIR3`, known names as indexes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_a_response_stored_in_an_earlier_format_still_replays_from_sqlite() {
    let (store, _path) = common::sqlite("legacy").await;
    let effects = Effects::default();
    let addr = serve(tickets(store.clone(), effects.clone())).await;
    // Each: 201, content-type text/plain, the body, no trailers.
    let v1 = [
        &b"TIR1\x00\xc9\x00\x00\x00\x01"[..],
        b"\x00\x00\x00\x0ccontent-type\x00\x00\x00\x0atext/plain",
        b"\x01\x00\x00\x00\x00\x00\x00\x00\x0eticket 7 (0.1)\x00",
    ]
    .concat();
    let v2 = [
        &b"TIR2\x00\xc9\x01"[..],
        b"\x0ccontent-type\x0atext/plain",
        b"\x01\x0fticket 8 (TIR2)\x00",
    ]
    .concat();
    for (format, stored, text) in [
        ("TIR1", v1, "ticket 7 (0.1)"),
        ("TIR2", v2, "ticket 8 (TIR2)"),
    ] {
        let key = unique("legacy");
        let body = json!({ "title": "stored long ago" });
        let before = effects.count();
        assert_eq!(
            create(addr, &key, &body).await.status(),
            StatusCode::CREATED
        );
        let rewritten = sqlx::query("UPDATE idempotency_records SET response = ? WHERE key = ?")
            .bind(stored)
            .bind(key.as_bytes())
            .execute(store.pool())
            .await
            .expect("rewrite the row")
            .rows_affected();
        assert_eq!(rewritten, 1, "{format}");

        let replay = create(addr, &key, &body).await;
        assert_eq!(replay.status(), StatusCode::CREATED, "{format}");
        assert_eq!(replay.headers()["idempotency-replayed"], "true", "{format}");
        assert_eq!(replay.headers()["content-type"], "text/plain", "{format}");
        assert_eq!(replay.text().await.expect("body"), text, "{format}");
        assert_eq!(
            effects.count(),
            before + 1,
            "{format}: the replay ran nothing"
        );
    }
}

/// A store whose every connection to PostgreSQL passes through `proxy`.
async fn store_behind(proxy: &Proxy, table: &str, connections: u32) -> PostgresStore {
    let mut url: reqwest::Url = common::postgres_url().parse().expect("url");
    url.set_host(Some("127.0.0.1")).expect("host");
    url.set_port(Some(proxy.addr.port())).expect("port");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_millis(1500))
        .test_before_acquire(false)
        .connect(url.as_str())
        .await
        .expect("connect through the proxy");
    let store = PostgresStore::new(pool).with_table(table).expect("table");
    store.migrate().await.expect("migrate");
    store
}

async fn postgres_addr() -> Option<SocketAddr> {
    common::postgres_pool().await?;
    let url: reqwest::Url = common::postgres_url().parse().expect("url");
    let host = url.host_str().unwrap_or("127.0.0.1");
    let port = url.port().unwrap_or(5432);
    tokio::net::lookup_host((host, port))
        .await
        .expect("resolve")
        .next()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_10_postgres_outage_fails_closed_and_recovers() {
    let Some(upstream) = postgres_addr().await else {
        return;
    };
    let proxy = Proxy::start(upstream).await;
    let store = store_behind(&proxy, "tower_idempotency_outage", 4).await;
    let effects = Effects::default();
    let addr = serve(tickets(store, effects.clone())).await;
    let (done, pending) = (unique("before-outage"), unique("during-outage"));
    let body = json!({ "title": "outage" });

    assert_eq!(
        create(addr, &done, &body).await.status(),
        StatusCode::CREATED
    );
    proxy.cut();
    for key in [&done, &pending, &pending] {
        let res = create(addr, key, &body).await;
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(res.headers().contains_key("retry-after"));
        assert_eq!(
            problem(res).await["type"],
            problem_type("store-unavailable")
        );
    }
    assert_eq!(
        effects.count(),
        1,
        "nothing runs while the database is unreachable"
    );

    proxy.restore();
    let mut recovered = None;
    for _ in 0..50 {
        let res = create(addr, &pending, &body).await;
        if res.status() != StatusCode::SERVICE_UNAVAILABLE {
            recovered = Some(res);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        recovered.expect("service resumes").status(),
        StatusCode::CREATED
    );
    let replay = create(addr, &done, &body).await;
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    let replay = create(addr, &pending, &body).await;
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(
        effects.count(),
        2,
        "each key ran exactly once across the outage"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_statements_claim_one_complete_one_replay_one() {
    let Some(upstream) = postgres_addr().await else {
        return;
    };
    let proxy = Proxy::start(upstream).await;
    // One connection, so every statement is prepared once, during the warm-up.
    let store = store_behind(&proxy, "tower_idempotency_round_trips", 1).await;
    let addr = serve(tickets(store, Effects::default())).await;
    let body = json!({ "title": "count" });
    let warm = unique("warm");
    create(addr, &warm, &body).await;
    create(addr, &warm, &body).await;

    let key = unique("counted");
    let before = proxy.statements();
    assert_eq!(
        create(addr, &key, &body).await.status(),
        StatusCode::CREATED
    );
    assert_eq!(
        proxy.statements() - before,
        2,
        "first request: claim 1 + complete 1"
    );

    let before = proxy.statements();
    let replay = create(addr, &key, &body).await;
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(proxy.statements() - before, 1, "replay: one claim-or-fetch");

    let before = proxy.statements();
    let mismatch = create(addr, &key, &json!({ "title": "other" })).await;
    assert_eq!(mismatch.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        proxy.statements() - before,
        1,
        "mismatch: one claim-or-fetch"
    );
}

#[tokio::test]
async fn hostile_table_names_are_refused() {
    let (store, _) = common::sqlite("hostile").await;
    for name in ["t; DROP TABLE x", "a\"b", "1abc", "", "a.b", "ta ble"] {
        assert!(store.clone().with_table(name).is_err(), "{name:?}");
    }
    let Some(pool) = common::postgres_pool().await else {
        return;
    };
    for table in [
        "public.x\"; DROP SCHEMA public; --",
        "pg catalog.t",
        "public.",
        ".t",
        "a.b.c",
        "",
    ] {
        assert!(
            PostgresStore::new(pool.clone()).with_table(table).is_err(),
            "{table}"
        );
    }
    // The same shape as SQLite's: one name, with a schema where PostgreSQL has them.
    assert!(
        PostgresStore::new(pool.clone())
            .with_table("records_v2")
            .is_ok()
    );
    assert!(
        PostgresStore::new(pool)
            .with_table("idem.records_v2")
            .is_ok()
    );
}
