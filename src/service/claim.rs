//! Step 5's claim: asked at once where the store can, seen to its end where it cannot, waited
//! for while another request holds the key, confirmed when it came back late.

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tracing::Instrument;

use crate::decide::adopt;
use crate::execute::{ReleaseOnDrop, Until, give_back, give_back_set_aside};
use crate::key::ScopedKey;
use crate::observe::{self, Event};
use crate::settings::Resolved;
use crate::store::{
    Claim, ClaimRequest, FencingToken, IdempotencyStore, RecordStatus, StoreError, poll,
    poll_backoff,
};

/// Waits, on a route that waits for an in-flight key, until claiming again is worth it: woken
/// by the store when `seen`'s holder moves on, or polled where nothing was seen (a record
/// locked by a transaction) or where the store woke this request early for nothing the time
/// before (`early`: the holder it saw then, still running). Returns the holder seen if the
/// store came back before `round`'s polling pause, as a store may.
///
/// A store that keeps waking its waiters early then costs a claim per polling pause, never a
/// storm of claims, which in process would starve the keeper renewing the holder's lease until
/// a waiter took over a live run.
pub(super) async fn wait_to_claim<St: IdempotencyStore>(
    store: &St,
    key: &ScopedKey,
    seen: Option<crate::store::InFlight>,
    early: Option<FencingToken>,
    round: u32,
    within: Duration,
) -> Option<FencingToken> {
    match seen {
        Some(seen) if early != Some(seen.token) => {
            let since = tokio::time::Instant::now();
            store.wait_for_change(key, &seen, round, within).await;
            (since.elapsed() < poll_backoff(round)).then_some(seen.token)
        }
        _ => {
            poll(round, within).await;
            None
        }
    }
}

/// Whether an answer to a request sent at `sent` for a lease of `lease` came back within half
/// of it: the lease began after `sent`, so at least half of it is left, whatever the store's
/// clock says.
pub(super) fn in_time(sent: tokio::time::Instant, lease: Duration) -> bool {
    sent.elapsed() * 2 < lease
}

/// What a late claim's lease turned out to be.
pub(super) enum Confirmed {
    /// Still this request's: renewed to `until` by a renewal sent at `sent` that came back
    /// with time to spare.
    Held {
        sent: tokio::time::Instant,
        until: std::time::SystemTime,
    },
    /// Another request took the key over.
    Lost,
    /// The store did not say, or kept answering too late to run under.
    Failed,
}

/// Renews a lease whose claim came back late, fenced, until a renewal comes back
/// [`in_time`]. A few tries; then the store is too slow to run anything under a lease.
///
/// Nothing has run under the lease yet: dropped before it is confirmed (a client hanging up
/// meanwhile), or not confirmed, it is given back (fenced, on a task of its own), as a claim
/// dropped in flight is (see `ClaimToEnd`).
pub(super) async fn confirm<St: IdempotencyStore>(
    store: Arc<St>,
    key: ScopedKey,
    token: FencingToken,
    lease: Duration,
) -> Confirmed {
    let unconfirmed = ReleaseOnDrop {
        store: Some(store.clone()),
        key: key.clone(),
        token,
        lease,
    };
    for _ in 0..3 {
        let sent = tokio::time::Instant::now();
        match store.renew(&key, token, lease).await {
            Ok(until) if in_time(sent, lease) => {
                unconfirmed.disarm();
                return Confirmed::Held { sent, until };
            }
            Ok(_) => {}
            // Another request holds it: a release would be fenced out anyway. Unless that
            // request only set the key aside, its lease having run out meanwhile: nothing ran
            // under it, so it is given back, and the claim that follows may run it.
            Err(StoreError::Fenced) => {
                unconfirmed.disarm();
                // On a task of its own, so that a hang-up meanwhile does not stop it; awaited
                // for up to a lease, so that the claim that follows finds the key given back.
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    let give = async move {
                        give_back_set_aside(&store, &key, token, lease).await;
                    };
                    let given = crate::detached::spawn(&runtime, give.in_current_span());
                    let _ = tokio::time::timeout(lease, given).await;
                }
                return Confirmed::Lost;
            }
            Err(error) => {
                observe::count(Event::StoreError);
                tracing::error!(%error, "a late claim could not be confirmed; not run");
                return Confirmed::Failed;
            }
        }
    }
    tracing::error!("the store answers too late to run under a lease; not run");
    Confirmed::Failed
}

/// How many times one claim adopts another scheme's record (see [`adopting`]) before its
/// answer stands: each time, the record moved on meanwhile.
const ADOPTIONS: usize = 4;

/// The claim to make next when `claimed` found a record this request may take that another
/// fingerprint scheme made from the same input (see `decide::adopt`): `request` with the
/// record's bytes, which the store compares. A store changes a record's bytes only with a
/// fresh claim, so a claim that adopts again follows other requests' progress. Each claim
/// starts from the request's own bytes: a record given back meanwhile under them is taken
/// as it is.
fn adopting(claimed: &Result<Claim, StoreError>, request: &ClaimRequest) -> Option<ClaimRequest> {
    let theirs = adopt(claimed.as_ref().ok()?, &request.fingerprint)?;
    Some(ClaimRequest {
        fingerprint: theirs,
        ..request.clone()
    })
}

/// [`IdempotencyStore::claim_now`], adopting as [`adopting`] says; `None` where the store
/// cannot claim at once (then the claim goes to the store, and adopts there).
pub(super) fn claim_now_adopting<St: IdempotencyStore>(
    store: &St,
    request: &ClaimRequest,
) -> Option<Result<Claim, StoreError>> {
    let mut claimed = store.claim_now(request)?;
    let mut adopted;
    let mut current = request;
    for _ in 0..ADOPTIONS {
        let Some(next) = adopting(&claimed, current) else {
            break;
        };
        claimed = store.claim_now(&next)?;
        adopted = next;
        current = &adopted;
    }
    Some(claimed)
}

