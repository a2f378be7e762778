//! Waiters woken by `NOTIFY`: the triggers' payload, one `LISTEN` per store, and the
//! store's side of a wait.

use std::time::Duration;

use sqlx::AssertSqlSafe;
use sqlx::postgres::PgPool;

use crate::store::sql;
use crate::store::subscription::{Running, Subscription};
use crate::store::{FencingToken, InFlight, ScopedKey};

use super::PostgresStore;

/// The waiters of one store, woken by `NOTIFY`s that the table's triggers send when an
/// in-flight record moves on (the payload: the hex SHA-256 of its scope, a NUL and its key).
/// One listening connection per store, opened on the first wait beside the store's pool
/// (see [`listen`]); while it is down, waiters poll.
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
        self.changes.subscribed(|changes, running| {
            listen(changes, self.pool.clone(), self.channel(), running)
        })
    }
}

/// Where a `LISTEN` connects: a pool of one connection of its own, made with the store's
/// pool's connect options as they are now (a password rotated with `set_connect_options`
/// included), as sqlx's `PgListener::connect` makes one; never a connection of the store's
/// pool. Held for good, one of those would leave claims, renewals and completions one fewer for
/// as long as the store lives (all of them, on a pool of one; two stores' `LISTEN`s on a pool
/// shared with `with_table`, the claims' whole share). A new one for every connection: the
/// one before may still be held by the last listener's clean-up on a link that died.
fn listening_pool(pool: &PgPool) -> PgPool {
    let options = pool.connect_options().as_ref().clone();
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .max_lifetime(None)
        .idle_timeout(None)
        .connect_lazy_with(options)
}

/// How often a quiet `LISTEN` is checked: that its store still lives, and that its
/// connection still answers (a link dropped without a close shows only then).
pub(super) const HEARTBEAT: Duration = Duration::from_secs(2);

/// Keeps a store's `LISTEN` on `channel` up while the store lives and its `pool` is open, on a
/// connection of its own (see [`listening_pool`]), waking the waiters of each key notified;
/// after a lost connection (notifications may have been missed) every waiter is woken to look
/// again.
async fn listen(
    changes: std::sync::Weak<Changes>,
    pool: PgPool,
    channel: String,
    // Ended for any reason (its runtime shut down, before or after it first ran), the
    // `LISTEN` is down: the next waiter starts another.
    _running: Running<String>,
) {
    loop {
        if changes.strong_count() == 0 || pool.is_closed() {
            return;
        }
        if let Ok(mut listener) =
            sqlx::postgres::PgListener::connect_with(&listening_pool(&pool)).await
            && listener.listen(&channel).await.is_ok()
        {
            // A lost connection ends this listener (and wakes every waiter, below), never a
            // quiet reconnect inside `try_recv` that a heartbeat could cut short unseen.
            listener.eager_reconnect(false);
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
                        if changes.strong_count() == 0 || pool.is_closed() {
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
