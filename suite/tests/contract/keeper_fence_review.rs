use crate::common;

// Adversarial review of d2a35eb and 13ad8fd (src/hold.rs): a renewal answered `Fenced` is no
// longer taken as a lost lease at once. It is tried again like a failed one (session 45: a sixth
// of the lease after it was sent, within a second for leases over six seconds), while
// a read (`lookup`, bounded by half a lease) runs beside it; only a read that shows the record
// no longer in progress under the hold's token marks the slot lost (matched by slot, key and
// token, since slots are reused) and counts `LeaseLost`.
//
// Each test tries to make the keeper let a lease lapse under a running handler, keep renewing a
// lease that is really lost, overrun its bound on store calls, or miscount. Effects are counted
// at the sink. No wall-clock assertion: sleeps only let leases lapse or bound how long a
// condition may take. Rates are printed (`--nocapture`) for the report.
//
// Three tests fail on 13ad8fd:
// - `s4_s6_a_takeover_seen_by_slow_reads_stops_renewals_and_counts_one_loss`: with reads slower
//   than a tick, each fenced renewal starts a read of its own, and every read that shows the
//   lease lost counts `LeaseLost` again (`settle` matches a slot already marked lost): one hold,
//   two losses.
// - `s6_a_record_whose_answer_is_slow_counts_no_lost_lease`: a renewal fenced because the
//   holder's own outcome landed (its answer still on the way) counts a lost lease (as before
//   these commits, when every fence did).
// - `s4_load_hanging_reads_of_a_long_lease_on_a_short_tick_stay_bounded`: the keeper's reads are
//   not under `OUTSTANDING`; a fenced renewal is tried again every tick of the shortest lease
//   while each read may take half of this lease: dozens of hanging reads for one hold.
//
// All three pass since the fix that followed: one read at a time per hold (bounded by two
// leases, off the renewals' path), a loss counted only when the slot turns lost, and a record
// settled under the hold's own token (recorded, given back) stops renewals without a count.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use common::Effects;
use common::counts::Counts;
use tower_idempotency::store::{FencingToken, Record, RecordStatus, ScopedKey, StoreError};
use tower_idempotency::{IdempotencyContext, IdempotencyStore, MemoryStore};

use common::rig::*;

/// `OUTSTANDING` in src/hold.rs: the most renewals of one lease under way at once.
const OUTSTANDING: usize = 2;

// ---- helpers -------------------------------------------------------------------------------

/// A store under the [`Rig`] that can fence by mistake the renewals of keys holding a marker
/// (refused, nothing changed, the record still the holder's) and hang every read, and that
/// counts the reads under way (a hanging read the keeper gives up on is dropped, and counted
/// out, when its bound runs out).
struct Twist<S> {
    inner: S,
    fence_marked: Mutex<Option<String>>,
    hang_reads: AtomicBool,
    reads_now: AtomicUsize,
    reads_max: AtomicUsize,
}

impl<S> Twist<S> {
    fn new(inner: S) -> Self {
        Self {
            inner,
            fence_marked: Mutex::default(),
            hang_reads: AtomicBool::new(false),
            reads_now: AtomicUsize::new(0),
            reads_max: AtomicUsize::new(0),
        }
    }

    fn fence_renewals_of(&self, marker: &str) {
        *self.fence_marked.lock().unwrap() = Some(marker.to_owned());
    }

    /// The most reads under way at once since the last call.
    fn take_reads_max(&self) -> usize {
        self.reads_max
            .swap(self.reads_now.load(Ordering::SeqCst), Ordering::SeqCst)
    }
}

struct Under<'a>(&'a AtomicUsize);

