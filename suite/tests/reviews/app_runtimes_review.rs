//! Review: the layer under the runtime conditions an application's own test suite (and unusual
//! deployments) create. A paused tokio clock (`start_paused`, `time::pause()`), blocking work
//! where the README says it belongs (`spawn_blocking`, `block_in_place`), a store shared by
//! runtimes built and dropped one after another (a `static`, as app suites keep one), a runtime
//! dropped under a detached run.
//!
//! DESIGN §4: "The holder keeps its lease for as long as its process lives: renewal does not
//! depend on the handler's task being polled." README fault table: "the handler blocks its thread
//! longer than the lease ... A current-thread runtime has no other thread: there, run blocking
//! work in `spawn_blocking`."
//!
//! Effects are counted at the sink (inside the handler, after its work), never by counting
//! responses. Every wait is bounded by a wall-clock watchdog on an OS thread of its own (tokio's
//! timers are what a paused clock changes, so they cannot guard a paused test). Tests on a paused
//! clock call the layered router with `tower::ServiceExt::oneshot` (no sockets: a paused clock
//! auto-advances past hyper's and reqwest's timers while a socket is idle); the others go over
//! real TCP.

use crate::common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use common::rig::{Answer, send_body};
use common::runtimes::{current_thread, multi_thread, on_thread, paused};
use tower_idempotency::scope::SingleTenant;
use tower_idempotency::store::{RecordStatus, ScopedKey};
use tower_idempotency::{
    IdempotencyContext, IdempotencyLayer, IdempotencyStore, LeaseExpiry, MemoryStore,
};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

// ---- the sink -----------------------------------------------------------------------------------

/// Runs entered and effects made, per key; effects are counted after the handler's work.
#[derive(Default)]
struct Sink {
    entered: Mutex<HashMap<String, usize>>,
    effects: Mutex<HashMap<String, usize>>,
    /// Woken whenever a run enters.
    entered_now: tokio::sync::Notify,
}

impl Sink {
    fn effects_of(&self, key: &str) -> usize {
        self.effects.lock().unwrap().get(key).copied().unwrap_or(0)
    }
    fn entered_of(&self, key: &str) -> usize {
        self.entered.lock().unwrap().get(key).copied().unwrap_or(0)
    }
    /// Waits (no timer: on a paused clock a timer may never fire) until `key` has entered `n`
    /// times.
    async fn entered(&self, key: &str, n: usize) {
        loop {
            let woken = self.entered_now.notified();
            if self.entered_of(key) >= n {
                return;
            }
            woken.await;
        }
    }
}

/// The body a request sends: how the handler works, and for how long.
fn body(mode: &str, work_ms: u64) -> String {
    format!(r#"{{"mode":"{mode}","work_ms":{work_ms}}}"#)
}

/// `/op` behind `layer`. Modes:
/// - `fast`: no work;
/// - `sleep`: `tokio::time::sleep` (tokio's clock);
/// - `spawn_blocking`: blocking work in `spawn_blocking`, as the README says (wall clock);
/// - `real`: waits for an OS thread that sleeps in wall time (I/O tokio's clock does not drive:
///   a downstream call);
/// - `block_in_place`: blocking work in `tokio::task::block_in_place` (multi-thread runtimes);
/// - `started_then_sleep`: marks `effect_started`, makes its effect, then works on (tokio sleep).
///
/// With `"first_only": true` only the first attempt works (a takeover answers at once).
fn app<St: IdempotencyStore>(layer: IdempotencyLayer<St, SingleTenant>, sink: Arc<Sink>) -> Router {
    // `/op` and `/other` (the same handler): routes a layer may configure apart (`for_path`).
    Router::new().route(
        "/{route}",
        post(move |ctx: IdempotencyContext, body: String| {
            let sink = sink.clone();
            async move {
                let key = ctx.key().to_owned();
                *sink.entered.lock().unwrap().entry(key.clone()).or_default() += 1;
                sink.entered_now.notify_waiters();
                let v: serde_json::Value = serde_json::from_str(&body).expect("json");
                // `first_only`: later attempts (takeovers) do not work.
                let work = if v["first_only"].as_bool() == Some(true) && ctx.attempt() > 1 {
                    Duration::ZERO
                } else {
                    ms(v["work_ms"].as_u64().unwrap_or(0))
                };
                let effect = |sink: &Sink| {
                    let mut effects = sink.effects.lock().unwrap();
                    let n = effects.entry(key.clone()).or_default();
                    *n += 1;
                    *n
                };
                let n = match v["mode"].as_str().unwrap_or("fast") {
                    "sleep" => {
                        tokio::time::sleep(work).await;
                        effect(&sink)
                    }
                    "spawn_blocking" => {
                        tokio::task::spawn_blocking(move || std::thread::sleep(work))
                            .await
                            .expect("blocking work");
                        effect(&sink)
                    }
                    "real" => {
                        let _ = wall_delay(work).await;
                        effect(&sink)
                    }
                    "block_in_place" => {
                        tokio::task::block_in_place(|| std::thread::sleep(work));
                        effect(&sink)
                    }
                    "started_then_sleep" => {
                        ctx.effect_started().await.expect("milestone");
                        let n = effect(&sink);
                        tokio::time::sleep(work).await;
                        n
                    }
                    _ => effect(&sink),
                };
                (
                    StatusCode::CREATED,
                    format!("{key} effect {n} attempt {}", ctx.attempt()),
                )
            }
        })
        .layer(layer),
    )
}

fn layer<St: IdempotencyStore>(
    store: Arc<St>,
    lease: Duration,
) -> IdempotencyLayer<St, SingleTenant> {
    IdempotencyLayer::from_arc(store)
        .single_tenant()
        .lease(lease)
        .on_lease_expiry(LeaseExpiry::Reclaim)
}

/// Resolves once `d` has passed on the wall clock (an OS thread sleeps it): what a real
/// downstream or a client on another machine does, whatever tokio's clock says.
fn wall_delay(d: Duration) -> tokio::sync::oneshot::Receiver<()> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        std::thread::sleep(d);
        let _ = tx.send(());
    });
    rx
}

