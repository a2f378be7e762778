//! The JSON-RPC mode against a model of DESIGN §8, as `model_differential.rs` does for HTTP:
//! seeded random sequences of `tools/call` requests, sent over real HTTP by several clients at
//! once, each answer compared with what the model predicts and every run counted in the
//! handler.
//!
//! What varies from step to step: the key and where it travels (the `Idempotency-Key` header,
//! `params._meta.idempotencyKey`, or both), the `id` (numbers and strings, spelled as no
//! serialiser would), a fresh `_meta.progressToken` on every request, the envelope's member
//! order and whitespace, the arguments (spellings of one document, near misses, JSON without an
//! exact canonical form), the handler's answer (a result as JSON or as an event stream, 503,
//! or a stream that ends without the response: a priming event only, an interim result, an
//! error to a `null` id), and bursts of three copies at once. What the model holds: two calls are the same when the canonical `params` without
//! `_meta` are (`serde_json_canonicalizer`; when the arguments have no exact form, the raw
//! text of `params` without `_meta`);
//! the `id` never counts; a replay is the recorded result's bytes under the new `id` exactly as
//! sent; a changed call is refused -31002 and a racer -31001, each echoing the `id` as sent; a
//! keyed call with a `null` id is refused -31009, and nothing runs; a stream that ends without
//! the response is taken as done (-31007, `safe_new_key: false`) unless it carried an interim
//! result or began with an error to a `null` id, which give the key back.
#![allow(missing_docs)]

use crate::common;

use std::collections::HashMap;

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::post;
use common::model::{Sink, at_once, exact, stream_seed};
use common::{Rng, guard, serve};
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::IdempotencyStore;
use tower_idempotency::jsonrpc::JsonRpc;

/// A tool server: counts the call under its key, then answers as `x-outcome` asks: a result
/// written as a server might (members in its own order, a decimal with a trailing zero), as
/// JSON or in an event stream after a progress notification; 503 (a technical failure: the
/// key is released); or an event stream without the response: a priming event only (the
/// response goes on a resumed stream), an interim result, an error to a `null` id.
async fn tool(sink: Sink, headers: HeaderMap, body: Bytes) -> axum::response::Response {
    let call: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| {
            call["params"]["_meta"]["idempotencyKey"]
                .as_str()
                .map(str::to_owned)
        })
        .unwrap_or_default();
    // One tenant: the layer is `single_tenant`.
    let serial = sink.hit("", &key);
    if headers.get("x-outcome").is_some_and(|v| v == "fail") {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("run {serial} failed"),
        )
            .into_response();
    }
    let id = &call["id"];
    let text = format!(
        r#"{{"jsonrpc":"2.0","id":{id},"result":{{"zeta":{serial},"for":"{key}","amount":10.50,"content":[]}}}}"#,
    );
    let progress = r#"{"jsonrpc":"2.0","method":"notifications/progress","params":{"progress":1}}"#;
    let stream = match headers.get("x-outcome").and_then(|v| v.to_str().ok()) {
        Some("sse") => format!("id: 1\ndata: {progress}\n\nid: 2\ndata: {text}\n\n"),
        Some("priming") => "id: 0\nretry: 3000\ndata: \n\n".to_owned(),
        Some("interim") => format!(
            "data: {progress}\n\ndata: {{\"jsonrpc\":\"2.0\",\"id\":{id},\"result\":{{\"resultType\":\"input_required\",\"inputRequests\":{{}}}}}}\n\n"
        ),
        Some("null") => "id: 0\ndata: \n\ndata: {\"jsonrpc\":\"2.0\",\"id\":null,\"error\":{\"code\":-32600,\"message\":\"no\"}}\n\n".to_owned(),
        _ => return ([(header::CONTENT_TYPE, "application/json")], text).into_response(),
    };
    ([(header::CONTENT_TYPE, "text/event-stream")], stream).into_response()
}

fn app<St: IdempotencyStore + Clone>(store: St, sink: Sink) -> Router {
    Router::new()
        .route(
            "/mcp",
            post(move |h: HeaderMap, b: Bytes| tool(sink.clone(), h, b)),
        )
        .layer(
            IdempotencyLayer::new(store)
                .single_tenant()
                .jsonrpc(JsonRpc::new().meta_key("idempotencyKey")),
        )
}

