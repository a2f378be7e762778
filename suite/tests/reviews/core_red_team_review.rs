//! Red-team review of the execution core (service, execute, hold, future): races and fault
//! paths that make one key's effect happen twice, replay one caller's answer to another, or
//! strand a key in flight.
//!
//! Effects are counted at the sink (inside the handler). Every layer test goes over real TCP.
//! Sleeps only order events; no assertion is about how long something took.

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use common::rig::{self, Act, Answer, Route};
use common::{Effects, serve};
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, IdempotencyStore, MemoryStore};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// What one POST was told (status, whether replayed, body).
async fn post_key(addr: SocketAddr, key: &str, mode: &str) -> Option<Answer> {
    let body = format!(r#"{{"mode":"{mode}"}}"#);
    rig::send_body(addr, key, &body, Duration::from_secs(40)).await
}

// ---- 1. the lease keeper lives on one runtime -------------------------------------------------
//
// DESIGN §4: "The holder keeps its lease for as long as its process lives: renewal does not
// depend on the handler's task being polled." The layer's keeper is one task per layer, started
// on whichever runtime first holds a lease. A layer (or a router built with it) served from two
// runtimes in one process (a runtime per core, a second runtime for an admin listener, a
// temporary runtime that warmed the router up) has every holder's lease renewed from that first
// runtime only.

/// `/op` behind `layer`: a body `slow` sleeps `slow_for` before its effect; `block` blocks its
/// worker thread (synchronous work) for `slow_for`; anything else makes its effect at once.
/// Every call that makes its effect counts it in `effects` under its key.
fn two_runtime_app<St: IdempotencyStore>(
    layer: IdempotencyLayer<St, tower_idempotency::scope::SingleTenant>,
    effects: Effects,
    entered: Effects,
    slow_for: Duration,
) -> Router {
    Router::new().route(
        "/op",
        post(move |ctx: IdempotencyContext, body: String| async move {
            entered.hit();
            if body.contains("slow") {
                tokio::time::sleep(slow_for).await;
            } else if body.contains("block") {
                std::thread::sleep(slow_for);
            }
            let n = effects.hit();
            (
                StatusCode::CREATED,
                format!("effect {n} attempt {}", ctx.attempt()),
            )
        })
        .layer(layer),
    )
}

/// Runs `app` on a runtime of its own (one worker) on a thread of its own, sends it one request
/// (`key`, `body`), and reports its status on `ready`; then waits for `stop` and drops the
/// runtime.
fn other_runtime(
    app: Router,
    key: &'static str,
    body: &'static str,
    ready: std::sync::mpsc::Sender<u16>,
    stop: std::sync::mpsc::Receiver<()>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime A");
        let addr = rt.block_on(async move { serve(app).await });
        // The first request: it runs on runtime A, and the keeper starts there.
        let status = rt.block_on(async move {
            post_key(addr, key, body)
                .await
                .map_or(0, |answer| answer.status)
        });
        ready.send(status).expect("ready");
        let _ = stop.recv();
        drop(rt);
    })
}

