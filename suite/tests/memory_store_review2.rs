//! Issue 23 §3 and §5, attacked a second time: the MemoryStore's newest mechanisms (compaction of
//! a shard far below its peak, one due entry per record, purging spread over claims, the due
//! index as a queue and a heap). Written by a reviewer briefed to break them, after
//! `memory_store_review.rs` (which this does not repeat). Public API only.

use std::alloc::System;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use tower_idempotency::store::{
    Claim, FencingToken, InFlight, Milestone, Record, RecordStatus, Resolution, ScopedKey,
    UncertainQuery,
};
use tower_idempotency::{IdempotencyStore, MemoryStore};

// ---------------------------------------------------------------------------------------------
// Allocation counting: the tests of this file run one at a time, so the counts are the test's.

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

mod common;

use common::memory::*;

const HOUR: u64 = 3_600_000;

/// Completes `key` with `body` for `ttl` ms: a write that must succeed.
async fn complete(store: &MemoryStore, key: &ScopedKey, token: FencingToken, body: &str, ttl: u64) {
    store
        .complete(key, token, &response(body), ms(ttl))
        .await
        .expect("complete");
}

/// `n` records that expire 16 ms after now (completed with a 16 ms TTL): enough, spread over
/// the 64 shards, that each shard grows past one 512-record chunk.
async fn burst(store: &MemoryStore, tag: &str, n: usize) {
    for i in 0..n {
        let key = ScopedKey::new("burst", format!("{tag}-{i}"));
        let t = acquire(store, &req(&key, 16, 16)).await;
        store
            .complete(&key, t, &response(Bytes::from_static(b"b")), ms(16))
            .await
            .expect("complete burst record");
    }
}

async fn guarded<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(300), f)
        .await
        .unwrap_or_else(|_| panic!("{what} hung"))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// The record as a string, for before/after comparisons (`Record` is not `PartialEq`).
fn shown(r: &Record) -> String {
    format!("{r:?}")
}

// ---------------------------------------------------------------------------------------------
// 1. Compaction.

