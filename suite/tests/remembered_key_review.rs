//! Review of fae836c (`src/store/memory/mod.rs`: `hash_of`, `Hashed`, `REMEMBERED`): a thread
//! remembers the last key it hashed for a store as a copy of its bytes (scope and key joined,
//! up to 512 bytes since a later change; 256 when written), the split, the store's id and the hash, instead of a clone of the key.
//!
//! Written to break it, through the public API only:
//!
//! - a wrong remembered hash puts a record where a fresh allocation of its key does not look
//!   (a second `Acquired` for one key, a lost record) or finds another key's record. Every
//!   scenario reads keys back through other allocations, other threads (whose remembered hash
//!   is cold), and keys that are prefixes of each other or the same bytes split elsewhere;
//! - a remembered key must not keep the key's allocation, nor anything per request, alive:
//!   heap counted with `stats_alloc` (the tests of this file run one at a time, so the
//!   global counts are this test's).

use std::alloc::System;
use std::cell::RefCell;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex, mpsc};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use futures_util::FutureExt;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use tower::ServiceExt;
use tower_idempotency::store::{
    Claim, ClaimRequest, FencingToken, Fingerprint, LeaseExpiry, RecordStatus, ScopedKey,
    StoreError, StoredResponse,
};
use tower_idempotency::{IdempotencyLayer, IdempotencyStore, MemoryStore};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

mod common;

use common::Rng;
use common::memory::{Clock, live_heap, serial_blocking};

const HOUR: u64 = 3_600_000;

// ---------------------------------------------------------------------------------------------
// Helpers.
// ---------------------------------------------------------------------------------------------

/// A memory store's answer, which never waits.
fn at_once<F: Future>(f: F) -> F::Output {
    f.now_or_never().expect("a MemoryStore answers at once")
}

fn fp() -> Fingerprint {
    Fingerprint::from_bytes([7; 32])
}

fn creq(key: &ScopedKey) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        fingerprint: fp(),
        lease: Duration::from_millis(HOUR),
        ttl: Duration::from_millis(HOUR),
        on_lease_expiry: LeaseExpiry::Reclaim,
    }
}

fn resp(body: &str) -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: HeaderMap::new(),
        body: Some(bytes::Bytes::copy_from_slice(body.as_bytes())),
        trailers: None,
    }
}

fn body_of(r: &StoredResponse) -> String {
    String::from_utf8(r.body.as_deref().unwrap_or_default().to_vec()).expect("utf-8 body")
}

/// What a key's record says, so a response found under another key is caught.
fn label(store: usize, scope: &str, key: &str) -> String {
    format!("store {store} | {} | {scope} | {key}", scope.len())
}

/// ASCII text whose prefixes are each other's: keys of different lengths cut from it are
/// prefixes of one another, and the same length split elsewhere is the same bytes.
fn base(n: usize) -> String {
    const ALPHA: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.~";
    (0..n)
        .map(|i| ALPHA[(i * 7 + i / 13) % ALPHA.len()] as char)
        .collect()
}

/// Lengths of scope and key together, around the length a thread remembers (256 bytes, then 512) (and its neighbours,
/// and far past it).
const LENS: &[usize] = &[
    1, 2, 3, 36, 37, 128, 254, 255, 256, 257, 258, 259, 300, 510, 511, 512, 513, 700,
];

/// (scope, key) pairs: every length of [`LENS`] cut from the one [`base`], split at the start,
/// near it, in the middle, near the end and at the end.
fn family() -> Vec<(String, String)> {
    let b = base(*LENS.iter().max().expect("lens"));
    let mut out = Vec::new();
    for &len in LENS {
        let mut splits = vec![0, 1, 2, len / 2, len.saturating_sub(2), len - 1, len];
        splits.retain(|&s| s <= len);
        splits.sort_unstable();
        splits.dedup();
        for s in splits {
            out.push((b[..s].to_owned(), b[s..len].to_owned()));
        }
    }
    out
}

fn sk((scope, key): &(String, String)) -> ScopedKey {
    ScopedKey::new(scope, key)
}

/// Claims `key` fresh and completes it with its label; panics unless it was acquired.
fn acquire_and_complete(store: &MemoryStore, n: usize, pair: &(String, String)) {
    let key = sk(pair);
    let token = match at_once(store.claim(&creq(&key))) {
        Ok(Claim::Acquired(lease)) => lease.token,
        other => panic!(
            "store {n}: {pair:?} (len {}) should be new: {other:?}",
            pair.0.len()
        ),
    };
    // Completed through another allocation of the same bytes.
    at_once(store.complete(
        &sk(pair),
        token,
        &resp(&label(n, &pair.0, &pair.1)),
        Duration::from_millis(HOUR),
    ))
    .unwrap_or_else(|e| panic!("store {n}: completing {pair:?}: {e:?}"));
}

/// The claim of a completed key replays its own response, nothing else.
fn expect_replay(what: &str, got: Result<Claim, StoreError>, want: &str) {
    match got {
        Ok(Claim::Completed { response, .. }) => {
            assert_eq!(body_of(&response), want, "{what}: another key's response")
        }
        other => panic!("{what}: expected its completed record ({want}), got {other:?}"),
    }
}

/// Checks every key of every store from a new thread, whose remembered hash is cold: a
/// record put in the wrong place by a wrong remembered hash is not found there.
fn check_from_another_thread(stores: &[MemoryStore], keys: &[(String, String)]) {
    let stores = stores.to_vec();
    let keys = keys.to_vec();
    std::thread::spawn(move || {
        for (n, store) in stores.iter().enumerate() {
            assert_eq!(store.len(), keys.len(), "store {n} holds one record a key");
            for pair in &keys {
                let want = label(n, &pair.0, &pair.1);
                expect_replay(
                    &format!("fresh thread, store {n}, {pair:?}"),
                    at_once(store.claim(&creq(&sk(pair)))),
                    &want,
                );
                let record = at_once(store.lookup(&sk(pair)))
                    .expect("lookup")
                    .unwrap_or_else(|| panic!("store {n}: {pair:?} lost"));
                assert_eq!(record.key, sk(pair), "the record found is the key's own");
                assert_eq!(record.attempts, 1, "store {n}: {pair:?} acquired once");
            }
        }
    })
    .join()
    .expect("the checking thread");
}

