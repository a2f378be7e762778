mod common;

// Adversarial review of b106d59: one `Retry` (execute/retry.rs) paces every write a holder
// retries after its run (the record, a give-back, a set-aside give-back), and a release fenced
// after a run goes straight to the set-aside give-back (`give_back_set_aside_later`), holding no
// lease, instead of releasing again under a renewed lease first.
//
// Each test tries to make the change run a handler twice for one key (effects counted at the
// sink), resolve as "not applied" a key whose effect was marked started, override another
// holder's or an operator's/reconciler's outcome, strand a key, miscount, or leave a task
// running after the key is settled. No wall-clock assertion: sleeps only let leases lapse or
// bound how long a condition may take to come true.
//
// One test failed on b106d59: a release fenced by mistake (the key still in flight under the
// holder's token) left the key unheld, so it lapsed and, on a route that reconciles, was set
// aside though nothing ran. The set-aside give-back now releases such a key, under the lease
// it holds meanwhile. The killed-process tests run this binary again as their own server
// (`RETRY_PACING_CHILD` set), as `crash_matrix.rs` does.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use common::Effects;
use common::counts::Counts;
use tower_idempotency::reconcile::Reconciliation;
use tower_idempotency::store::{HistoryEvent, RecordStatus, SqliteStore};
use tower_idempotency::{IdempotencyStore, MemoryStore};

use common::rig::*;

// ---- helpers -------------------------------------------------------------------------------

/// The path of `faults.rs`'s `s4_a_fenced_release_goes_straight_to_the_set_aside_give_back`:
/// a reconciling route whose renewals fail; call 0 works 700 ms (lease 300 ms) and answers 503
/// having done nothing; a retry at 450 ms sets the key aside; the holder's release is fenced.
/// Returns the holder's and the retry's answers.
async fn fenced_after_a_set_aside<S: IdempotencyStore>(
    rig: &Arc<Rig<S>>,
    effects: &Effects,
    key: &str,
) -> (SocketAddr, Answer, Answer) {
    rig.always("renew", Act::Fail);
    let addr = server(
        rig,
        Route::plain(ms(300)).reconcile(),
        fail_first(effects, ms(700), StatusCode::SERVICE_UNAVAILABLE),
    )
    .await;
    let k = key.to_owned();
    let holder = tokio::spawn(async move { ask(addr, &k).await });
    tokio::time::sleep(ms(450)).await;
    let during = ask(addr, key).await;
    let first = holder.await.expect("the holder's request");
    (addr, first, during)
}

// ==== 1. the fenced release holds no lease =====================================================

/// DESIGN §4 ("a worker whose lease was taken over can no longer write"; a resolved, or another
/// holder's, outcome stands), on a `Reclaim` route: holder A (renewals failing) loses its lease
/// while its handler works; a retry takes the key over as B, whose handler makes the effect and
/// answers 201, but B's record fails for a while, so B marks the key uncertain
/// (`needs_reconciliation`, B's token, no effect marked started: exactly what A's set-aside
/// give-back looks for, but under another token). Then A answers 503 and its release is
/// fenced. A must leave B's record alone: B's recorder lands and retries replay B's answer. Had
/// A resolved it "not applied", B's write would be fenced and a retry would run a second
/// effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_release_fenced_by_a_takeover_leaves_the_new_holders_uncertain_record_alone() {
    let rig = Rig::new(MemoryStore::new());
    rig.doom(0);
    rig.fail_for("complete", ms(1_600));
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(300)),
        fail_first(&effects, ms(900), StatusCode::SERVICE_UNAVAILABLE),
    )
    .await;
    let key = unique("takeover-then-fenced");
    let k = key.clone();
    let a = tokio::spawn(async move { ask(addr, &k).await });
    tokio::time::sleep(ms(500)).await;
    let b = ask(addr, &key).await;
    assert!(b.is_live(), "B took over and ran: {b:?}\n  {}", rig.log());
    assert_eq!(
        status_of(&rig, &key).await,
        Some(RecordStatus::NeedsReconciliation),
        "B's failed record marked the key uncertain\n  {}",
        rig.log()
    );
    let a = a.await.expect("A's request");
    assert_eq!(a.status, 503, "{a:?}");
    assert!(
        rig.logged("release", "fenced") >= 1,
        "A's release is fenced\n  {}",
        rig.log()
    );
    // B's recorder lands once the store takes records again.
    let landed =
        eventually(async || status_of(&rig, &key).await == Some(RecordStatus::Completed)).await;
    let later = ask(addr, &key).await;
    let events = events_of(&rig, &key).await;
    assert!(
        landed && later.is_replay_of(&b.body),
        "B's outcome was lost: later {later:?}; history {events:?}\n  {}",
        rig.log()
    );
    assert!(
        !events.contains(&HistoryEvent::ReconciledNotApplied),
        "A resolved B's record: {events:?}"
    );
    assert_eq!(effects.count(), 1);
}

