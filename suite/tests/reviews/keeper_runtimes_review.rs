//! Review of the per-runtime lease keeper (src/hold.rs, commit d9964ad) and of the drain of
//! detached work (src/detached.rs, commit 572f331), attacked from many runtimes.
//!
//! DESIGN §4: "The holder keeps its lease for as long as its process lives: renewal does not
//! depend on the handler's task being polled." DESIGN §1 / README "Run to completion": a run
//! whose client left runs to completion; `detached::finished()` waits for it at shutdown.
//!
//! Effects are counted at the sink (inside the handler), never by counting responses. Layer
//! tests go over real TCP. Sleeps only order events; every wait is bounded (a hang fails).

use crate::common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use common::rig::{Answer, send_body};
use common::runtimes::{current_thread, multi_thread, on_thread};
use tower_idempotency::scope::SingleTenant;
use tower_idempotency::store::{FencingToken, ScopedKey, StoreError};
use tower_idempotency::{
    IdempotencyContext, IdempotencyLayer, IdempotencyStore, LeaseExpiry, MemoryStore,
};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

// ---- a store that watches renewals --------------------------------------------------------------

/// A `MemoryStore` whose renewals are counted, with the runtime each ran on, and which can be
/// told to panic on every n-th renewal (a third-party store with a bug).
#[derive(Default)]
struct Watch {
    inner: MemoryStore,
    renews: AtomicUsize,
    renewed_ok: AtomicUsize,
    /// 0: never panic; n: renewal number k panics when k % n == 0 (from 1).
    panic_every: AtomicUsize,
    /// (key, runtime the renewal ran on) of every renewal.
    on: Mutex<Vec<(String, Option<tokio::runtime::Id>, std::time::Instant)>>,
}

impl Watch {
    fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn renews(&self) -> usize {
        self.renews.load(Ordering::SeqCst)
    }

    fn renews_of(&self, key: &str) -> Vec<Option<tokio::runtime::Id>> {
        self.on
            .lock()
            .unwrap()
            .iter()
            .filter(|(k, _, _)| k == key)
            .map(|(_, id, _)| *id)
            .collect()
    }

    /// The gaps (ms) between successive renewals of `key`.
    fn gaps_of(&self, key: &str) -> Vec<u128> {
        let on = self.on.lock().unwrap();
        let at: Vec<_> = on
            .iter()
            .filter(|(k, _, _)| k == key)
            .map(|(_, _, t)| *t)
            .collect();
        at.windows(2).map(|w| (w[1] - w[0]).as_millis()).collect()
    }
}

impl IdempotencyStore for Watch {
    async fn renew(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<SystemTime, StoreError> {
        let n = self.renews.fetch_add(1, Ordering::SeqCst) + 1;
        self.on.lock().unwrap().push((
            key.key().to_owned(),
            tokio::runtime::Handle::try_current().ok().map(|h| h.id()),
            std::time::Instant::now(),
        ));
        let every = self.panic_every.load(Ordering::SeqCst);
        if every != 0 && n.is_multiple_of(every) {
            panic!("renewal #{n} panics (injected store bug)");
        }
        let out = self.inner.renew(key, token, lease).await;
        if out.is_ok() {
            self.renewed_ok.fetch_add(1, Ordering::SeqCst);
        }
        out
    }

    crate::common::forward::forward_store!(inner: claim, claim_now, recorded_fingerprint_now, completed_now, complete, release, mark_uncertain, lookup, remove, purge_expired, record_milestone, list_uncertain, count_uncertain, resolve, append_history, wait_for_change);
}

// ---- the sink and the app ---------------------------------------------------------------------

/// Effects per key, counted inside the handler after its work; and how many runs entered.
#[derive(Default)]
struct Sink {
    effects: Mutex<HashMap<String, usize>>,
    entered: AtomicUsize,
    entered_keys: Mutex<HashMap<String, usize>>,
}

impl Sink {
    fn effects_of(&self, key: &str) -> usize {
        self.effects.lock().unwrap().get(key).copied().unwrap_or(0)
    }
    fn entered_of(&self, key: &str) -> usize {
        self.entered_keys
            .lock()
            .unwrap()
            .get(key)
            .copied()
            .unwrap_or(0)
    }
    fn entered(&self) -> usize {
        self.entered.load(Ordering::SeqCst)
    }
    fn most_effects(&self) -> (String, usize) {
        self.effects
            .lock()
            .unwrap()
            .iter()
            .max_by_key(|(_, n)| **n)
            .map(|(k, n)| (k.clone(), *n))
            .unwrap_or_default()
    }
}

/// The body a request sends: how the handler works, and for how long.
fn body(mode: &str, work_ms: u64) -> String {
    format!(r#"{{"mode":"{mode}","work_ms":{work_ms}}}"#)
}

/// `/op` behind `layer`. Modes: `fast` (no work), `sleep` (tokio sleep), `block` (blocks its
/// thread), `spawn_blocking` (blocking work where the README says it belongs), `real` (waits
/// for an OS thread that sleeps in real time: I/O the tokio clock does not drive).
fn app(layer: IdempotencyLayer<Watch, SingleTenant>, sink: Arc<Sink>) -> Router {
    Router::new().route(
        "/op",
        post(move |ctx: IdempotencyContext, body: String| {
            let sink = sink.clone();
            async move {
                sink.entered.fetch_add(1, Ordering::SeqCst);
                *sink
                    .entered_keys
                    .lock()
                    .unwrap()
                    .entry(ctx.key().to_owned())
                    .or_default() += 1;
                let v: serde_json::Value = serde_json::from_str(&body).expect("json");
                let work = ms(v["work_ms"].as_u64().unwrap_or(0));
                match v["mode"].as_str().unwrap_or("fast") {
                    "sleep" => tokio::time::sleep(work).await,
                    "block" => std::thread::sleep(work),
                    "spawn_blocking" => {
                        tokio::task::spawn_blocking(move || std::thread::sleep(work))
                            .await
                            .expect("blocking work")
                    }
                    "real" => {
                        let (tx, rx) = tokio::sync::oneshot::channel();
                        std::thread::spawn(move || {
                            std::thread::sleep(work);
                            let _ = tx.send(());
                        });
                        let _ = rx.await;
                    }
                    _ => {}
                }
                let n = {
                    let mut effects = sink.effects.lock().unwrap();
                    let n = effects.entry(ctx.key().to_owned()).or_default();
                    *n += 1;
                    *n
                };
                (
                    StatusCode::CREATED,
                    format!("{} effect {n} attempt {}", ctx.key(), ctx.attempt()),
                )
            }
        })
        .layer(layer),
    )
}

fn layer(store: &Arc<Watch>, lease: Duration) -> IdempotencyLayer<Watch, SingleTenant> {
    IdempotencyLayer::from_arc(store.clone())
        .single_tenant()
        .lease(lease)
        .on_lease_expiry(LeaseExpiry::Reclaim)
}

/// A server that stops (gracefully) when `stop` is sent; the router (and layer) then drops.
struct Server {
    addr: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

async fn serve_until(app: Router) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stopped.await;
            })
            .await
            .expect("serve");
    });
    Server { addr, stop, task }
}