/// One request through `router`, without a socket.
async fn call(router: &Router, key: &str, b: String) -> Answer {
    call_path(router, "/op", key, b).await
}

/// [`call`] on `path`.
async fn call_path(router: &Router, path: &str, key: &str, b: String) -> Answer {
    use tower::ServiceExt;
    let req = axum::http::Request::post(path)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(axum::body::Body::from(b))
        .expect("request");
    let res = router.clone().oneshot(req).await.expect("infallible");
    answer(res).await
}

async fn answer(res: axum::response::Response) -> Answer {
    use http_body_util::BodyExt;
    let status = res.status().as_u16();
    let replayed = res
        .headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let bytes = res.into_body().collect().await.expect("body").to_bytes();
    let body = String::from_utf8_lossy(&bytes).into_owned();
    let problem = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v["type"].as_str().map(str::to_owned))
        .map(|t| t.rsplit(':').next().unwrap_or_default().to_owned())
        .unwrap_or_default();
    Answer {
        status,
        replayed,
        body,
        problem,
    }
}

async fn post_key(addr: SocketAddr, key: &str, b: &str) -> Answer {
    send_body(addr, key, b, Duration::from_secs(30))
        .await
        .unwrap_or_else(|| panic!("no answer for {key}"))
}

/// A slow first request on `key` (through `oneshot`), a retry sent once `retry_after` has
/// passed on the wall clock while it works, then both answers.
async fn slow_then_retry_wall(
    router: &Router,
    sink: &Arc<Sink>,
    key: &str,
    b: String,
    retry_after: Duration,
) -> (Answer, Answer) {
    let first = {
        let (router, key, b) = (router.clone(), key.to_owned(), b.clone());
        tokio::spawn(async move { call(&router, &key, b).await })
    };
    sink.entered(key, 1).await;
    let _ = wall_delay(retry_after).await;
    let retry = call(router, key, b).await;
    let first = first.await.expect("first");
    (first, retry)
}

// ---- 1. a paused clock and blocking work in `spawn_blocking` -------------------------------------

/// One slow holder whose handler does blocking work in `spawn_blocking` (1.5 s, wall time) under
/// a 300 ms lease, and a retry 900 ms in (wall time), on `rt`.
fn spawn_blocking_holder_and_retry(rt: tokio::runtime::Runtime) -> (usize, Answer, Answer) {
    // As the README says to wire a test that pauses tokio's clock (the store is made outside
    // the runtime: without a paused clock it reads real time).
    let store = Arc::new(MemoryStore::on_tokio_clock());
    let sink = Arc::new(Sink::default());
    let router = app(layer(store, ms(300)), sink.clone());
    let (first, retry) = rt.block_on(slow_then_retry_wall(
        &router,
        &sink,
        "k",
        body("spawn_blocking", 1500),
        ms(900),
    ));
    drop(rt);
    (sink.effects_of("k"), first, retry)
}

/// DESIGN §4 (the holder keeps its lease while its process lives) and README's fault table ("a
/// current-thread runtime has no other thread: there, run blocking work in `spawn_blocking`").
/// Condition: the application's test runs on a paused clock (`#[tokio::test(start_paused =
/// true)]`), the handler does as the README says (blocking work in `spawn_blocking`, 1.5 s of
/// wall time under a 300 ms lease). Tokio does not auto-advance a paused clock while a blocking
/// task runs, so the keeper's timer never fires; a `MemoryStore::new()` lease would run on the
/// wall clock and lapse (it did: the key ran twice), so the store is wired as the README says
/// for such tests, `MemoryStore::on_tokio_clock()`. A retry 900 ms in must still be told 409
/// in flight, and the key run once.
#[test]
fn s4_paused_clock_a_spawn_blocking_handler_keeps_its_lease() {
    let (effects, first, retry) =
        on_thread("paused-spawn-blocking", Duration::from_secs(30), || {
            spawn_blocking_holder_and_retry(paused())
        });
    assert_eq!(
        effects, 1,
        "DESIGN §4: on a paused tokio clock a handler working in `spawn_blocking` (as README \
         says) lost its lease: the key ran {effects} times; first {first:?}, retry {retry:?}"
    );
    assert!(retry.in_flight(), "the retry during the run: {retry:?}");
}