/// DESIGN §4 and the trait's contract for `Fenced`, on a reconciling route: the holder's first
/// release is answered `Fenced` although the record is still in flight under its token (a store,
/// or a proxy in front of one, that answers `Fenced` spuriously; `Act::Fenced`). The handler
/// answered 503 having done nothing, so the key should be given back. Before b106d59 the fenced
/// release went to `release_later`, which kept the lease renewed and released again (landing);
/// now the set-aside give-back reads the record once, finds it in flight, and does nothing: no
/// lease is held, it lapses, and the next claim on this reconciling route sets the key aside,
/// "outcome unknown", for a run that provably did nothing.
///
/// Checks the safety half (never a second run; a reconciler can still settle the key) before
/// the liveness half (the key is given back without one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_spuriously_fenced_release_of_a_key_still_in_flight_gives_it_back() {
    let rig = Rig::new(MemoryStore::new());
    rig.on("release", 1, Act::Fenced);
    let effects = Effects::default();
    let addr = first_503(&rig, Route::plain(ms(300)).reconcile(), &effects).await;
    let key = unique("spurious-fenced-release");
    let first = ask(addr, &key).await;
    assert_eq!(first.status, 503, "{first:?}");
    // Past the lease: a retry that honours 409 in flight.
    let later = ask_past_in_flight(addr, &key, Duration::from_secs(4)).await;
    let record = record_of(&rig, &key).await;
    let what = format!(
        "later {later:?}; record {:?}; {} release(s), {} lookup(s)\n  {}",
        record.as_ref().map(|r| (r.status, r.effect_started)),
        rig.count("release"),
        rig.count("lookup"),
        rig.log()
    );
    let given_back = later.is_live() && later.body == "effect 1 attempt 2";
    if !given_back {
        // Whatever it is left as, it must be settled by a reconciler, and then run once.
        assert_eq!(later.problem, "outcome-unknown", "{what}");
        sweep(rig.inner.clone(), Reconciliation::NotApplied).await;
        let after = ask(addr, &key).await;
        assert!(after.is_live(), "after a reconciler: {after:?}\n  {what}");
    }
    assert_eq!(effects.count(), 1, "{what}");
    assert!(
        given_back,
        "a release answered Fenced while the key was still the holder's: the key nothing ran \
         under was left in flight, unrenewed, and then set aside for reconciliation: {what}"
    );
}