impl Drop for Under<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl<S: IdempotencyStore> IdempotencyStore for Twist<S> {
    async fn renew(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<std::time::SystemTime, StoreError> {
        let marked = self
            .fence_marked
            .lock()
            .unwrap()
            .as_ref()
            .is_some_and(|m| key.key().contains(m.as_str()));
        if marked {
            return Err(StoreError::Fenced);
        }
        self.inner.renew(key, token, lease).await
    }

    async fn lookup(&self, key: &ScopedKey) -> Result<Option<Record>, StoreError> {
        let now = self.reads_now.fetch_add(1, Ordering::SeqCst) + 1;
        self.reads_max.fetch_max(now, Ordering::SeqCst);
        let _under = Under(&self.reads_now);
        if self.hang_reads.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.inner.lookup(key).await
    }

    crate::common::forward::forward_store!(inner: claim, complete, release, mark_uncertain, remove, purge_expired, record_milestone, list_uncertain, count_uncertain, resolve, append_history, wait_for_change);
}

fn got(counts: &Counts, name: &str) -> u64 {
    counts.get(&format!("idempotency_{name}_total"))
}

/// A handler that sleeps `long` on keys holding "long", `short` (plus a little, by call) on
/// others, then makes its effect, counted per key.
fn by_key(
    per_key: &Arc<Mutex<HashMap<String, usize>>>,
    long: Duration,
    short: Duration,
) -> Handler {
    let per_key = per_key.clone();
    handler(move |i, ctx: IdempotencyContext| {
        let per_key = per_key.clone();
        async move {
            let key = ctx.key().to_owned();
            let nap = if key.contains("long") {
                long
            } else {
                short + ms(10 * (i as u64 % 5))
            };
            tokio::time::sleep(nap).await;
            *per_key.lock().unwrap().entry(key.clone()).or_default() += 1;
            (StatusCode::CREATED, format!("effect on {key}"))
        }
    })
}

// ==== 1. slots reused while a read is out =======================================================

/// DESIGN §4 (the holder keeps its lease while its process lives; a lost lease must never let
/// two runs happen), on a `Reclaim` route where a lapsed lease is taken over. Twenty short holds
/// have every renewal fenced by mistake, and every read is held back 250 ms, so their reads come
/// back after the short handlers finished and gave their slots back, to twenty long holds that
/// took those slots meanwhile. Each late read shows a completed record ("not in flight"): it
/// must mark nothing, since the slot now holds another key. A long hold wrongly marked lost stops
/// renewing; its lease lapses under its running handler and a polling retry takes it over and
/// runs it again. Every key must run exactly once, no probe may run, no lease is counted lost.
#[tokio::test(flavor = "current_thread")]
async fn s4_slots_reused_while_reads_are_out_never_let_a_lease_lapse() {
    let counts = Counts::default();
    let _local = metrics::set_default_local_recorder(&counts);
    let rig = Rig::new(Twist::new(MemoryStore::new()));
    rig.inner.fence_renewals_of("short");
    rig.always("lookup", Act::Before(ms(250)));
    let per_key = Arc::new(Mutex::new(HashMap::new()));
    let addr = server(
        &rig,
        Route::plain(ms(300)),
        by_key(&per_key, ms(1_500), ms(150)),
    )
    .await;
    let run = unique("slots");
    let mut tasks = Vec::new();
    for wave in 0..2 {
        for n in 0..20 {
            let key = format!("{run}-short-{wave}-{n}");
            tasks.push(tokio::spawn(async move { ask(addr, &key).await }));
        }
        tokio::time::sleep(ms(120)).await;
    }
    // The first wave is done (its renewals fenced at ~100 ms, reads out until ~350-450 ms):
    // long holds take its slots.
    tokio::time::sleep(ms(140)).await;
    let longs: Vec<String> = (0..20).map(|n| format!("{run}-long-{n}")).collect();
    for key in longs.clone() {
        tasks.push(tokio::spawn(async move { ask(addr, &key).await }));
    }
    let mut probes = Vec::new();
    for _ in 0..10 {
        tokio::time::sleep(ms(120)).await;
        for key in &longs {
            probes.push(ask(addr, key).await);
        }
    }
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.expect("a holder"));
    }
    let per_key = per_key.lock().unwrap().clone();
    let what = format!(
        "holders: {}; probes: {}; lost {} store_errors {}; lookups {}\n  {}",
        summary(&answers),
        summary(&probes),
        got(&counts, "lease_lost"),
        got(&counts, "store_errors"),
        rig.count("lookup"),
        rig.log()
    );
    assert!(
        rig.count("lookup") >= 20,
        "the short holds' fences were read: {what}"
    );
    assert!(answers.iter().all(Answer::is_live), "{what}");
    assert!(
        probes.iter().all(|a| !a.is_live()),
        "a retry took a long key over: {what}"
    );
    assert_eq!(per_key.len(), 60, "{what}");
    assert!(per_key.values().all(|n| *n == 1), "{per_key:?} {what}");
    assert_eq!(got(&counts, "lease_lost"), 0, "{what}");
}