impl Server {
    async fn stop(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("the server stops")
            .expect("server task");
    }
}

async fn post_key(addr: SocketAddr, key: &str, body: &str) -> Answer {
    send_body(addr, key, body, Duration::from_secs(40))
        .await
        .unwrap_or_else(|| panic!("no answer for {key}"))
}

/// One slow request on `key` (work `work`, mode `mode`), a retry once three leases have gone by
/// while it works, then both answers once the first is done.
async fn slow_then_retry(
    addr: SocketAddr,
    sink: &Arc<Sink>,
    key: &str,
    mode: &str,
    work: Duration,
    retry_after: Duration,
) -> (Answer, Answer) {
    let b = body(mode, work.as_millis() as u64);
    // Read before the request is sent: on a multi-thread runtime it may enter at once.
    let entered_before = sink.entered_of(key);
    let first = {
        let (key, b) = (key.to_owned(), b.clone());
        tokio::spawn(async move { post_key(addr, &key, &b).await })
    };
    common::until("the first run enters", || {
        sink.entered_of(key) > entered_before
    })
    .await;
    tokio::time::sleep(retry_after).await;
    let retry = post_key(addr, key, &b).await;
    let first = tokio::time::timeout(Duration::from_secs(40), first)
        .await
        .expect("first answered")
        .expect("first task");
    (first, retry)
}

// ---- 1. the thread-local cache and a layer rebuilt where an old one lived -----------------------