/// DESIGN §4 (`effect_started`: from then on a failure leaves the key `needs_reconciliation`,
/// never "not applied"): the same spurious `Fenced` on the release of a run that marked its
/// effect started and then answered 500. On both kinds of route the key must end "outcome
/// unknown" (never given back as not applied, never run again), and the holder must not have
/// resolved it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_spuriously_fenced_release_after_a_milestone_is_never_resolved_not_applied() {
    for route in [Route::plain(ms(300)), Route::plain(ms(300)).reconcile()] {
        let rig = Rig::new(MemoryStore::new());
        rig.on("release", 1, Act::Fenced);
        let effects = Effects::default();
        let addr = server(
            &rig,
            route,
            effect_then(&effects, StatusCode::INTERNAL_SERVER_ERROR),
        )
        .await;
        let key = unique("spurious-fenced-milestone");
        let first = ask(addr, &key).await;
        assert_eq!(first.status, 500, "{first:?}");
        let later = ask_past_in_flight(addr, &key, Duration::from_secs(4)).await;
        tokio::time::sleep(ms(300)).await;
        let again = ask(addr, &key).await;
        let events = events_of(&rig, &key).await;
        let what = format!(
            "{:?}: later {later:?}, again {again:?}; history {events:?}\n  {}",
            route.expiry,
            rig.log()
        );
        assert_eq!(later.problem, "outcome-unknown", "{what}");
        assert_eq!(again.problem, "outcome-unknown", "{what}");
        assert_eq!(
            status_of(&rig, &key).await,
            Some(RecordStatus::NeedsReconciliation),
            "{what}"
        );
        assert!(
            !events.contains(&HistoryEvent::ReconciledNotApplied),
            "{what}"
        );
        assert_eq!(effects.count(), 1, "{what}");
    }
}

// ==== 2. pacing =================================================================================

/// DESIGN §4 (the holder keeps renewing and retrying its write instead of letting the lease
/// lapse), for a give-back (`release_later`, `Until::Lands`): every release hangs. The key must
/// stay in flight, its lease renewed, for many leases (a retry never runs it, never finds it set
/// aside on this reconciling route), the release tried again and again; when the store answers
/// again the key is given back (once a hung call has gone 30 s unanswered: they hang on, as on
/// links that died) and runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_release_that_always_hangs_keeps_the_key_in_flight_renewed_until_it_lands() {
    let rig = Rig::new(MemoryStore::new());
    rig.always("release", Act::Hang);
    let effects = Effects::default();
    let addr = first_503(&rig, Route::plain(ms(300)).reconcile(), &effects).await;
    let key = unique("release-hangs");
    let first = ask(addr, &key).await;
    assert_eq!(first.status, 503, "{first:?}");
    for _ in 0..8 {
        tokio::time::sleep(ms(300)).await;
        let during = ask(addr, &key).await;
        assert!(during.in_flight(), "{during:?}\n  {}", rig.log());
    }
    // The request's own try, then two on tasks of their own, which hang on (see
    // `execute/room.rs`): no more until one has gone 30 s unanswered.
    assert!(
        rig.count("release") >= 3,
        "the release is tried again\n  {}",
        rig.log()
    );
    assert_eq!(status_of(&rig, &key).await, Some(RecordStatus::InProgress));
    rig.always("release", Act::Pass);
    let given = within(Duration::from_secs(45), async || {
        status_of(&rig, &key).await == Some(RecordStatus::Released)
    })
    .await;
    assert!(given, "the release lands\n  {}", rig.log());
    let later = ask(addr, &key).await;
    assert!(
        later.is_live() && later.body == "effect 1 attempt 2",
        "{later:?}"
    );
    assert_eq!(effects.count(), 1);
}

/// DESIGN §4 and §7.1, on a `Reclaim` route (where a lapsed lease would let a retry run the
/// handler again): the record and the mark that would set the key aside both hang, every time.
/// The recorder must keep the lease renewed for as long as it tries, so every retry meanwhile is
/// told "in flight", never run; when the store answers, the outcome lands and is replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_record_that_always_hangs_is_retried_under_a_renewed_lease_never_run_twice() {
    let rig = Rig::new(MemoryStore::new());
    rig.always("complete", Act::Hang);
    rig.always("mark_uncertain", Act::Hang);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(300)),
        sleep_then_effect(&effects, Duration::ZERO, false),
    )
    .await;
    let key = unique("record-hangs");
    let first = ask(addr, &key).await;
    assert!(first.is_live(), "{first:?}");
    for _ in 0..8 {
        tokio::time::sleep(ms(300)).await;
        let during = ask(addr, &key).await;
        assert!(during.in_flight(), "{during:?}\n  {}", rig.log());
    }
    assert!(rig.count("complete") >= 3, "{}", rig.log());
    rig.always("complete", Act::Pass);
    // The hung calls hang on (links that died): the next goes once one of them has gone 30 s
    // unanswered (see `execute/room.rs`).
    let landed = within(Duration::from_secs(45), async || {
        status_of(&rig, &key).await == Some(RecordStatus::Completed)
    })
    .await;
    assert!(landed, "the record lands\n  {}", rig.log());
    let later = ask(addr, &key).await;
    assert!(later.is_replay_of(&first.body), "{later:?}");
    assert_eq!(effects.count(), 1);
}

