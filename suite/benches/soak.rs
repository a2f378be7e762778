//! Many keys, one machine (issue 23 §5): unique keys through a MemoryStore with a short TTL and
//! the sweeper running, each a claim and a completed 200 B response. Reports resident memory
//! sampled as the keys go through (flat once the first TTL has passed: the store holds about a
//! TTL's worth of keys), and the latency of each key's claim + complete, per phase: first a
//! phase in which nothing expires (no purging), then the soak, in which expired records are
//! purged all along. Purging must not add latency spikes: the p99.9 of the soak's second half
//! (the store no longer grows) is held against the p99.9 of the phase that purges nothing
//! (`BENCH_SWEEPER=0` leaves the purging to the claims alone).
//!
//! `cargo bench -p suite --bench soak` (`BENCH_KEYS`, default 10 000 000; `BENCH_TTL_MS`,
//! default 1 000).

#[path = "support/rss.rs"]
mod rss;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use rss::rss_kib;
use tower_idempotency::reconcile::{Reconciler, Reconciliation, Sweeper};
use tower_idempotency::store::{
    Claim, ClaimRequest, Fingerprint, LeaseExpiry, Record, ScopedKey, StoredResponse,
};
use tower_idempotency::{IdempotencyStore, MemoryStore};

/// Nothing here is ever uncertain: the sweeper only purges.
struct Nothing;

impl Reconciler for Nothing {
    async fn reconcile(&self, _: &Record) -> Reconciliation {
        Reconciliation::Unknown
    }
}

/// Runs `keys` unique keys (numbered from `first`) through `store`; the nanoseconds each
/// claim + complete took, and resident memory every `sample` keys.
async fn run(
    store: &MemoryStore,
    first: u64,
    keys: u64,
    ttl: Duration,
    sample: u64,
) -> (Vec<u32>, Vec<(u64, Duration, u64)>) {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    let body = Bytes::from(vec![b'x'; 200]);
    // Written through before the first sample: four bytes a key that would otherwise become
    // resident as the soak goes, and read as the store's growth (4 MiB a million keys).
    let mut took = vec![u32::MAX; keys as usize];
    let mut rss = Vec::new();
    let started = Instant::now();
    for i in first..first + keys {
        let key = ScopedKey::new("tenant-a", format!("8e03978e-40d5-43e8-bc93-{i:012}"));
        let request = ClaimRequest {
            key: key.clone(),
            fingerprint: Fingerprint::from_bytes([7; 32]),
            lease: Duration::from_secs(30),
            ttl,
            on_lease_expiry: LeaseExpiry::Reclaim,
        };
        let response = StoredResponse {
            status: StatusCode::CREATED,
            headers: headers.clone(),
            body: Some(Bytes::copy_from_slice(&body)),
            trailers: None,
        };
        let t = Instant::now();
        let Ok(Claim::Acquired(lease)) = store.claim(&request).await else {
            panic!("claim {i}: the store is full or the key exists")
        };
        store
            .complete(&key, lease.token, &response, ttl)
            .await
            .expect("complete");
        took[(i - first) as usize] = u32::try_from(t.elapsed().as_nanos()).unwrap_or(u32::MAX);
        if (i - first + 1).is_multiple_of(sample) {
            rss.push((i - first + 1, started.elapsed(), rss_kib()));
        }
    }
    (took, rss)
}

