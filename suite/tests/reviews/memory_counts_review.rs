//! Review of f6fbdad and 6f3dd36 (MemoryStore: `max_records` taken in one compare-and-swap,
//! records counted off where they leave their shard, one bytes check). DESIGN §5 (stores,
//! memory bounds): live and completed records are never evicted to make room; a full store
//! answers `Full`, never holds more than `max_records`, and refuses a new key only when live
//! records fill it. Many OS threads at once, on a clock the tests move: the counts must never
//! drift, the bound never be passed, no claim be refused while an expired record (or a removed
//! one) left room, and `max_bytes` pass its bound by no more than it documents.

use std::future::Future;
use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use futures_util::FutureExt;
use tower_idempotency::store::{Claim, Milestone, Resolution, ScopedKey, StoreError};
use tower_idempotency::{IdempotencyStore, MemoryStore};

use crate::common::Rng;
use crate::common::memory::{Clock, acquired_or_full, ms, req, response};

/// The store's expiry tick (ms): records expiring within the tick under way are swept only
/// by a full store's second sweep.
const TICK: u64 = 16;
/// The shards the store's records live in (MemoryStore's docs: 64 independently locked).
const SHARDS: usize = 64;

/// The memory store answers every call but `wait_for_change` at once.
fn ready<F: Future>(f: F) -> F::Output {
    f.now_or_never().expect("the memory store answers at once")
}

fn key(name: &str) -> ScopedKey {
    ScopedKey::new("counts", name)
}

/// How many of `keys` a lookup finds (live records).
fn found(store: &MemoryStore, keys: impl IntoIterator<Item = ScopedKey>) -> usize {
    keys.into_iter()
        .filter(|k| ready(store.lookup(k)).expect("lookup").is_some())
        .count()
}

/// Moves `clock` to the next whole tick at least `ms` on, and purges: every record expired
/// by then is due and goes, so `len()` is exactly what lookups find.
fn purge_at_a_whole_tick(clock: &Clock, store: &MemoryStore, ms: u64) {
    let to = (clock.elapsed() + ms).div_ceil(TICK) * TICK;
    clock.advance((to - clock.elapsed()) as i64);
    ready(store.purge_expired()).expect("purge");
}

/// Fills `store` with `n` records named `{prefix}{i}`, claimed now and all expiring `ttl` ms
/// from now, of four kinds the purge finds in different places: completed and released
/// (its due index), abandoned under a lease shorter than the TTL (due index) and under a lease
/// as long as it (its polled set).
fn fill_expiring(store: &MemoryStore, prefix: &str, n: usize, ttl: u64) {
    for i in 0..n {
        let k = key(&format!("{prefix}{i}"));
        let r = match i % 4 {
            2 => req(&k, ttl, 1),
            _ => req(&k, 1, ttl),
        };
        let Ok(Claim::Acquired(lease)) = ready(store.claim(&r)) else {
            panic!("fill {i} of {n}: a new key in a store with room");
        };
        match i % 4 {
            0 => ready(store.complete(&k, lease.token, &response("old"), r.ttl)).expect("complete"),
            1 => {
                ready(store.release(&k, lease.token)).expect("release");
            }
            _ => {}
        }
    }
}

/// `threads` OS threads, released together, each claiming `per_thread` new keys one after
/// the other; what each claim answered.
fn race_new_keys(
    store: &MemoryStore,
    threads: usize,
    per_thread: usize,
    tag: &str,
) -> Vec<Result<Claim, StoreError>> {
    let barrier = Barrier::new(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    (0..per_thread)
                        .map(|j| {
                            let k = key(&format!("{tag}-t{t}-{j}"));
                            ready(store.claim(&req(&k, 60_000, 60_000)))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("claimer"))
            .collect()
    })
}

/// How many threads race, and how many new keys each claims in turn: few threads (as many as
/// the two cores run at once) meet in the race most often, more threads interleave more ways.
const RACES: [(usize, usize); 4] = [(4, 1), (3, 1), (8, 2), (16, 4)];

