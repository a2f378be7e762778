//! Giving a key back that nothing runs under any more: a claim dropped mid round trip or not
//! confirmed, a run cancelled by a hang-up, a run whose outcome is not kept. One failed write
//! must not be enough to strand the key, so each give-back is tried again (see [`Retry`]); and a
//! key set aside for reconciliation behind its own holder's back is given back by that holder,
//! which knows that nothing it ran may not be run again.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::observe::{self, Event};
use crate::store::{
    FencingToken, IdempotencyStore, RecordStatus, Resolution, ScopedKey, StoreError,
};

use super::retry::Retry;
use super::room::Call;
use crate::whose::Whose;

/// Releases a claim whose execution was dropped while its handler ran (routes that cancel on
/// disconnect), disarmed once the handler has answered; or a late claim dropped, or not
/// confirmed, before anything ran under it (see `service::confirm`).
pub(crate) struct ReleaseOnDrop<St: IdempotencyStore> {
    pub(crate) store: Option<Arc<St>>,
    pub(crate) key: ScopedKey,
    pub(crate) token: FencingToken,
    /// The claim's lease: how long a failed release is tried again (see [`give_back`]).
    pub(crate) lease: Duration,
}

impl<St: IdempotencyStore> ReleaseOnDrop<St> {
    pub(crate) fn disarm(mut self) {
        self.store = None;
    }
}

impl<St: IdempotencyStore> Drop for ReleaseOnDrop<St> {
    fn drop(&mut self) {
        let Some(store) = self.store.take() else {
            return;
        };
        let (key, token, lease) = (self.key.clone(), self.token, self.lease);
        // Without a runtime (shutting down) the lease simply runs out instead.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            crate::detached::spawn(&runtime, async move {
                let what = "a cancelled execution's key";
                give_back(&store, &key, token, lease, Until::LeaseEnds, what).await;
            });
        }
    }
}

/// How [`give_back`] paces its tries; either way it tries until the key is given back or is
/// no longer this holder's to give.
#[derive(Clone, Copy)]
pub(crate) enum Until {
    /// Nothing renews the lease meanwhile (a claim its request dropped or could not confirm,
    /// a run cancelled by a hang-up): a try is made just before the lease ends. After it, the
    /// next claim decides: a takeover fences the release (nothing left to give), and a key a
    /// retry set aside, since it could not know that nothing ran, is given back as not
    /// applied. Stopping at the lease's end left such a key set aside for ever, every retry
    /// told `outcome-unknown` for a request refused 503 before anything ran.
    LeaseEnds,
    /// The lease is kept renewed meanwhile (after a run whose outcome releases the key, as a
    /// failed record is retried: DESIGN §4).
    Lands,
}

/// Gives back a key that nothing runs under any more, trying again while the store fails or
/// does not answer, until it lands or the key is no longer this holder's (taken over, or set
/// aside and given back as not applied: see [`give_back_set_aside`]).
pub(crate) async fn give_back<St: IdempotencyStore>(
    store: &Arc<St>,
    key: &ScopedKey,
    token: FencingToken,
    lease: Duration,
    until: Until,
    what: &str,
) {
    give_back_paced(store, key, token, Retry::new(lease), until, what).await;
}

/// [`give_back`], its tries paced by `retry`, which may have made some already (the
/// execution's own release, see `Execution::release_later`).
pub(super) async fn give_back_paced<St: IdempotencyStore>(
    store: &Arc<St>,
    key: &ScopedKey,
    token: FencingToken,
    mut retry: Retry,
    until: Until,
    what: &str,
) {
    let ends = tokio::time::Instant::now() + retry.lease();
    loop {
        let error = match retry
            .spawned(Call::Release, release(store, key, token))
            .await
        {
            Ok(status) => {
                released(status);
                if retry.tries() > 1 {
                    let tries = retry.tries();
                    tracing::info!(tries, "gave back {what} after the store recovered");
                }
                return;
            }
            // Taken over, or settled: nothing of ours is left to give back, unless the key
            // was only set aside meanwhile.
            Err(StoreError::Fenced) => {
                give_back_set_aside_paced(store, key, token, retry, TakenOver::Quiet).await;
                return;
            }
            Err(error) => error,
        };
        observe::count(Event::StoreError);
        let left = ends.saturating_duration_since(tokio::time::Instant::now());
        let at_most = match until {
            Until::LeaseEnds if !left.is_zero() => left,
            Until::LeaseEnds => {
                tracing::warn!(%error, "could not give back {what} within its lease; trying on");
                // Past the lease the next claim decides, and a release that fails or hangs
                // cannot tell a takeover: each try reads the record first.
                give_back_set_aside_paced(store, key, token, retry, TakenOver::Lapsed).await;
                return;
            }
            Until::Lands => Duration::MAX,
        };
        tracing::debug!(%error, "could not give back {what}; trying again");
        retry.pause(at_most).await;
    }
}

/// After a release (or a late claim's confirming renewal) is fenced: gives back a key that was
/// only set aside for reconciliation while it still carries this holder's `token` and no
/// effect was marked started. Its lease ran out first (a renewal or the release failed for a
/// while, a claim came back late) on a route that reconciles; a retry then set it aside, since
/// it could not know what ran. The holder does: nothing it ran may not be run again, exactly as
/// a release in time would have said. Settled as not applied, fenced by the token, so an
/// operator's or a reconciler's resolution that came first stands. Tried again while the store
/// fails (a key set aside has no lease to bound it), until the record is given back or is no
/// longer this holder's to give; whether it gave the key back. A key found still in flight
/// under the token (the store fenced by mistake) is released instead, its lease running or
/// run out: until a release lands or a read shows the key set aside (then given back as
/// above) or no longer this holder's.
pub(crate) async fn give_back_set_aside<St: IdempotencyStore>(
    store: &Arc<St>,
    key: &ScopedKey,
    token: FencingToken,
    lease: Duration,
) -> bool {
    give_back_set_aside_paced(store, key, token, Retry::new(lease), TakenOver::Quiet).await
}

