//! [`SqliteStore`]: durable records for the processes of one host.

use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, Row};

use super::codec::fresh_token;
use super::sql::{self, InvalidIdentifier, RawRecord, millis, unavailable};
use super::{
    Claim, ClaimRequest, FencingToken, HistoryEvent, IdempotencyStore, Lease, LeaseExpiry,
    Milestone, Record, RecordStatus, Resolution, ScopedKey, StoreError, StoredResponse,
};

/// Records in a SQLite file: they survive restarts, and every process on the host that opens
/// the same file shares them.
///
/// The file is opened in WAL mode with a busy timeout, so concurrent writers (pools, processes)
/// queue instead of failing. A claim is one write transaction: an upsert that creates, takes
/// over or leaves the record, then (only when it left it) a read of the record, both under
/// SQLite's single write lock, so no other claim can come between them. Times are milliseconds
/// on SQLite's clock (`julianday('now')`).
///
/// Use a file, not `:memory:`: SQLite's in-memory shared cache takes table locks under
/// concurrent writes.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_idempotency::{IdempotencyLayer, store::SqliteStore};
///
/// let store = SqliteStore::connect("sqlite://idempotency.db").await?;
/// store.migrate().await?;
/// let layer = IdempotencyLayer::new(store);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    sql: Arc<Statements>,
}

#[derive(Debug)]
struct Statements {
    table: String,
    upsert: Arc<str>,
    renew: Arc<str>,
    complete: Arc<str>,
    settle: Arc<str>,
    release: Arc<str>,
    current: Arc<str>,
    lookup: Arc<str>,
    remove: Arc<str>,
    purge: Arc<str>,
    effect_started: Arc<str>,
    downstream_id: Arc<str>,
    list_uncertain: Arc<str>,
    resolve: Arc<str>,
    append_history: Arc<str>,
}

/// Milliseconds since the Unix epoch on SQLite's clock; fixed within one statement.
const NOW: &str = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER)";
const COLUMNS: &str = "scope, key, fingerprint, status, lease_token, lease_until, attempts, \
                       effect_started, downstream_id, response, created_at, updated_at, expires_at, \
                       history";

/// A history entry written on SQLite's clock (see [`super::HistoryEntry`]).
fn entry(attempt: &str, token: &str, event: &str) -> String {
    format!("({attempt}) || ' ' || ({token}) || ' ' || {NOW} || ' ' || ({event}) || ';'")
}

