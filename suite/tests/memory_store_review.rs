//! Issue 23 §3 and §5, attacked: the MemoryStore's compact records (a slab, the key beside the
//! response, histories implied while short) and its purging by a due index, against what
//! DESIGN §4 (histories, TTLs) and §5 (bounded memory) promise. Tests that try to break its
//! counts, its purging, its memory, its histories and its keys, alone and under concurrency,
//! written by a reviewer briefed to break them. Public API only.

use std::alloc::System;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use tower_idempotency::IdempotencyStore;
use tower_idempotency::reconcile::{Reconciler, Reconciliation, Sweeper};
use tower_idempotency::store::{
    Claim, FencingToken, HISTORY_LIMIT, HISTORY_REFUSALS, HistoryEntry, HistoryEvent, Milestone,
    Record, RecordStatus, Resolution, ScopedKey, StoreError,
};

// ---------------------------------------------------------------------------------------------
// Allocation counting (the tests of this file run one at a time, so the global counts are this
// test's).

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

mod common;

use common::Rng;
use common::memory::*;

fn entry(attempt: u32, token: FencingToken, at: SystemTime, event: HistoryEvent) -> HistoryEntry {
    HistoryEntry {
        attempt,
        token,
        at,
        event,
    }
}

/// Guards a concurrent part against hanging.
async fn guarded<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(120), f)
        .await
        .unwrap_or_else(|_| panic!("{what} hung"))
}

// ---------------------------------------------------------------------------------------------
// Keys.

/// Keys that differ only in where the scope ends are four records, each found by its own key
/// and unaffected by what happens to the others.
#[tokio::test]
async fn keys_that_differ_only_in_the_scope_split_are_separate_records() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    let keys = [
        ScopedKey::new("ab", "c"),
        ScopedKey::new("a", "bc"),
        ScopedKey::new("abc", ""),
        ScopedKey::new("", "abc"),
    ];
    let mut tokens = Vec::new();
    for key in &keys {
        tokens.push(acquire(&store, &req(key, 1000, 1000)).await);
    }
    assert_eq!(store.len(), 4);
    for (key, token) in keys.iter().zip(&tokens) {
        let r = record(&store, key).await;
        assert_eq!(&r.key, key);
        assert_eq!(r.key.scope(), key.scope());
        assert_eq!(r.lease_token, *token);
    }
    // Complete one with a short TTL: only it expires and is purged.
    store
        .complete(&keys[0], tokens[0], &response(b"zero"), ms(16))
        .await
        .expect("complete");
    store
        .complete(&keys[1], tokens[1], &response(b"one"), ms(100_000))
        .await
        .expect("complete");
    clock.advance(32);
    assert_eq!(store.purge_expired().await.expect("purge"), 1);
    assert!(store.lookup(&keys[0]).await.expect("lookup").is_none());
    let r1 = record(&store, &keys[1]).await;
    assert_eq!(
        r1.response.expect("response").body.as_deref(),
        Some(&b"one"[..])
    );
    // Removing one leaves the others.
    assert!(store.remove(&keys[2]).await.expect("remove"));
    assert!(!store.remove(&keys[2]).await.expect("remove"));
    assert_eq!(store.len(), 2);
    assert_eq!(record(&store, &keys[3]).await.lease_token, tokens[3]);
    assert!(store.remove(&keys[1]).await.expect("remove"));
    assert!(store.remove(&keys[3]).await.expect("remove"));
    assert_eq!((store.len(), store.bytes()), (0, 0));
}

/// A megabyte-long scope and key, and an empty scope and key, are stored, found, replayed and
/// weighed (the byte count grows by at least the key) and leave nothing counted once removed.
#[tokio::test]
async fn very_long_and_empty_keys_are_kept_and_weighed() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    let long = ScopedKey::new("s".repeat(1 << 20), "k".repeat(1 << 20));
    let empty = ScopedKey::new("", "");
    let before = store.bytes();
    let t = acquire(&store, &req(&long, 1000, 100_000)).await;
    assert!(
        store.bytes() - before >= 2 << 20,
        "the key is weighed: {} bytes",
        store.bytes()
    );
    let e = acquire(&store, &req(&empty, 1000, 100_000)).await;
    store
        .complete(&long, t, &response(b"long"), ms(100_000))
        .await
        .expect("complete");
    store
        .complete(&empty, e, &response(b"empty"), ms(100_000))
        .await
        .expect("complete");
    let r = record(&store, &long).await;
    assert_eq!(r.key, long);
    assert_eq!(r.response.expect("r").body.as_deref(), Some(&b"long"[..]));
    let r = record(&store, &empty).await;
    assert_eq!(r.key, empty);
    assert_eq!(r.response.expect("r").body.as_deref(), Some(&b"empty"[..]));
    // A prefix of the long key is another key.
    let prefix = ScopedKey::new("s".repeat(1 << 20), "k".repeat((1 << 20) - 1));
    assert!(store.lookup(&prefix).await.expect("lookup").is_none());
    match store.claim(&req(&long, 1000, 1000)).await {
        Ok(Claim::Completed { response, .. }) => {
            assert_eq!(response.body.as_deref(), Some(&b"long"[..]));
        }
        other => panic!("a replay: {other:?}"),
    }
    clock.advance(200_000);
    assert_eq!(store.purge_expired().await.expect("purge"), 2);
    assert_eq!((store.len(), store.bytes()), (0, 0));
}

// ---------------------------------------------------------------------------------------------
// Counts and bounds.

