//! Review (session 32) of today's changes: JSON-RPC answers that are JSON but not the call's
//! response taken as done (`final_response`), `Mcp-Method` given twice refused
//! (`HeaderMethod::of`), `MemoryStore::new()` on tokio's clock, and the keeper's start thread
//! joined before the first hold on a runtime returns.
//!
//! Section (3)'s first three tests failed on `MemoryStore::new()` reading tokio's clock (the
//! calling runtime's: a paused one and a running one disagree, and one `advance` jumps a lease):
//! `new()` went back to std's clock, and tokio's became the opt-in
//! `MemoryStore::on_tokio_clock()`. They now hold `new()` to a clock every runtime shares.
//!
//! Effects are counted at the sink (an `AtomicUsize` the handler bumps), never by counting
//! responses. Requests go through the layered router in process (`tower::ServiceExt::oneshot`):
//! a paused clock auto-advances past a socket's timers. Every test runs on an OS thread of its
//! own under a wall-clock watchdog (a paused tokio clock cannot guard itself).

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::Response;
use axum::routing::post;
use bytes::Bytes;
use common::jsonrpc_code;
use common::runtimes::{current_thread, multi_thread, on_thread, paused};
use serde_json::Value;
use tower_idempotency::jsonrpc::JsonRpc;
use tower_idempotency::scope::SingleTenant;
use tower_idempotency::{
    CachePolicy, IdempotencyContext, IdempotencyLayer, IdempotencyStore, LeaseExpiry, MemoryStore,
};

const WATCHDOG: Duration = Duration::from_secs(40);

// ---- harness -------------------------------------------------------------------------------------

// ---- an HTTP app whose handler can be held --------------------------------------------------------

/// Runs (entries into the handler) per key, and a gate the first run of a key waits at.
struct Sink {
    runs: Mutex<std::collections::HashMap<String, usize>>,
    entered: tokio::sync::Notify,
    /// The first run of a key with `"hold": true` waits for a permit here.
    gate: Arc<tokio::sync::Semaphore>,
}

impl Sink {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            runs: Mutex::default(),
            entered: tokio::sync::Notify::new(),
            gate: Arc::new(tokio::sync::Semaphore::new(0)),
        })
    }
    fn runs_of(&self, key: &str) -> usize {
        self.runs.lock().unwrap().get(key).copied().unwrap_or(0)
    }
    /// Waits (no timer) until `key` has run `n` times.
    async fn entered_n(&self, key: &str, n: usize) {
        loop {
            let woken = self.entered.notified();
            if self.runs_of(key) >= n {
                return;
            }
            woken.await;
        }
    }
    fn open(&self) {
        self.gate.add_permits(1000);
    }
}

