//! Adversarial review: store faults injected into (1) routes that wait for an in-flight key
//! (`wait_for_in_flight`), (2) handlers that mark their effect started (milestones), and (3) the
//! give-backs of 96cd320 (`give_back` retries a failed release of a key nothing runs under).
//!
//! A store wrapper ([`Rig`]) fails, stalls, hangs, or writes-then-fails the n-th operation of one
//! kind, takes the store down for a while at a given call, fails the renewals of chosen holders
//! (a crashed holder), and logs what it did. It does not offer the inner store's at-once paths
//! (`claim_now`...), so every claim is a round trip a hang-up can drop. Effects are counted at
//! the sink (inside the handler); every test also checks every client's answer.

use crate::common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::http::StatusCode;
use common::Effects;
use tokio::time::Instant;
use tower_idempotency::store::RecordStatus;
use tower_idempotency::{IdempotencyStore, MemoryStore};

use common::rig::*;

// ---- handlers ------------------------------------------------------------------------------

/// Marks its effect started, makes it, then (call 0 only) takes `after` to answer: the lease
/// may run out, or the client hang up, after the milestone and the effect.
fn effect_then_sleep(effects: &Effects, after: Duration) -> Handler {
    let effects = effects.clone();
    handler(move |i, ctx| {
        let effects = effects.clone();
        async move {
            if ctx.effect_started().await.is_err() {
                return (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "no milestone, no effect".into(),
                );
            }
            let n = effects.hit();
            if i == 0 {
                tokio::time::sleep(after).await;
            }
            (
                StatusCode::CREATED,
                format!("effect {n} attempt {}", ctx.attempt()),
            )
        }
    })
}

/// Every answer of `answers` is a replay of `body`, except exactly `live` ones that ran it.
fn assert_coalesced(what: &str, answers: &[Answer], body: &str, live: usize, rig_log: &str) {
    let runs = answers.iter().filter(|a| a.is_live()).count();
    let replays = answers.iter().filter(|a| a.is_replay_of(body)).count();
    assert!(
        runs == live && runs + replays == answers.len(),
        "{what}: expected {live} live run(s) and the rest replays of {body:?}; got {}\n  store log:\n  {rig_log}",
        summary(answers)
    );
}

// ==== 1. Routes that wait, with store faults ==================================================

/// DESIGN §1 step 6 (wait variant) and "store errors -> 503, nothing run": one waiter's first
/// claim fails (claim #5: #1 is the holder's). That waiter is told 503; every other waiter
/// replays the holder's answer; the handler ran once.
async fn a_waiters_failed_claim<S: IdempotencyStore>(store: S) {
    let rig = Rig::new(store);
    rig.on("claim", 5, Act::Fail);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::waiting(ms(2_000)),
        sleep_then_effect(&effects, ms(900), false),
    )
    .await;
    let key = unique("wait-claim-fails");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(200)).await;
    let answers = waiters(addr, &key, 20).await.expect("waiters");
    let first = first.await.expect("task").expect("the holder is answered");
    assert!(first.is_live(), "{first:?}");
    let unavailable = answers.iter().filter(|a| a.status == 503).count();
    let rest: Vec<_> = answers
        .iter()
        .filter(|a| a.status != 503)
        .cloned()
        .collect();
    assert_eq!(unavailable, 1, "{}", summary(&answers));
    assert!(
        answers
            .iter()
            .filter(|a| a.status == 503)
            .all(|a| a.problem == "store-unavailable")
    );
    assert_coalesced("the other waiters", &rest, &first.body, 0, &rig.log());
    assert_eq!(effects.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_wait_one_waiters_failed_claim_is_503_the_rest_replay() {
    a_waiters_failed_claim(MemoryStore::new()).await;
}

/// DESIGN §1 step 6 (wait variant): the read every woken waiter makes fails (every time); the
/// waiters fall back to a claim and still replay the one run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_wait_failing_woken_reads_fall_back_to_claims_and_replay() {
    let rig = Rig::new(MemoryStore::new());
    rig.always("lookup", Act::Fail);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::waiting(ms(2_000)),
        sleep_then_effect(&effects, ms(700), false),
    )
    .await;
    let key = unique("wait-read-fails");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(200)).await;
    let answers = waiters(addr, &key, 20).await.expect("waiters");
    let first = first.await.expect("task").expect("answered");
    assert!(first.is_live(), "{first:?}");
    assert_coalesced("waiters", &answers, &first.body, 0, &rig.log());
    assert!(rig.count("lookup") >= 1, "the woken read was made");
    assert_eq!(effects.count(), 1);
}

