use crate::common;

// Adversarial review of d4552d3 (a record refused `Busy` is retried) and d425450 (every write
// after a run is bounded by half a lease; a key set aside for reconciliation while its holder
// still carried the token, with no effect marked started, is resolved "not applied" by that
// holder: `execute::give_back_set_aside`, from a fenced release and from a late claim's fenced
// confirmation).
//
// Each test tries to make these changes run a handler twice for one key (effects counted at
// the sink), resolve as "not applied" a key whose effect happened, override an operator's
// resolution, lose a recorded outcome, strand a key, or panic. No wall-clock assertion: sleeps
// only let leases lapse or bound how long a condition may take to come true.
//
// The first four tests failed on d425450 and pass since the fix that followed it: the
// give-back of a set-aside key is retried until it is settled, runs on a task of its own, and
// every retried write gets a longer bound than the last.

use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use common::Effects;
use tower_idempotency::reconcile::{Reconciliation, resolve_by_hand};
use tower_idempotency::store::{HistoryEvent, RecordStatus, ScopedKey, StoredResponse};
use tower_idempotency::{IdempotencyStore, MemoryStore};

use common::rig::*;

// ---- helpers -------------------------------------------------------------------------------

/// Call 0 answers 503 at once, having started a task of its own that, `after` later, marks the
/// effect started and makes the effect only if that was recorded (as the README says a
/// handler must); later calls make the effect and answer 201.
fn spawned_milestone(effects: &Effects, after: Duration) -> Handler {
    let effects = effects.clone();
    handler(move |i, ctx| {
        let effects = effects.clone();
        async move {
            if i == 0 {
                let (effects, ctx) = (effects.clone(), ctx.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(after).await;
                    if ctx.effect_started().await.is_ok() {
                        effects.hit();
                    }
                });
                return (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "answered; work goes on".into(),
                );
            }
            let n = effects.hit();
            (
                StatusCode::CREATED,
                format!("effect {n} attempt {}", ctx.attempt()),
            )
        }
    })
}

/// The release path of the give-back: the handler answers 503 (nothing done); the holder's
/// release and renewals fail until a retry past the lease set the key aside (reconciling
/// route); then the store recovers. Returns the retry's answer during the outage.
async fn set_aside_after_a_503<S: IdempotencyStore>(
    rig: &std::sync::Arc<Rig<S>>,
    addr: std::net::SocketAddr,
    key: &str,
) -> Answer {
    let first = ask(addr, key).await;
    assert_eq!(first.status, 503, "{first:?}\n  {}", rig.log());
    tokio::time::sleep(ms(500)).await;
    ask(addr, key).await
}

// ==== 1. a give-back of a set-aside key is tried until settled ========================================

/// DESIGN §4 (a key nothing ran under, or whose holder's outcome releases it, is given back;
/// the holder keeps retrying its writes, fenced, until they land) and the commit's own promise
/// ("the holder ... settles it as not applied ... and the key may run again"), release path:
/// the holder's release and renewals fail until a retry sets the key aside; the store comes
/// back, but its reads still fail for a moment. The holder's next release is fenced, and its
/// read of the record fails. On d425450 nothing tried again and the key a 503 released stayed
/// "outcome unknown" for ever; now the read is retried and the key given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_set_aside_give_back_whose_read_fails_once_is_tried_again() {
    let rig = Rig::new(MemoryStore::new());
    rig.always("release", Act::Fail);
    rig.always("renew", Act::Fail);
    let effects = Effects::default();
    let addr = first_503(&rig, Route::plain(ms(300)).reconcile(), &effects).await;
    let key = unique("set-aside-read-fails");
    let during = set_aside_after_a_503(&rig, addr, &key).await;
    assert_eq!(during.problem, "outcome-unknown", "{during:?}");
    // The store comes back, its reads a little later.
    rig.fail_for("lookup", ms(1_500));
    rig.always("release", Act::Pass);
    rig.always("renew", Act::Pass);
    assert!(
        within(Duration::from_secs(4), async || rig
            .logged("release", "fenced")
            >= 1)
        .await,
        "the holder's give-back reaches the set-aside record\n  {}",
        rig.log()
    );
    // Reads come back; the give-back's next try (its pauses grow to 1 s) settles the key.
    eventually(async || {
        record_of(&rig, &key)
            .await
            .is_some_and(|r| r.status != RecordStatus::NeedsReconciliation)
    })
    .await;
    let later = ask(addr, &key).await;
    let record = record_of(&rig, &key).await;
    assert!(
        later.is_live() && later.body == "effect 1 attempt 2",
        "the 503 (nothing done) was in hand and the store is back, yet the key stays set aside: \
         {later:?}; record {:?}\n  {}",
        record.map(|r| (r.status, r.effect_started)),
        rig.log()
    );
    assert_eq!(effects.count(), 1);
}