/// Every way a record changes hands on one key (takeover after a lease, after a release, after
/// a resolution, re-claim of an expired record, remove then re-claim, re-completion, refusals
/// noted) keeps the count at one record; once it is gone, a store bounded to one record takes a
/// new key, and the counts return to zero.
#[tokio::test]
async fn counts_stay_exact_through_every_kind_of_hand_over_on_one_key() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store().max_records(1);
    let key = ScopedKey::new("t", "k");
    let other = ScopedKey::new("t", "other");
    let check = |what: &str| {
        assert_eq!(store.len(), 1, "after {what}");
    };
    // takeover after a lease ran out
    let t1 = acquire(&store, &req(&key, 16, 10_000)).await;
    clock.advance(32);
    let t2 = acquire(&store, &req(&key, 16, 10_000)).await;
    assert_ne!(t1, t2);
    check("a takeover after the lease");
    // release, takeover
    assert_eq!(
        store.release(&key, t2).await.expect("release"),
        RecordStatus::Released
    );
    let t3 = acquire(&store, &req(&key, 1000, 10_000)).await;
    check("a takeover after a release");
    // effect started, release -> uncertain, resolve not applied, takeover
    store
        .record_milestone(&key, t3, &Milestone::EffectStarted)
        .await
        .expect("milestone");
    store
        .record_milestone(&key, t3, &Milestone::DownstreamId("ch_1".into()))
        .await
        .expect("milestone");
    assert_eq!(
        store.release(&key, t3).await.expect("release"),
        RecordStatus::NeedsReconciliation
    );
    store
        .resolve(
            &key,
            t3,
            &Resolution::NotApplied,
            ms(10_000),
            Some("not found"),
        )
        .await
        .expect("resolve");
    let r = record(&store, &key).await;
    let t4 = acquire(&store, &req(&key, 1000, 10_000)).await;
    assert_ne!(t4, r.lease_token);
    check("a takeover after a resolution");
    // complete, complete again, refusals noted
    store
        .complete(&key, t4, &response(b"first"), ms(10_000))
        .await
        .expect("complete");
    store
        .complete(&key, t4, &response(b"second, longer body"), ms(20_000))
        .await
        .expect("complete again");
    for _ in 0..100 {
        store
            .append_history(&key, HistoryEvent::Replayed)
            .await
            .expect("append");
    }
    check("re-completion and refusals");
    // expired, re-claimed in its slot
    clock.advance(30_000);
    let t5 = acquire(&store, &req(&key, 1000, 10_000)).await;
    assert_eq!(record(&store, &key).await.attempts, 1);
    check("re-claiming an expired record");
    // removed, re-claimed
    assert!(store.remove(&key).await.expect("remove"));
    assert_eq!(store.len(), 0);
    let t6 = acquire(&store, &req(&key, 1000, 10_000)).await;
    assert_ne!(t5, t6);
    check("remove then re-claim");
    // full: another key is refused while this one lives
    assert!(matches!(
        store.claim(&req(&other, 1000, 1000)).await,
        Err(StoreError::Full)
    ));
    store
        .mark_uncertain(&key, t6)
        .await
        .expect("mark uncertain");
    store
        .resolve(
            &key,
            t6,
            &Resolution::Applied(Box::new(response(b"applied"))),
            ms(16),
            None,
        )
        .await
        .expect("resolve");
    clock.advance(32);
    // the expired record makes room for another key
    acquire(&store, &req(&other, 1000, 1000)).await;
    assert_eq!(store.len(), 1);
    assert!(store.remove(&other).await.expect("remove"));
    assert_eq!((store.len(), store.bytes()), (0, 0), "nothing left counted");
}

/// The byte count follows what a record holds: a bigger response weighs more, a re-completion
/// with a smaller one weighs less again, and two keys of the same total length split
/// differently weigh the same.
#[tokio::test]
async fn bytes_follow_what_records_hold() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    let a = ScopedKey::new("ab", "c");
    let b = ScopedKey::new("a", "bc");
    let ta = acquire(&store, &req(&a, 1000, 10_000)).await;
    let one = store.bytes();
    let tb = acquire(&store, &req(&b, 1000, 10_000)).await;
    assert_eq!(store.bytes(), 2 * one, "same length, same weight");
    static BIG: [u8; 100_000] = [b'x'; 100_000];
    store
        .complete(&a, ta, &response(BIG.as_slice()), ms(10_000))
        .await
        .expect("complete");
    let big = store.bytes();
    assert!(big >= 2 * one + 100_000, "{big}");
    store
        .complete(&a, ta, &response(b"small"), ms(10_000))
        .await
        .expect("complete again");
    let small = store.bytes();
    assert!(
        small < 2 * one + 1000,
        "the big body is no longer weighed: {small}"
    );
    store
        .complete(&b, tb, &response(b"small"), ms(10_000))
        .await
        .expect("complete");
    let db = store.bytes() - small;
    let c = ScopedKey::new("", "abc");
    let before = store.bytes();
    let tc = acquire(&store, &req(&c, 1000, 10_000)).await;
    assert_eq!(store.bytes() - before, one, "same length, same weight");
    let before = store.bytes();
    store
        .complete(&c, tc, &response(b"small"), ms(10_000))
        .await
        .expect("complete");
    assert_eq!(store.bytes() - before, db, "equal completions weigh alike");
    assert!(store.remove(&a).await.expect("remove"));
    assert!(store.remove(&b).await.expect("remove"));
    assert!(store.remove(&c).await.expect("remove"));
    assert_eq!((store.len(), store.bytes()), (0, 0));
}

