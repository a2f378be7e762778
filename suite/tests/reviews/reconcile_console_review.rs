#![allow(missing_docs)]
use crate::common;

// Adversarial review of reconciliation (`reconcile.rs`: the Sweeper, `resolve_by_hand`) and the
// operator console (`console.rs`) against the holders' latest fault paths: a record write the
// holder keeps retrying (`execute::Recorder`), a key set aside behind a holder that gives it
// back (`give_back_set_aside`), a lapsed lease on a `Reconcile` route, and removal / purge of
// keys in flight or uncertain. Effects are counted at the sink (in the handler). No wall-clock
// assertion: sleeps only let leases lapse, and every wait is bounded and fails the test.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use common::rig::*;
use common::{Effects, serve};
use serde_json::{Value, json};
use tower_idempotency::console::Console;
use tower_idempotency::reconcile::{Reconciler, Reconciliation, Sweeper, resolve_by_hand};
use tower_idempotency::store::{
    Claim, ClaimRequest, FencingToken, HistoryEvent, Record, RecordStatus, ScopedKey,
    StoredResponse,
};
use tower_idempotency::{Fingerprint, IdempotencyStore, LeaseExpiry, MemoryStore};

// ---- helpers -------------------------------------------------------------------------------

/// Headers a request is sent with, by name.
type Headers = Vec<(&'static str, String)>;

/// The console over the rig's store, nested at `/ops` (no auth: the tests are the operator).
async fn console<S: IdempotencyStore>(rig: &Arc<Rig<S>>) -> SocketAddr {
    console_with(Console::from_arc(rig.clone())).await
}

async fn console_with<S: IdempotencyStore>(console: Console<Rig<S>>) -> SocketAddr {
    serve(Router::new().nest("/ops", console.router())).await
}

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

/// A JSON API write, as the console's own page (same origin) sends it.
async fn api(ops: SocketAddr, path: &str, body: Value) -> (u16, Value) {
    let res = http()
        .post(format!("http://{ops}/ops{path}"))
        .header("sec-fetch-site", "same-origin")
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("post");
    let status = res.status().as_u16();
    let text = res.text().await.expect("body");
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

async fn get(ops: SocketAddr, path: &str) -> (u16, String) {
    let res = http()
        .get(format!("http://{ops}/ops{path}"))
        .send()
        .await
        .expect("get");
    let status = res.status().as_u16();
    (status, res.text().await.expect("body"))
}

/// A form post with the given extra headers (none: as a cross-site form of an old browser
/// that sends neither `Origin` nor `Sec-Fetch-Site`).
async fn form(
    ops: SocketAddr,
    path: &str,
    headers: &[(&str, String)],
    fields: &[(&str, &str)],
) -> u16 {
    let body = form_urlencoded::Serializer::new(String::new())
        .extend_pairs(fields.iter().copied())
        .finish();
    let mut req = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
        .post(format!("http://{ops}/ops{path}"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(body);
    for (name, value) in headers {
        req = req.header(*name, value.as_str());
    }
    req.send().await.expect("post").status().as_u16()
}

fn resolve_body(key: &str, outcome: &str) -> Value {
    json!({"scope": "", "key": key, "outcome": outcome, "reason": "checked the provider"})
}

/// A request sent to `addr` with `key`, once its holder runs (the key in progress).
async fn holding<S: IdempotencyStore>(
    rig: &Rig<S>,
    addr: SocketAddr,
    key: &str,
) -> tokio::task::JoinHandle<Option<Answer>> {
    let first = hang_up_later(addr, key);
    assert!(
        within(Duration::from_secs(5), async || is_status(
            rig,
            key,
            RecordStatus::InProgress
        )
        .await)
        .await
    );
    first
}

/// A request with a body of our choosing (the rig's `ask` always sends `{"amount":10}`).
async fn ask_body(addr: SocketAddr, key: &str, body: &str) -> Answer {
    send_body(addr, key, body, Duration::from_secs(30))
        .await
        .expect("answered")
}

/// A reconciler that thinks for `delay`, then answers `what`.
struct Slow(Duration, Reconciliation);

impl Reconciler for Slow {
    async fn reconcile(&self, _: &Record) -> Reconciliation {
        tokio::time::sleep(self.0).await;
        self.1.clone()
    }
}

async fn is_status<S: IdempotencyStore>(rig: &Rig<S>, key: &str, want: RecordStatus) -> bool {
    status_of(rig, key).await == Some(want)
}

fn history(record: &Option<Record>) -> Vec<HistoryEvent> {
    record
        .as_ref()
        .map(|r| r.history.iter().map(|h| h.event).collect())
        .unwrap_or_default()
}

/// Runs `scenario` on memory, SQLite (a real file), PostgreSQL and Redis when reachable.
macro_rules! on_stores {
    ($scenario:ident) => {
        mod $scenario {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn memory() {
                super::$scenario(tower_idempotency::MemoryStore::new(), "memory").await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn sqlite() {
                let (store, path) = crate::common::sqlite(stringify!($scenario)).await;
                super::$scenario(store, "sqlite").await;
                let _ = std::fs::remove_file(path);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn postgres() {
                // A table per scenario: a sweep settles every uncertain record of its table.
                let table = format!("rc_review_{}", line!());
                let Some(store) = crate::common::postgres(&table).await else {
                    return;
                };
                super::$scenario(store, "postgres").await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn redis() {
                let Some(store) = crate::common::redis(stringify!($scenario)).await else {
                    return;
                };
                super::$scenario(store, "redis").await;
            }
        }
    };
}

// ==== 1. resolutions against a holder still retrying its record ===============================

/// A key whose handler ran and answered, and whose record writes keep failing: awaiting
/// reconciliation, its holder still retrying the write.
struct Recording<S: IdempotencyStore> {
    rig: Arc<Rig<S>>,
    effects: Effects,
    addr: SocketAddr,
    ops: SocketAddr,
    key: String,
}

async fn record_failing<S: IdempotencyStore>(store: S, name: &str, key: &str) -> Recording<S> {
    let rig = Rig::new(store);
    rig.always("complete", Act::Fail);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(400)),
        sleep_then_effect(&effects, Duration::ZERO, false),
    )
    .await;
    let ops = console(&rig).await;
    let key = unique(key);
    let first = ask(addr, &key).await;
    assert!(
        first.is_live(),
        "[{name}] the client gets its answer: {first:?}"
    );
    assert!(
        eventually(async || is_status(&rig, &key, RecordStatus::NeedsReconciliation).await).await,
        "[{name}] a failed record marks the key uncertain\n  {}",
        rig.log()
    );
    Recording {
        rig,
        effects,
        addr,
        ops,
        key,
    }
}

/// reconcile.rs module docs: "the holder's write lands only if nobody has resolved the key
/// first. A resolution is final: it takes a new fencing token, and the holder's later write is
/// refused." The handler ran and answered; its record write fails, so the key is marked
/// uncertain and the holder keeps retrying. An operator resolves "not applied" through the
/// console; then the store takes writes again. The holder's retried write must be refused and
/// must stop; the key runs again (the operator said it did not happen), once.
async fn s4_console_not_applied_racing_the_holders_retried_record_is_final<S: IdempotencyStore>(
    store: S,
    name: &str,
) {
    let Recording {
        rig,
        effects,
        addr,
        ops,
        key,
    } = record_failing(store, name, "na-race").await;
    let during = ask(addr, &key).await;
    assert_eq!(
        (during.status, during.problem.as_str()),
        (409, "outcome-unknown"),
        "[{name}] {during:?}"
    );
    let (status, body) = api(ops, "/api/resolve", resolve_body(&key, "not_applied")).await;
    assert_eq!(status, 200, "[{name}] {body}");
    let before = rig.logged("complete", "fenced");
    rig.always("complete", Act::Pass);
    assert!(
        within(Duration::from_secs(8), async || rig
            .logged("complete", "fenced")
            > before)
        .await,
        "[{name}] the holder's recorder tries again once the store is back\n  {}",
        rig.log()
    );
    let record = record_of(&rig, &key).await;
    println!(
        "[{name}] after the holder's late write: {:?} {:?}",
        record.as_ref().map(|r| r.status),
        history(&record)
    );
    assert_eq!(
        record.as_ref().map(|r| r.status),
        Some(RecordStatus::Released),
        "[{name}] the holder's late write overwrote the operator's resolution"
    );
    // The recorder gives up once fenced: no more writes.
    let n = rig.count("complete");
    tokio::time::sleep(ms(2_500)).await;
    assert_eq!(
        rig.count("complete"),
        n,
        "[{name}] the recorder keeps writing after its fence\n  {}",
        rig.log()
    );
    let again = ask(addr, &key).await;
    assert!(
        again.is_live() && again.body == "effect 2 attempt 2",
        "[{name}] not applied lets the key run again: {again:?}"
    );
    let replay = ask(addr, &key).await;
    assert!(replay.is_replay_of(&again.body), "[{name}] {replay:?}");
    assert_eq!(effects.count(), 2, "[{name}]");
}
on_stores!(s4_console_not_applied_racing_the_holders_retried_record_is_final);

/// The same with "applied": the operator's response stands, the holder's retried write is
/// refused, nothing runs again.
async fn s4_console_applied_then_the_holders_recorder_is_refused<S: IdempotencyStore>(
    store: S,
    name: &str,
) {
    let Recording {
        rig,
        effects,
        addr,
        ops,
        key,
    } = record_failing(store, name, "applied-recorder").await;
    let mut body = resolve_body(&key, "applied");
    body["status"] = json!("201");
    body["body"] = json!("operator says applied");
    let (status, answer) = api(ops, "/api/resolve", body).await;
    assert_eq!(status, 200, "[{name}] {answer}");
    let before = rig.logged("complete", "fenced");
    rig.always("complete", Act::Pass);
    assert!(
        within(Duration::from_secs(8), async || rig
            .logged("complete", "fenced")
            > before)
        .await,
        "[{name}] the recorder tries again\n  {}",
        rig.log()
    );
    let replay = ask(addr, &key).await;
    assert!(
        replay.is_replay_of("operator says applied"),
        "[{name}] the resolution must stand: {replay:?}; history {:?}",
        history(&record_of(&rig, &key).await)
    );
    assert_eq!(effects.count(), 1, "[{name}]");
}
on_stores!(s4_console_applied_then_the_holders_recorder_is_refused);

// ==== 2. the sweeper against the set-aside give-back ==========================================

/// The holder's 503 releases the key; its release and renewals fail until a retry (past the
/// lease, `Reconcile` route) sets the key aside. Returns the server.
async fn set_aside_503<S: IdempotencyStore>(
    rig: &Arc<Rig<S>>,
    effects: &Effects,
    key: &str,
) -> SocketAddr {
    rig.always("release", Act::Fail);
    rig.always("renew", Act::Fail);
    let addr = first_503(rig, Route::plain(ms(300)).reconcile(), effects).await;
    let first = ask(addr, key).await;
    assert_eq!(first.status, 503, "{first:?}\n  {}", rig.log());
    tokio::time::sleep(ms(500)).await;
    let during = ask(addr, key).await;
    assert_eq!(
        during.problem,
        "outcome-unknown",
        "{during:?}\n  {}",
        rig.log()
    );
    addr
}

/// The sweeper resolves "applied" first; then the store takes the holder's release again:
/// its give-back must find the key resolved and leave it (the resolution is final).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s4_sweeper_applied_before_the_set_aside_give_back_stands() {
    let rig = Rig::new(MemoryStore::new());
    let effects = Effects::default();
    let key = unique("sweep-first");
    let addr = set_aside_503(&rig, &effects, &key).await;
    let report = Sweeper::new(
        rig.clone(),
        Says(Reconciliation::Applied(Box::new(created("swept")))),
    )
    .run_once()
    .await
    .expect("sweep");
    assert_eq!(report.applied, 1, "{report:?}\n  {}", rig.log());
    rig.always("release", Act::Pass);
    rig.always("renew", Act::Pass);
    assert!(
        within(Duration::from_secs(6), async || rig
            .logged("release", "fenced")
            >= 1)
        .await,
        "the holder's give-back reaches the resolved record\n  {}",
        rig.log()
    );
    tokio::time::sleep(ms(300)).await;
    let later = ask(addr, &key).await;
    assert!(
        later.is_replay_of("swept"),
        "the sweeper's resolution must stand: {later:?}; history {:?}",
        history(&record_of(&rig, &key).await)
    );
    assert_eq!(effects.count(), 0);
}

/// The reconciler is slow; meanwhile the holder gives the key back ("not applied", under its
/// own token). The sweeper's resolution, made for the attempt it listed, must be refused
/// (counted as raced), not settle the key the holder already gave back, nor a retry's attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s4_sweeper_slow_while_the_set_aside_give_back_lands_is_raced() {
    let rig = Rig::new(MemoryStore::new());
    let effects = Effects::default();
    let key = unique("give-back-first");
    let addr = set_aside_503(&rig, &effects, &key).await;
    let sweeper = Sweeper::new(
        rig.clone(),
        Slow(
            ms(1_500),
            Reconciliation::Applied(Box::new(created("swept late"))),
        ),
    );
    let sweep = tokio::spawn(async move { sweeper.run_once().await });
    tokio::time::sleep(ms(200)).await;
    rig.always("release", Act::Pass);
    rig.always("renew", Act::Pass);
    assert!(
        within(Duration::from_secs(6), async || is_status(
            &rig,
            &key,
            RecordStatus::Released
        )
        .await)
        .await,
        "the holder gives the key back\n  {}",
        rig.log()
    );
    let report = tokio::time::timeout(Duration::from_secs(20), sweep)
        .await
        .expect("the sweep ends")
        .expect("task")
        .expect("sweep");
    let record = record_of(&rig, &key).await;
    assert_eq!(
        (report.applied, report.raced),
        (0, 1),
        "{report:?}: history {:?}",
        history(&record)
    );
    let later = ask(addr, &key).await;
    assert!(
        later.is_live() && effects.count() == 1,
        "the key given back runs once: {later:?}"
    );
}

// ==== 3. removal and purge of keys in flight or uncertain =====================================

/// Console `POST /api/remove` while the first holder still runs: documented ("delete one
/// record; its next request runs as new"), so a retry runs. What must hold: the first holder's
/// late write does not overwrite the retry's record; retries replay the retry's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s4_console_remove_of_a_key_in_flight_then_a_retry_keeps_the_newer_record() {
    let rig = Rig::new(MemoryStore::new());
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(400)),
        sleep_then_effect(&effects, ms(1_200), false),
    )
    .await;
    let ops = console(&rig).await;
    let key = unique("remove-in-flight");
    let first = holding(&rig, addr, &key).await;
    let (status, body) = api(
        ops,
        "/api/remove",
        json!({"scope": "", "key": key, "reason": "stuck"}),
    )
    .await;
    assert_eq!(
        (status, body["removed"].clone()),
        (200, json!(true)),
        "{body}"
    );
    let second = ask(addr, &key).await;
    assert!(second.is_live(), "the next request runs as new: {second:?}");
    let first = first.await.expect("task").expect("answered");
    assert!(first.is_live(), "{first:?}");
    let replay = ask(addr, &key).await;
    println!("first {first:?} second {second:?} replay {replay:?}");
    assert!(
        replay.is_replay_of(&second.body),
        "the removed holder's late write replaced the newer record: {replay:?}; history {:?}",
        history(&record_of(&rig, &key).await)
    );
    assert_eq!(
        effects.count(),
        2,
        "documented: removal lets the key run again"
    );
}

