//! A retry of a finished request answered from reads: the record's fingerprint before the
//! request's (`IdempotencyStore::recorded_fingerprint_now`, for its hint: a body hashed as sent
//! is recognised by hashing it as sent), then the record after it
//! (`IdempotencyStore::completed_now`, in place of a claim). DESIGN §1 steps 4–6 must answer
//! exactly as a claim would. Every case is sent, over TCP, to the layer on a `MemoryStore`
//! (which reads) and on the same store behind a wrapper that does not (`Faulty` leaves both to
//! the trait's defaults): statuses, bodies, markers and the effects counted in the handler must
//! agree.

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use bytes::Bytes;
use common::{Effects, FlakyStore, TestClock, client, serve};
use http::StatusCode;
use tokio::sync::Barrier;
use tower_idempotency::fingerprint::JsonFields;
use tower_idempotency::store::{HistoryEvent, ScopedKey};
use tower_idempotency::{IdempotencyLayer, IdempotencyStore, MemoryStore};

/// What a client saw: status, replay marker, problem type (if any) and body.
#[derive(Debug, PartialEq)]
struct Seen {
    status: StatusCode,
    replayed: Option<String>,
    body: Bytes,
}

/// The handler: one effect per run, answered with its number and the body it got.
fn app<St: IdempotencyStore>(
    layer: IdempotencyLayer<St, tower_idempotency::scope::SingleTenant>,
    effects: Effects,
) -> Router {
    Router::new()
        .route(
            "/op",
            post(move |body: Bytes| {
                let effects = effects.clone();
                async move {
                    let n = effects.hit();
                    (
                        StatusCode::CREATED,
                        format!("run {n}: {}", String::from_utf8_lossy(&body)),
                    )
                }
            }),
        )
        .layer(layer)
}

async fn send(addr: SocketAddr, key: &str, content_type: &str, body: &[u8]) -> Seen {
    let res = client()
        .post(format!("http://{addr}/op"))
        .header("idempotency-key", key)
        .header("content-type", content_type)
        .body(body.to_vec())
        .send()
        .await
        .expect("send");
    let status = res.status();
    let replayed = res
        .headers()
        .get("idempotency-replayed")
        .map(|v| v.to_str().expect("ascii").to_owned());
    Seen {
        status,
        replayed,
        body: res.bytes().await.expect("body"),
    }
}

const JSON: &str = "application/json";

/// (name, first content type, first body, retry content type, retry body)
type Case = (
    &'static str,
    &'static str,
    &'static [u8],
    &'static str,
    &'static [u8],
);

