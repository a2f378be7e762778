//! Waiters woken by `NOTIFY`: the triggers' payload, one `LISTEN` per store, and the
//! store's side of a wait.

use std::sync::Arc;
use std::time::Duration;

use sqlx::AssertSqlSafe;
use sqlx::postgres::PgPool;

use crate::store::reserve::Reserve;
use crate::store::sql;
use crate::store::subscription::{Running, Subscription};
use crate::store::{FencingToken, InFlight, ScopedKey};

use super::PostgresStore;

/// The waiters of one store, woken by `NOTIFY`s that the table's triggers send when an
/// in-flight record moves on (the payload: the hex SHA-256 of its scope, a NUL and its key).
/// One listening connection per store, opened on the first wait; while it is down, waiters
/// poll.
pub(super) type Changes = Subscription<String>;

/// What the triggers send for a key: the hex SHA-256 of its scope, a NUL and its key.
pub(super) fn change_payload(key: &ScopedKey) -> String {
    use sha2::Digest;
    let mut hash = sha2::Sha256::new();
    hash.update(key.scope().as_bytes());
    hash.update([0]);
    hash.update(key.key().as_bytes());
    hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

impl PostgresStore {
    /// The channel this store's triggers notify and its waiters listen on.
    pub(super) fn channel(&self) -> String {
        sql::derived_name(
            &format!("{}_{}", self.sql.schema, self.sql.table),
            "_changed",
        )
    }

    /// Waits for a change of `key` (see [`IdempotencyStore::wait_for_change`]): woken by the
    /// triggers' `NOTIFY` through one `LISTEN` connection per store, or at the holder's lease
    /// end; polls while that connection is down.
    pub(super) async fn wait_changed(
        &self,
        key: &ScopedKey,
        seen: &InFlight,
        round: u32,
        within: Duration,
    ) {
        if !self.subscribed() {
            crate::store::poll(round, within).await;
            return;
        }
        // Checked once registered, so a change between the claim and now is not missed; and
        // the record marked as waited on, so that its change notifies.
        let moved_on = self.mark_waited(key, seen.token, within);
        self.changes
            .waiters
            .wait(&change_payload(key), seen, within, moved_on)
            .await;
    }

    /// Whether the record of `key` has moved on from the holder `token`; if not, marks it as
    /// waited on (once: later waiters only read), so its triggers notify when it does. A
    /// record locked by its holder's transaction counts as moved on: the caller claims again,
    /// which answers for it.
    pub(super) async fn mark_waited(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        within: Duration,
    ) -> bool {
        // A waiter's reads wait their turn in the claims' share, as its claims do, within the
        // route's bound on waiting (this comes before it). Not a turn taken only if free: under
        // a crowd of waiters every one would then claim again and again instead of being
        // woken, which is the storm the wake is for.
        let Ok(Ok(_turn)) = tokio::time::timeout(within, self.reserve.claim()).await else {
            return true;
        };
        let waited: Result<Option<bool>, sqlx::Error> =
            sqlx::query_scalar(AssertSqlSafe(self.sql.waited.clone()))
                .bind(key.scope().as_bytes())
                .bind(key.key().as_bytes())
                .bind(sql::token(token))
                .fetch_optional(&self.pool)
                .await;
        match waited {
            Ok(Some(true)) => false,
            Ok(Some(false)) => {
                match sqlx::query(AssertSqlSafe(self.sql.mark_waited.clone()))
                    .bind(key.scope().as_bytes())
                    .bind(key.key().as_bytes())
                    .bind(sql::token(token))
                    .execute(&self.pool)
                    .await
                {
                    Ok(done) => done.rows_affected() == 0,
                    Err(_) => true,
                }
            }
            Ok(None) | Err(_) => true,
        }
    }

    /// Whether this store's `LISTEN` is up; starts it on first use.
    pub(super) fn subscribed(&self) -> bool {
        // A pool of one connection: a `LISTEN` would hold it for good, and the store could do
        // nothing else. Waiters poll.
        if self.pool.options().get_max_connections() < 2 {
            return false;
        }
        self.changes.subscribed(|changes, running| {
            let (pool, reserve) = (self.pool.clone(), self.reserve.clone());
            listen(changes, pool, reserve, self.channel(), running)
        })
    }
}

/// How often a quiet `LISTEN` is checked: that its store still lives, and that its
/// connection still answers (a link dropped without a close shows only then).
pub(super) const HEARTBEAT: Duration = Duration::from_secs(2);

/// Keeps a store's `LISTEN` on `channel` up while the store lives (one of the pool's connections,
/// held for good: a turn of the claims' share is held as long), waking the waiters of each key
/// notified; after a lost connection (notifications may have been missed) every waiter is woken to
/// look again.
async fn listen(
    changes: std::sync::Weak<Changes>,
    pool: PgPool,
    reserve: Arc<Reserve>,
    channel: String,
    // Ended for any reason (its runtime shut down, before or after it first ran), the
    // `LISTEN` is down: the next waiter starts another.
    _running: Running<String>,
) {
    // Its connection comes out of the claims' share, never the holders'.
    let _turn = reserve.listening().await;
    loop {
        if changes.strong_count() == 0 {
            return;
        }
        if let Ok(mut listener) = sqlx::postgres::PgListener::connect_with(&pool).await
            && listener.listen(&channel).await.is_ok()
        {
            if let Some(c) = changes.upgrade() {
                c.up();
            }
            loop {
                match tokio::time::timeout(HEARTBEAT, listener.try_recv()).await {
                    Ok(Ok(Some(notification))) => {
                        let Some(c) = changes.upgrade() else {
                            return;
                        };
                        c.waiters.wake(&notification.payload().to_owned());
                    }
                    // `None`: the connection was lost.
                    Ok(Ok(None) | Err(_)) => break,
                    Err(_) => {
                        if changes.strong_count() == 0 {
                            return;
                        }
                        let ping = sqlx::query("SELECT 1").execute(&mut listener);
                        if !matches!(tokio::time::timeout(HEARTBEAT, ping).await, Ok(Ok(_))) {
                            break;
                        }
                    }
                }
            }
            tracing::warn!(
                "the PostgreSQL LISTEN connection was lost; waiters poll until it is back"
            );
        }
        let Some(c) = changes.upgrade() else {
            return;
        };
        c.down();
        drop(c);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[cfg(test)]
mod tests {
    /// DESIGN §5 (while the subscription is down, waiters poll): a store on a pool of one
    /// connection never starts a `LISTEN`, which would hold that connection for good and leave
    /// every claim, renewal and completion waiting for it; its waiters poll. One of two does.
    #[test]
    fn a_pool_of_one_never_listens() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        runtime.block_on(async {
            let store = |max| {
                let pool = sqlx::postgres::PgPoolOptions::new()
                    .max_connections(max)
                    .connect_lazy("postgres://postgres@127.0.0.1:1/none")
                    .expect("a lazy pool");
                super::PostgresStore::new(pool)
            };
            let one = store(1);
            assert!(!one.subscribed());
            assert!(!one.changes.started(), "no LISTEN on a pool of one");
            let two = store(2);
            assert!(!two.subscribed(), "not up yet");
            assert!(two.changes.started(), "a LISTEN on a pool of two");
        });
    }
}
