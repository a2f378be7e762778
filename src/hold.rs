//! The holder keeps its lease for as long as its process lives (DESIGN §4).
//!
//! A [`Keeper`], one per layer, renews every lease held for about a third of its length from
//! a task of its own on each runtime that holds leases (a layer may serve several: a runtime
//! per core, or one that shuts down while another goes on). Renewal never runs on the
//! handler's task, so on a multi-threaded runtime a handler that blocks its thread
//! (synchronous I/O, a CPU-bound step) cannot starve it: the keeper's timer fires on another
//! worker, and the keeper is only ever woken from outside a worker, never into the slot of one
//! that may be about to block. On a current-thread runtime there is no other worker: a handler
//! that blocks the thread for longer than its lease loses the leases held on that runtime, as
//! a crashed holder would, so such handlers belong in `spawn_blocking`.
//!
//! Holding costs one short lock to take a slot and one to give it back; the keeper wakes every
//! sixth of the shortest lease it has seen and at least once a second (a shorter lease coming
//! in wakes it to shorten the tick), and touches only leases due for renewal. Its wakes are
//! the runtime's timers: a runtime too busy to fire them on time (a burst of work on too few
//! threads) delays renewals as much, so a lease should be several times the longest such
//! stall.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::time::Instant;

use crate::observe::{self, Event};
use crate::store::{FencingToken, IdempotencyStore, ScopedKey, StoreError};
use crate::whose::{Whose, whose};

/// The keeper never sleeps longer than this, nor shorter than [`MIN_TICK`].
const MAX_TICK: Duration = Duration::from_secs(1);
const MIN_TICK: Duration = Duration::from_millis(5);

/// Renews held leases for one store; cheap to clone.
pub(crate) struct Keeper<St> {
    shared: Arc<Shared<St>>,
}

struct Shared<St> {
    /// Which keeper this is, for `KEPT` (an address could be a dropped keeper's, reused).
    id: u64,
    store: Arc<St>,
    slots: Mutex<Slots>,
    /// The runtimes a keeper task runs on, each with what wakes it when a shorter lease comes
    /// in (asleep for the tick of a longer one, up to a second, it would renew the shorter one
    /// too late, after another request had taken over a lease of under a second). A task's own
    /// guard takes its runtime out when the runtime drops it.
    keepers: Mutex<Vec<(RuntimeId, Arc<tokio::sync::Notify>)>>,
    /// How many keeper tasks have ended: a thread's cached finding (see `KEPT`) holds while
    /// none has since.
    ended: AtomicU64,
    /// The shortest lease ever held, in ms: the keepers' tick is a sixth of it.
    shortest: AtomicU64,
}

type RuntimeId = tokio::runtime::Id;

#[derive(Default)]
struct Slots {
    held: Vec<Option<Held>>,
    free: Vec<usize>,
}

