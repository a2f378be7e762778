//! Adversarial review of today's give-back, release-retry, wait-rule and JSON-RPC refusal
//! changes (96cd320, 6125112, 56ed0f1, 73705b9, b7aa7ea).
//!
//! A store wrapper ([`Rig`]) fails, hangs or writes-then-fails the n-th operation of one kind,
//! fails one kind of operation for a while, wakes waiters early, counts every operation by kind
//! and logs what it did. It does not offer the inner store's at-once paths (`claim_now`...), so
//! every claim is a round trip. Effects are counted at the sink (inside the handler); every
//! test also checks what every client was told. No wall-clock assertion: deadlines only bound
//! the wait for an eventual condition, leases and stalls are at least 300 ms.

mod common;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use bytes::Bytes;
use common::{Effects, serve};
use serde_json::Value;
use tower_idempotency::jsonrpc::JsonRpc;
use tower_idempotency::store::{FencingToken, RecordStatus, ScopedKey, StoredResponse};
use tower_idempotency::{IdempotencyLayer, IdempotencyStore, MemoryStore};

use common::rig::*;

// ---- handlers ------------------------------------------------------------------------------

/// Marks the effect started, makes it, then answers 500 (a provider timed out afterwards).
fn milestone_then_500(effects: &Effects) -> Handler {
    let effects = effects.clone();
    handler(move |_, ctx| {
        let effects = effects.clone();
        async move {
            if ctx.effect_started().await.is_err() {
                return (StatusCode::SERVICE_UNAVAILABLE, "no milestone".into());
            }
            effects.hit();
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "the provider timed out".into(),
            )
        }
    })
}

// ==== 1. The release retry after a run (56ed0f1) ===============================================

/// DESIGN §3/§4: the holder answers 503 having done nothing, its release fails, and the retried
/// release never answers (a stuck connection, which the keeper itself guards against for
/// renewals). The retry task holds the lease renewed, so a hung call must not hold the key for
/// ever: each try is bounded, the next one lands, and a retry runs (attempt 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_release_retry_that_hangs_never_holds_the_key_for_ever() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("release", 1, Act::Fail);
    rig.on("release", 2, Act::Hang);
    let effects = Effects::default();
    let addr = first_503(&rig, Route::plain(ms(400)), &effects).await;
    let key = unique("release-hangs");
    let first = ask(addr, &key).await;
    assert_eq!(first.status, 503, "{first:?}");
    assert!(
        eventually(async || rig.count("release") >= 2).await,
        "{}",
        rig.log()
    );
    // 15 s is 37 leases: far past "as long as a lease" and any lapse after it.
    let retry = ask_past_in_flight(addr, &key, Duration::from_secs(15)).await;
    let renewals = rig.count("renew");
    assert!(
        retry.is_live() && retry.body == "effect 1 attempt 2",
        "the key stayed in flight while a release retry hung: {retry:?}; {renewals} renewals \
         so far (the retry's hold keeps renewing)\n  {}",
        rig.log()
    );
    assert_eq!(effects.count(), 1);
}

/// DESIGN §4 for the record itself: the first write of the outcome fails and the retried one
/// hangs on a stuck connection. Each try is bounded as a give-back's is, so the third lands:
/// the record ends completed and the retry replays the one effect (unbounded, the hung try held
/// the lease renewed for ever and the key stayed uncertain).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_record_retry_that_hangs_is_tried_again_and_lands() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("complete", 1, Act::Fail);
    rig.on("complete", 2, Act::Hang);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(400)),
        sleep_then_effect(&effects, Duration::ZERO, false),
    )
    .await;
    let key = unique("record-hangs");
    let first = ask(addr, &key).await;
    assert!(first.is_live(), "{first:?}");
    assert!(
        eventually(async || record_of(&rig, &key)
            .await
            .is_some_and(|r| r.status == RecordStatus::Completed))
        .await,
        "the record landed after a hung try\n  {}",
        rig.log()
    );
    assert!(rig.count("complete") >= 3, "{}", rig.log());
    let retry = ask(addr, &key).await;
    assert!(retry.is_replay_of(&first.body), "{retry:?}");
    assert_eq!(effects.count(), 1);
}

/// DESIGN §4 "when recording the outcome fails, the holder keeps renewing and retrying the
/// write (fenced, bounded backoff) instead of letting the lease lapse", and §3 (a 5xx under
/// DefinitiveOnly releases the claim so a later retry re-attempts): on a route that reconciles
/// expired leases, the holder answers 503 having done nothing, and every release fails for three
/// leases while renewals keep working. The key must be given back once the store takes the
/// release; the retry then runs (attempt 2), never "outcome unknown" for a run that did nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_release_failing_for_longer_than_a_lease_is_still_given_back_on_reconcile() {
    let rig = Rig::new(MemoryStore::new());
    let lease = ms(600);
    rig.fail_for("release", ms(1_800));
    let effects = Effects::default();
    let addr = first_503(&rig, Route::plain(lease).reconcile(), &effects).await;
    let key = unique("release-long-outage");
    let first = ask(addr, &key).await;
    assert_eq!(first.status, 503, "{first:?}");
    // Until the key is given back, or its lease has visibly lapsed (nobody keeps it any more).
    let settled = eventually(async || {
        record_of(&rig, &key).await.is_none_or(|r| {
            r.status != RecordStatus::InProgress || r.lease_until + ms(50) < SystemTime::now()
        })
    })
    .await;
    assert!(settled, "{}", rig.log());
    let retry = ask_past_in_flight(addr, &key, Duration::from_secs(10)).await;
    let record = record_of(&rig, &key).await;
    assert!(
        retry.is_live() && retry.body == "effect 1 attempt 2",
        "a 503 that did nothing, whose release failed for 3 leases (renewals fine), ended as \
         {retry:?}; record {:?}\n  {}",
        record.map(|r| (r.status, r.attempts)),
        rig.log()
    );
    assert_eq!(effects.count(), 1);
}

