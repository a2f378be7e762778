use crate::common;

// Adversarial review of e9b1728: a give-back of a key nothing runs under any more (a claim its
// request dropped or could not confirm, a run cancelled by a hang-up on a `cancel_on_disconnect`
// route) no longer stops when the lease ends; it tries until the release lands or is fenced,
// and a fenced release whose key was set aside under its token with no effect started is
// resolved "not applied" (`execute/give_back.rs`).
//
// Each test tries to make the continued give-back release (or resolve "not applied") a key
// under which something ran, or that another holder (a takeover, an operator, a new claim after
// the TTL) now owns, counting effects at the sink; or checks that the give-back ends. No
// wall-clock assertion: sleeps only let leases lapse or bound how long a condition may take.
// Found on e9b1728 and fixed: past its lease a give-back whose releases failed or hung never
// read the record, so it outlived a key taken over and completed (and `detached::finished()`
// hung); and a key found in flight under its token after its lease (a store that fenced a
// release by mistake) was left to be set aside for ever on a `Reconcile` route.
// The liveness tests that look at `tower_idempotency::detached` run in a child process of
// their own (`common::run_child`), since the count of detached work is per process.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::http::StatusCode;
use common::Effects;
use common::rig::*;
use tokio::time::Instant;
use tower_idempotency::reconcile::{Reconciliation, resolve_by_hand};
use tower_idempotency::store::{RecordStatus, ScopedKey};
use tower_idempotency::{IdempotencyStore, MemoryStore, detached};

// ---- helpers -------------------------------------------------------------------------------

/// A handler that waits for `go` (up to 30 s), then makes its effect and answers 201.
fn gated(effects: &Effects, go: &Arc<AtomicBool>) -> Handler {
    let (effects, go) = (effects.clone(), go.clone());
    handler(move |_, ctx| {
        let (effects, go) = (effects.clone(), go.clone());
        async move {
            let until = Instant::now() + Duration::from_secs(30);
            while !go.load(Ordering::SeqCst) && Instant::now() < until {
                tokio::time::sleep(ms(10)).await;
            }
            let n = effects.hit();
            (
                StatusCode::CREATED,
                format!("effect {n} attempt {}", ctx.attempt()),
            )
        }
    })
}

/// Whether the rig has seen a release try after a window of injected failures (a try the rig
/// passed to the store, whatever it answered).
fn release_passed<S: IdempotencyStore>(rig: &Rig<S>) -> bool {
    rig.logged("release#", "Pass ->") >= 1
}

fn scoped(key: &str) -> ScopedKey {
    ScopedKey::new("", key)
}

// ==== 1. a cancelled run whose effect started ====================================================

/// DESIGN §4 (`effect_started`: from then on a failure of this attempt leaves the key
/// `needs_reconciliation`, never a second run) on a `cancel_on_disconnect` + `Reconcile` route:
/// the run marks its effect started, makes it, then is cancelled by a hang-up. Every release
/// fails for 3 s, well past the 400 ms lease, so the cancelled run's give-back goes on past the
/// lease while retries set the key aside. Once releases land again the give-back must not
/// resolve the key "not applied": it stays outcome-unknown and the effect is made once.
async fn cancelled_after_milestone<S: IdempotencyStore>(store: S, name: &str) {
    let rig = Rig::new(store);
    let effects = Effects::default();
    let h = {
        let effects = effects.clone();
        handler(move |i, ctx| {
            let effects = effects.clone();
            async move {
                if ctx.effect_started().await.is_err() {
                    return (StatusCode::SERVICE_UNAVAILABLE, "no milestone".into());
                }
                let n = effects.hit();
                if i == 0 {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                }
                (StatusCode::CREATED, format!("effect {n}"))
            }
        })
    };
    let addr = server(&rig, Route::plain(ms(400)).reconcile().cancelling(), h).await;
    let key = unique(&format!("gbla-cancel-milestone-{name}"));
    rig.fail_for("release", ms(3_000));
    assert!(
        send(addr, &key, ms(300)).await.is_none(),
        "the client hung up while the handler ran"
    );
    assert_eq!(effects.count(), 1, "the first run made its effect");
    tokio::time::sleep(ms(900)).await;
    let mut seen = Vec::new();
    for _ in 0..20 {
        let a = ask(addr, &key).await;
        assert!(
            !a.is_live(),
            "{name}: a retry ran a key whose effect started: {a:?}\n  {}",
            rig.log()
        );
        seen.push(a);
        tokio::time::sleep(ms(200)).await;
    }
    // Once releases are taken the stale give-back either tries again or has stopped (past
    // its lease a failed try reads the record, and a key set aside with its effect started,
    // resolved, or another holder's is not its to give): given the time, nothing of another
    // holder's may change.
    let _ = common::rig::within(ms(3_000), async || release_passed(&rig)).await;
    tokio::time::sleep(ms(500)).await;
    for _ in 0..3 {
        let a = ask(addr, &key).await;
        assert!(
            !a.is_live() && a.status == 409 && a.problem == "outcome-unknown",
            "{name}: after the give-back: {a:?}\n  {}",
            rig.log()
        );
        seen.push(a);
    }
    let record = record_of(&rig, &key).await.expect("the record");
    assert_eq!(
        record.status,
        RecordStatus::NeedsReconciliation,
        "{name}: {}",
        rig.log()
    );
    assert!(record.effect_started, "{name}: the milestone stays");
    assert_eq!(effects.count(), 1, "{name}: {}", summary(&seen));
}