/// [`give_back_set_aside`], its tries paced by `retry`.
pub(super) async fn give_back_set_aside_paced<St: IdempotencyStore>(
    store: &Arc<St>,
    key: &ScopedKey,
    token: FencingToken,
    mut retry: Retry,
    taken_over: TakenOver,
) -> bool {
    loop {
        let error = match set_aside_once(store, key, token, &mut retry).await {
            Ok(Found::Settled(given)) => {
                if let TakenOver::Counted = taken_over {
                    observe::count(Event::StaleWrite);
                    tracing::warn!("could not release the key: the lease was taken over");
                }
                return given;
            }
            // Still in flight under this token: its release failed past the lease, or was
            // fenced by mistake (a store or a proxy that broke the trait's word). It is given
            // back as a release in time would have; fenced again, it is read again.
            Ok(Found::InFlight) => {
                if let TakenOver::Lapsed = taken_over {
                    tracing::debug!("the key is still this holder's past its lease; releasing");
                } else {
                    observe::count(Event::StoreError);
                    tracing::warn!("a release was fenced, yet the key is still this holder's");
                }
                match retry
                    .spawned(Call::Release, release(store, key, token))
                    .await
                {
                    Ok(status) => {
                        released(status);
                        return true;
                    }
                    Err(StoreError::Fenced) => {
                        retry.pause(Duration::MAX).await;
                        continue;
                    }
                    Err(error) => error,
                }
            }
            // Past its lease a give-back that cannot read the record releases all the same, as
            // before its lease ran out: fenced, a release leaves a takeover standing.
            Err(error) if matches!(taken_over, TakenOver::Lapsed) => {
                match retry
                    .spawned(Call::Release, release(store, key, token))
                    .await
                {
                    Ok(status) => {
                        released(status);
                        return true;
                    }
                    Err(_) => error,
                }
            }
            Err(error) => error,
        };
        observe::count(Event::StoreError);
        tracing::debug!(%error, "could not give back a key set aside; trying again");
        retry.pause(Duration::MAX).await;
    }
}

/// What led to [`give_back_set_aside`]: a fenced release, counted as a stale write once a read
/// shows the fence was no mistake, or not; or releases failing past the lease.
#[derive(Clone, Copy)]
pub(super) enum TakenOver {
    /// Fenced, counted (the execution's own release: its lease was taken over, or set aside).
    Counted,
    /// Fenced, not counted (a give-back of a key nothing ran under).
    Quiet,
    /// Not fenced: a give-back of a key nothing ran under whose releases failed until its
    /// lease ran out. A key found still in flight under the token is no store's mistake then.
    Lapsed,
}

/// What [`set_aside_once`] found.
enum Found {
    /// Nothing more to do: whether the holder gave the key back.
    Settled(bool),
    /// The key is still in flight under the holder's token (its lease running or run out).
    InFlight,
}

/// One try of [`give_back_set_aside`], each call made through `retry` (the read not counted as a
/// try).
async fn set_aside_once<St: IdempotencyStore>(
    store: &Arc<St>,
    key: &ScopedKey,
    token: FencingToken,
    retry: &mut Retry,
) -> Result<Found, StoreError> {
    let expires_at = match retry.whose(store, key, token).await? {
        // Still this holder's, its lease running or run out with nobody come for it: given
        // back as a release in time would have (stopping here left a key nothing ran under to
        // be set aside by the next claim on a route that reconciles, for ever).
        Whose::InFlight { .. } => return Ok(Found::InFlight),
        Whose::SetAside {
            effect_started: false,
            expires_at,
        } => expires_at,
        _ => return Ok(Found::Settled(false)),
    };
    // A released record keeps the expiry it had.
    let ttl = expires_at
        .duration_since(SystemTime::now())
        .unwrap_or_default()
        .max(retry.lease());
    let (store, key) = (Arc::clone(store), key.clone());
    let resolve = async move {
        let note = "given back by its holder: set aside after its lease ran out, no effect started";
        store
            .resolve(&key, token, &Resolution::NotApplied, ttl, Some(note))
            .await
    };
    match retry.spawned(Call::Resolve, resolve).await {
        Ok(()) => {
            observe::count(Event::Release);
            tracing::warn!(
                "the key was set aside after its lease ran out; its holder gave it back"
            );
            Ok(Found::Settled(true))
        }
        // Resolved first by someone else, or no longer set aside: theirs stands.
        Err(StoreError::Fenced) => Ok(Found::Settled(false)),
        Err(error) => Err(error),
    }
}

/// A release of `key` under `token`, owning what it needs (a try on a task of its own: see
/// [`Retry::spawned`]).
fn release<St: IdempotencyStore>(
    store: &Arc<St>,
    key: &ScopedKey,
    token: FencingToken,
) -> impl Future<Output = Result<RecordStatus, StoreError>> + Send + 'static {
    let (store, key) = (Arc::clone(store), key.clone());
    async move { store.release(&key, token).await }
}

/// Counts and logs what a release left: the key given back, or, where the run had marked its
/// effect started, set aside for reconciliation.
pub(super) fn released(status: RecordStatus) {
    if status == RecordStatus::NeedsReconciliation {
        observe::count(Event::MovedToReconciliation);
        tracing::warn!("the effect had started: the key awaits reconciliation");
    } else {
        observe::count(Event::Release);
    }
}
