//! Red-team review of f92bffb: a record of another fingerprint scheme (another crate version,
//! other fingerprint settings) for the same input, released or held past its lease, is
//! "adopted": the claim loop claims again with the record's 32 bytes (`decide::adopt`). These
//! tests try to make adoption run a request twice, run one whose input differs, leak a
//! `safe_new_key: true` where a retry may be the same request, or answer otherwise than a
//! replica of the record's own scheme would. Real servers over TCP, a real client; effects are
//! counted in the handlers (the sink), at entry.

use crate::common;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use common::{Effects, FlakyStore, client, guard, serve, until};
use tokio::sync::{Barrier, Semaphore};
use tower_idempotency::jsonrpc::JsonRpc;
use tower_idempotency::scope::SingleTenant;
use tower_idempotency::store::{
    Claim, ClaimRequest, FencingToken, HistoryEvent, InFlight, Milestone, Record, RecordStatus,
    Resolution, ScopedKey, StoreError, StoredResponse, UncertainCount, UncertainPage,
    UncertainQuery,
};
use tower_idempotency::{
    Fingerprint, IdempotencyContext, IdempotencyLayer, IdempotencyStore, LeaseExpiry,
    MalformedBody, MemoryStore,
};

// ---- shared pieces ----------------------------------------------------------------------------

const BODY: &str = r#"{"amount":10,"currency":"EUR"}"#;

fn unique(name: &str) -> String {
    common::raw::unique(name)
}

/// What one exchange came to.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: HeaderMap,
    body: String,
    json: serde_json::Value,
}

impl Answer {
    fn replayed(&self) -> bool {
        self.headers
            .get("idempotency-replayed")
            .is_some_and(|v| v == "true")
    }
    fn safe_new_key(&self) -> Option<bool> {
        self.json["safe_new_key"]
            .as_bool()
            .or_else(|| self.json["error"]["data"]["safe_new_key"].as_bool())
    }
    fn slug(&self) -> String {
        let t = self.json["type"]
            .as_str()
            .or_else(|| self.json["error"]["data"]["type"].as_str())
            .unwrap_or_default();
        t.rsplit(':').next().unwrap_or_default().to_owned()
    }
    fn live(&self) -> bool {
        (200..300).contains(&self.status) && !self.replayed()
    }
}

async fn send_to(addr: SocketAddr, path: &str, key: &str, body: &str) -> Answer {
    guard("an exchange", async {
        let res = client()
            .post(format!("http://{addr}{path}"))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .await
            .expect("request");
        let status = res.status().as_u16();
        let headers = res.headers().clone();
        let bytes = res.bytes().await.unwrap_or_default();
        Answer {
            status,
            headers,
            body: String::from_utf8_lossy(&bytes).into_owned(),
            json: serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
        }
    })
    .await
}

async fn send(addr: SocketAddr, key: &str, body: &str) -> Answer {
    send_to(addr, "/tickets", key, body).await
}

/// How a replica's handler behaves: it counts an effect at entry (the sink), marks its effect
/// started if asked, sleeps, and answers `status`.
#[derive(Clone, Copy)]
struct Behave {
    status: StatusCode,
    delay: Duration,
    started: bool,
}

const OK: Behave = Behave {
    status: StatusCode::CREATED,
    delay: Duration::ZERO,
    started: false,
};
const FAIL: Behave = Behave {
    status: StatusCode::SERVICE_UNAVAILABLE,
    delay: Duration::ZERO,
    started: false,
};

fn slow(status: StatusCode, delay: Duration) -> Behave {
    Behave {
        status,
        delay,
        started: false,
    }
}

/// Which fingerprint settings a replica runs with. `Ours` counts nothing of its own (its
/// fingerprints are `Fingerprint::of`'s); `Theirs` and `Third` register a canonicaliser for a
/// media type these requests never have: the same input, named by another scheme, as a
/// replica of another version or configuration does.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Scheme {
    Ours,
    Theirs,
    Third,
}

fn raw(body: &[u8]) -> Result<Vec<u8>, MalformedBody> {
    Ok(body.to_vec())
}

type Layer<St> = IdempotencyLayer<St, SingleTenant>;

fn layer<St: IdempotencyStore>(store: St, scheme: Scheme) -> Layer<St> {
    let layer = IdempotencyLayer::new(store).single_tenant();
    match scheme {
        Scheme::Ours => layer,
        Scheme::Theirs => layer.canonicalize("application/x-never-sent", raw),
        Scheme::Third => layer.canonicalize("application/x-also-never-sent", raw),
    }
}

fn tickets<St: IdempotencyStore>(layer: Layer<St>, effects: &Effects, behave: Behave) -> Router {
    let effects = effects.clone();
    Router::new()
        .route(
            "/tickets",
            post(move |ctx: IdempotencyContext, body: String| {
                let effects = effects.clone();
                async move {
                    let n = effects.hit();
                    if behave.started {
                        ctx.effect_started().await.expect("milestone");
                    }
                    tokio::time::sleep(behave.delay).await;
                    (
                        behave.status,
                        format!("effect {n} attempt {} for {body}", ctx.attempt()),
                    )
                }
            }),
        )
        .layer(layer)
}

/// This replica's fingerprint of `POST /tickets` with `body` (JSON), as the layer makes it
/// with default settings.
fn ours(body: &str) -> Fingerprint {
    let (parts, ()) = http::Request::builder()
        .method("POST")
        .uri("/tickets")
        .header("content-type", "application/json")
        .body(())
        .expect("request")
        .into_parts();
    Fingerprint::of(&parts, body.as_bytes()).expect("fingerprint")
}

/// The same digest under another scheme's four bytes (another crate version).
fn flip(fp: &Fingerprint) -> Fingerprint {
    let mut bytes = *fp.as_bytes();
    bytes[..4].copy_from_slice(&[0x5c, 0x4e, 0x3d, 0x2b]);
    Fingerprint::from_bytes(bytes)
}

fn claim_request(
    key: &ScopedKey,
    fp: Fingerprint,
    lease: Duration,
    expiry: LeaseExpiry,
) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        fingerprint: fp,
        lease,
        ttl: Duration::from_secs(600),
        on_lease_expiry: expiry,
    }
}

/// A holder of another scheme that claimed `key` directly with `fp` (a replica that then
/// died): its token.
async fn hold<St: IdempotencyStore>(
    store: &St,
    key: &ScopedKey,
    fp: Fingerprint,
    lease: Duration,
    expiry: LeaseExpiry,
) -> FencingToken {
    match store
        .claim(&claim_request(key, fp, lease, expiry))
        .await
        .expect("claim")
    {
        Claim::Acquired(lease) => lease.token,
        other => panic!("the holder's claim: {other:?}"),
    }
}

async fn record<St: IdempotencyStore>(store: &St, key: &ScopedKey) -> Option<Record> {
    store.lookup(key).await.expect("lookup")
}

fn stored(text: &'static str) -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: HeaderMap::new(),
        body: Some(Bytes::from_static(text.as_bytes())),
        trailers: None,
    }
}

// ---- a store that holds claims at a gate ------------------------------------------------------

/// Where a gated claim waits: before it reaches the store, or after the store answered it
/// `Acquired` (committed, its answer not yet back).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum At {
    Before,
    AfterAcquired,
}

/// Fingerprints armed at a [`Gate`], each with where its claim stops.
type Armed = Arc<Mutex<VecDeque<([u8; 32], At)>>>;

