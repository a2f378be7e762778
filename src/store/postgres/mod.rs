//! [`PostgresStore`]: one record per key, shared by every replica of a service.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions, PgRow};
use sqlx::{AssertSqlSafe, Connection, Row};

use super::batch::Batches;
use super::reserve::Reserve;
use super::sql::{self, InvalidIdentifier, RawRecord, millis, unavailable};
use super::{
    Claim, ClaimRequest, FencingToken, HistoryEvent, IdempotencyStore, InFlight, Milestone, Record,
    RecordStatus, Resolution, ScopedKey, StoreError, StoredResponse, UncertainCount,
    UncertainCursor, UncertainPage, UncertainQuery, Unreadable,
};

mod batch;
mod changes;
mod claim;
mod statements;

use changes::Changes;
use statements::{Statements, WATCHED};

/// How long [`PostgresStore::connect`] waits for a server to answer.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Session limits on the connections [`PostgresStore::connect`] opens: no statement of the
/// store waits on a lock, or runs, without bound.
const SESSION_LIMITS: [(&str, &str); 2] = [("lock_timeout", "5s"), ("statement_timeout", "30s")];

/// Records in a PostgreSQL table, shared by every replica that uses the same database.
///
/// - **Claim in one round trip.** A single `INSERT … ON CONFLICT DO UPDATE … WHERE` statement
///   creates the record, takes over a released or expired one, or (in a data-modifying CTE)
///   returns the record that stands. Under READ COMMITTED a record committed by a concurrent
///   claim after the statement's snapshot can be invisible to the read half; the statement then
///   runs once more (two round trips, only under a race). Never SELECT-then-INSERT.
/// - **Fenced writes.** `complete`, `release`, `mark_uncertain` and `renew` are
///   `UPDATE … WHERE lease_token = $n AND status = 'in_progress'`: one round trip each.
/// - **The database's clock.** Leases and TTLs use `now()`, never a replica's clock.
/// - **Binary-safe.** Scope, key, fingerprint and response are `bytea`. A scope and key
///   together are limited by PostgreSQL's index (a row's `(scope, key)` entry must fit in
///   about 2 700 bytes, after compression): a longer pair, a principal id of several
///   kilobytes, is refused as a store error (503, nothing runs). The other stores take any
///   length.
/// - **Batches, under concurrency** ([`with_batching`](Self::with_batching)): claims (and,
///   apart, completions) that arrive while a batch is in flight go in one statement, an
///   `INSERT … SELECT FROM unnest(…)` of the claim's upsert or an `UPDATE … FROM unnest(…)`,
///   each request answered by its place in the arrays. A batch waits at most 100 ms for a row
///   held in another transaction; then each of its operations goes alone, so only the held
///   key waits. Counted on the wire, 64 concurrent claims take a few statements, not 64.
/// - **Holders first.** Claims take at most all but a quarter of the pool's connections at
///   once ([`with_holder_connections`](Self::with_holder_connections)): a crowd of retries
///   does not queue ahead of a holder's renewal or completion, which would let its lease run
///   out under a live handler.
///
/// The table is created by [`migrate`](Self::migrate) (idempotent, serialised by an advisory
/// lock, separate from the application's own sqlx migrations), or by running
/// [`migration_sql`](Self::migration_sql) with your own tooling.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_idempotency::{IdempotencyLayer, store::PostgresStore};
///
/// let store = PostgresStore::connect("postgres://postgres@127.0.0.1/app").await?;
/// store.migrate().await?;
/// let layer = IdempotencyLayer::new(store);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
    sql: Arc<Statements>,
    /// Requests waiting for in-flight keys, and the `LISTEN` that wakes them.
    changes: Arc<Changes>,
    /// Claims and completions sent together under concurrency, when turned on.
    batches: Option<Arc<Batches>>,
    /// The pool's connections claims may take at once: the rest are the lease holders'.
    reserve: Arc<Reserve>,
}

impl PostgresStore {
    /// The unit of a listing cursor's time: timestamps are microseconds here, so a cursor is exact.
    const CURSOR_TICK: Duration = Duration::from_micros(1);
    /// The listing's column that places a record: its last change ([`CURSOR_MICROS`]), which
    /// the shared reader reads anyway.
    const PLACE_COLUMN: usize = 11;

    /// The default table: `public.idempotency_records`.
    pub const DEFAULT_TABLE: &'static str = "idempotency_records";

