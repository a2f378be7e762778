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
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, response::Parts};
use http_body::Body;
use pin_project_lite::pin_project;
use tower_service::Service;
use tracing::Instrument;

use crate::body::{RequestBody, ResponseBody};
use crate::bounded::bounded;
use crate::detached;
use crate::dialect::jsonrpc::{self, Events, Id};
use crate::dialect::{Dialect, Recording};
use crate::hold::{Hold, Keeper};
use crate::observe::{self, Event};
use crate::policy::{CachePolicy, Outcome};
use crate::problem::{Problem, ProblemKind};
use crate::replay::{Captured, Presentation, capture, present, present_streaming, restore};
use crate::route::RouteConfig;
use crate::settings::Resolved;
use crate::store::{
    BoxError, FencingToken, IdempotencyStore, Lease, RecordStatus, ScopedKey, StoreError,
    StoredResponse,
};
use crate::unwind::CatchUnwind;
use crate::whose::{Whose, whose};
use crate::window::Timing;

mod give_back;
mod retry;
mod run;

pub(crate) use give_back::{ReleaseOnDrop, Until, give_back, give_back_set_aside};
use give_back::{TakenOver, give_back_paced, give_back_set_aside_paced, released};
use retry::Retry;
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

    /// Records a response whose body was lost after its head: as completed without a body
    /// when the policy records the status its head carries, else gives the key back. A head
    /// that carries no outcome (a gRPC head before its messages, whose status was to come in
    /// the trailers; any JSON-RPC call's) is taken as done: the handler answered, and the
    /// key is never run again (DESIGN §3). Returns the key's state.
    async fn record_lost(&self, parts: &Parts) -> &'static str {
        let done = !self.dialect.head_tells_outcome(&parts.headers);
        self.record_without_body(parts, None, done).await
    }

    /// Records a response without its body (too large to keep, or lost after its head),
    /// classified by its final status: the trailers' where it has them, UNKNOWN for a gRPC
    /// answer without one; or taken as `done` whatever it says. Returns the key's state.
    async fn record_without_body(
        &self,
        parts: &Parts,
        trailers: Option<&HeaderMap>,
        done: bool,
    ) -> &'static str {
        self.record_copied(parts, None, trailers, done).await
    }

    /// Records `body` under a copy of the head (the rare paths: an answer too large, broken,
    /// or recorded in another form than it is sent, as gRPC-Web's), classified as
    /// [`record_without_body`](Self::record_without_body) says. Returns the key's state.
    async fn record_copied(
        &self,
        parts: &Parts,
        body: Option<Bytes>,
        trailers: Option<&HeaderMap>,
        done: bool,
    ) -> &'static str {
        let trailers = self.dialect.stored_trailers(
            &parts.headers,
            trailers,
            &self.config.denied_headers,
            true,
        );
        let records = done
            || self.route.cache_policy.records(&Outcome {
                status: parts.status,
                headers: &parts.headers,
                trailers: trailers.as_ref(),
                jsonrpc: None,
            });
        if !records {
            return self.release().await;
        }
        let mut headers = parts.headers.clone();
        self.dialect
            .withhold(&mut headers, &self.config.denied_headers, true);
        // Without its body, an answer keeps of its trailers only its outcome: a gRPC call's
        // status (the trailers may be why it was too large to keep).
        let trailers = match body {
            Some(_) => trailers,
            None => trailers.map(outcome_only),
        };
        let stored = StoredResponse {
            status: parts.status,
            headers,
            body,
            trailers,
        };
        self.complete(&stored).await;
        RecordStatus::Completed.as_str()
    }

    /// Records an answer whose status cannot be read from its body (a compressed gRPC-Web
    /// answer) as it was sent: by the status in its head if it has one, else taken as done
    /// (the handler answered; a status the layer cannot see never runs it again).
    async fn record_opaque(&self, parts: &Parts, body: Option<Bytes>) {
        let told = crate::dialect::grpc::has_status(&parts.headers, None);
        let records = !told
            || self.route.cache_policy.records(&Outcome {
                status: parts.status,
                headers: &parts.headers,
                trailers: None,
                jsonrpc: None,
            });
        if !records {
            self.release().await;
            return;
        }
        let mut headers = parts.headers.clone();
        self.dialect
            .withhold(&mut headers, &self.config.denied_headers, body.is_some());
        let stored = StoredResponse {
            status: parts.status,
            headers,
            body,
            trailers: None,
        };
        self.complete(&stored).await;
    }

    /// Step 8: records the outcome if the route's policy keeps it, else releases the key.
    /// Hands `body` back: it moves through the record rather than being shared with it. An
    /// answer that does not `fit` the limit with its head and trailers is recorded without
    /// them, by its final status, as any response too large to keep.
    ///
    /// Decided before the first await: the common path's future waits on the store with the
    /// record alone, and the rare paths' are boxed, so the futures that wait on this one stay
    /// small.
    fn record<'a>(
        &'a self,
        parts: &'a mut Parts,
        body: Option<Bytes>,
        trailers: Option<&'a HeaderMap>,
        fits: bool,
    ) -> RecordFuture<'a, impl Future<Output = Option<Bytes>> + 'a> {
        match self.stored(parts, body, trailers, fits) {
            Stored::Record(stored, withheld) => RecordFuture::Store {
                store: async move {
                    self.complete(&stored).await;
                    parts.headers = stored.headers;
                    restore(&mut parts.headers, withheld);
                    stored.body
                },
            },
            Stored::Rare(rare, body) => RecordFuture::Rare {
                rare: Box::pin(self.record_rare(parts, rare, trailers)),
                body: Some(body),
            },
        }
    }

    /// Records an answer off the common path (see [`record`](Self::record)).
    async fn record_rare(&self, parts: &Parts, rare: Rare, trailers: Option<&HeaderMap>) {
        match rare {
            Rare::TooLarge => {
                self.record_without_body(parts, trailers, false).await;
            }
            Rare::Release => {
                self.release().await;
            }
            Rare::Web(messages, trailers) => {
                // Kept in its gRPC form; the client still gets the answer as it was sent.
                self.record_copied(parts, Some(messages), trailers.as_ref(), false)
                    .await;
            }
            Rare::Opaque(sent) => self.record_opaque(parts, sent).await,
            Rare::NotWeb => {
                // Not gRPC-Web: its status cannot be read, so it is UNKNOWN.
                tracing::warn!("a gRPC-Web answer is not well formed; recorded as UNKNOWN");
                self.record_without_body(parts, None, false).await;
            }
            Rare::Call(message) => {
                self.record_call(parts, message, trailers).await;
            }
            Rare::Unread => self.record_unread(parts).await,
        }
    }

    /// The record of an answer and the headers withheld from it meanwhile, or, off the common
    /// path, which rare path it takes and the body to hand back.
    fn stored(
        &self,
        parts: &mut Parts,
        body: Option<Bytes>,
        trailers: Option<&HeaderMap>,
        fits: bool,
    ) -> Stored {
        if !fits {
            return Stored::Rare(Rare::TooLarge, body);
        }
        let rare = match self.dialect.recording(&parts.headers, body.as_ref()) {
            Recording::AsIs => None,
            Recording::Web(Some((messages, trailers))) => Some(Rare::Web(messages, trailers)),
            Recording::Web(None) => Some(Rare::NotWeb),
            Recording::Opaque => Some(Rare::Opaque(body.clone())),
            Recording::Call(message) => Some(Rare::Call(message)),
            Recording::Interim => Some(Rare::Release),
            Recording::Unread => Some(Rare::Unread),
        };
        if let Some(rare) = rare {
            return Stored::Rare(rare, body);
        }
        // What of the trailers may be kept: the same deny list as the headers (credentials,
        // per-call ids and trace context never reach a retry nor the store). A gRPC answer
        // that never said how the call ended is UNKNOWN, not a success.
        let trailers = self.dialect.stored_trailers(
            &parts.headers,
            trailers,
            &self.config.denied_headers,
            body.is_some(),
        );
        let records = self.route.cache_policy.records(&Outcome {
            status: parts.status,
            headers: &parts.headers,
            trailers: trailers.as_ref(),
            jsonrpc: None,
        });
        if !records {
            return Stored::Rare(Rare::Release, body);
        }
        // The live headers are lent to the record, not copied; the ones never recorded step
        // aside meanwhile.
        let mut headers = std::mem::take(&mut parts.headers);
        // A whole body's length is recomputed by the server, as for replays; a body too large
        // to keep streams on with the length its handler gave.
        let withheld =
            self.dialect
                .withhold(&mut headers, &self.config.denied_headers, body.is_some());
        let stored = StoredResponse {
            status: parts.status,
            headers,
            body,
            trailers,
        };
        Stored::Record(stored, withheld)
    }

    /// Settles a call whose event stream ended, or broke, without its response: the key goes
    /// back where the stream said so (an interim result, or the server could not read the
    /// call); otherwise the server took the call and answers it elsewhere (a resumed stream),
    /// and it is recorded as [`record_unread`](Self::record_unread) says.
    async fn record_unanswered(&self, parts: &Parts, events: &Events) {
        if events.gives_back() {
            self.release().await;
        } else {
            self.record_unread(parts).await;
        }
    }

    /// Records a call the server took whose response this layer could not read (its event
    /// stream ended, or broke, without it; or the answer came compressed): under a success
    /// status, done whatever the route's policy says, as any answer whose head arrived and
    /// told no outcome (DESIGN §3), so it never runs again. An error status is an outcome the
    /// policy classifies (a 503 stream from an overloaded proxy gives the key back under
    /// `DefinitiveOnly`).
    async fn record_unread(&self, parts: &Parts) {
        if parts.status.is_success() || self.keeps_unread(parts, None) {
            self.complete(&jsonrpc::stored_unread(parts)).await;
        } else {
            self.release().await;
        }
    }

    /// Whether the route's policy keeps a JSON-RPC answer whose message it cannot read (too
    /// large to keep, or an event stream without the call's response): under
    /// `DefinitiveOnly`, only under a success status, as an answer read whole (DESIGN §3), so
    /// that the limit never decides whether a call runs again.
    fn keeps_unread(&self, parts: &Parts, trailers: Option<&HeaderMap>) -> bool {
        match &self.route.cache_policy {
            CachePolicy::DefinitiveOnly => parts.status.is_success(),
            policy => policy.records(&Outcome {
                status: parts.status,
                headers: &parts.headers,
                trailers,
                jsonrpc: None,
            }),
        }
    }

    /// Records a call's final response (`None`: too large to keep), or releases the key when
    /// the policy does not record it.
    async fn record_call(
        &self,
        parts: &Parts,
        message: Option<Bytes>,
        trailers: Option<&HeaderMap>,
    ) {
        let records = match message.as_deref() {
            Some(message) => self.route.cache_policy.records(&Outcome {
                status: parts.status,
                headers: &parts.headers,
                trailers,
                jsonrpc: Some(message),
            }),
            // Too large to read.
            None => self.keeps_unread(parts, trailers),
        };
        if records {
            self.complete(&jsonrpc::stored_call(message, parts.status))
                .await;
        } else {
            self.release().await;
        }
    }

    /// Records `stored`, fenced. When the store fails, the outcome is not dropped: the record
    /// is marked uncertain if the store takes that, and a task of its own keeps the lease
    /// renewed and retries the write with bounded backoff until it lands or is fenced (another
    /// holder's, or a resolved, outcome stands). Retries meanwhile get 409, never a second run.
    async fn complete(&self, stored: &StoredResponse) {
        let store = self.store();
        let mut retry = Retry::new(self.route.lease);
        let write = store.complete(&self.key, self.lease.token, stored, self.route.ttl);
        let result = retry.bounded(write).await;
        // Only a fenced write is final: another holder's, or a resolved, outcome stands (unless
        // the record says the store fenced by mistake). Any other failure (`Busy` included: a
        // store's row lock is let go) leaves the effect unrecorded, so it is kept and retried
        // like an outage.
        let error = match result {
            Ok(()) => return,
            Err(error) => error,
        };
        if matches!(error, StoreError::Fenced) {
            let (key, token) = (&self.key, self.lease.token);
            if !Box::pin(still_ours(&**store, key, token, retry.each())).await {
                return settle(Err(StoreError::Fenced), "record the outcome");
            }
        }
        observe::count(Event::StoreError);
        tracing::error!(
            %error,
            "could not record the outcome; keeping the lease and retrying until it lands"
        );
        // Should this process die before the write lands, the key stays "outcome unknown"
        // instead of running again when the lease expires.
        if bounded(
            retry.each(),
            store.mark_uncertain(&self.key, self.lease.token),
        )
        .await
        .is_ok()
        {
            observe::count(Event::MovedToReconciliation);
        }
        let recorder = Recorder {
            store: store.clone(),
            key: self.key.clone(),
            token: self.lease.token,
            stored: stored.clone(),
            ttl: self.route.ttl,
            retry,
        };
        self.held_while(recorder.run());
    }

    /// Gives the key back; the store keeps it for reconciliation instead if the effect had
    /// started. Returns the state the key is left in, for the client's answer.
    async fn release(&self) -> &'static str {
        let (store, key, token) = (self.store(), &self.key, self.lease.token);
        let mut retry = Retry::new(self.route.lease);
        match retry.bounded(store.release(key, token)).await {
            Ok(status) => {
                released(status);
                status.as_str()
            }
            // Taken over, settled, or only set aside meanwhile: a task of its own gives it
            // back if it was only set aside (see `give_back_set_aside`).
            Err(StoreError::Fenced) => {
                self.give_back_set_aside_later(retry);
                "in_progress"
            }
            Err(error) => {
                settle(Err(error), "release the key");
                self.release_later(retry);
                "in_progress"
            }
        }
    }

    /// Tries a failed release again on a task of its own until it lands or is fenced, with the
    /// lease kept renewed meanwhile, as a failed record is (DESIGN §4): left to lapse, it
    /// would have the next claim decide, which on a route that reconciles sets the key aside
    /// though the handler's outcome said a retry may run it again. Retries meanwhile find the
    /// key in flight.
    fn release_later(&self, mut retry: Retry) {
        let (store, key, token) = (self.store().clone(), self.key.clone(), self.lease.token);
        self.held_while(async move {
            retry.pause(Duration::MAX).await;
            give_back_paced(&*store, &key, token, retry, Until::Lands, "the key").await;
        });
    }

    /// After a fenced release: gives the key back on a task of its own if it was only set
    /// aside behind this holder (see [`give_back_set_aside`]). The lease is held meanwhile, in
    /// case the store fenced by mistake and the key is still this holder's: it is then given
    /// back as a failed release is, not left in flight.
    fn give_back_set_aside_later(&self, retry: Retry) {
        let (store, key, token) = (self.store().clone(), self.key.clone(), self.lease.token);
        self.held_while(async move {
            give_back_set_aside_paced(&*store, &key, token, retry, TakenOver::Counted).await;
        });
    }

    /// Runs `work` (a write after the run, tried until it settles) on a task of its own, in
    /// this request's span, with the lease kept renewed until it ends. Without a runtime
    /// (shutting down) nothing runs: the lease runs out, and the record stays as the store has
    /// it.
    fn held_while(&self, work: impl Future<Output = ()> + Send + 'static) {
        // The run's hold may have renewed the lease last up to a third of a lease ago: this
        // one renews it at the keeper's next wake, so the write keeps the four tries before
        // the lease runs out that the run had. Counted from now, its first renewal would come
        // a third of a lease late, and three refusals would let the lease lapse under it.
        let hold = self
            .keeper
            .hold_at_once(&self.key, self.lease.token, self.route.lease);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let pending = observe::PendingWrite::begin();
            let held = async move {
                work.await;
                drop(hold);
                drop(pending);
            };
            detached::spawn(&runtime, held.in_current_span());
        }
    }
}