/// 56ed0f1: once the retried release lands, the retry task's hold is gone: no renewal of the
/// released key follows (a hold left behind would renew a key nobody holds for ever). The next
/// request runs (attempt 2) and is replayed after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_release_retry_that_lands_stops_renewing() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("release", 1, Act::Fail);
    rig.on("release", 2, Act::Fail);
    let effects = Effects::default();
    let addr = first_503(&rig, Route::plain(ms(450)), &effects).await;
    let key = unique("release-lands");
    assert_eq!(ask(addr, &key).await.status, 503);
    assert!(
        eventually(async || record_of(&rig, &key)
            .await
            .is_some_and(|r| r.status == RecordStatus::Released))
        .await,
        "{}",
        rig.log()
    );
    tokio::time::sleep(ms(200)).await;
    let renewals = rig.count("renew");
    // Three leases: a hold left behind would renew ~9 times.
    tokio::time::sleep(ms(1_350)).await;
    assert!(
        rig.count("renew") <= renewals + 1,
        "renewals went on after the key was given back: {} then {}\n  {}",
        renewals,
        rig.count("renew"),
        rig.log()
    );
    let retry = ask(addr, &key).await;
    assert!(
        retry.is_live() && retry.body == "effect 1 attempt 2",
        "{retry:?}"
    );
    assert!(ask(addr, &key).await.is_replay_of(&retry.body));
    assert_eq!(effects.count(), 1);
}

/// DESIGN §4 ("the holder keeps renewing and retrying the write ... instead of letting the
/// lease lapse") when the store refuses every release for five leases while it renews: the key
/// stays held, so a request meanwhile is told "in flight" (never a run, never "outcome
/// unknown"); once the store takes releases again the retried release lands, the renewals
/// stop, and the next request runs exactly once (attempt 2). (The review first asked for the
/// retry to give up after a lease and let it lapse; that is what §4 rules out, and on a route
/// that reconciles it would set the key aside for a run that did nothing.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_release_refused_for_leases_keeps_the_key_held_until_it_lands() {
    let rig = Rig::new(MemoryStore::new());
    rig.fail_for("release", ms(2_250));
    let effects = Effects::default();
    let addr = first_503(&rig, Route::plain(ms(450)), &effects).await;
    let key = unique("release-refused");
    assert_eq!(ask(addr, &key).await.status, 503);
    // Two leases into the outage: still held, still renewed.
    tokio::time::sleep(ms(900)).await;
    let meanwhile = ask(addr, &key).await;
    assert!(meanwhile.in_flight(), "{meanwhile:?}\n  {}", rig.log());
    assert!(rig.count("renew") >= 1, "{}", rig.log());
    assert!(
        eventually(async || record_of(&rig, &key)
            .await
            .is_some_and(|r| r.status == RecordStatus::Released))
        .await,
        "the release lands once the store takes it\n  {}",
        rig.log()
    );
    tokio::time::sleep(ms(200)).await;
    let renewals = rig.count("renew");
    tokio::time::sleep(ms(1_350)).await;
    assert!(
        rig.count("renew") <= renewals + 1,
        "renewals went on after the release landed: {} then {}\n  {}",
        renewals,
        rig.count("renew"),
        rig.log()
    );
    let retry = ask(addr, &key).await;
    assert!(
        retry.is_live() && retry.body == "effect 1 attempt 2",
        "{retry:?}\n  {}",
        rig.log()
    );
    assert!(ask(addr, &key).await.is_replay_of(&retry.body));
    assert_eq!(effects.count(), 1);
}

/// DESIGN §1 step 8 (fenced by the lease token): the holder's release lands but its answer is
/// lost; the retry task then tries again. Meanwhile a retry takes the released key (attempt 2)
/// and runs for a second. The old release retry and the old hold's renewals must be fenced out:
/// a third request during that run is told "in flight", never runs; afterwards it replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_release_retry_after_its_release_landed_never_frees_the_next_holder() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("release", 1, Act::ApplyThenFail);
    let effects = Effects::default();
    let counter = effects.clone();
    let h = handler(move |i, ctx| {
        let effects = counter.clone();
        async move {
            match i {
                0 => return (StatusCode::SERVICE_UNAVAILABLE, "nothing done".into()),
                1 => tokio::time::sleep(ms(1_200)).await,
                _ => {}
            }
            let n = effects.hit();
            (
                StatusCode::CREATED,
                format!("effect {n} attempt {}", ctx.attempt()),
            )
        }
    });
    let addr = server(&rig, Route::plain(ms(600)), h).await;
    let key = unique("release-landed");
    assert_eq!(ask(addr, &key).await.status, 503);
    let second = tokio::spawn({
        let key = key.clone();
        async move { ask(addr, &key).await }
    });
    assert!(
        eventually(async || record_of(&rig, &key)
            .await
            .is_some_and(|r| r.attempts == 2 && r.status == RecordStatus::InProgress))
        .await,
        "{}",
        rig.log()
    );
    tokio::time::sleep(ms(300)).await;
    let third = ask(addr, &key).await;
    assert!(
        third.in_flight(),
        "a third request during the second holder's run: {third:?}\n  {}",
        rig.log()
    );
    let second = second.await.expect("task");
    assert_eq!(
        (second.status, second.body.as_str()),
        (201, "effect 1 attempt 2"),
        "{}",
        rig.log()
    );
    assert!(ask(addr, &key).await.is_replay_of(&second.body));
    assert_eq!(effects.count(), 1);
    assert!(
        rig.logged("release#2", "fenced") == 1 || rig.count("release") == 1,
        "the old release retry was fenced out\n  {}",
        rig.log()
    );
}

