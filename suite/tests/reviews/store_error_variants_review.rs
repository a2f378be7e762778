use crate::common;

// Adversarial review: how the layer reacts to each `StoreError` variant (`Fenced`, `Full`,
// `Busy`, `Unavailable`), and to a store call that never answers, at each step of a request:
// `claim`, `renew` (the keeper's, and a late claim's confirmation), `complete`,
// `mark_uncertain`, `release` (after a run, in a give-back), `record_milestone`, `lookup` (the
// read of requests woken from a wait), `append_history`, and `wait_for_change` returning early.
//
// The goal of each test is a path where a store error makes the handler run twice for one key,
// loses a recorded outcome, strands a key (in flight for ever, or uncertain although the
// outcome was in hand), or panics. Effects are counted at the sink (inside the handler), never
// from responses; every test also checks what the clients were told. No wall-clock assertion:
// sleeps only let leases lapse or bound how long a condition may take to come true.

use std::time::Duration;

use axum::http::StatusCode;
use common::Effects;
use tower_idempotency::MemoryStore;
use tower_idempotency::store::RecordStatus;

use common::rig::*;

// ---- helpers -------------------------------------------------------------------------------

/// A waiting route whose waiters give up after `wait` (not the harness's 25 s), so a test that
/// fails does so quickly.
fn waiting(lease: Duration, wait: Duration) -> Route {
    Route {
        wait: Some(wait),
        ..Route::waiting(lease)
    }
}

/// Call 0 panics (having done nothing); later calls make the effect.
fn panic_first(effects: &Effects) -> Handler {
    let effects = effects.clone();
    handler(move |i, ctx| {
        let effects = effects.clone();
        async move {
            if i == 0 {
                panic!("injected handler panic");
            }
            let n = effects.hit();
            (
                StatusCode::CREATED,
                format!("effect {n} attempt {}", ctx.attempt()),
            )
        }
    })
}

/// Every answer is a replay of `body` or exactly `live` ones ran it (live 201s).
fn assert_one_run(what: &str, answers: &[Answer], body: &str, live: usize, log: &str) {
    let runs = answers.iter().filter(|a| a.is_live()).count();
    let replays = answers.iter().filter(|a| a.is_replay_of(body)).count();
    assert!(
        runs == live && runs + replays == answers.len(),
        "{what}: expected {live} live run(s), the rest replays of {body:?}; got {}\n  store log:\n  {log}",
        summary(answers)
    );
}

// ==== 1. claim =================================================================================

/// DESIGN §1 step 6 ("store unreachable / errors -> 503, nothing run (fail closed)") and §5
/// ("MemoryStore has a capacity (full -> 503)"): a claim refused `Full`, or `Fenced` (which a
/// claim never should answer), is answered 503 `store-unavailable` with nothing run; a claim
/// refused `Busy` (a row lock held by a transaction) is answered 409 in flight, nothing run.
/// The next request with the key runs it exactly once, and the one after replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_claim_refused_full_fenced_or_busy_runs_nothing_then_recovers() {
    for (act, status, problem) in [
        (Act::Full, 503, "store-unavailable"),
        (Act::Fenced, 503, "store-unavailable"),
        (Act::Busy, 409, "in-flight"),
    ] {
        let rig = Rig::new(MemoryStore::new());
        rig.on("claim", 1, act);
        let effects = Effects::default();
        let addr = server(
            &rig,
            Route::plain(ms(400)),
            sleep_then_effect(&effects, Duration::ZERO, false),
        )
        .await;
        let key = unique("claim-refused");
        let first = ask(addr, &key).await;
        assert_eq!(
            (first.status, first.problem.as_str()),
            (status, problem),
            "{act:?}: {first:?}\n  {}",
            rig.log()
        );
        assert_eq!(
            effects.count(),
            0,
            "{act:?}: nothing ran on a refused claim"
        );
        assert_eq!(status_of(&rig, &key).await, None, "{act:?}: nothing stored");
        let second = ask(addr, &key).await;
        assert!(second.is_live(), "{act:?}: {second:?}\n  {}", rig.log());
        let third = ask(addr, &key).await;
        assert!(third.is_replay_of(&second.body), "{act:?}: {third:?}");
        assert_eq!(effects.count(), 1, "{act:?}");
    }
}

