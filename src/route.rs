//! Per-route settings: what a route guards, how long its records and leases last, what it
//! records.

use std::time::Duration;

use http::Method;

use std::sync::Arc;

use crate::dialect::jsonrpc::JsonRpc;
use crate::fingerprint::Scheme;
use crate::policy::CachePolicy;
use crate::store::LeaseExpiry;

/// The longest TTL, lease or wait a route takes: longer ones are cut to it. Every store can
/// represent a time this far ahead (`now() + interval` in SQL overflows on `Duration::MAX`,
/// which would turn every request into a 503), and no deadline computed from it overflows.
pub const LONGEST: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The settings of one route (or of the whole layer, as its default).
///
/// Build it by value, starting from the layer's defaults:
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{CachePolicy, IdempotencyLayer, MemoryStore};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     .ttl(Duration::from_secs(3600))
///     .for_path("/tools/deploy", |route| {
///         route.cache_policy(CachePolicy::Everything).lease(Duration::from_secs(120))
///     });
/// ```
#[derive(Debug, Clone)]
pub struct RouteConfig {
    pub(crate) require_key: bool,
    pub(crate) methods: Vec<Method>,
    pub(crate) cache_policy: CachePolicy,
    pub(crate) ttl: Duration,
    pub(crate) lease: Duration,
    pub(crate) on_lease_expiry: LeaseExpiry,
    pub(crate) body_limit: usize,
    pub(crate) response_limit: usize,
    pub(crate) envelope: bool,
    pub(crate) mark_first_response: bool,
    pub(crate) unavailable_retry_after: Duration,
    pub(crate) record_refusals: bool,
    pub(crate) jsonrpc: Option<Arc<JsonRpc>>,
    pub(crate) cancel_on_disconnect: bool,
    pub(crate) wait_for_in_flight: Option<Duration>,
    pub(crate) json_fields: Option<Arc<crate::fingerprint::JsonFields>>,
    /// How long this route's executions take (each resolved route has its own).
    pub(crate) window: Arc<crate::window::Window>,
    /// The scheme of this route's fingerprints: set when the layer is built, from its
    /// fingerprint settings and this route's, so no request computes it.
    pub(crate) scheme: Scheme,
}

impl Default for RouteConfig {
    fn default() -> Self {
        Self {
            require_key: true,
            methods: vec![Method::POST, Method::PATCH],
            cache_policy: CachePolicy::DefinitiveOnly,
            ttl: Duration::from_secs(24 * 60 * 60),
            lease: Duration::from_secs(30),
            on_lease_expiry: LeaseExpiry::Reclaim,
            body_limit: 1024 * 1024,
            response_limit: 1024 * 1024,
            envelope: false,
            mark_first_response: false,
            unavailable_retry_after: Duration::from_secs(1),
            record_refusals: false,
            jsonrpc: None,
            cancel_on_disconnect: false,
            wait_for_in_flight: None,
            json_fields: None,
            window: Arc::default(),
            scheme: crate::fingerprint::PLAIN_HTTP,
        }
    }
}

impl RouteConfig {
    /// The scheme of this route's fingerprints under a layer's `options` (computed once, when
    /// the layer is built).
    pub(crate) fn scheme_under(&self, options: &crate::fingerprint::FingerprintOptions) -> Scheme {
        crate::fingerprint::scheme(options, self.json_fields.as_deref(), self.jsonrpc.is_some())
    }

    /// Whether requests without a key are refused with 400 (`true`, the default) or passed
    /// through unguarded (`false`).
    pub fn require_key(mut self, required: bool) -> Self {
        self.require_key = required;
        self
    }

    /// The methods guarded (default `POST` and `PATCH`); others pass through untouched, but
    /// for `HEAD` where `GET` is guarded: axum answers a `HEAD` with the `GET` handler, so a
    /// `HEAD` with a key is refused (`call-unguardable`; its answer has no body to replay as
    /// the `GET`'s), and one without where a key is required as a `GET` would be (the layer
    /// cannot see a `HEAD` handler of the router's own: guard such a route's `GET` with a
    /// `route_layer` on its method router instead). Guard `HEAD` itself by naming it: it is
    /// then fingerprinted as a request of its own.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// Which outcomes are recorded (default [`CachePolicy::DefinitiveOnly`]).
    pub fn cache_policy(mut self, policy: CachePolicy) -> Self {
        self.cache_policy = policy;
        self
    }