type ClaimFuture = std::pin::Pin<Box<dyn Future<Output = Result<Claim, StoreError>> + Send>>;

/// A claim seen to its end even if the request is dropped while it is in flight (a client
/// hanging up during a PostgreSQL round trip): dropped unfinished, it finishes on a task of its
/// own and gives back a key it won, since no handler ever ran under it. Nothing is left in
/// progress, nor awaiting reconciliation, for a request that ran nothing.
pub(super) struct ClaimToEnd<St: IdempotencyStore> {
    claim: Claiming,
    store: Arc<St>,
    key: ScopedKey,
    /// The lease asked for: how long a failed give-back is tried again.
    lease: Duration,
}

/// Where a [`ClaimToEnd`] stands.
enum Claiming {
    /// On its way.
    InFlight(ClaimFuture),
    /// Given out.
    Done,
}

impl<St: IdempotencyStore> ClaimToEnd<St> {
    /// The claim of `request`; with `woken` (the settings of a request woken from waiting on
    /// it), the record is read first, once for every request woken with it, and claimed only
    /// if it may still be taken (absent, released, in flight). A recorded outcome (or one
    /// awaiting reconciliation) is answered from the read: on PostgreSQL a claim locks the
    /// row, and a hundred woken waiters would queue behind one another's commits. Another
    /// scheme's record of the same request is adopted (see [`adopting`]).
    pub(super) fn new(
        store: &Arc<St>,
        request: &ClaimRequest,
        woken: Option<Arc<Resolved>>,
    ) -> Self {
        let (owned, key, lease) = (store.clone(), request.key.clone(), request.lease);
        let mut request = request.clone();
        Self {
            claim: Claiming::InFlight(Box::pin(async move {
                let read = match &woken {
                    Some(config) => config.woken.lookup(&*owned, &request.key).await,
                    None => None,
                };
                if let Some(record) = read
                    && matches!(
                        record.status,
                        RecordStatus::Completed | RecordStatus::NeedsReconciliation
                    )
                {
                    // `now` is read for an in-flight answer's delay only, which this is not.
                    return Ok(Claim::existing(record, std::time::SystemTime::now()));
                }
                let mut claimed = owned.claim(&request).await;
                for _ in 0..ADOPTIONS {
                    let Some(next) = adopting(&claimed, &request) else {
                        break;
                    };
                    claimed = owned.claim(&next).await;
                    request = next;
                }
                claimed
            })),
            store: store.clone(),
            key,
            lease,
        }
    }
}

impl<St: IdempotencyStore> Future for ClaimToEnd<St> {
    type Output = Result<Claim, StoreError>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match std::mem::replace(&mut self.claim, Claiming::Done) {
            Claiming::InFlight(mut claim) => {
                let out = claim.as_mut().poll(cx);
                if out.is_pending() {
                    self.claim = Claiming::InFlight(claim);
                }
                out
            }
            // Polled after it finished: a caller bug that must not panic in a server.
            Claiming::Done => Poll::Pending,
        }
    }
}

impl<St: IdempotencyStore> Drop for ClaimToEnd<St> {
    fn drop(&mut self) {
        let claim = match std::mem::replace(&mut self.claim, Claiming::Done) {
            Claiming::Done => return,
            Claiming::InFlight(claim) => claim,
        };
        let (store, key, lease) = (self.store.clone(), self.key.clone(), self.lease);
        // Without a runtime (shutting down) a won claim's lease runs out instead.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            crate::detached::spawn(&runtime, async move {
                if let Ok(Claim::Acquired(won)) = claim.await {
                    let what = "a claim nobody ran under";
                    give_back(&store, &key, won.token, lease, Until::LeaseEnds, what).await;
                }
            });
        }
    }
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use super::*;
    use crate::MemoryStore;

    /// A claim dropped before the request read it (a client hanging up mid round trip): it
    /// is seen to its end, and since no handler ran under it, the key is given back (DESIGN
    /// §4). Made here on a store that could claim at once, which the pipeline asks first and
    /// reads in the same poll; this guard is for every other claim.
    #[tokio::test]
    async fn s4_a_claim_dropped_unread_gives_the_key_back() {
        let store = Arc::new(MemoryStore::new());
        let key = ScopedKey::new("", "dropped");
        let claim = ClaimToEnd::new(&store, &ClaimRequest::a_minute(&key), None);
        assert!(matches!(claim.claim, Claiming::InFlight(_)));
        drop(claim);
        // The release runs on a task of its own.
        let mut released = false;
        for _ in 0..100 {
            tokio::task::yield_now().await;
            let record = store.lookup(&key).await.expect("lookup").expect("record");
            if record.status == RecordStatus::Released {
                released = true;
                break;
            }
        }
        assert!(released, "the key won and never read is given back");
        match store.claim(&ClaimRequest::a_minute(&key)).await {
            Ok(Claim::Acquired(lease)) => assert_eq!(lease.attempt, 2),
            other => panic!("the next request takes the key over, got {other:?}"),
        }
    }

    /// A claim made at once and read is not given back when it is dropped afterwards.
    #[tokio::test]
    async fn s4_a_claim_made_at_once_and_read_is_kept() {
        let store = Arc::new(MemoryStore::new());
        let key = ScopedKey::new("", "read");
        let claimed = ClaimToEnd::new(&store, &ClaimRequest::a_minute(&key), None).await;
        assert!(matches!(claimed, Ok(Claim::Acquired(_))));
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        let record = store.lookup(&key).await.expect("lookup").expect("record");
        assert_eq!(record.status, RecordStatus::InProgress);
    }
}
