//! Review of b12ee55 (MemoryStore: a full store also makes room of records that expired
//! within the tick under way). A model of what is live (expires_at > now) drives random
//! sequences on a controlled clock at every millisecond offset from the store's base: a new
//! key is refused exactly when live records fill the store, a live record always replays,
//! expired records are purged by later purges; the clock steps back; many threads at once.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use tower_idempotency::IdempotencyStore;
use tower_idempotency::store::{
    Claim, ClaimRequest, Fingerprint, LeaseExpiry, MemoryStore, ScopedKey, StoreError,
    StoredResponse,
};

const TICK: u64 = 16;

fn req(name: &str, ttl_ms: u64) -> ClaimRequest {
    ClaimRequest {
        key: ScopedKey::new("t", name),
        fingerprint: Fingerprint::from_bytes([1; 32]),
        lease: Duration::from_millis(1),
        ttl: Duration::from_millis(ttl_ms),
        on_lease_expiry: LeaseExpiry::Reclaim,
    }
}

fn response() -> StoredResponse {
    StoredResponse {
        status: http::StatusCode::OK,
        headers: http::HeaderMap::new(),
        body: Some(bytes::Bytes::from_static(b"done")),
        trailers: None,
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

fn clocked(start_ms: u64) -> (MemoryStore, Arc<AtomicU64>) {
    let offset = Arc::new(AtomicU64::new(0));
    let clock = offset.clone();
    let start = SystemTime::UNIX_EPOCH + Duration::from_millis(1_800_000_000_000 + start_ms);
    let store = MemoryStore::with_clock(move || {
        start + Duration::from_millis(clock.load(Ordering::SeqCst))
    });
    (store, offset)
}

/// Claims and completes `name` with `ttl` at the clock's time; what the claim answered.
async fn put(store: &MemoryStore, name: &str, ttl: u64) -> Result<Claim, StoreError> {
    let r = req(name, ttl);
    let out = store.claim(&r).await;
    if let Ok(Claim::Acquired(lease)) = &out {
        store
            .complete(&r.key, lease.token, &response(), r.ttl)
            .await
            .expect("complete");
    }
    out
}

/// Random sequences against the model, at every start offset within a tick and several
/// capacities: new keys Acquired iff fewer live records than the cap; every live record
/// replays; after a purge, records expired two ticks ago are gone and live ones kept.
#[tokio::test]
async fn review_full_store_refuses_exactly_when_live_records_fill_it() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for start_ms in 0..TICK {
        for cap in [1usize, 2, 3, 5, 8] {
            let (store, clock) = clocked(start_ms);
            let store = store.max_records(cap);
            let mut model: HashMap<String, u64> = HashMap::new();
            let mut now = 0u64;
            for step in 0..120 {
                now += rng.next(12);
                // Sometimes step exactly onto an expiry.
                if rng.next(4) == 0
                    && let Some(&exp) = model.values().filter(|&&e| e > now).min()
                {
                    now = exp;
                }
                clock.store(now, Ordering::SeqCst);
                let live = model.values().filter(|&&e| e > now).count();
                let name = format!("k{step}");
                let ttl = 1 + rng.next(40);
                let tag = format!("start {start_ms} cap {cap} step {step} now {now} live {live}");
                let got = put(&store, &name, ttl).await;
                if live < cap {
                    assert!(
                        matches!(got, Ok(Claim::Acquired(_))),
                        "{tag}: room (expired records must make it), got {got:?}; model {model:?}"
                    );
                    model.insert(name, now + ttl);
                } else {
                    assert!(
                        matches!(got, Err(StoreError::Full)),
                        "{tag}: live records fill the store, got {got:?}"
                    );
                }
                // Every live record still replays (never removed early).
                for (k, &exp) in &model {
                    if exp > now {
                        let got = store.claim(&req(k, 60_000)).await;
                        assert!(
                            matches!(got, Ok(Claim::Completed { .. })),
                            "{tag}: live {k} (expires {exp}) replays, got {got:?}"
                        );
                    }
                }
                if rng.next(5) == 0 {
                    store.purge_expired().await.expect("purge");
                    let live = model.values().filter(|&&e| e > now).count();
                    let recent = model
                        .values()
                        .filter(|&&e| e <= now && e + 2 * TICK > now)
                        .count();
                    let len = store.len();
                    assert!(
                        len >= live && len <= live + recent,
                        "{tag}: after a purge {len} records, {live} live, {recent} recently expired"
                    );
                }
            }
            // Everything expires: a purge far later leaves nothing.
            clock.store(now + 10 * TICK + 100, Ordering::SeqCst);
            store.purge_expired().await.expect("purge");
            assert_eq!(
                store.len(),
                0,
                "start {start_ms} cap {cap}: all purged at last"
            );
        }
    }
}

/// Many records in one tick, half expired at `now` (inside the tick under way), half a
/// millisecond from expiry: a full store makes room of exactly the expired half, keeps the
/// others (they replay), and a later purge still finds those kept once they expire.
#[tokio::test]
async fn review_many_records_in_one_tick() {
    for start_ms in 0..TICK {
        for at in 1..TICK {
            let (store, clock) = clocked(start_ms);
            let n = 40;
            let store = store.max_records(n);
            // Records expiring at 16k + j for j in 0..n/2 at `at` and at+1, same tick mostly.
            for i in 0..n {
                let ttl = 2 * TICK + at + (i % 2) as u64;
                assert!(matches!(
                    put(&store, &format!("r{i}"), ttl).await,
                    Ok(Claim::Acquired(_))
                ));
            }
            let now = 2 * TICK + at;
            clock.store(now, Ordering::SeqCst);
            let tag = format!("start {start_ms} at {at}");
            let mut acquired = 0;
            for j in 0..n {
                match put(&store, &format!("new{j}"), 60_000).await {
                    Ok(Claim::Acquired(_)) => acquired += 1,
                    Err(StoreError::Full) => {}
                    other => panic!("{tag}: {other:?}"),
                }
            }
            assert_eq!(
                acquired,
                n / 2,
                "{tag}: exactly the expired half makes room"
            );
            for i in (1..n).step_by(2) {
                let got = store.claim(&req(&format!("r{i}"), 60_000)).await;
                assert!(
                    matches!(got, Ok(Claim::Completed { .. })),
                    "{tag}: r{i} expires 1 ms later and replays, got {got:?}"
                );
            }
            clock.store(now + 1 + 2 * TICK, Ordering::SeqCst);
            store.purge_expired().await.expect("purge");
            assert_eq!(
                store.len(),
                n / 2,
                "{tag}: the kept ones purged once expired"
            );
        }
    }
}

/// The clock steps back after a full store's sweep: nothing live at the earlier time is lost,
/// and records the sweep kept are purged once the clock passes them again.
#[tokio::test]
async fn review_clock_steps_back() {
    for at in 1..TICK {
        let (store, clock) = clocked(at);
        let store = store.max_records(3);
        put(&store, "a", 20 + at).await.expect("a");
        put(&store, "b", 21 + at).await.expect("b");
        put(&store, "c", 40).await.expect("c");
        clock.store(20 + at, Ordering::SeqCst);
        assert!(
            matches!(put(&store, "n1", 60_000).await, Ok(Claim::Acquired(_))),
            "at {at}: a makes room"
        );
        // Back in time, before b's and c's expiry; b still replays.
        clock.store(10, Ordering::SeqCst);
        for k in ["b", "c"] {
            let got = store.claim(&req(k, 60_000)).await;
            assert!(
                matches!(got, Ok(Claim::Completed { .. })),
                "at {at}: {k} replays after a step back, got {got:?}"
            );
        }
        assert!(
            matches!(put(&store, "n2", 60_000).await, Err(StoreError::Full)),
            "at {at}: full of live records"
        );
        // Forward past b: room again; past c too.
        clock.store(21 + at, Ordering::SeqCst);
        assert!(
            matches!(put(&store, "n2", 60_000).await, Ok(Claim::Acquired(_))),
            "at {at}: b makes room"
        );
        clock.store(40, Ordering::SeqCst);
        assert!(
            matches!(put(&store, "n3", 60_000).await, Ok(Claim::Acquired(_))),
            "at {at}: c makes room"
        );
        clock.store(200, Ordering::SeqCst);
        store.purge_expired().await.expect("purge");
        assert_eq!(store.len(), 3, "at {at}: n1, n2, n3 remain");
    }
}

/// Many threads claiming new keys at once on a full store whose records half expired within
/// the tick under way: exactly as many win as there was room, the live ones all replay.
#[test]
fn review_many_threads_on_a_full_store() {
    for at in 1..TICK {
        let (store, clock) = clocked(at);
        let n = 16;
        let store = store.max_records(n);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("rt");
        for i in 0..n {
            let ttl = TICK + at + (i % 2) as u64;
            rt.block_on(put(&store, &format!("r{i}"), ttl))
                .expect("fill");
        }
        clock.store(TICK + at, Ordering::SeqCst);
        let barrier = Arc::new(std::sync::Barrier::new(32));
        let threads: Vec<_> = (0..32)
            .map(|t| {
                let (store, barrier) = (store.clone(), barrier.clone());
                std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .build()
                        .expect("rt");
                    barrier.wait();
                    rt.block_on(put(&store, &format!("t{t}"), 60_000))
                })
            })
            .collect();
        let answers: Vec<_> = threads
            .into_iter()
            .map(|t| t.join().expect("thread"))
            .collect();
        let won = crate::common::memory::acquired_or_full(&answers, &format!("at {at}"));
        assert_eq!(won, n / 2, "at {at}: the expired half makes room, no more");
        for i in (1..n).step_by(2) {
            let got = rt.block_on(store.claim(&req(&format!("r{i}"), 60_000)));
            assert!(
                matches!(got, Ok(Claim::Completed { .. })),
                "at {at}: r{i} kept, got {got:?}"
            );
        }
    }
}
