//! Review of two MemoryStore changes, written to break them:
//!
//! - fccbc32 (`src/store/memory/mod.rs`, `src/key.rs`): `MemoryStore::hash_of` remembers, per
//!   thread, the last key it hashed (store id, a clone of the key, the keyed hash); a hit needs
//!   the same store and `ScopedKey::is_clone_of` (the same allocation, the same split).
//! - f7e9333 / 2765c7c (`src/store/memory/entry.rs`): the record keeps the fingerprint's
//!   `body_as_sent` hint in a flag bit; `recorded_fingerprint_now` and `completed_now` read it.
//!
//! The worst outcomes for an idempotency store are a claim that misses an existing record (the
//! handler runs twice for one key) and a read that finds another key's record (a response
//! replayed to the wrong key or tenant). Effects are counted at the sink: in a handler, or by
//! counting `Claim::Acquired`, never inferred from answers. A wrong remembered hash would put a
//! record where a fresh allocation of its key does not look, so every scenario here reads and
//! claims each key through other allocations (equal bytes), clones, clones made on other
//! threads, and the same bytes split elsewhere between scope and key.

#![allow(clippy::needless_range_loop)] // the indexes name the store and the key in messages

use crate::common;

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use common::memory::Clock;
use common::{Effects, guard};
use futures_util::FutureExt;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::store::{
    Claim, ClaimRequest, FencingToken, Fingerprint, LeaseExpiry, Milestone, Record, RecordStatus,
    Resolution, ScopedKey, StoreError, StoredResponse, UncertainQuery,
};
use tower_idempotency::{IdempotencyLayer, IdempotencyStore, MemoryStore};

const HOUR: u64 = 3_600_000;

/// A memory store's answer, which never waits.
fn at_once<F: Future>(f: F) -> F::Output {
    f.now_or_never().expect("a MemoryStore answers at once")
}

fn fp(byte: u8, hint: bool) -> Fingerprint {
    Fingerprint::from_bytes([byte; 32]).with_body_as_sent(hint)
}

fn creq(
    key: &ScopedKey,
    fp_byte: u8,
    hint: bool,
    reconcile: bool,
    lease: u64,
    ttl: u64,
) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        fingerprint: fp(fp_byte, hint),
        lease: Duration::from_millis(lease),
        ttl: Duration::from_millis(ttl),
        on_lease_expiry: if reconcile {
            LeaseExpiry::Reconcile
        } else {
            LeaseExpiry::Reclaim
        },
    }
}

fn body_response(body: &str) -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: HeaderMap::new(),
        body: Some(bytes::Bytes::copy_from_slice(body.as_bytes())),
        trailers: None,
    }
}

fn body_of(response: &StoredResponse) -> String {
    String::from_utf8(response.body.as_deref().unwrap_or_default().to_vec()).expect("utf-8")
}

/// A fresh allocation of `key`'s bytes (never a clone).
fn fresh(key: &ScopedKey) -> ScopedKey {
    let fresh = ScopedKey::new(key.scope(), key.key());
    assert_ne!(
        fresh.scope().as_ptr(),
        key.scope().as_ptr(),
        "a new allocation"
    );
    fresh
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn bit(&mut self) -> bool {
        self.next() & 1 == 1
    }
}

/// Keys whose joined bytes are equal (`prefix` + "abc") but split at three places: three
/// records.
fn split_family(prefix: &str) -> Vec<ScopedKey> {
    let joined = format!("{prefix}abc");
    let n = joined.len();
    (1..=3)
        .map(|back| ScopedKey::new(&joined[..n - back], &joined[n - back..]))
        .collect()
}

// =============================================================================================
// Keys: allocations, splits, stores.
// =============================================================================================

/// DESIGN §1 step 2 and §2 (one record per scoped key; two principals never see each other's
/// records): keys with equal joined bytes split elsewhere ("ab"+"c", "a"+"bc", ""+"abc",
/// "abc"+"") are four records, and each key is the same record through its clones and through
/// other allocations of equal bytes, whatever order the thread hashes them in. Each logical
/// key is acquired exactly once; every read through every allocation finds its own record.
#[test]
fn s1_equal_bytes_split_elsewhere_or_reallocated_are_each_one_record() {
    let store = MemoryStore::new();
    let logical: Vec<(&str, &str)> = vec![
        ("ab", "c"),
        ("a", "bc"),
        ("", "abc"),
        ("abc", ""),
        ("tenant", "k-1"),
        ("tenan", "tk-1"),
        ("tenant-", "k-1"),
    ];
    let homes: Vec<ScopedKey> = logical.iter().map(|(s, k)| ScopedKey::new(s, k)).collect();
    let mut acquired = vec![0usize; logical.len()];
    let mut tokens = vec![None; logical.len()];
    // Three rounds of claims in an order that alternates allocations: the home key, a fresh
    // allocation, a clone, a neighbour split elsewhere between each.
    for round in 0..3 {
        for (i, home) in homes.iter().enumerate() {
            let forms = [home.clone(), fresh(home), home.clone()];
            for (f, key) in forms.iter().enumerate() {
                // A neighbour with the same joined bytes, hashed in between.
                let neighbour = &homes[(i + 1 + f) % homes.len()];
                let _ = at_once(store.lookup(neighbour)).expect("lookup");
                match at_once(store.claim(&creq(key, i as u8, false, false, HOUR, HOUR))) {
                    Ok(Claim::Acquired(lease)) => {
                        acquired[i] += 1;
                        tokens[i] = Some(lease.token);
                    }
                    Ok(Claim::Existing { record, .. }) => {
                        assert_eq!(
                            record.key, *home,
                            "round {round} form {f}: {:?}",
                            logical[i]
                        );
                        assert_eq!(record.key.scope(), logical[i].0);
                        assert_eq!(record.key.key(), logical[i].1);
                        assert_eq!(record.fingerprint, fp(i as u8, false), "its own record");
                    }
                    other => panic!("round {round} key {:?}: {other:?}", logical[i]),
                }
            }
        }
    }
    assert_eq!(
        acquired,
        vec![1; logical.len()],
        "each key acquired exactly once"
    );
    assert_eq!(store.len(), logical.len());
    for (i, home) in homes.iter().enumerate() {
        let body = format!("{}|{}", logical[i].0, logical[i].1);
        at_once(store.complete(
            &fresh(home),
            tokens[i].expect("token"),
            &body_response(&body),
            Duration::from_millis(HOUR),
        ))
        .expect("complete through another allocation");
    }
    for _ in 0..2 {
        for (i, home) in homes.iter().enumerate() {
            let body = format!("{}|{}", logical[i].0, logical[i].1);
            for key in [home.clone(), fresh(home)] {
                let Some(Ok(Claim::Completed {
                    fingerprint,
                    response,
                })) = store.completed_now(&key)
                else {
                    panic!("{:?} completed", logical[i]);
                };
                assert_eq!(fingerprint, fp(i as u8, false));
                assert_eq!(body_of(&response), body, "its own response");
                assert_eq!(
                    store.recorded_fingerprint_now(&key),
                    Some(fp(i as u8, false))
                );
                let record = at_once(store.lookup(&key))
                    .expect("lookup")
                    .expect("record");
                assert_eq!(record.key, *home);
                assert_eq!(body_of(record.response.as_ref().expect("response")), body);
                match at_once(store.claim(&creq(&key, i as u8, true, false, HOUR, HOUR))) {
                    Ok(Claim::Completed { response, .. }) => assert_eq!(body_of(&response), body),
                    other => panic!("{:?}: {other:?}", logical[i]),
                }
            }
        }
    }
    // Removing one split leaves its neighbours.
    assert!(at_once(store.remove(&homes[0])).expect("remove"));
    assert!(!at_once(store.remove(&fresh(&homes[0]))).expect("remove"));
    for (i, home) in homes.iter().enumerate().skip(1) {
        assert!(
            store.completed_now(&fresh(home)).is_some(),
            "{:?} stays",
            logical[i]
        );
    }
    assert!(store.completed_now(&homes[0]).is_none());
    assert!(store.recorded_fingerprint_now(&homes[0]).is_none());
}

