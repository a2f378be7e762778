//! The PostgreSQL store against its own ceiling: claim + complete through `PostgresStore`, and
//! the same two SQL statements issued directly through sqlx, on one pool with the same
//! concurrency, in the same run.
//!
//! `cargo bench --all-features --bench store` (`TOWER_IDEMPOTENCY_POSTGRES_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`; `BENCH_SECONDS`, default 5)

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use sqlx::AssertSqlSafe;
use tower_idempotency::IdempotencyStore;
use tower_idempotency::store::{
    Claim, ClaimRequest, Fingerprint, LeaseExpiry, PostgresStore, ScopedKey, StoredResponse,
};

const TASKS: usize = 32;

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

#[tokio::main]
async fn main() {
    let seconds = std::env::var("BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
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
        .with_table("public", "tower_idempotency_ceiling")
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
    println!("{TASKS} concurrent tasks, one pool of {TASKS} connections, {seconds} s each");
    println!(
        "\n{:<40} {:>10} {:>12} {:>10}",
        "claim + complete", "ops/s", "statements", "vs raw"
    );

    let (p, claim_sql, complete_sql) = (
        pool.clone(),
        Arc::<str>::from(store.claim_statement()),
        Arc::<str>::from(store.complete_statement()),
    );
    let raw = run_for(seconds, move |t, i| {
        let (p, claim_sql, complete_sql, body) = (
            p.clone(),
            claim_sql.clone(),
            complete_sql.clone(),
            encoded.clone(),
        );
        async move {
            let key = format!("raw-{run}-{t}-{i}");
            let token = ((t as i64) << 40) | i as i64;
            sqlx::query(AssertSqlSafe(claim_sql))
                .bind(b"bench".as_slice())
                .bind(key.as_bytes())
                .bind([7u8; 32].as_slice())
                .bind(token)
                .bind(30_000i64)
                .bind(true)
                .bind(3_600_000i64)
                .fetch_optional(&p)
                .await
                .expect("claim");
            sqlx::query(AssertSqlSafe(complete_sql))
                .bind(b"bench".as_slice())
                .bind(key.as_bytes())
                .bind(token)
                .bind(body)
                .bind(3_600_000i64)
                .execute(&p)
                .await
                .expect("complete");
        }
    })
    .await;
    println!(
        "{:<40} {:>10.0} {:>12} {:>9.2}x",
        "raw SQL through sqlx", raw, 2, 1.0
    );

    let s = store.clone();
    let ours = run_for(seconds, move |t, i| {
        let s = s.clone();
        async move {
            let key = ScopedKey::new("bench", format!("store-{run}-{t}-{i}"));
            let claim = ClaimRequest {
                key: key.clone(),
                fingerprint: Fingerprint::from_bytes([7; 32]),
                lease: Duration::from_secs(30),
                ttl: Duration::from_secs(3600),
                on_lease_expiry: LeaseExpiry::Reclaim,
            };
            let Ok(Claim::Acquired(lease)) = s.claim(&claim).await else {
                panic!("claim")
            };
            s.complete(&key, lease.token, &response(), Duration::from_secs(3600))
                .await
                .expect("complete");
        }
    })
    .await;
    println!(
        "{:<40} {:>10.0} {:>12} {:>9.2}x",
        "PostgresStore",
        ours,
        2,
        ours / raw
    );
}