/// Records of every kind written after a burst sit in each shard's last chunks; once the burst
/// is purged, compaction moves them down. Every one must read back exactly as before, keep its
/// place in the uncertain listing and count, take its holder's writes, be purged at its TTL,
/// and the counts stay exact; then a second burst, shrink and compaction changes nothing.
#[tokio::test]
async fn moved_records_of_every_kind_stay_findable_writable_and_purgeable() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    const PER_KIND: usize = 128;
    burst(&store, "a", 100_000).await;
    let burst_bytes = store.bytes();
    assert_eq!(store.len(), 100_000);

    let k = |kind: &str, i: usize| ScopedKey::new(format!("special-{kind}"), format!("{i}"));
    let mut tokens: HashMap<ScopedKey, FencingToken> = HashMap::new();
    for i in 0..PER_KIND {
        // In progress, its lease live for an hour.
        let key = k("inprog", i);
        tokens.insert(key.clone(), acquire(&store, &req(&key, HOUR, HOUR)).await);
        // Completed, 10 s TTL.
        let key = k("done", i);
        let t = acquire(&store, &req(&key, 1000, 10_000)).await;
        store
            .complete(&key, t, &response(format!("done-{i}")), ms(10_000))
            .await
            .expect("complete");
        tokens.insert(key, t);
        // Released, 10 s TTL.
        let key = k("released", i);
        let t = acquire(&store, &req(&key, 1000, 10_000)).await;
        assert_eq!(
            store.release(&key, t).await.expect("release"),
            RecordStatus::Released
        );
        tokens.insert(key, t);
        // Marked uncertain.
        let key = k("uncertain", i);
        let t = acquire(&store, &req(&key, 1000, 10_000)).await;
        store.mark_uncertain(&key, t).await.expect("mark");
        tokens.insert(key, t);
        // A reconcile route whose lease will run out (watched).
        let key = k("watched", i);
        tokens.insert(
            key.clone(),
            acquire(&store, &reconcile_req(&key, 16, 16)).await,
        );
        // In progress with a downstream id, its effect started and a long history.
        let key = k("history", i);
        let t = acquire(&store, &req(&key, HOUR, HOUR)).await;
        store
            .record_milestone(&key, t, &Milestone::EffectStarted)
            .await
            .expect("milestone");
        for n in 0..40 {
            clock.advance(0);
            store
                .record_milestone(&key, t, &Milestone::DownstreamId(format!("ds-{i}-{n}")))
                .await
                .expect("milestone");
        }
        tokens.insert(key, t);
    }
    let specials: Vec<ScopedKey> = tokens.keys().cloned().collect();
    let special_bytes = store.bytes() - burst_bytes;
    let n_special = 6 * PER_KIND;
    assert_eq!(store.len(), 100_000 + n_special);
    let mut before = HashMap::new();
    for key in &specials {
        before.insert(key.clone(), shown(&record(&store, key).await));
    }

    // The burst expires; the purge takes it and compacts every shard.
    clock.advance(64);
    let mut before_at_64 = HashMap::new();
    for key in &specials {
        // The watched records' leases ran out: they read as they did (a lookup changes nothing).
        before_at_64.insert(key.clone(), shown(&record(&store, key).await));
    }
    assert_eq!(store.purge_expired().await.expect("purge"), 100_000);
    assert_eq!(store.len(), n_special, "only the special records are left");
    assert_eq!(store.bytes(), special_bytes, "the weight is the specials'");
    for key in &specials {
        let after = shown(&record(&store, key).await);
        assert_eq!(
            after, before_at_64[key],
            "{key:?} reads back the same after compaction"
        );
        assert_eq!(after, before[key], "{key:?}: a lookup is no write");
    }
    let count = store.count_uncertain().await.expect("count");
    assert_eq!(
        count.count,
        2 * PER_KIND as u64,
        "marked uncertain + watched with their leases run out"
    );
    let page = store
        .list_uncertain(&UncertainQuery::first(10_000))
        .await
        .expect("list");
    let listed: HashSet<ScopedKey> = page.records.iter().map(|r| r.key.clone()).collect();
    let expected: HashSet<ScopedKey> = specials
        .iter()
        .filter(|k| k.scope() == "special-uncertain" || k.scope() == "special-watched")
        .cloned()
        .collect();
    assert_eq!(listed, expected, "the uncertain listing after compaction");

    // A second burst and shrink, then the holders write.
    burst(&store, "b", 100_000).await;
    clock.advance(64);
    assert_eq!(store.purge_expired().await.expect("purge"), 100_000);
    assert_eq!(store.len(), n_special);
    for key in &specials {
        assert_eq!(
            shown(&record(&store, key).await),
            before[key],
            "{key:?} after the second compaction"
        );
    }
    for i in 0..PER_KIND {
        let key = k("inprog", i);
        store
            .renew(&key, tokens[&key], ms(HOUR))
            .await
            .expect("renew a moved record with its token");
        store
            .complete(&key, tokens[&key], &response("inprog"), ms(10_000))
            .await
            .expect("complete a moved record with its token");
        let key = k("done", i);
        let r = replayed(&store, &req(&key, 1000, 10_000)).await;
        assert_eq!(
            r.body,
            Some(Bytes::from(format!("done-{i}"))),
            "a moved record replays its own response"
        );
        let key = k("released", i);
        match store.claim(&req(&key, 16, 16)).await {
            Ok(Claim::Acquired(lease)) => assert_eq!(lease.attempt, 2),
            other => panic!("a moved released record is taken over: {other:?}"),
        }
        let key = k("uncertain", i);
        store
            .resolve(
                &key,
                tokens[&key],
                &Resolution::Applied(Box::new(response("resolved"))),
                ms(10_000),
                Some("moved"),
            )
            .await
            .expect("resolve a moved uncertain record");
        let key = k("watched", i);
        store
            .resolve(
                &key,
                tokens[&key],
                &Resolution::Applied(Box::new(response("resolved"))),
                ms(10_000),
                None,
            )
            .await
            .expect("resolve a moved watched record");
        let key = k("history", i);
        store
            .complete(&key, tokens[&key], &response("history"), ms(10_000))
            .await
            .expect("complete a moved record with a long history");
        let r = record(&store, &key).await;
        assert_eq!(r.downstream_id, Some(format!("ds-{i}-39")));
        assert!(r.effect_started);
    }
    assert_eq!(store.count_uncertain().await.expect("count").count, 0);
    assert_eq!(store.len(), n_special);
    // Nothing is purged early...
    assert_eq!(store.purge_expired().await.expect("purge"), 0);
    // ...and everything at its TTL (the taken-over released records expire with theirs).
    clock.advance(10_000 + 64);
    let purged = store.purge_expired().await.expect("purge");
    assert_eq!(
        (purged, store.len(), store.bytes()),
        (n_special as u64, 0, 0),
        "every moved record is purged at its TTL"
    );
}