/// Control for the test above: the same application on an ordinary current-thread runtime
/// (`#[tokio::test]`'s default). DESIGN §4 / README fault table: the keeper renews the lease
/// while the handler works in `spawn_blocking`; the retry is told 409 and the key runs once.
#[test]
fn s4_control_current_thread_a_spawn_blocking_handler_keeps_its_lease() {
    let (effects, first, retry) = on_thread("ct-spawn-blocking", Duration::from_secs(30), || {
        spawn_blocking_holder_and_retry(current_thread())
    });
    assert_eq!(effects, 1, "first {first:?}, retry {retry:?}");
    assert!(retry.in_flight(), "the retry during the run: {retry:?}");
}

// ---- 2. a paused clock, real I/O in the handler, and a blocking task elsewhere ---------------------

/// DESIGN §4. Condition: an application test on a paused clock (`time::pause()` once the app is
/// built) in which the *test* waits on a helper thread with `spawn_blocking` (as test suites do
/// to join a thread or read a channel) while a handler waits 1.5 s (wall time) for real I/O (a
/// downstream call) under a 300 ms lease. The handler blocks nothing; the blocking task only
/// stops tokio's clock. A retry 900 ms in (wall time) must be told 409 and the key run once.
#[test]
fn s4_paused_clock_a_blocking_task_elsewhere_never_lets_a_waiting_holder_lapse() {
    let (effects, first, retry) =
        on_thread("paused-blocking-elsewhere", Duration::from_secs(30), || {
            let store = Arc::new(MemoryStore::on_tokio_clock());
            let sink = Arc::new(Sink::default());
            let router = app(layer(store, ms(300)), sink.clone());
            let rt = current_thread();
            let (first, retry) = rt.block_on(async {
                tokio::time::pause();
                // The test's helper thread, joined from a blocking task (2.5 s of wall time).
                let helper = tokio::task::spawn_blocking(|| std::thread::sleep(ms(2500)));
                let out =
                    slow_then_retry_wall(&router, &sink, "k", body("real", 1500), ms(900)).await;
                helper.await.expect("helper");
                out
            });
            drop(rt);
            (sink.effects_of("k"), first, retry)
        });
    assert_eq!(
        effects, 1,
        "DESIGN §4: on a paused clock, a handler waiting for real I/O lost its lease while a \
         blocking task ran elsewhere: the key ran {effects} times; first {first:?}, retry \
         {retry:?}"
    );
    assert!(retry.in_flight(), "the retry during the run: {retry:?}");
}

// ---- 3. a store on tokio's clock, moved by a paused runtime -------------------------------------

/// A `MemoryStore` whose clock is tokio's (paused in these tests), as an application's test
/// wires it so that a paused clock moves leases and TTLs.
fn store_on_tokios_clock() -> Arc<MemoryStore> {
    let t0 = tokio::time::Instant::now();
    let wall0 = SystemTime::now();
    Arc::new(MemoryStore::with_clock(move || {
        wall0 + (tokio::time::Instant::now() - t0)
    }))
}

/// Rounds of a race between tokio's auto-advance and an OS thread: each round is cheap (its
/// time is paused), and a loaded machine makes the thread win more often.
const ROUNDS: usize = 80;

/// One round on a fresh paused runtime with a fresh layer (so a fresh keeper) over a store on
/// tokio's clock: a holder sleeping 3 s of tokio time under a 300 ms lease, the test sleeping
/// 1.5 s (auto-advance), then a retry. With `warm`, the layer first serves a fast request and
/// waits 50 ms of wall time (its keeper task is started meanwhile). (runs, first, retry)
fn tokio_clock_round(warm: bool) -> (usize, Answer, Answer) {
    let rt = paused();
    rt.block_on(async {
        let sink = Arc::new(Sink::default());
        let router = app(layer(store_on_tokios_clock(), ms(300)), sink.clone());
        if warm {
            assert!(call(&router, "warm", body("fast", 0)).await.is_live());
            let _ = wall_delay(ms(50)).await;
        }
        let b = body("sleep", 3000);
        let first = {
            let (router, b) = (router.clone(), b.clone());
            tokio::spawn(async move { call(&router, "k", b).await })
        };
        sink.entered("k", 1).await;
        tokio::time::sleep(ms(1500)).await;
        let retry = call(&router, "k", b).await;
        let first = first.await.expect("first");
        (sink.effects_of("k"), first, retry)
    })
}

