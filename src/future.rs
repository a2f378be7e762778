//! [`ResponseFuture`]: the future of [`Idempotency`](crate::Idempotency).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;
use tracing::Instrument;

use crate::body::ResponseBody;

pub(crate) type BoxFuture<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send>>;

/// Where steps 1–6 of the pipeline lead.
#[expect(
    clippy::large_enum_variant,
    reason = "a value moved once, right away; boxing would allocate for every replay"
)]
pub(crate) enum Step<B, E> {
    /// The answer, without running the inner service (a replay, a refusal).
    Answer(Result<Response<ResponseBody<B>>, E>),
    /// Running the inner service: to completion (`detach`) or cancelled with the request.
    Run { run: BoxFuture<B, E>, detach: bool },
}

type BoxStep<B, E> = Pin<Box<dyn Future<Output = Step<B, E>> + Send>>;

/// The response future of [`Idempotency`](crate::Idempotency).
///
/// Dropping it (a client hanging up) does not cancel an execution that has begun: the rest
/// runs on in a task of its own and records its outcome.
pub struct ResponseFuture<B, E> {
    state: State<B, E>,
    /// Spawns an execution whose client left; made where the bounds a task needs are known.
    spawn: fn(BoxFuture<B, E>, tracing::Span),
    /// Entered while polling, so the boxed futures need not carry it.
    span: tracing::Span,
}

/// Two futures rather than one: replays and refusals, which never run the inner service,
/// allocate only the small first one.
enum State<B, E> {
    Deciding(BoxStep<B, E>),
    Running { run: BoxFuture<B, E>, detach: bool },
    Done,
}

impl<B, E> ResponseFuture<B, E>
where
    B: Send + 'static,
    E: Send + 'static,
{
    /// A future that runs `future` and is cancelled with the request.
    pub(crate) fn new(
        future: impl Future<Output = Result<Response<ResponseBody<B>>, E>> + Send + 'static,
    ) -> Self {
        Self {
            state: State::Running {
                run: Box::pin(future),
                detach: false,
            },
            spawn: spawn_rest::<B, E>,
            span: tracing::Span::none(),
        }
    }

    /// A future that decides with `decide`, then answers or runs what it says to run; both
    /// are polled inside `span`.
    pub(crate) fn deciding(
        decide: impl Future<Output = Step<B, E>> + Send + 'static,
        span: tracing::Span,
    ) -> Self {
        Self {
            state: State::Deciding(Box::pin(decide)),
            spawn: spawn_rest::<B, E>,
            span,
        }
    }
}

fn spawn_rest<B: Send + 'static, E: Send + 'static>(run: BoxFuture<B, E>, span: tracing::Span) {
    // Without a runtime (it is shutting down) there is nothing to run on: the lease runs out
    // and the next claim decides, as for a process that died.
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            crate::detached::spawn(
                &runtime,
                async move {
                    // The answer has no one left to go to; the outcome is recorded inside.
                    drop(run.await);
                }
                // On its own task it is polled inside its span as it was here.
                .instrument(span),
            );
        }
        // Dropped here, inside its span, as it would have been polled.
        Err(_) => {
            let _entered = span.enter();
            drop(run);
        }
    }
}

impl<B, E> Future for ResponseFuture<B, E> {
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let _entered = this.span.enter();
        loop {
            match &mut this.state {
                State::Deciding(decide) => match decide.as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Step::Answer(answer)) => {
                        this.state = State::Done;
                        return Poll::Ready(answer);
                    }
                    Poll::Ready(Step::Run { run, detach }) => {
                        this.state = State::Running { run, detach };
                    }
                },
                State::Running { .. } => {
                    // Taken out while it is polled: should a poll panic, the state is `Done`,
                    // so `Drop` never hands a panicked future on to be polled again.
                    let State::Running { mut run, detach } =
                        std::mem::replace(&mut this.state, State::Done)
                    else {
                        return Poll::Pending;
                    };
                    return match run.as_mut().poll(cx) {
                        Poll::Pending => {
                            this.state = State::Running { run, detach };
                            Poll::Pending
                        }
                        Poll::Ready(answer) => Poll::Ready(answer),
                    };
                }
                // Polled after it finished: a caller bug that must not panic in a server.
                State::Done => return Poll::Pending,
            }
        }
    }
}

impl<B, E> Drop for ResponseFuture<B, E> {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.state, State::Done) {
            // The future is already on the heap: handing it on moves a pointer, nothing else.
            State::Running { run, detach: true } => (self.spawn)(run, self.span.clone()),
            // Dropped unfinished: inside its span, as it was polled (what it does on drop, such
            // as giving a key back, is traced with the request).
            unfinished @ (State::Deciding(_) | State::Running { .. }) => {
                let _entered = self.span.enter();
                drop(unfinished);
            }
            State::Done => {}
        }
    }
}

impl<B, E> fmt::Debug for ResponseFuture<B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            State::Deciding(_) => "deciding",
            State::Running { .. } => "running",
            State::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish_non_exhaustive()
    }
}

#[cfg(all(test, feature = "memory", feature = "axum"))]
impl<B, E> ResponseFuture<B, E> {
    /// Bytes of the state machine this future keeps on the heap in its current state.
    fn heap_size(&self) -> usize {
        match &self.state {
            State::Deciding(decide) => std::mem::size_of_val(&**decide),
            State::Running { run, .. } => std::mem::size_of_val(&**run),
            State::Done => 0,
        }
    }
}

#[cfg(all(test, feature = "memory", feature = "axum"))]
mod tests {
    use std::convert::Infallible;

    use axum::body::Body;
    use tower::util::BoxCloneSyncService;
    use tower::{Layer, Service, ServiceExt};

    use crate::body::RequestBody;
    use crate::{IdempotencyLayer, MemoryStore};

    type Inner =
        BoxCloneSyncService<http::Request<RequestBody<Body>>, http::Response<Body>, Infallible>;

    /// The cost of a replay (BENCHMARKS.md): a request answered without running its handler
    /// allocates one future, which must stay within glibc's per-thread cache (requests of at
    /// most 1032 bytes); anything held across an `.await` in `Pipeline::run` grows it. The
    /// inner service is boxed as axum boxes each route (`Router::layer` wraps routes), and
    /// this future's layout comes out the same in debug and release builds.
    #[tokio::test]
    async fn the_deciding_future_fits_the_allocators_thread_cache() {
        let app = axum::Router::new().route(
            "/t",
            axum::routing::post(|body: bytes::Bytes| async move { body.len().to_string() }),
        );
        let mut service = IdempotencyLayer::new(MemoryStore::new())
            .single_tenant()
            .layer(Inner::new(app));
        let request = http::Request::post("/t")
            .header("idempotency-key", "k")
            .header("content-type", "application/json")
            .body(Body::from(r#"{"a":1}"#))
            .expect("request");
        let ready = ServiceExt::<http::Request<Body>>::ready(&mut service);
        let future = ready.await.expect("ready").call(request);
        let size = future.heap_size();
        assert!(size <= 1032, "the deciding future takes {size} bytes");
        assert!(future.await.expect("response").status().is_success());
    }
}
