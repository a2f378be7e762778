//! The caller's half of the contract (feature `client`): a tower layer for HTTP clients that
//! keeps one key across every retry of a logical call, re-sends the same bytes, retries only
//! what is safe to retry, and stops with a typed error where a retry would be wrong.
//!
//! - **The key is the operation's.** A request carries an [`OperationKey`] in its extensions,
//!   derived from the durable step it performs (`{run}:{step}`): a caller that crashes and
//!   starts again derives the same key and reaches the same outcome. A request without one is
//!   refused ([`ClientError::NoOperationKey`]): a key minted here would die with the process,
//!   and a restarted caller would run the operation a second time.
//! - **Byte-identical retries.** The body is read once and every attempt sends those bytes,
//!   head and extensions under the same key (a body with trailers is refused: they would not
//!   be sent). Answers are read whole, up to
//!   [`max_answer_bytes`](IdempotentClientLayer::max_answer_bytes), before they are judged.
//! - **What is retried:** failures to connect or send, attempts past their timeout, `503`
//!   (the server's store is unavailable: nothing ran), `409 in-flight` (after its
//!   `Retry-After`; one marked as a replay was recorded, and is the answer), and a `5xx` the
//!   server did not record (it gave the key back: a retry may run it again, under the same
//!   key). Waits grow with jitter and never pass the deadline;
//!   a server's delay (`Retry-After` in seconds, gRPC's `RetryInfo`) is followed, but never
//!   below the first backoff (an HTTP-date `Retry-After` reads as no delay given).
//! - **What is not:** `422` (the key was used for another request: a programming error,
//!   [`ClientError::KeyReused`]); `409 outcome-unknown` ([`ClientError::OutcomeUnknown`], for a
//!   reconciliation, never an automatic retry); any answer the server recorded (a replayed
//!   `503` too); the middleware's refusals that a retry cannot change (a body over its limit,
//!   a server wired wrong), in every dialect: problem documents, JSON-RPC errors (the problem
//!   in `error.data`), gRPC `ErrorInfo` reasons. A new key is never minted.
//! - **The deadline rule.** Built [`for_window`](IdempotentClientLayer::for_window), the layer
//!   refuses timeouts (its own, and a gRPC call's `grpc-timeout`) that do not outlast the
//!   route's published processing window
//!   ([`ProcessingWindow::min_deadline`](crate::ProcessingWindow::min_deadline)): an attempt
//!   that gives up before the first could finish only turns every slow call into a wait.
//! - **A report per call** ([`CallReport`], in the response's extensions): attempts, replays,
//!   waits and how it ended; and counters (`idempotency_client_attempts_total`, …).
//! - **gRPC.** An answer of `application/grpc…` is judged by its `grpc-status` (trailers, or the
//!   headers of a trailers-only answer, or gRPC-Web's trailer frame): the middleware's own
//!   statuses by their `google.rpc.ErrorInfo` reason (`IN_FLIGHT` waits as its `RetryInfo`
//!   says, `FINGERPRINT_MISMATCH` and `OUTCOME_UNKNOWN` stop), other codes as the server's
//!   policy does (a non-definitive code not replayed is retried under the same key), and a
//!   stream cut before its status is retried. A call's `grpc-timeout` bounds the whole call,
//!   retries and waits included (within the layer's deadline), and each attempt is sent with
//!   the time left. The answer keeps its trailers ([`CallBody`]), so
//!   a tonic client over the layer reads its status as from the wire; a typed stop reaches it
//!   as a `Status` (code `UNKNOWN`) whose source is the [`ClientError`]
//!   ([`ClientError::find_in`]). On a `tonic::transport::Channel`, which takes tonic's body:
//!
//!   ```text
//!   let service = ServiceBuilder::new()
//!       .layer(IdempotentClientLayer::new())
//!       .map_request(|r: http::Request<Full<Bytes>>| r.map(tonic::body::Body::new))
//!       .service(channel);
//!   let mut client = tonic::client::Grpc::new(service); // or a generated client's `new`
//!   // per call: request.extensions_mut().insert(OperationKey::step(run, step)?)
//!   ```
//! - **reqwest** has no hook for a request-level tower layer (its `connector_layer` wraps
//!   connections, below requests); its `Client` is a tower `Service` of its own
//!   `reqwest::Request`. The layer goes around a few lines that convert both ways:
//!
//!   ```text
//!   let http = tower::service_fn(move |req: http::Request<Full<Bytes>>| {
//!       let client = reqwest_client.clone();
//!       async move {
//!           let req = reqwest::Request::try_from(req.map(reqwest::Body::wrap))?;
//!           Ok::<_, reqwest::Error>(http::Response::from(client.execute(req).await?))
//!       }
//!   });
//!   ```
//!
//!   `reqwest-middleware` is a trait of its own, not tower's; the adapter above is the way in.
//! - **MCP.** A tool call's key belongs to the call, but rmcp's custom headers belong to a
//!   transport: put the key in the call's `params._meta` (the server's
//!   [`JsonRpc::meta_key`](crate::jsonrpc::JsonRpc::meta_key)), as the `mcp_tools` example does.
//!
//! ```
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use tower::ServiceExt;
//! use tower_idempotency::client::{CallReport, IdempotentClientLayer, OperationKey};
//!
//! # let http = tower::service_fn(|_req: http::Request<http_body_util::Full<bytes::Bytes>>| async {
//! #     Ok::<_, std::io::Error>(http::Response::new(http_body_util::Full::new(bytes::Bytes::new())))
//! # });
//! // `http`: any client service, e.g. hyper-util's `Client` (see the crate's tests).
//! let client = tower::ServiceBuilder::new()
//!     .layer(IdempotentClientLayer::new().attempt_timeout(Duration::from_secs(10)))
//!     .service(http);
//! let mut request = http::Request::post("http://127.0.0.1:3000/refunds")
//!     .body(Full::new(Bytes::from_static(b"{\"order\":7}")))?;
//! request.extensions_mut().insert(OperationKey::step("run-42", "refund")?);
//! let response = client.oneshot(request).await?;
//! let report = response.extensions().get::<CallReport>();
//! # Ok(()) }
//! ```