impl Statements {
    fn new(table: &str) -> Self {
        let t = format!("\"{table}\"");
        let expired = format!("r.expires_at <= {NOW}");
        let same = "r.fingerprint = excluded.fingerprint";
        let lease_over = format!("r.status = 'in_progress' AND r.lease_until <= {NOW}");
        let takeover = format!(
            "({same} AND (r.status = 'released' OR ({lease_over} AND ?6 AND NOT r.effect_started)))"
        );
        let fresh_or_takeover = format!("({expired} OR {takeover})");
        let upsert = format!(
            "INSERT INTO {t} AS r ({COLUMNS})
             VALUES (?1, ?2, ?3, 'in_progress', ?4, {NOW} + ?5, 1, 0, NULL, NULL, {NOW}, {NOW},
                     {NOW} + MAX(?5, ?7), {claimed_first})
             ON CONFLICT (scope, key) DO UPDATE SET
               fingerprint = CASE WHEN {expired} THEN excluded.fingerprint ELSE r.fingerprint END,
               status = CASE WHEN {fresh_or_takeover} THEN 'in_progress' ELSE 'needs_reconciliation' END,
               lease_token = CASE WHEN {fresh_or_takeover} THEN excluded.lease_token ELSE r.lease_token END,
               lease_until = CASE WHEN {fresh_or_takeover} THEN excluded.lease_until ELSE r.lease_until END,
               attempts = CASE WHEN {expired} THEN 1 WHEN {takeover} THEN r.attempts + 1 ELSE r.attempts END,
               effect_started = CASE WHEN {expired} THEN 0 ELSE r.effect_started END,
               downstream_id = CASE WHEN {expired} THEN NULL ELSE r.downstream_id END,
               response = CASE WHEN {expired} THEN NULL ELSE r.response END,
               created_at = CASE WHEN {expired} THEN {NOW} ELSE r.created_at END,
               updated_at = {NOW},
               expires_at = CASE WHEN {expired} THEN excluded.expires_at
                                 WHEN {takeover} THEN MAX(r.expires_at, excluded.expires_at)
                                 ELSE r.expires_at END,
               history = CASE WHEN {expired} THEN excluded.history
                              WHEN {takeover} THEN r.history || {claimed_again}
                              ELSE r.history || {lease_expired} END
             WHERE {expired} OR ({same} AND (r.status = 'released' OR ({lease_over})))
             RETURNING {COLUMNS}, {NOW}",
            claimed_first = entry("1", "?4", "'claimed'"),
            claimed_again = entry("r.attempts + 1", "excluded.lease_token", "'claimed'"),
            lease_expired = entry("r.attempts", "r.lease_token", "'lease_expired'"),
        );
        let log = |event: &str| {
            format!(
                "history = history || {}",
                entry("attempts", "lease_token", event)
            )
        };
        let fenced = "scope = ?1 AND key = ?2 AND lease_token = ?3 AND status = 'in_progress'";
        // The holder may complete again what it completed in its own transaction.
        let completer = "scope = ?1 AND key = ?2 AND lease_token = ?3 \
                         AND status IN ('in_progress', 'completed')";
        let uncertain = format!(
            "r.status = 'needs_reconciliation' OR (r.status = 'in_progress' AND r.lease_until <= {NOW})"
        );
        Self {
            table: table.to_owned(),
            upsert: upsert.into(),
            renew: format!(
                "UPDATE {t} SET lease_until = {NOW} + ?4, expires_at = MAX(expires_at, {NOW} + ?4),
                   updated_at = {NOW}
                 WHERE {fenced} RETURNING lease_until"
            )
            .into(),
            complete: format!(
                "UPDATE {t} SET status = 'completed', response = ?4, expires_at = {NOW} + ?5,
                   updated_at = {NOW}, {}
                 WHERE {completer}",
                log("'completed'")
            )
            .into(),
            settle: format!(
                "UPDATE {t} SET status = ?4, updated_at = {NOW}, {} WHERE {fenced}",
                log("?4")
            )
            .into(),
            release: format!(
                "UPDATE {t} SET status = CASE WHEN effect_started THEN 'needs_reconciliation'
                   ELSE 'released' END, updated_at = {NOW}, {}
                 WHERE {fenced} RETURNING status",
                log("CASE WHEN effect_started THEN 'needs_reconciliation' ELSE 'released' END")
            )
            .into(),
            current: format!("SELECT {COLUMNS}, {NOW} FROM {t} WHERE scope = ?1 AND key = ?2").into(),
            lookup: format!(
                "SELECT {COLUMNS}, {NOW} FROM {t} WHERE scope = ?1 AND key = ?2 AND expires_at > {NOW}"
            )
            .into(),
            remove: format!("DELETE FROM {t} WHERE scope = ?1 AND key = ?2").into(),
            purge: format!("DELETE FROM {t} WHERE expires_at <= {NOW}").into(),
            effect_started: format!(
                "UPDATE {t} SET effect_started = 1, updated_at = {NOW}, {} WHERE {fenced}",
                log("'effect_started'")
            )
            .into(),
            downstream_id: format!(
                "UPDATE {t} SET downstream_id = ?4, updated_at = {NOW}, {} WHERE {fenced}",
                log("'downstream_id'")
            )
            .into(),
            list_uncertain: format!(
                "SELECT {COLUMNS}, {NOW} FROM {t} r WHERE ({uncertain}) AND r.expires_at > {NOW}
                 ORDER BY r.updated_at LIMIT ?1"
            )
            .into(),
            resolve: format!(
                "UPDATE {t} AS r SET status = ?4, response = COALESCE(?5, r.response),
                   expires_at = CASE WHEN ?4 = 'completed' THEN {NOW} + ?6 ELSE r.expires_at END,
                   updated_at = {NOW},
                   history = r.history || {}
                 WHERE r.scope = ?1 AND r.key = ?2 AND r.lease_token = ?3 AND ({uncertain})",
                entry(
                    "r.attempts",
                    "r.lease_token",
                    "CASE WHEN ?4 = 'completed' THEN 'reconciled_applied' ELSE 'reconciled_not_applied' END"
                )
            )
            .into(),
            append_history: format!(
                "UPDATE {t} SET {} WHERE scope = ?1 AND key = ?2 AND expires_at > {NOW}",
                log("?3")
            )
            .into(),
        }
    }
}