async fn shut_down_runtime_a_then_retry<St: IdempotencyStore>(store: St, what: &str) {
    let lease = ms(300);
    let effects = Effects::default();
    let entered = Effects::default();
    let layer = IdempotencyLayer::new(store).single_tenant().lease(lease);
    let app = two_runtime_app(layer, effects.clone(), entered.clone(), ms(2500));

    // Runtime A serves the router first (a warm-up request), then stays up, idle.
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = std::sync::mpsc::channel();
    let thread = other_runtime(app.clone(), "warm-up", "fast", ready_tx, stop_rx);
    let warm = tokio::task::spawn_blocking(move || ready_rx.recv().expect("warm-up"))
        .await
        .expect("warm-up");
    assert_eq!(warm, 201, "{what}: the warm-up request on runtime A");

    // Runtime B (this test's) serves the same router; a slow request holds key `k`.
    let addr = serve(app).await;
    let first = tokio::spawn(async move { post_key(addr, "k", "slow").await });
    common::until("the first request's handler starts", || {
        entered.count() == 2
    })
    .await;

    // Runtime A goes away (its work is done); runtime B and its handler run on.
    stop_tx.send(()).expect("stop");
    tokio::task::spawn_blocking(move || thread.join().expect("runtime A's thread"))
        .await
        .expect("join");

    // Well past the lease, the handler still running: a retry must be told 409 in flight.
    tokio::time::sleep(ms(900)).await;
    let retry = post_key(addr, "k", "slow")
        .await
        .expect("the retry's answer");
    let first = first.await.expect("first").expect("the first answer");
    // Wait for any run the retry started.
    tokio::time::sleep(ms(2800)).await;
    let k_effects = effects.count() - 1; // minus the warm-up's
    assert_eq!(
        k_effects, 1,
        "{what}: DESIGN §4 the holder keeps its lease while its process lives, yet key `k` ran \
         {k_effects} times: once runtime A (where the layer's keeper started) shut down, nothing \
         renewed the lease of the handler running on runtime B, and the retry took the key over \
         (retry: {retry:?}; first: {first:?})"
    );
    assert!(
        retry.in_flight(),
        "{what}: the retry of a key whose holder runs is answered 409 in flight, got {retry:?}"
    );
}

/// DESIGN §4, §7.3/§7.5: a router served from two runtimes, the first shut down while the
/// second's handler runs. Each runtime has a keeper of its own: the second's holder stays
/// renewed, the retry is told 409, one run. (With one keeper per layer, on the first runtime,
/// nothing renewed the lease and the retry ran the key again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_runtime_that_shut_down_leaves_other_runtimes_holders_renewed() {
    shut_down_runtime_a_then_retry(MemoryStore::new(), "memory").await;
}

/// The same on SQLite (a real temp file).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_runtime_that_shut_down_leaves_other_runtimes_holders_renewed_on_sqlite() {
    let (store, path) = common::sqlite("core_red_team_keeper").await;
    shut_down_runtime_a_then_retry(store, "sqlite").await;
    let _ = std::fs::remove_file(path);
}

/// DESIGN §4 ("renewal does not depend on the handler's task being polled") and README ("on a
/// multi-threaded runtime a retry gets 409, as long as one worker thread is free to run the
/// keeper"): runtime B has free workers and its handler does not block, while runtime A's only
/// worker is blocked by A's own (synchronous) handler. B's keeper renews B's lease: one run.
/// (With the layer's one keeper living on A, B's lease lapsed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_blocked_runtime_never_starves_a_holder_on_another_runtime() {
    let lease = ms(300);
    let effects = Effects::default();
    let entered = Effects::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .single_tenant()
        .lease(lease);
    let app = two_runtime_app(layer, effects.clone(), entered.clone(), ms(2500));

    // Runtime A: a warm-up request starts the keeper there.
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = std::sync::mpsc::channel();
    let app_a = app.clone();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime A");
        let addr = rt.block_on(async move { serve(app_a).await });
        let status = rt.block_on(async move {
            post_key(addr, "warm-up", "fast")
                .await
                .map_or(0, |a| a.status)
        });
        ready_tx.send((status, addr)).expect("ready");
        let _ = stop_rx.recv();
        drop(rt);
    });
    let (warm, addr_a) = tokio::task::spawn_blocking(move || ready_rx.recv().expect("ready"))
        .await
        .expect("ready");
    assert_eq!(warm, 201);

    // Runtime B: a slow (async, non-blocking) handler holds key `b`.
    let addr_b = serve(app).await;
    let first = tokio::spawn(async move { post_key(addr_b, "b", "slow").await });
    common::until("b's handler starts", || entered.count() == 2).await;
    // Runtime A: a handler that blocks A's only worker (documented to cost A's own lease).
    let blocker = tokio::spawn(async move { post_key(addr_a, "a", "block").await });
    common::until("a's handler starts", || entered.count() == 3).await;

    tokio::time::sleep(ms(900)).await;
    let retry = post_key(addr_b, "b", "slow")
        .await
        .expect("the retry's answer");
    let first = first.await.expect("first").expect("b's first answer");
    let _ = blocker.await;
    tokio::time::sleep(ms(2800)).await;
    stop_tx.send(()).expect("stop");
    tokio::task::spawn_blocking(move || thread.join().expect("join"))
        .await
        .expect("join");
    let b_runs = effects.count() - 2; // minus the warm-up's and a's
    assert_eq!(
        b_runs, 1,
        "DESIGN §4: key `b` on runtime B ran {b_runs} times: its (non-blocking) holder's lease \
         lapsed because the keeper lives on runtime A, whose only worker another handler \
         blocked; retry: {retry:?}; first: {first:?}"
    );
    assert!(retry.in_flight(), "retry of a running key: {retry:?}");
}

