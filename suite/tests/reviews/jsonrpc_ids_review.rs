//! Review of the JSON-RPC mode's id matching (a numeric id written back as its nearest double
//! answers the call): the response is found however a server writes the id back, in a JSON
//! body and in an event stream that also carries a server-to-client request with the call's
//! own id; an interim step under a rounded id still gives the key back; id texts that are not
//! JSON numbers are refused. Over real sockets, tool runs counted at the sink (the handler).

use crate::common;

use std::net::SocketAddr;

use axum::Router;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::{Effects, guard, serve};
use serde_json::Value;
use tower_idempotency::jsonrpc::JsonRpc;
use tower_idempotency::{IdempotencyLayer, MemoryStore};

/// The call's id as the client wrote it (sent alongside in `x-raw-id`, which is not part of
/// the fingerprint) and as the server writes it back (`x-write-id`, default: as sent).
fn ids(headers: &HeaderMap) -> (String, String) {
    let get = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let raw = get("x-raw-id").expect("x-raw-id");
    let write = get("x-write-id").unwrap_or_else(|| raw.clone());
    (raw, write)
}

fn json(status: StatusCode, text: String) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], text).into_response()
}

fn sse(content_type: &'static str, text: String) -> Response {
    ([(header::CONTENT_TYPE, content_type)], text).into_response()
}

/// The tool server. `x-mode` (not part of the fingerprint) picks what it does. Every run of
/// the tool is counted.
async fn tool(effects: Effects, headers: HeaderMap) -> Response {
    let (raw, write) = ids(&headers);
    let mode = headers
        .get("x-mode")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("ok")
        .to_owned();
    let result = |n: usize| {
        format!(
            r#"{{"jsonrpc":"2.0","id":{write},"result":{{"content":[{{"type":"text","text":"run {n}"}}]}}}}"#
        )
    };
    match mode.as_str() {
        "ok" => json(StatusCode::OK, result(effects.hit())),
        // An SSE answer with, before the response, a server-to-client request that reuses the
        // call's own id (ids are per direction) and a progress notification.
        "sse" => {
            let n = effects.hit();
            let request = format!(
                r#"{{"jsonrpc":"2.0","id":{raw},"method":"elicitation/create","params":{{"message":"sure?"}}}}"#
            );
            let progress = r#"{"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken":"p","progress":1}}"#;
            let text = format!(
                "id: 1\ndata: {request}\n\nid: 2\ndata: {progress}\n\nid: 3\ndata: {}\n\n",
                result(n)
            );
            sse("text/event-stream", text)
        }
        // MCP: a step of a multi-round-trip call, the id written back as `x-write-id` says.
        "interim" => {
            effects.hit();
            let text = format!(
                r#"{{"jsonrpc":"2.0","id":{write},"result":{{"resultType":"input_required","inputRequests":{{}}}}}}"#
            );
            json(StatusCode::OK, text)
        }
        other => panic!("unknown mode {other}"),
    }
}

/// The tool server behind the JSON-RPC mode's defaults.
async fn server() -> (SocketAddr, Effects) {
    let effects = Effects::default();
    let app = Router::new()
        .route(
            "/mcp",
            post({
                let effects = effects.clone();
                move |headers: HeaderMap| tool(effects.clone(), headers)
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .jsonrpc(JsonRpc::new()),
        );
    (serve(app).await, effects)
}

/// What came back.
#[derive(Debug)]
struct Answer {
    status: u16,
    replayed: bool,
    text: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_default()
    }

    fn code(&self) -> i64 {
        self.json()["error"]["code"].as_i64().unwrap_or_default()
    }

    /// The id member, as written.
    fn id_text(&self) -> String {
        let start = self.text.find(r#""id":"#).map(|i| i + 5);
        start.map_or_else(String::new, |i| {
            let rest = &self.text[i..];
            let end = rest.find([',', '}']).unwrap_or(rest.len());
            rest[..end].to_owned()
        })
    }
}

/// One keyed `tools/call` (same method and params every time: retries are the same
/// operation), its id written as `id`.
async fn call(addr: SocketAddr, key: &str, id: &str, headers: &[(&str, &str)]) -> Answer {
    let body = format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"t","arguments":{{"x":1}}}}}}"#
    );
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .redirect(reqwest::redirect::Policy::none())
        .timeout(std::time::Duration::from_secs(30))
        .build()
        .expect("client");
    let mut req = client
        .post(format!("http://{addr}/mcp"))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("idempotency-key", key)
        .header("x-raw-id", id)
        .body(body);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let res = guard("a call", req.send()).await.expect("request");
    let status = res.status().as_u16();
    let replayed = res
        .headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let text = guard("its body", res.text()).await.expect("body");
    Answer {
        status,
        replayed,
        text,
    }
}

