//! [`Idempotency`]: the pipeline of DESIGN §1, one step after another.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use crate::body::{RequestBody, ResponseBody};
use crate::context::IdempotencyContext;
use crate::decide::{Decision, busy, ceil_secs, decide};
use crate::dialect::grpc::read_unary;
use crate::dialect::http::{Admitted, Reading, buffer, refuse_body};
use crate::dialect::{self, Dialect, Head, Refusal};
use crate::execute::{Execution, ReleaseOnDrop};
use crate::future::{ResponseFuture, Step};
use crate::hold::Keeper;
use crate::key::ScopedKey;
use crate::observe::{self, Event};
use crate::problem::{Problem, ProblemKind};
use crate::route::RouteConfig;
use crate::scope::MakeScope;
use crate::settings::Resolved;
use crate::store::{
    BoxError, ClaimRequest, FencingToken, HistoryEvent, IdempotencyStore, RecordStatus, StoreError,
};

mod claim;

use claim::{ClaimToEnd, Confirmed, claim_now_adopting, confirm, in_time, wait_to_claim};

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
        if !route.guards(req.method()) {
            if let Some(problem) = head_of_guarded_get(route, &self.config.header, &req) {
                observe::count(Event::KeyRejected);
                let refused = Dialect::of(req.headers()).refuse(&problem);
                return ResponseFuture::new(std::future::ready(Ok(refused)));
            }
            return ResponseFuture::new(pass_through(inner, req.map(RequestBody::passthrough)));
        }
        // An outer idempotency layer already guards this request: one claim per request, if
        // under this layer's scope too.
        if req.extensions().get::<IdempotencyContext>().is_some() {
            let (parts, body) = req.into_parts();
            let outer = parts.extensions.get::<IdempotencyContext>();
            let outer = outer.map_or("", IdempotencyContext::scope);
            let methods = route
                .jsonrpc
                .as_deref()
                .map(|settings| &settings.methods[..]);
            if let Some(problem) = scope_conflict(outer, &self.make_scope, methods, &parts) {
                let dialect = match route.jsonrpc {
                    Some(_) => Dialect::JsonRpc(Arc::new(dialect::jsonrpc::Id::null())),
                    None => Dialect::of(&parts.headers),
                };
                return ResponseFuture::new(std::future::ready(Ok(dialect.refuse(&problem))));
            }
            let req = Request::from_parts(parts, RequestBody::passthrough(body));
            return ResponseFuture::new(pass_through(inner, req));
        }
        let span = if crate::observe::spans_heard() {
            tracing::info_span!(
                "idempotency",
                method = %req.method(),
                path,
                outcome = tracing::field::Empty,
                attempt = tracing::field::Empty,
            )
        } else {
            tracing::Span::none()
        };
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