// ==== 2. a real takeover: one read, one loss ====================================================

/// DESIGN §4 ("a worker whose lease was taken over can no longer write") and §6 (leases lost
/// counted): holder A's renewals fail until its lease lapses and B takes the key over on a
/// `Reclaim` route. A's renewals then reach the store and are fenced for real, while reads take
/// 100 ms (within the keeper's bound of half a lease, 150 ms): two ticks' worth of fenced
/// renewals each start a read before the first comes back. The keeper must stop renewing A's
/// lost lease once a read shows it, count the lease lost once for the one hold, and B's outcome
/// must stand.
#[tokio::test(flavor = "current_thread")]
async fn s4_s6_a_takeover_seen_by_slow_reads_stops_renewals_and_counts_one_loss() {
    let counts = Counts::default();
    let _local = metrics::set_default_local_recorder(&counts);
    let rig = Rig::new(MemoryStore::new());
    rig.doom(0);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(300)),
        sleep_then_effect(&effects, ms(3_000), false),
    )
    .await;
    let key = unique("takeover-slow-reads");
    let k = key.clone();
    let a = tokio::spawn(async move { ask(addr, &k).await });
    tokio::time::sleep(ms(500)).await;
    let b = ask(addr, &key).await;
    assert!(b.is_live(), "B took over and ran: {b:?}\n  {}", rig.log());
    let a_token = token_of(&rig, 0);
    rig.always("lookup", Act::Before(ms(100)));
    rig.doomed.lock().unwrap().clear();
    let stopped = eventually(async || got(&counts, "lease_lost") >= 1).await;
    assert!(stopped, "A's lease is seen lost\n  {}", rig.log());
    // Reads started before the first came back land within 100 ms more.
    tokio::time::sleep(ms(400)).await;
    let (renew1, lost1) = (renewals_of(&rig, a_token), got(&counts, "lease_lost"));
    tokio::time::sleep(ms(1_000)).await;
    let renew2 = renewals_of(&rig, a_token);
    let a = a.await.expect("A");
    tokio::time::sleep(ms(600)).await;
    let later = ask(addr, &key).await;
    let what = format!(
        "A {a:?}; A-renewals {renew1}->{renew2}; lost {lost1}, then {}; lookups {}\n  {}",
        got(&counts, "lease_lost"),
        rig.count("lookup"),
        rig.log()
    );
    println!("takeover, reads 100 ms: {what}");
    assert_eq!(renew2, renew1, "A's lost lease is still renewed: {what}");
    assert!(
        later.is_replay_of(&b.body),
        "B's outcome: {later:?}\n  {what}"
    );
    // A ran because its lease lapsed (its renewals failed, as a cut-off holder's), B after.
    assert_eq!(effects.count(), 2, "{what}");
    assert_eq!(
        got(&counts, "lease_lost"),
        1,
        "one hold lost its lease once: {what}"
    );
}

// ==== 3. marked uncertain by its own holder =====================================================