/// DESIGN §1 step 6 (wait variant): the first woken read stalls 1.5 s (shared by every waiter
/// woken with it), and the next one writes nothing and returns late. Nobody runs, nobody hangs,
/// everyone replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_wait_stalled_woken_reads_still_replay() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("lookup", 1, Act::Before(ms(1_500)));
    rig.on("lookup", 2, Act::After(ms(800)));
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::waiting(ms(600)),
        sleep_then_effect(&effects, ms(1_000), false),
    )
    .await;
    let key = unique("wait-read-stalls");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(200)).await;
    let answers = waiters(addr, &key, 20).await.expect("waiters");
    let first = first.await.expect("task").expect("answered");
    assert!(first.is_live(), "{first:?}");
    assert_coalesced("waiters", &answers, &first.body, 0, &rig.log());
    assert_eq!(effects.count(), 1);
}

/// DESIGN §1 step 6 (wait variant): `wait_for_change` returns at once every time (allowed:
/// "returning early is always allowed"): the waiters spin on claims, but none runs, and all
/// replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_wait_for_change_that_never_waits_still_coalesces() {
    let rig = Rig::new(MemoryStore::new());
    rig.always("wait_for_change", Act::Fail);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::waiting(ms(2_000)),
        sleep_then_effect(&effects, ms(600), false),
    )
    .await;
    let key = unique("wait-spins");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(150)).await;
    let answers = waiters(addr, &key, 20).await.expect("waiters");
    let first = first.await.expect("task").expect("answered");
    assert_eq!(
        effects.count(),
        1,
        "the handler's effect ran {} times for one key; the holder answered {:?}, the waiters \
         {}; renewals sent: {}",
        effects.count(),
        first.body,
        summary(&answers),
        rig.count("renew"),
    );
    assert_coalesced("waiters", &answers, &first.body, 0, &rig.log());
}