/// Wraps a store; claims with an armed fingerprint stop at the gate (once per arming) until
/// the test lets them go. Every claim's fingerprint is logged. Only `claim` is touched.
#[derive(Clone)]
struct Gate<S> {
    inner: S,
    armed: Armed,
    go: Arc<Semaphore>,
    claims: Arc<Mutex<Vec<[u8; 32]>>>,
    held: Arc<AtomicUsize>,
}

impl<S> Gate<S> {
    fn new(inner: S) -> Self {
        Self {
            inner,
            armed: Arc::default(),
            go: Arc::new(Semaphore::new(0)),
            claims: Arc::default(),
            held: Arc::default(),
        }
    }
    fn arm(&self, fp: &Fingerprint, at: At) {
        self.armed
            .lock()
            .expect("lock")
            .push_back((*fp.as_bytes(), at));
    }
    /// Until `n` claims in all have stopped at the gate.
    async fn arrived(&self, n: usize) {
        until("claims at the gate", || {
            self.held.load(Ordering::SeqCst) >= n
        })
        .await;
    }
    fn release(&self) {
        self.go.add_permits(1);
    }
    fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }
    fn claims(&self) -> Vec<[u8; 32]> {
        self.claims.lock().expect("lock").clone()
    }
    fn take(&self, fp: &Fingerprint) -> Option<At> {
        let mut armed = self.armed.lock().expect("lock");
        let at = armed.iter().position(|(b, _)| b == fp.as_bytes())?;
        armed.remove(at).map(|(_, at)| at)
    }
    async fn wait(&self) {
        self.held.fetch_add(1, Ordering::SeqCst);
        self.go.acquire().await.expect("gate").forget();
    }
}

impl<S: IdempotencyStore> IdempotencyStore for Gate<S> {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        self.claims
            .lock()
            .expect("lock")
            .push(*request.fingerprint.as_bytes());
        let at = self.take(&request.fingerprint);
        if at == Some(At::Before) {
            self.wait().await;
        }
        let claim = self.inner.claim(request).await?;
        if at == Some(At::AfterAcquired) && matches!(claim, Claim::Acquired(_)) {
            self.wait().await;
        }
        Ok(claim)
    }
    async fn renew(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<SystemTime, StoreError> {
        self.inner.renew(key, token, lease).await
    }
    async fn complete(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.inner.complete(key, token, response, ttl).await
    }
    async fn release(
        &self,
        key: &ScopedKey,
        token: FencingToken,
    ) -> Result<RecordStatus, StoreError> {
        self.inner.release(key, token).await
    }
    async fn mark_uncertain(&self, key: &ScopedKey, token: FencingToken) -> Result<(), StoreError> {
        self.inner.mark_uncertain(key, token).await
    }
    async fn lookup(&self, key: &ScopedKey) -> Result<Option<Record>, StoreError> {
        self.inner.lookup(key).await
    }
    async fn remove(&self, key: &ScopedKey) -> Result<bool, StoreError> {
        self.inner.remove(key).await
    }
    async fn purge_expired(&self) -> Result<u64, StoreError> {
        self.inner.purge_expired().await
    }
    async fn record_milestone(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        milestone: &Milestone,
    ) -> Result<(), StoreError> {
        self.inner.record_milestone(key, token, milestone).await
    }
    async fn list_uncertain(&self, query: &UncertainQuery) -> Result<UncertainPage, StoreError> {
        self.inner.list_uncertain(query).await
    }
    async fn count_uncertain(&self) -> Result<UncertainCount, StoreError> {
        self.inner.count_uncertain().await
    }
    async fn resolve(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        resolution: &Resolution,
        ttl: Duration,
        note: Option<&str>,
    ) -> Result<(), StoreError> {
        self.inner.resolve(key, token, resolution, ttl, note).await
    }
    async fn append_history(&self, key: &ScopedKey, event: HistoryEvent) -> Result<(), StoreError> {
        self.inner.append_history(key, event).await
    }
    async fn wait_for_change(
        &self,
        key: &ScopedKey,
        seen: &InFlight,
        round: u32,
        within: Duration,
    ) {
        self.inner.wait_for_change(key, seen, round, within).await;
    }
}

// ---- 1. replicas of both schemes racing on one released key -----------------------------------

