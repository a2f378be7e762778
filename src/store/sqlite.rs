//! [`SqliteStore`]: durable records for the processes of one host.

use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteRow, SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, Connection, Row};

use super::batch::{Batches, ClaimOp, CompleteOp};
use super::history::{HISTORY_LIMIT, HISTORY_REFUSALS};
use super::sql::{self, InvalidIdentifier, RawRecord, millis, unavailable};
use super::{
    Claim, ClaimRequest, FencingToken, HistoryEvent, IdempotencyStore, InFlight, LeaseExpiry,
    Milestone, Record, RecordStatus, Resolution, ScopedKey, StoreError, StoredResponse,
    UncertainCount, UncertainCursor, UncertainPage, UncertainQuery, Unreadable,
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
/// Under concurrency, [`with_batching`](Self::with_batching) sends claims (and, apart,
/// completions) that arrive while a batch is in flight in one write transaction: one commit,
/// one turn of the write lock, which this store's batches take in turn instead of contending
/// for it in SQLite's busy handler. A batch that fails is sent again one operation at a time.
///
/// For tests, `sqlite::memory:` works too: [`connect`](Self::connect) then keeps one
/// connection open for the store's life (the database lives as long as one connection does)
/// and serves it through a pool of one (SQLite's in-memory shared cache takes table locks
/// under concurrent writers). Its records die with the process, as a `MemoryStore`'s do.
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
    /// Held, never read: for an in-memory database, a connection outside the pool that keeps it alive when the
    /// pool closes all of its own (idle ones after 10 minutes, broken ones at any time).
    #[allow(dead_code)]
    anchor: Option<Arc<std::sync::Mutex<SqliteConnection>>>,
    /// Claims and completions sent together under concurrency, when turned on.
    batches: Option<Arc<Batches>>,
    /// Taken by each batch for its transaction: batches of this store take SQLite's one write
    /// lock in turn, woken in order, where contending for it would put the losers to sleep in
    /// SQLite's busy handler (1, 2, 5, 10… ms).
    writer: Arc<tokio::sync::Mutex<()>>,
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
    list_uncertain_after: Arc<str>,
    list_uncertain_desc: Arc<str>,
    list_uncertain_after_desc: Arc<str>,
    count_uncertain: Arc<str>,
    resolve: Arc<str>,
    append_history: Arc<str>,
}

/// Milliseconds since the Unix epoch on SQLite's clock; fixed within one statement.
const NOW: &str = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER)";
const COLUMNS: &str = "scope, key, fingerprint, status, lease_token, lease_until, attempts, \
                       effect_started, downstream_id, response, created_at, updated_at, expires_at, \
                       history";
/// What every read returns: the written columns and the resolution's note.
const READ: &str = "scope, key, fingerprint, status, lease_token, lease_until, attempts, \
                    effect_started, downstream_id, response, created_at, updated_at, expires_at, \
                    history, resolution_note";

/// A record's place in the uncertain listing: its time, or, for a time that is not an integer
/// (written by hand), the end of the listing, where SQLite sorts such values.
const CURSOR_MILLIS: &str =
    "(CASE WHEN typeof(r.updated_at) = 'integer' THEN r.updated_at ELSE 9223372036854775807 END)";

/// Records only a reconciliation can settle once their holder is gone: awaiting it, or in
/// progress with the effect started or on a route that reconciles expired leases.
const WATCHED: &str = "r.status = 'needs_reconciliation' \
    OR (r.status = 'in_progress' AND (r.effect_started OR r.reconcile_on_expiry))";

/// A history entry written on SQLite's clock (see [`super::HistoryEntry`]).
fn entry(attempt: &str, token: &str, event: &str) -> String {
    format!("({attempt}) || ' ' || ({token}) || ' ' || {NOW} || ' ' || ({event}) || ';'")
}