struct Held {
    key: ScopedKey,
    token: FencingToken,
    lease: Duration,
    /// When the next renewal starts, counted from the keeper's point (its wakes are due a tick
    /// apart) that sent the last one, in whole ticks: a sixth of the lease (rounded down, at least
    /// a tick) on, until it comes back renewed, which puts the next at the point nearest a third of
    /// a lease on, or refused, which brings it to a second on for a lease longer than six seconds
    /// (a blip lasts seconds whatever the lease). A wake sends what is due by when it fires (or,
    /// sent before, by the next point: see `keep`). So a renewal refused, or slower to come back
    /// than a sixth of the lease, has the next go at most a sixth of a lease (or a second) after it
    /// was sent, however long the store took to say no, and the lease gets at least four tries
    /// before it runs out (two, while renewals hang: see `given_up`) while the runtime's timers
    /// fire at most half a tick late (later, up to a tick, a shorter lease arriving mid-hold can
    /// leave three); a store that answers in time sees one renewal per third of a lease, a slower
    /// one at most twice as many. At most [`OUTSTANDING`] at once (not counting those given up on),
    /// and a refusal does not wake the keeper (a store slow to refuse is not sent renewals back to
    /// back, each holding a connection): refusals slower than about a fifth of the lease, with
    /// timers firing late, can leave three tries (a 32 ms lease: refusals taking 7 ms with timers
    /// 2.9 ms late, or 8 ms with 2.5 ms; a 30 ms lease, refusals taking 7 ms, one wake 4.9 ms late:
    /// tries at 14.9, 20 and 25 ms).
    due: Instant,
    /// Renewals under way for less than [`given_up_after`]. One that hangs (a connection
    /// stuck, a row lock) does not hold up the next: the lease would run out behind it and
    /// another request take the key over while this handler still runs. At most
    /// [`OUTSTANDING`], so a store that hangs every call, or is slow to answer, is not sent
    /// more and more.
    renewing: u8,
    /// Renewals under way for longer: given up on, they no longer hold up the next (two
    /// calls on connections that died mid-statement, which the kernel may take many minutes
    /// to give up on, would otherwise stop the renewing that long), but they are not dropped:
    /// a call's work goes on whatever the caller does (sqlx holds its connection until the
    /// statement ends), so they still count toward [`MOST`], and one queued for a pool's
    /// connection keeps its place.
    given_up: u8,
    /// When the last renewal was sent (before the first: the first due).
    sent: Instant,
    /// A renewal was fenced out, and a read showed it no mistake: nothing to keep.
    lost: bool,
    /// A read is under way of whether a fenced renewal was a mistake (see [`renew`]): one at a
    /// time, so a store whose reads hang is not sent more and more.
    reading: bool,
    /// The runtime the lease is held on, whose keeper renews it (any keeper, without one).
    runtime: Option<RuntimeId>,
}

/// The most renewals of one lease under way at once, not counting those given up on.
const OUTSTANDING: u8 = 2;
/// The most renewals of one hold under way at once, those given up on included: a store whose
/// calls hang holds at most four connections (or requests) for one hold. (A lease whose record
/// is written after its run has two holds for a moment, the run's and the record's, and the
/// run's renewals still under way then count for neither: up to eight.)
const MOST: u8 = 4;

/// How long a renewal (see `Held::given_up`), or a write's call after its run (see
/// `execute/room.rs`), may be under way before it no longer holds up the next: a lease, and at
/// least 30 s, about the bounds the crate's stores set on a call (Redis's 5 s reply time-out,
/// SQLite's 5 s busy wait, sqlx's 30 s default acquire time-out), so a store that answers within
/// that, however slowly, is sent at most two at a time.
pub(crate) fn given_up_after(lease: Duration) -> Duration {
    lease.max(Duration::from_secs(30))
}

impl<St> Clone for Keeper<St> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<St> std::fmt::Debug for Keeper<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keeper")
            .field("held", &lock(&self.shared.slots).held.len())
            .finish_non_exhaustive()
    }
}

impl<St> Keeper<St> {
    pub(crate) fn new(store: Arc<St>) -> Self {
        // Never 0: no thread has cached a keeper yet.
        static KEEPERS: AtomicU64 = AtomicU64::new(1);
        Self {
            shared: Arc::new(Shared {
                id: KEEPERS.fetch_add(1, Ordering::Relaxed),
                store,
                slots: Mutex::default(),
                keepers: Mutex::default(),
                ended: AtomicU64::new(0),
                shortest: AtomicU64::new(u64::MAX),
            }),
        }
    }

    /// The store whose leases this keeper renews.
    pub(crate) fn store(&self) -> &Arc<St> {
        &self.shared.store
    }
}

impl<St: IdempotencyStore> Keeper<St> {
    /// Keeps `token`'s lease on `key` renewed until the returned hold is dropped. `since`: when the
    /// lease was asked for, if the store took a while to answer (the lease began somewhere between
    /// then and now), or for a lease held already, a time at or before its last renewal; otherwise
    /// now. The first renewal is due a tick before a third of the lease from then: the keeper wakes
    /// a tick apart at a phase of its own, so it goes by a third of the lease at the latest (plus
    /// however late the runtime's timers fire), leaving the refusals that follow as many tries as a
    /// lease renewed on time has.
    pub(crate) fn hold(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        lease: Duration,
        since: Option<Instant>,
    ) -> Hold<St> {
        self.hold_from(key, token, lease, |tick| {
            since.unwrap_or_else(Instant::now) + (lease / 3).saturating_sub(tick)
        })
    }

