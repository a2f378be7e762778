//! [`Idempotency`]: the pipeline of DESIGN §1, one step after another.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, header};
use http_body::Body;
use http_body_util::BodyExt;
use tower_service::Service;
use tracing::Instrument;

use crate::body::{Gathered, RequestBody, ResponseBody};
use crate::context::IdempotencyContext;
use crate::decide::{Decision, busy, ceil_secs, decide};
use crate::execute::{Execution, ReleaseOnDrop};
use crate::fingerprint::fingerprint_fields;
use crate::future::{ResponseFuture, Step};
use crate::hold::Keeper;
use crate::jsonrpc::{self, JsonRpc};
use crate::key::{KeyError, ScopedKey, parse_key};
use crate::layer::Resolved;
use crate::observe::{self, Event};
use crate::problem::{Problem, ProblemKind, Protocol};
use crate::replay::replay;
use crate::route::RouteConfig;
use crate::scope::MakeScope;
use crate::store::{BoxError, Claim, ClaimRequest, HistoryEvent, IdempotencyStore, StoreError};

/// The middleware service made by [`IdempotencyLayer`](crate::IdempotencyLayer).
///
/// Its inner service receives `Request<RequestBody<B>>` (the buffered body of a guarded
/// request, or the original body of one passed through) and its responses carry a
/// [`ResponseBody`]. Every failure of its own is a response: it never returns an error the
/// inner service did not.
pub struct Idempotency<S, St, M> {
    inner: S,
    keeper: Keeper<St>,
    make_scope: M,
    config: Arc<Resolved>,
}

impl<S, St, M> Idempotency<S, St, M> {
    pub(crate) fn new(inner: S, keeper: Keeper<St>, make_scope: M, config: Arc<Resolved>) -> Self {
        Self {
            inner,
            keeper,
            make_scope,
            config,
        }
    }
}

impl<S, St, M, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S, St, M>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: IdempotencyStore,
    M: MakeScope,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // The ready service goes into the future; the clone stays behind for the next call.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        // The path the client sent, wherever this layer sits (see `crate::uri`).
        let path = crate::uri::sent(req.extensions(), req.uri()).path();
        let route = self
            .config
            .route(path, crate::uri::matched(req.extensions()));
        // An outer idempotency layer already guards this request: one claim per request.
        let nested = req.extensions().get::<IdempotencyContext>().is_some();
        if nested || !route.guards(req.method()) {
            return ResponseFuture::new(pass_through(inner, req.map(RequestBody::passthrough)));
        }
        let span = tracing::info_span!(
            "idempotency",
            method = %req.method(),
            path,
            outcome = tracing::field::Empty,
            attempt = tracing::field::Empty,
        );
        let pipeline = Pipeline {
            span: span.clone(),
            route: route.clone(),
            keeper: self.keeper.clone(),
            make_scope: self.make_scope.clone(),
            config: self.config.clone(),
        };
        let (parts, body) = req.into_parts();
        // The response future enters the span while it polls: one span fewer in the box.
        ResponseFuture::deciding(pipeline.run(inner, parts, body), span)
    }
}

/// One guarded request's trip through DESIGN §1.
struct Pipeline<St, M> {
    span: tracing::Span,
    route: Arc<RouteConfig>,
    keeper: Keeper<St>,
    make_scope: M,
    config: Arc<Resolved>,
}

impl<St: IdempotencyStore, M: MakeScope> Pipeline<St, M> {
    /// Steps 1–6, and the future that runs steps 7–9. Every byte of this future is allocated
    /// per request: what waits across an `.await` is kept small, rare paths are boxed.
    async fn run<S, ReqBody, ResBody>(
        self,
        inner: S,
        parts: http::request::Parts,
        body: ReqBody,
    ) -> Step<ResBody, S::Error>
    where
        S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqBody: Body<Data = Bytes> + Send + 'static,
        ReqBody::Error: Into<BoxError>,
        ResBody: Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        let route = &self.route;