/// DESIGN §3/§4 (a started effect then a 5xx: needs_reconciliation, never run again), when the
/// release that sets it aside lands but its answer is lost and the retry task takes over: the
/// key stays "outcome unknown" for every retry, across several leases; the effect ran once.
async fn milestone_500_release_answer_lost<S: IdempotencyStore>(store: S, name: &str) {
    let rig = Rig::new(store);
    rig.on("release", 1, Act::ApplyThenFail);
    let effects = Effects::default();
    let addr = server(&rig, Route::plain(ms(400)), milestone_then_500(&effects)).await;
    let key = unique("milestone-lost-answer");
    let first = ask(addr, &key).await;
    assert_eq!(first.status, 500, "{name}: {first:?}");
    assert!(
        eventually(async || record_of(&rig, &key)
            .await
            .is_some_and(|r| r.status == RecordStatus::NeedsReconciliation))
        .await,
        "{name}\n  {}",
        rig.log()
    );
    for _ in 0..3 {
        tokio::time::sleep(ms(450)).await;
        let a = ask(addr, &key).await;
        assert_eq!(
            (a.status, a.problem.as_str()),
            (409, "outcome-unknown"),
            "{name}: {a:?}\n  {}",
            rig.log()
        );
    }
    assert_eq!(effects.count(), 1, "{name}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_milestone_then_500_release_answer_lost_stays_outcome_unknown() {
    milestone_500_release_answer_lost(MemoryStore::new(), "memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_milestone_then_500_release_answer_lost_stays_outcome_unknown_on_sqlite() {
    let (store, path) = common::sqlite("gbw-milestone").await;
    milestone_500_release_answer_lost(store, "sqlite").await;
    let _ = std::fs::remove_file(path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_milestone_then_500_release_answer_lost_stays_outcome_unknown_on_redis() {
    let Some(store) = common::redis("gbw-milestone").await else {
        return;
    };
    milestone_500_release_answer_lost(store, "redis").await;
}

/// DESIGN §3 (a panic releases the claim: a later retry re-attempts) with 56ed0f1: the handler
/// panics, its release fails once, on a route that reconciles expired leases. The client is
/// told "execution failed"; the retried release gives the key back and the retry runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_a_panic_whose_release_fails_once_is_given_back_and_runs_once() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("release", 1, Act::Fail);
    let effects = Effects::default();
    let counter = effects.clone();
    let h = handler(move |i, ctx| {
        let effects = counter.clone();
        async move {
            assert!(i != 0, "the handler panics (on purpose)");
            let n = effects.hit();
            (
                StatusCode::CREATED,
                format!("effect {n} attempt {}", ctx.attempt()),
            )
        }
    });
    let addr = server(&rig, Route::plain(ms(600)).reconcile(), h).await;
    let key = unique("panic-release");
    let first = ask(addr, &key).await;
    assert_eq!(
        (first.status, first.problem.as_str()),
        (500, "execution-failed"),
        "{first:?}"
    );
    assert!(
        eventually(async || record_of(&rig, &key)
            .await
            .is_some_and(|r| r.status == RecordStatus::Released))
        .await,
        "{}",
        rig.log()
    );
    // Past the first lease: on this reconciling route a key not given back would be set aside.
    tokio::time::sleep(ms(700)).await;
    let retry = ask(addr, &key).await;
    assert!(
        retry.is_live() && retry.body == "effect 1 attempt 2",
        "{retry:?}\n  {}",
        rig.log()
    );
    assert!(ask(addr, &key).await.is_replay_of(&retry.body));
    assert_eq!(effects.count(), 1);
}

/// 56ed0f1 on every store: a 503 that did nothing, its release failing once, on a reconciling
/// route. The release is retried and lands; the retry runs once (attempt 2), then replays.
async fn s3_a_failed_release_after_a_503_is_retried<S: IdempotencyStore>(store: S, name: &str) {
    let rig = Rig::new(store);
    rig.on("release", 1, Act::Fail);
    let effects = Effects::default();
    let addr = first_503(&rig, Route::plain(ms(600)).reconcile(), &effects).await;
    let key = unique(&format!("release-once-{name}"));
    assert_eq!(ask(addr, &key).await.status, 503, "{name}");
    assert!(
        eventually(async || record_of(&rig, &key)
            .await
            .is_none_or(|r| r.status == RecordStatus::Released))
        .await,
        "{name}\n  {}",
        rig.log()
    );
    tokio::time::sleep(ms(700)).await;
    let retry = ask(addr, &key).await;
    assert!(
        retry.is_live() && retry.body == "effect 1 attempt 2",
        "{name}: {retry:?}\n  {}",
        rig.log()
    );
    assert!(ask(addr, &key).await.is_replay_of(&retry.body), "{name}");
    assert_eq!(effects.count(), 1, "{name}");
}

common::on_every_store!(s3_a_failed_release_after_a_503_is_retried);

/// 56ed0f1 under load: 30 keys each answered 503 at first, the first 60 releases failing.
/// Every key's release retry lands or lapses; no key stays stuck; each key then runs exactly
/// once and replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_many_keys_with_failing_releases_none_stuck_each_runs_once() {
    let rig = Rig::new(MemoryStore::new());
    for n in 1..=60 {
        rig.on("release", n, Act::Fail);
    }
    let effects = Effects::default();
    let counter = effects.clone();
    // Each key's first call fails; its later ones make the effect.
    let seen: Arc<Mutex<std::collections::HashSet<String>>> = Arc::default();
    let h = handler(move |_, ctx| {
        let (effects, seen) = (counter.clone(), seen.clone());
        async move {
            if seen.lock().unwrap().insert(ctx.key().to_owned()) {
                return (StatusCode::SERVICE_UNAVAILABLE, "nothing done".into());
            }
            effects.hit();
            (
                StatusCode::CREATED,
                format!("{} attempt {}", ctx.key(), ctx.attempt()),
            )
        }
    });
    let addr = server(&rig, Route::plain(ms(500)), h).await;
    let keys: Vec<String> = (0..30).map(|i| unique(&format!("many-{i}"))).collect();
    let firsts: Vec<_> = keys
        .iter()
        .map(|key| {
            let key = key.clone();
            tokio::spawn(async move { ask(addr, &key).await })
        })
        .collect();
    for first in firsts {
        assert_eq!(first.await.expect("task").status, 503);
    }
    let retries: Vec<_> = keys
        .iter()
        .map(|key| {
            let key = key.clone();
            tokio::spawn(async move {
                (
                    key.clone(),
                    ask_past_in_flight(addr, &key, Duration::from_secs(15)).await,
                )
            })
        })
        .collect();
    for retry in retries {
        let (key, a) = retry.await.expect("task");
        assert!(
            a.is_live() && a.body == format!("{key} attempt 2"),
            "{key}: {a:?}\n  {}",
            rig.log()
        );
        assert!(ask(addr, &key).await.is_replay_of(&a.body));
    }
    assert_eq!(effects.count(), 30);
    assert!(
        rig.count("release") >= 90,
        "60 failed releases and 30 that landed: {}",
        rig.count("release")
    );
}

use common::counts::Counts;

/// DESIGN §6 with 6125112/56ed0f1: a started effect then a 500, its release failing once. The
/// retried release sets the key aside: counted once as moved to reconciliation, never as a
/// release; and the key is "outcome unknown".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_a_retried_release_that_sets_the_key_aside_is_counted_as_moved() {
    let counts = Counts::global();
    let moved = counts.get("idempotency_moved_to_reconciliation_total");
    let releases = counts.get("idempotency_releases_total");
    let rig = Rig::new(MemoryStore::new());
    rig.on("release", 1, Act::Fail);
    let effects = Effects::default();
    let addr = server(&rig, Route::plain(ms(500)), milestone_then_500(&effects)).await;
    let key = unique("metrics-moved");
    assert_eq!(ask(addr, &key).await.status, 500);
    assert!(
        eventually(async || record_of(&rig, &key)
            .await
            .is_some_and(|r| r.status == RecordStatus::NeedsReconciliation))
        .await,
        "{}",
        rig.log()
    );
    tokio::time::sleep(ms(100)).await;
    assert_eq!(
        counts.get("idempotency_moved_to_reconciliation_total") - moved,
        1,
        "moved to reconciliation"
    );
    assert_eq!(
        counts.get("idempotency_releases_total") - releases,
        0,
        "not a release"
    );
    let a = ask(addr, &key).await;
    assert_eq!((a.status, a.problem.as_str()), (409, "outcome-unknown"));
    assert_eq!(effects.count(), 1);
}

// ==== 2. Give-backs of runs cancelled by a hang-up (96cd320) ===================================

/// A response as a handler records it inside its own transaction (DESIGN §4).
fn receipt() -> StoredResponse {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", "text/plain".parse().unwrap());
    StoredResponse {
        status: StatusCode::CREATED,
        headers,
        body: Some(Bytes::from_static(b"receipt 1")),
        trailers: None,
    }
}

type InHandler =
    Arc<dyn Fn(ScopedKey, FencingToken) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// DESIGN §4 (a handler records its result inside its own transaction) with 96cd320 on a route
/// that cancels on a hang-up: the handler commits its effect and its recorded result, then the
/// client hangs up before the handler returns. The give-back (its first try failing) must be
/// fenced by the completed record: the retry replays the receipt, the effect ran once.
async fn cancelled_after_in_handler_record<S: IdempotencyStore>(
    store: Arc<S>,
    record: InHandler,
    name: &str,
) {
    let rig = Rig::over(store);
    rig.on("release", 1, Act::Fail);
    let effects = Effects::default();
    let counter = effects.clone();
    let h = handler(move |i, ctx| {
        let (effects, record) = (counter.clone(), record.clone());
        async move {
            if i == 0 {
                record(ctx.scoped_key().clone(), ctx.fencing_token()).await;
                effects.hit();
                // The client hangs up during this.
                tokio::time::sleep(ms(30_000)).await;
            }
            let n = effects.hit();
            (StatusCode::CREATED, format!("effect {n}"))
        }
    });
    let addr = server(&rig, Route::plain(ms(600)).cancelling(), h).await;
    let key = unique(&format!("in-tx-{name}"));
    let first = hang_up_later(addr, &key);
    assert!(eventually(async || effects.count() == 1).await, "{name}");
    first.abort();
    assert!(
        eventually(async || rig.count("release") >= 2).await,
        "{name}: the give-back tried again\n  {}",
        rig.log()
    );
    tokio::time::sleep(ms(700)).await;
    let retry = ask(addr, &key).await;
    assert!(
        retry.is_replay_of("receipt 1"),
        "{name}: the run recorded its result then was cancelled; the retry got {retry:?}\n  {}",
        rig.log()
    );
    assert_eq!(effects.count(), 1, "{name}");
    let record = record_of(&rig, &key).await.expect("record");
    assert_eq!(record.status, RecordStatus::Completed, "{name}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_cancelled_run_that_recorded_its_result_in_its_transaction_is_not_given_back_sqlite() {
    let (store, path) = common::sqlite("gbw-in-tx").await;
    let store = Arc::new(store);
    let s = store.clone();
    let record: InHandler = Arc::new(move |key, token| {
        let s = s.clone();
        Box::pin(async move {
            let mut tx = s.pool().begin().await.expect("begin");
            s.complete_in(&mut tx, &key, token, &receipt(), Duration::from_secs(60))
                .await
                .expect("complete in the handler's transaction");
            tx.commit().await.expect("commit");
        })
    });
    cancelled_after_in_handler_record(store, record, "sqlite").await;
    let _ = std::fs::remove_file(path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_cancelled_run_that_recorded_its_result_in_its_transaction_is_not_given_back_pg() {
    let Some(store) = common::postgres("tower_idempotency_gbw_review").await else {
        return;
    };
    let store = Arc::new(store);
    let s = store.clone();
    let record: InHandler = Arc::new(move |key, token| {
        let s = s.clone();
        Box::pin(async move {
            let mut tx = s.pool().begin().await.expect("begin");
            s.complete_in(&mut tx, &key, token, &receipt(), Duration::from_secs(60))
                .await
                .expect("complete in the handler's transaction");
            tx.commit().await.expect("commit");
        })
    });
    cancelled_after_in_handler_record(store, record, "postgres").await;
}

/// DESIGN §1 (one key, at most one execution at a time) with 96cd320: on a route that cancels
/// on a hang-up, twelve rounds of three clients that each hang up mid-run, every other
/// give-back failing once. The handler never runs twice at once for the key, nothing completes
/// the effect, and a patient client then runs it exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_storm_of_hang_ups_mid_run_never_overlaps_two_runs() {
    let rig = Rig::new(MemoryStore::new());
    for n in (1..=40).step_by(2) {
        rig.on("release", n, Act::Fail);
    }
    let effects = Effects::default();
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let starts = Arc::new(AtomicUsize::new(0));
    struct Leaving(Arc<AtomicUsize>);
    impl Drop for Leaving {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let h = {
        let (effects, running, most, starts) = (
            effects.clone(),
            running.clone(),
            most.clone(),
            starts.clone(),
        );
        handler(move |_, ctx| {
            let (effects, running, most, starts) = (
                effects.clone(),
                running.clone(),
                most.clone(),
                starts.clone(),
            );
            async move {
                starts.fetch_add(1, Ordering::SeqCst);
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                let _leaving = Leaving(running.clone());
                most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(ms(400)).await;
                let n = effects.hit();
                (
                    StatusCode::CREATED,
                    format!("effect {n} attempt {}", ctx.attempt()),
                )
            }
        })
    };
    let addr = server(&rig, Route::plain(ms(800)).cancelling(), h).await;
    let key = unique("storm-mid-run");
    for _ in 0..12 {
        let tasks: Vec<_> = (0..3)
            .map(|_| {
                let key = key.clone();
                tokio::spawn(async move { send(addr, &key, ms(150)).await })
            })
            .collect();
        for task in tasks {
            if let Some(a) = task.await.expect("task") {
                assert!(a.in_flight(), "{a:?}");
            }
        }
        tokio::time::sleep(ms(30)).await;
    }
    assert_eq!(
        effects.count(),
        0,
        "every run was cancelled before its effect"
    );
    let answered = ask_past_in_flight(addr, &key, Duration::from_secs(15)).await;
    assert!(
        answered.is_live(),
        "{answered:?} after {} starts\n  {}",
        starts.load(Ordering::SeqCst),
        rig.log()
    );
    assert!(ask(addr, &key).await.is_replay_of(&answered.body));
    assert_eq!(effects.count(), 1);
    assert_eq!(
        most.load(Ordering::SeqCst),
        1,
        "two runs of one key at once\n  {}",
        rig.log()
    );
    assert!(
        starts.load(Ordering::SeqCst) >= 2,
        "hang-ups cancelled runs"
    );
}

// ==== 3. The runtime shutting down under a release retry ======================================

/// 56ed0f1 and the runtime shutting down while a release is being retried (its task sleeping,
/// its hold renewing): no panic anywhere; the store is left with a key in flight whose lease
/// lapses, and a new server on the same store (a new runtime) takes it over and runs it once.
#[test]
fn s4_a_runtime_shut_down_during_a_release_retry_is_quiet_and_the_key_comes_back() {
    static PANICS: AtomicUsize = AtomicUsize::new(0);
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        previous(info);
    }));
    let store = Arc::new(MemoryStore::new());
    let key = unique("shutdown");
    let effects = Effects::default();
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime")
    };
    let first_runtime = runtime();
    let rig = Rig::over(store.clone());
    rig.always("release", Act::Fail);
    first_runtime.block_on(async {
        let addr = first_503(&rig, Route::plain(ms(400)), &effects).await;
        assert_eq!(ask(addr, &key).await.status, 503);
        assert!(eventually(async || rig.count("release") >= 3).await);
    });
    first_runtime.shutdown_timeout(Duration::from_secs(5));
    let tried = rig.count("release");
    let second_runtime = runtime();
    second_runtime.block_on(async {
        let rig = Rig::over(store.clone());
        let addr = server(
            &rig,
            Route::plain(ms(400)),
            sleep_then_effect(&effects, ms(0), false),
        )
        .await;
        let a = ask_past_in_flight(addr, &key, Duration::from_secs(10)).await;
        assert!(
            a.is_live() && a.body == "effect 1 attempt 2",
            "{a:?}\n  {}",
            rig.log()
        );
        assert!(ask(addr, &key).await.is_replay_of(&a.body));
    });
    second_runtime.shutdown_timeout(Duration::from_secs(5));
    assert_eq!(effects.count(), 1);
    assert!(tried >= 3);
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a panic somewhere");
}