/// DESIGN §4 (retried writes, bounded backoff) and the commit's promise ("each later [try]
/// twice the last, up to 4 leases, so that a store always slower than half a lease still
/// lands a write"): a store whose record, or release, always takes more than two leases (700 ms
/// under a 300 ms lease) but always succeeds. The bounds go 150, 300, 600, 1200 ms: the fourth
/// try lands. Meanwhile the key is never run twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_writes_slower_than_two_leases_land_on_a_later_try() {
    let mut stuck = Vec::new();
    for kind in ["complete", "release"] {
        let rig = Rig::new(MemoryStore::new());
        rig.always(kind, Act::Before(ms(700)));
        let effects = Effects::default();
        let (h, want) = match kind {
            "complete" => (
                sleep_then_effect(&effects, Duration::ZERO, false),
                RecordStatus::Completed,
            ),
            _ => (
                fail_first(&effects, Duration::ZERO, StatusCode::SERVICE_UNAVAILABLE),
                RecordStatus::Released,
            ),
        };
        let addr = server(&rig, Route::plain(ms(300)), h).await;
        let key = unique("slower-than-two-leases");
        let first = ask(addr, &key).await;
        let landed = within(Duration::from_secs(8), async || {
            status_of(&rig, &key).await == Some(want)
        })
        .await;
        let later = ask(addr, &key).await;
        if !landed {
            stuck.push(format!(
                "{kind}: never lands ({} tries): first {first:?}; record {:?}; later {later:?}",
                rig.count(kind),
                status_of(&rig, &key).await,
            ));
        }
        let ran = effects.count();
        assert!(
            ran <= 1,
            "{kind}: ran {ran} times: {first:?} {later:?}\n  {}",
            rig.log()
        );
    }
    assert!(stuck.is_empty(), "{}", stuck.join("\n"));
}

/// DESIGN §4 (a key set aside stays until resolved; a resolved outcome is final; the sweeper
/// settles it) and the set-aside give-back's promise ("retried while the store fails ... until
/// the record is given back or is no longer this holder's"): the key is set aside behind a
/// holder whose release was fenced, and every read of the give-back hangs. The key stays
/// "outcome unknown" (never run) until a reconciler settles it; a retry then runs it once. When
/// reads come back, the holder's give-back finds the record no longer its own and stops: it
/// touches nothing and reads no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_set_aside_give_back_whose_reads_hang_leaves_the_key_to_a_reconciler_then_stops() {
    let rig = Rig::new(MemoryStore::new());
    rig.always("lookup", Act::Hang);
    let effects = Effects::default();
    let key = unique("set-aside-reads-hang");
    let (addr, first, during) = fenced_after_a_set_aside(&rig, &effects, &key).await;
    assert_eq!(first.status, 503, "{first:?}");
    assert_eq!(during.problem, "outcome-unknown", "{during:?}");
    rig.always("renew", Act::Pass);
    assert!(
        within(Duration::from_secs(4), async || rig.count("lookup") >= 2).await,
        "the give-back reads, and reads again\n  {}",
        rig.log()
    );
    let still = ask(addr, &key).await;
    assert_eq!(still.problem, "outcome-unknown", "{still:?}");
    sweep(rig.inner.clone(), Reconciliation::NotApplied).await;
    let next = ask(addr, &key).await;
    assert!(
        next.is_live() && next.body == "effect 1 attempt 2",
        "{next:?}\n  {}",
        rig.log()
    );
    rig.always("lookup", Act::Pass);
    // The give-back's next read (its pauses grow to 1 s, its bounds to four leases) ends it.
    let read = within(Duration::from_secs(6), async || {
        rig.logged("lookup", "Pass -> ok") >= 1
    })
    .await;
    assert!(read, "the give-back reads again\n  {}", rig.log());
    // The lease keeper, whose renewal was fenced while reads hung, reads the record once more
    // (was the fence a mistake?), then lets the lease go too.
    tokio::time::sleep(ms(1_000)).await;
    let lookups = rig.count("lookup");
    tokio::time::sleep(ms(2_500)).await;
    assert_eq!(
        rig.count("lookup"),
        lookups,
        "the give-back goes on reading a key settled by a reconciler\n  {}",
        rig.log()
    );
    let last = ask(addr, &key).await;
    assert!(last.is_replay_of(&next.body), "{last:?}");
    assert_eq!(effects.count(), 1);
}