/// Why a request an outer layer guards under the scope `outer` may not run under this layer's
/// `make_scope`, if it may not. Nested layers with different scopes are a wiring mistake
/// that could replay one caller's answer to another: an app-wide layer scoped to one tenant
/// over a route layer scoped by principal keeps the outer's claim, so the route's isolation
/// would silently not apply. On a JSON-RPC route (its guarded `methods`) the scope goes on
/// with the call's method (`scope\0method`); elsewhere the two are one text.
fn scope_conflict<M: MakeScope>(
    outer: &str,
    make_scope: &M,
    methods: Option<&[String]>,
    parts: &http::request::Parts,
) -> Option<Problem> {
    let agrees = |inner: &str| match methods {
        None => outer == inner,
        Some(methods) => outer
            .strip_prefix(inner)
            .and_then(|rest| rest.strip_prefix('\0'))
            .is_some_and(|method| methods.iter().any(|m| m == method)),
    };
    let detail = match make_scope.make_scope(parts) {
        Ok(inner) if agrees(&inner) => return None,
        Ok(_) => "two idempotency layers guard this request under different scopes, and only \
                  the outer one claims its key: give them one scope, or guard the route with \
                  one layer; nothing was run"
            .to_owned(),
        Err(missing) => format!(
            "an outer idempotency layer guards this request, but this layer's scope is \
             missing: {missing}; nothing was run"
        ),
    };
    tracing::error!(%detail, "misconfiguration: nested idempotency layers disagree");
    Some(Problem::new(ProblemKind::ScopeMissing, detail))
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
    ///
    /// A function returning an `async` block, not an `async fn`: an `async fn` keeps its
    /// arguments twice in its state (as captured and as locals), and the request's head alone
    /// is 224 bytes. Kept under glibc's per-thread cache size (1 032 bytes), the box this
    /// future goes into is allocated and freed from the cache.
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn's future keeps its arguments twice (see above)"
    )]
    fn run<S, ReqBody, ResBody>(
        self,
        inner: S,
        parts: http::request::Parts,
        body: ReqBody,
    ) -> impl Future<Output = Step<ResBody, S::Error>> + Send + 'static
    where
        S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqBody: Body<Data = Bytes> + Send + 'static,
        ReqBody::Error: Into<BoxError>,
        ResBody: Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        async move {
            let route = &self.route;

            // 1–4. Key and scope from the head, the whole body, then the fingerprint, as the
            // route's dialect reads them. Each `.await` stands on its own, outside any `match`: a
            // matched value lives to the end of its `match` and would stay in this future's state.
            let pending = match dialect::head(&self.reading(), route.jsonrpc.as_deref(), &parts) {
                Head::Read(pending) => pending,
                Head::PassThrough => {
                    self.outcome("pass_through");
                    let req = Request::from_parts(parts, RequestBody::passthrough(body));
                    return Step::Run {
                        run: Box::pin(pass_through(inner, req)),
                        detach: false,
                    };
                }
                Head::Refuse(refusal) => return Step::Answer(Ok(self.refuse(refusal))),
            };
            // A block, so the read's result is not kept in this future's state later on.
            let (bytes, trailers) = {
                // A gRPC call is read message by message: a guarded method must be unary, and a
                // streaming call is refused rather than buffered until a client that waits for a
                // reply gives up (never a hang).
                let buffered = match pending.reads_one_message() {
                    true => {
                        let text = crate::dialect::grpc_web::is_text(&parts.headers);
                        Box::pin(read_unary(body, route.body_limit, text)).await
                    }
                    false => buffer(&parts, body, route.body_limit).await,
                };
                match buffered {
                    Ok(read) => read,
                    Err(problem) => {
                        let refusal = refuse_body(problem, pending.dialect());
                        let keys = match (pending.key(), route.jsonrpc.as_deref()) {
                            (Some(key), _) => vec![key.clone()],
                            (None, Some(settings)) => dialect::jsonrpc::unread_call_keys(
                                &self.reading(),
                                settings,
                                &parts,
                            ),
                            (None, None) => Vec::new(),
                        };
                        if keys.is_empty() {
                            return Step::Answer(Ok(self.refuse(refusal)));
                        }
                        return self.telling(keys, refusal);
                    }
                }
            };
            // A retry of a finished request is answered from a read: its record's fingerprint
            // first, for its hint (see `IdempotencyStore::recorded_fingerprint_now`), so that a
            // body hashed as sent and sent again byte for byte is recognised unread. A block, so
            // that nothing of the reads stays in this future's state.
            let (key, fingerprint, dialect) = {
                let store = self.keeper.store();
                let recorded = pending
                    .key()
                    .and_then(|key| store.recorded_fingerprint_now(key));
                let admitted = match dialect::admit(
                    &self.reading(),
                    route.jsonrpc.as_deref(),
                    &parts,
                    trailers.as_deref(),
                    &bytes,
                    pending,
                    recorded.as_ref(),
                ) {
                    Admitted::Guard {
                        key,
                        fingerprint,
                        reply,
                    } => (key, fingerprint, reply),
                    Admitted::PassThrough => {
                        self.outcome("pass_through");
                        let req =
                            Request::from_parts(parts, RequestBody::buffered(bytes, trailers));
                        return Step::Run {
                            run: Box::pin(pass_through(inner, req)),
                            detach: false,
                        };
                    }
                    Admitted::Refuse(refusal) => return Step::Answer(Ok(self.refuse(refusal))),
                    Admitted::RefuseKeyed(refusal, key) => {
                        return self.telling(vec![key], refusal);
                    }
                };
                // 5–6 for a completed record: read again, now that the request is fingerprinted
                // (it may have expired meanwhile), in place of a claim that would change
                // nothing; answered (replayed, or refused on a mismatch), never run nor waited
                // on. A read that finds nothing, or fails, is left to the claim.
                let (key, fingerprint, dialect) = &admitted;
                if recorded.is_some()
                    && let Some(Ok(claim)) = store.completed_now(key)
                {
                    let window = route.window.p99();
                    let schemes = &self.config.schemes;
                    let decision = decide(claim, fingerprint, dialect.covers(), window, schemes);
                    match self.next(decision, false, dialect, &parts.headers) {
                        // Noted on a future of its own: one more `.await` here would lay out
                        // this future's state again, larger.
                        Next::Answer(response, Some(event)) => {
                            let key = admitted.0;
                            let noting = async move { Ok(self.noted(&key, event, response).await) };
                            return Step::Run {
                                run: Box::pin(noting),
                                detach: false,
                            };
                        }
                        Next::Answer(response, None) => return Step::Answer(Ok(response)),
                        // Not from a completed record: claim as usual.
                        Next::Run(_) | Next::Wait(_) => {}
                    }
                }
                admitted
            };

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
            let mut round = 0u32;
            // When the last claim that went to the store was sent (see `confirm`).
            let mut asked = None;
            // The holder seen before a wait for a change that came back before its round's
            // polling pause (see below).
            let mut early: Option<FencingToken> = None;
            let lease = loop {
                // Seen to its end even if this request is dropped meanwhile (see `ClaimToEnd`).
                // A record locked by a transaction is answered at once, and not noted in its
                // history: that write would wait for the same lock.
                // After a wait, a claim is what a recorded outcome needs least: read it first.
                let claimed = 'claim: {
                    // A store that claims at once (in process, `IdempotencyStore::claim_now`) is
                    // asked first: nothing can drop such a claim midway, so it needs no guard.
                    // Its answer is a temporary of the `if let`, so it takes no room in this
                    // future's state while an in-flight claim is awaited below.
                    if round == 0
                        && let Some(made) = claim_now_adopting(&**self.keeper.store(), &request)
                    {
                        break 'claim made;
                    }
                    asked = Some(tokio::time::Instant::now());
                    let woken = (round > 0).then(|| self.config.clone());
                    ClaimToEnd::new(self.keeper.store(), &request, woken).await
                };
                let (decision, noted) = match claimed {
                    Ok(claim) => {
                        let window = route.window.p99();
                        let decided = decide(
                            claim,
                            &request.fingerprint,
                            dialect.covers(),
                            window,
                            &self.config.schemes,
                        );
                        (decided, true)
                    }
                    Err(StoreError::Busy) => (busy(), false),
                    Err(error) => {
                        observe::count(Event::StoreError);
                        tracing::error!(%error, "claim failed; refusing to run (fail closed)");
                        self.outcome("store_unavailable");
                        return Step::Answer(Ok(unavailable(route, &dialect)));
                    }
                };
                let can_wait = wait_until.is_some_and(|until| tokio::time::Instant::now() < until);
                let mut seen = None;
                let mut late = None;
                let noting = match self.next(decision, can_wait, &dialect, &parts.headers) {
                    // A claim that took half its lease to come back may have lapsed meanwhile,
                    // and another request may hold the key and run: confirmed first, below.
                    Next::Run(lease) => match asked {
                        Some(sent) if !in_time(sent, route.lease) => {
                            late = Some((lease.token, lease.attempt));
                            None
                        }
                        _ => break lease,
                    },
                    Next::Wait(in_flight) => {
                        seen = in_flight;
                        None
                    }
                    Next::Answer(response, Some(event)) if noted => {
                        Some(Box::pin(self.noted(&request.key, event, response)))
                    }
                    Next::Answer(response, _) => return Step::Answer(Ok(response)),
                };
                // Run only under a lease the store confirms is still this request's (fenced),
                // with time left. Awaited outside the `match` above, which would keep its
                // value in this future's state.
                if let Some((token, attempt)) = late {
                    let (store, key) = (self.keeper.store().clone(), request.key.clone());
                    match Box::pin(confirm(store, key, token, route.lease)).await {
                        Confirmed::Held { sent, until } => {
                            asked = Some(sent);
                            break crate::store::Lease {
                                token,
                                attempt,
                                until,
                            };
                        }
                        // Taken over: claim again, to be told what its holder did.
                        Confirmed::Lost => {
                            round = round.saturating_add(1);
                            continue;
                        }
                        // Given back already (see `confirm`).
                        Confirmed::Failed => {
                            self.outcome("store_unavailable");
                            return Step::Answer(Ok(unavailable(route, &dialect)));
                        }
                    }
                }
                match noting {
                    Some(noting) => return Step::Answer(Ok(noting.await)),
                    // Woken by the store when the record moves on (or it polls), then claim again:
                    // a replay, a run (the key was released), or at the deadline the usual 409.
                    None => {
                        let within = wait_until.map_or(Duration::ZERO, |until| {
                            until.saturating_duration_since(tokio::time::Instant::now())
                        });
                        let store = self.keeper.store();
                        let waited =
                            wait_to_claim(&**store, &request.key, seen, early, round, within);
                        early = Box::pin(waited).await;
                        round = round.saturating_add(1);
                    }
                }
            };
            self.span.record("attempt", lease.attempt);

            // 7–9. Execute to completion, record, respond.
            self.outcome("executed");
            let mut parts = parts;
            // Recorded uncompressed, so that every retry can read the replay (see `coding`).
            dialect.ask_identity(&mut parts.headers);
            let head = parts.method == http::Method::HEAD;
            let mut req = Request::from_parts(parts, RequestBody::buffered(bytes, trailers));
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
                asked,
                route,
                config,
                dialect,
                head,
            };
            if cancel_on_disconnect {
                // The server treats a hang-up as cancellation: give the key back if this future
                // is dropped before the outcome is recorded.
                let guard = ReleaseOnDrop {
                    store: Some(execution.keeper.store().clone()),
                    key: execution.key.clone(),
                    token,
                    lease: execution.route.lease,
                };
                return Step::Run {
                    run: Box::pin(execution.run(inner, req, Some(guard))),
                    detach: false,
                };
            }
            // Run to completion: a client hanging up from here on detaches this future instead
            // of cancelling it. The response future polls it inside the request's span, here and
            // once detached, so it carries no span of its own.
            Step::Run {
                run: Box::pin(execution.run(inner, req, None)),
                detach: true,
            }
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

