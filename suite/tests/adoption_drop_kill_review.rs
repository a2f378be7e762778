//! Review: a red-team attack on "scheme adoption" (`decide::adopt`, `service::adopting`,
//! `claim_now_adopting`, the adoption loop in `ClaimToEnd::new` and `ClaimToEnd`'s `Drop`).
//! A claim that finds a record of the same input under another fingerprint scheme (released,
//! or in flight under a lease run out) claims again with the record's 32 bytes. Attacked here:
//!
//! 1. a request dropped (its client hangs up) between the claim that found the other scheme's
//!    record and the adopting claim, on the async store path of every store (memory behind a
//!    wrapper that hides `claim_now`, SQLite, PostgreSQL, Redis), on routes that reclaim and
//!    routes that reconcile a lapsed lease;
//! 2. a server process SIGKILLed between the two claims, and just after the adopting claim
//!    landed (separate processes on one SQLite file, and on PostgreSQL), retried on surviving
//!    servers of both schemes, effects counted at a sink file every process appends to;
//! 3. a store that claims at once for the first claim but not for the adopting one (`None`:
//!    the async path from the request's own bytes), or fails it (`Some(Err(..))`);
//! 4. replicas of two schemes other than the record's adopting one key at once (a rendezvous
//!    in the store), records with scheme bytes no layer makes, records of other input (never
//!    adopted, never touched), and a hostile store whose record keeps changing its scheme.
//!
//! Every test counts effects where they happen (an in-process counter, or lines of a sink
//! file across processes); every wait is bounded; nothing measures time.

mod common;

use std::collections::HashMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::StatusCode;
use axum::routing::post;
use common::Effects;
use common::child::Proc;
use tokio::sync::Semaphore;
use tower::ServiceExt;
use tower_idempotency::scope::SingleTenant;
use tower_idempotency::store::{
    Claim, ClaimRequest, FencingToken, Record, RecordStatus, ScopedKey, SqliteStore, StoreError,
};
use tower_idempotency::{
    Fingerprint, IdempotencyContext, IdempotencyLayer, IdempotencyStore, LeaseExpiry,
    MalformedBody, MemoryStore,
};

const CHILD: &str = "ADOPTION_DROP_KILL_CHILD";
const BODY: &str = r#"{"amount":10,"currency":"EUR"}"#;
const OTHER: &str = r#"{"amount":99,"currency":"EUR"}"#;
const RECLAIM: &str = "/reclaim";
const RECONCILE: &str = "/reconcile";

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn unique(name: &str) -> String {
    common::raw::unique(name)
}

fn path_of(expiry: LeaseExpiry) -> &'static str {
    match expiry {
        LeaseExpiry::Reconcile => RECONCILE,
        _ => RECLAIM,
    }
}

/// `f` within `secs` seconds, or the test fails naming `what` (a hang).
async fn bounded<F: std::future::Future>(what: &str, secs: u64, f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .unwrap_or_else(|_| panic!("{what} hung for {secs} s"))
}

/// Polls `done` every 5 ms for up to `secs` seconds; whether it came to hold.
async fn eventually(secs: u64, mut done: impl AsyncFnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if done().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(ms(5)).await;
    }
}

// ---- replicas of three fingerprint schemes ------------------------------------------------------

/// Which fingerprint settings a replica runs with. `Ours` counts nothing of its own; `Theirs`
/// and `Third` register a canonicaliser for a media type these requests never have: the same
/// input, named by another scheme (a replica of another version or configuration).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Scheme {
    Ours,
    Theirs,
    Third,
}

fn raw(body: &[u8]) -> Result<Vec<u8>, MalformedBody> {
    Ok(body.to_vec())
}

fn layer<St: IdempotencyStore>(
    store: St,
    scheme: Scheme,
    expiry: LeaseExpiry,
    lease: Duration,
) -> IdempotencyLayer<St, SingleTenant> {
    let layer = IdempotencyLayer::new(store).single_tenant();
    let layer = match scheme {
        Scheme::Ours => layer,
        Scheme::Theirs => layer.canonicalize("application/x-never-sent", raw),
        Scheme::Third => layer.canonicalize("application/x-also-never-sent", raw),
    };
    layer.lease(lease).on_lease_expiry(expiry)
}

/// Where a handler makes its effect: a counter in this process, or a line `key|pid` appended
/// to a file every process shares.
#[derive(Clone)]
enum Sink {
    Count(Effects),
    File(PathBuf),
}

impl Sink {
    fn hit(&self, key: &str) -> usize {
        match self {
            Sink::Count(effects) => effects.hit(),
            Sink::File(path) => {
                let mut file = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .expect("sink");
                file.write_all(format!("{key}|{}\n", std::process::id()).as_bytes())
                    .expect("write the effect");
                0
            }
        }
    }
}

/// Each key's effects at a sink file: the ids of the processes that made them.
fn effects_at(sink: &Path) -> HashMap<String, Vec<String>> {
    let mut made: HashMap<String, Vec<String>> = HashMap::new();
    for line in std::fs::read_to_string(sink).unwrap_or_default().lines() {
        let (key, pid) = line.rsplit_once('|').unwrap_or((line, "?"));
        made.entry(key.to_owned()).or_default().push(pid.to_owned());
    }
    made
}

/// A replica: `POST /reclaim` (a route that takes a lapsed lease over) and `POST /reconcile`
/// (one that sets it aside), each making its effect at `sink` at entry and answering 201.
fn app<St: IdempotencyStore + Clone>(
    store: St,
    scheme: Scheme,
    lease: Duration,
    sink: Sink,
) -> Router {
    let mut router = Router::new();
    for expiry in [LeaseExpiry::Reclaim, LeaseExpiry::Reconcile] {
        let sink = sink.clone();
        let handler = post(move |ctx: IdempotencyContext, body: String| {
            let sink = sink.clone();
            async move {
                let n = sink.hit(ctx.key());
                (
                    StatusCode::CREATED,
                    format!(
                        "run {n} of {} by {} attempt {} for {body}",
                        ctx.key(),
                        std::process::id(),
                        ctx.attempt()
                    ),
                )
            }
        })
        .layer(layer(store.clone(), scheme, expiry, lease));
        router = router.route(path_of(expiry), handler);
    }
    router
}

/// The fingerprint a replica of `scheme` makes of `POST path` with `body` (read from the
/// record of a request it ran in process).
async fn fingerprint_of(scheme: Scheme, path: &str, body: &str) -> Fingerprint {
    let store = MemoryStore::new();
    let router = app(
        store.clone(),
        scheme,
        Duration::from_secs(30),
        Sink::Count(Effects::default()),
    );
    let req = axum::http::Request::post(path)
        .header("idempotency-key", "probe")
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .expect("request");
    let res = router.oneshot(req).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::CREATED, "the probe runs");
    store
        .lookup(&ScopedKey::new("", "probe"))
        .await
        .expect("lookup")
        .expect("the probe's record")
        .fingerprint
}

/// The fingerprints of every scheme for one body, per path.
struct Prints {
    of: HashMap<(Scheme, &'static str), Fingerprint>,
}

impl Prints {
    async fn new(body: &str) -> Self {
        let mut of = HashMap::new();
        for scheme in [Scheme::Ours, Scheme::Theirs, Scheme::Third] {
            for path in [RECLAIM, RECONCILE] {
                of.insert((scheme, path), fingerprint_of(scheme, path, body).await);
            }
        }
        let prints = Self { of };
        // Preconditions: three schemes, one input.
        let ours = prints.get(Scheme::Ours, RECLAIM);
        for other in [Scheme::Theirs, Scheme::Third] {
            let theirs = prints.get(other, RECLAIM);
            assert_ne!(ours.as_bytes()[..4], theirs.as_bytes()[..4], "{other:?}");
            assert_eq!(ours.as_bytes()[4..], theirs.as_bytes()[4..], "{other:?}");
        }
        prints
    }

    fn get(&self, scheme: Scheme, path: &str) -> Fingerprint {
        *self
            .of
            .iter()
            .find(|((s, p), _)| *s == scheme && *p == path)
            .expect("a print")
            .1
    }

    fn own_scheme(&self) -> [u8; 4] {
        let b = self.get(Scheme::Ours, RECLAIM);
        let b = b.as_bytes();
        [b[0], b[1], b[2], b[3]]
    }
}

// ---- the client -----------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct Answer {
    status: u16,
    replayed: bool,
    retry_after: Option<String>,
    content_type: String,
    body: String,
    json: serde_json::Value,
}