/// DESIGN §4. A long-lived runtime rebuilds its router (a config reload, a layer per tenant
/// built on demand, a test helper building an app per case): each generation's layer is
/// dropped, its keeper ends, and the next layer is built on the same thread. `KEPT` caches
/// (layer address, runtime id, keepers ended): a new layer allocated at the dropped one's
/// address, with its own count of ended keepers back at 0, must not be taken for it. Every
/// generation's slow holder must stay renewed: the retry is told 409 in flight and the key
/// runs once.
fn rebuilt_layers(rt: tokio::runtime::Runtime, generations: usize) {
    // One store and one sink for every generation (keys are per generation), so that the
    // only thing built anew is the layer (as a router rebuilt from long-lived state is).
    let store = Watch::new();
    let sink = Arc::new(Sink::default());
    rt.block_on(async move {
        for generation in 0..generations {
            let (store_g, sink_g) = (store.clone(), sink.clone());
            // On a worker of the runtime, where its holds are made and its keepers end.
            let one = tokio::spawn(async move {
                let (store, sink) = (store_g, sink_g);
                let layer = layer(&store, ms(150));
                let server = serve_until(app(layer, sink.clone())).await;
                let addr = server.addr;
                // Holds on this thread: the second finds the keeper and caches it.
                for warm in ["w1", "w2", "w3"] {
                    let warm = format!("g{generation}-{warm}");
                    let a = post_key(addr, &warm, &body("fast", 0)).await;
                    assert_eq!(a.status, 201, "generation {generation}: {warm}: {a:?}");
                }
                let key = format!("g{generation}-k");
                let (first, retry) =
                    slow_then_retry(addr, &sink, &key, "sleep", ms(900), ms(500)).await;
                tokio::time::sleep(ms(100)).await;
                server.stop().await;
                (key, first, retry)
            });
            let (key, first, retry) = one.await.expect("generation");
            let runs = sink.effects_of(&key);
            let renewals = store.renews_of(&key).len();
            assert_eq!(
                runs, 1,
                "DESIGN §4: generation {generation} of a layer rebuilt on one live runtime: \
                 `{key}` ran {runs} times; its lease (150 ms) was renewed {renewals} times while \
                 the handler worked 900 ms: no keeper ran for this layer (the thread's KEPT \
                 cache took a dropped layer's keeper, at the same address, for this one's). \
                 first: {first:?}; retry: {retry:?}"
            );
            assert!(
                retry.in_flight(),
                "generation {generation}: the retry of a running key: {retry:?}"
            );
            assert!(
                renewals > 0,
                "generation {generation}: no renewal of `{key}`"
            );
            // The old layer's keeper notices the layer is gone within a tick (25 ms) and ends.
            tokio::time::sleep(ms(150)).await;
        }
    });
}

#[test]
fn s4_a_layer_rebuilt_on_a_live_current_thread_runtime_keeps_its_leases() {
    on_thread("rebuilt-ct", Duration::from_secs(240), || {
        rebuilt_layers(current_thread(), 20)
    });
}

#[test]
fn s4_a_layer_rebuilt_on_a_live_one_worker_runtime_keeps_its_leases() {
    on_thread("rebuilt-mt", Duration::from_secs(240), || {
        rebuilt_layers(multi_thread(1), 20)
    });
}

// ---- 2. one layer, runtimes in sequence on one thread ----------------------------------------

/// DESIGN §4: one layer outlives a sequence of runtimes built and dropped on one OS thread
/// (current-thread and multi-thread alternately, as test helpers or a restarting worker do).
/// Each runtime's slow holder is renewed by a keeper on that runtime: the retry is told 409
/// and the key runs once. A thread whose cache names an ended runtime's keeper must not take
/// it for the new runtime's.
#[test]
fn s4_one_layer_many_runtimes_in_sequence_on_one_thread_each_keeps_its_leases() {
    on_thread("sequence", Duration::from_secs(240), || {
        let store = Watch::new();
        let sink = Arc::new(Sink::default());
        let router = app(layer(&store, ms(150)), sink.clone());
        for round in 0..6 {
            let rt = if round % 2 == 0 {
                current_thread()
            } else {
                multi_thread(1)
            };
            let key = format!("k{round}");
            let (router, sink2, store2) = (router.clone(), sink.clone(), store.clone());
            let (first, retry, renewals) = rt.block_on(async move {
                let server = serve_until(router).await;
                for warm in ["w1", "w2"] {
                    let warm = format!("{warm}-{round}");
                    assert_eq!(
                        post_key(server.addr, &warm, &body("fast", 0)).await.status,
                        201
                    );
                }
                let (first, retry) =
                    slow_then_retry(server.addr, &sink2, &key, "sleep", ms(900), ms(500)).await;
                server.stop().await;
                (first, retry, store2.renews_of(&key))
            });
            drop(rt);
            let key = format!("k{round}");
            assert_eq!(
                sink.effects_of(&key),
                1,
                "DESIGN §4: runtime #{round} on a thread that ran earlier runtimes: `{key}` ran \
                 {} times, renewed {} times; first {first:?}, retry {retry:?}",
                sink.effects_of(&key),
                renewals.len()
            );
            assert!(retry.in_flight(), "runtime #{round}: retry {retry:?}");
        }
    });
}

// ---- 3. concurrent runtimes, one layer cloned into several routers ----------------------------