/// DESIGN §7.7 ("effect succeeds, response write fails -> key is not re-executed;
/// reconciliation resolves it") and §4 ("the holder keeps renewing and retrying the write")
/// with §1's waiting route: the holder's first `complete` fails once; the holder answers its
/// client 201, marks the key uncertain at once (so that reconciliation can resolve it should
/// the holder die), and its retried write lands ~10 ms later. The 20 waiters never run: each
/// replays or is told "outcome unknown" (the review asked for replays only; that needs a
/// contract decision, since §7.7 hands the key to reconciliation at once). A later retry
/// replays the landed write.
async fn complete_fails_once_while_others_wait<S: IdempotencyStore>(store: S) {
    let rig = Rig::new(store);
    rig.on("complete", 1, Act::Fail);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::waiting(ms(2_000)),
        sleep_then_effect(&effects, ms(900), false),
    )
    .await;
    let key = unique("wait-complete-fails");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(200)).await;
    let answers = waiters(addr, &key, 20).await.expect("waiters");
    let first = first.await.expect("task").expect("answered");
    assert!(first.is_live(), "{first:?}");
    // The retried record lands: a retry after the dust settles replays.
    assert!(
        eventually(async || record_of(&rig, &key)
            .await
            .is_some_and(|r| r.status == RecordStatus::Completed))
        .await,
        "the retried record landed\n  {}",
        rig.log()
    );
    let later = ask(addr, &key).await;
    assert!(later.is_replay_of(&first.body), "{later:?}");
    assert_eq!(effects.count(), 1, "never a second run");
    assert!(
        answers
            .iter()
            .all(|a| a.is_replay_of(&first.body)
                || (a.status == 409 && a.problem == "outcome-unknown")),
        "waiters of a holder whose first write failed once: replays or outcome unknown, never \
         a run; got {}\n  store log:\n  {}",
        summary(&answers),
        rig.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_7_wait_a_record_that_fails_once_never_runs_again() {
    complete_fails_once_while_others_wait(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_7_wait_a_record_that_fails_once_never_runs_again_on_postgres() {
    let Some(store) = common::postgres("tower_idempotency_fwm_review").await else {
        return;
    };
    complete_fails_once_while_others_wait(store).await;
}

/// DESIGN §3 (a 5xx under DefinitiveOnly "releases the claim so a later retry re-attempts") and
/// §4 (a failed write of the outcome is retried under a renewed lease, not left to lapse), on
/// a waiting route that reconciles expired leases: the holder answers 503 having done nothing,
/// and its one release fails once. The waiters must get the key back (one runs, the rest
/// replay), not "outcome unknown" after the lease lapses.
async fn release_fails_once_on_reconcile_route<S: IdempotencyStore>(store: S) {
    let rig = Rig::new(store);
    rig.on("release", 1, Act::Fail);
    let effects = Effects::default();
    let route = Route::waiting(ms(600)).reconcile();
    let addr = server(
        &rig,
        route,
        fail_first(&effects, ms(500), StatusCode::SERVICE_UNAVAILABLE),
    )
    .await;
    let key = unique("wait-release-fails");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(150)).await;
    let answers = waiters(addr, &key, 20).await.expect("waiters");
    let first = first.await.expect("task").expect("answered");
    assert_eq!(first.status, 503, "{first:?}");
    assert!(effects.count() <= 1, "{}", summary(&answers));
    let live = answers.iter().find(|a| a.is_live()).cloned();
    let body = live.as_ref().map_or(String::new(), |a| a.body.clone());
    assert_coalesced(
        "waiters after a holder gave the key back (its release failed once)",
        &answers,
        &body,
        1,
        &rig.log(),
    );
    assert_eq!(effects.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_wait_a_release_that_fails_once_still_gives_the_key_back_on_reconcile() {
    release_fails_once_on_reconcile_route(MemoryStore::new()).await;
}

/// The same on a route that reclaims: the key comes back (after the lease) and exactly one
/// waiter runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_wait_a_release_that_fails_once_on_reclaim_lets_one_waiter_run() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("release", 1, Act::Fail);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::waiting(ms(600)),
        fail_first(&effects, ms(500), StatusCode::SERVICE_UNAVAILABLE),
    )
    .await;
    let key = unique("wait-release-fails-reclaim");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(150)).await;
    let answers = waiters(addr, &key, 20).await.expect("waiters");
    let first = first.await.expect("task").expect("answered");
    assert_eq!(first.status, 503);
    let body = answers
        .iter()
        .find(|a| a.is_live())
        .map_or(String::new(), |a| a.body.clone());
    assert_coalesced("waiters", &answers, &body, 1, &rig.log());
    assert_eq!(effects.count(), 1);
}

/// DESIGN §4: a holder that crashes (its renewals fail; its handler never makes the effect)
/// while 20 requests wait. On a reclaiming route exactly one waiter takes over and runs, every
/// other waiter replays the new holder's answer.
async fn crashed_holder_with_waiters<S: IdempotencyStore>(store: S) {
    let rig = Rig::new(store);
    rig.doom(0);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::waiting(ms(500)),
        sleep_then_effect(&effects, ms(60_000), false),
    )
    .await;
    let key = unique("wait-crash");
    let crashed = tokio::spawn({
        let key = key.clone();
        async move { send(addr, &key, ms(4_000)).await }
    });
    tokio::time::sleep(ms(150)).await;
    let answers = waiters(addr, &key, 20).await.expect("waiters");
    let body = answers
        .iter()
        .find(|a| a.is_live())
        .map_or(String::new(), |a| a.body.clone());
    assert_coalesced(
        "waiters of a crashed holder",
        &answers,
        &body,
        1,
        &rig.log(),
    );
    assert!(body.ends_with("attempt 2"), "{body}");
    assert_eq!(effects.count(), 1);
    crashed.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_wait_crashed_holder_one_waiter_takes_over() {
    crashed_holder_with_waiters(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_wait_crashed_holder_one_waiter_takes_over_on_sqlite() {
    let (store, path) = common::sqlite("fwm-crash").await;
    crashed_holder_with_waiters(store).await;
    let _ = std::fs::remove_file(path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_wait_crashed_holder_one_waiter_takes_over_on_redis() {
    let Some(store) = common::redis("fwm-crash").await else {
        return;
    };
    crashed_holder_with_waiters(store).await;
}

/// DESIGN §4 with `LeaseExpiry::Reconcile`: the same crash; every waiter is told "outcome
/// unknown", nobody runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_wait_crashed_holder_on_reconcile_every_waiter_told_unknown() {
    let rig = Rig::new(MemoryStore::new());
    rig.doom(0);
    let effects = Effects::default();
    let route = Route::waiting(ms(500)).reconcile();
    let addr = server(&rig, route, sleep_then_effect(&effects, ms(60_000), false)).await;
    let key = unique("wait-crash-reconcile");
    let crashed = tokio::spawn({
        let key = key.clone();
        async move { send(addr, &key, ms(4_000)).await }
    });
    tokio::time::sleep(ms(150)).await;
    let answers = waiters(addr, &key, 20).await.expect("waiters");
    assert!(
        answers
            .iter()
            .all(|a| a.status == 409 && a.problem == "outcome-unknown"),
        "{}",
        summary(&answers)
    );
    assert_eq!(effects.count(), 0);
    crashed.abort();
}

/// DESIGN §4 (renewal survives one hanging store call): the holder's first renewal never
/// answers; the next ones keep the lease. 20 waiters never take over a live holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_wait_one_hanging_renewal_never_lets_a_waiter_take_over() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("renew", 1, Act::Hang);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::waiting(ms(600)),
        sleep_then_effect(&effects, ms(1_600), false),
    )
    .await;
    let key = unique("wait-renew-hangs");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(150)).await;
    let answers = waiters(addr, &key, 20).await.expect("waiters");
    let first = first.await.expect("task").expect("answered");
    assert!(first.is_live(), "{first:?}");
    assert_coalesced("waiters", &answers, &first.body, 0, &rig.log());
    assert_eq!(effects.count(), 1);
}

/// DESIGN §1 step 7 (a hang-up never cancels a half-done effect) on a waiting route: the
/// holder's client hangs up; the handler runs on; the waiters replay it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_wait_holder_hangs_up_without_cancel_waiters_replay() {
    let rig = Rig::new(MemoryStore::new());
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::waiting(ms(600)),
        sleep_then_effect(&effects, ms(1_000), false),
    )
    .await;
    let key = unique("wait-hang-up");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(150)).await;
    let answers = waiters(addr, &key, 20);
    tokio::time::sleep(ms(250)).await;
    first.abort();
    let answers = answers.await.expect("waiters");
    let body = "effect 1 attempt 1";
    assert_coalesced(
        "waiters of a holder whose client left",
        &answers,
        body,
        0,
        &rig.log(),
    );
    assert_eq!(effects.count(), 1);
}