impl Answer {
    fn slug(&self) -> String {
        let t = self.json["type"].as_str().unwrap_or_default();
        t.rsplit(':').next().unwrap_or_default().to_owned()
    }
    fn safe_new_key(&self) -> Option<bool> {
        self.json["safe_new_key"].as_bool()
    }
    fn live(&self) -> bool {
        self.status == 201 && !self.replayed
    }
    fn in_flight(&self) -> bool {
        self.status == 409 && self.slug() == "in-flight"
    }
    fn unknown(&self) -> bool {
        self.status == 409 && self.slug() == "outcome-unknown" && self.safe_new_key() == Some(false)
    }
}

/// One exchange, or `None` if the connection died (a server killed meanwhile).
async fn try_send(addr: SocketAddr, path: &str, key: &str, body: &str) -> Option<Answer> {
    let res = common::client()
        .post(format!("http://{addr}{path}"))
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
    let retry_after = res
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let content_type = res
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let bytes = res.bytes().await.ok()?;
    Some(Answer {
        status,
        replayed,
        retry_after,
        content_type,
        body: String::from_utf8_lossy(&bytes).into_owned(),
        json: serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    })
}

async fn send(addr: SocketAddr, path: &str, key: &str, body: &str) -> Answer {
    bounded("an exchange", 40, try_send(addr, path, key, body))
        .await
        .expect("an answer")
}

/// Asks as a client honouring 409 "in flight" does, for up to 15 s; every answer.
async fn settle(addr: SocketAddr, path: &str, key: &str, body: &str) -> Vec<Answer> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let mut answers = Vec::new();
    loop {
        let a = send(addr, path, key, body).await;
        let again = a.in_flight() && tokio::time::Instant::now() < deadline;
        answers.push(a);
        if !again {
            return answers;
        }
        tokio::time::sleep(ms(100)).await;
    }
}

// ---- records ----------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Seed {
    /// A holder of another scheme released the key (its handler failed retryably).
    Released,
    /// A holder of another scheme died holding it: its lease ran out (its route reclaims).
    Lapsed,
}

/// A record of `key` made by another replica with `fp`, as `seed` says; its token.
async fn seed<St: IdempotencyStore>(
    store: &St,
    key: &str,
    fp: Fingerprint,
    seed: Seed,
) -> FencingToken {
    let lease = match seed {
        Seed::Released => Duration::from_secs(30),
        Seed::Lapsed => ms(150),
    };
    let request = ClaimRequest {
        key: ScopedKey::new("", key),
        fingerprint: fp,
        lease,
        ttl: Duration::from_secs(600),
        on_lease_expiry: LeaseExpiry::Reclaim,
    };
    let token = match store.claim(&request).await.expect("the seed's claim") {
        Claim::Acquired(lease) => lease.token,
        other => panic!("the seed's claim: {other:?}"),
    };
    if seed == Seed::Released {
        store
            .release(&request.key, token)
            .await
            .expect("the seed's release");
    }
    token
}

/// Long enough for a lapsed seed's lease (150 ms) to run out on any store's clock.
async fn lapse() {
    tokio::time::sleep(ms(450)).await;
}

async fn record<St: IdempotencyStore>(store: &St, key: &str) -> Option<Record> {
    store
        .lookup(&ScopedKey::new("", key))
        .await
        .expect("lookup")
}

/// What a claim may change of a record.
type Snapshot = (RecordStatus, FencingToken, u32, [u8; 32]);

async fn snapshot<St: IdempotencyStore>(store: &St, key: &str) -> Snapshot {
    let r = record(store, key).await.expect("a record");
    (
        r.status,
        r.lease_token,
        r.attempts,
        *r.fingerprint.as_bytes(),
    )
}

fn is_adopting(fp: &Fingerprint, own: [u8; 4]) -> bool {
    fp.as_bytes()[..4] != own
}

// ---- a store that holds one key's claims at a gate --------------------------------------------

/// Where a gated claim of a key waits.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum At {
    /// The first claim (the request's own bytes) came back from the store; its answer waits.
    FirstAnswered,
    /// The adopting claim (another scheme's bytes), before it reaches the store.
    BeforeAdopting,
    /// The adopting claim landed in the store (whatever it did); its answer waits.
    AdoptingLanded,
}

/// Wraps a store; the armed claim of a key stops at the gate until the test lets it go. Every
/// claim is logged. It does not offer `claim_now`: every claim is a round trip a hang-up can
/// drop.
struct Gate<S> {
    inner: S,
    own: [u8; 4],
    armed: Mutex<HashMap<String, At>>,
    held: AtomicUsize,
    go: Semaphore,
    claims: Mutex<Vec<(String, [u8; 32])>>,
    /// While set, every `release` fails (the store unreachable for it).
    release_fails: AtomicBool,
    releases: AtomicUsize,
}

impl<S> Gate<S> {
    fn new(inner: S, own: [u8; 4]) -> Arc<Self> {
        Arc::new(Self {
            inner,
            own,
            armed: Mutex::default(),
            held: AtomicUsize::new(0),
            go: Semaphore::new(0),
            claims: Mutex::default(),
            release_fails: AtomicBool::new(false),
            releases: AtomicUsize::new(0),
        })
    }
    fn arm(&self, key: &str, at: At) {
        self.armed.lock().expect("lock").insert(key.to_owned(), at);
    }
    fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }
    fn open(&self) {
        self.go.add_permits(1);
    }
    fn claims_of(&self, key: &str) -> Vec<[u8; 32]> {
        let claims = self.claims.lock().expect("lock");
        claims
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, fp)| *fp)
            .collect()
    }
}

impl<S: IdempotencyStore> IdempotencyStore for Gate<S> {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        let key = request.key.key().to_owned();
        let adopting = is_adopting(&request.fingerprint, self.own);
        self.claims
            .lock()
            .expect("lock")
            .push((key.clone(), *request.fingerprint.as_bytes()));
        let at = {
            let mut armed = self.armed.lock().expect("lock");
            match armed.get(&key).copied() {
                Some(At::FirstAnswered) if !adopting => armed.remove(&key),
                Some(At::BeforeAdopting | At::AdoptingLanded) if adopting => armed.remove(&key),
                _ => None,
            }
        };
        if at == Some(At::BeforeAdopting) {
            self.held.fetch_add(1, Ordering::SeqCst);
            self.go.acquire().await.expect("gate").forget();
        }
        let claimed = self.inner.claim(request).await;
        if matches!(at, Some(At::FirstAnswered | At::AdoptingLanded)) {
            self.held.fetch_add(1, Ordering::SeqCst);
            self.go.acquire().await.expect("gate").forget();
        }
        claimed
    }

    async fn release(
        &self,
        key: &ScopedKey,
        token: FencingToken,
    ) -> Result<RecordStatus, StoreError> {
        self.releases.fetch_add(1, Ordering::SeqCst);
        if self.release_fails.load(Ordering::SeqCst) {
            return Err(StoreError::unavailable(std::io::Error::other(
                "release: injected",
            )));
        }
        self.inner.release(key, token).await
    }

    crate::common::forward::forward_store!(inner: renew, complete, mark_uncertain, lookup, remove, purge_expired, record_milestone, list_uncertain, count_uncertain, resolve, append_history, wait_for_change);
}

/// Counts the requests whose response future the server dropped before it finished (a client
/// that hung up), outside the idempotency layer.
#[derive(Default)]
struct Watch {
    dropped: AtomicUsize,
}

struct Unfinished(Arc<Watch>, bool);

impl Drop for Unfinished {
    fn drop(&mut self) {
        if !self.1 {
            self.0.dropped.fetch_add(1, Ordering::SeqCst);
        }
    }
}

fn watched(router: Router, watch: Arc<Watch>) -> Router {
    router.layer(axum::middleware::from_fn(
        move |req: axum::extract::Request, next: axum::middleware::Next| {
            let watch = watch.clone();
            async move {
                let mut unfinished = Unfinished(watch, false);
                let res = next.run(req).await;
                unfinished.1 = true;
                res
            }
        },
    ))
}

// ---- 1. a request dropped between the two claims --------------------------------------------