/// DESIGN §4 ("a resolved outcome is final: resolving bumps the fencing token, so a late holder
/// cannot overwrite it"; the reconcile docs: a key being recorded can be resolved under its live
/// holder): the record fails, the key is marked uncertain, and the recorder retries under the
/// run's `Retry`. An operator resolves the key meanwhile. When the store takes records again,
/// the recorder's write is fenced: the operator's answer stands, and the recorder stops (no
/// more writes after the key is settled).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_recorder_outlived_by_an_operators_resolution_is_fenced_and_stops() {
    let rig = Rig::new(MemoryStore::new());
    rig.always("complete", Act::Fail);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(300)),
        sleep_then_effect(&effects, Duration::ZERO, false),
    )
    .await;
    let key = unique("recorder-outlived");
    let first = ask(addr, &key).await;
    assert!(first.is_live(), "{first:?}");
    assert_eq!(
        status_of(&rig, &key).await,
        Some(RecordStatus::NeedsReconciliation),
        "{}",
        rig.log()
    );
    assert!(
        within(Duration::from_secs(4), async || rig.count("complete") >= 3).await,
        "{}",
        rig.log()
    );
    sweep(
        rig.inner.clone(),
        Reconciliation::Applied(Box::new(created("operator: done"))),
    )
    .await;
    rig.always("complete", Act::Pass);
    let fenced = within(Duration::from_secs(6), async || {
        rig.logged("complete", "fenced") >= 1
    })
    .await;
    assert!(fenced, "the recorder writes again, fenced\n  {}", rig.log());
    let writes = rig.count("complete");
    tokio::time::sleep(ms(2_500)).await;
    assert_eq!(
        rig.count("complete"),
        writes,
        "the recorder goes on after the key is settled\n  {}",
        rig.log()
    );
    let later = ask(addr, &key).await;
    assert!(later.is_replay_of("operator: done"), "{later:?}");
    assert_eq!(effects.count(), 1);
}

// ==== 3. metrics and history ===================================================================