        // 1–4. Key, scope, buffered body and fingerprint, the HTTP way or the JSON-RPC way.
        // A block, so the preparation's result is not kept in this future's state later on.
        let Guarded {
            bytes,
            key,
            fingerprint,
            protocol,
        } = {
            let prepared = match &route.jsonrpc {
                Some(settings) => Box::pin(self.prepare_jsonrpc(&parts, body, settings)).await,
                None => 'http: {
                    // A matched value lives to the end of its `match`: awaiting inside one would
                    // keep it in this future's state, so each `.await` here stands on its own.
                    let (key, protocol) = match self.admit(&parts) {
                        Admitted::Key(key, protocol) => (key, protocol),
                        Admitted::Unguarded => {
                            break 'http Prepared::PassThrough(RequestBody::passthrough(body));
                        }
                        Admitted::Refused(response) => return Step::Answer(Ok(response)),
                    };
                    let buffered = buffer(&parts, body, route.body_limit).await;
                    match buffered {
                        Ok(bytes) => self.fingerprinted(&parts, bytes, key, protocol),
                        Err(problem) => Prepared::Answer(self.refuse_body(problem, &protocol)),
                    }
                }
            };
            match prepared {
                Prepared::Guard(guarded) => guarded,
                Prepared::Answer(response) => return Step::Answer(Ok(response)),
                Prepared::PassThrough(body) => {
                    self.outcome("pass_through");
                    let run = Box::pin(pass_through(inner, Request::from_parts(parts, body)));
                    return Step::Run { run, detach: false };
                }
            }
        };
        // The JSON envelope is for plain JSON callers; gRPC and JSON-RPC keep their framing.
        let envelope = route.envelope && protocol == Protocol::Http;

        // 5–6. Claim, and decide; on routes that wait, an in-flight key is claimed again as
        // its holder finishes, until it replays, runs here (released) or the wait is over.
        let request = ClaimRequest {
            key,
            fingerprint,
            lease: route.lease,
            ttl: route.ttl,
            on_lease_expiry: route.on_lease_expiry,
        };
        let wait_until = route
            .wait_for_in_flight
            .map(|wait| tokio::time::Instant::now() + wait);
        let mut backoff = Duration::from_millis(10);
        let lease = loop {
            // Seen to its end even if this request is dropped meanwhile (see `ClaimToEnd`).
            // A record locked by a transaction is answered at once, and not noted in its
            // history: that write would wait for the same lock.
            let (decision, noted) = match ClaimToEnd::new(self.keeper.store(), &request).await {
                Ok(claim) => (decide(claim, &request.fingerprint), true),
                Err(StoreError::Busy) => (busy(), false),
                Err(error) => {
                    observe::count(Event::StoreError);
                    tracing::error!(%error, "claim failed; refusing to run (fail closed)");
                    self.outcome("store_unavailable");
                    return Step::Answer(Ok(unavailable(route, &protocol)));
                }
            };
            let can_wait =
                wait_until.is_some_and(|until| tokio::time::Instant::now() + backoff < until);
            let noting = match self.next(decision, can_wait, envelope, &protocol) {
                Next::Run(lease) => break lease,
                Next::Wait => None,
                Next::Answer(response, Some(event)) if noted => {
                    Some(Box::pin(self.noted(&request.key, event, response)))
                }
                Next::Answer(response, _) => return Step::Answer(Ok(response)),
            };
            match noting {
                Some(noting) => return Step::Answer(Ok(noting.await)),
                None => {
                    Box::pin(tokio::time::sleep(backoff)).await;
                    backoff = (backoff * 2).min(Duration::from_millis(250));
                }
            }
        };
        self.span.record("attempt", lease.attempt);

        // 7–9. Execute to completion, record, respond.
        self.outcome("executed");
        let mut req = Request::from_parts(parts, RequestBody::buffered(bytes));
        // The key moves on from the claim request: no second copy waits in this future.
        let key = request.key;
        let context = IdempotencyContext::new(key.clone(), &lease, self.keeper.store().clone());
        req.extensions_mut().insert(context);
        let cancel_on_disconnect = route.cancel_on_disconnect;
        let token = lease.token;
        // The pipeline's shared handles move on to the execution: no clone per request.
        let Pipeline {
            keeper,
            route,
            config,
            ..
        } = self;
        let execution = Execution {
            keeper,
            key,
            lease,
            route,
            config,
            protocol,
        };
        if cancel_on_disconnect {
            // The server treats a hang-up as cancellation: give the key back if this future
            // is dropped before the outcome is recorded.
            let guard = ReleaseOnDrop {
                store: Some(execution.keeper.store().clone()),
                key: execution.key.clone(),
                token,
            };
            return Step::Run {
                run: Box::pin(execution.run(inner, req, Some(guard)).in_current_span()),
                detach: false,
            };
        }
        // Run to completion: a client hanging up from here on detaches this future instead
        // of cancelling it.
        Step::Run {
            run: Box::pin(execution.run(inner, req, None).in_current_span()),
            detach: true,
        }
    }
}

