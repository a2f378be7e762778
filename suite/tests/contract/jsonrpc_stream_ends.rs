//! DESIGN §8 (SSE answers, interim results never stored; a keyed call that cannot be guarded is
//! refused) and §3 (a handler that answered is never run again): how an event stream that ends
//! without the call's final response settles the key, over real sockets, tool runs counted at
//! the sink (the handler), on every store.
//!
//! - MCP's SSE polling (2025-11-25, SEP-1699): the server sends a priming event (an event id,
//!   empty data), closes the stream, and sends the response on a resumed GET the layer never
//!   sees. The call was taken: a retry must not run it again, even while the first run goes on.
//! - The call's number echoed as a string (`"7"` for `7`) is its response, replayed.
//! - Any other stream that ends without the response (progress only, the response under an id
//!   that is not the call's) is taken as done, its response not stored; under an error status
//!   (a 503 stream) the route's policy decides, as for any answer.
//! - Only an explicit interim result (MCP's `input_required`) or an error to a `null` id (the
//!   server could not read the call) gives the key back.
//! - `Text/Event-Stream` is an event stream: media types are case-insensitive.
//! - A keyed call whose id this layer cannot read back (`1e400`) is refused, nothing run; a
//!   response with id `null` never answers a call.

use crate::common;

use std::net::SocketAddr;
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
use tokio::sync::Notify;
use tower_idempotency::jsonrpc::JsonRpc;
use tower_idempotency::{IdempotencyLayer, IdempotencyStore};

/// The response to the call written with `id`.
fn result(id: &str, n: usize) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"result":{{"content":[{{"type":"text","text":"run {n}"}}]}}}}"#
    )
}

const PROGRESS: &str = r#"{"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken":"p","progress":1}}"#;

/// What the tool server answers in each mode (`x-mode`, not part of the fingerprint): its
/// content type and body. Every run is counted before it answers.
fn answer(mode: &str, id: &str, n: usize) -> (&'static str, String) {
    let sse = "text/event-stream";
    match mode {
        // SEP-1699: the priming event, then the stream closes; the response goes elsewhere.
        "priming" => (sse, "id: 0\nretry: 3000\ndata: \n\n".to_owned()),
        // Priming with a CRLF stream and a progress event before the close.
        "priming-progress" => (
            sse,
            format!("id: a-1\r\ndata:\r\n\r\nid: a-2\r\ndata: {PROGRESS}\r\n\r\n"),
        ),
        "progress-only" => (sse, format!("data: {PROGRESS}\n\n")),
        // The call's number echoed as a string: its response all the same.
        "string-id" => (sse, format!("data: {}\n\n", result(&format!("\"{id}\""), n))),
        "string-id-json" => ("application/json", result(&format!("\"{id}\""), n)),
        // Another spelling is another id: not the response, but the call was taken.
        "other-string-id" => (sse, format!("data: {}\n\n", result(&format!("\"0{id}\""), n))),
        "interim" => (
            sse,
            format!(
                "data: {PROGRESS}\n\ndata: {{\"jsonrpc\":\"2.0\",\"id\":{id},\"result\":{{\"resultType\":\"input_required\",\"inputRequests\":{{}}}}}}\n\n"
            ),
        ),
        // The server could not read the call: an error to a null id.
        "null-error" => (
            sse,
            "data: {\"jsonrpc\":\"2.0\",\"id\":null,\"error\":{\"code\":-32700,\"message\":\"parse error\"}}\n\n"
                .to_owned(),
        ),
        "null-error-json" => (
            "application/json",
            r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"parse error"}}"#
                .to_owned(),
        ),
        "capitalised" => (
            "Text/Event-Stream; charset=utf-8",
            format!("data: {PROGRESS}\n\ndata: {}\n\n", result(id, n)),
        ),
        "sse" => (sse, format!("data: {}\n\n", result(id, n))),
        // Under an error status (see `tool`): an outcome the policy classifies.
        "priming-503" => (sse, "id: 0\ndata: \n\n".to_owned()),
        "json" => ("application/json", result(id, n)),
        other => panic!("unknown mode {other}"),
    }
}

/// A request header's value as text (empty when absent).
fn header_of(headers: &HeaderMap, name: &str) -> String {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// The tool server: answers as `x-mode` says, the call's id as `x-raw-id` gives it.
async fn tool(effects: Effects, headers: HeaderMap) -> Response {
    let get = |name: &str| header_of(&headers, name);
    let n = effects.hit();
    let mode = get("x-mode");
    let (content_type, text) = answer(&mode, &get("x-raw-id"), n);
    let status = if mode.ends_with("-503") { 503 } else { 200 };
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, content_type)
        .body(Body::from(text))
        .expect("response")
}