/// The holder's record write fails and it retries; the operator removes the uncertain key.
/// The recorder must not bring the record back (its write is fenced: the record is gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s4_console_remove_of_an_uncertain_key_is_not_undone_by_the_recorder() {
    let rig = Rig::new(MemoryStore::new());
    rig.always("complete", Act::Fail);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(400)),
        sleep_then_effect(&effects, Duration::ZERO, false),
    )
    .await;
    let ops = console(&rig).await;
    let key = unique("remove-uncertain");
    assert!(ask(addr, &key).await.is_live());
    assert!(
        eventually(async || is_status(&rig, &key, RecordStatus::NeedsReconciliation).await).await
    );
    let (status, body) = api(
        ops,
        "/api/remove",
        json!({"scope": "", "key": key, "reason": "test data"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let before = rig.count("complete");
    rig.always("complete", Act::Pass);
    assert!(
        within(Duration::from_secs(6), async || rig.count("complete")
            > before)
        .await,
        "the recorder tries again"
    );
    tokio::time::sleep(ms(200)).await;
    assert_eq!(
        status_of(&rig, &key).await,
        None,
        "the recorder brought a removed record back: {:?}",
        history(&record_of(&rig, &key).await)
    );
}

/// `POST /purge` (form) and `/api/purge` with a short route TTL: an uncertain key (effect
/// started) and a key in flight are past their TTL; neither may be purged, and retries get
/// outcome-unknown / in-flight, never a second run (README: "Such records never expire").
async fn s4_console_purge_never_removes_a_key_in_flight_or_uncertain<S: IdempotencyStore>(
    store: S,
    name: &str,
) {
    let rig = Rig::new(store);
    let effects = Effects::default();
    let effects2 = effects.clone();
    let h = handler(move |_, ctx| {
        let effects = effects2.clone();
        async move {
            ctx.effect_started().await.expect("milestone");
            effects.hit();
            if ctx.key() == "slow" || ctx.key().starts_with("slow-") {
                tokio::time::sleep(ms(2_000)).await;
                return (StatusCode::CREATED, "slow done".to_owned());
            }
            (StatusCode::BAD_GATEWAY, "provider timed out".to_owned())
        }
    });
    let layer = layer(&rig, Route::plain(ms(300))).defaults(|r| r.ttl(ms(100)));
    let addr = serve(app(layer, h)).await;
    let ops = console(&rig).await;
    let uncertain = unique("purge-uncertain");
    let slow = unique("slow");
    assert_eq!(ask(addr, &uncertain).await.status, 502);
    let in_flight = hang_up_later(addr, &slow);
    assert!(
        within(Duration::from_secs(5), async || is_status(
            &rig,
            &slow,
            RecordStatus::InProgress
        )
        .await)
        .await,
        "[{name}]"
    );
    tokio::time::sleep(ms(400)).await;
    let same = format!("http://{ops}");
    let purged = form(ops, "/purge", &[("origin", same)], &[]).await;
    assert_eq!(purged, 303, "[{name}]");
    let (status, body) = api(ops, "/api/purge", json!({})).await;
    assert_eq!(status, 200, "[{name}] {body}");
    assert_eq!(
        status_of(&rig, &uncertain).await,
        Some(RecordStatus::NeedsReconciliation),
        "[{name}] an uncertain key was purged"
    );
    let retry = ask(addr, &uncertain).await;
    assert_eq!(retry.problem, "outcome-unknown", "[{name}] {retry:?}");
    let retry_slow = ask(addr, &slow).await;
    assert!(retry_slow.in_flight(), "[{name}] {retry_slow:?}");
    let first = in_flight.await.expect("task").expect("answered");
    assert_eq!(first.body, "slow done", "[{name}]");
    assert_eq!(effects.count(), 2, "[{name}] a purged key ran again");
}
on_stores!(s4_console_purge_never_removes_a_key_in_flight_or_uncertain);

// ==== 4. resolving a key whose holder still runs ==============================================

/// `resolve_by_hand` docs: "Refused with StoreError::Fenced if the key is not uncertain (a live
/// holder, or already settled)". The console's record page and API on a key whose holder runs
/// under a live lease: the resolution is refused (409) and the holder's answer is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s4_console_resolve_of_a_live_holder_is_refused() {
    let rig = Rig::new(MemoryStore::new());
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(400)),
        sleep_then_effect(&effects, ms(1_500), false),
    )
    .await;
    let ops = console(&rig).await;
    let key = unique("live-holder");
    let first = holding(&rig, addr, &key).await;
    // The record page offers no resolution the store would refuse, and says why.
    let (status, page) = get(ops, &format!("/record?scope=&key={key}")).await;
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains("id=\"held\"") && !page.contains("resolve-applied"),
        "a live holder's page offers resolve forms: {page:.2000}"
    );
    for outcome in ["applied", "not_applied"] {
        let (status, body) = api(ops, "/api/resolve", resolve_body(&key, outcome)).await;
        assert_eq!(status, 409, "{outcome}: {body}");
    }
    let by_hand = resolve_by_hand(
        &*rig,
        &ScopedKey::new("", &key),
        Reconciliation::NotApplied,
        Duration::from_secs(60),
        "by hand",
    )
    .await;
    assert!(
        by_hand.is_err(),
        "resolve_by_hand settled a live holder's key"
    );
    let first = first.await.expect("task").expect("answered");
    let replay = ask(addr, &key).await;
    assert!(replay.is_replay_of(&first.body), "{first:?} {replay:?}");
    assert_eq!(effects.count(), 1);
}