/// Hands a request the layer does not guard to the inner service, untouched.
async fn pass_through<S, ReqBody, ResBody>(
    mut inner: S,
    req: Request<RequestBody<ReqBody>>,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
{
    let res = inner.call(req).await?;
    Ok(res.map(ResponseBody::passthrough))
}

type ClaimFuture = std::pin::Pin<Box<dyn Future<Output = Result<Claim, StoreError>> + Send>>;

/// A claim seen to its end even if the request is dropped while it is in flight (a client
/// hanging up during a PostgreSQL round trip): dropped unfinished, it finishes on a task of its
/// own and gives back a key it won, since no handler ever ran under it. Nothing is left in
/// progress, nor awaiting reconciliation, for a request that ran nothing.
struct ClaimToEnd<St: IdempotencyStore> {
    claim: Option<ClaimFuture>,
    store: Arc<St>,
    key: ScopedKey,
}

impl<St: IdempotencyStore> ClaimToEnd<St> {
    fn new(store: &Arc<St>, request: &ClaimRequest) -> Self {
        let (owned, key) = (store.clone(), request.key.clone());
        let request = request.clone();
        Self {
            claim: Some(Box::pin(async move { owned.claim(&request).await })),
            store: store.clone(),
            key,
        }
    }
}

impl<St: IdempotencyStore> Future for ClaimToEnd<St> {
    type Output = Result<Claim, StoreError>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(claim) = self.claim.as_mut() else {
            // Polled after it finished: a caller bug that must not panic in a server.
            return Poll::Pending;
        };
        let out = std::task::ready!(claim.as_mut().poll(cx));
        self.claim = None;
        Poll::Ready(out)
    }
}

impl<St: IdempotencyStore> Drop for ClaimToEnd<St> {
    fn drop(&mut self) {
        let Some(claim) = self.claim.take() else {
            return;
        };
        let (store, key) = (self.store.clone(), self.key.clone());
        // Without a runtime (shutting down) a won claim's lease runs out instead.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Ok(Claim::Acquired(lease)) = claim.await {
                    observe::count(Event::Release);
                    if let Err(error) = store.release(&key, lease.token).await {
                        tracing::warn!(%error, "could not give back a claim nobody ran under");
                    }
                }
            });
        }
    }
}

/// A request the pipeline guards, after steps 1–4.
struct Guarded {
    bytes: Bytes,
    key: ScopedKey,
    fingerprint: crate::fingerprint::Fingerprint,
    protocol: Protocol,
}

/// What steps 1–2 decided for an HTTP or gRPC request.
enum Admitted<ResBody> {
    Key(ScopedKey, Protocol),
    /// No key, on a route that lets such requests through.
    Unguarded,
    Refused(Response<ResponseBody<ResBody>>),
}

/// What step 6 decided, for the pipeline to act on: nothing of the decision itself is kept
/// while the pipeline waits.
#[expect(
    clippy::large_enum_variant,
    reason = "a value moved once, right away; boxing would allocate for every replay"
)]
enum Next<ResBody> {
    Run(crate::store::Lease),
    /// In flight, on a route that waits for it: claim again after a pause.
    Wait,
    /// The answer, and what to write into the key's history first (routes that ask).
    Answer(Response<ResponseBody<ResBody>>, Option<HistoryEvent>),
}

/// What steps 1–4 decided.
enum Prepared<B, ResBody> {
    Guard(Guarded),
    Answer(Response<ResponseBody<ResBody>>),
    PassThrough(RequestBody<B>),
}

impl<St: IdempotencyStore, M: MakeScope> Pipeline<St, M> {
    /// Steps 1–2 for HTTP and gRPC: the key from its header, in its scope; `None` when the
    /// request has no key and the route lets it through unguarded.
    fn admit<ResBody>(&self, parts: &http::request::Parts) -> Admitted<ResBody> {
        let protocol = Protocol::of(&parts.headers);
        // 1. Key.
        let key = match parse_key(&parts.headers, &self.config.header) {
            Ok(Some(key)) => key,
            Ok(None) if !self.route.require_key => return Admitted::Unguarded,
            Ok(None) => return Admitted::Refused(self.refuse_key(&KeyError::Missing, &protocol)),
            Err(error) => return Admitted::Refused(self.refuse_key(&error, &protocol)),
        };
        observe::count(Event::Attempt);
        // 2. Scope.
        match self.make_scope.make_scope(parts) {
            Ok(scope) => Admitted::Key(ScopedKey::new(scope, key), protocol),
            Err(missing) => Admitted::Refused(self.refuse_scope(&missing, &protocol)),
        }
    }

