//! Steps 7–8 of the pipeline: run the inner service to completion under a renewed lease, then
//! record its outcome (or release the key), fenced by the lease's token.
//!
//! It runs on the request's own future; hyper drops that future when the client hangs up, and
//! a half-done side effect must neither be cancelled nor left unrecorded, so from the moment
//! the inner service begins a dropped future is handed to a task of its own
//! ([`ResponseFuture`](crate::future::ResponseFuture)). The lease is renewed by the layer's
//! keeper ([`crate::hold`]) from before the handler starts until its outcome is recorded; a
//! record the store refuses is retried in the background, under the same lease, until it lands.

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, response::Parts};
use http_body::Body;
use tower_service::Service;
use tracing::Instrument;

use crate::body::{RequestBody, ResponseBody};
use crate::detached;
use crate::dialect::Dialect;
use crate::dialect::jsonrpc::{Events, Id};
use crate::hold::{Hold, Keeper};
use crate::problem::{Problem, ProblemKind};
use crate::replay::{Captured, Presentation, capture, present, present_streaming};
use crate::route::RouteConfig;
use crate::settings::Resolved;
use crate::store::{BoxError, IdempotencyStore, Lease, RecordStatus, ScopedKey};
use crate::unwind::CatchUnwind;
use crate::window::Timing;

mod give_back;
mod record;
mod retry;
mod room;
mod run;

pub(crate) use give_back::{ReleaseOnDrop, Until, give_back, give_back_set_aside};
use run::Run;

/// What a panic caught while the handler ran carries.
type Panic = Box<dyn Any + Send>;

/// The handler's answer (its response or its error), or its panic.
type Answered<B, E> = Result<Result<Response<B>, E>, Panic>;

/// Everything an execution needs, owned, so it can outlive the request's future.
pub(crate) struct Execution<St> {
    /// The store, and the keeper that renews this execution's lease while it holds it.
    pub(crate) keeper: Keeper<St>,
    pub(crate) key: ScopedKey,
    pub(crate) lease: Lease,
    /// When the lease was asked for, where the store took a while to answer (see
    /// [`Keeper::hold`]).
    pub(crate) asked: Option<tokio::time::Instant>,
    pub(crate) route: Arc<RouteConfig>,
    pub(crate) config: Arc<Resolved>,
    pub(crate) dialect: Dialect,
    /// Whether the request is a `HEAD`: its answer's `Content-Length` is the `GET`'s, over no
    /// body.
    pub(crate) head: bool,
}

impl<St: IdempotencyStore> Execution<St> {
    fn store(&self) -> &Arc<St> {
        self.keeper.store()
    }

    /// Keeps this execution's lease renewed while the returned value lives.
    fn hold(&self) -> Hold<St> {
        self.keeper
            .hold(&self.key, self.lease.token, self.route.lease, self.asked)
    }