mod body;
mod grpc;
mod key;
mod retry;
mod verdict;

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tower_layer::Layer;
use tower_service::Service;

pub use body::CallBody;
pub use key::OperationKey;
use retry::{Verdict, verdict};

use crate::store::BoxError;

/// How a logical call ended, in its [`CallReport`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Ended {
    /// The operation ran under this call: its first answer.
    Answered,
    /// An earlier attempt (this call's or another caller's) had run it: its recorded answer.
    Replayed,
}

/// What one logical call took, inserted into its response's extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CallReport {
    /// The key every attempt carried.
    pub key: String,
    /// Attempts sent.
    pub attempts: u32,
    /// Attempts answered `409 in-flight` and waited on.
    pub waits: u32,
    /// How it ended.
    pub ended: Ended,
}

/// Why a logical call did not get its answer.
#[derive(Debug)]
#[non_exhaustive]
pub enum ClientError {
    /// The request carries no [`OperationKey`]: nothing was sent.
    NoOperationKey,
    /// The key was first used with another request (`422`): a programming error, never
    /// retried.
    KeyReused {
        /// The key.
        key: String,
    },
    /// Whether the operation took effect is unknown (`409 outcome-unknown`): it awaits a
    /// reconciliation. Do not retry it, and do not move on to a new key, until it is resolved.
    OutcomeUnknown {
        /// The key.
        key: String,
    },
    /// The deadline passed before a definite answer; the operation may have run. Retry it
    /// later with the same key.
    DeadlineExceeded {
        /// The key.
        key: String,
        /// Attempts sent.
        attempts: u32,
    },
    /// A timeout that does not outlast the route's processing window (see
    /// [`IdempotentClientLayer::for_window`]): nothing was sent.
    DeadlineTooShort {
        /// The configured timeout.
        timeout: Duration,
        /// The least the route's window asks for.
        window: Duration,
    },
    /// The answer's body is larger than
    /// [`max_answer_bytes`](IdempotentClientLayer::max_answer_bytes), and its head does not say
    /// that nothing ran (a `503` or a `409 in-flight` is retried): the operation has most
    /// likely taken effect, and every retry would get the same answer. Raise the limit.
    AnswerTooLarge {
        /// The key.
        key: String,
        /// The limit it passed.
        limit: usize,
    },
    /// The request body could not be read: nothing was sent.
    Body(BoxError),
    /// The last attempt's transport error, once the deadline leaves no room for another.
    Transport(BoxError),
}