/// Claims, renewals, completions, lookups and removals from many tasks on two threads race
/// purges that compact (bursts keep making shards grow and shrink): every holder's record is
/// always found with its token, its writes are never fenced, replays give its response, and
/// the counts end exact.
#[test]
fn holders_racing_compacting_purges_never_lose_their_records() {
    let _serial = serial_blocking();
    let rt = runtime();
    rt.block_on(async {
        let clock = Clock::new();
        let store = clock.store();
        let stop = Arc::new(AtomicBool::new(false));
        let ops = Arc::new(AtomicU64::new(0));
        let mut workers = Vec::new();
        for w in 0..12 {
            let (store, stop, ops) = (store.clone(), stop.clone(), ops.clone());
            workers.push(tokio::spawn(async move {
                let mut round = 0u64;
                // Records held across many purges: claimed once, written at the end.
                let mut held = Vec::new();
                for i in 0..40 {
                    let key = ScopedKey::new(format!("held-{w}"), format!("{i}"));
                    let t = acquire(&store, &req(&key, 10 * HOUR, 10 * HOUR)).await;
                    held.push((key, t));
                }
                while !stop.load(Ordering::SeqCst) || round < 3 {
                    for i in 0..32 {
                        let key = ScopedKey::new(format!("w{w}"), format!("{round}-{i}"));
                        let t = acquire(&store, &req(&key, 10 * HOUR, 10 * HOUR)).await;
                        tokio::task::yield_now().await;
                        store
                            .renew(&key, t, ms(10 * HOUR))
                            .await
                            .unwrap_or_else(|e| panic!("{key:?} renew: {e:?}"));
                        tokio::task::yield_now().await;
                        let r = record(&store, &key).await;
                        assert_eq!(r.lease_token, t, "{key:?} found with its token");
                        store
                            .complete(
                                &key,
                                t,
                                &response(format!("{w}-{round}-{i}")),
                                ms(10 * HOUR),
                            )
                            .await
                            .unwrap_or_else(|e| panic!("{key:?} complete: {e:?}"));
                        tokio::task::yield_now().await;
                        let r = replayed(&store, &req(&key, 10 * HOUR, 10 * HOUR)).await;
                        assert_eq!(r.body, Some(Bytes::from(format!("{w}-{round}-{i}"))));
                        if i % 2 == 0 {
                            assert!(store.remove(&key).await.expect("remove"), "{key:?} removed");
                            assert!(store.lookup(&key).await.expect("lookup").is_none());
                        }
                        for (key, t) in &held {
                            if i % 8 == 0 {
                                let r = record(&store, key).await;
                                assert_eq!(r.lease_token, *t, "{key:?} held");
                            }
                        }
                        ops.fetch_add(1, Ordering::Relaxed);
                    }
                    round += 1;
                }
                for (key, t) in &held {
                    store
                        .renew(key, *t, ms(10 * HOUR))
                        .await
                        .unwrap_or_else(|e| panic!("{key:?} held renew: {e:?}"));
                    store
                        .complete(key, *t, &response("held"), ms(10 * HOUR))
                        .await
                        .unwrap_or_else(|e| panic!("{key:?} held complete: {e:?}"));
                }
                // Kept: those not removed (odd i), and the held ones.
                round * 16 + held.len() as u64
            }));
        }
        let purger = {
            let (store, clock, stop) = (store.clone(), clock.clone(), stop.clone());
            tokio::spawn(async move {
                let mut purged = 0u64;
                for round in 0..5 {
                    for i in 0..50_000 {
                        let key = ScopedKey::new("burst", format!("{round}-{i}"));
                        let t = acquire(&store, &req(&key, 16, 16)).await;
                        store
                            .complete(&key, t, &response(Bytes::from_static(b"b")), ms(16))
                            .await
                            .expect("complete");
                        if i % 256 == 0 {
                            tokio::task::yield_now().await;
                        }
                    }
                    clock.advance(64);
                    purged += store.purge_expired().await.expect("purge");
                    tokio::task::yield_now().await;
                }
                stop.store(true, Ordering::SeqCst);
                purged
            })
        };
        let purged = guarded("the purger", purger).await.expect("purger");
        let mut kept = 0;
        for w in workers {
            kept += guarded("a worker", w).await.expect("worker");
        }
        assert!(ops.load(Ordering::Relaxed) > 0);
        assert!(purged > 0);
        // Whatever the bursts left (claims purged some).
        clock.advance(64);
        store.purge_expired().await.expect("purge");
        assert_eq!(
            store.len() as u64,
            kept,
            "the holders' records, no more, no less"
        );
        clock.advance((10 * HOUR + 1000) as i64);
        assert_eq!(store.purge_expired().await.expect("purge"), kept);
        assert_eq!((store.len(), store.bytes()), (0, 0));
    });
}