/// DESIGN §4 (when recording the outcome fails, the holder marks the record uncertain and keeps
/// retrying the write) and §6: the record write fails for 1.5 s, so the holder marks the key
/// uncertain and a recorder retries under a hold of its own. That hold's renewals are now
/// fenced for real (the record is no longer in progress): the keeper must stop after the read
/// that shows it, not renew every tick until the write lands. At most one lease is counted lost
/// for the hold, and the outcome lands and is replayed.
#[tokio::test(flavor = "current_thread")]
async fn s4_marked_uncertain_by_its_own_holder_stops_renewals_after_one_read() {
    let counts = Counts::default();
    let _local = metrics::set_default_local_recorder(&counts);
    let rig = Rig::new(MemoryStore::new());
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(300)),
        sleep_then_effect(&effects, Duration::ZERO, false),
    )
    .await;
    let key = unique("own-uncertain");
    rig.fail_for("complete", ms(1_500));
    let first = ask(addr, &key).await;
    assert!(first.is_live(), "{first:?}");
    let token = token_of(&rig, 0);
    let landed =
        eventually(async || status_of(&rig, &key).await == Some(RecordStatus::Completed)).await;
    assert!(landed, "{}", rig.log());
    let later = ask(addr, &key).await;
    let fenced = rig
        .log
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.contains("renew#") && l.contains(&format!(" t={token} ")))
        .filter(|l| l.contains("-> fenced"))
        .count();
    let what = format!(
        "renewals {} (fenced {fenced}), lookups {}, marks {}, lost {}, store_errors {}\n  {}",
        renewals_of(&rig, token),
        rig.count("lookup"),
        rig.count("mark_uncertain"),
        got(&counts, "lease_lost"),
        got(&counts, "store_errors"),
        rig.log()
    );
    println!("marked uncertain by its holder: {what}");
    assert!(rig.count("mark_uncertain") >= 1, "{what}");
    assert!(later.is_replay_of(&first.body), "{later:?}\n  {what}");
    assert_eq!(effects.count(), 1, "{what}");
    // Without the stop, ~28 ticks of 50 ms would each send a renewal.
    assert!(fenced <= 3, "renewals go on after the read: {what}");
    assert!(rig.count("lookup") <= 3, "{what}");
    assert!(got(&counts, "lease_lost") <= 1, "{what}");
}

// ==== 4. a settled record is not a lost lease ===================================================

/// DESIGN §6 (leases lost counted apart from what is not a loss): with a 600 ms lease, the
/// holder's record write lands at once but its answer takes 260 ms (a slow network; within the
/// write's bound of half a lease), and the hold lives until the answer. The renewal due a third
/// of a lease in is fenced (the record is completed), and the keeper's read shows a completed
/// record. Nothing was lost: the holder recorded its own outcome. No lease may be counted lost;
/// the outcome is replayed.
#[tokio::test(flavor = "current_thread")]
async fn s6_a_record_whose_answer_is_slow_counts_no_lost_lease() {
    let counts = Counts::default();
    let _local = metrics::set_default_local_recorder(&counts);
    let rig = Rig::new(MemoryStore::new());
    rig.on("complete", 1, Act::After(ms(260)));
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(600)),
        sleep_then_effect(&effects, Duration::ZERO, false),
    )
    .await;
    let key = unique("slow-record-answer");
    let first = ask(addr, &key).await;
    tokio::time::sleep(ms(300)).await;
    let later = ask(addr, &key).await;
    let what = format!(
        "renewals {} lookups {} lost {} store_errors {}\n  {}",
        rig.count("renew"),
        rig.count("lookup"),
        got(&counts, "lease_lost"),
        got(&counts, "store_errors"),
        rig.log()
    );
    println!("slow record answer: {what}");
    assert!(first.is_live(), "{first:?}");
    assert!(later.is_replay_of(&first.body), "{later:?}");
    assert_eq!(effects.count(), 1);
    assert!(
        rig.logged("renew#", "fenced") >= 1,
        "a renewal met the completed record: {what}"
    );
    assert_eq!(
        got(&counts, "lease_lost"),
        0,
        "a holder that recorded its own outcome lost no lease: {what}"
    );
}

// ==== 5. load =================================================================================

