//! An MCP tool server (rmcp's Streamable HTTP service in axum) whose `tools/call` is safe to
//! retry: the layer's JSON-RPC mode guards calls that carry an `Idempotency-Key` header (or an
//! `idempotencyKey` entry in `params._meta`), whatever their JSON-RPC `id`.
//!
//! The key is per call, so the demo's client puts it in each call's `params._meta`: rmcp's
//! custom headers belong to a transport (every call of a session would share one key). The
//! tool's description carries the route's processing window (`ProcessingWindow::describe`):
//! the deadline a retry needs and how long keys are kept, for the agent that reads it.
//!
//! ```text
//! cargo run -p suite --example mcp_tools        # serve on 127.0.0.1:8000/mcp (ADDR=host:port)
//! cargo run -p suite --example mcp_tools -- --demo  # call itself with rmcp's client, print the result
//! ```

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ListToolsResult,
    PaginatedRequestParams, RequestMetaObject, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler, ServiceExt};
use tower_idempotency::jsonrpc::JsonRpc;
use tower_idempotency::scope::SingleTenant;
use tower_idempotency::{IdempotencyLayer, MemoryStore};

/// The tool: every call that runs creates a ticket.
#[derive(Clone)]
struct Tickets {
    created: Arc<AtomicU64>,
    /// The layer guarding the tool, for the window it publishes.
    guard: IdempotencyLayer<MemoryStore, SingleTenant>,
}

impl ServerHandler for Tickets {
    #[allow(deprecated)]
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _: Option<PaginatedRequestParams>,
        _: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        let window = self.guard.processing_windows().remove(0);
        let mut schema = serde_json::Map::new();
        schema.insert("type".into(), "object".into());
        schema.insert(
            "properties".into(),
            serde_json::json!({ "title": { "type": "string" } }),
        );
        let description = format!(
            "Creates a ticket. Put a key for this step in `_meta.idempotencyKey`. {}",
            window.describe()
        );
        Ok(ListToolsResult::with_all_items(vec![Tool::new(
            "create_ticket",
            description,
            schema,
        )]))
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
    let guard = IdempotencyLayer::new(MemoryStore::new())
        .single_tenant()
        // Replays say so in `result._meta`, where an MCP client can read it.
        .jsonrpc(
            JsonRpc::new()
                .meta_key("idempotencyKey")
                .mark_replay_in_meta(true),
        );
    let tickets = Tickets {
        created: Arc::default(),
        guard: guard.clone(),
    };
    let handler = tickets.clone();
    let mcp: StreamableHttpService<Tickets, LocalSessionManager> = StreamableHttpService::new(
        move || Ok(handler.clone()),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default(),
    );
    let app = axum::Router::new().nest_service("/mcp", mcp).layer(guard);
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
        Ok(()) if tickets.created.load(Ordering::SeqCst) == 2 => {
            println!("\ntickets created: 2 for three calls with two keys: ok");
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

/// One rmcp client session: the tool's description, then three calls, each with its key in
/// `params._meta`: a first try, its retry (the same key), and the next step (a new key).
async fn demo_run(addr: std::net::SocketAddr) -> Result<(), Box<dyn std::error::Error>> {
    let config = StreamableHttpClientTransportConfig::with_uri(format!("http://{addr}/mcp"));
    let client = ().serve(StreamableHttpClientTransport::from_config(config)).await?;
    let tools = client.list_all_tools().await?;
    for tool in &tools {
        println!(
            "tool {}: {}\n",
            tool.name,
            tool.description.as_deref().unwrap_or("")
        );
    }
    let mut arguments = serde_json::Map::new();
    arguments.insert("title".into(), "printer on fire".into());
    println!(
        "{:<12} {:<20} {:<9} content",
        "call", "_meta.idempotencyKey", "replayed"
    );
    for (attempt, key, replay) in [
        ("first call", "run-7:ticket-1", false),
        ("retry", "run-7:ticket-1", true),
        ("next step", "run-7:ticket-2", false),
    ] {
        // The key is this call's: in its `_meta`, beside what rmcp puts there itself.
        let mut meta = RequestMetaObject::new();
        meta.insert("idempotencyKey".into(), key.into());
        let mut params =
            CallToolRequestParams::new("create_ticket").with_arguments(arguments.clone());
        params.meta = Some(meta);
        let result = client.call_tool(params).await?;
        // The layer marks a replay in `result._meta` (`mark_replay_in_meta`).
        let meta = serde_json::to_value(&result.meta)?;
        let replayed = meta[tower_idempotency::jsonrpc::REPLAY_META] == true;
        println!(
            "{attempt:<12} {key:<20} {:<9} {}",
            if replayed { "yes" } else { "no" },
            serde_json::to_string(&result.content)?
        );
        if replayed != replay {
            return Err(format!(
                "the {attempt} should {}be a replay",
                if replayed { "not " } else { "" }
            )
            .into());
        }
    }
    client.cancel().await?;
    Ok(())
}