fn app<St: IdempotencyStore>(store: St, effects: &Effects) -> Router {
    let effects = effects.clone();
    Router::new()
        .route(
            "/mcp",
            post(move |headers: HeaderMap| tool(effects.clone(), headers)),
        )
        .layer(
            IdempotencyLayer::new(store)
                .single_tenant()
                .jsonrpc(JsonRpc::new()),
        )
}

/// What came back.
#[derive(Debug)]
struct Got {
    status: u16,
    replayed: bool,
    content_type: String,
    text: String,
}

impl Got {
    fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_default()
    }

    /// The JSON-RPC error code (0: none).
    fn code(&self) -> i64 {
        common::jsonrpc_code(&self.text)
    }
}

/// One keyed `tools/call` (the same operation every time), its id written as `id`.
async fn call(addr: SocketAddr, mode: &str, key: Option<&str>, id: &str) -> Got {
    let body = format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"t","arguments":{{"x":1}}}}}}"#
    );
    let mut req = common::client()
        .post(format!("http://{addr}/mcp"))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("x-mode", mode)
        .header("x-raw-id", id)
        .body(body);
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    let res = guard("a call", req.send()).await.expect("send");
    let status = res.status().as_u16();
    let replayed = res.headers().contains_key("idempotency-replayed");
    let content_type = res
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let text = guard("a body", res.text()).await.expect("body");
    Got {
        status,
        replayed,
        content_type,
        text,
    }
}