/// A holder on a `Reconcile` route whose renewals fail (partitioned) while its handler still
/// runs: its lapsed lease lists the key; the operator resolves it "applied" by hand. The module
/// docs allow this ("resolved while that holder is still alive") and promise finality: the
/// holder's answer, when it comes, must not replace the operator's, and nothing runs again.
async fn s4_console_resolve_of_a_lapsed_but_running_holder_is_final<S: IdempotencyStore>(
    store: S,
    name: &str,
) {
    let rig = Rig::new(store);
    rig.doom(0);
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(300)).reconcile(),
        sleep_then_effect(&effects, ms(1_500), false),
    )
    .await;
    let ops = console(&rig).await;
    let key = unique("lapsed-running");
    let first = hang_up_later(addr, &key);
    // Listed once its lease is over.
    assert!(
        within(Duration::from_secs(5), async || {
            let (_, text) = get(ops, "/api/uncertain?limit=500").await;
            text.contains(&key)
        })
        .await,
        "[{name}] the lapsed holder's key is listed\n  {}",
        rig.log()
    );
    let mut body = resolve_body(&key, "applied");
    body["status"] = json!(201);
    body["body"] = json!("operator");
    let (status, answer) = api(ops, "/api/resolve", body).await;
    assert_eq!(status, 200, "[{name}] {answer}");
    let first = first.await.expect("task").expect("answered");
    println!("[{name}] the holder's own client got {first:?}");
    tokio::time::sleep(ms(300)).await;
    let replay = ask(addr, &key).await;
    assert!(
        replay.is_replay_of("operator"),
        "[{name}] the holder's late write replaced the resolution: {replay:?}; history {:?}",
        history(&record_of(&rig, &key).await)
    );
    assert_eq!(effects.count(), 1, "[{name}]");
}
on_stores!(s4_console_resolve_of_a_lapsed_but_running_holder_is_final);

// ==== 5. answers while uncertain and after a resolution =======================================