/// The store holds only records expired at the clock's time, exactly as many as its
/// `max_records`, and as many claims of new keys race in as there are expired records: every
/// one must win (a refused claim was refused while the store still held an expired record,
/// since fewer claims than expired records had won). Fails with the rounds that refused one.
fn every_racing_claim_finds_room(under_way: bool, rounds: usize) {
    let mut refused_rounds = Vec::new();
    for round in 0..rounds {
        let (threads, per_thread) = RACES[round % RACES.len()];
        let expired = threads * per_thread;
        let at = 1 + (round as u64 % (TICK - 1));
        let clock = Clock::new();
        let store = clock.store().max_records(expired);
        // Expiring at 2 ticks + `at`: the tick under way is the third.
        let ttl = 2 * TICK + at;
        fill_expiring(&store, "old", expired, ttl);
        assert_eq!(store.len(), expired, "round {round}: the store is full");
        // At the expiry itself (inside the tick under way), or two ticks after it.
        clock.advance(if under_way { ttl } else { ttl + 2 * TICK } as i64);
        let answers = race_new_keys(&store, threads, per_thread, &format!("r{round}"));
        let won = acquired_or_full(&answers, &format!("round {round}"));
        assert!(
            store.len() <= expired,
            "round {round}: {} held",
            store.len()
        );
        if won < expired {
            refused_rounds.push(format!(
                "round {round} ({threads} threads x {per_thread}, {at} ms into the tick): \
                 {won} of {expired} won"
            ));
        }
        // Whatever the claims met, nothing old is live, and a purge leaves the winners.
        assert_eq!(
            found(&store, (0..expired).map(|i| key(&format!("old{i}")))),
            0
        );
        purge_at_a_whole_tick(&clock, &store, TICK);
        assert_eq!(
            store.len(),
            won,
            "round {round}: the winners are what is left"
        );
    }
    assert!(
        refused_rounds.is_empty(),
        "{} of {rounds} rounds refused a new key Full while the store held an expired record; \
         the first: {:#?}",
        refused_rounds.len(),
        &refused_rounds[..refused_rounds.len().min(8)]
    );
}

/// DESIGN §5 (memory bounds: `Full` only when live records fill the store). A full store of
/// records that all expired a tick or more ago (completed, released, abandoned: due and
/// polled), and exactly as many claims of new keys racing from 3 to 16 OS threads as there
/// are expired records: every claim must win. The control for the next test: here the first
/// sweep of every shard (`sweep_all`) finds all the room.
#[test]
fn s5_racing_claims_each_find_room_in_records_expired_ticks_ago() {
    every_racing_claim_finds_room(false, 1_200);
}

/// DESIGN §5 (memory bounds: `Full` only when live records fill the store; f6fbdad's
/// "a claim that swept every shard ... could still find it full and be refused"). The same
/// race, but every record expired within the tick under way, so only the second sweep
/// (`sweep_tick_under_way`) finds them. `claim_at_once` ran it only if the store still looked
/// full after the first: a claim that saw the room another thread's second sweep had made so
/// far skipped its own, and was refused when another claim took that room first, while
/// expired records that sweep had not reached yet were still held (failed in about 5% of
/// rounds). It now runs it whenever the claim after the first sweep is refused. Exactly as
/// many claims as expired records must all win (review_many_threads_on_a_full_store races
/// twice as many claims as there is room, so a refusal there hides behind a claim that wins
/// later).
#[test]
fn s5_racing_claims_each_find_room_in_records_expired_within_the_tick_under_way() {
    every_racing_claim_finds_room(true, 1_200);
}