/// Counts and logs a failed write after the claim. A fenced write means another holder took
/// the key over: its outcome, not ours, is the record.
fn settle(result: Result<(), StoreError>, what: &str) {
    match result {
        Ok(()) => {}
        Err(StoreError::Fenced) => {
            observe::count(Event::StaleWrite);
            tracing::warn!("could not {what}: the lease was taken over");
        }
        Err(error) => {
            observe::count(Event::StoreError);
            tracing::error!(%error, "could not {what}");
        }
    }
}

/// After a write was fenced: whether the record is, all the same, still this holder's to
/// record (in flight or set aside under its token; see [`crate::whose`]). A read that fails
/// says nothing: the write is tried again, and a fenced one read again.
async fn still_ours<St: IdempotencyStore>(
    store: &St,
    key: &ScopedKey,
    token: FencingToken,
    each: Duration,
) -> bool {
    whose(store, key, token, each)
        .await
        .map_or(true, Whose::ours)
}

/// Retries a failed record until it lands (run with the lease held: see
/// [`Execution::held_while`]).
struct Recorder<St> {
    store: Arc<St>,
    key: ScopedKey,
    token: FencingToken,
    stored: StoredResponse,
    ttl: Duration,
    /// The tries so far, the first one included.
    retry: Retry,
}