    /// A store on `pool`, in `public.idempotency_records`.
    pub fn new(pool: PgPool) -> Self {
        Self {
            reserve: Self::reserve_of(&pool, super::reserve::kept_by_default),
            pool,
            sql: Arc::new(Statements::new("public", Self::DEFAULT_TABLE)),
            changes: Changes::new(),
            batches: None,
        }
    }

    /// Connects a pool to `url` (`postgres://user@host/db`) for a store in the default table.
    ///
    /// Its connections wait at most 5 s for a lock and run a statement for at most 30 s
    /// (`lock_timeout`, `statement_timeout`), so a stuck transaction elsewhere cannot hold the
    /// store's connections without bound. A claim that would leave its record as it is (a
    /// replay, a duplicate in flight) reads it without waiting for its lock; one that would
    /// change it waits at most 100 ms for a locked record and then answers from what is
    /// committed, or "in flight". A pool you pass to [`new`](Self::new) keeps its own settings;
    /// claims are bounded on it all the same.
    pub async fn connect(url: &str) -> Result<Self, sqlx::Error> {
        let options = url.parse::<PgConnectOptions>()?.options(SESSION_LIMITS);
        // One connection first, on its own: its error names the cause (refused, no such
        // database, authentication), where the pool's would be a time-out after 5 s. Bounded
        // all the same: a server that accepts and never answers must not hang start-up.
        let first = tokio::time::timeout(CONNECT_TIMEOUT, PgConnection::connect_with(&options))
            .await
            .map_err(|_| {
                sqlx::Error::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "the server accepted the connection but did not answer within {} s",
                        CONNECT_TIMEOUT.as_secs()
                    ),
                ))
            })??;
        first.close().await?;
        let pool = PgPoolOptions::new()
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options)
            .await?;
        Ok(Self::new(pool))
    }

    /// Keeps records in `table` instead: `name` (in the `public` schema) or `schema.name`,
    /// each part a plain identifier. `SqliteStore::with_table` takes the same argument.
    pub fn with_table(mut self, table: &str) -> Result<Self, InvalidIdentifier> {
        let (schema, name) = match table.split_once('.') {
            Some((schema, name)) => (sql::identifier(schema), sql::identifier(name)),
            None => (Ok("public"), sql::identifier(table)),
        };
        let whole = |_| InvalidIdentifier(table.to_owned());
        self.sql = Arc::new(Statements::new(
            schema.map_err(whole)?,
            name.map_err(whole)?,
        ));
        // Its waiters listen on its own table's channel.
        self.changes = Changes::new();
        // And its batches go to its own table: a batch is sent with the statements of the
        // store that starts it, so stores on two tables must not share a queue.
        self.batches = self.batches.map(|b| Batches::new(b.settings()));
        Ok(self)
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The claim statement, for `EXPLAIN` and for benchmarks against raw SQL. It sets
    /// `lock_timeout` for its own transaction: run it on its own, not inside yours. Parameters:
    /// `$1` scope, `$2` key (bytea), `$3` fingerprint, `$4` token (int8), `$5` lease ms,
    /// `$6` reclaim on lease expiry (bool), `$7` TTL ms.
    pub fn claim_statement(&self) -> &str {
        &self.sql.claim
    }

    /// The listing of uncertain records past a cursor, for `EXPLAIN`: it reads the partial
    /// index of watched records in its order. Parameters: `$1` limit, `$2` the cursor's time
    /// in microseconds since the epoch, `$3` scope, `$4` key.
    pub fn uncertain_statement(&self) -> &str {
        &self.sql.list_uncertain_after
    }

    /// The completion statement. Parameters: `$1` scope, `$2` key, `$3` token, `$4` encoded
    /// response, `$5` TTL ms.
    pub fn complete_statement(&self) -> &str {
        &self.sql.complete
    }

    /// The DDL [`migrate`](Self::migrate) runs, one statement per entry, each idempotent: for
    /// teams that apply schema changes with their own tooling.
    pub fn migration_sql(&self) -> Vec<String> {
        let (schema, table) = (&self.sql.schema, &self.sql.table);
        let t = format!("\"{schema}\".\"{table}\"");
        vec![
            format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\""),
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                   scope bytea NOT NULL,
                   key bytea NOT NULL,
                   fingerprint bytea NOT NULL,
                   status text NOT NULL CHECK (status IN
                     ('in_progress', 'completed', 'released', 'needs_reconciliation')),
                   lease_token int8 NOT NULL,
                   lease_until timestamptz NOT NULL,
                   attempts int4 NOT NULL,
                   effect_started boolean NOT NULL DEFAULT false,
                   downstream_id text,
                   response bytea,
                   created_at timestamptz NOT NULL,
                   updated_at timestamptz NOT NULL,
                   expires_at timestamptz NOT NULL,
                   history text NOT NULL DEFAULT '',
                   reconcile_on_expiry boolean NOT NULL DEFAULT false,
                   resolution_note text,
                   waited boolean NOT NULL DEFAULT false,
                   PRIMARY KEY (scope, key)
                 )"
            ),
            // Tables created before these columns existed.
            format!("ALTER TABLE {t} ADD COLUMN IF NOT EXISTS history text NOT NULL DEFAULT ''"),
            format!(
                "ALTER TABLE {t} ADD COLUMN IF NOT EXISTS reconcile_on_expiry boolean NOT NULL DEFAULT false"
            ),
            format!("ALTER TABLE {t} ADD COLUMN IF NOT EXISTS resolution_note text"),
            // Set by the first request that waits on an in-flight record: only such records
            // notify (a NOTIFY serializes commits, which no other record should pay for).
            format!(
                "ALTER TABLE {t} ADD COLUMN IF NOT EXISTS waited boolean NOT NULL DEFAULT false"
            ),
            // Purging deletes by expiry: an index keeps it from scanning the table.
            format!(
                "CREATE INDEX IF NOT EXISTS \"{}\" ON {t} (expires_at)",
                sql::derived_name(table, "_expires_at")
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS \"{}\" ON {t} (updated_at)
                 WHERE status = 'needs_reconciliation'",
                sql::derived_name(table, "_needs_reconciliation")
            ),
            // What the reconciliation listing pages through, in its order.
            format!(
                "CREATE INDEX IF NOT EXISTS \"{}\" ON {t} (updated_at, scope, key)
                 WHERE {}",
                sql::derived_name(table, "_watched"),
                WATCHED.replace("r.", "")
            ),
            // Waiters for in-flight keys are woken by a NOTIFY when such a record moves on
            // (completed, released, uncertain, taken over, deleted); renewals send nothing.
            format!(
                "CREATE OR REPLACE FUNCTION \"{schema}\".\"{function}\"() RETURNS trigger
                 LANGUAGE plpgsql AS $$
                 BEGIN
                   PERFORM pg_notify('{channel}',
                     encode(sha256(OLD.scope || '\\x00'::bytea || OLD.key), 'hex'));
                   RETURN NULL;
                 END $$",
                function = sql::derived_name(table, "_notify"),
                channel = self.channel(),
            ),
            format!(
                "DROP TRIGGER IF EXISTS \"{}\" ON {t}",
                sql::derived_name(table, "_moved_on")
            ),
            format!(
                "CREATE TRIGGER \"{}\" AFTER UPDATE ON {t} FOR EACH ROW
                 WHEN (OLD.status = 'in_progress' AND OLD.waited
                       AND (NEW.status <> 'in_progress' OR NEW.lease_token <> OLD.lease_token))
                 EXECUTE FUNCTION \"{schema}\".\"{}\"()",
                sql::derived_name(table, "_moved_on"),
                sql::derived_name(table, "_notify"),
            ),
            format!(
                "DROP TRIGGER IF EXISTS \"{}\" ON {t}",
                sql::derived_name(table, "_removed")
            ),
            format!(
                "CREATE TRIGGER \"{}\" AFTER DELETE ON {t} FOR EACH ROW
                 WHEN (OLD.status = 'in_progress' AND OLD.waited)
                 EXECUTE FUNCTION \"{schema}\".\"{}\"()",
                sql::derived_name(table, "_removed"),
                sql::derived_name(table, "_notify"),
            ),
        ]
    }

    /// Creates the schema, table and indexes if missing. Safe to run from many replicas at
    /// once: an advisory lock serialises them.
    pub async fn migrate(&self) -> Result<(), sqlx::Error> {
        // Up to date: touch nothing. `ALTER TABLE` and `CREATE INDEX` lock the table even when
        // they have nothing to do, behind any handler's open transaction on a record, and every
        // claim would then queue behind them: a replica starting up must not stall the others.
        if self.up_to_date().await? {
            return Ok(());
        }
        let mut tx = self.pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('tower_idempotency_migrate'))")
            .execute(&mut *tx)
            .await?;
        // Replicas starting together on a new table all find it missing; the first to take the
        // lock makes it. The others must find it made, not run the DDL again: its `ALTER
        // TABLE` would queue behind any transaction already holding a record, and every claim
        // behind the `ALTER`.
        if self.up_to_date_on(&mut tx).await? {
            return tx.commit().await;
        }
        for statement in self.migration_sql() {
            sqlx::query(AssertSqlSafe(statement))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await
    }

    /// Checks that the table [`migrate`](Self::migrate) makes is there, with its indexes: call it
    /// at start-up to fail fast with a message that names the fix, instead of a service that
    /// answers every guarded request 503.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = tower_idempotency::store::PostgresStore::connect("postgres://postgres@127.0.0.1/app").await?;
    /// store.check().await?; // "… does not exist: run `store.migrate().await` …"
    /// # Ok(()) }
    /// ```
    pub async fn check(&self) -> Result<(), super::CheckError> {
        let table = || format!("{}.{}", self.sql.schema, self.sql.table);
        match self.up_to_date().await {
            Ok(true) => {}
            Ok(false) => return Err(super::CheckError::NotMigrated { table: table() }),
            Err(e) => return Err(super::CheckError::Unreachable(e)),
        }
        // A table of this name made by hand, or another application's, passes the count.
        let columns: Vec<(String, bool)> = sqlx::query_as(
            "SELECT column_name::text,
                    is_nullable = 'NO' AND column_default IS NULL AND is_identity = 'NO'
                      AND is_generated = 'NEVER'
               FROM information_schema.columns WHERE table_schema = $1 AND table_name = $2",
        )
        .bind(&self.sql.schema)
        .bind(&self.sql.table)
        .fetch_all(&self.pool)
        .await
        .map_err(super::CheckError::Unreachable)?;
        // `waited`: the waiters' mark its triggers read.
        match sql::misshapen(&["waited"], &columns) {
            None => Ok(()),
            Some(detail) => Err(super::CheckError::Misshapen {
                table: table(),
                detail,
            }),
        }
    }

    /// Whether the table, its latest columns and its indexes exist, read from the catalog
    /// (which takes no lock on the table).
    async fn up_to_date(&self) -> Result<bool, sqlx::Error> {
        let mut connection = self.pool.acquire().await?;
        self.up_to_date_on(&mut connection).await
    }

    /// [`up_to_date`](Self::up_to_date) on `connection` (inside a transaction: read as of the
    /// statement, so after a lock it waited for).
    async fn up_to_date_on(
        &self,
        connection: &mut sqlx::PgConnection,
    ) -> Result<bool, sqlx::Error> {
        let (schema, table) = (&self.sql.schema, &self.sql.table);
        sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM information_schema.columns
                      WHERE table_schema = $1 AND table_name = $2
                        AND column_name IN ('history', 'reconcile_on_expiry', 'resolution_note', 'waited')) = 4
                AND (SELECT count(*) FROM pg_indexes
                      WHERE schemaname = $1 AND tablename = $2 AND indexname IN ($3, $4, $5)) = 3
                AND (SELECT count(*) FROM pg_trigger t
                      JOIN pg_class c ON c.oid = t.tgrelid
                      JOIN pg_namespace n ON n.oid = c.relnamespace
                      WHERE n.nspname = $1 AND c.relname = $2 AND t.tgname IN ($6, $7)) = 2",
        )
        .bind(schema)
        .bind(table)
        .bind(sql::derived_name(table, "_expires_at"))
        .bind(sql::derived_name(table, "_needs_reconciliation"))
        .bind(sql::derived_name(table, "_watched"))
        .bind(sql::derived_name(table, "_moved_on"))
        .bind(sql::derived_name(table, "_removed"))
        .fetch_one(connection)
        .await
    }

    /// The statement a batch of claims runs, for `EXPLAIN`: the claim statement's parameters,
    /// each an array with one element per claim.
    pub fn claim_batch_statement(&self) -> &str {
        &self.sql.claim_batch
    }
}

sql::sql_store!(PostgresStore, sqlx::Postgres, sqlx::PgConnection, PgRow);
