//! Requests that wait for an in-flight key (`wait_for_in_flight`), woken when its record moves
//! on rather than polling the store.

use std::time::{Duration, SystemTime};

use super::FencingToken;

/// What a waiting request saw of a record in flight, for
/// [`IdempotencyStore::wait_for_change`](super::IdempotencyStore::wait_for_change).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InFlight {
    /// The holder's token: a record with another one has moved on (taken over, resolved).
    pub token: FencingToken,
    /// When the holder's lease ends, on the store's clock.
    pub lease_until: SystemTime,
    /// The store's clock when the record was read.
    pub now: SystemTime,
}

impl InFlight {
    /// How long the holder's lease had left when the record was read.
    pub fn lease_left(&self) -> Duration {
        self.lease_until
            .duration_since(self.now)
            .unwrap_or_default()
    }
}

/// The polling wait of round `round`, at most `within`: what a store that cannot be told of
/// changes waits (the trait's default, SQLite, a subscription that is down).
pub(crate) fn poll(round: u32, within: Duration) -> tokio::time::Sleep {
    tokio::time::sleep(poll_backoff(round).min(within))
}

/// The polling pause of round `round`: 10 ms, doubling up to 250 ms.
pub(crate) fn poll_backoff(round: u32) -> Duration {
    Duration::from_millis(10u64 << round.min(5)).min(Duration::from_millis(250))
}

/// A little past the lease's end, so the claim that follows finds it over.
#[cfg(any(feature = "memory", feature = "redis", feature = "postgres"))]
const PAST_LEASE: Duration = Duration::from_millis(5);

#[cfg(any(feature = "memory", feature = "redis", feature = "postgres"))]
pub(crate) use registry::Waiters;

#[cfg(any(feature = "memory", feature = "redis", feature = "postgres"))]
mod registry {
    use std::collections::HashMap;
    use std::future::Future;
    use std::hash::Hash;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use tokio::sync::Notify;

    use super::{InFlight, PAST_LEASE};

    /// The requests waiting on keys of one store, by key: a change wakes the waiters of its
    /// key. A store with no waiter pays one atomic load per change.
    pub(crate) struct Waiters<K> {
        count: AtomicUsize,
        keys: Mutex<HashMap<K, Arc<Notify>>>,
    }

    impl<K> Default for Waiters<K> {
        fn default() -> Self {
            Self {
                count: AtomicUsize::new(0),
                keys: Mutex::new(HashMap::new()),
            }
        }
    }

    impl<K: Hash + Eq + Clone> Waiters<K> {
        /// Wakes the waiters of `key`: its record has just moved on.
        pub(crate) fn wake(&self, key: &K) {
            // Ordered after the record's change: a waiter that registered before it is seen
            // here, one that registers after it sees the change when it checks.
            if self.count.load(Ordering::SeqCst) == 0 {
                return;
            }
            if let Some(notify) = self.lock().get(key) {
                notify.notify_waiters();
            }
        }

        /// Wakes every waiter: changes may have been missed (a lost subscription).
        #[cfg(any(feature = "redis", feature = "postgres"))]
        pub(crate) fn wake_all(&self) {
            for notify in self.lock().values() {
                notify.notify_waiters();
            }
        }

        fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<K, Arc<Notify>>> {
            // A waiter that panicked while holding it left a map that is still whole.
            self.keys
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
        }

        /// Waits until `key` is woken, its holder's lease (`seen`) is over, or `within`
        /// passes; at once if `moved_on` (checked after registering, so no change between the
        /// caller's claim and this wait is missed) says the record already moved on.
        pub(crate) async fn wait(
            &self,
            key: &K,
            seen: &InFlight,
            within: Duration,
            moved_on: impl Future<Output = bool>,
        ) {
            // The bound counts from here: the check below may itself wait (a store's turn at
            // its pool), and the wait after it is what is left, never `within` again.
            let since = tokio::time::Instant::now();
            let notify = self.lock().entry(key.clone()).or_default().clone();
            self.count.fetch_add(1, Ordering::SeqCst);
            let _registered = Registered {
                waiters: self,
                key,
                notify: &notify,
            };
            let notified = notify.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if moved_on.await {
                return;
            }
            let until = within
                .min(seen.lease_left() + PAST_LEASE)
                .saturating_sub(since.elapsed());
            let _ = tokio::time::timeout(until, notified).await;
        }
    }