// ==== 4. The wait rule (73705b9) =============================================================

/// DESIGN §1 step 6 (wait variant), §5 (stores wake waiters when a record changes): on a store
/// that wakes its waiters when the record moves on, the rule for stores that wake early must
/// cost nothing: ten waiters on a 1.5 s run (3 s lease: no lease end on the way) each make a
/// handful of store calls, not a poll's worth, and all replay the one run.
async fn well_behaved_store_waiters<S: IdempotencyStore>(store: S, name: &str, per_waiter: usize) {
    let rig = Rig::new(store);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::waiting(ms(3_000)),
        sleep_then_effect(&effects, ms(1_500), false),
    )
    .await;
    let key = unique(&format!("wait-well-{name}"));
    let first = hang_up_later(addr, &key);
    assert!(
        eventually(async || record_of(&rig, &key).await.is_some()).await,
        "{name}"
    );
    let before = rig.count("claim") + rig.count("lookup");
    let answers = waiters(addr, &key, 10).await.expect("waiters");
    let first = first.await.expect("task").expect("answered");
    assert!(first.is_live(), "{name}: {first:?}");
    assert!(
        answers.iter().all(|a| a.is_replay_of(&first.body)),
        "{name}: {}",
        summary(&answers)
    );
    let calls = rig.count("claim") + rig.count("lookup") - before;
    assert!(
        calls <= 10 * per_waiter,
        "{name}: ten waiters made {calls} claims and reads over one 1.5 s run ({} waits)",
        rig.count("wait_for_change")
    );
    assert_eq!(effects.count(), 1, "{name}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_wait_memory_store_waiters_sleep_until_the_run_ends() {
    well_behaved_store_waiters(MemoryStore::new(), "memory", 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_wait_postgres_listen_waiters_sleep_until_the_run_ends() {
    let Some(store) = common::postgres("tower_idempotency_gbw_review").await else {
        return;
    };
    well_behaved_store_waiters(store, "postgres", 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_wait_redis_pubsub_waiters_sleep_until_the_run_ends() {
    let Some(store) = common::redis("gbw-wait").await else {
        return;
    };
    well_behaved_store_waiters(store, "redis", 5).await;
}

/// 73705b9 against its own failure: a store that always wakes its waiters early, thirty
/// waiters, a 2 s run under a 300 ms lease on two workers. The holder keeps its lease (its
/// effect happens once), every waiter replays it, and the claims stay a polling cadence's worth
/// (a storm was half a million in two seconds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_wait_an_early_waking_store_costs_a_poll_not_a_storm() {
    let rig = Rig::new(MemoryStore::new());
    rig.early_waits.store(usize::MAX, Ordering::SeqCst);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::waiting(ms(300)),
        sleep_then_effect(&effects, ms(2_000), false),
    )
    .await;
    let key = unique("wait-early-storm");
    let first = hang_up_later(addr, &key);
    assert!(eventually(async || record_of(&rig, &key).await.is_some()).await);
    let answers = waiters(addr, &key, 30).await.expect("waiters");
    let first = first.await.expect("task").expect("answered");
    assert!(first.is_live(), "{first:?}");
    assert!(
        answers.iter().all(|a| a.is_replay_of(&first.body)),
        "{}",
        summary(&answers)
    );
    assert_eq!(effects.count(), 1);
    let claims = rig.count("claim") + rig.count("lookup");
    assert!(
        claims <= 30 * 100,
        "thirty waiters made {claims} claims and reads in a 2 s run"
    );
}

/// 73705b9 when the early wake-up comes first and the holder gives the key back (a 503 that
/// did nothing) while the waiters poll: exactly one waiter runs, every other replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_wait_early_wake_then_the_holder_gives_back_one_waiter_runs() {
    let rig = Rig::new(MemoryStore::new());
    rig.early_waits.store(20, Ordering::SeqCst);
    let effects = Effects::default();
    let counter = effects.clone();
    let h = handler(move |i, ctx| {
        let effects = counter.clone();
        async move {
            if i == 0 {
                tokio::time::sleep(ms(800)).await;
                return (StatusCode::SERVICE_UNAVAILABLE, "nothing done".into());
            }
            let n = effects.hit();
            (
                StatusCode::CREATED,
                format!("effect {n} attempt {}", ctx.attempt()),
            )
        }
    });
    let addr = server(&rig, Route::waiting(ms(2_000)), h).await;
    let key = unique("wait-early-release");
    let first = hang_up_later(addr, &key);
    assert!(eventually(async || record_of(&rig, &key).await.is_some()).await);
    let answers = waiters(addr, &key, 10).await.expect("waiters");
    let first = first.await.expect("task").expect("answered");
    assert_eq!(first.status, 503);
    let live: Vec<_> = answers.iter().filter(|a| a.is_live()).collect();
    assert_eq!(live.len(), 1, "{}\n  {}", summary(&answers), rig.log());
    let body = live[0].body.clone();
    assert_eq!(body, "effect 1 attempt 2");
    assert!(
        answers.iter().all(|a| a.is_live() || a.is_replay_of(&body)),
        "{}",
        summary(&answers)
    );
    assert_eq!(effects.count(), 1);
}

/// 73705b9 with a holder that completes while a waiter sleeps its polling pause (the store
/// woke everyone early once): the waiters still get the replay, and none of them runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_wait_holder_completes_during_the_poll_waiters_replay() {
    let rig = Rig::new(MemoryStore::new());
    rig.early_waits.store(1_000, Ordering::SeqCst);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::waiting(ms(5_000)),
        sleep_then_effect(&effects, ms(700), false),
    )
    .await;
    let key = unique("wait-complete-in-poll");
    let first = hang_up_later(addr, &key);
    assert!(eventually(async || record_of(&rig, &key).await.is_some()).await);
    let answers = waiters(addr, &key, 10).await.expect("waiters");
    let first = first.await.expect("task").expect("answered");
    assert!(first.is_live());
    assert!(
        answers.iter().all(|a| a.is_replay_of(&first.body)),
        "{}",
        summary(&answers)
    );
    assert_eq!(effects.count(), 1);
}