/// DESIGN §1 step 6 (wait variant): on a route that waits for in-flight keys, a claim refused
/// `Busy` is "in flight, nothing seen": the request polls and claims again instead of failing.
/// Here the key was free all along: the request runs it (one effect), not 409, not twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_wait_a_claim_refused_busy_polls_then_runs_once() {
    let rig = Rig::new(MemoryStore::new());
    for n in 1..=3 {
        rig.on("claim", n, Act::Busy);
    }
    let effects = Effects::default();
    let addr = server(
        &rig,
        waiting(ms(400), ms(5_000)),
        sleep_then_effect(&effects, Duration::ZERO, false),
    )
    .await;
    let key = unique("wait-busy-claim");
    let first = ask(addr, &key).await;
    assert!(first.is_live(), "{first:?}\n  {}", rig.log());
    assert_eq!(first.body, "effect 1 attempt 1");
    assert_eq!(rig.count("claim"), 4, "{}", rig.log());
    assert!(ask(addr, &key).await.is_replay_of(&first.body));
    assert_eq!(effects.count(), 1);
}

/// DESIGN §1 step 6 and §7.3 (wait variant): while a holder runs, its waiters' claims are
/// refused `Busy` (several), `Full` (one) and `Fenced` (one). `Busy` waiters go on waiting;
/// `Full`/`Fenced` ones are told 503 with nothing run. Nobody runs the key a second time: every
/// other waiter replays the holder's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_wait_waiters_claims_refused_busy_full_fenced_never_run_twice() {
    let rig = Rig::new(MemoryStore::new());
    // Claim #1 is the holder's.
    for n in 2..=8 {
        rig.on("claim", n, Act::Busy);
    }
    rig.on("claim", 9, Act::Full);
    rig.on("claim", 10, Act::Fenced);
    let effects = Effects::default();
    let addr = server(
        &rig,
        waiting(ms(600), ms(5_000)),
        sleep_then_effect(&effects, ms(700), false),
    )
    .await;
    let key = unique("wait-busy-full-fenced");
    let holder = hang_up_later(addr, &key);
    tokio::time::sleep(ms(100)).await;
    let answers = waiters(addr, &key, 12).await.expect("waiters");
    let holder = holder.await.expect("task").expect("answered");
    assert!(holder.is_live(), "{holder:?}");
    let refused: Vec<Answer> = answers
        .iter()
        .filter(|a| a.status == 503)
        .cloned()
        .collect();
    assert!(
        refused.iter().all(|a| a.problem == "store-unavailable") && refused.len() == 2,
        "the Full and Fenced waiters are told 503: {}\n  {}",
        summary(&answers),
        rig.log()
    );
    let rest: Vec<Answer> = answers
        .iter()
        .filter(|a| a.status != 503)
        .cloned()
        .collect();
    assert_one_run("waiters", &rest, &holder.body, 0, &rig.log());
    assert_eq!(effects.count(), 1);
}

// ==== 2. renew =================================================================================

