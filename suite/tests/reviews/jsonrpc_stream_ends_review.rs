//! Review of 9c5bcf1 (a JSON-RPC event stream that ends without the call's response is taken
//! as done unless it says the call was not run; `null` ids answer nothing; `1e400` ids are
//! refused; `Text/Event-Stream` in any case) and af3038e (a `charset` value is compared
//! without case), by a fresh reviewer. Its findings were fixed in the commit that adds this
//! file: a cut stream after an interim result gives the key back, an unseen stream is done
//! whatever the policy and does not tell the caller it may move on to a new key, a `null`-id
//! error gives the key back only before any other message and only as an error object,
//! whitespace before the media type, and a multipart part's charset.
//!
//! Every test tries to make a tool run twice for one key, lose a call (a retry can never run
//! although the tool never finished), replay the wrong answer, or say something false to the
//! caller. Runs are counted at the sink (the handler), never inferred from answers; real HTTP
//! over TCP.

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::header;
use axum::response::Response;
use axum::routing::post;
use bytes::Bytes;
use common::raw::unique;
use common::{Effects, guard, serve, until};
use serde_json::Value;
use tokio::sync::Notify;
use tower_idempotency::jsonrpc::JsonRpc;
use tower_idempotency::{CachePolicy, IdempotencyLayer, IdempotencyStore, MemoryStore};

// ---------------------------------------------------------------------------------------------
// The tool server: each run is counted, then answers with a scripted body.
// ---------------------------------------------------------------------------------------------

/// One step of a scripted response body.
#[derive(Clone)]
enum Step {
    /// A data frame.
    Data(Bytes),
    /// Waits until the test says go.
    Wait(Arc<Notify>),
    /// The body fails here (the connection is cut mid-stream).
    Fail,
}

fn data(text: &str) -> Step {
    Step::Data(Bytes::copy_from_slice(text.as_bytes()))
}

fn bytes(raw: &[u8]) -> Step {
    Step::Data(Bytes::copy_from_slice(raw))
}

/// A scripted answer: status, content type (none if empty), body steps.
struct Scripted {
    status: u16,
    content_type: String,
    steps: Vec<Step>,
}

fn sse(steps: Vec<Step>) -> Scripted {
    Scripted {
        status: 200,
        content_type: "text/event-stream".to_owned(),
        steps,
    }
}

fn json(text: &str) -> Scripted {
    Scripted {
        status: 200,
        content_type: "application/json".to_owned(),
        steps: vec![data(text)],
    }
}

fn body_of(steps: Vec<Step>) -> Body {
    let stream = futures_util::stream::unfold(steps.into_iter(), |mut steps| async move {
        loop {
            match steps.next()? {
                Step::Data(b) => return Some((Ok::<Bytes, std::io::Error>(b), steps)),
                Step::Wait(go) => go.notified().await,
                Step::Fail => {
                    return Some((Err(std::io::Error::other("the stream was cut")), steps));
                }
            }
        }
    });
    Body::from_stream(stream)
}

/// What the tool answers on its `n`th run (1-based) to the call whose id it read as the
/// second argument (written back as a JSON text).
type Script = Arc<dyn Fn(usize, &str) -> Scripted + Send + Sync>;

/// The tool behind the layer (JSON-RPC mode, `policy`, `limit` for recorded responses).
fn app_with<St: IdempotencyStore>(
    store: St,
    effects: &Effects,
    policy: CachePolicy,
    limit: usize,
    script: Script,
) -> Router {
    let effects = effects.clone();
    Router::new()
        .route(
            "/mcp",
            post(move |body: Bytes| {
                let (effects, script) = (effects.clone(), script.clone());
                async move {
                    let n = effects.hit();
                    let id = serde_json::from_slice::<Value>(&body)
                        .map(|v| v["id"].to_string())
                        .unwrap_or_default();
                    let answer = script(n, &id);
                    let mut res = Response::builder().status(answer.status);
                    if !answer.content_type.is_empty() {
                        res = res.header(header::CONTENT_TYPE, answer.content_type);
                    }
                    res.body(body_of(answer.steps)).expect("response")
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(store)
                .single_tenant()
                .cache_policy(policy)
                .response_limit(limit)
                .jsonrpc(JsonRpc::new().meta_key("idempotencyKey")),
        )
}

fn app(effects: &Effects, script: Script) -> Router {
    app_with(
        MemoryStore::new(),
        effects,
        CachePolicy::DefinitiveOnly,
        1024 * 1024,
        script,
    )
}

// ---------------------------------------------------------------------------------------------
// Messages.
// ---------------------------------------------------------------------------------------------

const PRIMING: &str = "id: 0\nretry: 3000\ndata: \n\n";
const PROGRESS: &str = r#"{"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken":"p","progress":1}}"#;

fn result(id: &str, n: usize) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"result":{{"content":[{{"type":"text","text":"run {n}"}}]}}}}"#
    )
}