/// What step 6 decided, for the pipeline to act on: nothing of the decision itself is kept
/// while the pipeline waits.
#[expect(
    clippy::large_enum_variant,
    reason = "a value moved once, right away; boxing would allocate for every replay"
)]
enum Next<ResBody> {
    Run(crate::store::Lease),
    /// In flight, on a route that waits for it: claim again once the record may have moved on
    /// (what was seen of it, if anything).
    Wait(Option<crate::store::InFlight>),
    /// The answer, and what to write into the key's history first (routes that ask).
    Answer(Response<ResponseBody<ResBody>>, Option<HistoryEvent>),
}

/// A `HEAD` on a route that guards `GET` but not `HEAD`: axum answers it with the `GET`
/// handler, which would run unguarded. One with a key is refused (its answer has no body to
/// record or replay as the `GET`'s), one without where the route requires a key is refused as
/// a `GET` would be; otherwise it passes, as an unkeyed `GET` does.
fn head_of_guarded_get<B>(
    route: &RouteConfig,
    header: &http::HeaderName,
    req: &Request<B>,
) -> Option<Problem> {
    if req.method() != http::Method::HEAD || !route.guards(&http::Method::GET) {
        return None;
    }
    if req.headers().contains_key(header) {
        Some(Problem::new(
            ProblemKind::CallUnguardable,
            "a HEAD request runs this route's GET handler, which is guarded; a HEAD's answer has \
             no body to record or replay, so send the GET itself with this key",
        ))
    } else if route.require_key {
        Some(Problem::new(
            ProblemKind::KeyMissing,
            "a HEAD request runs this route's GET handler, which requires an idempotency key",
        ))
    } else {
        None
    }
}

