//! RedisStore against its own ceiling: claim + complete through `RedisStore`, and the same two
//! Lua scripts invoked directly through redis-rs (`Script::invoke_async` on a
//! `ConnectionManager`, as the store uses), with the same concurrency, in alternating rounds of
//! one run. Round trips per operation are counted on the server (`INFO commandstats`: calls
//! of EVALSHA and EVAL), not assumed. Then the cost of `with_wait(0, …)`: a won claim asked
//! again with its `WAIT` (a second round trip), and a completion sent with its `WAIT`, on the
//! store's waiting connections (lent to one write at a time, so 32 tasks queue for them): four,
//! the default, and sixteen.
//!
//! `cargo bench -p suite --bench redis` (`TOWER_IDEMPOTENCY_REDIS_URL`, default
//! `redis://127.0.0.1:6379`; `BENCH_SECONDS` per round, default 2)

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use tower_idempotency::IdempotencyStore;
use tower_idempotency::store::{
    Claim, ClaimRequest, Fingerprint, LeaseExpiry, RedisStore, ScopedKey, StoredResponse,
};

const TASKS: usize = 32;
const ROUNDS: usize = 4;
const COUNTED: u64 = 200;

fn response() -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: HeaderMap::new(),
        body: Some(Bytes::from_static(
            br#"{"ticket":1,"title":"printer on fire"}"#,
        )),
        trailers: None,
    }
}

fn claim_request(key: &ScopedKey) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        fingerprint: Fingerprint::from_bytes([7; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(60),
        on_lease_expiry: LeaseExpiry::Reclaim,
    }
}

/// One claim + complete through the store.
async fn through_store(store: &RedisStore, key: &ScopedKey) {
    let Claim::Acquired(lease) = store.claim(&claim_request(key)).await.expect("claim") else {
        panic!("a fresh key");
    };
    store
        .complete(key, lease.token, &response(), Duration::from_secs(60))
        .await
        .expect("complete");
}

/// The same two scripts, invoked raw.
struct Raw {
    connection: redis::aio::ConnectionManager,
    claim: redis::Script,
    complete: redis::Script,
    store: RedisStore,
    response: Vec<u8>,
}

impl Raw {
    async fn once(&self, key: &ScopedKey, token: u64) {
        let [record, uncertain, pending, member] = self.store.keys(key);
        let mut connection = self.connection.clone();
        let token = token.to_string();
        let _: redis::Value = self
            .claim
            .key(&record[..])
            .key(&uncertain[..])
            .key(&pending[..])
            .arg(&member[..])
            .arg(&[7u8; 32][..])
            .arg(&token)
            .arg("30000")
            .arg("60000")
            .arg("1")
            .arg(key.scope())
            .arg(key.key())
            .invoke_async(&mut connection)
            .await
            .expect("claim");
        let written: i64 = self
            .complete
            .key(&record[..])
            .key(&uncertain[..])
            .key(&pending[..])
            .arg(&member[..])
            .arg(&token)
            .arg(&self.response[..])
            .arg("60000")
            .invoke_async(&mut connection)
            .await
            .expect("complete");
        assert_eq!(written, 1);
    }
}

/// Operations per second over `seconds` with `TASKS` tasks, each op on a fresh key.
async fn run<F, Fut>(seconds: f64, run_id: &str, op: F) -> f64
where
    F: Fn(ScopedKey, u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let (done, op, run_id) = (done.clone(), op.clone(), run_id.to_owned());
            tokio::spawn(async move {
                let mut i = 0u64;
                while Instant::now() < deadline {
                    let key = ScopedKey::new("", format!("{run_id}-{t}-{i}"));
                    op(key, (t as u64) << 40 | i).await;
                    done.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task");
    }
    done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

/// Calls of EVALSHA and EVAL the server has counted.
async fn script_calls(connection: &mut redis::aio::ConnectionManager) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(connection)
        .await
        .expect("INFO");
    info.lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let url = std::env::var("TOWER_IDEMPOTENCY_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let seconds: f64 = std::env::var("BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.0);
    let run_id = format!(
        "bench-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    let store = match RedisStore::connect(&url).await {
        Ok(store) => store.with_prefix(&run_id).expect("prefix"),
        Err(e) => {
            println!("skipped: Redis at {url} unreachable ({e})");
            return;
        }
    };
    let client = redis::Client::open(url.as_str()).expect("url");
    let mut connection = redis::aio::ConnectionManager::new(client)
        .await
        .expect("connect");
    let raw = Arc::new(Raw {
        connection: connection.clone(),
        claim: redis::Script::new(store.claim_script()),
        complete: redis::Script::new(store.complete_script()),
        store: store.clone(),
        response: response().to_bytes(),
    });

    // Round trips, counted on the server (after one warm-up op that loads the scripts).
    let warm = ScopedKey::new("", format!("{run_id}-warm"));
    through_store(&store, &warm).await;
    raw.once(&ScopedKey::new("", format!("{run_id}-warm-raw")), 1)
        .await;
    let before = script_calls(&mut connection).await;
    for i in 0..COUNTED {
        through_store(&store, &ScopedKey::new("", format!("{run_id}-counted-{i}"))).await;
    }
    let calls = script_calls(&mut connection).await - before;
    println!(
        "round trips: {calls} script calls for {COUNTED} claims + {COUNTED} completes ({:.2} per operation)",
        calls as f64 / (2 * COUNTED) as f64
    );

    println!(
        "\n{TASKS} tasks, claim + complete on fresh keys, {ROUNDS} rounds of {seconds} s per side:"
    );
    let (mut via_store, mut via_raw) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let s = store.clone();
        let store_op = move |key: ScopedKey, _: u64| {
            let s = s.clone();
            async move { through_store(&s, &key).await }
        };
        let r = raw.clone();
        let raw_op = move |key: ScopedKey, token: u64| {
            let r = r.clone();
            async move { r.once(&key, token).await }
        };
        // Alternating order: whichever runs first in a round does not always get the warm cache.
        if round % 2 == 0 {
            via_store.push(run(seconds, &format!("{run_id}-s{round}"), store_op).await);
            via_raw.push(run(seconds, &format!("{run_id}-r{round}"), raw_op).await);
        } else {
            via_raw.push(run(seconds, &format!("{run_id}-r{round}"), raw_op).await);
            via_store.push(run(seconds, &format!("{run_id}-s{round}"), store_op).await);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (s, r) = (median(&mut via_store), median(&mut via_raw));
    println!("{:<44} {:>10.0} ops/s", "RedisStore claim + complete", s);
    println!("{:<44} {:>10.0} ops/s", "the same scripts, raw", r);
    println!("{:<44} {:>10.2}x (target >= 0.85x)", "store / raw", s / r);

    for connections in [4, 16] {
        let waiting = store
            .clone()
            .with_wait(0, Duration::from_millis(100))
            .with_waiting_connections(connections);
        let w = run(
            seconds,
            &format!("{run_id}-w{connections}"),
            move |key: ScopedKey, _| {
                let s = waiting.clone();
                async move { through_store(&s, &key).await }
            },
        )
        .await;
        println!(
            "{:<44} {:>10.0} ops/s ({:.2}x of without)",
            format!("with_wait(0, 100 ms), {connections} waiting conns"),
            w,
            w / s
        );
    }
}