fn interim(id: &str) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"result":{{"resultType":"input_required","inputRequests":{{"q":{{"method":"elicitation/create","params":{{}}}}}},"requestState":"s1"}}}}"#
    )
}

fn event(message: &str) -> String {
    format!("data: {message}\n\n")
}

// ---------------------------------------------------------------------------------------------
// The client.
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
struct Got {
    status: u16,
    replayed: bool,
    text: String,
    /// The body failed before its end (the server cut the stream).
    cut: bool,
}

impl Got {
    fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_default()
    }

    /// The JSON-RPC error code, read from the text (0: none).
    fn code(&self) -> i64 {
        common::jsonrpc_code(&self.text)
    }
}

/// One `tools/call` of the same operation, its id written as `id`, `extra` appended to its
/// params (a continuation's `inputResponses`).
async fn call(addr: SocketAddr, key: Option<&str>, id: &str, extra: &str) -> Got {
    let body = format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"t","arguments":{{"x":1}}{extra}}}}}"#
    );
    let mut req = common::client()
        .post(format!("http://{addr}/mcp"))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(body);
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    let mut res = guard("a call", req.send()).await.expect("send");
    let status = res.status().as_u16();
    let replayed = res
        .headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let mut text = Vec::new();
    let mut cut = false;
    loop {
        match guard("a chunk", res.chunk()).await {
            Ok(Some(chunk)) => text.extend_from_slice(&chunk),
            Ok(None) => break,
            Err(_) => {
                cut = true;
                break;
            }
        }
    }
    Got {
        status,
        replayed,
        text: String::from_utf8_lossy(&text).into_owned(),
        cut,
    }
}

/// One call under a fresh key named `name`, then retries until the key settles: the tool
/// must have run once in all.
async fn runs_once(addr: SocketAddr, effects: &Effects, name: &str) {
    let key = unique(name);
    call(addr, Some(&key), "1", "").await;
    let retry = settled(addr, &key, "").await;
    assert_eq!(
        effects.count(),
        1,
        "{name}: the tool ran again for one key: {retry:?}"
    );
}

/// Retries `key` until it is no longer in flight (streams are recorded on a task of their
/// own), each retry with a new id.
async fn settled(addr: SocketAddr, key: &str, extra: &str) -> Got {
    for i in 0..1000 {
        let got = call(addr, Some(key), &(1000 + i).to_string(), extra).await;
        if got.code() != -31001 {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the key never settled");
}

const CONTINUATION: &str =
    r#","inputResponses":{"q":{"action":"accept","content":{}}},"requestState":"s1""#;

// =============================================================================================
// Findings: calls that run twice, calls that are lost.
// =============================================================================================

/// DESIGN §8 (interim results are never stored; the continuation runs under the same key):
/// the stream carried the call's `input_required` interim result, complete, to the client;
/// then the connection was cut. The tool never finished: the continuation (same key, with
/// `inputResponses`) must run. The commit gives the key back for this stream when it closes
/// cleanly, but records it as done when it is cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interim_result_then_a_cut_stream_does_not_lose_the_call() {
    let effects = Effects::default();
    let cut = Arc::new(Notify::new());
    let script: Script = {
        let cut = cut.clone();
        Arc::new(move |n, id| match n {
            1 => sse(vec![
                data(&event(PROGRESS)),
                data(&event(&interim("7"))),
                Step::Wait(cut.clone()),
                Step::Fail,
            ]),
            n => sse(vec![data(&event(&result(id, n)))]),
        })
    };
    let addr = serve(app(&effects, script)).await;
    let key = unique("interim-cut");
    let mut res = guard(
        "first",
        common::client()
            .post(format!("http://{addr}/mcp"))
            .header("content-type", "application/json")
            .header("idempotency-key", &key)
            .body(r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"t","arguments":{"x":1}}}"#)
            .send(),
    )
    .await
    .expect("send");
    // The client reads the interim result, complete; then the server cuts the stream.
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("\"requestState\":\"s1\"}}\n\n") {
        match guard("a chunk", res.chunk()).await {
            Ok(Some(chunk)) => seen.extend_from_slice(&chunk),
            other => panic!("the interim result never arrived: {other:?}"),
        }
    }
    cut.notify_one();
    let mut was_cut = false;
    loop {
        match guard("the rest", res.chunk()).await {
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(_) => {
                was_cut = true;
                break;
            }
        }
    }
    assert!(was_cut, "the stream was cut");
    let cont = settled(addr, &key, CONTINUATION).await;
    assert_eq!(
        effects.count(),
        2,
        "the continuation never ran (the call is lost): {cont:?}"
    );
    assert!(cont.text.contains("run 2"), "{cont:?}");
}

