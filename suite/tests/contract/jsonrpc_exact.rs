//! Issue 17: the JSON-RPC mode and the JSON envelope, exact. A keyed call is never run
//! unguarded, two calls are the same only when they are, replays are byte-faithful, and an
//! event stream is read once. Over real sockets, effects counted at the sink.

use crate::common;

use std::net::SocketAddr;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use common::{Effects, client, serve};
use serde_json::Value;
use tower_idempotency::jsonrpc::JsonRpc;
use tower_idempotency::{IdempotencyLayer, MemoryStore};

/// A tool server that answers every call with the same bytes a real one might write: a
/// decimal with a trailing zero, an integer beyond 2^64, members in its own order.
async fn tool(State(effects): State<Effects>, body: Bytes) -> Response {
    let message: Value = serde_json::from_slice(&body).unwrap_or_default();
    let id = message.get("id").map(ToString::to_string);
    let n = effects.hit();
    let Some(id) = id else {
        return StatusCode::ACCEPTED.into_response();
    };
    // The id is echoed as parsed (what servers do); the layer re-addresses replays itself.
    let text = format!(
        r#"{{"jsonrpc":"2.0","id":{id},"result":{{"zeta":{n},"amount":10.50,"big":123456789012345678901234567890,"content":[]}}}}"#
    );
    ([(header::CONTENT_TYPE, "application/json")], text).into_response()
}

async fn server(jsonrpc: JsonRpc) -> (SocketAddr, Effects) {
    // The layer's default limit.
    server_limited(jsonrpc, 1 << 20).await
}

async fn server_limited(jsonrpc: JsonRpc, body_limit: usize) -> (SocketAddr, Effects) {
    let effects = Effects::default();
    let app = Router::new()
        .route("/mcp", post(tool))
        .with_state(effects.clone())
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .body_limit(body_limit)
                .jsonrpc(jsonrpc),
        );
    (serve(app).await, effects)
}

async fn send(addr: SocketAddr, path: &str, key: Option<&str>, body: &str) -> reqwest::Response {
    let mut req = client()
        .post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(body.to_owned());
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    req.send().await.expect("request")
}

fn call(id: &str, args: &str) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"t","arguments":{args},"_meta":{{"progressToken":{id}}}}}}}"#
    )
}

async fn error_code(res: reqwest::Response) -> i64 {
    let v: Value = res.json().await.expect("json");
    v["error"]["code"].as_i64().unwrap_or_default()
}

// ---- 1. A keyed call is never run unguarded ---------------------------------------------------

#[tokio::test]
async fn s17_1_keyed_calls_that_cannot_be_guarded_are_refused_and_nothing_runs() {
    let (addr, effects) = server(JsonRpc::new().meta_key("idempotencyKey")).await;
    let batch = format!("[{}]", call("1", "{}"));
    let null_id = call("null", "{}");
    let bom = format!("\u{feff}{}", call("1", "{}"));
    for (name, key, body) in [
        ("a batch with a header key", Some("k-batch"), batch.as_str()),
        ("a null id", Some("k-null"), null_id.as_str()),
        ("a byte-order mark", Some("k-bom"), bom.as_str()),
    ] {
        let res = send(addr, "/mcp", key, body).await;
        assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{name}");
        assert_eq!(error_code(res).await, -31009, "{name}");
    }
    let meta_batch = r#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"_meta":{"idempotencyKey":"k"}}}]"#;
    let res = send(addr, "/mcp", None, meta_batch).await;
    assert_eq!(error_code(res).await, -31009, "a batch keyed in _meta");
    let numeric = r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"_meta":{"idempotencyKey":42}}}"#;
    let res = send(addr, "/mcp", None, numeric).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    let v: Value = res.json().await.expect("json");
    assert_eq!(v["id"], 3);
    assert_eq!(
        v["error"]["code"], -31000,
        "a _meta key that is not a string: {v}"
    );
    let differ = r#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"_meta":{"idempotencyKey":"a"}}}"#;
    let res = send(addr, "/mcp", Some("b"), differ).await;
    assert_eq!(error_code(res).await, -31000, "two different keys");
    // An invalid header key answers the call's own id, which the body tells.
    let res = send(addr, "/mcp", Some(""), &call("12", "{}")).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    let v: Value = res.json().await.expect("json");
    assert_eq!(
        (v["id"].clone(), v["error"]["code"].clone()),
        (12.into(), (-31000).into()),
        "{v}"
    );
    assert_eq!(effects.count(), 0, "nothing ran unguarded");
    // Unkeyed, the same shapes pass through as before: the server answers them.
    send(addr, "/mcp", None, &format!("[{}]", call("1", "{}"))).await;
    assert_eq!(effects.count(), 1);
}

