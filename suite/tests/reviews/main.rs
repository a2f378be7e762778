//! The red-team reviews, kept as regression tests: one module each, one test binary.
//!
//! Each test binary links the whole stack (tokio, sqlx, tonic, redis) and compiles `common`
//! again; as one binary the reviews build once, and their tests share the two test threads
//! instead of waiting for each other's slowest test. Reviews that install process-wide state
//! (a metrics recorder, a tracing subscriber or logger, a panic hook, a counting allocator),
//! count the process's threads, or run their own binary as a child stay binaries of their own
//! in `tests/`: here they would see (or change) every other review's.

#[path = "../common/mod.rs"]
mod common;

mod app_runtimes_review;
mod block_scan_claim_now_review;
mod client_review;
mod completed_now_review;
mod composition_review;
mod core_red_team_review;
mod execution_shape_review;
mod faults_wait_milestone_review;
mod fingerprint_scope_review;
mod grpc_exactness_review;
mod hash_memo_review;
mod jsonrpc_answers_review;
mod jsonrpc_ids_review;
mod jsonrpc_mcp_review;
mod jsonrpc_stream_ends_review;
mod keeper_runtimes_review;
mod lease_keeper_review;
mod listing_under_change_review;
mod lookup_hash_review;
mod memory_counts_review;
mod milestone_hold_review;
mod model_grpc_review;
mod model_mutants_review;
mod multipart_differential_review;
mod postgres_server_faults_review;
mod reconcile_console_review;
mod record_times_review;
mod redis_cluster_replace_review;
mod redis_coalescing_review;
mod redis_failover_review;
mod redis_replace_review;
mod redis_restart_review;
mod redis_server_faults_review;
mod resolution_changes_review;
mod review_claim_reads;
mod review_full_memory;
mod row_hold_review;
mod s33_fixes_review;
mod s33_foreign_records_review;
mod s33_replica_skew_review;
mod s33_schemes_review;
mod s33_transport_review;
mod scheme_adoption_review;
mod store_error_variants_review;
mod strict_media_review;
mod todays_fixes_review2;
mod tonic_composition_review;
mod window_moves_review;
