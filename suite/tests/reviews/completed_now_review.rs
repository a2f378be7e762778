//! Review of `IdempotencyStore::completed_now` and the fingerprint's `body_as_sent` hint: a
//! keyed retry of a finished request is decided from a read of the record, and a JSON body its
//! record hashed as sent is recognised by hashing it as sent. Every test tries to make the
//! layer run a handler twice, replay a response to a request that is not the same operation
//! (or fail to replay one that is), answer differently than without the read, or panic.
//! Effects are counted in the handler (the sink), never inferred from answers.
//!
//! Most tests are differential: the same scenario, key for key, against a MemoryStore the layer
//! reads through `completed_now` and against the same store behind a wrapper that does not
//! answer `completed_now` (the trait's default, the behaviour before the change). Status, body
//! bytes, replay marker, headers, effects and the record left behind must agree.

use crate::common;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use bytes::Bytes;
use common::memory::Clock;
use common::{Effects, grpc_frame, guard, serve};
use futures_util::FutureExt;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Barrier, Notify};
use tower_idempotency::fingerprint::JsonFields;
use tower_idempotency::store::{
    Claim, Fingerprint, HistoryEvent, RecordStatus, ScopedKey, StoreError,
};
use tower_idempotency::{AnyStore, IdempotencyLayer, IdempotencyStore, MalformedBody, MemoryStore};