/// Many keys (dozens per shard, so slab slots are freed and reused under stale due entries),
/// random writes on a clock that moves in whole ticks: after every purge the store holds
/// exactly what lookups find, a purge's count is what left, every record found is its own key's,
/// attempts match what claims said, and at the end nothing is left counted.
#[tokio::test]
async fn many_keys_random_writes_purge_exactly_and_counts_return_to_zero() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    const KEYS: usize = 3000;
    let keys: Vec<ScopedKey> = (0..KEYS)
        .map(|i| ScopedKey::new(format!("s{}", i % 7), format!("k{i}")))
        .collect();
    let mut tokens: HashMap<usize, (FencingToken, u32)> = HashMap::new();
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    for step in 0..40_000u32 {
        let k = rng.next(KEYS as u64) as usize;
        let key = &keys[k];
        match rng.next(20) {
            0..=5 => {
                let lease = 16 * (1 + rng.next(20));
                let ttl = 16 * rng.next(60);
                let request = if rng.next(5) == 0 {
                    reconcile_req(key, lease, ttl)
                } else {
                    req(key, lease, ttl)
                };
                if let Ok(Claim::Acquired(lease)) = store.claim(&request).await {
                    tokens.insert(k, (lease.token, lease.attempt));
                    let r = record(&store, key).await;
                    assert_eq!(&r.key, key);
                    assert_eq!(r.attempts, lease.attempt, "step {step}");
                    assert_eq!(r.lease_token, lease.token);
                    assert_eq!(r.status, RecordStatus::InProgress);
                }
            }
            6..=8 => {
                if let Some(&(t, _)) = tokens.get(&k) {
                    let ttl = 16 * rng.next(60);
                    let _ = store
                        .complete(key, t, &response(b"{\"ok\":1}"), ms(ttl))
                        .await;
                }
            }
            9 => {
                if let Some(&(t, _)) = tokens.get(&k) {
                    let _ = store.release(key, t).await;
                }
            }
            10 => {
                if let Some(&(t, _)) = tokens.get(&k) {
                    let _ = store.mark_uncertain(key, t).await;
                }
            }
            11 => {
                if let Some(&(t, _)) = tokens.get(&k) {
                    let _ = store
                        .record_milestone(key, t, &Milestone::EffectStarted)
                        .await;
                }
            }
            12 => {
                if let Some(&(t, _)) = tokens.get(&k) {
                    let _ = store.renew(key, t, ms(16 * (1 + rng.next(10)))).await;
                }
            }
            13 => {
                if let Some(r) = store.lookup(key).await.expect("lookup") {
                    let resolution = if rng.next(2) == 0 {
                        Resolution::NotApplied
                    } else {
                        Resolution::Applied(Box::new(response(b"resolved")))
                    };
                    let _ = store
                        .resolve(key, r.lease_token, &resolution, ms(16 * rng.next(40)), None)
                        .await;
                }
            }
            14 => {
                store.remove(key).await.expect("remove");
            }
            15 => {
                store
                    .append_history(key, HistoryEvent::Conflict)
                    .await
                    .expect("append");
            }
            16..=17 => clock.advance(16 * rng.next(8) as i64),
            _ => {
                let before = store.len();
                let purged = store.purge_expired().await.expect("purge");
                assert_eq!(
                    before - purged as usize,
                    store.len(),
                    "step {step}: a purge's count is what left"
                );
                let mut live = 0;
                for key in &keys {
                    if let Some(r) = store.lookup(key).await.expect("lookup") {
                        assert_eq!(&r.key, key);
                        live += 1;
                    }
                }
                assert_eq!(
                    store.len(),
                    live,
                    "step {step}: after a purge the store holds exactly what lookups find"
                );
            }
        }
    }
    // Far in the future, only what never expires is left (uncertain records).
    clock.advance(10 * 24 * 3600 * 1000);
    store.purge_expired().await.expect("purge");
    let mut left = 0;
    for key in &keys {
        if let Some(r) = store.lookup(key).await.expect("lookup") {
            left += 1;
            assert!(
                r.status == RecordStatus::NeedsReconciliation
                    || (r.status == RecordStatus::InProgress),
                "only an uncertain record outlives its TTL: {r:?}"
            );
        }
    }
    assert_eq!(store.len(), left, "nothing expired is left behind");
    assert_eq!(
        store.count_uncertain().await.expect("count").count,
        left as u64,
        "what outlives its TTL is exactly what awaits reconciliation"
    );
    for key in &keys {
        store.remove(key).await.expect("remove");
    }
    assert_eq!((store.len(), store.bytes()), (0, 0), "nothing left counted");
}

// ---------------------------------------------------------------------------------------------
// Purging.

/// Records settled along every path (resolved not applied, released after a takeover, completed
/// twice, resolved applied, re-claimed after expiry, removed and re-claimed, a lease left to
/// run out) are all purged once their TTL passes: none is left behind.
#[tokio::test]
async fn every_settled_path_is_purged_after_its_ttl() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    let k = |name: &str| ScopedKey::new("paths", name);
    // resolve not applied from an effect-started release
    let key = k("resolved-not-applied");
    let t = acquire(&store, &req(&key, 1000, 5_000)).await;
    store
        .record_milestone(&key, t, &Milestone::EffectStarted)
        .await
        .expect("milestone");
    store.release(&key, t).await.expect("release");
    store
        .resolve(&key, t, &Resolution::NotApplied, ms(5_000), None)
        .await
        .expect("resolve");
    // resolve applied from a reconcile route whose lease ran out
    let key = k("resolved-applied");
    acquire(&store, &reconcile_req(&key, 16, 5_000)).await;
    // released, taken over, released
    let key = k("released-twice");
    let t = acquire(&store, &req(&key, 1000, 5_000)).await;
    store.release(&key, t).await.expect("release");
    let t = acquire(&store, &req(&key, 1000, 5_000)).await;
    store.release(&key, t).await.expect("release");
    // completed twice
    let key = k("completed-twice");
    let t = acquire(&store, &req(&key, 1000, 5_000)).await;
    store
        .complete(&key, t, &response(b"a"), ms(5_000))
        .await
        .expect("complete");
    store
        .complete(&key, t, &response(b"b"), ms(3_000))
        .await
        .expect("complete");
    // removed then re-claimed and completed
    let key = k("removed-reclaimed");
    let t = acquire(&store, &req(&key, 1000, 5_000)).await;
    store
        .complete(&key, t, &response(b"a"), ms(5_000))
        .await
        .expect("complete");
    store.remove(&key).await.expect("remove");
    let t = acquire(&store, &req(&key, 1000, 5_000)).await;
    store
        .complete(&key, t, &response(b"a"), ms(5_000))
        .await
        .expect("complete");
    // a lease left to run out, nobody around
    acquire(&store, &req(&k("abandoned"), 16, 16)).await;
    // completed, expired, re-claimed in its slot, completed
    let key = k("expired-reclaimed");
    let t = acquire(&store, &req(&key, 16, 16)).await;
    store
        .complete(&key, t, &response(b"a"), ms(16))
        .await
        .expect("complete");
    clock.advance(48);
    let t = acquire(&store, &req(&key, 1000, 5_000)).await;
    store
        .complete(&key, t, &response(b"a"), ms(5_000))
        .await
        .expect("complete");
    // the reconcile route's lease ran out: a claim makes it uncertain, then resolved applied
    clock.advance(32);
    let key = k("resolved-applied");
    match store.claim(&reconcile_req(&key, 16, 5_000)).await {
        Ok(Claim::Existing { record, .. }) => {
            assert_eq!(record.status, RecordStatus::NeedsReconciliation);
            store
                .resolve(
                    &key,
                    record.lease_token,
                    &Resolution::Applied(Box::new(response(b"ok"))),
                    ms(5_000),
                    Some("found"),
                )
                .await
                .expect("resolve");
        }
        other => panic!("uncertain: {other:?}"),
    }
    assert_eq!(store.len(), 7);
    clock.advance(10_000);
    let purged = store.purge_expired().await.expect("purge");
    assert_eq!((purged, store.len()), (7, 0), "every settled record went");
    assert_eq!(store.bytes(), 0);
}

/// Nobody calls purge_expired: claims alone take expired records away, also those of a
/// shard whose records only ever get re-completed or released and taken over.
#[tokio::test]
async fn claims_alone_keep_a_store_bounded_by_what_lives() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    for round in 0..20u64 {
        for i in 0..2_000u64 {
            let key = ScopedKey::new("churn", format!("{round}-{i}"));
            let t = acquire(&store, &req(&key, 1000, 16)).await;
            if i % 3 == 0 {
                store.release(&key, t).await.expect("release");
            } else {
                store
                    .complete(&key, t, &response(b"x"), ms(16))
                    .await
                    .expect("complete");
            }
        }
        clock.advance(2_000);
    }
    // 40 000 records written, each expired 2 s after; claims purge 2 each.
    assert!(
        store.len() <= 4_000,
        "claims keep the store near what lives: {} held",
        store.len()
    );
}

