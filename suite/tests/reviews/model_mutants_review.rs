//! Review of `model_differential.rs` by mutation testing the hot path's shortcuts: what its
//! seeded sequences let through, closed here with exhaustive, deterministic cases.
//!
//! When this review ran, the model's generator drew method, path and one of 32 bodies
//! independently for every step, and a key keeps the fingerprint of its first request: of its
//! 1 440 steps per store, about 87% were 422 mismatches and 0.4% (six steps) replays, so two
//! spellings of one request met only when a draw paired them on one key, method and path.
//! (Since, two steps in three on a held key retry the request that holds it, spelled anew:
//! about 57% replays.) Mutants it let through, each caught here on every store:
//!
//! - `form.rs`: `+` not decoded when a piece has no `%` (the borrowed shortcut);
//! - `fingerprint/mod.rs`: media-type parameters dropped, any JSON `charset` dropped, a media
//!   type lower-cased only when its first byte is upper case;
//! - `json.rs`: duplicate member names merged, 16-digit integers taken as short (exact);
//! - `memory/mod.rs`: `completed_now` answering a record that is not completed.
//!
//! Every case uses a fresh key, so each answer is predicted from the contract alone, and every
//! execution is counted at the sink (the handler).
#![allow(missing_docs)]

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use common::model::{Answer, Call, Sink, app, route, send};
use common::{problem_type, serve};
use futures_util::FutureExt;
use tower_idempotency::store::{Claim, ClaimRequest, ScopedKey};
use tower_idempotency::{
    IdempotencyLayer, IdempotencyStore, LeaseExpiry, MalformedBody, MemoryStore,
};

// ---------------------------------------------------------------------------------------------
// Operations, each written several ways, in families of near neighbours.
// ---------------------------------------------------------------------------------------------

const JSON: &str = "application/json";
const FORM: &str = "application/x-www-form-urlencoded";

/// One operation: every spelling is the same request (DESIGN §1 step 4: JSON member order,
/// whitespace and number spelling do not count; form pairs are decoded and sorted; media type
/// and parameter names are case-insensitive, so are charset values, quoting does not count, and JSON's
/// `charset=utf-8` changes nothing). Two operations of one family differ in one thing the
/// contract says counts: a media-type parameter, a value, raw bytes where there is no exact
/// canonical form (a duplicate name, an integer beyond 2^53).
struct Operation {
    family: &'static str,
    spellings: &'static [(&'static str, &'static str)],
}

const fn op(family: &'static str, spellings: &'static [(&'static str, &'static str)]) -> Operation {
    Operation { family, spellings }
}