/// Attacks: adoption under contention. A key released by a replica of another scheme (its
/// handler answered 503) is retried at once, from behind one barrier, by three requests to a
/// replica of our scheme (each claims twice: its own bytes, then the record's) and three to
/// replicas of the record's scheme (one claim each), for several keys. At most one of them may
/// run, the others are told "in flight" (or replayed), and every later retry on either scheme
/// replays the one run's answer. DESIGN §1 (one operation key, at most one execution), §2 (a
/// released record is claimable again), §5 (every store alike).
async fn racing_replicas_run_a_released_key_once<St: IdempotencyStore + Clone>(store: St) {
    let (seed_effects, a_effects, b_effects) =
        (Effects::default(), Effects::default(), Effects::default());
    let handler = slow(StatusCode::CREATED, Duration::from_millis(150));
    let b_failing = serve(tickets(
        layer(store.clone(), Scheme::Theirs),
        &seed_effects,
        FAIL,
    ))
    .await;
    let a = serve(tickets(
        layer(store.clone(), Scheme::Ours),
        &a_effects,
        handler,
    ))
    .await;
    let b = serve(tickets(
        layer(store.clone(), Scheme::Theirs),
        &b_effects,
        handler,
    ))
    .await;
    for round in 0..4 {
        let key = unique(&format!("race-{round}"));
        let first = send(b_failing, &key, BODY).await;
        assert_eq!(first.status, 503, "{first:?}");
        let before = a_effects.count() + b_effects.count();
        let barrier = Arc::new(Barrier::new(6));
        let mut tasks = Vec::new();
        for i in 0..6 {
            let (barrier, key) = (barrier.clone(), key.clone());
            let addr = if i % 2 == 0 { a } else { b };
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                (i % 2 == 0, send(addr, &key, BODY).await)
            }));
        }
        let mut answers = Vec::new();
        for task in tasks {
            answers.push(task.await.expect("task"));
        }
        let ran = a_effects.count() + b_effects.count() - before;
        assert_eq!(
            ran, 1,
            "round {round}: {ran} runs for one key: {answers:#?}"
        );
        let live: Vec<_> = answers.iter().filter(|(_, a)| a.live()).collect();
        assert_eq!(
            live.len(),
            1,
            "round {round}: one live answer: {answers:#?}"
        );
        for (_, answer) in &answers {
            assert!(
                answer.live()
                    || answer.replayed()
                    || (answer.status == 409 && answer.slug() == "in-flight"),
                "round {round}: {answer:?}"
            );
        }
        for addr in [a, b] {
            let again = send(addr, &key, BODY).await;
            assert!(
                again.replayed() && again.body == live[0].1.body,
                "round {round}: the one run's answer replayed on both schemes: {again:?} vs {:?}",
                live[0].1
            );
        }
        assert_eq!(
            a_effects.count() + b_effects.count() - before,
            1,
            "never twice"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_s2_racing_replicas_of_both_schemes_run_a_released_key_once_on_memory() {
    racing_replicas_run_a_released_key_once(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_s2_racing_replicas_of_both_schemes_run_a_released_key_once_on_sqlite() {
    let (store, path) = common::sqlite("adoption-race").await;
    racing_replicas_run_a_released_key_once(store).await;
    let _ = std::fs::remove_file(path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_s2_racing_replicas_of_both_schemes_run_a_released_key_once_on_postgres() {
    let Some(store) = common::postgres("adoption_race").await else {
        return;
    };
    racing_replicas_run_a_released_key_once(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_s2_racing_replicas_of_both_schemes_run_a_released_key_once_on_redis() {
    let Some(store) = common::redis("adoption-race").await else {
        return;
    };
    racing_replicas_run_a_released_key_once(store).await;
}

// ---- 2. lapsed holders of another scheme: milestones and Reconcile -----------------------------

/// Attacks: adoption of a lapsed lease where the store must not take it over. A dead holder of
/// another scheme held the key for this very request and (a) marked its effect started, (b)
/// claimed on a route that reconciles, (c) neither, but the retrying replica's route
/// reconciles. In each case the retry must run nothing and be told `outcome-unknown` with
/// `safe_new_key: false`, exactly as a replica of the record's own scheme is; the holder's
/// outcome (or a resolution) then settles the key: a resolution "not applied" lets the next
/// retry run it once, "applied" is replayed. DESIGN §4 (lapsed lease: takeover only without a
/// milestone and where routes reclaim; `needs_reconciliation` otherwise; a resolved outcome
/// is final), §1 step 6 (outcome unknown: no new key).
async fn lapsed_holders_are_set_aside_as_their_own_scheme_would<St: IdempotencyStore + Clone>(
    store: St,
) {
    let lease = Duration::from_millis(100);
    let (a_effects, a_rec_effects) = (Effects::default(), Effects::default());
    let reclaiming = serve(tickets(layer(store.clone(), Scheme::Ours), &a_effects, OK)).await;
    let reconciling = serve(tickets(
        layer(store.clone(), Scheme::Ours).on_lease_expiry(LeaseExpiry::Reconcile),
        &a_rec_effects,
        OK,
    ))
    .await;
    let theirs = flip(&ours(BODY));
    // (what, holder's expiry, effect started, the retrying replica, then how it is settled)
    let cases = [
        (
            "milestone",
            LeaseExpiry::Reclaim,
            true,
            reclaiming,
            "holder completes",
        ),
        (
            "holder reconciles",
            LeaseExpiry::Reconcile,
            false,
            reclaiming,
            "not applied",
        ),
        (
            "retry reconciles",
            LeaseExpiry::Reclaim,
            false,
            reconciling,
            "applied",
        ),
    ];
    for (what, expiry, started, addr, settle) in cases {
        // The same case with the record's own bytes (a replica of its own scheme) is the
        // reference the adopting replica must match.
        for (whose, fp) in [("own scheme", ours(BODY)), ("other scheme", theirs)] {
            let text = unique("lapsed");
            let key = ScopedKey::new("", &text);
            let token = hold(&store, &key, fp, lease, expiry).await;
            if started {
                store
                    .record_milestone(&key, token, &Milestone::EffectStarted)
                    .await
                    .expect("milestone");
            }
            tokio::time::sleep(lease * 4).await;
            let before = a_effects.count() + a_rec_effects.count();
            let retry = send(addr, &text, BODY).await;
            assert_eq!(
                (retry.status, retry.slug().as_str(), retry.safe_new_key()),
                (409, "outcome-unknown", Some(false)),
                "{what}, record of the {whose}: {retry:?}"
            );
            assert_eq!(
                a_effects.count() + a_rec_effects.count(),
                before,
                "{what}, {whose}: nothing runs"
            );
            let r = record(&store, &key).await.expect("the record");
            assert_eq!(
                r.status,
                RecordStatus::NeedsReconciliation,
                "{what}, {whose}"
            );
            assert_eq!(
                r.fingerprint, fp,
                "{what}, {whose}: the record keeps its bytes"
            );
            let again = send(addr, &text, BODY).await;
            assert_eq!(
                again.slug(),
                "outcome-unknown",
                "{what}, {whose}: {again:?}"
            );
            match settle {
                "holder completes" => {
                    store
                        .complete(
                            &key,
                            token,
                            &stored("the holder's run"),
                            Duration::from_secs(600),
                        )
                        .await
                        .expect("the holder's outcome replaces the uncertainty");
                    let replay = send(addr, &text, BODY).await;
                    assert!(
                        replay.replayed() && replay.body == "the holder's run",
                        "{what}, {whose}: {replay:?}"
                    );
                }
                "not applied" => {
                    store
                        .resolve(
                            &key,
                            r.lease_token,
                            &Resolution::NotApplied,
                            Duration::from_secs(600),
                            None,
                        )
                        .await
                        .expect("resolve");
                    let run = send(addr, &text, BODY).await;
                    assert!(
                        run.live() && run.status == 201,
                        "{what}, {whose}: runs now: {run:?}"
                    );
                    let replay = send(addr, &text, BODY).await;
                    assert!(replay.replayed(), "{what}, {whose}: {replay:?}");
                    assert_eq!(
                        a_effects.count() + a_rec_effects.count(),
                        before + 1,
                        "{what}, {whose}: once"
                    );
                }
                _ => {
                    store
                        .resolve(
                            &key,
                            r.lease_token,
                            &Resolution::Applied(Box::new(stored("resolved by hand"))),
                            Duration::from_secs(600),
                            Some("checked downstream"),
                        )
                        .await
                        .expect("resolve");
                    let replay = send(addr, &text, BODY).await;
                    assert!(
                        replay.replayed() && replay.body == "resolved by hand",
                        "{what}, {whose}: {replay:?}"
                    );
                    // The old holder is fenced out of a resolved outcome.
                    assert!(
                        store
                            .complete(&key, token, &stored("late"), Duration::from_secs(600))
                            .await
                            .is_err(),
                        "{what}, {whose}: a resolved outcome is final"
                    );
                }
            }
        }
    }
    assert_eq!(
        a_effects.count() + a_rec_effects.count(),
        2,
        "only the two runs after a resolution 'not applied'"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_lapsed_holders_of_another_scheme_are_set_aside_on_memory() {
    lapsed_holders_are_set_aside_as_their_own_scheme_would(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_lapsed_holders_of_another_scheme_are_set_aside_on_postgres() {
    let Some(store) = common::postgres("adoption_lapsed").await else {
        return;
    };
    lapsed_holders_are_set_aside_as_their_own_scheme_would(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_lapsed_holders_of_another_scheme_are_set_aside_on_redis() {
    let Some(store) = common::redis("adoption-lapsed").await else {
        return;
    };
    lapsed_holders_are_set_aside_as_their_own_scheme_would(store).await;
}

// ---- 3. the record moves between the two claims -----------------------------------------------

/// Attacks: the window between the claim that finds another scheme's record and the claim made
/// with its bytes. The adopting claim is held at a gate while (a) a replica of the record's
/// scheme takes the released key over and completes it: the adopting request must replay that
/// answer, not run; (b) it takes the key over and is still running: "in flight", nothing run;
/// (c) a lapsed holder renews its lease: "in flight", never a takeover of a live lease; (d) a
/// lapsed holder marks its effect started: `outcome-unknown`. The gated request makes exactly
/// two claims: its own bytes, then the record's (which keeps its bytes). DESIGN §1 step 5 (one
/// atomic claim decides), §4.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_s4_the_record_moving_between_the_two_claims_is_decided_by_the_second() {
    let store = MemoryStore::new();
    let gate = Gate::new(store.clone());
    let (a_effects, b_effects, seed) = (Effects::default(), Effects::default(), Effects::default());
    let a = serve(tickets(layer(gate.clone(), Scheme::Ours), &a_effects, OK)).await;
    let b_failing = serve(tickets(layer(store.clone(), Scheme::Theirs), &seed, FAIL)).await;
    let b_ok = serve(tickets(
        layer(store.clone(), Scheme::Theirs),
        &b_effects,
        OK,
    ))
    .await;
    let b_slow = serve(tickets(
        layer(store.clone(), Scheme::Theirs),
        &b_effects,
        slow(StatusCode::CREATED, Duration::from_millis(600)),
    ))
    .await;

    // (a) and (b): released by the other scheme, taken over by it meanwhile.
    for running in [false, true] {
        let text = unique("moved");
        let key = ScopedKey::new("", &text);
        assert_eq!(send(b_failing, &text, BODY).await.status, 503);
        let theirs = record(&store, &key).await.expect("released").fingerprint;
        assert_ne!(theirs, ours(BODY), "precondition: another scheme's bytes");
        gate.arm(&theirs, At::Before);
        let claims_before = gate.claims().len();
        let held = gate.held();
        let adopting = tokio::spawn({
            let text = text.clone();
            async move { send(a, &text, BODY).await }
        });
        gate.arrived(held + 1).await;
        let b_before = b_effects.count();
        let other = if running {
            let text = text.clone();
            let t = tokio::spawn(async move { send(b_slow, &text, BODY).await });
            until("the other scheme's run starts", || {
                b_effects.count() > b_before
            })
            .await;
            Some(t)
        } else {
            let done = send(b_ok, &text, BODY).await;
            assert!(done.live(), "{done:?}");
            None
        };
        gate.release();
        let answer = adopting.await.expect("task");
        assert_eq!(
            a_effects.count(),
            0,
            "running={running}: the adopting request ran: {answer:?}"
        );
        if running {
            assert_eq!(
                (answer.status, answer.slug().as_str()),
                (409, "in-flight"),
                "{answer:?}"
            );
            let b_answer = other.expect("task").await.expect("task");
            let replay = send(a, &text, BODY).await;
            assert!(
                replay.replayed() && replay.body == b_answer.body,
                "{replay:?}"
            );
        } else {
            assert!(
                answer.replayed(),
                "the run made meanwhile is replayed: {answer:?}"
            );
        }
        let claims: Vec<_> = gate.claims()[claims_before..].to_vec();
        assert_eq!(
            claims.first().zip(claims.get(1)).map(|(x, y)| (*x, *y)),
            Some((*ours(BODY).as_bytes(), *theirs.as_bytes())),
            "the first request's claims: its own bytes, then the record's"
        );
        assert_eq!(b_effects.count(), b_before + 1);
    }

    // (c) and (d): a lapsed holder of the other scheme comes back meanwhile.
    let theirs = flip(&ours(BODY));
    for milestone in [false, true] {
        let text = unique("revived");
        let key = ScopedKey::new("", &text);
        let lease = Duration::from_millis(100);
        let token = hold(&store, &key, theirs, lease, LeaseExpiry::Reclaim).await;
        tokio::time::sleep(lease * 4).await;
        gate.arm(&theirs, At::Before);
        let held = gate.held();
        let adopting = tokio::spawn({
            let text = text.clone();
            async move { send(a, &text, BODY).await }
        });
        gate.arrived(held + 1).await;
        let revived = if milestone {
            store
                .record_milestone(&key, token, &Milestone::EffectStarted)
                .await
                .map(|()| "milestone")
        } else {
            store
                .renew(&key, token, Duration::from_secs(30))
                .await
                .map(|_| "renewed")
        };
        gate.release();
        let answer = adopting.await.expect("task");
        match revived {
            Ok(how) => {
                assert_eq!(
                    a_effects.count(),
                    0,
                    "{how}: a revived holder's key was taken over: {answer:?}"
                );
                let expected = if milestone {
                    "outcome-unknown"
                } else {
                    "in-flight"
                };
                assert_eq!(
                    (answer.status, answer.slug().as_str()),
                    (409, expected),
                    "{how}: {answer:?}"
                );
                assert_eq!(answer.safe_new_key(), Some(false), "{how}: {answer:?}");
            }
            // The store refused the lapsed holder's write: the takeover is the store's answer.
            Err(error) => {
                panic!("a lapsed holder's write was refused ({error}); answer {answer:?}")
            }
        }
    }
}

/// Attacks: two requests of our scheme that both decided to adopt (both held at the gate
/// after their first claim, both about to claim with the record's bytes), let go together, on
/// a released key and on a lapsed lease. Exactly one runs; the other is in flight and then
/// replays it. DESIGN §1 (at most one execution per key).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_two_requests_that_both_adopt_run_once() {
    let store = MemoryStore::new();
    let gate = Gate::new(store.clone());
    let effects = Effects::default();
    let a = serve(tickets(
        layer(gate.clone(), Scheme::Ours),
        &effects,
        slow(StatusCode::CREATED, Duration::from_millis(200)),
    ))
    .await;
    let theirs = flip(&ours(BODY));
    for released in [true, false] {
        let text = unique("both-adopt");
        let key = ScopedKey::new("", &text);
        let lease = Duration::from_millis(100);
        let token = hold(&store, &key, theirs, lease, LeaseExpiry::Reclaim).await;
        if released {
            assert_eq!(
                store.release(&key, token).await.expect("release"),
                RecordStatus::Released
            );
        } else {
            tokio::time::sleep(lease * 4).await;
        }
        gate.arm(&theirs, At::Before);
        gate.arm(&theirs, At::Before);
        let before = effects.count();
        let spawn = || {
            let text = text.clone();
            tokio::spawn(async move { send(a, &text, BODY).await })
        };
        let held = gate.held();
        let (one, two) = (spawn(), spawn());
        gate.arrived(held + 2).await;
        gate.release();
        gate.release();
        let answers = [one.await.expect("task"), two.await.expect("task")];
        assert_eq!(
            effects.count() - before,
            1,
            "released={released}: both adopting requests ran: {answers:#?}"
        );
        assert_eq!(
            answers.iter().filter(|a| a.live()).count(),
            1,
            "{answers:#?}"
        );
        let replay = send(a, &text, BODY).await;
        assert!(replay.replayed(), "{replay:?}");
    }
}

// ---- 4. routes that wait for in-flight keys ---------------------------------------------------

/// Attacks: adoption on a route that waits (`wait_for_in_flight`). Requests of our scheme wait
/// on a key another scheme's replica holds; its holder then (a) releases it (503): exactly one
/// waiter runs it, the other replays that run; (b) completes it: both replay it, nothing runs
/// here; (c) marks its effect started and dies (its renewals fail, its lease runs out): no
/// waiter takes it over, each is told `outcome-unknown`. A same-scheme waiter gets the same.
/// DESIGN §1 step 6 (wait for the first to finish and replay it, or run if it gave the key
/// back), §4.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_s4_waiters_of_our_scheme_follow_the_other_schemes_holder() {
    let store = MemoryStore::new();
    let waiting =
        |store: MemoryStore| layer(store, Scheme::Ours).wait_for_in_flight(Duration::from_secs(8));
    let (a_effects, b_effects) = (Effects::default(), Effects::default());
    let a = serve(tickets(
        waiting(store.clone()),
        &a_effects,
        slow(StatusCode::CREATED, Duration::from_millis(150)),
    ))
    .await;
    // The holder dies in (c): its store fails every renewal, as a dead process renews nothing.
    let dying = FlakyStore::new(store.clone());
    dying.fail_renew.store(true, Ordering::SeqCst);
    let lease = Duration::from_millis(300);
    let holder = |behave: Behave, store: FlakyStore| {
        let b_effects = b_effects.clone();
        async move {
            serve(tickets(
                layer(store, Scheme::Theirs).lease(lease),
                &b_effects,
                behave,
            ))
            .await
        }
    };
    let releases = holder(
        slow(StatusCode::SERVICE_UNAVAILABLE, Duration::from_millis(400)),
        FlakyStore::new(store.clone()),
    )
    .await;
    let completes = holder(
        slow(StatusCode::CREATED, Duration::from_millis(400)),
        FlakyStore::new(store.clone()),
    )
    .await;
    let dies = holder(
        Behave {
            status: StatusCode::CREATED,
            delay: Duration::from_millis(2500),
            started: true,
        },
        dying.clone(),
    )
    .await;
    for (what, addr) in [
        ("releases", releases),
        ("completes", completes),
        ("dies", dies),
    ] {
        let text = unique("waited");
        let (a_before, b_before) = (a_effects.count(), b_effects.count());
        let first = tokio::spawn({
            let text = text.clone();
            async move { send(addr, &text, BODY).await }
        });
        until("the holder runs", || b_effects.count() > b_before).await;
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let text = text.clone();
                tokio::spawn(async move { send(a, &text, BODY).await })
            })
            .collect();
        let mut answers = Vec::new();
        for w in waiters {
            answers.push(w.await.expect("task"));
        }
        let holder_answer = first.await.expect("task");
        let ran = a_effects.count() - a_before;
        match what {
            "releases" => {
                assert_eq!(holder_answer.status, 503);
                assert_eq!(ran, 1, "{what}: one waiter runs it: {answers:#?}");
                assert_eq!(
                    answers.iter().filter(|a| a.live()).count(),
                    1,
                    "{what}: {answers:#?}"
                );
                assert!(
                    answers.iter().all(|a| a.status == 201),
                    "{what}: the other waiter replays the run: {answers:#?}"
                );
            }
            "completes" => {
                assert_eq!(ran, 0, "{what}: {answers:#?}");
                assert!(
                    answers
                        .iter()
                        .all(|a| a.replayed() && a.body == holder_answer.body),
                    "{what}: {answers:#?} vs {holder_answer:?}"
                );
            }
            _ => {
                assert_eq!(
                    ran, 0,
                    "{what}: a waiter took over a started effect: {answers:#?}"
                );
                assert!(
                    answers
                        .iter()
                        .all(|a| a.slug() == "outcome-unknown" && a.safe_new_key() == Some(false)),
                    "{what}: {answers:#?}"
                );
            }
        }
    }
}

// ---- 5. faults and late claims at the adopting claim -------------------------------------------

/// Attacks: the store failing at the adopting (second) claim, and at the first. The request is
/// answered 503 `store-unavailable`, runs nothing, and leaves the record as it was (released,
/// the other scheme's bytes); the next retry adopts it and runs it once. DESIGN §1 step 6
/// (store errors: 503, nothing run, fail closed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_a_store_fault_at_either_claim_fails_closed_and_the_retry_runs_once() {
    let store = MemoryStore::new();
    let flaky = FlakyStore::new(store.clone());
    let effects = Effects::default();
    let a = serve(tickets(layer(flaky.clone(), Scheme::Ours), &effects, OK)).await;
    let theirs = flip(&ours(BODY));
    for nth in [1, 2] {
        let text = unique("fault");
        let key = ScopedKey::new("", &text);
        let token = hold(
            &store,
            &key,
            theirs,
            Duration::from_secs(30),
            LeaseExpiry::Reclaim,
        )
        .await;
        store.release(&key, token).await.expect("release");
        let ops = flaky.log().len();
        flaky.fail_at.store(ops + nth, Ordering::SeqCst);
        let failed = send(a, &text, BODY).await;
        assert_eq!(
            (failed.status, failed.slug().as_str()),
            (503, "store-unavailable"),
            "claim {nth} fails: {failed:?}"
        );
        assert_eq!(effects.count(), nth - 1, "claim {nth}: nothing ran");
        let r = record(&store, &key).await.expect("record");
        assert_eq!(
            (r.status, r.fingerprint),
            (RecordStatus::Released, theirs),
            "claim {nth}"
        );
        let log: Vec<_> = flaky.log()[ops..].to_vec();
        assert_eq!(log, ["claim"; 2][..nth], "claim {nth}: the claims made");
        let retry = send(a, &text, BODY).await;
        assert!(
            retry.live() && retry.status == 201,
            "claim {nth}: {retry:?}"
        );
        let replay = send(a, &text, BODY).await;
        assert!(replay.replayed(), "{replay:?}");
        assert_eq!(effects.count(), nth, "claim {nth}: once");
    }
}

/// Attacks: an adopting claim whose answer comes back late (held at the gate after the store
/// acquired it, past its whole lease). Meanwhile another request of our scheme finds the lapsed
/// lease: on a route that reclaims it takes it over and runs, and the late claim, confirming
/// its lease, finds it lost and runs nothing; on a route that reconciles it sets the key aside
/// (`outcome-unknown`), and the late claim, which ran nothing, gives the set-aside key back and
/// runs it. Either way exactly one run, and every later retry replays it. DESIGN §4 (fencing;
/// a lapsed lease with nothing run is no uncertainty), §1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_late_adopting_claim_is_confirmed_or_given_back_never_run_twice() {
    for expiry in [LeaseExpiry::Reclaim, LeaseExpiry::Reconcile] {
        let store = MemoryStore::new();
        let gate = Gate::new(store.clone());
        let lease = Duration::from_millis(200);
        let effects = Effects::default();
        let handler = slow(StatusCode::CREATED, Duration::from_millis(100));
        let routed = |st| layer(st, Scheme::Ours).lease(lease).on_lease_expiry(expiry);
        let late = serve(tickets(routed(gate.clone()), &effects, handler)).await;
        let other = serve(tickets(routed(Gate::new(store.clone())), &effects, handler)).await;
        let theirs = flip(&ours(BODY));
        let text = unique("late");
        let key = ScopedKey::new("", &text);
        let token = hold(
            &store,
            &key,
            theirs,
            Duration::from_secs(30),
            LeaseExpiry::Reclaim,
        )
        .await;
        store.release(&key, token).await.expect("release");
        gate.arm(&theirs, At::AfterAcquired);
        let held = gate.held();
        let first = tokio::spawn({
            let text = text.clone();
            async move { send(late, &text, BODY).await }
        });
        gate.arrived(held + 1).await;
        tokio::time::sleep(lease * 3).await;
        let second = send(other, &text, BODY).await;
        gate.release();
        let first = first.await.expect("task");
        assert_eq!(
            effects.count(),
            1,
            "{expiry:?}: runs for one key: late {first:?}, other {second:?}"
        );
        match expiry {
            LeaseExpiry::Reclaim => {
                assert!(
                    second.live(),
                    "{expiry:?}: the lapsed lease is taken over: {second:?}"
                );
            }
            _ => {
                assert_eq!(second.slug(), "outcome-unknown", "{expiry:?}: {second:?}");
                assert!(
                    first.live(),
                    "{expiry:?}: the late claim gives back and runs: {first:?}"
                );
            }
        }
        let live = if first.live() { &first } else { &second };
        for addr in [late, other] {
            let replay = send(addr, &text, BODY).await;
            assert!(
                replay.replayed() && replay.body == live.body,
                "{expiry:?}: {replay:?} vs {live:?}"
            );
        }
        assert_eq!(effects.count(), 1, "{expiry:?}: never twice");
    }
}

// ---- 6. after adoption: retries on every scheme, mismatches, hints -----------------------------

/// Attacks: what a key adopted and completed by our replica answers afterwards. The record
/// keeps the other scheme's bytes; the retry of the same request (byte-identical, or the same
/// JSON written another way, which the in-process hint must not mistake) replays on our
/// replica, on the record's scheme and on a third; a request of other input is a 422 that runs
/// nothing, with `safe_new_key: false` wherever the record's scheme is not the replica's own
/// (our replica, the third) and never a replay. DESIGN §1 step 6 (mismatch before anything,
/// replay of the same request), §1 (`safe_new_key` only where the outcome is definite).
async fn adopted_records_answer_every_scheme<St: IdempotencyStore + Clone>(store: St) {
    let (a_effects, b_effects, c_effects, seed) = (
        Effects::default(),
        Effects::default(),
        Effects::default(),
        Effects::default(),
    );
    let a = serve(tickets(layer(store.clone(), Scheme::Ours), &a_effects, OK)).await;
    let b_failing = serve(tickets(layer(store.clone(), Scheme::Theirs), &seed, FAIL)).await;
    let b = serve(tickets(
        layer(store.clone(), Scheme::Theirs),
        &b_effects,
        OK,
    ))
    .await;
    let c = serve(tickets(layer(store.clone(), Scheme::Third), &c_effects, OK)).await;
    let text = unique("adopted");
    let key = ScopedKey::new("", &text);
    assert_eq!(send(b_failing, &text, BODY).await.status, 503);
    let theirs = record(&store, &key).await.expect("released").fingerprint;
    let run = send(a, &text, BODY).await;
    assert!(run.live() && run.status == 201, "adopted and run: {run:?}");
    let r = record(&store, &key).await.expect("completed");
    assert_eq!((r.status, r.fingerprint), (RecordStatus::Completed, theirs));
    let respaced = "{ \"currency\" : \"EUR\", \"amount\" : 10 }";
    for (name, addr) in [("ours", a), ("theirs", b), ("third", c)] {
        for body in [BODY, respaced] {
            let retry = send(addr, &text, body).await;
            assert!(
                retry.replayed() && retry.body == run.body,
                "{name}, body {body}: the same request replays: {retry:?}"
            );
        }
    }
    let other = r#"{"amount":11,"currency":"EUR"}"#;
    for (name, addr, keep) in [("ours", a, true), ("third", c, true), ("theirs", b, false)] {
        let changed = send(addr, &text, other).await;
        assert_eq!(
            (changed.status, changed.slug().as_str()),
            (422, "fingerprint-mismatch"),
            "{name}: {changed:?}"
        );
        if keep {
            assert_eq!(
                changed.safe_new_key(),
                Some(false),
                "{name}: across schemes: {changed:?}"
            );
        }
    }
    assert_eq!(
        (
            a_effects.count(),
            b_effects.count(),
            c_effects.count(),
            seed.count()
        ),
        (1, 0, 0, 1),
        "one run after the release"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_adopted_records_answer_every_scheme_on_memory() {
    adopted_records_answer_every_scheme(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_adopted_records_answer_every_scheme_on_sqlite() {
    let (store, path) = common::sqlite("adoption-after").await;
    adopted_records_answer_every_scheme(store).await;
    let _ = std::fs::remove_file(path);
}

/// Attacks: a claimable record of another scheme whose input differs (a released key, a lapsed
/// lease): never adopted. The retry is a 422 that runs nothing and keeps the key
/// (`safe_new_key: false`), and the record is left exactly as it was (not taken over, not set
/// aside), so its own request's retry still runs there. DESIGN §1 step 6 (mismatch first,
/// nothing run), §4.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_another_schemes_record_of_other_input_is_never_adopted_nor_touched() {
    let store = MemoryStore::new();
    let effects = Effects::default();
    for expiry in [LeaseExpiry::Reclaim, LeaseExpiry::Reconcile] {
        let a = serve(tickets(
            layer(store.clone(), Scheme::Ours).on_lease_expiry(expiry),
            &effects,
            OK,
        ))
        .await;
        let theirs_of_other = flip(&ours(r#"{"amount":99,"currency":"EUR"}"#));
        for released in [true, false] {
            let text = unique("other-input");
            let key = ScopedKey::new("", &text);
            let lease = Duration::from_millis(100);
            let token = hold(&store, &key, theirs_of_other, lease, LeaseExpiry::Reclaim).await;
            if released {
                store.release(&key, token).await.expect("release");
            } else {
                tokio::time::sleep(lease * 4).await;
            }
            let before = record(&store, &key).await.expect("record");
            let retry = send(a, &text, BODY).await;
            assert_eq!(
                (retry.status, retry.slug().as_str(), retry.safe_new_key()),
                (422, "fingerprint-mismatch", Some(false)),
                "{expiry:?} released={released}: {retry:?}"
            );
            let after = record(&store, &key).await.expect("record");
            assert_eq!(
                (
                    after.status,
                    after.lease_token,
                    after.attempts,
                    after.fingerprint
                ),
                (
                    before.status,
                    before.lease_token,
                    before.attempts,
                    before.fingerprint
                ),
                "{expiry:?} released={released}: the record was changed by a request of other input"
            );
            assert_eq!(effects.count(), 0);
        }
    }
}

// ---- 7. JSON-RPC mode ---------------------------------------------------------------------------

/// A tool server at `/mcp`: one effect per call (at entry), its answer naming the call's id.
fn tools<St: IdempotencyStore>(layer: Layer<St>, effects: &Effects) -> Router {
    let effects = effects.clone();
    Router::new()
        .route(
            "/mcp",
            post(move |body: Bytes| {
                let effects = effects.clone();
                async move {
                    let n = effects.hit();
                    let call: serde_json::Value = serde_json::from_slice(&body).expect("a call");
                    let answer = serde_json::json!({
                        "jsonrpc": "2.0", "id": call["id"],
                        "result": {"content": [{"type": "text", "text": format!("run {n}")}]}
                    });
                    (
                        [(axum::http::header::CONTENT_TYPE, "application/json")],
                        answer.to_string(),
                    )
                }
            }),
        )
        .layer(layer)
}

fn tool_call(id: u32, amount: u32) -> String {
    serde_json::json!({
        "jsonrpc": "2.0", "id": id, "method": "tools/call",
        "params": {"name": "charge", "arguments": {"amount": amount}}
    })
    .to_string()
}

/// Attacks: adoption in the JSON-RPC mode (its own fingerprint scheme; a key is filed under the
/// scope plus the call's method). A `tools/call` key released by another crate version (the
/// same digest under other scheme bytes) is run once by its retry and then replayed; one held
/// by a dead holder of another version that marked its effect started is never run (-31003,
/// `safe_new_key: false`); a released key of another version for other params is a mismatch
/// that runs nothing and keeps the key. DESIGN §8 (JSON-RPC answers carry the same facts),
/// §2, §4.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s8_jsonrpc_calls_of_another_version_are_adopted_only_where_they_may_be() {
    let store = MemoryStore::new();
    let effects = Effects::default();
    let a = serve(tools(
        IdempotencyLayer::new(store.clone())
            .jsonrpc(JsonRpc::new())
            .single_tenant(),
        &effects,
    ))
    .await;
    let scope = "\u{0}tools/call";
    // This replica's fingerprint of each call, read from records it completed.
    let mut prints = Vec::new();
    for amount in [5, 6] {
        let seen = unique("rpc-seen");
        let done = send_to(a, "/mcp", &seen, &tool_call(1, amount)).await;
        assert_eq!(done.status, 200, "{done:?}");
        let r = record(&store, &ScopedKey::new(scope, &seen))
            .await
            .expect("the call's record (scope plus method)");
        prints.push(r.fingerprint);
    }
    assert_eq!(effects.count(), 2);

    // Released by another version: run once, then replayed.
    let text = unique("rpc-released");
    let key = ScopedKey::new(scope, &text);
    let token = hold(
        &store,
        &key,
        flip(&prints[0]),
        Duration::from_secs(30),
        LeaseExpiry::Reclaim,
    )
    .await;
    store.release(&key, token).await.expect("release");
    let run = send_to(a, "/mcp", &text, &tool_call(7, 5)).await;
    assert!(
        run.status == 200 && !run.replayed() && run.json["result"].is_object(),
        "run: {run:?}"
    );
    assert_eq!(effects.count(), 3);
    let replay = send_to(a, "/mcp", &text, &tool_call(8, 5)).await;
    assert!(replay.replayed() && replay.json["id"] == 8, "{replay:?}");
    assert_eq!(effects.count(), 3, "never twice");

    // Held by a dead holder of another version that started its effect.
    let text = unique("rpc-started");
    let key = ScopedKey::new(scope, &text);
    let lease = Duration::from_millis(100);
    let token = hold(&store, &key, flip(&prints[0]), lease, LeaseExpiry::Reclaim).await;
    store
        .record_milestone(&key, token, &Milestone::EffectStarted)
        .await
        .expect("milestone");
    tokio::time::sleep(lease * 4).await;
    let unknown = send_to(a, "/mcp", &text, &tool_call(9, 5)).await;
    assert_eq!(
        (
            unknown.json["error"]["code"].as_i64(),
            unknown.safe_new_key()
        ),
        (Some(-31003), Some(false)),
        "{unknown:?}"
    );
    assert_eq!(effects.count(), 3, "nothing run");

    // Released by another version for other params: a mismatch, never adopted.
    let text = unique("rpc-other");
    let key = ScopedKey::new(scope, &text);
    let token = hold(
        &store,
        &key,
        flip(&prints[1]),
        Duration::from_secs(30),
        LeaseExpiry::Reclaim,
    )
    .await;
    store.release(&key, token).await.expect("release");
    let changed = send_to(a, "/mcp", &text, &tool_call(10, 5)).await;
    assert_eq!(
        (
            changed.json["error"]["code"].as_i64(),
            changed.safe_new_key()
        ),
        (Some(-31002), Some(false)),
        "{changed:?}"
    );
    assert_eq!(effects.count(), 3, "nothing run");
    assert_eq!(
        record(&store, &key).await.expect("record").status,
        RecordStatus::Released
    );
}

/// Attacks: adoption through batched SQL stores (`with_batching`), where our request's first
/// claim, its adopting claim and the other scheme's claims of the same key may share one
/// batch statement. The race of `racing_replicas_run_a_released_key_once`: at most one run.
/// DESIGN §1, §5.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_s5_racing_replicas_run_a_released_key_once_on_batched_postgres() {
    let Some(store) = common::postgres("adoption_race_batched").await else {
        return;
    };
    racing_replicas_run_a_released_key_once(
        store.with_batching(tower_idempotency::store::Batching::default()),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_s5_racing_replicas_run_a_released_key_once_on_batched_sqlite() {
    let (store, path) = common::sqlite("adoption-race-batched").await;
    racing_replicas_run_a_released_key_once(
        store.with_batching(tower_idempotency::store::Batching::default()),
    )
    .await;
    let _ = std::fs::remove_file(path);
}

/// Attacks: the give-back of a late adopting claim that cannot be confirmed. The adopting
/// claim is acquired but its answer comes back past half its lease, and the renewal that
/// would confirm it fails: the request answers 503 `store-unavailable` with
/// `safe_new_key: false`, runs nothing, and gives the key back (released, still the other
/// scheme's bytes), so the next retry adopts it again and runs it once. DESIGN §1 step 6
/// (store errors: 503, nothing run), §4 (fencing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_s4_a_late_adopting_claim_that_cannot_be_confirmed_gives_the_key_back() {
    let store = MemoryStore::new();
    let flaky = FlakyStore::new(store.clone());
    let gate = Gate::new(flaky.clone());
    let lease = Duration::from_millis(200);
    let effects = Effects::default();
    let a = serve(tickets(
        layer(gate.clone(), Scheme::Ours).lease(lease),
        &effects,
        OK,
    ))
    .await;
    let theirs = flip(&ours(BODY));
    let text = unique("late-503");
    let key = ScopedKey::new("", &text);
    let token = hold(
        &store,
        &key,
        theirs,
        Duration::from_secs(30),
        LeaseExpiry::Reclaim,
    )
    .await;
    store.release(&key, token).await.expect("release");
    gate.arm(&theirs, At::AfterAcquired);
    let held = gate.held();
    let first = tokio::spawn({
        let text = text.clone();
        async move { send(a, &text, BODY).await }
    });
    gate.arrived(held + 1).await;
    flaky.fail_renew.store(true, Ordering::SeqCst);
    tokio::time::sleep(lease).await;
    gate.release();
    let first = first.await.expect("task");
    assert_eq!(
        (first.status, first.slug().as_str(), first.safe_new_key()),
        (503, "store-unavailable", Some(false)),
        "{first:?}"
    );
    assert_eq!(effects.count(), 0, "nothing ran under an unconfirmed lease");
    flaky.fail_renew.store(false, Ordering::SeqCst);
    let given_back = Arc::new(Mutex::new(None));
    let (s, k, g) = (store.clone(), key.clone(), given_back.clone());
    guard("the give-back", async move {
        loop {
            let r = record(&s, &k).await.expect("record");
            if r.status != RecordStatus::InProgress {
                *g.lock().expect("lock") = Some((r.status, r.fingerprint));
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert_eq!(
        *given_back.lock().expect("lock"),
        Some((RecordStatus::Released, theirs)),
        "given back, its bytes kept"
    );
    let retry = send(a, &text, BODY).await;
    assert!(retry.live() && retry.status == 201, "{retry:?}");
    let replay = send(a, &text, BODY).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(effects.count(), 1, "once");
}

// ---- 8. gRPC-Web --------------------------------------------------------------------------------

fn grpc_frame(flag: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![flag];
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// A gRPC-Web unary method at `/pkg.Svc/Do`: one effect at entry, one message, `grpc-status: 0`
/// in the trailer frame.
fn grpc_web_app<St: IdempotencyStore>(layer: Layer<St>, effects: &Effects) -> Router {
    let effects = effects.clone();
    Router::new()
        .route(
            "/pkg.Svc/Do",
            post(move || {
                let effects = effects.clone();
                async move {
                    let n = effects.hit();
                    let mut body = grpc_frame(0, format!("run {n}").as_bytes());
                    body.extend(grpc_frame(0x80, b"grpc-status:0\r\n"));
                    axum::response::Response::builder()
                        .header("content-type", "application/grpc-web+proto")
                        .body(axum::body::Body::from(body))
                        .expect("response")
                }
            }),
        )
        .layer(layer)
}

/// A gRPC-Web exchange: the status, the headers and the raw body.
async fn grpc_web_call(addr: SocketAddr, key: &str, message: &[u8]) -> (HeaderMap, Vec<u8>) {
    guard("a gRPC-Web call", async {
        let res = client()
            .post(format!("http://{addr}/pkg.Svc/Do"))
            .header("idempotency-key", key)
            .header("content-type", "application/grpc-web+proto")
            .body(grpc_frame(0, message))
            .send()
            .await
            .expect("call");
        let headers = res.headers().clone();
        (headers, res.bytes().await.expect("body").to_vec())
    })
    .await
}

/// A metadata entry of a gRPC-Web answer: from its headers (trailers-only) or its trailer frame.
fn grpc_meta(headers: &HeaderMap, raw: &[u8], name: &str) -> Option<String> {
    if let Some(v) = headers.get(name) {
        return v.to_str().ok().map(str::to_owned);
    }
    let mut rest = raw;
    while rest.len() >= 5 {
        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        let payload = rest.get(5..5 + len)?;
        if rest[0] & 0x80 != 0 {
            let text = String::from_utf8_lossy(payload);
            for line in text.split("\r\n") {
                if let Some((n, v)) = line.split_once(':')
                    && n.trim().eq_ignore_ascii_case(name)
                {
                    return Some(v.trim().to_owned());
                }
            }
        }
        rest = &rest[5 + len..];
    }
    None
}

/// Attacks: adoption in gRPC framing (gRPC-Web, the key in metadata). A key released by another
/// crate version for this very message runs once and is then replayed
/// (`idempotency-replayed: true`); a lapsed holder of another version that marked its effect
/// started is never taken over (a non-OK status, nothing run); another version's released key
/// for another message is refused, nothing run, the record left released. DESIGN §1 step 6
/// (the gRPC column), §4.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_grpc_web_calls_of_another_version_are_adopted_only_where_they_may_be() {
    let store = MemoryStore::new();
    let effects = Effects::default();
    let a = serve(grpc_web_app(layer(store.clone(), Scheme::Ours), &effects)).await;
    let mut prints = Vec::new();
    for message in [b"charge 5".as_slice(), b"charge 6".as_slice()] {
        let seen = unique("grpc-seen");
        let (h, raw) = grpc_web_call(a, &seen, message).await;
        assert_eq!(grpc_meta(&h, &raw, "grpc-status").as_deref(), Some("0"));
        let r = record(&store, &ScopedKey::new("", &seen))
            .await
            .expect("the call's record");
        prints.push(r.fingerprint);
    }
    assert_eq!(effects.count(), 2);

    let text = unique("grpc-released");
    let key = ScopedKey::new("", &text);
    let token = hold(
        &store,
        &key,
        flip(&prints[0]),
        Duration::from_secs(30),
        LeaseExpiry::Reclaim,
    )
    .await;
    store.release(&key, token).await.expect("release");
    let (h, raw) = grpc_web_call(a, &text, b"charge 5").await;
    assert_eq!(
        (
            grpc_meta(&h, &raw, "grpc-status").as_deref(),
            grpc_meta(&h, &raw, "idempotency-replayed")
        ),
        (Some("0"), None),
        "run here: {h:?}"
    );
    assert_eq!(effects.count(), 3);
    let (h, raw) = grpc_web_call(a, &text, b"charge 5").await;
    assert_eq!(
        grpc_meta(&h, &raw, "idempotency-replayed").as_deref(),
        Some("true"),
        "replayed: {h:?}"
    );
    assert_eq!(effects.count(), 3, "never twice");

    let text = unique("grpc-started");
    let key = ScopedKey::new("", &text);
    let lease = Duration::from_millis(100);
    let token = hold(&store, &key, flip(&prints[0]), lease, LeaseExpiry::Reclaim).await;
    store
        .record_milestone(&key, token, &Milestone::EffectStarted)
        .await
        .expect("milestone");
    tokio::time::sleep(lease * 4).await;
    let (h, raw) = grpc_web_call(a, &text, b"charge 5").await;
    let status = grpc_meta(&h, &raw, "grpc-status");
    assert!(
        status.as_deref().is_some_and(|s| s != "0"),
        "a started effect is not run again: {status:?} {h:?}"
    );
    assert_eq!(effects.count(), 3, "nothing run");
    assert_eq!(
        record(&store, &key).await.expect("record").status,
        RecordStatus::NeedsReconciliation
    );

    let text = unique("grpc-other");
    let key = ScopedKey::new("", &text);
    let token = hold(
        &store,
        &key,
        flip(&prints[1]),
        Duration::from_secs(30),
        LeaseExpiry::Reclaim,
    )
    .await;
    store.release(&key, token).await.expect("release");
    let (h, raw) = grpc_web_call(a, &text, b"charge 5").await;
    let status = grpc_meta(&h, &raw, "grpc-status");
    assert!(
        status.as_deref().is_some_and(|s| s == "9" || s == "3"),
        "another message: a mismatch: {status:?} {h:?}"
    );
    assert_eq!(effects.count(), 3, "nothing run");
    assert_eq!(
        record(&store, &key).await.expect("record").status,
        RecordStatus::Released
    );
}

// ---- 9. a record whose bytes change during a wait ------------------------------------------------

/// Attacks: adoption following a record whose bytes change, on a route that waits for in-flight
/// keys (it was once per request when this test was written, and failed). A waiter
/// of our scheme adopts another scheme's released record (its claim now carries the record's
/// bytes), but before its adopting claim lands the record is removed (an operator's
/// `remove`, or its expiry) and a request of our own scheme claims the key afresh, runs, and
/// gives it back (503). The waiter, still claiming with the other scheme's bytes, can no longer
/// take over a released record of its own scheme (the store compares 32 bytes) unless it adopts
/// again; adopting once, it waited out its whole wait and answered 409 "in flight" for a key
/// nobody held, where a waiter that never adopted (the control, same scheme all along) runs it. DESIGN §1
/// step 6 (a waiting route runs when the holder gave the key back), §2 (a released record is
/// claimable again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_s2_a_waiter_that_adopted_still_runs_a_key_its_own_scheme_gave_back() {
    let store = MemoryStore::new();
    let gate = Gate::new(store.clone());
    let (waiter_effects, failing_effects) = (Effects::default(), Effects::default());
    let waiter = serve(tickets(
        layer(gate.clone(), Scheme::Ours).wait_for_in_flight(Duration::from_secs(3)),
        &waiter_effects,
        OK,
    ))
    .await;
    let failing = serve(tickets(
        layer(store.clone(), Scheme::Ours),
        &failing_effects,
        slow(StatusCode::SERVICE_UNAVAILABLE, Duration::from_millis(300)),
    ))
    .await;
    let theirs = flip(&ours(BODY));
    for adopted in [false, true] {
        let text = unique("spent");
        let key = ScopedKey::new("", &text);
        let failing_before = failing_effects.count();
        // Read before anything starts: the waiter may run as soon as the key is given back.
        let before = waiter_effects.count();
        let start_failing = || {
            let text = text.clone();
            tokio::spawn(async move { send(failing, &text, BODY).await })
        };
        let (waiting, failed) = if adopted {
            let token = hold(
                &store,
                &key,
                theirs,
                Duration::from_secs(30),
                LeaseExpiry::Reclaim,
            )
            .await;
            store.release(&key, token).await.expect("release");
            gate.arm(&theirs, At::Before);
            let held = gate.held();
            let waiting = tokio::spawn({
                let text = text.clone();
                async move { send(waiter, &text, BODY).await }
            });
            gate.arrived(held + 1).await;
            assert!(store.remove(&key).await.expect("remove"), "removed");
            let failed = start_failing();
            until("our scheme's run starts", || {
                failing_effects.count() > failing_before
            })
            .await;
            gate.release();
            (waiting, failed)
        } else {
            let failed = start_failing();
            until("our scheme's run starts", || {
                failing_effects.count() > failing_before
            })
            .await;
            let waiting = tokio::spawn({
                let text = text.clone();
                async move { send(waiter, &text, BODY).await }
            });
            (waiting, failed)
        };
        assert_eq!(failed.await.expect("task").status, 503);
        let answer = waiting.await.expect("task");
        let r = record(&store, &key).await.expect("record");
        assert!(
            answer.live() && answer.status == 201 && waiter_effects.count() == before + 1,
            "adopted={adopted}: the waiter did not run the key given back ({} {}, record {:?} \
             with {} bytes): {answer:?}",
            answer.status,
            answer.slug(),
            r.status,
            if r.fingerprint == theirs {
                "the other scheme's"
            } else {
                "our scheme's"
            },
        );
    }
}