/// DESIGN §1 step 6: a mismatch is reported before any in-flight state (422, not 409); while
/// uncertain the retry gets 409 outcome-unknown with `safe_new_key: false`; after a resolution
/// "applied" the retry gets the resolved replay (its status, its body, the replay marker), a
/// mismatched body still 422.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s1_answers_while_uncertain_and_after_resolution() {
    let rig = Rig::new(MemoryStore::new());
    let effects = Effects::default();
    let addr = server(
        &rig,
        Route::plain(ms(400)),
        effect_then(&effects, StatusCode::BAD_GATEWAY),
    )
    .await;
    let ops = console(&rig).await;
    let key = unique("answers");
    assert_eq!(ask(addr, &key).await.status, 502);
    let mismatch = ask_body(addr, &key, r#"{"amount":11}"#).await;
    assert_eq!(mismatch.status, 422, "{mismatch:?}");
    let unknown = http()
        .post(format!("http://{addr}/op"))
        .header("idempotency-key", &key)
        .header("content-type", "application/json")
        .body(r#"{"amount":10}"#)
        .send()
        .await
        .expect("send");
    assert_eq!(unknown.status(), 409);
    assert!(
        unknown.headers().get("retry-after").is_none(),
        "no auto-retry hint"
    );
    let problem: Value = unknown.json().await.expect("json");
    assert_eq!(problem["safe_new_key"], json!(false), "{problem}");
    let mut body = resolve_body(&key, "applied");
    body["status"] = json!("202");
    body["content_type"] = json!("application/json");
    body["body"] = json!(r#"{"charge":"ch_1"}"#);
    let (status, answer) = api(ops, "/api/resolve", body).await;
    assert_eq!(status, 200, "{answer}");
    let replay = ask(addr, &key).await;
    assert_eq!(
        (replay.status, replay.replayed, replay.body.as_str()),
        (202, true, r#"{"charge":"ch_1"}"#),
        "{replay:?}"
    );
    // Key order does not matter (canonical JSON), values do.
    let reordered = ask_body(addr, &key, r#"{ "amount" : 10 }"#).await;
    assert!(reordered.replayed, "{reordered:?}");
    let mismatch = ask_body(addr, &key, r#"{"amount":12}"#).await;
    assert_eq!(mismatch.status, 422, "{mismatch:?}");
    // Resolving again is refused: settled.
    let (again, _) = api(ops, "/api/resolve", resolve_body(&key, "not_applied")).await;
    assert_eq!(again, 409);
    assert_eq!(effects.count(), 1);
}

// ==== 6. the resolution note in incident review ===============================================

fn claim_request(key: &ScopedKey, ttl: Duration) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        fingerprint: Fingerprint::from_bytes([3; 32]),
        lease: Duration::from_secs(60),
        ttl,
        on_lease_expiry: LeaseExpiry::Reconcile,
    }
}

async fn acquired<S: IdempotencyStore>(store: &S, req: &ClaimRequest) -> FencingToken {
    match store.claim(req).await.expect("claim") {
        Claim::Acquired(lease) => lease.token,
        other => panic!("not acquired: {other:?}"),
    }
}

/// `Record::resolution_note`: "Why the record was last resolved by hand ... shown with the
/// resolution's history entry". Attempt 1 is resolved by hand ("not applied", reason R1);
/// attempt 2 becomes uncertain and the Sweeper resolves it "applied" (no reason). The console
/// must not show the operator's R1 as the reason of the sweeper's resolution.
async fn s4_console_does_not_pin_an_old_hand_reason_on_a_sweepers_resolution<
    S: IdempotencyStore,
>(
    store: S,
    name: &str,
) {
    let rig = Rig::new(store);
    let ops = console(&rig).await;
    let key = ScopedKey::new("", unique("note"));
    let req = claim_request(&key, Duration::from_secs(600));
    let t1 = acquired(&*rig, &req).await;
    rig.mark_uncertain(&key, t1).await.expect("mark");
    let mut body = resolve_body(key.key(), "not_applied");
    body["reason"] = json!("R1: provider has no charge for attempt 1");
    let (status, answer) = api(ops, "/api/resolve", body).await;
    assert_eq!(status, 200, "[{name}] {answer}");
    let t2 = acquired(&*rig, &req).await;
    rig.mark_uncertain(&key, t2).await.expect("mark");
    let report = Sweeper::new(
        rig.clone(),
        Says(Reconciliation::Applied(Box::new(created("found it")))),
    )
    .run_once()
    .await
    .expect("sweep");
    assert_eq!(report.applied, 1, "[{name}] {report:?}");
    let (status, text) = get(ops, &format!("/api/record?scope=&key={}", key.key())).await;
    assert_eq!(status, 200, "[{name}] {text}");
    let record: Value = serde_json::from_str(&text).expect("json");
    let entries = record["history"].as_array().expect("history").clone();
    let swept = entries
        .iter()
        .rev()
        .find(|e| e["event"] == "reconciled_applied")
        .expect("the sweeper's entry");
    println!(
        "[{name}] resolution_note {} ; sweeper's entry {swept}",
        record["resolution_note"]
    );
    assert!(
        swept["note"].is_null() && record["resolution_note"].is_null(),
        "[{name}] the operator's reason for attempt 1 is shown as the reason of the sweeper's \
         resolution of attempt 2: entry {swept}, resolution_note {}",
        record["resolution_note"]
    );
}
on_stores!(s4_console_does_not_pin_an_old_hand_reason_on_a_sweepers_resolution);

/// A record resolved by hand ("applied", with a reason) expires; the key is claimed afresh
/// (attempt 1, a new history). The fresh record was never resolved: it must carry no
/// resolution note (the console shows it in the record's table).
async fn s4_a_fresh_record_after_expiry_carries_no_old_resolution_note<S: IdempotencyStore>(
    store: S,
    name: &str,
) {
    let rig = Rig::new(store);
    let ops = console_with(Console::from_arc(rig.clone()).ttl(ms(200))).await;
    let key = ScopedKey::new("", unique("old-note"));
    let req = claim_request(&key, ms(200));
    let t1 = acquired(&*rig, &req).await;
    rig.mark_uncertain(&key, t1).await.expect("mark");
    let mut body = resolve_body(key.key(), "applied");
    body["reason"] = json!("OLD-REASON");
    let (status, answer) = api(ops, "/api/resolve", body).await;
    assert_eq!(status, 200, "[{name}] {answer}");
    tokio::time::sleep(ms(700)).await;
    let _t = acquired(&*rig, &req).await;
    let record = rig.lookup(&key).await.expect("lookup").expect("record");
    println!(
        "[{name}] fresh record: attempts {} history {:?} note {:?}",
        record.attempts,
        record.history.iter().map(|h| h.event).collect::<Vec<_>>(),
        record.resolution_note
    );
    assert_eq!(record.attempts, 1, "[{name}] a fresh claim");
    let (_, page) = get(ops, &format!("/record?scope=&key={}", key.key())).await;
    assert!(
        record.resolution_note.is_none() && !page.contains("OLD-REASON"),
        "[{name}] a fresh record shows the reason of an expired record's resolution: {:?}",
        record.resolution_note
    );
}
on_stores!(s4_a_fresh_record_after_expiry_carries_no_old_resolution_note);

// ==== 7. console hostility ====================================================================

/// Console module docs: "Every write is refused (403) unless the browser says it comes from the
/// console's own origin (`Sec-Fetch-Site: same-origin`, or an `Origin` equal to the request's
/// host); the JSON API also requires `Content-Type: application/json`".
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s4_console_refuses_cross_site_writes() {
    let rig = Rig::new(MemoryStore::new());
    let ops = console(&rig).await;
    let host = format!("{ops}");
    let fields = [("scope", ""), ("key", "k"), ("reason", "r")];
    let forms: Vec<(&str, Vec<(&str, String)>)> = vec![
        ("no headers", vec![]),
        ("cross-site", vec![("sec-fetch-site", "cross-site".into())]),
        ("same-site", vec![("sec-fetch-site", "same-site".into())]),
        ("none", vec![("sec-fetch-site", "none".into())]),
        (
            "cross-site beats a same Origin",
            vec![
                ("sec-fetch-site", "cross-site".into()),
                ("origin", format!("http://{host}")),
            ],
        ),
        (
            "evil origin",
            vec![("origin", "http://evil.example".into())],
        ),
        ("null origin", vec![("origin", "null".into())]),
        ("other port", vec![("origin", "http://127.0.0.1:1".into())]),
        (
            "host as a prefix",
            vec![("origin", format!("http://{host}.evil.example"))],
        ),
    ];
    let mut wrong = Vec::new();
    for path in ["/remove", "/resolve", "/purge"] {
        for (what, headers) in &forms {
            let status = form(ops, path, headers, &fields).await;
            if status != 403 {
                wrong.push(format!("{path} {what}: {status}"));
            }
        }
    }
    // The JSON API: content types a cross-site form can send, and foreign origins.
    let json_body = json!({"scope": "", "key": "k", "reason": "r"}).to_string();
    let cases: Vec<(&str, Headers, u16)> = vec![
        (
            "text/plain",
            vec![("content-type", "text/plain".into())],
            415,
        ),
        (
            "form",
            vec![("content-type", "application/x-www-form-urlencoded".into())],
            415,
        ),
        (
            "multipart",
            vec![("content-type", "multipart/form-data; boundary=x".into())],
            415,
        ),
        (
            "json lookalike",
            vec![("content-type", "application/jsonx".into())],
            415,
        ),
        (
            "evil origin",
            vec![
                ("content-type", "application/json".into()),
                ("origin", "http://evil.example".into()),
            ],
            403,
        ),
        (
            "cross-site",
            vec![
                ("content-type", "application/json".into()),
                ("sec-fetch-site", "cross-site".into()),
            ],
            403,
        ),
    ];
    for path in ["/api/remove", "/api/resolve", "/api/purge"] {
        for (what, headers, want) in &cases {
            let mut req = http()
                .post(format!("http://{ops}/ops{path}"))
                .body(json_body.clone());
            for (n, v) in headers {
                req = req.header(*n, v.as_str());
            }
            let status = req.send().await.expect("post").status().as_u16();
            if status != *want {
                wrong.push(format!("{path} {what}: {status}, wanted {want}"));
            }
        }
    }
    assert!(wrong.is_empty(), "writes not refused: {wrong:#?}");
}

/// "the console's own origin": an Origin differing from the console's only by scheme (an
/// `ftp://` or `ws://` page of the same host and port, as a legacy browser without
/// `Sec-Fetch-Site` sends it) is another origin. (An `https://` page of the same host and port
/// cannot be told apart over HTTP/1.1, which does not send the scheme: documented on the
/// console; `Sec-Fetch-Site` does.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s4_console_origin_check_counts_the_scheme() {
    let rig = Rig::new(MemoryStore::new());
    let ops = console(&rig).await;
    let fields = [("reason", "r")];
    let mut allowed = Vec::new();
    for scheme in ["ftp", "ws", "chrome-extension", "null"] {
        let origin = format!("{scheme}://{ops}");
        // Past the origin check, the purge runs and answers 303.
        let status = form(ops, "/purge", &[("origin", origin.clone())], &fields).await;
        if status != 403 {
            allowed.push(format!("Origin {origin}: {status}"));
        }
    }
    assert!(
        allowed.is_empty(),
        "a foreign-scheme Origin passes as the console's own (served over http): {allowed:?}"
    );
}

/// Console module docs: "Every stored byte shown in HTML is escaped." Keys, scopes, downstream
/// ids, header values and bodies with markup, quotes and control bytes; the list page, the
/// record page, and the no-record page.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s4_console_escapes_hostile_bytes() {
    let rig = Rig::new(MemoryStore::new());
    let ops = console(&rig).await;
    let evil_scope = "\"><img src=x onerror=alert(1)>\0\r\n";
    let evil_key = "<script>alert('k')</script>&\"'";
    let key = ScopedKey::new(evil_scope, evil_key);
    let req = ClaimRequest {
        lease: Duration::from_millis(1),
        ..claim_request(&key, Duration::from_secs(600))
    };
    let t = acquired(&*rig, &req).await;
    rig.record_milestone(
        &key,
        t,
        &tower_idempotency::store::Milestone::DownstreamId("<iframe src=//evil>".into()),
    )
    .await
    .expect("downstream id");
    rig.mark_uncertain(&key, t).await.expect("mark");
    // A second record, completed with a hostile stored response.
    let done = ScopedKey::new(evil_scope, "done");
    let t = acquired(&*rig, &claim_request(&done, Duration::from_secs(600))).await;
    let mut headers = axum::http::HeaderMap::new();
    headers.insert(
        "x-evil",
        axum::http::HeaderValue::from_static("<svg onload=alert(2)>"),
    );
    let response = StoredResponse {
        status: StatusCode::CREATED,
        headers,
        body: Some("</pre><script>alert(3)</script>".into()),
        trailers: None,
    };
    rig.complete(&done, t, &response, Duration::from_secs(600))
        .await
        .expect("complete");
    let enc = |s: &str| form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>();
    let pages = [
        get(ops, "").await,
        get(
            ops,
            &format!("/record?scope={}&key={}", enc(evil_scope), enc(evil_key)),
        )
        .await,
        get(ops, &format!("/record?scope={}&key=done", enc(evil_scope))).await,
        get(
            ops,
            &format!("/record?scope={}&key=absent%3Cb%3E", enc(evil_scope)),
        )
        .await,
    ];
    let mut raw = Vec::new();
    for (i, (status, page)) in pages.iter().enumerate() {
        assert!(*status == 200 || *status == 404, "page {i}: {status}");
        for needle in [
            "<script",
            "<img",
            "<iframe",
            "<svg",
            "<b>",
            "onerror=alert(1)>",
        ] {
            if page.contains(needle) {
                raw.push(format!("page {i} holds {needle:?}"));
            }
        }
    }
    assert!(
        pages[0].1.contains(&key_text_escaped(evil_key)),
        "the key is listed, escaped"
    );
    assert!(raw.is_empty(), "unescaped markup: {raw:?}");
}

fn key_text_escaped(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&#39;")
}

/// Malformed and huge listing parameters and keys on every store: a clear 4xx (or a page),
/// never a 5xx nor a panic. Cursors the console never gave out are 400.
async fn s4_console_hostile_query_params_are_4xx_never_5xx<S: IdempotencyStore>(
    store: S,
    name: &str,
) {
    let rig = Rig::new(store);
    let ops = console(&rig).await;
    // One uncertain record so listings have something to page past.
    let key = ScopedKey::new("", unique("listed"));
    let t = acquired(&*rig, &claim_request(&key, Duration::from_secs(600))).await;
    rig.mark_uncertain(&key, t).await.expect("mark");
    let huge_cursor = format!("1~{}~{}", "%FF".repeat(2_000), "a".repeat(6_000));
    let long_key = "k".repeat(4_000);
    let bad_cursors = [
        "".to_owned(),
        "~".to_owned(),
        "abc".to_owned(),
        "99999999999999999999999~a~b".to_owned(),
        "1.5~a~b".to_owned(),
        "1~a".to_owned(),
    ];
    let odd_but_valid = [
        "18446744073709551615~a~b".to_owned(),
        // Before the epoch: a time written by hand into a SQL store may be.
        "-1~a~b".to_owned(),
        "-18446744073709551615~a~b".to_owned(),
        "0~%FF%FE~%00%0D%0A".to_owned(),
        "1~~".to_owned(),
        "+5~a~b".to_owned(),
        huge_cursor,
    ];
    let mut wrong = Vec::new();
    for base in ["/api/uncertain", ""] {
        for cursor in &bad_cursors {
            let path = format!(
                "{base}?after={}",
                form_urlencoded::byte_serialize(cursor.as_bytes()).collect::<String>()
            );
            let (status, _) = get(ops, &path).await;
            if status != 400 {
                wrong.push(format!("{base} after={cursor:.40}: {status}, wanted 400"));
            }
        }
        for cursor in &odd_but_valid {
            for order in ["oldest", "newest"] {
                let path = format!(
                    "{base}?order={order}&after={}",
                    form_urlencoded::byte_serialize(cursor.as_bytes()).collect::<String>()
                );
                let (status, text) = get(ops, &path).await;
                if status >= 500 {
                    wrong.push(format!(
                        "{base} {order} after={cursor:.40}: {status} {text:.200}"
                    ));
                }
            }
        }
        for query in [
            "limit=0",
            "limit=-1",
            "limit=99999999999999999999999",
            "limit=18446744073709551615",
            "order=%00",
            "order=newest&limit=1",
            "after=%ZZ",
            "after=1~%ZZ~%",
        ] {
            let (status, text) = get(ops, &format!("{base}?{query}")).await;
            if status >= 500 {
                wrong.push(format!("{base}?{query}: {status} {text:.200}"));
            }
        }
    }
    for path in [
        "/record".to_owned(),
        "/record?key=".to_owned(),
        "/record?ref=%FF~%FF".to_owned(),
        "/record?ref=nothing".to_owned(),
        format!("/record?scope=&key={long_key}"),
        "/record?scope=%FF&key=%FE".to_owned(),
        "/api/record".to_owned(),
        "/api/record?ref=~".to_owned(),
        format!("/api/record?scope=&key={long_key}"),
        "/api/record?scope=%00&key=%00".to_owned(),
    ] {
        let (status, text) = get(ops, &path).await;
        if !(400..500).contains(&status) {
            wrong.push(format!("{path:.60}: {status} {text:.200}"));
        }
    }
    println!("[{name}] {wrong:#?}");
    assert!(wrong.is_empty(), "[{name}] not a clear 4xx: {wrong:#?}");
}
on_stores!(s4_console_hostile_query_params_are_4xx_never_5xx);

/// `POST /api/resolve` with a status outside what is allowed, or with fields of the wrong JSON
/// type, must be refused (400) and leave the key uncertain, never settle it with a default.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s4_console_resolve_with_a_status_or_fields_outside_what_is_allowed_is_refused() {
    let rig = Rig::new(MemoryStore::new());
    let ops = console(&rig).await;
    let key = ScopedKey::new("", unique("bad-status"));
    let t = acquired(&*rig, &claim_request(&key, Duration::from_secs(600))).await;
    rig.mark_uncertain(&key, t).await.expect("mark");
    let mut accepted = Vec::new();
    let bad: Vec<(&str, Value)> = vec![
        ("status", json!("600")),
        ("status", json!("99")),
        ("status", json!("0")),
        ("status", json!("-200")),
        ("status", json!("65736")),
        ("status", json!("2e2")),
        ("status", json!(600)),
        ("status", json!(250.0)),
        ("status", json!(101)),
        ("status", json!([600])),
        ("status", json!({"code": 600})),
        ("status", json!(true)),
        ("body", json!({"charge": "ch_1"})),
        ("body", json!(["x"])),
        ("content_type", json!("text/plain\r\nx-evil: 1")),
        ("content_type", json!(["application/json"])),
        ("token", json!(true)),
        ("token", json!([1])),
        ("token", json!("-1")),
        ("outcome", json!(["applied"])),
        ("outcome", json!("Applied")),
        ("reason", json!("   ")),
        ("reason", json!(["r"])),
    ];
    for (field, value) in bad {
        let mut body = resolve_body(key.key(), "applied");
        body[field] = value.clone();
        let (status, answer) = api(ops, "/api/resolve", body).await;
        if status != 400 {
            let record = rig.lookup(&key).await.expect("lookup");
            accepted.push(format!(
                "{field}={value}: {status} -> record {:?} response {:?}",
                record.as_ref().map(|r| r.status),
                record
                    .as_ref()
                    .and_then(|r| r.response.as_ref())
                    .map(|r| (r.status, r.body.clone()))
            ));
            let _ = answer;
            // Put the key back to uncertain for the next case.
            if record.is_some_and(|r| r.status != RecordStatus::NeedsReconciliation) {
                let _ = rig.remove(&key).await;
                let t = acquired(&*rig, &claim_request(&key, Duration::from_secs(600))).await;
                rig.mark_uncertain(&key, t).await.expect("mark");
            }
        }
    }
    assert!(accepted.is_empty(), "accepted: {accepted:#?}");
}