impl SqliteStore {
    /// The default table: `idempotency_records`.
    pub const DEFAULT_TABLE: &'static str = "idempotency_records";

    /// A store on `pool`, in the default table. Open the pool with WAL and a busy timeout (as
    /// [`connect`](Self::connect) does) if several writers share the file.
    pub fn new(pool: SqlitePool) -> Self {
        Self {
            pool,
            sql: Arc::new(Statements::new(Self::DEFAULT_TABLE)),
        }
    }

    /// Opens (creating if missing) the database at `url` (`sqlite://path/to/file.db`) in WAL
    /// mode with a 5 s busy timeout.
    pub async fn connect(url: &str) -> Result<Self, sqlx::Error> {
        let options = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await?;
        Ok(Self::new(pool))
    }

    /// Keeps records in `table` instead; it must be a plain identifier.
    pub fn with_table(mut self, table: &str) -> Result<Self, InvalidIdentifier> {
        self.sql = Arc::new(Statements::new(sql::identifier(table)?));
        Ok(self)
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The DDL [`migrate`](Self::migrate) runs, one statement per entry, each idempotent.
    pub fn migration_sql(&self) -> Vec<String> {
        let table = &self.sql.table;
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS \"{table}\" (
                   scope BLOB NOT NULL,
                   key BLOB NOT NULL,
                   fingerprint BLOB NOT NULL,
                   status TEXT NOT NULL CHECK (status IN
                     ('in_progress', 'completed', 'released', 'needs_reconciliation')),
                   lease_token INTEGER NOT NULL,
                   lease_until INTEGER NOT NULL,
                   attempts INTEGER NOT NULL,
                   effect_started INTEGER NOT NULL DEFAULT 0,
                   downstream_id TEXT,
                   response BLOB,
                   created_at INTEGER NOT NULL,
                   updated_at INTEGER NOT NULL,
                   expires_at INTEGER NOT NULL,
                   history TEXT NOT NULL DEFAULT '',
                   PRIMARY KEY (scope, key)
                 ) WITHOUT ROWID"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS \"{table}_expires_at\" ON \"{table}\" (expires_at)"
            ),
        ]
    }

    /// Creates the table and index if missing.
    pub async fn migrate(&self) -> Result<(), sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        for statement in self.migration_sql() {
            sqlx::query(AssertSqlSafe(statement))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await
    }

    async fn settle(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        status: RecordStatus,
    ) -> Result<(), StoreError> {
        let done = sqlx::query(AssertSqlSafe(self.sql.settle.clone()))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(sql::token(token))
            .bind(status.as_str())
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
        fenced(done.rows_affected())
    }

    async fn try_claim(
        &self,
        req: &ClaimRequest,
        token: FencingToken,
    ) -> Result<Claim, sqlx::Error> {
        let (scope, key) = (req.key.scope().as_bytes(), req.key.key().as_bytes());
        // The upsert takes the write lock; the read that may follow runs under it.
        let mut tx = self.pool.begin().await?;
        let written = sqlx::query(AssertSqlSafe(self.sql.upsert.clone()))
            .bind(scope)
            .bind(key)
            .bind(req.fingerprint.as_bytes().as_slice())
            .bind(sql::token(token))
            .bind(millis(req.lease))
            .bind(req.on_lease_expiry == LeaseExpiry::Reclaim)
            .bind(millis(req.ttl))
            .fetch_optional(&mut *tx)
            .await?;
        let (row, written) = match written {
            Some(row) => (row, true),
            None => {
                let row = sqlx::query(AssertSqlSafe(self.sql.current.clone()))
                    .bind(scope)
                    .bind(key)
                    .fetch_one(&mut *tx)
                    .await?;
                (row, false)
            }
        };
        tx.commit().await?;
        let (raw, now) = raw(&row)?;
        let record = raw
            .into_record()
            .map_err(|e| sqlx::Error::Decode(e.into()))?;
        if written && record.lease_token == token && record.status == RecordStatus::InProgress {
            return Ok(Claim::Acquired(Lease {
                token,
                attempt: record.attempts,
                until: record.lease_until,
            }));
        }
        Ok(Claim::Existing {
            record: Box::new(record),
            now,
        })
    }

    /// Records a milestone on `connection`, typically inside the handler's own transaction, so
    /// the business write and the milestone commit or roll back together:
    ///
    /// ```no_run
    /// # async fn handler(store: tower_idempotency::store::SqliteStore, ctx: tower_idempotency::IdempotencyContext)
    /// # -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::store::Milestone;
    ///
    /// let mut tx = store.pool().begin().await?;
    /// sqlx::query("INSERT INTO orders (id) VALUES (1)").execute(&mut *tx).await?;
    /// store
    ///     .record_milestone_in(&mut tx, ctx.scoped_key(), ctx.fencing_token(), &Milestone::EffectStarted)
    ///     .await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn record_milestone_in(
        &self,
        connection: &mut sqlx::SqliteConnection,
        key: &ScopedKey,
        token: FencingToken,
        milestone: &Milestone,
    ) -> Result<(), StoreError> {
        self.milestone_on(connection, key, token, milestone).await
    }

    /// Records the outcome on `connection`, typically inside the handler's own transaction, so
    /// the business write and the recorded response commit or roll back together. The layer
    /// records the live response again afterwards, with the same token; that is allowed.
    pub async fn complete_in(
        &self,
        connection: &mut sqlx::SqliteConnection,
        key: &ScopedKey,
        token: FencingToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.complete_on(connection, key, token, response, ttl)
            .await
    }

    async fn complete_on<'c, E>(
        &self,
        executor: E,
        key: &ScopedKey,
        token: FencingToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError>
    where
        E: sqlx::Executor<'c, Database = sqlx::Sqlite>,
    {
        let done = sqlx::query(AssertSqlSafe(self.sql.complete.clone()))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(sql::token(token))
            .bind(response.to_bytes())
            .bind(millis(ttl))
            .execute(executor)
            .await
            .map_err(unavailable)?;
        fenced(done.rows_affected())
    }

    async fn milestone_on<'c, E>(
        &self,
        executor: E,
        key: &ScopedKey,
        token: FencingToken,
        milestone: &Milestone,
    ) -> Result<(), StoreError>
    where
        E: sqlx::Executor<'c, Database = sqlx::Sqlite>,
    {
        let query = match milestone {
            Milestone::EffectStarted => sqlx::query(AssertSqlSafe(self.sql.effect_started.clone())),
            Milestone::DownstreamId(_) => {
                sqlx::query(AssertSqlSafe(self.sql.downstream_id.clone()))
            }
        };
        let mut query = query
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(sql::token(token));
        if let Milestone::DownstreamId(id) = milestone {
            query = query.bind(id.as_str());
        }
        let done = query.execute(executor).await.map_err(unavailable)?;
        fenced(done.rows_affected())
    }
}