    /// How long a recorded outcome is replayed (default 24 hours); afterwards the key is new.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl.min(LONGEST);
        self
    }

    /// How long a claim holds without renewal (default 30 s).
    ///
    /// The holder keeps its lease for as long as its process lives: the layer's keeper task
    /// renews it every third of its length from before the handler starts until the outcome is
    /// recorded (a record the store refuses is retried, under the same lease, until it lands).
    /// The keeper never runs on the handler's task, so on a multi-threaded runtime a handler
    /// that blocks its thread keeps its lease, as long as one worker is free to run the keeper. A current-thread runtime has one thread: a
    /// handler blocking it for longer than the lease loses the lease as a crashed holder would,
    /// so run blocking work there in `tokio::task::spawn_blocking`.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.clamp(Duration::from_millis(30), LONGEST);
        self
    }

    /// What a claim does when it finds a dead holder's expired lease (default
    /// [`LeaseExpiry::Reclaim`]).
    pub fn on_lease_expiry(mut self, expiry: LeaseExpiry) -> Self {
        self.on_lease_expiry = expiry;
        self
    }

    /// The largest request body buffered (default 1 MiB); larger ones get 413.
    pub fn body_limit(mut self, bytes: usize) -> Self {
        self.body_limit = bytes;
        self
    }

    /// The largest response body recorded (default 1 MiB). A larger response still reaches the
    /// client, and the key stays consumed: replays get `response-not-stored` (409), never a
    /// second execution. A streamed (SSE) JSON-RPC answer is recorded so as soon as it passes
    /// the limit, so one that never ends holds neither its lease nor a growing copy.
    ///
    /// A response whose body fails after the handler answered is kept the same way (completed,
    /// response not available) when the policy records its status: the handler answered, so its
    /// effect is taken as done.
    ///
    /// Every byte of the response counts: its body, its headers and its trailers (those never
    /// recorded too), so a body of exactly the limit does not fit with its head.
    pub fn response_limit(mut self, bytes: usize) -> Self {
        self.response_limit = bytes;
        self
    }

    /// Wraps first responses and replays alike as
    /// `{"ok": <2xx?>, "status": <code>, "idempotent_replay": <bool>, "original_response": <body>}`
    /// (default off): for agent-tool endpoints whose callers read the replay flag from the body.
    /// A JSON body is embedded as its own bytes, never re-serialised; other UTF-8 becomes a
    /// JSON string and a binary body `null`. `204` and `304` keep their empty body, and
    /// `ETag`, `Content-MD5` and digest headers are dropped from wrapped responses (they
    /// describe the unwrapped bytes). A response over the record limit is wrapped as it streams.
    pub fn envelope(mut self, on: bool) -> Self {
        self.envelope = on;
        self
    }

    /// Adds `Idempotency-Replayed: false` to first responses (default off; replays always carry
    /// `Idempotency-Replayed: true`).
    pub fn mark_first_response(mut self, on: bool) -> Self {
        self.mark_first_response = on;
        self
    }

    /// The `Retry-After` sent with 503 when the store fails (default 1 s).
    pub fn unavailable_retry_after(mut self, after: Duration) -> Self {
        self.unavailable_retry_after = after.min(LONGEST);
        self
    }

    /// Declares that the route's handler has external effects (it charges, sends, deploys):
    /// a holder that dies leaves its key `needs_reconciliation` instead of letting a retry take
    /// it over. The same as `on_lease_expiry(LeaseExpiry::Reconcile)`.
    pub fn external_effects(self, external: bool) -> Self {
        self.on_lease_expiry(if external {
            LeaseExpiry::Reconcile
        } else {
            LeaseExpiry::Reclaim
        })
    }

    /// Fingerprints only part of a JSON body: the fields at some JSON Pointers, or all but
    /// some (see [`JsonFields`](crate::fingerprint::JsonFields)). What counts is canonicalised as
    /// exactly as a whole body is. The risk is yours: a field left out that changes the outcome
    /// makes two different operations look like one, and the second gets the first's answer.
    ///
    /// ```
    /// use tower_idempotency::fingerprint::JsonFields;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).for_path("/payments", |route| {
    ///     route.fingerprint_json(JsonFields::exclude(["/client_timestamp"]).expect("pointers"))
    /// });
    /// ```
    pub fn fingerprint_json(mut self, fields: crate::fingerprint::JsonFields) -> Self {
        self.json_fields = Some(Arc::new(fields));
        self
    }

    /// Also writes replays, conflicts, mismatches and "outcome unknown" refusals into the key's
    /// history (default off). Executions are always in it; these cost one extra write each on
    /// what is otherwise a read, so turn them on where an audit trail of every retry is worth it.
    /// A history keeps at most [`HISTORY_REFUSALS`](crate::store::HISTORY_REFUSALS) entries
    /// before refusals stop being written, on every store.
    pub fn record_refusals(mut self, on: bool) -> Self {
        self.record_refusals = on;
        self
    }

    /// Guards the route in JSON-RPC mode (MCP `tools/call` and the like): see
    /// [`jsonrpc`](crate::jsonrpc) for what it changes.
    pub fn jsonrpc(mut self, settings: JsonRpc) -> Self {
        self.jsonrpc = Some(Arc::new(settings));
        self
    }

    /// For servers that treat a client hanging up as cancellation (default off): the handler
    /// runs on the request's own future, so a disconnect cancels it, and the key is released
    /// (tried again while the store fails, until it lands or the key is no longer this
    /// holder's), so a retry runs it again. Off, the handler runs to completion and its
    /// outcome is recorded whatever the client does (DESIGN §1 step 7). Only turn it on when
    /// cancelling the handler cannot leave a half-done effect behind.
    pub fn cancel_on_disconnect(mut self, on: bool) -> Self {
        self.cancel_on_disconnect = on;
        self
    }

    /// Instead of answering `409 in-flight` at once, waits up to `wait` for the request holding
    /// the key to finish, then replays its outcome (or runs, if it gave the key back); after the
    /// wait, answers 409 as usual (default: no wait). For callers that cannot handle 409 well.
    pub fn wait_for_in_flight(mut self, wait: Duration) -> Self {
        self.wait_for_in_flight = Some(wait.min(LONGEST));
        self
    }

    pub(crate) fn guards(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }
}