/// DESIGN §5 (each store keeps its own records) and §1 (one execution per key): one key clone
/// used alternately with two stores on one thread is two records, never one store's hash in the
/// other; and stores made and dropped in a loop (their ids must never repeat) each start
/// empty, each acquire the remembered clone once, and each find it again through another
/// allocation (a stale remembered hash would put the record where a fresh hash does not look).
#[test]
fn s5_stores_used_alternately_and_stores_remade_never_share_a_hash() {
    let key = ScopedKey::new("tenant", "shared-key");
    let other = ScopedKey::new("tenant", "other-key");
    let a = MemoryStore::new();
    let b = MemoryStore::new();
    let ta = match at_once(a.claim(&creq(&key, 1, true, false, HOUR, HOUR))) {
        Ok(Claim::Acquired(l)) => l.token,
        other => panic!("a: {other:?}"),
    };
    // The same clone, straight after, in the other store.
    let tb = match at_once(b.claim(&creq(&key, 2, false, false, HOUR, HOUR))) {
        Ok(Claim::Acquired(l)) => l.token,
        other => panic!("b is its own store: {other:?}"),
    };
    at_once(a.complete(
        &key,
        ta,
        &body_response("from a"),
        Duration::from_millis(HOUR),
    ))
    .expect("a");
    assert!(b.completed_now(&key).is_none(), "b's record is in progress");
    assert_eq!(b.recorded_fingerprint_now(&key), None);
    at_once(b.complete(
        &key,
        tb,
        &body_response("from b"),
        Duration::from_millis(HOUR),
    ))
    .expect("b");
    for _ in 0..50 {
        for (store, body, fpb, hint) in [(&a, "from a", 1, true), (&b, "from b", 2, false)] {
            for k in [key.clone(), fresh(&key)] {
                let Some(Ok(Claim::Completed {
                    fingerprint,
                    response,
                })) = store.completed_now(&k)
                else {
                    panic!("completed");
                };
                assert_eq!(body_of(&response), body);
                assert_eq!(fingerprint.as_bytes(), &[fpb; 32]);
                assert_eq!(fingerprint.body_as_sent(), hint);
                let r = store.recorded_fingerprint_now(&k).expect("recorded");
                assert_eq!((r.as_bytes(), r.body_as_sent()), (&[fpb; 32], hint));
            }
            assert!(store.completed_now(&other).is_none());
        }
    }
    // Stores made and dropped: each new one is empty, its claims land where fresh hashes look.
    let mut acquired = 0;
    for round in 0..2_000u32 {
        let store = if round % 3 == 0 {
            MemoryStore::new()
        } else {
            let clock = Clock::new();
            clock.store()
        };
        // The clone this thread hashed last, for the dropped store (or for `a`/`b`).
        let first = if round % 2 == 0 {
            key.clone()
        } else {
            fresh(&key)
        };
        match at_once(store.claim(&creq(&first, 3, round % 2 == 0, false, HOUR, HOUR))) {
            Ok(Claim::Acquired(_)) => acquired += 1,
            other => panic!("round {round}: a new store is empty: {other:?}"),
        }
        let second = if round % 2 == 0 {
            fresh(&key)
        } else {
            key.clone()
        };
        match at_once(store.claim(&creq(&second, 3, false, false, HOUR, HOUR))) {
            Ok(Claim::Existing { record, .. }) => assert_eq!(record.key, key),
            other => panic!("round {round}: the same key twice in one store: {other:?}"),
        }
        assert_eq!(store.len(), 1);
        assert!(
            at_once(store.lookup(&fresh(&key)))
                .expect("lookup")
                .is_some()
        );
        assert!(
            at_once(store.remove(&key)).expect("remove"),
            "round {round}"
        );
        // Alternate with a long-lived store on the same clone.
        assert!(a.completed_now(&key).is_some());
    }
    assert_eq!(acquired, 2_000);
}

/// DESIGN §2 (a record is its key's): a key whose every clone was dropped, followed by keys of
/// the same length (which the allocator places at the freed address), each get their own
/// record. No reuse ever finds the earlier key's hash: every key is acquired once, and found
/// again through a fresh allocation.
/// Since session 19 the thread remembers its last key's bytes, not a clone of the key (which
/// kept the allocation, and the heap around it, alive): a freed key's address is taken by the
/// next key while the thread still remembers the first, the case a memo by address would get
/// wrong. The scenario is checked to reach it.
#[test]
fn s2_a_freed_keys_address_taken_by_another_key_is_another_record() {
    let store = MemoryStore::new();
    let mut same_address_while_remembered = 0;
    for i in 0..3_000u32 {
        let a = ScopedKey::new("t", format!("key-{i:06}-a"));
        let addr_a = a.scope().as_ptr() as usize;
        match at_once(store.claim(&creq(&a, 1, i % 2 == 0, false, HOUR, HOUR))) {
            Ok(Claim::Acquired(_)) => {}
            other => panic!("{i} a: {other:?}"),
        }
        drop(a);
        // Same length, other bytes: the allocator's first choice for its allocation is the one
        // just freed, if it was freed.
        let b = ScopedKey::new("t", format!("key-{i:06}-b"));
        if b.scope().as_ptr() as usize == addr_a {
            same_address_while_remembered += 1;
        }
        match at_once(store.claim(&creq(&b, 2, i % 3 == 0, false, HOUR, HOUR))) {
            Ok(Claim::Acquired(_)) => {}
            other => panic!("{i} b is new: {other:?}"),
        }
        // Now the thread remembers b, which sits where a was.
        let c = ScopedKey::new("t", format!("key-{i:06}-c"));
        match at_once(store.claim(&creq(&c, 3, false, false, HOUR, HOUR))) {
            Ok(Claim::Acquired(_)) => {}
            other => panic!("{i} c is new: {other:?}"),
        }
        for (suffix, byte) in [("a", 1u8), ("b", 2), ("c", 3)] {
            let k = ScopedKey::new("t", format!("key-{i:06}-{suffix}"));
            match at_once(store.claim(&creq(&k, byte, false, false, HOUR, HOUR))) {
                Ok(Claim::Existing { record, .. }) => {
                    assert_eq!(record.key, k, "{i}{suffix}: its own record");
                    assert_eq!(record.fingerprint.as_bytes(), &[byte; 32]);
                }
                other => panic!("{i}{suffix}: claimed twice: {other:?}"),
            }
        }
    }
    assert_eq!(store.len(), 9_000);
    // Nothing keeps a remembered key's allocation: the next key of its length takes it.
    assert!(
        same_address_while_remembered > 0,
        "a freed key's address was never taken while the thread remembered it: the scenario \
         did not reach the case"
    );
}

// =============================================================================================
// Threads.
// =============================================================================================

