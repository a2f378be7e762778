//! Review of 1add88b (a call's id written back as its text answers it), 8fa16b9 (an answer
//! too large to keep is classified by its own status under `DefinitiveOnly`, and keeps that
//! status) and 0325491 (an unseen stream under an error status is classified by the policy),
//! by a fresh reviewer. Two findings were fixed in the commit that adds this file: a 503
//! stream a policy keeps is described as the stream it was, and a string id that a server
//! reads as a number and writes back rounded still answers (ids that are numbers or hold a
//! number's text compare as numbers), and a JSON-RPC answer compressed all the same is taken as
//! done, never run again (a later commit). Two are left for planning (the session's note):
//! answers that settle differently over the limit, a server that answers one call twice.
//!
//! Every test tries to make a tool run twice for one key, lose a call (a retry can never run
//! although the tool never finished), replay the wrong answer, or tell the caller something
//! false. Runs are counted at the sink (the handler); real HTTP over TCP; MemoryStore.

use crate::common;

use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, header};
use axum::response::Response;
use axum::routing::post;
use bytes::Bytes;
use common::raw::unique;
use common::{Effects, guard, serve};
use serde_json::Value;
use tower_idempotency::jsonrpc::JsonRpc;
use tower_idempotency::{CachePolicy, IdempotencyLayer, MemoryStore};

// ---------------------------------------------------------------------------------------------
// The tool server.
// ---------------------------------------------------------------------------------------------

#[derive(Clone)]
enum Step {
    Data(Bytes),
    Fail,
}

fn data(text: &str) -> Step {
    Step::Data(Bytes::copy_from_slice(text.as_bytes()))
}

struct Scripted {
    status: u16,
    content_type: &'static str,
    encoding: Option<&'static str>,
    steps: Vec<Step>,
}

fn sse(steps: Vec<Step>) -> Scripted {
    Scripted {
        status: 200,
        content_type: "text/event-stream",
        encoding: None,
        steps,
    }
}

fn json(text: &str) -> Scripted {
    Scripted {
        status: 200,
        content_type: "application/json",
        encoding: None,
        steps: vec![data(text)],
    }
}

fn with_status(mut s: Scripted, status: u16) -> Scripted {
    s.status = status;
    s
}

fn body_of(steps: Vec<Step>) -> Body {
    let stream = futures_util::stream::unfold(steps.into_iter(), |mut steps| async move {
        match steps.next()? {
            Step::Data(b) => Some((Ok::<Bytes, std::io::Error>(b), steps)),
            Step::Fail => Some((Err(std::io::Error::other("the stream was cut")), steps)),
        }
    });
    Body::from_stream(stream)
}

/// What the tool answers on its `n`th run (1-based), to the call whose id text the client
/// sent (`x-raw-id`), in the mode `x-mode` names.
type Script = Arc<dyn Fn(usize, &str, &str) -> Scripted + Send + Sync>;

fn app(effects: &Effects, policy: CachePolicy, limit: usize, script: Script) -> Router {
    let effects = effects.clone();
    Router::new()
        .route(
            "/mcp",
            post(move |headers: HeaderMap| {
                let (effects, script) = (effects.clone(), script.clone());
                async move {
                    let n = effects.hit();
                    let get = |name: &str| {
                        headers
                            .get(name)
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or_default()
                            .to_owned()
                    };
                    let answer = script(n, &get("x-raw-id"), &get("x-mode"));
                    let mut res = Response::builder()
                        .status(answer.status)
                        .header(header::CONTENT_TYPE, answer.content_type);
                    if let Some(coding) = answer.encoding {
                        res = res.header(header::CONTENT_ENCODING, coding);
                    }
                    res.body(body_of(answer.steps)).expect("response")
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .cache_policy(policy)
                .response_limit(limit)
                .jsonrpc(JsonRpc::new()),
        )
}

// ---------------------------------------------------------------------------------------------
// Messages.
// ---------------------------------------------------------------------------------------------

const PRIMING: &str = "id: 0\nretry: 3000\ndata: \n\n";

fn progress(pad: usize) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","method":"notifications/progress","params":{{"progressToken":"p","progress":1,"message":"{}"}}}}"#,
        "p".repeat(pad)
    )
}

fn result(id: &str, text: &str) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"result":{{"content":[{{"type":"text","text":"{text}"}}]}}}}"#
    )
}

