//! [`Execution::run`]'s future, written as a state machine by hand: what calling the handler
//! needs (the request, the service) and what recording its answer needs (the recording's own
//! future) share their room. An `async` body keeps its arguments and upvars for its whole
//! life, which put the two side by side: 2 016 bytes, above glibc's per-thread cache, so every
//! unique-key request allocated and freed it through the allocator's slow bins.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http::Response;
use pin_project_lite::pin_project;
use tokio::task::JoinHandle;
use tower_service::Service;
use tracing::Instrument;

use super::{Answered, Execution, Panic, ReleaseOnDrop, failed};
use crate::body::ResponseBody;
use crate::dialect::Dialect;
use crate::hold::Hold;
use crate::observe::{self, Event};
use crate::store::IdempotencyStore;
use crate::window::Timing;

pin_project! {
    /// Calls `inner` on `req` under a held lease, then records its answer with `finish`
    /// (`Execution::finish`, passed in so its future's type can be named here).
    #[project = RunProj]
    #[project_replace = RunOwned]
    pub(crate) enum Run<St: IdempotencyStore, C, F, Fin, O> {
        /// The handler runs.
        Calling {
            #[pin]
            call: Call<C>,
            execution: Execution<St>,
            hold: Hold<St>,
            timing: Timing,
            cancel: Option<ReleaseOnDrop<St>>,
            finish: F,
        },
        /// Its answer is read and recorded here.
        Finishing {
            #[pin]
            finish: Fin,
        },
        /// Its answer is read and recorded on a task of its own, which a hang-up cannot drop.
        Detached {
            handle: JoinHandle<O>,
            dialect: Dialect,
        },
        Done,
    }
}

impl<St, C, B, E, F, Fin> Future for Run<St, C, F, Fin, Result<Response<ResponseBody<B>>, E>>
where
    St: IdempotencyStore,
    C: Future<Output = Result<Response<B>, E>>,
    E: Send + 'static,
    B: Send + 'static,
    F: FnOnce(Execution<St>, Answered<B, E>, Hold<St>, Timing) -> Fin,
    Fin: Future<Output = Result<Response<ResponseBody<B>>, E>> + Send + 'static,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            match self.as_mut().project() {
                RunProj::Calling { call, .. } => {
                    let answered =
                        match std::panic::catch_unwind(AssertUnwindSafe(|| call.poll(cx))) {
                            Ok(Poll::Pending) => return Poll::Pending,
                            Ok(Poll::Ready(answer)) => Ok(answer),
                            Err(panic) => Err(panic),
                        };
                    if let RunOwned::Calling {
                        execution,
                        hold,
                        timing,
                        cancel,
                        finish,
                        ..
                    } = self.as_mut().project_replace(Run::Done)
                    {
                        let next =
                            Self::answered(execution, answered, hold, timing, cancel, finish);
                        self.set(next);
                    }
                }
                RunProj::Finishing { finish } => {
                    let answer = ready!(finish.poll(cx));
                    self.set(Run::Done);
                    return Poll::Ready(answer);
                }
                RunProj::Detached { handle, dialect } => {
                    let answer = match ready!(Pin::new(handle).poll(cx)) {
                        Ok(answer) => answer,
                        Err(_) => Ok(failed(
                            "recording the outcome failed",
                            "in_progress",
                            dialect,
                        )),
                    };
                    self.set(Run::Done);
                    return Poll::Ready(answer);
                }
                // Polled after it finished: a caller bug that must not panic in a server.
                RunProj::Done => return Poll::Pending,
            }
        }
    }
}

impl<St, C, F, Fin, O> Run<St, C, F, Fin, O>
where
    St: IdempotencyStore,
    C: Future,
    F: FnOnce(Execution<St>, Result<C::Output, Panic>, Hold<St>, Timing) -> Fin,
    Fin: Future<Output = O> + Send + 'static,
    O: Send + 'static,
{
    /// Calls `inner` on `req`: made where the request's future is polled, and polled at once
    /// (a run is only made to be polled), so nothing is held nor has run unless it is.
    pub(crate) fn new<S, Req>(
        execution: Execution<St>,
        mut inner: S,
        req: Req,
        cancel: Option<ReleaseOnDrop<St>>,
        finish: F,
    ) -> Self
    where
        S: Service<Req, Future = C>,
    {
        observe::count(Event::Execution);
        // From before the handler's first poll to the recorded outcome: renewed on the keeper's
        // task, which a handler blocking its own thread cannot starve.
        let hold = execution.hold();
        // Into the route's window however the execution ends (see `finish`).
        let timing = Timing::start(execution.route.window.clone());
        // A service may do work (and panic) in `call` itself. The service goes once called: its
        // future owns what it needs, as with tower's `Oneshot`.
        // The service is dropped inside the catch too: its `Drop` is code the layer does not own.
        let called = std::panic::catch_unwind(AssertUnwindSafe(move || {
            let call = inner.call(req);
            drop(inner);
            call
        }));
        match called {
            Ok(call) => Run::Calling {
                call: Call::Running { call },
                execution,
                hold,
                timing,
                cancel,
                finish,
            },
            Err(panic) => Self::answered(execution, Err(panic), hold, timing, cancel, finish),
        }
    }

    /// The handler answered (or panicked): record it here, or, on routes that cancel on a
    /// hang-up, on a task of its own, since the answer means its effect happened.
    fn answered(
        execution: Execution<St>,
        answered: Result<C::Output, Panic>,
        hold: Hold<St>,
        timing: Timing,
        cancel: Option<ReleaseOnDrop<St>>,
        finish: F,
    ) -> Self {
        let Some(cancel) = cancel else {
            return Run::Finishing {
                finish: finish(execution, answered, hold, timing),
            };
        };
        cancel.disarm();
        let dialect = execution.dialect.clone();
        let finishing = finish(execution, answered, hold, timing).in_current_span();
        let handle = crate::detached::spawn(&tokio::runtime::Handle::current(), finishing);
        Run::Detached { handle, dialect }
    }
}

pin_project! {
    /// The handler's future, dropped as soon as it answers, inside the poll that read the
    /// answer: a panic in its `Drop` is caught with the poll's (as an `async` block's `.await`
    /// drops what it awaited), never between the answer and its recording.
    #[project = CallProj]
    pub(crate) enum Call<C> {
        Running {
            #[pin]
            call: C,
        },
        Answered,
    }
}

impl<C: Future> Future for Call<C> {
    type Output = C::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.as_mut().project() {
            CallProj::Running { call } => {
                let answer = ready!(call.poll(cx));
                self.set(Call::Answered);
                Poll::Ready(answer)
            }
            // Polled after it answered: never, as `Run` moves on at once.
            CallProj::Answered => Poll::Pending,
        }
    }
}