/// A clock stepped back an hour below the store's start: records written then expire by that
/// clock and are purged; a record written before the step is not purged early, and goes once
/// the clock passes its expiry again.
#[tokio::test]
async fn a_clock_stepped_back_below_the_start_neither_leaks_nor_purges_early() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    let before = ScopedKey::new("t", "before");
    let t = acquire(&store, &req(&before, 1000, 100_000)).await;
    store
        .complete(&before, t, &response(b"b"), ms(100_000))
        .await
        .expect("complete");
    clock.advance(-3_600_000);
    let back = ScopedKey::new("t", "back");
    let t = acquire(&store, &req(&back, 1000, 10_000)).await;
    store
        .complete(&back, t, &response(b"k"), ms(10_000))
        .await
        .expect("complete");
    let abandoned = ScopedKey::new("t", "abandoned");
    acquire(&store, &req(&abandoned, 1000, 10_000)).await;
    // Purges before anything expires take nothing.
    for _ in 0..3 {
        assert_eq!(store.purge_expired().await.expect("purge"), 0);
        clock.advance(16);
    }
    assert_eq!(store.len(), 3);
    assert!(store.lookup(&back).await.expect("lookup").is_some());
    clock.advance(20_000);
    assert_eq!(
        store.purge_expired().await.expect("purge"),
        2,
        "both expired"
    );
    assert_eq!(store.len(), 1);
    assert!(store.lookup(&before).await.expect("lookup").is_some());
    clock.advance(3_700_000);
    assert_eq!(store.purge_expired().await.expect("purge"), 1);
    assert_eq!((store.len(), store.bytes()), (0, 0));
}

/// A hot key whose attempts keep failing retryably (release, takeover, release, ...) within its
/// TTL is one record: what the store keeps for it must not grow with the number of attempts
/// (DESIGN §5: every store bounds what it keeps).
#[tokio::test]
async fn a_hot_key_released_and_retried_keeps_memory_bounded() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    let key = ScopedKey::new("hot", "key");
    // Warm up (table, slab, history at its cap).
    let mut t = acquire(&store, &req(&key, 1000, 24 * 3600 * 1000)).await;
    for _ in 0..1_000 {
        store.release(&key, t).await.expect("release");
        t = acquire(&store, &req(&key, 1000, 24 * 3600 * 1000)).await;
    }
    let region = Region::new(GLOBAL);
    let bytes = store.bytes();
    for i in 0..400_000u32 {
        store.release(&key, t).await.expect("release");
        t = acquire(&store, &req(&key, 1000, 24 * 3600 * 1000)).await;
        if i % 1000 == 0 {
            clock.advance(1);
        }
    }
    let grown = live_heap(&region);
    assert_eq!(store.len(), 1);
    assert_eq!(
        store.bytes(),
        bytes,
        "the record itself stays the same size"
    );
    assert!(
        grown < 256 * 1024,
        "400 000 attempts on one key kept {grown} more bytes allocated"
    );
}

/// Same for a holder that re-completes its record (allowed) over and over.
#[tokio::test]
async fn re_completing_one_record_keeps_memory_bounded() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    let key = ScopedKey::new("hot", "recomplete");
    let t = acquire(&store, &req(&key, 1000, 1000)).await;
    for _ in 0..300 {
        store
            .complete(&key, t, &response(b"x"), ms(24 * 3600 * 1000))
            .await
            .expect("complete");
        clock.advance(1);
    }
    let region = Region::new(GLOBAL);
    for _ in 0..200_000 {
        store
            .complete(&key, t, &response(b"x"), ms(24 * 3600 * 1000))
            .await
            .expect("complete");
        clock.advance(1);
    }
    let grown = live_heap(&region);
    assert_eq!(store.len(), 1);
    assert!(
        grown < 256 * 1024,
        "200 000 re-completions of one record kept {grown} more bytes allocated"
    );
}

/// After a burst, a purge leaves each shard far below its peak but not empty (a few records
/// live on, as uncertain ones do until someone resolves them): what the store keeps allocated
/// must come back down near what its live records weigh, not stay at the burst's peak.
#[tokio::test]
async fn a_store_far_below_its_peak_gives_memory_back() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    let region = Region::new(GLOBAL);
    // Records that stay: enough that every shard keeps some.
    for i in 0..2_000 {
        let key = ScopedKey::new("stays", format!("k{i}"));
        let t = acquire(&store, &req(&key, 1000, 1000)).await;
        store.mark_uncertain(&key, t).await.expect("mark");
    }
    let steady = live_heap(&region);
    // A burst of short-lived records.
    for i in 0..300_000 {
        let key = ScopedKey::new("burst", format!("k{i}"));
        let t = acquire(&store, &req(&key, 16, 16)).await;
        store
            .complete(&key, t, &response(b"x"), ms(16))
            .await
            .expect("complete");
    }
    let peak = live_heap(&region);
    clock.advance(1_000);
    assert_eq!(store.purge_expired().await.expect("purge"), 300_000);
    assert_eq!(store.len(), 2_000);
    let after = live_heap(&region);
    assert!(
        after < steady + 4 * 1024 * 1024,
        "2 000 live records ({} bytes counted) keep {after} bytes allocated after the purge \
         ({steady} before the burst, {peak} at its peak)",
        store.bytes()
    );
}

/// The byte bound refuses a new key once the records weigh it, and takes one again once the
/// record that filled it is gone.
#[tokio::test]
async fn the_byte_bound_refuses_then_admits_again() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store().max_bytes(1);
    let a = ScopedKey::new("b", "a");
    let b = ScopedKey::new("b", "b");
    let t = acquire(&store, &req(&a, 1000, 16)).await;
    assert!(matches!(
        store.claim(&req(&b, 1000, 16)).await,
        Err(StoreError::Full)
    ));
    // The key already claimed records its outcome.
    store
        .complete(&a, t, &response(b"ok"), ms(16))
        .await
        .expect("complete");
    clock.advance(32);
    acquire(&store, &req(&b, 1000, 16)).await;
    assert_eq!(store.len(), 1);
    assert!(store.lookup(&a).await.expect("lookup").is_none());
    store.remove(&b).await.expect("remove");
    assert_eq!((store.len(), store.bytes()), (0, 0));
}

