//! [`Idempotency`]: the pipeline of DESIGN §1, one step after another.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
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
use crate::decide::{Decision, ceil_secs, decide};
use crate::execute::Execution;
use crate::fingerprint::fingerprint;
use crate::future::ResponseFuture;
use crate::jsonrpc::{self, JsonRpc};
use crate::key::{DefaultScope, KeyError, MakeScope, ScopedKey, parse_key};
use crate::layer::Resolved;
use crate::observe::{self, Event};
use crate::problem::{Problem, ProblemKind, Protocol};
use crate::replay::replay;
use crate::route::RouteConfig;
use crate::store::{BoxError, ClaimRequest, HistoryEvent, IdempotencyStore};

/// The middleware service made by [`IdempotencyLayer`](crate::IdempotencyLayer).
///
/// Its inner service receives `Request<RequestBody<B>>` (the buffered body of a guarded
/// request, or the original body of one passed through) and its responses carry a
/// [`ResponseBody`]. Every failure of its own is a response: it never returns an error the
/// inner service did not.
pub struct Idempotency<S, St, M = DefaultScope> {
    inner: S,
    store: Arc<St>,
    make_scope: M,
    config: Arc<Resolved>,
}

impl<S, St, M> Idempotency<S, St, M> {
    pub(crate) fn new(inner: S, store: Arc<St>, make_scope: M, config: Arc<Resolved>) -> Self {
        Self {
            inner,
            store,
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
        let route = self.config.route(req.uri().path());
        // An outer idempotency layer already guards this request: one claim per request.
        let nested = req.extensions().get::<IdempotencyContext>().is_some();
        if nested || !route.guards(req.method()) {
            return ResponseFuture::new(pass_through(inner, req.map(RequestBody::passthrough)));
        }
        let span = tracing::info_span!(
            "idempotency",
            method = %req.method(),
            path = req.uri().path(),
            outcome = tracing::field::Empty,
            attempt = tracing::field::Empty,
        );
        let started = Arc::new(AtomicBool::new(false));
        let pipeline = Pipeline {
            span: span.clone(),
            route: route.clone(),
            store: self.store.clone(),
            make_scope: self.make_scope.clone(),
            config: self.config.clone(),
            started: started.clone(),
        };
        ResponseFuture::detachable(pipeline.run(inner, req).instrument(span), started)
    }
}

/// One guarded request's trip through DESIGN §1.
struct Pipeline<St, M> {
    span: tracing::Span,
    route: Arc<RouteConfig>,
    store: Arc<St>,
    make_scope: M,
    config: Arc<Resolved>,
    /// Set when the inner service begins: from then on, a dropped response future hands this
    /// one to a task of its own (see [`ResponseFuture`]) instead of cancelling it.
    started: Arc<AtomicBool>,
}

impl<St: IdempotencyStore, M: MakeScope> Pipeline<St, M> {
    async fn run<S, ReqBody, ResBody>(
        self,
        inner: S,
        req: Request<ReqBody>,
    ) -> Result<Response<ResponseBody<ResBody>>, S::Error>
    where
        S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqBody: Body<Data = Bytes> + Send + 'static,
        ReqBody::Error: Into<BoxError>,
        ResBody: Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        let route = self.route.clone();

        // 1–4. Key, scope, buffered body and fingerprint, the HTTP way or the JSON-RPC way.
        // Rarer paths are boxed: every byte of this future is allocated and moved per request.
        let prepared = match &route.jsonrpc {
            Some(settings) => Box::pin(self.prepare_jsonrpc(req, settings)).await,
            None => {
                // Inline rather than a nested future: a nested one would hold the request twice.
                let (parts, body) = req.into_parts();
                match self.admit(&parts) {
                    Admitted::Key(key, protocol) => {
                        match buffer(&parts, body, route.body_limit).await {
                            Ok(bytes) => self.fingerprinted(parts, bytes, key, protocol),
                            Err(problem) => Prepared::Answer(self.refuse_body(problem, &protocol)),
                        }
                    }
                    Admitted::Unguarded => Prepared::PassThrough(Request::from_parts(
                        parts,
                        RequestBody::passthrough(body),
                    )),
                    Admitted::Refused(response) => Prepared::Answer(response),
                }
            }
        };
        let Guarded {
            parts,
            bytes,
            key,
            fingerprint,
            protocol,
        } = match prepared {
            Prepared::Guard(guarded) => guarded,
            Prepared::Answer(response) => return Ok(response),
            Prepared::PassThrough(req) => {
                self.outcome("pass_through");
                return pass_through(inner, req).await;
            }
        };
        // The JSON envelope is for plain JSON callers; gRPC and JSON-RPC keep their framing.
        let envelope = route.envelope && protocol == Protocol::Http;