/// Console module docs: "The reason of a resolution by hand is kept with the record
/// (`Record::resolution_note`)"; README: "the reason is kept with the record". A key whose
/// effect started waits for reconciliation longer than its route's TTL (it never expires while
/// uncertain); the operator then resolves it "not applied" with a reason. The record, its
/// history and the reason must still be there for review (as "released"), not vanish at once.
async fn s4_a_hand_resolution_of_an_old_uncertain_key_keeps_its_reason<S: IdempotencyStore>(
    store: S,
    name: &str,
) {
    let rig = Rig::new(store);
    let effects = Effects::default();
    let layer = layer(&rig, Route::plain(ms(300))).defaults(|r| r.ttl(ms(200)));
    let addr = serve(app(layer, effect_then(&effects, StatusCode::BAD_GATEWAY))).await;
    let ops = console(&rig).await;
    let key = unique("old-uncertain");
    assert_eq!(ask(addr, &key).await.status, 502, "[{name}]");
    // Waits past its TTL: still uncertain (never expires).
    tokio::time::sleep(ms(700)).await;
    assert_eq!(
        status_of(&rig, &key).await,
        Some(RecordStatus::NeedsReconciliation),
        "[{name}]"
    );
    let mut body = resolve_body(&key, "not_applied");
    body["reason"] = json!("INCIDENT-42: provider shows no charge");
    let (status, answer) = api(ops, "/api/resolve", body).await;
    println!("[{name}] resolve answered {status} {answer}");
    assert_eq!(status, 200, "[{name}] {answer}");
    let (status, text) = get(ops, &format!("/api/record?scope=&key={key}")).await;
    println!("[{name}] the record after the resolution: {status} {text:.300}");
    assert!(
        status == 200 && text.contains("INCIDENT-42"),
        "[{name}] the resolved record and its reason are gone at once: {status} {text:.300}"
    );
}
on_stores!(s4_a_hand_resolution_of_an_old_uncertain_key_keeps_its_reason);