    /// Runs `inner` on `req` and records the outcome; the answer for the client.
    ///
    /// `cancel` is set on routes that treat a hang-up as cancellation: it gives the key back if
    /// this future is dropped while the handler runs. Once the handler has answered, its
    /// outcome is recorded on a task of its own, so a hang-up can no longer drop it (the
    /// handler answered: its effect happened).
    ///
    /// The lease is held and `inner` called here, not at the first poll: the pipeline makes a
    /// run only to poll it at once (see [`run::Run`]).
    pub(crate) fn run<S, ReqBody, ResBody>(
        self,
        inner: S,
        req: Request<RequestBody<ReqBody>>,
        cancel: Option<ReleaseOnDrop<St>>,
    ) -> impl Future<Output = Result<Response<ResponseBody<ResBody>>, S::Error>>
    where
        S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
        S::Error: Send + 'static,
        ResBody: Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        Run::new(self, inner, req, cancel, Self::finish::<ResBody, S::Error>)
    }

    /// Reads the handler's answer and records it (steps 8–9).
    ///
    /// An `async` block rather than an `async fn`: a coroutine keeps its arguments for its
    /// whole life and an `async fn` copies them into locals besides, which the future's every
    /// state would carry.
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn's future keeps its arguments twice (see above)"
    )]
    fn finish<ResBody, E>(
        self,
        answered: Answered<ResBody, E>,
        hold: Hold<St>,
        timing: Timing,
    ) -> impl Future<Output = Result<Response<ResponseBody<ResBody>>, E>>
    where
        ResBody: Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        async move {
            // In a block of its own: neither the handler's answer nor the whole of what was read
            // of it keeps its room in the states that record it (a coroutine keeps a local's
            // room for as long as it is in scope).
            let ((mut parts, body, trailers, fits), hold) = {
                let status;
                let captured = CatchUnwind {
                    inner: capture(
                        match answered {
                            Err(_panic) => {
                                tracing::error!(
                                    "the idempotent handler panicked; releasing the key"
                                );
                                let state = self.release().await;
                                return Ok(failed(
                                    "the handler panicked; nothing was recorded",
                                    state,
                                    &self.dialect,
                                ));
                            }
                            Ok(Err(service_error)) => {
                                // No response exists to record, whatever the policy: give the
                                // key back.
                                self.release().await;
                                return Err(service_error);
                            }
                            Ok(Ok(res)) => {
                                status = res.status();
                                res
                            }
                        },
                        self.route.response_limit,
                        self.head,
                        // JSON-RPC event streams go to the client as they arrive (progress
                        // notifications).
                        self.dialect.watches(),
                    ),
                }
                .await
                .unwrap_or_else(|_panic| {
                    // A panic while the body is produced: the handler had answered all the same.
                    let mut head = Response::new(());
                    *head.status_mut() = status;
                    Captured::Broken {
                        parts: head.into_parts().0,
                        error: "the response body panicked".into(),
                    }
                });
                // One await for every rare path, after `captured` is gone: a local kept across
                // two awaits keeps its room in every state of this future.
                match self.next(captured, hold, timing) {
                    Next::Record { answer, hold } => (answer, hold),
                    Next::Answered(answer) => return answer,
                    Next::Rare(answer) => return answer.await,
                }
            };
            // Over the limit with its head and trailers: recorded without them, by its final
            // status, as any response too large to keep.
            let body = self
                .record(&mut parts, Some(body), trailers.as_deref(), fits)
                .await
                .unwrap_or_default();
            drop(hold);
            let how = self.first_presentation();
            Ok(present(
                parts.status,
                parts.headers,
                body,
                trailers.map(|trailers| *trailers),
                how,
            ))
        }
    }

    /// What follows a captured answer. The route's processing window runs from the handler's
    /// start to its answer read whole (here), or, for one that goes on streaming, to the
    /// stream's end (`timing` goes with it).
    fn next<'a, B, E>(
        &'a self,
        captured: Captured<B, Arc<Id>>,
        hold: Hold<St>,
        timing: Timing,
    ) -> Next<'a, St, B, E>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
        E: 'a,
    {
        match captured {
            Captured::Complete {
                parts,
                body,
                trailers,
                fits,
            } => {
                drop(timing);
                let answer = (parts, body, trailers, fits);
                Next::Record { answer, hold }
            }
            Captured::Streaming {
                parts,
                body,
                watched: id,
            } => Next::Answered(forwarded(parts, |head, tx| {
                // The stream's own task keeps the lease until it is recorded.
                self.detached().tee(id, head, body, tx, hold, timing)
            })),
            Captured::TooLarge {
                mut parts,
                prefix,
                rest,
            } if self.dialect.outcome_in_trailers() => {
                // Too large to keep, and how it ended is only told at its end: forwarded as it
                // comes, recorded (without its response) by its final status, before that
                // status reaches the client.
                if self.route.mark_first_response {
                    parts.headers.insert(
                        crate::replay::IDEMPOTENCY_REPLAYED.clone(),
                        http::HeaderValue::from_static("false"),
                    );
                }
                Next::Answered(forwarded(parts, |head, tx| {
                    self.detached().tail(head, prefix, rest, tx, hold, timing)
                }))
            }
            // Rare paths are boxed, so the common one's future stays small; the lease is kept
            // until they are recorded.
            Captured::TooLarge {
                parts,
                prefix,
                rest,
            } => Next::Rare(Box::pin(async move {
                let answer = self.answer_too_large(parts, prefix, rest, timing).await;
                drop(hold);
                answer
            })),
            Captured::Broken { parts, error } => {
                drop(timing);
                Next::Rare(Box::pin(async move {
                    let answer = self.answer_broken(parts, error).await;
                    drop(hold);
                    answer
                }))
            }
        }
    }

    /// How the first answer (not a replay) goes to the client.
    fn first_presentation(&self) -> Presentation {
        Presentation {
            replayed: false,
            mark: self.route.mark_first_response,
            envelope: self.dialect.envelopes(self.route.envelope),
        }
    }

    /// This execution again, for a task of its own that records a stream's outcome.
    fn detached(&self) -> Self {
        Self {
            keeper: self.keeper.clone(),
            key: self.key.clone(),
            lease: self.lease,
            asked: self.asked,
            route: self.route.clone(),
            config: self.config.clone(),
            dialect: self.dialect.clone(),
            head: self.head,
        }
    }

    /// A response whose body failed after the handler answered: the handler answered, so its
    /// effect is taken as done (DESIGN §3). Only a head the policy would not record (a 5xx
    /// under DefinitiveOnly) gives the key back.
    async fn answer_broken<B, E>(
        &self,
        parts: Parts,
        error: BoxError,
    ) -> Result<Response<ResponseBody<B>>, E> {
        tracing::warn!(%error, "the response body failed after the handler answered");
        let state = self.record_lost(&parts).await;
        let detail = if state == RecordStatus::Completed.as_str() {
            "the handler answered but its response body failed; the operation is taken as done \
             and will not run again, and its response is not available"
        } else {
            "the handler answered with a failure and its response body failed; nothing was \
             recorded"
        };
        Ok(failed(detail, state, &self.dialect))
    }

    /// A response too large to keep whose outcome its head tells: recorded without a body (the
    /// key stays consumed, never a second run), then streamed on.
    async fn answer_too_large<B, E>(
        &self,
        mut parts: Parts,
        prefix: Bytes,
        rest: Pin<Box<B>>,
        timing: Timing,
    ) -> Result<Response<ResponseBody<B>>, E>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        self.record(&mut parts, None, None, true).await;
        let how = self.first_presentation();
        Ok(present_streaming(parts, prefix, rest, how, timing))
    }

    /// Forwards the rest of a response too large to keep, then records it without its
    /// response, classified by its trailers (a gRPC status), before they are sent on: a client
    /// that has the final status can count on its retry seeing the record. A failed body is
    /// recorded by its head, as any answer whose body was lost.
    async fn tail<B>(
        self,
        mut head: Parts,
        prefix: Bytes,
        mut rest: Pin<Box<B>>,
        tx: tokio::sync::mpsc::Sender<Result<http_body::Frame<Bytes>, BoxError>>,
        hold: Hold<St>,
        // Timed to the stream's end: dropped, and recorded, when this task ends.
        _timing: Timing,
    ) where
        B: Body<Data = Bytes>,
        B::Error: Into<BoxError>,
    {
        // gRPC-Web's status is in its last frame: read as it passes, and from the frame it
        // begins in, held back until the answer is recorded.
        let mut web = self.dialect.web_frames(&head.headers);
        let mut held: Vec<Bytes> = Vec::new();
        let mut forward = |data: Bytes| match &mut web {
            Some(frames) => {
                frames.feed(&data);
                match frames.in_trailers() {
                    true => {
                        held.push(data);
                        None
                    }
                    false => Some(data),
                }
            }
            None => Some(data),
        };
        // A client that hangs up stops the stream, as it would without the layer: the answer
        // is then recorded by its head, as one too large to keep was before its end was read.
        let mut left = match forward(prefix) {
            Some(data) => tx.send(Ok(http_body::Frame::data(data))).await.is_err(),
            None => false,
        };
        let mut trailers: Option<HeaderMap> = None;
        while !left {
            let next = next_frame(&mut rest).await;
            match next {
                None => break,
                Some(Err(error)) => {
                    self.record_lost(&head).await;
                    let _ = tx.send(Err(error)).await;
                    return;
                }
                Some(Ok(frame)) => match frame.into_trailers() {
                    Ok(t) => trailers.get_or_insert_with(HeaderMap::new).extend(t),
                    Err(frame) => match frame.into_data() {
                        Ok(data) => {
                            if let Some(data) = forward(data) {
                                left = tx.send(Ok(http_body::Frame::data(data))).await.is_err();
                            }
                        }
                        Err(frame) => left = tx.send(Ok(frame)).await.is_err(),
                    },
                },
            }
        }
        if left {
            drop(rest);
            self.record(&mut head, None, None, true).await;
            return;
        }
        // A gRPC-Web answer's trailers are its trailer frame (none, or not gRPC-Web: its
        // head decides, UNKNOWN without a status there).
        let told = match &web {
            Some(frames) => frames.finish().flatten(),
            None => trailers.clone(),
        };
        // A compressed gRPC-Web answer's status cannot be read: by its head, else done.
        let done = self.dialect.opaque(&head.headers)
            && !crate::dialect::grpc::has_status(&head.headers, None);
        self.record_without_body(&head, told.as_ref(), done).await;
        drop(hold);
        for data in held {
            if tx.send(Ok(http_body::Frame::data(data))).await.is_err() {
                return;
            }
        }
        if let Some(trailers) = trailers {
            let _ = tx.send(Ok(http_body::Frame::trailers(trailers))).await;
        }
    }

    /// Forwards an event stream to the client as it arrives while watching it for the call's
    /// final response, then records that. Each event is read once, as it completes: the cost
    /// is linear in the stream. A client that hangs up stops receiving, not the reading: the
    /// stream runs to its end and is recorded all the same. Past the response limit (a stream
    /// that never ends) the answer is recorded at once as not stored.
    async fn tee<B>(
        self,
        id: Arc<Id>,
        head: Parts,
        mut body: Pin<Box<B>>,
        tx: tokio::sync::mpsc::Sender<Result<http_body::Frame<Bytes>, BoxError>>,
        hold: Hold<St>,
        // Timed to the stream's end: dropped, and recorded, when this task ends.
        _timing: Timing,
    ) where
        B: Body<Data = Bytes>,
        B::Error: Into<BoxError>,
    {
        let limit = self.route.response_limit;
        let mut events = Events::default();
        let mut seen = 0usize;
        let mut recorded = false;
        // Kept until the answer is recorded, not for the rest of the stream.
        let mut hold = Some(hold);
        loop {
            let next = next_frame(&mut body).await;
            let Some(frame) = next else { break };
            let frame = match frame {
                Ok(frame) => frame,
                Err(error) => {
                    let _ = tx.send(Err(error)).await;
                    if !recorded {
                        // The handler answered: the call is taken as done, its answer lost.
                        self.record_unanswered(&head, &events).await;
                    }
                    return;
                }
            };
            if let Some(data) = frame.data_ref()
                && !recorded
            {
                seen += data.len();
                let done = if seen > limit {
                    // Too much to keep: recorded without a body, like any oversized answer.
                    Some(None)
                } else {
                    events.feed(data, &id).map(Some)
                };
                // Recorded before the frame leaves, so a client that has the final response
                // can count on its retry being a replay.
                if let Some(message) = done {
                    self.record_call(&head, message, None).await;
                    recorded = true;
                    hold = None;
                }
            }
            // A closed receiver only means the client left.
            let _ = tx.send(Ok(frame)).await;
        }
        if !recorded {
            match events.finish(&id) {
                // The last event, cut short of its blank line: the server answered all the same.
                Some(message) => self.record_call(&head, Some(message), None).await,
                None => self.record_unanswered(&head, &events).await,
            }
        }
        drop(hold);
    }
}