    /// Step 4 for HTTP and gRPC, once step 3 buffered the body.
    fn fingerprinted<B, ResBody>(
        &self,
        parts: &http::request::Parts,
        bytes: Bytes,
        key: ScopedKey,
        protocol: Protocol,
    ) -> Prepared<B, ResBody> {
        let fields = self.route.json_fields.as_deref();
        match fingerprint_fields(parts, &bytes, &self.config.fingerprint, fields) {
            Ok(fingerprint) => Prepared::Guard(Guarded {
                bytes,
                key,
                fingerprint,
                protocol,
            }),
            Err(error) => {
                let kind = match error.panicked() {
                    true => ProblemKind::FingerprintFailed,
                    false => ProblemKind::BodyMalformed,
                };
                let problem = Problem::new(kind, error.to_string());
                Prepared::Answer(self.refuse_body(problem, &protocol))
            }
        }
    }

    /// Steps 1–4 for JSON-RPC: the body first (the method decides what is guarded), then the
    /// key from the header or `params._meta`, the scope plus the method, and a fingerprint of
    /// method and params that ignores the `id` (see [`crate::jsonrpc`]).
    async fn prepare_jsonrpc<B, ResBody>(
        &self,
        parts: &http::request::Parts,
        body: B,
        settings: &JsonRpc,
    ) -> Prepared<B, ResBody>
    where
        B: Body<Data = Bytes>,
        B::Error: Into<BoxError>,
    {
        // A request with no key header, on a route that reads no `_meta` keys, cannot ask for
        // a guarantee: whatever it is (a big `tools/list`, a batch), it passes unread. Any
        // other is read to its end, within the body limit: a key may sit anywhere in it.
        let keyed = parts.headers.contains_key(&self.config.header);
        if !keyed && settings.meta_key.is_none() {
            return Prepared::PassThrough(RequestBody::passthrough(body));
        }
        let bytes = match buffer(parts, body, self.route.body_limit).await {
            Ok(bytes) => bytes,
            Err(problem) => return Prepared::Answer(self.refuse_body(problem, &Protocol::Http)),
        };
        let mcp_method = parts
            .headers
            .get(&jsonrpc::MCP_METHOD)
            .and_then(|v| v.to_str().ok());
        // An invalid header key is refused as in HTTP mode, with a JSON-RPC error.
        let header_key = match parse_key(&parts.headers, &self.config.header) {
            Ok(key) => key,
            Err(error) => {
                let id = Arc::new(jsonrpc::Id::null());
                return Prepared::Answer(self.refuse_key(&error, &Protocol::JsonRpc(id)));
            }
        };
        let call = match jsonrpc::parse(&bytes, settings, header_key.as_deref(), mcp_method) {
            jsonrpc::Parsed::Guard(call) => call,
            jsonrpc::Parsed::PassThrough => {
                return Prepared::PassThrough(RequestBody::buffered(bytes));
            }
            jsonrpc::Parsed::Refuse(problem, id) => {
                return Prepared::Answer(self.refuse_body(problem, &Protocol::JsonRpc(id)));
            }
        };
        let protocol = Protocol::JsonRpc(call.id.clone());
        // The header and `_meta` agree when both are there (`parse` refuses otherwise).
        let Some(key) = header_key.map(|k| k.into_owned()).or(call.meta_key.clone()) else {
            return Prepared::PassThrough(RequestBody::buffered(bytes));
        };
        observe::count(Event::Attempt);
        let scope = match self.make_scope.make_scope(parts) {
            Ok(scope) => scope,
            Err(missing) => return Prepared::Answer(self.refuse_scope(&missing, &protocol)),
        };
        // The method joins the scope: a key names one operation of one tool method.
        let scope = format!("{scope}\u{0}{}", call.method);
        let fingerprint = match jsonrpc::fingerprint(parts, &call, &self.config.fingerprint) {
            Ok(fingerprint) => fingerprint,
            Err(error) => {
                let problem = Problem::new(ProblemKind::BodyMalformed, error.to_string());
                return Prepared::Answer(self.refuse_body(problem, &protocol));
            }
        };
        Prepared::Guard(Guarded {
            bytes,
            key: ScopedKey::new(scope, key),
            fingerprint,
            protocol,
        })
    }
}

impl<St, M> Pipeline<St, M> {
    fn outcome(&self, name: &str) {
        self.span.record("outcome", name);
    }
}