common::on_every_store!(cancelled_after_milestone);

// ==== 2. a takeover on a Reclaim route =========================================================

/// DESIGN §1.8 (fenced by the lease token: a worker whose lease was taken over can no longer
/// write) and §7.3 (one effect per key): on a `cancel_on_disconnect` + `Reclaim` route the
/// first run is cancelled by a hang-up, its give-back fails for 2 s, a retry takes the key over
/// after the lease and runs. While the new holder runs, the stale give-back tries again (its
/// releases are taken now): it must not release the new holder's claim, so a third request is
/// told in flight, never run, and the key runs once.
async fn takeover_not_released<S: IdempotencyStore>(store: S, name: &str) {
    let rig = Rig::new(store);
    let effects = Effects::default();
    let go = Arc::new(AtomicBool::new(false));
    let first_done = Arc::new(AtomicBool::new(false));
    let h = {
        let (effects, go, first_done) = (effects.clone(), go.clone(), first_done.clone());
        handler(move |i, ctx| {
            let (effects, go, first_done) = (effects.clone(), go.clone(), first_done.clone());
            async move {
                if i == 0 {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    first_done.store(true, Ordering::SeqCst);
                    return (StatusCode::INTERNAL_SERVER_ERROR, "never".into());
                }
                let until = Instant::now() + Duration::from_secs(30);
                while !go.load(Ordering::SeqCst) && Instant::now() < until {
                    tokio::time::sleep(ms(10)).await;
                }
                let n = effects.hit();
                (
                    StatusCode::CREATED,
                    format!("effect {n} attempt {}", ctx.attempt()),
                )
            }
        })
    };
    let addr = server(&rig, Route::plain(ms(400)).cancelling(), h).await;
    let key = unique(&format!("gbla-takeover-{name}"));
    rig.fail_for("release", ms(2_000));
    assert!(
        send(addr, &key, ms(300)).await.is_none(),
        "the client hung up while the handler ran"
    );
    tokio::time::sleep(ms(900)).await;
    let second = {
        let key = key.clone();
        tokio::spawn(async move { ask(addr, &key).await })
    };
    assert!(
        eventually(async || rig.acquired() >= 2).await,
        "{name}: the retry took the key over\n  {}",
        rig.log()
    );
    // Once releases are taken the stale give-back either tries again or has stopped (past
    // its lease a failed try reads the record, and a key set aside with its effect started,
    // resolved, or another holder's is not its to give): given the time, nothing of another
    // holder's may change.
    let _ = common::rig::within(ms(3_000), async || release_passed(&rig)).await;
    tokio::time::sleep(ms(300)).await;
    let probe = ask(addr, &key).await;
    assert!(
        probe.in_flight(),
        "{name}: the new holder's run must still hold the key: {probe:?}\n  {}",
        rig.log()
    );
    let record = record_of(&rig, &key).await.expect("the record");
    assert_eq!(record.status, RecordStatus::InProgress, "{name}");
    assert_eq!(record.lease_token.get(), token_of(&rig, 1), "{name}");
    go.store(true, Ordering::SeqCst);
    let second = second.await.expect("the retry's task");
    assert!(
        second.is_live() && second.body == "effect 1 attempt 2",
        "{name}: {second:?}\n  {}",
        rig.log()
    );
    let replay = ask(addr, &key).await;
    assert!(replay.is_replay_of(&second.body), "{name}: {replay:?}");
    assert!(
        !first_done.load(Ordering::SeqCst),
        "the first run was cancelled"
    );
    assert_eq!(effects.count(), 1, "{name}: {}", rig.log());
}

