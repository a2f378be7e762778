//! The memory store against what it must keep true whatever happens to it: purging removes
//! exactly what expired, the byte and record counts stay exact, and a history only grows.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use proptest::prelude::*;

use super::super::{Fingerprint, HistoryEntry, LeaseExpiry};
use super::*;

#[derive(Debug, Clone)]
enum Op {
    Claim {
        key: u8,
        fingerprint: u8,
        lease_ms: u64,
        ttl_ms: u64,
        reconcile: bool,
    },
    Complete {
        key: u8,
        ttl_ms: u64,
    },
    Release(u8),
    Uncertain(u8),
    Renew(u8),
    Started(u8),
    DownstreamId(u8),
    Refused(u8),
    Resolve {
        key: u8,
        applied: bool,
    },
    Remove(u8),
    Advance(u64),
    StepBack(u64),
    Purge,
}

fn op() -> impl Strategy<Value = Op> {
    let key = 0u8..12;
    prop_oneof![
        4 => (key.clone(), 0u8..2, 1u64..400, 0u64..2500, any::<bool>()).prop_map(
            |(key, fingerprint, lease_ms, ttl_ms, reconcile)| Op::Claim {
                key,
                fingerprint,
                lease_ms,
                ttl_ms,
                reconcile
            }
        ),
        3 => (key.clone(), 0u64..2500).prop_map(|(key, ttl_ms)| Op::Complete { key, ttl_ms }),
        1 => key.clone().prop_map(Op::Release),
        1 => key.clone().prop_map(Op::Uncertain),
        1 => key.clone().prop_map(Op::Renew),
        1 => key.clone().prop_map(Op::Started),
        1 => key.clone().prop_map(Op::DownstreamId),
        1 => key.clone().prop_map(Op::Refused),
        1 => (key.clone(), any::<bool>()).prop_map(|(key, applied)| Op::Resolve { key, applied }),
        1 => key.prop_map(Op::Remove),
        3 => (0u64..1200).prop_map(Op::Advance),
        1 => (0u64..300).prop_map(Op::StepBack),
        2 => Just(Op::Purge),
    ]
}

fn response() -> StoredResponse {
    StoredResponse {
        status: http::StatusCode::CREATED,
        headers: http::HeaderMap::new(),
        body: Some(bytes::Bytes::from_static(b"{\"id\":1}")),
        trailers: None,
    }
}