// ---------------------------------------------------------------------------------------------
// Histories.

/// A first attempt that records milestones, renews and completes, each at its own time: every
/// event dated when it happened, signed by the attempt's token, attempt 1.
#[tokio::test]
async fn history_of_one_attempt_dates_each_event() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    let key = ScopedKey::new("h", "one");
    let t0 = clock.now();
    let tok = acquire(&store, &req(&key, 1000, 10_000)).await;
    clock.advance(5);
    let t1 = clock.now();
    store
        .record_milestone(&key, tok, &Milestone::EffectStarted)
        .await
        .expect("milestone");
    clock.advance(5);
    store.renew(&key, tok, ms(1000)).await.expect("renew");
    clock.advance(5);
    let t3 = clock.now();
    store
        .record_milestone(&key, tok, &Milestone::DownstreamId("ch_9".into()))
        .await
        .expect("milestone");
    clock.advance(5);
    let t4 = clock.now();
    store
        .complete(&key, tok, &response(b"ok"), ms(10_000))
        .await
        .expect("complete");
    let r = record(&store, &key).await;
    assert_eq!(
        r.history,
        vec![
            entry(1, tok, t0, HistoryEvent::Claimed),
            entry(1, tok, t1, HistoryEvent::EffectStarted),
            entry(1, tok, t3, HistoryEvent::DownstreamId),
            entry(1, tok, t4, HistoryEvent::Completed),
        ]
    );
    assert_eq!(r.downstream_id.as_deref(), Some("ch_9"));
    assert_eq!(r.updated_at, t4);
    assert_eq!(r.created_at, t0);
}

/// The simplest record (claim, then one event) after a renewal at another time: the event
/// keeps its own time, not the renewal's.
#[tokio::test]
async fn history_event_keeps_its_time_across_a_later_renewal_and_refusal() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    let key = ScopedKey::new("h", "renewed");
    let t0 = clock.now();
    let tok = acquire(&store, &req(&key, 1000, 10_000)).await;
    clock.advance(3);
    let t1 = clock.now();
    store
        .append_history(&key, HistoryEvent::Conflict)
        .await
        .expect("append");
    clock.advance(3);
    store.renew(&key, tok, ms(1000)).await.expect("renew");
    clock.advance(3);
    let t3 = clock.now();
    store
        .record_milestone(&key, tok, &Milestone::EffectStarted)
        .await
        .expect("milestone");
    let r = record(&store, &key).await;
    assert_eq!(
        r.history,
        vec![
            entry(1, tok, t0, HistoryEvent::Claimed),
            entry(1, tok, t1, HistoryEvent::Conflict),
            entry(1, tok, t3, HistoryEvent::EffectStarted),
        ]
    );
    // Claim, milestone at the claim's own ms, then a renewal later.
    let key = ScopedKey::new("h", "same-ms");
    let t0 = clock.now();
    let tok = acquire(&store, &req(&key, 1000, 10_000)).await;
    store
        .record_milestone(&key, tok, &Milestone::EffectStarted)
        .await
        .expect("milestone");
    clock.advance(7);
    store.renew(&key, tok, ms(1000)).await.expect("renew");
    clock.advance(7);
    let t2 = clock.now();
    store
        .complete(&key, tok, &response(b"ok"), ms(1000))
        .await
        .expect("complete");
    assert_eq!(
        record(&store, &key).await.history,
        vec![
            entry(1, tok, t0, HistoryEvent::Claimed),
            entry(1, tok, t0, HistoryEvent::EffectStarted),
            entry(1, tok, t2, HistoryEvent::Completed),
        ]
    );
}

/// Takeovers: after a lease runs out and after a release, each attempt's entries carry its own
/// token and number; the first claim keeps the first token.
#[tokio::test]
async fn history_across_takeovers_keeps_each_attempts_token() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    let key = ScopedKey::new("h", "takeovers");
    let t0 = clock.now();
    let a = acquire(&store, &req(&key, 10, 10_000)).await;
    clock.advance(20);
    let t1 = clock.now();
    let b = match store.claim(&req(&key, 1000, 10_000)).await {
        Ok(Claim::Acquired(lease)) => {
            assert_eq!(lease.attempt, 2);
            lease.token
        }
        other => panic!("takeover: {other:?}"),
    };
    clock.advance(5);
    let t2 = clock.now();
    assert_eq!(
        store.release(&key, b).await.expect("release"),
        RecordStatus::Released
    );
    clock.advance(5);
    let t3 = clock.now();
    let c = acquire(&store, &req(&key, 1000, 10_000)).await;
    clock.advance(5);
    let t4 = clock.now();
    store
        .complete(&key, c, &response(b"ok"), ms(10_000))
        .await
        .expect("complete");
    // The old holders are fenced.
    assert!(matches!(
        store.complete(&key, a, &response(b"late"), ms(1)).await,
        Err(StoreError::Fenced)
    ));
    let r = record(&store, &key).await;
    assert_eq!(r.attempts, 3);
    assert_eq!(
        r.history,
        vec![
            entry(1, a, t0, HistoryEvent::Claimed),
            entry(2, b, t1, HistoryEvent::Claimed),
            entry(2, b, t2, HistoryEvent::Released),
            entry(3, c, t3, HistoryEvent::Claimed),
            entry(3, c, t4, HistoryEvent::Completed),
        ]
    );
}

/// A reconcile route's lease runs out, a claim marks it uncertain, a resolution settles it: the
/// history names the holder for the expiry and the resolution's new token for the resolution,
/// and the first claim keeps the holder's token.
#[tokio::test]
async fn history_of_a_lease_expiry_and_resolution() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    let key = ScopedKey::new("h", "reconciled");
    let t0 = clock.now();
    let a = acquire(&store, &reconcile_req(&key, 10, 10_000)).await;
    clock.advance(20);
    let t1 = clock.now();
    match store.claim(&reconcile_req(&key, 10, 10_000)).await {
        Ok(Claim::Existing { record, .. }) => {
            assert_eq!(record.status, RecordStatus::NeedsReconciliation)
        }
        other => panic!("uncertain: {other:?}"),
    }
    clock.advance(20);
    let t2 = clock.now();
    store
        .resolve(
            &key,
            a,
            &Resolution::NotApplied,
            ms(10_000),
            Some("nothing"),
        )
        .await
        .expect("resolve");
    let r = record(&store, &key).await;
    assert_ne!(r.lease_token, a, "a resolution takes a new token");
    let fresh = r.lease_token;
    assert_eq!(r.resolution_note.as_deref(), Some("nothing"));
    assert_eq!(
        r.history,
        vec![
            entry(1, a, t0, HistoryEvent::Claimed),
            entry(1, a, t1, HistoryEvent::LeaseExpired),
            entry(1, fresh, t2, HistoryEvent::ReconciledNotApplied),
        ]
    );
    // The released record is taken over as attempt 2.
    clock.advance(20);
    let t3 = clock.now();
    let b = match store.claim(&req(&key, 1000, 10_000)).await {
        Ok(Claim::Acquired(lease)) => {
            assert_eq!(lease.attempt, 2);
            lease.token
        }
        other => panic!("takeover: {other:?}"),
    };
    let r = record(&store, &key).await;
    assert_eq!(r.history.len(), 4);
    assert_eq!(r.history[3], entry(2, b, t3, HistoryEvent::Claimed));
    assert_eq!(r.history[0], entry(1, a, t0, HistoryEvent::Claimed));
}