/// Console docs: `POST /api/resolve` takes "JSON bodies of the same fields" as the form, whose
/// `token` names the attempt a resolution was made for ("a form loaded before a retry must not
/// settle the retry"). A script that reads `/api/record` and then resolves must be able to
/// send that token: the record's JSON must carry it. Without it the API resolves whatever
/// attempt holds the key at the time of the write.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s4_console_api_record_gives_the_token_its_resolution_needs() {
    let rig = Rig::new(MemoryStore::new());
    let ops = console(&rig).await;
    let key = ScopedKey::new("", unique("api-token"));
    let req = claim_request(&key, Duration::from_secs(600));
    let t1 = acquired(&*rig, &req).await;
    rig.mark_uncertain(&key, t1).await.expect("mark");
    let (_, text) = get(ops, &format!("/api/record?scope=&key={}", key.key())).await;
    let read: Value = serde_json::from_str(&text).expect("json");
    let token = ["token", "lease_token"]
        .iter()
        .find_map(|f| read.get(*f).cloned());
    // Attempt 1 is settled and attempt 2 becomes uncertain before the script's write.
    resolve_by_hand(
        &*rig,
        &key,
        Reconciliation::NotApplied,
        Duration::from_secs(60),
        "sweep",
    )
    .await
    .expect("resolve");
    let t2 = acquired(&*rig, &req).await;
    rig.mark_uncertain(&key, t2).await.expect("mark");
    let mut body = resolve_body(key.key(), "applied");
    if let Some(token) = &token {
        body["token"] = token.clone();
    }
    let (status, _) = api(ops, "/api/resolve", body).await;
    let now = rig.lookup(&key).await.expect("lookup").expect("record");
    println!(
        "token read: {token:?}; resolve answered {status}; attempt 2 now {:?}",
        now.status
    );
    assert!(
        token.is_some() && status == 409 && now.status == RecordStatus::NeedsReconciliation,
        "the API gives out no token (fields {:?}), so a resolution read for attempt 1 settled \
         attempt 2: {status}, {:?}",
        read.as_object()
            .map(|o| o.keys().cloned().collect::<Vec<_>>()),
        now.status
    );
}

// ---- session 51's review of the console: what a stale page, a failing store or a careless
// script could settle or remove ------------------------------------------------------------

/// An uncertain record of a fresh key on `rig`, and its token.
async fn uncertain<S: IdempotencyStore>(rig: &Rig<S>, name: &str) -> (ScopedKey, FencingToken) {
    let key = ScopedKey::new("", unique(name));
    let token = acquired(rig, &claim_request(&key, Duration::from_secs(600))).await;
    rig.mark_uncertain(&key, token).await.expect("mark");
    (key, token)
}

/// DESIGN §4 (reconciliation by hand; the console answers a failed store with a typed error,
/// never a page that did nothing): a record's page read while the store fails is a 503 with
/// nothing to remove. Before, any failed read showed "this record cannot be read" with a
/// Remove button, over a record that was intact: removed, its next retry runs the effect
/// again. A record that is there but does not decode (a row written by something else) still
/// gets its page and its Remove form.
#[tokio::test]
async fn s4_console_record_page_while_the_store_fails_offers_nothing_to_remove() {
    let rig = Rig::new(MemoryStore::new());
    let ops = console(&rig).await;
    let (key, _) = uncertain(&rig, "page-down").await;
    let path = format!("/record?scope=&key={}", key.key());
    rig.on("lookup", rig.count("lookup") + 1, Act::Fail);
    let (status, page) = get(ops, &path).await;
    assert_eq!(status, 503, "{page}");
    assert!(!page.contains("id=\"remove\""), "a Remove form: {page}");
    assert!(rig.lookup(&key).await.expect("lookup").is_some());
    let (status, page) = get(ops, &path).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("id=\"remove\""), "{page}");

    // A row that does not decode, on a real SQLite file.
    let (_rig, ops, key, pool) = sqlite_console("console-corrupt", "page-corrupt").await;
    set_row(&pool, &key, "fingerprint = X'0102'").await;
    shown_unreadable(ops, &key).await;
}

/// DESIGN §4: a removal asked from a record's page names the attempt the page showed (its
/// `token`); once the record has moved on (settled by the sweeper or another operator), the
/// stale page's Remove is refused (409) and the settled outcome stays for its retries to
/// replay. Before, the token was ignored and the record was deleted. Through the form and the
/// API; the page's own fields are posted back as a browser would.
#[tokio::test]
async fn s4_console_remove_from_a_stale_page_keeps_the_settled_record() {
    for api_write in [false, true] {
        let rig = Rig::new(MemoryStore::new());
        let ops = console(&rig).await;
        let (key, token) = uncertain(&rig, "stale-remove").await;
        let (_, page) = get(ops, &format!("/record?scope=&key={}", key.key())).await;
        assert!(
            page.contains(&format!("name=\"token\" value=\"{}\"", token.get())),
            "{page}"
        );
        resolve_by_hand(
            &*rig,
            &key,
            Reconciliation::NotApplied,
            Duration::from_secs(600),
            "the sweeper",
        )
        .await
        .expect("resolve");
        let reference = format!("~{}", key.key());
        let token_text = token.get().to_string();
        let status = if api_write {
            let body = json!({"ref": reference, "token": token_text, "reason": "stuck"});
            api(ops, "/api/remove", body).await.0
        } else {
            let same = vec![("sec-fetch-site", "same-origin".to_owned())];
            let fields = [
                ("ref", reference.as_str()),
                ("token", token_text.as_str()),
                ("reason", "stuck"),
            ];
            form(ops, "/remove", &same, &fields).await
        };
        let left = rig.lookup(&key).await.expect("lookup");
        assert_eq!(status, 409, "api {api_write}");
        assert_eq!(
            left.map(|r| r.status),
            Some(RecordStatus::Released),
            "api {api_write}: the settled record stays"
        );
        // The same removal for the attempt and state there are now goes through.
        let now = rig.lookup(&key).await.expect("lookup").expect("record");
        let body = json!({
            "ref": reference,
            "token": now.lease_token.get().to_string(),
            "state": now.status.as_str(),
            "reason": "x",
        });
        assert_eq!(api(ops, "/api/remove", body).await.0, 200);
        assert!(rig.lookup(&key).await.expect("lookup").is_none());
    }
}

