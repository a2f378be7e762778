//! Adversarial review of two commits: 4cc529e (a renewal never shortens a lease, on every
//! store) and 4f45a90 (the keeper schedules renewals from when they were sent, at most two
//! under way, a fenced answer is final; a claim that took half a lease to come back is
//! confirmed by a fenced renewal before anything runs under it).
//!
//! A store wrapper ([`Rig`]) stalls, hangs or fails the n-th operation of one kind and counts
//! what is under way. Executions are counted at the sink (the handler). A "healthy" server is
//! a second layer (another replica) over the same inner store, without faults.
//!
//! Each test says which mutant of the change it catches.

use crate::common;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use tokio::time::Instant;
use tower_idempotency::store::{
    Claim, ClaimRequest, FencingToken, RecordStatus, ScopedKey, StoreError, StoredResponse,
};
use tower_idempotency::{Fingerprint, IdempotencyLayer, IdempotencyStore, LeaseExpiry};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn unique(name: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{name}-{nanos}")
}

// ---- the store wrapper -----------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Act {
    Pass,
    /// Fails at once (store unavailable), changing nothing.
    Fail,
    /// Waits, then happens.
    Before(Duration),
    /// Happens, then its answer waits.
    After(Duration),
    /// Never arrives, never answers.
    Hang,
}

#[derive(Clone, Debug)]
struct Op {
    kind: &'static str,
    n: usize,
    key: String,
    started: Instant,
    ended: Option<(Instant, String)>,
}

#[derive(Default)]
struct RigState {
    counts: Mutex<HashMap<&'static str, usize>>,
    plan: Mutex<HashMap<(&'static str, usize), Act>>,
    always: Mutex<HashMap<&'static str, Act>>,
    live: Mutex<HashMap<&'static str, usize>>,
    peak: Mutex<HashMap<&'static str, usize>>,
    ops: Mutex<Vec<Op>>,
}

/// The n-th operation of a kind meets its planned [`Act`]; counted across every request made
/// through this wrapper.
struct Rig<S> {
    inner: Arc<S>,
    state: Arc<RigState>,
    /// Whether the inner store's at-once paths (MemoryStore's `claim_now`...) are offered.
    now_reads: bool,
}

/// Counts an operation under way until dropped (finished, or dropped with its request).
struct Live {
    state: Arc<RigState>,
    kind: &'static str,
}

impl Live {
    fn new(state: Arc<RigState>, kind: &'static str) -> Self {
        {
            let mut live = state.live.lock().unwrap();
            let n = live.entry(kind).or_insert(0);
            *n += 1;
            let now = *n;
            let mut peak = state.peak.lock().unwrap();
            let p = peak.entry(kind).or_insert(0);
            *p = (*p).max(now);
        }
        Self { state, kind }
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        let mut live = self.state.live.lock().unwrap();
        if let Some(n) = live.get_mut(self.kind) {
            *n -= 1;
        }
    }
}

impl<S> Rig<S> {
    fn new(inner: Arc<S>, now_reads: bool) -> Arc<Self> {
        Arc::new(Self {
            inner,
            state: Arc::default(),
            now_reads,
        })
    }

    fn on(&self, kind: &'static str, n: usize, act: Act) {
        self.state.plan.lock().unwrap().insert((kind, n), act);
    }

    fn always(&self, kind: &'static str, act: Act) {
        self.state.always.lock().unwrap().insert(kind, act);
    }

    fn act(&self, kind: &'static str, n: usize) -> Act {
        if let Some(act) = self.state.plan.lock().unwrap().get(&(kind, n)) {
            return *act;
        }
        self.state
            .always
            .lock()
            .unwrap()
            .get(kind)
            .copied()
            .unwrap_or(Act::Pass)
    }

    fn count(&self, kind: &str) -> usize {
        self.state
            .counts
            .lock()
            .unwrap()
            .get(kind)
            .copied()
            .unwrap_or(0)
    }

    fn live(&self, kind: &str) -> usize {
        self.state
            .live
            .lock()
            .unwrap()
            .get(kind)
            .copied()
            .unwrap_or(0)
    }

    fn peak(&self, kind: &str) -> usize {
        self.state
            .peak
            .lock()
            .unwrap()
            .get(kind)
            .copied()
            .unwrap_or(0)
    }

    fn ops(&self, kind: &str) -> Vec<Op> {
        self.state
            .ops
            .lock()
            .unwrap()
            .iter()
            .filter(|o| o.kind == kind)
            .cloned()
            .collect()
    }