        // 5–6. Claim, and decide; on routes that wait, an in-flight key is claimed again as
        // its holder finishes, until it replays, runs here (released) or the wait is over.
        let request = ClaimRequest {
            key: key.clone(),
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
            let claim = match self.store.claim(&request).await {
                Ok(claim) => claim,
                Err(error) => {
                    observe::count(Event::StoreError);
                    tracing::error!(%error, "claim failed; refusing to run (fail closed)");
                    self.outcome("store_unavailable");
                    return Ok(unavailable(&route, &protocol));
                }
            };
            let decision = decide(claim, &fingerprint);
            if let (Decision::Refuse(problem), Some(until)) = (&decision, wait_until)
                && problem.kind == ProblemKind::InFlight
                && tokio::time::Instant::now() + backoff < until
            {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(250));
                continue;
            }
            if route.record_refusals {
                Box::pin(self.note_refusal(&key, &decision)).await;
            }
            match decision {
                Decision::Run(lease) => break lease,
                Decision::Replay(stored) => {
                    self.outcome("replayed");
                    let mark = route
                        .jsonrpc
                        .as_ref()
                        .is_some_and(|j| j.mark_replay_in_meta);
                    return Ok(replay(stored, envelope, mark, &protocol));
                }
                Decision::Refuse(problem) => {
                    self.outcome(problem.kind.slug());
                    return Ok(problem.respond(&protocol));
                }
            }
        };
        self.span.record("attempt", lease.attempt);

        // 7–9. Execute to completion, record, respond.
        self.outcome("executed");
        // Built in a block, so its parts are not kept beside the future they move into.
        let (work, guard) = {
            let mut req = Request::from_parts(parts, RequestBody::buffered(bytes));
            let context = IdempotencyContext::new(key.clone(), &lease, self.store.clone());
            req.extensions_mut().insert(context);
            // Routes that treat a hang-up as cancellation give the key back if dropped.
            let guard = route.cancel_on_disconnect.then(|| ReleaseOnDrop {
                store: Some(self.store.clone()),
                key: key.clone(),
                token: lease.token,
            });
            let execution = Execution {
                store: self.store.clone(),
                key,
                lease,
                route,
                denied_headers: self.config.denied_headers.clone(),
                protocol,
            };
            (execution.run(inner, req), guard)
        };
        if guard.is_none() {
            // Run to completion: from here on, a client hanging up detaches this future
            // instead of cancelling it.
            self.started.store(true, Ordering::Release);
        }
        let answer = work.await;
        if let Some(guard) = guard {
            guard.disarm();
        }
        answer
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

/// Releases a claim whose execution was dropped unfinished (routes that cancel on disconnect).
struct ReleaseOnDrop<St: IdempotencyStore> {
    store: Option<Arc<St>>,
    key: ScopedKey,
    token: crate::store::FencingToken,
}

impl<St: IdempotencyStore> ReleaseOnDrop<St> {
    fn disarm(mut self) {
        self.store = None;
    }
}

impl<St: IdempotencyStore> Drop for ReleaseOnDrop<St> {
    fn drop(&mut self) {
        let Some(store) = self.store.take() else {
            return;
        };
        let (key, token) = (self.key.clone(), self.token);
        // Without a runtime (shutting down) the lease simply runs out instead.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                observe::count(Event::Release);
                if let Err(error) = store.release(&key, token).await {
                    tracing::warn!(%error, "could not release a cancelled execution's key");
                }
            });
        }
    }
}

