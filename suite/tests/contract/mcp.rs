//! DESIGN §8 with rmcp's own server and client: an MCP tool server (`StreamableHttpService`
//! mounted in axum) behind the layer in JSON-RPC mode, called by rmcp's Streamable HTTP client,
//! in both response modes (JSON and SSE). Effects are counted in the tool.

use crate::common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::http::{HeaderName, HeaderValue};
use common::{Effects, serve};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ServerCapabilities,
    ServerConfig,
};
use rmcp::service::{RequestContext, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData as McpError, RoleClient, RoleServer, ServerHandler, ServiceExt};
use serde_json::json;
use tower_idempotency::jsonrpc::JsonRpc;
use tower_idempotency::{IdempotencyLayer, MemoryStore};

/// One tool, `create_ticket`, whose every run is an effect.
#[derive(Clone)]
struct Tickets {
    effects: Effects,
}

impl ServerHandler for Tickets {
    #[allow(deprecated)]
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let title = request
            .arguments
            .as_ref()
            .and_then(|args| args.get("title"))
            .and_then(|title| title.as_str())
            .unwrap_or_default()
            .to_owned();
        if title == "slow" {
            tokio::time::sleep(std::time::Duration::from_millis(600)).await;
        }
        let n = self.effects.hit();
        Ok(
            CallToolResult::success(vec![ContentBlock::text(format!("ticket {n}: {title}"))])
                .into(),
        )
    }
}

async fn mcp_server(json_response: bool) -> (SocketAddr, Effects) {
    mcp_server_with(StreamableHttpServerConfig::default().with_json_response(json_response)).await
}

async fn mcp_server_with(config: StreamableHttpServerConfig) -> (SocketAddr, Effects) {
    mcp_server_reading(config, JsonRpc::new()).await
}

/// The tool server, its layer in the JSON-RPC mode `jsonrpc`.
async fn mcp_server_reading(
    config: StreamableHttpServerConfig,
    jsonrpc: JsonRpc,
) -> (SocketAddr, Effects) {
    let effects = Effects::default();
    let tickets = Tickets {
        effects: effects.clone(),
    };
    let service: StreamableHttpService<Tickets, LocalSessionManager> = StreamableHttpService::new(
        move || Ok(tickets.clone()),
        Arc::new(LocalSessionManager::default()),
        config,
    );
    let app = axum::Router::new().nest_service("/mcp", service).layer(
        IdempotencyLayer::new(MemoryStore::new())
            .single_tenant()
            .jsonrpc(jsonrpc),
    );
    (serve(app).await, effects)
}

/// rmcp's client, its requests carrying `key` as the orchestrator would set it.
async fn mcp_client(addr: SocketAddr, key: Option<&str>) -> RunningService<RoleClient, ()> {
    let mut headers = HashMap::new();
    if let Some(key) = key {
        headers.insert(
            HeaderName::from_static("idempotency-key"),
            HeaderValue::from_str(key).expect("key"),
        );
    }
    let config = StreamableHttpClientTransportConfig::with_uri(format!("http://{addr}/mcp"))
        .custom_headers(headers);
    ().serve(StreamableHttpClientTransport::from_config(config))
        .await
        .expect("rmcp client connects")
}

fn create_ticket(title: &str) -> CallToolRequestParams {
    let args = json!({ "title": title });
    let serde_json::Value::Object(args) = args else {
        unreachable!("an object literal")
    };
    CallToolRequestParams::new("create_ticket").with_arguments(args)
}

fn text(result: &CallToolResult) -> String {
    serde_json::to_value(&result.content)
        .expect("content")
        .to_string()
}