/// DESIGN §4 (the holder keeps its lease while its process lives). Condition: an application's
/// test on a paused clock (`start_paused`) that gives `MemoryStore` tokio's clock
/// (`MemoryStore::with_clock` reading `tokio::time::Instant`), so that its leases and TTLs move
/// with the paused clock; the first request a layer serves on the runtime sleeps 10 leases of
/// tokio time, and the test sleeps 5 leases (auto-advance) and retries. Eighty rounds, each a
/// fresh runtime and layer, as eighty `#[tokio::test(start_paused = true)]`s building their app.
/// Each retry must be told 409 and each key run once.
#[test]
fn s4_paused_clock_store_on_tokios_clock_the_first_hold_keeps_its_lease() {
    let rounds = on_thread("tokio-clock-cold", Duration::from_secs(30), || {
        (0..ROUNDS)
            .map(|_| tokio_clock_round(false))
            .collect::<Vec<_>>()
    });
    let twice: Vec<_> = rounds
        .iter()
        .enumerate()
        .filter(|(_, (runs, _, _))| *runs != 1)
        .collect();
    assert!(
        twice.is_empty(),
        "DESIGN §4: on a paused clock (store on tokio's clock), the first hold of a fresh layer \
         lost its lease in {} of {ROUNDS} rounds and the key ran again: {:?}",
        twice.len(),
        twice.first()
    );
    for (runs, first, retry) in &rounds {
        assert!(
            retry.in_flight(),
            "runs {runs}, first {first:?}, retry {retry:?}"
        );
    }
}

/// Control for the test above: the same eighty rounds, each layer having served one fast
/// request (and its keeper task started, 50 ms of wall time) before the slow one. DESIGN §4:
/// each retry is told 409, each key runs once.
#[test]
fn s4_control_paused_clock_store_on_tokios_clock_a_warm_layer_keeps_leases() {
    let rounds = on_thread("tokio-clock-warm", Duration::from_secs(30), || {
        (0..ROUNDS)
            .map(|_| tokio_clock_round(true))
            .collect::<Vec<_>>()
    });
    for (runs, first, retry) in &rounds {
        assert_eq!(*runs, 1, "first {first:?}, retry {retry:?}");
        assert!(retry.in_flight(), "first {first:?}, retry {retry:?}");
    }
}

/// DESIGN §4 and hold.rs ("the keeper wakes every sixth of the shortest lease it has seen (at
/// once when a shorter one comes in)"). Condition: a paused clock, the store on tokio's clock, and
/// a layer whose routes have different leases (30 s by default, 300 ms on `/op` by
/// `for_path`): the app's test first calls the 30 s route (the keeper starts, ticking every
/// second), then a slow request on the 300 ms route; the test sleeps 700 ms (auto-advance) and
/// retries. Eighty rounds, each a fresh runtime and layer. Each retry must be told 409 and each
/// key run once.
#[test]
fn s4_paused_clock_store_on_tokios_clock_a_shorter_lease_after_a_longer_keeps_its_lease() {
    let rounds = on_thread("tokio-clock-shorter", Duration::from_secs(30), || {
        (0..ROUNDS)
            .map(|_| {
                paused().block_on(async {
                    let sink = Arc::new(Sink::default());
                    let layer = IdempotencyLayer::from_arc(store_on_tokios_clock())
                        .single_tenant()
                        .lease(Duration::from_secs(30))
                        .for_path("/op", |r| r.lease(ms(300)));
                    let router = app(layer, sink.clone());
                    let warm = call_path(&router, "/other", "warm", body("fast", 0)).await;
                    assert!(warm.is_live(), "{warm:?}");
                    // The keeper task is started meanwhile (wall time), ticking every second.
                    let _ = wall_delay(ms(50)).await;
                    let b = body("sleep", 3000);
                    let first = {
                        let (router, b) = (router.clone(), b.clone());
                        tokio::spawn(async move { call(&router, "k", b).await })
                    };
                    sink.entered("k", 1).await;
                    tokio::time::sleep(ms(700)).await;
                    let retry = call(&router, "k", b).await;
                    let first = first.await.expect("first");
                    (sink.effects_of("k"), first, retry)
                })
            })
            .collect::<Vec<_>>()
    });
    let twice: Vec<_> = rounds.iter().filter(|(runs, _, _)| *runs != 1).collect();
    assert!(
        twice.is_empty(),
        "DESIGN §4: on a paused clock (store on tokio's clock), a 300 ms lease held after the \
         layer's keeper started for a 30 s one lost its lease in {} of {ROUNDS} rounds: {:?}",
        twice.len(),
        twice.first()
    );
    for (runs, first, retry) in &rounds {
        assert!(
            retry.in_flight(),
            "runs {runs}, first {first:?}, retry {retry:?}"
        );
    }
}

