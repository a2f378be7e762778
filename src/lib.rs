//! Idempotency keys for tower services: one execution per key, the recorded outcome replayed to
//! every retry.
//!
//! Agents, queues and people retry after every timeout. Put [`IdempotencyLayer`] in front of a
//! write endpoint and a refund, a ticket or an email still happens once: the first request with
//! an `Idempotency-Key` runs, retries get its recorded answer (marked
//! `Idempotency-Replayed: true`), a retry that arrives while the first still runs gets
//! `409` with `Retry-After`, and a key reused for a different request gets `422`.
//!
//! ```no_run
//! use axum::{Router, routing::post};
//! use tower_idempotency::{IdempotencyContext, IdempotencyLayer, MemoryStore};
//!
//! /// The caller, put in the request's extensions by your auth layer.
//! #[derive(Clone)]
//! struct User {
//!     id: u64,
//! }
//!
//! async fn create_ticket(ctx: IdempotencyContext, body: String) -> String {
//!     format!("ticket for {body:?}, attempt {}", ctx.attempt())
//! }
//!
//! # async fn run(auth: tower::layer::util::Identity) -> std::io::Result<()> {
//! let app = Router::new()
//!     .route("/tools/create_ticket", post(create_ticket))
//!     // Keys are scoped by the caller: never shared, and stable across token refreshes.
//!     .route_layer(IdempotencyLayer::new(MemoryStore::new()).scope_by_principal(|u: &User| u.id.to_string()))
//!     .route_layer(auth); // runs first: sets `User`
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! axum::serve(listener, app).await
//! # }
//! ```
//!
//! # The pipeline
//!
//! For each request on a guarded method (`POST` and `PATCH` by default), in this order:
//!
//! 1. **Key** ([`KeyError`]): `Idempotency-Key` as an RFC 8941 string or a bare
//!    visible-ASCII value, at most 255 bytes, once. Missing: 400 when required (the default),
//!    pass-through when [`require_key(false)`](IdempotencyLayer::require_key).
//! 2. **Scope** ([`scope`]): keys live in the caller's scope, chosen when the layer is built
//!    (the authenticated principal, a header, a closure, or an explicit single tenant); a
//!    layer without one does not compile, and a request without what its scope needs is a
//!    server misconfiguration (500, nothing runs).
//! 3. **Buffer**: the body, up to [`body_limit`](IdempotencyLayer::body_limit) (1 MiB), else
//!    413; nothing is claimed before this.
//! 4. **Fingerprint** ([`Fingerprint`]): method, path, query, media type and
//!    the canonical body (RFC 8785 JSON, sorted form pairs, multipart by parts).
//! 5. **Claim** ([`IdempotencyStore::claim`]): one atomic store operation.
//! 6. **Decide**: run, replay, or refuse (see the table below).
//! 7. **Execute** to completion even if the client hangs up (the request's future moves to a
//!    task of its own when dropped), the lease renewed by a keeper task while it runs (see
//!    [`RouteConfig::lease`]). A claim dropped in flight is finished, and given back.
//! 8. **Record** by [`CachePolicy`], fenced by the lease's token; a record the store refuses
//!    is retried until it lands, never dropped.
//! 9. **Respond** with the same bytes a replay will return.
//!
//! | the key's record | answer |
//! |---|---|
//! | none | run the handler |
//! | completed, same request | the recorded response, `Idempotency-Replayed: true` |
//! | any state, different request | 422 `fingerprint-mismatch`, nothing run |
//! | in progress | 409 `in-flight` with `Retry-After`, nothing run |
//! | needs reconciliation | 409 `outcome-unknown`, nothing run |
//! | expired | as none |
//! | store failing | 503 `store-unavailable` with `Retry-After`, nothing run |
//!
//! Every refusal is an RFC 9457 problem: see [`problem`] for the types. gRPC requests get gRPC
//! statuses ([`grpc`]); routes in JSON-RPC mode (MCP `tools/call`) get JSON-RPC errors and
//! replays under the new request's `id` ([`jsonrpc`]). Uncertain outcomes are settled with
//! [`reconcile`]. Backends are chosen in
//! [`store`]; [`store::AnyStore`] picks one from a URL at run time.
//!
//! # Metrics
//!
//! Through the [`metrics`](https://docs.rs/metrics) facade, counters named
//! `idempotency_attempts_total`, `idempotency_executions_total`, `idempotency_replays_total`,
//! `idempotency_conflicts_total`, `idempotency_mismatches_total`,
//! `idempotency_key_rejections_total`, `idempotency_body_rejections_total`,
//! `idempotency_store_errors_total`, `idempotency_releases_total`,
//! `idempotency_outcome_unknown_total`, `idempotency_moved_to_reconciliation_total`,
//! `idempotency_reconciled_applied_total`, `idempotency_reconciled_not_applied_total`,
//! `idempotency_lease_lost_total` and `idempotency_stale_writes_total`, and the gauge
//! `idempotency_awaiting_reconciliation`. Each guarded request also runs in a `tracing` span named
//! `idempotency` (at `INFO`) whose `outcome` field says what happened. Whether anyone can see
//! it is asked once, when the request arrives (a subscriber, or `log` through `tracing`'s `log`
//! feature); a request nobody can see gets no span, and costs nothing for it.
//!
//! # Features
//!
//! - `axum` (default): [`IdempotencyContext`] as an axum extractor.
//! - `memory` (default): the embedded [`MemoryStore`].
//! - `sqlite`, `postgres`: the durable stores, on sqlx.
//! - `redis`: `RedisStore`, on redis-rs (a single server or a Redis Cluster).
//! - `tonic`: the middleware keeps tonic's `NamedService`. (gRPC requests are handled without
//!   it: see [`grpc`].)
//! - `test-kit`: [`store::kit`], the conformance checks for stores.
//! - `client`: [`client`], the caller's half: a tower layer for HTTP clients that keeps one key
//!   across every retry of a logical call and stops where a retry would be wrong.
//! - `console`: the operator console (`console::Console`), an axum `Router` to mount behind your
//!   own authentication.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod base64;
mod body;
mod bounded;
#[cfg(feature = "client")]
pub mod client;
#[cfg(feature = "console")]
pub mod console;
mod context;
mod decide;
pub mod detached;
mod dialect;
mod execute;
pub mod fingerprint;
mod future;
mod hold;
mod json_text;
mod key;
mod layer;
mod lines;
mod observe;
mod policy;
pub mod problem;
pub mod reconcile;
mod replay;
mod reuse;
mod route;
pub mod scope;
mod service;
mod settings;
pub mod store;
mod unwind;
mod uri;
mod whose;
mod window;
mod window_document;
mod woken;

pub use body::{RequestBody, ResponseBody};
pub use context::IdempotencyContext;
#[cfg(feature = "axum")]
pub use context::MissingIdempotencyContext;
pub use dialect::{grpc, jsonrpc};
pub use fingerprint::{Canonicalize, Fingerprint, MalformedBody};
pub use future::ResponseFuture;
pub use key::{IDEMPOTENCY_KEY, KeyError, MAX_KEY_LEN, ScopedKey};
pub use layer::IdempotencyLayer;
pub use policy::{CachePolicy, Outcome};
pub use replay::IDEMPOTENCY_REPLAYED;
pub use route::{LONGEST, RouteConfig};
pub use scope::{MakeScope, MissingScope};
pub use service::Idempotency;
pub use store::AnyStore;
#[cfg(feature = "memory")]
pub use store::MemoryStore;
#[cfg(feature = "postgres")]
pub use store::PostgresStore;
#[cfg(feature = "redis")]
pub use store::RedisStore;
#[cfg(feature = "sqlite")]
pub use store::SqliteStore;
pub use store::{IdempotencyStore, LeaseExpiry};
pub use window::ProcessingWindow;
pub use window_document::WindowsService;
