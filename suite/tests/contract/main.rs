//! The contract tests of the layer, the stores and the client, as one test binary: one module
//! per file, as in `tests/reviews/`.
//!
//! Each test binary links the whole stack (tokio, sqlx, tonic, redis) and compiles `common`
//! again; as one binary they build once, and their tests share the two test threads instead of
//! waiting for each other's slowest test. Files that install process-wide state (a metrics
//! recorder, a tracing subscriber or logger, a panic hook, a counting allocator), count the
//! process's threads, or run their own binary as a child stay binaries of their own in
//! `tests/`: here they would see (or change) every other file's.

#[path = "../common/mod.rs"]
mod common;

mod bad_input;
mod batching;
mod batching_big;
mod batching_edges;
mod batching_faults;
mod client;
mod client_grpc;
mod client_hostile;
mod coalescing;
mod coalescing_hostile;
mod codings;
mod codings_http;
mod configuration;
mod console;
mod faults;
mod fenced_by_mistake_review;
mod give_back_lease_attack_review;
mod grpc_contract;
mod grpc_exact;
mod grpc_hostile;
mod grpc_web;
mod grpc_web_hostile;
mod http_contract;
mod isolation;
mod jsonrpc;
mod jsonrpc_exact;
mod jsonrpc_stream_ends;
mod keeper_fence_review;
mod mcp;
mod model_differential;
mod model_jsonrpc;
mod postgres_claim_reads;
mod reconcile;
mod redis_hostile;
mod replay_as_sent;
mod replay_shape_review;
mod set_aside_give_back_review;
mod sqlite_batch_review;
mod sqlite_batch_rows;
mod store_kit;
mod sweeper;
mod todays_fixes_review;
mod window;
mod window_hostile;