/// DESIGN §4 ("the holder keeps its lease for as long as its process lives"): the keeper's
/// renewals are refused `Busy`, then `Full`, then `Busy` again (each a refusal that changes
/// nothing), then pass. Each is retried a tick later, so the lease never lapses: a request sent
/// well past the first lease's end, while the holder still runs, is told 409 in flight and
/// never runs the key; afterwards it replays. One effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_renewals_refused_busy_and_full_keep_the_lease() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("renew", 1, Act::Busy);
    rig.on("renew", 2, Act::Full);
    rig.on("renew", 3, Act::Busy);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(900)),
        sleep_then_effect(&effects, ms(2_000), false),
    )
    .await;
    let key = unique("renew-busy-full");
    let holder = hang_up_later(addr, &key);
    // Past the first lease's end (900 ms), several renewals in.
    tokio::time::sleep(ms(1_300)).await;
    let probe = ask(addr, &key).await;
    assert!(
        probe.in_flight(),
        "a live holder whose renewals were refused Busy/Full lost its lease: {probe:?}\n  {}",
        rig.log()
    );
    let holder = holder.await.expect("task").expect("answered");
    assert!(holder.is_live(), "{holder:?}");
    let retry = ask(addr, &key).await;
    assert!(
        retry.is_replay_of(&holder.body),
        "{retry:?}\n  {}",
        rig.log()
    );
    assert_eq!(effects.count(), 1, "{}", rig.log());
}

/// DESIGN §4/§1 step 8: a renewal refused `Fenced` although nobody took the key over (a store
/// that says so wrongly, or a renewal answered for an earlier state). The keeper stops renewing,
/// as it must for a real takeover; the lease runs out while the handler still works. Nobody
/// claims meanwhile, so the holder's own fenced `complete` (its token still stands) lands: the
/// outcome is not lost, and the retry replays it. One effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_renewal_refused_fenced_still_records_when_nobody_took_over() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("renew", 1, Act::Fenced);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(300)),
        sleep_then_effect(&effects, ms(900), false),
    )
    .await;
    let key = unique("renew-fenced");
    let first = ask(addr, &key).await;
    assert!(first.is_live(), "{first:?}");
    assert_eq!(
        status_of(&rig, &key).await,
        Some(RecordStatus::Completed),
        "{}",
        rig.log()
    );
    let retry = ask(addr, &key).await;
    assert!(
        retry.is_replay_of(&first.body),
        "{retry:?}\n  {}",
        rig.log()
    );
    assert_eq!(effects.count(), 1);
}

/// DESIGN §1 step 5 (a claim that came back late is confirmed by a fenced renewal before
/// anything runs under it): the claim lands at once but its answer takes 60% of the lease; the
/// confirming renewal is refused `Busy` (then, in a second round, `Full`). Nothing runs, the
/// client is told 503, and the won claim is given back: on this route that reconciles expired
/// leases, the next request runs the key (attempt 2), never "outcome unknown".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_late_claims_confirmation_refused_busy_or_full_gives_the_key_back() {
    for act in [Act::Busy, Act::Full] {
        let rig = Rig::new(MemoryStore::new());
        rig.on("claim", 1, Act::After(ms(300)));
        rig.on("renew", 1, act);
        let effects = Effects::default();
        let addr = server(
            &rig,
            Route::plain(ms(500)).reconcile(),
            sleep_then_effect(&effects, Duration::ZERO, false),
        )
        .await;
        let key = unique("late-claim-confirm");
        let first = ask(addr, &key).await;
        assert_eq!(
            (first.status, first.problem.as_str()),
            (503, "store-unavailable"),
            "{act:?}: {first:?}\n  {}",
            rig.log()
        );
        assert_eq!(effects.count(), 0, "{act:?}");
        assert!(
            eventually(async || status_of(&rig, &key).await == Some(RecordStatus::Released)).await,
            "{act:?}: the unconfirmed claim is given back\n  {}",
            rig.log()
        );
        // Past the claim's lease: a lapse would now show as "outcome unknown".
        tokio::time::sleep(ms(600)).await;
        let retry = ask(addr, &key).await;
        assert!(
            retry.is_live() && retry.body == "effect 1 attempt 2",
            "{act:?}: {retry:?}\n  {}",
            rig.log()
        );
        assert_eq!(effects.count(), 1, "{act:?}");
    }
}

// ==== 3. complete and mark_uncertain ===========================================================