/// A resolution (applied) of a record marked uncertain in the same millisecond as its claim.
#[tokio::test]
async fn history_of_a_resolution_in_the_claims_millisecond() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    let key = ScopedKey::new("h", "same-ms-resolve");
    let t0 = clock.now();
    let a = acquire(&store, &req(&key, 1000, 10_000)).await;
    store.mark_uncertain(&key, a).await.expect("mark");
    store
        .resolve(
            &key,
            a,
            &Resolution::Applied(Box::new(response(b"ok"))),
            ms(10_000),
            None,
        )
        .await
        .expect("resolve");
    let r = record(&store, &key).await;
    let fresh = r.lease_token;
    assert_ne!(fresh, a);
    assert_eq!(
        r.history,
        vec![
            entry(1, a, t0, HistoryEvent::Claimed),
            entry(1, a, t0, HistoryEvent::NeedsReconciliation),
            entry(1, fresh, t0, HistoryEvent::ReconciledApplied),
        ]
    );
}

/// An expired record claimed again starts a new history (attempt 1, the new token), and a
/// record removed and claimed again too.
#[tokio::test]
async fn history_restarts_for_an_expired_or_removed_record() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    let key = ScopedKey::new("h", "restart");
    let a = acquire(&store, &req(&key, 16, 16)).await;
    store
        .record_milestone(&key, a, &Milestone::DownstreamId("d".into()))
        .await
        .expect("milestone");
    store
        .complete(&key, a, &response(b"ok"), ms(16))
        .await
        .expect("complete");
    clock.advance(100);
    let t1 = clock.now();
    let b = acquire(&store, &req(&key, 1000, 10_000)).await;
    let r = record(&store, &key).await;
    assert_eq!(r.history, vec![entry(1, b, t1, HistoryEvent::Claimed)]);
    assert_eq!(
        r.downstream_id, None,
        "nothing of the expired record survives"
    );
    assert_eq!(r.response, None);
    store.remove(&key).await.expect("remove");
    clock.advance(5);
    let t2 = clock.now();
    let c = acquire(&store, &req(&key, 1000, 10_000)).await;
    let r = record(&store, &key).await;
    assert_eq!(r.history, vec![entry(1, c, t2, HistoryEvent::Claimed)]);
}

/// Histories are capped: milestones beyond HISTORY_LIMIT replace the last entry (the outcome
/// is always last), refusals stop at HISTORY_REFUSALS, and the weight returns to zero.
#[tokio::test]
async fn history_caps_hold_and_keep_the_latest_event() {
    let _serial = serial().await;
    let clock = Clock::new();
    let store = clock.store();
    let key = ScopedKey::new("h", "capped");
    let refusals = ScopedKey::new("h", "refusals");
    let tok = acquire(&store, &req(&key, 100_000, 100_000)).await;
    for i in 0..HISTORY_LIMIT + 50 {
        clock.advance(1);
        store
            .record_milestone(&key, tok, &Milestone::DownstreamId(format!("d{i}")))
            .await
            .expect("milestone");
    }
    clock.advance(1);
    let done = clock.now();
    store
        .complete(&key, tok, &response(b"ok"), ms(100_000))
        .await
        .expect("complete");
    let r = record(&store, &key).await;
    assert_eq!(r.history.len(), HISTORY_LIMIT);
    assert_eq!(r.history[0].event, HistoryEvent::Claimed);
    assert_eq!(
        *r.history.last().expect("last"),
        entry(1, tok, done, HistoryEvent::Completed)
    );
    let r2 = acquire(&store, &req(&refusals, 100_000, 100_000)).await;
    for _ in 0..HISTORY_REFUSALS * 3 {
        clock.advance(1);
        store
            .append_history(&refusals, HistoryEvent::Conflict)
            .await
            .expect("append");
    }
    clock.advance(1);
    store
        .complete(&refusals, r2, &response(b"ok"), ms(100_000))
        .await
        .expect("complete");
    let r = record(&store, &refusals).await;
    assert_eq!(r.history.len(), HISTORY_REFUSALS + 1);
    assert_eq!(
        r.history.last().expect("last").event,
        HistoryEvent::Completed
    );
    store.remove(&key).await.expect("remove");
    store.remove(&refusals).await.expect("remove");
    assert_eq!((store.len(), store.bytes()), (0, 0));
}