// ---------------------------------------------------------------------------------------------
// 1. Hash correctness, one thread.
// ---------------------------------------------------------------------------------------------

/// Every key of the family (lengths 1..700 around 256 and 512, each split five ways, prefixes of each
/// other) in two stores: each is acquired exactly once and replays its own response, read
/// right after every other key of either store (so the thread remembers that key's bytes,
/// split, store and hash when it reads this one), through fresh allocations. Then checked from
/// a thread that remembers nothing, and removed one at a time without disturbing its
/// neighbours.
#[test]
fn every_key_after_every_other_key_finds_its_own_record() {
    let _serial = serial_blocking();
    let keys = family();
    // Same bytes, another split: different keys (`("ab", "c")` and `("a", "bc")` in kind).
    let abc = base(3);
    assert!(keys.contains(&(abc[..2].to_owned(), abc[2..].to_owned())));
    assert!(keys.contains(&(abc[..1].to_owned(), abc[1..].to_owned())));
    let stores = [MemoryStore::new(), MemoryStore::new()];
    for (i, pair) in keys.iter().enumerate() {
        for (n, store) in stores.iter().enumerate() {
            acquire_and_complete(store, n, pair);
            // The previous key's twin, the same bytes split elsewhere, read right after.
            if i > 0 {
                let prev = &keys[i - 1];
                expect_replay(
                    "the previous key right after",
                    at_once(store.claim(&creq(&sk(prev)))),
                    &label(n, &prev.0, &prev.1),
                );
            }
        }
    }
    for (n, store) in stores.iter().enumerate() {
        assert_eq!(store.len(), keys.len(), "store {n}: one record a key");
    }
    // Every ordered pair, in every pair of stores: `b` read right after `a` was hashed.
    let mut checked = 0usize;
    for (ai, a) in keys.iter().enumerate() {
        for (bi, b) in keys.iter().enumerate() {
            for sa in 0..2 {
                for sb in 0..2 {
                    let first = sk(a);
                    let r = stores[sa]
                        .completed_now(&first)
                        .expect("a completed key answers at once");
                    expect_replay("first of a pair", r, &label(sa, &a.0, &a.1));
                    // Through a fresh allocation, and through a clone of one.
                    let second = sk(b);
                    let want = label(sb, &b.0, &b.1);
                    let r = stores[sb]
                        .completed_now(&second)
                        .unwrap_or_else(|| panic!("{b:?} after {a:?} ({sa}->{sb}): not found"));
                    expect_replay(&format!("{b:?} after {a:?} ({sa}->{sb})"), r, &want);
                    assert_eq!(
                        stores[sb].recorded_fingerprint_now(&second.clone()),
                        Some(fp()),
                        "{b:?} after {a:?}"
                    );
                    if ai != bi && (ai + bi) % 3 == 0 {
                        // And back to the first, through its first allocation.
                        expect_replay(
                            "back to the first",
                            at_once(stores[sa].claim(&creq(&first))),
                            &label(sa, &a.0, &a.1),
                        );
                    }
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, keys.len() * keys.len() * 4);
    check_from_another_thread(&stores, &keys);

    // Removing a key removes that key only: its twins, prefixes and extensions stay, in both
    // stores.
    for (i, pair) in keys.iter().enumerate() {
        let n = i % 2;
        // Hash a twin first, so the thread remembers the same bytes split elsewhere.
        if let Some(next) = keys.get(i + 1) {
            let _ = stores[n].completed_now(&sk(next));
        }
        assert!(
            at_once(stores[n].remove(&sk(pair))).expect("remove"),
            "store {n}: {pair:?} was there to remove"
        );
        assert!(
            at_once(stores[n].lookup(&sk(pair)))
                .expect("lookup")
                .is_none()
        );
        assert!(!at_once(stores[n].remove(&sk(pair))).expect("remove again"));
        for later in &keys[i + 1..] {
            expect_replay(
                &format!("after removing {pair:?}"),
                stores[n].completed_now(&sk(later)).expect("still there"),
                &label(n, &later.0, &later.1),
            );
        }
        // The other store still has it.
        expect_replay(
            "the other store keeps its own",
            stores[1 - n].completed_now(&sk(pair)).expect("other store"),
            &label(1 - n, &pair.0, &pair.1),
        );
    }
    for (n, store) in stores.iter().enumerate() {
        assert_eq!(
            store.len(),
            keys.len() - keys.len().div_ceil(2) * (1 - n) - keys.len() / 2 * n
        );
    }
}

/// Issue 23 §3's own example, by the book: `("ab", "c")` and `("a", "bc")` are two keys, and
/// so are the same 256 (and 257, 512, 513) bytes split one apart. Each asked right after the other, in
/// both orders, in one store and across stores, each claim of a new one is `Acquired` once;
/// then each replays its own.
#[test]
fn the_same_bytes_split_one_apart_are_two_keys_at_every_length() {
    let _serial = serial_blocking();
    let b = base(600);
    for total in [3usize, 255, 256, 257, 511, 512, 513] {
        for at in [1usize, total / 2, total - 2] {
            let x = (b[..at + 1].to_owned(), b[at + 1..total].to_owned());
            let y = (b[..at].to_owned(), b[at..total].to_owned());
            for order in [[&x, &y], [&y, &x]] {
                let store = MemoryStore::new();
                let mut acquired = 0;
                for round in 0..3 {
                    for pair in order {
                        match at_once(store.claim(&creq(&sk(pair)))) {
                            Ok(Claim::Acquired(lease)) => {
                                acquired += 1;
                                at_once(store.complete(
                                    &sk(pair),
                                    lease.token,
                                    &resp(&label(0, &pair.0, &pair.1)),
                                    Duration::from_millis(HOUR),
                                ))
                                .expect("complete");
                            }
                            other => expect_replay(
                                &format!("round {round}, {pair:?}"),
                                other,
                                &label(0, &pair.0, &pair.1),
                            ),
                        }
                    }
                }
                assert_eq!(
                    acquired, 2,
                    "total {total}, split {at}: two keys, once each"
                );
                assert_eq!(store.len(), 2);
                check_from_another_thread(&[store], &[x.clone(), y.clone()]);
            }
        }
    }
}

/// Stores made and dropped one after another (each a fresh id and hasher), and two kept
/// stores used alternately with the same keys: a key's hash remembered for one store never
/// answers for another. Counted by acquisitions: each store acquires each key once.
#[test]
fn stores_used_alternately_and_stores_remade_never_share_a_remembered_hash() {
    let _serial = serial_blocking();
    let keys = family();
    let kept = [MemoryStore::new(), MemoryStore::new()];
    for round in 0..40usize {
        let pair = &keys[(round * 7) % keys.len()];
        // A store that lives for one round, and its clone (the same store).
        let brief = MemoryStore::new();
        let same = brief.clone();
        for (n, store) in kept.iter().enumerate() {
            let key = sk(pair);
            // The kept store remembers the key...
            let got = at_once(store.claim(&creq(&key)));
            if let Ok(Claim::Acquired(lease)) = got {
                at_once(store.complete(
                    &key,
                    lease.token,
                    &resp(&label(n, &pair.0, &pair.1)),
                    Duration::from_millis(HOUR),
                ))
                .expect("complete");
            } else {
                expect_replay("kept store", got, &label(n, &pair.0, &pair.1));
            }
            // ...then the brief store is asked for the same bytes: new there.
            match at_once(brief.claim(&creq(&key))) {
                Ok(Claim::Acquired(_)) if n == 0 => {}
                Ok(Claim::Existing { record, .. }) if n == 1 => {
                    assert_eq!(record.status, RecordStatus::InProgress);
                    assert_eq!(record.key, key);
                }
                other => panic!("round {round}, store {n}: brief store: {other:?}"),
            }
            // Its clone shares its records.
            assert!(
                at_once(same.lookup(&sk(pair))).expect("lookup").is_some(),
                "a clone of the store finds the record"
            );
        }
        assert_eq!(brief.len(), 1);
        drop((brief, same));
    }
    // 40 rounds over a family of > 40 keys at stride 7: each key at most once a round, so the
    // kept stores hold as many records as distinct keys named.
    let named: std::collections::BTreeSet<usize> =
        (0..40usize).map(|r| (r * 7) % keys.len()).collect();
    let named: Vec<(String, String)> = named.into_iter().map(|i| keys[i].clone()).collect();
    check_from_another_thread(&kept, &named);
}

/// Random operations (claim, claim_now, complete, a fenced complete, release, remove, lookup,
/// completed_now, recorded_fingerprint_now) over the family in three stores (one remade now
/// and then), each through a fresh allocation or a clone kept from before, against a model.
#[test]
fn random_operations_match_a_model() {
    let _serial = serial_blocking();
    #[derive(Clone, Debug, PartialEq)]
    enum M {
        InProgress(FencingToken),
        Completed(String),
        Released,
    }
    let keys = family();
    let mut stores = [MemoryStore::new(), MemoryStore::new(), MemoryStore::new()];
    let mut models: [HashMap<usize, M>; 3] = Default::default();
    let mut held: Vec<ScopedKey> = keys.iter().map(sk).collect();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for step in 0..30_000u64 {
        if step % 5_000 == 4_999 {
            stores[2] = MemoryStore::new();
            models[2].clear();
        }
        let s = rng.next(3) as usize;
        let k = rng.next(keys.len() as u64) as usize;
        let key = if rng.next(2) == 0 {
            sk(&keys[k])
        } else {
            held[k].clone()
        };
        if rng.next(16) == 0 {
            // Another allocation of the same bytes kept from now on (the old one freed).
            held[k] = sk(&keys[k]);
        }
        let store = &stores[s];
        let model = &mut models[s];
        let what = format!("step {step}, store {s}, key {k} {:?}", keys[k]);
        match rng.next(9) {
            0 | 1 => {
                let got = if rng.next(2) == 0 {
                    at_once(store.claim(&creq(&key)))
                } else {
                    store.claim_now(&creq(&key)).expect("claim_now answers")
                };
                match (model.get(&k).cloned(), got) {
                    (None | Some(M::Released), Ok(Claim::Acquired(lease))) => {
                        model.insert(k, M::InProgress(lease.token));
                    }
                    (Some(M::InProgress(t)), Ok(Claim::Existing { record, .. })) => {
                        assert_eq!(record.lease_token, t, "{what}");
                        assert_eq!(record.key, key, "{what}");
                    }
                    (Some(M::Completed(b)), got) => expect_replay(&what, got, &b),
                    (m, got) => panic!("{what}: model {m:?}, store {got:?}"),
                }
            }
            2 => {
                if let Some(M::InProgress(t)) = model.get(&k).cloned() {
                    let b = format!("{} at {step}", label(s, &keys[k].0, &keys[k].1));
                    at_once(store.complete(&key, t, &resp(&b), Duration::from_millis(HOUR)))
                        .unwrap_or_else(|e| panic!("{what}: complete: {e:?}"));
                    model.insert(k, M::Completed(b));
                }
            }
            3 => {
                let got = at_once(store.complete(
                    &key,
                    FencingToken::new(0),
                    &resp("never"),
                    Duration::from_millis(HOUR),
                ));
                assert!(matches!(got, Err(StoreError::Fenced)), "{what}: {got:?}");
            }
            4 => {
                if let Some(M::InProgress(t)) = model.get(&k).cloned() {
                    let got = at_once(store.release(&key, t));
                    assert_eq!(got.ok(), Some(RecordStatus::Released), "{what}");
                    model.insert(k, M::Released);
                }
            }
            5 => {
                let removed = at_once(store.remove(&key)).expect("remove");
                assert_eq!(removed, model.remove(&k).is_some(), "{what}");
            }
            6 => {
                let got = at_once(store.lookup(&key)).expect("lookup");
                let status = got.as_ref().map(|r| r.status);
                let want = model.get(&k).map(|m| match m {
                    M::InProgress(_) => RecordStatus::InProgress,
                    M::Completed(_) => RecordStatus::Completed,
                    M::Released => RecordStatus::Released,
                });
                assert_eq!(status, want, "{what}");
                if let Some(r) = got {
                    assert_eq!(r.key, key, "{what}");
                    if let Some(M::Completed(b)) = model.get(&k) {
                        assert_eq!(r.response.as_ref().map(body_of).as_deref(), Some(&b[..]));
                    }
                }
            }
            7 => match (model.get(&k), store.completed_now(&key)) {
                (Some(M::Completed(b)), Some(got)) => expect_replay(&what, got, b),
                (Some(M::Completed(_)), None) => panic!("{what}: completed record not found"),
                (_, None) => {}
                (m, Some(got)) => panic!("{what}: model {m:?}, completed_now {got:?}"),
            },
            _ => {
                let got = store.recorded_fingerprint_now(&key);
                let want = matches!(model.get(&k), Some(M::Completed(_))).then(fp);
                assert_eq!(got, want, "{what}");
            }
        }
    }
    // From a thread that remembers nothing: every store holds exactly what its model says.
    let stores_c = stores.clone();
    let models_c = models.clone();
    std::thread::spawn(move || {
        for (s, (store, model)) in stores_c.iter().zip(&models_c).enumerate() {
            assert_eq!(store.len(), model.len(), "store {s}");
            for (k, pair) in keys.iter().enumerate() {
                let got = at_once(store.lookup(&sk(pair))).expect("lookup");
                match (model.get(&k), got) {
                    (None, None) => {}
                    (Some(M::InProgress(t)), Some(r)) => {
                        assert_eq!(r.status, RecordStatus::InProgress);
                        assert_eq!(r.lease_token, *t);
                    }
                    (Some(M::Completed(b)), Some(r)) => {
                        assert_eq!(r.response.as_ref().map(body_of).as_deref(), Some(&b[..]))
                    }
                    (Some(M::Released), Some(r)) => assert_eq!(r.status, RecordStatus::Released),
                    (m, got) => panic!("store {s}, key {k}: model {m:?}, store {got:?}"),
                }
            }
        }
    })
    .join()
    .expect("checking thread");
}

// ---------------------------------------------------------------------------------------------
// 2. Hash correctness, many threads.
// ---------------------------------------------------------------------------------------------

/// Four OS threads claim the whole family in two stores, each in its own order and several
/// times over, hashing another key between a claim and its completion: each key is acquired
/// exactly once per store, the completion (which hashes again, maybe on a remembered hash) is
/// never fenced, and every replay is the key's own.
#[test]
fn threads_hammering_overlapping_keys_acquire_each_once() {
    let _serial = serial_blocking();
    let keys = Arc::new(family());
    let stores = [MemoryStore::new(), MemoryStore::new()];
    let acquired: Arc<Vec<AtomicUsize>> =
        Arc::new((0..keys.len() * 2).map(|_| AtomicUsize::new(0)).collect());
    const THREADS: usize = 4;
    let barrier = Arc::new(Barrier::new(THREADS));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (keys, stores, acquired, barrier) = (
                keys.clone(),
                stores.clone(),
                acquired.clone(),
                barrier.clone(),
            );
            std::thread::spawn(move || {
                let mut rng = Rng(0x1234_5678 + t as u64 * 0x9E37);
                barrier.wait();
                for round in 0..3 {
                    for step in 0..keys.len() * 2 {
                        let k = rng.next(keys.len() as u64) as usize;
                        let s = (step + t + round) % 2;
                        let pair = &keys[k];
                        let key = sk(pair);
                        let want = label(s, &pair.0, &pair.1);
                        match at_once(stores[s].claim(&creq(&key))) {
                            Ok(Claim::Acquired(lease)) => {
                                acquired[s * keys.len() + k].fetch_add(1, Ordering::SeqCst);
                                // Another key, maybe in the other store, hashed in between.
                                let other = &keys[rng.next(keys.len() as u64) as usize];
                                let _ = stores[1 - s].completed_now(&sk(other));
                                let _ = stores[s].recorded_fingerprint_now(&sk(other));
                                std::thread::yield_now();
                                at_once(stores[s].complete(
                                    &key,
                                    lease.token,
                                    &resp(&want),
                                    Duration::from_millis(HOUR),
                                ))
                                .unwrap_or_else(|e| {
                                    panic!("thread {t}: completing {pair:?} in {s}: {e:?}")
                                });
                            }
                            Ok(Claim::Existing { record, .. }) => {
                                assert_eq!(record.key, key, "thread {t}");
                                assert_eq!(record.status, RecordStatus::InProgress);
                            }
                            other => expect_replay(&format!("thread {t}, {pair:?}"), other, &want),
                        }
                    }
                }
                // Then every key, in this thread's order.
                for k in 0..keys.len() {
                    let k = (k * 13 + t) % keys.len();
                    for s in 0..2 {
                        let pair = &keys[k];
                        let got = at_once(stores[s].claim(&creq(&sk(pair))));
                        match got {
                            Ok(Claim::Acquired(lease)) => {
                                acquired[s * keys.len() + k].fetch_add(1, Ordering::SeqCst);
                                at_once(stores[s].complete(
                                    &sk(pair),
                                    lease.token,
                                    &resp(&label(s, &pair.0, &pair.1)),
                                    Duration::from_millis(HOUR),
                                ))
                                .expect("complete");
                            }
                            Ok(Claim::Existing { .. }) => {}
                            other => expect_replay("last pass", other, &label(s, &pair.0, &pair.1)),
                        }
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a hammering thread");
    }
    for (i, n) in acquired.iter().enumerate() {
        assert_eq!(
            n.load(Ordering::SeqCst),
            1,
            "store {}, key {:?}: acquired once",
            i / keys.len(),
            keys[i % keys.len()]
        );
    }
    check_from_another_thread(&stores, &keys);
}

/// Tasks on a multi-thread tokio runtime claim, yield (so they move between workers, each
/// with its own remembered hash) and complete overlapping keys; a completion made on another
/// worker than its claim is never fenced, and each key is acquired once.
#[test]
fn tasks_moving_between_workers_acquire_each_key_once() {
    let _serial = serial_blocking();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("runtime");
    let keys = Arc::new(family());
    let stores = [MemoryStore::new(), MemoryStore::new()];
    let acquired: Arc<Vec<AtomicUsize>> =
        Arc::new((0..keys.len() * 2).map(|_| AtomicUsize::new(0)).collect());
    rt.block_on(async {
        let mut tasks = Vec::new();
        for t in 0..32usize {
            let (keys, stores, acquired) = (keys.clone(), stores.clone(), acquired.clone());
            tasks.push(tokio::spawn(async move {
                let mut rng = Rng(0xABCD_EF01 + t as u64 * 7919);
                for step in 0..keys.len() {
                    let k = rng.next(keys.len() as u64) as usize;
                    let s = (t + step) % 2;
                    let pair = &keys[k];
                    let key = sk(pair);
                    let want = label(s, &pair.0, &pair.1);
                    match stores[s].claim(&creq(&key)).await {
                        Ok(Claim::Acquired(lease)) => {
                            acquired[s * keys.len() + k].fetch_add(1, Ordering::SeqCst);
                            for _ in 0..rng.next(4) {
                                tokio::task::yield_now().await;
                            }
                            stores[s]
                                .complete(
                                    &key,
                                    lease.token,
                                    &resp(&want),
                                    Duration::from_secs(3600),
                                )
                                .await
                                .unwrap_or_else(|e| panic!("task {t}: {pair:?}: {e:?}"));
                            tokio::task::yield_now().await;
                            expect_replay(
                                "right after completing",
                                stores[s].claim(&creq(&sk(pair))).await,
                                &want,
                            );
                        }
                        Ok(Claim::Existing { record, .. }) => assert_eq!(record.key, key),
                        other => expect_replay(&format!("task {t}"), other, &want),
                    }
                }
            }));
        }
        for task in tasks {
            common::guard("a task", task).await.expect("task");
        }
    });
    let mut named = 0;
    for (i, n) in acquired.iter().enumerate() {
        let n = n.load(Ordering::SeqCst);
        assert!(
            n <= 1,
            "store {}, key {:?} acquired {n} times",
            i / keys.len(),
            keys[i % keys.len()]
        );
        named += n;
    }
    // Records are exactly the acquisitions: no key recorded twice under two hashes.
    assert_eq!(stores[0].len() + stores[1].len(), named);
    for (s, store) in stores.iter().enumerate() {
        for (k, pair) in keys.iter().enumerate() {
            if acquired[s * keys.len() + k].load(Ordering::SeqCst) == 1 {
                expect_replay(
                    "after",
                    store.completed_now(&sk(pair)).expect("found"),
                    &label(s, &pair.0, &pair.1),
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Keys used from thread-local destructors (a child process: a panic there aborts).
// ---------------------------------------------------------------------------------------------

const TEARDOWN_CHILD: &str = "REMEMBERED_KEY_REVIEW_TEARDOWN_CHILD";

struct Teardown {
    store: MemoryStore,
    keys: Vec<(String, String)>,
    out: Arc<Mutex<Vec<String>>>,
}

impl Drop for Teardown {
    fn drop(&mut self) {
        for pair in &self.keys {
            let line = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let key = sk(pair);
                let Ok(Claim::Acquired(lease)) = at_once(self.store.claim(&creq(&key))) else {
                    return format!("{pair:?}: not acquired");
                };
                let done = at_once(self.store.complete(
                    &sk(pair),
                    lease.token,
                    &resp(&label(0, &pair.0, &pair.1)),
                    Duration::from_millis(HOUR),
                ));
                if done.is_err() {
                    return format!("{pair:?}: complete {done:?}");
                }
                match self.store.completed_now(&sk(pair)) {
                    Some(Ok(Claim::Completed { response, .. }))
                        if body_of(&response) == label(0, &pair.0, &pair.1) =>
                    {
                        format!("{pair:?}: ok")
                    }
                    other => format!("{pair:?}: read back {other:?}"),
                }
            }))
            .unwrap_or_else(|_| format!("{pair:?}: panicked"));
            self.out.lock().expect("out").push(line);
        }
    }
}

thread_local! {
    static EARLY: RefCell<Option<Teardown>> = const { RefCell::new(None) };
    static LATE: RefCell<Option<Teardown>> = const { RefCell::new(None) };
}

fn teardown_child() {
    let keys = family();
    let (early, late) = keys.split_at(keys.len() / 2);
    for round in 0..3 {
        let store = MemoryStore::new();
        let out = Arc::new(Mutex::new(Vec::new()));
        let (s, o, early, late) = (store.clone(), out.clone(), early.to_vec(), late.to_vec());
        std::thread::spawn(move || {
            // EARLY registers before the thread has hashed anything or joined a key, LATE
            // after: one runs after the thread's key buffer is torn down.
            EARLY.with(|e| {
                *e.borrow_mut() = Some(Teardown {
                    store: s.clone(),
                    keys: early,
                    out: o.clone(),
                })
            });
            let warm = ScopedKey::new("warm", format!("{round}"));
            assert!(matches!(
                at_once(s.claim(&creq(&warm))),
                Ok(Claim::Acquired(_))
            ));
            LATE.with(|l| {
                *l.borrow_mut() = Some(Teardown {
                    store: s,
                    keys: late,
                    out: o,
                })
            });
        })
        .join()
        .expect("thread");
        let got = std::mem::take(&mut *out.lock().expect("out"));
        let bad: Vec<&String> = got.iter().filter(|l| !l.ends_with(": ok")).collect();
        assert!(bad.is_empty(), "round {round}: {bad:?}");
        assert_eq!(got.len(), keys.len(), "both destructors ran every key");
        assert_eq!(store.len(), keys.len() + 1);
        assert!(at_once(store.remove(&ScopedKey::new("warm", format!("{round}")))).expect("rm"));
        for pair in &keys {
            expect_replay(
                "after the thread ended",
                at_once(store.claim(&creq(&sk(pair)))),
                &label(0, &pair.0, &pair.1),
            );
        }
        check_from_another_thread(&[store], &keys);
    }
    println!("TEARDOWN-CHILD-OK");
}

/// DESIGN §1 step 7 (a dropped future gives its key back during a thread's teardown): store
/// calls from thread-local destructors, before and after the thread's key buffer is gone,
/// neither panic nor answer another key's record, and what they record is found afterwards
/// through other allocations on another thread.
#[test]
fn keys_used_while_a_threads_locals_are_torn_down() {
    if std::env::var_os(TEARDOWN_CHILD).is_some() {
        teardown_child();
        return;
    }
    let _serial = serial_blocking();
    common::run_child(
        module_path!(),
        "keys_used_while_a_threads_locals_are_torn_down",
        TEARDOWN_CHILD,
    );
}

// ---------------------------------------------------------------------------------------------
// 4. What stays alive.
// ---------------------------------------------------------------------------------------------

/// The size of a key's one allocation (`Arc<str>`: two counts, then scope and key joined).
fn key_alloc(joined: usize) -> usize {
    16 + joined
}

/// Dropping the last handle of a key frees its allocation right there, whatever the store did
/// with it last (claimed, completed, replayed, read, removed, released and taken over, asked
/// at once, in another store too), whatever its length around the length a thread remembers (256 bytes, then 512), and
/// whether the store was last used with it on this thread or on another one that is still
/// alive. A thread remembering the key by a clone would keep it (no deallocation at the drop).
#[test]
fn dropping_a_keys_last_handle_frees_it_whatever_the_store_did() {
    let _serial = serial_blocking();
    let stores = [MemoryStore::new(), MemoryStore::new()];
    type Ops = fn(&[MemoryStore; 2], &ScopedKey);
    let sequences: Vec<(&str, Ops)> = vec![
        (
            "claim",
            (|s: &[MemoryStore; 2], k: &ScopedKey| {
                assert!(matches!(
                    at_once(s[0].claim(&creq(k))),
                    Ok(Claim::Acquired(_))
                ));
            }) as Ops,
        ),
        (
            "claim, complete",
            (|s: &[MemoryStore; 2], k: &ScopedKey| {
                let Ok(Claim::Acquired(l)) = at_once(s[0].claim(&creq(k))) else {
                    panic!("acquired")
                };
                at_once(s[0].complete(k, l.token, &resp("x"), Duration::from_millis(HOUR)))
                    .expect("complete");
            }) as Ops,
        ),
        (
            "claim, complete, replay, lookup, reads at once",
            (|s: &[MemoryStore; 2], k: &ScopedKey| {
                let Ok(Claim::Acquired(l)) = at_once(s[0].claim(&creq(k))) else {
                    panic!("acquired")
                };
                at_once(s[0].complete(k, l.token, &resp("x"), Duration::from_millis(HOUR)))
                    .expect("complete");
                expect_replay("replay", at_once(s[0].claim(&creq(k))), "x");
                drop(at_once(s[0].lookup(k)).expect("lookup").expect("record"));
                assert!(s[0].completed_now(k).is_some());
                assert!(s[0].recorded_fingerprint_now(k).is_some());
            }) as Ops,
        ),
        (
            "claim, complete, remove",
            (|s: &[MemoryStore; 2], k: &ScopedKey| {
                let Ok(Claim::Acquired(l)) = at_once(s[0].claim(&creq(k))) else {
                    panic!("acquired")
                };
                at_once(s[0].complete(k, l.token, &resp("x"), Duration::from_millis(HOUR)))
                    .expect("complete");
                assert!(at_once(s[0].remove(k)).expect("remove"));
            }) as Ops,
        ),
        (
            "claim, release, take over, complete, remove",
            (|s: &[MemoryStore; 2], k: &ScopedKey| {
                let Ok(Claim::Acquired(l)) = at_once(s[0].claim(&creq(k))) else {
                    panic!("acquired")
                };
                at_once(s[0].release(k, l.token)).expect("release");
                let Ok(Claim::Acquired(l)) = s[0].claim_now(&creq(k)).expect("now") else {
                    panic!("taken over")
                };
                at_once(s[0].renew(k, l.token, Duration::from_millis(HOUR))).expect("renew");
                at_once(s[0].complete(k, l.token, &resp("x"), Duration::from_millis(HOUR)))
                    .expect("complete");
                assert!(at_once(s[0].remove(k)).expect("remove"));
            }) as Ops,
        ),
        (
            "reads of an absent key only",
            (|s: &[MemoryStore; 2], k: &ScopedKey| {
                assert!(s[0].completed_now(k).is_none());
                assert!(s[0].recorded_fingerprint_now(k).is_none());
                assert!(at_once(s[0].lookup(k)).expect("lookup").is_none());
                assert!(!at_once(s[0].remove(k)).expect("remove"));
            }) as Ops,
        ),
        (
            "two stores, alternately",
            (|s: &[MemoryStore; 2], k: &ScopedKey| {
                for store in [&s[0], &s[1], &s[0]] {
                    let _ = at_once(store.claim(&creq(k)));
                }
                assert!(at_once(s[1].remove(k)).expect("remove"));
                assert!(at_once(s[0].remove(k)).expect("remove"));
            }) as Ops,
        ),
    ];
    let mut checked = 0;
    for (name, ops) in &sequences {
        for len in [
            1usize, 36, 200, 248, 249, 250, 255, 256, 257, 504, 505, 506, 1000,
        ] {
            for elsewhere in [false, true] {
                let scope = "tenant-";
                let tail = format!("{name}-{elsewhere}-");
                let key_text = format!(
                    "{tail}{}",
                    "k".repeat(len.saturating_sub(tail.len()).max(1))
                );
                let key = ScopedKey::new(scope, &key_text);
                let joined = scope.len() + key_text.len();
                if elsewhere {
                    // Used on another thread, which stays alive (parked) while we look.
                    let (done_tx, done_rx) = mpsc::channel();
                    let (go_tx, go_rx) = mpsc::channel::<()>();
                    let (s2, k2) = (stores.clone(), key.clone());
                    let ops = *ops;
                    let t = std::thread::spawn(move || {
                        ops(&s2, &k2);
                        drop((s2, k2));
                        done_tx.send(()).expect("done");
                        let _ = go_rx.recv();
                    });
                    done_rx.recv().expect("the thread ran");
                    let region = Region::new(GLOBAL);
                    drop(key);
                    let freed = region.change();
                    go_tx.send(()).expect("go");
                    t.join().expect("thread");
                    assert!(
                        freed.deallocations >= 1 && freed.bytes_deallocated >= key_alloc(joined),
                        "{name}, {joined} bytes, on a live thread: the key's allocation was \
                         not freed with its last handle ({freed:?})"
                    );
                } else {
                    ops(&stores, &key);
                    let region = Region::new(GLOBAL);
                    drop(key);
                    let freed = region.change();
                    assert!(
                        freed.deallocations >= 1 && freed.bytes_deallocated >= key_alloc(joined),
                        "{name}, {joined} bytes: the key's allocation was not freed with its \
                         last handle ({freed:?})"
                    );
                }
                checked += 1;
                // Clean up what the sequence left, through another allocation.
                let again = ScopedKey::new(scope, &key_text);
                for store in &stores {
                    let _ = at_once(store.remove(&again));
                }
            }
        }
    }
    assert_eq!(checked, sequences.len() * 26);
    assert!(stores.iter().all(MemoryStore::is_empty));
}

/// One round of `n` unique keys (`tag` keeps rounds apart): claimed, completed, replayed.
fn unique_round(store: &MemoryStore, tag: &str, n: usize, ttl: Duration) -> Vec<(String, String)> {
    let mut pairs = Vec::with_capacity(n);
    for i in 0..n {
        let scope = format!("tenant-{}", i % 5);
        let len = [8usize, 36, 120, 240, 249, 250, 251, 400, 700][i % 9];
        let head = format!("{tag}-{i}-");
        let key = format!("{head}{}", "k".repeat(len.saturating_sub(head.len())));
        let k = ScopedKey::new(&scope, &key);
        let Ok(Claim::Acquired(l)) = at_once(store.claim(&creq(&k))) else {
            panic!("{tag} {i}: acquired")
        };
        at_once(store.complete(&k, l.token, &resp("done"), ttl)).expect("complete");
        expect_replay(
            "replay",
            at_once(store.claim(&creq(&ScopedKey::new(&scope, &key)))),
            "done",
        );
        pairs.push((scope, key));
    }
    pairs
}

/// Unique keys (short, around 256 bytes, and long) claimed, completed, replayed and then
/// removed leave the heap where it was: nothing keeps their keys (or anything per request)
/// once they are gone. Measured after a first round of the same shape, so the store's tables
/// and the thread's buffers are already grown.
#[test]
fn unique_keys_removed_leave_the_heap_where_it_was() {
    let _serial = serial_blocking();
    let store = MemoryStore::new();
    const N: usize = 3_000;
    let mut deltas = Vec::new();
    for round in 0..3 {
        let region = Region::new(GLOBAL);
        let pairs = unique_round(&store, &format!("r{round}"), N, Duration::from_millis(HOUR));
        assert_eq!(store.len(), N);
        for (scope, key) in &pairs {
            assert!(at_once(store.remove(&ScopedKey::new(scope, key))).expect("remove"));
        }
        drop(pairs);
        assert!(store.is_empty());
        assert_eq!(store.bytes(), 0, "what the records weigh goes with them");
        deltas.push(live_heap(&region));
    }
    println!("live heap after each round of {N} unique keys removed: {deltas:?}");
    // Each round keeps ~N keys of ~300 bytes alive if keys leak: ~900 KB. The first round
    // grows the store's tables; the later ones must give everything back.
    for (round, d) in deltas.iter().enumerate().skip(1) {
        assert!(
            *d <= 1024,
            "round {round}: {d} bytes stayed live after every key was removed: {deltas:?}"
        );
    }
}

/// The same through expiry: unique keys completed with a short TTL, the clock moved past it,
/// `purge_expired`: the heap goes back where it was after the first round.
#[test]
fn unique_keys_expired_and_purged_leave_the_heap_where_it_was() {
    let _serial = serial_blocking();
    let clock = Clock::new();
    let store = clock.store();
    const N: usize = 3_000;
    let mut deltas = Vec::new();
    for round in 0..3 {
        let region = Region::new(GLOBAL);
        let pairs = unique_round(
            &store,
            &format!("e{round}"),
            N,
            Duration::from_millis(1_000),
        );
        drop(pairs);
        assert_eq!(store.len(), N);
        clock.advance(2_000);
        let purged = at_once(store.purge_expired()).expect("purge");
        assert_eq!(
            purged, N as u64,
            "round {round}: every expired record purged"
        );
        assert!(store.is_empty());
        assert_eq!(store.bytes(), 0);
        deltas.push(live_heap(&region));
    }
    println!("live heap after each round of {N} unique keys purged: {deltas:?}");
    for (round, d) in deltas.iter().enumerate().skip(1) {
        assert!(
            *d <= 1024,
            "round {round}: {d} bytes stayed live after every record was purged: {deltas:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 5. Through the HTTP layer.
// ---------------------------------------------------------------------------------------------

/// A route whose handler counts its runs per (scope header, key) and answers with the count;
/// the layer scopes by the `x-scope` header verbatim (`custom:` + it), so the test chooses
/// where scope ends and key begins.
fn app(store: MemoryStore, runs: Arc<Mutex<HashMap<(String, String), usize>>>) -> Router {
    Router::new()
        .route(
            "/op",
            post(move |headers: HeaderMap| {
                let runs = runs.clone();
                async move {
                    let scope = headers
                        .get("x-scope")
                        .map(|v| v.to_str().expect("ascii").to_owned())
                        .unwrap_or_default();
                    let key = headers
                        .get("idempotency-key")
                        .map(|v| v.to_str().expect("ascii").to_owned())
                        .expect("a key");
                    let mut runs = runs.lock().expect("runs");
                    let n = runs.entry((scope.clone(), key.clone())).or_default();
                    *n += 1;
                    format!("{scope}|{key}|run {n}")
                }
            }),
        )
        .layer(IdempotencyLayer::new(store).scope_with(HeaderScope))
}

/// The scope a closure over `x-scope` would give (`custom:` and the header's text), an empty
/// one included: a closure's empty scope is refused (500 `scope-missing`), and these tests
/// want every split of the same bytes, the one that leaves the scope empty too.
#[derive(Clone)]
struct HeaderScope;

impl tower_idempotency::scope::MakeScope for HeaderScope {
    fn make_scope(
        &self,
        parts: &http::request::Parts,
    ) -> Result<String, tower_idempotency::scope::MissingScope> {
        let scope = parts
            .headers
            .get("x-scope")
            .map(|v| v.to_str().unwrap_or_default().to_owned())
            .unwrap_or_default();
        Ok(format!("custom:{scope}"))
    }
}

async fn call(app: &Router, scope: &str, key: &str) -> (StatusCode, String) {
    let mut req = Request::post("/op")
        .header("idempotency-key", key)
        .header("content-type", "text/plain");
    if !scope.is_empty() {
        req = req.header("x-scope", scope);
    }
    let res = app
        .clone()
        .oneshot(req.body(Body::from("go")).expect("request"))
        .await
        .expect("infallible");
    let status = res.status();
    let body = res.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8(body.to_vec()).expect("utf-8"))
}

/// Through the layer (in process, `oneshot`): scope and key splits of the same bytes, with
/// scope and key together (`custom:` included) around the length a thread remembers (256 bytes, then 512), each sent
/// three times in three orders. The handler runs once per pair, every retry replays that
/// run's answer, and no pair gets another's.
#[test]
fn through_the_layer_each_split_runs_once_and_replays_its_own() {
    let _serial = serial_blocking();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let b = base(600);
    let mut pairs: Vec<(String, String)> = Vec::new();
    // "custom:" is 7 bytes: totals of scope + key from 242 to 256 put the stored key at
    // 249..263 bytes.
    for total in [3usize, 36, 242, 247, 248, 249, 250, 251, 256, 300] {
        let lowest = total.saturating_sub(255);
        for s in [lowest, lowest + 1, total / 2, total - 2, total - 1] {
            if s < total && total - s <= 255 {
                pairs.push((b[..s].to_owned(), b[s..total].to_owned()));
            }
        }
    }
    pairs.sort();
    pairs.dedup();
    let runs = Arc::new(Mutex::new(HashMap::new()));
    let app = app(MemoryStore::new(), runs.clone());
    rt.block_on(async {
        let mut first: HashMap<(String, String), String> = HashMap::new();
        let orders: [Vec<usize>; 3] = [
            (0..pairs.len()).collect(),
            (0..pairs.len()).rev().collect(),
            (0..pairs.len()).map(|i| (i * 7) % pairs.len()).collect(),
        ];
        for (o, order) in orders.iter().enumerate() {
            for &i in order {
                let (scope, key) = &pairs[i];
                // Twice in a row, then its neighbour (the same bytes split one apart).
                for _ in 0..2 {
                    let (status, body) = call(&app, scope, key).await;
                    assert_eq!(status, StatusCode::OK, "{scope:?} {key:?}: {body}");
                    let was = first
                        .entry(pairs[i].clone())
                        .or_insert_with(|| body.clone());
                    assert_eq!(
                        &body, was,
                        "order {o}: {scope:?} {key:?} replays its own run"
                    );
                    assert!(body.starts_with(&format!("{scope}|{key}|")), "{body}");
                }
                if let Some(next) = pairs.get(i + 1) {
                    let (_, body) = call(&app, &next.0, &next.1).await;
                    assert!(
                        body.starts_with(&format!("{}|{}|", next.0, next.1)),
                        "{body}"
                    );
                }
            }
        }
    });
    let runs = runs.lock().expect("runs");
    assert_eq!(runs.len(), pairs.len(), "every pair ran");
    for (pair, n) in runs.iter() {
        assert_eq!(*n, 1, "{pair:?} ran {n} times");
    }
}

/// Through the layer: requests with unique keys (and scopes, up to the longest key) answered,
/// then expired and purged: the heap goes back where it was after a first round. Nothing the
/// layer or the store did for a request keeps its key.
#[test]
fn through_the_layer_unique_keys_leave_the_heap_where_it_was_once_purged() {
    let _serial = serial_blocking();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let clock = Clock::new();
    let store = clock.store();
    let effects = Arc::new(AtomicUsize::new(0));
    let e = effects.clone();
    let app = Router::new()
        .route(
            "/op",
            post(move || {
                let e = e.clone();
                async move {
                    e.fetch_add(1, Ordering::SeqCst);
                    "done"
                }
            }),
        )
        .layer(IdempotencyLayer::new(store.clone()).scope_with(HeaderScope));
    const N: usize = 800;
    let mut deltas = Vec::new();
    rt.block_on(async {
        for round in 0..3 {
            let region = Region::new(GLOBAL);
            for i in 0..N {
                let scope = "t".repeat([0usize, 1, 36, 100][i % 4]);
                let head = format!("r{round}-{i}-");
                let len = [1usize, 36, 200, 248, 249, 250, 255][i % 7].max(head.len());
                let key = format!("{head}{}", "k".repeat(len - head.len()));
                for _ in 0..2 {
                    let (status, body) = call(&app, &scope, &key).await;
                    assert_eq!((status, body.as_str()), (StatusCode::OK, "done"));
                }
            }
            assert_eq!(store.len(), N);
            // Past the default TTL (a day).
            clock.advance(48 * HOUR as i64);
            let purged = store.purge_expired().await.expect("purge");
            assert_eq!(purged, N as u64);
            assert!(store.is_empty());
            deltas.push(live_heap(&region));
        }
    });
    assert_eq!(
        effects.load(Ordering::SeqCst),
        3 * N,
        "each request ran once"
    );
    println!("live heap after each round of {N} requests purged: {deltas:?}");
    for (round, d) in deltas.iter().enumerate().skip(1) {
        assert!(
            *d <= 1024,
            "round {round}: {d} bytes stayed live after every record was purged: {deltas:?}"
        );
    }
}