/// DESIGN §6 (releases, stale writes, store errors, records awaiting reconciliation are
/// counted) for the paths b106d59 changed, each on a current-thread runtime with a recorder of
/// its own:
/// - fenced release, key set aside, given back: one stale write, one release, no reconciler's
///   "not applied", no store error; the history ends set aside then settled not applied, once;
/// - fenced release after a real takeover: one stale write and no release by the old holder.
#[tokio::test]
async fn s6_a_fenced_release_counts_one_stale_write_and_one_release_at_most() {
    let counts = Counts::default();
    let _local = metrics::set_default_local_recorder(&counts);

    let rig = Rig::new(MemoryStore::new());
    let effects = Effects::default();
    let key = unique("counted-set-aside");
    let (_, first, during) = fenced_after_a_set_aside(&rig, &effects, &key).await;
    assert_eq!(first.status, 503, "{first:?}");
    assert_eq!(during.problem, "outcome-unknown", "{during:?}");
    let given =
        eventually(async || status_of(&rig, &key).await == Some(RecordStatus::Released)).await;
    assert!(given, "{}", rig.log());
    tokio::time::sleep(ms(300)).await;
    let got = |name: &str| counts.get(&format!("idempotency_{name}_total"));
    let seen = format!(
        "stale {} releases {} not_applied {} store_errors {} moved {}\n  {}",
        got("stale_writes"),
        got("releases"),
        got("reconciled_not_applied"),
        got("store_errors"),
        got("moved_to_reconciliation"),
        rig.log()
    );
    assert_eq!(got("stale_writes"), 1, "{seen}");
    assert_eq!(got("releases"), 1, "{seen}");
    assert_eq!(got("reconciled_not_applied"), 0, "{seen}");
    let events = events_of(&rig, &key).await;
    let settled = events
        .iter()
        .filter(|e| **e == HistoryEvent::ReconciledNotApplied)
        .count();
    assert_eq!(settled, 1, "{events:?}");
    let set_aside = events
        .iter()
        .position(|e| *e == HistoryEvent::NeedsReconciliation);
    let resolved = events
        .iter()
        .position(|e| *e == HistoryEvent::ReconciledNotApplied);
    assert!(set_aside < resolved, "{events:?}");

    // A real takeover on a `Reclaim` route: the old holder's release is fenced, nothing else.
    let counts = Counts::default();
    let _local = metrics::set_default_local_recorder(&counts);
    let rig = Rig::new(MemoryStore::new());
    rig.doom(0);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(300)),
        fail_first(&effects, ms(700), StatusCode::SERVICE_UNAVAILABLE),
    )
    .await;
    let key = unique("counted-takeover");
    let k = key.clone();
    let a = tokio::spawn(async move { ask(addr, &k).await });
    tokio::time::sleep(ms(450)).await;
    let b = ask(addr, &key).await;
    assert!(b.is_live(), "{b:?}");
    let a = a.await.expect("A");
    assert_eq!(a.status, 503);
    tokio::time::sleep(ms(300)).await;
    let got = |name: &str| counts.get(&format!("idempotency_{name}_total"));
    let seen = format!(
        "stale {} releases {}\n  {}",
        got("stale_writes"),
        got("releases"),
        rig.log()
    );
    assert!(got("stale_writes") >= 1, "{seen}");
    assert_eq!(got("releases"), 0, "{seen}");
    assert_eq!(effects.count(), 1);
}

// ==== 4. a process killed mid give-back ========================================================

/// The lease of the killed-process tests.
const KILL_LEASE: Duration = Duration::from_millis(600);

/// Appends one effect to the sink file; the count so far.
fn hit_file(sink: &Path) -> usize {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(sink)
        .expect("sink");
    file.write_all(b"effect\n").expect("write the effect");
    file_effects(sink)
}

fn file_effects(sink: &Path) -> usize {
    std::fs::read_to_string(sink).map_or(0, |s| s.lines().count())
}

/// The killed server's and the fresh server's handler: in `set-aside`, call 0 works 1.5 s and
/// answers 503 having done nothing; in `release`, call 0 marks its effect started, makes it and
/// answers 500; otherwise (and every later call) it makes the effect and answers 201.
fn file_handler(sink: PathBuf, mode: &'static str) -> Handler {
    handler(move |i, ctx| {
        let sink = sink.clone();
        async move {
            if i == 0 && mode == "set-aside" {
                tokio::time::sleep(ms(1_500)).await;
                return (StatusCode::SERVICE_UNAVAILABLE, "nothing done".into());
            }
            if ctx.effect_started().await.is_err() {
                return (StatusCode::SERVICE_UNAVAILABLE, "no milestone".into());
            }
            let n = hit_file(&sink);
            if i == 0 && mode == "release" {
                return (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("effect {n}, then"),
                );
            }
            (StatusCode::CREATED, format!("effect {n}"))
        }
    })
}