/// Requests waiting on records in flight are woken by the holders' writes after compaction
/// moved those records (a waiter not woken would sleep its hour: the hang guard catches it).
#[tokio::test]
async fn waiters_on_moved_records_are_woken_by_their_holders() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    burst(&store, "w", 60_000).await;
    let mut held = Vec::new();
    for i in 0..256 {
        let key = ScopedKey::new("waited", format!("{i}"));
        let request = req(&key, HOUR, HOUR);
        let lease = match store.claim(&request).await {
            Ok(Claim::Acquired(lease)) => lease,
            other => panic!("{other:?}"),
        };
        held.push((key, lease));
    }
    let start = tokio::time::Instant::now();
    let mut waiters = Vec::new();
    for (key, lease) in &held {
        let (store, key) = (store.clone(), key.clone());
        let seen = InFlight {
            token: lease.token,
            lease_until: lease.until,
            now: SystemTime::UNIX_EPOCH + Duration::from_millis(START_MS + clock.elapsed()),
        };
        waiters.push(tokio::spawn(async move {
            store
                .wait_for_change(&key, &seen, 0, Duration::from_secs(3600))
                .await;
            tokio::time::Instant::now()
        }));
    }
    // Let every waiter register.
    tokio::time::sleep(Duration::from_millis(10)).await;
    clock.advance(64);
    assert_eq!(store.purge_expired().await.expect("purge"), 60_000);
    assert_eq!(store.len(), 256);
    let woken_at = tokio::time::Instant::now();
    for (n, (key, lease)) in held.iter().enumerate() {
        match n % 3 {
            0 => store
                .complete(key, lease.token, &response("x"), ms(HOUR))
                .await
                .expect("complete"),
            1 => {
                store.release(key, lease.token).await.expect("release");
            }
            _ => {
                assert!(store.remove(key).await.expect("remove"));
            }
        }
    }
    for (n, waiter) in waiters.into_iter().enumerate() {
        let done = tokio::time::timeout(Duration::from_secs(60), waiter)
            .await
            .unwrap_or_else(|_| panic!("waiter {n} was never woken by its holder's write"))
            .expect("waiter");
        assert!(
            done >= woken_at,
            "waiter {n} returned {:?} after it started, before any holder wrote",
            done.duration_since(start)
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 2. One due entry per record.

/// What runs between the steps of a scenario.
#[derive(Clone, Copy, Debug)]
enum Between {
    Nothing,
    /// Claims of other keys (each purging two due records of its shard).
    Claims,
    /// A purge of the whole store.
    Purge,
    /// A purge of a store grown by a burst first: records move under the scenario.
    Compaction,
}

struct Env {
    clock: Clock,
    store: MemoryStore,
    between: Between,
    n: std::cell::Cell<u64>,
}

impl Env {
    async fn new(between: Between) -> Self {
        let clock = Clock::new();
        let store = clock.store();
        if let Between::Compaction = between {
            burst(&store, "env", 40_000).await;
        }
        Env {
            clock,
            store,
            between,
            n: std::cell::Cell::new(0),
        }
    }

    async fn between(&self) {
        match self.between {
            Between::Nothing => {}
            Between::Claims => {
                for _ in 0..256 {
                    let n = self.n.get();
                    self.n.set(n + 1);
                    let key = ScopedKey::new("other", format!("{n}"));
                    let t = acquire(&self.store, &req(&key, 16, 16)).await;
                    self.store
                        .complete(&key, t, &response("o"), ms(16))
                        .await
                        .expect("complete other");
                }
            }
            Between::Purge | Between::Compaction => {
                self.store.purge_expired().await.expect("purge");
            }
        }
    }

    fn advance(&self, ms: u64) {
        self.clock.advance(ms as i64);
    }
}

type Scenario =
    for<'a> fn(&'a Env, ScopedKey) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + 'a>>;

fn sc(f: Scenario) -> Scenario {
    f
}

fn scenarios() -> Vec<(&'static str, Scenario)> {
    vec![
        (
            "takeover then a shorter complete",
            sc(|env, key| {
                Box::pin(async move {
                    let s = &env.store;
                    let t = acquire(s, &req(&key, 1000, HOUR)).await;
                    env.between().await;
                    s.release(&key, t).await.expect("release");
                    env.between().await;
                    env.advance(2000);
                    env.between().await;
                    let t = acquire(s, &req(&key, 1000, HOUR)).await;
                    env.between().await;
                    complete(s, &key, t, "x", 16).await;
                    env.between().await;
                    env.advance(100);
                    env.between().await;
                })
            }),
        ),
        (
            "resolve applied with a short TTL",
            sc(|env, key| {
                Box::pin(async move {
                    let s = &env.store;
                    acquire(s, &reconcile_req(&key, 16, HOUR)).await;
                    env.between().await;
                    env.advance(32);
                    env.between().await;
                    let r = existing(s, &reconcile_req(&key, 16, HOUR)).await;
                    assert_eq!(r.status, RecordStatus::NeedsReconciliation);
                    env.between().await;
                    s.resolve(
                        &key,
                        r.lease_token,
                        &Resolution::Applied(Box::new(response("x"))),
                        ms(16),
                        None,
                    )
                    .await
                    .expect("resolve");
                    env.between().await;
                })
            }),
        ),
        (
            "release after the effect started, resolved not applied",
            sc(|env, key| {
                Box::pin(async move {
                    let s = &env.store;
                    let t = acquire(s, &req(&key, 1000, 50)).await;
                    s.record_milestone(&key, t, &Milestone::EffectStarted)
                        .await
                        .expect("milestone");
                    env.between().await;
                    assert_eq!(
                        s.release(&key, t).await.expect("release"),
                        RecordStatus::NeedsReconciliation
                    );
                    env.between().await;
                    env.advance(1000);
                    env.between().await;
                    s.resolve(&key, t, &Resolution::NotApplied, ms(16), None)
                        .await
                        .expect("resolve");
                    env.between().await;
                })
            }),
        ),
        (
            "release after the effect started, resolved applied",
            sc(|env, key| {
                Box::pin(async move {
                    let s = &env.store;
                    let t = acquire(s, &req(&key, 1000, HOUR)).await;
                    s.record_milestone(&key, t, &Milestone::EffectStarted)
                        .await
                        .expect("milestone");
                    env.between().await;
                    s.release(&key, t).await.expect("release");
                    env.between().await;
                    s.resolve(
                        &key,
                        t,
                        &Resolution::Applied(Box::new(response("x"))),
                        ms(16),
                        None,
                    )
                    .await
                    .expect("resolve");
                    env.between().await;
                })
            }),
        ),
        (
            "renew extending the expiry, then complete",
            sc(|env, key| {
                Box::pin(async move {
                    let s = &env.store;
                    let t = acquire(s, &req(&key, 100, 100)).await;
                    env.between().await;
                    env.advance(50);
                    s.renew(&key, t, ms(HOUR)).await.expect("renew");
                    env.between().await;
                    env.advance(200);
                    env.between().await;
                    complete(s, &key, t, "x", 16).await;
                    env.between().await;
                })
            }),
        ),
        (
            "re-completed long, short, long, short",
            sc(|env, key| {
                Box::pin(async move {
                    let s = &env.store;
                    let t = acquire(s, &req(&key, 1000, 1000)).await;
                    for ttl in [HOUR, 16, HOUR, 16] {
                        complete(s, &key, t, "x", ttl).await;
                        env.between().await;
                        // Less than the short TTL: the record is never expired here.
                        env.advance(8);
                        env.between().await;
                    }
                })
            }),
        ),
        (
            "re-claimed after expiry, completed longer",
            sc(|env, key| {
                Box::pin(async move {
                    let s = &env.store;
                    let t = acquire(s, &req(&key, 16, 16)).await;
                    complete(s, &key, t, "x", 16).await;
                    env.advance(48);
                    env.between().await;
                    let t = acquire(s, &req(&key, 1000, 1000)).await;
                    env.between().await;
                    env.advance(40);
                    env.between().await;
                    complete(s, &key, t, "y", HOUR).await;
                    env.between().await;
                })
            }),
        ),
        (
            "re-claimed after expiry with a long lease, completed short",
            sc(|env, key| {
                Box::pin(async move {
                    let s = &env.store;
                    let t = acquire(s, &req(&key, 16, 16)).await;
                    complete(s, &key, t, "x", 16).await;
                    env.advance(48);
                    let t = acquire(s, &req(&key, HOUR, 16)).await;
                    env.between().await;
                    complete(s, &key, t, "y", 16).await;
                    env.between().await;
                })
            }),
        ),
        (
            "released, taken over, marked uncertain, resolved applied short",
            sc(|env, key| {
                Box::pin(async move {
                    let s = &env.store;
                    let t = acquire(s, &req(&key, 1000, 100)).await;
                    s.release(&key, t).await.expect("release");
                    env.between().await;
                    let t = acquire(s, &req(&key, HOUR, HOUR)).await;
                    env.between().await;
                    s.mark_uncertain(&key, t).await.expect("mark");
                    env.between().await;
                    env.advance(200);
                    env.between().await;
                    s.resolve(
                        &key,
                        t,
                        &Resolution::Applied(Box::new(response("x"))),
                        ms(16),
                        None,
                    )
                    .await
                    .expect("resolve");
                    env.between().await;
                })
            }),
        ),
        (
            "removed then re-claimed in the slot, completed short",
            sc(|env, key| {
                Box::pin(async move {
                    let s = &env.store;
                    let t = acquire(s, &req(&key, 1000, HOUR)).await;
                    complete(s, &key, t, "x", HOUR).await;
                    env.between().await;
                    assert!(s.remove(&key).await.expect("remove"));
                    env.between().await;
                    let t = acquire(s, &req(&key, 1000, 1000)).await;
                    env.between().await;
                    complete(s, &key, t, "x", 16).await;
                    env.between().await;
                })
            }),
        ),
        (
            "a lease longer than the TTL, completed",
            sc(|env, key| {
                Box::pin(async move {
                    let s = &env.store;
                    let t = acquire(s, &req(&key, HOUR, 16)).await;
                    env.between().await;
                    env.advance(40);
                    env.between().await;
                    complete(s, &key, t, "x", 16).await;
                    env.between().await;
                })
            }),
        ),
        (
            "a reclaim route's lease ran out, the holder completes short",
            sc(|env, key| {
                Box::pin(async move {
                    let s = &env.store;
                    let t = acquire(s, &reconcile_req(&key, 16, HOUR)).await;
                    env.between().await;
                    env.advance(40);
                    env.between().await;
                    complete(s, &key, t, "x", 16).await;
                    env.between().await;
                })
            }),
        ),
    ]
}

/// Every sequence of writes that settles a record leaves it purgeable: far past every TTL, a
/// purge leaves nothing, whatever ran between the steps (nothing, claims of other keys, purges,
/// compacting purges).
#[tokio::test]
async fn every_settling_sequence_leaves_the_record_purgeable() {
    let _serial = serial().await;
    let mut failures = Vec::new();
    for between in [
        Between::Nothing,
        Between::Claims,
        Between::Purge,
        Between::Compaction,
    ] {
        for (name, scenario) in scenarios() {
            let env = Env::new(between).await;
            // Several keys, so some land in shards the claims between steps purge.
            for i in 0..8 {
                scenario(&env, ScopedKey::new("scenario", format!("{name}-{i}"))).await;
            }
            env.advance(4 * HOUR);
            env.store.purge_expired().await.expect("purge");
            if !env.store.is_empty() || env.store.bytes() != 0 {
                failures.push(format!(
                    "{name} ({between:?}): {} records ({} bytes) never purged",
                    env.store.len(),
                    env.store.bytes()
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// One hot record, completed again and again by its holder with alternating TTLs (allowed): it
/// is one record, and what the store keeps for it must not grow with the number of
/// re-completions (DESIGN §5; "a record has one due entry", shard.rs).
#[tokio::test]
async fn a_record_re_completed_with_alternating_ttls_keeps_memory_bounded() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    let key = ScopedKey::new("hot", "alternating");
    let t = acquire(&store, &req(&key, 1000, 1000)).await;
    // Warm up: the history at its cap.
    for _ in 0..600 {
        store
            .complete(&key, t, &response("x"), ms(10 * HOUR))
            .await
            .expect("complete");
    }
    let region = Region::new(GLOBAL);
    for i in 0..200_000u32 {
        store
            .complete(&key, t, &response("x"), ms(10 * HOUR))
            .await
            .expect("complete");
        store
            .complete(&key, t, &response("x"), ms(16))
            .await
            .expect("complete");
        store
            .complete(&key, t, &response("x"), ms(10 * HOUR))
            .await
            .expect("complete");
        if i % 1000 == 999 {
            clock.advance(32);
            store.purge_expired().await.expect("purge");
        }
    }
    let grown = live_heap(&region);
    assert_eq!(store.len(), 1);
    assert!(
        grown < 256 * 1024,
        "200 000 alternating re-completions of one record kept {grown} more bytes allocated"
    );
}

// ---------------------------------------------------------------------------------------------
// 3. Purging by claims.

/// Expired settled records and abandoned in-progress ones, and then only replays of other keys:
/// the claims alone purge all of them (no purge_expired).
#[tokio::test]
async fn claims_of_other_keys_alone_purge_expired_and_abandoned_records() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    for i in 0..20_000 {
        let key = ScopedKey::new("settled", format!("{i}"));
        let t = acquire(&store, &req(&key, 16, 16)).await;
        if i % 2 == 0 {
            store
                .complete(&key, t, &response("x"), ms(16))
                .await
                .expect("complete");
        } else {
            store.release(&key, t).await.expect("release");
        }
    }
    for i in 0..5_000 {
        acquire(
            &store,
            &req(&ScopedKey::new("abandoned", format!("{i}")), 16, 16),
        )
        .await;
    }
    let live: Vec<ScopedKey> = (0..2_000)
        .map(|i| ScopedKey::new("live", format!("{i}")))
        .collect();
    for key in &live {
        let t = acquire(&store, &req(key, 1000, HOUR)).await;
        store
            .complete(key, t, &response("live"), ms(HOUR))
            .await
            .expect("complete");
    }
    clock.advance(100);
    for round in 0..80 {
        for key in &live {
            replayed(&store, &req(key, 1000, HOUR)).await;
        }
        if round % 20 == 19 {
            clock.advance(16);
        }
    }
    // 160 000 claims: about 2 500 per shard, two purges each, and the in-progress set looked at
    // twice.
    assert_eq!(
        store.len(),
        live.len(),
        "claims of other keys left {} expired records",
        store.len() - live.len()
    );
}

/// Claims purge only what expired: records whose due entries come early (expiry moved later),
/// live leases, uncertain and watched records, effects started, re-completed records, all
/// survive a long stream of claims on other keys and a purge.
#[tokio::test]
async fn claims_never_purge_a_record_that_has_not_expired() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    const N: usize = 200;
    let k = |kind: &str, i: usize| ScopedKey::new(format!("keep-{kind}"), format!("{i}"));
    let mut expect: Vec<(ScopedKey, RecordStatus)> = Vec::new();
    for i in 0..N {
        // Completed short, then re-completed for an hour: its first entry comes early.
        let key = k("recompleted", i);
        let t = acquire(&store, &req(&key, 1000, 16)).await;
        store
            .complete(&key, t, &response("a"), ms(16))
            .await
            .expect("complete");
        store
            .complete(&key, t, &response("b"), ms(HOUR))
            .await
            .expect("complete");
        expect.push((key, RecordStatus::Completed));
        // Released short, taken over for an hour.
        let key = k("takenover", i);
        let t = acquire(&store, &req(&key, 16, 16)).await;
        store.release(&key, t).await.expect("release");
        acquire(&store, &req(&key, HOUR, HOUR)).await;
        expect.push((key, RecordStatus::InProgress));
        // A live lease with a short TTL.
        let key = k("lease", i);
        acquire(&store, &req(&key, HOUR, 16)).await;
        expect.push((key, RecordStatus::InProgress));
        // Uncertain, its TTL short.
        let key = k("uncertain", i);
        let t = acquire(&store, &req(&key, 16, 16)).await;
        store.mark_uncertain(&key, t).await.expect("mark");
        expect.push((key, RecordStatus::NeedsReconciliation));
        // A reconcile route, its lease and TTL run out: never expires.
        let key = k("watched", i);
        acquire(&store, &reconcile_req(&key, 16, 16)).await;
        expect.push((key, RecordStatus::InProgress));
        // Effect started, its lease and TTL run out: never expires.
        let key = k("effect", i);
        let t = acquire(&store, &req(&key, 16, 16)).await;
        store
            .record_milestone(&key, t, &Milestone::EffectStarted)
            .await
            .expect("milestone");
        expect.push((key, RecordStatus::InProgress));
        // Expired and re-claimed in its slot for an hour, then completed for an hour.
        let key = k("reclaimed", i);
        let t = acquire(&store, &req(&key, 16, 16)).await;
        store
            .complete(&key, t, &response("a"), ms(16))
            .await
            .expect("complete");
        expect.push((key, RecordStatus::Completed));
    }
    clock.advance(48);
    for i in 0..N {
        let key = k("reclaimed", i);
        let t = acquire(&store, &req(&key, HOUR, HOUR)).await;
        store
            .complete(&key, t, &response("b"), ms(HOUR))
            .await
            .expect("complete");
    }
    let others: Vec<ScopedKey> = (0..2_000)
        .map(|i| ScopedKey::new("other", format!("{i}")))
        .collect();
    for key in &others {
        let t = acquire(&store, &req(key, 1000, 10 * HOUR)).await;
        store
            .complete(key, t, &response("o"), ms(10 * HOUR))
            .await
            .expect("complete");
    }
    for round in 0..60 {
        clock.advance(20);
        for key in &others {
            replayed(&store, &req(key, 1000, 10 * HOUR)).await;
        }
        if round % 10 == 0 {
            store.purge_expired().await.expect("purge");
        }
    }
    assert_eq!(store.len(), expect.len() + others.len());
    for (key, status) in &expect {
        let r = store
            .lookup(key)
            .await
            .expect("lookup")
            .unwrap_or_else(|| panic!("{key:?} was purged before it expired"));
        assert_eq!(r.status, *status, "{key:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// 4. The due index.

/// TTLs of 1 ms, an hour and 10 ms, alternating (so entries go to the queue and the heap),
/// settled one millisecond apart: after each purge the store holds exactly the records whose
/// expiry tick has not passed, none purged early, none late.
#[tokio::test]
async fn mixed_ttls_are_purged_at_their_tick_none_early_none_late() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    let ttls = [1u64, HOUR, 10, 37, 5, HOUR / 2, 16, 3];
    let mut expiries = Vec::new();
    for i in 0..6_000usize {
        let key = ScopedKey::new("mixed", format!("{i}"));
        let ttl = ttls[i % ttls.len()];
        let t = acquire(&store, &req(&key, 1, ttl)).await;
        store
            .complete(&key, t, &response("m"), ms(ttl))
            .await
            .expect("complete");
        expiries.push(clock.elapsed() + ttl);
        if i % 3 == 0 {
            clock.advance(1);
        }
    }
    let remaining = |now: u64| {
        expiries
            .iter()
            .filter(|&&e| e.div_ceil(16) > now / 16)
            .count()
    };
    let end = clock.elapsed() + 200;
    while clock.elapsed() < end {
        store.purge_expired().await.expect("purge");
        let now = clock.elapsed();
        assert_eq!(
            store.len(),
            remaining(now),
            "at {now} ms: {} held, {} not yet due",
            store.len(),
            remaining(now)
        );
        clock.advance(7);
    }
    clock.advance(HOUR as i64);
    store.purge_expired().await.expect("purge");
    assert_eq!((store.len(), store.bytes()), (0, 0));
}