// ==== 5. JSON-RPC refusals of bodies the mode cannot read (b7aa7ea) ============================

/// A tool server: counts each call it runs, answers JSON-RPC with the call's id.
async fn tool(
    axum::extract::State(effects): axum::extract::State<Effects>,
    body: Bytes,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let message: Value = serde_json::from_slice(&body).unwrap_or_default();
    let id = message.get("id").cloned().unwrap_or(Value::Null);
    let n = effects.hit();
    let text = serde_json::json!({"jsonrpc":"2.0","id":id,"result":{"n":n,"content":[]}});
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        text.to_string(),
    )
        .into_response()
}

/// `/mcp` in JSON-RPC mode (`jsonrpc`) and `/http` in plain HTTP mode, both with a 1 KiB body
/// limit, on one server.
async fn rpc_server(jsonrpc: JsonRpc) -> (SocketAddr, Effects) {
    let effects = Effects::default();
    let layer = |rpc: Option<JsonRpc>| {
        let layer = IdempotencyLayer::new(MemoryStore::new())
            .single_tenant()
            .body_limit(1024);
        match rpc {
            Some(rpc) => layer.jsonrpc(rpc),
            None => layer,
        }
    };
    let app = Router::new()
        .route("/mcp", post(tool).layer(layer(Some(jsonrpc))))
        .route("/http", post(tool).layer(layer(None)))
        .with_state(effects.clone());
    (serve(app).await, effects)
}