/// A key no other test (nor run) has used.
fn unique(name: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{name}-{}-{nanos}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

// ---------------------------------------------------------------------------------------------
// A store wrapper: reads through `completed_now` (counted) or not at all (the default).
// ---------------------------------------------------------------------------------------------

type Hook<S> = Arc<dyn Fn(&S, &ScopedKey) + Send + Sync>;

#[derive(Clone)]
struct Probe<S> {
    inner: S,
    /// Whether `completed_now` is forwarded; `false` is a store that never overrode it.
    read: bool,
    /// `completed_now` answers that were a claim (the fast path taken).
    answered: Arc<AtomicUsize>,
    /// Runs after a forwarded read that answered, before the layer sees the answer.
    after_read: Option<Hook<S>>,
}

impl<S> Probe<S> {
    fn new(inner: S, read: bool) -> Self {
        Self {
            inner,
            read,
            answered: Arc::default(),
            after_read: None,
        }
    }

    fn answered(&self) -> usize {
        self.answered.load(Ordering::SeqCst)
    }
}

impl<S: IdempotencyStore> IdempotencyStore for Probe<S> {
    fn recorded_fingerprint_now(&self, key: &ScopedKey) -> Option<Fingerprint> {
        if !self.read {
            return None;
        }
        self.inner.recorded_fingerprint_now(key)
    }

    fn completed_now(&self, key: &ScopedKey) -> Option<Result<Claim, StoreError>> {
        if !self.read {
            return None;
        }
        let read = self.inner.completed_now(key);
        if matches!(read, Some(Ok(_))) {
            self.answered.fetch_add(1, Ordering::SeqCst);
            if let Some(hook) = &self.after_read {
                hook(&self.inner, key);
            }
        }
        read
    }

    crate::common::forward::forward_store!(inner: claim, claim_now, renew, complete, release, mark_uncertain, lookup, remove, purge_expired, record_milestone, list_uncertain, count_uncertain, resolve, append_history, wait_for_change);
}

// ---------------------------------------------------------------------------------------------
// The app: a handler that counts its effects and says which run answered.
// ---------------------------------------------------------------------------------------------

/// Media type with a custom canonicaliser that is itself a JSON type (`+json`).
const TRIM_JSON: &str = "application/vnd.trim+json";
/// Media type whose canonicaliser moves the store's clock (a slow canonicaliser).
const SLOW: &str = "application/x-slow";

/// 201 `{"run":n,"len":len}` with `x-run` and `location`; 500 when `x-fail` is sent (released
/// under the default policy); parked on `gate` when `x-gate` is sent.
fn handler_app<St: IdempotencyStore>(
    layer: IdempotencyLayer<St, tower_idempotency::scope::SingleTenant>,
    effects: Effects,
    gate: Arc<Notify>,
) -> Router {
    let handler = move |headers: HeaderMap, body: Bytes| {
        let effects = effects.clone();
        let gate = gate.clone();
        async move {
            if headers.contains_key("x-gate") {
                gate.notified().await;
            }
            let n = effects.hit();
            if headers.contains_key("x-fail") {
                let mut res = Response::new(Body::from(format!("fail {n}")));
                *res.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                return res;
            }
            let mut res = Response::new(Body::from(format!(
                r#"{{"run":{n},"len":{},"sum":{}}}"#,
                body.len(),
                body.iter().map(|&b| u64::from(b)).sum::<u64>()
            )));
            *res.status_mut() = StatusCode::CREATED;
            let h = res.headers_mut();
            h.insert("content-type", HeaderValue::from_static("application/json"));
            h.insert("x-run", HeaderValue::from(n));
            h.insert(
                "location",
                HeaderValue::from_str(&format!("/things/{n}")).expect("v"),
            );
            res
        }
    };
    let route = post(handler.clone()).patch(handler);
    Router::new()
        .route("/t", route.clone())
        .route("/t/{id}", route.clone())
        .route("/fields", route.clone())
        .route("/norec", route)
        .layer(layer)
}

/// The layer every differential app uses (one configuration, two stores).
fn layer<St: IdempotencyStore>(
    store: St,
    slow: Option<(Clock, Arc<AtomicI64>)>,
) -> IdempotencyLayer<St, tower_idempotency::scope::SingleTenant> {
    let mut layer = IdempotencyLayer::new(store)
        .single_tenant()
        .record_refusals(true)
        .ttl(Duration::from_secs(10))
        .fingerprint_header(HeaderName::from_static("x-v"))
        .canonicalize(TRIM_JSON, |b: &[u8]| -> Result<Vec<u8>, MalformedBody> {
            Ok(b.trim_ascii().to_vec())
        })
        .for_path("/fields", |r| {
            r.fingerprint_json(JsonFields::include(["/a"]).expect("pointer"))
        })
        .for_path("/norec", |r| r.record_refusals(false));
    if let Some((clock, by)) = slow {
        layer = layer.canonicalize(SLOW, move |b: &[u8]| -> Result<Vec<u8>, MalformedBody> {
            // The canonicaliser's work takes `by` ms on the store's clock (once).
            clock.advance(by.swap(0, Ordering::SeqCst));
            Ok(b.to_vec())
        });
    }
    layer
}

#[derive(Clone, Debug)]
struct Req {
    method: Method,
    path: String,
    content_type: Option<String>,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

fn req(path: &str, content_type: Option<&str>, body: &[u8]) -> Req {
    Req {
        method: Method::POST,
        path: path.to_owned(),
        content_type: content_type.map(str::to_owned),
        headers: Vec::new(),
        body: body.to_vec(),
    }
}

fn json(body: &[u8]) -> Req {
    req("/t", Some("application/json"), body)
}

impl Req {
    fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    fn method(mut self, method: Method) -> Self {
        self.method = method;
        self
    }

    fn path(mut self, path: &str) -> Self {
        self.path = path.to_owned();
        self
    }
}

/// What a client sees of an answer, minus framing and the clock.
#[derive(Clone, Debug, PartialEq)]
struct Answer {
    status: u16,
    replayed: Option<String>,
    run: Option<String>,
    location: Option<String>,
    content_type: Option<String>,
    body: Vec<u8>,
}

impl Answer {
    fn is_replay(&self) -> bool {
        self.replayed.as_deref() == Some("true")
    }

    fn problem_type(&self) -> Option<String> {
        let v: serde_json::Value = serde_json::from_slice(&self.body).ok()?;
        v.get("type")?.as_str().map(str::to_owned)
    }
}

async fn send(addr: SocketAddr, key: &str, r: &Req) -> Answer {
    guard("a request", async {
        let mut b = common::client()
            .request(r.method.clone(), format!("http://{addr}{}", r.path))
            .header("idempotency-key", key)
            .body(r.body.clone());
        if let Some(ct) = &r.content_type {
            b = b.header("content-type", ct.as_str());
        }
        for (n, v) in &r.headers {
            b = b.header(n.as_str(), v.as_str());
        }
        let res = b.send().await.expect("send");
        let h = |name: &str| {
            res.headers()
                .get(name)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        };
        let (status, replayed, run, location, content_type) = (
            res.status().as_u16(),
            h("idempotency-replayed"),
            h("x-run"),
            h("location"),
            h("content-type"),
        );
        let body = res.bytes().await.expect("body").to_vec();
        Answer {
            status,
            replayed,
            run,
            location,
            content_type,
            body,
        }
    })
    .await
}

/// What a record holds that the layer's decisions leave behind.
#[derive(Debug, PartialEq)]
struct Kept {
    fingerprint: [u8; 32],
    hint: bool,
    status: RecordStatus,
    attempts: u32,
    events: Vec<(u32, HistoryEvent)>,
}

async fn kept<S: IdempotencyStore>(store: &S, key: &str) -> Option<Kept> {
    let record = store
        .lookup(&ScopedKey::new("", key))
        .await
        .expect("lookup")?;
    Some(Kept {
        fingerprint: *record.fingerprint.as_bytes(),
        hint: record.fingerprint.body_as_sent(),
        status: record.status,
        attempts: record.attempts,
        events: record
            .history
            .iter()
            .map(|e| (e.attempt, e.event))
            .collect(),
    })
}

struct Side {
    addr: SocketAddr,
    store: Probe<MemoryStore>,
    effects: Effects,
}

impl Side {
    async fn new(read: bool, memory: MemoryStore, slow: Option<(Clock, Arc<AtomicI64>)>) -> Self {
        let store = Probe::new(memory, read);
        let effects = Effects::default();
        let app = handler_app(
            layer(store.clone(), slow),
            effects.clone(),
            Arc::new(Notify::new()),
        );
        Self {
            addr: serve(app).await,
            store,
            effects,
        }
    }
}

/// The same app twice: `read` answers `completed_now`, `plain` never does.
struct Pair {
    read: Side,
    plain: Side,
}

impl Pair {
    async fn new() -> Self {
        Self {
            read: Side::new(true, MemoryStore::new(), None).await,
            plain: Side::new(false, MemoryStore::new(), None).await,
        }
    }

    /// Runs `steps` under one fresh key on both sides, one step at a time, and checks that
    /// every answer, every step's effects and the record left agree. The read side's answers.
    async fn check(&self, label: &str, steps: &[Req]) -> Vec<Answer> {
        let key = unique("diff");
        let mut out = Vec::new();
        for (i, step) in steps.iter().enumerate() {
            let (ra, pa) = (self.read.effects.count(), self.plain.effects.count());
            let (a, b) = tokio::join!(
                send(self.read.addr, &key, step),
                send(self.plain.addr, &key, step)
            );
            let (ra, pa) = (
                self.read.effects.count() - ra,
                self.plain.effects.count() - pa,
            );
            assert_eq!(
                a, b,
                "{label}: step {i} ({step:?}) is answered differently with completed_now \
                 (left) than without (right)"
            );
            assert_eq!(
                ra, pa,
                "{label}: step {i} ({step:?}) ran the handler {ra} times with completed_now, \
                 {pa} times without"
            );
            out.push(a);
        }
        let (a, b) = (
            kept(&self.read.store, &key).await,
            kept(&self.plain.store, &key).await,
        );
        assert_eq!(a, b, "{label}: the records left behind differ");
        out
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Fingerprints: every pair of body forms answers as it would without the read.
// ---------------------------------------------------------------------------------------------

/// JSON bodies: one value in many forms, others near it, and bodies no canonical form covers.
fn corpus() -> Vec<Vec<u8>> {
    let mut v: Vec<Vec<u8>> = [
        &br#"{"a":1,"b":[true,null,"x"]}"#[..],
        br#"{ "a": 1, "b": [true, null, "x"] }"#,
        br#"{"b":[true,null,"x"],"a":1}"#,
        br#"{"\u0061":1,"b":[true,null,"x"]}"#,
        br#"{"a":1.0,"b":[true,null,"x"]}"#,
        br#"{"a":1e0,"b":[true,null,"x"]}"#,
        br#"{"a":2,"b":[true,null,"x"]}"#,
        br#"{"a":1,"a":1,"b":[true,null,"x"]}"#,
        br#"{"a":1,"b":[true,null,"x"]} "#,
        br#"{"a":1,"b":[true,null,"\u0078"]}"#,
        br#"{"\n":1}"#,
        br#"{"\u000a":1}"#,
        br#"{"s":"\u001f"}"#,
        br#"{"s":"\u001F"}"#,
        "{\"s\":\"é\"}".as_bytes(),
        br#"{"s":"\u00e9"}"#,
        br#"{"s":"/"}"#,
        br#"{"s":"\/"}"#,
        br#"{"n":12345678901234567890}"#,
        br#"{"n":12345678901234567000}"#,
        br#"{"n":1e21}"#,
        br#"{"n":1e+21}"#,
        br#"{"n":-0}"#,
        br#"{"n":0}"#,
        "{\"\u{10000}\":1,\"\u{ffff}\":2}".as_bytes(),
        "{\"\u{ffff}\":2,\"\u{10000}\":1}".as_bytes(),
        b"null",
        b"\"x\"",
        b"[]",
        b"",
        b"{\"a\":\"\xff\"}",
        b"{\"a\":1",
    ]
    .iter()
    .map(|b| b.to_vec())
    .collect();
    // With a byte-order mark: not JSON's canonical form.
    v.push([&b"\xef\xbb\xbf"[..], br#"{"a":1,"b":[true,null,"x"]}"#].concat());
    v
}

/// DESIGN §1 step 4 (canonical JSON; values with no exact canonical form hashed raw in their
/// own domain) and step 6 (same fingerprint: replay; different: 422): for every ordered pair of
/// bodies (a first request, a retry, the first again), the layer reading `completed_now` and
/// hashing a retry as sent answers, runs and records exactly as without the read. The read
/// side must also have taken the fast path (else the comparison proves nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_4_every_pair_of_json_forms_answers_as_without_the_read() {
    let pair = Pair::new().await;
    let bodies = corpus();
    let mut replays = 0;
    for (i, first) in bodies.iter().enumerate() {
        for (j, retry) in bodies.iter().enumerate() {
            let label = format!("pair {i}/{j}");
            let answers = pair
                .check(&label, &[json(first), json(retry), json(first)])
                .await;
            if first == retry && answers[0].status == 201 {
                assert!(
                    answers[1].is_replay() && answers[1].body == answers[0].body,
                    "{label}: the same bytes are not replayed: {:?}",
                    answers[1]
                );
            }
            replays += usize::from(answers[1].is_replay());
        }
    }
    // The canonical body and its spaced and reordered forms are one operation.
    for (i, j) in [
        (0, 1),
        (1, 0),
        (0, 2),
        (2, 0),
        (0, 3),
        (3, 0),
        (14, 15),
        (15, 14),
    ] {
        let answers = pair
            .check(
                &format!("same value {i}/{j}"),
                &[json(&bodies[i]), json(&bodies[j])],
            )
            .await;
        assert!(answers[1].is_replay(), "{i}/{j}: {:?}", answers[1]);
    }
    // A changed value is another operation.
    let answers = pair
        .check("changed", &[json(&bodies[0]), json(&bodies[6])])
        .await;
    assert_eq!(answers[1].status, 422, "{:?}", answers[1]);
    assert_eq!(
        answers[1].problem_type().as_deref(),
        Some("urn:tower-idempotency:problem:fingerprint-mismatch")
    );
    assert!(replays > bodies.len(), "too few replays: {replays}");
    assert!(
        pair.read.store.answered() > bodies.len() * bodies.len(),
        "the read side answered only {} retries from completed_now",
        pair.read.store.answered()
    );
    assert_eq!(pair.plain.store.answered(), 0);
}

/// DESIGN §1 step 4 ("method, the full path ... and query", "`Content-Type` and selected
/// request headers are included", "media-type parameters count"): a retry with the recorded
/// body's exact bytes but another method, path, query, media type, media parameter or
/// fingerprint header is another operation (422), however the body was hashed; the forms that
/// provably change nothing (`charset=utf-8` on JSON, case, header whitespace) replay. Every
/// answer as without the read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_4_same_bytes_with_another_head_is_another_operation() {
    let pair = Pair::new().await;
    let canonical: &[u8] = br#"{"a":1,"b":[true,null,"x"]}"#;
    let spaced: &[u8] = br#"{ "a": 1, "b": [true, null, "x"] }"#;
    for body in [canonical, spaced] {
        let first = req("/t/1?x=1", Some("application/json"), body).header("x-v", "1");
        let same = |r: Req| (r, true);
        let other = |r: Req| (r, false);
        let variants = [
            same(first.clone()),
            same(first.clone().path("/t/1?x=1").header("x-other", "ignored")),
            same(req("/t/1?x=1", Some("application/json; charset=utf-8"), body).header("x-v", "1")),
            same(
                req("/t/1?x=1", Some("application/json;charset=\"UTF-8\""), body)
                    .header("x-v", "1"),
            ),
            same(req("/t/1?x=1", Some("Application/JSON"), body).header("x-v", "1")),
            same(req("/t/1?x=1", Some("application/json"), body).header("x-v", " 1 ")),
            other(
                req("/t/1?x=1", Some("application/json; charset=latin1"), body).header("x-v", "1"),
            ),
            other(req("/t/1?x=1", Some("application/json; v=2"), body).header("x-v", "1")),
            other(req("/t/1?x=1", Some("application/problem+json"), body).header("x-v", "1")),
            other(req("/t/1?x=1", Some("text/plain"), body).header("x-v", "1")),
            other(req("/t/1?x=1", None, body).header("x-v", "1")),
            other(req("/t/1?x=1", Some(TRIM_JSON), body).header("x-v", "1")),
            other(first.clone().path("/t/1?x=2")),
            other(first.clone().path("/t/1?x=1&")),
            other(first.clone().path("/t/1")),
            other(first.clone().path("/t/2?x=1")),
            other(first.clone().path("/t?x=1")),
            other(first.clone().method(Method::PATCH)),
            other(req("/t/1?x=1", Some("application/json"), body).header("x-v", "2")),
            other(req("/t/1?x=1", Some("application/json"), body)),
            other(req("/t/1?x=1", Some("application/json"), body).header("x-v", "1, 1")),
        ];
        for (i, (variant, is_same)) in variants.into_iter().enumerate() {
            let label = format!("head variant {i} of {:?}", String::from_utf8_lossy(body));
            let answers = pair
                .check(&label, &[first.clone(), variant.clone(), first.clone()])
                .await;
            assert_eq!(answers[0].status, 201, "{label}");
            match is_same {
                true => assert!(
                    answers[1].is_replay() && answers[1].body == answers[0].body,
                    "{label}: {variant:?} is the same operation: {:?}",
                    answers[1]
                ),
                false => assert_eq!(
                    answers[1].status, 422,
                    "{label}: {variant:?} is another operation: {:?}",
                    answers[1]
                ),
            }
            assert!(
                answers[2].is_replay(),
                "{label}: the first again: {:?}",
                answers[2]
            );
        }
    }
    assert!(pair.read.store.answered() > 0);
}

/// DESIGN §1 step 4 (routes that count only chosen JSON fields; a pluggable canonicaliser, here
/// on a `+json` type, that decides alone what is the same body): a retry differing only where
/// the route does not look replays, one differing where it looks is refused, and neither reads
/// the body as sent where the route fingerprints otherwise. As without the read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_4_json_fields_and_custom_canonicalisers_answer_as_without_the_read() {
    let pair = Pair::new().await;
    let fields = |b: &[u8]| req("/fields", Some("application/json"), b);
    let trim = |b: &[u8]| req("/t", Some(TRIM_JSON), b);
    let cases: Vec<(Req, Req, bool)> = vec![
        (
            fields(br#"{"a":1,"b":2}"#),
            fields(br#"{"a":1,"b":2}"#),
            true,
        ),
        (
            fields(br#"{"a":1,"b":2}"#),
            fields(br#"{"a":1,"b":3}"#),
            true,
        ),
        (
            fields(br#"{"a":1,"b":2}"#),
            fields(br#"{ "b": 9, "a": 1 }"#),
            true,
        ),
        (
            fields(br#"{"a":1,"b":2}"#),
            fields(br#"{"a":2,"b":2}"#),
            false,
        ),
        (fields(br#"{"a":1}"#), fields(br#"{"a":1,"a":1}"#), false),
        (trim(br#"{"a":1}"#), trim(br#"  {"a":1}  "#), true),
        (trim(br#"{"a":1}"#), trim(br#"{"a":1}"#), true),
        (trim(br#"{"a":1}"#), trim(br#"{ "a":1}"#), false),
        (trim(br#"{"b":1,"a":2}"#), trim(br#"{"a":2,"b":1}"#), false),
        (trim(b"not json"), trim(b"not json "), true),
    ];
    for (i, (first, retry, is_same)) in cases.into_iter().enumerate() {
        let label = format!("case {i}");
        let answers = pair
            .check(&label, &[first.clone(), retry.clone(), retry, first])
            .await;
        assert_eq!(answers[0].status, 201, "{label}: {:?}", answers[0]);
        match is_same {
            true => assert!(answers[1].is_replay(), "{label}: {:?}", answers[1]),
            false => assert!(
                !answers[1].is_replay() && answers[1].status >= 400 && answers[1].run.is_none(),
                "{label}: {:?}",
                answers[1]
            ),
        }
        assert!(answers[3].is_replay(), "{label}: {:?}", answers[3]);
    }
}

// ---------------------------------------------------------------------------------------------
// 2. The hint kept with the record: takeovers by another form of the same body.
// ---------------------------------------------------------------------------------------------

/// DESIGN §2 (released -> claimable again) and §1 step 6: a first attempt fails retryably
/// (released), a retry with another form of the same JSON takes the key over and completes,
/// then every form replays that outcome and a changed body is refused; the record's hint is the
/// form that ran last (canonical sent as is, or not), and all answers, runs and records are as
/// without the read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_a_takeover_by_another_form_keeps_every_form_replaying() {
    let pair = Pair::new().await;
    let canonical: &[u8] = br#"{"a":1,"b":[true,null,"x"]}"#;
    let spaced: &[u8] = br#"{ "b": [true, null, "x"], "a": 1 }"#;
    let escaped: &[u8] = br#"{"\u0061":1,"b":[true,null,"x"]}"#;
    let changed: &[u8] = br#"{"a":2,"b":[true,null,"x"]}"#;
    let forms = [canonical, spaced, escaped];
    for (i, failing) in forms.iter().enumerate() {
        for (j, winning) in forms.iter().enumerate() {
            let label = format!("failed as form {i}, ran as form {j}");
            let key_steps = [
                json(failing).header("x-fail", "1"),
                json(winning),
                json(canonical),
                json(spaced),
                json(escaped),
                json(changed),
                json(winning),
            ];
            let answers = pair.check(&label, &key_steps).await;
            assert_eq!(answers[0].status, 500, "{label}: {:?}", answers[0]);
            assert_eq!(answers[1].status, 201, "{label}: {:?}", answers[1]);
            assert!(!answers[1].is_replay(), "{label}");
            for k in [2, 3, 4, 6] {
                assert!(
                    answers[k].is_replay() && answers[k].body == answers[1].body,
                    "{label}: step {k}: {:?}",
                    answers[k]
                );
            }
            assert_eq!(answers[5].status, 422, "{label}: {:?}", answers[5]);
        }
    }
    // The hint follows the attempt that took the key over.
    for (failing, winning, hint) in [(canonical, spaced, false), (spaced, canonical, true)] {
        let key = unique("hint");
        let side = &pair.read;
        let first = send(side.addr, &key, &json(failing).header("x-fail", "1")).await;
        assert_eq!(first.status, 500);
        let k = kept(&side.store, &key).await.expect("record");
        assert_eq!(k.status, RecordStatus::Released);
        assert_eq!(k.hint, !hint, "the first attempt's hint");
        let won = send(side.addr, &key, &json(winning)).await;
        assert_eq!(won.status, 201);
        let k = kept(&side.store, &key).await.expect("record");
        assert_eq!(k.status, RecordStatus::Completed);
        assert_eq!(k.attempts, 2);
        assert_eq!(
            k.hint, hint,
            "the hint of the attempt that took the key over"
        );
        for form in [failing, winning] {
            let again = send(side.addr, &key, &json(form)).await;
            assert!(again.is_replay() && again.body == won.body, "{again:?}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Expiry on the store's clock.
// ---------------------------------------------------------------------------------------------

/// DESIGN §1 step 6 ("completed but expired (past TTL): treated as absent: new claim") and
/// §7.4: one millisecond before `expires_at` a retry replays; at exactly `expires_at` it runs
/// again (the record is absent), with the read as without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_6_expiry_at_exactly_the_ttl_runs_again_as_without_the_read() {
    for read in [true, false] {
        let clock = Clock::new();
        let side = Side::new(read, clock.store(), None).await;
        let key = unique("ttl");
        let body: &[u8] = br#"{"a":1}"#;
        let first = send(side.addr, &key, &json(body)).await;
        assert_eq!(first.status, 201);
        let record = side
            .store
            .lookup(&ScopedKey::new("", &key))
            .await
            .expect("lookup")
            .expect("record");
        let left = record
            .expires_at
            .duration_since(clock.now())
            .expect("expires later")
            .as_millis() as i64;
        assert!(left > 1, "read={read}: {left}");
        clock.advance(left - 1);
        for retry in [body, br#"{ "a" : 1 }"#] {
            let again = send(side.addr, &key, &json(retry)).await;
            assert!(
                again.is_replay() && again.body == first.body,
                "read={read}: 1 ms before the TTL: {again:?}"
            );
        }
        assert_eq!(side.effects.count(), 1, "read={read}");
        clock.advance(1);
        let expired = send(side.addr, &key, &json(body)).await;
        assert_eq!(expired.status, 201, "read={read}: {expired:?}");
        assert!(
            !expired.is_replay(),
            "read={read}: an expired record replayed"
        );
        assert_eq!(
            side.effects.count(),
            2,
            "read={read}: at the TTL the key runs again"
        );
        let again = send(side.addr, &key, &json(br#"{ "a" : 1 }"#)).await;
        assert!(
            again.is_replay() && again.body == expired.body,
            "read={read}"
        );
        assert_eq!(side.effects.count(), 2, "read={read}");
        if read {
            assert!(side.store.answered() >= 2, "the read answered the retries");
        }
    }
}

/// DESIGN §1 (steps "in this order and no other": 4 fingerprint, 5 claim, 6 decide from the
/// claim) and step 6 ("completed but expired: treated as absent: new claim"): when
/// fingerprinting takes time (here a custom canonicaliser during which the store's clock passes
/// the record's expiry), the request is decided from the record as the claim after the
/// fingerprint finds it. Without the read, the key runs again; the layer must answer the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_5_a_record_that_expires_while_the_request_is_fingerprinted_is_absent() {
    // The retry sends the same payload (a replay if the record counted) or another one (a 422
    // if it counted); either way the record had expired by the time of the claim.
    let mut wrong = Vec::new();
    for retry_body in [&b"payload"[..], b"other payload"] {
        let mut outcomes = Vec::new();
        for read in [true, false] {
            let clock = Clock::new();
            let by = Arc::new(AtomicI64::new(0));
            let side = Side::new(read, clock.store(), Some((clock.clone(), by.clone()))).await;
            let key = unique("slow");
            let first = send(side.addr, &key, &req("/t", Some(SLOW), b"payload")).await;
            assert_eq!(first.status, 201);
            // The retry's fingerprint takes 11 s on the store's clock; the TTL is 10 s.
            by.store(11_000, Ordering::SeqCst);
            let retry = send(side.addr, &key, &req("/t", Some(SLOW), retry_body)).await;
            outcomes.push((retry, side.effects.count()));
        }
        let what = String::from_utf8_lossy(retry_body);
        let (plain, plain_runs) = &outcomes[1];
        assert_eq!(
            (plain.status, plain.is_replay(), *plain_runs),
            (201, false, 2),
            "{what}: without the read the expired key runs: {plain:?}"
        );
        let (read, read_runs) = &outcomes[0];
        if (read.status, read.is_replay(), *read_runs) != (201, false, 2) {
            wrong.push(format!(
                "retry {what:?}: status {}, replayed {}, handler runs {read_runs} (without the \
                 read: 201, not replayed, 2 runs); body {:?}",
                read.status,
                read.is_replay(),
                String::from_utf8_lossy(&read.body)
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "with completed_now the request was decided from the record read before its \
         fingerprint, which had expired when it was decided:\n{}",
        wrong.join("\n")
    );
}

// ---------------------------------------------------------------------------------------------
// 4. The record changes between the read and the answer.
// ---------------------------------------------------------------------------------------------

/// DESIGN §7.4 ("after TTL (or deleting the record) the key executes again") and §1 step 6: a
/// record removed right after the layer read it (the read is the decision's point in time, as a
/// claim's would be) answers that read's replay exactly, nothing panics, noting the replay into
/// the gone record's history does not change the answer, and the next retry runs again once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_4_a_record_removed_after_the_read_replays_the_read_then_runs_again() {
    let memory = MemoryStore::new();
    let mut store = Probe::new(memory.clone(), true);
    let armed = Arc::new(AtomicUsize::new(0));
    let trigger = armed.clone();
    store.after_read = Some(Arc::new(move |inner: &MemoryStore, key: &ScopedKey| {
        if trigger.swap(0, Ordering::SeqCst) == 1 {
            let removed = inner.remove(key).now_or_never().expect("at once");
            assert!(removed.expect("remove"), "the record was there");
        }
    }));
    let effects = Effects::default();
    let app = handler_app(layer(store.clone(), None), effects.clone(), Arc::default());
    let addr = serve(app).await;
    let key = unique("removed");
    let body: &[u8] = br#"{"a":1}"#;
    let first = send(addr, &key, &json(body)).await;
    assert_eq!(first.status, 201);
    armed.store(1, Ordering::SeqCst);
    let replay = send(addr, &key, &json(body)).await;
    assert!(
        replay.is_replay() && replay.body == first.body,
        "the read's answer: {replay:?}"
    );
    assert_eq!(effects.count(), 1);
    assert!(
        memory
            .lookup(&ScopedKey::new("", &key))
            .await
            .expect("lookup")
            .is_none()
    );
    let again = send(addr, &key, &json(br#"{ "a": 1 }"#)).await;
    assert_eq!(again.status, 201, "{again:?}");
    assert!(!again.is_replay());
    assert_eq!(effects.count(), 2, "a removed key runs again, once");
    let last = send(addr, &key, &json(body)).await;
    assert!(last.is_replay() && last.body == again.body, "{last:?}");
    assert_eq!(effects.count(), 2);
}

/// DESIGN §1 step 6 ("any state, different fingerprint: 422, nothing run") and §2: a record
/// removed and claimed afresh by another request (another body) right after the read: the
/// request answered from the read never runs the handler, and the new holder's outcome is
/// what every later retry of the new body replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_6_a_record_replaced_after_the_read_never_runs_the_reader() {
    let memory = MemoryStore::new();
    let mut store = Probe::new(memory.clone(), true);
    let armed = Arc::new(AtomicUsize::new(0));
    let trigger = armed.clone();
    store.after_read = Some(Arc::new(move |inner: &MemoryStore, key: &ScopedKey| {
        if trigger.swap(0, Ordering::SeqCst) == 1 {
            inner
                .remove(key)
                .now_or_never()
                .expect("at once")
                .expect("remove");
        }
    }));
    let effects = Effects::default();
    let app = handler_app(layer(store.clone(), None), effects.clone(), Arc::default());
    let addr = serve(app).await;
    let key = unique("replaced");
    let first = send(addr, &key, &json(br#"{"a":1}"#)).await;
    assert_eq!(first.status, 201);
    armed.store(1, Ordering::SeqCst);
    // Read (completed, {"a":1}), then the record is gone; this request is {"a":2}.
    let refused = send(addr, &key, &json(br#"{"a":2}"#)).await;
    assert_eq!(refused.status, 422, "{refused:?}");
    assert_eq!(effects.count(), 1, "a refused request ran the handler");
    let runs = send(addr, &key, &json(br#"{"a":2}"#)).await;
    assert_eq!(runs.status, 201, "the key is absent now: {runs:?}");
    assert_eq!(effects.count(), 2);
    let old = send(addr, &key, &json(br#"{"a":1}"#)).await;
    assert_eq!(
        old.status, 422,
        "the first body is another operation now: {old:?}"
    );
    let new = send(addr, &key, &json(br#"{ "a": 2 }"#)).await;
    assert!(new.is_replay() && new.body == runs.body, "{new:?}");
    assert_eq!(effects.count(), 2);
}

// ---------------------------------------------------------------------------------------------
// 5. History on record_refusals routes.
// ---------------------------------------------------------------------------------------------

/// DESIGN §6 ("per key, the record keeps enough history ... for incident review"): on a route
/// that records refusals, replays and mismatches answered from the read are written into the
/// key's history (Replayed, Mismatch), in order, exactly as when they are answered from a
/// claim; a route that does not record refusals writes neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_replays_and_mismatches_from_the_read_are_in_the_history() {
    let pair = Pair::new().await;
    let canonical: &[u8] = br#"{"a":1}"#;
    for path in ["/t", "/norec"] {
        let r = |b: &[u8]| req(path, Some("application/json"), b);
        let steps = [
            r(canonical),
            r(canonical),
            r(br#"{ "a": 1 }"#),
            r(br#"{"a":2}"#),
            r(canonical),
        ];
        let key = unique("history");
        for step in &steps {
            let (a, b) = tokio::join!(
                send(pair.read.addr, &key, step),
                send(pair.plain.addr, &key, step)
            );
            assert_eq!(a, b, "{path}: {step:?}");
        }
        let a = kept(&pair.read.store, &key).await.expect("record");
        let b = kept(&pair.plain.store, &key).await.expect("record");
        assert_eq!(a, b, "{path}: the histories differ");
        let events: Vec<HistoryEvent> = a.events.iter().map(|(_, e)| *e).collect();
        let expected = match path {
            "/t" => vec![
                HistoryEvent::Claimed,
                HistoryEvent::Completed,
                HistoryEvent::Replayed,
                HistoryEvent::Replayed,
                HistoryEvent::Mismatch,
                HistoryEvent::Replayed,
            ],
            _ => vec![HistoryEvent::Claimed, HistoryEvent::Completed],
        };
        assert_eq!(events, expected, "{path}");
    }
    assert!(pair.read.store.answered() >= 8);
}

// ---------------------------------------------------------------------------------------------
// 6. Concurrency.
// ---------------------------------------------------------------------------------------------

/// DESIGN §7.3 and §1 step 6: while the first request runs, concurrent retries (every form,
/// through a barrier) get 409 or wait, never a run; once it completes, 32 concurrent retries of
/// every form (canonical, spaced, reordered, escaped) replay its exact bytes and a changed body
/// gets 422; the handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_3_concurrent_retries_of_a_completed_key_run_nothing() {
    let store = MemoryStore::new();
    let effects = Effects::default();
    let gate = Arc::new(Notify::new());
    let app = handler_app(layer(store.clone(), None), effects.clone(), gate.clone());
    let addr = serve(app).await;
    let key = unique("concurrent");
    let canonical: &[u8] = br#"{"a":1,"b":[true,null,"x"]}"#;
    let forms: [&[u8]; 4] = [
        canonical,
        br#"{ "a": 1, "b": [true, null, "x"] }"#,
        br#"{"b":[true,null,"x"],"a":1}"#,
        br#"{"\u0061":1,"b":[true,null,"x"]}"#,
    ];
    let changed: &[u8] = br#"{"a":1,"b":[true,null,"y"]}"#;
    let first = {
        let key = key.clone();
        tokio::spawn(async move { send(addr, &key, &json(canonical).header("x-gate", "1")).await })
    };
    common::until("the first request holds the key", || {
        store
            .lookup(&ScopedKey::new("", &key))
            .now_or_never()
            .and_then(Result::ok)
            .flatten()
            .is_some_and(|r| r.status == RecordStatus::InProgress)
    })
    .await;
    let barrier = Arc::new(Barrier::new(8));
    let during: Vec<_> = (0..8)
        .map(|i| {
            let (key, barrier) = (key.clone(), barrier.clone());
            let body = forms[i % forms.len()].to_vec();
            tokio::spawn(async move {
                barrier.wait().await;
                send(addr, &key, &json(&body)).await
            })
        })
        .collect();
    for task in during {
        let answer = task.await.expect("task");
        assert_eq!(answer.status, 409, "a retry while in flight: {answer:?}");
    }
    gate.notify_one();
    let first = first.await.expect("task");
    assert_eq!(first.status, 201);
    assert_eq!(effects.count(), 1);
    let barrier = Arc::new(Barrier::new(40));
    let after: Vec<_> = (0..40)
        .map(|i| {
            let (key, barrier) = (key.clone(), barrier.clone());
            let body = match i % 5 {
                4 => changed.to_vec(),
                n => forms[n].to_vec(),
            };
            tokio::spawn(async move {
                barrier.wait().await;
                (i, send(addr, &key, &json(&body)).await)
            })
        })
        .collect();
    for task in after {
        let (i, answer) = task.await.expect("task");
        if i % 5 == 4 {
            assert_eq!(answer.status, 422, "a changed body: {answer:?}");
        } else {
            assert!(
                answer.is_replay() && answer.body == first.body && answer.run == first.run,
                "retry {i}: {answer:?}"
            );
        }
    }
    assert_eq!(
        effects.count(),
        1,
        "a retry of a completed key ran the handler"
    );
}

/// DESIGN §7.3 and §2 (released -> claimable again): the first attempt fails retryably; then
/// 24 concurrent retries in two forms of the same body race for the released key (some read a
/// record that is not completed, some the one that completes meanwhile): exactly one runs,
/// every other answer is a 409 or a replay of that run, and afterwards every form replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_3_concurrent_takeover_in_two_forms_runs_once() {
    for round in 0..4 {
        let store = MemoryStore::new();
        let effects = Effects::default();
        let app = handler_app(layer(store.clone(), None), effects.clone(), Arc::default());
        let addr = serve(app).await;
        let key = unique("takeover");
        let canonical: &[u8] = br#"{"a":1}"#;
        let spaced: &[u8] = br#"{ "a" : 1 }"#;
        let failed = send(addr, &key, &json(canonical).header("x-fail", "1")).await;
        assert_eq!(failed.status, 500);
        assert_eq!(effects.count(), 1);
        let barrier = Arc::new(Barrier::new(24));
        let tasks: Vec<_> = (0..24)
            .map(|i| {
                let (key, barrier) = (key.clone(), barrier.clone());
                let body = if i % 2 == 0 { canonical } else { spaced }.to_vec();
                tokio::spawn(async move {
                    barrier.wait().await;
                    send(addr, &key, &json(&body)).await
                })
            })
            .collect();
        let mut answers = Vec::new();
        for task in tasks {
            answers.push(task.await.expect("task"));
        }
        assert_eq!(
            effects.count(),
            2,
            "round {round}: one run after the failed one"
        );
        let ran: Vec<&Answer> = answers
            .iter()
            .filter(|a| a.status == 201 && !a.is_replay())
            .collect();
        assert_eq!(ran.len(), 1, "round {round}: {answers:?}");
        let won = ran[0].clone();
        for a in &answers {
            assert!(
                a.status == 409 || (a.status == 201 && a.body == won.body),
                "round {round}: {a:?}"
            );
        }
        for form in [canonical, spaced] {
            let again = send(addr, &key, &json(form)).await;
            assert!(
                again.is_replay() && again.body == won.body,
                "round {round}: {again:?}"
            );
        }
        assert_eq!(effects.count(), 2);
    }
}

// ---------------------------------------------------------------------------------------------
// 7. Other stores and dialects.
// ---------------------------------------------------------------------------------------------

/// DESIGN §5 (one behaviour whatever the backend; a backend chosen at run time): `AnyStore`
/// forwards `completed_now` to its MemoryStore (the read answers), and through it a retry in
/// another form replays, a changed body is refused, the handler runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_any_store_reads_its_memory_store_and_answers_the_same() {
    let memory = MemoryStore::new();
    let any = Probe::new(AnyStore::Memory(memory.clone()), true);
    let effects = Effects::default();
    let app = handler_app(layer(any.clone(), None), effects.clone(), Arc::default());
    let addr = serve(app).await;
    let key = unique("any");
    let first = send(addr, &key, &json(br#"{"a":1,"b":2}"#)).await;
    assert_eq!(first.status, 201);
    for form in [
        &br#"{"a":1,"b":2}"#[..],
        br#"{"b":2,"a":1}"#,
        br#" {"a":1,"b":2}"#,
    ] {
        let again = send(addr, &key, &json(form)).await;
        assert!(again.is_replay() && again.body == first.body, "{again:?}");
    }
    let changed = send(addr, &key, &json(br#"{"a":1,"b":3}"#)).await;
    assert_eq!(changed.status, 422);
    assert_eq!(effects.count(), 1);
    assert_eq!(
        any.answered(),
        4,
        "AnyStore answered every retry from the read"
    );
    let k = kept(&memory, &key).await.expect("record");
    assert!(k.hint, "the canonical first body's hint is kept");
    // Straight through AnyStore, no wrapper: the same.
    let effects = Effects::default();
    let app = handler_app(
        layer(AnyStore::Memory(MemoryStore::new()), None),
        effects.clone(),
        Arc::default(),
    );
    let addr = serve(app).await;
    let first = send(addr, &key, &json(br#"{ "a": 1 }"#)).await;
    assert_eq!(first.status, 201);
    let again = send(addr, &key, &json(br#"{"a":1}"#)).await;
    assert!(again.is_replay() && again.body == first.body, "{again:?}");
    let again = send(addr, &key, &json(br#"{"a":1}"#)).await;
    assert!(again.is_replay() && again.body == first.body, "{again:?}");
    assert_eq!(send(addr, &key, &json(br#"{"a":2}"#)).await.status, 422);
    assert_eq!(effects.count(), 1);
}

const GRPC_POST: &str = "/zz.Counter/Add";

#[derive(Clone, Default)]
struct Counter {
    effects: Effects,
}

impl tonic::server::NamedService for Counter {
    const NAME: &'static str = "zz.Counter";
}

impl<B: Send + 'static> tower::Service<http::Request<B>> for Counter {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _req: http::Request<B>) -> Self::Future {
        let n = self.effects.hit();
        Box::pin(async move {
            let mut trailers = HeaderMap::new();
            trailers.insert("grpc-status", HeaderValue::from_static("0"));
            trailers.insert("x-run", HeaderValue::from(n));
            let frames = vec![
                Ok::<_, Infallible>(Frame::data(Bytes::from(grpc_frame(
                    format!("run {n}").as_bytes(),
                )))),
                Ok(Frame::trailers(trailers)),
            ];
            let body = StreamBody::new(futures_util::stream::iter(frames));
            let mut res = http::Response::new(tonic::body::Body::new(body));
            res.headers_mut()
                .insert("content-type", HeaderValue::from_static("application/grpc"));
            Ok(res)
        })
    }
}

async fn h2_call(
    addr: SocketAddr,
    key: &str,
    content_type: &str,
    message: &[u8],
) -> (StatusCode, HeaderMap, Bytes, Option<HeaderMap>) {
    guard("an HTTP/2 call", async {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (mut sender, connection) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(stream),
        )
        .await
        .expect("h2 handshake");
        tokio::spawn(connection);
        let request = http::Request::post(format!("http://{addr}{GRPC_POST}"))
            .header("content-type", content_type)
            .header("te", "trailers")
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from(grpc_frame(message))))
            .expect("request");
        let res = sender.send_request(request).await.expect("response");
        let (parts, body) = res.into_parts();
        match body.collect().await {
            Ok(collected) => {
                let trailers = collected.trailers().cloned();
                (parts.status, parts.headers, collected.to_bytes(), trailers)
            }
            Err(_reset) => (parts.status, parts.headers, Bytes::new(), None),
        }
    })
    .await
}

fn grpc_status(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> Option<String> {
    headers
        .get("grpc-status")
        .or_else(|| trailers.and_then(|t| t.get("grpc-status")))
        .map(|v| v.to_str().expect("ascii").to_owned())
}

/// DESIGN §1 step 4 ("gRPC as the raw message bytes plus the method path") and step 6 (stored
/// response + trailers with `idempotency-replayed`; a different message `INVALID_ARGUMENT` or
/// `FAILED_PRECONDITION`): gRPC calls on a MemoryStore, answered from the read (a message that
/// happens to be canonical JSON included), replay the same message and refuse another, with the
/// read as without it, and the method runs once per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_6_grpc_calls_answered_from_the_read() {
    let mut seen = Vec::new();
    for read in [true, false] {
        let store = Probe::new(MemoryStore::new(), read);
        let counter = Counter::default();
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let layer = IdempotencyLayer::new_for_grpc(store.clone())
            .single_tenant()
            .grpc_method(GRPC_POST, |m| m.record_refusals(true));
        let server = tonic::transport::Server::builder()
            .layer(layer)
            .add_service(counter.clone())
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
        tokio::spawn(async move { server.await.expect("grpc server") });
        let mut answers = Vec::new();
        for (i, message) in [&br#"{"a":1}"#[..], b"\x00\x01binary"].iter().enumerate() {
            let key = unique("grpc");
            let (status, _, body, trailers) =
                h2_call(addr, &key, "application/grpc", message).await;
            assert_eq!(status, StatusCode::OK);
            assert_eq!(
                grpc_status(&HeaderMap::new(), trailers.as_ref()).as_deref(),
                Some("0")
            );
            let (_, headers2, body2, trailers2) =
                h2_call(addr, &key, "application/grpc", message).await;
            assert_eq!(headers2["idempotency-replayed"], "true", "read={read} {i}");
            assert_eq!(body2, body, "read={read} {i}: the message bytes");
            assert_eq!(
                trailers2.as_ref().and_then(|t| t.get("x-run")),
                trailers.as_ref().and_then(|t| t.get("x-run")),
                "read={read} {i}: the trailers"
            );
            // The same bytes sent as another content type, and another message.
            let (_, h3, _, t3) = h2_call(addr, &key, "application/grpc+proto", message).await;
            let (_, h4, _, t4) = h2_call(addr, &key, "application/grpc", b"{ \"a\": 1 }").await;
            for (what, code) in [
                ("another subtype", grpc_status(&h3, t3.as_ref())),
                ("another message", grpc_status(&h4, t4.as_ref())),
            ] {
                let code = code.expect("a grpc-status");
                assert!(
                    code == "3" || code == "9",
                    "read={read} {i}: {what} must be refused, got {code}"
                );
            }
            let k = kept(&store, &key).await.expect("record");
            answers.push((body, k.events));
        }
        assert_eq!(counter.effects.count(), 2, "read={read}: one run per key");
        if read {
            assert!(
                store.answered() >= 6,
                "the read answered: {}",
                store.answered()
            );
        }
        // Bodies name the run; compare the shape and the history.
        seen.push(answers);
    }
    assert_eq!(
        seen[0], seen[1],
        "gRPC answers and histories with and without the read"
    );
}

/// DESIGN §1 step 6 ("store unreachable / errors: 503 + Retry-After, nothing run (fail
/// closed)") and §5 (a third-party store written against the trait): a wrapper store that does
/// not override `completed_now` (the test suite's fault injector) keeps failing closed for a
/// completed key while it is down, and replays once it is back; the handler runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_6_a_wrapper_without_completed_now_still_fails_closed() {
    let store = common::FlakyStore::new(MemoryStore::new());
    let effects = Effects::default();
    let app = handler_app(layer(store.clone(), None), effects.clone(), Arc::default());
    let addr = serve(app).await;
    let key = unique("down");
    let first = send(addr, &key, &json(br#"{"a":1}"#)).await;
    assert_eq!(first.status, 201);
    store.down.store(true, Ordering::SeqCst);
    let down = send(addr, &key, &json(br#"{"a":1}"#)).await;
    assert_eq!(down.status, 503, "{down:?}");
    assert!(!down.is_replay());
    store.down.store(false, Ordering::SeqCst);
    let back = send(addr, &key, &json(br#"{ "a": 1 }"#)).await;
    assert!(back.is_replay() && back.body == first.body, "{back:?}");
    assert_eq!(effects.count(), 1);
}
