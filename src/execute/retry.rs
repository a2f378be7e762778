//! The pace of a write a holder tries again after its run: a record, a give-back, a key set
//! aside given back. Each try is bounded, so a call stuck on a connection is given up and
//! tried again instead of holding the lease, renewed, for ever; the pauses between tries grow
//! so that an outage is not hammered.

use std::future::Future;
use std::time::Duration;

use crate::bounded::{Bounded, bounded};
use crate::store::StoreError;

/// The first pause between two tries.
const FIRST_PAUSE: Duration = Duration::from_millis(10);

/// The longest pause between two tries.
const MAX_PAUSE: Duration = Duration::from_secs(1);

/// One write's tries: how long the next is given and how long to wait before it.
pub(super) struct Retry {
    /// The holder's lease, from which the bounds are reckoned.
    lease: Duration,
    /// How long the next try is given.
    each: Duration,
    /// How long to wait before the next try.
    pause: Duration,
    /// Tries made so far.
    tries: u32,
}

impl Retry {
    /// A write under a lease of `lease`, not tried yet. Its first try gets half the lease, at
    /// least 100 ms; each later one twice the last, up to four leases, so that a store always
    /// slower than half a lease still lands a write in the end.
    pub(super) fn new(lease: Duration) -> Self {
        Self {
            lease,
            each: (lease / 2).max(Duration::from_millis(100)),
            pause: FIRST_PAUSE,
            tries: 0,
        }
    }

    /// The lease the bounds are reckoned from.
    pub(super) fn lease(&self) -> Duration {
        self.lease
    }

    /// How long the next try is given (also what a call made alongside it is given).
    pub(super) fn each(&self) -> Duration {
        self.each
    }

    /// Tries made so far.
    pub(super) fn tries(&self) -> u32 {
        self.tries
    }

    /// A try of `call`, bounded, and counted.
    pub(super) fn bounded<F, T>(&mut self, call: F) -> Bounded<F>
    where
        F: Future<Output = Result<T, StoreError>>,
    {
        self.tries = self.tries.saturating_add(1);
        bounded(self.each, call)
    }

    /// Waits before the next try, no longer than `at_most`; the pause after it and the try's
    /// bound grow.
    pub(super) async fn pause(&mut self, at_most: Duration) {
        tokio::time::sleep(self.pause.min(at_most)).await;
        self.grow();
    }

    /// The next pause twice the last, up to [`MAX_PAUSE`]; the next try's bound twice the
    /// last, up to four leases.
    fn grow(&mut self) {
        self.pause = (self.pause * 2).min(MAX_PAUSE);
        self.each = self
            .each
            .saturating_mul(2)
            .min(self.lease.saturating_mul(4));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_try_gets_half_a_lease_and_at_least_100_ms() {
        assert_eq!(
            Retry::new(Duration::from_secs(30)).each(),
            Duration::from_secs(15)
        );
        assert_eq!(
            Retry::new(Duration::from_millis(50)).each(),
            Duration::from_millis(100)
        );
    }

    #[test]
    fn later_tries_get_longer_up_to_four_leases_and_pauses_up_to_a_second() {
        let mut retry = Retry::new(Duration::from_millis(400));
        let (mut bounds, mut pauses) = (Vec::new(), Vec::new());
        for _ in 0..10 {
            bounds.push(retry.each().as_millis());
            pauses.push(retry.pause.as_millis());
            retry.grow();
        }
        assert_eq!(
            bounds,
            [200, 400, 800, 1600, 1600, 1600, 1600, 1600, 1600, 1600]
        );
        assert_eq!(pauses, [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000]);
    }

    #[tokio::test]
    async fn a_pause_is_cut_short_by_its_limit_and_grows_what_follows() {
        let mut retry = Retry::new(Duration::from_secs(1));
        retry.pause = Duration::from_secs(3600);
        retry.pause(Duration::from_millis(1)).await;
        assert_eq!(retry.pause, MAX_PAUSE);
        assert_eq!(retry.each(), Duration::from_secs(1));
    }

    #[tokio::test]
    async fn tries_are_counted() {
        let mut retry = Retry::new(Duration::from_secs(1));
        assert_eq!(retry.tries(), 0);
        let ok = retry.bounded(async { Ok::<_, StoreError>(()) }).await;
        assert!(ok.is_ok());
        let failed = retry
            .bounded(async { Err::<(), _>(StoreError::Fenced) })
            .await;
        assert!(matches!(failed, Err(StoreError::Fenced)));
        assert_eq!(retry.tries(), 2);
    }
}