/// A test of `$scenario` (an async fn taking the store, then `$arg`s) on one store, the
/// child-mode guard first (the kill tests run this binary again as their children): `memory`,
/// or `sqlite`/`postgres`/`redis` with the tag of the file, table or prefix it makes.
macro_rules! on_store {
    ($name:ident, memory, $scenario:ident $(, $arg:expr)*) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            if let Some(mode) = child_mode() {
                return child_main(mode).await;
            }
            $scenario(MemoryStore::new() $(, $arg)*).await;
        }
    };
    ($name:ident, sqlite($tag:literal), $scenario:ident $(, $arg:expr)*) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            if let Some(mode) = child_mode() {
                return child_main(mode).await;
            }
            let (store, path) = common::sqlite($tag).await;
            $scenario(store $(, $arg)*).await;
            let _ = std::fs::remove_file(path);
        }
    };
    ($name:ident, $server:ident($tag:literal), $scenario:ident $(, $arg:expr)*) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            if let Some(mode) = child_mode() {
                return child_main(mode).await;
            }
            let Some(store) = common::$server($tag).await else {
                return;
            };
            $scenario(store $(, $arg)*).await;
        }
    };
}

/// DESIGN §1 step 7 (a hang-up never leaves a half-done claim behind), §2 (a released record is
/// claimable again), §4 (a lapsed lease is taken over where the route reclaims, set aside where
/// it reconciles; nothing is left in progress for a request that ran nothing): a request whose
/// claim found another scheme's claimable record of its input is dropped by its client while
/// (a) the first claim's answer is on its way back, (b) the adopting claim is on its way to the
/// store, (c) the adopting claim landed and its answer is on its way back. The claim is seen to
/// its end on a task: a key it won is given back (released, attempts + 1, the record's own
/// bytes kept); a lapsed lease on a route that reconciles is set aside (`outcome-unknown`, the
/// dead holder may have run). Nothing runs meanwhile; a retry of the same body runs exactly
/// once where the key was given back and is replayed on both schemes; no key stays in flight.
async fn dropped_between_the_claims<St: IdempotencyStore + Clone>(store: St) {
    let prints = Prints::new(BODY).await;
    let gate = Gate::new(store.clone(), prints.own_scheme());
    let effects = Effects::default();
    let watch = Arc::new(Watch::default());
    let lease = Duration::from_secs(5);
    let a = common::serve(watched(
        app(
            gate.clone(),
            Scheme::Ours,
            lease,
            Sink::Count(effects.clone()),
        ),
        watch.clone(),
    ))
    .await;
    let b = common::serve(app(
        store.clone(),
        Scheme::Theirs,
        lease,
        Sink::Count(effects.clone()),
    ))
    .await;
    let mut faults = Vec::new();
    for seeded in [Seed::Released, Seed::Lapsed] {
        for expiry in [LeaseExpiry::Reclaim, LeaseExpiry::Reconcile] {
            for at in [At::FirstAnswered, At::BeforeAdopting, At::AdoptingLanded] {
                let case = format!("{seeded:?} on {expiry:?}, dropped at {at:?}");
                let path = path_of(expiry);
                let theirs = prints.get(Scheme::Theirs, path);
                let ours = prints.get(Scheme::Ours, path);
                let text = unique("dropped");
                let seed_token = seed(&store, &text, theirs, seeded).await;
                if seeded == Seed::Lapsed {
                    lapse().await;
                }
                let before = snapshot(&store, &text).await;
                let ran_before = effects.count();
                gate.arm(&text, at);
                let (held, dropped) = (gate.held(), watch.dropped.load(Ordering::SeqCst));
                let request = tokio::spawn({
                    let text = text.clone();
                    async move { try_send(a, path, &text, BODY).await }
                });
                let reached = eventually(20, async || gate.held() > held).await;
                assert!(reached, "{case}: the claim never reached the gate");
                request.abort();
                let _ = request.await;
                let hung_up =
                    eventually(20, async || watch.dropped.load(Ordering::SeqCst) > dropped).await;
                assert!(
                    hung_up,
                    "{case}: the server never dropped the request whose client hung up"
                );
                gate.open();
                // Seen to its end on a task of its own: given back, or set aside.
                let want = match (seeded, expiry) {
                    (Seed::Lapsed, LeaseExpiry::Reconcile) => RecordStatus::NeedsReconciliation,
                    _ => RecordStatus::Released,
                };
                let settled = eventually(10, async || {
                    // A released seed is released already: the adopting claim's give-back is
                    // a new token on it.
                    record(&store, &text).await.is_some_and(|r| {
                        r.status == want
                            && (want != RecordStatus::Released || r.lease_token != before.1)
                    })
                })
                .await;
                let r = record(&store, &text).await.expect("the record");
                if !settled {
                    faults.push(format!(
                        "{case}: the dropped claim left the key {:?} (token {:?}, seed's {:?}, \
                         attempts {}), expected {want:?}",
                        r.status, r.lease_token, seed_token, r.attempts
                    ));
                    continue;
                }
                if effects.count() != ran_before {
                    faults.push(format!("{case}: a dropped request ran"));
                }
                let claims = gate.claims_of(&text);
                if claims != [*ours.as_bytes(), *theirs.as_bytes()] {
                    faults.push(format!(
                        "{case}: the claims made were {} (own bytes then the record's expected)",
                        claims.len()
                    ));
                }
                if r.fingerprint != theirs {
                    faults.push(format!("{case}: the record lost its bytes"));
                }
                if want == RecordStatus::Released {
                    if r.attempts != before.2 + 1 || r.lease_token == before.1 {
                        faults.push(format!(
                            "{case}: the adopting claim did not land (attempts {} -> {})",
                            before.2, r.attempts
                        ));
                    }
                    let retry = send(a, path, &text, BODY).await;
                    if !retry.live() {
                        faults.push(format!("{case}: the retry did not run: {retry:?}"));
                        continue;
                    }
                    for addr in [a, b] {
                        let again = send(addr, path, &text, BODY).await;
                        if !(again.replayed && again.body == retry.body) {
                            faults.push(format!("{case}: not replayed: {again:?}"));
                        }
                    }
                    if effects.count() != ran_before + 1 {
                        faults.push(format!(
                            "{case}: {} runs after the retry, expected exactly 1",
                            effects.count() - ran_before
                        ));
                    }
                } else {
                    for addr in [a, b] {
                        let retry = send(addr, path, &text, BODY).await;
                        if !retry.unknown() {
                            faults.push(format!("{case}: not outcome-unknown: {retry:?}"));
                        }
                    }
                    if effects.count() != ran_before {
                        faults.push(format!("{case}: a set-aside key ran"));
                    }
                }
            }
        }
    }
    assert!(
        faults.is_empty(),
        "{} faults:\n{}",
        faults.len(),
        faults.join("\n")
    );
}

on_store!(
    s1_s4_dropped_between_the_claims_on_memory_async_path,
    memory,
    dropped_between_the_claims
);
on_store!(
    s1_s4_dropped_between_the_claims_on_sqlite,
    sqlite("adk-drop"),
    dropped_between_the_claims
);
on_store!(
    s1_s4_dropped_between_the_claims_on_postgres,
    postgres("adk_drop"),
    dropped_between_the_claims
);
on_store!(
    s1_s4_dropped_between_the_claims_on_redis,
    redis("adk-drop"),
    dropped_between_the_claims
);