/// DESIGN §1 with `cancel_on_disconnect` (the route's promise: a hang-up cancels the run and
/// gives the key back so a retry runs it again), while 20 wait: the holder's client hangs up
/// before the effect; its give-back fails once and is tried again (96cd320); then exactly one
/// waiter runs (attempt 2) and the others replay it.
async fn cancelled_holder_with_waiters(fail_first_give_back: bool) {
    let rig = Rig::new(MemoryStore::new());
    if fail_first_give_back {
        rig.on("release", 1, Act::Fail);
    }
    let effects = Effects::default();
    let route = Route::waiting(ms(3_000)).cancelling();
    let addr = server(&rig, route, sleep_then_effect(&effects, ms(20_000), false)).await;
    let key = unique("wait-cancel");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(150)).await;
    let answers = waiters(addr, &key, 20);
    tokio::time::sleep(ms(300)).await;
    first.abort();
    let answers = answers.await.expect("waiters");
    let body = answers
        .iter()
        .find(|a| a.is_live())
        .map_or(String::new(), |a| a.body.clone());
    assert_coalesced(
        "waiters of a cancelled holder",
        &answers,
        &body,
        1,
        &rig.log(),
    );
    assert_eq!(body, "effect 1 attempt 2");
    assert_eq!(effects.count(), 1, "the cancelled run made no effect");
    let releases = rig.count("release");
    assert_eq!(
        releases,
        if fail_first_give_back { 2 } else { 1 },
        "{}",
        rig.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_wait_cancelled_holder_gives_back_and_one_waiter_runs() {
    cancelled_holder_with_waiters(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_wait_cancelled_holder_whose_give_back_fails_once_one_waiter_runs() {
    cancelled_holder_with_waiters(true).await;
}

// ==== 2. Milestones ============================================================================

/// DESIGN §4: the milestone write fails, so the handler (as the README tells it) declines the
/// effect and answers 503; the key is released (the store has no milestone): the waiters get
/// it back and one of them runs; a later retry replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_milestone_write_fails_the_key_is_given_back_to_waiters() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("record_milestone", 1, Act::Fail);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::waiting(ms(2_000)),
        sleep_then_effect(&effects, ms(500), true),
    )
    .await;
    let key = unique("milestone-fails");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(150)).await;
    let answers = waiters(addr, &key, 10).await.expect("waiters");
    let first = first.await.expect("task").expect("answered");
    assert_eq!(first.status, 503, "{first:?}");
    let body = answers
        .iter()
        .find(|a| a.is_live())
        .map_or(String::new(), |a| a.body.clone());
    assert_coalesced("waiters", &answers, &body, 1, &rig.log());
    assert_eq!(effects.count(), 1);
    assert!(ask(addr, &key).await.is_replay_of(&body));
}

/// DESIGN §4: the milestone write lands but its answer is lost (the handler sees an error and
/// declines). The store now says the effect may have started: the key must never run again;
/// every retry, waiting or not, is told "outcome unknown", across several leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_milestone_written_but_its_answer_lost_never_runs_again() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("record_milestone", 1, Act::ApplyThenFail);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::waiting(ms(400)),
        sleep_then_effect(&effects, ms(300), true),
    )
    .await;
    let key = unique("milestone-answer-lost");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(100)).await;
    let answers = waiters(addr, &key, 10).await.expect("waiters");
    let first = first.await.expect("task").expect("answered");
    assert_eq!(first.status, 503);
    assert!(
        answers
            .iter()
            .all(|a| a.status == 409 && a.problem == "outcome-unknown"),
        "{}\n  {}",
        summary(&answers),
        rig.log()
    );
    for _ in 0..4 {
        tokio::time::sleep(ms(300)).await;
        let retry = ask(addr, &key).await;
        assert_eq!(
            (retry.status, retry.problem.as_str()),
            (409, "outcome-unknown")
        );
    }
    assert_eq!(effects.count(), 0);
}

