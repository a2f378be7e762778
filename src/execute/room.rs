//! The room of one write's calls, each on a task of its own (see `retry`): how many of a call
//! may be under way at once, and the answer of one given up on, heard late.
//!
//! A call given up on at its try's bound is not dropped: dropping frees nothing that matters
//! (sqlx keeps a connection dropped mid-statement until the statement ends, behind a held lock
//! for as long as it is held) and loses a place in the pool's queue. So it runs on, and keeps a
//! place: at most [`UNDER_WAY`] of a call are under way at once, and a store that hangs every
//! call is not sent one more, on one more connection, at every bound. As the keeper's renewals
//! (`hold.rs`), a call with no answer for a lease (at least 30 s) no longer holds up the next,
//! but still counts toward [`IN_ALL`]; one with no answer for [`ABANDONED_AFTER`] more (a call
//! on a link that died, waiting for an answer that never comes) is dropped and no longer counts
//! at all, so the write goes on once its store is back however its old calls ended.

use std::any::Any;
use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{Notify, oneshot};
use tracing::Instrument;

use crate::store::StoreError;

/// At most this many calls of one kind are under way at once, those given up on aside.
const UNDER_WAY: usize = 2;

/// At most this many calls of one kind are under way at once, those given up on included
/// (those dropped after [`ABANDONED_AFTER`] more aside).
const IN_ALL: usize = 4;

/// How long a call given up on may go on unanswered before it is dropped and no longer counts
/// toward [`IN_ALL`]: about as long as a kernel takes to give up a link that died with data in
/// flight (and a link with none in flight, which sqlx's connections are not kept alive to
/// notice, never ends).
const ABANDONED_AFTER: Duration = Duration::from_secs(15 * 60);

/// Which call of a write's tries: each has room of its own (a release that hangs must not keep
/// the settling of a key set aside from going), and a late answer is only ever taken by a try
/// of the same call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Call {
    Complete,
    Release,
    Resolve,
    /// A read after a fence: never heard late (it is stale by then), nor counted as a try.
    Lookup,
}

impl Call {
    const ALL: usize = 4;

    fn index(self) -> usize {
        self as usize
    }

    /// Whether this is a write: heard late, and counted as a try.
    pub(super) fn writes(self) -> bool {
        !matches!(self, Call::Lookup)
    }
}

/// The calls of one kind under way, and the answer of one given up on.
#[derive(Default)]
struct Places {
    /// Not yet given up on.
    under_way: usize,
    /// Given up on, not yet dropped.
    given_up: usize,
    /// The answer of a call nobody waited for any more.
    late: Option<Late>,
}

/// What a write's call nobody waited for any more answered, if it tells something.
enum Late {
    /// It landed: its `T`, the call's own.
    Landed(Box<dyn Any + Send>),
    /// It was fenced.
    Fenced,
}

/// The room of one write's calls.
pub(super) struct Room {
    places: Mutex<[Places; Call::ALL]>,
    /// Told whenever a place is freed or a call given up on.
    changed: Notify,
    /// How long a call may go unanswered before it is given up on.
    given_up_after: Duration,
}

impl Room {
    /// The room of a write under a lease of `lease`.
    pub(super) fn new(lease: Duration) -> Self {
        Self {
            places: Mutex::default(),
            changed: Notify::new(),
            given_up_after: crate::hold::given_up_after(lease),
        }
    }