/// DESIGN §4, §7.3: one layer cloned into four routers, each served by a runtime of its own
/// (two current-thread, two multi-thread), started together; runtime 0 serves one fast
/// request and shuts down while the others' holders work. Each key runs once, each retry
/// during its run is told 409.
#[test]
fn s4_one_layer_cloned_into_routers_on_concurrent_runtimes_runs_each_key_once() {
    let store = Watch::new();
    let sink = Arc::new(Sink::default());
    let layer = layer(&store, ms(200));
    let barrier = Arc::new(std::sync::Barrier::new(4));
    let mut threads = Vec::new();
    for r in 0..4usize {
        let router = app(layer.clone(), sink.clone());
        let (sink, barrier) = (sink.clone(), barrier.clone());
        threads.push(std::thread::spawn(move || {
            let rt = if r % 2 == 0 {
                current_thread()
            } else {
                multi_thread(2)
            };
            rt.block_on(async move {
                let server = serve_until(router).await;
                barrier.wait();
                if r == 0 {
                    assert_eq!(
                        post_key(server.addr, "r0-fast", &body("fast", 0))
                            .await
                            .status,
                        201
                    );
                    server.stop().await;
                    return Vec::new();
                }
                let mut tasks = Vec::new();
                for i in 0..8 {
                    let (sink, key) = (sink.clone(), format!("r{r}-k{i}"));
                    let addr = server.addr;
                    tasks.push(tokio::spawn(async move {
                        let (first, retry) =
                            slow_then_retry(addr, &sink, &key, "sleep", ms(1200), ms(700)).await;
                        (key, first, retry)
                    }));
                }
                let mut out = Vec::new();
                for t in tasks {
                    out.push(t.await.expect("task"));
                }
                server.stop().await;
                out
            })
        }));
    }
    let mut answers = Vec::new();
    for t in threads {
        answers.extend(on_thread("join", Duration::from_secs(120), move || {
            t.join().expect("runtime thread")
        }));
    }
    assert_eq!(answers.len(), 24);
    for (key, first, retry) in &answers {
        assert_eq!(
            sink.effects_of(key),
            1,
            "DESIGN §4: `{key}` ran {} times (renewed {} times); first {first:?}; retry {retry:?}",
            sink.effects_of(key),
            store.renews_of(key).len()
        );
        assert!(
            retry.in_flight(),
            "`{key}`: retry during the run: {retry:?}"
        );
    }
}

// ---- 4. a keeper renews only its own runtime's holds -------------------------------------------

/// DESIGN §4 / hold.rs: "Each runtime now gets its own keeper task, renewing the leases held on
/// it". Runtime A (warmed first, so its keeper exists) stays idle; a slow holder on runtime B
/// is renewed, and every one of its renewals runs on B, none on A.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_holders_renewals_run_on_its_own_runtime_only() {
    let store = Watch::new();
    let sink = Arc::new(Sink::default());
    let router = app(layer(&store, ms(150)), sink.clone());
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let router_a = router.clone();
    let a = std::thread::spawn(move || {
        let rt = multi_thread(1);
        let id = rt.handle().id();
        let server = rt.block_on(async move {
            let server = serve_until(router_a).await;
            for w in ["a-1", "a-2"] {
                assert_eq!(post_key(server.addr, w, &body("fast", 0)).await.status, 201);
            }
            server
        });
        ready_tx.send(id).expect("ready");
        let _ = stop_rx.recv();
        rt.block_on(server.stop());
    });
    let id_a = tokio::task::spawn_blocking(move || ready_rx.recv().expect("a ready"))
        .await
        .expect("join");
    let id_b = tokio::runtime::Handle::current().id();
    let server = serve_until(router).await;
    let (first, retry) = slow_then_retry(server.addr, &sink, "b", "sleep", ms(900), ms(500)).await;
    let _ = stop_tx.send(());
    tokio::task::spawn_blocking(move || a.join().expect("a"))
        .await
        .expect("join");
    server.stop().await;
    let on = store.renews_of("b");
    assert_eq!(sink.effects_of("b"), 1, "first {first:?} retry {retry:?}");
    assert!(retry.in_flight(), "{retry:?}");
    assert!(!on.is_empty(), "DESIGN §4: B's holder was never renewed");
    assert!(
        on.iter().all(|id| *id == Some(id_b)),
        "hold.rs: renewals of a hold made on runtime B ({id_b}) ran elsewhere (A is {id_a}): \
         {on:?}"
    );
}

// ---- 5. many holds across runtimes ----------------------------------------------------------------

