//! [`Rig`]: a store wrapper that fails, stalls, hangs or applies-then-fails the n-th operation
//! of a kind, takes the store down for a while, fails the renewals of chosen holders (a crashed
//! holder), wakes waiters early, and logs what it did; with the HTTP harness the fault reviews
//! of waiting routes, milestones and give-backs drive it through (routes, answers, waiters). It
//! does not offer the inner store's at-once paths (`claim_now`...) unless [`Rig::at_once`] says
//! so for claims, so every claim is otherwise a round trip a hang-up can drop.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use tokio::sync::Barrier;
use tokio::time::Instant;
use tower_idempotency::reconcile::{Reconciler, Reconciliation, Sweeper};
use tower_idempotency::scope::SingleTenant;
use tower_idempotency::store::{
    Claim, ClaimRequest, FencingToken, HistoryEvent, InFlight, Milestone, Record, RecordStatus,
    ScopedKey, StoreError, StoredResponse,
};
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, IdempotencyStore, LeaseExpiry};

use super::{Effects, serve};

pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

pub fn unique(name: &str) -> String {
    super::raw::unique(name)
}

// ---- the store wrapper -----------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
pub enum Act {
    Pass,
    /// Fails at once, changing nothing.
    Fail,
    /// Waits, then happens.
    Before(Duration),
    /// Happens, then its answer waits.
    After(Duration),
    /// Never answers.
    Hang,
    /// Happens, then answers with an error (the write landed, its answer was lost).
    ApplyThenFail,
    /// Fails, and the whole store is down for this long from now (this call included).
    DownFor(Duration),
    /// Refused as `Busy` (a row lock held elsewhere), changing nothing.
    Busy,
    /// Refused as `Full` (no room), changing nothing.
    Full,
    /// Refused as `Fenced`, changing nothing (whether or not the record is still the caller's).
    Fenced,
}

pub struct Rig<S> {
    pub inner: Arc<S>,
    pub start: Instant,
    pub counts: Mutex<HashMap<&'static str, usize>>,
    pub plan: Mutex<HashMap<(&'static str, usize), Act>>,
    pub always: Mutex<HashMap<&'static str, Act>>,
    pub down_until: Mutex<Option<Instant>>,
    /// The tokens of the claims that acquired, in order.
    pub acquired: Mutex<Vec<FencingToken>>,
    /// Indexes (into `acquired`) of holders whose renewals fail: crashed holders.
    pub doomed: Mutex<HashSet<usize>>,
    /// `release` fails while fewer claims than this have acquired.
    pub release_fails_below: AtomicUsize,
    pub renewed_ok: AtomicUsize,
    /// Claims go to the inner store's `claim_now` (no faults injected into them), as
    /// MemoryStore's do without a rig: the pipeline then knows the lease began at once.
    pub at_once: std::sync::atomic::AtomicBool,
    /// When each renewal reached the store (the tokio clock: exact under a paused one).
    pub renewals_at: Mutex<Vec<Instant>>,
    /// Operations of a kind fail until this instant.
    pub fail_until: Mutex<HashMap<&'static str, Instant>>,
    /// How many more `wait_for_change` calls return (almost) at once, as a store may.
    pub early_waits: AtomicUsize,
    /// How long every operation of a kind takes before its act (a store that answers slowly).
    pub slow: Mutex<HashMap<&'static str, Duration>>,
    pub log: Mutex<Vec<String>>,
    /// Calls that hung (`Act::Hang`) and were dropped by their caller: a connection sqlx would
    /// still hold until its statement ended, for each.
    pub hangs_dropped: Arc<AtomicUsize>,
}

/// Counts a hung call dropped (see [`Rig::hangs_dropped`]).
struct DroppedHang(Arc<AtomicUsize>);

impl Drop for DroppedHang {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

pub fn injected(what: &str) -> StoreError {
    StoreError::unavailable(std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        format!("{what}: injected"),
    ))
}

impl<S: IdempotencyStore> Rig<S> {
    pub fn new(inner: S) -> Arc<Self> {
        Self::over(Arc::new(inner))
    }