common::on_every_store!(takeover_not_released);

// ==== 3. an operator's resolution lands first ==================================================

/// DESIGN §4 (a resolved outcome is final: resolving bumps the fencing token): a claim is
/// dropped by its request (the client hangs up while its answer is slow), its give-back fails
/// for 4 s, a retry after the lease sets the key aside on this `Reconcile` route, and an
/// operator resolves it by hand as applied. The stale give-back, trying on past the lease,
/// must not undo that: retries get the operator's answer and nothing runs.
async fn operator_first<S: IdempotencyStore>(store: S, name: &str) {
    let rig = Rig::new(store);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(400)).reconcile(),
        sleep_then_effect(&effects, Duration::ZERO, false),
    )
    .await;
    let key = unique(&format!("gbla-operator-{name}"));
    rig.on("claim", 1, Act::After(ms(600)));
    rig.fail_for("release", ms(4_000));
    assert!(
        send(addr, &key, ms(200)).await.is_none(),
        "the client hung up during the claim"
    );
    tokio::time::sleep(ms(1_300)).await;
    let aside = ask(addr, &key).await;
    assert!(
        aside.status == 409 && !aside.is_live(),
        "{name}: {aside:?}\n  {}",
        rig.log()
    );
    assert_eq!(
        status_of(&rig, &key).await,
        Some(RecordStatus::NeedsReconciliation),
        "{name}: set aside by the retry\n  {}",
        rig.log()
    );
    resolve_by_hand(
        &*rig.inner,
        &scoped(&key),
        Reconciliation::Applied(Box::new(created("by hand"))),
        Duration::from_secs(600),
        "checked downstream: it happened",
    )
    .await
    .expect("the operator's resolution");
    // Once releases are taken the stale give-back either tries again or has stopped (past
    // its lease a failed try reads the record, and a key set aside with its effect started,
    // resolved, or another holder's is not its to give): given the time, nothing of another
    // holder's may change.
    let _ = common::rig::within(ms(3_000), async || release_passed(&rig)).await;
    tokio::time::sleep(ms(500)).await;
    let after = ask(addr, &key).await;
    assert!(
        after.is_replay_of("by hand"),
        "{name}: the operator's answer must stand: {after:?}\n  {}",
        rig.log()
    );
    assert_eq!(
        status_of(&rig, &key).await,
        Some(RecordStatus::Completed),
        "{name}"
    );
    assert_eq!(effects.count(), 0, "{name}: {}", rig.log());
}

common::on_every_store!(operator_first);

// ==== 4. the record expires at its TTL and a new request claims the key ========================