impl<St, M> Pipeline<St, M> {
    fn outcome(&self, name: &str) {
        self.span.record("outcome", name);
    }

    /// What the dialects read a request with.
    fn reading(&self) -> Reading<'_, M> {
        Reading {
            header: &self.config.header,
            require_key: self.route.require_key,
            json_fields: self.route.json_fields.as_deref(),
            fingerprint: &self.config.fingerprint,
            scheme: self.route.scheme,
            make_scope: &self.make_scope,
        }
    }

    /// A keyed request whose body was refused (too large, cut off on its way, or not
    /// fingerprinted) before the store was read: the key may have run already (a retry whose
    /// upload failed, a replica with a larger body limit, or another version that read the
    /// body, ran it), so what became of it is read from its record (each of
    /// `keys` it may be filed under: a JSON-RPC call's, under each method), never guessed. A
    /// key in flight, completed or uncertain, or one whose record cannot be read, is not to be
    /// left for a new one.
    async fn told(&self, keys: &[ScopedKey], refusal: Refusal) -> Refusal
    where
        St: IdempotencyStore,
    {
        let Refusal {
            mut problem,
            reply,
            counted,
        } = refusal;
        let store = self.keeper.store();
        for key in keys {
            // Bounded as a holder's reads are: a refusal must not wait on a stuck store.
            match crate::bounded::bounded(self.route.lease / 2, store.lookup(key)).await {
                Ok(None) => {}
                Ok(Some(record)) if record.status == RecordStatus::Released => {}
                Ok(Some(record)) => {
                    problem = problem.state(record.status.as_str()).keep_key();
                    if record.status == RecordStatus::InProgress {
                        let left = record
                            .lease_until
                            .duration_since(std::time::SystemTime::now())
                            .unwrap_or_default();
                        problem = problem.retry_after(ceil_secs(left));
                    }
                    break;
                }
                // Unknown: not a key to leave.
                Err(error) => {
                    observe::count(Event::StoreError);
                    tracing::warn!(%error, "could not read the key of a refused body");
                    problem = problem
                        .state("unknown")
                        .keep_key()
                        .retry_after(ceil_secs(self.route.unavailable_retry_after));
                    break;
                }
            }
        }
        Refusal {
            problem,
            reply,
            counted,
        }
    }

    /// The refusal of a keyed request refused before the store was read, once the key's
    /// record has told what became of it (see [`told`](Self::told)). On a future of its own:
    /// a rare path, kept out of the pipeline's state.
    fn telling<B, E>(self, keys: Vec<ScopedKey>, refusal: Refusal) -> Step<B, E>
    where
        St: IdempotencyStore,
        M: MakeScope,
        B: Send + 'static,
        E: Send + 'static,
    {
        let telling = async move {
            let refusal = self.told(&keys, refusal).await;
            Ok(self.refuse(refusal))
        };
        Step::Run {
            run: Box::pin(telling),
            detach: false,
        }
    }

    /// A refusal before anything was claimed: counted, noted on the span, framed.
    fn refuse<B>(&self, refusal: Refusal) -> Response<ResponseBody<B>> {
        if let Some(event) = refusal.counted {
            observe::count(event);
        }
        self.outcome(refusal.problem.kind.slug());
        refusal.reply.refuse(&refusal.problem)
    }
}

