//! The pace of a write a holder tries again after its run: a record, a give-back, a key set
//! aside given back. Each try is bounded, so a call stuck on a connection is given up and
//! tried again instead of holding the lease, renewed, for ever; the pauses between tries grow
//! so that an outage is not hammered.
//!
//! A try on a task of its own ([`Retry::spawned`]) given up on at its bound is not dropped: it
//! runs on, in its room (see `room`).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::bounded::{Bounded, bounded};
use crate::store::{FencingToken, IdempotencyStore, ScopedKey, StoreError};
use crate::whose::{Whose, read_as};

use super::room::{self, Call, Room};

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
    /// Room for this write's calls on tasks of their own, made at the first of them.
    room: Option<Arc<Room>>,
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
            room: None,
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

    /// A try of `call` (a call of `what`) on a task of its own, counted once it starts, and
    /// bounded: waiting for a place in its room and then for its answer, it is given the same
    /// time as a try of [`bounded`](Self::bounded). When the bound runs out the try fails as
    /// unavailable, but its call is not dropped: it runs on in its place (see `room`), and what
    /// it answers then is heard late: a try of the same write waiting for a place, or the next
    /// one, takes that answer as its own instead of sending another (a write that always takes
    /// longer than its bound lands all the same, and is known to have landed).
    pub(super) async fn spawned<F, T>(&mut self, what: Call, call: F) -> Result<T, StoreError>
    where
        F: Future<Output = Result<T, StoreError>> + Send + 'static,
        T: Send + 'static,
    {
        let lease = self.lease;
        let room = Arc::clone(self.room.get_or_insert_with(|| Arc::new(Room::new(lease))));
        let tries = &mut self.tries;
        let answer = async move {
            let place = match room.place(what).await {
                Ok(place) => place,
                Err(late) => return late,
            };
            if what.writes() {
                *tries = tries.saturating_add(1);
            }
            match room::start(place, call).answer().await {
                // Fenced by a try given up on that landed meanwhile: that one's answer.
                Err(StoreError::Fenced) => room.landed(what).ok_or(StoreError::Fenced),
                answer => answer,
            }
        };
        bounded(self.each, answer).await
    }

    /// After a write was fenced: a read of whose the record of `key` is, made on a task of its
    /// own as [`spawned`](Self::spawned) makes a write, but neither counted as a try nor heard
    /// late (see [`crate::whose`]).
    pub(super) async fn whose<St: IdempotencyStore>(
        &mut self,
        store: &Arc<St>,
        key: &ScopedKey,
        token: FencingToken,
    ) -> Result<Whose, StoreError> {
        let (store, key) = (Arc::clone(store), key.clone());
        let read = async move { store.lookup(&key).await };
        Ok(read_as(self.spawned(Call::Lookup, read).await?, token))
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

    /// What [`Retry::spawned`]'s calls did: started, and ended by answering or by a drop.
    #[derive(Default)]
    struct Calls {
        started: std::sync::atomic::AtomicUsize,
        answered: std::sync::atomic::AtomicUsize,
        dropped: std::sync::atomic::AtomicUsize,
    }

    struct Unanswered(Arc<Calls>);

    impl Drop for Unanswered {
        fn drop(&mut self) {
            self.0
                .dropped
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// A call that answers `7` after `takes`.
    fn call(
        calls: &Arc<Calls>,
        takes: Duration,
    ) -> impl Future<Output = Result<u8, StoreError>> + use<> {
        let calls = Arc::clone(calls);
        async move {
            calls
                .started
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let unanswered = Unanswered(Arc::clone(&calls));
            tokio::time::sleep(takes).await;
            std::mem::forget(unanswered);
            calls
                .answered
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(7)
        }
    }

    /// DESIGN §4: a try given up on at its bound runs on and keeps its room; with two under
    /// way no third is sent, and the try fails as unavailable within its bound; once they
    /// answer, the next goes.
    #[tokio::test(start_paused = true)]
    async fn a_try_given_up_on_runs_on_and_keeps_its_room() {
        use std::sync::atomic::Ordering::SeqCst;
        let calls = Arc::new(Calls::default());
        let mut retry = Retry::new(Duration::from_secs(1));
        let slow = Duration::from_secs(10);
        let start = tokio::time::Instant::now();
        for _ in 0..2 {
            let answer = retry.spawned(Call::Complete, call(&calls, slow)).await;
            assert!(
                matches!(answer, Err(StoreError::Unavailable(_))),
                "{answer:?}"
            );
        }
        assert_eq!(
            start.elapsed(),
            Duration::from_secs(1),
            "half a second each"
        );
        let answer = retry
            .spawned(Call::Complete, call(&calls, Duration::ZERO))
            .await;
        assert!(
            matches!(answer, Err(StoreError::Unavailable(_))),
            "{answer:?}"
        );
        assert_eq!(calls.started.load(SeqCst), 2, "no room for a third");
        assert_eq!(retry.tries(), 2);
        tokio::time::sleep(slow).await;
        assert_eq!(
            calls.answered.load(SeqCst),
            2,
            "both given up on, both answered"
        );
        assert_eq!(calls.dropped.load(SeqCst), 0);
        // Their answer is heard late: the next try takes it instead of sending another.
        let answer = retry
            .spawned(Call::Complete, call(&calls, Duration::ZERO))
            .await;
        assert_eq!(answer.ok(), Some(7));
        assert_eq!((calls.started.load(SeqCst), retry.tries()), (2, 2));
        // Heard once: the one after sends a call.
        let answer = retry
            .spawned(Call::Complete, call(&calls, Duration::ZERO))
            .await;
        assert_eq!(answer.ok(), Some(7));
        assert_eq!((calls.started.load(SeqCst), retry.tries()), (3, 3));
    }

    /// Writes that hang hold their own room, not the reads': a read after a fence still goes.
    #[tokio::test(start_paused = true)]
    async fn reads_have_room_of_their_own() {
        let calls = Arc::new(Calls::default());
        let mut retry = Retry::new(Duration::from_secs(1));
        for _ in 0..3 {
            let answer = retry
                .spawned(Call::Complete, call(&calls, Duration::from_secs(60)))
                .await;
            assert!(answer.is_err(), "{answer:?}");
        }
        assert_eq!(calls.started.load(std::sync::atomic::Ordering::SeqCst), 2);
        let read = retry
            .spawned(Call::Lookup, call(&calls, Duration::ZERO))
            .await;
        assert_eq!(read.ok(), Some(7));
    }

    /// A call that ends while the next try waits for its place: a write's answer is heard
    /// late and taken (no third call sent); a read's is not, and the next read is sent then,
    /// within its own bound.
    #[tokio::test(start_paused = true)]
    async fn a_try_waiting_for_its_place_goes_when_a_call_ends() {
        for (what, sent) in [(Call::Complete, 2), (Call::Lookup, 3)] {
            let calls = Arc::new(Calls::default());
            let mut retry = Retry::new(Duration::from_secs(1));
            for takes in [Duration::from_millis(1100), Duration::from_secs(60)] {
                let answer = retry.spawned(what, call(&calls, takes)).await;
                assert!(answer.is_err(), "{answer:?}");
            }
            // The first ends 100 ms into this try's bound of half a second.
            let answer = retry.spawned(what, call(&calls, Duration::ZERO)).await;
            assert_eq!(answer.ok(), Some(7), "{what:?}");
            let started = calls.started.load(std::sync::atomic::Ordering::SeqCst);
            assert_eq!(started, sent, "{what:?}");
        }
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