/// DESIGN §4 (a lost lease is let go; the keeper's calls bounded), load (a): A's lease was
/// really taken over (as in test 2) and every read fails. The keeper cannot tell, so it keeps
/// renewing: no more than one renewal and one read per hold per keeper tick (50 ms for a 300 ms
/// lease), and once reads answer it stops within a few ticks though A's handler still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_load_a_takeover_with_failing_reads_is_paced_and_let_go_once_reads_answer() {
    let rig = Rig::new(MemoryStore::new());
    rig.doom(0);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(300)),
        sleep_then_effect(&effects, ms(3_500), false),
    )
    .await;
    let key = unique("load-takeover-reads-fail");
    let k = key.clone();
    let a = tokio::spawn(async move { ask(addr, &k).await });
    tokio::time::sleep(ms(500)).await;
    let b = ask(addr, &key).await;
    assert!(b.is_live(), "{b:?}\n  {}", rig.log());
    let a_token = token_of(&rig, 0);
    rig.always("lookup", Act::Fail);
    rig.doomed.lock().unwrap().clear();
    tokio::time::sleep(ms(100)).await;
    let (r0, l0) = (renewals_of(&rig, a_token), rig.count("lookup"));
    tokio::time::sleep(ms(1_000)).await;
    let (r1, l1) = (renewals_of(&rig, a_token), rig.count("lookup"));
    rig.always("lookup", Act::Pass);
    tokio::time::sleep(ms(300)).await;
    let r2 = renewals_of(&rig, a_token);
    tokio::time::sleep(ms(1_000)).await;
    let r3 = renewals_of(&rig, a_token);
    let still_running = effects.count() == 1;
    let _ = a.await;
    let what = format!(
        "(a) takeover, reads failing: {} renewals/s, {} lookups/s; after reads answer: \
         {r2}->{r3}\n  {}",
        r1 - r0,
        l1 - l0,
        rig.log()
    );
    println!("{what}");
    assert!(still_running, "A's handler ran through the window: {what}");
    assert!(r1 - r0 <= 1_000 / 50 + 2, "renewals per tick: {what}");
    assert!(l1 - l0 <= 1_000 / 50 + 2, "reads per tick: {what}");
    assert_eq!(r3, r2, "renewals of a lost lease go on: {what}");
    let later = ask(addr, &key).await;
    assert!(later.is_replay_of(&b.body), "{later:?}\n  {what}");
}

/// Drives one hold of `lease` on `/op` (its handler takes `runs`) whose renewals are all fenced
/// by mistake, reads hanging or not, on a layer whose keeper has also held a `shortest` lease on
/// `/short` (its tick a sixth of that); measures renewals and reads per second over `window`,
/// and the most reads under way at once. Then checks that the keeper's calls end once the hold
/// is given back.
async fn fenced_by_mistake_load(
    what: &str,
    lease: Duration,
    shortest: Option<Duration>,
    hang: bool,
    runs: Duration,
    window: Duration,
) -> (f64, f64, usize) {
    let rig = Rig::new(Twist::new(MemoryStore::new()));
    let effects = Effects::default();
    let mut layer = layer(&rig, Route::plain(lease).reconcile());
    if let Some(short) = shortest {
        layer = layer.for_path("/short", move |r| r.lease(short));
    }
    let e = effects.clone();
    let app = Router::new()
        .route(
            "/op",
            post(move || {
                let e = e.clone();
                async move {
                    tokio::time::sleep(runs).await;
                    (StatusCode::CREATED, format!("effect {}", e.hit()))
                }
            }),
        )
        .route(
            "/short",
            post(|| async { (StatusCode::CREATED, "short".to_owned()) }),
        )
        .layer(layer);
    let addr = common::serve(app).await;
    if shortest.is_some() {
        let res = common::client()
            .post(format!("http://{addr}/short"))
            .header("idempotency-key", unique("short"))
            .header("content-type", "application/json")
            .body(r#"{"amount":10}"#)
            .send()
            .await
            .expect("the short route");
        assert_eq!(res.status().as_u16(), 201);
    }
    let key = unique("fenced-load-mark");
    rig.inner.fence_renewals_of("fenced-load-mark");
    rig.inner.hang_reads.store(hang, Ordering::SeqCst);
    let k = key.clone();
    let holder = tokio::spawn(async move { ask(addr, &k).await });
    // The first renewal is due a third of a lease in; let the pattern settle.
    tokio::time::sleep(lease / 3 + lease / 2 + ms(50)).await;
    let (r0, l0) = (rig.count("renew"), rig.count("lookup"));
    rig.inner.take_reads_max();
    tokio::time::sleep(window).await;
    let (r1, l1) = (rig.count("renew"), rig.count("lookup"));
    let most = rig.inner.take_reads_max();
    let alive = effects.count() == 0;
    let answer = holder.await.expect("the holder");
    // Reads still out end at their bound (two leases: `hold::renew`); then nothing more is
    // sent. (Half a lease, as this waited, passed or failed by the phase the last read began
    // at.)
    tokio::time::sleep(lease * 2 + ms(200)).await;
    let (r2, l2, out2) = (
        rig.count("renew"),
        rig.count("lookup"),
        rig.inner.reads_now.load(Ordering::SeqCst),
    );
    tokio::time::sleep(ms(500)).await;
    let (r3, l3) = (rig.count("renew"), rig.count("lookup"));
    let secs = window.as_secs_f64();
    let (renews, reads) = ((r1 - r0) as f64 / secs, (l1 - l0) as f64 / secs);
    let report = format!(
        "{what}: {renews:.0} renewals/s, {reads:.0} lookups/s, at most {most} reads under way \
         at once; after the hold was given back: renewals {r2}->{r3}, lookups {l2}->{l3}, \
         reads still under way {out2}; holder {answer:?}"
    );
    println!("{report}");
    assert!(alive, "the handler ran through the window: {report}");
    assert_eq!(answer.status, 201, "{report}");
    assert_eq!(effects.count(), 1, "{report}");
    assert_eq!(
        (r3, l3, out2),
        (r2, l2, 0),
        "the keeper's calls end with the hold: {report}"
    );
    (renews, reads, most)
}

/// DESIGN §4 (a renewal that hangs does not hold up the next; at most `OUTSTANDING` under way,
/// "so a store that hangs every call is not sent more and more"), load (b): every renewal of a
/// 300 ms lease is fenced by mistake and every read hangs (the keeper bounds each by half a
/// lease). At most one renewal and one read per tick (50 ms), no more than 2 x `OUTSTANDING`
/// reads under way at once for the one hold, and all of it ends once the hold is given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_load_reads_hanging_behind_mistaken_fences_stay_bounded() {
    let (renews, reads, most) = fenced_by_mistake_load(
        "(b) fenced by mistake, reads hang, lease 300 ms",
        ms(300),
        None,
        true,
        ms(1_600),
        ms(1_000),
    )
    .await;
    assert!(renews <= (1_000 / 50 + 2) as f64, "{renews}");
    assert!(reads <= (1_000 / 50 + 2) as f64, "{reads}");
    assert!(most <= 2 * OUTSTANDING, "{most} reads under way at once");
}