fn call(id: &str, args: &str) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"t","arguments":{args},"_meta":{{"progressToken":{id}}}}}}}"#
    )
}

fn big_args() -> String {
    format!(r#"{{"pad":"{}"}}"#, "x".repeat(2048))
}

/// A strict JSON-RPC 2.0 reader of one error response: an object with exactly `jsonrpc`
/// ("2.0"), `id` (null, a number or a string) and `error` (an object with an integer `code`, a
/// string `message` and optionally `data`), no `result`, no byte-order mark. Returns
/// `(id, code, data)`.
fn strict_error(body: &[u8]) -> Result<(Value, i64, Value), String> {
    if body.first() != Some(&b'{') {
        return Err(format!(
            "not one JSON object: {:?}",
            String::from_utf8_lossy(body)
        ));
    }
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let o = v.as_object().ok_or("not an object")?;
    let mut members: Vec<&str> = o.keys().map(String::as_str).collect();
    members.sort_unstable();
    if members != ["error", "id", "jsonrpc"] {
        return Err(format!("members {members:?}: {v}"));
    }
    if o["jsonrpc"] != "2.0" {
        return Err(format!("jsonrpc member: {v}"));
    }
    let id = o["id"].clone();
    if !(id.is_null() || id.is_number() || id.is_string()) {
        return Err(format!("id of the wrong type: {v}"));
    }
    let error = o["error"].as_object().ok_or("error is not an object")?;
    for name in error.keys() {
        if !["code", "message", "data"].contains(&name.as_str()) {
            return Err(format!("error member {name}: {v}"));
        }
    }
    let code = error
        .get("code")
        .and_then(Value::as_i64)
        .ok_or_else(|| format!("code is not an integer: {v}"))?;
    if !error.get("message").is_some_and(Value::is_string) {
        return Err(format!("message is not a string: {v}"));
    }
    Ok((id, code, error.get("data").cloned().unwrap_or(Value::Null)))
}

/// DESIGN §8 ("errors travel as JSON-RPC error objects ... with codes outside the reserved
/// range and the same facts as the problem+json bodies in `error.data`") with b7aa7ea: a keyed
/// call over the body limit, its length declared, is a strict JSON-RPC 2.0 error to a null id
/// (413, `application/json`); its `error.data` is the very problem the plain HTTP route writes
/// for the same body; nothing runs.
#[tokio::test]
async fn s8_an_oversized_keyed_call_is_a_strict_error_carrying_the_http_problem() {
    let (addr, effects) = rpc_server(JsonRpc::new()).await;
    let body = call("7", &big_args());
    let headers = [
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
        ("idempotency-key", "k-big"),
    ];
    let rpc = common::raw::raw_post(addr, "/mcp", &headers, body.as_bytes()).await;
    let http = common::raw::raw_post(addr, "/http", &headers, body.as_bytes()).await;
    assert_eq!(rpc.status, 413, "{}", rpc.text());
    assert_eq!(rpc.one("content-type"), Some(&b"application/json"[..]));
    let (id, code, data) = strict_error(&rpc.body).unwrap_or_else(|e| panic!("{e}"));
    assert!(id.is_null(), "{}", rpc.text());
    assert!(
        !(-32768..=-32000).contains(&code),
        "a reserved code: {code}"
    );
    assert_eq!(code, -31005);
    assert_eq!(http.status, 413);
    assert_eq!(
        http.one("content-type"),
        Some(&b"application/problem+json"[..])
    );
    let problem: Value = serde_json::from_slice(&http.body).expect("problem JSON");
    assert_eq!(data, problem, "error.data is the HTTP route's problem");
    assert_eq!(data["safe_new_key"], true, "nothing ran: {data}");
    assert_eq!(effects.count(), 0);
}

/// JSON-RPC 2.0 §6 ("if the batch rpc call itself fails to be recognized ... the response from
/// the Server MUST be a single Response object") with b7aa7ea: a keyed batch over the limit,
/// streamed in chunks (no length declared), is one error object to a null id, never an array,
/// never problem+json; nothing runs.
#[tokio::test]
async fn s8_an_oversized_keyed_batch_is_one_strict_error_object() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (addr, effects) = rpc_server(JsonRpc::new()).await;
    let batch = format!("[{},{}]", call("1", &big_args()), call("2", "{}"));
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "POST /mcp HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\
         content-type: application/json\r\nidempotency-key: k-batch\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.expect("write");
    let mut framed = Vec::new();
    for piece in batch.as_bytes().chunks(300) {
        framed.extend(format!("{:x}\r\n", piece.len()).into_bytes());
        framed.extend_from_slice(piece);
        framed.extend_from_slice(b"\r\n");
    }
    framed.extend_from_slice(b"0\r\n\r\n");
    let _ = stream.write_all(&framed).await;
    let mut buf = Vec::new();
    let _ = common::guard("the answer", stream.read_to_end(&mut buf)).await;
    let raw = common::raw::parse_raw(&buf);
    assert_eq!(raw.status, 413, "{}", raw.text());
    assert_eq!(raw.one("content-type"), Some(&b"application/json"[..]));
    let (id, code, _) = strict_error(&raw.body).unwrap_or_else(|e| panic!("{e}"));
    assert!(id.is_null());
    assert_eq!(code, -31005);
    assert_eq!(effects.count(), 0);
}