/// DESIGN §4, §7.3: 300 concurrent slow holders (1 s leases) on each of two runtimes sharing
/// one layer:
/// every retry during the runs is told 409 (or, had its first run finished, a replay), and
/// every key runs exactly once.
#[test]
fn s4_hundreds_of_holds_on_two_runtimes_each_run_once() {
    const PER: usize = 300;
    let store = Watch::new();
    let sink = Arc::new(Sink::default());
    let layer = layer(&store, ms(1000));
    let mut threads = Vec::new();
    for r in 0..2usize {
        let router = app(layer.clone(), sink.clone());
        let sink = sink.clone();
        threads.push(std::thread::spawn(move || {
            let rt = if r == 0 {
                multi_thread(2)
            } else {
                current_thread()
            };
            rt.block_on(async move {
                let server = serve_until(router).await;
                let addr = server.addr;
                let firsts: Vec<_> = (0..PER)
                    .map(|i| {
                        let key = format!("r{r}-{i}");
                        tokio::spawn(async move {
                            let a = post_key(addr, &key, &body("sleep", 4000)).await;
                            (key, a)
                        })
                    })
                    .collect();
                common::until("all runs entered", || {
                    (0..PER).all(|i| sink.entered_of(&format!("r{r}-{i}")) > 0)
                })
                .await;
                // Past a lease and a half since the last run entered, every holder working on.
                tokio::time::sleep(ms(1500)).await;
                let retries: Vec<_> = (0..PER)
                    .map(|i| {
                        let key = format!("r{r}-{i}");
                        tokio::spawn(async move {
                            let a = post_key(addr, &key, &body("sleep", 4000)).await;
                            (key, a)
                        })
                    })
                    .collect();
                let mut out = Vec::new();
                for (f, r) in firsts.into_iter().zip(retries) {
                    let (key, first) = f.await.expect("first");
                    let (_, retry) = r.await.expect("retry");
                    out.push((key, first, retry));
                }
                server.stop().await;
                out
            })
        }));
    }
    let mut all = Vec::new();
    for t in threads {
        all.extend(on_thread("join", Duration::from_secs(200), move || {
            t.join().expect("runtime")
        }));
    }
    std::thread::sleep(ms(200));
    let (worst, n) = sink.most_effects();
    let answers: Vec<_> = all.iter().filter(|(k, _, _)| *k == worst).collect();
    let twice = sink
        .effects
        .lock()
        .unwrap()
        .values()
        .filter(|n| **n > 1)
        .count();
    assert_eq!(
        n,
        1,
        "DESIGN §4: `{worst}` ran {n} times among {} holders on two runtimes ({twice} keys ran \
         more than once); its renewals' gaps (ms): {:?}; answers {answers:?}",
        2 * PER,
        store.gaps_of(&worst)
    );
    let total: usize = sink.effects.lock().unwrap().values().sum();
    assert_eq!(total, 2 * PER, "every key ran once");
    for (key, first, retry) in &all {
        assert!(
            retry.in_flight() || retry.is_replay_of(&first.body),
            "`{key}`: first {first:?}, retry {retry:?}"
        );
    }
}

// ---- 6. a paused tokio clock ----------------------------------------------------------------
//
// Tried in `app_runtimes_review.rs` (the suite's tokio has `test-util` since session 32).

// ---- 7. a store whose renewal panics ----------------------------------------------------------

/// DESIGN §4 / d9964ad: "a panicking renewal counts as failed". A store whose every other
/// renewal panics: the ones in between succeed, so the lease is kept (two panics in a row must
/// not leave the slot's count of renewals under way stuck at its limit), the retry is told 409,
/// and the key runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_renewals_that_panic_every_other_time_keep_the_lease() {
    let store = Watch::new();
    store.panic_every.store(2, Ordering::SeqCst);
    let sink = Arc::new(Sink::default());
    let server = serve_until(app(layer(&store, ms(300)), sink.clone())).await;
    let (first, retry) =
        slow_then_retry(server.addr, &sink, "k", "sleep", ms(2400), ms(1600)).await;
    server.stop().await;
    let (renews, ok) = (store.renews(), store.renewed_ok.load(Ordering::SeqCst));
    assert_eq!(
        sink.effects_of("k"),
        1,
        "DESIGN §4: `k` ran {} times; renewals {renews} ({ok} ok); first {first:?}; retry \
         {retry:?}",
        sink.effects_of("k")
    );
    assert!(retry.in_flight(), "{retry:?}");
    assert!(
        ok >= 3,
        "the renewals between panics kept going: {renews} sent, {ok} ok"
    );
}

/// A store whose every renewal panics: the lease lapses as for a crash (a retry on a Reclaim
/// route may take the key over), but the keeper never stops trying (no stuck counter: more
/// than two renewals are sent) and nothing hangs: both requests are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_renewals_that_always_panic_lapse_as_a_crash_and_never_wedge() {
    let store = Watch::new();
    store.panic_every.store(1, Ordering::SeqCst);
    let sink = Arc::new(Sink::default());
    let server = serve_until(app(layer(&store, ms(200)), sink.clone())).await;
    let (first, retry) = slow_then_retry(server.addr, &sink, "k", "sleep", ms(1500), ms(700)).await;
    tokio::time::sleep(ms(1800)).await;
    server.stop().await;
    assert!(
        store.renews() > 2,
        "d9964ad: after two panicking renewals the keeper stopped renewing for good: {} sent",
        store.renews()
    );
    assert!(
        first.status == 201 && (retry.status == 201 || retry.in_flight()),
        "first {first:?} retry {retry:?}"
    );
    assert!(
        sink.effects_of("k") <= 2,
        "at most the crash's takeover: {}",
        sink.effects_of("k")
    );
}

// ---- 8. a layer outside any runtime -------------------------------------------------------------