fn percentile(sorted: &[u32], p: f64) -> u32 {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

fn main() {
    let keys: u64 = std::env::var("BENCH_KEYS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000_000);
    let ttl = Duration::from_millis(
        std::env::var("BENCH_TTL_MS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1_000),
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    println!("{keys} unique keys through a MemoryStore, TTL {ttl:?}, the sweeper every 250 ms");
    let store = MemoryStore::new()
        .max_records(usize::MAX)
        .max_bytes(usize::MAX);
    let outcome = runtime.block_on(async {
        // `BENCH_SWEEPER=0`: the claims' own sweeping alone.
        let sweeper = (std::env::var("BENCH_SWEEPER").as_deref() != Ok("0")).then(|| {
            Sweeper::new(store.clone(), Nothing)
                .interval(Duration::from_millis(250))
                .spawn()
        });
        // No purging: the keys of this phase outlive the run, and the store holds no more
        // than the soak will.
        let quiet = (keys / 10).max(1);
        let (calm, _) = run(&store, 0, quiet, Duration::from_secs(3600), quiet).await;
        let quiet_len = store.len();
        let (soak, rss) = run(&store, quiet, keys, ttl, (keys / 40).max(1)).await;
        if let Some(sweeper) = sweeper {
            sweeper.abort();
        }
        (calm, quiet_len, soak, rss)
    });
    let (mut calm, quiet_len, mut soak, rss) = outcome;
    // The soak's second half: the store no longer grows, so what remains of the tail is
    // purging's (and the host's).
    let mut steady = soak[soak.len() / 2..].to_vec();
    calm.sort_unstable();
    soak.sort_unstable();
    steady.sort_unstable();
    let p99 = percentile(&soak, 0.99);
    let spikes = |sorted: &[u32]| {
        let over = sorted.len() - sorted.partition_point(|&ns| ns <= 5 * p99);
        over as f64 * 1e6 / sorted.len().max(1) as f64
    };
    println!(
        "\n{:<34} {:>10} {:>10} {:>10} {:>10} {:>12} {:>22}",
        "claim + complete", "keys", "p50", "p99", "p99.9", "max", "over 5x soak p99 / M"
    );
    for (name, sorted) in [
        ("no purging (TTL 1 h)", &calm),
        ("soak (purging)", &soak),
        ("soak, second half (steady)", &steady),
    ] {
        println!(
            "{name:<34} {:>10} {:>8.2}µs {:>8.2}µs {:>8.2}µs {:>10.0}µs {:>22.1}",
            sorted.len(),
            f64::from(percentile(sorted, 0.5)) / 1e3,
            f64::from(percentile(sorted, 0.99)) / 1e3,
            f64::from(percentile(sorted, 0.999)) / 1e3,
            f64::from(*sorted.last().unwrap_or(&0)) / 1e3,
            spikes(sorted)
        );
    }
    println!(
        "\nresident memory as the soak's keys go through (records held {quiet_len} before it):"
    );
    for (done, at, kib) in &rss {
        println!(
            "  {done:>10} keys  {:>7.2} s  {:>8.1} MiB",
            at.as_secs_f64(),
            *kib as f64 / 1024.0
        );
    }
    // Flat after the first TTL (and a sweeper interval): what remains is a TTL's worth.
    let settled: Vec<u64> = rss
        .iter()
        .filter(|(_, at, _)| *at > ttl * 2)
        .map(|(_, _, kib)| *kib)
        .collect();
    let (lo, hi) = (
        settled.iter().min().copied().unwrap_or(0),
        settled.iter().max().copied().unwrap_or(0),
    );
    let flat = hi as f64 / lo.max(1) as f64;
    // Spikes from purging: the steady half's tail against the tail of the phase that purges
    // nothing (the host's and the allocator's own); the target holds while purging adds at
    // most half again to its p99.9.
    let (steady_tail, calm_tail) = (percentile(&steady, 0.999), percentile(&calm, 0.999));
    let tail_ratio = f64::from(steady_tail) / f64::from(calm_tail.max(1));
    println!(
        "\ntarget: resident memory flat within 10% after the first TTL: {:.3}x ({} samples) {}",
        flat,
        settled.len(),
        if settled.len() >= 2 && flat <= 1.10 {
            "met"
        } else {
            "NOT met"
        }
    );
    println!(
        "target: no spikes from purging: p99.9 {:.0} µs purging against {:.0} µs without: {:.2}x \
         (at most 1.5x asked) {}",
        f64::from(steady_tail) / 1e3,
        f64::from(calm_tail) / 1e3,
        tail_ratio,
        if tail_ratio <= 1.5 { "met" } else { "NOT met" }
    );
}