/// A rare path's recording and answer, boxed.
type Answering<'a, B, E> =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send + 'a>>;

/// What follows a captured answer (see [`Execution::next`]).
enum Next<'a, St, B, E> {
    /// The common path: record the answer (head, body, trailers, and whether they fit the
    /// limit), then send it.
    Record {
        answer: (Parts, Bytes, Option<Box<HeaderMap>>, bool),
        hold: Hold<St>,
    },
    /// Answered at once: a stream whose outcome a task of its own records.
    Answered(Result<Response<ResponseBody<B>>, E>),
    /// A rare path (a body that failed, or one too large to keep), recorded, then answered.
    Rare(Answering<'a, B, E>),
}

/// The next frame of a handler's body that a task of its own forwards, its error converted at
/// once (the body's own error type need not be `Send`). A body that panics is a body that
/// failed: the handler had answered, so the answer is recorded as lost, never left in flight
/// for its lease to lapse and the handler to run again (DESIGN §3). It is not polled again.
async fn next_frame<B>(body: &mut Pin<Box<B>>) -> Option<Result<http_body::Frame<Bytes>, BoxError>>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let frame = CatchUnwind {
        inner: http_body_util::BodyExt::frame(body),
    }
    .await;
    match frame {
        Ok(frame) => frame.map(|frame| frame.map_err(Into::<BoxError>::into)),
        Err(_panic) => {
            tracing::error!("the response body panicked after the handler answered");
            Some(Err("the response body panicked".into()))
        }
    }
}

/// An answer whose body a task of its own forwards as it arrives (and records at its end):
/// `task` gets a copy of the head and the channel's sending end.
fn forwarded<B, E, T>(
    parts: Parts,
    task: impl FnOnce(Parts, tokio::sync::mpsc::Sender<Result<http_body::Frame<Bytes>, BoxError>>) -> T,
) -> Result<Response<ResponseBody<B>>, E>
where
    T: Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    // Read to its end and recorded even once its client left: counted as detached work.
    let forwarding = task(head_of(&parts), tx).in_current_span();
    detached::spawn(&tokio::runtime::Handle::current(), forwarding);
    Ok(Response::from_parts(parts, ResponseBody::channel(rx)))
}

/// A copy of a response head (status and headers) for recording after the head is sent.
fn head_of(parts: &Parts) -> Parts {
    let mut head = Response::new(());
    *head.status_mut() = parts.status;
    *head.headers_mut() = parts.headers.clone();
    head.into_parts().0
}

fn failed<B>(detail: &str, state: &'static str, dialect: &Dialect) -> Response<ResponseBody<B>> {
    dialect.refuse(&Problem::new(ProblemKind::ExecutionFailed, detail).state(state))
}
