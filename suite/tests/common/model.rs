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

    /// Counts a run of `key` in `tenant`; its serial number, unique to the run.
    pub fn hit(&self, tenant: &str, key: &str) -> usize {
        let serial = self.serial.fetch_add(1, Ordering::SeqCst) + 1;
        *self
            .runs
            .lock()
            .expect("sink")
            .entry((tenant.to_owned(), key.to_owned()))
            .or_insert(0) += 1;
        serial
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
    let serial = sink.hit(&tenant, &key);
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

/// Whether `text` parses to `value` with nothing lost: no member name twice (serde keeps the
/// last), no integer that a double cannot hold exactly.
pub fn exact(text: &str, value: &serde_json::Value) -> bool {
    fn members(v: &serde_json::Value) -> usize {
        match v {
            serde_json::Value::Object(m) => m.len() + m.values().map(members).sum::<usize>(),
            serde_json::Value::Array(a) => a.iter().map(members).sum(),
            _ => 0,
        }
    }
    fn numbers_exact(v: &serde_json::Value) -> bool {
        match v {
            serde_json::Value::Number(n) => match (n.as_u64(), n.as_i64()) {
                (Some(u), _) => u <= 1 << 53,
                (None, Some(i)) => i.unsigned_abs() <= 1 << 53,
                (None, None) => true,
            },
            serde_json::Value::Object(m) => m.values().all(numbers_exact),
            serde_json::Value::Array(a) => a.iter().all(numbers_exact),
            _ => true,
        }
    }
    // Member names counted in the text: a colon outside strings starts a member's value.
    let mut colons = 0;
    let (mut in_string, mut escaped) = (false, false);
    for c in text.chars() {
        match (in_string, escaped, c) {
            (true, true, _) => escaped = false,
            (true, false, '\\') => escaped = true,
            (true, false, '"') => in_string = false,
            (false, _, '"') => in_string = true,
            (false, _, ':') => colons += 1,
            _ => {}
        }
    }
    colons == members(value) && numbers_exact(value)
}

/// Seeds of a model test's rounds: `fixed` ones, so a failure reproduces, and one of this run's
/// (printed with any failure).
pub fn round_seeds(fixed: u64) -> Vec<u64> {
    let fresh = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(7, |d| d.as_nanos() as u64);
    (1..=fixed).chain([fresh]).collect()
}

/// The generator seed of `stream` in the round `seed` on the store `name`: each store its own
/// sequences, the same on every run, spread by an odd multiplier (`Rng` drops the lowest bit).
pub fn stream_seed(name: &str, seed: u64, stream: usize) -> u64 {
    let salt = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    (seed.wrapping_mul(31).wrapping_add(stream as u64) ^ salt).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Clients sending at once in each round of a model test, each with tenants or keys of its own.
pub const STREAMS: usize = 4;

/// Runs `stream(s)` for each of the [`STREAMS`] streams at once, each on a task of its own, and
/// sums what they return (the runs each expected). A stream that panicked fails the test.
pub async fn at_once<F>(stream: impl Fn(usize) -> F) -> usize
where
    F: std::future::Future<Output = usize> + Send + 'static,
{
    let tasks = (0..STREAMS).map(|s| tokio::spawn(stream(s)));
    futures_util::future::join_all(tasks)
        .await
        .into_iter()
        .map(|done| done.expect("a stream panicked: see its message above"))
        .sum()
}