/// DESIGN §7.4 (expiry: after the TTL the key executes again) and §1 ("TTLs are computed with
/// the store's clock"). Condition: a paused clock with the store on tokio's clock; a key runs,
/// its retry is replayed, then the test sleeps past the route's 60 s TTL (auto-advance): the
/// key executes again.
#[test]
fn s7_4_paused_clock_store_on_tokios_clock_expires_ttls() {
    let (runs, first, replay, after) =
        on_thread("tokio-clock-ttl", Duration::from_secs(30), || {
            paused().block_on(async {
                let sink = Arc::new(Sink::default());
                let router = app(
                    layer(store_on_tokios_clock(), ms(300))
                        .defaults(|r| r.ttl(Duration::from_secs(60))),
                    sink.clone(),
                );
                let first = call(&router, "k", body("fast", 0)).await;
                let replay = call(&router, "k", body("fast", 0)).await;
                tokio::time::sleep(Duration::from_secs(61)).await;
                let after = call(&router, "k", body("fast", 0)).await;
                (sink.effects_of("k"), first, replay, after)
            })
        });
    assert!(
        first.is_live() && replay.is_replay_of(&first.body),
        "{first:?} {replay:?}"
    );
    assert_eq!(
        (runs, after.is_live()),
        (2, true),
        "past the TTL: {after:?}"
    );
}

// ---- 4. waiting for an in-flight key on a paused clock -------------------------------------------

/// DESIGN §1.6 (a route that opts in waits for the first to finish and replays it) and README
/// "Waiting instead of 409". Condition: a paused clock (`start_paused`), the wall-clock
/// `MemoryStore`, a holder sleeping 5 s of tokio time under a 300 ms lease, and a duplicate on a
/// route that waits up to 20 s. The waiter sleeps to the lease's end (wall-clock remaining time,
/// slept on tokio's clock) again and again: it must end with the replay, never a second run, nor
/// hang.
#[test]
fn s1_6_paused_clock_a_waiting_duplicate_gets_the_replay() {
    let (effects, first, waiter) = on_thread("paused-wait", Duration::from_secs(30), || {
        let rt = paused();
        rt.block_on(async {
            let store = Arc::new(MemoryStore::new());
            let sink = Arc::new(Sink::default());
            let router = app(
                layer(store, ms(300)).defaults(|r| r.wait_for_in_flight(Duration::from_secs(20))),
                sink.clone(),
            );
            let b = body("sleep", 5000);
            let first = {
                let (router, b) = (router.clone(), b.clone());
                tokio::spawn(async move { call(&router, "k", b).await })
            };
            sink.entered("k", 1).await;
            tokio::time::sleep(ms(100)).await;
            let waiter = call(&router, "k", b).await;
            let first = first.await.expect("first");
            (sink.effects_of("k"), first, waiter)
        })
    });
    assert_eq!(effects, 1, "first {first:?}, waiter {waiter:?}");
    assert!(
        waiter.is_replay_of(&first.body),
        "the waiter on a paused clock: {waiter:?} (first {first:?})"
    );
}

// ---- 5. detached runs and `finished()` on a paused clock -----------------------------------------

/// README "the server is stopped gracefully" / DESIGN §1.7. Condition: a paused clock; a
/// client hangs up (its response future is dropped) while the handler sleeps 2 s of tokio time,
/// so the run goes on detached; the test then awaits `detached::finished()`, as a shutdown
/// helper would. The run ends and records (auto-advance drives its sleep); the retry after it
/// gets the replay; one run.
#[test]
fn s1_7_paused_clock_a_detached_run_records_and_finished_returns() {
    let (effects, status, retry) = on_thread("paused-detached", Duration::from_secs(30), || {
        let rt = paused();
        rt.block_on(async {
            let store = Arc::new(MemoryStore::new());
            let sink = Arc::new(Sink::default());
            let router = app(layer(store.clone(), ms(300)), sink.clone());
            let b = body("sleep", 2000);
            let hung_up = {
                let (router, b) = (router.clone(), b.clone());
                tokio::spawn(async move { call(&router, "k", b).await })
            };
            sink.entered("k", 1).await;
            hung_up.abort();
            let _ = hung_up.await;
            tower_idempotency::detached::finished().await;
            let status = store
                .lookup(&ScopedKey::new("", "k"))
                .await
                .expect("lookup")
                .map(|r| r.status);
            let retry = call(&router, "k", b).await;
            (sink.effects_of("k"), status, retry)
        })
    });
    assert_eq!(effects, 1, "retry {retry:?}");
    assert_eq!(
        status,
        Some(RecordStatus::Completed),
        "finished() returned before the detached run recorded"
    );
    assert!(retry.replayed && retry.status == 201, "{retry:?}");
}

// ---- 6. `block_in_place` on a multi-thread runtime ---------------------------------------------