/// The mode a killed-process test was started in as the server it kills (see [`Killed`]).
fn child_mode() -> Option<String> {
    std::env::var("RETRY_PACING_CHILD").ok()
}

/// The server a killed-process test starts in a process of its own (this binary, running that
/// same test with `RETRY_PACING_CHILD` set) and kills with SIGKILL. Says `LISTENING addr`,
/// then `AT <step>` once its give-back is where it is to be killed.
async fn serve_until_killed(mode: String) {
    let db = std::env::var("RETRY_PACING_DB").expect("db");
    let sink: PathBuf = std::env::var("RETRY_PACING_SINK").expect("sink").into();
    {
        let store = SqliteStore::connect(&db).await.expect("sqlite");
        let rig = Rig::new(store);
        let (mode, step, at): (&'static str, &'static str, usize) = match mode.as_str() {
            "set-aside" => {
                // The lease lapses while the handler works; the give-back's reads hang.
                rig.always("renew", Act::Fail);
                rig.always("lookup", Act::Hang);
                ("set-aside", "lookup", 1)
            }
            _ => {
                // Every release fails: the holder retries it under a renewed lease.
                rig.always("release", Act::Fail);
                ("release", "release", 3)
            }
        };
        let addr = server(
            &rig,
            Route::plain(KILL_LEASE).reconcile(),
            file_handler(sink, mode),
        )
        .await;
        println!("LISTENING {addr}");
        let _ = std::io::stdout().flush();
        while rig.count(step) < at {
            tokio::time::sleep(ms(5)).await;
        }
        println!("AT {step}");
        let _ = std::io::stdout().flush();
        std::future::pending::<()>().await;
    }
}

struct Killed {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
    addr: SocketAddr,
}

impl Killed {
    /// Runs `test` of this binary as the server, in `mode`.
    fn start(test: &str, mode: &str, db: &str, sink: &Path) -> Self {
        let mut child = Command::new(std::env::current_exe().expect("this binary"))
            .args([test, "--exact", "--nocapture"])
            .env("RETRY_PACING_CHILD", mode)
            .env("RETRY_PACING_DB", db)
            .env("RETRY_PACING_SINK", sink)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the server");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut addr = None;
        while addr.is_none() {
            let line = lines
                .recv_timeout(Duration::from_secs(30))
                .expect("the server's banner");
            addr = line.strip_prefix("LISTENING ").and_then(|a| a.parse().ok());
        }
        Self {
            child,
            lines,
            addr: addr.expect("an address"),
        }
    }

    async fn reached(&self, what: &str) -> bool {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            match self.lines.try_recv() {
                Ok(line) if line == what => return true,
                Ok(_) => {}
                Err(std::sync::mpsc::TryRecvError::Empty) => tokio::time::sleep(ms(5)).await,
                Err(_) => return false,
            }
        }
        false
    }

    /// SIGKILL: no destructor, no graceful shutdown, nothing written on the way out.
    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fresh SQLite database and an empty sink for one killed-process test.
async fn durable(name: &str) -> (String, SqliteStore, PathBuf) {
    let path = common::sqlite_path(name);
    let db = format!("sqlite://{}", path.display());
    let store = SqliteStore::connect(&db).await.expect("sqlite");
    store.migrate().await.expect("migrate");
    let sink = path.with_extension("effects");
    (db, store, sink)
}