    pub fn over(inner: Arc<S>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            start: Instant::now(),
            counts: Mutex::default(),
            plan: Mutex::default(),
            always: Mutex::default(),
            down_until: Mutex::default(),
            acquired: Mutex::default(),
            doomed: Mutex::default(),
            release_fails_below: AtomicUsize::new(0),
            renewed_ok: AtomicUsize::new(0),
            renewals_at: Mutex::default(),
            at_once: std::sync::atomic::AtomicBool::new(false),
            fail_until: Mutex::default(),
            early_waits: AtomicUsize::new(0),
            slow: Mutex::default(),
            log: Mutex::default(),
            hangs_dropped: Arc::default(),
        })
    }

    pub fn on(&self, kind: &'static str, n: usize, act: Act) {
        self.plan.lock().unwrap().insert((kind, n), act);
    }

    pub fn always(&self, kind: &'static str, act: Act) {
        self.always.lock().unwrap().insert(kind, act);
    }

    /// Every later operation of `kind` takes `d` before its act, whatever the act.
    pub fn slow(&self, kind: &'static str, d: Duration) {
        self.slow.lock().unwrap().insert(kind, d);
    }

    pub fn fail_for(&self, kind: &'static str, d: Duration) {
        self.fail_until
            .lock()
            .unwrap()
            .insert(kind, Instant::now() + d);
    }

    pub fn doom(&self, holder: usize) {
        self.doomed.lock().unwrap().insert(holder);
    }

    pub fn count(&self, kind: &str) -> usize {
        self.counts.lock().unwrap().get(kind).copied().unwrap_or(0)
    }

    pub fn acquired(&self) -> usize {
        self.acquired.lock().unwrap().len()
    }

    pub fn log(&self) -> String {
        let log = self.log.lock().unwrap();
        // The tail: enough to read what happened last.
        let from = log.len().saturating_sub(80);
        log[from..].join("\n  ")
    }

    pub fn logged(&self, a: &str, b: &str) -> usize {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(a) && l.contains(b))
            .count()
    }

    pub fn is_down(&self) -> bool {
        self.down_until
            .lock()
            .unwrap()
            .is_some_and(|until| Instant::now() < until)
    }

    pub fn next(&self, kind: &'static str) -> (usize, Act) {
        let n = {
            let mut counts = self.counts.lock().unwrap();
            let n = counts.entry(kind).or_insert(0);
            *n += 1;
            *n
        };
        let failing = self
            .fail_until
            .lock()
            .unwrap()
            .get(kind)
            .is_some_and(|until| Instant::now() < *until);
        if failing {
            return (n, Act::Fail);
        }
        let act = match self.plan.lock().unwrap().get(&(kind, n)) {
            Some(act) => *act,
            None => self
                .always
                .lock()
                .unwrap()
                .get(kind)
                .copied()
                .unwrap_or(Act::Pass),
        };
        (n, act)
    }

    pub fn note(&self, line: String) {
        let at = self.start.elapsed().as_millis();
        self.log.lock().unwrap().push(format!("+{at}ms {line}"));
    }

    pub fn doomed_token(&self, token: FencingToken) -> bool {
        let acquired = self.acquired.lock().unwrap();
        let doomed = self.doomed.lock().unwrap();
        acquired
            .iter()
            .enumerate()
            .any(|(i, t)| *t == token && doomed.contains(&i))
    }

    pub async fn around<T>(
        &self,
        kind: &'static str,
        token: Option<FencingToken>,
        op: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let (n, act) = self.next(kind);
        let gated =
            kind == "release" && self.acquired() < self.release_fails_below.load(Ordering::SeqCst);
        let doomed = kind == "renew" && token.is_some_and(|t| self.doomed_token(t));
        let slow = self.slow.lock().unwrap().get(kind).copied();
        if let Some(slow) = slow {
            tokio::time::sleep(slow).await;
        }
        let out = if self.is_down() || gated || doomed {
            Err(injected(kind))
        } else {
            match act {
                Act::Pass => op.await,
                Act::Fail => Err(injected(kind)),
                Act::Busy => Err(StoreError::Busy),
                Act::Full => Err(StoreError::Full),
                Act::Fenced => Err(StoreError::Fenced),
                Act::Before(d) => {
                    tokio::time::sleep(d).await;
                    op.await
                }
                Act::After(d) => {
                    let out = op.await;
                    tokio::time::sleep(d).await;
                    out
                }
                Act::Hang => {
                    let token = token.map_or(String::new(), |t| format!(" t={}", t.get()));
                    self.note(format!("{kind}#{n}{token} hangs"));
                    let _dropped = DroppedHang(self.hangs_dropped.clone());
                    std::future::pending().await
                }
                Act::ApplyThenFail => {
                    let _ = op.await;
                    Err(injected(kind))
                }
                Act::DownFor(d) => {
                    *self.down_until.lock().unwrap() = Some(Instant::now() + d);
                    Err(injected(kind))
                }
            }
        };
        let what = match &out {
            Ok(_) => "ok".to_owned(),
            Err(StoreError::Fenced) => "fenced".to_owned(),
            Err(e) => format!("error ({e})"),
        };
        let token = token.map_or(String::new(), |t| format!(" t={}", t.get()));
        self.note(format!("{kind}#{n}{token} {act:?} -> {what}"));
        out
    }
}