    fn log(&self) -> String {
        let ops = self.state.ops.lock().unwrap();
        let Some(first) = ops.first().map(|o| o.started) else {
            return String::new();
        };
        ops.iter()
            .map(|o| {
                let end = o.ended.as_ref().map_or("-".to_owned(), |(at, what)| {
                    format!("{}ms {what}", (*at - first).as_millis())
                });
                format!(
                    "{}#{} @{}ms -> {end}",
                    o.kind,
                    o.n,
                    (o.started - first).as_millis()
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    fn next(&self, kind: &'static str, key: &ScopedKey) -> (usize, Act) {
        let n = {
            let mut counts = self.state.counts.lock().unwrap();
            let n = counts.entry(kind).or_insert(0);
            *n += 1;
            *n
        };
        self.state.ops.lock().unwrap().push(Op {
            kind,
            n,
            key: key.key().to_owned(),
            started: Instant::now(),
            ended: None,
        });
        (n, self.act(kind, n))
    }

    fn ended(&self, kind: &'static str, n: usize, what: String) {
        let mut ops = self.state.ops.lock().unwrap();
        if let Some(op) = ops.iter_mut().find(|o| o.kind == kind && o.n == n) {
            op.ended = Some((Instant::now(), what));
        }
    }

    async fn around<T>(
        &self,
        kind: &'static str,
        key: &ScopedKey,
        op: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let (n, act) = self.next(kind, key);
        let _live = Live::new(self.state.clone(), kind);
        let out = match act {
            Act::Pass => op.await,
            Act::Fail => Err(injected(kind)),
            Act::Before(d) => {
                tokio::time::sleep(d).await;
                op.await
            }
            Act::After(d) => {
                let out = op.await;
                tokio::time::sleep(d).await;
                out
            }
            Act::Hang => std::future::pending().await,
        };
        let what = match &out {
            Ok(_) => "ok".to_owned(),
            Err(StoreError::Fenced) => "fenced".to_owned(),
            Err(e) => format!("error: {e}"),
        };
        self.ended(kind, n, what);
        out
    }
}

fn injected(what: &str) -> StoreError {
    StoreError::unavailable(std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        format!("{what}: store unavailable (injected)"),
    ))
}

impl<S: IdempotencyStore> IdempotencyStore for Rig<S> {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        self.around("claim", &request.key, self.inner.claim(request))
            .await
    }

    fn claim_now(&self, request: &ClaimRequest) -> Option<Result<Claim, StoreError>> {
        if !self.now_reads {
            return None;
        }
        // A claim with a planned fault goes the awaited way.
        let n = self.count("claim") + 1;
        if self.act("claim", n) != Act::Pass {
            return None;
        }
        let made = self.inner.claim_now(request)?;
        let (n, _) = self.next("claim", &request.key);
        self.ended("claim", n, "at once".to_owned());
        Some(made)
    }

    fn recorded_fingerprint_now(&self, key: &ScopedKey) -> Option<Fingerprint> {
        if !self.now_reads {
            return None;
        }
        self.inner.recorded_fingerprint_now(key)
    }

    fn completed_now(&self, key: &ScopedKey) -> Option<Result<Claim, StoreError>> {
        if !self.now_reads {
            return None;
        }
        self.inner.completed_now(key)
    }

    async fn renew(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<SystemTime, StoreError> {
        self.around("renew", key, self.inner.renew(key, token, lease))
            .await
    }

    async fn complete(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.around(
            "complete",
            key,
            self.inner.complete(key, token, response, ttl),
        )
        .await
    }

    async fn release(
        &self,
        key: &ScopedKey,
        token: FencingToken,
    ) -> Result<RecordStatus, StoreError> {
        self.around("release", key, self.inner.release(key, token))
            .await
    }

    async fn mark_uncertain(&self, key: &ScopedKey, token: FencingToken) -> Result<(), StoreError> {
        self.around("uncertain", key, self.inner.mark_uncertain(key, token))
            .await
    }

    crate::common::forward::forward_store!(inner: lookup, remove, purge_expired, record_milestone, list_uncertain, count_uncertain, resolve, append_history, wait_for_change);
}

// ---- the sink and the servers ----------------------------------------------------------------

/// The handler behind every server: counts runs where they happen.
#[derive(Default)]
struct Sink {
    runs: AtomicUsize,
    done: AtomicUsize,
    work: Mutex<Duration>,
    /// The first run answers 503 (a retryable failure: the key is given back).
    fail_first: AtomicBool,
}

impl Sink {
    fn new(work: Duration) -> Arc<Self> {
        let sink = Self::default();
        *sink.work.lock().unwrap() = work;
        Arc::new(sink)
    }

    async fn work(&self) -> (StatusCode, String) {
        let n = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
        let work = *self.work.lock().unwrap();
        tokio::time::sleep(work).await;
        self.done.fetch_add(1, Ordering::SeqCst);
        if n == 1 && self.fail_first.load(Ordering::SeqCst) {
            return (StatusCode::SERVICE_UNAVAILABLE, format!("run {n} failed"));
        }
        (StatusCode::CREATED, format!("run {n}"))
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    fn done(&self) -> usize {
        self.done.load(Ordering::SeqCst)
    }
}

#[derive(Clone, Copy)]
struct Cfg {
    lease: Duration,
    reconcile: bool,
    wait: Option<Duration>,
    cancel: bool,
    ttl: Option<Duration>,
}

fn cfg(lease: Duration) -> Cfg {
    Cfg {
        lease,
        reconcile: false,
        wait: None,
        cancel: false,
        ttl: None,
    }
}

async fn server<St: IdempotencyStore>(store: Arc<St>, cfg: Cfg, sink: Arc<Sink>) -> SocketAddr {
    let layer = IdempotencyLayer::from_arc(store)
        .single_tenant()
        .defaults(move |route| {
            let route = route
                .lease(cfg.lease)
                .on_lease_expiry(if cfg.reconcile {
                    LeaseExpiry::Reconcile
                } else {
                    LeaseExpiry::Reclaim
                })
                .cancel_on_disconnect(cfg.cancel);
            let route = match cfg.wait {
                Some(wait) => route.wait_for_in_flight(wait),
                None => route,
            };
            match cfg.ttl {
                Some(ttl) => route.ttl(ttl),
                None => route,
            }
        });
    let app = Router::new().route(
        "/op",
        post(move || {
            let sink = sink.clone();
            async move { sink.work().await }
        })
        .layer(layer),
    );
    common::serve(app).await
}

#[derive(Debug, Clone)]
struct Answer {
    status: u16,
    replayed: Option<String>,
    problem: Option<String>,
    body: String,
}

impl Answer {
    fn refused_as(&self, slug: &str) -> bool {
        self.status == 409 && self.problem.as_deref() == Some(&common::problem_type(slug))
    }

    /// A retry that did not run: told the key is in flight, or (once the holder's outcome is
    /// recorded) a replay.
    fn did_not_run(&self) -> bool {
        self.refused_as("in-flight") || self.replayed.as_deref() == Some("true")
    }
}

async fn read(res: reqwest::Response) -> Answer {
    let status = res.status().as_u16();
    let replayed = res
        .headers()
        .get("idempotency-replayed")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let problem_json = res
        .headers()
        .get("content-type")
        .is_some_and(|v| v == "application/problem+json");
    let body = res.text().await.unwrap_or_default();
    let problem = problem_json
        .then(|| serde_json::from_str::<serde_json::Value>(&body).ok())
        .flatten()
        .and_then(|v| v["type"].as_str().map(str::to_owned));
    Answer {
        status,
        replayed,
        problem,
        body,
    }
}

/// One call, given up (the client hangs up) after `patience`: `None` when it did.
async fn call_within(addr: SocketAddr, key: &str, patience: Duration) -> Option<Answer> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(patience)
        .build()
        .expect("client");
    match client
        .post(format!("http://{addr}/op"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(r#"{"amount":10}"#)
        .send()
        .await
    {
        Ok(res) => Some(read(res).await),
        Err(e) if e.is_timeout() => None,
        Err(e) => panic!("request failed: {e}"),
    }
}

/// One call that must be answered (within 20 s, else the test calls it a hang).
async fn call(addr: SocketAddr, key: &str) -> Answer {
    call_within(addr, key, Duration::from_secs(20))
        .await
        .expect("a call hung for 20 s")
}

/// Calls `key` on `addr` every 25 ms until `stop` holds; every answer.
async fn pester(addr: SocketAddr, key: &str, stop: impl Fn() -> bool) -> Vec<Answer> {
    let mut answers = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !stop() {
        assert!(Instant::now() < deadline, "pestering for 20 s");
        answers.push(call(addr, key).await);
        tokio::time::sleep(ms(25)).await;
    }
    answers
}

async fn until(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "waited 20 s for: {what}");
        tokio::time::sleep(ms(5)).await;
    }
}

fn statuses(answers: &[Answer]) -> Vec<u16> {
    answers.iter().map(|a| a.status).collect()
}

// ---- the keeper ------------------------------------------------------------------------------

/// Every renewal hangs: the keeper sends a second while the first is out, and never a third.
/// Catches OUTSTANDING = 1 (the old code: only one) and an unbounded keeper (a renewal per
/// third of a lease, piling up against the hanging store).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k1_hanging_renewals_are_bounded_at_two_per_lease() {
    let inner = Arc::new(tower_idempotency::MemoryStore::new());
    let rig = Rig::new(inner, true);
    rig.always("renew", Act::Hang);
    let lease = ms(450);
    let sink = Sink::new(lease * 5);
    let addr = server(rig.clone(), cfg(lease), sink.clone()).await;
    let key = unique("k1");
    let answer = call(addr, &key).await;
    assert_eq!(answer.status, 201, "{answer:?}");
    // A few more thirds of a lease with the hold dropped: still nothing more.
    tokio::time::sleep(lease).await;
    assert_eq!(sink.runs(), 1);
    assert_eq!(
        rig.count("renew"),
        2,
        "renewals sent against a store hanging every one: {}",
        rig.log()
    );
    assert_eq!(rig.peak("renew"), 2, "{}", rig.log());
}

/// The first renewal hangs, later ones land: the lease is kept, and a retry pestering the key
/// on another replica for the whole run never runs it. Catches OUTSTANDING = 1 (the next
/// renewal waits behind the hanging one, the lease lapses, the retry takes over).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k2_one_hanging_renewal_lets_no_second_run_in() {
    let inner = Arc::new(tower_idempotency::MemoryStore::new());
    let rig = Rig::new(inner.clone(), true);
    rig.on("renew", 1, Act::Hang);
    let lease = ms(600);
    let sink = Sink::new(lease * 4);
    let addr = server(rig.clone(), cfg(lease), sink.clone()).await;
    let healthy = server(inner, cfg(lease), sink.clone()).await;
    let key = unique("k2");
    let first = tokio::spawn({
        let key = key.clone();
        async move { call(addr, &key).await }
    });
    until("the handler starts", || sink.runs() == 1).await;
    let retries = pester(healthy, &key, || sink.done() >= 1).await;
    let first = first.await.expect("first call");
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(
        sink.runs(),
        1,
        "retries: {:?}; {}",
        statuses(&retries),
        rig.log()
    );
    assert!(retries.iter().all(Answer::did_not_run), "{retries:?}");
    assert!(rig.count("renew") >= 2, "{}", rig.log());
}

/// The claim takes 45% of a lease to come back (under the confirmation threshold), and the
/// first renewal takes 30% of one to land. Counted from when the claim was sent, it lands
/// before the lease ends; counted from when the claim came back (no `since`), it lands after,
/// and a retry pestering the key takes it over. Catches `since` ignored in `Keeper::hold`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k3_first_renewal_counts_from_when_the_claim_was_sent() {
    let inner = Arc::new(tower_idempotency::MemoryStore::new());
    let rig = Rig::new(inner.clone(), true);
    let lease = ms(1500);
    rig.on("claim", 1, Act::After(lease * 45 / 100));
    rig.on("renew", 1, Act::Before(lease * 30 / 100));
    let sink = Sink::new(lease * 3);
    let addr = server(rig.clone(), cfg(lease), sink.clone()).await;
    let healthy = server(inner, cfg(lease), sink.clone()).await;
    let key = unique("k3");
    let first = tokio::spawn({
        let key = key.clone();
        async move { call(addr, &key).await }
    });
    // From the claim on: the lease is the claim's until the first renewal lands.
    until("the claim is sent", || rig.count("claim") == 1).await;
    let retries = pester(healthy, &key, || sink.done() >= 1).await;
    let first = first.await.expect("first call");
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(
        sink.runs(),
        1,
        "retries: {:?}; {}",
        statuses(&retries),
        rig.log()
    );
}

/// The lease is taken from the holder while a slow renewal (answer late, but Ok) is out; the
/// next renewal is fenced. From then on nothing is renewed, whatever the slow one says when it
/// comes back. Catches a fenced answer treated as a failure to retry, and a late Ok clearing
/// the loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k4_a_fenced_renewal_stops_renewing_for_good() {
    let inner = Arc::new(tower_idempotency::MemoryStore::new());
    let rig = Rig::new(inner.clone(), true);
    let lease = ms(600);
    rig.on("renew", 1, Act::After(lease));
    let sink = Sink::new(lease * 4);
    let addr = server(rig.clone(), cfg(lease), sink.clone()).await;
    let key = unique("k4");
    let first = tokio::spawn({
        let key = key.clone();
        async move { call(addr, &key).await }
    });
    until("the first renewal is out", || rig.count("renew") >= 1).await;
    // An operator removes the record: the holder's lease is gone.
    assert!(
        inner
            .remove(&ScopedKey::new("", &key))
            .await
            .expect("remove")
    );
    until("a renewal is fenced", || {
        rig.ops("renew")
            .iter()
            .any(|o| matches!(&o.ended, Some((_, w)) if w == "fenced"))
    })
    .await;
    let fenced_at = rig
        .ops("renew")
        .iter()
        .filter_map(|o| match &o.ended {
            Some((at, w)) if w == "fenced" => Some(*at),
            _ => None,
        })
        .min()
        .unwrap();
    let _ = first.await;
    tokio::time::sleep(lease).await;
    let after: Vec<_> = rig
        .ops("renew")
        .into_iter()
        .filter(|o| o.started > fenced_at)
        .collect();
    assert!(
        after.is_empty(),
        "renewed after a fenced answer: {after:?}; {}",
        rig.log()
    );
    assert!(rig.count("renew") >= 2, "{}", rig.log());
    assert_eq!(sink.runs(), 1);
}

/// The first three renewals fail (store unavailable), later ones land: the keeper keeps
/// trying, the lease holds, a retry pestering the key never runs it. Catches an error treated
/// as a lost lease (no more renewals).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k5_failing_renewals_are_retried_and_the_lease_holds() {
    let inner = Arc::new(tower_idempotency::MemoryStore::new());
    let rig = Rig::new(inner.clone(), true);
    let lease = ms(900);
    rig.on("renew", 1, Act::Fail);
    rig.on("renew", 2, Act::Fail);
    let sink = Sink::new(lease * 3);
    let addr = server(rig.clone(), cfg(lease), sink.clone()).await;
    let healthy = server(inner, cfg(lease), sink.clone()).await;
    let key = unique("k5");
    let first = tokio::spawn({
        let key = key.clone();
        async move { call(addr, &key).await }
    });
    until("the handler starts", || sink.runs() == 1).await;
    let retries = pester(healthy, &key, || sink.done() >= 1).await;
    let first = first.await.expect("first call");
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(
        sink.runs(),
        1,
        "retries: {:?}; {}",
        statuses(&retries),
        rig.log()
    );
    assert!(rig.count("renew") >= 3, "{}", rig.log());
}

