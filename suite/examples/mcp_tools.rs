//! An MCP tool server (rmcp's Streamable HTTP service in axum) whose `tools/call` is safe to
//! retry: the layer's JSON-RPC mode guards calls that carry an `Idempotency-Key` header (or an
//! `idempotencyKey` entry in `params._meta`), whatever their JSON-RPC `id`.
//!
//! ```text
//! cargo run -p suite --example mcp_tools        # serve on 127.0.0.1:8000/mcp (ADDR=host:port)
//! cargo run -p suite --example mcp_tools -- --demo  # call itself with rmcp's client, print the result
//! ```

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::http::{HeaderName, HeaderValue};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ServerCapabilities,
    ServerConfig,
};
use rmcp::service::RequestContext;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler, ServiceExt};
use tower_idempotency::jsonrpc::JsonRpc;
use tower_idempotency::{IdempotencyLayer, MemoryStore};

/// The tool: every call that runs creates a ticket.
#[derive(Clone, Default)]
struct Tickets {
    created: Arc<AtomicU64>,
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
            .unwrap_or("untitled")
            .to_owned();
        let id = self.created.fetch_add(1, Ordering::SeqCst) + 1;
        println!("  [effect] ticket #{id} {title:?}");
        Ok(CallToolResult::success(vec![ContentBlock::text(format!(
            "created ticket #{id}: {title}"
        ))])
        .into())
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    // Without a subscriber the layer's logs (a store it cannot reach, a record it cannot
    // write) go nowhere.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(tracing_subscriber::filter::LevelFilter::WARN)
        .init();
    let demo = std::env::args().any(|a| a == "--demo");
    let addr = if demo {
        "127.0.0.1:0".to_owned()
    } else {
        std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:8000".to_owned())
    };
    let tickets = Tickets::default();
    let handler = tickets.clone();
    let mcp: StreamableHttpService<Tickets, LocalSessionManager> = StreamableHttpService::new(
        move || Ok(handler.clone()),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default(),
    );
    let app = axum::Router::new().nest_service("/mcp", mcp).layer(
        IdempotencyLayer::new(MemoryStore::new())
            .single_tenant()
            // Replays say so in `result._meta`, where an MCP client can read it.
            .jsonrpc(
                JsonRpc::new()
                    .meta_key("idempotencyKey")
                    .mark_replay_in_meta(true),
            ),
    );
    let listener = match tokio::net::TcpListener::bind(&addr).await {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!("cannot listen on {addr}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let Ok(local) = listener.local_addr() else {
        return ExitCode::FAILURE;
    };
    let server = axum::serve(listener, app);
    if !demo {
        println!("MCP tools on http://{local}/mcp (tools/call guarded by Idempotency-Key)");
        return match server.await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("server failed: {e}");
                ExitCode::FAILURE
            }
        };
    }
    tokio::spawn(async move { server.await });
    match demo_run(local).await {
        Ok(()) if tickets.created.load(Ordering::SeqCst) == 1 => {
            println!("\ntickets created: 1 for two calls with one key: ok");
            ExitCode::SUCCESS
        }
        Ok(()) => {
            eprintln!(
                "WRONG: {} tickets created",
                tickets.created.load(Ordering::SeqCst)
            );
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("demo failed: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Two rmcp client sessions (a first try and its retry) calling the tool with one key.
async fn demo_run(addr: std::net::SocketAddr) -> Result<(), Box<dyn std::error::Error>> {
    let mut arguments = serde_json::Map::new();
    arguments.insert("title".into(), "printer on fire".into());
    println!("{:<12} {:<9} content", "call", "replayed");
    for attempt in ["first call", "retry"] {
        let mut headers = HashMap::new();
        headers.insert(
            HeaderName::from_static("idempotency-key"),
            HeaderValue::from_static("demo-ticket-1"),
        );
        let config = StreamableHttpClientTransportConfig::with_uri(format!("http://{addr}/mcp"))
            .custom_headers(headers);
        let client = ().serve(StreamableHttpClientTransport::from_config(config)).await?;
        let result = client
            .call_tool(
                CallToolRequestParams::new("create_ticket").with_arguments(arguments.clone()),
            )
            .await?;
        // The layer marks a replay in `result._meta` (`mark_replay_in_meta`).
        let meta = serde_json::to_value(&result.meta)?;
        let replayed = meta[tower_idempotency::jsonrpc::REPLAY_META] == true;
        println!(
            "{attempt:<12} {:<9} {}",
            if replayed { "yes" } else { "no" },
            serde_json::to_string(&result.content)?
        );
        if replayed != (attempt == "retry") {
            return Err(format!(
                "the {attempt} should {}be a replay",
                if replayed { "not " } else { "" }
            )
            .into());
        }
        client.cancel().await?;
    }
    Ok(())
}
