//! Work the layer finishes after its request is gone: a run whose client hung up (it runs to
//! completion), an answer's body read to its end and recorded after its client left, a write
//! after a run tried again until it lands, a key given back. It runs on
//! tasks of their own, which a graceful shutdown of the server does not wait for: a runtime
//! dropped under them ends them as a crash would, and a retry after the restart may run the
//! key again. [`finished`] waits for them.
//!
//! ```no_run
//! # async fn serve(listener: tokio::net::TcpListener, app: axum::Router) {
//! axum::serve(listener, app)
//!     .with_graceful_shutdown(async { let _ = tokio::signal::ctrl_c().await; })
//!     .await
//!     .expect("serve");
//! // The connections are closed; runs whose clients left may still be at work.
//! tower_idempotency::detached::finished().await;
//! # }
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

static RUNNING: AtomicUsize = AtomicUsize::new(0);
static IDLE: Notify = Notify::const_new();

/// Waits until no work the layer detached from its requests is left, in this process: every
/// run whose client left has recorded its outcome (or given its key back), every write after a
/// run has landed or given up. Call it after the server's graceful shutdown, before the runtime
/// ends; bound it with a timeout of your own (a write to a store that is down is tried until
/// the store answers: a record until it lands, a give-back until it lands or a read shows the
/// key is no longer its holder's).
pub async fn finished() {
    loop {
        // Made before the count is read: a wake-up between the two is not lost.
        let idle = IDLE.notified();
        if RUNNING.load(Ordering::Acquire) == 0 {
            return;
        }
        idle.await;
    }
}

/// How many pieces of such work are under way in this process now.
pub fn running() -> usize {
    RUNNING.load(Ordering::Acquire)
}

/// Spawns `work` on `runtime`, counted as detached work until it ends or its task is dropped
/// with the runtime.
pub(crate) fn spawn<F>(
    runtime: &tokio::runtime::Handle,
    work: F,
) -> tokio::task::JoinHandle<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let counted = Detached::begin();
    runtime.spawn(async move {
        let out = work.await;
        drop(counted);
        out
    })
}

/// One piece of detached work, counted while this value lives (its task dropped with the
/// runtime drops it too).
struct Detached(());

impl Detached {
    fn begin() -> Self {
        RUNNING.fetch_add(1, Ordering::AcqRel);
        Self(())
    }
}

impl Drop for Detached {
    fn drop(&mut self) {
        if RUNNING.fetch_sub(1, Ordering::AcqRel) == 1 {
            IDLE.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    /// README (fault table, graceful shutdown): work that panics is no longer running. Its
    /// count drops as its task unwinds, or [`super::finished`] would wait for it forever.
    #[tokio::test]
    async fn work_that_panics_is_counted_out() {
        let runtime = tokio::runtime::Handle::current();
        let mut panicked = 0;
        for _ in 0..3 {
            let task = super::spawn(&runtime, async {
                tokio::task::yield_now().await;
                panic!("a detached run that panics");
            });
            panicked += usize::from(task.await.is_err_and(|e| e.is_panic()));
        }
        assert_eq!(panicked, 3);
        // Other tests of this binary may detach work of their own meanwhile: it ends too.
        tokio::time::timeout(Duration::from_secs(30), super::finished())
            .await
            .expect("finished() returns once the panicked work is counted out");
    }
}