    /// A waiter's place, given up when it stops waiting (woken, timed out, or dropped with a
    /// client that hung up).
    struct Registered<'a, K: Hash + Eq> {
        waiters: &'a Waiters<K>,
        key: &'a K,
        notify: &'a Arc<Notify>,
    }

    impl<K: Hash + Eq> Drop for Registered<'_, K> {
        fn drop(&mut self) {
            self.waiters.count.fetch_sub(1, Ordering::SeqCst);
            let mut keys = self
                .waiters
                .keys
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            // The map's handle and this one: no other waiter on the key.
            if Arc::strong_count(self.notify) == 2 {
                keys.remove(self.key);
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use std::time::SystemTime;

        use super::super::super::FencingToken;
        use super::*;

        #[tokio::test]
        async fn a_waiter_is_woken_by_its_key_and_leaves_nothing_behind() {
            use std::sync::Arc;
            let waiters: Arc<Waiters<String>> = Arc::default();
            let now = SystemTime::now();
            let seen = InFlight {
                token: FencingToken::new(1),
                lease_until: now + Duration::from_secs(60),
                now,
            };
            let w = waiters.clone();
            let waiting = tokio::spawn(async move {
                let started = tokio::time::Instant::now();
                w.wait(&"k".to_owned(), &seen, Duration::from_secs(60), async {
                    false
                })
                .await;
                started.elapsed()
            });
            // Another key's change wakes no one; this key's does.
            while waiters.count.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                tokio::task::yield_now().await;
            }
            waiters.wake(&"other".to_owned());
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert!(!waiting.is_finished(), "woken by another key");
            // Registered is not yet listening: woken until it has heard.
            while !waiting.is_finished() {
                waiters.wake(&"k".to_owned());
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let waited = waiting.await.expect("waiter");
            assert!(waited < Duration::from_secs(60), "woken, not timed out");
            assert!(waiters.lock().is_empty(), "nothing left registered");
            assert_eq!(waiters.count.load(std::sync::atomic::Ordering::SeqCst), 0);
        }

        /// DESIGN §4 (a waiter's bound): the check that the record moved on may itself wait
        /// (a store's turn at its pool); the wait after it is what is left of the bound, never
        /// the whole bound again. On the paused clock: a 100 ms bound whose check takes 40 ms
        /// ends at 100 ms; one whose check takes 150 ms ends with the check.
        #[tokio::test(start_paused = true)]
        async fn a_slow_check_counts_toward_the_bound() {
            let waiters: Waiters<String> = Waiters::default();
            let now = SystemTime::now();
            let seen = InFlight {
                token: FencingToken::new(1),
                lease_until: now + Duration::from_secs(60),
                now,
            };
            for (check, ends) in [(40, 100), (150, 150)] {
                let started = tokio::time::Instant::now();
                let moved_on = async {
                    tokio::time::sleep(Duration::from_millis(check)).await;
                    false
                };
                waiters
                    .wait(&"k".to_owned(), &seen, Duration::from_millis(100), moved_on)
                    .await;
                assert_eq!(
                    started.elapsed(),
                    Duration::from_millis(ends),
                    "a check of {check} ms"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_poll_backs_off_to_250_ms() {
        let rounds: Vec<u64> = (0..8).map(|r| poll_backoff(r).as_millis() as u64).collect();
        assert_eq!(rounds, [10, 20, 40, 80, 160, 250, 250, 250]);
    }
}