/// Once the outcome is recorded (completed), given back (a 503), or the request cancelled on a
/// cancel-on-disconnect route, the hold is dropped: no renewal starts for that key afterwards.
/// Catches a hold that outlives its execution (the keeper renews until fenced).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k6_no_renewal_after_the_hold_is_dropped() {
    let inner = Arc::new(tower_idempotency::MemoryStore::new());
    let rig = Rig::new(inner.clone(), true);
    let lease = ms(450);
    let sink = Sink::new(lease * 2);
    let addr = server(rig.clone(), cfg(lease), sink.clone()).await;
    let cancel = server(
        rig.clone(),
        Cfg {
            cancel: true,
            ..cfg(lease)
        },
        sink.clone(),
    )
    .await;
    let last_end = |kind: &str, key: &str| {
        rig.ops(kind)
            .iter()
            .filter(|o| o.key == key)
            .filter_map(|o| o.ended.as_ref().map(|(at, _)| *at))
            .max()
    };

    // Completed.
    let done = unique("k6-done");
    assert_eq!(call(addr, &done).await.status, 201);
    until("recorded", || last_end("complete", &done).is_some()).await;

    // Given back after a 503.
    sink.fail_first.store(true, Ordering::SeqCst);
    sink.runs.store(0, Ordering::SeqCst);
    let failed = unique("k6-failed");
    assert_eq!(call(addr, &failed).await.status, 503);
    until("released", || last_end("release", &failed).is_some()).await;
    sink.fail_first.store(false, Ordering::SeqCst);

    // Cancelled: the client hangs up while the handler runs.
    let cancelled = unique("k6-cancelled");
    assert!(
        call_within(cancel, &cancelled, lease * 3 / 2)
            .await
            .is_none()
    );
    until("released on drop", || {
        last_end("release", &cancelled).is_some()
    })
    .await;

    tokio::time::sleep(lease * 2).await;
    for (key, kind) in [
        (&done, "complete"),
        (&failed, "release"),
        (&cancelled, "release"),
    ] {
        let end = last_end(kind, key).unwrap();
        let late: Vec<_> = rig
            .ops("renew")
            .into_iter()
            .filter(|o| &o.key == key && o.started > end + ms(30))
            .collect();
        assert!(
            late.is_empty(),
            "{key}: renewed after its {kind}: {late:?}; {}",
            rig.log()
        );
        assert!(
            rig.ops("renew").iter().any(|o| &o.key == key),
            "{key}: never renewed at all (the test did not hold long enough)"
        );
    }
}