// ---------------------------------------------------------------------------------------------
// Concurrency.

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Eight tasks released through a barrier claim the same 3 000 keys in different orders: each
/// key is acquired exactly once, the store holds 3 000 records; then they complete, purge and
/// remove at once, and nothing is left counted.
#[test]
fn concurrent_claims_acquire_each_key_once_and_counts_end_exact() {
    let _serial = serial_blocking();
    runtime().block_on(async {
        let clock = Clock::new();
        let store = clock.store();
        const KEYS: usize = 3000;
        const TASKS: usize = 8;
        let keys: Arc<Vec<ScopedKey>> = Arc::new(
            (0..KEYS)
                .map(|i| ScopedKey::new(format!("{}", i % 3), format!("key-{i}")))
                .collect(),
        );
        let won: Arc<Vec<AtomicUsize>> = Arc::new((0..KEYS).map(|_| AtomicUsize::new(0)).collect());
        let tokens: Arc<Mutex<HashMap<usize, FencingToken>>> = Arc::default();
        let barrier = Arc::new(tokio::sync::Barrier::new(TASKS));
        let mut tasks = Vec::new();
        for t in 0..TASKS {
            let (store, keys, won, tokens, barrier) = (
                store.clone(),
                keys.clone(),
                won.clone(),
                tokens.clone(),
                barrier.clone(),
            );
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                for n in 0..KEYS {
                    let i = (n * (2 * t + 1) + t * 97) % KEYS;
                    match store.claim(&req(&keys[i], 60_000, 60_000)).await {
                        Ok(Claim::Acquired(lease)) => {
                            won[i].fetch_add(1, Ordering::SeqCst);
                            tokens.lock().unwrap().insert(i, lease.token);
                        }
                        Ok(Claim::Existing { .. } | Claim::Completed { .. }) => {}
                        Err(e) => panic!("claim: {e}"),
                    }
                }
            }));
        }
        guarded("claims", async {
            for task in tasks {
                task.await.expect("task");
            }
        })
        .await;
        for (i, n) in won.iter().enumerate() {
            assert_eq!(n.load(Ordering::SeqCst), 1, "key {i} acquired once");
        }
        assert_eq!(store.len(), KEYS);

        // Complete half (short TTL), release a quarter, leave the rest; purge and remove
        // concurrently.
        let tokens = Arc::new(tokens.lock().unwrap().clone());
        let barrier = Arc::new(tokio::sync::Barrier::new(4));
        let mut tasks = Vec::new();
        for t in 0..2 {
            let (store, keys, tokens, barrier) =
                (store.clone(), keys.clone(), tokens.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                for i in (t..KEYS).step_by(2) {
                    let tok = tokens[&i];
                    if i % 4 < 2 {
                        store
                            .complete(&keys[i], tok, &response(b"done"), ms(16))
                            .await
                            .expect("complete");
                    } else if i % 4 == 2 {
                        store.release(&keys[i], tok).await.expect("release");
                    }
                }
            }));
        }
        {
            let (store, barrier, clock) = (store.clone(), barrier.clone(), clock.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                for _ in 0..200 {
                    clock.advance(1);
                    store.purge_expired().await.expect("purge");
                    tokio::task::yield_now().await;
                }
            }));
        }
        {
            let (store, keys, barrier) = (store.clone(), keys.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                for i in (0..KEYS).filter(|i| i % 4 == 3) {
                    assert!(store.remove(&keys[i]).await.expect("remove"));
                }
            }));
        }
        guarded("settling", async {
            for task in tasks {
                task.await.expect("task");
            }
        })
        .await;
        // Released records live their TTL (60 s), completed ones 16 ms.
        clock.advance(120_000);
        store.purge_expired().await.expect("purge");
        assert_eq!(store.len(), 0, "everything expired or was removed");
        assert_eq!(store.bytes(), 0, "nothing left weighed");
    });
}

/// Tasks churn on shared keys (claim, complete or release or remove, re-claim after expiry)
/// while another moves the clock and purges, and a Sweeper runs its passes: every moment, one
/// holder per key at most; at the end, everything expired and nothing is left counted.
#[test]
fn churn_with_purges_and_a_sweeper_ends_with_exact_counts() {
    let _serial = serial_blocking();
    runtime().block_on(async {
        let clock = Clock::new();
        let store = clock.store();
        const KEYS: u64 = 400;
        const TASKS: usize = 6;
        let holders: Arc<Vec<AtomicUsize>> =
            Arc::new((0..KEYS).map(|_| AtomicUsize::new(0)).collect());
        let barrier = Arc::new(tokio::sync::Barrier::new(TASKS + 2));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut tasks = Vec::new();
        for t in 0..TASKS {
            let (store, holders, barrier) = (store.clone(), holders.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((t as u64 + 1) * 0x1234_5678));
                barrier.wait().await;
                for _ in 0..6_000 {
                    let i = rng.next(KEYS);
                    let key = ScopedKey::new("churn", format!("k{i}"));
                    let claim = store
                        .claim(&req(&key, 24 * 3600 * 1000, 16 * (1 + rng.next(4))))
                        .await
                        .expect("claim");
                    let Claim::Acquired(lease) = claim else {
                        continue;
                    };
                    let n = holders[i as usize].fetch_add(1, Ordering::SeqCst);
                    assert_eq!(n, 0, "two holders of key {i} at once");
                    tokio::task::yield_now().await;
                    holders[i as usize].fetch_sub(1, Ordering::SeqCst);
                    match rng.next(4) {
                        0 => {
                            store.release(&key, lease.token).await.expect("release");
                        }
                        1 => {
                            store.remove(&key).await.expect("remove");
                        }
                        _ => store
                            .complete(&key, lease.token, &response(b"ok"), ms(16 * rng.next(4)))
                            .await
                            .expect("complete"),
                    }
                }
            }));
        }
        let purger = {
            let (store, barrier, clock, stop) =
                (store.clone(), barrier.clone(), clock.clone(), stop.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                while !stop.load(Ordering::SeqCst) {
                    clock.advance(16);
                    store.purge_expired().await.expect("purge");
                    tokio::task::yield_now().await;
                }
            })
        };
        let sweeper = {
            let (store, barrier, stop) = (store.clone(), barrier.clone(), stop.clone());
            tokio::spawn(async move {
                let sweeper = Sweeper::new(store, Settles);
                barrier.wait().await;
                while !stop.load(Ordering::SeqCst) {
                    sweeper.run_once().await.expect("pass");
                    tokio::task::yield_now().await;
                }
            })
        };
        guarded("churn", async {
            for task in tasks {
                task.await.expect("task");
            }
        })
        .await;
        stop.store(true, Ordering::SeqCst);
        guarded("purger and sweeper", async {
            purger.await.expect("purger");
            sweeper.await.expect("sweeper");
        })
        .await;
        // Leases were a day and TTLs at most 64 ms: ten days later nothing lives.
        clock.advance(10 * 24 * 3600 * 1000);
        let held = store.len();
        let purged = store.purge_expired().await.expect("purge");
        assert_eq!(held as u64, purged, "the last purge took all that was held");
        assert_eq!((store.len(), store.bytes()), (0, 0), "nothing left counted");
    });
}

#[derive(Clone)]
struct Settles;

impl Reconciler for Settles {
    async fn reconcile(&self, _record: &Record) -> Reconciliation {
        Reconciliation::Applied(Box::new(response(b"settled")))
    }
}