/// `/op`: counts a run at the sink; with `{"hold":true}` a key's first run waits at the gate
/// (later runs, a takeover or a second run, answer at once).
fn app<St: IdempotencyStore>(layer: IdempotencyLayer<St, SingleTenant>, sink: Arc<Sink>) -> Router {
    Router::new().route(
        "/op",
        post(move |ctx: IdempotencyContext, body: String| {
            let sink = sink.clone();
            async move {
                let key = ctx.key().to_owned();
                let n = {
                    let mut runs = sink.runs.lock().unwrap();
                    let n = runs.entry(key.clone()).or_default();
                    *n += 1;
                    *n
                };
                sink.entered.notify_waiters();
                let v: Value = serde_json::from_str(&body).unwrap_or_default();
                if v["hold"].as_bool() == Some(true) && n == 1 {
                    let _permit = sink.gate.acquire().await.expect("gate");
                }
                (
                    StatusCode::CREATED,
                    format!("{key} run {n} attempt {}", ctx.attempt()),
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

#[derive(Debug, Clone)]
struct Got {
    status: u16,
    replayed: bool,
    text: String,
}

impl Got {
    /// `error.data` of a JSON-RPC error.
    fn data(&self) -> Value {
        serde_json::from_str::<Value>(&self.text)
            .ok()
            .map(|v| v["error"]["data"].clone())
            .unwrap_or_default()
    }
}

async fn got(res: Response) -> Got {
    use http_body_util::BodyExt;
    let status = res.status().as_u16();
    let replayed = res
        .headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let bytes = res.into_body().collect().await.expect("body").to_bytes();
    Got {
        status,
        replayed,
        text: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

async fn call(router: &Router, key: &str, body: &str) -> Got {
    use tower::ServiceExt;
    let req = axum::http::Request::post("/op")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .expect("request");
    got(router.clone().oneshot(req).await.expect("infallible")).await
}

const HOLD: &str = r#"{"hold":true}"#;
const FAST: &str = r#"{"hold":false}"#;

// ---- (3) MemoryStore on tokio's clock ------------------------------------------------------------

/// DESIGN §4 ("The holder keeps its lease for as long as its process lives") and README's fault
/// table row for paused clocks ("leases stand still with the keeper's timers ..., and `advance`
/// expires records"). Condition: an application's test on a paused clock with
/// `MemoryStore::new()` made inside it, a handler still working (waiting
/// on its downstream), and the test moving time on with `tokio::time::advance(31 s)` past the
/// 30 s lease (a test of "a retry while the first is slow"); then a retry with the same key. The
/// holder is alive and its keeper runs: the retry must get 409 in flight, the key run once.
#[test]
fn s4_paused_clock_advance_past_the_lease_never_hands_a_live_holders_key_to_a_retry() {
    let (runs, retry) = on_thread("advance-past-lease", WATCHDOG, || {
        paused().block_on(async {
            let store = Arc::new(MemoryStore::new());
            let sink = Sink::new();
            let router = app(layer(store, Duration::from_secs(30)), sink.clone());
            let first = tokio::spawn({
                let router = router.clone();
                async move { call(&router, "adv", HOLD).await }
            });
            sink.entered_n("adv", 1).await;
            tokio::time::advance(Duration::from_secs(31)).await;
            let retry = call(&router, "adv", HOLD).await;
            sink.open();
            let _ = first.await.expect("first");
            (sink.runs_of("adv"), retry)
        })
    });
    assert_eq!(
        runs, 1,
        "one key, one live holder: the handler ran {runs} times (retry: {retry:?})"
    );
    assert_eq!(
        retry.status, 409,
        "the retry meets the live holder: {retry:?}"
    );
}

/// Control for the test above (DESIGN §4, README's paused-clock row). Condition: the same, but
/// the test advances in steps shorter than the lease (20 s twice, past one 30 s lease in all),
/// yielding between them: the keeper renews in between, so the retry must get 409 and the key
/// run once.
#[test]
fn s4_control_paused_clock_advance_in_steps_shorter_than_the_lease_keeps_it() {
    let (runs, retry) = on_thread("advance-in-steps", WATCHDOG, || {
        paused().block_on(async {
            let store = Arc::new(MemoryStore::new());
            let sink = Sink::new();
            let router = app(layer(store, Duration::from_secs(30)), sink.clone());
            let first = tokio::spawn({
                let router = router.clone();
                async move { call(&router, "steps", HOLD).await }
            });
            sink.entered_n("steps", 1).await;
            for _ in 0..2 {
                tokio::time::advance(Duration::from_secs(20)).await;
                for _ in 0..10 {
                    tokio::task::yield_now().await;
                }
            }
            let retry = call(&router, "steps", HOLD).await;
            sink.open();
            let _ = first.await.expect("first");
            (sink.runs_of("steps"), retry)
        })
    });
    assert_eq!(runs, 1, "ran {runs} times (retry: {retry:?})");
    assert_eq!(retry.status, 409, "{retry:?}");
}

/// DESIGN §4 (a live holder keeps its lease) and `MemoryStore`'s own word ("Records under a live
/// lease never expire, so in-flight keys are never evicted"). Condition: one `MemoryStore::new()`
/// made outside any runtime (as an application's test suite keeps one in a `static`), used by
/// two tests at once: one on an ordinary runtime whose request on key `live` is still working,
/// one on a paused clock that advances past the 24 h TTL (to test expiry) and sends requests on
/// keys of its own. Then the first test retries `live`: the holder is alive, so the retry must
/// get 409 in flight and `live` run once.
#[test]
fn s4_a_store_shared_with_a_paused_test_never_evicts_a_live_claim_of_another_runtime() {
    let store = Arc::new(MemoryStore::new()); // outside any runtime
    let (runs, retry) = on_thread("shared-store", WATCHDOG, move || {
        let (entered_tx, entered_rx) = std::sync::mpsc::channel::<()>();
        let (paused_done_tx, paused_done_rx) = std::sync::mpsc::channel::<()>();
        // The paused test: waits until the other test's request is at work, then expires.
        let paused_store = store.clone();
        let paused_test = std::thread::spawn(move || {
            entered_rx.recv().expect("entered");
            paused().block_on(async move {
                let sink = Sink::new();
                let router = app(layer(paused_store, Duration::from_secs(30)), sink.clone());
                tokio::time::advance(Duration::from_secs(25 * 3600)).await;
                for i in 0..800 {
                    let answer = call(&router, &format!("paused-{i}"), FAST).await;
                    assert_eq!(answer.status, 201, "{answer:?}");
                }
            });
            let _ = paused_done_tx.send(());
        });
        let out = multi_thread(2).block_on(async move {
            let sink = Sink::new();
            let router = app(layer(store, Duration::from_secs(30)), sink.clone());
            let first = tokio::spawn({
                let router = router.clone();
                async move { call(&router, "live", HOLD).await }
            });
            sink.entered_n("live", 1).await;
            entered_tx.send(()).expect("signal");
            tokio::task::spawn_blocking(move || paused_done_rx.recv())
                .await
                .expect("join")
                .expect("paused test done");
            let retry = call(&router, "live", HOLD).await;
            sink.open();
            let _ = first.await.expect("first");
            (sink.runs_of("live"), retry)
        });
        paused_test.join().expect("paused test");
        out
    });
    assert_eq!(
        runs, 1,
        "a live claim of one runtime was evicted by a paused runtime's clock: `live` ran {runs} \
         times (retry: {retry:?})"
    );
    assert_eq!(retry.status, 409, "{retry:?}");
}

/// README fault table ("a runtime dropped under them ends them as a crash would") and DESIGN §4
/// (an expired lease with no effect started is taken over by the next claim, `Reclaim`).
/// Condition: `MemoryStore::new()` made inside a paused test's runtime after its clock moved an
/// hour (a `static` first touched there), that runtime dropped, then the store used on ordinary
/// runtimes: a holder under a 300 ms lease dies with its runtime; a retry 1.2 s later (wall
/// time, four leases) must take the key over and run it, not find it held.
#[test]
fn s4_a_store_made_on_a_paused_clock_lets_a_crashed_lease_lapse_elsewhere() {
    let (runs, retry) = on_thread("store-from-paused", WATCHDOG, || {
        let store = paused().block_on(async {
            tokio::time::advance(Duration::from_secs(3600)).await;
            Arc::new(MemoryStore::new())
        });
        let sink = Sink::new();
        let lease = Duration::from_millis(300);
        // The holder's runtime dies under it: a crash.
        let crashed = current_thread();
        crashed.block_on({
            let (store, sink) = (store.clone(), sink.clone());
            async move {
                let router = app(layer(store, lease), sink.clone());
                tokio::spawn(async move { call(&router, "crash", HOLD).await });
                sink.entered_n("crash", 1).await;
            }
        });
        crashed.shutdown_background();
        std::thread::sleep(Duration::from_millis(1200));
        let retry = current_thread().block_on({
            let (store, sink) = (store.clone(), sink.clone());
            async move {
                let router = app(layer(store, lease), sink);
                call(&router, "crash", HOLD).await
            }
        });
        (sink.runs_of("crash"), retry)
    });
    assert_eq!(
        retry.status, 201,
        "the crashed holder's 300 ms lease never lapsed: {retry:?}"
    );
    assert_eq!(runs, 2, "the retry takes the key over and runs it once");
}

// ---- (4) the keeper's start thread, joined ---------------------------------------------------------

/// Names of this process's threads that are the keeper's start/wake threads.
fn keeper_threads() -> usize {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .filter(|name| name.starts_with("idempotency-kee"))
        .count()
}

/// hold.rs (one keeper task per runtime a layer serves on; the start thread joined) and DESIGN §4.
/// Condition: one layer serving 150 current-thread runtimes built and dropped in sequence (an
/// application suite's `#[tokio::test]`s over a `static` app), then a multi-thread runtime where
/// holds start from `spawn_blocking` (`Handle::block_on`) and from `block_in_place`. Each key runs
/// once and its retry on the next runtime is replayed; no request hangs; no keeper thread is left
/// behind.
#[test]
fn s4_holds_on_many_runtimes_and_from_blocking_contexts_run_once_and_leave_no_threads() {
    let runs = on_thread("many-runtimes", WATCHDOG, || {
        let store = Arc::new(MemoryStore::new());
        let sink = Sink::new();
        let router = app(layer(store, Duration::from_millis(500)), sink.clone());
        let mut replayed = 0;
        for i in 0..150 {
            let rt = current_thread();
            let router = router.clone();
            rt.block_on(async {
                let first = call(&router, &format!("rt-{i}"), FAST).await;
                assert_eq!(first.status, 201, "{first:?}");
                if i > 0 {
                    let retry = call(&router, &format!("rt-{}", i - 1), FAST).await;
                    replayed += usize::from(retry.replayed);
                }
            });
            drop(rt);
        }
        assert_eq!(replayed, 149, "each retry on the next runtime is replayed");
        let rt = multi_thread(2);
        rt.block_on(async {
            let r = router.clone();
            let a = tokio::task::spawn_blocking(move || {
                tokio::runtime::Handle::current().block_on(call(&r, "from-spawn-blocking", FAST))
            })
            .await
            .expect("spawn_blocking");
            assert_eq!(a.status, 201, "{a:?}");
            let r = router.clone();
            let b = tokio::spawn(async move {
                tokio::task::block_in_place(|| {
                    tokio::runtime::Handle::current().block_on(call(
                        &r,
                        "from-block-in-place",
                        FAST,
                    ))
                })
            })
            .await
            .expect("block_in_place");
            assert_eq!(b.status, 201, "{b:?}");
            for key in ["from-spawn-blocking", "from-block-in-place"] {
                let again = call(&router, key, FAST).await;
                assert!(again.replayed, "{key}: {again:?}");
            }
        });
        drop(rt);
        let left = keeper_threads();
        assert!(left <= 2, "{left} keeper start/wake threads left behind");
        let mut runs: Vec<usize> = (0..150).map(|i| sink.runs_of(&format!("rt-{i}"))).collect();
        runs.push(sink.runs_of("from-spawn-blocking"));
        runs.push(sink.runs_of("from-block-in-place"));
        runs
    });
    assert!(
        runs.iter().all(|&n| n == 1),
        "every key runs once: {runs:?}"
    );
}

/// A minimal executor: polls `f` on this thread, parking between wakes.
fn block_on_here<F: std::future::Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(out) = f.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park_timeout(Duration::from_millis(50));
    }
}

/// hold.rs ("Without a runtime there is nothing to renew on") and README ("a runtime dropped
/// under them ends them as a crash would"). Condition: a request made from the `Drop` of a task's
/// value while its runtime shuts down (the hold starts on a runtime that can spawn nothing: the
/// start thread's spawn drops the keeper at once, and the joined thread must not deadlock on
/// the keepers' lock). The request must neither hang nor panic, and run once; a retry on a new
/// runtime afterwards is replayed, not run again.
#[test]
fn s4_a_hold_started_from_a_drop_during_runtime_shutdown_neither_hangs_nor_runs_twice() {
    let (runs, retry) = on_thread("hold-from-drop", WATCHDOG, || {
        let store = Arc::new(MemoryStore::new());
        let sink = Sink::new();
        let router = app(layer(store, Duration::from_millis(500)), sink.clone());
        let answered = Arc::new(Mutex::new(None::<Got>));
        struct OnDrop(Router, Arc<Mutex<Option<Got>>>);
        impl Drop for OnDrop {
            fn drop(&mut self) {
                let got = block_on_here(call(&self.0, "from-drop", FAST));
                *self.1.lock().unwrap() = Some(got);
            }
        }
        let rt = current_thread();
        rt.block_on(async {
            // A keeper already runs here, and one does not: both starts are tried.
            let _ = call(&router, "warm", FAST).await;
            let on_drop = OnDrop(router.clone(), answered.clone());
            tokio::spawn(async move {
                let _kept = on_drop;
                std::future::pending::<()>().await;
            });
            tokio::task::yield_now().await;
        });
        drop(rt);
        let first = answered
            .lock()
            .unwrap()
            .clone()
            .expect("answered from drop");
        assert_eq!(first.status, 201, "{first:?}");
        let retry = current_thread().block_on(call(&router, "from-drop", FAST));
        (sink.runs_of("from-drop"), retry)
    });
    assert_eq!(runs, 1, "ran {runs} times; retry {retry:?}");
    assert!(retry.replayed, "{retry:?}");
}

// ---- (1) JSON-RPC answers that are JSON but not the call's response --------------------------------

/// The tool: one run per request that reaches it. It answers `x-reply` (`{ID}` replaced by the
/// call's id), or a plain result; `x-sse: 1` frames it as one SSE event; `x-empty: 1` sends no
/// body; `x-status` sets the status.
async fn tool(State(runs): State<Arc<AtomicUsize>>, headers: HeaderMap, body: Bytes) -> Response {
    runs.fetch_add(1, Ordering::SeqCst);
    let h = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let id = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v.get("id").map(Value::to_string))
        .unwrap_or_else(|| "null".to_owned());
    let reply = match h("x-reply") {
        r if r.is_empty() => format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{{"content":[]}}}}"#),
        r => r.replace("{ID}", &id),
    };
    let status = h("x-status").parse::<u16>().unwrap_or(200);
    let sse = h("x-sse") == "1";
    let body = match (h("x-empty") == "1", sse) {
        (true, _) => String::new(),
        (false, true) => format!("data: {reply}\n\n"),
        (false, false) => reply,
    };
    let ct = if sse {
        "text/event-stream"
    } else {
        "application/json"
    };
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, ct)
        .body(Body::from(body))
        .expect("response")
}

fn tool_app(jsonrpc: JsonRpc, policy: CachePolicy) -> (Router, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let router = Router::new()
        .route("/mcp", post(tool))
        .with_state(runs.clone())
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .cache_policy(policy)
                .jsonrpc(jsonrpc),
        );
    (router, runs)
}

fn call_body(id: u64, meta_key: Option<&str>) -> String {
    let meta = meta_key
        .map(|k| format!(r#","_meta":{{"idempotencyKey":"{k}"}}"#))
        .unwrap_or_default();
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"t","arguments":{{"a":1}}{meta}}}}}"#
    )
}