// ---- late claims -----------------------------------------------------------------------------

/// A's claim lands at once but its answer takes 1.5 leases to come back; meanwhile, after A's
/// lease ran out, B (another replica, healthy) takes the key over and runs. A's confirmation
/// is fenced: A claims again and is told B is in flight. One run. On every store: the real
/// store's renewal must answer `Fenced` (not an error, which would be "store unavailable").
/// Catches confirm skipped (A runs beside B), and a fenced confirmation treated as Failed.
async fn late_claim_taken_over<S: IdempotencyStore>(store: S, now_reads: bool) {
    let inner = Arc::new(store);
    let rig = Rig::new(inner.clone(), now_reads);
    let lease = ms(600);
    rig.on("claim", 1, Act::After(lease * 3 / 2));
    let sink = Sink::new(lease * 3);
    let addr = server(rig.clone(), cfg(lease), sink.clone()).await;
    let healthy = server(inner.clone(), cfg(lease), sink.clone()).await;
    let key = unique("late-taken");
    let a = tokio::spawn({
        let key = key.clone();
        async move { call(addr, &key).await }
    });
    until("A's claim is sent", || rig.count("claim") == 1).await;
    tokio::time::sleep(lease * 5 / 4).await;
    let b = tokio::spawn({
        let key = key.clone();
        async move { call(healthy, &key).await }
    });
    let a = a.await.expect("A");
    let b = b.await.expect("B");
    assert_eq!(
        b.status,
        201,
        "B took the key over and ran: {b:?}; {}",
        rig.log()
    );
    assert!(
        a.refused_as("in-flight"),
        "A is told B is in flight: {a:?}; {}",
        rig.log()
    );
    assert_eq!(sink.runs(), 1, "{}", rig.log());
    assert_eq!(rig.count("renew"), 1, "one confirmation: {}", rig.log());
    // Settled: A's replica replays B's run.
    let again = call(addr, &key).await;
    assert_eq!(again.status, 201, "{again:?}");
    assert_eq!(again.replayed.as_deref(), Some("true"));
    assert_eq!(again.body, b.body);
    assert_eq!(sink.runs(), 1);
}

