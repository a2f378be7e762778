//! The PostgreSQL store against its own ceiling: claim + complete through `PostgresStore`, and
//! the same two SQL statements issued directly through sqlx, on one pool with the same
//! concurrency, in the same run. Statements per operation are counted on the wire, by a proxy
//! that reads the PostgreSQL protocol (the one the tests use), not assumed.
//!
//! `cargo bench -p suite --bench store` (`TOWER_IDEMPOTENCY_POSTGRES_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`; `BENCH_SECONDS` per side, default 8)

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use sqlx::AssertSqlSafe;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tower_idempotency::IdempotencyStore;
use tower_idempotency::store::{
    Claim, ClaimRequest, Fingerprint, LeaseExpiry, PostgresStore, ScopedKey, StoredResponse,
};

#[allow(dead_code, unreachable_pub)] // shared with the tests, which also cut and restore it
#[path = "../tests/common/proxy.rs"]
mod proxy;

const TASKS: usize = 32;
/// Rounds per side in the timed runs, in alternating order.
const ROUNDS: usize = 4;
/// Operations of each kind in the counted run.
const COUNTED: u64 = 100;

fn claim_request(key: &ScopedKey) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        fingerprint: Fingerprint::from_bytes([7; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
        on_lease_expiry: LeaseExpiry::Reclaim,
    }
}

fn response() -> StoredResponse {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", "application/json".parse().expect("value"));
    StoredResponse {
        status: StatusCode::CREATED,
        headers,
        body: Some(Bytes::from(vec![b'x'; 200])),
        trailers: None,
    }
}