/// DESIGN §8 ("a call that carries a key but cannot be guarded (... a body the mode cannot
/// read) is refused, never run unguarded"): a keyed call starting with a byte-order mark is a
/// strict JSON-RPC error to a null id, with a code outside the reserved range; nothing runs.
/// The same call without the mark runs once and replays.
#[tokio::test]
async fn s8_a_keyed_call_with_a_byte_order_mark_is_a_strict_error_nothing_run() {
    let (addr, effects) = rpc_server(JsonRpc::new()).await;
    let body = call("5", r#"{"amount":10}"#);
    let mut bom = "\u{feff}".as_bytes().to_vec();
    bom.extend_from_slice(body.as_bytes());
    let headers = [
        ("content-type", "application/json"),
        ("idempotency-key", "k-bom"),
    ];
    let raw = common::raw::raw_post(addr, "/mcp", &headers, &bom).await;
    assert!((400..500).contains(&raw.status), "{}", raw.text());
    assert_eq!(raw.one("content-type"), Some(&b"application/json"[..]));
    let (id, code, data) = strict_error(&raw.body).unwrap_or_else(|e| panic!("{e}"));
    assert!(id.is_null(), "{}", raw.text());
    assert!(!(-32768..=-32000).contains(&code), "{}", raw.text());
    assert_eq!(data["status"], raw.status, "{}", raw.text());
    assert_eq!(effects.count(), 0);
    let plain = common::raw::raw_post(addr, "/mcp", &headers, body.as_bytes()).await;
    assert_eq!(plain.status, 200, "{}", plain.text());
    let again = common::raw::raw_post(addr, "/mcp", &headers, body.as_bytes()).await;
    assert!(again.replayed(), "{}", again.text());
    assert_eq!(effects.count(), 1);
}

/// A key over 255 bytes: a valid header, an invalid key.
const LONG_KEY: &str = "kkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkk";

/// b7aa7ea whatever else the request says: over the limit on the JSON-RPC route with a gRPC
/// content type, with an event-stream-only `Accept`, or with an invalid key, the refusal is
/// still a strict JSON-RPC error object in `application/json` (never a gRPC trailers-only
/// answer, never problem+json, never an event stream); nothing runs.
#[tokio::test]
async fn s8_oversized_calls_with_grpc_type_sse_accept_or_bad_key_are_strict_errors() {
    let (addr, effects) = rpc_server(JsonRpc::new()).await;
    let body = call("9", &big_args());
    let cases: [(&str, Vec<(&str, &str)>); 3] = [
        (
            "a gRPC content type",
            vec![
                ("content-type", "application/grpc"),
                ("idempotency-key", "k-grpc"),
            ],
        ),
        (
            "an event-stream-only Accept",
            vec![
                ("content-type", "application/json"),
                ("accept", "text/event-stream"),
                ("idempotency-key", "k-sse"),
            ],
        ),
        (
            "an invalid key",
            vec![
                ("content-type", "application/json"),
                ("idempotency-key", LONG_KEY),
            ],
        ),
    ];
    for (what, headers) in cases {
        let raw = common::raw::raw_post(addr, "/mcp", &headers, body.as_bytes()).await;
        assert!(
            (400..500).contains(&raw.status),
            "{what}: {} {}",
            raw.status,
            raw.text()
        );
        assert_eq!(
            raw.one("content-type"),
            Some(&b"application/json"[..]),
            "{what}"
        );
        assert!(raw.one("grpc-status").is_none(), "{what}");
        let (id, code, _) = strict_error(&raw.body).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(id.is_null(), "{what}: {}", raw.text());
        assert!(!(-32768..=-32000).contains(&code), "{what}: {}", raw.text());
    }
    assert_eq!(effects.count(), 0);
}

/// b7aa7ea must not refuse what the mode never reads: on a route that takes keys from the
/// header only, an unkeyed call over the limit (a big `tools/list`, say) passes through unread
/// and runs, answered by the server as it would be.
#[tokio::test]
async fn s8_an_unkeyed_oversized_call_on_a_header_key_route_passes_through() {
    let (addr, effects) = rpc_server(JsonRpc::new()).await;
    let body = call("11", &big_args());
    let headers = [("content-type", "application/json")];
    let raw = common::raw::raw_post(addr, "/mcp", &headers, body.as_bytes()).await;
    assert_eq!(raw.status, 200, "{}", raw.text());
    let v = raw.json();
    assert_eq!(v["id"], 11, "{v}");
    assert!(v.get("result").is_some(), "{v}");
    assert_eq!(effects.count(), 1);
}