/// Arguments as sent: spellings of one document, near misses, and JSON with no exact
/// canonical form (a duplicate name, an integer beyond 2^53), each its own request.
const ARGUMENTS: &[&str] = &[
    r#"{"amount":100,"currency":"eur"}"#,
    r#"{"currency":"eur","amount":100}"#,
    "{ \"amount\": 1e2, \"currency\": \"\\u0065ur\" }",
    r#"{"amount":100,"currency":"usd"}"#,
    "{}",
    "{ }",
    r#"{"a":1}"#,
    r#"{"a":1,"a":1}"#,
    r#"{"a":1, "a":1}"#,
    r#"{"n":9007199254740993}"#,
    r#"{"n": 9007199254740993}"#,
    r#"{"n":9007199254740992}"#,
    r#"{"n": 9007199254740992.0}"#,
];

/// Ids as sent; `null` is never a guarded call's.
const IDS: &[&str] = &[
    "1",
    "2",
    "1.0",
    "-0",
    "1e2",
    "123456789012345678901234567890",
    r#""a""#,
    r#""retry \u0041""#,
    "null",
];

/// Where the key travels.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Carrier {
    Header,
    Meta,
    Both,
}

/// The operation's part of the fingerprint as the model reads it (`name` is always `t`):
/// canonical `params` without `_meta`, or, when the arguments have no exact form, the raw
/// `params` without `_meta`: its members in the order sent, each value's text as sent (the
/// whitespace between members says nothing).
fn operation(arguments: &str, layout: usize) -> String {
    let value: serde_json::Value = serde_json::from_str(arguments).expect("valid arguments");
    match exact(arguments, &value) {
        true => format!(
            "canonical {}",
            serde_json_canonicalizer::to_string(&value).expect("jcs")
        ),
        false => match layout {
            0 => format!("raw: name, then arguments {arguments}"),
            _ => format!("raw: arguments {arguments}, then name"),
        },
    }
}

/// Arguments read alike by the model (`strict`), or by serde alone (near misses).
fn alike(i: usize, strict: bool) -> Vec<usize> {
    let read = |a: &str| match strict {
        true => operation(a, 0),
        false => serde_json::from_str::<serde_json::Value>(a)
            .map(|v| serde_json_canonicalizer::to_string(&v).expect("jcs"))
            .expect("valid arguments"),
    };
    let mine = read(ARGUMENTS[i]);
    (0..ARGUMENTS.len())
        .filter(|&j| read(ARGUMENTS[j]) == mine)
        .collect()
}

#[derive(Debug, Clone)]
struct Step {
    key: usize,
    carrier: Carrier,
    id: &'static str,
    /// The envelope's member order and whitespace.
    layout: usize,
    arguments: usize,
    /// A progress token, fresh on every request as MCP clients send it.
    token: u64,
    outcome: &'static str,
    burst: usize,
}

impl Step {
    /// The request body.
    fn body(&self) -> String {
        let key = match self.carrier {
            Carrier::Header => String::new(),
            Carrier::Meta | Carrier::Both => format!(r#","idempotencyKey":"k{}""#, self.key),
        };
        let meta = format!(r#"{{"progressToken":{}{key}}}"#, self.token);
        let (id, arguments) = (self.id, ARGUMENTS[self.arguments]);
        match self.layout {
            0 => format!(
                r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"t","arguments":{arguments},"_meta":{meta}}}}}"#
            ),
            1 => format!(
                r#"{{"method":"tools/call","params":{{"_meta":{meta},"arguments":{arguments},"name":"t"}},"id":{id},"jsonrpc":"2.0"}}"#
            ),
            _ => format!(
                "{{\n  \"jsonrpc\" : \"2.0\",\n  \"method\" : \"tools/call\",\n  \"id\" : {id},\n  \"params\" : {{ \"arguments\" : {arguments} , \"_meta\" : {meta} , \"name\" : \"t\" }}\n}}"
            ),
        }
    }
}

const CARRIERS: &[Carrier] = &[Carrier::Header, Carrier::Meta, Carrier::Both];
const OUTCOMES: &[&str] = &[
    "ok", "ok", "sse", "sse", "fail", "priming", "interim", "null",
];

/// Outcomes that give the key back: sent alone (a racer could run after the release).
const RELEASING: &[&str] = &["fail", "interim", "null"];