/// DESIGN §1.6 (completed but expired: treated as absent) and §7.3: on a `Reclaim` route with a
/// 500 ms TTL a claim is dropped by its request and its give-back fails for 3 s; past the lease
/// and the TTL a new request (another body) claims the key afresh and runs. While it runs, the
/// stale give-back tries again: it must not release the new claim, so a duplicate of the new
/// request is told in flight, and the new request runs once.
async fn purged_and_claimed_anew<S: IdempotencyStore>(store: S, name: &str) {
    let rig = Rig::new(store);
    let effects = Effects::default();
    let go = Arc::new(AtomicBool::new(false));
    let l = layer(&rig, Route::plain(ms(300))).ttl(ms(500));
    let addr = common::serve(app(l, gated(&effects, &go))).await;
    let key = unique(&format!("gbla-ttl-{name}"));
    rig.on("claim", 1, Act::After(ms(500)));
    rig.fail_for("release", ms(3_000));
    assert!(
        send_body(addr, &key, r#"{"amount":10}"#, ms(150))
            .await
            .is_none(),
        "the client hung up during the claim"
    );
    tokio::time::sleep(ms(1_300)).await;
    let new_body = r#"{"amount":20}"#;
    let second = {
        let key = key.clone();
        tokio::spawn(async move {
            send_body(addr, &key, new_body, Duration::from_secs(40))
                .await
                .expect("an answer")
        })
    };
    assert!(
        eventually(async || rig.acquired() >= 2).await,
        "{name}: the new request claimed the expired key\n  {}",
        rig.log()
    );
    // Once releases are taken the stale give-back either tries again or has stopped (past
    // its lease a failed try reads the record, and a key set aside with its effect started,
    // resolved, or another holder's is not its to give): given the time, nothing of another
    // holder's may change.
    let _ = common::rig::within(ms(3_000), async || release_passed(&rig)).await;
    tokio::time::sleep(ms(300)).await;
    let probe = send_body(addr, &key, new_body, Duration::from_secs(40))
        .await
        .expect("an answer");
    assert!(
        probe.in_flight(),
        "{name}: the new claim must still hold the key: {probe:?}\n  {}",
        rig.log()
    );
    go.store(true, Ordering::SeqCst);
    let second = second.await.expect("the task");
    assert!(
        second.is_live() && second.body == "effect 1 attempt 1",
        "{name}: {second:?}\n  {}",
        rig.log()
    );
    let replay = send_body(addr, &key, new_body, Duration::from_secs(40))
        .await
        .expect("an answer");
    assert!(replay.is_replay_of(&second.body), "{name}: {replay:?}");
    assert_eq!(effects.count(), 1, "{name}: {}", rig.log());
}

common::on_every_store!(purged_and_claimed_anew);

// ==== 5. liveness ===============================================================================

/// A request whose claim lands but whose answer waits 500 ms, dropped by a client that gives
/// up after 150 ms: its claim is finished, and given back, on a task of its own.
async fn drop_a_claim<S: IdempotencyStore>(
    rig: &Arc<Rig<S>>,
    addr: std::net::SocketAddr,
    key: &str,
) {
    rig.on("claim", 1, Act::After(ms(500)));
    assert!(
        send(addr, key, ms(150)).await.is_none(),
        "the client hung up during the claim"
    );
}

/// README (graceful shutdown: `detached::finished()` waits for detached work): the store goes
/// down for 2 s (five leases) just after a dropped claim landed. The give-back now goes on past
/// the lease; once the store is back it must land, `finished()` must return, and the key must
/// run once on this `Reconcile` route. Prints how much detached work was running past the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s_liveness_finished_returns_once_the_store_recovers() {
    const VAR: &str = "GBLA_CHILD_RECOVERS";
    if std::env::var(VAR).is_err() {
        common::run_child(
            module_path!(),
            "s_liveness_finished_returns_once_the_store_recovers",
            VAR,
        );
        return;
    }
    let rig = Rig::new(MemoryStore::new());
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(400)).reconcile(),
        sleep_then_effect(&effects, Duration::ZERO, false),
    )
    .await;
    let key = unique("gbla-recovers");
    drop_a_claim(&rig, addr, &key).await;
    *rig.down_until.lock().unwrap() = Some(Instant::now() + ms(2_000));
    tokio::time::sleep(ms(1_600)).await;
    println!(
        "detached work running past the lease while the store is down: {}",
        detached::running()
    );
    common::guard(
        "detached::finished() once the store is back",
        detached::finished(),
    )
    .await;
    println!(
        "finished() returned; releases tried: {}",
        rig.count("release")
    );
    let mut seen = Vec::new();
    let mut ran = None;
    for _ in 0..40 {
        let a = ask(addr, &key).await;
        if a.is_live() {
            ran = Some(a);
            break;
        }
        seen.push(a);
        tokio::time::sleep(ms(200)).await;
    }
    let ran = ran.unwrap_or_else(|| panic!("never ran: {}\n  {}", summary(&seen), rig.log()));
    assert!(ran.body.starts_with("effect 1"), "{ran:?}\n  {}", rig.log());
    assert_eq!(effects.count(), 1);
    println!("TEARDOWN-CHILD-OK");
}