/// One JSON-RPC request through `router`, with raw header lines (appended: a name given twice is
/// two lines).
async fn rpc(router: &Router, headers: &[(&str, &str)], body: String) -> Got {
    use tower::ServiceExt;
    let mut req = axum::http::Request::post("/mcp")
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(Body::from(body))
        .expect("request");
    for (name, value) in headers {
        req.headers_mut().append(
            HeaderName::from_bytes(name.as_bytes()).expect("name"),
            HeaderValue::from_bytes(value.as_bytes()).expect("value"),
        );
    }
    got(router.clone().oneshot(req).await.expect("infallible")).await
}

/// A keyed call answered as `headers` say, then its retry (a new id, the same key); (runs, retry).
async fn call_and_retry(
    router: &Router,
    runs: &AtomicUsize,
    key: &str,
    headers: &[(&str, &str)],
) -> (usize, Got) {
    let mut with_key = vec![("idempotency-key", key)];
    with_key.extend_from_slice(headers);
    let _ = rpc(router, &with_key, call_body(7, None)).await;
    let retry = rpc(router, &with_key, call_body(8, None)).await;
    (runs.load(Ordering::SeqCst), retry)
}

/// DESIGN §1 ("`safe_new_key`: whether the client may now use a new key (the outcome is
/// definite: nothing ran, or it is recorded) or must keep retrying this one (the outcome is
/// unknown)") and README §JSON-RPC (a stream without the call's response: retries get -31007
/// "with `safe_new_key: false` (resume the first stream: a new key would run the call again)").
/// Condition: the same answer that is not the call's response (an answer to another id; a
/// notification) sent as a JSON body and as an SSE event under 200. Both are taken as done (one
/// run, -31007 to the retry); the outcome is unknown in both, so both retries must say
/// `safe_new_key: false`, whatever the framing.
#[test]
fn s8_an_unread_json_answer_tells_the_same_safe_new_key_as_the_same_answer_on_sse() {
    let results = on_thread("unread-parity", WATCHDOG, || {
        current_thread().block_on(async {
            let mut out = Vec::new();
            for (what, reply) in [
                ("other id", r#"{"jsonrpc":"2.0","id":999,"result":{"content":[]}}"#),
                ("notification", r#"{"jsonrpc":"2.0","method":"notifications/progress","params":{"progress":1}}"#),
            ] {
                for sse in [false, true] {
                    let (router, runs) = tool_app(JsonRpc::new(), CachePolicy::DefinitiveOnly);
                    let framing = if sse { "1" } else { "0" };
                    let (n, retry) =
                        call_and_retry(&router, &runs, "k", &[("x-reply", reply), ("x-sse", framing)])
                            .await;
                    out.push((format!("{what} sse={sse}"), n, retry));
                }
            }
            out
        })
    });
    for (what, runs, retry) in &results {
        assert_eq!(*runs, 1, "{what}: ran {runs} times");
        assert_eq!(jsonrpc_code(&retry.text), -31007, "{what}: {retry:?}");
    }
    for (what, _, retry) in &results {
        assert_eq!(
            retry.data()["safe_new_key"],
            Value::Bool(false),
            "{what}: the call's outcome is unknown here, a new key would run it again: {}",
            retry.text
        );
    }
}

/// README §JSON-RPC ("JSON that serde_json's `Value` cannot hold ... is read from its text ...
/// like any other"; "Only an answer that says the call did not run or is not finished ... gives
/// the key back") and DESIGN §3. Condition (differential): each answer sent as serde_json reads
/// it and with an extra member `"x":1e400` (read from its text), as a JSON body and as an SSE
/// event, under 200. The runs after a retry must be alike for both readings: an answer to
/// another id, a notification, a final result: one run; an interim result, an error to a `null`
/// id: the key given back, two runs.
#[test]
fn s3_readable_and_text_read_answers_classify_alike_in_body_and_stream() {
    let rows = on_thread("differential", WATCHDOG, || {
        current_thread().block_on(async {
            let answers: [(&str, &str, usize); 5] = [
                ("other id", r#"{"jsonrpc":"2.0","id":999,"result":{}X}"#, 1),
                (
                    "notification",
                    r#"{"jsonrpc":"2.0","method":"notifications/message","params":{}X}"#,
                    1,
                ),
                (
                    "final",
                    r#"{"jsonrpc":"2.0","id":{ID},"result":{"content":[]}X}"#,
                    1,
                ),
                (
                    "interim",
                    r#"{"jsonrpc":"2.0","id":{ID},"result":{"resultType":"input_required"}X}"#,
                    2,
                ),
                (
                    "null-id error",
                    r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"parse"}X}"#,
                    2,
                ),
            ];
            let mut rows = Vec::new();
            for (what, template, want) in answers {
                for extra in ["", r#","x":1e400"#] {
                    for sse in ["0", "1"] {
                        let reply = template.replace('X', extra);
                        let (router, runs) = tool_app(JsonRpc::new(), CachePolicy::DefinitiveOnly);
                        let (n, retry) = call_and_retry(
                            &router,
                            &runs,
                            "d",
                            &[("x-reply", &reply), ("x-sse", sse)],
                        )
                        .await;
                        rows.push((format!("{what} extra={extra:?} sse={sse}"), n, want, retry));
                    }
                }
            }
            rows
        })
    });
    let wrong: Vec<_> = rows
        .iter()
        .filter(|(_, n, want, _)| n != want)
        .map(|(what, n, want, retry)| format!("{what}: ran {n}, want {want} ({})", retry.text))
        .collect();
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// A case: its name, the headers that script the tool's answer, the route's policy, the runs.
type Case<'a> = (&'a str, Vec<(&'a str, &'a str)>, CachePolicy, usize);

/// README §JSON-RPC ("under a success status it is taken as done ... never run again"; "under
/// an error status the policy decides, as for any answer") and DESIGN §3. Condition: answers
/// that are not the call's response under 200/202/204 (no body; a batch holding the response;
/// a bare string; `null`) and an answer to another id under 500 and 400, with `DefinitiveOnly`
/// and `Everything`. Success: one run. Error status: `DefinitiveOnly` gives the key back (two
/// runs, as the same status with the call's own response does), `Everything` keeps it (one).
#[test]
fn s3_not_the_response_under_each_status_and_policy() {
    let rows = on_thread("status-policy", WATCHDOG, || {
        current_thread().block_on(async {
            let other = r#"{"jsonrpc":"2.0","id":999,"result":{}}"#;
            let own = r#"{"jsonrpc":"2.0","id":{ID},"result":{}}"#;
            let batch = r#"[{"jsonrpc":"2.0","id":{ID},"result":{}}]"#;
            let cases: Vec<Case<'_>> = vec![
                (
                    "204 empty",
                    vec![("x-status", "204"), ("x-empty", "1")],
                    CachePolicy::DefinitiveOnly,
                    1,
                ),
                (
                    "202 empty",
                    vec![("x-status", "202"), ("x-empty", "1")],
                    CachePolicy::DefinitiveOnly,
                    1,
                ),
                (
                    "200 batch",
                    vec![("x-reply", batch)],
                    CachePolicy::DefinitiveOnly,
                    1,
                ),
                (
                    "200 string",
                    vec![("x-reply", r#""done""#)],
                    CachePolicy::DefinitiveOnly,
                    1,
                ),
                (
                    "200 null",
                    vec![("x-reply", "null")],
                    CachePolicy::DefinitiveOnly,
                    1,
                ),
                (
                    "500 other id definitive",
                    vec![("x-status", "500"), ("x-reply", other)],
                    CachePolicy::DefinitiveOnly,
                    2,
                ),
                (
                    "500 own definitive",
                    vec![("x-status", "500"), ("x-reply", own)],
                    CachePolicy::DefinitiveOnly,
                    2,
                ),
                (
                    "400 other id definitive",
                    vec![("x-status", "400"), ("x-reply", other)],
                    CachePolicy::DefinitiveOnly,
                    2,
                ),
                (
                    "500 other id everything",
                    vec![("x-status", "500"), ("x-reply", other)],
                    CachePolicy::Everything,
                    1,
                ),
                (
                    "500 other id everything sse",
                    vec![("x-status", "500"), ("x-reply", other), ("x-sse", "1")],
                    CachePolicy::Everything,
                    1,
                ),
                (
                    "500 other id definitive sse",
                    vec![("x-status", "500"), ("x-reply", other), ("x-sse", "1")],
                    CachePolicy::DefinitiveOnly,
                    2,
                ),
            ];
            let mut rows = Vec::new();
            for (what, headers, policy, want) in cases {
                let (router, runs) = tool_app(JsonRpc::new(), policy);
                let (n, retry) = call_and_retry(&router, &runs, "s", &headers).await;
                rows.push((what, n, want, retry));
            }
            rows
        })
    });
    let wrong: Vec<_> = rows
        .iter()
        .filter(|(_, n, want, _)| n != want)
        .map(|(what, n, want, retry)| format!("{what}: ran {n}, want {want} ({})", retry.text))
        .collect();
    assert!(wrong.is_empty(), "{wrong:#?}");
}

// ---- (2) Mcp-Method ------------------------------------------------------------------------------

/// README §JSON-RPC / DESIGN §8 ("a keyed request whose `Mcp-Method` header disagrees with its
/// body is refused with -32020"; a call without a key passes through). Condition: `Mcp-Method`
/// given twice (in different case), on a header-keyed call, on a `_meta`-keyed call, on unkeyed
/// calls (plain route and `_meta` route), and once (agreeing). Keyed with two lines: -32020,
/// nothing runs. Unkeyed: passes through and runs. One agreeing line: guarded (the retry is
/// replayed, one run).
#[test]
fn s8_mcp_method_twice_refuses_keyed_calls_only() {
    let rows = on_thread("mcp-method", WATCHDOG, || {
        current_thread().block_on(async {
            let twice = [("Mcp-Method", "tools/call"), ("MCP-METHOD", "tools/call")];
            let mut rows: Vec<(&str, usize, usize, Got)> = Vec::new();
            // Header-keyed, twice.
            let (router, runs) = tool_app(JsonRpc::new(), CachePolicy::DefinitiveOnly);
            let mut h = vec![("idempotency-key", "k1")];
            h.extend_from_slice(&twice);
            let g = rpc(&router, &h, call_body(1, None)).await;
            rows.push(("header key, twice", runs.load(Ordering::SeqCst), 0, g));
            // `_meta`-keyed, twice.
            let (router, runs) = tool_app(
                JsonRpc::new().meta_key("idempotencyKey"),
                CachePolicy::DefinitiveOnly,
            );
            let g = rpc(&router, &twice, call_body(1, Some("m1"))).await;
            rows.push(("meta key, twice", runs.load(Ordering::SeqCst), 0, g));
            // Unkeyed, twice: plain route, then `_meta` route.
            let (router, runs) = tool_app(JsonRpc::new(), CachePolicy::DefinitiveOnly);
            let g = rpc(&router, &twice, call_body(1, None)).await;
            rows.push(("unkeyed, twice", runs.load(Ordering::SeqCst), 1, g));
            let (router, runs) = tool_app(
                JsonRpc::new().meta_key("idempotencyKey"),
                CachePolicy::DefinitiveOnly,
            );
            let g = rpc(&router, &twice, call_body(1, None)).await;
            rows.push((
                "unkeyed on a meta route, twice",
                runs.load(Ordering::SeqCst),
                1,
                g,
            ));
            // One agreeing line: guarded.
            let (router, runs) = tool_app(JsonRpc::new(), CachePolicy::DefinitiveOnly);
            let h = [("idempotency-key", "k2"), ("Mcp-Method", "tools/call")];
            let _ = rpc(&router, &h, call_body(1, None)).await;
            let g = rpc(&router, &h, call_body(2, None)).await;
            rows.push(("one line, retried", runs.load(Ordering::SeqCst), 1, g));
            rows
        })
    });
    for (what, runs, want, g) in &rows {
        assert_eq!(runs, want, "{what}: {g:?}");
        if *want == 0 {
            assert_eq!(jsonrpc_code(&g.text), -32020, "{what}: {g:?}");
        } else {
            assert_ne!(jsonrpc_code(&g.text), -32020, "{what}: {g:?}");
        }
    }
    assert!(
        rows[4].3.replayed,
        "one agreeing line: the retry is replayed"
    );
}

/// README §JSON-RPC (a keyed request is refused -32020 only when its `Mcp-Method` header
/// *disagrees* with its body) and the crate's own reading of header values elsewhere
/// (`is_event_stream`: "Whitespace around a value is not part of it (an in-process service may
/// leave some)"; RFC 9110 §5.5: a field value excludes surrounding whitespace). Condition: an
/// in-process caller sets `Mcp-Method: "tools/call "` (a trailing space) on a keyed `tools/call`:
/// it names the body's method, so the call must be guarded (run once, the retry replayed), not
/// refused as a mismatch.
#[test]
fn s8_an_mcp_method_with_surrounding_whitespace_agrees_with_its_body() {
    let (runs, first, retry) = on_thread("mcp-method-ows", WATCHDOG, || {
        current_thread().block_on(async {
            let (router, runs) = tool_app(JsonRpc::new(), CachePolicy::DefinitiveOnly);
            let h = [("idempotency-key", "ws"), ("Mcp-Method", "tools/call ")];
            let first = rpc(&router, &h, call_body(1, None)).await;
            let retry = rpc(&router, &h, call_body(2, None)).await;
            (runs.load(Ordering::SeqCst), first, retry)
        })
    });
    assert_ne!(
        jsonrpc_code(&first.text),
        -32020,
        "refused as a mismatch: {first:?}"
    );
    assert_eq!(runs, 1, "{first:?} {retry:?}");
    assert!(retry.replayed, "{retry:?}");
}