mod c1_late_claim_taken_over {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn memory() {
        super::late_claim_taken_over(tower_idempotency::MemoryStore::new(), true).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite() {
        let (store, path) = crate::common::sqlite("lease_keeper_review").await;
        super::late_claim_taken_over(store, false).await;
        let _ = std::fs::remove_file(path);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres() {
        let Some(store) = crate::common::postgres("tower_idempotency_lease_keeper_review").await
        else {
            return;
        };
        super::late_claim_taken_over(store, false).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis() {
        let Some(store) = crate::common::redis("lease_keeper_review").await else {
            return;
        };
        super::late_claim_taken_over(store, false).await;
    }
}

/// As above, on a route that waits for in-flight keys: A, taken over, waits for B and replays
/// B's answer. Catches confirm skipped, and Lost answered with anything but B's outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c2_late_claim_taken_over_on_a_waiting_route_replays_the_holder() {
    let inner = Arc::new(tower_idempotency::MemoryStore::new());
    let rig = Rig::new(inner.clone(), true);
    let lease = ms(600);
    rig.on("claim", 1, Act::After(lease * 3 / 2));
    let sink = Sink::new(lease * 2);
    let waiting = Cfg {
        wait: Some(Duration::from_secs(15)),
        ..cfg(lease)
    };
    let addr = server(rig.clone(), waiting, sink.clone()).await;
    let healthy = server(inner, cfg(lease), sink.clone()).await;
    let key = unique("c2");
    let a = tokio::spawn({
        let key = key.clone();
        async move { call(addr, &key).await }
    });
    until("A's claim is sent", || rig.count("claim") == 1).await;
    tokio::time::sleep(lease * 5 / 4).await;
    let b = call(healthy, &key).await;
    let a = a.await.expect("A");
    assert_eq!(b.status, 201, "{b:?}");
    assert_eq!(a.status, 201, "A replays B: {a:?}; {}", rig.log());
    assert_eq!(a.replayed.as_deref(), Some("true"), "{a:?}");
    assert_eq!(a.body, b.body);
    assert_eq!(sink.runs(), 1, "{}", rig.log());
}

/// On a route that reconciles expired leases, B finds A's lapsed lease and marks the key
/// "outcome unknown"; A's confirmation is fenced. Nothing ran under A's token, which the record
/// still carries, so A gives the key back (settled as not applied, fenced) and claims again: it
/// runs once, and B's next try replays it (session 27; before, the key stayed "outcome unknown"
/// until resolved by hand). Catches confirm skipped (A runs a handler on a key marked uncertain)
/// and a Lost confirmation that loops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c3_late_claim_on_a_reconcile_route_gives_back_what_it_never_ran() {
    let inner = Arc::new(tower_idempotency::MemoryStore::new());
    let rig = Rig::new(inner.clone(), true);
    let lease = ms(600);
    rig.on("claim", 1, Act::After(lease * 3 / 2));
    let sink = Sink::new(lease);
    let reconcile = Cfg {
        reconcile: true,
        ..cfg(lease)
    };
    let addr = server(rig.clone(), reconcile, sink.clone()).await;
    let healthy = server(inner, reconcile, sink.clone()).await;
    let key = unique("c3");
    let a = tokio::spawn({
        let key = key.clone();
        async move { call(addr, &key).await }
    });
    until("A's claim is sent", || rig.count("claim") == 1).await;
    tokio::time::sleep(lease * 5 / 4).await;
    let b = call(healthy, &key).await;
    let a = a.await.expect("A");
    assert!(b.refused_as("outcome-unknown"), "{b:?}");
    assert_eq!(a.status, 201, "{a:?}; {}", rig.log());
    assert_eq!(a.replayed, None, "A ran it: {a:?}");
    assert_eq!(sink.runs(), 1, "{}", rig.log());
    assert!(rig.count("claim") <= 2, "{}", rig.log());
    let again = call(healthy, &key).await;
    assert_eq!(again.replayed.as_deref(), Some("true"), "{again:?}");
    assert_eq!(again.body, a.body);
}

/// A's claim takes 70% of a lease to come back, nobody else came: the confirmation holds, A
/// runs once for four leases, and a retry pestering the key meanwhile never runs it. Catches a
/// confirmation that never holds (A refused), and a hold whose renewals do not keep the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c4_late_claim_still_held_runs_once() {
    let inner = Arc::new(tower_idempotency::MemoryStore::new());
    let rig = Rig::new(inner.clone(), true);
    let lease = ms(600);
    rig.on("claim", 1, Act::After(lease * 7 / 10));
    let sink = Sink::new(lease * 4);
    let addr = server(rig.clone(), cfg(lease), sink.clone()).await;
    let healthy = server(inner, cfg(lease), sink.clone()).await;
    let key = unique("c4");
    let a = tokio::spawn({
        let key = key.clone();
        async move { call(addr, &key).await }
    });
    until("A's claim is sent", || rig.count("claim") == 1).await;
    let retries = pester(healthy, &key, || sink.done() >= 1).await;
    let a = a.await.expect("A");
    assert_eq!(a.status, 201, "{a:?}; {}", rig.log());
    assert_eq!(
        sink.runs(),
        1,
        "retries {:?}; {}",
        statuses(&retries),
        rig.log()
    );
    assert!(retries.iter().all(Answer::did_not_run), "{retries:?}");
}