/// DESIGN §4 ("when recording the outcome fails, the holder keeps renewing and retrying the
/// write ... instead of letting the lease lapse"), for the variants the Busy fix did not name:
/// the first write refused `Full`; the first failing and its retry refused `Full`. The record
/// lands, and a retry several leases later replays the one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_record_refused_full_is_tried_again() {
    for plan in [vec![Act::Full], vec![Act::Fail, Act::Full, Act::Busy]] {
        let rig = Rig::new(MemoryStore::new());
        for (n, act) in plan.iter().enumerate() {
            rig.on("complete", n + 1, *act);
        }
        let effects = Effects::default();
        let addr = server(
            &rig,
            Route::plain(ms(300)),
            sleep_then_effect(&effects, Duration::ZERO, false),
        )
        .await;
        let key = unique("record-full");
        let first = ask(addr, &key).await;
        assert!(first.is_live(), "{plan:?}: {first:?}");
        assert!(
            eventually(async || status_of(&rig, &key).await == Some(RecordStatus::Completed)).await,
            "{plan:?}: the record lands\n  {}",
            rig.log()
        );
        tokio::time::sleep(ms(900)).await;
        let retry = ask(addr, &key).await;
        assert!(
            retry.is_replay_of(&first.body),
            "{plan:?}: {retry:?}\n  {}",
            rig.log()
        );
        assert_eq!(effects.count(), 1, "{plan:?}");
    }
}

/// DESIGN §4: the first write of the outcome is refused `Busy` and so is the holder's
/// `mark_uncertain` (the record stays in progress, so only the renewed lease keeps a retry from
/// taking it over), and the first retried write too. Over several leases, a retry is told 409,
/// never runs the key, and ends up replaying the one effect once the write lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_record_and_mark_uncertain_both_refused_busy_the_lease_is_held() {
    for mark in [Act::Busy, Act::Full, Act::Fenced] {
        let rig = Rig::new(MemoryStore::new());
        rig.on("complete", 1, Act::Busy);
        rig.on("complete", 2, Act::Busy);
        rig.on("complete", 3, Act::Busy);
        rig.on("complete", 4, Act::Busy);
        rig.on("mark_uncertain", 1, mark);
        let effects = Effects::default();
        let addr = server(
            &rig,
            Route::plain(ms(300)),
            sleep_then_effect(&effects, Duration::ZERO, false),
        )
        .await;
        let key = unique("record-mark-busy");
        let first = ask(addr, &key).await;
        assert!(first.is_live(), "{mark:?}: {first:?}");
        let retry = ask_past_in_flight(addr, &key, Duration::from_secs(5)).await;
        assert!(
            retry.is_replay_of(&first.body),
            "{mark:?}: {retry:?}\n  {}",
            rig.log()
        );
        assert_eq!(effects.count(), 1, "{mark:?}: {}", rig.log());
        assert_eq!(
            status_of(&rig, &key).await,
            Some(RecordStatus::Completed),
            "{mark:?}"
        );
    }
}

/// DESIGN §7.3 and §4 on a waiting route: the holder's first two writes of the outcome are
/// refused `Busy`, and so is its `mark_uncertain`, so the record stays in progress under the
/// renewed lease while 12 requests wait on it. None of them runs the key: all replay the
/// holder's answer once its write lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_wait_waiters_of_a_record_refused_busy_replay_never_run() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("complete", 1, Act::Busy);
    rig.on("complete", 2, Act::Busy);
    rig.on("mark_uncertain", 1, Act::Busy);
    let effects = Effects::default();
    let addr = server(
        &rig,
        waiting(ms(300), ms(5_000)),
        sleep_then_effect(&effects, ms(400), false),
    )
    .await;
    let key = unique("wait-record-busy");
    let holder = hang_up_later(addr, &key);
    tokio::time::sleep(ms(100)).await;
    let answers = waiters(addr, &key, 12).await.expect("waiters");
    let holder = holder.await.expect("task").expect("answered");
    assert!(holder.is_live(), "{holder:?}");
    assert_one_run("waiters", &answers, &holder.body, 0, &rig.log());
    assert_eq!(effects.count(), 1);
}

// ==== 4. release (after a run) =================================================================