async fn run_for<F, Fut>(seconds: u64, op: F) -> f64
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let op = Arc::new(op);
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let start = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let (op, done) = (op.clone(), done.clone());
            tokio::spawn(async move {
                let mut i = 0;
                while Instant::now() < deadline {
                    op(t, i).await;
                    i += 1;
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task");
    }
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

/// The store's claim statement, issued directly.
async fn raw_claim(pool: &sqlx::PgPool, sql: &str, key: &str, token: i64) {
    sqlx::query(AssertSqlSafe(sql))
        .bind(b"bench".as_slice())
        .bind(key.as_bytes())
        .bind([7u8; 32].as_slice())
        .bind(token)
        .bind(30_000i64)
        .bind(true)
        .bind(3_600_000i64)
        .fetch_optional(pool)
        .await
        .expect("claim");
}

/// The store's complete statement, issued directly.
async fn raw_complete(pool: &sqlx::PgPool, sql: &str, key: &str, token: i64, body: Vec<u8>) {
    sqlx::query(AssertSqlSafe(sql))
        .bind(b"bench".as_slice())
        .bind(key.as_bytes())
        .bind(token)
        .bind(body)
        .bind(3_600_000i64)
        .execute(pool)
        .await
        .expect("complete");
}

/// Statements per operation, counted by a proxy on a one-connection pool (so every statement
/// is prepared during the warm-up, as on a pool that has been serving for a while).
struct Counted {
    claim: f64,
    complete: f64,
    replay: f64,
    raw_claim: f64,
    raw_complete: f64,
}

/// `run` keeps this run's keys apart from earlier runs' rows.
async fn count_statements(url: &str, claim_sql: &str, complete_sql: &str, run: u128) -> Counted {
    let options: PgConnectOptions = url.parse().expect("postgres url");
    let upstream = tokio::net::lookup_host((options.get_host(), options.get_port()))
        .await
        .expect("resolve postgres")
        .next()
        .expect("an address");
    let proxy = proxy::Proxy::start(upstream).await;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.host("127.0.0.1").port(proxy.addr.port()))
        .await
        .expect("connect through the proxy");
    let store = PostgresStore::new(pool.clone())
        .with_table("tower_idempotency_ceiling")
        .expect("table");
    let keys: Vec<_> = (0..=COUNTED)
        .map(|i| ScopedKey::new("bench", format!("counted-{run}-{i}")))
        .collect();
    let per_op = |before: u64| (proxy.statements() - before) as f64 / COUNTED as f64;

    // Warm-up: key 0 goes through the store's claim, complete and replay once.
    let (warm, keys) = keys.split_first().expect("keys");
    let Ok(Claim::Acquired(lease)) = store.claim(&claim_request(warm)).await else {
        panic!("claim")
    };
    store
        .complete(warm, lease.token, &response(), Duration::from_secs(3600))
        .await
        .expect("complete");
    let Ok(Claim::Completed { .. }) = store.claim(&claim_request(warm)).await else {
        panic!("replay")
    };
    let mut tokens = Vec::new();
    let before = proxy.statements();
    for key in keys {
        let Ok(Claim::Acquired(lease)) = store.claim(&claim_request(key)).await else {
            panic!("claim")
        };
        tokens.push(lease.token);
    }
    let claim = per_op(before);
    let before = proxy.statements();
    for (key, token) in keys.iter().zip(&tokens) {
        store
            .complete(key, *token, &response(), Duration::from_secs(3600))
            .await
            .expect("complete");
    }
    let complete = per_op(before);
    let before = proxy.statements();
    for key in keys {
        let Ok(Claim::Completed { .. }) = store.claim(&claim_request(key)).await else {
            panic!("replay")
        };
    }
    let replay = per_op(before);

    let encoded = response().to_bytes();
    let raw = |i: u64| (format!("raw-counted-{run}-{i}"), i as i64 + 1);
    let before = proxy.statements();
    for i in 0..COUNTED {
        let (key, token) = raw(i);
        raw_claim(&pool, claim_sql, &key, token).await;
    }
    let claimed_raw = per_op(before);
    let before = proxy.statements();
    for i in 0..COUNTED {
        let (key, token) = raw(i);
        raw_complete(&pool, complete_sql, &key, token, encoded.clone()).await;
    }
    let completed_raw = per_op(before);
    pool.close().await;
    Counted {
        claim,
        complete,
        replay,
        raw_claim: claimed_raw,
        raw_complete: completed_raw,
    }
}

#[tokio::main]
async fn main() {
    let seconds: u64 = std::env::var("BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8);
    let url = std::env::var("TOWER_IDEMPOTENCY_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let pool = match sqlx::postgres::PgPoolOptions::new()
        .max_connections(TASKS as u32)
        .connect(&url)
        .await
    {
        Ok(pool) => pool,
        Err(e) => {
            println!("skipped: PostgreSQL unreachable at {url} ({e})");
            return;
        }
    };
    let store = PostgresStore::new(pool.clone())
        .with_table("tower_idempotency_ceiling")
        .expect("table");
    store.migrate().await.expect("migrate");
    sqlx::query("TRUNCATE tower_idempotency_ceiling")
        .execute(&pool)
        .await
        .expect("truncate");
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let encoded = response().to_bytes();
    let counted = count_statements(
        &url,
        store.claim_statement(),
        store.complete_statement(),
        run,
    )
    .await;
    println!(
        "statements per operation, counted on the wire over {COUNTED} operations each \
         (target: claim 1, complete 1, replay 1):"
    );
    println!(
        "  PostgresStore: claim {:.2}, complete {:.2}, replay {:.2}; raw SQL: claim {:.2}, complete {:.2}",
        counted.claim, counted.complete, counted.replay, counted.raw_claim, counted.raw_complete
    );
    println!(
        "\n{TASKS} concurrent tasks, one pool of {TASKS} connections, {seconds} s each side \
         in {ROUNDS} alternating rounds"
    );
    println!(
        "{:<40} {:>10} {:>12} {:>10}",
        "claim + complete", "ops/s", "statements", "vs raw"
    );

    let (claim_sql, complete_sql) = (
        Arc::<str>::from(store.claim_statement()),
        Arc::<str>::from(store.complete_statement()),
    );
    let raw_op = |phase: usize| {
        let (p, claim_sql, complete_sql, encoded) = (
            pool.clone(),
            claim_sql.clone(),
            complete_sql.clone(),
            encoded.clone(),
        );
        move |t: usize, i: u64| {
            let (p, claim_sql, complete_sql, body) = (
                p.clone(),
                claim_sql.clone(),
                complete_sql.clone(),
                encoded.clone(),
            );
            async move {
                let key = format!("raw-{phase}-{run}-{t}-{i}");
                let token = ((t as i64) << 40) | i as i64;
                raw_claim(&p, &claim_sql, &key, token).await;
                raw_complete(&p, &complete_sql, &key, token, body).await;
            }
        }
    };
    let store_op = |phase: usize| {
        let s = store.clone();
        move |t: usize, i: u64| {
            let s = s.clone();
            async move {
                let key = ScopedKey::new("bench", format!("store-{phase}-{run}-{t}-{i}"));
                let Ok(Claim::Acquired(lease)) = s.claim(&claim_request(&key)).await else {
                    panic!("claim")
                };
                s.complete(&key, lease.token, &response(), Duration::from_secs(3600))
                    .await
                    .expect("complete");
            }
        }
    };
    // Every connection of the pool opened, and both statement sets prepared on it, before
    // either side is measured: otherwise the first run pays for that.
    run_for(1, raw_op(0)).await;
    run_for(1, store_op(0)).await;
    // Then rounds in alternating order, so that neither side always runs on a table (and a
    // write-ahead log) the other has just grown.
    let (mut raw, mut ours) = (0.0, 0.0);
    for round in 1..=ROUNDS {
        let each = (seconds / ROUNDS as u64).max(1);
        if round % 2 == 1 {
            raw += run_for(each, raw_op(round)).await;
            ours += run_for(each, store_op(round)).await;
        } else {
            ours += run_for(each, store_op(round)).await;
            raw += run_for(each, raw_op(round)).await;
        }
    }
    let (raw, ours) = (raw / ROUNDS as f64, ours / ROUNDS as f64);
    println!(
        "{:<40} {:>10.0} {:>12.2} {:>9.2}x",
        "raw SQL through sqlx",
        raw,
        counted.raw_claim + counted.raw_complete,
        1.0
    );
    println!(
        "{:<40} {:>10.0} {:>12.2} {:>9.2}x",
        "PostgresStore",
        ours,
        counted.claim + counted.complete,
        ours / raw
    );
    println!(
        "target: PostgresStore at least 0.85x of raw SQL: {:.2}x, {}",
        ours / raw,
        if ours / raw >= 0.85 { "met" } else { "missed" }
    );
}