impl Statements {
    fn new(table: &str) -> Self {
        let t = format!("\"{table}\"");
        // An unknown outcome (awaiting reconciliation, or an effect started) never expires.
        let expired = format!(
            "(r.expires_at <= {NOW} AND (r.status IN ('completed', 'released') \
             OR (r.status = 'in_progress' AND NOT r.effect_started AND NOT r.reconcile_on_expiry)))"
        );
        let same = "r.fingerprint = excluded.fingerprint";
        let lease_over = format!("r.status = 'in_progress' AND r.lease_until <= {NOW}");
        let takeover = format!(
            "({same} AND (r.status = 'released' OR ({lease_over} AND ?6 AND NOT r.effect_started)))"
        );
        let fresh_or_takeover = format!("({expired} OR {takeover})");
        let upsert = format!(
            "INSERT INTO {t} AS r ({COLUMNS}, reconcile_on_expiry)
             VALUES (?1, ?2, ?3, 'in_progress', ?4, {NOW} + ?5, 1, 0, NULL, NULL, {NOW}, {NOW},
                     {NOW} + MAX(?5, ?7), {claimed_first}, NOT ?6)
             ON CONFLICT (scope, key) DO UPDATE SET
               fingerprint = CASE WHEN {expired} THEN excluded.fingerprint ELSE r.fingerprint END,
               status = CASE WHEN {fresh_or_takeover} THEN 'in_progress' ELSE 'needs_reconciliation' END,
               lease_token = CASE WHEN {fresh_or_takeover} THEN excluded.lease_token ELSE r.lease_token END,
               lease_until = CASE WHEN {fresh_or_takeover} THEN excluded.lease_until ELSE r.lease_until END,
               attempts = CASE WHEN {expired} THEN 1 WHEN {takeover} THEN r.attempts + 1 ELSE r.attempts END,
               effect_started = CASE WHEN {expired} THEN 0 ELSE r.effect_started END,
               reconcile_on_expiry = CASE WHEN {fresh_or_takeover} THEN excluded.reconcile_on_expiry
                                          ELSE r.reconcile_on_expiry END,
               downstream_id = CASE WHEN {expired} THEN NULL ELSE r.downstream_id END,
               response = CASE WHEN {expired} THEN NULL ELSE r.response END,
               created_at = CASE WHEN {expired} THEN {NOW} ELSE r.created_at END,
               updated_at = {NOW},
               expires_at = CASE WHEN {expired} THEN excluded.expires_at
                                 WHEN {takeover} THEN MAX(r.expires_at, excluded.expires_at)
                                 ELSE r.expires_at END,
               history = CASE WHEN {expired} THEN excluded.history
                              WHEN {takeover} THEN {claimed_again}
                              ELSE {lease_expired} END
             WHERE {expired} OR ({same} AND (r.status = 'released' OR ({lease_over})))
             RETURNING {READ}, {NOW}",
            claimed_first = entry("1", "?4", "'claimed'"),
            claimed_again = sql::appended(
                "r.history",
                &entry("r.attempts + 1", "excluded.lease_token", "'claimed'"),
                HISTORY_LIMIT
            ),
            lease_expired = sql::appended(
                "r.history",
                &entry("r.attempts", "r.lease_token", "'lease_expired'"),
                HISTORY_LIMIT
            ),
        );
        let log_capped = |event: &str, cap: usize| {
            format!(
                "history = {}",
                sql::appended("history", &entry("attempts", "lease_token", event), cap)
            )
        };
        let log = |event: &str| log_capped(event, HISTORY_LIMIT);
        let fenced = "scope = ?1 AND key = ?2 AND lease_token = ?3 AND status = 'in_progress'";
        // The holder may complete again what it completed in its own transaction.
        let completer = "scope = ?1 AND key = ?2 AND lease_token = ?3 \
                         AND status IN ('in_progress', 'completed', 'needs_reconciliation')";
        // Records only a reconciliation can settle once their holder is gone (the partial
        // index's condition, word for word, so SQLite sees that it may use it), and those of
        // them whose outcome is unknown now.
        let watched = WATCHED;
        let uncertain = format!(
            "({watched}) AND (r.status = 'needs_reconciliation' OR r.lease_until <= {NOW})"
        );
        let list_first = format!(
            "SELECT {READ}, {NOW}, {CURSOR_MILLIS} FROM {t} r WHERE {uncertain}
                 ORDER BY r.updated_at, r.scope, r.key LIMIT ?1"
        );
        let list_after = format!(
            "SELECT {READ}, {NOW}, {CURSOR_MILLIS} FROM {t} r WHERE {uncertain}
                   AND (r.updated_at, r.scope, r.key) > (?2, ?3, ?4)
                 ORDER BY r.updated_at, r.scope, r.key LIMIT ?1"
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
            current: format!("SELECT {READ}, {NOW} FROM {t} WHERE scope = ?1 AND key = ?2").into(),
            lookup: format!(
                "SELECT {READ}, {NOW} FROM {t} r WHERE scope = ?1 AND key = ?2 AND NOT {expired}"
            )
            .into(),
            remove: format!("DELETE FROM {t} WHERE scope = ?1 AND key = ?2").into(),
            purge: format!("DELETE FROM {t} AS r WHERE {expired}").into(),
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
            list_uncertain: list_first.as_str().into(),
            list_uncertain_after: list_after.as_str().into(),
            list_uncertain_desc: sql::descending(&list_first).into(),
            list_uncertain_after_desc: sql::descending(&list_after).into(),
            count_uncertain: format!(
                "SELECT count(*), min({CURSOR_MILLIS}) FROM {t} r WHERE {uncertain}"
            )
            .into(),
            resolve: format!(
                "UPDATE {t} AS r SET status = ?4, response = COALESCE(?5, r.response), lease_token = ?7,
                   resolution_note = COALESCE(?8, r.resolution_note),
                   expires_at = CASE WHEN ?4 = 'completed' THEN {NOW} + ?6 ELSE r.expires_at END,
                   updated_at = {NOW},
                   history = {}
                 WHERE r.scope = ?1 AND r.key = ?2 AND r.lease_token = ?3 AND ({uncertain})",
                sql::appended(
                    "r.history",
                    &entry(
                    "r.attempts",
                    "?7",
                    "CASE WHEN ?4 = 'completed' THEN 'reconciled_applied' ELSE 'reconciled_not_applied' END"
                ),
                    HISTORY_LIMIT
                )
            )
            .into(),
            append_history: format!(
                "UPDATE {t} AS r SET {} WHERE scope = ?1 AND key = ?2 AND NOT {expired}",
                log_capped("?3", HISTORY_REFUSALS)
            )
            .into(),
        }
    }
}