    /// [`hold`](Self::hold) for a lease held already, which may have been renewed last up to
    /// a third of a lease ago: its first renewal goes at the keeper's next wake.
    pub(crate) fn hold_at_once(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        lease: Duration,
    ) -> Hold<St> {
        self.hold_from(key, token, lease, |_| Instant::now())
    }

    /// A hold whose first renewal is due when `first` says, given the keeper's tick.
    fn hold_from(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        lease: Duration,
        first: impl FnOnce(Duration) -> Instant,
    ) -> Hold<St> {
        let runtime = tokio::runtime::Handle::try_current().ok();
        self.start(lease, runtime.as_ref());
        let tick = tick(self.shared.shortest.load(Ordering::Relaxed));
        let due = first(tick);
        let held = Held {
            key: key.clone(),
            token,
            lease,
            due,
            // Set when a renewal is sent; until then the first due, which keeps that renewal
            // from going early (see `keep`).
            sent: due,
            renewing: 0,
            given_up: 0,
            lost: false,
            reading: false,
            runtime: runtime.as_ref().map(tokio::runtime::Handle::id),
        };
        let mut slots = lock(&self.shared.slots);
        let slot = match slots.free.pop() {
            Some(slot) => {
                slots.held[slot] = Some(held);
                slot
            }
            None => {
                slots.held.push(Some(held));
                slots.held.len() - 1
            }
        };
        Hold {
            shared: self.shared.clone(),
            slot,
        }
    }

    /// Starts a keeper task on `runtime` if none runs there.
    fn start(&self, lease: Duration, runtime: Option<&tokio::runtime::Handle>) {
        let ms = u64::try_from(lease.as_millis()).unwrap_or(u64::MAX);
        // Read first: the shortest lease rarely changes, and a write on every request would
        // move this line between the cores serving requests.
        if ms < self.shared.shortest.load(Ordering::Relaxed)
            && tick(ms) < tick(self.shared.shortest.fetch_min(ms, Ordering::Relaxed))
        {
            let wake: Vec<_> = lock(&self.shared.keepers)
                .iter()
                .map(|(_, shorter)| shorter.clone())
                .collect();
            // From a thread of its own, as the keeper is started (below), and woken before this
            // hold goes on: a runtime whose clock is paused (an application's tests) jumps to its
            // next timer once idle, past the shorter lease, unless the keeper is queued by then.
            let woken = std::thread::Builder::new()
                .name("idempotency-keeper-wake".into())
                .spawn(move || wake.iter().for_each(|shorter| shorter.notify_one()));
            if let Ok(woken) = woken {
                let _ = woken.join();
            }
        }
        // Without a runtime there is nothing to renew on: the lease runs out as for a crash.
        let Some(runtime) = runtime else {
            return;
        };
        let id = runtime.id();
        // One lookup per request: whether this thread last saw a keeper of this layer on this
        // runtime (a thread may outlive a runtime and run another).
        let this = self.shared.id;
        let ended = self.shared.ended.load(Ordering::Acquire);
        if KEPT.get() == Some((this, id, ended)) {
            return;
        }
        let shorter = {
            let mut keepers = lock(&self.shared.keepers);
            if keepers.iter().any(|(kept, _)| *kept == id) {
                KEPT.set(Some((this, id, ended)));
                return;
            }
            let shorter = Arc::new(tokio::sync::Notify::new());
            keepers.push((id, shorter.clone()));
            shorter
        };
        let keeper = keep(
            Arc::downgrade(&self.shared),
            id,
            shorter,
            Running(Arc::downgrade(&self.shared), id),
        );
        // Handed over from a thread of its own: spawned from this worker, the task would wait
        // in the worker's LIFO slot, which no other worker steals from, behind the very handler
        // that may now block the worker. From outside, it goes to the shared queue. Once per
        // keeper and runtime. Queued before this hold goes on (the thread is joined, tens of
        // microseconds once per runtime): a runtime whose clock is paused (an application's
        // tests) jumps to its next timer once idle, past the lease, unless the keeper is
        // queued by then.
        let hand_over = runtime.clone();
        let spawned = std::thread::Builder::new()
            .name("idempotency-keeper-start".into())
            .spawn(move || drop(hand_over.spawn(keeper)));
        match spawned {
            Ok(spawned) => {
                let _ = spawned.join();
            }
            // No thread to spare: the next hold tries again.
            Err(_) => lock(&self.shared.keepers).retain(|(kept, _)| *kept != id),
        }
    }
}