/// Uncertain records made while a Sweeper resolves them and claims go on: every one ends
/// resolved, none is lost or counted twice, and once their TTL passes they are all purged.
#[test]
fn a_sweeper_resolving_while_claims_go_on_loses_nothing() {
    let _serial = serial_blocking();
    runtime().block_on(async {
        let clock = Clock::new();
        let store = clock.store();
        const PER_TASK: usize = 1_500;
        const TASKS: usize = 4;
        let barrier = Arc::new(tokio::sync::Barrier::new(TASKS + 1));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut tasks = Vec::new();
        for t in 0..TASKS {
            let (store, barrier) = (store.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                for i in 0..PER_TASK {
                    let key = ScopedKey::new(format!("t{t}"), format!("u{i}"));
                    let tok = acquire(&store, &req(&key, 60_000, 60_000)).await;
                    store
                        .record_milestone(&key, tok, &Milestone::EffectStarted)
                        .await
                        .expect("milestone");
                    assert_eq!(
                        store.release(&key, tok).await.expect("release"),
                        RecordStatus::NeedsReconciliation
                    );
                    // Claims of other keys go on.
                    let other = ScopedKey::new(format!("t{t}"), format!("c{i}"));
                    let tok = acquire(&store, &req(&other, 60_000, 60_000)).await;
                    store
                        .complete(&other, tok, &response(b"x"), ms(60_000))
                        .await
                        .expect("complete");
                }
            }));
        }
        let sweeper = {
            let (store, barrier, stop) = (store.clone(), barrier.clone(), stop.clone());
            tokio::spawn(async move {
                let sweeper = Sweeper::new(store, Settles).batch(50).ttl(ms(60_000));
                barrier.wait().await;
                while !stop.load(Ordering::SeqCst) {
                    sweeper.run_once().await.expect("pass");
                    tokio::task::yield_now().await;
                }
                // Finish what is left.
                for _ in 0..1000 {
                    let report = sweeper.run_once().await.expect("pass");
                    if report.awaiting == 0 {
                        break;
                    }
                }
            })
        };
        guarded("claims", async {
            for task in tasks {
                task.await.expect("task");
            }
        })
        .await;
        stop.store(true, Ordering::SeqCst);
        guarded("sweeper", async { sweeper.await.expect("sweeper") }).await;
        assert_eq!(store.len(), 2 * TASKS * PER_TASK);
        for t in 0..TASKS {
            for i in 0..PER_TASK {
                let key = ScopedKey::new(format!("t{t}"), format!("u{i}"));
                let r = record(&store, &key).await;
                assert_eq!(r.status, RecordStatus::Completed, "{key:?}");
            }
        }
        clock.advance(120_000);
        assert_eq!(
            store.purge_expired().await.expect("purge"),
            (2 * TASKS * PER_TASK) as u64
        );
        assert_eq!((store.len(), store.bytes()), (0, 0));
    });
}

/// A purge and a claim of the same expired key race, many times: the claim always wins the key
/// as a new first attempt, and exactly one record is left.
#[test]
fn a_purge_racing_a_claim_of_the_same_expired_key() {
    let _serial = serial_blocking();
    runtime().block_on(async {
        let clock = Clock::new();
        let store = clock.store();
        guarded("race", async {
            for round in 0..1_500u32 {
                let key = ScopedKey::new("race", format!("k{}", round % 50));
                // Fill the shard's due index with others expiring at the same time.
                let tok = match store.claim(&req(&key, 16, 16)).await.expect("claim") {
                    Claim::Acquired(lease) => lease.token,
                    other => panic!("round {round}: the key was left live: {other:?}"),
                };
                store
                    .complete(&key, tok, &response(b"ok"), ms(16))
                    .await
                    .expect("complete");
                clock.advance(2_048);
                let barrier = Arc::new(tokio::sync::Barrier::new(2));
                let purge = {
                    let (store, barrier) = (store.clone(), barrier.clone());
                    tokio::spawn(async move {
                        barrier.wait().await;
                        store.purge_expired().await.expect("purge")
                    })
                };
                let claim = {
                    let (store, barrier, key) = (store.clone(), barrier.clone(), key.clone());
                    tokio::spawn(async move {
                        barrier.wait().await;
                        store.claim(&req(&key, 16, 16)).await.expect("claim")
                    })
                };
                purge.await.expect("purge");
                let lease = match claim.await.expect("claim") {
                    Claim::Acquired(lease) => lease,
                    other => panic!("round {round}: an expired record was served: {other:?}"),
                };
                assert_eq!(lease.attempt, 1);
                let r = record(&store, &key).await;
                assert_eq!(r.lease_token, lease.token);
                assert_eq!(r.history.len(), 1);
                // Settle it so the next round of this key re-claims an expired record.
                store
                    .complete(&key, lease.token, &response(b"ok"), ms(16))
                    .await
                    .expect("complete");
                clock.advance(2_048);
            }
        })
        .await;
        clock.advance(100_000);
        store.purge_expired().await.expect("purge");
        assert_eq!((store.len(), store.bytes()), (0, 0));
    });
}

/// Many tasks append refusals, renew and read one hot in-progress record while its holder
/// records milestones: the byte count stays consistent (back to zero once removed) and the
/// history is capped.
#[test]
fn concurrent_refusals_on_one_hot_record_keep_weight_consistent() {
    let _serial = serial_blocking();
    runtime().block_on(async {
        let clock = Clock::new();
        let store = clock.store();
        let key = ScopedKey::new("hot", "refusals");
        let tok = acquire(&store, &req(&key, 600_000, 600_000)).await;
        let barrier = Arc::new(tokio::sync::Barrier::new(5));
        let mut tasks = Vec::new();
        for t in 0..4 {
            let (store, key, barrier, clock) =
                (store.clone(), key.clone(), barrier.clone(), clock.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                for i in 0..2_000 {
                    if t == 0 && i % 7 == 0 {
                        clock.advance(1);
                    }
                    store
                        .append_history(&key, HistoryEvent::Conflict)
                        .await
                        .expect("append");
                    let _ = store.lookup(&key).await.expect("lookup");
                }
            }));
        }
        {
            let (store, key, barrier) = (store.clone(), key.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                for i in 0..500 {
                    store
                        .record_milestone(&key, tok, &Milestone::DownstreamId(format!("d{i}")))
                        .await
                        .expect("milestone");
                    store.renew(&key, tok, ms(600_000)).await.expect("renew");
                }
            }));
        }
        guarded("refusals", async {
            for task in tasks {
                task.await.expect("task");
            }
        })
        .await;
        let r = record(&store, &key).await;
        assert!(r.history.len() <= HISTORY_LIMIT);
        assert_eq!(r.history[0].event, HistoryEvent::Claimed);
        assert_eq!(r.history[0].token, tok);
        assert!(store.remove(&key).await.expect("remove"));
        assert_eq!((store.len(), store.bytes()), (0, 0));
    });
}