impl std::fmt::Display for ClientError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoOperationKey => f.write_str(
                "the request carries no OperationKey: derive one from the durable step it performs",
            ),
            Self::KeyReused { key } => write!(
                f,
                "the key {key:?} was first used with a different request (422); this is a bug in \
                 the caller, not a failure to retry"
            ),
            Self::OutcomeUnknown { key } => write!(
                f,
                "whether the operation {key:?} took effect is unknown; it awaits reconciliation"
            ),
            Self::DeadlineExceeded { key, attempts } => write!(
                f,
                "no definite answer for {key:?} after {attempts} attempts before the deadline; \
                 retry later with the same key"
            ),
            Self::DeadlineTooShort { timeout, window } => write!(
                f,
                "a timeout of {timeout:?} does not outlast the route's processing window \
                 ({window:?}): every slow call would be retried mid-flight"
            ),
            Self::AnswerTooLarge { key, limit } => write!(
                f,
                "the answer for {key:?} is over {limit} bytes; the operation has most likely \
                 taken effect: raise max_answer_bytes and retry with the same key"
            ),
            Self::Body(e) => write!(f, "the request body could not be read: {e}"),
            Self::Transport(e) => write!(f, "the request could not be sent: {e}"),
        }
    }
}

impl ClientError {
    /// The `ClientError` in `error`'s chain of sources: how a caller behind another client
    /// finds it, e.g. in the `tonic::Status` a tonic client makes of it (code `UNKNOWN`, the
    /// error as its source).
    pub fn find_in<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a ClientError> {
        let mut current = Some(error);
        while let Some(error) = current {
            if let Some(found) = error.downcast_ref::<ClientError>() {
                return Some(found);
            }
            current = error.source();
        }
        None
    }
}

impl std::error::Error for ClientError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Body(e) | Self::Transport(e) => Some(e.as_ref()),
            _ => None,
        }
    }
}

/// The least pause between two attempts of a call, whatever [`IdempotentClientLayer::backoff`]
/// is given.
pub const MIN_BACKOFF: Duration = Duration::from_millis(1);

/// The client layer: see the [module docs](self).
#[derive(Debug, Clone)]
pub struct IdempotentClientLayer {
    header: http::HeaderName,
    attempt_timeout: Option<Duration>,
    deadline: Duration,
    first_backoff: Duration,
    max_backoff: Duration,
    window: Option<Duration>,
    max_answer_bytes: usize,
}

impl Default for IdempotentClientLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotentClientLayer {
    /// Retries for up to 60 s overall, backing off from 100 ms to 5 s with jitter; no
    /// per-attempt timeout; answers of up to 16 MiB.
    pub fn new() -> Self {
        Self {
            header: crate::key::IDEMPOTENCY_KEY.clone(),
            attempt_timeout: None,
            deadline: Duration::from_secs(60),
            first_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            window: None,
            max_answer_bytes: 16 * 1024 * 1024,
        }
    }

    /// A layer for a route whose published window is `window`
    /// ([`ProcessingWindow`](crate::ProcessingWindow), read in process or from the server's
    /// [`WindowsService`](crate::WindowsService) document): timeouts (per attempt and overall)
    /// that do not outlast its [`min_deadline`](crate::ProcessingWindow::min_deadline) are
    /// refused by [`check`](Self::check) and by every call, before anything is sent.
    pub fn for_window(window: &crate::window::ProcessingWindow) -> Self {
        Self {
            window: Some(window.min_deadline()),
            ..Self::new()
        }
    }

    /// The header the key travels in (default `Idempotency-Key`).
    pub fn header(mut self, name: http::HeaderName) -> Self {
        self.header = name;
        self
    }

    /// How long one attempt may take before it is abandoned and retried (same key).
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = Some(timeout);
        self
    }

    /// How long a whole call may take, reading the request's body, its attempts and waits
    /// together (default 60 s). The first wait the server asks for that would end past it is
    /// cut to half the time left, so that the call asks once more while it can; the next one
    /// ends the call.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// The most an answer's body may hold (default 16 MiB): it is read whole, in memory, before
    /// it is judged. A larger one is judged by its head: retried if that says nothing ran (a
    /// proxy's `503` page), otherwise the call ends with [`ClientError::AnswerTooLarge`].
    pub fn max_answer_bytes(mut self, limit: usize) -> Self {
        self.max_answer_bytes = limit;
        self
    }

    /// The first pause between attempts and the longest (default 100 ms and 5 s). The first is
    /// also the least wait a server's `Retry-After` or `RetryInfo` can ask for. Neither is
    /// under [`MIN_BACKOFF`]: a zero would send attempts back to back, as fast as a failing
    /// server answers, for the whole deadline.
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.first_backoff = first.max(MIN_BACKOFF);
        self.max_backoff = max.max(self.first_backoff);
        self
    }

    /// The pause before the next attempt: the server's delay, but never under the first
    /// backoff (a `Retry-After: 0` from something in between is not an invitation to spin),
    /// or the backoff if it gave none.
    fn pause(&self, server_said: Option<Duration>, backoff: Duration) -> Duration {
        server_said.map_or(backoff, |d| d.max(self.first_backoff))
    }

    /// Whether the configured timeouts outlast the route's window (and are not zero, with or
    /// without a window): the error a call would get.
    pub fn check(&self) -> Result<(), ClientError> {
        let window = self.window.unwrap_or(Duration::ZERO);
        for timeout in self.attempt_timeout.iter().chain([&self.deadline]) {
            if *timeout <= window {
                return Err(ClientError::DeadlineTooShort {
                    timeout: *timeout,
                    window,
                });
            }
        }
        Ok(())
    }
}