/// DESIGN §5 (a full store refuses only when live records fill it; remove counts off under
/// the shard's lock). The store is exactly full: 24 long-lived completed records, 8 slots
/// each owned by one thread that removes its key and then claims a fresh one, and 32 keys
/// contested by every thread (claimed with short TTLs, completed, released or abandoned,
/// removed, purged, while one thread moves the clock so they expire and are claimed again in
/// their slot). Every contested key and every slot, present or not, has its room: a claim of
/// a contested key, or of a slot's fresh key after its remove, can never be refused Full. A
/// sampler checks `len()` never passes `max_records`; at the end `len()` is what lookups
/// find, and removing everything leaves `len()` and `bytes()` at 0.
#[test]
fn s5_claims_racing_removes_of_the_same_keys_on_an_exactly_full_store() {
    const FILLERS: usize = 24;
    const OWNERS: usize = 8;
    const CONTESTED: usize = 32;
    const MAX: usize = FILLERS + OWNERS + CONTESTED;
    const ROUNDS: usize = 12;
    const OPS: usize = 1_500;
    let clock = Clock::new();
    let store = clock.store().max_records(MAX);
    for i in 0..FILLERS {
        let k = key(&format!("filler{i}"));
        let r = req(&k, 60_000, 3_600_000);
        let Ok(Claim::Acquired(lease)) = ready(store.claim(&r)) else {
            panic!("filler {i}");
        };
        ready(store.complete(&k, lease.token, &response("kept"), r.ttl)).expect("complete");
    }
    let slot = |t: usize, generation: usize| key(&format!("slot{t}-{generation}"));
    for t in 0..OWNERS {
        assert!(matches!(
            ready(store.claim(&req(&slot(t, 0), 60_000, 3_600_000))),
            Ok(Claim::Acquired(_))
        ));
    }
    let contested = |i: u64| key(&format!("contested{i}"));
    let mut generations = [0usize; OWNERS];
    for round in 0..ROUNDS {
        let done = AtomicBool::new(false);
        let most = AtomicUsize::new(0);
        let barrier = Barrier::new(OWNERS + 1);
        std::thread::scope(|s| {
            let sampler = s.spawn(|| {
                while !done.load(Ordering::Relaxed) {
                    most.fetch_max(store.len(), Ordering::Relaxed);
                    std::hint::spin_loop();
                }
            });
            let workers: Vec<_> = generations
                .iter_mut()
                .enumerate()
                .map(|(t, generation)| {
                    let (store, clock, barrier) = (&store, &clock, &barrier);
                    s.spawn(move || {
                        let mut rng = Rng::new((round * 100 + t) as u64 + 1);
                        let mut refused = Vec::new();
                        barrier.wait();
                        for op in 0..OPS {
                            if t == 0 && op % 8 == 0 {
                                clock.advance(rng.next(6) as i64);
                            }
                            match rng.next(10) {
                                // The owned slot: its key goes, a fresh one takes its room.
                                0 => {
                                    ready(store.remove(&slot(t, *generation))).expect("remove");
                                    *generation += 1;
                                    let r = req(&slot(t, *generation), 60_000, 3_600_000);
                                    let got = ready(store.claim(&r));
                                    if !matches!(got, Ok(Claim::Acquired(_))) {
                                        refused.push(format!("slot {t} gen {generation}: {got:?}"));
                                    }
                                }
                                1 => {
                                    ready(store.remove(&contested(rng.next(CONTESTED as u64))))
                                        .expect("remove");
                                }
                                2 => {
                                    ready(store.purge_expired()).expect("purge");
                                }
                                _ => {
                                    let k = contested(rng.next(CONTESTED as u64));
                                    let r = req(&k, 1 + rng.next(30), 1 + rng.next(40));
                                    match ready(store.claim(&r)) {
                                        Ok(Claim::Acquired(lease)) => {
                                            let wrote = match rng.next(3) {
                                                0 => ready(store.complete(
                                                    &k,
                                                    lease.token,
                                                    &response("x"),
                                                    r.ttl,
                                                )),
                                                1 => ready(store.release(&k, lease.token))
                                                    .map(|_| ()),
                                                _ => Ok(()),
                                            };
                                            assert!(
                                                matches!(wrote, Ok(()) | Err(StoreError::Fenced)),
                                                "{wrote:?}"
                                            );
                                        }
                                        Ok(_) => {}
                                        Err(e) => refused.push(format!("{k:?}: {e:?}")),
                                    }
                                }
                            }
                        }
                        refused
                    })
                })
                .collect();
            barrier.wait();
            let refused: Vec<String> = workers
                .into_iter()
                .flat_map(|w| w.join().expect("worker"))
                .collect();
            done.store(true, Ordering::Relaxed);
            sampler.join().expect("sampler");
            assert!(
                refused.is_empty(),
                "round {round}: claims refused on a store with their room: {refused:?}"
            );
        });
        assert!(
            most.load(Ordering::Relaxed) <= MAX,
            "round {round}: len() reached {} of {MAX}",
            most.load(Ordering::Relaxed)
        );
        // Quiet: every record expired by a whole tick is purged; len() is what is found.
        purge_at_a_whole_tick(&clock, &store, 0);
        let all: Vec<ScopedKey> = (0..FILLERS)
            .map(|i| key(&format!("filler{i}")))
            .chain((0..OWNERS).map(|t| slot(t, generations[t])))
            .chain((0..CONTESTED as u64).map(contested))
            .collect();
        assert_eq!(
            store.len(),
            found(&store, all.iter().cloned()),
            "round {round}: len() is the records held"
        );
        assert_eq!(
            found(&store, all.iter().take(FILLERS + OWNERS).cloned()),
            FILLERS + OWNERS,
            "round {round}: fillers and every slot's key kept"
        );
    }
    purge_at_a_whole_tick(&clock, &store, 60_000);
    assert_eq!(store.len(), FILLERS + OWNERS);
    for i in 0..FILLERS {
        ready(store.remove(&key(&format!("filler{i}")))).expect("remove");
    }
    for (t, generation) in generations.iter().enumerate() {
        assert!(ready(store.remove(&slot(t, *generation))).expect("remove"));
    }
    assert_eq!(
        (store.len(), store.bytes(), store.is_empty()),
        (0, 0, true),
        "nothing held, nothing counted"
    );
}