/// Load (c): a store that fences every renewal by mistake but answers reads. One renewal and
/// one read per tick per hold at most, and they end with the hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_load_every_renewal_fenced_by_mistake_with_reads_answering_is_paced() {
    let (renews, reads, most) = fenced_by_mistake_load(
        "(c) fenced by mistake, reads answer, lease 300 ms",
        ms(300),
        None,
        false,
        ms(1_600),
        ms(1_000),
    )
    .await;
    assert!(renews <= (1_000 / 50 + 2) as f64, "{renews}");
    assert!(reads <= (1_000 / 50 + 2) as f64, "{reads}");
    assert!(most <= OUTSTANDING, "{most} reads under way at once");
}

/// DESIGN §4 as in load (b), with leases of different lengths on one layer: the keeper's tick
/// is a sixth of the shortest lease it has held (a 60 ms route: 10 ms), while a read of a
/// 1.2 s lease is bounded by 600 ms. With every renewal of the long lease fenced by mistake and
/// every read hanging, the one hold must still have no more than 2 x `OUTSTANDING` reads under
/// way at once (the limit that keeps "a store that hangs every call" from being sent more and
/// more), and all of it must end with the hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_load_hanging_reads_of_a_long_lease_on_a_short_tick_stay_bounded() {
    let (renews, reads, most) = fenced_by_mistake_load(
        "(b') fenced by mistake, reads hang, lease 1.2 s, shortest lease 60 ms",
        ms(1_200),
        Some(ms(60)),
        true,
        ms(2_400),
        ms(1_000),
    )
    .await;
    assert!(renews <= (1_000 / 10 + 5) as f64, "{renews}");
    assert!(reads <= (1_000 / 10 + 5) as f64, "{reads}");
    assert!(
        most <= 2 * OUTSTANDING,
        "{most} reads of one hold under way at once ({renews:.0} renewals/s, {reads:.0} reads/s)"
    );
}

