//! A store's one subscription to the changes its records announce (PostgreSQL's `LISTEN`,
//! Redis's pub/sub): started by the first request that waits for a key in flight, up or down,
//! and marked down whenever its task ends, so the next waiter starts another.

use std::future::Future;
use std::hash::Hash;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use super::Waiters;

/// The waiters of one store and the state of the subscription that wakes them. While it is
/// down, waiters poll.
pub(crate) struct Subscription<K> {
    pub(crate) waiters: Waiters<K>,
    /// A task keeping the subscription up has been started and has not ended.
    started: AtomicBool,
    /// The subscription is up: changes are heard.
    live: AtomicBool,
}

impl<K> std::fmt::Debug for Subscription<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription")
            .field("live", &self.live)
            .finish_non_exhaustive()
    }
}

impl<K: Hash + Eq + Clone> Subscription<K> {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            waiters: Waiters::default(),
            started: AtomicBool::new(false),
            live: AtomicBool::new(false),
        })
    }

    /// Whether the subscription is up; on first use (or once its task has ended), starts
    /// `listen` on the current runtime, handing it a weak handle (it ends once the store is
    /// gone) and the guard that marks the subscription down when the task ends.
    pub(crate) fn subscribed<F>(
        self: &Arc<Self>,
        listen: impl FnOnce(Weak<Self>, Running<K>) -> F,
    ) -> bool
    where
        F: Future<Output = ()> + Send + 'static,
    {
        if !self.started.swap(true, Ordering::SeqCst) {
            // Made before the task and moved into it: a task dropped before its first poll
            // (its runtime shutting down) marks the subscription down too, where a guard made
            // inside it never would, and waiters would poll for good.
            let running = Running(Arc::downgrade(self));
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(listen(Arc::downgrade(self), running));
            }
        }
        self.live.load(Ordering::SeqCst)
    }

    /// The subscription is up: every waiter looks again (a change may have come before).
    pub(crate) fn up(&self) {
        self.live.store(true, Ordering::SeqCst);
        self.waiters.wake_all();
    }

    /// The subscription is down (changes may have been missed): every waiter looks again,
    /// and polls until it is back.
    pub(crate) fn down(&self) {
        self.live.store(false, Ordering::SeqCst);
        self.waiters.wake_all();
    }
}

/// Marks a subscription down, and its task ended, when dropped with the task (ended for any
/// reason, or dropped unpolled).
pub(crate) struct Running<K: Hash + Eq + Clone>(Weak<Subscription<K>>);

impl<K: Hash + Eq + Clone> Drop for Running<K> {
    fn drop(&mut self) {
        if let Some(subscription) = self.0.upgrade() {
            // Down first: once `started` is clear a new task may start and come up, which a
            // `down` after it would undo (waiters would poll while it is up).
            subscription.down();
            subscription.started.store(false, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn current_thread() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
    }

    /// DESIGN §5 (stores wake waiters when a record changes; while the subscription is down,
    /// waiters poll): a subscription's task dropped before its first poll (its runtime
    /// shutting down) is marked ended, so the next waiter, on another runtime, starts another.
    /// Before, PostgreSQL's and Redis's guards were made inside their tasks: `started` stayed
    /// set, and waiters polled for good.
    #[test]
    fn a_task_dropped_before_it_ran_is_started_again() {
        let subscription = Subscription::<Vec<u8>>::new();
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let listen = |runs: Arc<std::sync::atomic::AtomicUsize>| {
            move |weak: Weak<Subscription<Vec<u8>>>, running: Running<Vec<u8>>| async move {
                let _running = running;
                runs.fetch_add(1, Ordering::SeqCst);
                if let Some(subscription) = weak.upgrade() {
                    subscription.up();
                }
                std::future::pending::<()>().await;
            }
        };
        let doomed = current_thread();
        // Spawned, never polled: `block_on` returns on its own future's first poll.
        let live = doomed.block_on(async { subscription.subscribed(listen(runs.clone())) });
        assert!(!live, "not up yet");
        assert!(subscription.started.load(Ordering::SeqCst));
        drop(doomed);
        assert_eq!(runs.load(Ordering::SeqCst), 0, "the task never ran");
        assert!(
            !subscription.started.load(Ordering::SeqCst),
            "the dropped task marked the subscription ended"
        );
        // The next waiter starts one again, which comes up; a waiter after it starts none.
        let next = current_thread();
        next.block_on(async {
            subscription.subscribed(listen(runs.clone()));
            tokio::task::yield_now().await;
            assert!(subscription.subscribed(listen(runs.clone())), "up");
            // A task wrongly started by the second would have run by now.
            tokio::task::yield_now().await;
        });
        assert_eq!(runs.load(Ordering::SeqCst), 1, "one task started");
        drop(next);
        assert!(
            !subscription.live.load(Ordering::SeqCst),
            "down with its task"
        );
        assert!(!subscription.started.load(Ordering::SeqCst));
    }
}