/// Retries `key` until its first answer has settled (streams are recorded on their own task):
/// the first answer that is not "in flight".
async fn settled(addr: SocketAddr, mode: &str, key: &str) -> Got {
    for i in 0..500 {
        let got = call(addr, mode, Some(key), &(1000 + i).to_string()).await;
        if got.code() != -31001 {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{mode}: the key never settled");
}

/// Streams that end without the call's response: the runs after a first call and a settled
/// retry, and what the retry gets.
async fn streams_that_end_without_the_response<St: IdempotencyStore>(store: St, name: &str) {
    let effects = Effects::default();
    let addr = serve(app(store, &effects)).await;
    // (mode, runs after the first call and a retry, the retry's error code; 0: ran)
    for (mode, runs, code) in [
        ("priming", 1, -31007),
        ("priming-progress", 1, -31007),
        ("progress-only", 1, -31007),
        ("other-string-id", 1, -31007),
        ("string-id", 1, 0),
        ("string-id-json", 1, 0),
        ("interim", 2, 0),
        ("null-error", 2, -32700),
        ("null-error-json", 2, -32700),
        // A 503 is no success: DefinitiveOnly gives the key back, as for any 503.
        ("priming-503", 2, 0),
    ] {
        let before = effects.count();
        let key = unique(&format!("{name}-{mode}"));
        let first = call(addr, mode, Some(&key), "7").await;
        let status = if mode.ends_with("-503") { 503 } else { 200 };
        assert_eq!(first.status, status, "{name} {mode}: {first:?}");
        let retry = settled(addr, mode, &key).await;
        assert_eq!(
            effects.count() - before,
            runs,
            "{name} {mode}: the runs after a retry ({retry:?})"
        );
        assert_eq!(retry.code(), code, "{name} {mode}: {retry:?}");
        if runs == 1 && code == 0 {
            // Recorded: replayed under the retry's own id.
            assert!(retry.replayed, "{name} {mode}: {retry:?}");
            assert_eq!(retry.json()["id"], Value::from(1000), "{name} {mode}");
            assert_eq!(
                retry.json()["result"]["content"][0]["text"],
                format!("run {}", before + 1),
                "{name} {mode}: {retry:?}"
            );
        } else if runs == 1 {
            // Answered about the recorded outcome, to the retry's own id.
            assert!(retry.replayed, "{name} {mode}: {retry:?}");
            assert_eq!(retry.json()["id"], Value::from(1000), "{name} {mode}");
            assert_eq!(retry.json()["error"]["data"]["state"], "completed");
            // Its outcome is not known here: a new key would run it again.
            assert_eq!(
                retry.json()["error"]["data"]["safe_new_key"],
                false,
                "{name} {mode}: {retry:?}"
            );
            assert!(
                retry.text.contains("event stream"),
                "{name} {mode}: {retry:?}"
            );
            // And it stays so: a third call runs nothing either.
            call(addr, mode, Some(&key), "8").await;
            assert_eq!(
                effects.count() - before,
                runs,
                "{name} {mode}: a third call"
            );
        }
    }
}

common::on_every_store!(streams_that_end_without_the_response);

/// `Text/Event-Stream; charset=utf-8` is teed and its response recorded: the retry replays it
/// under its own id, and the tool ran once. The same for the lower-case spelling.
async fn an_event_stream_in_any_case_is_recorded<St: IdempotencyStore>(store: St, name: &str) {
    let effects = Effects::default();
    let addr = serve(app(store, &effects)).await;
    for mode in ["capitalised", "sse"] {
        let before = effects.count();
        let key = unique(&format!("{name}-{mode}"));
        let first = call(addr, mode, Some(&key), "7").await;
        assert!(
            first.content_type.eq_ignore_ascii_case("text/event-stream")
                || first
                    .content_type
                    .to_ascii_lowercase()
                    .starts_with("text/event-stream;"),
            "{name} {mode}: {first:?}"
        );
        let retry = settled(addr, mode, &key).await;
        assert_eq!(effects.count() - before, 1, "{name} {mode}: {retry:?}");
        assert!(retry.replayed, "{name} {mode}: {retry:?}");
        assert_eq!(retry.json()["id"], Value::from(1000), "{name} {mode}");
        assert_eq!(
            retry.json()["result"]["content"][0]["text"],
            format!("run {}", before + 1),
            "{name} {mode}: {retry:?}"
        );
    }
}

common::on_every_store!(an_event_stream_in_any_case_is_recorded);

/// SEP-1699 as it happens: the tool is still running when the priming stream closes. Retries
/// while it runs, and after it finished, run nothing. Counted at the sink when the work ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_answered_on_a_resumed_stream_runs_once_while_it_runs_and_after() {
    let effects = Effects::default();
    let started = Effects::default();
    let finish = std::sync::Arc::new(Notify::new());
    let app = Router::new()
        .route(
            "/mcp",
            post({
                let (effects, started, finish) = (effects.clone(), started.clone(), finish.clone());
                move || {
                    let (effects, started, finish) =
                        (effects.clone(), started.clone(), finish.clone());
                    async move {
                        started.hit();
                        // The tool goes on after the stream closes, as an MCP server's task.
                        tokio::spawn(async move {
                            finish.notified().await;
                            effects.hit();
                        });
                        Response::builder()
                            .header(header::CONTENT_TYPE, "text/event-stream")
                            .body(Body::from(Bytes::from_static(
                                b"id: 0\nretry: 3000\ndata: \n\n",
                            )))
                            .expect("response")
                    }
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(tower_idempotency::MemoryStore::new())
                .single_tenant()
                .jsonrpc(JsonRpc::new()),
        );
    let addr = serve(app).await;
    let key = unique("sep-1699");
    let first = call(addr, "priming", Some(&key), "1").await;
    assert_eq!(first.status, 200, "{first:?}");
    assert!(first.text.contains("id: 0"), "{first:?}");
    // While the tool runs: retries, some at once.
    let retries: Vec<_> = (0..8)
        .map(|i| {
            let key = key.clone();
            tokio::spawn(
                async move { call(addr, "priming", Some(&key), &(10 + i).to_string()).await },
            )
        })
        .collect();
    for retry in retries {
        let retry = retry.await.expect("join");
        assert!(
            [-31001, -31007].contains(&retry.code()),
            "a retry while the tool runs: {retry:?}"
        );
    }
    assert_eq!(started.count(), 1, "the tool was started again");
    finish.notify_one();
    for _ in 0..500 {
        if effects.count() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let after = settled(addr, "priming", &key).await;
    assert_eq!(after.code(), -31007, "{after:?}");
    assert_eq!(started.count(), 1, "the tool was started again");
    assert_eq!(effects.count(), 1, "the effect happened once");
}

/// A keyed call with an id beyond a double's range (`1e400`, which JavaScript writes back as
/// `null`) is refused, nothing run; without a key it passes through untouched. A response with
/// id `null` answers no call: it never becomes the recorded outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_that_cannot_be_read_back_are_refused_and_null_answers_nothing() {
    let effects = Effects::default();
    let addr = serve(app(tower_idempotency::MemoryStore::new(), &effects)).await;
    for id in ["1e400", "-1e400", "1E+999"] {
        let before = effects.count();
        let key = unique("big-id");
        let refused = call(addr, "json", Some(&key), id).await;
        assert_eq!(refused.code(), -31009, "{id}: {refused:?}");
        assert!(
            refused.text.contains(&format!("\"id\":{id}")),
            "{id}: {refused:?}"
        );
        assert_eq!(effects.count(), before, "{id}: the refused call ran");
        let passed = call(addr, "json", None, id).await;
        assert_eq!(passed.status, 200, "{id}: {passed:?}");
        assert_eq!(effects.count(), before + 1, "{id}: without a key it passes");
    }
    // The null-id error the server writes is not the call's response: the key goes back, and
    // the retry's answer is its own, never the recorded parse error.
    let before = effects.count();
    let key = unique("null-answer");
    call(addr, "null-error-json", Some(&key), "5").await;
    let retry = call(addr, "json", Some(&key), "6").await;
    assert!(!retry.replayed, "{retry:?}");
    assert_eq!(retry.json()["id"], Value::from(6), "{retry:?}");
    assert_eq!(effects.count() - before, 2);
    let replay = call(addr, "json", Some(&key), "9").await;
    assert!(replay.replayed, "{replay:?}");
    assert_eq!(effects.count() - before, 2, "{replay:?}");
}

/// DESIGN §3 and §8: an answer too large to keep is classified as one read whole would be,
/// and a retry is told its own status. Under `DefinitiveOnly` a JSON-RPC answer is definitive
/// only under a success status: over the response limit, a 201 is kept (its retry's -31007
/// says "status 201", never a status the layer made up) and a 422 gives the key back, as the
/// same 422 under the limit does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_too_large_to_keep_is_classified_by_its_own_status() {
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/mcp",
            post(move |headers: HeaderMap| {
                let sink = sink.clone();
                async move {
                    sink.hit();
                    let get = |name: &str| header_of(&headers, name);
                    let (id, status) = (get("x-raw-id"), get("x-status"));
                    let padding = "x".repeat(usize::from(get("x-big") == "1") * 400);
                    let text = format!(
                        r#"{{"jsonrpc":"2.0","id":{id},"error":{{"code":-32602,"message":"{padding}"}}}}"#
                    );
                    Response::builder()
                        .status(status.parse::<u16>().expect("x-status"))
                        .header(header::CONTENT_TYPE, "application/json")
                        .body(Body::from(text))
                        .expect("response")
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(tower_idempotency::MemoryStore::new())
                .single_tenant()
                .response_limit(160)
                .jsonrpc(JsonRpc::new()),
        );
    let addr = serve(app).await;
    let send = |key: String, id: &'static str, status: &'static str, big: &'static str| async move {
        let body = format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"t","arguments":{{"x":1}}}}}}"#
        );
        let res = common::client()
            .post(format!("http://{addr}/mcp"))
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .header("x-raw-id", id)
            .header("x-status", status)
            .header("x-big", big)
            .body(body)
            .send();
        let res = guard("a call", res).await.expect("send");
        let code = res.status().as_u16();
        (code, guard("a body", res.text()).await.expect("body"))
    };
    // (status, over the limit, runs after a retry)
    for (status, big, runs) in [("201", "1", 1), ("422", "1", 2), ("422", "0", 2)] {
        let before = effects.count();
        let key = unique(&format!("too-large-{status}-{big}"));
        let (first, _) = send(key.clone(), "7", status, big).await;
        assert_eq!(first.to_string(), status);
        let (_, retry) = send(key, "8", status, big).await;
        assert_eq!(
            effects.count() - before,
            runs,
            "{status} big={big}: {retry}"
        );
        if runs == 1 {
            assert!(retry.contains("-31007"), "{retry}");
            assert!(retry.contains("status 201"), "{retry}");
        }
    }
}