/// DESIGN §3 ("once the inner service has returned a response head, the effect is taken as
/// done") and §8: a stream taken as done (SEP-1699 priming, response elsewhere) stays done
/// under a custom policy too. A plausible custom policy, "record results, but not tool
/// errors", reads `Outcome::jsonrpc`; the unseen stream reaches it as `None`, the key is
/// released, and the retry runs the tool again (a JSON-RPC body lost after its head, on the
/// non-streaming path, is taken as done whatever the policy).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_taken_as_done_stays_done_under_a_custom_policy() {
    let effects = Effects::default();
    let policy = CachePolicy::custom(|o| {
        o.jsonrpc
            .is_some_and(|m| !String::from_utf8_lossy(m).contains(r#""isError":true"#))
    });
    let addr = serve(app_with(
        MemoryStore::new(),
        &effects,
        policy,
        1024 * 1024,
        Arc::new(|_, _| sse(vec![data(PRIMING)])),
    ))
    .await;
    runs_once(addr, &effects, "custom-unseen").await;
}

/// DESIGN §3 (`CachePolicy::Everything`: the first outcome is the answer forever) and §8: an
/// error to a `null` id is read as "the server could not read the call", but here the
/// stream had already carried the call's own progress (the tool was running) when the
/// server, failing to write its result, sent `{"id":null,"error":{-32603}}`. The key is
/// given back and the retry runs the tool a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_null_id_error_after_the_calls_progress_does_not_rerun_it() {
    let effects = Effects::default();
    let addr = serve(app_with(
        MemoryStore::new(),
        &effects,
        CachePolicy::Everything,
        1024 * 1024,
        Arc::new(|_, _| {
            sse(vec![
                data(PRIMING),
                data(&event(PROGRESS)),
                data(&event(
                    r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32603,"message":"Internal error"}}"#,
                )),
            ])
        }),
    ))
    .await;
    runs_once(addr, &effects, "progress-null-error").await;
}

/// DESIGN §8: only an error response to a `null` id says the server could not read the call;
/// `"error": null` is no error object (not a JSON-RPC response at all). After SEP-1699's
/// priming event (the server took the call), such a message must not give the key back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_null_id_with_error_null_is_not_a_refusal() {
    let effects = Effects::default();
    let addr = serve(app(
        &effects,
        Arc::new(|_, _| {
            sse(vec![
                data(PRIMING),
                data(&event(r#"{"jsonrpc":"2.0","id":null,"error":null}"#)),
            ])
        }),
    ))
    .await;
    runs_once(addr, &effects, "error-null").await;
}

/// DESIGN §1 (`safe_new_key` is true only when the outcome is definite: nothing ran, or it is
/// recorded) and §9 (the caller mints a new key only when told so): under SEP-1699 the tool
/// is still running when the priming stream closes. The retry's -31007 answer must not tell
/// the caller it may start over with a new key: neither did nothing run, nor is the outcome
/// recorded (it may yet fail).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_while_the_unseen_tool_runs_is_not_told_to_start_over() {
    let effects = Effects::default();
    let finished = Effects::default();
    let finish = Arc::new(Notify::new());
    let script: Script = {
        let (finished, finish) = (finished.clone(), finish.clone());
        Arc::new(move |_, _| {
            let (finished, finish) = (finished.clone(), finish.clone());
            tokio::spawn(async move {
                finish.notified().await;
                finished.hit();
            });
            sse(vec![data(PRIMING)])
        })
    };
    let addr = serve(app(&effects, script)).await;
    let key = unique("sep-1699-safe");
    call(addr, Some(&key), "1", "").await;
    let retry = settled(addr, &key, "").await;
    assert_eq!(retry.code(), -31007, "{retry:?}");
    assert_eq!(finished.count(), 0, "the tool is still running");
    let safe = retry.json()["error"]["data"]["safe_new_key"].clone();
    finish.notify_one();
    until("the tool finished", || finished.count() == 1).await;
    assert_eq!(effects.count(), 1);
    assert_eq!(
        safe,
        Value::Bool(false),
        "a caller told safe_new_key while the tool still runs may run it twice: {retry:?}"
    );
}