/// DESIGN §4: the JSON API refuses what it would otherwise read as absent, so a script's
/// mistake never widens a resolution to "whichever attempt holds the key now": a misspelt
/// token (`lease_token`, `Token`), an empty one, a field it does not take, and a `ref` beside
/// a `scope` or `key` it would silently override (another tenant's record). Each is a 400 and
/// the uncertain record stays as it was; the same body spelt right settles it.
#[tokio::test]
async fn s4_console_api_refuses_fields_it_would_read_as_absent() {
    let rig = Rig::new(MemoryStore::new());
    let ops = console(&rig).await;
    let (key, token) = uncertain(&rig, "api-fields").await;
    let token = token.get().to_string();
    let base = || resolve_body(key.key(), "not_applied");
    let with = |name: &str, value: Value| {
        let mut body = base();
        body[name] = value;
        body
    };
    let mut referenced = base();
    referenced["ref"] = json!(format!("other~{}", key.key()));
    for body in [
        with("lease_token", json!(token)),
        with("Token", json!(token)),
        with("token", json!("")),
        with("attempt", json!(1)),
        referenced,
    ] {
        let (status, problem) = api(ops, "/api/resolve", body.clone()).await;
        assert_eq!(status, 400, "{body}: {problem}");
        let record = rig.lookup(&key).await.expect("lookup").expect("record");
        assert_eq!(record.status, RecordStatus::NeedsReconciliation, "{body}");
    }
    let body = json!({"scope": "", "key": key.key(), "token": "", "reason": "x"});
    assert_eq!(api(ops, "/api/remove", body).await.0, 400);
    let body = json!({"scope": "", "key": key.key(), "reason": "x", "why": "y"});
    assert_eq!(api(ops, "/api/remove", body).await.0, 400);
    assert!(rig.lookup(&key).await.expect("lookup").is_some());
    let (status, _) = api(ops, "/api/resolve", with("token", json!(token))).await;
    assert_eq!(status, 200);
    let record = rig.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(record.status, RecordStatus::Released);
}

/// DESIGN §4: a resolution that landed is answered as done even when the read that shows the
/// record afterwards fails: a 503 would read as "not done", and a script that resolves again
/// (without its token) could settle a later attempt.
#[tokio::test]
async fn s4_console_api_resolve_that_landed_is_answered_done_when_the_read_after_fails() {
    let rig = Rig::new(MemoryStore::new());
    let ops = console(&rig).await;
    let (key, token) = uncertain(&rig, "resolve-read-fails").await;
    let mut body = resolve_body(key.key(), "not_applied");
    body["token"] = json!(token.get().to_string());
    // The resolution reads nothing first (it has its token): the next read is the one after.
    rig.on("lookup", rig.count("lookup") + 1, Act::Fail);
    let (status, answer) = api(ops, "/api/resolve", body).await;
    assert_eq!(
        (status, &answer["resolved"]),
        (200, &json!(true)),
        "{answer}"
    );
    let record = rig.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(record.status, RecordStatus::Released);
}

/// DESIGN §4 (resolutions by hand and by the sweeper) and §5 (every store): a resolution kept
/// "for ever" (`Duration::MAX`, on the console, `resolve_by_hand` or the sweeper) is kept for
/// `LONGEST`, as a route's TTL is, and lands on every store. Before, it was handed on as it
/// was: `now() + interval` overflows in SQL, so every resolution failed (503) and the key
/// stayed uncertain.
async fn s4_resolutions_kept_for_ever_land<S: IdempotencyStore>(store: S, name: &str) {
    let rig = Rig::new(store);
    let ops = console_with(Console::from_arc(rig.clone()).ttl(Duration::MAX)).await;
    let (key, token) = uncertain(&rig, &format!("ttl-max-console-{name}")).await;
    let mut body = resolve_body(key.key(), "applied");
    body["token"] = json!(token.get().to_string());
    let (status, answer) = api(ops, "/api/resolve", body).await;
    assert_eq!(status, 200, "{name}: {answer}");
    let record = rig.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(record.status, RecordStatus::Completed, "{name}");

    let (key, _) = uncertain(&rig, &format!("ttl-max-hand-{name}")).await;
    resolve_by_hand(
        &*rig,
        &key,
        Reconciliation::NotApplied,
        Duration::MAX,
        "checked",
    )
    .await
    .unwrap_or_else(|error| panic!("{name}: {error}"));
    let record = rig.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(record.status, RecordStatus::Released, "{name}");

    let (key, _) = uncertain(&rig, &format!("ttl-max-sweep-{name}")).await;
    let applied = Reconciliation::Applied(Box::new(StoredResponse {
        status: StatusCode::OK,
        headers: http::HeaderMap::new(),
        body: Some(bytes::Bytes::from_static(b"done")),
        trailers: None,
    }));
    Sweeper::new(rig.clone(), Slow(Duration::ZERO, applied))
        .ttl(Duration::MAX)
        .run_once()
        .await
        .unwrap_or_else(|error| panic!("{name}: {error}"));
    let record = rig.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(record.status, RecordStatus::Completed, "{name}");

    // And the store itself, asked by anything else (the trait is public).
    let (key, token) = uncertain(&rig, &format!("ttl-max-store-{name}")).await;
    rig.inner
        .resolve(
            &key,
            token,
            &tower_idempotency::store::Resolution::NotApplied,
            Duration::MAX,
            None,
        )
        .await
        .unwrap_or_else(|error| panic!("{name}: {error}"));
    let record = rig
        .lookup(&key)
        .await
        .expect("lookup")
        .expect("a record that reads");
    assert_eq!(record.status, RecordStatus::Released, "{name}");
}

on_stores!(s4_resolutions_kept_for_ever_land);

/// The hidden fields of a record's page (`ref`, `token`, `state`), as its forms post them.
async fn page_fields(ops: SocketAddr, key: &ScopedKey) -> Vec<(String, String)> {
    let (_, page) = get(
        ops,
        &format!("/record?scope={}&key={}", key.scope(), key.key()),
    )
    .await;
    let mut fields = Vec::new();
    for name in ["ref", "token", "state"] {
        let marker = format!("name=\"{name}\" value=\"");
        let at = page
            .find(&marker)
            .unwrap_or_else(|| panic!("no {name}: {page}"))
            + marker.len();
        let value = &page[at..at + page[at..].find('"').expect("end")];
        fields.push((name.to_owned(), value.to_owned()));
    }
    fields
}

/// DESIGN §4 (the holder keeps retrying its record; only what the store has settled is
/// final): a record set aside while its holder retries its write is shown on its page; the
/// write then lands (completed, under the same token), and the page's Remove, posted late, is
/// refused (409): the recorded outcome stays for its retries. The token alone could not tell
/// (a completion keeps it): the page sends the state it showed, and the API takes it too. Also
/// a live holder's page, whose holder completes before the Remove lands.
#[tokio::test]
async fn s4_console_remove_from_a_page_its_holder_has_completed_since_is_refused() {
    let rig = Rig::new(MemoryStore::new());
    let ops = console(&rig).await;
    let response = StoredResponse {
        status: StatusCode::CREATED,
        headers: http::HeaderMap::new(),
        body: Some(bytes::Bytes::from_static(b"paid")),
        trailers: None,
    };
    let same = vec![("sec-fetch-site", "same-origin".to_owned())];
    for (i, set_aside) in [true, false].into_iter().enumerate() {
        let key = ScopedKey::new("", unique(&format!("completed-since-{i}")));
        let token = acquired(&*rig, &claim_request(&key, Duration::from_secs(600))).await;
        if set_aside {
            rig.mark_uncertain(&key, token).await.expect("mark");
        }
        let mut fields = page_fields(ops, &key).await;
        assert_eq!(fields[1].1, token.get().to_string());
        rig.complete(&key, token, &response, Duration::from_secs(600))
            .await
            .expect("the holder's write lands");
        fields.push(("reason".to_owned(), "stuck".to_owned()));
        let posted: Vec<(&str, &str)> = fields
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            form(ops, "/remove", &same, &posted).await,
            409,
            "set aside {set_aside}"
        );
        let body: serde_json::Map<String, Value> = fields
            .iter()
            .map(|(n, v)| (n.clone(), Value::from(v.as_str())))
            .collect();
        let (status, _) = api(ops, "/api/remove", Value::Object(body)).await;
        assert_eq!(status, 409, "set aside {set_aside}");
        let record = rig.lookup(&key).await.expect("lookup").expect("kept");
        assert_eq!(
            record.status,
            RecordStatus::Completed,
            "set aside {set_aside}"
        );
    }
}

/// A console over a SQLite file of its own, an uncertain record on it, and a pool of the
/// test's own on the file, to damage the record's row by hand.
async fn sqlite_console(
    name: &str,
    key: &str,
) -> (
    Arc<Rig<tower_idempotency::store::SqliteStore>>,
    SocketAddr,
    ScopedKey,
    sqlx::SqlitePool,
) {
    let (store, path) = common::sqlite(name).await;
    let rig = Rig::new(store);
    let ops = console(&rig).await;
    let (key, _) = uncertain(&rig, key).await;
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", path.display()))
        .await
        .expect("open the file");
    (rig, ops, key, pool)
}

/// Sets `assignment` (SQL) on the row of `key`, as another tool could.
async fn set_row(pool: &sqlx::SqlitePool, key: &ScopedKey, assignment: &str) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE idempotency_records SET {assignment} WHERE key = ?"
    )))
    .bind(key.key().as_bytes())
    .execute(pool)
    .await
    .unwrap_or_else(|e| panic!("{assignment}: {e}"));
}