fn fenced(rows: u64) -> Result<(), StoreError> {
    if rows == 1 {
        Ok(())
    } else {
        Err(StoreError::Fenced)
    }
}

fn raw(row: &SqliteRow) -> Result<(RawRecord, SystemTime), sqlx::Error> {
    let record = RawRecord {
        scope: row.try_get(0)?,
        key: row.try_get(1)?,
        fingerprint: row.try_get(2)?,
        status: row.try_get(3)?,
        lease_token: row.try_get(4)?,
        lease_until_ms: row.try_get(5)?,
        attempts: row.try_get(6)?,
        effect_started: row.try_get(7)?,
        downstream_id: row.try_get(8)?,
        response: row.try_get(9)?,
        created_at_ms: row.try_get(10)?,
        updated_at_ms: row.try_get(11)?,
        expires_at_ms: row.try_get(12)?,
        history: row.try_get(13)?,
    };
    Ok((record, sql::from_millis(row.try_get(14)?)))
}

impl IdempotencyStore for SqliteStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        self.try_claim(req, fresh_token())
            .await
            .map_err(unavailable)
    }

    async fn renew(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<SystemTime, StoreError> {
        let until: Option<i64> = sqlx::query_scalar(AssertSqlSafe(self.sql.renew.clone()))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(sql::token(token))
            .bind(millis(lease))
            .fetch_optional(&self.pool)
            .await
            .map_err(unavailable)?;
        until.map(sql::from_millis).ok_or(StoreError::Fenced)
    }

    async fn complete(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.complete_on(&self.pool, key, token, response, ttl)
            .await
    }

    async fn release(
        &self,
        key: &ScopedKey,
        token: FencingToken,
    ) -> Result<RecordStatus, StoreError> {
        let status: Option<String> = sqlx::query_scalar(AssertSqlSafe(self.sql.release.clone()))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(sql::token(token))
            .fetch_optional(&self.pool)
            .await
            .map_err(unavailable)?;
        match status.as_deref() {
            Some("needs_reconciliation") => Ok(RecordStatus::NeedsReconciliation),
            Some(_) => Ok(RecordStatus::Released),
            None => Err(StoreError::Fenced),
        }
    }

    async fn mark_uncertain(&self, key: &ScopedKey, token: FencingToken) -> Result<(), StoreError> {
        self.settle(key, token, RecordStatus::NeedsReconciliation)
            .await
    }

    async fn lookup(&self, key: &ScopedKey) -> Result<Option<Record>, StoreError> {
        let row = sqlx::query(AssertSqlSafe(self.sql.lookup.clone()))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .fetch_optional(&self.pool)
            .await
            .map_err(unavailable)?;
        match row {
            Some(row) => Ok(Some(raw(&row).map_err(unavailable)?.0.into_record()?)),
            None => Ok(None),
        }
    }

    async fn remove(&self, key: &ScopedKey) -> Result<bool, StoreError> {
        let done = sqlx::query(AssertSqlSafe(self.sql.remove.clone()))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
        Ok(done.rows_affected() > 0)
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let done = sqlx::query(AssertSqlSafe(self.sql.purge.clone()))
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
        Ok(done.rows_affected())
    }

    async fn record_milestone(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        milestone: &Milestone,
    ) -> Result<(), StoreError> {
        self.milestone_on(&self.pool, key, token, milestone).await
    }

    async fn list_uncertain(&self, limit: usize) -> Result<Vec<Record>, StoreError> {
        let rows = sqlx::query(AssertSqlSafe(self.sql.list_uncertain.clone()))
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(&self.pool)
            .await
            .map_err(unavailable)?;
        rows.iter()
            .map(|row| raw(row).map_err(unavailable)?.0.into_record())
            .collect()
    }

    async fn resolve(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        resolution: &Resolution,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let (status, response) = match resolution {
            Resolution::Applied(response) => (RecordStatus::Completed, Some(response.to_bytes())),
            Resolution::NotApplied => (RecordStatus::Released, None),
        };
        let done = sqlx::query(AssertSqlSafe(self.sql.resolve.clone()))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(sql::token(token))
            .bind(status.as_str())
            .bind(response)
            .bind(millis(ttl))
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
        fenced(done.rows_affected())
    }

    async fn append_history(&self, key: &ScopedKey, event: HistoryEvent) -> Result<(), StoreError> {
        sqlx::query(AssertSqlSafe(self.sql.append_history.clone()))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(event.as_str())
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
        Ok(())
    }
}