/// DESIGN §8 (SSE responses are teed and replayed as their final response; one run): a
/// `Content-Type` whose value a client reads as `text/event-stream` (HTTP clients drop
/// surrounding whitespace, RFC 9110 §5.5) but the layer does not: the stream is read whole
/// as if it were JSON, its complete final response is not found, the key is given back, and
/// the retry runs the tool again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_stream_with_leading_whitespace_is_still_recorded() {
    let effects = Effects::default();
    let addr = serve(app(
        &effects,
        Arc::new(|n, _| Scripted {
            status: 200,
            content_type: " text/event-stream".to_owned(),
            steps: vec![data(&event(&result("7", n)))],
        }),
    ))
    .await;
    let key = unique("leading-space");
    let first = call(addr, Some(&key), "7", "").await;
    assert_eq!(first.status, 200, "{first:?}");
    assert!(first.text.contains("run 1"), "{first:?}");
    let retry = settled(addr, &key, "").await;
    assert_eq!(
        effects.count(),
        1,
        "the tool ran again for one key: {retry:?}"
    );
}

// =============================================================================================
// Probes that hold on the current code.
// =============================================================================================

/// DESIGN §8 and §1.7 (run to completion; recorded even if the caller hangs up): the client
/// hangs up after the priming event; the stream goes on and carries the final response. The
/// retry replays it; the tool ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_hanging_up_after_priming_still_gets_the_final_replayed() {
    let effects = Effects::default();
    let go = Arc::new(Notify::new());
    let script: Script = {
        let go = go.clone();
        Arc::new(move |n, _| {
            sse(vec![
                data(PRIMING),
                Step::Wait(go.clone()),
                data(&event(PROGRESS)),
                data(&event(&result("7", n))),
            ])
        })
    };
    let addr = serve(app(&effects, script)).await;
    let key = unique("hang-up");
    let mut res = guard(
        "first",
        common::client()
            .post(format!("http://{addr}/mcp"))
            .header("content-type", "application/json")
            .header("idempotency-key", &key)
            .body(r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"t","arguments":{"x":1}}}"#)
            .send(),
    )
    .await
    .expect("send");
    let chunk = guard("priming", res.chunk()).await.expect("chunk");
    assert!(chunk.is_some_and(|c| c.starts_with(b"id: 0")));
    drop(res);
    go.notify_one();
    let retry = settled(addr, &key, "").await;
    assert!(retry.replayed, "{retry:?}");
    assert_eq!(retry.json()["id"], Value::from(1000), "{retry:?}");
    assert_eq!(retry.json()["result"]["content"][0]["text"], "run 1");
    assert_eq!(effects.count(), 1);
}

/// DESIGN §1.6 (in flight, lease live: 409, nothing run) and §8: a retry racing the first
/// stream while it is open (after its priming event) gets -31001, never a run; once the
/// stream carries the final response, the retry replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_racing_an_open_stream_is_in_flight_then_replayed() {
    let effects = Effects::default();
    let go = Arc::new(Notify::new());
    let script: Script = {
        let go = go.clone();
        Arc::new(move |n, _| {
            sse(vec![
                data(PRIMING),
                Step::Wait(go.clone()),
                data(&event(&result("7", n))),
            ])
        })
    };
    let addr = serve(app(&effects, script)).await;
    let key = unique("race");
    let first = tokio::spawn({
        let key = key.clone();
        async move { call(addr, Some(&key), "7", "").await }
    });
    until("the first run", || effects.count() == 1).await;
    for i in 0..5 {
        let racing = call(addr, Some(&key), &format!("\"r{i}\""), "").await;
        assert_eq!(racing.code(), -31001, "{racing:?}");
        assert_eq!(racing.json()["id"], Value::from(format!("r{i}")));
    }
    go.notify_one();
    let first = first.await.expect("join");
    assert!(first.text.contains("run 1"), "{first:?}");
    let retry = settled(addr, &key, "").await;
    assert!(retry.replayed, "{retry:?}");
    assert_eq!(retry.json()["result"]["content"][0]["text"], "run 1");
    assert_eq!(effects.count(), 1);
}

