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

    /// A turn held for as long as a `LISTEN` runs on a connection of the pool, taken out of
    /// the claims' share (so the connections kept for holders stay theirs); none from a share
    /// of one, which claims need. Waits its turn as a claim does, without a bound: waiters
    /// poll until the `LISTEN` is up.
    #[cfg(feature = "postgres")]
    pub(crate) async fn listening(&self) -> Option<SemaphorePermit<'_>> {
        if self.share < 2 {
            tracing::warn!(
                share = self.share,
                kept = self.kept,
                "the claims' share of this PostgreSQL store's pool is one connection, which \
                 its claims need: the LISTEN that wakes waiters holds one of the connections \
                 kept for lease holders instead, for as long as it runs (give a store whose \
                 routes wait for keys in flight a claims' share of at least two connections: \
                 a pool of three, with the default kept for holders)"
            );
            return None;
        }
        self.claims.acquire().await.ok()
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

    /// DESIGN §4: a `LISTEN`'s connection comes out of the claims' share while it runs, never
    /// out of a share of one (the claims' only turn), and goes back to it when it ends.
    #[cfg(feature = "postgres")]
    #[tokio::test]
    async fn a_listen_takes_a_turn_of_the_claims_share_while_it_runs() {
        let reserve = Reserve::new(8, 2, Duration::from_millis(50));
        let listening = reserve.listening().await;
        assert!(listening.is_some(), "a share of six lends one");
        assert_eq!(reserve.claims.available_permits(), 5);
        drop(listening);
        assert_eq!(reserve.claims.available_permits(), 6, "given back");
        let tiny = Reserve::new(2, 1, Duration::from_millis(50));
        assert!(
            tiny.listening().await.is_none(),
            "a share of one lends none"
        );
        assert!(tiny.claim().await.is_ok(), "its claims keep their turn");
    }

    /// Counts the warnings emitted while it is the thread's subscriber.
    struct Warnings(std::sync::atomic::AtomicUsize);

    impl tracing::Subscriber for Warnings {
        fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, event: &tracing::Event<'_>) {
            if *event.metadata().level() == tracing::Level::WARN {
                self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }

    /// DESIGN §4 (holders first): a pool whose claims' share is one connection lends the
    /// `LISTEN` no turn, so it takes a connection kept for holders; that is said, once per
    /// `LISTEN` started, where an operator reads it. A larger share says nothing.
    #[cfg(feature = "postgres")]
    #[test]
    fn a_share_of_one_says_the_listen_takes_a_holders_connection() {
        let warnings = std::sync::Arc::new(Warnings(std::sync::atomic::AtomicUsize::new(0)));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        tracing::subscriber::with_default(warnings.clone(), || {
            // Another test's dispatcher may have cached this callsite as never enabled.
            tracing::callsite::rebuild_interest_cache();
            runtime.block_on(async {
                let roomy = Reserve::new(8, 2, Duration::from_millis(50));
                assert!(roomy.listening().await.is_some());
                let tiny = Reserve::new(2, 1, Duration::from_millis(50));
                assert!(tiny.listening().await.is_none());
            });
        });
        assert_eq!(warnings.0.load(std::sync::atomic::Ordering::SeqCst), 1);
    }
}