/// Control for the two tests above: the same two runtimes, runtime A left up and idle: B's
/// holder stays renewed, and the retry is told 409 in flight (one run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_control_keeper_on_a_live_idle_runtime_keeps_another_runtimes_holder() {
    let effects = Effects::default();
    let entered = Effects::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .single_tenant()
        .lease(ms(300));
    let app = two_runtime_app(layer, effects.clone(), entered.clone(), ms(2000));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = std::sync::mpsc::channel();
    let thread = other_runtime(app.clone(), "warm-up", "fast", ready_tx, stop_rx);
    let warm = tokio::task::spawn_blocking(move || ready_rx.recv().expect("warm-up"))
        .await
        .expect("warm-up");
    assert_eq!(warm, 201);
    let addr = serve(app).await;
    let first = tokio::spawn(async move { post_key(addr, "k", "slow").await });
    common::until("the handler starts", || entered.count() == 2).await;
    tokio::time::sleep(ms(900)).await;
    let retry = post_key(addr, "k", "slow").await.expect("retry");
    let first = first.await.expect("first").expect("first answer");
    tokio::time::sleep(ms(300)).await;
    stop_tx.send(()).expect("stop");
    tokio::task::spawn_blocking(move || thread.join().expect("join"))
        .await
        .expect("join");
    assert!(first.is_live(), "{first:?}");
    assert!(retry.in_flight(), "{retry:?}");
    assert_eq!(effects.count(), 2, "the warm-up and one run of `k`");
}

// ---- 2. one store fault at a time, under concurrency ------------------------------------------
//
// A seeded sweep over (route, handler, fault): each cell serves `/op` over a `Rig` (the k-th
// operation of one kind fails, is refused Busy/Full/Fenced, applies then loses its answer, is
// slow before or after it applies, or hangs), sends a holder, a hang-up (on cancelling routes),
// three concurrent retries released through a barrier and a final retry that honours 409s.
// Invariants (DESIGN §1, §3, §4, §7.3): never two runs of one key at once; at most one effect;
// every 201 any client saw is one body; the key never ends in flight.

#[derive(Clone, Copy, Debug)]
enum Mode {
    /// Works past the lease, then its effect, then 201.
    Slow,
    /// Marks its effect started (503 if it cannot), works past the lease, effect, 201.
    Milestone,
    /// Call 0 answers 503 having done nothing; later calls make the effect.
    First503,
    /// Call 0 panics having done nothing; later calls make the effect.
    FirstPanics,
    /// Call 0 marks its effect started, makes it, answers 500 (the key awaits reconciliation).
    MilestoneThen500,
}

struct Cell {
    mode: Mode,
    route: Route,
    kind: &'static str,
    n: usize,
    act: Act,
    hang_up: bool,
}

impl std::fmt::Debug for Cell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} wait={} cancel={} expiry={:?} {}#{}={:?} hang_up={}",
            self.mode,
            self.route.wait.is_some(),
            self.route.cancel,
            self.route.expiry,
            self.kind,
            self.n,
            self.act,
            self.hang_up
        )
    }
}