/// DESIGN §8 (an event stream is read as the EventSource parser reads it) and §3 (done, never
/// run again): a priming event cut into one-byte frames, CR-only line ends, a byte-order mark
/// split across frames; and the same framing around a final response, which is replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_framing_is_read_as_one_stream() {
    let effects = Effects::default();
    let addr = serve(app(
        &effects,
        Arc::new(|n, _| {
            let mut raw = b"\xef\xbb\xbfid: 0\rretry: 3000\rdata:\r\r".to_vec();
            if n % 2 == 0 {
                raw.extend_from_slice(format!("data: {}\r\r", result("7", n)).as_bytes());
            }
            sse(raw.chunks(1).map(bytes).collect())
        }),
    ))
    .await;
    // Odd runs: priming only, done, not stored.
    let key = unique("odd-priming");
    call(addr, Some(&key), "7", "").await;
    let retry = settled(addr, &key, "").await;
    assert_eq!(retry.code(), -31007, "{retry:?}");
    assert_eq!(effects.count(), 1);
    // Even runs: the response after the priming event, replayed.
    let key = unique("odd-final");
    call(addr, Some(&key), "7", "").await;
    let retry = settled(addr, &key, "").await;
    assert!(retry.replayed, "{retry:?}");
    assert_eq!(retry.json()["result"]["content"][0]["text"], "run 2");
    assert_eq!(effects.count(), 2);
}

/// DESIGN §8 (interim results are never stored; the continuation runs under the same key):
/// an interim result cut across frames, after priming and progress, gives the key back; the
/// continuation runs and its final response is replayed to a third call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interim_result_after_other_events_gives_the_key_back() {
    let effects = Effects::default();
    let addr = serve(app(
        &effects,
        Arc::new(|n, id| match n {
            1 => {
                let text = format!("{PRIMING}{}{}", event(PROGRESS), event(&interim("7")));
                sse(text.as_bytes().chunks(7).map(bytes).collect())
            }
            n => sse(vec![data(&event(&result(id, n)))]),
        }),
    ))
    .await;
    let key = unique("interim-late");
    call(addr, Some(&key), "7", "").await;
    let cont = settled(addr, &key, CONTINUATION).await;
    assert!(cont.text.contains("run 2"), "{cont:?}");
    assert_eq!(effects.count(), 2);
    let again = call(addr, Some(&key), "9", CONTINUATION).await;
    assert!(again.replayed, "{again:?}");
    assert_eq!(again.json()["id"], Value::from(9));
    assert_eq!(
        again.json()["result"]["content"][0]["text"],
        "run 2",
        "{again:?}"
    );
    assert_eq!(effects.count(), 2);
}

/// DESIGN §8 and §3: streams that end without the call's response and with nothing that says
/// it was not run are done, never run again: an interim result to another id, a `null` id
/// with a result, an empty stream, a stream cut after priming, and a priming stream in an
/// upper-case media type with parameters. Each on its own key; one run each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_without_a_sign_of_not_run_are_done() {
    let cases: Vec<(&str, Scripted)> = vec![
        ("interim-other-id", sse(vec![data(&event(&interim("8")))])),
        (
            "interim-other-string-id",
            sse(vec![data(&event(&interim("\"07\"")))]),
        ),
        ("null-result", sse(vec![data(&event(&result("null", 1)))])),
        ("empty", sse(vec![])),
        ("cut-after-priming", sse(vec![data(PRIMING), Step::Fail])),
        (
            "upper-case",
            Scripted {
                status: 200,
                content_type: "TEXT/EVENT-STREAM\t;charset=UTF-8".to_owned(),
                steps: vec![data(PRIMING)],
            },
        ),
    ];
    for (name, scripted) in cases {
        let effects = Effects::default();
        let scripted = Arc::new(std::sync::Mutex::new(Some(scripted)));
        let addr = serve(app(
            &effects,
            Arc::new(move |_, _| {
                scripted
                    .lock()
                    .unwrap()
                    .take()
                    .unwrap_or_else(|| json("{}"))
            }),
        ))
        .await;
        let key = unique(name);
        let first = call(addr, Some(&key), "7", "").await;
        assert_eq!(first.cut, name == "cut-after-priming", "{name}: {first:?}");
        let retry = settled(addr, &key, "").await;
        assert_eq!(retry.code(), -31007, "{name}: {retry:?}");
        assert_eq!(effects.count(), 1, "{name}: ran again");
        assert_eq!(retry.json()["id"], Value::from(1000), "{name}");
    }
}