/// DESIGN §4 and README's fault table ("a retry gets 409 as long as one worker thread is free").
/// Condition: a one-worker multi-thread runtime (`#[tokio::test(flavor = "multi_thread",
/// worker_threads = 1)]`) whose handler blocks in `block_in_place` for 1.2 s under a 200 ms
/// lease: the worker's core is handed to another thread, so the keeper must still run. Over real
/// TCP: the retry 700 ms in is told 409, and the key runs once.
#[test]
fn s4_block_in_place_on_a_one_worker_runtime_keeps_the_lease() {
    let (effects, first, retry) = on_thread("block-in-place", Duration::from_secs(40), || {
        let store = Arc::new(MemoryStore::new());
        let sink = Arc::new(Sink::default());
        let router = app(layer(store, ms(200)), sink.clone());
        let rt = multi_thread(1);
        let (first, retry) = rt.block_on(async {
            let addr = common::serve(router).await;
            let b = body("block_in_place", 1200);
            let first = {
                let b = b.clone();
                tokio::spawn(async move { post_key(addr, "k", &b).await })
            };
            common::until("entered", || sink.entered_of("k") == 1).await;
            let _ = wall_delay(ms(700)).await;
            let retry = post_key(addr, "k", &b).await;
            let first = tokio::time::timeout(Duration::from_secs(30), first)
                .await
                .expect("first answered")
                .expect("first");
            (first, retry)
        });
        drop(rt);
        (sink.effects_of("k"), first, retry)
    });
    assert_eq!(effects, 1, "first {first:?}, retry {retry:?}");
    assert!(retry.in_flight(), "the retry during the run: {retry:?}");
}

// ---- 7. a static store shared by runtimes that come and go ---------------------------------------

fn started_body() -> String {
    r#"{"mode":"started_then_sleep","work_ms":20000,"first_only":true}"#.to_owned()
}

fn plain_body() -> String {
    r#"{"mode":"sleep","work_ms":20000,"first_only":true}"#.to_owned()
}

/// The store an application's test suite keeps in a `static`, shared by every test's runtime.
fn shared_store() -> Arc<MemoryStore> {
    static STORE: OnceLock<Arc<MemoryStore>> = OnceLock::new();
    STORE.get_or_init(|| Arc::new(MemoryStore::new())).clone()
}

/// DESIGN §4 (a dead holder's lease runs out; with `effect_started` the key is set aside, never
/// run again) and README "a runtime dropped under them ends them as a crash would". Condition:
/// a store kept in a `static` and shared by two runtimes built one after another, as two
/// `#[tokio::test]`s do; the first runtime (current-thread) is dropped while two runs whose
/// clients hung up work on detached: `started` has marked `effect_started` and made its effect,
/// `plain` has not. On the second runtime (a new layer on the same store), over real TCP:
/// retries are told 409 while the dead leases last, then `started` is `outcome-unknown` (never
/// run again: one effect) and `plain` is taken over (attempt 2) and answered: no key is held
/// forever.
#[test]
fn s4_a_runtime_dropped_under_detached_runs_with_a_static_store() {
    let store = shared_store();
    let sink = Arc::new(Sink::default());
    let lease = ms(300);
    // Keys of their own: the static store may serve other tests of this file.
    static ROUND: AtomicU64 = AtomicU64::new(0);
    let round = ROUND.fetch_add(1, Ordering::SeqCst);
    let (started, plain) = (format!("started-{round}"), format!("plain-{round}"));
    {
        let (store, sink, started, plain) =
            (store.clone(), sink.clone(), started.clone(), plain.clone());
        on_thread("first-runtime", Duration::from_secs(30), move || {
            let rt = current_thread();
            rt.block_on(async {
                let router = app(layer(store, lease), sink.clone());
                let addr = common::serve(router).await;
                for (key, b) in [(&started, started_body()), (&plain, plain_body())] {
                    let out = reqwest::Client::builder()
                        .pool_max_idle_per_host(0)
                        .timeout(ms(300))
                        .build()
                        .expect("client")
                        .post(format!("http://{addr}/op"))
                        .header("idempotency-key", key.as_str())
                        .header("content-type", "application/json")
                        .body(b)
                        .send()
                        .await;
                    assert!(out.is_err(), "the client hung up: {out:?}");
                }
                common::until("both runs entered", || {
                    sink.entered_of(&started) == 1 && sink.entered_of(&plain) == 1
                })
                .await;
                common::until("the effect was made", || sink.effects_of(&started) == 1).await;
            });
            // The test ends: its runtime is dropped under both detached runs.
            drop(rt);
        });
    }
    let out = on_thread("second-runtime", Duration::from_secs(40), move || {
        let rt = current_thread();
        rt.block_on(async {
            let router = app(layer(store.clone(), lease), sink.clone());
            let addr = common::serve(router).await;
            let early = post_key(addr, &started, &started_body()).await;
            // Past the dead holders' leases.
            tokio::time::sleep(ms(700)).await;
            let unknown = post_key(addr, &started, &started_body()).await;
            let taken_over = post_key(addr, &plain, &plain_body()).await;
            let replay = post_key(addr, &plain, &plain_body()).await;
            let record = store
                .lookup(&ScopedKey::new("", &plain))
                .await
                .expect("lookup")
                .map(|r| (r.status, r.attempts));
            (
                early,
                unknown,
                taken_over,
                replay,
                record,
                sink.effects_of(&started),
                sink.effects_of(&plain),
            )
        })
    });
    let (early, unknown, taken_over, replay, record, started_effects, plain_effects) = out;
    assert_eq!(
        started_effects, 1,
        "DESIGN §4: a key whose effect was marked started ran again after its runtime was \
         dropped: early {early:?}, later {unknown:?}"
    );
    assert!(
        early.status == 409 && !early.replayed,
        "a retry while the dead holder's lease lasts: {early:?}"
    );
    assert_eq!(
        (unknown.status, unknown.problem.as_str()),
        (409, "outcome-unknown"),
        "after the dead holder's lease: {unknown:?}"
    );
    assert!(
        taken_over.is_live() && taken_over.body.ends_with("attempt 2"),
        "README: the key of a run cut by a dropped runtime is taken over by a retry, not held \
         forever: {taken_over:?}"
    );
    assert_eq!(
        plain_effects, 1,
        "the cut run made no effect; the takeover made one"
    );
    assert!(replay.is_replay_of(&taken_over.body), "{replay:?}");
    assert_eq!(record, Some((RecordStatus::Completed, 2)));
}