/// `n` steps; two in three on a held key retry its holder's arguments, spelled anew (one in
/// four a near miss), under a new id and progress token.
fn steps(rng: &mut Rng, n: usize) -> Vec<Step> {
    let mut holders: HashMap<usize, usize> = HashMap::new();
    let pick = |rng: &mut Rng, n: usize| rng.next(n as u64) as usize;
    (0..n)
        .map(|_| {
            let outcome = OUTCOMES[pick(rng, OUTCOMES.len())];
            let key = pick(rng, 3);
            let id = IDS[pick(rng, IDS.len())];
            let arguments = match holders.get(&key) {
                Some(&held) if pick(rng, 3) != 0 => {
                    let alike = alike(held, pick(rng, 4) != 0);
                    alike[pick(rng, alike.len())]
                }
                _ => pick(rng, ARGUMENTS.len()),
            };
            let step = Step {
                key,
                carrier: CARRIERS[pick(rng, CARRIERS.len())],
                id,
                layout: pick(rng, 3),
                arguments,
                token: rng.next(1 << 40),
                outcome,
                burst: match pick(rng, 5) {
                    _ if RELEASING.contains(&outcome) => 1,
                    0 => 3,
                    _ => 1,
                },
            };
            if id != "null" {
                holders.entry(key).or_insert(arguments);
            }
            step
        })
        .collect()
}

struct Answer {
    status: u16,
    replayed: bool,
    text: String,
}

impl Answer {
    fn error_code(&self) -> Option<i64> {
        let v: serde_json::Value = serde_json::from_str(&self.text).ok()?;
        v["error"]["code"].as_i64()
    }