/// The same on the late-claim path (`service::confirm`): a claim comes back after its lease, a
/// retry has set the key aside, the late claimant's confirmation is fenced, and its one read
/// of the record fails. On d425450 the claimant answered "outcome unknown" for a request that
/// provably ran nothing, and the key stayed so for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_late_claims_give_back_whose_read_fails_once_is_tried_again() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("claim", 1, Act::After(ms(700)));
    rig.on("lookup", 1, Act::Fail);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(400)).reconcile(),
        sleep_then_effect(&effects, Duration::ZERO, false),
    )
    .await;
    let key = unique("late-claim-read-fails");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(500)).await;
    let during = ask(addr, &key).await;
    assert_eq!(during.problem, "outcome-unknown", "{during:?}");
    let first = first.await.expect("task").expect("answered");
    tokio::time::sleep(ms(1_500)).await;
    let later = ask(addr, &key).await;
    let record = record_of(&rig, &key).await;
    assert!(
        (later.is_live() || later.is_replay_of(&first.body)) && effects.count() == 1,
        "nothing ran under the late claim, yet the key stays set aside: first {first:?}; \
         later {later:?}; record {:?}\n  {}",
        record.map(|r| (r.status, r.effect_started)),
        rig.log()
    );
}

/// DESIGN §1 step 5/7 ("a claim dropped in flight ... is given back", `ClaimToEnd`,
/// `ReleaseOnDrop`): the late claimant's confirmation is fenced by a set-aside, and it starts
/// giving the key back (`give_back_set_aside`), on the request's own future, after disarming
/// its `ReleaseOnDrop`. The store is slow to read (the very reason claims come back late) and
/// the client hangs up meanwhile. On d425450 the give-back ran on the request's own future, was
/// dropped half-way, and the key nothing ran under stayed "outcome unknown" for ever; now it
/// runs on a task of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_late_claims_give_back_survives_a_hang_up() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("claim", 1, Act::After(ms(700)));
    rig.always("lookup", Act::Before(ms(700)));
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(400)).reconcile(),
        sleep_then_effect(&effects, Duration::ZERO, false),
    )
    .await;
    let key = unique("late-claim-hang-up");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(500)).await;
    let during = ask(addr, &key).await;
    assert_eq!(during.problem, "outcome-unknown", "{during:?}");
    // The late claimant's confirmation is fenced at ~700 ms; its read of the record is slow.
    assert!(
        within(Duration::from_secs(4), async || rig.count("lookup") >= 1).await,
        "the late claimant reads the record\n  {}",
        rig.log()
    );
    tokio::time::sleep(ms(150)).await;
    first.abort();
    rig.always("lookup", Act::Pass);
    tokio::time::sleep(ms(1_500)).await;
    let later = ask(addr, &key).await;
    let record = record_of(&rig, &key).await;
    assert!(
        later.is_live() && effects.count() == 1,
        "a hang-up during the give-back left the key set aside: later {later:?}; record {:?}\n  {}",
        record.map(|r| (r.status, r.effect_started)),
        rig.log()
    );
}

// ==== 2. bounded writes ========================================================================

/// DESIGN §4 ("when recording the outcome fails, the holder keeps renewing and retrying the
/// write ... instead of letting the lease lapse"; the write is meant to land): a store whose
/// `complete` (or `release`) always takes a little longer than half the lease, but always
/// succeeds. Before d425450 the first write, unbounded, landed. On d425450 every try was given
/// up at half a lease: the write never landed, the key stayed "outcome unknown" (or in flight)
/// for ever, its lease renewed. Now each retried try gets twice the last one's time (up to four
/// leases), so the write lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_write_always_slower_than_half_a_lease_still_lands() {
    let mut stuck = Vec::new();
    for kind in ["complete", "release"] {
        let rig = Rig::new(MemoryStore::new());
        rig.always(kind, Act::Before(ms(260)));
        let effects = Effects::default();
        let h = match kind {
            "complete" => sleep_then_effect(&effects, Duration::ZERO, false),
            _ => fail_first(&effects, Duration::ZERO, StatusCode::SERVICE_UNAVAILABLE),
        };
        let addr = server(&rig, Route::plain(ms(400)), h).await;
        let key = unique("slow-write");
        let first = ask(addr, &key).await;
        let want = match kind {
            "complete" => RecordStatus::Completed,
            _ => RecordStatus::Released,
        };
        let landed = within(Duration::from_secs(3), async || {
            status_of(&rig, &key).await == Some(want)
        })
        .await;
        if !landed {
            stuck.push(format!(
                "{kind}: never lands ({} tries, {} renewals): first {first:?}; record {:?}; \
                 a retry is told {:?}",
                rig.count(kind),
                rig.count("renew"),
                status_of(&rig, &key).await,
                ask(addr, &key).await.problem,
            ));
        }
    }
    assert!(
        stuck.is_empty(),
        "a write of 260 ms under a 400 ms lease:\n{}",
        stuck.join("\n")
    );
}