#[tokio::test]
async fn s17_5_a_method_header_that_disagrees_with_the_body_is_refused() {
    let (addr, effects) = server(JsonRpc::new()).await;
    let res = client()
        .post(format!("http://{addr}/mcp"))
        .header("content-type", "application/json")
        .header("idempotency-key", "k-mismatch")
        .header("mcp-method", "tools/list")
        .body(call("1", "{}"))
        .send()
        .await
        .expect("request");
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(error_code(res).await, -32020, "MCP's HeaderMismatchError");
    assert_eq!(effects.count(), 0);
}

// ---- 2. Two calls are the same only when they are ---------------------------------------------

#[tokio::test]
async fn s17_2_the_query_string_and_exact_arguments_count() {
    let (addr, effects) = server(JsonRpc::new()).await;
    let first = send(addr, "/mcp?tenant=a", Some("k-q"), &call("1", "{}")).await;
    assert_eq!(first.status(), StatusCode::OK);
    let other = send(addr, "/mcp?tenant=b", Some("k-q"), &call("2", "{}")).await;
    assert_eq!(
        error_code(other).await,
        -31002,
        "tenant b is never given tenant a's result"
    );
    send(
        addr,
        "/mcp",
        Some("k-n"),
        &call("1", r#"{"amount":9007199254740993}"#),
    )
    .await;
    let near = send(
        addr,
        "/mcp",
        Some("k-n"),
        &call("2", r#"{"amount":9007199254740992}"#),
    )
    .await;
    assert_eq!(error_code(near).await, -31002, "exact arguments");
    assert_eq!(effects.count(), 2);
}

// ---- 3. Replays are byte-faithful -------------------------------------------------------------

#[tokio::test]
async fn s17_3_a_replay_writes_the_new_id_as_sent_and_the_recorded_bytes() {
    let (addr, effects) = server(JsonRpc::new()).await;
    let first = send(addr, "/mcp", Some("k-bytes"), &call("1", "{}")).await;
    let first = first.text().await.expect("body");
    let recorded_result = &first[first.find(r#""result":"#).expect("result")..];
    for id in [
        "123456789012345678901234567890",
        "1e2",
        "-0",
        r#""retry-7""#,
    ] {
        let replay = send(addr, "/mcp", Some("k-bytes"), &call(id, "{}")).await;
        assert_eq!(replay.headers()["idempotency-replayed"], "true");
        let text = replay.text().await.expect("body");
        assert!(
            text.contains(&format!(r#""id":{id},"#)),
            "the id as it was sent: {text}"
        );
        assert!(
            text.ends_with(recorded_result),
            "the recorded bytes: {text}"
        );
        assert!(text.contains("10.50") && text.contains("123456789012345678901234567890"));
    }
    assert_eq!(effects.count(), 1);
}

#[tokio::test]
async fn s17_3_refusals_answer_the_id_as_sent() {
    let (addr, _effects) = server(JsonRpc::new()).await;
    send(addr, "/mcp", Some("k-ref"), &call("1", r#"{"a":1}"#)).await;
    let id = "123456789012345678901234567890";
    let res = send(addr, "/mcp", Some("k-ref"), &call(id, r#"{"a":2}"#)).await;
    let text = res.text().await.expect("body");
    assert!(text.contains(&format!(r#""id":{id},"#)), "{text}");
}

/// The envelope embeds the handler's JSON as its own bytes, first response and replay alike.
#[tokio::test]
async fn s17_3_the_envelope_embeds_the_handlers_bytes() {
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/pay",
            post(move || async move {
                sink.hit();
                (
                    StatusCode::CREATED,
                    [
                        (header::CONTENT_TYPE, "application/json"),
                        (header::ETAG, "\"v1\""),
                    ],
                    r#"{"amount":10.50,"big":123456789012345678901234567890,"b":1,"a":2}"#,
                )
            }),
        )
        .route(
            "/empty",
            post(|| async { StatusCode::NO_CONTENT.into_response() }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .envelope(true),
        );
    let addr = serve(app).await;
    for round in 0..2 {
        let res = send(addr, "/pay", Some("k-env"), "{}").await;
        assert!(
            res.headers().get("etag").is_none(),
            "it described the unwrapped bytes"
        );
        let text = res.text().await.expect("body");
        assert!(
            text.contains(
                r#""original_response":{"amount":10.50,"big":123456789012345678901234567890,"b":1,"a":2}"#
            ),
            "round {round}: {text}"
        );
    }
    let empty = send(addr, "/empty", Some("k-204"), "{}").await;
    assert_eq!(empty.status(), StatusCode::NO_CONTENT);
    assert!(
        empty
            .headers()
            .get("content-length")
            .is_none_or(|v| v == "0")
    );
    assert!(
        empty.bytes().await.expect("body").is_empty(),
        "a 204 has no body"
    );
    assert_eq!(effects.count(), 1);
}

// ---- 4. Linear ---------------------------------------------------------------------------------

/// A tool that streams many progress events before its answer: the stream reaches the client
/// whole, the final response is recorded, and the retry replays it.
#[tokio::test]
async fn s17_4_a_long_event_stream_is_read_once_and_recorded() {
    const EVENTS: usize = 20_000;
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/mcp",
            post(move |body: Bytes| async move {
                sink.hit();
                let message: Value = serde_json::from_slice(&body).unwrap_or_default();
                let id = message["id"].to_string();
                let progress = "data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{\"progress\":1}}\n\n";
                let done = format!(
                    "data: {{\"jsonrpc\":\"2.0\",\"id\":{id},\"result\":{{\"content\":[],\"n\":10.50}}}}\n\n"
                );
                let chunks = std::iter::repeat_n(progress.to_owned(), EVENTS)
                    .chain([done])
                    .map(Ok::<_, std::io::Error>);
                Response::builder()
                    .header(header::CONTENT_TYPE, "text/event-stream")
                    .body(Body::from_stream(futures_util::stream::iter(chunks)))
                    .expect("response")
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .response_limit(8 << 20)
                .jsonrpc(JsonRpc::new()),
        );
    let addr = serve(app).await;
    let first = send(addr, "/mcp", Some("k-sse"), &call("1", "{}")).await;
    let text = first.text().await.expect("stream");
    assert_eq!(text.matches("notifications/progress").count(), EVENTS);
    let replay = send(addr, "/mcp", Some("k-sse"), &call("2", "{}")).await;
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(
        replay.text().await.expect("body"),
        r#"{"jsonrpc":"2.0","id":2,"result":{"content":[],"n":10.50}}"#
    );
    assert_eq!(effects.count(), 1);
}

/// Issue 17 §4: a request that cannot ask for a guarantee (no key header, and no `_meta` keys
/// read on the route) passes unread, whatever its size: a big `tools/list` or batch passes
/// through untouched; a keyed call over the body limit is refused.
#[tokio::test]
async fn s17_4_big_unguarded_requests_pass_and_big_guarded_calls_are_refused() {
    let (addr, effects) = server(JsonRpc::new()).await;
    let filler = "x".repeat(1_200_000);
    let list = format!(
        r#"{{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{{"pad":"{filler}"}}}}"#
    );
    let res = send(addr, "/mcp", None, &list).await;
    assert_eq!(
        res.status(),
        StatusCode::OK,
        "a 1.2 MB tools/list passes through"
    );
    // `method` after a big member: decided once it is read, still not buffered as guarded.
    let late = format!(
        r#"{{"jsonrpc":"2.0","params":{{"pad":"{filler}"}},"id":2,"method":"tools/list"}}"#
    );
    // Without a key header, on a route that reads no `_meta` keys, nothing can ask for a
    // guarantee: passes unread, wherever its `method` is.
    assert_eq!(
        send(addr, "/mcp", None, &late).await.status(),
        StatusCode::OK
    );
    // (Under axum's own 2 MB limit for the handler's `Bytes`.)
    let batch = format!("[{list}]");
    let res = send(addr, "/mcp", None, &batch).await;
    assert!(
        res.status().is_success(),
        "a 1.2 MB batch passes through to the server"
    );
    let headed = client()
        .post(format!("http://{addr}/mcp"))
        .header("content-type", "application/json")
        .header("mcp-method", "tools/list")
        .body(list.clone())
        .send()
        .await
        .expect("request");
    assert_eq!(
        headed.status(),
        StatusCode::OK,
        "the Mcp-Method header decides unread"
    );
    let big_call = call("9", &format!(r#"{{"pad":"{filler}"}}"#));
    let refused = send(addr, "/mcp", Some("k-big"), &big_call).await;
    assert_eq!(refused.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        effects.count(),
        4,
        "the four that passed ran; the big call did not"
    );
}

/// Issue 17 §5: a `tools/call` answered with a task handle (MCP's tasks extension) is a final
/// answer: the retry gets that same handle, byte for byte, never a second task.
#[tokio::test]
async fn s17_5_a_task_handle_is_replayed_as_the_same_handle() {
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/mcp",
            post(move |body: Bytes| async move {
                let n = sink.hit();
                let message: Value = serde_json::from_slice(&body).unwrap_or_default();
                let text = format!(
                    r#"{{"jsonrpc":"2.0","id":{},"result":{{"task":{{"taskId":"task-{n}","status":"working","pollInterval":500}}}}}}"#,
                    message["id"]
                );
                ([(header::CONTENT_TYPE, "application/json")], text).into_response()
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .jsonrpc(JsonRpc::new()),
        );
    let addr = serve(app).await;
    let first = send(addr, "/mcp", Some("k-task"), &call("1", "{}")).await;
    assert!(
        first
            .text()
            .await
            .expect("body")
            .contains(r#""taskId":"task-1""#)
    );
    let retry = send(addr, "/mcp", Some("k-task"), &call("2", "{}")).await;
    assert_eq!(retry.headers()["idempotency-replayed"], "true");
    assert_eq!(
        retry.text().await.expect("body"),
        r#"{"jsonrpc":"2.0","id":2,"result":{"task":{"taskId":"task-1","status":"working","pollInterval":500}}}"#
    );
    assert_eq!(effects.count(), 1, "one task for one key");
}

/// Issue 17 §3: a response over the record limit is enveloped like any other, as it streams:
/// JSON as its bytes, text as an escaped string. Its key stays consumed.
#[tokio::test]
async fn s17_3_an_oversized_response_is_enveloped_too() {
    let effects = Effects::default();
    let (json_sink, text_sink) = (effects.clone(), effects.clone());
    let big_json = format!(r#"{{"amount":10.50,"pad":"{}"}}"#, "x".repeat(200));
    let served = big_json.clone();
    let app = Router::new()
        .route(
            "/json",
            post(move || async move {
                json_sink.hit();
                ([(header::CONTENT_TYPE, "application/json")], served.clone())
            }),
        )
        .route(
            "/text",
            post(move || async move {
                text_sink.hit();
                let text = format!("say \"hi\"\\\n{}", "y".repeat(200));
                ([(header::CONTENT_TYPE, "text/plain")], text)
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .envelope(true)
                .response_limit(64),
        );
    let addr = serve(app).await;
    let first = send(addr, "/json", Some("k-big-json"), "{}").await;
    assert_eq!(first.headers()["content-type"], "application/json");
    let text = first.text().await.expect("body");
    let v: Value = serde_json::from_str(&text).expect("the envelope is JSON");
    assert_eq!(v["idempotent_replay"], false);
    assert!(
        text.ends_with(&format!(r#""original_response":{big_json}}}"#)),
        "{text}"
    );
    let replay = send(addr, "/json", Some("k-big-json"), "{}").await;
    assert_eq!(
        replay.status(),
        StatusCode::CONFLICT,
        "the key stays consumed"
    );
    let first = send(addr, "/text", Some("k-big-text"), "{}").await;
    let v: Value = serde_json::from_str(&first.text().await.expect("body")).expect("JSON");
    assert_eq!(
        v["original_response"],
        format!("say \"hi\"\\\n{}", "y".repeat(200)),
        "text escaped on the way"
    );
    assert_eq!(effects.count(), 2);
}

/// Review of issue 17: the shapes that let a `_meta`-keyed call run unguarded are closed.
#[tokio::test]
async fn s17_review_meta_keyed_calls_are_never_run_unguarded() {
    let (addr, effects) = server(JsonRpc::new().meta_key("idempotencyKey")).await;
    let bodies = [
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","method":"tools/call","params":{"name":"t","_meta":{"idempotencyKey":"k1"}}}"#,
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","method":"tools/call","params":{"name":"t","_meta":{"idempotencyKey":"k2"}}}"#,
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t","_meta":{"idempotencyKey":"k3"},"_meta":{}}}"#,
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t","_meta":{"idempotencyKey":"a","idempotencyKey":"b"}}}"#,
    ];
    for body in bodies {
        for _ in 0..2 {
            let res = send(addr, "/mcp", None, body).await;
            assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{body}");
        }
    }
    for header in ["tools/list", "Tools/Call"] {
        let res = client()
            .post(format!("http://{addr}/mcp"))
            .header("content-type", "application/json")
            .header("mcp-method", header)
            .body(r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"_meta":{"idempotencyKey":"k4"}}}"#)
            .send()
            .await
            .expect("request");
        assert_eq!(error_code(res).await, -32020, "{header}");
    }
    assert_eq!(effects.count(), 0, "nothing ran unguarded");
}

/// A tool server answering as real ones do: a task handle typed `"task"`, the id written back
/// as it parsed it (`1.0` as `1`), an SSE stream with CR line ends, without its last blank
/// line, or starting with a byte-order mark. Each is one run per key; the retry is a replay.
#[tokio::test]
async fn s17_review_real_server_answers_are_recorded() {
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/mcp",
            post(move |req_headers: axum::http::HeaderMap, body: Bytes| async move {
                let n = sink.hit();
                let message: Value = serde_json::from_slice(&body).unwrap_or_default();
                // As a JavaScript server would: integral ids come back as integers.
                let id = match message["id"].as_f64() {
                    Some(f) if f.fract() == 0.0 => format!("{}", f as i64),
                    _ => message["id"].to_string(),
                };
                let answer = format!(
                    r#"{{"jsonrpc":"2.0","id":{id},"result":{{"resultType":"task","taskId":"task-{n}","status":"working"}}}}"#
                );
                let shape = req_headers
                    .get("x-shape")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("json");
                let (content_type, text) = match shape {
                    "cr" => ("text/event-stream", format!("data: {answer}\r\r")),
                    "unterminated" => ("text/event-stream", format!("data: {answer}")),
                    "bom" => ("text/event-stream", format!("\u{feff}data: {answer}\n\n")),
                    _ => ("application/json", answer),
                };
                ([(header::CONTENT_TYPE, content_type)], text).into_response()
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .jsonrpc(JsonRpc::new()),
        );
    let addr = serve(app).await;
    let mut keys = 0;
    for shape in ["json", "cr", "unterminated", "bom"] {
        for id in ["1.0", "1e2", "-0", "7"] {
            keys += 1;
            let key = format!("k-{shape}-{id}");
            for attempt in 0..2 {
                let res = client()
                    .post(format!("http://{addr}/mcp"))
                    .header("content-type", "application/json")
                    .header("accept", "application/json, text/event-stream")
                    .header("idempotency-key", &key)
                    .header("x-shape", shape)
                    .body(call(id, "{}"))
                    .send()
                    .await
                    .expect("request");
                let replayed = res.headers().get("idempotency-replayed").is_some();
                assert_eq!(replayed, attempt == 1, "{shape} {id}");
                let _ = res.bytes().await;
            }
        }
    }
    assert_eq!(effects.count(), keys, "one task per key");
}

// ---- A body the mode cannot read is refused in the route's own form ----------------------------

/// Checks `v` against JSON-RPC 2.0 §5 and §5.1 strictly, as a client library would read it: an
/// object with exactly `jsonrpc: "2.0"`, `id` and `error`; an error with an integer `code` and a
/// string `message`. Returns the id, the code and the error's `data`.
fn strict_error(v: &Value) -> (&Value, i64, &Value) {
    let object = v.as_object().expect("a JSON-RPC response is an object");
    let mut members: Vec<&str> = object.keys().map(String::as_str).collect();
    members.sort_unstable();
    assert_eq!(
        members,
        ["error", "id", "jsonrpc"],
        "exactly these members: {v}"
    );
    assert_eq!(v["jsonrpc"], "2.0");
    let error = v["error"].as_object().expect("error is an object");
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{v}"
    );
    let code = error["code"].as_i64().expect("an integer code");
    (&v["id"], code, &v["error"]["data"])
}

/// POSTs `chunks` as a chunked body (no length declared), each chunk framed as written, and
/// reads the answer to the connection's close.
async fn chunked_post(
    addr: SocketAddr,
    headers: &[(&str, &str)],
    framed: &[u8],
) -> common::raw::Raw {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut head = format!(
        "POST /mcp HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\
         transfer-encoding: chunked\r\ncontent-type: application/json\r\n"
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).await.expect("write");
    // The server may answer and close before reading all of it.
    let _ = stream.write_all(framed).await;
    let mut buf = Vec::new();
    let _ = stream.read_to_end(&mut buf).await;
    assert!(!buf.is_empty(), "the server answered");
    common::raw::parse_raw(&buf)
}

/// One chunk of `body`, framed.
fn chunk(body: &[u8]) -> Vec<u8> {
    let mut framed = format!("{:x}\r\n", body.len()).into_bytes();
    framed.extend_from_slice(body);
    framed.extend_from_slice(b"\r\n");
    framed
}

/// DESIGN §8 (JSON-RPC mode): a call whose body the layer cannot read, over the body limit
/// (declared or streamed) or cut by broken framing, is refused as every refusal on the route
/// is: the problem's status, `application/json`, a JSON-RPC 2.0 error object (-31005, the
/// problem in `error.data`) to a `null` id, since the call's id could not be read (JSON-RPC 2.0
/// §5). It was a problem+json body, which a JSON-RPC client cannot read. Nothing runs.
#[tokio::test]
async fn s8_a_call_whose_body_cannot_be_read_is_refused_as_a_json_rpc_error() {
    let (addr, effects) = server_limited(JsonRpc::new().meta_key("idempotencyKey"), 1024).await;
    let big = call("7", &format!(r#"{{"pad":"{}"}}"#, "x".repeat(2048)));
    let check = |status: u16, content_type: Option<&[u8]>, body: &[u8], want: u16, what: &str| {
        assert_eq!(status, want, "{what}: the problem's status");
        assert_eq!(content_type, Some(&b"application/json"[..]), "{what}");
        let v: Value = serde_json::from_slice(body).expect("a JSON body");
        let (id, code, data) = strict_error(&v);
        assert!(id.is_null(), "{what}: the id could not be read: {v}");
        assert_eq!(code, -31005, "{what}: {v}");
        let kind = if want == 413 {
            "body-too-large"
        } else {
            "body-unreadable"
        };
        assert_eq!(data["type"], common::problem_type(kind), "{what}: {v}");
    };

    // Keyed by the header, the length declared.
    let res = send(addr, "/mcp", Some("k-declared"), &big).await;
    let status = res.status().as_u16();
    let content_type = res
        .headers()
        .get(header::CONTENT_TYPE)
        .map(|v| v.as_bytes().to_vec());
    let body = res.bytes().await.expect("body");
    check(status, content_type.as_deref(), &body, 413, "declared");

    // Keyed by the header, streamed past the limit in chunks.
    let mut framed = Vec::new();
    for piece in big.as_bytes().chunks(256) {
        framed.extend(chunk(piece));
    }
    framed.extend_from_slice(b"0\r\n\r\n");
    let raw = chunked_post(addr, &[("idempotency-key", "k-streamed")], &framed).await;
    check(
        raw.status,
        raw.one("content-type"),
        &raw.body,
        413,
        "streamed",
    );

    // No header: on a route that reads `_meta` keys the body may hold one.
    let raw = chunked_post(addr, &[], &framed).await;
    check(
        raw.status,
        raw.one("content-type"),
        &raw.body,
        413,
        "a _meta key may be in it",
    );

    // Framing broken after the first chunk: the body cannot be read.
    let mut broken = chunk(&big.as_bytes()[..100]);
    broken.extend_from_slice(b"not-a-chunk-size\r\n");
    let raw = chunked_post(addr, &[("idempotency-key", "k-broken")], &broken).await;
    check(
        raw.status,
        raw.one("content-type"),
        &raw.body,
        400,
        "broken framing",
    );

    assert_eq!(effects.count(), 0, "nothing ran");
}