    /// Whether the answer names `id` exactly as it was sent.
    fn echoes(&self, id: &str) -> bool {
        self.text.contains(&format!(r#""id":{id},"#))
            || self.text.contains(&format!(r#""id":{id}}}"#))
    }
}

/// Posts a call `body` to `/mcp`, with `key` in the header if given and one `extra` header.
async fn call_mcp(
    client: &reqwest::Client,
    addr: std::net::SocketAddr,
    key: Option<String>,
    extra: (&'static str, String),
    body: String,
) -> Answer {
    let mut request = client
        .post(format!("http://{addr}/mcp"))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header(extra.0, extra.1)
        .body(body);
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let res = guard("a call", request.send()).await.expect("response");
    let status = res.status().as_u16();
    let replayed = res
        .headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let text = guard("a body", res.text()).await.expect("body");
    Answer {
        status,
        replayed,
        text,
    }
}

async fn send(
    client: &reqwest::Client,
    addr: std::net::SocketAddr,
    step: &Step,
    run: &str,
) -> Vec<Answer> {
    let key = format!("{run}-k{}", step.key);
    let body = step
        .body()
        .replace(&format!(r#""k{}""#, step.key), &format!(r#""{key}""#));
    let key = (step.carrier != Carrier::Meta).then_some(key);
    let one = || {
        let outcome = ("x-outcome", step.outcome.to_owned());
        call_mcp(client, addr, key.clone(), outcome, body.clone())
    };
    futures_util::future::join_all((0..step.burst).map(|_| one())).await
}

/// Each answer a refusal with this HTTP status and JSON-RPC code, echoing `id` as sent.
fn refused(answers: &[Answer], (status, code): (u16, i64), id: &str, what: &str) {
    for a in answers {
        assert_eq!(
            (a.status, a.error_code()),
            (status, Some(code)),
            "{}: {what}",
            a.text
        );
        assert!(a.echoes(id), "the id as sent: {}: {what}", a.text);
    }
}

/// What the model holds for a key: the operation holding it and what is recorded.
struct Held {
    operation: String,
    recorded: Recorded,
}

/// What a key's record holds, as the model sees it.
enum Recorded {
    /// Nothing: the key was given back.
    Nothing,
    /// The result's bytes (from `"result":` to the end of the message).
    Result(String),
    /// A call taken whose response went elsewhere: no response, never run again.
    Unseen,
}

async fn run_sequence(
    addr: std::net::SocketAddr,
    sink: &Sink,
    run: &str,
    steps: &[Step],
    what: &str,
) -> usize {
    let client = common::client();
    let mut model: HashMap<usize, Held> = HashMap::new();
    let mut expected: HashMap<usize, usize> = HashMap::new();
    let mut history = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        history.push(format!("{i}: {step:?} {}", step.body()));
        let at = || format!("{what}, step {i} of\n{}", history.join("\n"));
        let key = format!("{run}-k{}", step.key);
        let before = sink.runs("", &key);
        let answers = send(&client, addr, step, run).await;
        let ran = sink.runs("", &key) - before;
        if step.id == "null" {
            assert_eq!(ran, 0, "a keyed call with a null id never runs: {}", at());
            refused(&answers, (400, -31009), step.id, &at());
            continue;
        }
        let op = operation(ARGUMENTS[step.arguments], step.layout);
        match model.get(&step.key) {
            Some(held) if held.operation != op => {
                assert_eq!(ran, 0, "a changed call runs nothing: {}", at());
                let what = format!("a changed call ({op} against {}): {}", held.operation, at());
                refused(&answers, (422, -31002), step.id, &what);
            }
            None
            | Some(Held {
                recorded: Recorded::Nothing,
                ..
            }) => {
                assert_eq!(ran, 1, "a call on a free key runs once: {}", at());
                let live: Vec<&Answer> = answers
                    .iter()
                    .filter(|a| !a.replayed && a.status != 409)
                    .collect();
                assert_eq!(live.len(), 1, "one live answer: {}", at());
                let live = live[0];
                let recorded = match step.outcome {
                    "fail" => {
                        assert_eq!(live.status, 503, "the handler's failure: {}", at());
                        Recorded::Nothing
                    }
                    "priming" | "interim" | "null" => {
                        assert_eq!(live.status, 200, "the handler's stream: {}", at());
                        match step.outcome {
                            "priming" => Recorded::Unseen,
                            _ => Recorded::Nothing,
                        }
                    }
                    _ => {
                        assert_eq!(live.status, 200, "the handler's result: {}", at());
                        assert!(
                            live.text.contains(&format!(r#""for":"{key}""#)),
                            "this call's result: {}: {}",
                            live.text,
                            at()
                        );
                        // The message itself: a JSON body, or the stream's last event's data.
                        let message = live.text.trim_end().rsplit("data: ").next();
                        let message = message.unwrap_or_default();
                        let start = message.find(r#""result":"#).expect("a result");
                        Recorded::Result(message[start..].to_owned())
                    }
                };
                for a in answers.iter().filter(|a| a.status == 409) {
                    // A racer: in flight, or (a priming stream) done without its response.
                    let done = matches!(recorded, Recorded::Unseen) && a.replayed;
                    assert_eq!(
                        a.error_code(),
                        Some(if done { -31007 } else { -31001 }),
                        "a racer: {}: {}",
                        a.text,
                        at()
                    );
                    assert!(a.echoes(step.id), "its id as sent: {}: {}", a.text, at());
                }
                for a in answers.iter().filter(|a| a.replayed && a.status != 409) {
                    assert!(
                        matches!(&recorded, Recorded::Result(r) if a.text.ends_with(r.as_str())),
                        "a racer's replay is the live result: {}: {}",
                        a.text,
                        at()
                    );
                }
                *expected.entry(step.key).or_insert(0) += 1;
                model.insert(
                    step.key,
                    Held {
                        operation: op,
                        recorded,
                    },
                );
            }
            Some(Held {
                recorded: Recorded::Unseen,
                ..
            }) => {
                assert_eq!(ran, 0, "a call taken is never run again: {}", at());
                refused(&answers, (409, -31007), step.id, &at());
                for a in &answers {
                    assert!(a.replayed, "about the record: {}: {}", a.text, at());
                    assert!(
                        a.text.contains(r#""safe_new_key":false"#),
                        "a new key would run it again: {}: {}",
                        a.text,
                        at()
                    );
                }
            }
            Some(Held {
                recorded: Recorded::Result(recorded),
                ..
            }) => {
                assert_eq!(ran, 0, "a replay runs nothing: {}", at());
                for a in &answers {
                    assert!(
                        a.status == 200 && a.replayed,
                        "a replay: {} {}: {}",
                        a.status,
                        a.text,
                        at()
                    );
                    assert!(
                        a.echoes(step.id),
                        "the new id as sent: {}: {}",
                        a.text,
                        at()
                    );
                    assert!(
                        a.text.ends_with(recorded.as_str()),
                        "the recorded bytes ({recorded}): {}: {}",
                        a.text,
                        at()
                    );
                }
            }
        }
    }
    for k in 0..3 {
        assert_eq!(
            sink.runs("", &format!("{run}-k{k}")),
            expected.get(&k).copied().unwrap_or(0),
            "{what}: runs of k{k} at the sink"
        );
    }
    expected.values().sum()
}

/// §8 against the model: seeded rounds of `model::STREAMS` streams at once, each its own keys.
async fn calls_agree_with_the_model<St: IdempotencyStore + Clone>(store: St, name: &str) {
    const STEPS: usize = 60;
    let sink = Sink::default();
    let addr = serve(app(store, sink.clone())).await;
    let run = common::batching::unique(&format!("jsonrpc-model-{name}"));
    let mut total = 0;
    for seed in common::model::round_seeds(3) {
        total += at_once(|s| {
            let sink = sink.clone();
            let run = format!("{run}-{seed}-{s}");
            let what = format!("{name}, seed {seed}, stream {s}");
            let steps = steps(&mut Rng::new(stream_seed(name, seed, s)), STEPS);
            async move { run_sequence(addr, &sink, &run, &steps, &what).await }
        })
        .await;
    }
    assert_eq!(sink.total(), total, "{name}: runs in all");
}

// §8 against the model, on every store the crate ships.
common::on_every_store!(calls_agree_with_the_model);

/// A tool server whose answer is chosen by `x-answer`: the call's id as a double (what a
/// JavaScript server writes back), a response to another id, JSON that is not JSON-RPC, a 503
/// page, or a 404 for a lost session; it counts its runs.
async fn odd_server(sink: Sink, headers: HeaderMap, body: Bytes) -> axum::response::Response {
    let call: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let serial = sink.hit("", "");
    let answer = headers
        .get("x-answer")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let id = match answer {
        // serde_json reads an integer beyond u64 as a double, as JSON.parse does.
        "double" => call["id"]
            .as_f64()
            .map_or_else(|| call["id"].to_string(), |d| format!("{d:e}")),
        _ => r#""another""#.to_owned(),
    };
    let text = match answer {
        "not-jsonrpc" => format!(r#"{{"ok":true,"run":{serial}}}"#),
        "page" => {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("run {serial}: try later"),
            )
                .into_response();
        }
        // What a stateful MCP server answers a session it no longer knows, before any tool.
        "gone" => {
            let text = format!(r#"{{"error":"session not found","run":{serial}}}"#);
            let json = [(header::CONTENT_TYPE, "application/json")];
            return (StatusCode::NOT_FOUND, json, text).into_response();
        }
        _ => format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{{"run":{serial}}}}}"#),
    };
    ([(header::CONTENT_TYPE, "application/json")], text).into_response()
}

/// DESIGN §8: the answer a call's outcome is read from. A server that writes an id beyond
/// 2^53 back as a double still answers the call: recorded and replayed under each retry's id
/// as sent (before, the answer was not found, the key went back and every retry ran the tool
/// again). A success without the call's response (one to another id, JSON that is not
/// JSON-RPC) may have run the tool: taken as done, never run again, retries told
/// `response-not-stored` (-31007). An error status without it (a 503 page, a 404 for a session
/// the server no longer knows) gives the key back under `DefinitiveOnly`, and the retry runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_answer_to_a_call_is_found_by_its_id() {
    let sink = Sink::default();
    let app = Router::new()
        .route(
            "/mcp",
            post({
                let sink = sink.clone();
                move |h: HeaderMap, b: Bytes| odd_server(sink.clone(), h, b)
            }),
        )
        .layer(
            IdempotencyLayer::new(tower_idempotency::MemoryStore::new())
                .single_tenant()
                .jsonrpc(JsonRpc::new()),
        );
    let addr = serve(app).await;
    let client = common::client();
    let call = |key: &str, answer: &str, id: &str| {
        let body = format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"t","arguments":{{}}}}}}"#
        );
        let answer = ("x-answer", answer.to_owned());
        call_mcp(&client, addr, Some(key.to_owned()), answer, body)
    };
    let key = common::batching::unique("odd");
    // (answer, runs after a call and two retries, what the retries get)
    for (answer, runs, retried) in [
        ("double", 1, "replay"),
        ("another", 1, "not-stored"),
        ("not-jsonrpc", 1, "not-stored"),
        ("page", 3, "503"),
        ("gone", 3, "404"),
    ] {
        let key = format!("{key}-{answer}");
        let before = sink.total();
        let first = call(&key, answer, "9007199254740993").await;
        let live = first.text.clone();
        for id in ["123456789012345678901234567890", r#""retry""#] {
            let retry = call(&key, answer, id).await;
            match retried {
                "replay" => {
                    assert!(
                        retry.replayed && retry.status == 200,
                        "{answer}: {}",
                        retry.text
                    );
                    assert!(
                        retry.echoes(id),
                        "{answer}: the retry's id as sent: {}",
                        retry.text
                    );
                    let result = &live[live.find(r#""result":"#).expect("a result")..];
                    assert!(retry.text.ends_with(result), "{answer}: {}", retry.text);
                }
                "not-stored" => {
                    assert!(
                        retry.text.contains("-31007"),
                        "{answer}: response-not-stored: {}",
                        retry.text
                    );
                    assert!(
                        retry.echoes(id),
                        "{answer}: the retry's id as sent: {}",
                        retry.text
                    );
                }
                status => {
                    let got = retry.status.to_string();
                    assert_eq!(got, status, "{answer}: {}", retry.text);
                }
            }
        }
        assert_eq!(sink.total() - before, runs, "{answer}: runs at the sink");
    }
}