/// DESIGN §4 and §7.1: the first record lands at once but its answer comes back after half a
/// lease (`After`), or is lost (`ApplyThenFail`). The holder gives it up, marks the key
/// uncertain (refused: it is completed) and starts a recorder, whose write finds its own record
/// completed. Nothing is lost or set aside: the retry replays the one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_record_that_applies_then_is_given_up_is_not_lost() {
    for act in [Act::After(ms(600)), Act::ApplyThenFail] {
        let rig = Rig::new(MemoryStore::new());
        rig.on("complete", 1, act);
        let effects = Effects::default();
        let addr = server(
            &rig,
            Route::plain(ms(400)).reconcile(),
            sleep_then_effect(&effects, Duration::ZERO, false),
        )
        .await;
        let key = unique("record-applies-late");
        let first = ask(addr, &key).await;
        assert!(first.is_live(), "{act:?}: {first:?}");
        assert!(
            within(Duration::from_secs(4), async || rig.count("complete") >= 2).await,
            "{act:?}: the recorder writes again\n  {}",
            rig.log()
        );
        tokio::time::sleep(ms(800)).await;
        let retry = ask(addr, &key).await;
        assert!(
            retry.is_replay_of(&first.body),
            "{act:?}: {retry:?}\n  {}",
            rig.log()
        );
        assert_eq!(status_of(&rig, &key).await, Some(RecordStatus::Completed));
        assert_eq!(effects.count(), 1, "{act:?}");
    }
}

// ==== 3. what the holder resolves ==============================================================

/// DESIGN §4 (`effect_started`: from then on a failure leaves the key `needs_reconciliation`),
/// with a handler that answers 503 at once and marks its effect started later, from a task of
/// its own. Its release and renewals fail until a retry sets the key aside.
/// - The milestone lands before the set-aside: the effect happened; the holder must not give
///   the key back (retries get "outcome unknown", never a second run).
/// - The milestone comes after: it is fenced, so the task makes no effect; the holder gives
///   the key back and a retry runs it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_milestone_marked_from_a_spawned_task_decides_the_give_back() {
    for (after, started) in [(ms(100), true), (ms(800), false)] {
        let rig = Rig::new(MemoryStore::new());
        rig.always("release", Act::Fail);
        rig.always("renew", Act::Fail);
        let effects = Effects::default();
        let addr = server(
            &rig,
            Route::plain(ms(300)).reconcile(),
            spawned_milestone(&effects, after),
        )
        .await;
        let key = unique("spawned-milestone");
        let during = set_aside_after_a_503(&rig, addr, &key).await;
        assert_eq!(during.problem, "outcome-unknown", "{after:?}: {during:?}");
        tokio::time::sleep(ms(500)).await;
        rig.always("release", Act::Pass);
        rig.always("renew", Act::Pass);
        assert!(
            within(Duration::from_secs(4), async || rig
                .logged("release", "fenced")
                >= 1)
            .await,
            "{after:?}: the holder's release reaches the record\n  {}",
            rig.log()
        );
        tokio::time::sleep(ms(300)).await;
        let later = ask(addr, &key).await;
        let record = record_of(&rig, &key).await;
        let what = format!(
            "{after:?}: later {later:?}; record {:?}\n  {}",
            record.as_ref().map(|r| (r.status, r.effect_started)),
            rig.log()
        );
        if started {
            assert_eq!(later.problem, "outcome-unknown", "{what}");
            assert_eq!(
                status_of(&rig, &key).await,
                Some(RecordStatus::NeedsReconciliation),
                "{what}"
            );
        } else {
            assert!(
                later.is_live() && later.body == "effect 1 attempt 2",
                "{what}"
            );
        }
        assert_eq!(effects.count(), 1, "{what}");
    }
}