/// A request the pipeline guards, after steps 1–4.
struct Guarded {
    parts: http::request::Parts,
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

/// What steps 1–4 decided.
enum Prepared<B, ResBody> {
    Guard(Guarded),
    Answer(Response<ResponseBody<ResBody>>),
    PassThrough(Request<RequestBody<B>>),
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
        let key = ScopedKey::new(self.make_scope.make_scope(parts), key);
        Admitted::Key(key, protocol)
    }

    /// Step 4 for HTTP and gRPC, once step 3 buffered the body.
    fn fingerprinted<B, ResBody>(
        &self,
        parts: http::request::Parts,
        bytes: Bytes,
        key: ScopedKey,
        protocol: Protocol,
    ) -> Prepared<B, ResBody> {
        match fingerprint(&parts, &bytes, &self.config.fingerprint) {
            Ok(fingerprint) => Prepared::Guard(Guarded {
                parts,
                bytes,
                key,
                fingerprint,
                protocol,
            }),
            Err(error) => {
                let problem = Problem::new(ProblemKind::BodyMalformed, error.to_string());
                Prepared::Answer(self.refuse_body(problem, &protocol))
            }
        }
    }

    /// Steps 1–4 for JSON-RPC: the body first (the method decides what is guarded), then the
    /// key from the header or `params._meta`, the scope plus the method, and a fingerprint of
    /// method and params that ignores the `id` (see [`crate::jsonrpc`]).
    async fn prepare_jsonrpc<B, ResBody>(
        &self,
        req: Request<B>,
        settings: &JsonRpc,
    ) -> Prepared<B, ResBody>
    where
        B: Body<Data = Bytes>,
        B::Error: Into<BoxError>,
    {
        let (parts, body) = req.into_parts();
        let bytes = match buffer(&parts, body, self.route.body_limit).await {
            Ok(bytes) => bytes,
            Err(problem) => return Prepared::Answer(self.refuse_body(problem, &Protocol::Http)),
        };
        let Some(call) = jsonrpc::parse(&bytes, settings) else {
            let req = Request::from_parts(parts, RequestBody::buffered(bytes));
            return Prepared::PassThrough(req);
        };
        let protocol = Protocol::JsonRpc(call.id.clone());
        let key = match parse_key(&parts.headers, &self.config.header) {
            Ok(Some(key)) => key.into_owned(),
            Ok(None) => match call.meta_key.clone() {
                Some(key) if !key.is_empty() && key.len() <= crate::key::MAX_KEY_LEN => key,
                Some(_) => return Prepared::Answer(self.refuse_key(&KeyError::TooLong, &protocol)),
                None => {
                    let req = Request::from_parts(parts, RequestBody::buffered(bytes));
                    return Prepared::PassThrough(req);
                }
            },
            Err(error) => return Prepared::Answer(self.refuse_key(&error, &protocol)),
        };
        observe::count(Event::Attempt);
        // The method joins the scope: a key names one operation of one tool method.
        let scope = format!("{}\u{0}{}", self.make_scope.make_scope(&parts), call.method);
        let fingerprint = jsonrpc::fingerprint(&parts, &call);
        Prepared::Guard(Guarded {
            parts,
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

impl<St: IdempotencyStore, M> Pipeline<St, M> {
    /// Writes what this request was told into the key's history (routes that ask for it).
    async fn note_refusal(&self, key: &ScopedKey, decision: &Decision) {
        let event = match decision {
            Decision::Run(_) => return,
            Decision::Replay(_) => HistoryEvent::Replayed,
            Decision::Refuse(problem) => match problem.kind {
                ProblemKind::FingerprintMismatch => HistoryEvent::Mismatch,
                ProblemKind::InFlight => HistoryEvent::Conflict,
                ProblemKind::OutcomeUnknown => HistoryEvent::OutcomeUnknown,
                _ => HistoryEvent::Replayed,
            },
        };
        if let Err(error) = self.store.append_history(key, event).await {
            // The answer stands; only its trace in the history is missing.
            observe::count(Event::StoreError);
            tracing::warn!(%error, "could not write the refusal into the key's history");
        }
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
            store: self.store.clone(),
            make_scope: self.make_scope.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: fmt::Debug, St: fmt::Debug, M: fmt::Debug> fmt::Debug for Idempotency<S, St, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("store", &self.store)
            .field("make_scope", &self.make_scope)
            .field("config", &self.config)
            .finish()
    }
}
