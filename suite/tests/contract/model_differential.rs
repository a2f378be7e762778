//! The whole pipeline against a model of the contract: seeded random sequences of requests,
//! sent over real HTTP by several clients at once, each answer compared with what an
//! independent reading of DESIGN §1 steps 1–9 and §3 predicts, and every execution counted at
//! the sink. The model shares no code with the crate: JSON is made canonical by
//! `serde_json_canonicalizer` (RFC 8785), forms by `form_urlencoded`, keys and media types by
//! the rules as the contract and the fingerprint's documentation state them.
//!
//! What it attacks: every shortcut issue 23 put on the hot path (a replay answered from a read
//! and a body recognised as sent, a key's hash remembered per thread, batched claims and
//! completions) must decide exactly as the plain pipeline would, for every store: the same
//! request (however its JSON or form is spelled) replays, a different one (a byte of a value,
//! another path, query, nest prefix or media type, a duplicate JSON name, a number beyond 2^53)
//! is refused 422, a scope never sees another's record, and a handler runs once per definitive
//! outcome. Some steps are bursts, three copies sent at once: one runs, each other copy gets its
//! replay or "in flight" (§7.3), whichever shortcut it took.
#![allow(missing_docs)]

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use axum::body::Bytes;
use common::model::{Answer, Call, Sink, app, at_once, exact, stream_seed};
use common::{Rng, TestClock, problem_type, serve};
use tower_idempotency::IdempotencyStore;

/// A body as sent, and its identity in the model's fingerprint.
struct Body {
    content_type: &'static str,
    bytes: &'static str,
}

const fn body(content_type: &'static str, bytes: &'static str) -> Body {
    Body {
        content_type,
        bytes,
    }
}