/// A's claim comes back late and its confirmation fails (store unavailable): A is told the
/// store is unavailable, and the key is given back. On a route that reconciles expired leases,
/// a key left to run out would read "outcome unknown" for ever though nothing ran; given back,
/// the retry runs. Catches `give_back` missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c5_failed_confirmation_gives_the_key_back() {
    let inner = Arc::new(tower_idempotency::MemoryStore::new());
    let rig = Rig::new(inner.clone(), true);
    let lease = ms(600);
    rig.on("claim", 1, Act::After(lease * 7 / 10));
    rig.on("renew", 1, Act::Fail);
    let sink = Sink::new(ms(50));
    let reconcile = Cfg {
        reconcile: true,
        ..cfg(lease)
    };
    let addr = server(rig.clone(), reconcile, sink.clone()).await;
    let healthy = server(inner.clone(), reconcile, sink.clone()).await;
    let key = unique("c5");
    let a = call(addr, &key).await;
    assert_eq!(a.status, 503, "{a:?}");
    assert_eq!(
        a.problem.as_deref(),
        Some(common::problem_type("store-unavailable").as_str())
    );
    assert_eq!(sink.runs(), 0);
    tokio::time::sleep(lease * 2).await;
    let record = inner
        .lookup(&ScopedKey::new("", &key))
        .await
        .expect("lookup");
    assert_eq!(
        record.as_ref().map(|r| r.status),
        Some(RecordStatus::Released),
        "{}",
        rig.log()
    );
    let retry = call(healthy, &key).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert_eq!(sink.runs(), 1);
}

/// Every confirmation comes back Ok but after 60% of a lease: three tries, then "store
/// unavailable" and the key given back. Catches unbounded tries (the call never ends, or more
/// than three renewals), a late Ok taken as held, and `give_back` missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c6_confirmation_answered_too_late_gives_up_after_three() {
    let inner = Arc::new(tower_idempotency::MemoryStore::new());
    let rig = Rig::new(inner.clone(), true);
    let lease = ms(600);
    rig.on("claim", 1, Act::After(lease * 7 / 10));
    rig.always("renew", Act::After(lease * 6 / 10));
    let sink = Sink::new(ms(50));
    let reconcile = Cfg {
        reconcile: true,
        ..cfg(lease)
    };
    let addr = server(rig.clone(), reconcile, sink.clone()).await;
    let healthy = server(inner.clone(), reconcile, sink.clone()).await;
    let key = unique("c6");
    let a = call(addr, &key).await;
    assert_eq!(a.status, 503, "{a:?}; {}", rig.log());
    assert_eq!(sink.runs(), 0);
    tokio::time::sleep(lease * 2).await;
    assert_eq!(rig.count("renew"), 3, "{}", rig.log());
    let retry = call(healthy, &key).await;
    assert_eq!(retry.status, 201, "{retry:?}; {}", rig.log());
    assert_eq!(sink.runs(), 1);
}

/// A's claim comes back after B took the key over; A's confirmation then meets a store error
/// (not a fenced answer): A gives back *its* lease, fenced, which must not release B's. A
/// third caller pestering the key while B runs never runs it. Catches an unfenced give-back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c7_failed_confirmation_never_releases_the_new_holder() {
    let inner = Arc::new(tower_idempotency::MemoryStore::new());
    let rig = Rig::new(inner.clone(), true);
    let lease = ms(600);
    rig.on("claim", 1, Act::After(lease * 3 / 2));
    rig.on("renew", 1, Act::Fail);
    let sink = Sink::new(lease * 3);
    let addr = server(rig.clone(), cfg(lease), sink.clone()).await;
    let healthy = server(inner.clone(), cfg(lease), sink.clone()).await;
    let key = unique("c7");
    let a = tokio::spawn({
        let key = key.clone();
        async move { call(addr, &key).await }
    });
    until("A's claim is sent", || rig.count("claim") == 1).await;
    tokio::time::sleep(lease * 5 / 4).await;
    let b = tokio::spawn({
        let key = key.clone();
        async move { call(healthy, &key).await }
    });
    let a = a.await.expect("A");
    assert_eq!(a.status, 503, "{a:?}; {}", rig.log());
    until("A gave back", || {
        rig.ops("release").iter().any(|o| o.ended.is_some())
    })
    .await;
    let c = pester(healthy, &key, || sink.done() >= 1).await;
    let b = b.await.expect("B");
    assert_eq!(b.status, 201, "{b:?}");
    assert_eq!(sink.runs(), 1, "C: {:?}; {}", statuses(&c), rig.log());
    assert!(c.iter().all(Answer::did_not_run), "{c:?}");
}

