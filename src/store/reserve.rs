//! The connections of a sqlx store's pool kept for the requests holding leases.
//!
//! Claims come in crowds: a retry storm, sixteen duplicates of one key, a queue redelivering.
//! A holder's writes (renewals, completions, releases) come one at a time and are late at a
//! price: sqlx's pool serves its waiters in turn, so a renewal queued for a connection behind
//! a crowd of claims can wait past the lease's end, and a duplicate then takes over a run that
//! is still going: the effect happens twice. So claims (and the reads that wait for a key in
//! flight) hold at most all but a few of the pool's connections at once; the few left are
//! the holders'. A holder then queues behind other holders, and at worst behind one claim's
//! statement, never behind the crowd.
//!
//! Only the store's own statements are shared out so: connections the application takes from
//! the same pool (a handler's own transaction, another store on the same pool) are not.

use std::time::Duration;

use tokio::sync::{Semaphore, SemaphorePermit};

/// How many of a pool's `max` connections are kept for holders unless the store is told
/// otherwise: a quarter, at least one; none of a pool of one, whose claims need it.
pub(crate) fn kept_by_default(max: u32) -> u32 {
    if max < 2 { 0 } else { (max / 4).max(1) }
}

/// The claims' share of a pool: the connections claims may hold (or wait for) at once.
#[derive(Debug)]
pub(crate) struct Reserve {
    claims: Semaphore,
    /// How many turns the share has in all.
    share: usize,
    /// How long a claim waits for its share: the pool's own acquire time-out.
    wait: Duration,
    kept: u32,
}

impl Reserve {
    /// For a pool of `max` connections whose acquire waits at most `wait`, keeping `kept` of
    /// them for holders (at most all but one: claims always have one).
    pub(crate) fn new(max: u32, kept: u32, wait: Duration) -> Self {
        let kept = kept.min(max.saturating_sub(1));
        let share = usize::try_from(max.saturating_sub(kept).max(1)).unwrap_or(usize::MAX);
        Self {
            claims: Semaphore::new(share),
            share,
            wait,
            kept,
        }
    }

    /// How many connections are kept for holders.
    pub(crate) fn kept(&self) -> u32 {
        self.kept
    }

    /// A claim's turn at the pool, held while its statement runs. Waits at most as long as
    /// the pool would for a connection, then fails as the pool does (`PoolTimedOut`: the
    /// store is unavailable, nothing runs). The pool's own wait for a connection comes after.
    pub(crate) async fn claim(&self) -> Result<SemaphorePermit<'_>, sqlx::Error> {
        match tokio::time::timeout(self.wait, self.claims.acquire()).await {
            Ok(Ok(permit)) => Ok(permit),
            // Never closed; and a claim that cannot have its turn is one the pool refused.
            Ok(Err(_)) | Err(_) => {
                tracing::warn!(
                    share = self.share,
                    kept = self.kept,
                    "a claim (or a waiter's read) waited the pool's acquire time-out for a turn \
                     in the claims' share of the pool (a crowd of claims, or the pool too \
                     small): refused"
                );
                Err(sqlx::Error::PoolTimedOut)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DESIGN §4 (the holder keeps its lease while its process lives): a quarter of the pool, at
    /// least one, is kept for holders; a pool of one keeps none; claims always keep at least one
    /// connection, whatever is asked.
    #[test]
    fn a_quarter_of_the_pool_is_kept_and_claims_keep_one() {
        for (max, kept) in [
            (0, 0),
            (1, 0),
            (2, 1),
            (4, 1),
            (7, 1),
            (8, 2),
            (16, 4),
            (100, 25),
        ] {
            assert_eq!(kept_by_default(max), kept, "pool of {max}");
        }
        let wait = Duration::from_secs(1);
        for (max, asked, kept, share) in [(16, 4, 4, 12), (2, 5, 1, 1), (1, 1, 0, 1), (8, 0, 0, 8)]
        {
            let reserve = Reserve::new(max, asked, wait);
            assert_eq!(reserve.kept(), kept, "pool of {max}, {asked} asked");
            assert_eq!(reserve.claims.available_permits(), share, "pool of {max}");
        }
    }

    /// DESIGN §4: a claim past its share waits, and fails as the pool does once the pool's
    /// acquire time-out has passed; a share given back lets the next in.
    #[tokio::test]
    async fn a_claim_past_the_share_waits_the_pools_time_out() {
        let reserve = Reserve::new(2, 1, Duration::from_millis(50));
        let held = reserve.claim().await.expect("the one share");
        let started = tokio::time::Instant::now();
        let refused = reserve.claim().await;
        assert!(
            matches!(refused, Err(sqlx::Error::PoolTimedOut)),
            "{refused:?}"
        );
        assert!(started.elapsed() >= Duration::from_millis(50), "it waited");
        drop(held);
        assert!(reserve.claim().await.is_ok(), "given back, taken again");
    }
}