#[rustfmt::skip]
const CASES: &[Case] = &[
    ("same canonical bytes", JSON, br#"{"a":1,"b":[true,null]}"#, JSON, br#"{"a":1,"b":[true,null]}"#),
    ("canonical, then spaced", JSON, br#"{"a":1}"#, JSON, br#"{ "a" : 1 }"#),
    ("canonical, then reordered", JSON, br#"{"a":1,"b":2}"#, JSON, br#"{"b":2,"a":1}"#),
    ("spaced, then canonical", JSON, br#"{ "a": 1 }"#, JSON, br#"{"a":1}"#),
    ("spaced, then the same spacing", JSON, br#"{ "a": 1 }"#, JSON, br#"{ "a": 1 }"#),
    ("canonical, then another value", JSON, br#"{"a":1}"#, JSON, br#"{"a":2}"#),
    ("canonical, then one byte longer", JSON, br#"{"a":"x"}"#, JSON, br#"{"a":"xx"}"#),
    ("canonical, then malformed", JSON, br#"{"a":1}"#, JSON, br#"{"a":1"#),
    ("canonical, then not UTF-8", JSON, br#"{"a":"x"}"#, JSON, b"{\"a\":\"\xff\"}"),
    ("canonical, then trailing space", JSON, br#"{"a":1}"#, JSON, b"{\"a\":1} "),
    ("canonical, then text/plain", JSON, br#"{"a":1}"#, "text/plain", br#"{"a":1}"#),
    ("canonical, then a charset", JSON, br#"{"a":1}"#, "application/json; charset=utf-8", br#"{"a":1}"#),
    ("canonical, then +json", JSON, br#"{"a":1}"#, "application/vnd.x+json", br#"{"a":1}"#),
    ("escape written short, then long", JSON, br#"{"a":"\n"}"#, JSON, br#"{"a":"\u000a"}"#),
    ("escaped name, the same bytes", JSON, br#"{"\u0061":1}"#, JSON, br#"{"\u0061":1}"#),
    ("escaped name, then plain", JSON, br#"{"\u0061":1}"#, JSON, br#"{"a":1}"#),
    ("1.0, then 1", JSON, br#"{"n":1.0}"#, JSON, br#"{"n":1}"#),
    ("1, then 1.0", JSON, br#"{"n":1}"#, JSON, br#"{"n":1.0}"#),
    ("a long number, the same bytes", JSON, br#"{"n":12345678901234567890}"#, JSON, br#"{"n":12345678901234567890}"#),
    ("duplicate names, the same bytes", JSON, br#"{"a":1,"a":2}"#, JSON, br#"{"a":1,"a":2}"#),
    ("duplicate names, then the last", JSON, br#"{"a":1,"a":2}"#, JSON, br#"{"a":2}"#),
    ("empty, then empty", JSON, b"", JSON, b""),
    ("empty, then {}", JSON, b"", JSON, b"{}"),
    ("text, then the same text", "text/plain", b"hello", "text/plain", b"hello"),
    ("text, then JSON of it", "text/plain", br#"{"a":1}"#, JSON, br#"{"a":1}"#),
    ("a bare string", JSON, br#""s""#, JSON, br#""s""#),
    ("an array, then spaced", JSON, br#"[1,2,3]"#, JSON, br#"[ 1, 2, 3 ]"#),
];

/// DESIGN §1 steps 4–6: with the read and without it, every retry gets the same answer and no
/// more effects (a fingerprint merged or split by the hint would differ here).
#[tokio::test]
async fn s1_a_read_answers_every_retry_as_a_claim_would() {
    let (fast_effects, plain_effects) = (Effects::default(), Effects::default());
    let fast = serve(app(
        IdempotencyLayer::new(MemoryStore::new()).single_tenant(),
        fast_effects.clone(),
    ))
    .await;
    let plain = serve(app(
        IdempotencyLayer::new(FlakyStore::new(MemoryStore::new())).single_tenant(),
        plain_effects.clone(),
    ))
    .await;
    let mut replays = 0;
    for (i, (name, ct1, first, ct2, retry)) in CASES.iter().enumerate() {
        let key = format!("case-{i}");
        let a1 = send(fast, &key, ct1, first).await;
        let b1 = send(plain, &key, ct1, first).await;
        assert_eq!(a1, b1, "{name}: first answers");
        let a2 = send(fast, &key, ct2, retry).await;
        let b2 = send(plain, &key, ct2, retry).await;
        assert_eq!(a2, b2, "{name}: retries");
        // And a third, byte-identical to the first: the hint of the first body still holds.
        let a3 = send(fast, &key, ct1, first).await;
        let b3 = send(plain, &key, ct1, first).await;
        assert_eq!(a3, b3, "{name}: a retry as first sent");
        if a1.status == StatusCode::CREATED {
            assert_eq!(a3.replayed.as_deref(), Some("true"), "{name}: replayed");
            assert_eq!(a3.body, a1.body, "{name}: the first answer's bytes");
            replays += 1;
        }
        assert_eq!(
            fast_effects.count(),
            plain_effects.count(),
            "{name}: effects at the sink"
        );
    }
    // The cases ran their handlers: the differential compared replays, not refusals only.
    assert!(
        replays >= CASES.len() - 2,
        "{replays} of {} cases replayed",
        CASES.len()
    );
    assert_eq!(fast_effects.count(), replays);
}

/// DESIGN §1 step 4 with a route that counts only some JSON fields: the read changes nothing
/// there either (its fingerprints are never hashed as sent).
#[tokio::test]
async fn s1_json_field_routes_answer_alike_with_the_read() {
    let fields = || JsonFields::include(["/amount"]).expect("pointer");
    let (fast_effects, plain_effects) = (Effects::default(), Effects::default());
    let fast = serve(app(
        IdempotencyLayer::new(MemoryStore::new())
            .single_tenant()
            .defaults(|route| route.fingerprint_json(fields())),
        fast_effects.clone(),
    ))
    .await;
    let plain = serve(app(
        IdempotencyLayer::new(FlakyStore::new(MemoryStore::new()))
            .single_tenant()
            .defaults(|route| route.fingerprint_json(fields())),
        plain_effects.clone(),
    ))
    .await;
    let bodies: [&[u8]; 4] = [
        br#"{"amount":1,"note":"a"}"#,
        br#"{"amount":1,"note":"b"}"#,
        br#"{"amount":2,"note":"a"}"#,
        br#"{"amount":1,"note":"a"}"#,
    ];
    for body in bodies {
        let a = send(fast, "fields", JSON, body).await;
        let b = send(plain, "fields", JSON, body).await;
        assert_eq!(a, b, "{}", String::from_utf8_lossy(body));
    }
    assert_eq!(fast_effects.count(), 1);
    assert_eq!(plain_effects.count(), 1);
}

/// DESIGN §1 step 6, "completed but expired: treated as absent": a record read past its TTL
/// is not replayed; the retry runs, once.
#[tokio::test]
async fn s6_an_expired_record_is_not_answered_from_the_read() {
    let clock = TestClock::default();
    let effects = Effects::default();
    let addr = serve(app(
        IdempotencyLayer::new(clock.store())
            .single_tenant()
            .defaults(|route| route.ttl(Duration::from_secs(60))),
        effects.clone(),
    ))
    .await;
    let body = br#"{"a":1}"#;
    let first = send(addr, "ttl", JSON, body).await;
    assert_eq!(send(addr, "ttl", JSON, body).await.body, first.body);
    clock.advance(Duration::from_secs(61));
    let again = send(addr, "ttl", JSON, body).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.replayed, None, "run again, not replayed");
    assert_eq!(effects.count(), 2);
    assert_eq!(send(addr, "ttl", JSON, body).await.body, again.body);
    assert_eq!(effects.count(), 2);
}

/// DESIGN §1 step 6 on a route that notes refusals: answers from the read are noted in the
/// key's history as a claim's are (a replay, a mismatch).
#[tokio::test]
async fn s6_answers_from_the_read_are_noted_in_the_history() {
    let store = Arc::new(MemoryStore::new());
    let effects = Effects::default();
    let addr = serve(app(
        IdempotencyLayer::from_arc(store.clone())
            .single_tenant()
            .record_refusals(true),
        effects.clone(),
    ))
    .await;
    send(addr, "noted", JSON, br#"{"a":1}"#).await;
    let replay = send(addr, "noted", JSON, br#"{"a":1}"#).await;
    assert_eq!(replay.replayed.as_deref(), Some("true"));
    let mismatch = send(addr, "noted", JSON, br#"{"a":2}"#).await;
    assert_eq!(mismatch.status, StatusCode::UNPROCESSABLE_ENTITY);
    // Noted before the answer is sent: the history holds both now.
    let key = ScopedKey::new("", "noted");
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    let history: Vec<_> = record.history.iter().map(|h| h.event).collect();
    let count = |event| history.iter().filter(|e| **e == event).count();
    assert_eq!(count(HistoryEvent::Replayed), 1, "{history:?}");
    assert_eq!(count(HistoryEvent::Mismatch), 1, "{history:?}");
    assert_eq!(effects.count(), 1);
}

/// DESIGN §1 steps 5–6 under a crowd: once the first run is recorded, concurrent retries (the
/// same bytes and reordered ones, on fresh connections, released together) all replay it and
/// run nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_a_crowd_of_retries_after_the_outcome_runs_nothing() {
    let effects = Effects::default();
    let addr = serve(app(
        IdempotencyLayer::new(MemoryStore::new()).single_tenant(),
        effects.clone(),
    ))
    .await;
    let first = send(addr, "crowd", JSON, br#"{"a":1,"b":2}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let barrier = Arc::new(Barrier::new(32));
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                let body: &[u8] = if i % 2 == 0 {
                    br#"{"a":1,"b":2}"#
                } else {
                    br#"{ "b": 2, "a": 1 }"#
                };
                send(addr, "crowd", JSON, body).await
            })
        })
        .collect();
    for task in tasks {
        let seen = task.await.expect("task");
        assert_eq!(seen.status, StatusCode::CREATED);
        assert_eq!(seen.replayed.as_deref(), Some("true"));
        assert_eq!(seen.body, first.body);
    }
    assert_eq!(effects.count(), 1);
}