/// The give-back's own promise ("until it lands or the key is no longer this holder's"): on a
/// `Reclaim` route a dropped claim's give-back meets a store whose releases hang (each try is
/// bounded and fails); after the lease a retry takes the key over and completes it. The key is
/// no longer the holder's, so its give-back must end; it used to end with its lease. Counts the
/// releases tried over 5 s, 3 s after the key was completed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s_liveness_give_back_of_a_key_taken_over_ends_while_releases_hang() {
    let rig = Rig::new(MemoryStore::new());
    rig.always("release", Act::Hang);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(300)),
        sleep_then_effect(&effects, Duration::ZERO, false),
    )
    .await;
    let key = unique("gbla-hang-taken-over");
    drop_a_claim(&rig, addr, &key).await;
    tokio::time::sleep(ms(1_000)).await;
    let second = ask(addr, &key).await;
    assert!(
        second.is_live() && second.body == "effect 1 attempt 2",
        "{second:?}\n  {}",
        rig.log()
    );
    assert_eq!(status_of(&rig, &key).await, Some(RecordStatus::Completed));
    tokio::time::sleep(ms(3_000)).await;
    let before = rig.count("release");
    tokio::time::sleep(ms(5_000)).await;
    let after = rig.count("release");
    println!("releases tried: {before} at +3 s after completion, {after} at +8 s");
    assert_eq!(
        after,
        before,
        "the give-back of a key taken over and completed by another holder goes on trying \
         (hung releases are never answered Fenced, and nothing reads the record)\n  {}",
        rig.log()
    );
    let replay = ask(addr, &key).await;
    assert!(replay.is_replay_of(&second.body), "{replay:?}");
    assert_eq!(effects.count(), 1);
}

/// The same as a graceful shutdown sees it: once the key was taken over and completed, with the
/// store's releases hanging, `detached::finished()` must return (bounded by `common::guard`,
/// 60 s). It did before e9b1728, when the give-back ended with its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s_liveness_finished_returns_once_the_key_is_taken_over_while_releases_hang() {
    const VAR: &str = "GBLA_CHILD_HANG";
    if std::env::var(VAR).is_err() {
        common::run_child(
            module_path!(),
            "s_liveness_finished_returns_once_the_key_is_taken_over_while_releases_hang",
            VAR,
        );
        return;
    }
    let rig = Rig::new(MemoryStore::new());
    rig.always("release", Act::Hang);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(300)),
        sleep_then_effect(&effects, Duration::ZERO, false),
    )
    .await;
    let key = unique("gbla-hang-finished");
    drop_a_claim(&rig, addr, &key).await;
    tokio::time::sleep(ms(1_000)).await;
    let second = ask(addr, &key).await;
    assert!(second.is_live(), "{second:?}\n  {}", rig.log());
    common::guard(
        "detached::finished() after the key was taken over and completed (releases hang)",
        detached::finished(),
    )
    .await;
    assert_eq!(effects.count(), 1);
    println!("TEARDOWN-CHILD-OK");
}

/// DESIGN §1.6 (a 503, or a hang-up before anything ran, leaves the key retryable) against a
/// store that fences releases by mistake for 1.5 s (the record stays in progress under the
/// holder's token) while a dropped claim is given back, on a `Reconcile` route with a 300 ms
/// lease; then releases are taken again. Nothing ran under the key: once the store behaves,
/// a retry must run it (once), not be told outcome-unknown for ever. Also checks the give-back
/// ends (no release tried over the last 3 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s_a_give_back_fenced_by_mistake_past_the_lease_never_strands_the_key() {
    let rig = Rig::new(MemoryStore::new());
    rig.always("release", Act::Fenced);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(300)).reconcile(),
        sleep_then_effect(&effects, Duration::ZERO, false),
    )
    .await;
    let key = unique("gbla-fenced-mistake");
    drop_a_claim(&rig, addr, &key).await;
    tokio::time::sleep(ms(1_500)).await;
    rig.always("release", Act::Pass);
    let mut seen = Vec::new();
    let mut ran = None;
    for _ in 0..30 {
        let a = ask(addr, &key).await;
        if a.is_live() {
            ran = Some(a);
            break;
        }
        seen.push(a);
        tokio::time::sleep(ms(200)).await;
    }
    let before = rig.count("release");
    tokio::time::sleep(ms(3_000)).await;
    let after = rig.count("release");
    assert_eq!(after, before, "the give-back ends\n  {}", rig.log());
    let status = status_of(&rig, &key).await;
    let ran = ran.unwrap_or_else(|| {
        panic!(
            "a key nothing ran under is stranded: {}\n  record: {:?}\n  {}",
            summary(&seen),
            status,
            rig.log()
        )
    });
    assert!(ran.body.starts_with("effect 1"), "{ran:?}");
    assert_eq!(effects.count(), 1);
}
