//! [`ResponseFuture`]: the future of [`Idempotency`](crate::Idempotency).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use http::Response;

use crate::body::ResponseBody;

type BoxFuture<B, E> = Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send>>;

/// The response future of [`Idempotency`](crate::Idempotency).
///
/// Dropping it (a client hanging up) does not cancel an execution that has begun: the rest
/// runs on in a task of its own and records its outcome.
pub struct ResponseFuture<B, E> {
    inner: Option<BoxFuture<B, E>>,
    detach: Option<Detach<B, E>>,
}

/// How a dropped response future hands its execution on.
struct Detach<B, E> {
    /// Set by the pipeline once the inner service has begun.
    started: Arc<AtomicBool>,
    /// Spawns the rest; a function made where the bounds a task needs are known.
    spawn: fn(BoxFuture<B, E>),
}

impl<B, E> ResponseFuture<B, E> {
    /// A future that is simply cancelled when dropped.
    pub(crate) fn new(
        future: impl Future<Output = Result<Response<ResponseBody<B>>, E>> + Send + 'static,
    ) -> Self {
        Self {
            inner: Some(Box::pin(future)),
            detach: None,
        }
    }

    /// A future that, dropped after `started` is set, runs to its end in its own task. The
    /// future is already on the heap, so handing it on moves a pointer: an execution needs no
    /// allocation of its own for the case where the client leaves.
    pub(crate) fn detachable(
        future: impl Future<Output = Result<Response<ResponseBody<B>>, E>> + Send + 'static,
        started: Arc<AtomicBool>,
    ) -> Self
    where
        B: Send + 'static,
        E: Send + 'static,
    {
        Self {
            inner: Some(Box::pin(future)),
            detach: Some(Detach {
                started,
                spawn: spawn_rest::<B, E>,
            }),
        }
    }
}

fn spawn_rest<B: Send + 'static, E: Send + 'static>(future: BoxFuture<B, E>) {
    // Without a runtime (it is shutting down) there is nothing to run on: the lease runs out
    // and the next claim decides, as for a process that died.
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            // The answer has no one left to go to; the outcome is recorded inside.
            drop(future.await);
        });
    }
}

impl<B, E> Future for ResponseFuture<B, E> {
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(inner) = self.inner.as_mut() else {
            // Polled after it finished: a caller bug that must not panic in a server.
            return Poll::Pending;
        };
        let out = inner.as_mut().poll(cx);
        if out.is_ready() {
            self.inner = None;
        }
        out
    }
}

impl<B, E> Drop for ResponseFuture<B, E> {
    fn drop(&mut self) {
        if let (Some(inner), Some(detach)) = (self.inner.take(), self.detach.take())
            && detach.started.load(Ordering::Acquire)
        {
            (detach.spawn)(inner);
        }
    }
}

impl<B, E> fmt::Debug for ResponseFuture<B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