impl<St, M> Pipeline<St, M> {
    /// Step 6 turned into what to do: run, wait, or answer (a replay or a refusal).
    fn next<B>(
        &self,
        decision: Decision,
        can_wait: bool,
        envelope: bool,
        protocol: &Protocol,
    ) -> Next<B> {
        let note = |event| self.route.record_refusals.then_some(event);
        match decision {
            Decision::Run(lease) => Next::Run(lease),
            Decision::Refuse(problem) if can_wait && problem.kind == ProblemKind::InFlight => {
                Next::Wait
            }
            Decision::Replay(stored) => {
                self.outcome("replayed");
                let mark = self
                    .route
                    .jsonrpc
                    .as_ref()
                    .is_some_and(|j| j.mark_replay_in_meta);
                let response = replay(stored, envelope, mark, protocol);
                Next::Answer(response, note(HistoryEvent::Replayed))
            }
            Decision::Refuse(problem) => {
                self.outcome(problem.kind.slug());
                let event = match problem.kind {
                    ProblemKind::FingerprintMismatch => HistoryEvent::Mismatch,
                    ProblemKind::InFlight => HistoryEvent::Conflict,
                    ProblemKind::OutcomeUnknown => HistoryEvent::OutcomeUnknown,
                    _ => HistoryEvent::Replayed,
                };
                Next::Answer(problem.respond(protocol), note(event))
            }
        }
    }
}

impl<St: IdempotencyStore, M> Pipeline<St, M> {
    /// Writes what this request was told into the key's history (routes that ask for it),
    /// then hands the answer back.
    async fn noted<B>(
        &self,
        key: &ScopedKey,
        event: HistoryEvent,
        response: Response<ResponseBody<B>>,
    ) -> Response<ResponseBody<B>> {
        if let Err(error) = self.keeper.store().append_history(key, event).await {
            // The answer stands; only its trace in the history is missing.
            observe::count(Event::StoreError);
            tracing::warn!(%error, "could not write the refusal into the key's history");
        }
        response
    }
}

/// Step 3: the whole body, or why not. Nothing is claimed before this succeeds.
async fn buffer<B>(parts: &http::request::Parts, body: B, limit: usize) -> Result<Bytes, Problem>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let too_large = || {
        Problem::new(
            ProblemKind::BodyTooLarge,
            format!("the request body is larger than this endpoint's limit of {limit} bytes"),
        )
    };
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(too_large());
    }
    let mut body = std::pin::pin!(body);
    let mut data = Gathered::default();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| {
            Problem::new(
                ProblemKind::BodyUnreadable,
                format!("the request body could not be read: {}", error.into()),
            )
        })?;
        if let Ok(chunk) = frame.into_data() {
            if data.len() + chunk.len() > limit {
                return Err(too_large());
            }
            data.push(chunk);
        }
    }
    Ok(data.freeze())
}

impl<St, M> Pipeline<St, M> {
    fn refuse_key<B>(&self, error: &KeyError, protocol: &Protocol) -> Response<ResponseBody<B>> {
        observe::count(Event::KeyRejected);
        let kind = match error {
            KeyError::Missing => ProblemKind::KeyMissing,
            _ => ProblemKind::KeyInvalid,
        };
        self.outcome(kind.slug());
        Problem::new(kind, error.to_string()).respond(protocol)
    }

    /// The app is wired wrong: the server's fault, logged as such, and nothing runs.
    fn refuse_scope<B>(
        &self,
        missing: &crate::scope::MissingScope,
        protocol: &Protocol,
    ) -> Response<ResponseBody<B>> {
        tracing::error!(%missing, "misconfiguration: the request has no scope");
        self.outcome(ProblemKind::ScopeMissing.slug());
        Problem::new(ProblemKind::ScopeMissing, missing.to_string()).respond(protocol)
    }

    fn refuse_body<B>(&self, problem: Problem, protocol: &Protocol) -> Response<ResponseBody<B>> {
        observe::count(Event::BodyRejected);
        self.outcome(problem.kind.slug());
        problem.respond(protocol)
    }
}

fn unavailable<B>(route: &RouteConfig, protocol: &Protocol) -> Response<ResponseBody<B>> {
    Problem::new(
        ProblemKind::StoreUnavailable,
        "the idempotency store is unavailable, so the request was not run; retry with the same key",
    )
    .state("unknown")
    .retry_after(ceil_secs(route.unavailable_retry_after))
    .respond(protocol)
}

impl<S: Clone, St, M: Clone> Clone for Idempotency<S, St, M> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            keeper: self.keeper.clone(),
            make_scope: self.make_scope.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: fmt::Debug, St: fmt::Debug, M: fmt::Debug> fmt::Debug for Idempotency<S, St, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("store", self.keeper.store())
            .field("make_scope", &self.make_scope)
            .field("config", &self.config)
            .finish()
    }
}