impl<S: IdempotencyStore> IdempotencyStore for Rig<S> {
    fn claim_now(&self, request: &ClaimRequest) -> Option<Result<Claim, StoreError>> {
        if !self.at_once.load(Ordering::SeqCst) {
            return None;
        }
        let claim = self.inner.claim_now(request)?;
        if let Ok(Claim::Acquired(lease)) = &claim {
            self.acquired.lock().unwrap().push(lease.token);
            self.note(format!(
                "  acquired t={} attempt {} (at once)",
                lease.token.get(),
                lease.attempt
            ));
        }
        Some(claim)
    }

    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        let claim = self
            .around("claim", None, self.inner.claim(request))
            .await?;
        if let Claim::Acquired(lease) = &claim {
            self.acquired.lock().unwrap().push(lease.token);
            self.note(format!(
                "  acquired t={} attempt {}",
                lease.token.get(),
                lease.attempt
            ));
        }
        Ok(claim)
    }

    async fn renew(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<SystemTime, StoreError> {
        self.renewals_at.lock().unwrap().push(Instant::now());
        let out = self
            .around("renew", Some(token), self.inner.renew(key, token, lease))
            .await;
        if out.is_ok() {
            self.renewed_ok.fetch_add(1, Ordering::SeqCst);
        }
        out
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
            Some(token),
            self.inner.complete(key, token, response, ttl),
        )
        .await
    }

    async fn release(
        &self,
        key: &ScopedKey,
        token: FencingToken,
    ) -> Result<RecordStatus, StoreError> {
        self.around("release", Some(token), self.inner.release(key, token))
            .await
    }

    async fn mark_uncertain(&self, key: &ScopedKey, token: FencingToken) -> Result<(), StoreError> {
        self.around(
            "mark_uncertain",
            Some(token),
            self.inner.mark_uncertain(key, token),
        )
        .await
    }

    async fn lookup(&self, key: &ScopedKey) -> Result<Option<Record>, StoreError> {
        self.around("lookup", None, self.inner.lookup(key)).await
    }

    async fn record_milestone(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        milestone: &Milestone,
    ) -> Result<(), StoreError> {
        self.around(
            "record_milestone",
            Some(token),
            self.inner.record_milestone(key, token, milestone),
        )
        .await
    }

    async fn append_history(&self, key: &ScopedKey, event: HistoryEvent) -> Result<(), StoreError> {
        self.around(
            "append_history",
            None,
            self.inner.append_history(key, event),
        )
        .await
    }

    async fn wait_for_change(
        &self,
        key: &ScopedKey,
        seen: &InFlight,
        round: u32,
        within: Duration,
    ) {
        let (n, act) = self.next("wait_for_change");
        let early = self
            .early_waits
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if early {
            tokio::time::sleep(ms(1).min(within)).await;
            return;
        }
        match act {
            // "Returning early is always allowed."
            Act::Fail | Act::DownFor(_) => {}
            Act::Before(d) => {
                tokio::time::sleep(d.min(within)).await;
                self.inner.wait_for_change(key, seen, round, within).await;
            }
            _ => self.inner.wait_for_change(key, seen, round, within).await,
        }
        let _ = n;
    }

    crate::common::forward::forward_store!(inner: remove, purge_expired, list_uncertain, count_uncertain, resolve);
}

