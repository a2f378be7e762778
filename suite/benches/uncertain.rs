//! Listing the records that await reconciliation costs the page, not the store (issue 18 §5;
//! before, MemoryStore decoded every uncertain record on every listing: 381 ms at 200 000).
//! A page of 100 is listed from stores holding 1 000 and 200 000 uncertain records (and as
//! many settled ones), and the two are compared in the same run: about 1x means O(page).
//! Counting them all is O(count), reported beside it.
//!
//! `cargo bench -p suite --bench uncertain` (`BENCH_RECORDS` sets the larger count)

use std::time::{Duration, Instant};

use tower_idempotency::store::{Claim, ClaimRequest, Fingerprint, ScopedKey, UncertainQuery};
use tower_idempotency::{IdempotencyStore, LeaseExpiry, MemoryStore};

const PAGE: usize = 100;
const LONG: Duration = Duration::from_secs(3600);

async fn store_with(uncertain: usize) -> MemoryStore {
    let store = MemoryStore::new();
    for i in 0..uncertain * 2 {
        let request = ClaimRequest {
            key: ScopedKey::new("bench", format!("key-{i}")),
            fingerprint: Fingerprint::from_bytes([1; 32]),
            lease: LONG,
            ttl: LONG,
            on_lease_expiry: LeaseExpiry::Reclaim,
        };
        let Ok(Claim::Acquired(lease)) = store.claim(&request).await else {
            panic!("a fresh key is acquired");
        };
        // Half await reconciliation, half are settled: only the first half is listed.
        if i % 2 == 0 {
            store
                .mark_uncertain(&request.key, lease.token)
                .await
                .expect("mark");
        } else {
            store
                .release(&request.key, lease.token)
                .await
                .expect("release");
        }
    }
    store
}

/// Microseconds per call of `f`, over enough calls to take about half a second.
async fn per_call<F, Fut>(mut f: F) -> f64
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    f().await;
    let mut calls = 1u32;
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(500) {
        f().await;
        calls += 1;
    }
    started.elapsed().as_secs_f64() * 1e6 / f64::from(calls)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let large: usize = std::env::var("BENCH_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    println!("uncertain records: listing a page of {PAGE}, and counting them all (MemoryStore)");
    println!(
        "{:>12} {:>14} {:>14} {:>16}",
        "uncertain", "first page", "a later page", "count them all"
    );
    let mut pages = Vec::new();
    for n in [1_000, large] {
        let store = store_with(n).await;
        let first = per_call(|| async {
            let page = store
                .list_uncertain(&UncertainQuery::first(PAGE))
                .await
                .expect("list");
            assert_eq!(page.records.len(), PAGE);
        })
        .await;
        let middle = store
            .list_uncertain(&UncertainQuery::first(n / 2))
            .await
            .expect("list")
            .next
            .expect("more");
        let later = per_call(|| async {
            let page = store
                .list_uncertain(&UncertainQuery::after(middle.clone(), PAGE))
                .await
                .expect("list");
            assert_eq!(page.records.len(), PAGE);
        })
        .await;
        let count = per_call(|| async {
            let count = store.count_uncertain().await.expect("count");
            assert_eq!(count.count, n as u64);
        })
        .await;
        println!("{n:>12} {first:>12.1}µs {later:>12.1}µs {count:>14.1}µs");
        pages.push((first, later));
    }
    let (small, big) = (pages[0], pages[1]);
    println!(
        "\n{large} against 1 000 records: first page {:.2}x, later page {:.2}x (1x: the cost is the page's)",
        big.0 / small.0,
        big.1 / small.1
    );
}