const OPERATIONS: &[Operation] = &[
    op(
        "document",
        &[
            (JSON, r#"{"amount":100,"currency":"eur"}"#),
            (JSON, r#"{"currency":"eur","amount":100}"#),
            (JSON, "{ \"amount\" : 1e2 , \"currency\" : \"\\u0065ur\" }"),
            (
                "application/json; charset=utf-8",
                r#"{"amount":100.0,"currency":"eur"}"#,
            ),
            (
                "application/json;charset=\"UTF-8\"",
                r#"{"amount":100,"currency":"eur"}"#,
            ),
            ("Application/JSON", r#"{"currency":"eur","amount":100}"#),
            ("application/JSON", r#"{"amount":100,"currency":"eur"}"#),
            (
                "APPLICATION/json ; Charset=utf-8",
                r#"{"amount":100,"currency":"eur"}"#,
            ),
        ],
    ),
    op(
        "document",
        &[
            (
                "application/json; charset=latin1",
                r#"{"amount":100,"currency":"eur"}"#,
            ),
            (
                "application/json;charset=\"latin1\"",
                r#"{"currency":"eur","amount":100}"#,
            ),
            (
                "application/json; CHARSET=latin1",
                r#"{ "amount": 100, "currency": "eur" }"#,
            ),
            (
                "application/json; charset=LATIN1",
                r#"{"amount":1e2,"currency":"eur"}"#,
            ),
        ],
    ),
    op(
        "document",
        &[
            (
                "application/json; profile=\"https://example.com/v2\"",
                r#"{"amount":100,"currency":"eur"}"#,
            ),
            (
                "application/json;profile=https://example.com/v2",
                r#"{"currency":"eur","amount":100}"#,
            ),
        ],
    ),
    op(
        "document",
        &[
            (
                "application/merge-patch+json",
                r#"{"amount":100,"currency":"eur"}"#,
            ),
            (
                "application/merge-patch+json; charset=utf-8",
                r#"{"currency":"eur","amount":100}"#,
            ),
        ],
    ),
    op(
        "document",
        &[
            (JSON, r#"{"amount":100,"currency":"usd"}"#),
            (JSON, r#"{"currency":"usd","amount":100}"#),
        ],
    ),
    // Duplicate names: no exact canonical form, so each text is its own request.
    op("duplicates", &[(JSON, r#"{"a":1,"a":2}"#)]),
    op("duplicates", &[(JSON, r#"{"a":2,"a":1}"#)]),
    op("duplicates", &[(JSON, r#"{"a":1, "a":2}"#)]),
    op(
        "duplicates",
        &[(JSON, r#"{"a":2}"#), (JSON, r#"{ "a" : 2 }"#)],
    ),
    // 2^53 + 1 has no exact double: each text its own request; 2^53 is exact, however written.
    op("numbers", &[(JSON, r#"{"n":9007199254740993}"#)]),
    op("numbers", &[(JSON, r#"{"n": 9007199254740993}"#)]),
    op(
        "numbers",
        &[
            (JSON, r#"{"n":9007199254740992}"#),
            (JSON, r#"{"n": 9007199254740992}"#),
            (JSON, r#"{"n":9007199254740992.0}"#),
            (JSON, r#"{"n":9.007199254740992e15}"#),
        ],
    ),
    // `+` is a space; `%2B` is a plus.
    op(
        "forms",
        &[
            (FORM, "a=1&b=two+words"),
            (FORM, "b=two%20words&a=%31"),
            (FORM, "b=two+words&a=1"),
        ],
    ),
    op(
        "forms",
        &[(FORM, "a=1&b=two%2Bwords"), (FORM, "b=two%2bwords&a=1")],
    ),
    // Other media types: their parameters count, names case-insensitive, quoting not.
    op("text", &[("text/plain", "hello")]),
    op(
        "text",
        &[
            ("text/plain; charset=latin1", "hello"),
            ("text/plain;charset=\"latin1\"", "hello"),
            ("TEXT/PLAIN; CHARSET=latin1", "hello"),
            ("text/plain; charset=Latin1", "hello"),
            ("text/plain; charset=\"LATIN1\"", "hello"),
        ],
    ),
    op(
        "text",
        &[
            ("text/plain; charset=latin1; format=flowed", "hello"),
            ("text/plain; format=flowed; charset=latin1", "hello"),
        ],
    ),
];

/// Every spelling: (operation, content type, body).
fn spellings() -> Vec<(usize, &'static str, &'static str)> {
    OPERATIONS
        .iter()
        .enumerate()
        .flat_map(|(i, o)| o.spellings.iter().map(move |&(ct, b)| (i, ct, b)))
        .collect()
}

const METHODS: &[&str] = &["POST", "PATCH"];
const PATHS: &[&str] = &["/a", "/v1/a", "/b?x=1"];

// ---------------------------------------------------------------------------------------------
// 1. Every ordered pair of spellings in a family, on every store.
// ---------------------------------------------------------------------------------------------

/// DESIGN §1 step 4 (canonical JSON and forms; "media-type parameters count"; a value with no
/// exact canonical form "is hashed by its raw bytes in its own domain") and step 6 (same
/// fingerprint: replay of the stored answer; different: 422, nothing run): for every ordered
/// pair of spellings of one family, under a fresh key, the first runs once, the second replays
/// its answer (same operation) or is refused 422 (another), and the first sent again replays.
/// Exhaustive where `model_differential.rs` samples: a pair is met on every run, on every
/// store.
async fn every_pair_answers_as_the_contract_says<St: IdempotencyStore + Clone>(
    store: St,
    name: &str,
) {
    let sink = Sink::default();
    let addr = serve(app(store, sink.clone())).await;
    let run = common::batching::unique(&format!("pairs-{name}"));
    let all = spellings();
    let mut pairs = Vec::new();
    for (i, first) in all.iter().enumerate() {
        for (j, second) in all.iter().enumerate() {
            if OPERATIONS[first.0].family == OPERATIONS[second.0].family {
                pairs.push((i, j));
            }
        }
    }
    // Lanes of pairs sent one after another, the lanes at once.
    const LANES: usize = 6;
    let lanes = (0..LANES).map(|lane| {
        let (sink, run, all) = (sink.clone(), run.clone(), all.clone());
        let pairs: Vec<(usize, usize)> = pairs.iter().copied().skip(lane).step_by(LANES).collect();
        let name = name.to_owned();
        async move {
            let client = common::client();
            let mut wrong = Vec::new();
            for (n, &(i, j)) in pairs.iter().enumerate() {
                let (first, second) = (all[i], all[j]);
                let key = format!("k-{lane}-{n}");
                let tenant = format!("{run}-{}", n % 2);
                let base = Call {
                    tenant: &tenant,
                    key: &key,
                    method: METHODS[(i + j) % METHODS.len()],
                    path: PATHS[(i * 7 + j) % PATHS.len()],
                    content_type: first.1,
                    body: first.2,
                    outcome: "ok",
                };
                let what = format!(
                    "{name}: {} {} then {:?} {:?} then {:?} {:?}",
                    base.method, base.path, first.1, first.2, second.1, second.2
                );
                let live = send(&client, addr, base).await;
                if (live.status, sink.runs(&tenant, &key)) != (201, 1) || live.is_replay() {
                    wrong.push(format!(
                        "{what}: the first ran: {} {:?}",
                        live.status, live.bytes
                    ));
                    continue;
                }
                let retry = Call {
                    content_type: second.1,
                    body: second.2,
                    ..base
                };
                let answer = send(&client, addr, retry).await;
                let same = first.0 == second.0;
                let ok = match same {
                    true => {
                        answer.status == 201
                            && answer.is_replay()
                            && answer.bytes == live.bytes
                            && answer.run == live.run
                    }
                    false => {
                        answer.status == 422
                            && answer.problem_type() == problem_type("fingerprint-mismatch")
                    }
                };
                if !ok || sink.runs(&tenant, &key) != 1 {
                    wrong.push(format!(
                        "{what}: expected {}, got {} replayed {:?} {:?}, runs {}",
                        if same { "a replay" } else { "422" },
                        answer.status,
                        answer.replayed,
                        answer.bytes,
                        sink.runs(&tenant, &key)
                    ));
                    continue;
                }
                let again = send(&client, addr, base).await;
                if !(again.status == 201 && again.is_replay() && again.bytes == live.bytes)
                    || sink.runs(&tenant, &key) != 1
                {
                    wrong.push(format!(
                        "{what}: the first again: {} replayed {:?} {:?}, runs {}",
                        again.status,
                        again.replayed,
                        again.bytes,
                        sink.runs(&tenant, &key)
                    ));
                }
            }
            wrong
        }
    });
    let wrong: Vec<String> = futures_util::future::join_all(lanes)
        .await
        .into_iter()
        .flatten()
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of {} pairs answered against the contract:\n{}",
        wrong.len(),
        pairs.len(),
        wrong.join("\n")
    );
    assert_eq!(
        sink.total(),
        pairs.len(),
        "{name}: one run per pair, in all"
    );
}

common::on_every_store!(every_pair_answers_as_the_contract_says);

// ---------------------------------------------------------------------------------------------
// 2. Every spelling of an operation at once.
// ---------------------------------------------------------------------------------------------

/// DESIGN §7.3 (concurrent requests with one key: exactly one effect, every other answer a
/// replay or 409) with §1 step 4 and §2 (released -> claimable again): for every operation,
/// (a) after it completed, all its spellings sent at once each replay its bytes; (b) after a
/// first attempt failed (503, released), all its spellings sent at once race for the key:
/// exactly one runs, each other gets that run's replay or "in flight", and afterwards every
/// spelling replays it.
async fn spellings_at_once_share_one_run<St: IdempotencyStore + Clone>(store: St, name: &str) {
    let sink = Sink::default();
    let addr = serve(app(store, sink.clone())).await;
    let tenant = common::batching::unique(&format!("at-once-{name}"));
    let client = common::client();
    let mut expected = 0;
    for (o, operation) in OPERATIONS.iter().enumerate() {
        for (case, first_outcome) in [(0, "ok"), (1, "fail")] {
            let key = format!("op{o}-{case}");
            let what = format!(
                "{name}: {operation_spellings:?}, first {first_outcome}",
                operation_spellings = operation.spellings
            );
            let (ct, body) = operation.spellings[0];
            let base = Call {
                tenant: &tenant,
                key: &key,
                method: "POST",
                path: PATHS[o % PATHS.len()],
                content_type: ct,
                body,
                outcome: first_outcome,
            };
            // A released key runs once more; a completed one never.
            let runs = if first_outcome == "ok" { 1 } else { 2 };
            expected += runs;
            let first = send(&client, addr, base).await;
            assert_eq!(sink.runs(&tenant, &key), 1, "{what}: the first ran once");
            let answers = futures_util::future::join_all(operation.spellings.iter().map(
                |&(content_type, body)| {
                    send(
                        &client,
                        addr,
                        Call {
                            content_type,
                            body,
                            outcome: "ok",
                            ..base
                        },
                    )
                },
            ))
            .await;
            assert_eq!(
                sink.runs(&tenant, &key),
                runs,
                "{what}: runs after the race"
            );
            let live = match first_outcome {
                "ok" => {
                    assert_eq!(first.status, 201, "{what}");
                    &first
                }
                _ => {
                    assert_eq!(first.status, 503, "{what}");
                    let live: Vec<&Answer> = answers
                        .iter()
                        .filter(|a| !a.is_replay() && a.status != 409)
                        .collect();
                    assert_eq!(live.len(), 1, "{what}: one live answer");
                    assert_eq!(live[0].status, 201, "{what}");
                    for a in answers.iter().filter(|a| a.status == 409) {
                        assert_eq!(a.problem_type(), problem_type("in-flight"), "{what}");
                    }
                    live[0]
                }
            };
            for a in answers.iter().filter(|a| a.is_replay()) {
                assert_eq!(
                    (a.status, &a.bytes, &a.run),
                    (live.status, &live.bytes, &live.run),
                    "{what}: a replay is the run's answer"
                );
            }
            if first_outcome == "ok" {
                assert!(
                    answers.iter().all(Answer::is_replay),
                    "{what}: every spelling replays"
                );
            }
            for &(content_type, body) in operation.spellings {
                let a = send(
                    &client,
                    addr,
                    Call {
                        content_type,
                        body,
                        ..base
                    },
                )
                .await;
                assert!(
                    a.is_replay() && a.status == live.status && a.bytes == live.bytes,
                    "{what}: {content_type:?} {body:?} afterwards: {} {:?}",
                    a.status,
                    a.bytes
                );
            }
            assert_eq!(sink.runs(&tenant, &key), runs, "{what}");
        }
    }
    assert_eq!(sink.total(), expected, "{name}: runs in all");
}

common::on_every_store!(spellings_at_once_share_one_run);

// ---------------------------------------------------------------------------------------------
// 3. The replay read after the fingerprint decides as a claim would.
// ---------------------------------------------------------------------------------------------

/// DESIGN §1 ("in this order and no other": 4 fingerprint, 5 claim, 6 decide from the claim)
/// and §2 (released: "claimable again"): a MemoryStore answers a retry of a completed record
/// from a read made after the fingerprint (`completed_now`), in place of the claim. If, while
/// the request is fingerprinted, the record is replaced and then released by another holder
/// of the same request, the read must not decide from that released record (it is not
/// completed): the claim takes the key over and the handler runs, once. Deciding from the read
/// answered 409 "in flight" for a key no one holds.
///
/// The canonicaliser stands for the concurrent holder: it runs between the read before the
/// fingerprint and the read after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_released_while_the_request_is_fingerprinted_is_claimed_and_run() {
    const RACE: &str = "application/x-race";
    let store = MemoryStore::new();
    let sink = Sink::default();
    let key = common::batching::unique("released-while-fingerprinted");
    let armed = Arc::new(AtomicBool::new(false));
    let holder = {
        let (store, key, armed) = (store.clone(), key.clone(), armed.clone());
        move |body: &[u8]| -> Result<Vec<u8>, MalformedBody> {
            if armed.swap(false, Ordering::SeqCst) {
                let scoped = ScopedKey::new("", &key);
                // The completed record's fingerprint: this very request's.
                let fingerprint = store
                    .recorded_fingerprint_now(&scoped)
                    .expect("the completed record");
                let removed = store.remove(&scoped).now_or_never().expect("at once");
                assert!(removed.expect("remove"), "the record was there");
                let claim = ClaimRequest {
                    key: scoped.clone(),
                    fingerprint,
                    lease: Duration::from_secs(60),
                    ttl: Duration::from_secs(3600),
                    on_lease_expiry: LeaseExpiry::Reclaim,
                };
                let Some(Ok(Claim::Acquired(lease))) = store.claim_now(&claim) else {
                    panic!("the other holder's claim");
                };
                store
                    .release(&scoped, lease.token)
                    .now_or_never()
                    .expect("at once")
                    .expect("release");
            }
            Ok(body.to_vec())
        }
    };
    let app = Router::new().route("/a", route(sink.clone())).layer(
        IdempotencyLayer::new(store.clone())
            .single_tenant()
            .canonicalize(RACE, holder),
    );
    let addr = serve(app).await;
    let client = common::client();
    let request = Call {
        tenant: "",
        key: &key,
        method: "POST",
        path: "/a",
        content_type: RACE,
        body: "payload",
        outcome: "ok",
    };
    let first = send(&client, addr, request).await;
    assert_eq!((first.status, sink.runs("", &key)), (201, 1));
    let replay = send(&client, addr, request).await;
    assert!(replay.is_replay() && replay.bytes == first.bytes);
    armed.store(true, Ordering::SeqCst);
    let raced = send(&client, addr, request).await;
    assert!(!armed.load(Ordering::SeqCst), "the canonicaliser ran");
    assert_eq!(
        (raced.status, raced.replayed.as_deref(), sink.runs("", &key)),
        (201, None, 2),
        "a released key is claimed and run: {:?}",
        raced.bytes
    );
    let after = send(&client, addr, request).await;
    assert!(after.is_replay() && after.bytes == raced.bytes);
    assert_eq!(sink.runs("", &key), 2);
}