impl<S> Layer<S> for IdempotentClientLayer {
    type Service = IdempotentClient<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotentClient {
            inner,
            config: self.clone(),
        }
    }
}

/// The service made by [`IdempotentClientLayer`].
#[derive(Debug, Clone)]
pub struct IdempotentClient<S> {
    inner: S,
    config: IdempotentClientLayer,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B, ResBody> Service<Request<B>> for IdempotentClient<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<CallBody>;
    type Error = ClientError;
    type Future = BoxFuture<Result<Self::Response, ClientError>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), ClientError>> {
        // Each attempt waits for the inner service's readiness itself.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let (inner, config) = (self.inner.clone(), self.config.clone());
        Box::pin(call(inner, config, req))
    }
}

/// One logical call: attempts under one key until a definite answer, a typed stop, or the
/// deadline.
async fn call<S, B, ResBody>(
    mut inner: S,
    config: IdempotentClientLayer,
    req: Request<B>,
) -> Result<Response<CallBody>, ClientError>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
{
    config.check()?;
    let key = req
        .extensions()
        .get::<OperationKey>()
        .cloned()
        .ok_or(ClientError::NoOperationKey)?;
    let key_value = HeaderValue::from_str(key.as_str()).map_err(|e| ClientError::Body(e.into()))?;
    let started = tokio::time::Instant::now();
    // A gRPC call's own timeout bounds the whole call, its retries included, not each attempt:
    // every attempt is sent with the time left (below).
    let grpc_timeout = grpc::timeout_of(req.headers());
    // It is the call's deadline, so the window's rule holds for it too (a zero included).
    if let Some(timeout) = grpc_timeout {
        let window = config.window.unwrap_or(Duration::ZERO);
        if timeout <= window {
            return Err(ClientError::DeadlineTooShort { timeout, window });
        }
    }
    let within = grpc_timeout.map_or(config.deadline, |t| t.min(config.deadline));
    // `Duration::MAX` means no deadline of its own: a century stands in for it.
    let deadline = started
        .checked_add(within)
        .unwrap_or_else(|| started + Duration::from_secs(100 * 365 * 86_400));
    // The whole body before the first attempt (every attempt sends it again), within the
    // call's deadline: a body that never ends (a stalled upload) must not hang the call.
    let (parts, body) = req.into_parts();
    let bytes = match tokio::time::timeout_at(deadline, body.collect()).await {
        Ok(collected) => {
            let collected = collected.map_err(|e| ClientError::Body(e.into()))?;
            // Every attempt sends a body without trailers: refused rather than dropped, since
            // the server fingerprints them and the caller meant them to be sent.
            if collected.trailers().is_some_and(|t| !t.is_empty()) {
                return Err(ClientError::Body(
                    "the request's body has trailers, which the client layer cannot send \
                     again on each attempt; nothing was sent"
                        .into(),
                ));
            }
            collected.to_bytes()
        }
        Err(_) => {
            return Err(ClientError::DeadlineExceeded {
                key: key.as_str().to_owned(),
                attempts: 0,
            });
        }
    };
    let mut report = CallReport {
        key: key.as_str().to_owned(),
        attempts: 0,
        waits: 0,
        ended: Ended::Answered,
    };
    let mut backoff = config.first_backoff;
    // Whether a pause past the deadline was cut already (see below): once per call.
    let mut cut = false;
    loop {
        // The same head, extensions and bytes every time.
        let mut attempt = Request::new(Full::new(bytes.clone()));
        *attempt.method_mut() = parts.method.clone();
        *attempt.uri_mut() = parts.uri.clone();
        *attempt.version_mut() = parts.version;
        *attempt.headers_mut() = parts.headers.clone();
        *attempt.extensions_mut() = parts.extensions.clone();
        attempt
            .headers_mut()
            .insert(config.header.clone(), key_value.clone());
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let limit = config.attempt_timeout.map_or(left, |t| t.min(left));
        // The call's time left, not the attempt's: a run the layer lets finish after the
        // attempt is given up on may pass the deadline on downstream.
        if grpc_timeout.is_some() {
            attempt
                .headers_mut()
                .insert("grpc-timeout", grpc::timeout_value(left));
        }
        let mut sent_one = false;
        let sent = tokio::time::timeout(limit, async {
            std::future::poll_fn(|cx| inner.poll_ready(cx))
                .await
                .map_err(Into::into)?;
            // Counted once it leaves: an attempt that waited for readiness was never sent.
            sent_one = true;
            let res = inner.call(attempt).await.map_err(Into::into)?;
            let (head, body) = res.into_parts();
            // Whole, trailers included: gRPC says in them how the call ended. Bounded: the
            // answer is held in memory.
            let collected = match http_body_util::Limited::new(body, config.max_answer_bytes)
                .collect()
                .await
            {
                Ok(collected) => collected,
                // Judged by its head alone (below): a proxy's large error page is not the
                // operation's answer.
                Err(error) if error.is::<http_body_util::LengthLimitError>() => {
                    return Ok((Response::from_parts(head, CallBody::default()), true));
                }
                Err(error) => return Err(error),
            };
            let trailers = collected.trailers().cloned();
            let body = CallBody::new(collected.to_bytes(), trailers);
            // The answer, and whether its body was too large to keep.
            Ok::<_, BoxError>((Response::from_parts(head, body), false))
        })
        .await;
        if sent_one {
            report.attempts += 1;
            metrics::counter!("idempotency_client_attempts_total").increment(1);
        }
        let (pause, last_error) = match sent {
            Ok(Ok((res, too_large))) => match verdict(&res) {
                // An answer too large to hold, whose head alone does not say nothing ran (a
                // 503, a 409 in flight): the operation has most likely taken effect.
                Verdict::Done { .. } | Verdict::KeyReused | Verdict::OutcomeUnknown
                    if too_large =>
                {
                    return Err(ClientError::AnswerTooLarge {
                        key: report.key,
                        limit: config.max_answer_bytes,
                    });
                }
                // A gRPC answer says how it ended in its trailers, which come after the body
                // that was too large to read: its head (a success, with no status) says the
                // call answered, not that nothing ran. Asked again, it would only be too large
                // again (a replay), or come back without its response.
                Verdict::Retry { .. } if too_large && grpc::answered_past_its_head(&res) => {
                    return Err(ClientError::AnswerTooLarge {
                        key: report.key,
                        limit: config.max_answer_bytes,
                    });
                }
                Verdict::Done { replayed } => {
                    report.ended = match replayed {
                        true => Ended::Replayed,
                        false => Ended::Answered,
                    };
                    if replayed {
                        metrics::counter!("idempotency_client_replays_total").increment(1);
                    }
                    let mut res = res;
                    res.extensions_mut().insert(report);
                    return Ok(res);
                }
                Verdict::KeyReused => {
                    metrics::counter!("idempotency_client_key_reused_total").increment(1);
                    return Err(ClientError::KeyReused { key: report.key });
                }
                Verdict::OutcomeUnknown => {
                    metrics::counter!("idempotency_client_outcome_unknown_total").increment(1);
                    return Err(ClientError::OutcomeUnknown { key: report.key });
                }
                Verdict::InFlight { retry_after } => {
                    report.waits += 1;
                    (config.pause(retry_after, backoff), None)
                }
                Verdict::Retry { retry_after } => (config.pause(retry_after, backoff), None),
            },
            Ok(Err(error)) => (backoff, Some(error)),
            // The attempt ran out of time: the server may still be running it; the retry
            // waits on it under the same key.
            Err(_) => (backoff, None),
        };
        let pause = retry::jitter(pause);
        backoff = backoff.saturating_mul(2).min(config.max_backoff);
        // A pause that does not end before the deadline (a `Retry-After` of a whole lease, or
        // past any clock) is cut to half the time left, once, so that the call asks once more
        // while it can (a run that ends sooner than its lease is then answered); asked again to
        // wait past the deadline, it gives up rather than press a server that asked for time.
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let pause = match pause < left {
            true => Some(pause),
            false if !cut && !left.is_zero() && left / 2 >= config.first_backoff => {
                cut = true;
                Some(left / 2)
            }
            false => None,
        };
        let Some(pause) = pause else {
            metrics::counter!("idempotency_client_deadline_exceeded_total").increment(1);
            return Err(match last_error {
                Some(error) => ClientError::Transport(error),
                None => ClientError::DeadlineExceeded {
                    key: report.key,
                    attempts: report.attempts,
                },
            });
        };
        tokio::time::sleep(pause).await;
    }
}
