//! [`IdempotencyLayer`]: the configuration, applied to a service.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method};
use tower_layer::Layer;

use crate::fingerprint::{Canonicalize, FingerprintOptions};
use crate::hold::Keeper;
use crate::key::IDEMPOTENCY_KEY;
use crate::policy::CachePolicy;
use crate::replay::default_denied_headers;
use crate::route::RouteConfig;
use crate::scope::{ByHeader, ByPrincipal, CredentialHash, MakeScope, SingleTenant, Unscoped};
use crate::service::Idempotency;
use crate::settings::Resolved;
use crate::store::LeaseExpiry;

type Override = Arc<dyn Fn(RouteConfig) -> RouteConfig + Send + Sync>;

/// Makes the wrapped service safe to retry: one execution per idempotency key, the recorded
/// outcome replayed to every retry.
///
/// Cheap to clone. Configure it by value; per-path settings start from the layer's defaults
/// whenever those are set:
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{IdempotencyLayer, MemoryStore};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     .lease(Duration::from_secs(10))
///     .for_path("/tools/search", |route| route.require_key(false));
/// ```
pub struct IdempotencyLayer<St, M = Unscoped> {
    /// The store, and the task that renews the leases its requests hold.
    keeper: Keeper<St>,
    make_scope: M,
    config: Arc<LayerConfig>,
}

#[derive(Clone)]
struct LayerConfig {
    header: HeaderName,
    default: RouteConfig,
    overrides: Vec<(String, Override)>,
    fingerprint: FingerprintOptions,
    denied_headers: Vec<HeaderName>,
    /// The configuration services run with, made once: axum applies a router's layers to
    /// handler routes on every request, so `layer` must be cheap.
    resolved: std::sync::OnceLock<Arc<Resolved>>,
}

/// Why a `for_path` could never match a request, or `None`.
fn never_matches(path: &str) -> Option<&'static str> {
    if !path.starts_with('/') {
        return Some("a request path always starts with '/'");
    }
    if path.contains(['?', '#']) {
        return Some("a path has no query or fragment: settings apply to the path alone");
    }
    if path
        .bytes()
        .any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
    {
        return Some("a request path has no spaces or control characters");
    }
    if !path.is_ascii() {
        return Some("a request path is ASCII: write other characters percent-encoded");
    }
    let mut names: Vec<&str> = path
        .split('{')
        .skip(1)
        .filter_map(|param| {
            param
                .split_once('}')
                .map(|(name, _)| name.trim_start_matches('*'))
        })
        .collect();
    names.sort_unstable();
    if names.windows(2).any(|pair| pair[0] == pair[1]) {
        return Some("a parameter name appears twice");
    }
    None
}

impl<St> IdempotencyLayer<St> {
    /// A layer keeping its records in `store`, with the default settings (see [`RouteConfig`]).
    pub fn new(store: St) -> Self {
        Self::from_arc(Arc::new(store))
    }

    /// A layer for a tonic server (`Server::builder().layer(..)`): it guards no method until
    /// [`grpc_method`](Self::grpc_method) names one, so streaming methods and reads pass
    /// through untouched.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new_for_grpc(MemoryStore::new())
    ///     .grpc_method("/tickets.Tickets/CreateTicket", |m| m)
    ///     .grpc_method("/tickets.Tickets/UpdateTicket", |m| m.require_key(false));
    /// ```
    pub fn new_for_grpc(store: St) -> Self {
        Self::new(store).defaults(|route| route.methods(std::iter::empty()))
    }

    /// A layer sharing an existing `Arc` of a store.
    pub fn from_arc(store: Arc<St>) -> Self {
        Self {
            keeper: Keeper::new(store),
            make_scope: Unscoped,
            config: Arc::new(LayerConfig {
                header: IDEMPOTENCY_KEY.clone(),
                default: RouteConfig::default(),
                overrides: Vec::new(),
                fingerprint: FingerprintOptions::default(),
                denied_headers: default_denied_headers(),
                resolved: std::sync::OnceLock::new(),
            }),
        }
    }
}

