//! [`SqliteStore`]: durable records for the processes of one host.

mod batch;
mod claim;
mod file;
mod statements;
#[cfg(test)]
mod tests;

use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteRow, SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, Connection, Row};

use self::file::OpenedFile;
use self::statements::{Statements, WATCHED};
use super::batch::Batches;
use super::reserve::Reserve;
use super::sql::{self, InvalidIdentifier, RawRecord, millis, unavailable};
use super::{
    Claim, ClaimRequest, FencingToken, HistoryEvent, IdempotencyStore, InFlight, Milestone, Record,
    RecordStatus, Resolution, ScopedKey, StoreError, StoredResponse, UncertainCount,
    UncertainCursor, UncertainPage, UncertainQuery, Unreadable,
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
/// for it in SQLite's busy handler. Within it, a chunk of up to 64 claims is one upsert and one
/// read answered in a single row, and a chunk of completions one update: sqlx hands every
/// statement and every row between its connection's thread and the caller, which costs more
/// than SQLite's own work. A batch that fails is sent again one operation at a time.
///
/// Claims take at most all but a quarter of the pool's connections at once
/// ([`with_holder_connections`](Self::with_holder_connections)), so a holder's renewal does
/// not queue for a connection behind a crowd of retries.
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
    /// The pool's connections claims may take at once: the rest are the lease holders'.
    reserve: Arc<Reserve>,
}

impl SqliteStore {
    /// The unit of a listing cursor's time: times are whole milliseconds here, so a cursor is exact.
    const CURSOR_TICK: Duration = Duration::from_millis(1);
    /// The listing's column that places a record: [`CURSOR_MILLIS`], after the shared reader's
    /// columns. It differs from the last change the reader reads (column 11) for a time
    /// written by hand that is not an integer, which it places at the listing's end.
    const PLACE_COLUMN: usize = 16;

    /// The default table: `idempotency_records`.
    pub const DEFAULT_TABLE: &'static str = "idempotency_records";

    /// A store on `pool`, in the default table. Open the pool with WAL and a busy timeout (as
    /// [`connect`](Self::connect) does) if several writers share the file, and with
    /// [`check_writable`](Self::check_writable) as its `after_connect`. An in-memory
    /// database (`sqlite::memory:`) is one per connection: give it a pool of one connection, or
    /// use [`connect`](Self::connect), which does.
    pub fn new(pool: SqlitePool) -> Self {
        Self {
            reserve: Self::reserve_of(&pool, super::reserve::kept_by_default),
            pool,
            sql: Arc::new(Statements::new(Self::DEFAULT_TABLE)),
            anchor: None,
            batches: None,
            writer: Arc::default(),
        }
    }