// ---- the server and its clients ----------------------------------------------------------------

pub type Reply = (StatusCode, String);
pub type Handler = Arc<
    dyn Fn(usize, IdempotencyContext) -> Pin<Box<dyn Future<Output = Reply> + Send>> + Send + Sync,
>;

pub fn handler<F, Fut>(f: F) -> Handler
where
    F: Fn(usize, IdempotencyContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Reply> + Send + 'static,
{
    Arc::new(move |i, ctx| Box::pin(f(i, ctx)))
}

/// `/op` behind `layer`; the handler is told which call it is (from 0).
pub fn app<S: IdempotencyStore>(
    layer: IdempotencyLayer<Rig<S>, SingleTenant>,
    h: Handler,
) -> Router {
    let calls = Arc::new(AtomicUsize::new(0));
    Router::new().route(
        "/op",
        post(move |ctx: IdempotencyContext| {
            let i = calls.fetch_add(1, Ordering::SeqCst);
            h(i, ctx)
        })
        .layer(layer),
    )
}

#[derive(Clone, Copy)]
pub struct Route {
    pub lease: Duration,
    pub expiry: LeaseExpiry,
    pub wait: Option<Duration>,
    pub cancel: bool,
}

impl Route {
    pub fn waiting(lease: Duration) -> Self {
        Self {
            lease,
            expiry: LeaseExpiry::Reclaim,
            wait: Some(Duration::from_secs(25)),
            cancel: false,
        }
    }

    pub fn plain(lease: Duration) -> Self {
        Self {
            wait: None,
            ..Self::waiting(lease)
        }
    }

    pub fn reconcile(self) -> Self {
        Self {
            expiry: LeaseExpiry::Reconcile,
            ..self
        }
    }

    pub fn cancelling(self) -> Self {
        Self {
            cancel: true,
            ..self
        }
    }
}

pub fn layer<S: IdempotencyStore>(
    rig: &Arc<Rig<S>>,
    r: Route,
) -> IdempotencyLayer<Rig<S>, SingleTenant> {
    let layer = IdempotencyLayer::from_arc(rig.clone())
        .single_tenant()
        .lease(r.lease)
        .on_lease_expiry(r.expiry)
        .cancel_on_disconnect(r.cancel);
    match r.wait {
        Some(wait) => layer.wait_for_in_flight(wait),
        None => layer,
    }
}

pub async fn server<S: IdempotencyStore>(rig: &Arc<Rig<S>>, r: Route, h: Handler) -> SocketAddr {
    serve(app(layer(rig, r), h)).await
}

/// What a client was told.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub status: u16,
    pub replayed: bool,
    pub body: String,
    /// The problem type's slug, for a problem answer.
    pub problem: String,
}

impl Answer {
    pub fn is_replay_of(&self, body: &str) -> bool {
        self.replayed && self.status == 201 && self.body == body
    }

    pub fn is_live(&self) -> bool {
        !self.replayed && self.status == 201
    }

    pub fn in_flight(&self) -> bool {
        self.status == 409 && self.problem == "in-flight"
    }
}