async fn same_key_runs_once(json_response: bool) {
    let (addr, effects) = mcp_server(json_response).await;

    let first = mcp_client(addr, Some("mcp-1")).await;
    let a = first
        .call_tool(create_ticket("printer"))
        .await
        .expect("first call");
    // A retry is a new client session with the same key: new request id, new progress token.
    let retry = mcp_client(addr, Some("mcp-1")).await;
    let b = retry
        .call_tool(create_ticket("printer"))
        .await
        .expect("the replay is accepted");
    assert_eq!(
        text(&a),
        text(&b),
        "both results are the one effect's result"
    );
    assert_eq!(effects.count(), 1, "the tool ran once");

    // A new key runs; tools/list and keyless calls pass through.
    let other = mcp_client(addr, Some("mcp-2")).await;
    other
        .call_tool(create_ticket("scanner"))
        .await
        .expect("new key");
    assert_eq!(effects.count(), 2);
    let keyless = mcp_client(addr, None).await;
    keyless
        .list_all_tools()
        .await
        .expect("tools/list passes through");
    keyless
        .call_tool(create_ticket("x"))
        .await
        .expect("keyless call");
    keyless
        .call_tool(create_ticket("x"))
        .await
        .expect("keyless call");
    assert_eq!(effects.count(), 4, "calls without a key run every time");

    // Same key, different arguments: an error at the client, and no effect.
    let changed = retry.call_tool(create_ticket("a different ticket")).await;
    match changed {
        Err(rmcp::ServiceError::McpError(error)) => {
            assert_eq!(error.code.0, -31002, "a typed conflict: {error:?}");
            let data = error.data.expect("problem details in error.data");
            assert_eq!(
                data["type"],
                "urn:tower-idempotency:problem:fingerprint-mismatch"
            );
            assert_eq!(data["safe_new_key"], true);
        }
        other => panic!("expected a JSON-RPC error at the client, got {other:?}"),
    }
    assert_eq!(effects.count(), 4);
    for client in [first, retry, other, keyless] {
        let _ = client.cancel().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s8_rmcp_json_responses_same_key_runs_once() {
    same_key_runs_once(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s8_rmcp_sse_responses_same_key_runs_once_and_replays_as_json() {
    same_key_runs_once(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s8_rmcp_concurrent_duplicate_gets_an_in_flight_error_and_no_effect() {
    let (addr, effects) = mcp_server(true).await;
    let first = mcp_client(addr, Some("mcp-slow")).await;
    let duplicate = mcp_client(addr, Some("mcp-slow")).await;
    let running = tokio::spawn(async move {
        let result = first.call_tool(create_ticket("slow")).await;
        let _ = first.cancel().await;
        result
    });
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    match duplicate.call_tool(create_ticket("slow")).await {
        Err(rmcp::ServiceError::McpError(error)) => {
            assert_eq!(error.code.0, -31001, "in flight: {error:?}");
            let data = error.data.expect("problem details");
            assert_eq!(data["safe_new_key"], false);
        }
        other => panic!("expected an in-flight error, got {other:?}"),
    }
    assert_eq!(effects.count(), 0, "the duplicate ran nothing");
    running
        .await
        .expect("task")
        .expect("the first call completes");
    assert_eq!(effects.count(), 1);
    let replay = duplicate
        .call_tool(create_ticket("slow"))
        .await
        .expect("then it replays");
    assert!(text(&replay).contains("ticket 1"));
    assert_eq!(effects.count(), 1);
    let _ = duplicate.cancel().await;
}

/// The wire, seen with a plain client: rmcp's SSE answer goes out as SSE, and its replay as
/// JSON under the new id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s8_rmcp_sse_answer_is_streamed_then_replayed_as_json() {
    let config = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(false)
        .with_json_response(false);
    let (addr, effects) = mcp_server_with(config).await;
    let call = |id: i64| {
        json!({"jsonrpc":"2.0","id":id,"method":"tools/call",
            "params":{"name":"create_ticket","arguments":{"title":"wire"}}})
        .to_string()
    };
    let post = |body: String| {
        common::client()
            .post(format!("http://{addr}/mcp"))
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", "2025-03-26")
            .header("idempotency-key", "mcp-wire")
            .body(body)
            .send()
    };
    let first = post(call(1)).await.expect("first");
    assert!(first.status().is_success(), "{:?}", first.status());
    assert_eq!(first.headers()["content-type"], "text/event-stream");
    let stream = first.text().await.expect("stream");
    assert!(stream.contains("ticket 1: wire"));
    let replay = post(call(2)).await.expect("replay");
    assert_eq!(replay.headers()["content-type"], "application/json");
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    let replay: serde_json::Value = replay.json().await.expect("json");
    assert_eq!(replay["id"], 2);
    assert!(
        replay["result"]["content"][0]["text"]
            .as_str()
            .is_some_and(|t| t.contains("ticket 1: wire"))
    );
    assert_eq!(effects.count(), 1);
}

/// rmcp's stateless mode cancels a handler when its client disconnects; behind the layer the
/// handler runs to completion, once, and the retry replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s8_rmcp_client_disconnect_mid_call_runs_once_and_the_retry_replays() {
    let config = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(false)
        .with_json_response(true);
    let (addr, effects) = mcp_server_with(config).await;
    let post = |id: i64, timeout: std::time::Duration| {
        let body = json!({"jsonrpc":"2.0","id":id,"method":"tools/call",
            "params":{"name":"create_ticket","arguments":{"title":"slow"}}});
        common::client()
            .post(format!("http://{addr}/mcp"))
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", "2025-03-26")
            .header("idempotency-key", "mcp-hangup")
            .timeout(timeout)
            .body(body.to_string())
            .send()
    };
    let hung_up = post(1, std::time::Duration::from_millis(150)).await;
    assert!(hung_up.is_err(), "the client hung up mid-call");
    let mut replay = None;
    for i in 0..100 {
        let res = post(10 + i, std::time::Duration::from_secs(30))
            .await
            .expect("retry");
        if res.status().is_success() {
            replay = Some(res);
            break;
        }
        assert_eq!(res.status(), 409);
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let replay = replay.expect("the tool finished and was recorded");
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    let body: serde_json::Value = replay.json().await.expect("json");
    assert!(
        body["result"]["content"][0]["text"]
            .as_str()
            .is_some_and(|t| t.contains("ticket 1: slow"))
    );
    assert_eq!(effects.count(), 1, "run once, not cancelled, not repeated");
}

/// rmcp's client on MCP 2026-07-28: `server/discover` instead of `initialize`, stateless
/// requests with their protocol version, client info and trace context in `params._meta`, and
/// the `Mcp-Method`/`Mcp-Name` headers. Issue 17 §5: the revision end to end, one key, one run,
/// the retry (a new id, new `_meta`) replayed.
async fn discover_client(addr: SocketAddr, key: &str) -> RunningService<RoleClient, ()> {
    use rmcp::{ClientLifecycleMode, ClientServiceExt};
    let mut headers = HashMap::new();
    headers.insert(
        HeaderName::from_static("idempotency-key"),
        HeaderValue::from_str(key).expect("key"),
    );
    let config = StreamableHttpClientTransportConfig::with_uri(format!("http://{addr}/mcp"))
        .custom_headers(headers);
    ().serve_with_lifecycle(
        StreamableHttpClientTransport::from_config(config),
        ClientLifecycleMode::Discover {
            preferred_versions: vec![rmcp::model::ProtocolVersion::V_2026_07_28],
        },
    )
    .await
    .expect("rmcp client discovers the server on 2026-07-28")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s17_5_rmcp_on_2026_07_28_same_key_runs_once() {
    for json_response in [true, false] {
        let (addr, effects) = mcp_server(json_response).await;
        let first = discover_client(addr, "mcp-2026").await;
        let a = first
            .call_tool(create_ticket("printer"))
            .await
            .expect("first call");
        let retry = discover_client(addr, "mcp-2026").await;
        let b = retry
            .call_tool(create_ticket("printer"))
            .await
            .expect("the replay is accepted");
        assert_eq!(text(&a), text(&b), "json_response={json_response}");
        assert_eq!(
            effects.count(),
            1,
            "the tool ran once (json_response={json_response})"
        );
        let changed = retry.call_tool(create_ticket("another")).await;
        assert!(
            matches!(&changed, Err(rmcp::ServiceError::McpError(e)) if e.code.0 == -31002),
            "{changed:?}"
        );
        assert_eq!(effects.count(), 1);
        for client in [first, retry] {
            let _ = client.cancel().await;
        }
    }
}

/// Issue 22: the key is per call, and rmcp's custom headers are per transport, so an agent
/// puts each call's key in its `params._meta` (the layer's `meta_key`), beside what rmcp puts
/// there itself. One session: a call, its retry (one effect), the next step (a second).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s22_rmcp_sends_a_key_per_call_in_params_meta() {
    let (addr, effects) = mcp_server_reading(
        StreamableHttpServerConfig::default(),
        JsonRpc::new().meta_key("idempotencyKey"),
    )
    .await;
    let client = mcp_client(addr, None).await;
    let call = |key: &str| {
        let mut meta = rmcp::model::RequestMetaObject::new();
        meta.insert("idempotencyKey".into(), key.into());
        let mut params = create_ticket("printer");
        params.meta = Some(meta);
        client.call_tool(params)
    };
    let first = call("run-7:ticket-1").await.expect("first");
    let retry = call("run-7:ticket-1").await.expect("retry");
    assert_eq!(
        text(&first),
        text(&retry),
        "the retry is the first's answer"
    );
    assert_eq!(effects.count(), 1);
    let next = call("run-7:ticket-2").await.expect("next step");
    assert_ne!(text(&first), text(&next));
    assert_eq!(effects.count(), 2, "one effect a key");
    // Without a key in `_meta` (or a header) the call is not guarded: it runs each time.
    client
        .call_tool(create_ticket("unkeyed"))
        .await
        .expect("unkeyed");
    assert_eq!(effects.count(), 3);
    let _ = client.cancel().await;
}