/// hold.rs: "Without a runtime there is nothing to renew on: the lease runs out as for a
/// crash." A layer driven outside any tokio runtime must not panic or hang the caller.
#[test]
fn s4_a_layer_polled_outside_any_runtime_answers_or_refuses_without_hanging() {
    use tower::{Service, ServiceExt};
    let store = Watch::new();
    let sink = Arc::new(Sink::default());
    let router = app(layer(&store, ms(200)), sink.clone());
    let out = on_thread("no-runtime", Duration::from_secs(30), move || {
        let req = axum::http::Request::post("/op")
            .header("idempotency-key", "k")
            .header("content-type", "application/json")
            .body(axum::body::Body::from(body("fast", 0)))
            .expect("request");
        let mut router = router;
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            block_on(async move {
                ServiceExt::<axum::http::Request<axum::body::Body>>::ready(&mut router)
                    .await
                    .expect("ready");
                let res = router.call(req).await.expect("infallible");
                res.status().as_u16()
            })
        }))
        .map_err(|p| {
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default()
        })
    });
    eprintln!(
        "outside any runtime: {out:?}; effects {}",
        sink.effects_of("k")
    );
    match out {
        Ok(status) => assert!(
            status == 201 || status == 503 || status == 500,
            "status {status}"
        ),
        Err(panic) => panic!("a layer polled outside any runtime panicked: {panic}"),
    }
}

/// A minimal executor: polls `f` on this thread, parking between wake-ups.
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    use std::task::{Context, Poll, Wake, Waker};
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(out) = f.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park_timeout(ms(50));
    }
}

// ---- 9. a shorter lease racing keepers as they start ------------------------------------------

/// DESIGN §4 / hold.rs `start`: a shorter lease wakes every keeper from a thread of its own.
/// Four fresh runtimes start together; on each, the first request holds a 10 s lease (a keeper
/// starts with a 1 s tick), and at once a second one holds a 150 ms lease and works 900 ms:
/// the wake-ups race the keepers' starts. Every short holder must be renewed: 409, one run.
#[test]
fn s4_shorter_leases_racing_keeper_starts_on_fresh_runtimes_are_kept() {
    let store = Watch::new();
    let sink = Arc::new(Sink::default());
    let router = app(layer(&store, ms(150)), sink.clone());
    let long_router = app(
        IdempotencyLayer::from_arc(store.clone())
            .single_tenant()
            .lease(Duration::from_secs(10)),
        sink.clone(),
    );
    let barrier = Arc::new(std::sync::Barrier::new(4));
    let threads: Vec<_> = (0..4usize)
        .map(|r| {
            let (router, long_router, sink, barrier) = (
                router.clone(),
                long_router.clone(),
                sink.clone(),
                barrier.clone(),
            );
            std::thread::spawn(move || {
                let rt = if r % 2 == 0 {
                    multi_thread(2)
                } else {
                    current_thread()
                };
                rt.block_on(async move {
                    let short = serve_until(router).await;
                    let long = serve_until(long_router).await;
                    barrier.wait();
                    let (long_key, fast) = (format!("long-{r}"), body("fast", 0));
                    let warm = post_key(long.addr, &long_key, &fast);
                    let key = format!("short-{r}");
                    let slow = slow_then_retry(short.addr, &sink, &key, "sleep", ms(900), ms(550));
                    let (_, (first, retry)) = tokio::join!(warm, slow);
                    short.stop().await;
                    long.stop().await;
                    (key, first, retry)
                })
            })
        })
        .collect();
    for t in threads {
        let (key, first, retry) = on_thread("join", Duration::from_secs(120), move || {
            t.join().expect("runtime")
        });
        assert_eq!(
            sink.effects_of(&key),
            1,
            "DESIGN §4: `{key}` ran {} times (renewed {} times); first {first:?} retry {retry:?}",
            sink.effects_of(&key),
            store.renews_of(&key).len()
        );
        assert!(retry.in_flight(), "`{key}`: {retry:?}");
    }
}

// ---- 10. detached::finished() ------------------------------------------------------------------
//
// `running()` counts the whole process's detached work, so each test runs in a child process
// of its own (common::run_child): other tests' hang-ups cannot move the count.

const CHILD: &str = "KEEPER_RUNTIMES_REVIEW_CHILD";

fn is_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

/// README "the server is stopped gracefully": with nothing detached, `finished()` returns at
/// once (bounded here) and `running()` is 0, before and after any runtime existed.
#[test]
fn s1_7_finished_with_nothing_running_returns_at_once() {
    if !is_child() {
        return common::run_child(
            module_path!(),
            "s1_7_finished_with_nothing_running_returns_at_once",
            CHILD,
        );
    }
    assert_eq!(tower_idempotency::detached::running(), 0);
    for _ in 0..3 {
        let rt = current_thread();
        rt.block_on(async {
            tokio::time::timeout(ms(2000), tower_idempotency::detached::finished())
                .await
                .expect("finished() with nothing running returns at once");
        });
    }
    println!("TEARDOWN-CHILD-OK");
}