/// DESIGN §3 ("unresolved technical failures ... release the claim so a later retry
/// re-attempts") and §4 (a failed write is retried, the lease kept, "instead of letting the
/// lease lapse"): the handler answers 503 having done nothing, or panics, and the release is
/// refused `Busy`, then `Full`. The retried release lands: on this route that reconciles expired
/// leases, a retry runs the key (attempt 2) instead of being told "outcome unknown".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_a_release_refused_busy_then_full_is_tried_until_it_lands() {
    for panics in [false, true] {
        let rig = Rig::new(MemoryStore::new());
        rig.on("release", 1, Act::Busy);
        rig.on("release", 2, Act::Full);
        rig.on("release", 3, Act::Busy);
        let effects = Effects::default();
        let handler = match panics {
            true => panic_first(&effects),
            false => fail_first(&effects, Duration::ZERO, StatusCode::SERVICE_UNAVAILABLE),
        };
        let addr = server(&rig, Route::plain(ms(400)).reconcile(), handler).await;
        let key = unique("release-busy-full");
        let first = ask(addr, &key).await;
        assert!(
            matches!(first.status, 500 | 503),
            "panics {panics}: {first:?}"
        );
        assert!(
            eventually(async || status_of(&rig, &key).await == Some(RecordStatus::Released)).await,
            "panics {panics}: the key is given back\n  {}",
            rig.log()
        );
        tokio::time::sleep(ms(600)).await;
        let retry = ask(addr, &key).await;
        assert!(
            retry.is_live() && retry.body == "effect 1 attempt 2",
            "panics {panics}: {retry:?}\n  {}",
            rig.log()
        );
        assert_eq!(effects.count(), 1, "panics {panics}");
    }
}

/// DESIGN §4 ("the holder keeps its lease ... when recording the outcome fails, the holder
/// keeps renewing and retrying the write") and the brief's "uncertain when the answer was in
/// hand": the handler answers 503 having done nothing (its outcome says: a retry may run it),
/// but for a while the store refuses every write of this holder `Busy` (its release and its
/// renewals), while claims still pass. On this route that reconciles expired leases, a retry
/// that comes after the lease lapsed sets the key aside (the claim cannot know better). Once the
/// store lets go, the holder, which still holds the token and knows nothing ran, settles the
/// key as given back: a later retry runs it (attempt 2). Found by this review: the give-back
/// stopped at the first `Fenced` and left the key "outcome unknown" for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_release_fenced_by_a_set_aside_gives_the_key_back() {
    let rig = Rig::new(MemoryStore::new());
    rig.always("release", Act::Busy);
    rig.always("renew", Act::Busy);
    let effects = Effects::default();
    let addr = first_503(&rig, Route::plain(ms(300)).reconcile(), &effects).await;
    let key = unique("release-busy-lapse");
    let first = ask(addr, &key).await;
    assert_eq!(first.status, 503, "{first:?}");
    // Past the lease: the next claim finds it expired.
    tokio::time::sleep(ms(500)).await;
    let during = ask(addr, &key).await;
    rig.always("release", Act::Pass);
    rig.always("renew", Act::Pass);
    // The give-back's next tries (backoff up to 1 s) now reach the store.
    tokio::time::sleep(ms(2_500)).await;
    let later = ask(addr, &key).await;
    let record = record_of(&rig, &key).await;
    assert!(
        later.is_live() && effects.count() == 1,
        "the handler's outcome (503, nothing done: retry may run it) was in hand, yet the key \
         stays set aside: during the outage {during:?}; afterwards {later:?}; record {:?}\n  {}",
        record.map(|r| (r.status, r.lease_token, r.effect_started)),
        rig.log()
    );
}