// ---- 8. a paused clock on a route that reconciles ------------------------------------------------

/// DESIGN §4 (the holder keeps its lease while its process lives; a lease is lost only by a dead
/// holder) on a route with `external_effects(true)` (`LeaseExpiry::Reconcile`), where a lapsed
/// lease sets the key aside for reconciliation. Condition: `start_paused`, a handler working
/// 1.5 s (wall) in `spawn_blocking` under a 300 ms lease, a retry 900 ms in. The retry must be
/// told 409 in flight (the holder is alive), and once the holder has answered, a retry gets its
/// replay: the live holder's answer is recorded, the key is not left awaiting a human.
#[test]
fn s4_paused_clock_a_live_holder_on_a_reconciling_route_is_not_set_aside() {
    let out = on_thread("paused-reconcile", Duration::from_secs(30), || {
        let store = Arc::new(MemoryStore::on_tokio_clock());
        let sink = Arc::new(Sink::default());
        let router = app(
            layer(store.clone(), ms(300)).defaults(|r| r.external_effects(true)),
            sink.clone(),
        );
        let rt = paused();
        rt.block_on(async {
            let b = body("spawn_blocking", 1500);
            let (first, retry) =
                slow_then_retry_wall(&router, &sink, "k", b.clone(), ms(900)).await;
            let after = call(&router, "k", b).await;
            let status = store
                .lookup(&ScopedKey::new("", "k"))
                .await
                .expect("lookup")
                .map(|r| r.status);
            (sink.effects_of("k"), first, retry, after, status)
        })
    });
    let (effects, first, retry, after, status) = out;
    assert_eq!(
        effects, 1,
        "first {first:?}, retry {retry:?}, after {after:?}"
    );
    assert!(
        after.is_replay_of(&first.body),
        "DESIGN §4: the live holder answered {first:?}, yet a retry after it is told {after:?} \
         (record {status:?})"
    );
    assert!(
        retry.in_flight(),
        "DESIGN §4: on a paused clock the live holder's lease lapsed and a retry during its run \
         was told {retry:?} (the holder's answer was recorded later: {status:?})"
    );
}

// ---- 9. SqliteStore on a paused clock -------------------------------------------------------------

/// The first request and its retry on three keys, through a `SqliteStore` connected and
/// migrated on `rt` itself (a file in a temporary directory).
fn sqlite_first_then_retry(
    rt: tokio::runtime::Runtime,
    pause: bool,
) -> Vec<(&'static str, usize, Answer, Answer)> {
    let dir = std::env::temp_dir().join(format!(
        "app-runtimes-review-{}-{}",
        std::process::id(),
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .expect("time")
            .as_nanos()
    ));
    std::fs::create_dir_all(&dir).expect("dir");
    let url = format!("sqlite://{}?mode=rwc", dir.join("db.sqlite").display());
    let sink = Arc::new(Sink::default());
    let answers = rt.block_on(async {
        let store = tower_idempotency::SqliteStore::connect(&url)
            .await
            .expect("connect");
        store.migrate().await.expect("migrate");
        // Warm the pool's connection before the clock stops.
        assert!(
            store
                .lookup(&ScopedKey::new("", "warm"))
                .await
                .expect("lookup")
                .is_none()
        );
        if pause {
            tokio::time::pause();
        }
        let router = app(layer(Arc::new(store), Duration::from_secs(2)), sink.clone());
        let mut answers = Vec::new();
        for key in ["a", "b", "c"] {
            let first = call(&router, key, body("fast", 0)).await;
            let retry = call(&router, key, body("fast", 0)).await;
            answers.push((key, first, retry));
        }
        answers
    });
    drop(rt);
    let _ = std::fs::remove_dir_all(&dir);
    answers
        .into_iter()
        .map(|(key, first, retry)| (key, sink.effects_of(key), first, retry))
        .collect()
}