    fn places(&self) -> MutexGuard<'_, [Places; Call::ALL]> {
        self.places.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits for a place for a call of `call`; or, for a write, for the answer a call of it
    /// given up on gave meanwhile, taken instead (so a try waiting for a place hears it at
    /// once, not at its bound).
    pub(super) async fn place<T: 'static>(
        self: &Arc<Self>,
        call: Call,
    ) -> Result<Place, Result<T, StoreError>> {
        loop {
            // Made before the places are read: a change between the two is not missed.
            let mut changed = pin!(self.changed.notified());
            changed.as_mut().enable();
            {
                let mut places = self.places();
                let places = &mut places[call.index()];
                if let Some(late) = take_late(places) {
                    return Err(late);
                }
                if places.under_way < UNDER_WAY && places.under_way + places.given_up < IN_ALL {
                    places.under_way += 1;
                    return Ok(Place {
                        room: Arc::clone(self),
                        call,
                        phase: Phase::UnderWay,
                    });
                }
            }
            changed.await;
        }
    }

    /// After a call of `call` was fenced: whether one given up on landed meanwhile (so the
    /// fence is its doing), taken.
    pub(super) fn landed<T: 'static>(&self, call: Call) -> Option<T> {
        let mut places = self.places();
        let places = &mut places[call.index()];
        if !matches!(places.late, Some(Late::Landed(_))) {
            return None;
        }
        take_late(places).and_then(Result::ok)
    }

    /// Keeps the answer of a write nobody waited for any more, if it tells something: that it
    /// landed, or was fenced (kept under one that landed); any other failure tells nothing a
    /// next try would not. A try waiting for a place is told.
    fn keep<T: Send + 'static>(&self, call: Call, answer: Result<T, StoreError>) {
        let answer = match answer {
            _ if !call.writes() => return,
            Ok(landed) => Late::Landed(Box::new(landed)),
            Err(StoreError::Fenced) => Late::Fenced,
            Err(_) => return,
        };
        {
            let mut places = self.places();
            let late = &mut places[call.index()].late;
            if !matches!(late, Some(Late::Landed(_))) || matches!(answer, Late::Landed(_)) {
                *late = Some(answer);
            }
        }
        self.changed.notify_waiters();
    }
}

/// The answer kept in `places`, if any, taken (it is heard once); one of another type than the
/// call's is dropped (it is not this call's).
fn take_late<T: 'static>(places: &mut Places) -> Option<Result<T, StoreError>> {
    match places.late.take()? {
        Late::Landed(landed) => landed.downcast::<T>().ok().map(|landed| Ok(*landed)),
        Late::Fenced => Some(Err(StoreError::Fenced)),
    }
}

/// A try's ear for its call's answer: dropped before the answer came (the try's bound ran out),
/// it keeps an answer sent meanwhile in the room, as one sent after is (see [`run`]), instead
/// of losing it.
pub(super) struct Hearing<T: Send + 'static> {
    answer: oneshot::Receiver<Result<T, StoreError>>,
    room: Arc<Room>,
    call: Call,
}

impl<T: Send + 'static> Hearing<T> {
    /// The call's answer.
    pub(super) async fn answer(&mut self) -> Result<T, StoreError> {
        (&mut self.answer).await.unwrap_or_else(|_| {
            Err(StoreError::unavailable(
                "the store's call ended unanswered (dropped, unanswered for a lease and 15 \
                 minutes more; panicked; or its runtime shut down)",
            ))
        })
    }
}

impl<T: Send + 'static> Drop for Hearing<T> {
    fn drop(&mut self) {
        self.answer.close();
        if let Ok(answer) = self.answer.try_recv() {
            self.room.keep(self.call, answer);
        }
    }
}

/// Starts `call` in `place` on a task of its own (see [`run`]); what hears its answer.
pub(super) fn start<T: Send + 'static>(
    place: Place,
    call: impl Future<Output = Result<T, StoreError>> + Send + 'static,
) -> Hearing<T> {
    let (answered, answer) = oneshot::channel();
    let hearing = Hearing {
        answer,
        room: Arc::clone(&place.room),
        call: place.call,
    };
    tokio::spawn(run(place, call, answered).in_current_span());
    hearing
}

/// Where a call is in its life (see the module doc).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    UnderWay,
    GivenUp,
    /// Ended, or dropped: it holds no place.
    Gone,
}

/// A call's place in its room, freed when dropped.
pub(super) struct Place {
    room: Arc<Room>,
    call: Call,
    phase: Phase,
}

impl Place {
    /// Moves the call on to `phase`, freeing what it held before.
    fn become_(&mut self, phase: Phase) {
        {
            let mut places = self.room.places();
            let places = &mut places[self.call.index()];
            match self.phase {
                Phase::UnderWay => places.under_way -= 1,
                Phase::GivenUp => places.given_up -= 1,
                Phase::Gone => {}
            }
            if phase == Phase::GivenUp {
                places.given_up += 1;
            }
        }
        self.phase = phase;
        self.room.changed.notify_waiters();
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.become_(Phase::Gone);
    }
}