impl<St: IdempotencyStore> Recorder<St> {
    async fn run(mut self) {
        loop {
            self.retry.pause(Duration::MAX).await;
            let write = self
                .store
                .complete(&self.key, self.token, &self.stored, self.ttl);
            match self.retry.bounded(write).await {
                Ok(()) => {
                    let tries = self.retry.tries();
                    tracing::info!(tries, "the outcome is recorded after the store recovered");
                    break;
                }
                Err(StoreError::Fenced)
                    if !still_ours(&*self.store, &self.key, self.token, self.retry.each())
                        .await =>
                {
                    settle(Err(StoreError::Fenced), "record the outcome");
                    break;
                }
                Err(_) => observe::count(Event::StoreError),
            }
        }
    }
}

/// An answer made ready for the store (see [`Execution::stored`]).
enum Stored {
    /// The record, and the headers withheld from it meanwhile.
    Record(StoredResponse, Vec<(http::HeaderName, http::HeaderValue)>),
    /// Off the common path: which one, and the body to hand back.
    Rare(Rare, Option<Bytes>),
}

/// An answer's recording off the common path (see [`Execution::record`]).
enum Rare {
    /// Too large to keep with its head and trailers: recorded without them.
    TooLarge,
    /// Nothing to record (the route's policy keeps no such answer, or an interim one): the key
    /// is given back.
    Release,
    /// A gRPC-Web answer, kept in its gRPC form: messages and trailers.
    Web(Bytes, Option<HeaderMap>),
    /// Not well-formed gRPC-Web: its status cannot be read.
    NotWeb,
    /// A gRPC-Web answer that cannot be read (compressed whole), kept as it was sent.
    Opaque(Option<Bytes>),
    /// A JSON-RPC call's final response (`None`: too large to keep).
    Call(Option<Bytes>),
    /// A JSON-RPC call the server took whose response could not be read.
    Unread,
}