/// Tracks runs of one key: how many at once (the most seen), and effects.
#[derive(Default)]
struct Runs {
    now: AtomicUsize,
    most: AtomicUsize,
    effects: AtomicUsize,
}

struct Running(Arc<Runs>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.now.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Runs {
    fn enter(self: &Arc<Self>) -> Running {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        Running(self.clone())
    }
}

fn cell_handler(mode: Mode, runs: Arc<Runs>, lease: Duration) -> rig::Handler {
    rig::handler(move |i, ctx: IdempotencyContext| {
        let runs = runs.clone();
        async move {
            let _running = runs.enter();
            let work = lease + lease / 2;
            match mode {
                Mode::Slow => tokio::time::sleep(work).await,
                Mode::Milestone => {
                    tokio::time::sleep(ms(50)).await;
                    if ctx.effect_started().await.is_err() {
                        return (StatusCode::SERVICE_UNAVAILABLE, "no milestone".into());
                    }
                    tokio::time::sleep(work).await;
                }
                Mode::First503 => {
                    tokio::time::sleep(lease / 2).await;
                    if i == 0 {
                        return (StatusCode::SERVICE_UNAVAILABLE, "nothing done".into());
                    }
                }
                Mode::FirstPanics => {
                    tokio::time::sleep(lease / 2).await;
                    if i == 0 {
                        panic!("call 0 panics before its effect");
                    }
                }
                Mode::MilestoneThen500 => {
                    if ctx.effect_started().await.is_err() {
                        return (StatusCode::SERVICE_UNAVAILABLE, "no milestone".into());
                    }
                    tokio::time::sleep(lease / 2).await;
                    if i == 0 {
                        let n = runs.effects.fetch_add(1, Ordering::SeqCst) + 1;
                        return (
                            StatusCode::INTERNAL_SERVER_ERROR,
                            format!("effect {n}, 500"),
                        );
                    }
                }
            }
            // The effect, and the answer in the same poll (nothing to cancel in between).
            let n = runs.effects.fetch_add(1, Ordering::SeqCst) + 1;
            (
                StatusCode::CREATED,
                format!("effect {n} attempt {}", ctx.attempt()),
            )
        }
    })
}

async fn run_cell(cell: &Cell) -> Result<(), String> {
    let lease = cell.route.lease;
    let rig = rig::Rig::new(MemoryStore::new());
    rig.on(cell.kind, cell.n, cell.act);
    let runs = Arc::new(Runs::default());
    let addr = rig::server(
        &rig,
        cell.route,
        cell_handler(cell.mode, runs.clone(), lease),
    )
    .await;
    let key = "k";
    let mut answers: Vec<Answer> = Vec::new();
    // The holder: on a cancelling route, it may hang up mid-run.
    let holder = tokio::spawn(async move { rig::send(addr, key, Duration::from_secs(8)).await });
    tokio::time::sleep(ms(40)).await;
    if cell.hang_up {
        tokio::time::sleep(lease / 3).await;
        holder.abort();
    }
    // Three retries at once, mid-run (they wait on waiting routes).
    let barrier = Arc::new(tokio::sync::Barrier::new(3));
    let retries: Vec<_> = (0..3)
        .map(|_| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                rig::send(addr, key, Duration::from_secs(8)).await
            })
        })
        .collect();
    if !cell.hang_up
        && let Ok(Some(a)) = holder.await
    {
        answers.push(a);
    }
    for r in retries {
        if let Ok(Some(a)) = r.await {
            answers.push(a);
        }
    }
    // Retries that honour 409s until the answer is definite (or 12 s pass).
    let until = tokio::time::Instant::now() + Duration::from_secs(12);
    let last = loop {
        tokio::time::sleep(ms(150)).await;
        let a = rig::send(addr, key, Duration::from_secs(8)).await;
        let done = a
            .as_ref()
            .is_some_and(|a| !(a.in_flight() || a.problem == "store-unavailable"));
        if let Some(a) = a.clone() {
            answers.push(a);
        }
        if done || tokio::time::Instant::now() >= until {
            break a;
        }
    };
    // Let any straggling run end before counting.
    tokio::time::sleep(lease * 3).await;
    let effects = runs.effects.load(Ordering::SeqCst);
    let most = runs.most.load(Ordering::SeqCst);
    let status = rig::status_of(&rig, key).await;
    let report = || {
        format!(
            "effects={effects} most_at_once={most} final={last:?} record={status:?}\n    \
             answers: {}\n    log: {}",
            rig::summary(&answers),
            rig.log()
        )
    };
    if most > 1 {
        return Err(format!("two runs of one key at once; {}", report()));
    }
    if effects > 1 {
        return Err(format!("{effects} effects for one key; {}", report()));
    }
    let bodies: std::collections::HashSet<&str> = answers
        .iter()
        .filter(|a| a.status == 201)
        .map(|a| a.body.as_str())
        .collect();
    if bodies.len() > 1 {
        return Err(format!("two different 201 answers; {}", report()));
    }
    if answers.iter().filter(|a| a.is_live()).count() > 1 {
        return Err(format!("two live runs answered; {}", report()));
    }
    match &last {
        Some(a) if a.in_flight() => Err(format!("the key is stranded in flight; {}", report())),
        None => Err(format!("the last retry was never answered; {}", report())),
        _ => Ok(()),
    }
}