/// DESIGN §5 (the store's counts are what it holds). A storm: 8 threads on 96 shared keys,
/// a store of 48 (so claims meet `Full` and sweep every shard), claims with random leases and
/// TTLs while one thread moves the clock (expired keys reclaimed in their slot, leases taken
/// over), completions, releases, uncertain marks resolved either way, effects started then
/// completed, abandoned leases, removes and purges. A sampler checks `len()` never passes the
/// bound. At every quiet point, purged at a whole tick, `len()` equals the records lookups
/// find, and at most the bound are found; at the end, all expired and removed, `len()` and
/// `bytes()` are 0: a count taken off twice, or never given back, shows.
#[test]
fn s5_counts_never_drift_under_a_storm_of_every_operation() {
    const THREADS: usize = 8;
    const KEYS: u64 = 96;
    const MAX: usize = 48;
    const ROUNDS: usize = 16;
    const OPS: usize = 1_200;
    let clock = Clock::new();
    let store = clock.store().max_records(MAX);
    let pool = || (0..KEYS).map(|i| key(&format!("p{i}")));
    for round in 0..ROUNDS {
        let done = AtomicBool::new(false);
        let most = AtomicUsize::new(0);
        let barrier = Barrier::new(THREADS);
        std::thread::scope(|s| {
            let sampler = s.spawn(|| {
                while !done.load(Ordering::Relaxed) {
                    most.fetch_max(store.len(), Ordering::Relaxed);
                    std::hint::spin_loop();
                }
            });
            let workers: Vec<_> = (0..THREADS)
                .map(|t| {
                    let (store, clock, barrier) = (&store, &clock, &barrier);
                    s.spawn(move || {
                        let mut rng = Rng::new((round * 1000 + t) as u64 + 7);
                        barrier.wait();
                        for op in 0..OPS {
                            if t == 0 && op % 4 == 0 {
                                clock.advance(rng.next(4) as i64);
                            }
                            let k = key(&format!("p{}", rng.next(KEYS)));
                            storm_op(store, &k, &mut rng);
                        }
                    })
                })
                .collect();
            for w in workers {
                w.join().expect("worker");
            }
            done.store(true, Ordering::Relaxed);
            sampler.join().expect("sampler");
        });
        let most = most.load(Ordering::Relaxed);
        assert!(most <= MAX, "round {round}: len() reached {most} of {MAX}");
        purge_at_a_whole_tick(&clock, &store, 0);
        let live = found(&store, pool());
        assert_eq!(
            store.len(),
            live,
            "round {round}: len() counts the records held (purged at a whole tick)"
        );
        assert!(live <= MAX, "round {round}: {live} live records of {MAX}");
        assert_eq!(store.bytes() == 0, live == 0, "round {round}: bytes()");
        // Sometimes clear half the keys, so the next round starts with room.
        if round % 2 == 1 {
            for k in pool().step_by(2) {
                ready(store.remove(&k)).expect("remove");
            }
            assert_eq!(
                store.len(),
                found(&store, pool()),
                "round {round}: after removes"
            );
        }
    }
    // An hour on: everything expires (nothing is left uncertain), then is removed.
    purge_at_a_whole_tick(&clock, &store, 3_600_000);
    assert_eq!(store.len(), found(&store, pool()), "after the last purge");
    for k in pool() {
        ready(store.remove(&k)).expect("remove");
    }
    assert_eq!(
        (store.len(), store.bytes(), store.is_empty()),
        (0, 0, true),
        "every record gone: nothing counted, nothing weighed"
    );
}