/// Runs `call` in `place` (on a task of its own): given up on and then dropped as it goes
/// unanswered; its answer is sent to `answered`, or, for a write nobody waits for any more,
/// kept for the next try of the same call. The place is freed only after, so a try waiting for
/// it finds the answer kept.
async fn run<T: Send + 'static>(
    mut place: Place,
    call: impl Future<Output = Result<T, StoreError>>,
    answered: oneshot::Sender<Result<T, StoreError>>,
) {
    let mut call = pin!(call);
    let given_up_after = place.room.given_up_after;
    let answer = match tokio::time::timeout(given_up_after, call.as_mut()).await {
        Ok(answer) => answer,
        Err(_) => {
            place.become_(Phase::GivenUp);
            match tokio::time::timeout(ABANDONED_AFTER, call.as_mut()).await {
                Ok(answer) => answer,
                // Dropped, and its place freed with it: what it held is the store's to give
                // back now (sqlx's clean-up of a connection dropped mid-statement), and what it
                // holds of ours (the response it records) is freed.
                Err(_) => return,
            }
        }
    };
    if let Err(answer) = answered.send(answer) {
        place.room.keep(place.call, answer);
    }
    drop(place);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn room() -> Arc<Room> {
        Arc::new(Room::new(Duration::from_secs(10)))
    }

    /// The answer kept for `call`, taken.
    fn late<T: 'static>(room: &Room, call: Call) -> Option<Result<T, StoreError>> {
        take_late(&mut room.places()[call.index()])
    }

    /// A place for `call`, with no answer kept.
    async fn placed(room: &Arc<Room>, call: Call) -> Place {
        room.place::<()>(call).await.expect("a place")
    }

    /// A late answer that landed is kept over a later one that failed; one of another type
    /// is not taken for this one's, and each call's are its own; a read's are never kept.
    #[test]
    fn a_late_answer_is_the_same_calls_and_a_landed_one_is_kept() {
        let room = room();
        room.keep(Call::Release, Ok::<u8, _>(7));
        room.keep(Call::Release, Err::<u8, _>(StoreError::Fenced));
        assert!(late::<u8>(&room, Call::Resolve).is_none(), "another call's");
        assert_eq!(
            late::<u8>(&room, Call::Release).map(Result::ok),
            Some(Some(7))
        );
        assert!(late::<u8>(&room, Call::Release).is_none(), "heard once");
        room.keep(Call::Release, Err::<u8, _>(StoreError::Fenced));
        room.keep(Call::Release, Ok::<u8, _>(8));
        assert_eq!(
            late::<u8>(&room, Call::Release).map(Result::ok),
            Some(Some(8))
        );
        room.keep(Call::Release, Ok::<u8, _>(9));
        assert!(
            late::<String>(&room, Call::Release).is_none(),
            "another type"
        );
        assert!(late::<u8>(&room, Call::Release).is_none(), "dropped");
        room.keep(Call::Lookup, Ok::<u8, _>(1));
        assert!(late::<u8>(&room, Call::Lookup).is_none(), "a read's");
        room.keep(Call::Complete, Err::<(), _>(StoreError::Busy));
        assert!(
            late::<()>(&room, Call::Complete).is_none(),
            "a failure that tells nothing"
        );
    }

    /// After a fence: a landed answer kept is taken; a kept fence is left.
    #[test]
    fn a_fence_finds_a_landed_answer_kept() {
        let room = room();
        room.keep(Call::Release, Err::<u8, _>(StoreError::Fenced));
        assert_eq!(room.landed::<u8>(Call::Release), None);
        assert!(
            late::<u8>(&room, Call::Release).is_some(),
            "the fence is left"
        );
        room.keep(Call::Release, Ok::<u8, _>(4));
        assert_eq!(room.landed::<u8>(Call::Release), Some(4));
        assert!(late::<u8>(&room, Call::Release).is_none(), "taken");
    }

    /// Two places of a call at once; a third once one is freed; each call has its own.
    #[tokio::test(start_paused = true)]
    async fn two_places_of_a_call_at_once() {
        let room = room();
        let first = placed(&room, Call::Complete).await;
        let _second = placed(&room, Call::Complete).await;
        let third = tokio::time::timeout(Duration::from_secs(1), placed(&room, Call::Complete));
        assert!(third.await.is_err(), "no third place");
        let other = tokio::time::timeout(Duration::from_secs(1), placed(&room, Call::Lookup));
        assert!(other.await.is_ok(), "another call's place");
        let waiting = tokio::spawn({
            let room = Arc::clone(&room);
            async move { placed(&room, Call::Complete).await.phase == Phase::UnderWay }
        });
        tokio::task::yield_now().await;
        drop(first);
        let placed = tokio::time::timeout(Duration::from_secs(1), waiting).await;
        assert!(placed.expect("in time").expect("placed"));
    }

    /// A try waiting for a place hears a late answer as soon as it is kept, not at its bound.
    #[tokio::test(start_paused = true)]
    async fn a_try_waiting_for_a_place_hears_a_late_answer_at_once() {
        let room = room();
        let _held = (
            placed(&room, Call::Complete).await,
            placed(&room, Call::Complete).await,
        );
        let waiting = tokio::spawn({
            let room = Arc::clone(&room);
            async move { room.place::<u8>(Call::Complete).await.err() }
        });
        tokio::task::yield_now().await;
        room.keep(Call::Complete, Ok::<u8, _>(5));
        let heard = tokio::time::timeout(Duration::from_secs(1), waiting).await;
        let heard = heard.expect("at once").expect("task").map(|late| late.ok());
        assert_eq!(heard, Some(Some(5)));
    }

    /// An answer sent as its try gave up (the try's ear dropped after the send, before
    /// reading it) is kept, not lost.
    #[test]
    fn an_answer_sent_as_its_try_gave_up_is_kept() {
        let room = room();
        let (answered, answer) = oneshot::channel();
        let hearing = Hearing {
            answer,
            room: Arc::clone(&room),
            call: Call::Release,
        };
        assert!(answered.send(Ok::<u8, _>(3)).is_ok());
        drop(hearing);
        assert_eq!(
            late::<u8>(&room, Call::Release).map(Result::ok),
            Some(Some(3))
        );
    }

    /// A call unanswered for a lease (at least 30 s) is given up on and frees its place for
    /// the next; four in all, then none until one is dropped, after 15 minutes more.
    #[tokio::test(start_paused = true)]
    async fn hung_calls_are_given_up_on_then_dropped() {
        let room = room();
        let start = tokio::time::Instant::now();
        let mut sent = Vec::new();
        let mut answers = Vec::new();
        for _ in 0..5 {
            let place = placed(&room, Call::Release).await;
            sent.push(start.elapsed().as_secs());
            let (answered, answer) = oneshot::channel::<Result<(), StoreError>>();
            answers.push(answer);
            tokio::spawn(run(place, std::future::pending(), answered));
        }
        assert_eq!(sent, [0, 0, 30, 30, 930], "{sent:?}");
        tokio::task::yield_now().await;
        use tokio::sync::oneshot::error::TryRecvError::{Closed, Empty};
        let ended: Vec<_> = answers.iter_mut().map(|a| a.try_recv().err()).collect();
        assert_eq!(
            ended,
            [
                Some(Closed),
                Some(Closed),
                Some(Empty),
                Some(Empty),
                Some(Empty)
            ],
            "the first two dropped, the others still under way"
        );
    }

    /// An answer nobody waits for any more is kept, for a write; the place is freed after.
    #[tokio::test(start_paused = true)]
    async fn an_answer_unheard_is_kept_for_a_write_only() {
        for (call, kept) in [(Call::Complete, true), (Call::Lookup, false)] {
            let room = room();
            let place = placed(&room, call).await;
            let (answered, answer) = oneshot::channel();
            drop(answer);
            run(place, async { Ok::<u8, StoreError>(5) }, answered).await;
            let late = late::<u8>(&room, call).map(Result::ok);
            assert_eq!(late, kept.then_some(Some(5)), "{call:?}");
            assert_eq!(room.places()[call.index()].under_way, 0);
        }
    }
}