/// DESIGN §1 (one key, at most one execution) and §7.3 (N concurrent requests, exactly one
/// effect): 8 std threads, released through a barrier, claim the same 24 keys (three splits of
/// eight joined strings) in two stores, each thread through its own allocation, clones made on
/// other threads and its own clones, in a different order each. Each (store, key) is acquired
/// exactly once; each holder completes it with its own body through a clone made on another
/// thread; then every thread reads every key back and finds its own body.
#[test]
fn s1_threads_claiming_shared_keys_acquire_each_once() {
    const THREADS: usize = 8;
    let stores = [MemoryStore::new(), MemoryStore::new()];
    let keys: Vec<ScopedKey> = (0..8)
        .flat_map(|j| split_family(&format!("k{j}-")))
        .collect();
    let shared = Arc::new(keys.clone());
    let acquired: Arc<Vec<AtomicUsize>> =
        Arc::new((0..2 * keys.len()).map(|_| AtomicUsize::new(0)).collect());
    let barrier = Arc::new(Barrier::new(THREADS));
    let expected_body =
        |s: usize, i: usize, k: &ScopedKey| format!("{s}|{}|{}|{i}", k.scope(), k.key());
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (stores, shared, acquired, barrier) = (
                stores.clone(),
                shared.clone(),
                acquired.clone(),
                barrier.clone(),
            );
            std::thread::spawn(move || {
                let mut rng = Rng::new(t as u64 + 11);
                let own: Vec<ScopedKey> = shared.iter().map(fresh).collect();
                let mut held = Vec::new();
                barrier.wait();
                for _ in 0..4 {
                    for _ in 0..shared.len() * 2 {
                        let i = rng.below(shared.len());
                        let s = rng.below(2);
                        let key = match rng.below(3) {
                            0 => own[i].clone(),
                            1 => shared[i].clone(),
                            _ => fresh(&shared[i]),
                        };
                        match at_once(stores[s].claim(&creq(
                            &key,
                            i as u8,
                            rng.bit(),
                            false,
                            HOUR,
                            HOUR,
                        ))) {
                            Ok(Claim::Acquired(lease)) => {
                                acquired[s * shared.len() + i].fetch_add(1, Ordering::SeqCst);
                                held.push((s, i, lease.token));
                            }
                            Ok(Claim::Existing { record, .. }) => {
                                assert_eq!(record.key, shared[i], "thread {t}: its own record");
                                assert_eq!(record.fingerprint.as_bytes(), &[i as u8; 32]);
                            }
                            Ok(Claim::Completed {
                                fingerprint,
                                response,
                            }) => {
                                assert_eq!(fingerprint.as_bytes(), &[i as u8; 32]);
                                assert_eq!(body_of(&response), expected_body(s, i, &shared[i]));
                            }
                            Err(e) => panic!("{e:?}"),
                        }
                        // Complete some of what this thread holds, through a clone made on
                        // another thread.
                        if rng.below(4) == 0
                            && let Some((s, i, token)) = held.pop()
                        {
                            at_once(stores[s].complete(
                                &shared[i],
                                token,
                                &body_response(&expected_body(s, i, &shared[i])),
                                Duration::from_millis(HOUR),
                            ))
                            .expect("the holder completes");
                        }
                    }
                }
                for (s, i, token) in held {
                    at_once(stores[s].complete(
                        &own[i],
                        token,
                        &body_response(&expected_body(s, i, &shared[i])),
                        Duration::from_millis(HOUR),
                    ))
                    .expect("the holder completes");
                }
                barrier.wait();
                // Every key read back on every thread, through every form.
                for _ in 0..3 {
                    for s in 0..2 {
                        for i in 0..shared.len() {
                            for key in [own[i].clone(), shared[i].clone(), fresh(&shared[i])] {
                                let Some(Ok(Claim::Completed {
                                    response,
                                    fingerprint,
                                })) = stores[s].completed_now(&key)
                                else {
                                    panic!("thread {t}: {s}/{i} completed");
                                };
                                assert_eq!(body_of(&response), expected_body(s, i, &shared[i]));
                                assert_eq!(fingerprint.as_bytes(), &[i as u8; 32]);
                            }
                        }
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("thread");
    }
    let counts: Vec<usize> = acquired.iter().map(|a| a.load(Ordering::SeqCst)).collect();
    assert_eq!(
        counts,
        vec![1; 2 * keys.len()],
        "each (store, key) acquired exactly once"
    );
    for store in &stores {
        assert_eq!(store.len(), keys.len());
    }
}

/// DESIGN §1 and §7.3 on a multi-thread runtime: tasks move between worker threads at every
/// await, so a key's claim, completion and reads are hashed on different threads (whose
/// remembered keys are other tasks'). 256 tasks over 12 keys (four split families) and two
/// stores, and 64 blocking tasks: each (store, key) acquired once, each holder's completion
/// accepted, every later read on every thread finds the key's own body.
#[test]
fn s1_tasks_moving_between_workers_acquire_each_key_once() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .max_blocking_threads(8)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let stores = [MemoryStore::new(), MemoryStore::new()];
        let keys: Arc<Vec<ScopedKey>> = Arc::new(
            (0..4)
                .flat_map(|j| split_family(&format!("task{j}")))
                .collect(),
        );
        let effects: Arc<Vec<AtomicUsize>> =
            Arc::new((0..2 * keys.len()).map(|_| AtomicUsize::new(0)).collect());
        let body = |s: usize, k: &ScopedKey| format!("{s}:{}/{}", k.scope(), k.key());
        let mut tasks = Vec::new();
        for n in 0..256usize {
            let (stores, keys, effects) = (stores.clone(), keys.clone(), effects.clone());
            tasks.push(tokio::spawn(async move {
                let i = n % keys.len();
                let s = (n / keys.len()) % 2;
                let key = if n % 2 == 0 {
                    keys[i].clone()
                } else {
                    fresh(&keys[i])
                };
                tokio::task::yield_now().await;
                match stores[s]
                    .claim(&creq(&key, 9, n % 3 == 0, false, HOUR, HOUR))
                    .await
                {
                    Ok(Claim::Acquired(lease)) => {
                        // The sink: the handler's effect.
                        effects[s * keys.len() + i].fetch_add(1, Ordering::SeqCst);
                        for _ in 0..3 {
                            tokio::task::yield_now().await;
                            // Reads on whatever thread the task is on now.
                            let record =
                                stores[s].lookup(&key).await.expect("lookup").expect("held");
                            assert_eq!(record.key, keys[i]);
                            assert_eq!(record.lease_token, lease.token);
                        }
                        stores[s]
                            .complete(
                                &key,
                                lease.token,
                                &body_response(&body(s, &keys[i])),
                                Duration::from_millis(HOUR),
                            )
                            .await
                            .expect("complete");
                    }
                    Ok(Claim::Existing { record, .. }) => assert_eq!(record.key, keys[i]),
                    Ok(Claim::Completed { response, .. }) => {
                        assert_eq!(body_of(&response), body(s, &keys[i]))
                    }
                    Err(e) => panic!("{e:?}"),
                }
            }));
        }
        for n in 0..64usize {
            let (stores, keys) = (stores.clone(), keys.clone());
            tasks.push(tokio::task::spawn_blocking(move || {
                let i = n % keys.len();
                for s in 0..2 {
                    let key = fresh(&keys[i]);
                    match stores[s].completed_now(&key) {
                        Some(Ok(Claim::Completed { response, .. })) => {
                            assert_eq!(body_of(&response), body(s, &keys[i]))
                        }
                        Some(other) => panic!("{other:?}"),
                        None => {}
                    }
                    if let Some(r) = stores[s].recorded_fingerprint_now(&keys[i]) {
                        assert_eq!(r.as_bytes(), &[9; 32]);
                    }
                }
            }));
        }
        for t in tasks {
            guard("task", t).await.expect("task");
        }
        let counts: Vec<usize> = effects.iter().map(|a| a.load(Ordering::SeqCst)).collect();
        assert_eq!(
            counts,
            vec![1; 2 * keys.len()],
            "one effect per (store, key)"
        );
        // After: every key replays its own body, from tasks and from blocking threads.
        let mut checks = Vec::new();
        for n in 0..96usize {
            let (stores, keys) = (stores.clone(), keys.clone());
            let check = move || {
                let i = n % keys.len();
                for s in 0..2 {
                    match at_once(stores[s].claim(&creq(
                        &fresh(&keys[i]),
                        9,
                        false,
                        false,
                        HOUR,
                        HOUR,
                    ))) {
                        Ok(Claim::Completed { response, .. }) => {
                            assert_eq!(body_of(&response), body(s, &keys[i]))
                        }
                        other => panic!("{n}: {other:?}"),
                    }
                }
            };
            checks.push(if n % 2 == 0 {
                tokio::task::spawn_blocking(check)
            } else {
                tokio::spawn(async move { check() })
            });
        }
        for c in checks {
            c.await.expect("check");
        }
    });
}

// =============================================================================================
// A reference model.
// =============================================================================================

#[derive(Clone, Debug)]
struct ModelRecord {
    status: RecordStatus,
    fp: u8,
    hint: bool,
    token: FencingToken,
    effect: bool,
    attempts: u32,
    response: Option<String>,
}

/// Checks `record` (read from the store) against the model's.
fn check_record(what: &str, key: &ScopedKey, m: &ModelRecord, record: &Record) {
    assert_eq!(record.key, *key, "{what}: another key's record");
    assert_eq!(record.key.scope(), key.scope(), "{what}");
    assert_eq!(record.status, m.status, "{what}: status");
    assert_eq!(
        record.fingerprint.as_bytes(),
        &[m.fp; 32],
        "{what}: fingerprint"
    );
    assert_eq!(
        record.fingerprint.body_as_sent(),
        m.hint,
        "{what}: the hint"
    );
    assert_eq!(record.attempts, m.attempts, "{what}: attempts");
    assert_eq!(record.effect_started, m.effect, "{what}: effect_started");
    assert_eq!(record.lease_token, m.token, "{what}: token");
    assert_eq!(
        record.response.as_ref().map(body_of),
        m.response,
        "{what}: response"
    );
}

/// Checks a claim's answer on an existing record that the claim must not take.
fn check_answer(what: &str, key: &ScopedKey, m: &ModelRecord, got: Result<Claim, StoreError>) {
    match got {
        Ok(Claim::Completed {
            fingerprint,
            response,
        }) => {
            assert_eq!(
                m.status,
                RecordStatus::Completed,
                "{what}: replayed a record not completed"
            );
            assert_eq!(fingerprint.as_bytes(), &[m.fp; 32], "{what}");
            assert_eq!(fingerprint.body_as_sent(), m.hint, "{what}: the hint");
            assert_eq!(
                Some(body_of(&response)),
                m.response,
                "{what}: another response"
            );
        }
        Ok(Claim::Existing { record, .. }) => {
            assert_ne!(m.status, RecordStatus::Completed, "{what}");
            check_record(what, key, m, &record);
        }
        other => panic!("{what}: expected the record {m:?}, got {other:?}"),
    }
}