/// One random operation of the storm on `k`; every write that fails must fail as fenced
/// (another thread took the key over or removed it), every claim answer a claim's.
fn storm_op(store: &MemoryStore, k: &ScopedKey, rng: &mut Rng) {
    let fenced_ok = |what: &str, r: Result<(), StoreError>| {
        assert!(
            matches!(r, Ok(()) | Err(StoreError::Fenced)),
            "{what} {k:?}: {r:?}"
        );
    };
    match rng.next(12) {
        0 | 1 => {
            ready(store.remove(k)).expect("remove");
        }
        2 => {
            ready(store.purge_expired()).expect("purge");
        }
        3 => {
            ready(store.lookup(k)).expect("lookup");
        }
        _ => {
            let r = req(k, 1 + rng.next(20), 1 + rng.next(30));
            let lease = match ready(store.claim(&r)) {
                Ok(Claim::Acquired(lease)) => lease,
                Ok(Claim::Existing { .. } | Claim::Completed { .. }) | Err(StoreError::Full) => {
                    return;
                }
                other => panic!("claim {k:?}: {other:?}"),
            };
            let ttl = ms(1 + rng.next(30));
            match rng.next(6) {
                0 => fenced_ok(
                    "complete",
                    ready(store.complete(k, lease.token, &response("done"), ttl)),
                ),
                1 => fenced_ok("release", ready(store.release(k, lease.token)).map(|_| ())),
                2 => {
                    fenced_ok("mark", ready(store.mark_uncertain(k, lease.token)));
                    let resolution = match rng.next(2) {
                        0 => Resolution::NotApplied,
                        _ => Resolution::Applied(Box::new(response("applied"))),
                    };
                    fenced_ok(
                        "resolve",
                        ready(store.resolve(k, lease.token, &resolution, ttl, None)),
                    );
                }
                3 => {
                    fenced_ok(
                        "milestone",
                        ready(store.record_milestone(k, lease.token, &Milestone::EffectStarted)),
                    );
                    fenced_ok(
                        "complete",
                        ready(store.complete(k, lease.token, &response("effect"), ttl)),
                    );
                }
                // Abandoned: the lease lapses, the key is taken over or expires.
                _ => {}
            }
        }
    }
}