// ==== 6. real stores ============================================================================

/// On `store`: (1) holder A's renewals fail until B takes the key over on a `Reclaim` route;
/// then A's renewals are fenced for real and the keeper stops after the read that shows it,
/// while A's handler still runs; B's outcome stands. (2) A record write that fails for 1.5 s is
/// marked uncertain by its holder: the recorder's renewals are fenced for real and stop after
/// one read; the outcome lands once and is replayed.
async fn real_store_stops<S: IdempotencyStore + 'static>(name: &str, store: S) -> String {
    let lease = ms(400);
    // (1) a real takeover.
    let rig = Rig::new(store);
    rig.doom(0);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(lease),
        sleep_then_effect(&effects, ms(3_000), false),
    )
    .await;
    let key = unique("real-takeover");
    let k = key.clone();
    let a = tokio::spawn(async move { ask(addr, &k).await });
    tokio::time::sleep(ms(800)).await;
    let b = ask(addr, &key).await;
    assert!(b.is_live(), "{name}: B took over: {b:?}\n  {}", rig.log());
    let a_token = token_of(&rig, 0);
    rig.doomed.lock().unwrap().clear();
    let (r0, l0) = (renewals_of(&rig, a_token), rig.count("lookup"));
    tokio::time::sleep(ms(1_200)).await;
    let (r1, l1) = (renewals_of(&rig, a_token), rig.count("lookup"));
    let running = effects.count() == 1;
    let _ = a.await;
    let later = ask(addr, &key).await;
    let takeover = format!(
        "{name} takeover: A-renewals after B {}, keeper reads {}",
        r1 - r0,
        l1 - l0
    );
    assert!(running, "{takeover}\n  {}", rig.log());
    assert!(
        r1 - r0 <= 3,
        "the lost lease is still renewed: {takeover}\n  {}",
        rig.log()
    );
    assert!(l1 - l0 <= 3, "{takeover}\n  {}", rig.log());
    assert!(later.is_replay_of(&b.body), "{name}: {later:?}");

    // (2) marked uncertain by its own holder.
    let inner = rig.inner.clone();
    let rig = Rig::over(inner);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(lease),
        sleep_then_effect(&effects, Duration::ZERO, false),
    )
    .await;
    let key = unique("real-uncertain");
    rig.fail_for("complete", ms(1_500));
    let first = ask(addr, &key).await;
    assert!(first.is_live(), "{name}: {first:?}");
    let token = token_of(&rig, 0);
    let landed =
        eventually(async || status_of(&rig, &key).await == Some(RecordStatus::Completed)).await;
    let later = ask(addr, &key).await;
    let uncertain = format!(
        "{name} uncertain: marks {}, renewals {}, keeper reads {}",
        rig.count("mark_uncertain"),
        renewals_of(&rig, token),
        rig.count("lookup")
    );
    assert!(landed, "{uncertain}\n  {}", rig.log());
    assert!(rig.count("mark_uncertain") >= 1, "{uncertain}");
    assert!(
        renewals_of(&rig, token) <= 3,
        "renewals go on after the read: {uncertain}\n  {}",
        rig.log()
    );
    assert!(later.is_replay_of(&first.body), "{name}: {later:?}");
    assert_eq!(effects.count(), 1, "{uncertain}");
    format!("{takeover}; {uncertain}")
}

/// DESIGN §4 and §5 (one behaviour on every store): a real takeover and a real mark-uncertain,
/// with the keeper, on SqliteStore, PostgresStore and RedisStore: renewals stop after one read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_s5_real_stores_stop_renewing_after_one_read() {
    let mut seen = Vec::new();
    let (sqlite, _path) = common::sqlite("keeper-fence").await;
    seen.push(real_store_stops("sqlite", sqlite).await);
    if let Some(pg) = common::postgres("keeper_fence_review").await {
        seen.push(real_store_stops("postgres", pg).await);
    }
    if let Some(redis) = common::redis("keeper-fence").await {
        seen.push(real_store_stops("redis", redis).await);
    }
    println!("real stores:\n  {}", seen.join("\n  "));
}