/// One thread's randomized run over its own 12 logical keys (three splits of four joined
/// strings) in `stores`, against a model keyed by (store, key). `pool` holds allocations of
/// the same keys made on another thread.
fn model_run(
    t: usize,
    seed: u64,
    steps: usize,
    stores: &[MemoryStore; 2],
    pool: &[ScopedKey],
    barrier: Option<&Barrier>,
) -> HashMap<(usize, usize), ModelRecord> {
    let mut rng = Rng::new(seed);
    let home: Vec<ScopedKey> = pool.iter().map(fresh).collect();
    let mut model: HashMap<(usize, usize), ModelRecord> = HashMap::new();
    let mut tokens: [Vec<FencingToken>; 2] = [Vec::new(), Vec::new()];
    let mut acquired_unexpectedly = 0usize;
    // What the run reached, so that it is known to exercise every path.
    let mut reached: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut hit = |what: &'static str| *reached.entry(what).or_default() += 1;
    if let Some(b) = barrier {
        b.wait();
    }
    for n in 0..steps {
        let s = rng.below(2);
        let i = rng.below(home.len());
        let key = match rng.below(4) {
            0 | 1 => home[i].clone(),
            2 => fresh(&home[i]),
            _ => pool[i].clone(),
        };
        let store = &stores[s];
        let op = rng.below(11);
        let what = format!("thread {t} step {n} store {s} key {key:?} op {op}");
        // A token: mostly the record's, sometimes another this thread got from this store.
        let current = model.get(&(s, i)).map(|m| m.token);
        let token = match (current, rng.below(5)) {
            (Some(c), 0..=3) => c,
            _ if !tokens[s].is_empty() => tokens[s][rng.below(tokens[s].len())],
            (Some(c), _) => c,
            (None, _) => FencingToken::new(rng.next()),
        };
        let fenced_ok = |m: Option<&ModelRecord>, statuses: &[RecordStatus]| {
            m.is_some_and(|m| m.token == token && statuses.contains(&m.status))
        };
        match op {
            0 | 1 => {
                let (f, hint, reconcile) = (1 + rng.below(2) as u8, rng.bit(), rng.bit());
                let got = at_once(store.claim(&creq(&key, f, hint, reconcile, HOUR, HOUR)));
                match model.get_mut(&(s, i)) {
                    None => match got {
                        Ok(Claim::Acquired(lease)) => {
                            hit("acquired new");
                            assert_eq!(lease.attempt, 1, "{what}");
                            tokens[s].push(lease.token);
                            model.insert(
                                (s, i),
                                ModelRecord {
                                    status: RecordStatus::InProgress,
                                    fp: f,
                                    hint,
                                    token: lease.token,
                                    effect: false,
                                    attempts: 1,
                                    response: None,
                                },
                            );
                        }
                        other => panic!("{what}: a new key, got {other:?}"),
                    },
                    Some(m) if m.fp == f && m.status == RecordStatus::Released => match got {
                        Ok(Claim::Acquired(lease)) => {
                            hit("taken over");
                            if hint != m.hint {
                                hit("taken over, hint flipped");
                            }
                            assert_eq!(lease.attempt, m.attempts + 1, "{what}");
                            tokens[s].push(lease.token);
                            m.status = RecordStatus::InProgress;
                            m.hint = hint;
                            m.token = lease.token;
                            m.attempts += 1;
                        }
                        other => panic!("{what}: a released key is taken over, got {other:?}"),
                    },
                    Some(m) => {
                        match (&got, m.fp == f) {
                            (Ok(Claim::Acquired(_)), _) => acquired_unexpectedly += 1,
                            (Ok(Claim::Completed { .. }), true) => hit("replayed"),
                            (Ok(Claim::Completed { .. }), false) => {
                                hit("completed, other fingerprint")
                            }
                            (_, _) if m.status == RecordStatus::NeedsReconciliation => {
                                hit("existing uncertain")
                            }
                            _ => hit("existing"),
                        }
                        check_answer(&what, &home[i], m, got)
                    }
                }
            }
            2 => {
                let body = format!("t{t} n{n} s{s} {}|{}", key.scope(), key.key());
                let ok = fenced_ok(
                    model.get(&(s, i)),
                    &[
                        RecordStatus::InProgress,
                        RecordStatus::Completed,
                        RecordStatus::NeedsReconciliation,
                    ],
                );
                let got = at_once(store.complete(
                    &key,
                    token,
                    &body_response(&body),
                    Duration::from_millis(HOUR),
                ));
                hit(if ok { "complete ok" } else { "complete fenced" });
                if ok {
                    got.unwrap_or_else(|e| panic!("{what}: complete refused: {e:?}"));
                    let m = model.get_mut(&(s, i)).expect("record");
                    m.status = RecordStatus::Completed;
                    m.response = Some(body);
                } else {
                    assert!(matches!(got, Err(StoreError::Fenced)), "{what}: {got:?}");
                }
            }
            3 => {
                let ok = fenced_ok(model.get(&(s, i)), &[RecordStatus::InProgress]);
                let got = at_once(store.release(&key, token));
                if ok {
                    let m = model.get_mut(&(s, i)).expect("record");
                    m.status = if m.effect {
                        RecordStatus::NeedsReconciliation
                    } else {
                        RecordStatus::Released
                    };
                    assert_eq!(got.expect("release"), m.status, "{what}");
                    hit(if m.effect {
                        "released uncertain"
                    } else {
                        "released"
                    });
                } else {
                    assert!(matches!(got, Err(StoreError::Fenced)), "{what}: {got:?}");
                }
            }
            4 => {
                let ok = fenced_ok(model.get(&(s, i)), &[RecordStatus::InProgress]);
                let got = at_once(store.record_milestone(&key, token, &Milestone::EffectStarted));
                if ok {
                    got.expect("milestone");
                    model.get_mut(&(s, i)).expect("record").effect = true;
                } else {
                    assert!(matches!(got, Err(StoreError::Fenced)), "{what}: {got:?}");
                }
            }
            5 => {
                let ok = fenced_ok(model.get(&(s, i)), &[RecordStatus::InProgress]);
                let got = at_once(store.renew(&key, token, Duration::from_millis(HOUR)));
                assert_eq!(got.is_ok(), ok, "{what}: {got:?}");
            }
            6 => {
                let got = at_once(store.lookup(&key)).expect("lookup");
                match (model.get(&(s, i)), got) {
                    (None, None) => {}
                    (Some(m), Some(r)) => check_record(&what, &home[i], m, &r),
                    (m, r) => panic!("{what}: model {m:?}, store {r:?}"),
                }
            }
            7 => {
                if rng.below(3) == 0 {
                    let removed = at_once(store.remove(&key)).expect("remove");
                    assert_eq!(removed, model.remove(&(s, i)).is_some(), "{what}");
                    hit(if removed {
                        "removed"
                    } else {
                        "removed nothing"
                    });
                }
            }
            8 => {
                let got = store.completed_now(&key);
                match model
                    .get(&(s, i))
                    .filter(|m| m.status == RecordStatus::Completed)
                {
                    Some(m) => {
                        hit("completed_now");
                        check_answer(&what, &home[i], m, got.expect("completed_now answers"))
                    }
                    None => assert!(got.is_none(), "{what}: {got:?}"),
                }
            }
            9 => {
                let got = store.recorded_fingerprint_now(&key);
                let want = model
                    .get(&(s, i))
                    .filter(|m| m.status == RecordStatus::Completed)
                    .map(|m| (m.fp, m.hint));
                assert_eq!(
                    got.map(|f| (f.as_bytes()[0], f.body_as_sent())),
                    want,
                    "{what}"
                );
                if let Some(f) = got {
                    assert_eq!(f.as_bytes(), &[want.expect("want").0; 32], "{what}");
                    hit(if f.body_as_sent() {
                        "recorded hinted"
                    } else {
                        "recorded unhinted"
                    });
                }
            }
            _ => {
                let ok = fenced_ok(model.get(&(s, i)), &[RecordStatus::InProgress]);
                let got = at_once(store.mark_uncertain(&key, token));
                if ok {
                    got.expect("mark_uncertain");
                    // An answer that could not be recorded had its effect (see the trait).
                    let record = model.get_mut(&(s, i)).expect("record");
                    record.status = RecordStatus::NeedsReconciliation;
                    record.effect = true;
                } else {
                    assert!(matches!(got, Err(StoreError::Fenced)), "{what}: {got:?}");
                }
            }
        }
    }
    assert_eq!(acquired_unexpectedly, 0);
    for path in [
        "acquired new",
        "taken over",
        "taken over, hint flipped",
        "replayed",
        "completed, other fingerprint",
        "existing",
        "existing uncertain",
        "complete ok",
        "complete fenced",
        "released",
        "released uncertain",
        "removed",
        "removed nothing",
        "completed_now",
        "recorded hinted",
        "recorded unhinted",
    ] {
        assert!(
            reached.get(path).is_some_and(|&n| n > 0),
            "thread {t} never reached {path}: {reached:?}"
        );
    }
    model
}

fn model_keys(t: usize) -> Vec<ScopedKey> {
    (0..4)
        .flat_map(|j| split_family(&format!("m{t}-{j}-")))
        .collect()
}

/// One thread's keys and its model of every (store, key) record.
type Run = (Vec<ScopedKey>, HashMap<(usize, usize), ModelRecord>);

/// Checks every model record against the stores, from this thread, through fresh
/// allocations; and the stores' sizes and uncertain counts.
fn check_models(stores: &[MemoryStore; 2], runs: &[Run]) {
    for (s, store) in stores.iter().enumerate() {
        let mut len = 0;
        let mut uncertain = 0;
        for (keys, model) in runs {
            for (i, key) in keys.iter().enumerate() {
                let got = at_once(store.lookup(&fresh(key))).expect("lookup");
                match (model.get(&(s, i)), got) {
                    (None, None) => {}
                    (Some(m), Some(r)) => {
                        check_record(&format!("final {s} {key:?}"), key, m, &r);
                        len += 1;
                        uncertain += usize::from(m.status == RecordStatus::NeedsReconciliation);
                    }
                    (m, r) => panic!("final {s} {key:?}: model {m:?}, store {r:?}"),
                }
            }
        }
        assert_eq!(store.len(), len, "store {s} holds the model's records");
        let count = at_once(store.count_uncertain()).expect("count");
        assert_eq!(
            count.count as usize, uncertain,
            "store {s}: uncertain records"
        );
        let page = at_once(store.list_uncertain(&UncertainQuery::first(10_000))).expect("list");
        assert_eq!(page.records.len(), uncertain, "store {s}: listed");
        for r in &page.records {
            let (keys, model) = runs
                .iter()
                .find(|(keys, _)| keys.contains(&r.key))
                .expect("a listed record is a model key");
            let i = keys.iter().position(|k| *k == r.key).expect("key");
            check_record("listed", &keys[i], &model[&(s, i)], r);
        }
    }
}