// ---- Id matching ----------------------------------------------------------------------------

/// DESIGN §8: the call's response is found by its id's value, however the server writes it
/// back (JavaScript's double for ids beyond 2^53, with its `e+29`; `1e2` as `100`; `-0` as
/// `0`; `1.0` as `1`), in a JSON body and in an event stream that also holds a server-to-client
/// request carrying the call's own id and a notification. Recorded once, replayed under each
/// retry's id as sent, never run again.
#[tokio::test]
async fn ids_written_back_otherwise_still_answer_the_call_in_json_and_sse() {
    let (addr, effects) = server().await;
    let cases = [
        ("123456789012345678901234567890", "1.2345678901234568e+29"),
        (
            "123456789012345678901234567890",
            "123456789012345680000000000000",
        ),
        ("9007199254740993", "9007199254740992"),
        ("1e2", "100"),
        ("-0", "0"),
        ("1.0", "1"),
        ("0.1", "0.1"),
        ("7", "7.0"),
    ];
    let mut runs = 0;
    for mode in ["ok", "sse"] {
        for (sent, written) in cases {
            let key = format!("ids-{mode}-{sent}-{written}");
            let headers = [("x-mode", mode), ("x-write-id", written)];
            let first = call(addr, &key, sent, &headers).await;
            assert_eq!(first.status, 200, "{key}: {}", first.text);
            runs += 1;
            let retry = call(addr, &key, r#""again""#, &headers).await;
            assert!(retry.replayed, "{key}: a replay: {}", retry.text);
            assert_eq!(retry.id_text(), r#""again""#, "{key}: {}", retry.text);
            assert!(
                retry.text.contains(&format!("run {runs}")),
                "{key}: the first run's result: {}",
                retry.text
            );
            assert_eq!(effects.count(), runs, "{key}: runs at the sink");
        }
    }
}

/// DESIGN §8 (a keyed call is never run unguarded) for id texts that are not JSON numbers
/// (`NaN`, `Infinity`, hexadecimal, a leading `+` or zero, a bare fraction): refused, nothing
/// runs.
#[tokio::test]
async fn id_texts_that_are_not_json_are_refused() {
    let (addr, effects) = server().await;
    for id in [
        "NaN",
        "Infinity",
        "-Infinity",
        "0x10",
        "+1",
        "01",
        ".5",
        "1.",
    ] {
        let answer = call(addr, &format!("nan-{id}"), id, &[]).await;
        assert_eq!(answer.status, 400, "{id}: {}", answer.text);
        assert_eq!(answer.code(), -31009, "{id}: {}", answer.text);
    }
    assert_eq!(effects.count(), 0);
}

/// DESIGN §8 (interim results are never stored): an `input_required` step whose id the server
/// wrote back as a double is still read as the call's interim result: the key goes back and
/// the continuation runs under it.
#[tokio::test]
async fn an_interim_result_under_a_rounded_id_gives_the_key_back() {
    let (addr, effects) = server().await;
    let sent = "123456789012345678901234567890";
    let headers = [
        ("x-mode", "interim"),
        ("x-write-id", "1.2345678901234568e+29"),
    ];
    let first = call(addr, "interim", sent, &headers).await;
    assert_eq!(first.status, 200, "{}", first.text);
    let next = call(addr, "interim", "2", &[]).await;
    assert_eq!(next.status, 200, "{}", next.text);
    assert!(!next.replayed, "the continuation ran: {}", next.text);
    assert_eq!(effects.count(), 2, "the step and the continuation");
}