/// The bodies the generator draws from. Spellings of one JSON document, one form, and
/// documents or forms that differ in one value; bodies whose JSON has no exact canonical form
/// (a duplicate name, a number beyond 2^53), which must never merge; media types that differ
/// only in a parameter the fingerprint drops (JSON's `charset=utf-8`) or keeps (any other); and a body that
/// claims to be JSON and is not.
const BODIES: &[Body] = &[
    body("application/json", r#"{"amount":100,"currency":"eur"}"#),
    body("application/json", r#"{"currency":"eur","amount":100}"#),
    body(
        "application/json",
        "{ \"amount\" : 100 ,\n \"currency\":\"eur\" }",
    ),
    body(
        "application/json",
        r#"{"amount":1e2,"currency":"\u0065ur"}"#,
    ),
    body("application/json", r#"{"amount":100.0,"currency":"eur"}"#),
    body(
        "application/json; charset=utf-8",
        r#"{"amount":100,"currency":"eur"}"#,
    ),
    body("Application/JSON", r#"{"amount":100,"currency":"eur"}"#),
    body("application/JSON", r#"{"currency":"eur","amount":100}"#),
    body(
        "application/json; charset=\"UTF-8\"",
        r#"{"currency":"eur","amount":100}"#,
    ),
    body(
        "application/merge-patch+json",
        r#"{"amount":100,"currency":"eur"}"#,
    ),
    body(
        "application/merge-patch+json",
        r#"{"currency":"eur","amount":100}"#,
    ),
    body("application/json", r#"{"amount":100,"currency":"usd"}"#),
    body("application/json", r#"{"amount":101,"currency":"eur"}"#),
    body("application/json", "[1,2,3]"),
    body("application/json", "[ 1, 2, 3 ]"),
    body("application/json", r#"{"note":"é"}"#),
    body("application/json", r#"{"note":"\u00e9"}"#),
    body("application/json", r#"{"note":"e\u0301"}"#),
    body("application/json", r#"{"a":1}"#),
    body("application/json", r#"{ "a": 1 }"#),
    body("application/json", r#"{"a":1,"a":1}"#),
    body("application/json", r#"{"a":1, "a":1}"#),
    body("application/json", r#"{"n":9007199254740993}"#),
    body("application/json", r#"{"n": 9007199254740993}"#),
    body("application/json", r#"{"n":9007199254740992}"#),
    body("application/json", r#"{"n": 9007199254740992}"#),
    body("application/json", r#"{"a":"#),
    body("application/x-www-form-urlencoded", "a=1&b=2"),
    body("application/x-www-form-urlencoded", "b=2&a=%31"),
    body("application/x-www-form-urlencoded", "a+b=1"),
    body("application/x-www-form-urlencoded", "a%20b=1"),
    body("application/x-www-form-urlencoded", "a=1&b=3"),
    body("application/x-www-form-urlencoded", "a=1&a=2&b=3"),
    body("application/x-www-form-urlencoded", "b=3&a=1&a=2"),
    body("application/x-www-form-urlencoded", "a=2&a=1&b=3"),
    body("text/plain", "hello"),
    body("text/plain", "hello "),
    body("text/plain; charset=latin1", "hello"),
    body("text/plain;charset=\"latin1\"", "hello"),
    body("text/plain; charset=LATIN1", "hello"),
];

/// What the model predicts of a body before any state: refused as malformed, or its part of the
/// fingerprint.
enum Reading {
    Malformed,
    Fingerprinted(String),
}

/// The body's part of the fingerprint, as the contract states it (§1 step 4 and the fingerprint
/// module's table): the media type without JSON's `charset=utf-8`, then the canonical body.
fn read(body: &Body) -> Reading {
    read_as(body, true)
}

/// [`read`], or (not `strict`) a lossy reading that merges near misses the contract keeps
/// apart: JSON by what serde makes of it (duplicate names and numbers beyond 2^53 included),
/// form pairs sorted by value too, text trimmed. Only the generator uses it, to send them.
fn read_as(body: &Body, strict: bool) -> Reading {
    let mut pieces = body.content_type.split(';');
    let media = pieces
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    let json = media == "application/json" || media.ends_with("+json");
    // Parameters count, by lower-cased name and unquoted value (a charset's lower-cased), in
    // any order; JSON's
    // `charset=utf-8` alone changes nothing.
    let mut parameters: Vec<(String, String)> = pieces
        .filter_map(|p| p.split_once('='))
        .map(|(n, v)| {
            let v = v.trim();
            let v = v
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .unwrap_or(v);
            let n = n.trim().to_ascii_lowercase();
            // RFC 9110 §8.3.2: a charset's name has no case.
            let v = match n == "charset" {
                true => v.to_ascii_lowercase(),
                false => v.to_owned(),
            };
            (n, v)
        })
        .filter(|(n, v)| !(json && n == "charset" && v.eq_ignore_ascii_case("utf-8")))
        .collect();
    parameters.sort();
    let form = media == "application/x-www-form-urlencoded";
    let media = format!("{media} {parameters:?}");
    let part = if json {
        match serde_json::from_str::<serde_json::Value>(body.bytes) {
            Err(_) => return Reading::Malformed,
            Ok(value) if !strict || exact(body.bytes, &value) => format!(
                "{media} canonical {}",
                serde_json_canonicalizer::to_string(&value).expect("jcs")
            ),
            // No exact canonical form: its raw bytes, in a domain of their own.
            Ok(_) => format!("{media} raw {}", body.bytes),
        }
    } else if form {
        let mut pairs: Vec<(String, String)> = form_urlencoded::parse(body.bytes.as_bytes())
            .map(|(n, v)| (n.into_owned(), v.into_owned()))
            .collect();
        // By name only: the values of a repeated name keep their order (a list's order may
        // mean something, so it is not provably the same request).
        match strict {
            true => pairs.sort_by(|a, b| a.0.cmp(&b.0)),
            false => pairs.sort(),
        }
        format!("{media} pairs {pairs:?}")
    } else if strict {
        format!("{media} bytes {}", body.bytes)
    } else {
        format!("{media} bytes {}", body.bytes.trim())
    };
    Reading::Fingerprinted(part)
}

/// What the model holds for one scoped key: a recorded answer, or (after a technical failure
/// released the key) none, but still the fingerprint of the request that holds the key: any
/// state refuses a different request (§1 step 6).
#[derive(Clone)]
struct Recorded {
    fingerprint: String,
    /// Status, `x-run` (which execution) and body.
    answer: Option<(u16, Option<String>, Bytes)>,
}

/// One request of a sequence.
#[derive(Debug, Clone)]
struct Step {
    tenant: usize,
    key: usize,
    quoted: bool,
    method: &'static str,
    path: &'static str,
    body: usize,
    outcome: &'static str,
    /// Copies sent at once: a race on the key (never for `fail`, whose release would let a
    /// racer run it again, as the contract allows).
    burst: usize,
}

const METHODS: &[&str] = &["POST", "POST", "PATCH"];
const PATHS: &[&str] = &["/a", "/b", "/v1/a", "/a?x=1", "/a?x=2"];
const OUTCOMES: &[&str] = &["ok", "ok", "ok", "reject", "fail"];

/// The bodies read as `BODIES[i]` is ([`read_as`]).
fn alike(i: usize, strict: bool) -> Vec<usize> {
    let part = |b: &Body| match read_as(b, strict) {
        Reading::Malformed => None,
        Reading::Fingerprinted(part) => Some(part),
    };
    match part(&BODIES[i]) {
        None => vec![i],
        Some(p) => (0..BODIES.len())
            .filter(|&j| part(&BODIES[j]).as_ref() == Some(&p))
            .collect(),
    }
}

/// `n` steps. Two thirds of those on a key already held are retries: the request that holds
/// the key (its first that was not malformed: a key keeps its fingerprint, released or
/// completed) again, its body spelled any way the model reads as the same (or, one time in
/// four, a near miss: see [`read_as`]), so that replays are about as common as refusals, and
/// what only just differs meets what it differs from.
fn steps(rng: &mut Rng, n: usize) -> Vec<Step> {
    let mut holders: HashMap<(usize, usize), Step> = HashMap::new();
    let pick = |rng: &mut Rng, n: usize| rng.next(n as u64) as usize;
    (0..n)
        .map(|_| {
            let outcome = OUTCOMES[pick(rng, OUTCOMES.len())];
            let (tenant, key) = (pick(rng, 2), pick(rng, 3));
            let (quoted, retry) = (pick(rng, 2) == 0, pick(rng, 3) != 0);
            let burst = match (outcome, pick(rng, 5)) {
                ("fail", _) | (_, 1..) => 1,
                (_, 0) => 3,
            };
            let (method, path, body) = match holders.get(&(tenant, key)) {
                Some(prev) if retry => {
                    let alike = alike(prev.body, pick(rng, 4) != 0);
                    (prev.method, prev.path, alike[pick(rng, alike.len())])
                }
                _ => (
                    METHODS[pick(rng, METHODS.len())],
                    PATHS[pick(rng, PATHS.len())],
                    pick(rng, BODIES.len()),
                ),
            };
            let step = Step {
                tenant,
                key,
                quoted,
                method,
                path,
                body,
                outcome,
                burst,
            };
            if matches!(read(&BODIES[body]), Reading::Fingerprinted(_)) {
                holders.entry((tenant, key)).or_insert_with(|| step.clone());
            }
            step
        })
        .collect()
}

/// Sends `step` as `tenant`, `burst` times at once, each on a connection of its own.
async fn send(
    client: &reqwest::Client,
    addr: std::net::SocketAddr,
    step: &Step,
    tenant: &str,
) -> Vec<Answer> {
    let key = format!("k{}", step.key);
    let sent_key = if step.quoted {
        format!("\"{key}\"")
    } else {
        key
    };
    let body = &BODIES[step.body];
    let call = Call {
        tenant,
        key: &sent_key,
        method: step.method,
        path: step.path,
        content_type: body.content_type,
        body: body.bytes,
        outcome: step.outcome,
    };
    let copies = (0..step.burst).map(|_| common::model::send(client, addr, call));
    futures_util::future::join_all(copies).await
}

/// Sends `steps` one after another (a burst's copies at once), tenants named under `prefix`,
/// and checks each answer and the sink against the model. Returns how many executions the
/// model expected.
async fn run_sequence(
    addr: std::net::SocketAddr,
    sink: &Sink,
    prefix: &str,
    steps: &[Step],
    what: &str,
) -> usize {
    let client = common::client();
    let mut model: HashMap<(usize, usize), Recorded> = HashMap::new();
    let mut expected_runs: HashMap<(usize, usize), usize> = HashMap::new();
    let mut history = Vec::new();
    let all = || (0..2).flat_map(|t| (0..3).map(move |k| (t, k)));
    let name = |(t, k): (usize, usize)| (format!("{prefix}-t{t}"), format!("k{k}"));
    let start: HashMap<(usize, usize), usize> = all()
        .map(|slot| {
            let (tenant, key) = name(slot);
            (slot, sink.runs(&tenant, &key))
        })
        .collect();
    for (i, step) in steps.iter().enumerate() {
        history.push(format!("{i}: {step:?}"));
        let slot = (step.tenant, step.key);
        let (tenant, key) = name(slot);
        let at = || format!("{what}, step {i} of\n{}", history.join("\n"));
        let before = sink.runs(&tenant, &key);
        let answers = send(&client, addr, step, &tenant).await;
        let ran = sink.runs(&tenant, &key) - before;
        let fingerprint = match read(&BODIES[step.body]) {
            Reading::Malformed => {
                for answer in &answers {
                    assert_eq!(answer.status, 400, "malformed JSON is refused: {}", at());
                }
                assert_eq!(ran, 0, "nothing runs for malformed JSON: {}", at());
                continue;
            }
            Reading::Fingerprinted(part) => format!("{} {} {part}", step.method, step.path),
        };
        match model.get(&slot) {
            Some(held) if held.fingerprint != fingerprint => {
                assert_eq!(ran, 0, "a mismatch runs nothing: {}", at());
                for answer in &answers {
                    assert_eq!(
                        answer.status,
                        422,
                        "another request under the key ({} against {}): {}",
                        fingerprint,
                        held.fingerprint,
                        at()
                    );
                    assert_eq!(
                        answer.problem_type(),
                        problem_type("fingerprint-mismatch"),
                        "{}",
                        at()
                    );
                }
            }
            None | Some(Recorded { answer: None, .. }) => {
                assert_eq!(ran, 1, "a fresh key runs its handler once: {}", at());
                let expected = match step.outcome {
                    "reject" => 400,
                    "fail" => 503,
                    _ => 201,
                };
                // One answer is the execution's; the burst's others raced it: each is its
                // replay or "in flight", never a run of its own.
                let live: Vec<&Answer> = answers
                    .iter()
                    .filter(|a| a.replayed.as_deref().is_none_or(|v| v == "false"))
                    .filter(|a| a.status != 409)
                    .collect();
                assert_eq!(live.len(), 1, "one live answer: {}", at());
                let live = live[0];
                assert_eq!(live.status, expected, "the live answer: {}", at());
                assert!(
                    String::from_utf8_lossy(&live.bytes).contains(&format!("for {tenant}/{key},")),
                    "the live answer is this request's: {:?}: {}",
                    live.bytes,
                    at()
                );
                for answer in &answers {
                    if answer.status == 409 {
                        assert_eq!(
                            answer.problem_type(),
                            problem_type("in-flight"),
                            "a racer finds it in flight: {}",
                            at()
                        );
                    } else if answer.replayed.as_deref() == Some("true") {
                        assert_eq!(
                            (answer.status, &answer.run, &answer.bytes),
                            (live.status, &live.run, &live.bytes),
                            "a racer's replay is the live answer: {}",
                            at()
                        );
                    }
                }
                *expected_runs.entry(slot).or_insert(0) += 1;
                let answer = (live.status != 503)
                    .then(|| (live.status, live.run.clone(), live.bytes.clone()));
                model.insert(
                    slot,
                    Recorded {
                        fingerprint,
                        answer,
                    },
                );
            }
            Some(Recorded {
                answer: Some((first_status, first_run, first_body)),
                ..
            }) => {
                assert_eq!(ran, 0, "a replay runs nothing: {}", at());
                for answer in &answers {
                    assert_eq!(
                        answer.status,
                        *first_status,
                        "a replay keeps the status: {}",
                        at()
                    );
                    assert_eq!(
                        answer.replayed.as_deref(),
                        Some("true"),
                        "marked replayed: {}",
                        at()
                    );
                    assert_eq!(
                        (&answer.run, &answer.bytes),
                        (first_run, first_body),
                        "a replay is the first answer: {}",
                        at()
                    );
                }
            }
        }
    }
    // Every scoped key, used or not: the runs this sequence added are the model's.
    for slot in all() {
        let (tenant, key) = name(slot);
        assert_eq!(
            sink.runs(&tenant, &key) - start[&slot],
            expected_runs.get(&slot).copied().unwrap_or(0),
            "{what}: executions of {tenant}/{key} at the sink"
        );
    }
    expected_runs.values().sum()
}

async fn agrees_with_the_model<St: IdempotencyStore + Clone>(store: St, name: &str) {
    rounds(store, name, None).await;
}

/// Seeded rounds of `model::STREAMS` streams at once on one server. With a `clock`, every round
/// reuses the same tenants and keys, and the clock moves past every record's TTL between
/// rounds, so each round starts, in the model, from nothing.
async fn rounds<St: IdempotencyStore + Clone>(store: St, name: &str, clock: Option<&TestClock>) {
    const STEPS: usize = 60;
    let sink = Sink::default();
    let addr = serve(app(store, sink.clone())).await;
    let run = common::batching::unique(&format!("model-{name}"));
    let mut total = 0;
    for seed in common::model::round_seeds(5) {
        total += at_once(|s| {
            let sink = sink.clone();
            let prefix = match clock {
                Some(_) => format!("{run}-{s}"),
                None => format!("{run}-{seed}-{s}"),
            };
            let what = format!("{name}, seed {seed}, stream {s}");
            let steps = steps(&mut Rng::new(stream_seed(name, seed, s)), STEPS);
            async move { run_sequence(addr, &sink, &prefix, &steps, &what).await }
        })
        .await;
        if let Some(clock) = clock {
            // Past the default TTL (24 h): completed and released records alike.
            clock.advance(Duration::from_secs(25 * 3600));
        }
    }
    // Every execution at the sink is one the model expected (none from another scope's keys).
    assert_eq!(sink.total(), total, "{name}: executions in all");
}

// §1 steps 1–9 and §3 against the model, on every store the crate ships.
common::on_every_store!(agrees_with_the_model);

/// §1 step 6 and §2 with the store's clock moved a day between rounds that reuse the same
/// tenants and keys: an expired record (completed or released) is absent, whichever path finds
/// it (a replay's read, a claim), and its fingerprint binds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_records_are_absent_to_the_model() {
    let clock = TestClock::default();
    rounds(clock.store(), "memory, clock moved", Some(&clock)).await;
}