/// DESIGN §1 (steps 5-6: a claim creates a record or returns the existing one), §2, §4
/// (milestones, release into needs_reconciliation, fencing) and §5: a seeded random sequence of
/// claim (two fingerprints, either hint, either lease-expiry policy), complete, release,
/// effect_started, renew, mark_uncertain (right and stale tokens), lookup, remove,
/// completed_now and recorded_fingerprint_now on 12 keys with equal joined bytes split three
/// ways, through home clones, fresh allocations and allocations made on another thread, over
/// two stores, on one thread; every answer equals the model's, and the stores end holding
/// exactly the model (lookups, sizes, the uncertain listing).
#[test]
fn s2_random_operations_match_a_model_on_one_thread() {
    let stores = [MemoryStore::new(), MemoryStore::new()];
    let mut runs = Vec::new();
    for (t, seed) in [(0usize, 1u64), (1, 77), (2, 4242)] {
        let keys = model_keys(t);
        let pool = std::thread::spawn({
            let keys = keys.clone();
            move || keys.iter().map(fresh).collect::<Vec<_>>()
        })
        .join()
        .expect("pool");
        let model = model_run(t, seed, 6_000, &stores, &pool, None);
        runs.push((keys, model));
    }
    check_models(&stores, &runs);
}

/// DESIGN §1, §2, §4, §5: the model run above on 6 threads at once (released through a
/// barrier) sharing the two stores, each on its own keys (equal bytes across threads never
/// occur, but every thread's shards, locks and remembered hashes interleave with the
/// others'); the pool of each thread's keys is allocated on another thread. Every answer
/// equals the thread's model; the stores end holding exactly the union of the models.
#[test]
fn s2_random_operations_match_a_model_on_many_threads() {
    const THREADS: usize = 6;
    let stores = [MemoryStore::new(), MemoryStore::new()];
    let barrier = Arc::new(Barrier::new(THREADS));
    // Thread t's pool is allocated by thread (t + 1) % THREADS's creator: here, another thread.
    let pools: Vec<Vec<ScopedKey>> = std::thread::spawn(|| {
        (0..THREADS)
            .map(|t| model_keys(t).iter().map(fresh).collect())
            .collect()
    })
    .join()
    .expect("pools");
    let handles: Vec<_> = pools
        .into_iter()
        .enumerate()
        .map(|(t, pool)| {
            let (stores, barrier) = (stores.clone(), barrier.clone());
            std::thread::spawn(move || {
                let model = model_run(t, 1_000 + t as u64, 5_000, &stores, &pool, Some(&barrier));
                (model_keys(t), model)
            })
        })
        .collect();
    let runs: Vec<_> = handles
        .into_iter()
        .map(|h| h.join().expect("thread"))
        .collect();
    check_models(&stores, &runs);
}

// =============================================================================================
// Re-entrancy and teardown.
// =============================================================================================

/// DESIGN §1 and §5: a store whose clock (application code, read between a request's hashes:
/// before a claim's, inside completed_now under the shard lock) uses another store on the same
/// thread with other keys, so the thread's remembered key changes between every two hashes of
/// the first store. Both stores answer exactly: each key acquired once, each replays its own
/// body, the clock's reads find their own records.
#[test]
fn s5_a_clock_that_uses_another_store_between_hashes() {
    let inner = MemoryStore::new();
    let inner_keys: Arc<Vec<ScopedKey>> = Arc::new(
        (0..6)
            .flat_map(|j| split_family(&format!("clock{j}")))
            .collect(),
    );
    for (i, key) in inner_keys.iter().enumerate() {
        let Ok(Claim::Acquired(lease)) =
            at_once(inner.claim(&creq(key, i as u8, i % 2 == 0, false, HOUR, HOUR)))
        else {
            panic!("inner {i}");
        };
        at_once(inner.complete(
            key,
            lease.token,
            &body_response(&format!("inner {i}")),
            Duration::from_millis(HOUR),
        ))
        .expect("complete");
    }
    let reads = Arc::new(AtomicUsize::new(0));
    let wrong = Arc::new(Mutex::new(Vec::<String>::new()));
    let outer = {
        let (inner, keys, reads, wrong) = (
            inner.clone(),
            inner_keys.clone(),
            reads.clone(),
            wrong.clone(),
        );
        let base = std::time::SystemTime::now();
        MemoryStore::with_clock(move || {
            let n = reads.fetch_add(1, Ordering::SeqCst);
            let i = n % keys.len();
            let key = if n % 2 == 0 {
                keys[i].clone()
            } else {
                fresh(&keys[i])
            };
            match inner.completed_now(&key) {
                Some(Ok(Claim::Completed {
                    response,
                    fingerprint,
                })) => {
                    if body_of(&response) != format!("inner {i}")
                        || fingerprint.as_bytes() != &[i as u8; 32]
                        || fingerprint.body_as_sent() != (i % 2 == 0)
                    {
                        wrong
                            .lock()
                            .expect("lock")
                            .push(format!("{key:?}: {}", body_of(&response)));
                    }
                }
                other => wrong
                    .lock()
                    .expect("lock")
                    .push(format!("{key:?}: {other:?}")),
            }
            if inner
                .recorded_fingerprint_now(&keys[(i + 1) % keys.len()])
                .is_none()
            {
                wrong.lock().expect("lock").push("recorded".into());
            }
            base
        })
    };
    let outer_keys: Vec<ScopedKey> = (0..6)
        .flat_map(|j| split_family(&format!("clock{j}")))
        .collect();
    let mut acquired = vec![0usize; outer_keys.len()];
    for round in 0..4 {
        for (i, key) in outer_keys.iter().enumerate() {
            let k = if round % 2 == 0 {
                key.clone()
            } else {
                fresh(key)
            };
            match at_once(outer.claim(&creq(&k, 100 + i as u8, true, false, HOUR, HOUR))) {
                Ok(Claim::Acquired(lease)) => {
                    acquired[i] += 1;
                    at_once(outer.complete(
                        &k,
                        lease.token,
                        &body_response(&format!("outer {i}")),
                        Duration::from_millis(HOUR),
                    ))
                    .expect("complete");
                }
                Ok(Claim::Completed { response, .. }) => {
                    assert_eq!(body_of(&response), format!("outer {i}"))
                }
                other => panic!("{other:?}"),
            }
            let Some(Ok(Claim::Completed { response, .. })) = outer.completed_now(&k) else {
                panic!("outer {i} completed");
            };
            assert_eq!(body_of(&response), format!("outer {i}"));
            assert_eq!(
                outer.recorded_fingerprint_now(&k),
                Some(fp(100 + i as u8, true))
            );
        }
    }
    assert_eq!(acquired, vec![1; outer_keys.len()]);
    assert!(
        reads.load(Ordering::SeqCst) > 100,
        "the clock was read between hashes"
    );
    assert_eq!(
        *wrong.lock().expect("lock"),
        Vec::<String>::new(),
        "the clock's reads"
    );
}

/// Run by `s5_store_operations_while_a_threads_locals_are_torn_down` in a child process (a
/// panic in a thread-local destructor aborts the process).
const TEARDOWN_CHILD: &str = "HASH_MEMO_REVIEW_TEARDOWN_CHILD";

struct Teardown {
    store: MemoryStore,
    keys: Vec<ScopedKey>,
    fresh: Vec<ScopedKey>,
    label: &'static str,
    out: Arc<Mutex<Vec<String>>>,
}

impl Drop for Teardown {
    fn drop(&mut self) {
        let mut out = Vec::new();
        let gone = MARKER.try_with(|_| ()).is_err();
        out.push(format!("{} marker gone {gone}", self.label));
        for (i, key) in self.keys.iter().enumerate() {
            let other = &self.fresh[i];
            let claim =
                |k: &ScopedKey| at_once(self.store.claim(&creq(k, 5, true, false, HOUR, HOUR)));
            let first = claim(key);
            let Ok(Claim::Acquired(lease)) = first else {
                out.push(format!("{} {i}: first claim {first:?}", self.label));
                continue;
            };
            let again = claim(other);
            if !matches!(again, Ok(Claim::Existing { .. })) {
                out.push(format!("{} {i}: second claim {again:?}", self.label));
            }
            let body = format!("{} {}", self.label, key.key());
            if let Err(e) = at_once(self.store.complete(
                other,
                lease.token,
                &body_response(&body),
                Duration::from_millis(HOUR),
            )) {
                out.push(format!("{} {i}: complete {e:?}", self.label));
            }
            match self.store.completed_now(key) {
                Some(Ok(Claim::Completed { response, .. })) if body_of(&response) == body => {}
                other => out.push(format!("{} {i}: completed_now {other:?}", self.label)),
            }
            if self.store.recorded_fingerprint_now(other) != Some(fp(5, true)) {
                out.push(format!("{} {i}: recorded", self.label));
            }
            match at_once(self.store.lookup(key)) {
                Ok(Some(r)) if r.key == *key && r.status == RecordStatus::Completed => {}
                other => out.push(format!("{} {i}: lookup {other:?}", self.label)),
            }
            out.push(format!("{} {i}: ok", self.label));
        }
        self.out.lock().expect("lock").extend(out);
    }
}

/// Registered right after the store's first use on a thread: torn down next to its remembered
/// hash, so a destructor that finds it gone runs after that hash is gone too.
struct Marker;

impl Drop for Marker {
    fn drop(&mut self) {}
}

thread_local! {
    static MARKER: Marker = const { Marker };
    static FIRST: RefCell<Option<Teardown>> = const { RefCell::new(None) };
    static SECOND: RefCell<Option<Teardown>> = const { RefCell::new(None) };
}