/// DESIGN §4 and §7.6 (a crash leaves the key in flight or "outcome unknown", never new; a
/// reconciler settles it), with a real process killed by SIGKILL in the middle of the fenced
/// release's set-aside give-back (b106d59's new path: no lease held): on a durable store
/// (SQLite), the holder's lease lapses while its handler works, a retry sets the key aside, the
/// handler answers 503 having done nothing, the release is fenced, and the give-back's read of
/// the record hangs. The process is killed there. A fresh process must find the key "outcome
/// unknown", never run it; a reconciler that finds nothing downstream settles it not applied,
/// and the next retry runs it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_process_killed_mid_set_aside_give_back_leaves_the_key_for_a_reconciler() {
    if let Some(mode) = child_mode() {
        return serve_until_killed(mode).await;
    }
    let (db, store, sink) = durable("killed-set-aside").await;
    let key = unique("killed-set-aside");
    let test = "s4_a_process_killed_mid_set_aside_give_back_leaves_the_key_for_a_reconciler";
    let child = Killed::start(test, "set-aside", &db, &sink);
    let addr = child.addr;
    let k = key.clone();
    let holder = tokio::spawn(async move { send(addr, &k, Duration::from_secs(10)).await });
    tokio::time::sleep(KILL_LEASE + ms(300)).await;
    let during = ask(addr, &key).await;
    assert_eq!(during.problem, "outcome-unknown", "{during:?}");
    let reached = child.reached("AT lookup").await;
    child.kill();
    assert!(reached, "the killed server reached its give-back's read");
    let first = holder.await.expect("the holder's request");
    assert!(first.as_ref().is_none_or(|a| a.status == 503), "{first:?}");

    let rig = Rig::new(store.clone());
    let fresh = server(
        &rig,
        Route::plain(KILL_LEASE).reconcile(),
        file_handler(sink.clone(), "fresh"),
    )
    .await;
    tokio::time::sleep(KILL_LEASE).await;
    let after = ask(fresh, &key).await;
    assert_eq!(
        after.problem,
        "outcome-unknown",
        "{after:?}; record {:?}",
        status_of(&rig, &key).await
    );
    assert_eq!(file_effects(&sink), 0);
    sweep(store.clone(), Reconciliation::NotApplied).await;
    let next = ask(fresh, &key).await;
    assert!(next.is_live() && next.body == "effect 1", "{next:?}");
    let last = ask(fresh, &key).await;
    assert!(last.is_replay_of(&next.body), "{last:?}");
    assert_eq!(file_effects(&sink), 1);
    let _ = std::fs::remove_file(&sink);
}

/// DESIGN §4 and §7.6–7: the same, killed in the middle of a release retried under a renewed
/// lease (`release_later`, paced by the run's `Retry`): the run marked its effect started,
/// made it, and answered 500; every release fails; while the holder retries, a retry is told
/// "in flight". Killed there, the key must come back "outcome unknown" (its effect started),
/// never run again; a reconciler that finds the effect downstream settles it applied, and
/// retries replay that answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_process_killed_mid_release_retry_leaves_the_key_unknown_never_run_twice() {
    if let Some(mode) = child_mode() {
        return serve_until_killed(mode).await;
    }
    let (db, store, sink) = durable("killed-release").await;
    let key = unique("killed-release");
    let test = "s4_a_process_killed_mid_release_retry_leaves_the_key_unknown_never_run_twice";
    let child = Killed::start(test, "release", &db, &sink);
    let first = ask(child.addr, &key).await;
    assert_eq!(first.status, 500, "{first:?}");
    let during = ask(child.addr, &key).await;
    assert!(during.in_flight(), "{during:?}");
    let reached = child.reached("AT release").await;
    child.kill();
    assert!(reached, "the killed server retried its release");
    assert_eq!(file_effects(&sink), 1);

    let rig = Rig::new(store.clone());
    let fresh = server(
        &rig,
        Route::plain(KILL_LEASE),
        file_handler(sink.clone(), "fresh"),
    )
    .await;
    tokio::time::sleep(KILL_LEASE + ms(200)).await;
    let after = ask_past_in_flight(fresh, &key, Duration::from_secs(4)).await;
    assert_eq!(
        after.problem,
        "outcome-unknown",
        "{after:?}; record {:?}",
        status_of(&rig, &key).await
    );
    sweep(
        store.clone(),
        Reconciliation::Applied(Box::new(created("found downstream: effect 1"))),
    )
    .await;
    let replay = ask(fresh, &key).await;
    assert!(
        replay.is_replay_of("found downstream: effect 1"),
        "{replay:?}"
    );
    assert_eq!(file_effects(&sink), 1, "run again after the kill");
    let _ = std::fs::remove_file(&sink);
}