/// Every claim through the faulty replica takes 1.5 leases to come back. A claims; B (same
/// replica) claims after A's lease ran out (before A's answer is back) and takes the key
/// over. Both come back late; A's confirmation is fenced (B holds the key), B's holds. One run.
/// Catches confirm skipped (both run).
async fn two_late_claims<S: IdempotencyStore>(store: S, now_reads: bool) {
    let inner = Arc::new(store);
    let rig = Rig::new(inner.clone(), now_reads);
    let lease = ms(800);
    rig.always("claim", Act::After(lease * 3 / 2));
    let sink = Sink::new(lease);
    let addr = server(rig.clone(), cfg(lease), sink.clone()).await;
    let key = unique("two-late");
    let a = tokio::spawn({
        let key = key.clone();
        async move { call(addr, &key).await }
    });
    until("A's claim is sent", || rig.count("claim") == 1).await;
    // After A's lease ran out, before A's answer comes back.
    tokio::time::sleep(lease * 6 / 5).await;
    let b = call(addr, &key).await;
    let a = a.await.expect("A");
    assert_eq!(sink.runs(), 1, "A {a:?}, B {b:?}; {}", rig.log());
    assert_eq!(b.status, 201, "B holds the key: {b:?}; {}", rig.log());
    assert!(a.refused_as("in-flight"), "{a:?}; {}", rig.log());
}

mod c8_two_late_claims {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn memory() {
        super::two_late_claims(tower_idempotency::MemoryStore::new(), true).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres() {
        let Some(store) = crate::common::postgres("tower_idempotency_lease_keeper_review").await
        else {
            return;
        };
        super::two_late_claims(store, false).await;
    }
}

/// The client hangs up while its late claim's confirmation is out (the renewal hangs). Nothing
/// ran, so nothing may be left in progress nor awaiting reconciliation (as `ClaimToEnd` does for
/// a claim dropped midway, and `give_back` for a failed confirmation): on a route that
/// reconciles expired leases, the key left to run out reads "outcome unknown" for ever. A retry
/// well after the lease must run. Catches a confirmation without a guard on drop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c9_hang_up_during_confirmation_leaves_the_key_claimable() {
    let inner = Arc::new(tower_idempotency::MemoryStore::new());
    let rig = Rig::new(inner.clone(), true);
    let lease = ms(600);
    rig.on("claim", 1, Act::After(lease * 7 / 10));
    rig.on("renew", 1, Act::Hang);
    let sink = Sink::new(ms(50));
    let reconcile = Cfg {
        reconcile: true,
        ..cfg(lease)
    };
    let addr = server(rig.clone(), reconcile, sink.clone()).await;
    let healthy = server(inner.clone(), reconcile, sink.clone()).await;
    let key = unique("c9");
    let gave_up = call_within(addr, &key, lease * 3 / 2).await;
    assert!(gave_up.is_none(), "{gave_up:?}");
    assert_eq!(
        rig.count("renew"),
        1,
        "the confirmation was out: {}",
        rig.log()
    );
    // The server dropped the request (and its confirmation) when the client hung up.
    until("the confirmation is dropped", || rig.live("renew") == 0).await;
    tokio::time::sleep(lease * 2).await;
    let record = inner
        .lookup(&ScopedKey::new("", &key))
        .await
        .expect("lookup");
    let retry = call(healthy, &key).await;
    assert_eq!(
        retry.status,
        201,
        "a retry of a request that ran nothing: {retry:?}; record {:?}; {}",
        record.map(|r| (r.status, r.attempts)),
        rig.log()
    );
    assert_eq!(sink.runs(), 1);
}

/// The same hang-up on a cancel-on-disconnect route, whose contract is "a hang-up gives the
/// key back": here the confirmation's renewal landed (the lease is live until its answer is
/// read), so right after the hang-up the key must already be given back. Polled for half a
/// lease after the hang-up — sooner than the renewed lease's end, about a lease away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c10_hang_up_during_confirmation_on_a_cancel_route_gives_the_key_back() {
    let inner = Arc::new(tower_idempotency::MemoryStore::new());
    let rig = Rig::new(inner.clone(), true);
    let lease = ms(1200);
    rig.on("claim", 1, Act::After(lease * 6 / 10));
    // The renewal lands at once (lease renewed to a full one from ~0.6), its answer never.
    rig.on("renew", 1, Act::After(Duration::from_secs(30)));
    let sink = Sink::new(ms(50));
    let cancel = Cfg {
        cancel: true,
        ..cfg(lease)
    };
    let addr = server(rig.clone(), cancel, sink.clone()).await;
    let key = unique("c10");
    let gave_up = call_within(addr, &key, lease * 7 / 10).await;
    assert!(gave_up.is_none(), "{gave_up:?}");
    let hung_up = Instant::now();
    until("the confirmation is dropped", || rig.live("renew") == 0).await;
    // Allow the give-back (a task of its own) a little time; still well inside the lease the
    // confirmation renewed (~0.6 + 1.0 leases from the claim, i.e. ~0.9 lease from here).
    tokio::time::sleep(lease / 4).await;
    let record = inner
        .lookup(&ScopedKey::new("", &key))
        .await
        .expect("lookup")
        .expect("a record");
    let early = hung_up.elapsed() < lease * 8 / 10;
    assert!(early, "the check came too late to tell (slow machine)");
    assert_ne!(
        record.status,
        RecordStatus::InProgress,
        "nothing runs, yet the key stays claimed for the renewed lease: {}",
        rig.log()
    );
}

// ---- route settings --------------------------------------------------------------------------

