//! DESIGN §8: JSON-RPC mode in front of a JSON-RPC-over-HTTP tool server (the MCP Streamable
//! HTTP shape: one POST per message, answered with JSON or an SSE stream), over real sockets,
//! with the tool's effects counted where they happen.

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use common::{Effects, FlakyStore, client, serve};
use serde_json::{Value, json};
use tokio::sync::Notify;
use tower_idempotency::jsonrpc::{JsonRpc, REPLAY_META};
use tower_idempotency::{IdempotencyLayer, MemoryStore};

/// A small MCP-like tool server: `tools/list`, and `tools/call` of `create_ticket`, answered as
/// JSON or, when asked and accepted, as an SSE stream with a progress notification first.
async fn tool_server(State(effects): State<Effects>, headers: HeaderMap, body: Bytes) -> Response {
    let Ok(message) = serde_json::from_slice::<Value>(&body) else {
        let error =
            json!({"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"Parse error"}});
        return (StatusCode::BAD_REQUEST, axum::Json(error)).into_response();
    };
    if message.is_array() {
        let error = json!({"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"batches are not supported"}});
        return (StatusCode::BAD_REQUEST, axum::Json(error)).into_response();
    }
    let id = message["id"].clone();
    let result = match message["method"].as_str() {
        Some("tools/list") => json!({ "tools": [{ "name": "create_ticket" }] }),
        Some("tools/call") => {
            let args = &message["params"]["arguments"];
            tokio::time::sleep(Duration::from_millis(args["work_ms"].as_u64().unwrap_or(0))).await;
            let n = effects.hit();
            json!({
                "content": [{ "type": "text", "text": format!("ticket {n}: {}", args["title"]) }],
                "isError": false
            })
        }
        _ => json!({}),
    };
    if id.is_null() {
        return StatusCode::ACCEPTED.into_response(); // a notification
    }
    let response = json!({ "jsonrpc": "2.0", "id": id, "result": result });
    let sse = message["params"]["arguments"]["sse"].as_bool() == Some(true)
        && headers
            .get(header::ACCEPT)
            .is_some_and(|a| a.to_str().unwrap_or("").contains("text/event-stream"));
    if sse {
        let progress = json!({"jsonrpc":"2.0","method":"notifications/progress",
            "params":{"progressToken": message["params"]["_meta"]["progressToken"], "progress": 1}});
        let stream = format!("id: 1\ndata: {progress}\n\nid: 2\ndata: {response}\n\n");
        return ([(header::CONTENT_TYPE, "text/event-stream")], stream).into_response();
    }
    axum::Json(response).into_response()
}

async fn server(jsonrpc: JsonRpc) -> (SocketAddr, Effects) {
    let effects = Effects::default();
    let app = Router::new()
        .route("/mcp", post(tool_server))
        .with_state(effects.clone())
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .jsonrpc(jsonrpc),
        );
    (serve(app).await, effects)
}

fn tool_call(id: Value, progress: &str, arguments: Value) -> Value {
    json!({
        "jsonrpc": "2.0",
        "id": id,
        "method": "tools/call",
        "params": {
            "name": "create_ticket",
            "arguments": arguments,
            "_meta": { "progressToken": progress }
        }
    })
}

async fn send(addr: SocketAddr, key: Option<&str>, message: &Value) -> reqwest::Response {
    let mut request = client()
        .post(format!("http://{addr}/mcp"))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(message.to_string());
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    request.send().await.expect("request")
}

async fn json(res: reqwest::Response) -> Value {
    serde_json::from_slice(&res.bytes().await.expect("body")).expect("JSON body")
}

#[tokio::test]
async fn s8_identical_tool_calls_run_once_and_replay_under_the_new_id() {
    let (addr, effects) = server(JsonRpc::new()).await;
    let args = json!({ "title": "printer" });

    let first = send(addr, Some("k-1"), &tool_call(json!(1), "p-1", args.clone())).await;
    assert_eq!(first.status(), StatusCode::OK);
    assert!(first.headers().get("idempotency-replayed").is_none());
    let first = json(first).await;
    // The retry has a new id and a new progress token, as MCP clients send.
    let second = send(addr, Some("k-1"), &tool_call(json!("retry-2"), "p-2", args)).await;
    assert_eq!(second.headers()["idempotency-replayed"], "true");
    assert_eq!(second.headers()["content-type"], "application/json");
    let second = json(second).await;
    assert_eq!(
        second["id"], "retry-2",
        "the replay answers the new request's id"
    );
    assert_eq!(second["result"], first["result"]);
    assert_eq!(effects.count(), 1);
}

#[tokio::test]
async fn s8_changed_arguments_are_a_typed_jsonrpc_conflict() {
    let (addr, effects) = server(JsonRpc::new()).await;
    send(
        addr,
        Some("k-2"),
        &tool_call(json!(1), "p", json!({"title": "a"})),
    )
    .await;
    let changed = send(
        addr,
        Some("k-2"),
        &tool_call(json!(7), "p", json!({"title": "b"})),
    )
    .await;
    assert_eq!(changed.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let body = json(changed).await;
    assert_eq!(body["jsonrpc"], "2.0");
    assert_eq!(body["id"], 7, "the error echoes the request's id");
    assert_eq!(body["error"]["code"], -31002);
    assert!(
        body["error"]["code"]
            .as_i64()
            .is_some_and(|c| !(-32768..=-32000).contains(&c))
    );
    assert_eq!(
        body["error"]["data"]["type"],
        "urn:tower-idempotency:problem:fingerprint-mismatch"
    );
    assert_eq!(body["error"]["data"]["safe_new_key"], true);
    // Issue 20 §10: the detail speaks of the call, not of an HTTP request's path and query.
    let detail = body["error"]["data"]["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("params, path, query or content type") && !detail.contains("method"),
        "{detail}"
    );
    assert_eq!(effects.count(), 1);
}

#[tokio::test]
async fn s8_other_methods_notifications_and_keyless_calls_pass_through() {
    let (addr, effects) = server(JsonRpc::new()).await;
    let list = json!({"jsonrpc":"2.0","id":1,"method":"tools/list"});
    for _ in 0..2 {
        let res = send(addr, Some("k-list"), &list).await;
        assert!(res.headers().get("idempotency-replayed").is_none());
        assert_eq!(
            json(res).await["result"]["tools"][0]["name"],
            "create_ticket"
        );
    }
    for id in [1, 2] {
        let res = send(
            addr,
            None,
            &tool_call(json!(id), "p", json!({"title": "no key"})),
        )
        .await;
        assert_eq!(json(res).await["id"], id);
    }
    assert_eq!(effects.count(), 2, "calls without a key run every time");
    let notification = json!({"jsonrpc":"2.0","method":"tools/call","params":{"arguments":{}}});
    for _ in 0..2 {
        assert_eq!(
            send(addr, None, &notification).await.status(),
            StatusCode::ACCEPTED
        );
    }
    assert_eq!(
        effects.count(),
        4,
        "notifications without a key are never guarded"
    );
    // With a key, a notification asks for a guarantee it cannot have (issue 17 §1).
    let keyed = send(addr, Some("k-note"), &notification).await;
    assert_eq!(keyed.status(), StatusCode::BAD_REQUEST);
    assert_eq!(json(keyed).await["error"]["code"], -31009);
    assert_eq!(effects.count(), 4, "and it never runs unguarded");
}

#[tokio::test]
async fn s8_concurrent_duplicate_gets_409_in_jsonrpc_form() {
    let (addr, effects) = server(JsonRpc::new()).await;
    let slow = json!({ "title": "slow", "work_ms": 600 });
    let first =
        tokio::spawn(async move { send(addr, Some("k-4"), &tool_call(json!(1), "p", slow)).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let dup = send(
        addr,
        Some("k-4"),
        &tool_call(json!(2), "p", json!({ "title": "slow", "work_ms": 600 })),
    )
    .await;
    assert_eq!(dup.status(), StatusCode::CONFLICT);
    assert!(dup.headers().contains_key("retry-after"));
    let body = json(dup).await;
    assert_eq!(body["id"], 2);
    assert_eq!(body["error"]["code"], -31001);
    assert_eq!(body["error"]["data"]["safe_new_key"], false);
    assert_eq!(effects.count(), 0, "nothing ran for the duplicate");
    assert_eq!(first.await.expect("task").status(), StatusCode::OK);
    assert_eq!(effects.count(), 1);
}

#[tokio::test]
async fn s8_sse_original_is_recorded_and_replayed_as_its_final_json_response() {
    let (addr, effects) = server(JsonRpc::new()).await;
    let args = json!({ "title": "streamed", "sse": true });
    let first = send(addr, Some("k-5"), &tool_call(json!(1), "p-1", args.clone())).await;
    assert_eq!(first.headers()["content-type"], "text/event-stream");
    let stream = first.text().await.expect("body");
    assert!(
        stream.contains("notifications/progress"),
        "the live stream keeps its notifications"
    );

    let replay = send(addr, Some("k-5"), &tool_call(json!(2), "p-2", args)).await;
    assert_eq!(replay.headers()["content-type"], "application/json");
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    let replay = json(replay).await;
    assert_eq!(replay["id"], 2);
    assert_eq!(
        replay["result"]["content"][0]["text"],
        "ticket 1: \"streamed\""
    );
    assert!(
        replay.get("method").is_none(),
        "no notification is replayed"
    );
    assert_eq!(effects.count(), 1);
}

#[tokio::test]
async fn s8_client_disconnect_mid_call_runs_the_tool_once_and_the_retry_replays() {
    let (addr, effects) = server(JsonRpc::new()).await;
    let args = json!({ "title": "slow", "work_ms": 400 });
    let hung_up = client()
        .post(format!("http://{addr}/mcp"))
        .header("idempotency-key", "k-6")
        .header("content-type", "application/json")
        .timeout(Duration::from_millis(100))
        .body(tool_call(json!(1), "p", args.clone()).to_string())
        .send()
        .await;
    assert!(hung_up.is_err(), "the client gave up");
    let mut replay = None;
    for i in 0..100 {
        let res = send(
            addr,
            Some("k-6"),
            &tool_call(json!(10 + i), "p", args.clone()),
        )
        .await;
        if res.status() == StatusCode::OK {
            replay = Some(res);
            break;
        }
        assert_eq!(res.status(), StatusCode::CONFLICT);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let replay = replay.expect("the tool finished and was recorded");
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(effects.count(), 1);
}

#[tokio::test]
async fn s8_batches_and_malformed_bodies_pass_through_untouched_unless_keyed() {
    let (addr, effects) = server(JsonRpc::new()).await;
    let batch = json!([tool_call(json!(1), "p", json!({"title": "in a batch"}))]);
    // Without a key: the server's own answer.
    let res = send(addr, None, &batch).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(json(res).await["error"]["code"], -32600);
    let res = client()
        .post(format!("http://{addr}/mcp"))
        .body("{\"jsonrpc\": \"2.0\", \"id\": ")
        .send()
        .await
        .expect("request");
    assert_eq!(json(res).await["error"]["code"], -32700);
    // With a key: refused by the layer, since it cannot guard them (issue 17 §1).
    for _ in 0..2 {
        let res = send(addr, Some("k-7"), &batch).await;
        assert_eq!(res.status(), StatusCode::BAD_REQUEST);
        assert!(res.headers().get("idempotency-replayed").is_none());
        assert_eq!(json(res).await["error"]["code"], -31009);
    }
    let res = client()
        .post(format!("http://{addr}/mcp"))
        .header("idempotency-key", "k-7b")
        .body("{\"jsonrpc\": \"2.0\", \"id\": ")
        .send()
        .await
        .expect("request");
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(json(res).await["error"]["code"], -31009);
    assert_eq!(effects.count(), 0);
}

#[tokio::test]
async fn s8_key_from_params_meta_and_replay_marked_in_meta() {
    let (addr, effects) = server(
        JsonRpc::new()
            .meta_key("idempotencyKey")
            .mark_replay_in_meta(true),
    )
    .await;
    let call = |id: i64, progress: &str| {
        json!({"jsonrpc":"2.0","id":id,"method":"tools/call","params":{
            "name":"create_ticket","arguments":{"title":"meta"},
            "_meta":{"progressToken":progress,"idempotencyKey":"k-meta"}}})
    };
    let first = json(send(addr, None, &call(1, "a")).await).await;
    assert!(first["result"].get("_meta").is_none());
    let second = json(send(addr, None, &call(2, "b")).await).await;
    assert_eq!(second["id"], 2);
    assert_eq!(second["result"]["_meta"][REPLAY_META], true);
    assert_eq!(second["result"]["content"], first["result"]["content"]);
    assert_eq!(effects.count(), 1);
}

/// A tool that streams: a progress event at once, the final response only when the test says.
async fn gated_server() -> (SocketAddr, Effects, Arc<Notify>) {
    let effects = Effects::default();
    let gate = Arc::new(Notify::new());
    let (e, g) = (effects.clone(), gate.clone());
    let app = Router::new()
        .route(
            "/mcp",
            post(move |body: Bytes| {
                let (e, g) = (e.clone(), g.clone());
                async move {
                    let message: Value = serde_json::from_slice(&body).expect("json");
                    let id = message["id"].clone();
                    let progress = json!({"jsonrpc":"2.0","method":"notifications/progress","params":{"progress":1}});
                    let first = Bytes::from(format!("data: {progress}\n\n"));
                    let stream = futures_util::stream::unfold(0, move |step| {
                        let (e, g, id, first) = (e.clone(), g.clone(), id.clone(), first.clone());
                        async move {
                            match step {
                                0 => Some((Ok::<_, std::io::Error>(first), 1)),
                                1 => {
                                    g.notified().await;
                                    let n = e.hit();
                                    let done = json!({"jsonrpc":"2.0","id":id,"result":{"content":[{"type":"text","text":format!("ticket {n}")}]}});
                                    Some((Ok(Bytes::from(format!("data: {done}\n\n"))), 2))
                                }
                                _ => None,
                            }
                        }
                    });
                    ([(header::CONTENT_TYPE, "text/event-stream")], axum::body::Body::from_stream(stream))
                }
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant().jsonrpc(JsonRpc::new()));
    (serve(app).await, effects, gate)
}

#[tokio::test]
async fn s8_sse_is_teed_live_and_recorded_at_its_end() {
    let (addr, effects, gate) = gated_server().await;
    let mut live = send(addr, Some("k-tee"), &tool_call(json!(1), "p", json!({}))).await;
    assert_eq!(live.headers()["content-type"], "text/event-stream");
    // The progress event arrives while the tool is still working: nothing is held back.
    let first = tokio::time::timeout(Duration::from_secs(5), live.chunk())
        .await
        .expect("the first event arrives before the tool finishes")
        .expect("chunk")
        .expect("data");
    assert!(String::from_utf8_lossy(&first).contains("notifications/progress"));
    assert_eq!(effects.count(), 0);
    gate.notify_one();
    let rest = live.text().await.expect("rest");
    assert!(rest.contains("ticket 1"));
    let replay = json(send(addr, Some("k-tee"), &tool_call(json!(2), "p", json!({}))).await).await;
    assert_eq!(replay["id"], 2);
    assert_eq!(replay["result"]["content"][0]["text"], "ticket 1");
    assert_eq!(effects.count(), 1);
}

#[tokio::test]
async fn s8_a_client_leaving_mid_stream_does_not_stop_the_recording() {
    let (addr, effects, gate) = gated_server().await;
    let mut live = send(addr, Some("k-left"), &tool_call(json!(1), "p", json!({}))).await;
    live.chunk().await.expect("chunk").expect("data");
    drop(live); // the client hangs up mid-stream
    gate.notify_one();
    let mut replay = None;
    for i in 0..100 {
        let res = send(
            addr,
            Some("k-left"),
            &tool_call(json!(10 + i), "p", json!({})),
        )
        .await;
        if res.status() == StatusCode::OK {
            replay = Some(json(res).await);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let replay = replay.expect("the stream ran to its end and was recorded");
    assert_eq!(replay["result"]["content"][0]["text"], "ticket 1");
    assert_eq!(effects.count(), 1);
}

#[tokio::test]
async fn s8_store_down_and_unknown_outcomes_answer_in_jsonrpc_form() {
    let effects = Effects::default();
    let store = FlakyStore::default();
    let app = Router::new()
        .route("/mcp", post(tool_server))
        .with_state(effects.clone())
        .layer(
            IdempotencyLayer::new(store.clone())
                .single_tenant()
                .jsonrpc(JsonRpc::new()),
        );
    let addr = serve(app).await;
    let call = |id: i64| tool_call(json!(id), "p", json!({ "title": "x" }));

    store.down.store(true, std::sync::atomic::Ordering::SeqCst);
    let down = send(addr, Some("k-down"), &call(1)).await;
    assert_eq!(down.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(down.headers().contains_key("retry-after"));
    let body = json(down).await;
    assert_eq!(
        (body["id"].clone(), body["error"]["code"].clone()),
        (json!(1), json!(-31004))
    );
    assert_eq!(effects.count(), 0, "nothing runs while the store is down");
    store.down.store(false, std::sync::atomic::Ordering::SeqCst);

    // The tool runs but its outcome cannot be written: retries are told it is unknown.
    store
        .fail_complete
        .store(true, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        send(addr, Some("k-unknown"), &call(2)).await.status(),
        StatusCode::OK
    );
    store
        .fail_complete
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let unknown = send(addr, Some("k-unknown"), &call(3)).await;
    assert_eq!(unknown.status(), StatusCode::CONFLICT);
    let body = json(unknown).await;
    assert_eq!(body["id"], 3);
    assert_eq!(body["error"]["code"], -31003);
    assert_eq!(body["error"]["data"]["state"], "needs_reconciliation");
    assert_eq!(effects.count(), 1, "never run twice");
}
