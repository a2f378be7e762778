//! Claims whose answer was lost on the way back: the store may have made them all the same.
//!
//! A networked store's claim runs on the server; if the connection breaks (or times out)
//! before its answer arrives, nobody knows whether it landed. Left so, a claim that landed
//! holds the key for a request that was refused and ran nothing: in flight for a lease, and
//! on a route with external effects sent to reconciliation ("outcome unknown") when the lease
//! ends. The stores ask once more with the same token (a claim that landed then reads as this
//! one's); when that answer is lost too, [`give_back`] releases whatever of it landed.

use std::time::Duration;

use tokio::time::Instant;

use super::{FencingToken, IdempotencyStore, ScopedKey, StoreError};

/// Whether a failed store call may have run all the same: the first error of type `E` in
/// `error`'s chain of sources says so by `broke` (its connection broke or timed out before the
/// answer came), rather than the store answering with an error or with something unreadable.
pub(crate) fn lost<E: std::error::Error + 'static>(
    error: &StoreError,
    broke: impl Fn(&E) -> bool,
) -> bool {
    let StoreError::Unavailable(source) = error else {
        return false;
    };
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(source.as_ref());
    while let Some(error) = next {
        if let Some(error) = error.downcast_ref::<E>() {
            return broke(error);
        }
        next = error.source();
    }
    false
}

/// Releases, in the background, what may have landed of a claim made with `token` whose
/// answers were all lost; tried again while the store fails, until `lease` would end (after
/// that the next claim decides, as for any lapsed claim). Nothing ran under the token, so
/// nothing can be lost by it: the release is fenced by the token (another claim's record is
/// left alone), and a record this claim took over had no effect started (a claim never takes
/// such a one), so it ends `released`.
///
/// A release fenced may mean that nothing landed, or that the claim is still on its way (held
/// by a link or a pooler after the connection broke): asked [`FENCED_TRIES`] times over a
/// second and a half, whatever the lease, before it is believed. On a store whose commands on one connection run in
/// order (Redis), the release follows the lost claim there, so one that timed out lands first.
/// (A Redis claim refused for want of replicas' acknowledgement is given back on its first
/// connection; the re-ask that waited for them, should it land later, writes nothing.)
pub(crate) fn give_back<S: IdempotencyStore + Clone>(
    store: &S,
    key: &ScopedKey,
    token: FencingToken,
    lease: Duration,
) {
    // Without a runtime (shutting down) the lease simply runs out instead.
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let (store, key) = (store.clone(), key.clone());
    crate::detached::spawn(&runtime, async move {
        let until = Instant::now() + lease;
        let mut pause = Duration::from_millis(100);
        let mut fenced = 0;
        loop {
            let error = match store.release(&key, token).await {
                Ok(_) => return,
                Err(error) => error,
            };
            if matches!(error, StoreError::Fenced) {
                // Whatever the lease: one landing late holds a lease of its own from then.
                fenced += 1;
                if fenced == FENCED_TRIES {
                    return;
                }
                pause = pause.max(Duration::from_millis(500));
            } else if Instant::now() + pause >= until {
                tracing::warn!(
                    scope = key.scope(),
                    key = key.key(),
                    %error,
                    "a claim whose answer was lost could not be given back; the key stays held \
                     until its lease ends"
                );
                return;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(2));
        }
    });
}

/// How many fenced releases [`give_back`] takes for an answer that nothing of the claim landed.
const FENCED_TRIES: u32 = 3;