/// DESIGN §4 ("a resolved outcome is final"): while the holder's give-back is between its read
/// of the set-aside record and its resolve (the read's answer is slow), an operator resolves
/// the key by hand as applied. The holder's resolve is fenced by its old token: the operator's
/// response is replayed, the operator's note kept, and nothing runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_an_operators_resolution_between_the_read_and_the_resolve_stands() {
    let rig = Rig::new(MemoryStore::new());
    rig.always("release", Act::Fail);
    rig.always("renew", Act::Fail);
    let effects = Effects::default();
    let addr = first_503(&rig, Route::plain(ms(300)).reconcile(), &effects).await;
    let key = unique("operator-races-holder");
    let during = set_aside_after_a_503(&rig, addr, &key).await;
    assert_eq!(during.problem, "outcome-unknown", "{during:?}");
    rig.on("lookup", 1, Act::After(ms(600)));
    rig.always("release", Act::Pass);
    rig.always("renew", Act::Pass);
    assert!(
        within(Duration::from_secs(4), async || rig.count("lookup") >= 1).await,
        "the holder reads the set-aside record\n  {}",
        rig.log()
    );
    tokio::time::sleep(ms(50)).await;
    let response = StoredResponse {
        status: StatusCode::CREATED,
        headers: HeaderMap::new(),
        body: Some("operator: done downstream".into()),
        trailers: None,
    };
    resolve_by_hand(
        &*rig.inner,
        &ScopedKey::new("", &key),
        Reconciliation::Applied(Box::new(response)),
        Duration::from_secs(60),
        "checked downstream: it happened",
    )
    .await
    .expect("the operator resolves the set-aside key");
    // The holder's read comes back (stale) and it tries to resolve.
    tokio::time::sleep(ms(900)).await;
    let later = ask(addr, &key).await;
    let record = record_of(&rig, &key).await.expect("a record");
    assert!(
        later.is_replay_of("operator: done downstream"),
        "the holder overrode the operator: {later:?}; record {:?}\n  {}",
        (record.status, &record.resolution_note),
        rig.log()
    );
    assert_eq!(
        record.resolution_note.as_deref(),
        Some("checked downstream: it happened")
    );
    assert_eq!(effects.count(), 0);
}

/// DESIGN §4 (Reclaim: no milestone, the next claim takes over with a new token): the holder's
/// release and renewals fail; a retry past the lease takes the key over and runs it. The
/// holder's release, when the store is back, is fenced; its read finds the new holder's token
/// and leaves the record alone. One effect, replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_reclaim_takeover_is_never_given_back_by_the_old_holder() {
    let rig = Rig::new(MemoryStore::new());
    rig.always("release", Act::Fail);
    rig.always("renew", Act::Fail);
    let effects = Effects::default();
    let addr = first_503(&rig, Route::plain(ms(300)), &effects).await;
    let key = unique("reclaim-old-holder");
    let during = set_aside_after_a_503(&rig, addr, &key).await;
    assert!(
        during.is_live() && during.body == "effect 1 attempt 2",
        "{during:?}\n  {}",
        rig.log()
    );
    rig.always("release", Act::Pass);
    rig.always("renew", Act::Pass);
    assert!(
        within(Duration::from_secs(4), async || rig
            .logged("release", "fenced")
            >= 1)
        .await,
        "the old holder's release is fenced\n  {}",
        rig.log()
    );
    tokio::time::sleep(ms(200)).await;
    let later = ask(addr, &key).await;
    assert!(
        later.is_replay_of(&during.body),
        "{later:?}\n  {}",
        rig.log()
    );
    assert_eq!(effects.count(), 1);
}