/// DESIGN §1/§3/§4/§7.3: a seeded sweep of one fault per cell, every route shape (waiting,
/// cancelling, reconciling), five handler shapes, eight fault kinds on seven operations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_one_fault_under_concurrency_never_runs_twice_nor_strands_the_key() {
    let lease = ms(400);
    let kinds = [
        "claim",
        "renew",
        "complete",
        "release",
        "mark_uncertain",
        "record_milestone",
        "lookup",
    ];
    let acts = [
        Act::Fail,
        Act::Busy,
        Act::Full,
        Act::Fenced,
        Act::ApplyThenFail,
        Act::After(ms(500)),
        Act::Before(ms(500)),
        Act::Hang,
    ];
    let modes = [
        Mode::Slow,
        Mode::Milestone,
        Mode::First503,
        Mode::FirstPanics,
        Mode::MilestoneThen500,
    ];
    let seed: u64 = std::env::var("CORE_RED_TEAM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_c0de);
    let cells_n: usize = std::env::var("CORE_RED_TEAM_CELLS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(96);
    let mut rng = common::Rng::new(seed);
    let mut cells = Vec::new();
    for _ in 0..cells_n {
        let mut route = if rng.next(2) == 0 {
            Route::waiting(lease)
        } else {
            Route::plain(lease)
        };
        if route.wait.is_some() {
            route.wait = Some(Duration::from_secs(3));
        }
        if rng.next(3) == 0 {
            route = route.reconcile();
        }
        let cancel = rng.next(3) == 0;
        if cancel {
            route = route.cancelling();
        }
        let kind = kinds[rng.next(kinds.len() as u64) as usize];
        // Claims: the holder's, a waiter's; renewals: any of the first few.
        let n = 1 + rng.next(if kind == "renew" { 4 } else { 2 }) as usize;
        // A claim that hangs for ever leaves its own request unanswered by design (the store's
        // driver bounds its calls): only the holder's own claim may hang.
        let mut act = acts[rng.next(acts.len() as u64) as usize];
        if matches!(act, Act::Hang) && (kind == "claim" || kind == "lookup") {
            act = Act::Before(ms(900));
        }
        cells.push(Cell {
            mode: modes[rng.next(modes.len() as u64) as usize],
            route,
            kind,
            n,
            act,
            hang_up: cancel && rng.next(2) == 0,
        });
    }
    let cells = Arc::new(cells);
    let failures = Arc::new(std::sync::Mutex::new(Vec::new()));
    let next = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..6)
        .map(|_| {
            let (cells, failures, next) = (cells.clone(), failures.clone(), next.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(cell) = cells.get(i) else { break };
                    if let Err(e) = run_cell(cell).await {
                        failures
                            .lock()
                            .unwrap()
                            .push(format!("cell {i} [{cell:?}]: {e}"));
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.await.expect("worker");
    }
    let failures = failures.lock().unwrap();
    assert!(
        failures.is_empty(),
        "{} of {} cells (seed {seed:#x}) broke the contract:\n{}",
        failures.len(),
        cells.len(),
        failures.join("\n")
    );
}

// ---- 3. the keeper woken into a worker that then blocks ---------------------------------------
//
// README (fault table): "the lease is renewed by the layer's keeper task, not the handler's, so
// on a multi-threaded runtime a retry gets 409, as long as one worker thread is free to run the
// keeper". `Keeper::start` (hold.rs) wakes the sleeping keeper with `Notify::notify_one` when a
// lease shorter than any seen before is held. That wake happens on the request's own task, in
// the same poll that then calls and polls the handler: tokio puts a task woken from a worker
// into that worker's LIFO slot, which other workers do not steal from. A handler that blocks its
// thread in that first poll keeps the keeper stuck behind it, with the other worker idle.

/// `/long` (the layer's 10 s lease) and `/op` (a 300 ms lease via `for_path`): a body `block`
/// blocks the worker thread for 1.5 s before the effect.
fn lease_routes(effects: Effects, entered: Effects, blocked: bool) -> Router {
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .single_tenant()
        .lease(Duration::from_secs(10))
        .for_path("/op", |r| r.lease(ms(300)));
    let handler = move |ctx: IdempotencyContext, body: String| {
        let (effects, entered) = (effects.clone(), entered.clone());
        async move {
            entered.hit();
            if body.contains("block") {
                if blocked {
                    std::thread::sleep(ms(1500));
                } else {
                    tokio::time::sleep(ms(1500)).await;
                }
            }
            let n = effects.hit();
            (
                StatusCode::CREATED,
                format!("effect {n} attempt {}", ctx.attempt()),
            )
        }
    };
    Router::new()
        .route("/long", post(handler.clone()))
        .route("/op", post(handler))
        .route_layer(layer)
}

async fn post_path(addr: SocketAddr, path: &str, key: &str, mode: &str) -> Answer {
    post_with(&common::client(), addr, path, key, mode).await
}

async fn post_with(
    client: &reqwest::Client,
    addr: SocketAddr,
    path: &str,
    key: &str,
    mode: &str,
) -> Answer {
    let res = client
        .post(format!("http://{addr}{path}"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(format!(r#"{{"mode":"{mode}"}}"#))
        .send()
        .await
        .expect("an answer");
    let status = res.status().as_u16();
    let replayed = res
        .headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let problem_json = res
        .headers()
        .get("content-type")
        .is_some_and(|v| v == "application/problem+json");
    let body = res.text().await.expect("body");
    let problem = if problem_json {
        let p: serde_json::Value = serde_json::from_str(&body).expect("problem");
        p["type"]
            .as_str()
            .unwrap_or_default()
            .rsplit(':')
            .next()
            .unwrap_or_default()
            .to_owned()
    } else {
        String::new()
    };
    Answer {
        status,
        replayed,
        body,
        problem,
    }
}

async fn shorter_lease_then_block(
    warm_short_lease_first: bool,
    blocked: bool,
) -> (usize, Answer, Answer) {
    let effects = Effects::default();
    let entered = Effects::default();
    let addr = serve(lease_routes(effects.clone(), entered.clone(), blocked)).await;
    // The keeper starts for the 10 s lease (a tick of 1 s).
    // The retry's client keeps a connection open from before, so that its request is read by
    // the free worker (a new connection waits for the accept loop, which the blocked worker may
    // hold).
    let retrier = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client");
    let warm = post_with(&retrier, addr, "/long", "warm-long", "fast").await;
    assert_eq!(warm.status, 201);
    if warm_short_lease_first {
        // The keeper already knows the short lease: no wake-up on the next hold.
        let warm = post_path(addr, "/op", "warm-short", "fast").await;
        assert_eq!(warm.status, 201);
    }
    // Let the keeper go back to sleep on its (1 s) tick.
    tokio::time::sleep(ms(200)).await;
    let before = entered.count();
    let first = tokio::spawn(async move { post_path(addr, "/op", "k", "block").await });
    common::until("the blocking handler starts", || {
        entered.count() == before + 1
    })
    .await;
    // The other worker is free; the lease (300 ms) must be renewed by the keeper.
    tokio::time::sleep(ms(800)).await;
    let retry = post_with(&retrier, addr, "/op", "k", "block").await;
    let first = first.await.expect("first");
    tokio::time::sleep(ms(300)).await;
    let runs = effects.count() - if warm_short_lease_first { 2 } else { 1 };
    (runs, first, retry)
}

/// README fault table "the handler blocks its thread longer than the lease" / DESIGN §4: the
/// first request on a route whose lease is shorter than any held before blocks its worker. The
/// keeper is woken from a thread of its own, so the free worker runs it: one run. (Woken from
/// that very request's poll, it waited in the blocked worker's LIFO slot, the lease lapsed and
/// a retry ran the key a second time.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_blocking_first_request_on_a_shorter_lease_route_keeps_its_lease() {
    let (runs, first, retry) = shorter_lease_then_block(false, true).await;
    assert_eq!(
        runs, 1,
        "key `k` ran {runs} times with one worker free: the keeper was woken into the blocked \
         worker's LIFO slot by `Keeper::start`'s notify; first: {first:?}; retry: {retry:?}"
    );
    assert!(retry.in_flight(), "retry: {retry:?}");
}

/// Control: the same, once the keeper already knows the short lease (no wake-up from the
/// blocking request's own poll): the free worker renews, the retry is told 409, one run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_control_a_blocking_request_after_the_keeper_knows_its_lease_keeps_it() {
    let (runs, first, retry) = shorter_lease_then_block(true, true).await;
    assert_eq!(runs, 1, "first: {first:?}; retry: {retry:?}");
    // The retry's own connection may wait behind the blocked worker too (then it replays).
    assert!(
        retry.in_flight() || retry.is_replay_of(&first.body),
        "retry: {retry:?}"
    );
}

/// Control: the same first request on the shorter-lease route, its handler awaiting instead of
/// blocking: the keeper, woken the same way, runs once the task yields; one run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_control_a_non_blocking_first_request_on_a_shorter_lease_route_keeps_its_lease() {
    let (runs, first, retry) = shorter_lease_then_block(false, false).await;
    assert_eq!(runs, 1, "first: {first:?}; retry: {retry:?}");
    // The retry's own connection may wait behind the blocked worker too (then it replays).
    assert!(
        retry.in_flight() || retry.is_replay_of(&first.body),
        "retry: {retry:?}"
    );
}

// ---- 4. a graceful shutdown cuts executions whose clients left -------------------------------
//
// DESIGN §1.7: "the inner service runs to completion even if the caller disconnects; its
// outcome is recorded either way". A run whose client hung up is detached onto a task of its
// own (future.rs `spawn_rest`), which nothing tracks: axum's graceful shutdown waits for open
// connections only, so the server stops, the runtime drops the detached run mid-handler, and
// nothing records or releases the key. After the restart the key is taken over and run again.

fn graceful_app<St: IdempotencyStore>(store: St, effects: Effects) -> Router {
    let layer = IdempotencyLayer::new(store).single_tenant().lease(ms(300));
    Router::new().route(
        "/op",
        post(move |ctx: IdempotencyContext, _body: String| async move {
            // The effect (a row written, a message sent), then the rest of the handler's work.
            let n = effects.hit();
            tokio::time::sleep(ms(800)).await;
            (
                StatusCode::CREATED,
                format!("effect {n} attempt {}", ctx.attempt()),
            )
        })
        .layer(layer),
    )
}

/// DESIGN §1.7, §7.6: a graceful shutdown (no crash) right after a client hung up mid-run. The
/// run went on detached, which the server's graceful shutdown does not wait for; the operator
/// waits with `detached::finished()` before the process exits, so the run records and the
/// retry after the restart replays it. (Before that wait existed, the runtime dropped the run
/// before it recorded, and the retry ran the key again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_7_a_graceful_shutdown_after_a_hang_up_never_lets_the_key_run_again() {
    graceful_shutdown(true).await;
}

/// Control: the same shutdown with the client still connected: graceful shutdown waits for the
/// connection, the run records, and the retry after the restart replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_7_control_a_graceful_shutdown_with_the_client_connected_records_the_run() {
    graceful_shutdown(false).await;
}

async fn graceful_shutdown(hang_up: bool) {
    let path = common::sqlite_path("core_red_team_graceful");
    let url = format!("sqlite://{}", path.display());
    let effects = Effects::default();

    // The first server process: a runtime of its own, stopped gracefully.
    let (url_a, effects_a) = (url.clone(), effects.clone());
    let first = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let store = tower_idempotency::store::SqliteStore::connect(&url_a)
                .await
                .expect("sqlite");
            store.migrate().await.expect("migrate");
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let addr = listener.local_addr().expect("addr");
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let server = tokio::spawn(async move {
                axum::serve(listener, graceful_app(store, effects_a.clone()))
                    .with_graceful_shutdown(async move {
                        let _ = stopped.await;
                    })
                    .await
                    .expect("serve");
            });
            // The client gives up after 200 ms: the handler has made its effect and works on.
            let hung_up = reqwest::Client::builder()
                .pool_max_idle_per_host(0)
                .timeout(if hang_up { ms(200) } else { ms(5000) })
                .build()
                .expect("client")
                .post(format!("http://{addr}/op"))
                .header("idempotency-key", "k")
                .header("content-type", "application/json")
                .body(r#"{"mode":"slow"}"#)
                .send();
            let hung_up = if hang_up {
                let answer = hung_up.await;
                assert!(answer.is_err(), "the client hung up before the answer");
                None
            } else {
                Some(tokio::spawn(hung_up))
            };
            // The operator stops the server gracefully; the process then exits.
            tokio::time::sleep(ms(200)).await;
            let _ = stop.send(());
            if let Some(answer) = hung_up {
                let answer = answer.await.expect("task").expect("answered");
                assert_eq!(answer.status(), 201);
            }
            server.await.expect("server");
            // The connections are closed; a run whose client left is still at work, and the
            // operator waits for it before the process exits (README, "Run to completion").
            if hang_up {
                assert!(
                    tower_idempotency::detached::running() > 0,
                    "the detached run is counted"
                );
            }
            tower_idempotency::detached::finished().await;
            assert_eq!(tower_idempotency::detached::running(), 0);
        });
        drop(rt);
    });
    tokio::task::spawn_blocking(move || first.join().expect("first process"))
        .await
        .expect("join");
    assert_eq!(effects.count(), 1, "the first run made its effect");

    // The restarted process, on the same file, a lease later: the client retries.
    let store = tower_idempotency::store::SqliteStore::connect(&url)
        .await
        .expect("sqlite");
    let addr = serve(graceful_app(store, effects.clone())).await;
    tokio::time::sleep(ms(700)).await;
    let retry = post_key(addr, "k", "slow").await.expect("retry");
    let runs = effects.count();
    let _ = std::fs::remove_file(&path);
    assert_eq!(
        runs, 1,
        "DESIGN §1.7: the first run was cut by a graceful shutdown (its client had hung up, so \
         it ran detached, untracked) before it recorded anything; after the restart the retry \
         ran the key again: {retry:?}"
    );
}