/// The counterpart of the test above for a *recorded* outcome, which passes: the first write
/// of the outcome, `mark_uncertain` and every renewal are refused `Busy` for longer than the
/// lease; a retry meanwhile sets the key aside (reconciling route). When the store lets go, the
/// recorder's write lands all the same (a holder may `complete` a record that carries its token
/// and awaits reconciliation), and the retry replays. One effect. `release` has no such path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_record_refused_busy_past_the_lease_still_settles_the_key() {
    let rig = Rig::new(MemoryStore::new());
    rig.always("complete", Act::Busy);
    rig.always("mark_uncertain", Act::Busy);
    rig.always("renew", Act::Busy);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(300)).reconcile(),
        sleep_then_effect(&effects, Duration::ZERO, false),
    )
    .await;
    let key = unique("record-busy-lapse");
    let first = ask(addr, &key).await;
    assert!(first.is_live(), "{first:?}");
    tokio::time::sleep(ms(500)).await;
    let during = ask(addr, &key).await;
    rig.always("complete", Act::Pass);
    rig.always("mark_uncertain", Act::Pass);
    rig.always("renew", Act::Pass);
    assert!(
        eventually(async || status_of(&rig, &key).await == Some(RecordStatus::Completed)).await,
        "the recorder's write lands on the set-aside record\n  {}",
        rig.log()
    );
    let later = ask(addr, &key).await;
    assert!(
        later.is_replay_of(&first.body),
        "during {during:?}; later {later:?}\n  {}",
        rig.log()
    );
    assert_eq!(effects.count(), 1);
}

/// The same stranding without any failed write: a claim lands at once but its answer comes
/// back after the lease (a slow round trip); meanwhile another request finds the lease expired
/// and, on this reconciling route, sets the key aside. The late claimant's confirming renewal is
/// then (rightly) refused `Fenced`. But nothing ever ran under its token, and it is the token
/// the record still carries: the claimant settles the key as not applied, claims again and
/// runs it, once. Found by this review: the key stayed "outcome unknown" for ever (until a
/// reconciler or an operator resolved it), for a request that provably ran nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_late_claim_fenced_by_a_set_aside_gives_it_back_and_runs() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("claim", 1, Act::After(ms(700)));
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(400)).reconcile(),
        sleep_then_effect(&effects, Duration::ZERO, false),
    )
    .await;
    let key = unique("late-claim-set-aside");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(500)).await;
    let during = ask(addr, &key).await;
    let first = first.await.expect("task").expect("answered");
    // The late claimant gives the key it never ran back, claims again, and runs (attempt 2).
    assert!(
        during.problem == "outcome-unknown"
            && first.is_live()
            && first.body == "effect 1 attempt 2",
        "first {first:?}; during {during:?}\n  {}",
        rig.log()
    );
    let later = ask(addr, &key).await;
    let record = record_of(&rig, &key).await;
    assert!(
        later.is_replay_of(&first.body) && effects.count() == 1,
        "later {later:?}; record {:?}\n  {}",
        record.map(|r| (r.status, r.attempts, r.effect_started)),
        rig.log()
    );
}

// ==== 5. record_milestone ======================================================================

/// DESIGN §4 (`effect_started` "if it fails ... do not start the effect"): the milestone write is
/// refused `Busy`, `Full` or `Fenced` (nothing written); the handler declines (503). The store
/// holds no milestone, so the release gives the key back: a retry runs it (attempt 2), one
/// effect, then replays. Never "outcome unknown", never two effects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_milestone_refused_busy_full_or_fenced_gives_the_key_back() {
    for act in [Act::Busy, Act::Full, Act::Fenced] {
        let rig = Rig::new(MemoryStore::new());
        rig.on("record_milestone", 1, act);
        let effects = Effects::default();
        let addr = server(
            &rig,
            Route::plain(ms(400)).reconcile(),
            sleep_then_effect(&effects, Duration::ZERO, true),
        )
        .await;
        let key = unique("milestone-refused");
        let first = ask(addr, &key).await;
        assert_eq!(first.status, 503, "{act:?}: {first:?}");
        assert_eq!(effects.count(), 0, "{act:?}");
        let retry = ask(addr, &key).await;
        assert!(
            retry.is_live() && retry.body == "effect 1 attempt 2",
            "{act:?}: {retry:?}\n  {}",
            rig.log()
        );
        assert!(ask(addr, &key).await.is_replay_of(&retry.body), "{act:?}");
        assert_eq!(effects.count(), 1, "{act:?}");
    }
}