/// Runs `ops` on a store whose clock the test moves (also backwards, past the store's start),
/// checking after each that every history only grew by entries dated now and signed by the
/// record's current token and attempt, and after each purge that what the store holds is
/// exactly what a lookup still finds.
async fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    let offset = Arc::new(AtomicU64::new(1_000_000));
    let clock = offset.clone();
    // The clock starts 1000 s in; stepping back goes below where it started.
    let store = MemoryStore::with_clock(move || {
        start + Duration::from_millis(clock.load(Ordering::SeqCst)) - Duration::from_secs(1000)
    });
    let now_ms = || ms(start) + offset.load(Ordering::SeqCst) - 1_000_000;
    let key = |k: u8| ScopedKey::new(format!("tenant-{}", k % 3), format!("key-{k}"));
    let mut tokens: HashMap<u8, FencingToken> = HashMap::new();
    let mut seen: HashMap<u8, Vec<HistoryEntry>> = HashMap::new();
    for op in ops {
        match op.clone() {
            Op::Claim {
                key: k,
                fingerprint,
                lease_ms,
                ttl_ms,
                reconcile,
            } => {
                let request = ClaimRequest {
                    key: key(k),
                    fingerprint: Fingerprint::from_bytes([fingerprint; 32]),
                    lease: Duration::from_millis(lease_ms),
                    ttl: Duration::from_millis(ttl_ms),
                    on_lease_expiry: match reconcile {
                        true => LeaseExpiry::Reconcile,
                        false => LeaseExpiry::Reclaim,
                    },
                };
                // Half the claims are made at once: both ways keep every invariant.
                let claimed = match fingerprint % 2 {
                    0 => store
                        .claim_now(&request)
                        .expect("a memory store claims at once"),
                    _ => store.claim(&request).await,
                };
                if let Ok(Claim::Acquired(lease)) = claimed {
                    tokens.insert(k, lease.token);
                }
            }
            Op::Complete { key: k, ttl_ms } => {
                if let Some(&token) = tokens.get(&k) {
                    let _ = store
                        .complete(&key(k), token, &response(), Duration::from_millis(ttl_ms))
                        .await;
                }
            }
            Op::Release(k) => {
                if let Some(&token) = tokens.get(&k) {
                    let _ = store.release(&key(k), token).await;
                }
            }
            Op::Uncertain(k) => {
                if let Some(&token) = tokens.get(&k) {
                    let _ = store.mark_uncertain(&key(k), token).await;
                }
            }
            Op::Renew(k) => {
                if let Some(&token) = tokens.get(&k) {
                    let _ = store
                        .renew(&key(k), token, Duration::from_millis(300))
                        .await;
                }
            }
            Op::Started(k) => {
                if let Some(&token) = tokens.get(&k) {
                    let _ = store
                        .record_milestone(&key(k), token, &Milestone::EffectStarted)
                        .await;
                }
            }
            Op::DownstreamId(k) => {
                if let Some(&token) = tokens.get(&k) {
                    let id = Milestone::DownstreamId(format!("ch_{k}"));
                    let _ = store.record_milestone(&key(k), token, &id).await;
                }
            }
            Op::Refused(k) => {
                store
                    .append_history(&key(k), HistoryEvent::Conflict)
                    .await
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            Op::Resolve { key: k, applied } => {
                if let Ok(Some(record)) = store.lookup(&key(k)).await {
                    let resolution = match applied {
                        true => Resolution::Applied(Box::new(response())),
                        false => Resolution::NotApplied,
                    };
                    let _ = store
                        .resolve(
                            &key(k),
                            record.lease_token,
                            &resolution,
                            Duration::from_millis(900),
                            Some("checked"),
                        )
                        .await;
                }
            }
            Op::Remove(k) => {
                store
                    .remove(&key(k))
                    .await
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            Op::Advance(ms) => {
                offset.fetch_add(ms, Ordering::SeqCst);
            }
            Op::StepBack(ms) => {
                offset.fetch_sub(ms, Ordering::SeqCst);
            }
            Op::Purge => {
                store
                    .purge_expired()
                    .await
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                // Records go within a tick of their expiry: what a lookup finds now, at most
                // what it found a tick ago.
                let live = |store: MemoryStore| async move {
                    let mut live = 0;
                    for k in 0..12 {
                        if store.lookup(&key(k)).await.ok().flatten().is_some() {
                            live += 1;
                        }
                    }
                    live
                };
                let now_live = live(store.clone()).await;
                offset.fetch_sub(shard::TICK_MS, Ordering::SeqCst);
                let tick_ago = live(store.clone()).await;
                offset.fetch_add(shard::TICK_MS, Ordering::SeqCst);
                prop_assert!(
                    now_live <= store.len() && store.len() <= tick_ago,
                    "after a purge the store holds what lookups find: {} now, {} a tick ago, {} held",
                    now_live,
                    tick_ago,
                    store.len()
                );
            }
        }
        let now = time(now_ms());
        for k in 0..12 {
            let record = store
                .lookup(&key(k))
                .await
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            // Expired (a clock step back may revive it, with what was written to it unseen).
            let Some(record) = record else {
                seen.remove(&k);
                continue;
            };
            let history = record.history.clone();
            prop_assert_eq!(history[0].event, HistoryEvent::Claimed);
            prop_assert_eq!(history[0].attempt, 1);
            prop_assert_eq!(history[0].at, record.created_at);
            let before = seen.get(&k).cloned().unwrap_or_default();
            if before.is_empty() {
                // New, or seen again after it expired: nothing to hold it to.
            } else if history[0] != before[0] {
                prop_assert_eq!(history.len(), 1, "a new record: its claim alone");
                prop_assert_eq!(history[0].at, now);
            } else {
                prop_assert!(
                    history.starts_with(&before),
                    "after {:?} the history of key {} rewrote its past: {:?} then {:?}",
                    op,
                    k,
                    before,
                    history
                );
                for entry in &history[before.len()..] {
                    prop_assert_eq!(entry.at, now, "{:?} logged {:?}", op, entry);
                    prop_assert_eq!(entry.attempt, record.attempts);
                    prop_assert_eq!(entry.token, record.lease_token);
                }
            }
            seen.insert(k, history);
        }
    }
    // Everything removed by hand: nothing is left counted.
    for k in 0..12 {
        let _ = store.remove(&key(k)).await;
    }
    prop_assert_eq!(store.len(), 0);
    prop_assert_eq!(store.bytes(), 0, "the byte count returns to zero");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Issue 23 §3 and §5: the compact record (its history implied while short) and the
    /// purge by due index keep the contract: histories only grow, dated and signed as they
    /// were written (DESIGN §4), and a purge removes exactly what expired, whatever the order
    /// of writes, expiries, removals and clock steps.
    #[test]
    fn s5_purging_and_histories_hold_under_any_sequence(ops in proptest::collection::vec(op(), 1..80)) {
        let runtime = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        runtime.block_on(run(ops))?;
    }
}

/// Issue 23 §5: many records in one shard's slab (several chunks, many slices), short and long
/// TTLs interleaved: a purge takes exactly the expired ones, claims alone take them too when
/// nobody purges, and an emptied store holds nothing.
#[tokio::test]
async fn s5_a_purge_takes_exactly_the_expired_among_many() {
    let offset = Arc::new(AtomicU64::new(0));
    let clock = offset.clone();
    let store = MemoryStore::with_clock(move || {
        SystemTime::now() + Duration::from_millis(clock.load(Ordering::SeqCst))
    })
    .max_records(usize::MAX)
    .max_bytes(usize::MAX);
    let claim = |i: usize, ttl: Duration| ClaimRequest {
        key: ScopedKey::new("t", format!("k-{i}")),
        fingerprint: Fingerprint::from_bytes([1; 32]),
        lease: Duration::from_secs(1),
        ttl,
        on_lease_expiry: LeaseExpiry::Reclaim,
    };
    let (short, long) = (Duration::from_secs(2), Duration::from_secs(3600));
    for i in 0..60_000 {
        let ttl = if i % 10 == 0 { long } else { short };
        let request = claim(i, ttl);
        let Ok(Claim::Acquired(lease)) = store.claim(&request).await else {
            panic!("claim {i}");
        };
        store
            .complete(&request.key, lease.token, &response(), ttl)
            .await
            .expect("complete");
    }
    assert_eq!(store.len(), 60_000);
    offset.store(3_000, Ordering::SeqCst);
    let purged = store.purge_expired().await.expect("purge");
    assert_eq!(purged, 54_000, "exactly the short-lived records");
    assert_eq!(store.len(), 6_000);
    // Every record that lives is still found: the purge moved many of them, to give back the
    // chunks the short-lived ones filled.
    for i in 0..60_000 {
        let found = store
            .lookup(&ScopedKey::new("t", format!("k-{i}")))
            .await
            .expect("lookup");
        assert_eq!(found.is_some(), i % 10 == 0, "key {i}");
    }

    // Nobody purges: claims take what has been due for a while, more than each adds.
    for i in 60_000..100_000 {
        let request = claim(i, short);
        let Ok(Claim::Acquired(lease)) = store.claim(&request).await else {
            panic!("claim {i}");
        };
        store
            .complete(&request.key, lease.token, &response(), short)
            .await
            .expect("complete");
    }
    offset.store(10_000, Ordering::SeqCst);
    for i in 100_000..300_000 {
        let request = claim(i, long);
        assert!(matches!(
            store.claim(&request).await,
            Ok(Claim::Acquired(_))
        ));
    }
    assert_eq!(
        store.len(),
        6_000 + 200_000,
        "claims alone purged the 40 000 that expired"
    );

    offset.store(100_000_000, Ordering::SeqCst);
    store.purge_expired().await.expect("purge");
    assert_eq!(store.len(), 0);
    assert_eq!(store.bytes(), 0);
    for shard in &store.inner.shards {
        let shard = lock(shard);
        assert!(shard.watch.is_empty());
        assert_eq!(shard.held(), (0, 0, 0, 0), "an empty shard keeps nothing");
    }
}

/// DESIGN §5 (a full store): a claim of a new key is refused only when live records fill the
/// store. The due index dates records by whole ticks, rounded up, so a sweep by ticks leaves
/// those that expired since the tick under way began: they make room as well, at every point
/// of a tick, while a record one millisecond from its expiry is kept.
#[tokio::test]
async fn s5_a_full_store_makes_room_of_records_expired_within_the_tick() {
    for ttl_ms in 1..=3 * shard::TICK_MS {
        let offset = Arc::new(AtomicU64::new(0));
        let clock = offset.clone();
        let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let store = MemoryStore::with_clock(move || {
            start + Duration::from_millis(clock.load(Ordering::SeqCst))
        })
        .max_records(2);
        let claim = |name: &str, ttl_ms: u64| ClaimRequest {
            key: ScopedKey::new("t", name),
            fingerprint: Fingerprint::from_bytes([1; 32]),
            lease: Duration::from_millis(1),
            ttl: Duration::from_millis(ttl_ms),
            on_lease_expiry: LeaseExpiry::Reclaim,
        };
        for (name, ttl) in [("expires", ttl_ms), ("stays", ttl_ms + 1)] {
            let request = claim(name, ttl);
            let Ok(Claim::Acquired(lease)) = store.claim(&request).await else {
                panic!("claim {name}");
            };
            store
                .complete(&request.key, lease.token, &response(), request.ttl)
                .await
                .expect("complete");
        }
        offset.store(ttl_ms, Ordering::SeqCst);
        assert!(
            matches!(
                store.claim(&claim("new", 60_000)).await,
                Ok(Claim::Acquired(_))
            ),
            "ttl {ttl_ms} ms: the expired record makes room"
        );
        assert!(
            matches!(
                store.claim(&claim("stays", 60_000)).await,
                Ok(Claim::Completed { .. })
            ),
            "ttl {ttl_ms} ms: the record still live is kept"
        );
        assert!(
            matches!(
                store.claim(&claim("another", 60_000)).await,
                Err(StoreError::Full)
            ),
            "ttl {ttl_ms} ms: live records fill the store"
        );
        assert_eq!(store.len(), 2);
        // The kept record's due entry still finds it once it expires.
        offset.store(ttl_ms + 1 + shard::TICK_MS, Ordering::SeqCst);
        store.purge_expired().await.expect("purge");
        assert_eq!(store.len(), 1, "ttl {ttl_ms} ms: only the new key is left");
    }
}