macro_rules! route_setting {
    ($( $(#[$doc:meta])* $name:ident($arg:ident: $ty:ty); )*) => {$(
        $(#[$doc])*
        ///
        /// Sets the layer's default; see [`RouteConfig`].
        pub fn $name(self, $arg: $ty) -> Self {
            self.defaults(|route| route.$name($arg))
        }
    )*};
}

impl<St, M> IdempotencyLayer<St, M> {
    fn config_mut(&mut self) -> &mut LayerConfig {
        let config = Arc::make_mut(&mut self.config);
        // Any change makes the cached resolution stale.
        config.resolved = std::sync::OnceLock::new();
        config
    }

    /// Changes the default settings of every route.
    pub fn defaults(mut self, f: impl FnOnce(RouteConfig) -> RouteConfig) -> Self {
        let config = self.config_mut();
        config.default = f(std::mem::take(&mut config.default));
        self
    }

    /// Settings for the requests of one route, made from the defaults by `f`. `path` is
    /// written as axum writes routes: a path (`/tools/search`), or a template with
    /// `{param}` segments and a final `{*rest}` (`/accounts/{id}/charge`).
    ///
    /// Behind an axum `Router` a request gets the settings of the route axum matched it to
    /// (its `MatchedPath`), so a literal route beside a template keeps its own; elsewhere
    /// (tonic, plain tower) the path is matched against the templates by axum's rules (a
    /// literal segment before a parameter, a parameter before a wildcard). With axum you may
    /// also put differently configured layers on different routes (`route_layer`); this form
    /// serves one layer across a router, and gRPC methods, whose paths are
    /// `/package.Service/Method`.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .for_path("/accounts/{id}/charge", |route| route.require_key(true))
    ///     .for_path("/tools/{*name}", |route| route.require_key(false));
    /// ```
    ///
    /// # Panics
    ///
    /// While the layer is built, as axum panics on a bad route, when the configuration could
    /// never do what it says: `path` does not start with `/`, holds a query, a fragment or a
    /// space, is not a valid template, conflicts with another `for_path` (as `/a/{x}` and
    /// `/a/{y}` do), or is given twice (the second would silently replace the first).
    pub fn for_path(
        mut self,
        path: impl Into<String>,
        f: impl Fn(RouteConfig) -> RouteConfig + Send + Sync + 'static,
    ) -> Self {
        let path = path.into();
        assert!(
            !self.config.overrides.iter().any(|(p, _)| *p == path),
            "IdempotencyLayer::for_path({path:?}) is given twice: the second would replace the \
             first; configure the path in one call"
        );
        if let Some(why) = never_matches(&path) {
            panic!("IdempotencyLayer::for_path({path:?}) can never match a request: {why}");
        }
        let mut templates = matchit::Router::new();
        for (other, _) in &self.config.overrides {
            // Earlier paths were checked as they came.
            let _ = templates.insert(other.as_str(), ());
        }
        if let Err(error) = templates.insert(path.as_str(), ()) {
            panic!("IdempotencyLayer::for_path({path:?}) is not a route axum could match: {error}");
        }
        self.config_mut().overrides.push((path, Arc::new(f)));
        self
    }

    /// Guards the unary gRPC method at `path` (`/package.Service/Method`), with settings made
    /// from the defaults by `f`. Only unary methods can be guarded: a call whose request stream
    /// sends a second message, or stays open a second after its first (a bidi client waiting
    /// for a reply), is refused with `INVALID_ARGUMENT` (`CALL_UNGUARDABLE`) before anything
    /// is claimed or run, never buffered until the client gives up. A server-streaming answer
    /// is recorded and replayed whole (streamed on, and recorded without its messages, past the
    /// response limit).
    pub fn grpc_method(
        self,
        path: impl Into<String>,
        f: impl Fn(RouteConfig) -> RouteConfig + Send + Sync + 'static,
    ) -> Self {
        self.for_path(path, move |route| f(route.methods([Method::POST])))
    }

    route_setting! {
        /// Whether requests without a key get 400 (`true`, the default) or pass through.
        require_key(required: bool);
        /// Which outcomes are recorded.
        cache_policy(policy: CachePolicy);
        /// How long a recorded outcome is replayed.
        ttl(ttl: Duration);
        /// How long a claim holds without renewal.
        lease(lease: Duration);
        /// What a claim does on finding an expired lease.
        on_lease_expiry(expiry: LeaseExpiry);
        /// The largest request body buffered.
        body_limit(bytes: usize);
        /// The largest response body recorded.
        response_limit(bytes: usize);
        /// Whether responses are wrapped in the JSON envelope.
        envelope(on: bool);
        /// Whether first responses carry `Idempotency-Replayed: false`.
        mark_first_response(on: bool);
        /// The `Retry-After` sent with 503 when the store fails.
        unavailable_retry_after(after: Duration);
        /// Whether a dead holder's key needs reconciliation rather than a takeover.
        external_effects(external: bool);
        /// Whether refusals are written into the key's history.
        record_refusals(on: bool);
        /// Guards JSON-RPC calls (MCP `tools/call`) instead of plain HTTP requests.
        jsonrpc(settings: crate::dialect::jsonrpc::JsonRpc);
        /// Whether a client hanging up cancels the handler (and releases the key).
        cancel_on_disconnect(on: bool);
        /// How long a retry waits for an in-flight first request before answering 409.
        wait_for_in_flight(wait: Duration);
    }

    /// The methods guarded (default `POST` and `PATCH`).
    ///
    /// Sets the layer's default; see [`RouteConfig`].
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods: Vec<Method> = methods.into_iter().collect();
        self.defaults(|route| route.methods(methods))
    }

    /// The header carrying the key (default `Idempotency-Key`).
    pub fn header_name(mut self, name: HeaderName) -> Self {
        self.config_mut().header = name;
        self
    }

    /// Adds a request header to the fingerprint: requests differing in it are different
    /// operations (for example `x-api-version`).
    pub fn fingerprint_header(mut self, name: HeaderName) -> Self {
        // A set: replicas adding the same headers in another order read one request alike.
        let headers = &mut self.config_mut().fingerprint.headers;
        if let Err(at) = headers.binary_search_by(|h| h.as_str().cmp(name.as_str())) {
            headers.insert(at, name);
        }
        self
    }

    /// Fingerprints bodies of `media_type` (for example `application/cbor`) by what
    /// `canonicalizer` returns, instead of their raw bytes. One per media type: the first
    /// registered for a type stands.
    pub fn canonicalize(mut self, media_type: &str, canonicalizer: impl Canonicalize) -> Self {
        let media = crate::fingerprint::media_type(media_type).into_owned();
        // A set by media type: replicas registering the same types in another order read one
        // request alike.
        let custom = &mut self.config_mut().fingerprint.custom;
        if let Err(at) = custom.binary_search_by(|(m, _)| m.as_str().cmp(&media)) {
            custom.insert(at, (media, Arc::new(canonicalizer)));
        }
        self
    }

    /// Never records nor replays this response header (in addition to `Set-Cookie`,
    /// `Authorization`, `WWW-Authenticate`, `Date`, request ids and hop-by-hop headers).
    pub fn deny_header(mut self, name: HeaderName) -> Self {
        self.config_mut().denied_headers.push(name);
        self
    }

    /// Scopes keys by the authenticated principal: the extension of type `T` that your auth
    /// layer puts on the request (the axum way), turned into a scope by `scope`. The principal
    /// outlives any token: a retry sent with a refreshed token still finds its key.
    ///
    /// The auth layer must run before this one; a request without the extension (or with an
    /// empty id) is answered 500 `scope-missing` and nothing runs (see
    /// [`scope`](crate::scope)). Where several kinds of principal share a store, make the ids
    /// distinct (`user:42`, `org:42`).
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// #[derive(Clone)]
    /// struct User {
    ///     id: u64,
    /// }
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .scope_by_principal(|user: &User| user.id.to_string());
    /// ```
    pub fn scope_by_principal<T, F>(self, scope: F) -> IdempotencyLayer<St, ByPrincipal<T, F>>
    where
        T: Send + Sync + 'static,
        F: Fn(&T) -> String + Clone + Send + Sync + 'static,
    {
        self.scope_with(ByPrincipal::new(scope))
    }

    /// Scopes keys by the value of the header `name` (a tenant id, an API key), hashed so a
    /// credential never lands in the store. A request without it (or with it twice) is
    /// answered 500 `scope-missing` and nothing runs: the layer in front that checks the
    /// header must have let it through.
    pub fn scope_by_header(self, name: HeaderName) -> IdempotencyLayer<St, ByHeader> {
        self.scope_with(ByHeader::new(name))
    }

    /// One scope for every caller: for a service with one client, or behind a gateway that
    /// already gives each caller its own service. Two callers sending the same key see each
    /// other's answers, so choose it deliberately.
    pub fn single_tenant(self) -> IdempotencyLayer<St, SingleTenant> {
        self.scope_with(SingleTenant)
    }

    /// Scopes keys by a hash of the `Authorization` header: the credential, not the caller. It
    /// breaks on token rotation (a retry with a refreshed token runs again): see
    /// [`CredentialHash`](crate::scope::CredentialHash). Prefer
    /// [`scope_by_principal`](Self::scope_by_principal).
    pub fn scope_by_credential_hash(self) -> IdempotencyLayer<St, CredentialHash> {
        self.scope_with(CredentialHash)
    }

    /// Computes each request's scope with `make_scope`: a closure returning `String`, or
    /// `Option<String>` where `None` means the request lacks what the scope is made from
    /// (answered 500 `scope-missing`, nothing runs). A closure's empty scope is no scope
    /// either: one that falls back to `""` would otherwise put every such caller in one scope
    /// (keys recorded under such a scope before are answered 500 too, never replayed to
    /// another caller). A `MakeScope` of your own is taken as it answers.
    ///
    /// ```
    /// use http::request::Parts;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// #[derive(Clone)]
    /// struct Tenant(String);
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).scope_with(|parts: &Parts| {
    ///     parts.extensions.get::<Tenant>().map(|t| t.0.clone())
    /// });
    /// ```
    pub fn scope_with<M2: MakeScope>(self, make_scope: M2) -> IdempotencyLayer<St, M2> {
        IdempotencyLayer {
            keeper: self.keeper,
            make_scope,
            config: self.config,
        }
    }

    fn resolve(&self) -> Resolved {
        let c = &self.config;
        let routes: HashMap<_, _> = c
            .overrides
            .iter()
            .map(|(path, f)| {
                // A window of its own: the defaults' clone would share theirs.
                let mut route = f(c.default.clone());
                route.window = Arc::default();
                route.scheme = route.scheme_under(&c.fingerprint);
                (path.clone(), Arc::new(route))
            })
            .collect();
        let mut templates = matchit::Router::new();
        for (path, route) in &routes {
            // `for_path` inserted each into a router like this one already.
            let _ = templates.insert(path.as_str(), route.clone());
        }
        let shapes = routes
            .iter()
            .map(|(path, route)| (crate::settings::shape(path), route.clone()))
            .collect();
        // The defaults too: a layer built from a clone of another shares nothing it measures.
        let mut default = c.default.clone();
        default.window = Arc::default();
        default.scheme = default.scheme_under(&c.fingerprint);
        let mut schemes: Vec<_> = std::iter::once(default.scheme)
            .chain(routes.values().map(|route| route.scheme))
            .collect();
        schemes.sort_unstable();
        schemes.dedup();
        Resolved {
            header: c.header.clone(),
            default: Arc::new(default),
            routes,
            templates,
            shapes,
            schemes,
            fingerprint: c.fingerprint.clone(),
            denied_headers: Arc::new(crate::replay::DeniedHeaders::new(c.denied_headers.clone())),
            woken: crate::woken::WokenReads::default(),
        }
    }
}

impl<St, M> IdempotencyLayer<St, M> {
    /// What each route publishes to its callers: the 99th percentile of its recent executions
    /// (its processing window) and how long its keys are kept, the defaults' first, then each
    /// `for_path` in the order given. Shared by every service this layer made.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new());
    /// for window in layer.processing_windows() {
    ///     // e.g. into an MCP tool's description: the deadline a retry needs, the key's life.
    ///     println!("{:?}: {}", window.route, window.describe());
    /// }
    /// ```
    pub fn processing_windows(&self) -> Vec<crate::window::ProcessingWindow> {
        let resolved = self.resolved();
        let published =
            |route: Option<String>, config: &RouteConfig| crate::window::ProcessingWindow {
                route,
                p99: config.window.p99(),
                executions: config.window.executions(),
                lease: config.lease,
                ttl: config.ttl,
            };
        let mut windows = vec![published(None, &resolved.default)];
        for (path, _) in &self.config.overrides {
            if let Some(route) = resolved.routes.get(path) {
                windows.push(published(Some(path.clone()), route));
            }
        }
        windows
    }

    /// The settings every service of this layer runs with, resolved on first use.
    fn resolved(&self) -> &Arc<Resolved> {
        self.config
            .resolved
            .get_or_init(|| Arc::new(self.resolve()))
    }
}

impl<S, St, M: MakeScope> Layer<S> for IdempotencyLayer<St, M> {
    type Service = Idempotency<S, St, M>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(
            inner,
            self.keeper.clone(),
            self.make_scope.clone(),
            self.resolved().clone(),
        )
    }
}

impl<St, M: Clone> Clone for IdempotencyLayer<St, M> {
    fn clone(&self) -> Self {
        Self {
            keeper: self.keeper.clone(),
            make_scope: self.make_scope.clone(),
            config: self.config.clone(),
        }
    }
}

impl<St: fmt::Debug, M: fmt::Debug> fmt::Debug for IdempotencyLayer<St, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        f.debug_struct("IdempotencyLayer")
            .field("store", self.keeper.store())
            .field("make_scope", &self.make_scope)
            .field("header", &c.header)
            .field("default", &c.default)
            .field(
                "paths",
                &c.overrides.iter().map(|(p, _)| p).collect::<Vec<_>>(),
            )
            .field("fingerprint", &c.fingerprint)
            .finish()
    }
}