pub async fn send(addr: SocketAddr, key: &str, patience: Duration) -> Option<Answer> {
    send_body(addr, key, r#"{"amount":10}"#, patience).await
}

/// [`send`] with a body of the caller's choosing.
pub async fn send_body(
    addr: SocketAddr,
    key: &str,
    body: &str,
    patience: Duration,
) -> Option<Answer> {
    let res = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(patience)
        .build()
        .expect("client")
        .post(format!("http://{addr}/op"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .ok()?;
    let status = res.status().as_u16();
    let replayed = res
        .headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let is_problem = res
        .headers()
        .get("content-type")
        .is_some_and(|v| v == "application/problem+json");
    let body = res.text().await.ok()?;
    let problem = if is_problem {
        let p: serde_json::Value = serde_json::from_str(&body).expect("problem JSON");
        let t = p["type"].as_str().unwrap_or_default();
        t.rsplit(':').next().unwrap_or_default().to_owned()
    } else {
        String::new()
    };
    Some(Answer {
        status,
        replayed,
        body,
        problem,
    })
}

/// One request that must be answered.
pub async fn ask(addr: SocketAddr, key: &str) -> Answer {
    send(addr, key, Duration::from_secs(40))
        .await
        .expect("an answer, never a hang")
}

/// Asks until the answer is not "in flight" (a retrying client honouring 409), for up to
/// `patience`; the last answer.
pub async fn ask_past_in_flight(addr: SocketAddr, key: &str, patience: Duration) -> Answer {
    let until = Instant::now() + patience;
    loop {
        let a = ask(addr, key).await;
        if !a.in_flight() || Instant::now() >= until {
            return a;
        }
        tokio::time::sleep(ms(100)).await;
    }
}

/// A request whose client hangs up (its future is dropped) when the returned handle is
/// aborted.
pub fn hang_up_later(addr: SocketAddr, key: &str) -> tokio::task::JoinHandle<Option<Answer>> {
    let key = key.to_owned();
    tokio::spawn(async move { send(addr, &key, Duration::from_secs(40)).await })
}

/// `n` requests with one key released together through a barrier, each answered.
pub fn waiters(addr: SocketAddr, key: &str, n: usize) -> tokio::task::JoinHandle<Vec<Answer>> {
    let key = key.to_owned();
    tokio::spawn(async move {
        let barrier = Arc::new(Barrier::new(n));
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                let (barrier, key) = (barrier.clone(), key.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    ask(addr, &key).await
                })
            })
            .collect();
        let mut answers = Vec::new();
        for task in tasks {
            answers.push(task.await.expect("a waiter's task"));
        }
        answers
    })
}

/// Answers summarised for failure messages.
pub fn summary(answers: &[Answer]) -> String {
    let mut counts: HashMap<String, usize> = HashMap::new();
    for a in answers {
        let what = if a.problem.is_empty() {
            format!(
                "{} {}{}",
                a.status,
                if a.replayed { "replay " } else { "live " },
                a.body
            )
        } else {
            format!("{} {}", a.status, a.problem)
        };
        *counts.entry(what).or_default() += 1;
    }
    let mut v: Vec<_> = counts
        .into_iter()
        .map(|(k, n)| format!("{n}x [{k}]"))
        .collect();
    v.sort();
    v.join(", ")
}

pub async fn record_of<S: IdempotencyStore>(rig: &Rig<S>, key: &str) -> Option<Record> {
    rig.inner
        .lookup(&ScopedKey::new("", key))
        .await
        .expect("lookup")
}

/// The status the record of `key` has now (`None`: no record).
pub async fn status_of<S: IdempotencyStore>(rig: &Rig<S>, key: &str) -> Option<RecordStatus> {
    record_of(rig, key).await.map(|r| r.status)
}

/// Polls `done` every 10 ms for up to 20 s; whether it came true.
pub async fn eventually(done: impl AsyncFnMut() -> bool) -> bool {
    within(Duration::from_secs(20), done).await
}

/// Polls `done` every 10 ms for up to `limit`; whether it came true.
pub async fn within(limit: Duration, mut done: impl AsyncFnMut() -> bool) -> bool {
    let until = Instant::now() + limit;
    while Instant::now() < until {
        if done().await {
            return true;
        }
        tokio::time::sleep(ms(10)).await;
    }
    false
}