fn interim(id: &str, pad: usize) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"result":{{"resultType":"input_required","inputRequests":{{"q":{{"method":"elicitation/create","params":{{"message":"{}"}}}}}},"requestState":"s1"}}}}"#,
        "q".repeat(pad)
    )
}

fn event(message: &str) -> String {
    format!("data: {message}\n\n")
}

const CONTINUATION: &str =
    r#","inputResponses":{"q":{"action":"accept","content":{}}},"requestState":"s1""#;

fn gzip(text: &str) -> Bytes {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(text.as_bytes()).expect("gzip");
    Bytes::from(enc.finish().expect("gzip"))
}

// ---------------------------------------------------------------------------------------------
// The client.
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
struct Got {
    status: u16,
    replayed: bool,
    text: String,
}

impl Got {
    fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_default()
    }

    fn code(&self) -> i64 {
        common::jsonrpc_code(&self.text)
    }
}

/// One keyed `tools/call` of the same operation, its id written as `id`, `extra` appended to
/// its params.
async fn call(addr: SocketAddr, key: &str, id: &str, mode: &str, extra: &str) -> Got {
    let body = format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"t","arguments":{{"x":1}}{extra}}}}}"#
    );
    let req = common::client()
        .post(format!("http://{addr}/mcp"))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("accept-encoding", "gzip")
        .header("x-raw-id", id)
        .header("x-mode", mode)
        .header("idempotency-key", key)
        .body(body);
    let mut res = guard("a call", req.send()).await.expect("send");
    let status = res.status().as_u16();
    let replayed = res
        .headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let mut text = Vec::new();
    while let Ok(Some(chunk)) = guard("a chunk", res.chunk()).await {
        text.extend_from_slice(&chunk);
    }
    Got {
        status,
        replayed,
        text: String::from_utf8_lossy(&text).into_owned(),
    }
}