impl<St, M> Pipeline<St, M> {
    /// Step 6 turned into what to do: run, wait, or answer (a replay or a refusal).
    fn next<B>(
        &self,
        decision: Decision,
        can_wait: bool,
        dialect: &Dialect,
        request: &http::HeaderMap,
    ) -> Next<B> {
        let note = |event| self.route.record_refusals.then_some(event);
        match decision {
            Decision::Run(lease) => Next::Run(lease),
            Decision::InFlight(_, seen) if can_wait => Next::Wait(seen),
            Decision::InFlight(problem, _) => {
                // Once per request refused, however often it waited first.
                observe::count(Event::Conflict);
                self.outcome(problem.kind.slug());
                Next::Answer(dialect.refuse(&problem), note(HistoryEvent::Conflict))
            }
            Decision::Replay(stored) => {
                self.outcome("replayed");
                let (envelope, settings) = (self.route.envelope, self.route.jsonrpc.as_deref());
                let denied = &self.config.denied_headers;
                let response = dialect.replay(stored, request, envelope, settings, denied);
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
                Next::Answer(dialect.refuse(&problem), note(event))
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
        // Bounded as the reads of a refusal are: the note waits its turn behind claims (and
        // for the row), and an answer must not wait on a crowd for its trace.
        let note = self.keeper.store().append_history(key, event);
        if let Err(error) = crate::bounded::bounded(self.route.lease / 2, note).await {
            // The answer stands; only its trace in the history is missing.
            observe::count(Event::StoreError);
            tracing::warn!(%error, "could not write the refusal into the key's history");
        }
        response
    }
}

fn unavailable<B>(route: &RouteConfig, dialect: &Dialect) -> Response<ResponseBody<B>> {
    dialect.refuse(
        &Problem::new(
            ProblemKind::StoreUnavailable,
            "the idempotency store is unavailable, so the request was not run; retry with the \
             same key",
        )
        .state("unknown")
        .retry_after(ceil_secs(route.unavailable_retry_after)),
    )
}

#[cfg(feature = "tonic")]
impl<S, St, M> tonic::server::NamedService for Idempotency<S, St, M>
where
    S: tonic::server::NamedService,
{
    const NAME: &'static str = S::NAME;
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

#[cfg(all(test, feature = "memory"))]
mod tests;