/// DESIGN §6 (per key, the history keeps what happened, for incident review): after a holder
/// gives back a set-aside key, its history tells the lease expiry, then the holder's
/// resolution as not applied with its note; the next run is attempt 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_the_holders_give_back_is_in_the_keys_history() {
    let counts = common::counts::Counts::global();
    let rig = Rig::new(MemoryStore::new());
    rig.always("release", Act::Fail);
    rig.always("renew", Act::Fail);
    let effects = Effects::default();
    let addr = first_503(&rig, Route::plain(ms(300)).reconcile(), &effects).await;
    let key = unique("give-back-history");
    let releases = counts.get("idempotency_releases_total");
    let during = set_aside_after_a_503(&rig, addr, &key).await;
    assert_eq!(during.problem, "outcome-unknown", "{during:?}");
    rig.always("release", Act::Pass);
    rig.always("renew", Act::Pass);
    assert!(
        within(Duration::from_secs(4), async || {
            status_of(&rig, &key).await == Some(RecordStatus::Released)
        })
        .await,
        "the holder gives the key back\n  {}",
        rig.log()
    );
    let record = record_of(&rig, &key).await.expect("a record");
    let events: Vec<HistoryEvent> = record.history.iter().map(|e| e.event).collect();
    let expired = events.iter().position(|e| *e == HistoryEvent::LeaseExpired);
    let resolved = events
        .iter()
        .position(|e| *e == HistoryEvent::ReconciledNotApplied);
    assert!(
        matches!((expired, resolved), (Some(a), Some(b)) if a < b),
        "history {events:?}"
    );
    assert!(
        record
            .resolution_note
            .as_deref()
            .is_some_and(|n| n.contains("given back by its holder")),
        "{:?}",
        record.resolution_note
    );
    assert!(counts.get("idempotency_releases_total") > releases);
    let later = ask(addr, &key).await;
    assert!(
        later.is_live() && later.body == "effect 1 attempt 2",
        "{later:?}"
    );
    assert_eq!(effects.count(), 1);
}

// ==== 4. the same on the durable stores ========================================================

/// The release path and the late-claim path of the give-back, on a real store: a 503's key set
/// aside while the holder's writes failed is given back and runs once; a late claim fenced by
/// a set-aside gives back and runs once. Then both replay.
async fn give_backs_on<S: IdempotencyStore>(what: &str, store: S) {
    let rig = Rig::new(store);
    rig.always("release", Act::Fail);
    rig.always("renew", Act::Fail);
    let effects = Effects::default();
    let addr = first_503(&rig, Route::plain(ms(400)).reconcile(), &effects).await;
    let key = unique("durable-release-give-back");
    let first = ask(addr, &key).await;
    assert_eq!(first.status, 503, "{what}: {first:?}");
    tokio::time::sleep(ms(600)).await;
    let during = ask(addr, &key).await;
    assert_eq!(during.problem, "outcome-unknown", "{what}: {during:?}");
    rig.always("release", Act::Pass);
    rig.always("renew", Act::Pass);
    assert!(
        within(Duration::from_secs(5), async || {
            status_of(&rig, &key).await == Some(RecordStatus::Released)
        })
        .await,
        "{what}: the holder gives the set-aside key back\n  {}",
        rig.log()
    );
    let later = ask(addr, &key).await;
    assert!(
        later.is_live() && later.body == "effect 1 attempt 2",
        "{what}: {later:?}\n  {}",
        rig.log()
    );
    assert!(ask(addr, &key).await.is_replay_of(&later.body), "{what}");
    assert_eq!(effects.count(), 1, "{what}");

    // The late claim.
    let n = rig.count("claim");
    rig.on("claim", n + 1, Act::After(ms(700)));
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(400)).reconcile(),
        sleep_then_effect(&effects, Duration::ZERO, false),
    )
    .await;
    let key = unique("durable-late-claim");
    let first = hang_up_later(addr, &key);
    tokio::time::sleep(ms(500)).await;
    let during = ask(addr, &key).await;
    let first = first.await.expect("task").expect("answered");
    assert!(
        during.problem == "outcome-unknown" && first.is_live(),
        "{what}: first {first:?}; during {during:?}\n  {}",
        rig.log()
    );
    let later = ask(addr, &key).await;
    assert!(
        later.is_replay_of(&first.body),
        "{what}: {later:?}\n  {}",
        rig.log()
    );
    assert_eq!(effects.count(), 1, "{what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_give_backs_of_set_aside_keys_on_sqlite() {
    let (store, path) = common::sqlite("set-aside-give-back").await;
    give_backs_on("sqlite", store).await;
    let _ = std::fs::remove_file(path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_give_backs_of_set_aside_keys_on_postgres() {
    let Some(store) = common::postgres("set_aside_give_back_review").await else {
        return;
    };
    give_backs_on("postgres", store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_give_backs_of_set_aside_keys_on_redis() {
    let Some(store) = common::redis("set-aside-give-back").await else {
        return;
    };
    give_backs_on("redis", store).await;
}