pin_project! {
    /// The future of [`Execution::record`]: the common path's, or a rare path's, boxed.
    #[project = RecordProj]
    pub(crate) enum RecordFuture<'a, F> {
        Store { #[pin] store: F },
        Rare {
            rare: Pin<Box<dyn Future<Output = ()> + Send + 'a>>,
            body: Option<Option<Bytes>>,
        },
    }
}

impl<F: Future<Output = Option<Bytes>>> Future for RecordFuture<'_, F> {
    type Output = Option<Bytes>;

    fn poll(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        match self.project() {
            RecordProj::Store { store } => store.poll(cx),
            RecordProj::Rare { rare, body } => {
                std::task::ready!(rare.as_mut().poll(cx));
                std::task::Poll::Ready(body.take().flatten())
            }
        }
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

/// Of a record's trailers, what tells its outcome: the gRPC status, and its message where it
/// is short.
fn outcome_only(trailers: HeaderMap) -> HeaderMap {
    let mut kept = HeaderMap::new();
    if let Some(status) = trailers.get(&crate::dialect::grpc::STATUS) {
        kept.insert(crate::dialect::grpc::STATUS.clone(), status.clone());
    }
    if let Some(message) = trailers
        .get(&crate::dialect::grpc::MESSAGE)
        .filter(|m| m.len() <= 1024)
    {
        kept.insert(crate::dialect::grpc::MESSAGE.clone(), message.clone());
    }
    kept
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