/// DESIGN §5 (memory bounds: `max_bytes` "may pass the bound by what requests in flight
/// record, and by one new record per shard when claims race"). No request records anything
/// here (claims only, keys of one length, so every record weighs the same `w`): 32 threads
/// claim new keys until refused, while a sampler reads `bytes()`; then removes race claims
/// and it starts again. `bytes()` must never pass `max_bytes - 1 + 64 w`, must at every
/// quiet point be exactly `len() * w` (a weight counted off twice or never shows), and the
/// store refuses only at or past its bound.
#[test]
fn s5_max_bytes_passes_its_bound_by_at_most_one_new_record_per_shard() {
    const THREADS: usize = 32;
    const ROUNDS: usize = 20;
    let name = |t: usize, n: usize| format!("b{t:03}-{n:06}");
    let w = {
        let probe = MemoryStore::new();
        ready(probe.claim(&req(&key(&name(0, 0)), 60_000, 60_000))).expect("probe");
        probe.bytes()
    };
    assert!(w > 0, "a record weighs something");
    let max_bytes = 200 * w + w / 2;
    let ceiling = max_bytes - 1 + SHARDS * w;
    let clock = Clock::new();
    let store = clock.store().max_bytes(max_bytes);
    let mut next = vec![0usize; THREADS];
    // Records kept from earlier rounds.
    let mut kept: Vec<ScopedKey> = Vec::new();
    for round in 0..ROUNDS {
        let done = AtomicBool::new(false);
        let most = AtomicUsize::new(0);
        let barrier = Barrier::new(THREADS);
        let held: Vec<ScopedKey> = std::thread::scope(|s| {
            let sampler = s.spawn(|| {
                while !done.load(Ordering::Relaxed) {
                    most.fetch_max(store.bytes(), Ordering::Relaxed);
                    std::hint::spin_loop();
                }
            });
            let workers: Vec<_> = next
                .iter_mut()
                .enumerate()
                .map(|(t, next)| {
                    let (store, barrier) = (&store, &barrier);
                    s.spawn(move || {
                        let mut mine = Vec::new();
                        let mut rng = Rng::new((round * 100 + t) as u64 + 3);
                        barrier.wait();
                        loop {
                            // After the first round, removes race the claims.
                            if round > 0 && !mine.is_empty() && rng.next(3) == 0 {
                                let at = rng.next(mine.len() as u64) as usize;
                                let k: ScopedKey = mine.swap_remove(at);
                                assert!(ready(store.remove(&k)).expect("remove"));
                            }
                            let k = key(&name(t, *next));
                            *next += 1;
                            match ready(store.claim(&req(&k, 60_000, 60_000))) {
                                Ok(Claim::Acquired(_)) => mine.push(k),
                                Err(StoreError::Full) => {
                                    // Only claims add weight in the first round: a refusal
                                    // saw the bound reached, and the weight only grows.
                                    let at = store.bytes();
                                    assert!(
                                        round > 0 || at >= max_bytes,
                                        "round {round}: refused at {at} of {max_bytes} bytes"
                                    );
                                    break;
                                }
                                other => panic!("{k:?}: {other:?}"),
                            }
                        }
                        mine
                    })
                })
                .collect();
            let held = workers
                .into_iter()
                .flat_map(|w| w.join().expect("worker"))
                .collect();
            done.store(true, Ordering::Relaxed);
            sampler.join().expect("sampler");
            held
        });
        let most = most.load(Ordering::Relaxed).max(store.bytes());
        assert!(
            most <= ceiling,
            "round {round}: {most} bytes, past max_bytes {max_bytes} by {} records of {w} \
             (documented: at most one per shard, {SHARDS})",
            (most - max_bytes) / w + 1
        );
        assert_eq!(
            kept.len() + held.len(),
            store.len(),
            "round {round}: len() is what was kept and what won"
        );
        assert_eq!(
            store.bytes(),
            store.len() * w,
            "round {round}: bytes() is what the records weigh"
        );
        // Every thread's last claim was refused after its last remove: the last refusal
        // saw the bound reached, and nothing changed after it.
        assert!(
            store.bytes() >= max_bytes,
            "round {round}: refused below its bound ({} of {max_bytes})",
            store.bytes()
        );
        // Room for the next round: a third of the records go.
        kept.extend(held);
        let mut i = 0;
        kept.retain(|k| {
            i += 1;
            i % 3 != 0 || !ready(store.remove(k)).expect("remove")
        });
        assert_eq!(kept.len(), store.len(), "round {round}: after removes");
        assert_eq!(
            store.bytes(),
            store.len() * w,
            "round {round}: after removes"
        );
    }
    for k in &kept {
        assert!(ready(store.remove(k)).expect("remove"));
    }
    assert_eq!((store.len(), store.bytes()), (0, 0), "all removed");
}