/// DESIGN §4 (a key nothing ran under is given back, never left set aside for ever; a
/// resolution as not applied lets the next attempt run), §1 step 7: on a route that reconciles,
/// a request is dropped while its adopting claim is on its way; the claim lands (the released
/// key acquired, lease 600 ms) and its give-back fails past the whole lease. A retry of our
/// scheme meanwhile finds the lapsed lease and sets the key aside (`outcome-unknown`, nothing
/// run). Once the store takes releases again, the dropped claim's give-back settles the key as
/// not applied (it ran nothing), and the next retry runs exactly once and is replayed on both
/// schemes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_dropped_adopting_claim_whose_give_back_fails_past_its_lease_is_given_back() {
    if let Some(mode) = child_mode() {
        return child_main(mode).await;
    }
    let store = MemoryStore::new();
    let prints = Prints::new(BODY).await;
    let gate = Gate::new(store.clone(), prints.own_scheme());
    let effects = Effects::default();
    let watch = Arc::new(Watch::default());
    let a = common::serve(watched(
        app(
            gate.clone(),
            Scheme::Ours,
            ms(600),
            Sink::Count(effects.clone()),
        ),
        watch.clone(),
    ))
    .await;
    let b = common::serve(app(
        store.clone(),
        Scheme::Theirs,
        ms(600),
        Sink::Count(effects.clone()),
    ))
    .await;
    let theirs = prints.get(Scheme::Theirs, RECONCILE);
    let text = unique("give-back-fails");
    seed(&store, &text, theirs, Seed::Released).await;
    let before = snapshot(&store, &text).await;
    gate.arm(&text, At::BeforeAdopting);
    gate.release_fails.store(true, Ordering::SeqCst);
    let request = tokio::spawn({
        let text = text.clone();
        async move { try_send(a, RECONCILE, &text, BODY).await }
    });
    assert!(
        eventually(20, async || gate.held() > 0).await,
        "never gated"
    );
    request.abort();
    let _ = request.await;
    assert!(
        eventually(20, async || watch.dropped.load(Ordering::SeqCst) > 0).await,
        "the server never dropped the request"
    );
    gate.open();
    // The adopting claim lands; its give-back fails.
    let acquired = eventually(10, async || {
        record(&store, &text)
            .await
            .is_some_and(|r| r.status == RecordStatus::InProgress && r.lease_token != before.1)
    })
    .await;
    assert!(acquired, "the dropped adopting claim never landed");
    assert!(
        eventually(10, async || gate.releases.load(Ordering::SeqCst) > 0).await,
        "no give-back was tried"
    );
    // Past the lease: the retry sets the key aside, nothing runs.
    tokio::time::sleep(ms(900)).await;
    let told = send(a, RECONCILE, &text, BODY).await;
    assert!(
        told.unknown(),
        "a lapsed lease on a reconciling route: {told:?}"
    );
    assert_eq!(effects.count(), 0, "nothing ran");
    gate.release_fails.store(false, Ordering::SeqCst);
    let given_back = eventually(15, async || {
        record(&store, &text)
            .await
            .is_some_and(|r| r.status == RecordStatus::Released)
    })
    .await;
    let r = record(&store, &text).await.expect("a record");
    assert!(
        given_back,
        "the key a dropped claim won and never ran under stays {:?} (attempts {}): a retry is \
         told outcome-unknown for ever",
        r.status, r.attempts
    );
    let run = send(a, RECONCILE, &text, BODY).await;
    assert!(run.live(), "{run:?}");
    for addr in [a, b] {
        let again = send(addr, RECONCILE, &text, BODY).await;
        assert!(again.replayed && again.body == run.body, "{again:?}");
    }
    assert_eq!(effects.count(), 1, "exactly once");
}

// ---- 2. a process SIGKILLed between the two claims --------------------------------------------

/// The victim's store: claims with its own scheme's bytes pass; the adopting claim (another
/// scheme's bytes) prints `ADOPT-POINT <key> before` and parks, or (`after`) lands, prints
/// `ADOPT-POINT <key> after <what it did>` and parks. The parent SIGKILLs it there.
struct Victim<S> {
    inner: S,
    own: [u8; 4],
    after: bool,
}

fn say(line: &str) {
    let mut out = std::io::stdout();
    let _ = out.write_all(format!("{line}\n").as_bytes());
    let _ = out.flush();
}

impl<S: IdempotencyStore> IdempotencyStore for Victim<S> {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        if !is_adopting(&request.fingerprint, self.own) {
            return self.inner.claim(request).await;
        }
        let key = request.key.key().to_owned();
        if !self.after {
            say(&format!("ADOPT-POINT {key} before"));
            tokio::time::sleep(Duration::from_secs(120)).await;
        }
        let claimed = self.inner.claim(request).await;
        let what = match &claimed {
            Ok(Claim::Acquired(_)) => "acquired".to_owned(),
            Ok(Claim::Existing { record, .. }) => format!("{:?}", record.status),
            Ok(Claim::Completed { .. }) => "completed".to_owned(),
            Err(e) => format!("error {e}"),
        };
        say(&format!("ADOPT-POINT {key} after {what}"));
        tokio::time::sleep(Duration::from_secs(120)).await;
        claimed
    }

    crate::common::forward::forward_store!(inner: renew, complete, release, mark_uncertain, lookup, remove, purge_expired, record_milestone, list_uncertain, count_uncertain, resolve, append_history, wait_for_change);
}

fn child_mode() -> Option<String> {
    std::env::var(CHILD).ok()
}