/// DESIGN §3/§4: milestone, effect, then a 500; the release (which would move the key to
/// reconciliation) fails. The lease then lapses on a reclaiming route: the next claim must
/// still see the milestone and never run the effect again.
async fn milestone_then_500_and_release_fails<S: IdempotencyStore>(store: S) {
    let rig = Rig::new(store);
    rig.on("release", 1, Act::Fail);
    let effects = Effects::default();
    let counter = effects.clone();
    let h = handler(move |_, ctx| {
        let effects = counter.clone();
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
    });
    let addr = server(&rig, Route::waiting(ms(500)), h).await;
    let key = unique("milestone-500-release-fails");
    let first = ask(addr, &key).await;
    assert_eq!(first.status, 500);
    let answers = waiters(addr, &key, 10).await.expect("waiters");
    assert!(
        answers
            .iter()
            .all(|a| a.status == 409 && a.problem == "outcome-unknown"),
        "{}\n  {}",
        summary(&answers),
        rig.log()
    );
    tokio::time::sleep(ms(1_200)).await;
    let late = ask(addr, &key).await;
    assert_eq!(
        (late.status, late.problem.as_str()),
        (409, "outcome-unknown")
    );
    assert_eq!(effects.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_milestone_then_500_and_a_failed_release_never_runs_again() {
    milestone_then_500_and_release_fails(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_milestone_then_500_and_a_failed_release_never_runs_again_on_postgres() {
    let Some(store) = common::postgres("tower_idempotency_fwm_review").await else {
        return;
    };
    milestone_then_500_and_release_fails(store).await;
}

/// DESIGN §4: milestone, effect, then the lease runs out while the handler still works
/// (`fail`: every renewal fails; else: every renewal hangs). 20 waiters on a reclaiming
/// route must never run it: "outcome unknown" (or, once the holder's own record lands, its
/// replay); a retry at the end replays the one effect.
async fn lease_lapses_after_milestone<S: IdempotencyStore>(store: S, hang: bool) {
    let rig = Rig::new(store);
    if hang {
        rig.always("renew", Act::Hang);
    } else {
        rig.always("renew", Act::Fail);
    }
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::waiting(ms(500)),
        effect_then_sleep(&effects, ms(1_500)),
    )
    .await;
    let key = unique("milestone-lease-lapses");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(150)).await;
    let answers = waiters(addr, &key, 20).await.expect("waiters");
    let first = first.await.expect("task").expect("answered");
    assert!(first.is_live(), "{first:?}");
    assert!(
        answers
            .iter()
            .all(|a| (a.status == 409 && a.problem == "outcome-unknown")
                || a.is_replay_of(&first.body)),
        "{}\n  {}",
        summary(&answers),
        rig.log()
    );
    assert!(
        eventually(async || record_of(&rig, &key)
            .await
            .is_some_and(|r| r.status == RecordStatus::Completed))
        .await,
        "the holder that ran settles its outcome\n  {}",
        rig.log()
    );
    assert!(ask(addr, &key).await.is_replay_of(&first.body));
    assert_eq!(effects.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_milestone_then_failed_renewals_waiters_never_run() {
    lease_lapses_after_milestone(MemoryStore::new(), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_milestone_then_hanging_renewals_waiters_never_run() {
    lease_lapses_after_milestone(MemoryStore::new(), true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_milestone_then_failed_renewals_waiters_never_run_on_postgres() {
    let Some(store) = common::postgres("tower_idempotency_fwm_review").await else {
        return;
    };
    lease_lapses_after_milestone(store, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_milestone_then_failed_renewals_waiters_never_run_on_redis() {
    let Some(store) = common::redis("fwm-milestone-lapse").await else {
        return;
    };
    lease_lapses_after_milestone(store, false).await;
}

/// DESIGN §4 with `cancel_on_disconnect`: milestone, effect, then the client hangs up while
/// the handler still waits on its provider. The give-back (its first try failing when
/// `fail_first`) must leave the key "outcome unknown" for the waiters and every later retry,
/// never a second run.
async fn hang_up_after_milestone(fail_first: bool) {
    let rig = Rig::new(MemoryStore::new());
    if fail_first {
        rig.on("release", 1, Act::Fail);
    }
    let effects = Effects::default();
    let route = Route::waiting(ms(3_000)).cancelling();
    let addr = server(&rig, route, effect_then_sleep(&effects, ms(20_000))).await;
    let key = unique("milestone-hang-up");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(150)).await;
    let answers = waiters(addr, &key, 20);
    tokio::time::sleep(ms(300)).await;
    first.abort();
    let answers = answers.await.expect("waiters");
    assert!(
        answers
            .iter()
            .all(|a| a.status == 409 && a.problem == "outcome-unknown"),
        "{}\n  {}",
        summary(&answers),
        rig.log()
    );
    let record = record_of(&rig, &key).await.expect("record");
    assert_eq!(record.status, RecordStatus::NeedsReconciliation);
    tokio::time::sleep(ms(3_500)).await;
    let late = ask(addr, &key).await;
    assert_eq!(
        (late.status, late.problem.as_str()),
        (409, "outcome-unknown")
    );
    assert_eq!(effects.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_milestone_then_hang_up_with_cancel_is_outcome_unknown() {
    hang_up_after_milestone(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_milestone_then_hang_up_with_cancel_and_a_failed_give_back_is_outcome_unknown() {
    hang_up_after_milestone(true).await;
}

/// DESIGN §4: milestone, effect, hang-up on a cancelling route, and the store goes down for
/// longer than the lease as the give-back begins: the give-back gives up, the lease lapses,
/// and the next claim must still refuse to run (effect started), even on a reclaiming route.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_milestone_then_hang_up_and_an_outage_past_the_lease_never_runs_again() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("release", 1, Act::DownFor(ms(1_500)));
    let effects = Effects::default();
    let route = Route::plain(ms(600)).cancelling();
    let addr = server(&rig, route, effect_then_sleep(&effects, ms(20_000))).await;
    let key = unique("milestone-hang-up-outage");
    let first = hang_up_later(addr, &key);
    assert!(eventually(async || effects.count() == 1).await);
    tokio::time::sleep(ms(100)).await;
    first.abort();
    tokio::time::sleep(ms(2_200)).await;
    for _ in 0..3 {
        let retry = ask(addr, &key).await;
        assert_eq!(
            (retry.status, retry.problem.as_str()),
            (409, "outcome-unknown"),
            "{retry:?}\n  {}",
            rig.log()
        );
        tokio::time::sleep(ms(300)).await;
    }
    assert_eq!(effects.count(), 1);
}

/// DESIGN §4 (fencing): the first holder's renewals fail (it is taken for dead) and it waits
/// before marking its effect; a waiter takes the key over and runs. The late holder's
/// milestone is then refused, so it makes no effect: one effect, and every waiter replays the
/// new holder's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_late_holders_milestone_after_a_takeover_is_refused() {
    let rig = Rig::new(MemoryStore::new());
    rig.doom(0);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::waiting(ms(500)),
        sleep_then_effect(&effects, ms(1_500), true),
    )
    .await;
    let key = unique("late-milestone");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(150)).await;
    let answers = waiters(addr, &key, 20).await.expect("waiters");
    let first = first.await.expect("task").expect("answered");
    assert_eq!(first.status, 503, "the late holder declined: {first:?}");
    let body = answers
        .iter()
        .find(|a| a.is_live())
        .map_or(String::new(), |a| a.body.clone());
    assert_coalesced("waiters", &answers, &body, 1, &rig.log());
    assert_eq!(effects.count(), 1);
    assert!(ask(addr, &key).await.is_replay_of(&body));
}

/// DESIGN §4: the milestone write stalls past the lease while the holder's renewals fail.
/// `before`: the write has not landed when a waiter takes over, so it is fenced later and the
/// old holder declines; else the write lands at once and only its answer is slow, so the
/// waiter finds the effect started and must not run. One effect either way.
async fn milestone_write_stalls(before: bool) {
    let rig = Rig::new(MemoryStore::new());
    rig.doom(0);
    let stall = ms(1_500);
    rig.on(
        "record_milestone",
        1,
        if before {
            Act::Before(stall)
        } else {
            Act::After(stall)
        },
    );
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::waiting(ms(500)),
        sleep_then_effect(&effects, ms(0), true),
    )
    .await;
    let key = unique("milestone-stalls");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(150)).await;
    let answers = waiters(addr, &key, 10).await.expect("waiters");
    let first = first.await.expect("task").expect("answered");
    if before {
        assert_eq!(first.status, 503, "{first:?}");
        let body = answers
            .iter()
            .find(|a| a.is_live())
            .map_or(String::new(), |a| a.body.clone());
        assert_coalesced("waiters", &answers, &body, 1, &rig.log());
    } else {
        assert!(first.is_live(), "{first:?}");
        assert!(
            answers
                .iter()
                .all(|a| (a.status == 409 && a.problem == "outcome-unknown")
                    || a.is_replay_of(&first.body)),
            "{}\n  {}",
            summary(&answers),
            rig.log()
        );
    }
    assert_eq!(effects.count(), 1, "{}", rig.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_milestone_write_stalled_before_landing_is_fenced_after_a_takeover() {
    milestone_write_stalls(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_milestone_landed_but_answered_late_stops_the_takeover() {
    milestone_write_stalls(false).await;
}

// ==== 3. Give-backs (96cd320) ================================================================

/// 96cd320 on its own terms: a run cancelled by a hang-up is given back "tried again while the
/// store fails, for as long as the lease lasts". The client hangs up right after a renewal (a
/// whole 3 s lease ahead); the first give-back takes the store down for 2.4 s, well inside
/// that lease. A give-back that keeps trying while the lease lasts lands after the store
/// returns; the key is released and, on this reconciling route, the retry runs (attempt 2)
/// instead of being told "outcome unknown" for a run that was cancelled before its effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_giveback_keeps_trying_while_the_lease_lasts() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("release", 1, Act::DownFor(ms(2_400)));
    let effects = Effects::default();
    let route = Route::plain(ms(3_000)).reconcile().cancelling();
    let addr = server(&rig, route, sleep_then_effect(&effects, ms(30_000), false)).await;
    let key = unique("give-back-lease");
    let first = hang_up_later(addr, &key);
    assert!(eventually(async || rig.renewed_ok.load(Ordering::SeqCst) >= 1).await);
    first.abort();
    let hung_up = Instant::now();
    assert!(eventually(async || rig.count("release") >= 1).await);
    // Past the lease's end (3 s after the renewal), whatever happened.
    tokio::time::sleep_until(hung_up + ms(3_600)).await;
    assert_eq!(effects.count(), 0, "the cancelled run made no effect");
    let retry = ask(addr, &key).await;
    assert_eq!(
        (retry.status, retry.body.as_str()),
        (201, "effect 1 attempt 2"),
        "{retry:?}\n  store log:\n  {}",
        rig.log()
    );
    assert_eq!(effects.count(), 1);
}

/// 96cd320: a give-back still retrying when another request takes the key over must be fenced
/// out, never release the new holder's key. The first holder is taken for dead (renewals
/// fail), hangs up on a cancelling route 2 s into a 3 s lease; every release fails until a
/// second claim acquires. The waiter takes over at the lease's end and runs for 1.5 s; a third
/// request meanwhile must find it in flight, never run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_giveback_after_a_takeover_is_fenced_out() {
    let rig = Rig::new(MemoryStore::new());
    rig.doom(0);
    rig.release_fails_below.store(2, Ordering::SeqCst);
    let effects = Effects::default();
    let counter = effects.clone();
    let h = handler(move |i, ctx| {
        let effects = counter.clone();
        async move {
            tokio::time::sleep(if i == 0 { ms(30_000) } else { ms(1_500) }).await;
            let n = effects.hit();
            (
                StatusCode::CREATED,
                format!("effect {n} attempt {}", ctx.attempt()),
            )
        }
    });
    let route = Route::waiting(ms(3_000)).cancelling();
    let addr = server(&rig, route, h).await;
    let key = unique("give-back-fenced");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(200)).await;
    let waiter = tokio::spawn({
        let key = key.clone();
        async move { ask(addr, &key).await }
    });
    tokio::time::sleep(ms(1_800)).await;
    first.abort();
    assert!(
        eventually(async || rig.acquired() >= 2).await,
        "{}",
        rig.log()
    );
    // The new holder runs; the old give-back tries again meanwhile.
    tokio::time::sleep(ms(500)).await;
    let third = send(addr, &key, ms(40_000)).await.expect("answered");
    assert!(
        !third.is_live(),
        "a third request ran while the new holder ran: {third:?}\n  {}",
        rig.log()
    );
    let waiter = waiter.await.expect("task");
    assert_eq!(
        (waiter.status, waiter.body.as_str()),
        (201, "effect 1 attempt 2"),
        "{}",
        rig.log()
    );
    let later = ask(addr, &key).await;
    assert!(
        later.is_replay_of(&waiter.body),
        "{later:?}\n  {}",
        rig.log()
    );
    assert_eq!(effects.count(), 1);
    assert!(
        rig.logged("release#", "-> fenced") >= 1,
        "the old give-back met the new holder and was fenced out\n  {}",
        rig.log()
    );
}

/// 96cd320, a storm of retries whose clients all hang up during a slow claim (every claim
/// answers 300 ms after it committed), with the first two give-backs failing: every claim won
/// is given back, the key is never stuck for the 60 s lease, and one calm request then runs
/// exactly once.
async fn retry_storm_of_hang_ups<S: IdempotencyStore>(store: S) {
    let rig = Rig::new(store);
    rig.always("claim", Act::After(ms(300)));
    rig.on("release", 1, Act::Fail);
    rig.on("release", 2, Act::Fail);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(60_000)),
        sleep_then_effect(&effects, ms(0), false),
    )
    .await;
    let key = unique("storm");
    for _ in 0..3 {
        let tasks: Vec<_> = (0..20)
            .map(|_| {
                let key = key.clone();
                tokio::spawn(async move { send(addr, &key, ms(100)).await })
            })
            .collect();
        for task in tasks {
            assert!(task.await.expect("task").is_none(), "every client hung up");
        }
        // Past the round's slow claims and their give-backs: the next round claims afresh.
        tokio::time::sleep(ms(400)).await;
    }
    assert_eq!(effects.count(), 0);
    assert!(
        rig.acquired() >= 2,
        "several claims were won and dropped\n  {}",
        rig.log()
    );
    assert!(
        eventually(async || record_of(&rig, &key)
            .await
            .is_some_and(|r| r.status == RecordStatus::Released))
        .await,
        "every dropped claim given back\n  {}",
        rig.log()
    );
    assert!(rig.count("release") >= rig.acquired() + 2, "{}", rig.log());
    rig.always("claim", Act::Pass);
    let mut answered = None;
    let until = Instant::now() + Duration::from_secs(15);
    while Instant::now() < until {
        let a = ask(addr, &key).await;
        if a.status == 201 {
            answered = Some(a);
            break;
        }
        assert_eq!(a.problem, "in-flight", "{a:?}");
        tokio::time::sleep(ms(50)).await;
    }
    let answered = answered.unwrap_or_else(|| {
        panic!(
            "the key stayed stuck in flight after the storm\n  {}",
            rig.log()
        )
    });
    assert!(answered.is_live(), "{answered:?}");
    assert!(ask(addr, &key).await.is_replay_of(&answered.body));
    assert_eq!(effects.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_giveback_retry_storm_of_hang_ups_leaves_the_key_free() {
    retry_storm_of_hang_ups(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_giveback_retry_storm_of_hang_ups_leaves_the_key_free_on_postgres() {
    let Some(store) = common::postgres("tower_idempotency_fwm_review").await else {
        return;
    };
    retry_storm_of_hang_ups(store).await;
}

/// 96cd320 with a late claim (answered after more than half its lease): its confirming renewal
/// fails, so the request answers 503 and gives the key back; that give-back fails once and is
/// tried again. The next request runs at once (attempt 2), exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_giveback_of_an_unconfirmed_late_claim_is_tried_again() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("claim", 1, Act::After(ms(400)));
    rig.on("renew", 1, Act::Fail);
    rig.on("release", 1, Act::Fail);
    let effects = Effects::default();
    let route = Route::plain(ms(600)).reconcile();
    let addr = server(&rig, route, sleep_then_effect(&effects, ms(0), false)).await;
    let key = unique("late-claim");
    let first = ask(addr, &key).await;
    assert_eq!(
        (first.status, first.problem.as_str()),
        (503, "store-unavailable")
    );
    assert!(
        eventually(async || record_of(&rig, &key)
            .await
            .is_some_and(|r| r.status == RecordStatus::Released))
        .await,
        "{}",
        rig.log()
    );
    // Past the first claim's lease: on this reconciling route a key not given back would now
    // be set aside.
    tokio::time::sleep(ms(700)).await;
    let retry = ask(addr, &key).await;
    assert_eq!(
        (retry.status, retry.body.as_str()),
        (201, "effect 1 attempt 2"),
        "{}",
        rig.log()
    );
    assert_eq!(effects.count(), 1);
}

/// 96cd320: a waiter woken by a release claims the key but its client hangs up during that
/// (slow) claim: the won claim is given back (its first give-back failing), and another waiter
/// runs it; never two runs, never a key stuck in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_giveback_of_a_woken_waiters_dropped_claim_lets_another_run() {
    let rig = Rig::new(MemoryStore::new());
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::waiting(ms(5_000)),
        fail_first(&effects, ms(500), StatusCode::SERVICE_UNAVAILABLE),
    )
    .await;
    let key = unique("woken-drop");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(100)).await;
    // The quitter waits, and gives up 800 ms in: 300 ms into its woken claim.
    let quitter = tokio::spawn({
        let key = key.clone();
        async move { send(addr, &key, ms(800)).await }
    });
    tokio::time::sleep(ms(100)).await;
    // Every claim from now on (the woken ones) answers 600 ms after it committed; the first
    // give-back fails.
    rig.always("claim", Act::After(ms(600)));
    rig.on("release", 2, Act::Fail);
    let patient = tokio::spawn({
        let key = key.clone();
        async move { ask(addr, &key).await }
    });
    let first = first.await.expect("task").expect("answered");
    assert_eq!(first.status, 503);
    let quitter = quitter.await.expect("task");
    let patient = patient.await.expect("task");
    match quitter {
        // The quitter's claim was given back: the patient one ran.
        None => assert_eq!(
            (patient.status, patient.replayed),
            (201, false),
            "{patient:?}\n  {}",
            rig.log()
        ),
        Some(q) => panic!("the quitter was meant to hang up: {q:?}"),
    }
    rig.always("claim", Act::Pass);
    assert!(ask(addr, &key).await.is_replay_of(&patient.body));
    assert_eq!(effects.count(), 1, "{}", rig.log());
}