/// The child's half: the same test, run again by its parent with `TEARDOWN_CHILD` set.
fn teardown_child() {
    let store = MemoryStore::new();
    let out = Arc::new(Mutex::new(Vec::new()));
    let keys: Vec<ScopedKey> = (0..8)
        .flat_map(|j| split_family(&format!("td{j}")))
        .collect();
    let (first_keys, second_keys) = keys.split_at(12);
    let (first_keys, second_keys) = (first_keys.to_vec(), second_keys.to_vec());
    for _ in 0..4 {
        let (thread_store, thread_out, first_keys, second_keys) = (
            store.clone(),
            out.clone(),
            first_keys.clone(),
            second_keys.clone(),
        );
        std::thread::spawn(move || {
            let (store, out) = (thread_store, thread_out);
            // FIRST registers its destructor before the store's thread-local exists, SECOND
            // after: one of them runs after the remembered hash is torn down, whatever the
            // platform's order.
            FIRST.with(|f| {
                *f.borrow_mut() = Some(Teardown {
                    store: store.clone(),
                    fresh: first_keys.iter().map(fresh).collect(),
                    keys: first_keys,
                    label: "first",
                    out: out.clone(),
                })
            });
            let warm = ScopedKey::new("warm", format!("{:?}", std::thread::current().id()));
            let _ = store.completed_now(&warm);
            MARKER.with(|_| ());
            SECOND.with(|f| {
                *f.borrow_mut() = Some(Teardown {
                    store: store.clone(),
                    fresh: second_keys.iter().map(fresh).collect(),
                    keys: second_keys,
                    label: "second",
                    out: out.clone(),
                })
            });
        })
        .join()
        .expect("thread");
        // Each thread's teardown ran: records made then are found here, through other
        // allocations, once each.
        let got = std::mem::take(&mut *out.lock().expect("lock"));
        let oks = got.iter().filter(|l| l.ends_with(": ok")).count();
        let markers: Vec<&String> = got.iter().filter(|l| l.contains(" marker gone ")).collect();
        assert_eq!(markers.len(), 2, "{got:?}");
        assert_eq!(
            markers.iter().filter(|l| l.ends_with("true")).count(),
            1,
            "one destructor ran after the remembered hash was torn down, one before: {markers:?}"
        );
        println!("{markers:?}");
        let errors: Vec<&String> = got
            .iter()
            .filter(|l| !l.ends_with(": ok") && !l.contains(" marker gone "))
            .collect();
        assert!(errors.is_empty(), "teardown answers: {errors:?}");
        assert_eq!(oks, keys.len(), "both destructors ran every key");
        for key in &keys {
            match at_once(store.claim(&creq(&fresh(key), 5, false, false, HOUR, HOUR))) {
                Ok(Claim::Completed { response, .. }) => {
                    assert!(body_of(&response).ends_with(key.key()))
                }
                other => panic!("{key:?}: {other:?}"),
            }
            assert!(at_once(store.remove(key)).expect("remove"));
        }
    }
    println!("TEARDOWN-CHILD-OK");
}

/// DESIGN §1 step 7 and §5 (a dropped future gives its key back, and the store answers it):
/// MemoryStore operations from `Drop` impls of values in thread-locals, torn down at thread
/// exit both before and after the store's remembered hash is, never panic (a panic there
/// aborts the process, hence a child process) and answer exactly: claims, completions and
/// reads made during teardown are found later through other allocations, once each.
#[test]
fn s5_store_operations_while_a_threads_locals_are_torn_down() {
    if std::env::var_os(TEARDOWN_CHILD).is_some() {
        teardown_child();
        return;
    }
    common::run_child(
        module_path!(),
        "s5_store_operations_while_a_threads_locals_are_torn_down",
        TEARDOWN_CHILD,
    );
}

// =============================================================================================
// The hint bit.
// =============================================================================================

/// The hint as every read reports it: (recorded_fingerprint_now, completed_now, lookup).
fn hints(store: &MemoryStore, key: &ScopedKey) -> (Option<bool>, Option<bool>, Option<bool>) {
    let recorded = store
        .recorded_fingerprint_now(&fresh(key))
        .map(|f| f.body_as_sent());
    let completed = match store.completed_now(key) {
        Some(Ok(Claim::Completed { fingerprint, .. })) => Some(fingerprint.body_as_sent()),
        Some(other) => panic!("{other:?}"),
        None => None,
    };
    let looked = at_once(store.lookup(&fresh(key)))
        .expect("lookup")
        .map(|r| r.fingerprint.body_as_sent());
    (recorded, completed, looked)
}