/// Lease, TTL and wait of `Duration::MAX` (cut to `LONGEST`) with a claim slow to come back:
/// no overflow in the keeper's `since + lease / 3` nor in the confirmation's threshold; the
/// request runs once, a concurrent retry waits and replays. Catches arithmetic on the
/// unclamped or doubled lease (a panic: 500 or a hang).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r1_duration_max_everything_with_a_slow_claim() {
    let inner = Arc::new(tower_idempotency::MemoryStore::new());
    let rig = Rig::new(inner.clone(), true);
    rig.on("claim", 1, Act::After(ms(300)));
    let sink = Sink::new(ms(1200));
    let max = Cfg {
        lease: Duration::MAX,
        reconcile: false,
        wait: Some(Duration::MAX),
        cancel: false,
        ttl: Some(Duration::MAX),
    };
    let addr = server(rig.clone(), max, sink.clone()).await;
    let healthy = server(inner, max, sink.clone()).await;
    let key = unique("r1");
    let a = tokio::spawn({
        let key = key.clone();
        async move { call(addr, &key).await }
    });
    until("A runs", || sink.runs() == 1).await;
    let b = call(healthy, &key).await;
    let a = a.await.expect("A");
    assert_eq!(a.status, 201, "{a:?}");
    assert_eq!(b.status, 201, "{b:?}");
    assert_eq!(b.replayed.as_deref(), Some("true"));
    assert_eq!(sink.runs(), 1);
    assert_eq!(
        rig.count("renew"),
        0,
        "no confirmation for a 300 ms claim of a century's lease"
    );
}

/// A mix on one layer: a 100-year lease route beside a 450 ms one. The keeper's tick follows
/// the shortest; the long lease's hold with a slow claim neither renews nor confirms early, the
/// short one still keeps its lease through a hanging first renewal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r2_long_and_short_leases_on_one_keeper() {
    let inner = Arc::new(tower_idempotency::MemoryStore::new());
    let rig = Rig::new(inner.clone(), true);
    let short = ms(450);
    rig.on("renew", 1, Act::Hang);
    let sink = Sink::new(short * 4);
    let layer = IdempotencyLayer::from_arc(rig.clone())
        .single_tenant()
        .for_path("/long", |route| route.lease(Duration::MAX))
        .for_path("/op", move |route| route.lease(short));
    let app = Router::new()
        .route(
            "/op",
            post({
                let sink = sink.clone();
                move || {
                    let sink = sink.clone();
                    async move { sink.work().await }
                }
            }),
        )
        .route(
            "/long",
            post({
                let sink = sink.clone();
                move || {
                    let sink = sink.clone();
                    async move { sink.work().await }
                }
            }),
        )
        .layer(layer);
    let addr = common::serve(app).await;
    let healthy = server(inner, cfg(short), sink.clone()).await;
    let (long_key, short_key) = (unique("r2-long"), unique("r2-short"));
    let long = tokio::spawn({
        let key = long_key.clone();
        async move {
            common::client()
                .post(format!("http://{addr}/long"))
                .header("idempotency-key", key)
                .body("{}")
                .send()
                .await
                .expect("long")
                .status()
                .as_u16()
        }
    });
    let first = tokio::spawn({
        let key = short_key.clone();
        async move { call(addr, &key).await }
    });
    until("both run", || sink.runs() == 2).await;
    let retries = pester(healthy, &short_key, || sink.done() >= 2).await;
    assert_eq!(long.await.expect("long"), 201);
    assert_eq!(first.await.expect("short").status, 201);
    assert_eq!(
        sink.runs(),
        2,
        "retries {:?}; {}",
        statuses(&retries),
        rig.log()
    );
    assert!(
        rig.ops("renew").iter().all(|o| o.key == short_key),
        "the century lease was renewed: {}",
        rig.log()
    );
}

// ---- stores: a renewal never shortens a lease ------------------------------------------------

/// A claim with a short lease, a long renewal, then shorter renewals (one by one, then several
/// at once, as overlapping renewals land): the end never moves back, and once the short lease
/// would have run out a second claim still finds the key in progress. Catches a renewal that
/// sets `now + lease` (the old SQL, script and memory code) on each store.
async fn renewal_never_shortens<S: IdempotencyStore>(store: S) {
    let store = Arc::new(store);
    let key = ScopedKey::new("", unique("never-shorter"));
    let request = ClaimRequest {
        key: key.clone(),
        fingerprint: Fingerprint::from_bytes([9; 32]),
        lease: ms(400),
        ttl: Duration::from_secs(60),
        on_lease_expiry: LeaseExpiry::Reclaim,
    };
    let Claim::Acquired(lease) = store.claim(&request).await.expect("claim") else {
        panic!("a fresh key is acquired");
    };
    let long = store
        .renew(&key, lease.token, Duration::from_secs(30))
        .await
        .expect("renew long");
    assert!(long > lease.until);
    for _ in 0..3 {
        let short = store
            .renew(&key, lease.token, ms(400))
            .await
            .expect("renew short");
        assert!(short >= long, "a shorter renewal moved the end back");
    }
    let overlapping: Vec<_> = (0..8)
        .map(|i| {
            let (store, key) = (store.clone(), key.clone());
            let length = if i % 2 == 0 {
                ms(400)
            } else {
                Duration::from_secs(30)
            };
            tokio::spawn(async move { store.renew(&key, lease.token, length).await })
        })
        .collect();
    let mut latest = long;
    for renewal in overlapping {
        latest = latest.max(renewal.await.expect("join").expect("renew"));
    }
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    assert!(
        record.lease_until + ms(2) >= latest,
        "the record's end {:?} is before an answered end {:?}",
        record.lease_until,
        latest
    );
    tokio::time::sleep(ms(900)).await;
    match store.claim(&request).await.expect("claim again") {
        Claim::Existing { record, .. } => assert_eq!(record.status, RecordStatus::InProgress),
        Claim::Acquired(_) => panic!("a short renewal shortened the lease: taken over"),
        Claim::Completed { .. } => panic!("completed?"),
    }
}

mod s1_renewal_never_shortens {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn memory() {
        super::renewal_never_shortens(tower_idempotency::MemoryStore::new()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite() {
        let (store, path) = crate::common::sqlite("lease_keeper_review").await;
        super::renewal_never_shortens(store).await;
        let _ = std::fs::remove_file(path);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres() {
        let Some(store) = crate::common::postgres("tower_idempotency_lease_keeper_review").await
        else {
            return;
        };
        super::renewal_never_shortens(store).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis() {
        let Some(store) = crate::common::redis("lease_keeper_review").await else {
            return;
        };
        super::renewal_never_shortens(store).await;
    }
}
