//! Coalescing (issue 21): on a route with `wait_for_in_flight`, how long after the first
//! request's handler returns does each waiting duplicate have its answer, woken by the store
//! against polling (the trait's default, as a store that does not implement
//! `wait_for_change`), in the same run; and how many claims each waiter made. Over loopback
//! HTTP, one axum server per scenario; the first works `WORK_MS`, `WAITERS` duplicates arrive
//! while it runs.
//!
//! `cargo bench -p suite --bench coalescing` (Redis from `TOWER_IDEMPOTENCY_REDIS_URL`,
//! default `redis://127.0.0.1:6379`, PostgreSQL from `TOWER_IDEMPOTENCY_POSTGRES_URL`; their
//! rows are skipped if they are down). `BENCH_ROUNDS`
//! rounds per scenario (default 5).

#[allow(dead_code, unreachable_pub)]
#[path = "../tests/common/faulty.rs"]
mod faulty;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use faulty::Faulty;
use tower_idempotency::store::{PostgresStore, RedisStore};
use tower_idempotency::{IdempotencyLayer, IdempotencyStore, MemoryStore};

const WAITERS: usize = 100;
const WORK_MS: u64 = 300;

async fn serve<St: IdempotencyStore>(
    store: St,
    returned: Arc<Mutex<Option<Instant>>>,
) -> SocketAddr {
    let app = Router::new()
        .route(
            "/refunds",
            post(move || {
                let returned = returned.clone();
                async move {
                    tokio::time::sleep(Duration::from_millis(WORK_MS)).await;
                    *returned.lock().expect("lock") = Some(Instant::now());
                    (StatusCode::CREATED, "refund 1")
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(store)
                .single_tenant()
                .wait_for_in_flight(Duration::from_secs(30)),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// One round: the first, then `WAITERS` duplicates; each duplicate's delay after the first's
/// handler returned, in µs.
async fn round<St: IdempotencyStore + Clone>(store: St, key: &str) -> Vec<u64> {
    let returned = Arc::new(Mutex::new(None));
    let addr = serve(store, returned.clone()).await;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(WAITERS + 1)
        .build()
        .expect("client");
    let send = |client: reqwest::Client| {
        let request = client
            .post(format!("http://{addr}/refunds"))
            .header("idempotency-key", key);
        async move {
            let res = request.send().await.expect("request");
            assert_eq!(res.status(), StatusCode::CREATED);
            let _ = res.bytes().await;
            Instant::now()
        }
    };
    let first = tokio::spawn(send(client.clone()));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let waiters: Vec<_> = (0..WAITERS)
        .map(|_| tokio::spawn(send(client.clone())))
        .collect();
    first.await.expect("first");
    let mut delays = Vec::new();
    for waiter in waiters {
        let answered = waiter.await.expect("waiter");
        let returned = returned.lock().expect("lock").expect("the first returned");
        delays.push(answered.saturating_duration_since(returned).as_micros() as u64);
    }
    delays
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// `rounds` rounds on a store made by `make`, its waiters woken (`wake`) or polling; the
/// delays' p50 and p99 in ms, and claims per waiter.
async fn scenario<St, F>(name: &str, rounds: usize, wake: bool, make: F)
where
    St: IdempotencyStore + Clone,
    F: Fn() -> St,
{
    let mut delays = Vec::new();
    let mut claims = 0usize;
    // A server that has run a while has its change subscription up: open it first.
    let warm = make();
    let now = std::time::SystemTime::now();
    let seen = tower_idempotency::store::InFlight {
        token: tower_idempotency::store::FencingToken::new(1),
        lease_until: now,
        now,
    };
    warm.wait_for_change(
        &tower_idempotency::ScopedKey::new("", "nobody"),
        &seen,
        0,
        Duration::from_millis(1),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    for r in 0..rounds {
        let store = Faulty::new(make());
        store.wake.store(wake, Ordering::SeqCst);
        static ROUND: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = ROUND.fetch_add(1, Ordering::Relaxed);
        let key = format!("coalesce-{n}-{r}-{}", std::process::id());
        delays.extend(round(store.clone(), &key).await);
        claims += store.log().iter().filter(|op| **op == "claim").count() - 1;
    }
    delays.sort_unstable();
    println!(
        "{:<36} {:>9.2} {:>9.2} {:>14.2}",
        name,
        percentile(&delays, 0.5) as f64 / 1000.0,
        percentile(&delays, 0.99) as f64 / 1000.0,
        claims as f64 / (rounds * WAITERS) as f64,
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let rounds: usize = std::env::var("BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    println!(
        "{WAITERS} waiters on a first that works {WORK_MS} ms, {rounds} rounds: the delay from the \
         first's handler returning to each waiter's answer"
    );
    println!(
        "\n{:<36} {:>9} {:>9} {:>14}",
        "scenario", "p50 ms", "p99 ms", "claims/waiter"
    );
    scenario("MemoryStore, woken", rounds, true, MemoryStore::new).await;
    scenario("MemoryStore, polling", rounds, false, MemoryStore::new).await;
    let url = std::env::var("TOWER_IDEMPOTENCY_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    match RedisStore::connect(&url).await {
        Ok(store) => {
            let store = store
                .with_prefix(&format!("bench-coalesce-{}", std::process::id()))
                .expect("prefix");
            // One store for all rounds: its subscription is made once, as in a server.
            let s = store.clone();
            scenario("RedisStore, woken", rounds, true, move || s.clone()).await;
            scenario("RedisStore, polling", rounds, false, move || store.clone()).await;
        }
        Err(e) => println!("{:<36} skipped: Redis unreachable ({e})", "RedisStore"),
    }
    let url = std::env::var("TOWER_IDEMPOTENCY_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    match PostgresStore::connect(&url).await {
        Ok(store) => {
            let store = store
                .with_table("tower_idempotency_bench_coalescing")
                .expect("table");
            store.migrate().await.expect("migrate");
            let s = store.clone();
            scenario("PostgresStore, woken", rounds, true, move || s.clone()).await;
            scenario("PostgresStore, polling", rounds, false, move || {
                store.clone()
            })
            .await;
        }
        Err(e) => println!(
            "{:<36} skipped: PostgreSQL unreachable ({e})",
            "PostgresStore"
        ),
    }
}