/// The child: a server of our scheme on the store `AK_STORE` names, its adopting claims
/// parked as `AK_KILL` says, effects at `AK_SINK`.
async fn child_main(_mode: String) {
    let own = Prints::new(BODY).await.own_scheme();
    let after = std::env::var("AK_KILL").is_ok_and(|v| v == "after");
    let lease = ms(std::env::var("AK_LEASE_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(600));
    let sink = PathBuf::from(std::env::var("AK_SINK").expect("AK_SINK"));
    let at = std::env::var("AK_AT").expect("AK_AT");
    match std::env::var("AK_STORE").expect("AK_STORE").as_str() {
        "sqlite" => {
            let store = SqliteStore::connect(&at).await.expect("connect");
            victim_serves(
                Victim {
                    inner: store,
                    own,
                    after,
                },
                lease,
                sink,
            )
            .await;
        }
        _ => {
            let store = common::postgres(&at).await.expect("postgres");
            victim_serves(
                Victim {
                    inner: store,
                    own,
                    after,
                },
                lease,
                sink,
            )
            .await;
        }
    }
}

async fn victim_serves<S: IdempotencyStore>(victim: Victim<S>, lease: Duration, sink: PathBuf) {
    let router = app(Arc::new(victim), Scheme::Ours, lease, Sink::File(sink));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    say(&format!(
        "LISTENING {}",
        listener.local_addr().expect("addr")
    ));
    axum::serve(listener, router).await.expect("serve");
}

struct KillCase {
    key: String,
    seed: Seed,
    expiry: LeaseExpiry,
    seed_token: FencingToken,
    survivor: Scheme,
}

/// Whether a key whose victim was killed `after` its adopting claim landed (or before it was
/// sent) runs once on a retry after the lease, per DESIGN §4: a route that reclaims takes a
/// lapsed lease over (nothing started); on a route that reconciles, a lease run out is set
/// aside (the store cannot tell that its dead holder ran nothing), and a released record
/// (the adopting claim never landed) is claimed as usual.
fn runs_on_retry(after: bool, seed: Seed, expiry: LeaseExpiry) -> bool {
    match expiry {
        LeaseExpiry::Reconcile => !after && seed == Seed::Released,
        _ => true,
    }
}

/// DESIGN §1 (one operation key, at most one execution), §2, §4 (lapsed leases: takeover only
/// where routes reclaim and nothing started; otherwise `needs_reconciliation`), §7 (a crash
/// after the claim is never a second run): a server process of our scheme is SIGKILLed while
/// its adopting claim is (a) not yet sent, (b) landed (the key acquired or set aside), never
/// with its handler started. Eight keys per kill: a released or lapsed record of the other
/// scheme, on a route that reclaims or reconciles, retried on a surviving server of our scheme
/// or the record's. After the kill the record is exactly as the victim left it; after the
/// lease, each key runs exactly once (counted at the sink file, never by the victim) and is
/// replayed on the other survivor, or (a lapsed lease on a route that reconciles, or a landed
/// claim there) is answered `outcome-unknown` on both schemes and never runs.
async fn killed_between_the_claims<St: IdempotencyStore + Clone>(
    test: &str,
    store: St,
    env: Vec<(&'static str, String)>,
    sink: &Path,
) {
    let prints = Prints::new(BODY).await;
    let survivors: HashMap<&str, SocketAddr> = HashMap::from([
        (
            "Ours",
            common::serve(app(
                store.clone(),
                Scheme::Ours,
                Duration::from_secs(30),
                Sink::File(sink.to_path_buf()),
            ))
            .await,
        ),
        (
            "Theirs",
            common::serve(app(
                store.clone(),
                Scheme::Theirs,
                Duration::from_secs(30),
                Sink::File(sink.to_path_buf()),
            ))
            .await,
        ),
    ]);
    let name = |s: Scheme| if s == Scheme::Ours { "Ours" } else { "Theirs" };
    let victim_lease = ms(600);
    let mut faults = Vec::new();
    for after in [false, true] {
        let kill = if after { "after" } else { "before" };
        let mut env = env.clone();
        env.push(("AK_KILL", kill.to_owned()));
        env.push(("AK_SINK", sink.display().to_string()));
        env.push(("AK_LEASE_MS", victim_lease.as_millis().to_string()));
        let victim = Proc::spawn(test, CHILD, "serve", &env, &[]).listening();
        let (vaddr, vpid) = (victim.addr(), victim.pid().to_string());
        let mut cases = Vec::new();
        for seeded in [Seed::Released, Seed::Lapsed] {
            for expiry in [LeaseExpiry::Reclaim, LeaseExpiry::Reconcile] {
                for survivor in [Scheme::Ours, Scheme::Theirs] {
                    let key = unique(&format!("kill-{kill}"));
                    let theirs = prints.get(Scheme::Theirs, path_of(expiry));
                    let seed_token = seed(&store, &key, theirs, seeded).await;
                    cases.push(KillCase {
                        key,
                        seed: seeded,
                        expiry,
                        seed_token,
                        survivor,
                    });
                }
            }
        }
        lapse().await;
        let mut seeded = HashMap::new();
        for c in &cases {
            seeded.insert(c.key.clone(), snapshot(&store, &c.key).await);
        }
        let requests: Vec<_> = cases
            .iter()
            .map(|c| {
                let (key, path) = (c.key.clone(), path_of(c.expiry));
                tokio::spawn(async move { try_send(vaddr, path, &key, BODY).await })
            })
            .collect();
        let mut parked: HashMap<String, String> = HashMap::new();
        while parked.len() < cases.len() {
            let line = victim
                .wait_for("ADOPT-POINT ")
                .unwrap_or_else(|| panic!("{kill}: the victim never parked: {parked:?}"));
            let mut words = line.split_whitespace().skip(1);
            let key = words.next().unwrap_or_default().to_owned();
            parked.insert(key, words.collect::<Vec<_>>().join(" "));
        }
        drop(victim); // SIGKILL, every key parked
        for r in requests {
            if let Some(answer) = bounded("a request to the killed victim", 40, r)
                .await
                .expect("task")
            {
                faults.push(format!(
                    "{kill}: the victim answered before it died: {answer:?}"
                ));
            }
        }
        // The records as the killed victim left them.
        for c in &cases {
            let case = format!("{kill}: {:?} on {:?}", c.seed, c.expiry);
            let theirs = prints.get(Scheme::Theirs, path_of(c.expiry));
            let r = record(&store, &c.key).await.expect("a record");
            let now = (
                r.status,
                r.lease_token,
                r.attempts,
                *r.fingerprint.as_bytes(),
            );
            let said = parked.get(&c.key).cloned().unwrap_or_default();
            if !after {
                if now != seeded[&c.key] || said != "before" {
                    faults.push(format!(
                        "{case}: the record moved though the adopting claim was never sent \
                         ({said}): {now:?} vs {:?}",
                        seeded[&c.key]
                    ));
                }
                continue;
            }
            let set_aside = c.seed == Seed::Lapsed && c.expiry == LeaseExpiry::Reconcile;
            let ok = if set_aside {
                r.status == RecordStatus::NeedsReconciliation
                    && said.contains("NeedsReconciliation")
            } else {
                r.status == RecordStatus::InProgress
                    && r.lease_token != c.seed_token
                    && said == "after acquired"
            };
            if !ok || r.fingerprint != theirs {
                faults.push(format!(
                    "{case}: the landed adopting claim left {:?} ({said})",
                    r.status
                ));
            }
        }
        tokio::time::sleep(victim_lease * 2 + ms(300)).await;
        for c in &cases {
            let case = format!(
                "{kill}: {:?} on {:?}, retried on {:?}",
                c.seed, c.expiry, c.survivor
            );
            let path = path_of(c.expiry);
            let (first, second) = match c.survivor {
                Scheme::Ours => (survivors["Ours"], survivors["Theirs"]),
                _ => (survivors["Theirs"], survivors["Ours"]),
            };
            let answers = settle(first, path, &c.key, BODY).await;
            let last = answers.last().expect("an answer").clone();
            let again = send(second, path, &c.key, BODY).await;
            let runs = effects_at(sink).get(&c.key).cloned().unwrap_or_default();
            if runs.contains(&vpid) {
                faults.push(format!("{case}: the killed victim ran it"));
            }
            if runs_on_retry(after, c.seed, c.expiry) {
                if !last.live() || runs.len() != 1 {
                    faults.push(format!(
                        "{case}: expected one run on retry; {} runs at the sink, answers {:?}",
                        runs.len(),
                        answers
                            .iter()
                            .map(|a| (a.status, a.slug()))
                            .collect::<Vec<_>>()
                    ));
                } else if !(again.replayed && again.body == last.body) {
                    faults.push(format!(
                        "{case}: not replayed on {}: {again:?}",
                        name(if c.survivor == Scheme::Ours {
                            Scheme::Theirs
                        } else {
                            Scheme::Ours
                        })
                    ));
                }
            } else {
                let r = record(&store, &c.key).await.expect("a record");
                if !last.unknown() || !again.unknown() || !runs.is_empty() {
                    faults.push(format!(
                        "{case}: expected outcome-unknown and no run; {} runs, answers {:?} \
                         then {again:?}",
                        runs.len(),
                        answers
                    ));
                }
                if r.status != RecordStatus::NeedsReconciliation {
                    faults.push(format!("{case}: left {:?}", r.status));
                }
            }
        }
        let after_retries = effects_at(sink);
        for c in &cases {
            let runs = after_retries.get(&c.key).map_or(0, Vec::len);
            if runs > 1 {
                faults.push(format!("{kill}: {} ran {runs} times", c.key));
            }
        }
    }
    assert!(
        faults.is_empty(),
        "{} faults:\n{}",
        faults.len(),
        faults.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_s7_a_process_killed_between_the_two_claims_on_sqlite() {
    if let Some(mode) = child_mode() {
        return child_main(mode).await;
    }
    let (store, path) = common::sqlite("adk-kill").await;
    let sink = path.with_extension("sink");
    let url = format!("sqlite://{}", path.display());
    killed_between_the_claims(
        "s4_s7_a_process_killed_between_the_two_claims_on_sqlite",
        store,
        vec![("AK_STORE", "sqlite".to_owned()), ("AK_AT", url)],
        &sink,
    )
    .await;
    for p in [path.clone(), sink] {
        let _ = std::fs::remove_file(p);
    }
    for suffix in ["-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_s7_a_process_killed_between_the_two_claims_on_postgres() {
    if let Some(mode) = child_mode() {
        return child_main(mode).await;
    }
    let Some(store) = common::postgres("adk_kill").await else {
        return;
    };
    let sink = common::sqlite_path("adk-kill-pg").with_extension("sink");
    killed_between_the_claims(
        "s4_s7_a_process_killed_between_the_two_claims_on_postgres",
        store,
        vec![
            ("AK_STORE", "postgres".to_owned()),
            ("AK_AT", "adk_kill".to_owned()),
        ],
        &sink,
    )
    .await;
    let _ = std::fs::remove_file(sink);
}

// ---- 3. a store that claims at once, then cannot (or fails) -----------------------------------

/// What the adopting `claim_now` answers, once per arming.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Then {
    /// `None`: it cannot claim at once any more.
    CannotNow,
    /// `Some(Err(Unavailable))`.
    Fails,
    /// `Some(Err(Busy))`: the row is locked by a transaction.
    Busy,
}

/// A memory store that claims at once, except the armed adopting claim. Logs both paths.
struct AtOnce {
    inner: MemoryStore,
    own: [u8; 4],
    then: Mutex<Option<Then>>,
    now_calls: Mutex<Vec<[u8; 32]>>,
    claims: Mutex<Vec<[u8; 32]>>,
}

impl AtOnce {
    fn new(inner: MemoryStore, own: [u8; 4]) -> Arc<Self> {
        Arc::new(Self {
            inner,
            own,
            then: Mutex::default(),
            now_calls: Mutex::default(),
            claims: Mutex::default(),
        })
    }
    fn arm(&self, then: Option<Then>) {
        *self.then.lock().expect("lock") = then;
    }
    fn take_logs(&self) -> (Vec<[u8; 32]>, Vec<[u8; 32]>) {
        (
            std::mem::take(&mut *self.now_calls.lock().expect("lock")),
            std::mem::take(&mut *self.claims.lock().expect("lock")),
        )
    }
}

impl IdempotencyStore for AtOnce {
    fn claim_now(&self, request: &ClaimRequest) -> Option<Result<Claim, StoreError>> {
        self.now_calls
            .lock()
            .expect("lock")
            .push(*request.fingerprint.as_bytes());
        if is_adopting(&request.fingerprint, self.own) {
            let then = self.then.lock().expect("lock").take();
            match then {
                Some(Then::CannotNow) => return None,
                Some(Then::Fails) => {
                    return Some(Err(StoreError::unavailable(std::io::Error::other(
                        "the adopting claim fails: injected",
                    ))));
                }
                Some(Then::Busy) => return Some(Err(StoreError::Busy)),
                None => {}
            }
        }
        self.inner.claim_now(request)
    }

    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        self.claims
            .lock()
            .expect("lock")
            .push(*request.fingerprint.as_bytes());
        self.inner.claim(request).await
    }

    crate::common::forward::forward_store!(inner: recorded_fingerprint_now, completed_now, renew, complete, release, mark_uncertain, lookup, remove, purge_expired, record_milestone, list_uncertain, count_uncertain, resolve, append_history, wait_for_change);
}

/// DESIGN §1 steps 5–6 (one claim decides; fail closed), §2, §4, §5 (every store alike): a
/// store that claimed at once for the request's first claim answers the adopting `claim_now`
/// with `None` (it can no longer claim at once). The layer claims again on the store's async
/// path, starting from the request's own bytes (exactly two async claims: its own, then the
/// record's), and the key runs once (or, a lapsed lease on a route that reconciles, is set
/// aside and never runs); the retry replays on both schemes; never a 409 "in flight" for a
/// record nobody holds. A record of other input is never adopted: one `claim_now`, no async
/// claim, 422 with `safe_new_key: false`, the record untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_s5_an_adopting_claim_now_that_cannot_claim_at_once_goes_async_from_own_bytes() {
    if let Some(mode) = child_mode() {
        return child_main(mode).await;
    }
    let prints = Prints::new(BODY).await;
    let memory = MemoryStore::new();
    let store = AtOnce::new(memory.clone(), prints.own_scheme());
    let effects = Effects::default();
    let lease = Duration::from_secs(5);
    let a = common::serve(app(
        store.clone(),
        Scheme::Ours,
        lease,
        Sink::Count(effects.clone()),
    ))
    .await;
    let b = common::serve(app(
        memory.clone(),
        Scheme::Theirs,
        lease,
        Sink::Count(effects.clone()),
    ))
    .await;
    let mut faults = Vec::new();
    for seeded in [Seed::Released, Seed::Lapsed] {
        for expiry in [LeaseExpiry::Reclaim, LeaseExpiry::Reconcile] {
            let case = format!("{seeded:?} on {expiry:?}");
            let path = path_of(expiry);
            let (ours, theirs) = (
                prints.get(Scheme::Ours, path),
                prints.get(Scheme::Theirs, path),
            );
            let text = unique("cannot-now");
            seed(&memory, &text, theirs, seeded).await;
            if seeded == Seed::Lapsed {
                lapse().await;
            }
            let ran_before = effects.count();
            store.take_logs();
            store.arm(Some(Then::CannotNow));
            let answer = send(a, path, &text, BODY).await;
            let (now_calls, claims) = store.take_logs();
            if now_calls != [*ours.as_bytes(), *theirs.as_bytes()] {
                faults.push(format!(
                    "{case}: claim_now was asked {} times, not own bytes then the record's",
                    now_calls.len()
                ));
            }
            if claims != [*ours.as_bytes(), *theirs.as_bytes()] {
                faults.push(format!(
                    "{case}: the async path claimed {} times, not from own bytes then the \
                     record's",
                    claims.len()
                ));
            }
            let r = record(&memory, &text).await.expect("a record");
            if seeded == Seed::Lapsed && expiry == LeaseExpiry::Reconcile {
                if !answer.unknown()
                    || effects.count() != ran_before
                    || r.status != RecordStatus::NeedsReconciliation
                {
                    faults.push(format!(
                        "{case}: expected set aside, nothing run: {answer:?}, {:?}",
                        r.status
                    ));
                }
                continue;
            }
            if !answer.live() || effects.count() != ran_before + 1 {
                faults.push(format!(
                    "{case}: expected one run, {} runs: {answer:?}",
                    effects.count() - ran_before
                ));
                continue;
            }
            if (r.status, r.fingerprint) != (RecordStatus::Completed, theirs) {
                faults.push(format!("{case}: left {:?}", r.status));
            }
            for addr in [a, b] {
                let again = send(addr, path, &text, BODY).await;
                if !(again.replayed && again.body == answer.body) {
                    faults.push(format!("{case}: not replayed: {again:?}"));
                }
            }
            if effects.count() != ran_before + 1 {
                faults.push(format!("{case}: ran again on a retry"));
            }
        }
    }
    // Other input under the other scheme: never adopted, never touched.
    for seeded in [Seed::Released, Seed::Lapsed] {
        let other = fingerprint_of(Scheme::Theirs, RECLAIM, OTHER).await;
        let text = unique("cannot-now-other");
        seed(&memory, &text, other, seeded).await;
        if seeded == Seed::Lapsed {
            lapse().await;
        }
        let before = snapshot(&memory, &text).await;
        let ran_before = effects.count();
        store.take_logs();
        store.arm(Some(Then::CannotNow));
        let answer = send(a, RECLAIM, &text, BODY).await;
        store.arm(None);
        let (now_calls, claims) = store.take_logs();
        if (answer.status, answer.slug(), answer.safe_new_key())
            != (422, "fingerprint-mismatch".to_owned(), Some(false))
        {
            faults.push(format!("{seeded:?}, other input: {answer:?}"));
        }
        if now_calls.len() != 1 || !claims.is_empty() {
            faults.push(format!(
                "{seeded:?}, other input: adopted ({} claim_now, {} async claims)",
                now_calls.len(),
                claims.len()
            ));
        }
        if snapshot(&memory, &text).await != before || effects.count() != ran_before {
            faults.push(format!("{seeded:?}, other input: touched or run"));
        }
    }
    assert!(
        faults.is_empty(),
        "{} faults:\n{}",
        faults.len(),
        faults.join("\n")
    );
}

/// DESIGN §1 step 6 (store errors: 503 + `Retry-After`, problem+json, nothing run, fail
/// closed; a locked row: "in flight"), §2, §4: the adopting `claim_now` fails (`Some(Err)`) or
/// is refused as busy, on a released record and on a lapsed lease of the other scheme. The
/// answer is a 503 `store-unavailable` problem (busy: 409 `in-flight`), nothing runs, no async
/// claim is made, and the record is exactly as it was (not taken over, not set aside); the
/// next retry runs exactly once, then replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_an_adopting_claim_now_that_fails_answers_503_and_the_retry_runs_once() {
    if let Some(mode) = child_mode() {
        return child_main(mode).await;
    }
    let prints = Prints::new(BODY).await;
    let memory = MemoryStore::new();
    let store = AtOnce::new(memory.clone(), prints.own_scheme());
    let effects = Effects::default();
    let a = common::serve(app(
        store.clone(),
        Scheme::Ours,
        Duration::from_secs(5),
        Sink::Count(effects.clone()),
    ))
    .await;
    let theirs = prints.get(Scheme::Theirs, RECLAIM);
    let mut faults = Vec::new();
    for then in [Then::Fails, Then::Busy] {
        for seeded in [Seed::Released, Seed::Lapsed] {
            let case = format!("{then:?}, {seeded:?}");
            let text = unique("now-fails");
            seed(&memory, &text, theirs, seeded).await;
            if seeded == Seed::Lapsed {
                lapse().await;
            }
            let before = snapshot(&memory, &text).await;
            let ran_before = effects.count();
            store.take_logs();
            store.arm(Some(then));
            let answer = send(a, RECLAIM, &text, BODY).await;
            let (now_calls, claims) = store.take_logs();
            let expected = match then {
                Then::Busy => (409, "in-flight"),
                _ => (503, "store-unavailable"),
            };
            if (answer.status, answer.slug().as_str()) != expected
                || answer.content_type != "application/problem+json"
                || answer.retry_after.is_none()
            {
                faults.push(format!("{case}: answered {answer:?}"));
            }
            if now_calls.len() != 2 || !claims.is_empty() {
                faults.push(format!(
                    "{case}: {} claim_now, {} async claims (2 and 0 expected)",
                    now_calls.len(),
                    claims.len()
                ));
            }
            if snapshot(&memory, &text).await != before || effects.count() != ran_before {
                faults.push(format!("{case}: the record moved or something ran"));
            }
            let retry = send(a, RECLAIM, &text, BODY).await;
            let replay = send(a, RECLAIM, &text, BODY).await;
            let replayed = replay.replayed && replay.body == retry.body;
            if !(retry.live() && replayed && effects.count() == ran_before + 1) {
                faults.push(format!(
                    "{case}: the retry: {retry:?}, then {replay:?}, {} runs",
                    effects.count() - ran_before
                ));
            }
        }
    }
    assert!(
        faults.is_empty(),
        "{} faults:\n{}",
        faults.len(),
        faults.join("\n")
    );
}

// ---- 4. races, foreign scheme bytes, other input, a record that keeps moving ------------------

/// Holds every claim with the armed bytes until `n` of them have arrived (or 5 s passed), then
/// lets them all go at once. No `claim_now`.
struct Rendezvous<S> {
    inner: S,
    armed: Mutex<Option<([u8; 32], usize)>>,
    arrived: AtomicUsize,
}

impl<S> Rendezvous<S> {
    fn new(inner: S) -> Arc<Self> {
        Arc::new(Self {
            inner,
            armed: Mutex::default(),
            arrived: AtomicUsize::new(0),
        })
    }
    fn arm(&self, fp: &Fingerprint, n: usize) {
        self.arrived.store(0, Ordering::SeqCst);
        *self.armed.lock().expect("lock") = Some((*fp.as_bytes(), n));
    }
}

impl<S: IdempotencyStore> IdempotencyStore for Rendezvous<S> {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        let armed = *self.armed.lock().expect("lock");
        if let Some((bytes, n)) = armed
            && bytes == *request.fingerprint.as_bytes()
        {
            self.arrived.fetch_add(1, Ordering::SeqCst);
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while self.arrived.load(Ordering::SeqCst) < n && tokio::time::Instant::now() < deadline
            {
                tokio::time::sleep(ms(1)).await;
            }
        }
        self.inner.claim(request).await
    }

    crate::common::forward::forward_store!(inner: renew, complete, release, mark_uncertain, lookup, remove, purge_expired, record_milestone, list_uncertain, count_uncertain, resolve, append_history, wait_for_change);
}

/// DESIGN §1 (at most one execution per key), §2, §4: a key released (or left with a lapsed
/// lease) by a replica of one scheme is retried at once by three requests to a replica of our
/// scheme and three to a replica of a third scheme (both adopt: each claims its own bytes, then
/// the record's) and two to a replica of the record's scheme, the eight claims with the
/// record's bytes let go together. Exactly one runs; the others are told "in flight" or
/// replayed; afterwards all three schemes replay the one run's answer.
async fn two_adopting_schemes_race<St: IdempotencyStore + Clone>(store: St, rendezvous: bool) {
    let prints = Prints::new(BODY).await;
    let rv = Rendezvous::new(store.clone());
    let effects = Effects::default();
    let lease = Duration::from_secs(5);
    let mut replicas = Vec::new();
    for scheme in [Scheme::Ours, Scheme::Third, Scheme::Theirs] {
        let sink = Sink::Count(effects.clone());
        let addr = if rendezvous {
            common::serve(app(rv.clone(), scheme, lease, sink)).await
        } else {
            common::serve(app(store.clone(), scheme, lease, sink)).await
        };
        replicas.push((scheme, addr));
    }
    let theirs = prints.get(Scheme::Theirs, RECLAIM);
    let mut faults = Vec::new();
    for seeded in [Seed::Released, Seed::Lapsed] {
        for round in 0..2 {
            let case = format!("{seeded:?}, round {round}");
            let text = unique("race");
            seed(&store, &text, theirs, seeded).await;
            if seeded == Seed::Lapsed {
                lapse().await;
            }
            let before = effects.count();
            rv.arm(&theirs, 8);
            let barrier = Arc::new(tokio::sync::Barrier::new(8));
            let senders: Vec<_> = [0, 0, 0, 1, 1, 1, 2, 2]
                .into_iter()
                .map(|i| {
                    let (scheme, addr) = replicas[i];
                    let (barrier, text) = (barrier.clone(), text.clone());
                    tokio::spawn(async move {
                        barrier.wait().await;
                        (scheme, send(addr, RECLAIM, &text, BODY).await)
                    })
                })
                .collect();
            let mut answers = Vec::new();
            for s in senders {
                answers.push(bounded("a racer", 40, s).await.expect("task"));
            }
            if rendezvous && rv.arrived.load(Ordering::SeqCst) < 8 {
                faults.push(format!(
                    "{case}: only {} claims with the record's bytes met (every request of our \
                     and the third scheme should adopt)",
                    rv.arrived.load(Ordering::SeqCst)
                ));
            }
            let ran = effects.count() - before;
            let live: Vec<_> = answers.iter().filter(|(_, a)| a.live()).collect();
            if ran != 1 || live.len() != 1 {
                faults.push(format!(
                    "{case}: {ran} runs, {} live answers: {:?}",
                    live.len(),
                    answers
                        .iter()
                        .map(|(s, a)| (*s, a.status, a.slug(), a.replayed))
                        .collect::<Vec<_>>()
                ));
                continue;
            }
            for (scheme, a) in &answers {
                if !(a.live() || a.replayed || a.in_flight()) {
                    faults.push(format!("{case}: {scheme:?} answered {a:?}"));
                }
            }
            let body = live[0].1.body.clone();
            for (scheme, addr) in &replicas {
                let again = send(*addr, RECLAIM, &text, BODY).await;
                if !(again.replayed && again.body == body) {
                    faults.push(format!("{case}: {scheme:?} did not replay: {again:?}"));
                }
            }
            if effects.count() != before + 1 {
                faults.push(format!("{case}: ran again"));
            }
        }
    }
    assert!(
        faults.is_empty(),
        "{} faults:\n{}",
        faults.len(),
        faults.join("\n")
    );
}

on_store!(
    s1_two_adopting_schemes_race_on_memory_at_once,
    memory,
    two_adopting_schemes_race,
    false
);
on_store!(
    s1_two_adopting_schemes_race_on_memory_async_path,
    memory,
    two_adopting_schemes_race,
    true
);
on_store!(
    s1_two_adopting_schemes_race_on_sqlite,
    sqlite("adk-race"),
    two_adopting_schemes_race,
    true
);
on_store!(
    s1_two_adopting_schemes_race_on_postgres,
    postgres("adk_race"),
    two_adopting_schemes_race,
    true
);
on_store!(
    s1_two_adopting_schemes_race_on_redis,
    redis("adk-race"),
    two_adopting_schemes_race,
    true
);

/// DESIGN §1 step 4 (one input, one request: the 224-bit digest after the scheme names it) and
/// step 6 (a mismatch keeps the key where the scheme is not this layer's), §2: a released
/// record whose four scheme bytes no layer makes (zeros, ones, a made-up version) but whose
/// digest is this request's is adopted as `decide::adopt` reads it (a record of another crate
/// version or of one before schemes were named): run once, the record keeps its bytes, the
/// retry replays on our scheme and on another; a request of other input is a 422 with
/// `safe_new_key: false`. A record under such bytes whose digest differs in one bit is never
/// adopted: 422, `safe_new_key: false`, untouched, nothing run.
async fn foreign_scheme_bytes<St: IdempotencyStore + Clone>(store: St) {
    let ours = fingerprint_of(Scheme::Ours, RECLAIM, BODY).await;
    let effects = Effects::default();
    let lease = Duration::from_secs(5);
    let a = common::serve(app(
        store.clone(),
        Scheme::Ours,
        lease,
        Sink::Count(effects.clone()),
    ))
    .await;
    let b = common::serve(app(
        store.clone(),
        Scheme::Theirs,
        lease,
        Sink::Count(effects.clone()),
    ))
    .await;
    let mut faults = Vec::new();
    for garbage in [[0u8; 4], [0xff; 4], [0x76, 0x30, 0x2e, 0x39]] {
        let case = format!("scheme bytes {garbage:02x?}");
        let mut bytes = *ours.as_bytes();
        bytes[..4].copy_from_slice(&garbage);
        let foreign = Fingerprint::from_bytes(bytes);
        let text = unique("foreign");
        seed(&store, &text, foreign, Seed::Released).await;
        let before = effects.count();
        let run = send(a, RECLAIM, &text, BODY).await;
        if !run.live() || effects.count() != before + 1 {
            faults.push(format!("{case}: not adopted and run once: {run:?}"));
            continue;
        }
        let r = record(&store, &text).await.expect("a record");
        if (r.status, r.fingerprint) != (RecordStatus::Completed, foreign) {
            faults.push(format!("{case}: left {:?}", r.status));
        }
        for addr in [a, b] {
            let again = send(addr, RECLAIM, &text, BODY).await;
            if !(again.replayed && again.body == run.body) {
                faults.push(format!("{case}: not replayed: {again:?}"));
            }
            let changed = send(addr, RECLAIM, &text, OTHER).await;
            if (changed.status, changed.safe_new_key()) != (422, Some(false)) {
                faults.push(format!("{case}: other input: {changed:?}"));
            }
        }
        // One bit off in the digest: another input.
        let mut off = bytes;
        off[31] ^= 1;
        let text = unique("foreign-off");
        seed(&store, &text, Fingerprint::from_bytes(off), Seed::Released).await;
        let snap = snapshot(&store, &text).await;
        let ran = effects.count();
        let refused = send(a, RECLAIM, &text, BODY).await;
        if (
            refused.status,
            refused.slug().as_str(),
            refused.safe_new_key(),
        ) != (422, "fingerprint-mismatch", Some(false))
        {
            faults.push(format!("{case}, one bit off: {refused:?}"));
        }
        if snapshot(&store, &text).await != snap || effects.count() != ran {
            faults.push(format!("{case}, one bit off: adopted or touched"));
        }
    }
    assert!(
        faults.is_empty(),
        "{} faults:\n{}",
        faults.len(),
        faults.join("\n")
    );
}

on_store!(
    s1_foreign_scheme_bytes_of_the_same_digest_are_adopted_on_memory,
    memory,
    foreign_scheme_bytes
);
on_store!(
    s1_foreign_scheme_bytes_of_the_same_digest_are_adopted_on_sqlite,
    sqlite("adk-foreign"),
    foreign_scheme_bytes
);

/// DESIGN §1 step 6 (a mismatch is reported before anything, nothing run), §4 (only the same
/// request's lapsed lease is taken over or set aside): on the async path of every store, a
/// claimable record of the other scheme for OTHER input (released, or a lapsed lease; on a
/// route that reclaims and one that reconciles) is never adopted: one claim only (no adopting
/// claim), 422 `fingerprint-mismatch` with `safe_new_key: false`, nothing run, the record
/// exactly as it was (never taken over nor set aside by a request of other input); the
/// record's own request then still runs there once, on a replica of its scheme (set aside
/// instead where its lease lapsed on a route that reconciles).
async fn other_input_is_never_adopted<St: IdempotencyStore + Clone>(store: St) {
    let prints = Prints::new(BODY).await;
    let gate = Gate::new(store.clone(), prints.own_scheme());
    let effects = Effects::default();
    let lease = Duration::from_secs(5);
    let a = common::serve(app(
        gate.clone(),
        Scheme::Ours,
        lease,
        Sink::Count(effects.clone()),
    ))
    .await;
    let b = common::serve(app(
        store.clone(),
        Scheme::Theirs,
        lease,
        Sink::Count(effects.clone()),
    ))
    .await;
    let mut faults = Vec::new();
    for seeded in [Seed::Released, Seed::Lapsed] {
        for expiry in [LeaseExpiry::Reclaim, LeaseExpiry::Reconcile] {
            let case = format!("{seeded:?} on {expiry:?}");
            let path = path_of(expiry);
            let other = fingerprint_of(Scheme::Theirs, path, OTHER).await;
            let text = unique("other-input");
            seed(&store, &text, other, seeded).await;
            if seeded == Seed::Lapsed {
                lapse().await;
            }
            let before = snapshot(&store, &text).await;
            let ran = effects.count();
            let answer = send(a, path, &text, BODY).await;
            if (answer.status, answer.slug().as_str(), answer.safe_new_key())
                != (422, "fingerprint-mismatch", Some(false))
            {
                faults.push(format!("{case}: {answer:?}"));
            }
            let claims = gate.claims_of(&text);
            if claims != [*prints.get(Scheme::Ours, path).as_bytes()] {
                faults.push(format!(
                    "{case}: {} claims (an adopting claim?)",
                    claims.len()
                ));
            }
            if snapshot(&store, &text).await != before || effects.count() != ran {
                faults.push(format!("{case}: the record was touched or something ran"));
            }
            let own = send(b, path, &text, OTHER).await;
            let set_aside = seeded == Seed::Lapsed && expiry == LeaseExpiry::Reconcile;
            let ok = if set_aside {
                own.unknown() && effects.count() == ran
            } else {
                own.live() && effects.count() == ran + 1
            };
            if !ok {
                faults.push(format!("{case}: the record's own request: {own:?}"));
            }
        }
    }
    assert!(
        faults.is_empty(),
        "{} faults:\n{}",
        faults.len(),
        faults.join("\n")
    );
}

on_store!(
    s1_s4_other_input_is_never_adopted_on_memory_async_path,
    memory,
    other_input_is_never_adopted
);
on_store!(
    s1_s4_other_input_is_never_adopted_on_sqlite,
    sqlite("adk-other"),
    other_input_is_never_adopted
);
on_store!(
    s1_s4_other_input_is_never_adopted_on_postgres,
    postgres("adk_other"),
    other_input_is_never_adopted
);
on_store!(
    s1_s4_other_input_is_never_adopted_on_redis,
    redis("adk-other"),
    other_input_is_never_adopted
);

/// A hostile memory store: while `on`, every record a claim finds is reported under yet another
/// scheme's bytes (same digest), as if another replica adopted and re-created it each time.
/// With `at_once`, it claims at once too.
struct Shifty {
    inner: MemoryStore,
    at_once: bool,
    on: AtomicBool,
    next: AtomicUsize,
    claims: AtomicUsize,
}

impl Shifty {
    fn shift(&self, claimed: Result<Claim, StoreError>) -> Result<Claim, StoreError> {
        if !self.on.load(Ordering::SeqCst) {
            return claimed;
        }
        match claimed {
            Ok(Claim::Existing { mut record, now }) => {
                let n = self.next.fetch_add(1, Ordering::SeqCst) as u8;
                let mut bytes = *record.fingerprint.as_bytes();
                bytes[..4].copy_from_slice(&[0xa0 ^ n, 0x5a, n, 0xc3]);
                record.fingerprint = Fingerprint::from_bytes(bytes);
                Ok(Claim::Existing { record, now })
            }
            other => other,
        }
    }
}

impl IdempotencyStore for Shifty {
    fn claim_now(&self, request: &ClaimRequest) -> Option<Result<Claim, StoreError>> {
        if !self.at_once {
            return None;
        }
        self.claims.fetch_add(1, Ordering::SeqCst);
        Some(self.shift(self.inner.claim_now(request)?))
    }

    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        let claimed = self.inner.claim(request).await;
        self.shift(claimed)
    }

    crate::common::forward::forward_store!(inner: renew, complete, release, mark_uncertain, lookup, remove, purge_expired, record_milestone, list_uncertain, count_uncertain, resolve, append_history, wait_for_change);
}