/// The page of `key`, asserted to show a record that cannot be read, with its Remove form.
async fn shown_unreadable(ops: SocketAddr, key: &ScopedKey) -> String {
    let (status, page) = get(ops, &format!("/record?scope=&key={}", key.key())).await;
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains("cannot be read") && page.contains("id=\"remove\""),
        "{page}"
    );
    page
}

/// DESIGN §4: a SQLite row whose column does not read as its type (text in the token's
/// integer column, as another tool could leave it) is a damaged record, shown with its Remove
/// form, not a store that failed: the record page's read names the column, as the listing
/// does.
#[tokio::test]
async fn s4_console_a_row_whose_column_does_not_read_is_shown_to_remove() {
    let (rig, ops, key, pool) = sqlite_console("console-column", "column-damage").await;
    set_row(&pool, &key, "lease_token = 'garbage'").await;
    let page = shown_unreadable(ops, &key).await;
    // The page's own form names the record's state as unreadable.
    assert!(
        page.contains("name=\"state\" value=\"unreadable\""),
        "{page}"
    );
    let same = vec![("sec-fetch-site", "same-origin".to_owned())];
    let reference = format!("~{}", key.key());
    let stale = [
        ("ref", reference.as_str()),
        ("state", "unreadable"),
        ("reason", "damaged"),
    ];
    // Mended meanwhile (by hand, or removed and claimed anew): the damaged record's removal
    // is refused, and what reads now stays.
    set_row(&pool, &key, "lease_token = 7").await;
    assert!(rig.lookup(&key).await.expect("reads").is_some());
    assert_eq!(form(ops, "/remove", &same, &stale).await, 409);
    assert!(rig.lookup(&key).await.expect("reads").is_some(), "kept");
    // Damaged again: the page's removal goes through.
    set_row(&pool, &key, "lease_token = 'garbage'").await;
    let status = form(ops, "/remove", &same, &stale).await;
    assert_eq!(status, 303);
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_records WHERE key = ?")
        .bind(key.key().as_bytes())
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(left, 0, "removed");
}

/// DESIGN §4: `/api/purge` takes no field, as its table says: a body naming a key (a script
/// that meant `/api/remove`) is refused, not read as "purge everything expired".
#[tokio::test]
async fn s4_console_api_purge_refuses_fields() {
    let rig = Rig::new(MemoryStore::new());
    let ops = console(&rig).await;
    let (status, answer) = api(ops, "/api/purge", json!({"scope": "", "key": "k"})).await;
    assert_eq!(status, 400, "{answer}");
    assert!(answer.get("purged").is_none(), "{answer}");
    let (status, answer) = api(ops, "/api/purge", json!({})).await;
    assert_eq!((status, &answer["purged"]), (200, &json!(0)), "{answer}");
}

/// A console over a Redis store of its own (`name`'s prefix), and a connection of the test's
/// to damage its records with; `None` (the test skips, or fails under CI) without Redis.
async fn redis_console(
    name: &str,
) -> Option<(
    Arc<Rig<tower_idempotency::store::RedisStore>>,
    SocketAddr,
    redis::aio::MultiplexedConnection,
)> {
    let store = common::redis(name).await?;
    let rig = Rig::new(store);
    let ops = console(&rig).await;
    let conn = redis::Client::open(common::redis_url())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("connection");
    Some((rig, ops, conn))
}

/// DESIGN §4 and §5 (Redis): a record hash damaged by hand or by another tool (fields that do
/// not parse, a field missing, another type at its key) is shown on its page as a record that
/// cannot be read, with its Remove form, and removing it removes it. Before, the lookup script
/// raised on an expiry that does not read and on another type (`WRONGTYPE`), which the page
/// could not tell from a store that failed: a 503 with nothing to remove, for a record that
/// holds its key (and, awaiting reconciliation, the alert) for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_console_damaged_redis_records_are_shown_to_remove() {
    let Some((rig, ops, mut conn)) = redis_console("console-damaged").await else {
        return;
    };
    type Damage = &'static [&'static [u8]];
    let cases: [(&str, Damage); 6] = [
        (
            "garbage resp",
            &[b"HSET", b"@", b"resp", b"\xde\xadnot a record"],
        ),
        ("missing ea", &[b"HDEL", b"@", b"ea"]),
        ("non-numeric ea", &[b"HSET", b"@", b"ea", b"tomorrow"]),
        ("unknown status", &[b"HSET", b"@", b"st", b"done"]),
        ("a string in its place", &[b"SET", b"@", b"not a hash"]),
        ("a list in its place", &[b"RPUSH", b"@", b"x"]),
    ];
    let same = vec![("sec-fetch-site", "same-origin".to_owned())];
    for (what, damage) in cases {
        let (key, _) = uncertain(&rig, "redis-damage").await;
        let [record, ..] = rig.inner.keys(&key);
        if damage[0] == b"SET" || damage[0] == b"RPUSH" {
            let _: i64 = redis::cmd("DEL")
                .arg(&record)
                .query_async(&mut conn)
                .await
                .expect("del");
        }
        let mut cmd = redis::cmd(std::str::from_utf8(damage[0]).expect("command"));
        for arg in &damage[1..] {
            cmd.arg(if *arg == b"@" { &record[..] } else { *arg });
        }
        let _: redis::Value = cmd.query_async(&mut conn).await.expect(what);
        let (status, page) = get(ops, &format!("/record?scope=&key={}", key.key())).await;
        assert_eq!(status, 200, "{what}: {page}");
        assert!(
            page.contains("cannot be read") && page.contains("id=\"remove\""),
            "{what}: {page}"
        );
        // The listing reads on past it, and names it unreadable (this store's prefix holds
        // only this test's records).
        let (status, listed) = get(ops, "/api/uncertain").await;
        assert_eq!(status, 200, "{what}: {listed}");
        let listed: Value = serde_json::from_str(&listed).expect("json");
        let named = listed["unreadable"]
            .as_array()
            .is_some_and(|u| u.iter().any(|e| e["key"] == key.key()));
        assert!(named, "{what}: {listed}");
        let (status, _) = get(ops, "/api/uncertain?order=newest").await;
        assert_eq!(status, 200, "{what}");
        let reference = format!("~{}", key.key());
        let fields = [
            ("ref", reference.as_str()),
            ("state", "unreadable"),
            ("reason", "damaged"),
        ];
        let status = form(ops, "/remove", &same, &fields).await;
        assert_eq!(status, 303, "{what}");
        let left: i64 = redis::cmd("EXISTS")
            .arg(&record)
            .query_async(&mut conn)
            .await
            .expect("exists");
        assert_eq!(left, 0, "{what}: removed");
    }
}

/// DESIGN §4 and §5 (Redis): a watched record whose lease ran out while it was damaged is still
/// listed when the listing moves it from its pending index to the uncertain one: an update time
/// that does not read (the step used to fail the listing and the count, after taking the record
/// out of the pending index, so it was never listed again) and another type at its key (listed
/// with what the server said of it). Each is shown as unreadable on every listing after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_console_damaged_redis_records_whose_lease_ran_out_are_listed() {
    let Some((rig, ops, mut conn)) = redis_console("console-pending-damaged").await else {
        return;
    };
    let mut keys = Vec::new();
    for damage in ["ua", "type"] {
        let key = ScopedKey::new("", unique(&format!("pending-{damage}")));
        let req = ClaimRequest {
            lease: ms(100),
            ..claim_request(&key, Duration::from_secs(600))
        };
        acquired(&*rig, &req).await;
        let [record, ..] = rig.inner.keys(&key);
        if damage == "ua" {
            let _: i64 = redis::cmd("HSET")
                .arg(&record)
                .arg("ua")
                .arg("yesterday")
                .query_async(&mut conn)
                .await
                .expect("hset");
        } else {
            let _: i64 = redis::cmd("DEL")
                .arg(&record)
                .query_async(&mut conn)
                .await
                .expect("del");
            let _: () = redis::cmd("SET")
                .arg(&record)
                .arg("not a hash")
                .query_async(&mut conn)
                .await
                .expect("set");
        }
        keys.push((damage, key));
    }
    tokio::time::sleep(ms(300)).await;
    for round in 0..2 {
        let (status, listed) = get(ops, "/api/uncertain").await;
        assert_eq!(status, 200, "round {round}: {listed}");
        let listed: Value = serde_json::from_str(&listed).expect("json");
        for (damage, key) in &keys {
            let entry = listed["unreadable"]
                .as_array()
                .and_then(|u| u.iter().find(|e| e["key"] == key.key()).cloned());
            let entry = entry.unwrap_or_else(|| panic!("round {round}, {damage}: {listed}"));
            if *damage == "type" {
                let error = entry["error"].as_str().unwrap_or_default();
                assert!(error.contains("WRONGTYPE"), "{error}");
            }
        }
        assert_eq!(listed["count"], json!(2), "round {round}: {listed}");
    }
}