/// DESIGN §3 (`Everything`: the first outcome is the answer) and §8: a priming-only stream
/// under `Everything` is done as well, never run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_priming_stream_under_everything_is_done() {
    let effects = Effects::default();
    let addr = serve(app_with(
        MemoryStore::new(),
        &effects,
        CachePolicy::Everything,
        1024 * 1024,
        Arc::new(|_, _| sse(vec![data(PRIMING)])),
    ))
    .await;
    let key = unique("everything-priming");
    call(addr, Some(&key), "1", "").await;
    let retry = settled(addr, &key, "").await;
    assert_eq!(retry.code(), -31007, "{retry:?}");
    assert_eq!(effects.count(), 1);
}

/// DESIGN §8 (a keyed call that cannot be guarded is refused, never run unguarded): an id
/// beyond a double's range is refused whether the key is the header or `params._meta`, and in
/// a batch; ids the layer can read (`-0`, `1e2`, a big integer, the string `"null"`) still
/// find their response written back as a JavaScript server writes it, and are replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_ids_are_refused_and_readable_ones_answered() {
    let effects = Effects::default();
    let addr = serve(app(
        &effects,
        Arc::new(|n, _| {
            // The server reads the id as a double and writes it back (JavaScript).
            sse(vec![
                data(PRIMING),
                data(&event(&result(ID_BACK[n - 1], n))),
            ])
        }),
    ))
    .await;
    // `_meta`-keyed call with an unreadable id.
    let meta = r#","_meta":{"idempotencyKey":"k-1e400-meta"}"#;
    let refused = call(addr, None, "1e400", meta).await;
    assert_eq!(refused.code(), -31009, "{refused:?}");
    // A keyed batch holding one.
    let batch = guard(
        "batch",
        common::client()
            .post(format!("http://{addr}/mcp"))
            .header("content-type", "application/json")
            .header("idempotency-key", unique("batch"))
            .body(r#"[{"jsonrpc":"2.0","id":1e400,"method":"tools/call","params":{"name":"t"}}]"#)
            .send(),
    )
    .await
    .expect("send");
    let text = batch.text().await.expect("text");
    assert!(text.contains("-31009"), "{text}");
    assert_eq!(effects.count(), 0, "a refused call ran");
    for (i, sent) in ID_SENT.iter().enumerate() {
        let key = unique(&format!("id-{i}"));
        let first = call(addr, Some(&key), sent, "").await;
        assert!(
            first.text.contains(&format!("run {}", i + 1)),
            "{sent}: {first:?}"
        );
        let retry = settled(addr, &key, "").await;
        assert!(retry.replayed, "{sent}: {retry:?}");
        assert_eq!(
            retry.json()["result"]["content"][0]["text"],
            format!("run {}", i + 1),
            "{sent}"
        );
        assert_eq!(effects.count(), i + 1, "{sent}: ran again");
    }
}

const ID_SENT: [&str; 4] = ["-0", "1e2", "123456789012345678901234567890", "\"null\""];
const ID_BACK: [&str; 4] = ["0", "100", "1.2345678901234568e29", "\"null\""];

// =============================================================================================
// af3038e: charset values without case.
// =============================================================================================