/// DESIGN §1 (every retry gets the original answer, "still running", or a clear error; nothing
/// hangs), §2: a hostile store whose claimable record of this request's input shows up under
/// new scheme bytes at every claim (a chain of re-creations). Adoption follows it a bounded
/// number of times (at least once, at most `ADOPTIONS` = 4 more claims), runs nothing, and
/// answers 409 "in flight" (the record keeps moving); on both the at-once and the async path.
/// Once the store behaves, the retry runs exactly once and then replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_a_record_that_keeps_changing_scheme_is_followed_a_bounded_number_of_times() {
    if let Some(mode) = child_mode() {
        return child_main(mode).await;
    }
    let theirs = fingerprint_of(Scheme::Theirs, RECLAIM, BODY).await;
    let mut faults = Vec::new();
    for at_once in [true, false] {
        let memory = MemoryStore::new();
        let store = Arc::new(Shifty {
            inner: memory.clone(),
            at_once,
            on: AtomicBool::new(false),
            next: AtomicUsize::new(0),
            claims: AtomicUsize::new(0),
        });
        let effects = Effects::default();
        let a = common::serve(app(
            store.clone(),
            Scheme::Ours,
            Duration::from_secs(5),
            Sink::Count(effects.clone()),
        ))
        .await;
        let text = unique("shifty");
        seed(&memory, &text, theirs, Seed::Released).await;
        store.on.store(true, Ordering::SeqCst);
        let answer = send(a, RECLAIM, &text, BODY).await;
        let claims = store.claims.swap(0, Ordering::SeqCst);
        store.on.store(false, Ordering::SeqCst);
        if !answer.in_flight() || effects.count() != 0 || !(2..=5).contains(&claims) {
            faults.push(format!(
                "at_once={at_once}: {claims} claims, {} runs: {answer:?}",
                effects.count()
            ));
        }
        let retry = send(a, RECLAIM, &text, BODY).await;
        let replay = send(a, RECLAIM, &text, BODY).await;
        if !retry.live() || !replay.replayed || effects.count() != 1 {
            faults.push(format!(
                "at_once={at_once}: once it behaves: {retry:?}, {replay:?}, {} runs",
                effects.count()
            ));
        }
    }
    assert!(
        faults.is_empty(),
        "{} faults:\n{}",
        faults.len(),
        faults.join("\n")
    );
}