/// A request whose client hangs up after `after`, its handler working on detached.
async fn hang_up(addr: SocketAddr, key: &str, b: String, after: Duration) {
    let out = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(after)
        .build()
        .expect("client")
        .post(format!("http://{addr}/op"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(b)
        .send()
        .await;
    assert!(
        out.is_err(),
        "the client hung up before the answer: {out:?}"
    );
}

/// README "the server is stopped gracefully" / DESIGN §1.7: a run detached (its client left)
/// on runtime A; while `finished()` waits (on runtime B, another runtime), a second run is
/// detached before the first ends. `finished()` returns only when both have recorded their
/// outcomes: each record is completed when it returns.
#[test]
fn s1_7_finished_waits_for_work_detached_while_it_waits_from_another_runtime() {
    if !is_child() {
        return common::run_child(
            module_path!(),
            "s1_7_finished_waits_for_work_detached_while_it_waits_from_another_runtime",
            CHILD,
        );
    }
    let store = Watch::new();
    let sink = Arc::new(Sink::default());
    let router = app(layer(&store, ms(300)), sink.clone());
    let rt_a = multi_thread(2);
    let addr = rt_a.block_on(async move { serve_until(router).await.addr_leaked() });
    rt_a.block_on(async {
        hang_up(addr, "one", body("sleep", 600), ms(150)).await;
        common::until("the run is detached", || {
            tower_idempotency::detached::running() >= 1
        })
        .await;
    });
    assert_eq!(
        tower_idempotency::detached::running(),
        1,
        "the first detached run is counted"
    );
    // Runtime B waits; meanwhile A detaches a second run before the first ends.
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let store_b = store.clone();
    let waiter = std::thread::spawn(move || {
        current_thread().block_on(async move {
            tokio::time::timeout(
                Duration::from_secs(30),
                tower_idempotency::detached::finished(),
            )
            .await
            .expect("finished() returns once the work is done");
            let one = store_b
                .lookup(&ScopedKey::new("", "one"))
                .await
                .expect("lookup");
            let two = store_b
                .lookup(&ScopedKey::new("", "two"))
                .await
                .expect("lookup");
            let _ = done_tx.send((one.map(|r| r.status), two.map(|r| r.status)));
        });
    });
    rt_a.block_on(hang_up(addr, "two", body("sleep", 900), ms(150)));
    let (one, two) = done_rx
        .recv_timeout(Duration::from_secs(40))
        .expect("finished() returned");
    waiter.join().expect("waiter");
    assert_eq!(
        (sink.effects_of("one"), sink.effects_of("two")),
        (1, 1),
        "both detached runs made their effect before finished() returned"
    );
    assert_eq!(
        (format!("{one:?}"), format!("{two:?}")),
        ("Some(Completed)".to_owned(), "Some(Completed)".to_owned()),
        "finished() returned before the detached runs recorded"
    );
    assert_eq!(tower_idempotency::detached::running(), 0);
    drop(rt_a);
    println!("TEARDOWN-CHILD-OK");
}

/// README: "a runtime dropped under them ends them as a crash would". A current-thread and a
/// multi-thread runtime are each dropped while a run whose client left is still at work:
/// the count falls back to 0 and `finished()`, awaited on another runtime, returns (never a
/// hang).
#[test]
fn s1_7_a_runtime_dropped_under_detached_work_brings_the_count_back_to_zero() {
    if !is_child() {
        return common::run_child(
            module_path!(),
            "s1_7_a_runtime_dropped_under_detached_work_brings_the_count_back_to_zero",
            CHILD,
        );
    }
    for flavour in ["current_thread", "multi_thread", "multi_thread_background"] {
        let store = Watch::new();
        let sink = Arc::new(Sink::default());
        let router = app(layer(&store, ms(300)), sink.clone());
        let rt = if flavour == "current_thread" {
            current_thread()
        } else {
            multi_thread(2)
        };
        let addr = rt.block_on(async move { serve_until(router).await.addr_leaked() });
        // A run (and its client) that will be cut: the handler works 20 s.
        rt.block_on(async {
            hang_up(addr, "cut", body("sleep", 20_000), ms(150)).await;
            common::until("the run entered", || sink.entered() == 1).await;
            common::until("the run is detached", || {
                tower_idempotency::detached::running() >= 1
            })
            .await;
        });
        assert!(
            tower_idempotency::detached::running() >= 1,
            "{flavour}: the detached run is counted"
        );
        if flavour == "multi_thread_background" {
            rt.shutdown_background();
        } else {
            drop(rt);
        }
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            current_thread().block_on(async move {
                let out = tokio::time::timeout(
                    Duration::from_secs(10),
                    tower_idempotency::detached::finished(),
                )
                .await;
                let _ = tx.send(out.is_ok());
            });
        });
        let returned = rx.recv_timeout(Duration::from_secs(20)).unwrap_or(false);
        assert!(
            returned,
            "{flavour}: finished() hung after the runtime was dropped under the work; running() \
             = {}",
            tower_idempotency::detached::running()
        );
        assert_eq!(tower_idempotency::detached::running(), 0, "{flavour}");
        assert_eq!(
            sink.effects_of("cut"),
            0,
            "{flavour}: the cut run made no effect"
        );
    }
    println!("TEARDOWN-CHILD-OK");
}

impl Server {
    /// The address, the server left running until its runtime ends.
    fn addr_leaked(self) -> SocketAddr {
        std::mem::forget(self.stop);
        self.addr
    }
}