// ---- records and reconciliation ----------------------------------------------------------------

/// A 201 answer with `body`, as a record or a resolution holds it.
pub fn created(body: &str) -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: axum::http::HeaderMap::new(),
        body: Some(body.to_owned().into()),
        trailers: None,
    }
}

/// The history events of `key`'s record.
pub async fn events_of<S: IdempotencyStore>(rig: &Rig<S>, key: &str) -> Vec<HistoryEvent> {
    record_of(rig, key)
        .await
        .map(|r| r.history.iter().map(|h| h.event).collect())
        .unwrap_or_default()
}

/// The token of the `n`-th claim that acquired (from 0).
pub fn token_of<S: IdempotencyStore>(rig: &Rig<S>, n: usize) -> u64 {
    rig.acquired.lock().unwrap()[n].get()
}

/// Renewals sent under `token` so far (every one the rig saw, whatever it answered).
pub fn renewals_of<S: IdempotencyStore>(rig: &Rig<S>, token: u64) -> usize {
    rig.logged("renew#", &format!(" t={token} "))
}

/// A reconciler that always answers the same.
pub struct Says(pub Reconciliation);

impl Reconciler for Says {
    async fn reconcile(&self, _: &Record) -> Reconciliation {
        self.0.clone()
    }
}

/// One sweep over `store` with a reconciler that says `what`.
pub async fn sweep<S: IdempotencyStore>(store: S, what: Reconciliation) {
    Sweeper::new(store, Says(what))
        .run_once()
        .await
        .expect("a sweep");
}

// ---- handlers --------------------------------------------------------------------------------

/// Call 0 marks its effect started, makes it, then answers `failed` (a 500 or 502 the policy
/// leaves unrecorded: the key then awaits reconciliation); later calls make the effect and
/// answer 201. Every call declines (503, no effect) if the milestone cannot be marked.
pub fn effect_then(effects: &Effects, failed: StatusCode) -> Handler {
    let effects = effects.clone();
    handler(move |i, ctx| {
        let effects = effects.clone();
        async move {
            if ctx.effect_started().await.is_err() {
                return (StatusCode::SERVICE_UNAVAILABLE, "no milestone".into());
            }
            let n = effects.hit();
            if i == 0 {
                return (failed, format!("effect {n}, then {failed}"));
            }
            (StatusCode::CREATED, format!("effect {n}"))
        }
    })
}

/// Call 0 sleeps `first` (a slow, or crashed, holder) before its effect; later calls make it at
/// once. With `milestone`, every call marks its effect started first and declines (503, no
/// effect) if that fails, as the README says a handler must.
pub fn sleep_then_effect(effects: &Effects, first: Duration, milestone: bool) -> Handler {
    let effects = effects.clone();
    handler(move |i, ctx| {
        let effects = effects.clone();
        async move {
            if i == 0 {
                tokio::time::sleep(first).await;
            }
            if milestone && ctx.effect_started().await.is_err() {
                return (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "no milestone, no effect".into(),
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

/// Call 0 works `first`, then fails with `status` having done nothing; later calls make the
/// effect.
/// A server on `r` whose first call answers 503 at once, having done nothing (nothing to
/// record under `DefinitiveOnly`: the key is given back); later calls make the effect.
pub async fn first_503<S: IdempotencyStore>(
    rig: &Arc<Rig<S>>,
    r: Route,
    effects: &Effects,
) -> SocketAddr {
    let h = fail_first(effects, Duration::ZERO, StatusCode::SERVICE_UNAVAILABLE);
    server(rig, r, h).await
}

pub fn fail_first(effects: &Effects, first: Duration, status: StatusCode) -> Handler {
    let effects = effects.clone();
    handler(move |i, ctx| {
        let effects = effects.clone();
        async move {
            if i == 0 {
                tokio::time::sleep(first).await;
                return (status, "nothing done".into());
            }
            let n = effects.hit();
            (
                StatusCode::CREATED,
                format!("effect {n} attempt {}", ctx.attempt()),
            )
        }
    })
}