// ==== 6. lookup, append_history, wait_for_change ===============================================

/// DESIGN §1 step 6 (wait variant): every read of a woken waiter is refused (`Busy`, `Full` or
/// `Fenced` in turn); the waiters fall back to claims. Nobody runs the key twice: all replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_wait_woken_reads_refused_busy_full_fenced_fall_back_to_claims() {
    for act in [Act::Busy, Act::Full, Act::Fenced] {
        let rig = Rig::new(MemoryStore::new());
        rig.always("lookup", act);
        let effects = Effects::default();
        let addr = server(
            &rig,
            waiting(ms(600), ms(5_000)),
            sleep_then_effect(&effects, ms(500), false),
        )
        .await;
        let key = unique("woken-read-refused");
        let holder = hang_up_later(addr, &key);
        tokio::time::sleep(ms(100)).await;
        let answers = waiters(addr, &key, 8).await.expect("waiters");
        let holder = holder.await.expect("task").expect("answered");
        assert!(holder.is_live(), "{act:?}: {holder:?}");
        assert_one_run(&format!("{act:?}"), &answers, &holder.body, 0, &rig.log());
        assert_eq!(effects.count(), 1, "{act:?}");
    }
}

/// DESIGN §6 (the key's history records what requests saw) and §1 step 6: on a route that
/// records refusals, the history note is refused `Busy`, `Full`, `Fenced` or fails: the answer
/// (a replay) still stands, and nothing runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_a_history_note_refused_never_changes_the_answer() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("append_history", 1, Act::Busy);
    rig.on("append_history", 2, Act::Full);
    rig.on("append_history", 3, Act::Fenced);
    rig.on("append_history", 4, Act::Fail);
    let effects = Effects::default();
    let l = layer(&rig, Route::plain(ms(400))).record_refusals(true);
    let addr = common::serve(app(l, sleep_then_effect(&effects, Duration::ZERO, false))).await;
    let key = unique("history-refused");
    let first = ask(addr, &key).await;
    assert!(first.is_live(), "{first:?}");
    for n in 0..5 {
        let retry = ask(addr, &key).await;
        assert!(
            retry.is_replay_of(&first.body),
            "retry {n}: {retry:?}\n  {}",
            rig.log()
        );
    }
    assert!(rig.count("append_history") >= 5, "{}", rig.log());
    assert_eq!(effects.count(), 1);
}

/// DESIGN §1 step 6 (wait variant) and the store contract ("returning early is always
/// allowed"): every `wait_for_change` returns at once, and the waiters' claims are refused
/// `Busy` every other time. The waiters spin on polls, never on a storm, and never run the key:
/// all replay the holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_wait_early_wakes_with_busy_claims_never_run_twice() {
    let rig = Rig::new(MemoryStore::new());
    rig.early_waits
        .store(10_000, std::sync::atomic::Ordering::SeqCst);
    for n in (2..200).step_by(2) {
        rig.on("claim", n, Act::Busy);
    }
    let effects = Effects::default();
    let addr = server(
        &rig,
        waiting(ms(500), ms(5_000)),
        sleep_then_effect(&effects, ms(700), false),
    )
    .await;
    let key = unique("early-busy");
    let holder = hang_up_later(addr, &key);
    tokio::time::sleep(ms(100)).await;
    let answers = waiters(addr, &key, 8).await.expect("waiters");
    let holder = holder.await.expect("task").expect("answered");
    assert!(holder.is_live(), "{holder:?}");
    assert_one_run("waiters", &answers, &holder.body, 0, &rig.log());
    assert_eq!(effects.count(), 1);
}

// ==== 7. give-back of a cancelled run ==========================================================