/// A plain HTTP route (one run counted per request that reaches it).
fn http_app(effects: &Effects) -> Router {
    let (effects, op_effects) = (effects.clone(), effects.clone());
    Router::new()
        .route(
            "/op",
            post(move || {
                let effects = op_effects.clone();
                async move {
                    let n = effects.hit();
                    Response::builder()
                        .status(201)
                        .body(Body::from(format!("run {n}")))
                        .expect("response")
                }
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant())
        .merge(
            Router::new().route(
                "/mcp",
                post({
                    let effects = effects.clone();
                    move || {
                        let effects = effects.clone();
                        async move {
                            let n = effects.hit();
                            Response::builder()
                                .header(header::CONTENT_TYPE, "application/json")
                                .body(Body::from(result("1", n)))
                                .expect("response")
                        }
                    }
                })
                .layer(
                    IdempotencyLayer::new(MemoryStore::new())
                        .single_tenant()
                        .jsonrpc(JsonRpc::new()),
                ),
            ),
        )
}

async fn post_as(addr: SocketAddr, path: &str, key: &str, content_type: &str, body: &[u8]) -> u16 {
    let res = guard(
        "post",
        common::client()
            .post(format!("http://{addr}{path}"))
            .header("idempotency-key", key)
            .header("content-type", content_type)
            .body(body.to_vec())
            .send(),
    )
    .await
    .expect("send");
    res.status().as_u16()
}

/// DESIGN §1.4 (media-type parameters count; canonicalisation merges only what is provably
/// the same) and §7.1: a charset's name has no case (RFC 9110 §8.3.2), in any spelling of the
/// parameter name and quoting, so such a retry replays; a charset that differs, an alias that
/// is not the same name, and another parameter's case still make it another request (422,
/// nothing run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charset_case_replays_other_values_do_not() {
    let effects = Effects::default();
    let addr = serve(http_app(&effects)).await;
    // (first, retry, same request?)
    let pairs = [
        (
            "text/plain; Charset=LATIN1",
            "text/plain; charset=\"latin1\"",
            true,
        ),
        (
            "text/plain;charset=\"ISO-8859-1\"",
            "TEXT/PLAIN ; CHARSET=iso-8859-1",
            true,
        ),
        ("application/json; charset=UTF-8", "application/json", true),
        (
            "application/json; charset=\"Utf-8\"",
            "application/json; charset=utf-8",
            true,
        ),
        ("application/json; charset=utf8", "application/json", false),
        (
            "text/plain; charset=latin1",
            "text/plain; charset=latin2",
            false,
        ),
        (
            "text/csv; header=Present",
            "text/csv; header=present",
            false,
        ),
        ("text/plain; charset=latin1", "text/plain", false),
    ];
    for (i, (first, retry, same)) in pairs.into_iter().enumerate() {
        let key = unique(&format!("charset-{i}"));
        let body: &[u8] = if first.contains("json") {
            b"{\"a\":1}"
        } else {
            b"caf\xe9"
        };
        assert_eq!(
            post_as(addr, "/op", &key, first, body).await,
            201,
            "{first}"
        );
        let before = effects.count();
        let status = post_as(addr, "/op", &key, retry, body).await;
        assert_eq!(effects.count(), before, "{first} then {retry}: ran again");
        assert_eq!(status, if same { 201 } else { 422 }, "{first} then {retry}");
    }
    // JSON-RPC mode compares the media type as HTTP mode does.
    let key = unique("charset-jsonrpc");
    let call = br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t"}}"#;
    let before = effects.count();
    assert_eq!(
        post_as(addr, "/mcp", &key, "application/json; charset=UTF-8", call).await,
        200
    );
    assert_eq!(
        post_as(addr, "/mcp", &key, "Application/Json", call).await,
        200
    );
    assert_eq!(effects.count(), before + 1, "a JSON-RPC retry ran again");
}

/// DESIGN §1.4 (`multipart/form-data` by its parts, not its boundary) and af3038e's reason
/// (RFC 9110 §8.3.2: a retry that spells a charset in another case is the same request and
/// should replay, not get 422): a part's own `Content-Type` charset is compared by its raw
/// bytes, so a client whose retry writes the part's charset in another case gets 422.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multipart_parts_charset_is_compared_without_case_too() {
    let effects = Effects::default();
    let addr = serve(http_app(&effects)).await;
    let form = |boundary: &str, charset: &str| {
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"a\"\r\nContent-Type: text/plain; charset={charset}\r\n\r\ncaf\u{e9}\r\n--{boundary}--\r\n"
        )
    };
    let key = unique("multipart-charset");
    let first = post_as(
        addr,
        "/op",
        &key,
        "multipart/form-data; boundary=AAA",
        form("AAA", "UTF-8").as_bytes(),
    )
    .await;
    assert_eq!(first, 201);
    let retry = post_as(
        addr,
        "/op",
        &key,
        "multipart/form-data; boundary=BBB",
        form("BBB", "utf-8").as_bytes(),
    )
    .await;
    assert_eq!(effects.count(), 1, "ran again");
    assert_eq!(
        retry, 201,
        "the same form, its part's charset in another case"
    );
}
