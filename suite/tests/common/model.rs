//! The app and client of the model tests (`model_differential.rs`, `model_mutants_review.rs`):
//! a handler that counts its runs per (tenant, key) and makes every answer unique, routes
//! guarded with and without a `nest` prefix, and one request as a client sends it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderName, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{MethodRouter, post};
use tower_idempotency::{IdempotencyLayer, IdempotencyStore};

use super::guard;

/// Executions the handler saw, per (tenant, key as the handler reads it, unquoted), and a
/// serial number that makes every execution's answer unique.
#[derive(Clone, Default)]
pub struct Sink {
    runs: Arc<Mutex<HashMap<(String, String), usize>>>,
    serial: Arc<AtomicUsize>,
}

impl Sink {
    /// Runs of `key` in `tenant`.
    pub fn runs(&self, tenant: &str, key: &str) -> usize {
        let runs = self.runs.lock().expect("sink");
        runs.get(&(tenant.to_owned(), key.to_owned()))
            .copied()
            .unwrap_or(0)
    }

    /// Runs in all.
    pub fn total(&self) -> usize {
        self.serial.load(Ordering::SeqCst)
    }
}

/// The key as sent, unquoted (the tests quote only keys without `"` or `\`).
fn bare_key(sent: &str) -> String {
    sent.trim_matches('"').to_owned()
}

/// Counts its run, then answers as `x-outcome` asks: `reject` 400 (definitive), `fail` 503 (a
/// technical failure, which releases the key), anything else 201; the body and `x-run` name
/// the run.
async fn handle(sink: Sink, headers: HeaderMap, body: Bytes) -> axum::response::Response {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let (tenant, key) = (header("x-tenant"), bare_key(&header("idempotency-key")));
    let serial = sink.serial.fetch_add(1, Ordering::SeqCst) + 1;
    *sink
        .runs
        .lock()
        .expect("sink")
        .entry((tenant.clone(), key.clone()))
        .or_insert(0) += 1;
    let status = match header("x-outcome").as_str() {
        "reject" => StatusCode::BAD_REQUEST,
        "fail" => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::CREATED,
    };
    let text = format!(
        "run {serial} for {tenant}/{key}, {} bytes: {}",
        body.len(),
        String::from_utf8_lossy(&body)
    );
    (status, [("x-run", serial.to_string())], text).into_response()
}

/// The counting handler on `sink` for `POST` and `PATCH` (both guarded by default).
pub fn route(sink: Sink) -> MethodRouter {
    let patched = sink.clone();
    post(move |h: HeaderMap, b: Bytes| handle(sink.clone(), h, b))
        .patch(move |h: HeaderMap, b: Bytes| handle(patched.clone(), h, b))
}

/// `/a`, `/b` and `/v1/a` scoped by `x-tenant`, where `/v1` is a nest whose inner router
/// carries a layer of its own on the same store: axum strips `/v1` before that layer sees the
/// path, and the contract still counts it.
pub fn app<St: IdempotencyStore + Clone>(store: St, sink: Sink) -> Router {
    let layer = || {
        IdempotencyLayer::new(store.clone()).scope_by_header(HeaderName::from_static("x-tenant"))
    };
    let routes = || {
        Router::new()
            .route("/a", route(sink.clone()))
            .route("/b", route(sink.clone()))
    };
    Router::new()
        .nest("/v1", routes().layer(layer()))
        .merge(routes().layer(layer()))
}

/// One request as the client sends it.
#[derive(Clone, Copy, Debug)]
pub struct Call<'a> {
    pub tenant: &'a str,
    pub key: &'a str,
    pub method: &'a str,
    pub path: &'a str,
    pub content_type: &'a str,
    pub body: &'a str,
    pub outcome: &'a str,
}

/// One answer as the client saw it.
pub struct Answer {
    pub status: u16,
    pub replayed: Option<String>,
    pub run: Option<String>,
    pub bytes: Bytes,
}

impl Answer {
    /// The problem type of a problem+json body (null otherwise).
    pub fn problem_type(&self) -> serde_json::Value {
        serde_json::from_slice::<serde_json::Value>(&self.bytes)
            .map(|p| p["type"].clone())
            .unwrap_or_default()
    }

    /// Marked `Idempotency-Replayed: true`.
    pub fn is_replay(&self) -> bool {
        self.replayed.as_deref() == Some("true")
    }
}

/// Sends `call` on a connection of its own ([`super::client`]).
pub async fn send(client: &reqwest::Client, addr: SocketAddr, call: Call<'_>) -> Answer {
    let res = guard(
        "a request",
        client
            .request(
                call.method.parse().expect("method"),
                format!("http://{addr}{}", call.path),
            )
            .header("x-tenant", call.tenant)
            .header("idempotency-key", call.key)
            .header("content-type", call.content_type)
            .header("x-outcome", call.outcome)
            .body(call.body.to_owned())
            .send(),
    )
    .await
    .expect("response");
    let status = res.status().as_u16();
    let header = |name: &str| {
        res.headers()
            .get(name)
            .map(|v| v.to_str().unwrap_or("?").to_owned())
    };
    let (replayed, run) = (header("idempotency-replayed"), header("x-run"));
    let bytes = guard("a body", res.bytes()).await.expect("body");
    Answer {
        status,
        replayed,
        run,
        bytes,
    }
}