/// DESIGN §1 (`cancel_on_disconnect`: a hang-up cancels the run and gives the key back): the
/// client hangs up before the effect; the give-back is refused `Busy`, then `Full`, then
/// `Busy`. It is tried again within the lease and lands: on this route that reconciles expired
/// leases, the retry runs the key (attempt 2), never "outcome unknown". One effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_a_cancelled_runs_give_back_refused_busy_full_lands() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("release", 1, Act::Busy);
    rig.on("release", 2, Act::Full);
    rig.on("release", 3, Act::Busy);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(1_500)).reconcile().cancelling(),
        sleep_then_effect(&effects, ms(20_000), false),
    )
    .await;
    let key = unique("cancel-give-back-busy");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(200)).await;
    first.abort();
    assert!(
        eventually(async || status_of(&rig, &key).await == Some(RecordStatus::Released)).await,
        "the cancelled run's key is given back\n  {}",
        rig.log()
    );
    let retry = ask(addr, &key).await;
    assert!(
        retry.is_live() && retry.body == "effect 1 attempt 2",
        "{retry:?}\n  {}",
        rig.log()
    );
    assert_eq!(effects.count(), 1);
}

// ==== 8. a store call that never answers, on the first try =====================================

/// DESIGN §4 and the layer's own rule for retried writes ("a call stuck on a connection must
/// not hold the lease, renewed, for ever", `execute::one_try`): the *first* write of the
/// outcome never answers (a stuck connection in a third-party store without timeouts), or it
/// fails and the holder's `mark_uncertain` never answers. Each retried write was bounded, these
/// were not, and the key stayed in flight for ever, the recorder never started (found by this
/// review). Now each is given up after half a lease: the client is answered, the record lands
/// on the recorder's next try, and the retry replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_first_record_or_mark_uncertain_that_hangs_is_given_up() {
    let plans: [&[(&str, Act)]; 2] = [
        &[("complete", Act::Hang)],
        &[("complete", Act::Fail), ("mark_uncertain", Act::Hang)],
    ];
    for plan in plans {
        let rig = Rig::new(MemoryStore::new());
        for (kind, act) in plan {
            rig.on(kind, 1, *act);
        }
        let effects = Effects::default();
        let addr = server(
            &rig,
            Route::plain(ms(300)),
            sleep_then_effect(&effects, Duration::ZERO, false),
        )
        .await;
        let key = unique("first-write-hangs");
        let first = ask(addr, &key).await;
        assert!(first.is_live(), "{plan:?}: {first:?}\n  {}", rig.log());
        // Meanwhile a retry is told "in flight", or "outcome unknown" where the key was marked
        // uncertain, until the recorder's next write lands.
        assert!(
            eventually(async || status_of(&rig, &key).await == Some(RecordStatus::Completed)).await,
            "{plan:?}: the recorder's write lands ({} renewals so far)\n  {}",
            rig.count("renew"),
            rig.log()
        );
        let retry = ask(addr, &key).await;
        assert!(
            retry.is_replay_of(&first.body),
            "{plan:?}: {retry:?}\n  {}",
            rig.log()
        );
        assert_eq!(effects.count(), 1, "{plan:?}");
    }
}

/// The same for the first release after a 503 (nothing done): it never answers. Unbounded, the
/// retry of `release_later` never started and the key stayed in flight for ever; now a retry
/// runs it (attempt 2). (A hung retried release is covered elsewhere.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_a_first_release_that_hangs_is_given_up_and_tried_again() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("release", 1, Act::Hang);
    let effects = Effects::default();
    let addr = first_503(&rig, Route::plain(ms(300)), &effects).await;
    let key = unique("first-release-hangs");
    let first = ask(addr, &key).await;
    assert_eq!(first.status, 503, "{first:?}\n  {}", rig.log());
    let retry = ask_past_in_flight(addr, &key, Duration::from_secs(4)).await;
    assert!(
        retry.is_live() && retry.body == "effect 1 attempt 2",
        "a hung first release keeps the key in flight: {retry:?}\n  {}",
        rig.log()
    );
    assert_eq!(effects.count(), 1);
}