/// DESIGN §3 and §7 (a record that fails is retried, never dropped: retries get 409 meanwhile,
/// never a second run): the store fails at the very step that records a priming stream as
/// done. While it fails, retries run nothing; once it is back, the record lands and retries
/// are told the call was taken (-31007). Counted at the sink.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_priming_stream_whose_record_fails_still_runs_once() {
    let effects = Effects::default();
    let store = common::faulty::Faulty::new(tower_idempotency::MemoryStore::new());
    store
        .fail_complete
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let addr = serve(app(store.clone(), &effects)).await;
    let key = unique("priming-record-fails");
    let first = call(addr, "priming", Some(&key), "7").await;
    assert_eq!(first.status, 200, "{first:?}");
    for i in 0..5 {
        let retry = call(addr, "priming", Some(&key), &(100 + i).to_string()).await;
        assert_eq!(retry.status, 409, "while the record fails: {retry:?}");
        assert_eq!(
            effects.count(),
            1,
            "a retry ran while the record failed: {retry:?}"
        );
    }
    store
        .fail_complete
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let mut told = None;
    for i in 0..600 {
        let retry = call(addr, "priming", Some(&key), &(200 + i).to_string()).await;
        if retry.code() == -31007 {
            told = Some(retry);
            break;
        }
        assert_eq!(retry.status, 409, "before the record lands: {retry:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let told = told.expect("the record landed once the store was back");
    assert!(told.text.contains("event stream"), "{told:?}");
    assert_eq!(effects.count(), 1, "the tool ran again");
}