    /// Opens (creating if missing) the database at `url` (`sqlite://path/to/file.db`) in WAL
    /// mode with a 5 s busy timeout. An error names what went wrong (opening the file, not
    /// a pool's time-out), and a file this process may not write is an error (SQLite itself
    /// would open it read-only). A connection the pool opens later while the file is
    /// write-protected is refused too, and opened again until the pool's acquire time-out
    /// (5 s, as the busy timeout; the store then answers unavailable).
    ///
    /// So is a connection opened once the file was deleted or another put in its place under
    /// the running store: connections already open keep the file they opened, new ones are
    /// refused before they read a page (sharing the `-wal` and `-shm` names with the old
    /// file's connections would mix the two databases and can kill the process with
    /// SIGBUS), and `connect` refuses the path while this process still has the old file
    /// open. Stop the server, then delete the `-wal` and `-shm` beside the new file before
    /// starting it again: they are the old file's (SQLite keeps them when the file it wrote
    /// has moved), and SQLite would read the new file through them.
    ///
    /// A store made with [`new`](Self::new) on a pool of your own keeps whatever connections
    /// that pool makes, unless the pool runs [`check_writable`](Self::check_writable) on each;
    /// it has none of the checks for a file deleted or replaced.
    pub async fn connect(url: &str) -> Result<Self, sqlx::Error> {
        let in_memory = url.contains(":memory:") || url.contains("mode=memory");
        // Never created by the pool's connections, whatever the URL asks (`mode=rwc`): the
        // first makes the file, and one the pool opens after it was deleted must not.
        let base = SqliteConnectOptions::from_str(url)?
            .busy_timeout(Duration::from_secs(5))
            .create_if_missing(false);
        let options = base
            .clone()
            .synchronous(SqliteSynchronous::Normal)
            .create_if_missing(true)
            .journal_mode(if in_memory {
                SqliteJournalMode::Memory
            } else {
                SqliteJournalMode::Wal
            });
        if !in_memory {
            file::check_unshared(base.get_filename())?;
        }
        // One connection first, on its own: its error is the real one.
        let mut first = SqliteConnection::connect_with(&options).await?;
        if !in_memory {
            let opened = OpenedFile::of(base.get_filename()).map(Arc::new);
            match writable(&mut first).await {
                // Another connection held the write lock past the busy timeout: this one
                // cannot tell, and each of the pool's is tried as it is opened.
                Err(sqlx::Error::Database(e)) if e.code().is_some_and(|c| busy(&c)) => {}
                other => other?,
            }
            first.close().await?;
            // Every connection the pool opens is tried the same way: SQLite opens a file it
            // may not write read-only, without an error, and such a connection would stay in
            // the pool (failing every write sent to it) long after the file's modes came back.
            // Refused (or busy past the busy timeout), it is opened again (sqlx's back-off)
            // until the acquire time-out: the busy timeout's 5 s, so a call waits for the
            // database about as long whether its connection is new or not. It must also have
            // opened the file the first did, and before it reads a page (so it neither creates
            // the file nor sets WAL, which the file keeps): see `OpenedFile`.
            let pool = SqlitePoolOptions::new()
                .max_connections(8)
                .acquire_timeout(Duration::from_secs(5))
                .after_connect(move |connection, _| {
                    let opened = opened.clone();
                    Box::pin(async move {
                        if let Some(opened) = opened {
                            opened.check()?;
                        }
                        // Not among the options: `synchronous` reads the schema.
                        sqlx::query("PRAGMA synchronous = NORMAL")
                            .execute(&mut *connection)
                            .await?;
                        writable(connection).await
                    })
                })
                // Opened as requests need them: none waits here for a lock another holds.
                .connect_lazy_with(base);
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

    /// Proves that `connection` can write, for a pool of your own given to [`new`](Self::new):
    /// SQLite opens a file the process may not write (or whose WAL it may not write) read-only,
    /// without an error, and such a connection stays in a pool failing every write sent to it.
    /// [`connect`](Self::connect) runs this on every connection its pool opens; hand it to your
    /// pool's `after_connect` for the same. It writes the database's `user_version` back
    /// unchanged in a transaction it rolls back at once, waiting for the write lock as any
    /// write does (the connection's busy timeout): a connection refused, or busy past that
    /// timeout, is dropped and the pool opens another until its acquire time-out.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::str::FromStr;
    /// use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
    /// use tower_idempotency::store::SqliteStore;
    ///
    /// let options = SqliteConnectOptions::from_str("sqlite://idempotency.db")?
    ///     .create_if_missing(true)
    ///     .journal_mode(SqliteJournalMode::Wal)
    ///     .busy_timeout(std::time::Duration::from_secs(5));
    /// let pool = SqlitePoolOptions::new()
    ///     .max_connections(16)
    ///     .after_connect(|connection, _| Box::pin(SqliteStore::check_writable(connection)))
    ///     .connect_lazy_with(options);
    /// let store = SqliteStore::new(pool);
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub async fn check_writable(connection: &mut SqliteConnection) -> Result<(), sqlx::Error> {
        writable(connection).await
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
    /// before the indexes (`migrate` adds them). A table made by this version refuses a
    /// scope, key or fingerprint that is not a BLOB: another tool writing one as TEXT would hide
    /// its record from every claim (they bind BLOBs, and SQLite never finds TEXT equal to a
    /// BLOB), so the key would run again; a table made earlier does not check.
    pub fn migration_sql(&self) -> Vec<String> {
        let table = &self.sql.table;
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS \"{table}\" (
                   scope BLOB NOT NULL CHECK (typeof(scope) = 'blob'),
                   key BLOB NOT NULL CHECK (typeof(key) = 'blob'),
                   fingerprint BLOB NOT NULL CHECK (typeof(fingerprint) = 'blob'),
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
        if present != 5 {
            return Err(super::CheckError::NotMigrated {
                table: table.clone(),
            });
        }
        // A table of this name made by hand, or another application's, passes the count.
        let columns: Vec<(String, bool)> = sqlx::query_as(
            "SELECT name, \"notnull\" AND dflt_value IS NULL AND pk = 0 AND hidden = 0
               FROM pragma_table_xinfo(?1)",
        )
        .bind(table)
        .fetch_all(&self.pool)
        .await
        .map_err(super::CheckError::Unreachable)?;
        match sql::misshapen(&[], &columns) {
            None => Ok(()),
            Some(detail) => Err(super::CheckError::Misshapen {
                table: table.clone(),
                detail,
            }),
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
}

impl SqliteStore {
    /// Waits for a change of `key` by polling (see
    /// [`IdempotencyStore::wait_for_change`]): SQLite has no way to tell other processes.
    async fn wait_changed(&self, key: &ScopedKey, seen: &InFlight, round: u32, within: Duration) {
        let _ = (key, seen);
        super::poll(round, within).await;
    }
}

/// Fails if `connection` cannot prove it can write: SQLite opens a file it may not write (or
/// whose WAL it may not write) read-only, silently. Only a write tells: beginning a write
/// transaction succeeds on such a connection while another of the process holds the file. So
/// the database's `user_version` is written back unchanged, in a transaction rolled back at
/// once. It waits for the write lock as any write does (the busy timeout), so a connection
/// opened while another holds the lock is ready the moment the lock is let go, as a statement
/// waiting on the lock would be; still held past the timeout, the connection fails (busy) and
/// the pool opens another. Nothing here opens the files itself: closing any descriptor of a
/// file drops every POSIX lock the process holds on it, SQLite's own.
async fn writable(connection: &mut SqliteConnection) -> Result<(), sqlx::Error> {
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut *connection)
        .await?;
    let written = async {
        let version: i64 = sqlx::query_scalar("PRAGMA user_version")
            .fetch_one(&mut *connection)
            .await?;
        sqlx::query(AssertSqlSafe(format!("PRAGMA user_version = {version}")))
            .execute(&mut *connection)
            .await
    }
    .await;
    let undone = sqlx::query("ROLLBACK").execute(&mut *connection).await;
    written?;
    undone.map(drop)
}

/// Whether SQLite's (extended) result code is `SQLITE_BUSY` or one of its kinds.
fn busy(code: &str) -> bool {
    code.parse::<i64>().is_ok_and(|c| c & 0xff == 5)
}

sql::sql_store!(SqliteStore, sqlx::Sqlite, sqlx::SqliteConnection, SqliteRow);