fn assert_first_then_replay(out: Vec<(&'static str, usize, Answer, Answer)>) {
    for (key, effects, first, retry) in out {
        assert_eq!(effects, 1, "`{key}`: first {first:?}, retry {retry:?}");
        assert!(first.is_live(), "`{key}`: the first request: {first:?}");
        assert!(
            retry.is_replay_of(&first.body),
            "`{key}`: its retry: {retry:?}"
        );
    }
}

/// DESIGN §1.6 (store errors: 503, nothing run, fail closed) and §1.5 (a claim answered late
/// is confirmed before anything runs under it). Condition: an application's test stops tokio's
/// clock (`time::pause()`) with a `SqliteStore` whose calls are real I/O on sqlx's worker
/// thread: meanwhile tokio's clock auto-advances to the next timer, so every store call looks
/// late to the layer (and sqlx's own pool times out). Whatever each request is told, nothing
/// may run unclaimed or twice: each key runs at most once, a live first answer is never
/// followed by a second live one, and every other answer is a replay or a fail-closed
/// refusal (503 `store-unavailable`, 409 `in-flight`, or 409 `outcome-unknown`: a holder
/// whose record landed "after" its lease, on the stopped clock, set it aside as uncertain;
/// opening a connection takes several calls to sqlx's worker since the store refuses
/// connections SQLite opened read-only, so the clock has more chances to jump).
#[test]
fn s1_6_paused_clock_sqlite_store_fails_closed() {
    let out = on_thread("paused-sqlite", Duration::from_secs(40), || {
        sqlite_first_then_retry(current_thread(), true)
    });
    for (key, effects, first, retry) in out {
        let closed = |a: &Answer| {
            (a.status == 503 && a.problem == "store-unavailable")
                || a.in_flight()
                || (a.status == 409 && a.problem == "outcome-unknown")
        };
        assert!(
            effects <= 1,
            "`{key}` ran {effects} times: {first:?}, {retry:?}"
        );
        assert_eq!(
            effects,
            usize::from(first.is_live()) + usize::from(retry.is_live()),
            "`{key}`: runs at the sink vs live answers: {first:?}, {retry:?}"
        );
        assert!(
            first.is_live() || closed(&first),
            "`{key}`: first {first:?}"
        );
        assert!(
            retry.is_replay_of(&first.body)
                || (!first.is_live() && (retry.is_live() || closed(&retry)))
                || (first.is_live() && closed(&retry)),
            "`{key}`: first {first:?}, retry {retry:?}"
        );
    }
}

/// Control for the test above: the same on an ordinary current-thread runtime.
#[test]
fn s7_1_control_current_thread_sqlite_store_first_then_replay() {
    let out = on_thread("ct-sqlite", Duration::from_secs(40), || {
        sqlite_first_then_retry(current_thread(), false)
    });
    assert_first_then_replay(out);
}

// ---- 10. a `LocalSet` ----------------------------------------------------------------------------

/// DESIGN §4 and README's fault table (on a current-thread runtime, blocking work belongs in
/// `spawn_blocking`). Condition: the application drives the layered router from a `LocalSet`
/// (`run_until` on a current-thread runtime, its requests `spawn_local`ed, as apps with `!Send`
/// state do); the handler works 1.2 s (wall) in `spawn_blocking` under a 200 ms lease. The
/// keeper, spawned on the runtime rather than the `LocalSet`, must still renew: the retry 700 ms
/// in is told 409 and the key runs once.
#[test]
fn s4_a_local_set_with_a_spawn_blocking_handler_keeps_the_lease() {
    let (effects, first, retry) = on_thread("local-set", Duration::from_secs(30), || {
        let store = Arc::new(MemoryStore::new());
        let sink = Arc::new(Sink::default());
        let router = app(layer(store, ms(200)), sink.clone());
        let rt = current_thread();
        let local = tokio::task::LocalSet::new();
        let out = local.block_on(&rt, async {
            let b = body("spawn_blocking", 1200);
            let first = {
                let (router, b) = (router.clone(), b.clone());
                tokio::task::spawn_local(async move { call(&router, "k", b).await })
            };
            sink.entered("k", 1).await;
            let _ = wall_delay(ms(700)).await;
            let retry = call(&router, "k", b).await;
            (first.await.expect("first"), retry)
        });
        drop(local);
        drop(rt);
        (sink.effects_of("k"), out.0, out.1)
    });
    assert_eq!(effects, 1, "first {first:?}, retry {retry:?}");
    assert!(retry.in_flight(), "the retry during the run: {retry:?}");
}