/// Retries `key` (new ids) until it is no longer in flight.
async fn settled(addr: SocketAddr, key: &str, mode: &str, extra: &str) -> Got {
    for i in 0..1000 {
        let got = call(addr, key, &(1000 + i).to_string(), mode, extra).await;
        if got.code() != -31001 {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the key never settled");
}

// =============================================================================================
// Findings candidates.
// =============================================================================================

/// DESIGN §3 ("once the inner service has returned a response head, the effect is taken as
/// done"; "a replay never carries a content encoding the retrying client did not accept")
/// and README "Compression" (an answer compressed all the same is replayed to retries that
/// accept its coding, and nothing runs again): a tool server that always gzips its JSON-RPC
/// answer. The retry (accepting gzip) must not run the tool again. Second row: the same over
/// SSE; the retry must not be told the stream "ended without the call's response" (it did
/// not: the response was in it, compressed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressed_answer_runs_the_tool_once() {
    let effects = Effects::default();
    let script: Script = Arc::new(|n, id, mode| {
        let text = result(id, &format!("run {n}"));
        let (ct, body) = match mode {
            "sse" => ("text/event-stream", gzip(&event(&text))),
            _ => ("application/json", gzip(&text)),
        };
        Scripted {
            status: 200,
            content_type: ct,
            encoding: Some("gzip"),
            steps: vec![Step::Data(body)],
        }
    });
    let addr = serve(app(&effects, CachePolicy::DefinitiveOnly, 1 << 20, script)).await;
    let mut failures = Vec::new();
    for mode in ["json", "sse"] {
        let before = effects.count();
        let key = unique(&format!("gzip-{mode}"));
        let first = call(addr, &key, "7", mode, "").await;
        assert_eq!(first.status, 200, "{mode}: {first:?}");
        let retry = settled(addr, &key, mode, "").await;
        let runs = effects.count() - before;
        if runs != 1 {
            failures.push(format!(
                "{mode}: the tool ran {runs} times for one key: {retry:?}"
            ));
        }
        if retry.text.contains("ended without the call's response") {
            failures.push(format!(
                "{mode}: told the stream had no response: {retry:?}"
            ));
        }
        // Told what happened, and kept on its key: a new key would run it again.
        if retry.code() != -31007
            || !retry.text.contains("compressed (gzip)")
            || !retry.text.contains(r#""safe_new_key":false"#)
        {
            failures.push(format!("{mode}: not told it came compressed: {retry:?}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Problem table (`response-not-stored`: "over the size limit", or "(JSON-RPC) the server took
/// the call and its event stream ended without the response") and DESIGN §3
/// (`Everything`: the first outcome is the answer): a 503 event stream that ends after its
/// priming event, under `Everything` and under a custom policy that keeps everything, is
/// recorded (0325491 hands it to the policy). The retry's -31007 must not tell the caller the
/// answer "was larger than the limit ... or its body failed": it was neither (the limit is
/// 1 MiB; the stream ended cleanly). It was told so before 0325491 (event-stream wording).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_stream_kept_by_the_policy_is_described_truly() {
    let mut failures = Vec::new();
    for (name, policy) in [
        ("everything", CachePolicy::Everything),
        ("custom", CachePolicy::custom(|_| true)),
    ] {
        let effects = Effects::default();
        let script: Script = Arc::new(|_, _, _| with_status(sse(vec![data(PRIMING)]), 503));
        let addr = serve(app(&effects, policy, 1 << 20, script)).await;
        let key = unique(&format!("unseen-503-{name}"));
        let first = call(addr, &key, "7", "", "").await;
        assert_eq!(first.status, 503, "{name}: {first:?}");
        let retry = settled(addr, &key, "", "").await;
        assert_eq!(effects.count(), 1, "{name}: the policy keeps it: {retry:?}");
        assert_eq!(retry.code(), -31007, "{name}: {retry:?}");
        let detail = retry.json()["error"]["data"]["detail"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        if detail.contains("larger than the limit") || detail.contains("body failed") {
            failures.push(format!(
                "{name}: told a false reason (safe_new_key {}): {detail}",
                retry.json()["error"]["data"]["safe_new_key"]
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// DESIGN §3 (never run twice for one key) and 1add88b's rationale (a server that reads the
/// id text `"7"` as a number writes back `7`, and 2^53+ ids a double-reading server writes
/// back rounded are matched "because not finding it would give the key back and run the call
/// again"): the string id `"9007199254740993"`, read as a number by a JavaScript server,
/// comes back as `9007199254740992`. The JSON answer is not found, the key is given back, and
/// the retry runs the tool again. (Edge; see the report: may be by design.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_big_string_id_written_back_as_a_rounded_number_runs_once() {
    let effects = Effects::default();
    let script: Script = Arc::new(|n, id, _| {
        let written = match id {
            r#""9007199254740993""# => "9007199254740992".to_owned(),
            other => other.to_owned(),
        };
        json(&result(&written, &format!("run {n}")))
    });
    let addr = serve(app(&effects, CachePolicy::DefinitiveOnly, 1 << 20, script)).await;
    let key = unique("big-string-id");
    call(addr, &key, r#""9007199254740993""#, "", "").await;
    let retry = settled(addr, &key, "", "").await;
    assert_eq!(effects.count(), 1, "the tool ran twice: {retry:?}");
}

/// DESIGN §8: a server-to-client request (sampling) whose id is the call's id in the other
/// spelling (`7` for the call `"7"`, `"7"` for the call `7`), and a request carrying the
/// call's exact id, are not the call's response: the response that follows is recorded and
/// replayed, the tool ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_requests_under_the_id_text_are_not_the_answer() {
    let effects = Effects::default();
    let script: Script = Arc::new(|n, id, _| {
        let other = match id.strip_prefix('"') {
            Some(s) => s.trim_end_matches('"').to_owned(),
            None => format!("\"{id}\""),
        };
        let req = |rid: &str| {
            format!(
                r#"{{"jsonrpc":"2.0","id":{rid},"method":"sampling/createMessage","params":{{"messages":[]}}}}"#
            )
        };
        let note = |rid: &str| {
            format!(
                r#"{{"jsonrpc":"2.0","id":{rid},"method":"notifications/message","params":{{}}}}"#
            )
        };
        sse(vec![
            data(PRIMING),
            data(&event(&req(&other))),
            data(&event(&req(id))),
            data(&event(&note(&other))),
            data(&event(&result(id, &format!("run {n}")))),
        ])
    });
    let addr = serve(app(&effects, CachePolicy::DefinitiveOnly, 1 << 20, script)).await;
    for id in [r#""7""#, "7"] {
        let before = effects.count();
        let key = unique("server-requests");
        call(addr, &key, id, "", "").await;
        let retry = settled(addr, &key, "", "").await;
        assert_eq!(effects.count() - before, 1, "{id}: {retry:?}");
        assert!(retry.replayed, "{id}: {retry:?}");
        assert_eq!(retry.json()["id"], Value::from(1000), "{id}: {retry:?}");
        assert_eq!(
            retry.json()["result"]["content"][0]["text"],
            format!("run {}", before + 1),
            "{id}: {retry:?}"
        );
    }
}

/// DESIGN §8 (interim results never stored; the continuation runs under the key): an
/// interim result to the call `7` written back as `"7"`, over SSE and JSON. The continuation
/// runs and its result is then replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interim_result_under_the_id_text_gives_the_key_back() {
    let effects = Effects::default();
    let script: Script = Arc::new(|n, id, mode| {
        let text_id = format!("\"{id}\"");
        match (n % 2, mode) {
            (1, "sse") => sse(vec![data(&event(&interim(&text_id, 5)))]),
            (1, _) => json(&interim(&text_id, 5)),
            _ => json(&result(&text_id, &format!("run {n}"))),
        }
    });
    let addr = serve(app(&effects, CachePolicy::DefinitiveOnly, 1 << 20, script)).await;
    for mode in ["sse", "json"] {
        let before = effects.count();
        let key = unique(&format!("interim-text-{mode}"));
        call(addr, &key, "7", mode, "").await;
        let cont = settled(addr, &key, mode, CONTINUATION).await;
        assert_eq!(effects.count() - before, 2, "{mode}: {cont:?}");
        let replay = call(addr, &key, "9", mode, CONTINUATION).await;
        assert_eq!(effects.count() - before, 2, "{mode}: {replay:?}");
        assert!(replay.replayed, "{mode}: {replay:?}");
        assert_eq!(replay.json()["id"], Value::from(9), "{mode}: {replay:?}");
    }
}

/// 1add88b: odd number texts written back as strings answer the call, and the replay echoes
/// the retry's id text as sent (`"\u0037"` stays escaped): `-0` as `"-0"`, `1E2` as `"1E2"`,
/// `-1.5e-3` as `"-1.5e-3"`; the string `"\u0037"` answered by `7`. One run each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_number_texts_written_back_as_strings_answer() {
    let effects = Effects::default();
    let script: Script = Arc::new(|n, id, _| {
        let written = if id == r#""\u0037""# {
            "7".to_owned()
        } else {
            format!("\"{id}\"")
        };
        json(&result(&written, &format!("run {n}")))
    });
    let addr = serve(app(&effects, CachePolicy::DefinitiveOnly, 1 << 20, script)).await;
    for id in ["-0", "1E2", "-1.5e-3", r#""\u0037""#] {
        let before = effects.count();
        let key = unique("odd-texts");
        call(addr, &key, id, "", "").await;
        let retry = call(addr, &key, r#""\u0038""#, "", "").await;
        assert_eq!(effects.count() - before, 1, "{id}: {retry:?}");
        assert!(retry.replayed, "{id}: {retry:?}");
        assert!(retry.text.contains(r#""id":"\u0038""#), "{id}: {retry:?}");
        assert!(
            retry.text.contains(&format!("run {}", before + 1)),
            "{id}: {retry:?}"
        );
    }
}

/// 8fa16b9 and DESIGN §3 (a response over the cache size limit is never silently re-executed;
/// retries are told its real status): over the limit, 202 and 206 are kept (-31007 naming the
/// status, state completed, the tool ran once); 303 and 500 give the key back under
/// `DefinitiveOnly` as they do under the limit; an SSE stream of exactly `limit` bytes is
/// replayed, one byte more is kept as not stored (status 200).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statuses_and_the_exact_limit() {
    let effects = Effects::default();
    const LIMIT: usize = 400;
    let script: Script = Arc::new(|n, id, mode| {
        let (status, pad) = mode.split_once('-').expect("mode");
        let status: u16 = status.parse().expect("status");
        if status == 0 {
            // An SSE stream of exactly LIMIT + pad bytes: progress, then the result.
            let tail = event(&result(id, &format!("run {n}")));
            let head_len = event(&progress(0)).len();
            let fill = LIMIT - head_len - tail.len() + pad.parse::<usize>().expect("pad");
            let body = format!("{}{tail}", event(&progress(fill)));
            assert_eq!(body.len(), LIMIT + pad.parse::<usize>().expect("pad"));
            return sse(vec![data(&body)]);
        }
        let text = format!(
            r#"{{"jsonrpc":"2.0","id":{id},"result":{{"content":[],"pad":"{}"}}}}"#,
            "x".repeat(pad.parse().expect("pad"))
        );
        with_status(json(&text), status)
    });
    let addr = serve(app(&effects, CachePolicy::DefinitiveOnly, LIMIT, script)).await;
    // (mode, runs after a retry, the retry's code)
    for (mode, runs, code) in [
        ("202-600", 1, -31007),
        ("206-600", 1, -31007),
        ("303-600", 2, 0),
        ("303-5", 2, 0),
        ("500-600", 2, 0),
        ("0-0", 1, 0),
        ("0-1", 1, -31007),
    ] {
        let before = effects.count();
        let key = unique(&format!("status-{mode}"));
        call(addr, &key, "7", mode, "").await;
        let retry = settled(addr, &key, mode, "").await;
        assert_eq!(effects.count() - before, runs, "{mode}: {retry:?}");
        assert_eq!(retry.code(), code, "{mode}: {retry:?}");
        if code == -31007 {
            let data = &retry.json()["error"]["data"];
            assert_eq!(data["state"], "completed", "{mode}: {retry:?}");
            let status = match mode.split_once('-').expect("mode").0 {
                "0" => "200",
                s => s,
            };
            assert!(
                data["detail"]
                    .as_str()
                    .unwrap_or_default()
                    .contains(&format!("status {status}")),
                "{mode}: {retry:?}"
            );
        } else if runs == 1 {
            assert!(retry.replayed, "{mode}: {retry:?}");
            assert!(
                retry.text.contains(&format!("run {}", before + 1)),
                "{mode}: {retry:?}"
            );
        }
    }
}

/// 0325491 and DESIGN §3 (a body failure after the head: taken as done, unless the policy
/// would not record the head): a 500 event stream cut before the call's response gives the
/// key back under `DefinitiveOnly` (the retry runs), and is kept under `Everything` (the
/// retry gets -31007, state completed, and nothing runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_500_stream_follows_the_policy() {
    for (name, policy, runs) in [
        ("definitive", CachePolicy::DefinitiveOnly, 2),
        ("everything", CachePolicy::Everything, 1),
    ] {
        let effects = Effects::default();
        let script: Script = Arc::new(|n, id, _| match n {
            1 => with_status(
                sse(vec![data(PRIMING), data(&event(&progress(3))), Step::Fail]),
                500,
            ),
            n => json(&result(id, &format!("run {n}"))),
        });
        let addr = serve(app(&effects, policy, 1 << 20, script)).await;
        let key = unique(&format!("cut-500-{name}"));
        call(addr, &key, "7", "", "").await;
        let retry = settled(addr, &key, "", "").await;
        assert_eq!(effects.count(), runs, "{name}: {retry:?}");
        if runs == 1 {
            assert_eq!(retry.code(), -31007, "{name}: {retry:?}");
            assert_eq!(retry.json()["error"]["data"]["state"], "completed");
        } else {
            assert!(retry.text.contains("run 2"), "{name}: {retry:?}");
        }
    }
}