thread_local! {
    /// The keeper (its id) and runtime this thread last found a keeper task for, and
    /// how many keepers had ended then: while none has since, that keeper still runs (a runtime
    /// that ended and a new one given its id is not taken for it).
    static KEPT: std::cell::Cell<Option<(u64, RuntimeId, u64)>> =
        const { std::cell::Cell::new(None) };
}

/// A lease kept renewed while this value lives.
pub(crate) struct Hold<St> {
    shared: Arc<Shared<St>>,
    slot: usize,
}

impl<St> Drop for Hold<St> {
    fn drop(&mut self) {
        let mut slots = lock(&self.shared.slots);
        slots.held[self.slot] = None;
        slots.free.push(self.slot);
    }
}

/// Marks the keeper of a runtime stopped when its task ends or the runtime drops it, so the
/// next hold there starts one again (a layer may outlive a runtime, as in tests).
struct Running<St>(Weak<Shared<St>>, RuntimeId);

impl<St> Drop for Running<St> {
    fn drop(&mut self) {
        if let Some(shared) = self.0.upgrade() {
            lock(&shared.keepers).retain(|(kept, _)| *kept != self.1);
            shared.ended.fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// The keeper task: ends when the last layer and hold of its store are gone.
async fn keep<St: IdempotencyStore>(
    shared: Weak<Shared<St>>,
    runtime: RuntimeId,
    shorter: Arc<tokio::sync::Notify>,
    _running: Running<St>,
) {
    // The wakes are points a tick apart (`next`: the next one). What a wake sends is
    // scheduled from its point, in whole ticks, not from when it fired (late, by amounts that
    // vary from one wake to the next): a renewal due at a point then goes at that point's
    // wake however late that fires, lateness never adds up from one renewal to the next, and
    // a wake never sends what the next point was for. A due between points (counted on a
    // tick since shortened) goes at the wake before it.
    let Some(first) = shared.upgrade() else {
        return;
    };
    // The last wake's point, and the next one.
    let mut last = Instant::now();
    let mut next = last + tick(first.shortest.load(Ordering::Relaxed));
    drop(first);
    loop {
        let woken = tokio::time::timeout_at(next, shorter.notified())
            .await
            .is_ok();
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let now = Instant::now();
        // A shorter lease (the one that woke it, say) has the tick it leaves.
        let tick = tick(shared.shortest.load(Ordering::Relaxed));
        let (at, then) = point(now, last, next, tick, woken);
        (last, next) = (at, then);
        let due: Vec<(usize, ScopedKey, FencingToken, Duration, Sent)> = {
            let mut slots = lock(&shared.slots);
            slots
                .held
                .iter_mut()
                .enumerate()
                .filter_map(|(slot, held)| {
                    let held = held.as_mut()?;
                    // Due by now, or before the next wake's point: a due that falls between
                    // points (counted on a tick a shorter lease has since shortened) goes at
                    // the wake before it, not a tick after; but not within half a tick of
                    // the last renewal (a late wake restarts the points, and a due counted
                    // from the old ones would be sent again at once), nor before the first
                    // (a new hold's first due is set off the points on purpose: `sent` is
                    // that due until then).
                    let early = held.due < next && now >= held.sent + tick / 2;
                    if held.lost
                        || held.renewing >= OUTSTANDING
                        || held.renewing + held.given_up >= MOST
                        || (held.due > now && !early)
                        // One still on its way went less than half a tick ago (by the clock,
                        // whatever the points say: a wake late by most of a tick is followed
                        // by the next point's on time).
                        || (held.renewing > 0 && now < held.sent + tick / 2)
                        || held.runtime.is_some_and(|held_on| held_on != runtime)
                    {
                        return None;
                    }
                    held.renewing += 1;
                    held.sent = now;
                    let lease = held.lease;
                    // The next one starts a sixth of the lease after this one unless this one
                    // comes back renewed by then (see `Held::due`). Not a tick: the tick is
                    // the shortest lease's, and a longer lease renewed that often by a slow
                    // store would add to its load as many times over.
                    held.due = at + ticks_within(lease / 6, tick);
                    // The point nearest a third of the lease: the four tries after it still
                    // fit in the lease, refusals being tried again within a sixth (see
                    // `ticks_within`).
                    let third = tick.saturating_mul(whole(lease / 3 + tick / 2, tick).max(1));
                    let sent = Sent {
                        renewed: at + third,
                        // Refused, the next goes sooner for a lease longer than six seconds:
                        // a store's blip lasts seconds whatever the lease, and a long lease
                        // tried again only a sixth of it later would have its tries spread
                        // over hours.
                        again: at + ticks_within((lease / 6).min(MAX_TICK), tick),
                    };
                    Some((slot, held.key.clone(), held.token, held.lease, sent))
                })
                .collect()
        };
        for (slot, key, token, lease, sent) in due {
            // A task per renewal: one slow or hanging store call holds up no other lease.
            // Holding the keeper weakly: a renewal that never ends keeps the store alive (its
            // call borrows it), not the keeper, whose task ends with the last layer and hold.
            let (store, keeper) = (shared.store.clone(), Arc::downgrade(&shared));
            tokio::spawn(renew(store, keeper, slot, key, token, lease, sent));
        }
    }
}

/// When the next renewal goes after one sent at a keeper's point: `renewed` if this one comes
/// back renewed, `again` if it is refused.
struct Sent {
    renewed: Instant,
    again: Instant,
}

async fn renew<St: IdempotencyStore>(
    store: Arc<St>,
    shared: Weak<Shared<St>>,
    slot: usize,
    key: ScopedKey,
    token: FencingToken,
    lease: Duration,
    sent: Sent,
) {
    // A store's renewal that panics is a failed one: the slot's count of renewals under way
    // must come down, or after two the lease would never be renewed again.
    let renewal = crate::unwind::CatchUnwind {
        inner: store.renew(&key, token, lease),
    };
    let mut renewal = std::pin::pin!(renewal);
    let mut given_up = false;
    let answer = match tokio::time::timeout(given_up_after(lease), renewal.as_mut()).await {
        Ok(answer) => answer,
        Err(_) => {
            // Given up on, not dropped (see `Held::given_up`): the next goes beside it.
            given_up = true;
            tracing::warn!(
                key = key.key(),
                "a lease renewal had no answer in a lease (at least 30 s); it no longer holds \
                 up the next"
            );
            settle(&shared, slot, &key, token, |held| {
                held.renewing = held.renewing.saturating_sub(1);
                held.given_up = held.given_up.saturating_add(1);
            });
            renewal.await
        }
    };
    let result =
        answer.unwrap_or_else(|_| Err(StoreError::unavailable("the store's renewal panicked")));
    if let Err(error) = &result
        && !matches!(error, StoreError::Fenced)
    {
        observe::count(Event::StoreError);
        tracing::warn!(%error, "lease renewal failed; trying again");
    }
    // Until a read shows the lease lost, a fenced renewal is followed by the next as a failed
    // one is (see `Held::due`): a store or a proxy may fence by mistake (breaking the trait's
    // word), and a lease given up then would lapse under a running handler, for a retry to
    // take over. The read may take a while: the next renewal does not wait for it.
    let fenced = matches!(result, Err(StoreError::Fenced));
    let mut read = false;
    settle(&shared, slot, &key, token, |held| {
        if given_up {
            held.given_up = held.given_up.saturating_sub(1);
        } else {
            held.renewing = held.renewing.saturating_sub(1);
        }
        // Renewed: the next about a third of a lease after this one was sent (a later one may
        // have been sent meanwhile, and come back later still). Refused: the next is due as
        // `again` says, counted from when this one was sent, not from when the refusal came
        // back, which would miss the keeper's wake by however long the store took to say no
        // and wait for the one after, and a few refusals in a row would let the lease lapse.
        match result {
            Ok(_) => held.due = held.due.max(sent.renewed),
            Err(_) => held.due = held.due.min(sent.again),
        }
        read = fenced && !held.lost && !std::mem::replace(&mut held.reading, true);
    });
    if !read {
        return;
    }
    // Off the renewals' path, one at a time per hold: the read may take as long as two leases.
    let read = whose(&*store, &key, token, lease.saturating_mul(2)).await;
    // `None`: still in flight (the fence was a mistake), or the read failed and cannot say
    // otherwise, so the next fenced renewal asks again. `Some(lost)`: nothing to keep.
    let over = match read {
        Ok(Whose::InFlight { .. }) | Err(_) => None,
        Ok(Whose::Theirs | Whose::SetAside { .. }) => Some(true),
        Ok(Whose::Settled) => Some(false),
    };
    let mut first = false;
    settle(&shared, slot, &key, token, |held| {
        held.reading = false;
        if over.is_some() {
            first = !std::mem::replace(&mut held.lost, true);
        }
    });
    match over {
        None => {
            observe::count(Event::StoreError);
            tracing::warn!("a renewal was fenced, yet the record is in flight under this lease");
        }
        // Taken over, or set aside: counted once. Whatever an earlier renewal says when it
        // comes back, a lost lease stays lost.
        Some(true) if first => {
            observe::count(Event::LeaseLost);
            tracing::warn!(
                key = key.key(),
                "lease lost while held; no longer renewing it"
            );
        }
        // Settled by its own holder (recorded, given back) while a renewal was on its way.
        Some(_) => {}
    }
}

/// Applies `f` to the slot if it still holds `key` under `token` (it may have been given
/// back, or taken by another hold, meanwhile); nothing once the keeper is gone (a renewal's
/// task holds it weakly).
fn settle<St>(
    shared: &Weak<Shared<St>>,
    slot: usize,
    key: &ScopedKey,
    token: FencingToken,
    f: impl FnOnce(&mut Held),
) {
    let Some(shared) = shared.upgrade() else {
        return;
    };
    let mut slots = lock(&shared.slots);
    if let Some(Some(held)) = slots.held.get_mut(slot)
        && held.token == token
        && held.key == *key
    {
        f(held);
    }
}

/// Which point a wake is for, and when the next wake is due: `last` is the last wake's point,
/// `next` the point this wake was waiting for, `tick` the tick now (a shorter lease may have
/// just shortened it), `woken` whether a shorter lease woke it early. The point is never
/// after `now` and never before `last`: a wake never sends what a later point is for, and what
/// it sends is never counted from a point before the last wake's.
fn point(
    now: Instant,
    last: Instant,
    next: Instant,
    tick: Duration,
    woken: bool,
) -> (Instant, Instant) {
    if woken {
        // Woken early by a shorter lease: for the latest point by now, the shorter tick apart
        // from the last wake's. The point it was waiting for stays next if it is still to come
        // and sooner, so what is due then goes then; one passed already (a timer late) is this
        // wake's.
        let at = last + tick.saturating_mul(whole(now.saturating_duration_since(last), tick));
        let next = if next > now {
            next.min(at + tick)
        } else {
            at + tick
        };
        return (at, next);
    }
    match now.checked_duration_since(next + tick) {
        // Behind by a tick or more (a busy runtime, whose timers fire that late): for the
        // latest point by now, and the next wake at once, not a point later: the wakes come as
        // often as the runtime lets them, and none is for a point that another wake was for.
        Some(behind) => (
            next + tick.saturating_mul(whole(behind, tick).saturating_add(1)),
            now,
        ),
        None => (next, next + tick),
    }
}

fn tick(shortest_ms: u64) -> Duration {
    Duration::from_millis(shortest_ms / 6).clamp(MIN_TICK, MAX_TICK)
}

/// How many whole ticks fit in `span`.
fn whole(span: Duration, tick: Duration) -> u32 {
    u32::try_from(span.as_nanos() / tick.as_nanos().max(1)).unwrap_or(u32::MAX)
}

/// The whole ticks that fit in `span`, at least one: a renewal tried again after a refusal
/// goes at the last point by then, never past it. (A sixth that is not a whole number of
/// ticks, a lease of 46 ms beside one of 30 ms (a tick of 5 ms), rounded to the nearest point
/// would space the tries 10 ms apart, and the fourth would go 45 ms after the last renewal.)
fn ticks_within(span: Duration, tick: Duration) -> Duration {
    tick.saturating_mul(whole(span, tick).max(1))
}

/// A panic never happens while the lock is held (plain assignments), so poison is harmless.
fn lock<T>(slots: &Mutex<T>) -> MutexGuard<'_, T> {
    slots
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    fn current_thread() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    fn hold(keeper: &Keeper<MemoryStore>) -> Hold<MemoryStore> {
        let key = ScopedKey::new("scope", "key");
        keeper.hold(&key, FencingToken::new(7), Duration::from_secs(30), None)
    }

    /// DESIGN §4: keepers made one after another on one thread and runtime (a dropped one's
    /// memory may be the next one's) each get a keeper task of their own: what a thread caches
    /// is for the keeper it found, never for another at the same address.
    #[test]
    fn each_keeper_on_a_thread_gets_its_own_task() {
        for _ in 0..8 {
            // A runtime (whose id a later one may be given) and a keeper, both dropped after.
            let runtime = current_thread();
            let keeper = Keeper::new(Arc::new(MemoryStore::new()));
            let held = runtime.block_on(async { hold(&keeper) });
            assert_eq!(lock(&keeper.shared.keepers).len(), 1);
            drop(held);
            drop(runtime);
            drop(keeper);
        }
    }

    /// DESIGN §4: a keeper serving two runtimes has a task on each; one runtime ending takes
    /// its task out, and a hold made on the other afterwards finds its own still there.
    #[test]
    fn each_runtime_gets_a_keeper_task_and_an_ended_one_is_taken_out() {
        let keeper = Keeper::new(Arc::new(MemoryStore::new()));
        let (first, second) = (current_thread(), current_thread());
        let first_id = first.handle().id();
        let held_first = first.block_on(async { hold(&keeper) });
        let held_second = second.block_on(async { hold(&keeper) });
        assert_eq!(lock(&keeper.shared.keepers).len(), 2);
        // Let the keeper tasks be handed over and polled once on their runtimes.
        for runtime in [&first, &second] {
            runtime.block_on(async { tokio::time::sleep(Duration::from_millis(20)).await });
        }
        drop(held_first);
        drop(first);
        let taken_out = (0..200).any(|_| {
            std::thread::sleep(Duration::from_millis(5));
            !lock(&keeper.shared.keepers)
                .iter()
                .any(|(kept, _)| *kept == first_id)
        });
        assert!(taken_out, "the ended runtime's keeper is taken out");
        let again = second.block_on(async { hold(&keeper) });
        let kept: Vec<_> = lock(&keeper.shared.keepers)
            .iter()
            .map(|(id, _)| *id)
            .collect();
        assert_eq!(kept, vec![second.handle().id()]);
        drop((held_second, again));
    }

    /// DESIGN §4 (the keeper's wakes): a wake is for a point never after it fired and never
    /// before the last wake's, and the next wake is due at most a tick after that point (or at
    /// once, when behind), whatever mix of late timers and shorter leases comes. Found on a
    /// re-read: a wake woken by a shorter lease after its timer was already due kept that
    /// earlier point as the next, and the wake that followed was for a point before its own.
    #[test]
    fn a_wake_is_for_a_point_between_the_last_wake_and_now() {
        let origin = Instant::now();
        let us = Duration::from_micros;
        // A small generator: the same cases on every run.
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut roll = |below: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % below
        };
        for _ in 0..2_000 {
            let mut tick = us(5_000 + roll(5) * 1_000);
            let (mut last, mut next) = (origin, origin + tick);
            let mut now = origin;
            for _ in 0..60 {
                // A shorter lease wakes it before its timer (or after, when the timer is late
                // and the notice comes first); otherwise the timer fires, up to three ticks
                // late.
                let woken = roll(4) == 0;
                if woken {
                    tick = us((tick.as_micros() as u64 * (5 + roll(5)) / 10).max(1_000));
                    now = now.max(last) + us(roll(3 * tick.as_micros() as u64));
                } else {
                    now = now.max(next) + us(roll(3 * tick.as_micros() as u64 + 1));
                }
                let (at, then) = point(now, last, next, tick, woken);
                let what = format!(
                    "now {:?}, last {:?}, next {:?}, tick {tick:?}, woken {woken}: at {:?}, then {:?}",
                    now - origin,
                    last - origin,
                    next - origin,
                    at - origin,
                    then - origin
                );
                assert!(at <= now, "a point to come: {what}");
                assert!(now - at < tick, "not the latest point by now: {what}");
                if woken && next > now {
                    assert_eq!(then, next.min(at + tick), "the point waited for: {what}");
                }
                assert!(at >= last, "a point before the last wake's: {what}");
                assert!(
                    then > at || then == now,
                    "the next wake not after this one: {what}"
                );
                assert!(
                    then <= at + tick || then == now,
                    "the next wake too late: {what}"
                );
                if !woken && then != now {
                    assert_eq!(at, next, "an on-time wake is for its point: {what}");
                }
                (last, next) = (at, then);
            }
        }
    }

    /// DESIGN §4: the case the re-read found, by hand. Points 10 ms apart; the timer for 10 ms
    /// is late and a 3 ms tick arrives at 12.9 ms: the wake is for 12 ms and the next at 15 ms,
    /// not 10 ms (which would have made the wake after it one for 10 ms, before 12).
    #[test]
    fn a_shorter_lease_after_a_late_timer_does_not_bring_the_points_back() {
        let origin = Instant::now();
        // Tenths of a millisecond.
        let t = |n: u64| Duration::from_micros(n * 100);
        let (at, next) = point(origin + t(129), origin, origin + t(100), t(30), true);
        assert_eq!((at - origin, next - origin), (t(120), t(150)));
        // Its timer for 15 ms fires at 15.2: for 15 ms.
        let (after, then) = point(origin + t(152), at, next, t(30), false);
        assert_eq!((after - origin, then - origin), (t(150), t(180)));
        // A point passed already is not kept as the next: points 10 ms apart, the timer for
        // 10 ms late, a 3 ms tick in at 11 ms: for 9 ms, the next at 12 ms (not 10 ms, a point
        // under a tick after this one's and before this wake).
        let (at, next) = point(origin + t(110), origin, origin + t(100), t(30), true);
        assert_eq!((at - origin, next - origin), (t(90), t(120)));
        // Before its timer, a shorter tick keeps the point it was waiting for when sooner.
        let (at, next) = point(origin + t(70), origin, origin + t(100), t(30), true);
        assert_eq!((at - origin, next - origin), (t(60), t(90)));
        let (at, next) = point(origin + t(70), origin, origin + t(80), t(30), true);
        assert_eq!((at - origin, next - origin), (t(60), t(80)));
    }
}