// ---- 11. layers rebuilt back to back, driven directly ----------------------------------------

/// One request through `router` without a socket: (status, problem slug).
async fn call(router: &Router, key: &str, b: String) -> (u16, String) {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let req = axum::http::Request::post("/op")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(axum::body::Body::from(b))
        .expect("request");
    let res = router.clone().oneshot(req).await.expect("infallible");
    let status = res.status().as_u16();
    let bytes = res.into_body().collect().await.expect("body").to_bytes();
    let problem = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v["type"].as_str().map(str::to_owned))
        .map(|t| t.rsplit(':').next().unwrap_or_default().to_owned())
        .unwrap_or_default();
    (status, problem)
}

/// DESIGN §4, as §1 above but many generations and no sockets (fewer allocations between a
/// dropped layer's keeper ending and the next layer being built, as in a tight rebuild loop):
/// each generation's slow holder must be renewed and run once.
#[test]
fn s4_layers_rebuilt_back_to_back_on_one_thread_each_get_a_keeper() {
    on_thread("rebuilt-direct", Duration::from_secs(240), || {
        let store = Watch::new();
        let sink = Arc::new(Sink::default());
        current_thread().block_on(async move {
            let mut groomed: Vec<Box<[u8]>> = Vec::new();
            for generation in 0..80 {
                let router = app(layer(&store, ms(60)), sink.clone());
                drop(std::mem::take(&mut groomed));
                for w in 0..3 {
                    let (status, _) =
                        call(&router, &format!("g{generation}-w{w}"), body("fast", 0)).await;
                    assert_eq!(status, 201);
                }
                let key = format!("g{generation}-k");
                let slow = {
                    let (router, key) = (router.clone(), key.clone());
                    tokio::spawn(async move { call(&router, &key, body("sleep", 300)).await })
                };
                common::until("entered", || sink.entered_of(&key) == 1).await;
                tokio::time::sleep(ms(200)).await;
                let retry = call(&router, &key, body("sleep", 300)).await;
                let first = slow.await.expect("slow");
                let renewals = store.renews_of(&key).len();
                assert_eq!(
                    sink.effects_of(&key),
                    1,
                    "DESIGN §4: generation {generation} of a layer rebuilt on one live runtime: \
                     `{key}` ran {} times; its 60 ms lease was renewed {renewals} times over a \
                     300 ms run (no keeper ran for this layer: the thread's KEPT cache named a \
                     dropped layer's keeper at the same address); first {first:?}, retry \
                     {retry:?}",
                    sink.effects_of(&key)
                );
                assert_eq!(
                    retry,
                    (409, "in-flight".to_owned()),
                    "generation {generation}"
                );
                drop(router);
                if generation % 2 == 1 {
                    // Every other generation, the allocator's free lists of small sizes are
                    // taken up before the dropped layer's keeper ends (as busy request handling
                    // on this thread may leave them): the next layer is then built in the
                    // memory the dropped one's keeper gave back last.
                    groomed = (96..=192usize)
                        .step_by(8)
                        .flat_map(|size| (0..64).map(move |_| vec![1u8; size].into_boxed_slice()))
                        .collect();
                }
                // The dropped layer's keeper ends within a tick (10 ms).
                tokio::time::sleep(ms(60)).await;
            }
        })
    });
}

/// hold.rs `Held::runtime`: "The runtime the lease is held on, whose keeper renews it (any
/// keeper, without one)". A layer whose keeper runs on a live runtime A also serves a request
/// polled outside any runtime (a plain executor on an OS thread) whose handler waits 900 ms
/// for real I/O. A's keeper renews that lease: a retry through A is told 409; one run.
#[test]
fn s4_a_hold_made_outside_any_runtime_is_kept_by_a_live_keeper() {
    let store = Watch::new();
    let sink = Arc::new(Sink::default());
    let router = app(layer(&store, ms(150)), sink.clone());
    let rt_a = multi_thread(2);
    let server = rt_a.block_on(serve_until(router.clone()));
    let addr = server.addr;
    rt_a.block_on(async {
        for w in ["a-1", "a-2"] {
            assert_eq!(post_key(addr, w, &body("fast", 0)).await.status, 201);
        }
    });
    let outside = std::thread::spawn(move || block_on(call(&router, "k", body("real", 900))));
    let retry = rt_a.block_on(async {
        common::until("the outside run entered", || sink.entered_of("k") == 1).await;
        tokio::time::sleep(ms(500)).await;
        post_key(addr, "k", &body("real", 900)).await
    });
    let first = on_thread("outside", Duration::from_secs(30), move || {
        outside.join().expect("outside")
    });
    rt_a.block_on(server.stop());
    assert_eq!(
        sink.effects_of("k"),
        1,
        "hold.rs: a hold made outside any runtime is renewed by any keeper; `k` ran {} times \
         ({} renewals); first {first:?}; retry {retry:?}",
        sink.effects_of("k"),
        store.renews_of("k").len()
    );
    assert!(retry.in_flight(), "{retry:?}");
}