impl SqliteStore {
    /// The unit of a listing cursor's time: times are whole milliseconds here, so a cursor is exact.
    const CURSOR_TICK: Duration = Duration::from_millis(1);

    /// The default table: `idempotency_records`.
    pub const DEFAULT_TABLE: &'static str = "idempotency_records";

    /// A store on `pool`, in the default table. Open the pool with WAL and a busy timeout (as
    /// [`connect`](Self::connect) does) if several writers share the file.
    pub fn new(pool: SqlitePool) -> Self {
        Self {
            pool,
            sql: Arc::new(Statements::new(Self::DEFAULT_TABLE)),
            anchor: None,
            batches: None,
            writer: Arc::default(),
        }
    }

    /// Opens (creating if missing) the database at `url` (`sqlite://path/to/file.db`) in WAL
    /// mode with a 5 s busy timeout. An error names what went wrong (opening the file, not
    /// a pool's time-out).
    pub async fn connect(url: &str) -> Result<Self, sqlx::Error> {
        let in_memory = url.contains(":memory:") || url.contains("mode=memory");
        let options = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(if in_memory {
                SqliteJournalMode::Memory
            } else {
                SqliteJournalMode::Wal
            })
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(5));
        // One connection first, on its own: its error is the real one.
        let first = SqliteConnection::connect_with(&options).await?;
        if !in_memory {
            first.close().await?;
            let pool = SqlitePoolOptions::new()
                .max_connections(8)
                .connect_with(options)
                .await?;
            return Ok(Self::new(pool));
        }
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_with(options)
            .await?;
        Ok(Self {
            anchor: Some(Arc::new(std::sync::Mutex::new(first))),
            ..Self::new(pool)
        })
    }

    /// Keeps records in `table` instead; it must be a plain identifier (SQLite has no schemas
    /// to name here). `PostgresStore::with_table` takes the same argument.
    pub fn with_table(mut self, table: &str) -> Result<Self, InvalidIdentifier> {
        self.sql = Arc::new(Statements::new(sql::identifier(table)?));
        // Its batches go to its own table: a batch is sent with the statements of the
        // store that starts it, so stores on two tables must not share a queue.
        self.batches = self.batches.map(|b| Batches::new(b.settings()));
        Ok(self)
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The listing of uncertain records past a cursor, for `EXPLAIN QUERY PLAN`: it reads the
    /// partial index of watched records in its order. Parameters: `?1` limit, `?2` the
    /// cursor's time in milliseconds since the epoch, `?3` scope, `?4` key.
    pub fn uncertain_statement(&self) -> &str {
        &self.sql.list_uncertain_after
    }

    /// The DDL [`migrate`](Self::migrate) runs, one statement per entry, each idempotent. A
    /// table made by an earlier version also needs `ALTER TABLE … ADD COLUMN
    /// reconcile_on_expiry INTEGER NOT NULL DEFAULT 0` and `… ADD COLUMN resolution_note TEXT`
    /// before the indexes (`migrate` adds them).
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
                   reconcile_on_expiry INTEGER NOT NULL DEFAULT 0,
                   resolution_note TEXT,
                   PRIMARY KEY (scope, key)
                 ) WITHOUT ROWID"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS \"{}\" ON \"{table}\" (expires_at)",
                sql::derived_name(table, "_expires_at")
            ),
            // What the reconciliation listing pages through, in its order.
            format!(
                "CREATE INDEX IF NOT EXISTS \"{}\" ON \"{table}\" (updated_at, scope, key)
                 WHERE {}",
                sql::derived_name(table, "_watched"),
                WATCHED.replace("r.", "")
            ),
        ]
    }

    /// Checks that the table [`migrate`](Self::migrate) makes is there, with its index: call it
    /// at start-up to fail fast with a message that names the fix, instead of a service that
    /// answers every guarded request 503.
    pub async fn check(&self) -> Result<(), super::CheckError> {
        let table = &self.sql.table;
        let present: i64 = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM sqlite_master WHERE (type = 'table' AND name = ?1)
                       OR (type = 'index' AND name IN (?2, ?3)))
                  + (SELECT count(*) FROM pragma_table_info(?1)
                      WHERE name IN ('reconcile_on_expiry', 'resolution_note'))",
        )
        .bind(table)
        .bind(sql::derived_name(table, "_expires_at"))
        .bind(sql::derived_name(table, "_watched"))
        .fetch_one(&self.pool)
        .await
        .map_err(super::CheckError::Unreachable)?;
        if present == 5 {
            Ok(())
        } else {
            Err(super::CheckError::NotMigrated {
                table: table.clone(),
            })
        }
    }

    /// Creates the table and index if missing.
    pub async fn migrate(&self) -> Result<(), sqlx::Error> {
        // The write lock from the start: processes migrating one file at once take turns
        // (under the busy timeout) instead of failing on a read that then wants to write.
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let mut statements = self.migration_sql().into_iter();
        if let Some(create_table) = statements.next() {
            sqlx::query(AssertSqlSafe(create_table))
                .execute(&mut *tx)
                .await?;
        }
        // A table made before these columns existed gets them (SQLite has no `ADD COLUMN IF
        // NOT EXISTS`) before an index names one.
        for (column, definition) in [
            ("reconcile_on_expiry", "INTEGER NOT NULL DEFAULT 0"),
            ("resolution_note", "TEXT"),
        ] {
            let has_column: i64 =
                sqlx::query_scalar("SELECT count(*) FROM pragma_table_info(?1) WHERE name = ?2")
                    .bind(&self.sql.table)
                    .bind(column)
                    .fetch_one(&mut *tx)
                    .await?;
            if has_column == 0 {
                let add = format!(
                    "ALTER TABLE \"{}\" ADD COLUMN {column} {definition}",
                    self.sql.table
                );
                sqlx::query(AssertSqlSafe(add)).execute(&mut *tx).await?;
            }
        }
        for statement in statements {
            sqlx::query(AssertSqlSafe(statement))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await
    }

    /// Claims `req` with `token` on `connection`, inside a write transaction the caller
    /// commits. The outer error is the database's (the transaction is lost); the inner one is
    /// this record's own (it does not decode).
    async fn claim_in(
        &self,
        connection: &mut SqliteConnection,
        req: &ClaimRequest,
        token: FencingToken,
    ) -> Result<Result<Claim, StoreError>, sqlx::Error> {
        let (scope, key) = (req.key.scope().as_bytes(), req.key.key().as_bytes());
        // The upsert takes the write lock; the read that may follow runs under it.
        let written = sqlx::query(AssertSqlSafe(self.sql.upsert.clone()))
            .bind(scope)
            .bind(key)
            .bind(req.fingerprint.as_bytes().as_slice())
            .bind(sql::token(token))
            .bind(millis(req.lease))
            .bind(req.on_lease_expiry == LeaseExpiry::Reclaim)
            .bind(millis(req.ttl))
            .fetch_optional(&mut *connection)
            .await?;
        let row = match written {
            Some(row) => row,
            None => {
                sqlx::query(AssertSqlSafe(self.sql.current.clone()))
                    .bind(scope)
                    .bind(key)
                    .fetch_one(&mut *connection)
                    .await?
            }
        };
        // A row that does not read fails this claim alone, not the transaction: in a batch,
        // the other keys' claims go on.
        Ok(raw(&row).map_err(unavailable).and_then(|(raw, now)| {
            raw.into_record()
                .map(|record| sql::claim_outcome(record, now, token))
        }))
    }

    /// One claim in a transaction of its own.
    async fn claim_one(
        &self,
        req: &ClaimRequest,
        token: FencingToken,
    ) -> Result<Claim, StoreError> {
        let mut tx = self.pool.begin().await.map_err(unavailable)?;
        let outcome = self
            .claim_in(&mut tx, req, token)
            .await
            .map_err(unavailable)?;
        tx.commit().await.map_err(unavailable)?;
        outcome
    }

    /// A batch of claims: one transaction. If it fails, its claims go alone, each on a task of
    /// its own (and its own transaction), holding neither the writer nor a batch slot.
    async fn claim_batch(self, ops: Vec<ClaimOp>) {
        let writer = self.writer.lock().await;
        let outcomes = match ops.as_slice() {
            [op] => Ok(vec![self.claim_one(&op.request, op.token).await]),
            _ => self.claim_together(&ops).await,
        };
        drop(writer);
        self.settle_claims(ops, outcomes.map(|o| o.into_iter().map(Some).collect()));
    }

    async fn claim_together(
        &self,
        ops: &[ClaimOp],
    ) -> Result<Vec<Result<Claim, StoreError>>, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let mut outcomes = Vec::with_capacity(ops.len());
        for op in ops {
            outcomes.push(self.claim_in(&mut tx, &op.request, op.token).await?);
        }
        tx.commit().await?;
        Ok(outcomes)
    }

    /// A batch of completions: one transaction; if it fails, each goes alone, as claims do.
    async fn complete_batch(self, ops: Vec<CompleteOp>) {
        let writer = self.writer.lock().await;
        let outcomes = match ops.as_slice() {
            [op] => Ok(vec![self.complete_encoded(op).await]),
            _ => self.complete_together(&ops).await,
        };
        drop(writer);
        self.settle_completes(ops, outcomes);
    }

    async fn complete_together(
        &self,
        ops: &[CompleteOp],
    ) -> Result<Vec<Result<(), StoreError>>, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let mut outcomes = Vec::with_capacity(ops.len());
        for op in ops {
            let rows = self
                .complete_rows(
                    &mut *tx,
                    &self.sql.complete,
                    &op.key,
                    op.token,
                    &op.response,
                    op.ttl,
                )
                .await?;
            outcomes.push(fenced(rows));
        }
        tx.commit().await?;
        Ok(outcomes)
    }
}

impl SqliteStore {
    /// Waits for a change of `key` by polling (see
    /// [`IdempotencyStore::wait_for_change`]): SQLite has no way to tell other processes.
    async fn wait_changed(&self, key: &ScopedKey, seen: &InFlight, round: u32, within: Duration) {
        let _ = (key, seen);
        super::poll(round, within).await;
    }
}

sql::sql_store!(SqliteStore, sqlx::Sqlite, sqlx::SqliteConnection, SqliteRow);