/// DESIGN §1 step 6 and §2/§4 (takeover: released, lease expired, expired completed, resolved
/// not-applied): the record's hint is the one of the request now holding it, whichever way it
/// flips, and a replay or a refused claim never changes it. Every read (recorded_fingerprint_now,
/// completed_now, lookup, a claim's Completed/Existing) reports it, with the fingerprint's bytes.
#[test]
fn s4_the_hint_follows_the_request_that_holds_the_record() {
    for first in [true, false] {
        let clock = Clock::new();
        let store = clock.store();
        let complete = |key: &ScopedKey, token, ttl| {
            at_once(store.complete(
                key,
                token,
                &body_response("done"),
                Duration::from_millis(ttl),
            ))
            .expect("complete")
        };
        let acquire = |req: &ClaimRequest| match at_once(store.claim(req)) {
            Ok(Claim::Acquired(l)) => l,
            other => panic!("{:?}: {other:?}", req.key),
        };
        // Released, then taken over by a request with the other hint.
        let k = ScopedKey::new("hint", format!("released-{first}"));
        let l = acquire(&creq(&k, 1, first, false, HOUR, HOUR));
        assert_eq!(hints(&store, &k), (None, None, Some(first)));
        at_once(store.release(&k, l.token)).expect("release");
        assert_eq!(hints(&store, &k), (None, None, Some(first)));
        let l = acquire(&creq(&fresh(&k), 1, !first, false, HOUR, HOUR));
        assert_eq!(l.attempt, 2);
        assert_eq!(hints(&store, &k), (None, None, Some(!first)));
        complete(&k, l.token, HOUR);
        assert_eq!(
            hints(&store, &k),
            (Some(!first), Some(!first), Some(!first))
        );
        // A replay with the other hint, and a mismatch, change nothing.
        for (f, h) in [(1, first), (2, first), (2, !first)] {
            match at_once(store.claim(&creq(&k, f, h, false, HOUR, HOUR))) {
                Ok(Claim::Completed { fingerprint, .. }) => {
                    assert_eq!(fingerprint.as_bytes(), &[1; 32]);
                    assert_eq!(fingerprint.body_as_sent(), !first);
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(
            hints(&store, &k),
            (Some(!first), Some(!first), Some(!first))
        );
        // A refused claim on an in-flight record changes nothing either.
        let k2 = ScopedKey::new("hint", format!("in-flight-{first}"));
        acquire(&creq(&k2, 1, first, false, HOUR, HOUR));
        match at_once(store.claim(&creq(&k2, 1, !first, false, HOUR, HOUR))) {
            Ok(Claim::Existing { record, .. }) => {
                assert_eq!(record.fingerprint.body_as_sent(), first)
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(hints(&store, &k2), (None, None, Some(first)));

        // Lease expired without an effect, taken over (Reclaim).
        let k = ScopedKey::new("hint", format!("lease-{first}"));
        acquire(&creq(&k, 3, first, false, 100, HOUR));
        clock.advance(200);
        let l = acquire(&creq(&k, 3, !first, false, HOUR, HOUR));
        assert_eq!(l.attempt, 2);
        assert_eq!(hints(&store, &k), (None, None, Some(!first)));
        complete(&k, l.token, HOUR);
        assert_eq!(
            hints(&store, &k),
            (Some(!first), Some(!first), Some(!first))
        );

        // Completed and expired: a new claim with the other hint makes a new record.
        let k = ScopedKey::new("hint", format!("expired-{first}"));
        let l = acquire(&creq(&k, 4, first, false, HOUR, 100));
        complete(&k, l.token, 100);
        assert_eq!(hints(&store, &k), (Some(first), Some(first), Some(first)));
        clock.advance(200);
        let (recorded, completed, looked) = hints(&store, &k);
        assert!(
            recorded.is_none() || recorded == Some(first),
            "unchecked for expiry: {recorded:?}"
        );
        assert_eq!(
            (completed, looked),
            (None, None),
            "expired counts as absent"
        );
        let l = acquire(&creq(&k, 4, !first, false, HOUR, HOUR));
        assert_eq!(l.attempt, 1);
        assert_eq!(hints(&store, &k), (None, None, Some(!first)));
        complete(&k, l.token, HOUR);
        assert_eq!(
            hints(&store, &k),
            (Some(!first), Some(!first), Some(!first))
        );

        // Uncertain, resolved not applied (released), taken over.
        let k = ScopedKey::new("hint", format!("resolved-{first}"));
        let l = acquire(&creq(&k, 5, first, true, HOUR, HOUR));
        at_once(store.mark_uncertain(&k, l.token)).expect("uncertain");
        at_once(store.resolve(
            &k,
            l.token,
            &Resolution::NotApplied,
            Duration::from_millis(HOUR),
            Some("no"),
        ))
        .expect("resolve");
        let l = acquire(&creq(&fresh(&k), 5, !first, false, HOUR, HOUR));
        assert_eq!(l.attempt, 2);
        complete(&k, l.token, HOUR);
        assert_eq!(
            hints(&store, &k),
            (Some(!first), Some(!first), Some(!first))
        );
        // Resolved applied: the hint of the record as it was claimed.
        let k = ScopedKey::new("hint", format!("applied-{first}"));
        let l = acquire(&creq(&k, 6, first, true, HOUR, HOUR));
        at_once(store.mark_uncertain(&k, l.token)).expect("uncertain");
        at_once(store.resolve(
            &k,
            l.token,
            &Resolution::Applied(Box::new(body_response("by hand"))),
            Duration::from_millis(HOUR),
            None,
        ))
        .expect("resolve");
        assert_eq!(hints(&store, &k), (Some(first), Some(first), Some(first)));
    }
}

/// What a scenario observes, the hint left out.
fn scrub(record: &Record) -> String {
    format!(
        "{}+{} {:?} attempts={} effect={} resp={:?} fp={:?}",
        record.key.scope().len(),
        record.key.key(),
        record.status,
        record.attempts,
        record.effect_started,
        record.response.as_ref().map(body_of),
        record.fingerprint.as_bytes()[0]
    )
}

fn scrub_claim(got: &Result<Claim, StoreError>) -> String {
    match got {
        Ok(Claim::Acquired(l)) => format!("acquired {}", l.attempt),
        Ok(Claim::Completed {
            fingerprint,
            response,
        }) => {
            format!(
                "completed {} {}",
                fingerprint.as_bytes()[0],
                body_of(response)
            )
        }
        Ok(Claim::Existing { record, .. }) => format!("existing {}", scrub(record)),
        Err(e) => format!("error {e:?}"),
    }
}

/// One scenario over flags (reconcile-on-expiry, effect_started, the polled set and due index,
/// purging, the uncertain listing, wide key heads), with claims' hints given by `hint(n)`;
/// what it observes, and the hints every record reported (checked against the claims').
fn flag_scenario(hint: impl Fn(usize) -> bool) -> Vec<String> {
    let clock = Clock::new();
    let store = clock.store();
    let mut seen = Vec::new();
    let mut n = 0;
    let mut claim =
        |store: &MemoryStore, key: &ScopedKey, f: u8, reconcile: bool, lease: u64, ttl: u64| {
            n += 1;
            let h = hint(n);
            let got = at_once(store.claim(&creq(key, f, h, reconcile, lease, ttl)));
            (got, h)
        };
    let wide = "w".repeat(70_000);
    let keys: Vec<ScopedKey> = ["a", "b", "c", "d", "e", "f", "g", "h"]
        .iter()
        .flat_map(|k| [ScopedKey::new("flags", k), ScopedKey::new(&wide, k)])
        .collect();
    let token = |got: &Result<Claim, StoreError>| match got {
        Ok(Claim::Acquired(l)) => l.token,
        other => panic!("{}", scrub_claim(other)),
    };
    let mut holders = Vec::new();
    for (j, key) in keys.iter().enumerate() {
        let scenario = j / 2;
        let (reconcile, lease, ttl) = match scenario {
            // a: reconcile route, lease runs out without an effect.
            0 => (true, 100, 1_000),
            // b: reclaim route, effect started, lease runs out.
            1 => (false, 100, 1_000),
            // c: reclaim route, no effect, lease runs out: taken over.
            2 => (false, 100, 1_000),
            // d: lease longer than the TTL (polled), released.
            3 => (false, 5_000, 500),
            // e: completed, short TTL: purged.
            4 => (false, 100, 500),
            // f: reconcile route, in progress, lease out: listed before any claim.
            5 => (true, 100, 1_000),
            // g: released, taken over on a reconcile route, lease out.
            6 => (false, HOUR, HOUR),
            // h: effect started, released: needs reconciliation.
            _ => (false, HOUR, HOUR),
        };
        let (got, h) = claim(&store, key, 1, reconcile, lease, ttl);
        let t = token(&got);
        let record = at_once(store.lookup(key)).expect("lookup").expect("record");
        assert_eq!(
            record.fingerprint.body_as_sent(),
            h,
            "key {j} claimed with hint {h}"
        );
        match scenario {
            1 | 7 => {
                at_once(store.record_milestone(key, t, &Milestone::EffectStarted)).expect("effect")
            }
            4 => at_once(store.complete(key, t, &body_response("e"), Duration::from_millis(500)))
                .expect("complete"),
            _ => {}
        }
        if scenario == 3 || scenario == 7 {
            seen.push(format!("release {:?}", at_once(store.release(key, t))));
        }
        if scenario == 6 {
            at_once(store.release(key, t)).expect("release");
            let (got, h) = claim(&store, key, 1, true, 100, 1_000);
            seen.push(format!("takeover {}", scrub_claim(&got)));
            let record = at_once(store.lookup(key)).expect("lookup").expect("record");
            assert_eq!(record.fingerprint.body_as_sent(), h, "takeover's hint");
        }
        holders.push(t);
    }
    let count = at_once(store.count_uncertain()).expect("count");
    seen.push(format!("uncertain before {}", count.count));
    clock.advance(200);
    let page = at_once(store.list_uncertain(&UncertainQuery::first(100))).expect("list");
    let mut listed: Vec<String> = page.records.iter().map(scrub).collect();
    listed.sort();
    seen.push(format!("listed {listed:?}"));
    for (j, key) in keys.iter().enumerate() {
        let (got, _) = claim(&store, &fresh(key), 1, false, HOUR, HOUR);
        seen.push(format!("{j} after lease: {}", scrub_claim(&got)));
    }
    clock.advance(1_000);
    seen.push(format!("purged {:?}", at_once(store.purge_expired())));
    seen.push(format!("len {}", store.len()));
    for (j, key) in keys.iter().enumerate() {
        let record = at_once(store.lookup(key)).expect("lookup");
        seen.push(format!("{j} end {:?}", record.as_ref().map(scrub)));
        let (got, _) = claim(&store, key, 1, false, HOUR, HOUR);
        seen.push(format!("{j} end claim {}", scrub_claim(&got)));
    }
    let count = at_once(store.count_uncertain()).expect("count");
    seen.push(format!("uncertain end {}", count.count));
    seen
}

/// DESIGN §3/§4 (effect_started and reconcile-on-expiry decide what a lapsed lease becomes; a
/// needs_reconciliation record never expires) and §5 (expired records are purged): the hint bit
/// shares the flag byte with these, with the polled/queued bits and the wide-head bit. The same
/// scenario (both key head widths) run with every claim hinted, none hinted and alternating
/// observes exactly the same statuses, attempts, effects, responses, purges and listings.
#[test]
fn s4_the_hint_never_leaks_into_other_flags() {
    let none = flag_scenario(|_| false);
    let all = flag_scenario(|_| true);
    let odd = flag_scenario(|n| n % 2 == 1);
    let even = flag_scenario(|n| n % 2 == 0);
    assert!(
        none.iter().any(|l| l.contains("NeedsReconciliation")),
        "the scenario reaches reconciliation: {none:#?}"
    );
    assert!(
        none.iter()
            .any(|l| l.starts_with("purged Ok(") && !l.contains("Ok(0)")),
        "{none:#?}"
    );
    assert_eq!(all, none, "all hinted");
    assert_eq!(odd, none, "odd claims hinted");
    assert_eq!(even, none, "even claims hinted");
}

/// DESIGN §5 (bounded memory: expired records purged, the shards' tables grown and compacted)
/// and §2: the hint is the record's through 24 000 claims (every shard's table grown several
/// times), a purge of four in five records (compaction of every shard), and growth again: every
/// surviving key reports its own fingerprint and hint through fresh allocations; purged keys
/// report nothing and are acquired once each.
#[test]
fn s5_the_hint_survives_growth_compaction_and_purge() {
    let clock = Clock::new();
    let store = clock.store();
    let key = |i: usize| ScopedKey::new(format!("tenant-{}", i % 5), format!("k-{i}"));
    let hint = |i: usize| i % 3 != 1;
    let f = |i: usize| (i % 251) as u8;
    let short = |i: usize| !i.is_multiple_of(5);
    const N: usize = 24_000;
    for i in 0..N {
        let k = key(i);
        let Ok(Claim::Acquired(l)) =
            at_once(store.claim(&creq(&k, f(i), hint(i), false, HOUR, HOUR)))
        else {
            panic!("{i}");
        };
        let ttl = if short(i) { 1_000 } else { HOUR };
        at_once(store.complete(
            &k,
            l.token,
            &body_response(&format!("r{i}")),
            Duration::from_millis(ttl),
        ))
        .expect("complete");
    }
    let check_live = |i: usize| {
        let k = key(i);
        let r = store
            .recorded_fingerprint_now(&k)
            .unwrap_or_else(|| panic!("{i} recorded"));
        assert_eq!(
            (r.as_bytes(), r.body_as_sent()),
            (&[f(i); 32], hint(i)),
            "{i}"
        );
        let Some(Ok(Claim::Completed {
            fingerprint,
            response,
        })) = store.completed_now(&fresh(&k))
        else {
            panic!("{i} completed");
        };
        assert_eq!(
            (fingerprint.as_bytes(), fingerprint.body_as_sent()),
            (&[f(i); 32], hint(i)),
            "{i}"
        );
        assert_eq!(body_of(&response), format!("r{i}"));
    };
    for i in (0..N).step_by(7) {
        check_live(i);
    }
    clock.advance(2_000);
    let purged = at_once(store.purge_expired()).expect("purge");
    let short_count = (0..N).filter(|&i| short(i)).count();
    assert_eq!(purged as usize, short_count);
    assert_eq!(store.len(), N - short_count);
    for i in 0..N {
        if short(i) {
            assert!(
                store.recorded_fingerprint_now(&key(i)).is_none(),
                "{i} purged"
            );
            assert!(store.completed_now(&key(i)).is_none());
        } else {
            check_live(i);
        }
    }
    // Growth again: purged keys claimed anew (each once) with the other hint.
    for i in (0..N).filter(|&i| short(i)) {
        let k = key(i);
        match at_once(store.claim(&creq(&fresh(&k), f(i), !hint(i), false, HOUR, HOUR))) {
            Ok(Claim::Acquired(l)) => {
                assert_eq!(l.attempt, 1);
                at_once(store.complete(
                    &k,
                    l.token,
                    &body_response(&format!("again{i}")),
                    Duration::from_millis(HOUR),
                ))
                .expect("complete");
            }
            other => panic!("{i}: {other:?}"),
        }
    }
    assert_eq!(store.len(), N);
    for i in 0..N {
        let k = key(i);
        let want_hint = if short(i) { !hint(i) } else { hint(i) };
        let want_body = if short(i) {
            format!("again{i}")
        } else {
            format!("r{i}")
        };
        let r = store.recorded_fingerprint_now(&k).expect("recorded");
        assert_eq!(
            (r.as_bytes(), r.body_as_sent()),
            (&[f(i); 32], want_hint),
            "{i}"
        );
        match at_once(store.claim(&creq(&fresh(&k), f(i), true, false, HOUR, HOUR))) {
            Ok(Claim::Completed {
                response,
                fingerprint,
            }) => {
                assert_eq!(body_of(&response), want_body);
                assert_eq!(fingerprint.body_as_sent(), want_hint);
            }
            other => panic!("{i}: {other:?}"),
        }
    }
}

// =============================================================================================
// Over the layer.
// =============================================================================================

/// An app scoped by the raw `x-tenant` header (so tenant "ab" with key "c" and tenant "a" with
/// key "bc" store equal joined bytes), whose handler counts its runs per (tenant, key) and per
/// body, and answers with them. `fail_first`: the first run of a key answers 500 (released).
fn tenant_app(
    store: MemoryStore,
    runs: Arc<Mutex<BTreeMap<(String, String), usize>>>,
    effects: Effects,
    fail_first: bool,
) -> Router {
    let handler = move |req: Request<Body>| {
        let (runs, effects) = (runs.clone(), effects.clone());
        async move {
            let tenant = req.headers()["x-tenant"]
                .to_str()
                .expect("tenant")
                .to_owned();
            let key = req.headers()["idempotency-key"]
                .to_str()
                .expect("key")
                .to_owned();
            let body = req.into_body().collect().await.expect("body").to_bytes();
            tokio::task::yield_now().await;
            effects.hit();
            let n = {
                let mut runs = runs.lock().expect("runs");
                let n = runs.entry((tenant.clone(), key.clone())).or_default();
                *n += 1;
                *n
            };
            let status = if fail_first && n == 1 {
                StatusCode::INTERNAL_SERVER_ERROR
            } else {
                StatusCode::CREATED
            };
            (
                status,
                format!("{tenant}|{key}|{}|run {n}", String::from_utf8_lossy(&body)),
            )
        }
    };
    let layer = IdempotencyLayer::new(store).scope_with(|parts: &http::request::Parts| {
        parts
            .headers
            .get("x-tenant")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    });
    Router::new().route("/op", post(handler)).layer(layer)
}

async fn send(
    app: &Router,
    tenant: &str,
    key: &str,
    content_type: &str,
    body: &str,
) -> (StatusCode, Option<String>, String) {
    let req = Request::post("/op")
        .header("x-tenant", tenant)
        .header("idempotency-key", key)
        .header("content-type", content_type)
        .body(Body::from(body.to_owned()))
        .expect("request");
    let res = app.clone().oneshot(req).await.expect("infallible");
    let status = res.status();
    let replayed = res
        .headers()
        .get("idempotency-replayed")
        .map(|v| v.to_str().expect("ascii").to_owned());
    let body = res.into_body().collect().await.expect("body").to_bytes();
    (
        status,
        replayed,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

/// DESIGN §1 steps 2 and 6, §7.1 and §7.3: over the layer on a multi-thread runtime, tenants
/// whose scope and key join to the same bytes ("ab"+"c", "a"+"bc", "abc"+"x"...) each run their
/// handler exactly once (counted in the handler) under 160 concurrent requests, every other
/// answer being a replay of that tenant's own body or a 409; afterwards each replays its own
/// body, and a tenant never receives another's.
#[test]
fn s1_tenants_with_equal_joined_bytes_each_run_once_over_the_layer() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let runs = Arc::new(Mutex::new(BTreeMap::new()));
        let effects = Effects::default();
        let app = tenant_app(MemoryStore::new(), runs.clone(), effects.clone(), false);
        let pairs: Vec<(&str, &str)> = vec![
            ("ab", "c"),
            ("a", "bc"),
            ("abc", "d"),
            ("ab", "cd"),
            ("a", "bcd"),
            ("t1", "k"),
            ("t", "1k"),
            ("t1k", "z"),
        ];
        let mut tasks = Vec::new();
        for n in 0..160usize {
            let app = app.clone();
            let (tenant, key) = pairs[n % pairs.len()];
            tasks.push(tokio::spawn(async move {
                let (status, replayed, body) =
                    send(&app, tenant, key, "application/json", r#"{"a":1}"#).await;
                (tenant, key, status, replayed, body)
            }));
        }
        for t in tasks {
            let (tenant, key, status, replayed, body) = guard("request", t).await.expect("task");
            match status {
                StatusCode::CREATED => {
                    assert_eq!(
                        body,
                        format!(r#"{tenant}|{key}|{{"a":1}}|run 1"#),
                        "its own body"
                    );
                    assert!(replayed.is_none() || replayed.as_deref() == Some("true"));
                }
                StatusCode::CONFLICT => {}
                other => panic!("{tenant}/{key}: {other} {body}"),
            }
        }
        let runs_now = runs.lock().expect("runs").clone();
        assert_eq!(runs_now.len(), pairs.len(), "{runs_now:?}");
        assert!(
            runs_now.values().all(|&n| n == 1),
            "one run each: {runs_now:?}"
        );
        assert_eq!(effects.count(), pairs.len());
        // Afterwards: replays, each tenant its own, with the body canonical and not.
        for body in [r#"{"a":1}"#, r#"{ "a" : 1 }"#] {
            for (tenant, key) in &pairs {
                let (status, replayed, got) =
                    send(&app, tenant, key, "application/json", body).await;
                assert_eq!(status, StatusCode::CREATED);
                assert_eq!(replayed.as_deref(), Some("true"));
                assert_eq!(got, format!(r#"{tenant}|{key}|{{"a":1}}|run 1"#));
            }
        }
        assert_eq!(effects.count(), pairs.len(), "no more runs");
    });
}

/// DESIGN §1 step 4 (key order and whitespace do not matter, values do), §3 (a 5xx releases the
/// key; a retry re-attempts) and §7.1/§7.2: a JSON request sent canonical (hint set) fails with
/// 500 and is retried non-canonical (the takeover clears the hint), or the other way round;
/// later retries in either form replay the second run, a changed value gets 422, and the
/// handler ran exactly twice per key (counted in it); another tenant's same key runs its own.
#[test]
fn s1_json_retries_across_hint_flips_replay_the_run_that_completed() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let runs = Arc::new(Mutex::new(BTreeMap::new()));
        let effects = Effects::default();
        let app = tenant_app(MemoryStore::new(), runs.clone(), effects.clone(), true);
        let canonical = r#"{"a":1,"b":[true,null]}"#;
        let spaced = "{ \"b\" : [true, null], \"a\" : 1 }";
        for (key, first, second) in [
            ("k1", canonical, spaced),
            ("k2", spaced, canonical),
            ("k3", canonical, canonical),
        ] {
            for tenant in ["x", "xk"] {
                let (status, _, _) = send(&app, tenant, key, "application/json", first).await;
                assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
                let (status, replayed, body) =
                    send(&app, tenant, key, "application/json", second).await;
                assert_eq!(status, StatusCode::CREATED, "{key}: {body}");
                assert_ne!(replayed.as_deref(), Some("true"));
                let want = format!("{tenant}|{key}|{second}|run 2");
                assert_eq!(body, want);
                for retry in [canonical, spaced, first, second] {
                    let (status, replayed, body) =
                        send(&app, tenant, key, "application/json", retry).await;
                    assert_eq!(
                        (status, replayed.as_deref(), body.as_str()),
                        (StatusCode::CREATED, Some("true"), want.as_str()),
                        "{tenant}/{key} retry {retry}"
                    );
                }
                let (status, _, _) = send(
                    &app,
                    tenant,
                    key,
                    "application/json",
                    r#"{"a":2,"b":[true,null]}"#,
                )
                .await;
                assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
            }
        }
        let runs_now = runs.lock().expect("runs").clone();
        assert_eq!(runs_now.len(), 6);
        assert!(runs_now.values().all(|&n| n == 2), "{runs_now:?}");
        assert_eq!(effects.count(), 12);
    });
}
