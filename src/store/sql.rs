//! What the SQL stores share: identifier validation and the row they read back.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::history::HISTORY_REFUSALS;
use super::{
    Claim, FencingToken, Fingerprint, HistoryEntry, Lease, Record, RecordStatus, ScopedKey,
    StoreError, StoredResponse,
};

/// A schema or table name that is not a plain SQL identifier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidIdentifier(pub(crate) String);

impl fmt::Display for InvalidIdentifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} is not a valid identifier: use 1 to 63 ASCII letters, digits and underscores, \
             not starting with a digit",
            self.0
        )
    }
}

impl std::error::Error for InvalidIdentifier {}

/// Why a SQL store cannot serve: the database is out of reach, or its table is not there.
#[derive(Debug)]
#[non_exhaustive]
pub enum CheckError {
    /// The database could not be queried.
    Unreachable(sqlx::Error),
    /// The table (or its indexes) is missing: run the store's `migrate()` first.
    NotMigrated {
        /// The table the store was configured with.
        table: String,
    },
    /// The table is there but is not the store's: columns it reads are missing, or columns it
    /// never writes are required (made by hand, or another application's table of that name).
    Misshapen {
        /// The table the store was configured with.
        table: String,
        /// What is wrong with it.
        detail: String,
    },
}

impl fmt::Display for CheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unreachable(e) => {
                write!(f, "the idempotency store's database is unreachable: {e}")
            }
            Self::NotMigrated { table } => write!(
                f,
                "the idempotency store's table {table} (or its indexes) does not exist: run \
                 `store.migrate().await` at start-up, or apply `store.migration_sql()` with your \
                 own migrations; until then every guarded request is answered 503"
            ),
            Self::Misshapen { table, detail } => write!(
                f,
                "the idempotency store's table {table} is not the one `migrate()` makes \
                 ({detail}): every guarded request would be answered 503; give the store a \
                 table of its own (`with_table`) and migrate it"
            ),
        }
    }
}

impl std::error::Error for CheckError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Unreachable(e) => Some(e),
            Self::NotMigrated { .. } | Self::Misshapen { .. } => None,
        }
    }
}

/// Accepts `[A-Za-z_][A-Za-z0-9_]{0,62}`: names that need no quoting and cannot smuggle SQL.
pub(crate) fn identifier(name: &str) -> Result<&str, InvalidIdentifier> {
    let mut chars = name.chars();
    let valid = name.len() <= 63
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if valid {
        Ok(name)
    } else {
        Err(InvalidIdentifier(name.to_owned()))
    }
}

/// The name of an object derived from a table's (an index), within the 63 bytes PostgreSQL
/// keeps: a long table name is shortened and followed by a hash of the whole name, so the
/// derived name never collapses into the table's own, nor into another table's.
pub(crate) fn derived_name(table: &str, suffix: &str) -> String {
    const MAX: usize = 63;
    if table.len() + suffix.len() <= MAX {
        return format!("{table}{suffix}");
    }
    // FNV-1a: stable across builds and platforms, unlike std's hasher.
    let hash = table.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let tag = format!("_{:08x}", hash as u32);
    // Identifiers are ASCII (see `identifier`), so any byte index is a char boundary.
    let keep = MAX - suffix.len() - tag.len();
    format!("{}{tag}{suffix}", &table[..keep])
}

/// What is wrong with a stored row, by column: a record that cannot be read names the
/// column at fault.
#[derive(Debug)]
pub(crate) struct RowError(pub(crate) String);

impl RowError {
    /// A column the database could not hand over as its type.
    pub(crate) fn column(error: sqlx::Error) -> StoreError {
        StoreError::unavailable(Self(format!("a column does not read: {error}")))
    }
}

impl std::fmt::Display for RowError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "stored record is corrupt: {}", self.0)
    }
}

impl std::error::Error for RowError {}

/// The listing `ascending` in the reverse order, newest first: its order reversed and, past a
/// cursor, the records before it.
pub(crate) fn descending(ascending: &str) -> String {
    ascending
        .replace(
            "ORDER BY r.updated_at, r.scope, r.key",
            "ORDER BY r.updated_at DESC, r.scope DESC, r.key DESC",
        )
        .replace(
            "(r.updated_at, r.scope, r.key) > (",
            "(r.updated_at, r.scope, r.key) < (",
        )
}

pub(crate) use super::uncertain::{from_ticks, ticks};

/// The columns every claim or lookup reads, in this order.
pub(crate) struct RawRecord {
    pub(crate) scope: Vec<u8>,
    pub(crate) key: Vec<u8>,
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) status: String,
    pub(crate) lease_token: i64,
    pub(crate) lease_until_ms: i64,
    pub(crate) attempts: i64,
    pub(crate) effect_started: bool,
    pub(crate) downstream_id: Option<String>,
    pub(crate) response: Option<Vec<u8>>,
    pub(crate) created_at_ms: i64,
    /// Read at the store's cursor tick, not in milliseconds: a record read by `lookup` then
    /// stands where the listing places it, and a cursor made from it pages on exactly.
    pub(crate) updated_at: SystemTime,
    pub(crate) expires_at_ms: i64,
    pub(crate) history: String,
    pub(crate) resolution_note: Option<String>,
}

impl RawRecord {
    pub(crate) fn into_record(self) -> Result<Record, StoreError> {
        let corrupt = |what: String| StoreError::unavailable(RowError(what));
        let text = |bytes: Vec<u8>, column: &str| {
            String::from_utf8(bytes)
                .map_err(|_| corrupt(format!("the {column} column is not UTF-8")))
        };
        let fingerprint: [u8; 32] = self.fingerprint.try_into().map_err(|bytes: Vec<u8>| {
            corrupt(format!(
                "the fingerprint column holds {} bytes where a SHA-256 has 32",
                bytes.len()
            ))
        })?;
        let status = match self.status.as_str() {
            "in_progress" => RecordStatus::InProgress,
            "completed" => RecordStatus::Completed,
            "released" => RecordStatus::Released,
            "needs_reconciliation" => RecordStatus::NeedsReconciliation,
            other => {
                return Err(corrupt(format!(
                    "the status column holds {other:?}, not a status"
                )));
            }
        };
        let response = match self.response {
            // The row's bytes become the body and header values, uncopied.
            Some(bytes) => Some(
                StoredResponse::from_shared(&bytes::Bytes::from(bytes)).map_err(|e| {
                    corrupt(format!("the response column does not decode: {}", e.0))
                })?,
            ),
            None => None,
        };
        Ok(Record {
            key: ScopedKey::new(text(self.scope, "scope")?, text(self.key, "key")?),
            fingerprint: Fingerprint::from_bytes(fingerprint),
            status,
            lease_token: FencingToken::new(self.lease_token as u64),
            lease_until: from_millis(self.lease_until_ms),
            attempts: u32::try_from(self.attempts).map_err(|_| {
                corrupt(format!(
                    "the attempts column holds {}, out of range",
                    self.attempts
                ))
            })?,
            effect_started: self.effect_started,
            downstream_id: self.downstream_id,
            response,
            created_at: from_millis(self.created_at_ms),
            updated_at: self.updated_at,
            expires_at: from_millis(self.expires_at_ms),
            history: HistoryEntry::parse_all(&self.history),
            resolution_note: self.resolution_note,
        })
    }
}

/// What a claim statement's row means: the caller's claim won if the row holds the caller's
/// token and is in progress; otherwise it is the record that stands. Tokens are drawn fresh for
/// each claim, so a row with the caller's token was written by this claim, by this statement
/// or by an earlier send of it whose answer was lost: either way the lease is the caller's.
pub(crate) fn claim_outcome(record: Record, now: SystemTime, token: FencingToken) -> Claim {
    if record.lease_token == token && record.status == RecordStatus::InProgress {
        return Claim::Acquired(Lease {
            token,
            attempt: record.attempts,
            until: record.lease_until,
        });
    }
    Claim::existing(record, now)
}

/// `history` with `entry` appended while it holds fewer than `cap` entries (each ends in `;`),
/// in SQL both databases speak. At the cap, a refusal note is dropped; any other event takes
/// the last entry's place, so a history keeps its first attempts and always its latest event
/// (`rtrim` of the characters an entry is made of removes exactly the last one).
pub(crate) fn appended(history: &str, entry: &str, cap: usize) -> String {
    let full = if cap == HISTORY_REFUSALS {
        history.to_owned()
    } else {
        format!("rtrim(rtrim({history}, ';'), '{ENTRY_CHARS}') || {entry}")
    };
    format!(
        "(CASE WHEN length({history}) - length(replace({history}, ';', '')) < {cap} \
         THEN {history} || {entry} ELSE {full} END)"
    )
}

/// How long a milestone written in a handler's own transaction holds its lease, in ms, from
/// when it is written: the transaction holds the record's row, so no renewal can land until it
/// ends, and a lease lapsed meanwhile would be taken over by the first claim to get the row
/// once it commits, while its holder runs on. Renewals never shorten a lease, so a holder gone
/// after its commit holds the key this long from its milestone.
pub(crate) const HELD_IN_TRANSACTION_MS: i64 = 10 * 60 * 1000;

/// The characters of a history entry (`attempt token ms event`), `;` excluded.
const ENTRY_CHARS: &str = "0123456789 -_abcdefghijklmnopqrstuvwxyz";

pub(crate) fn from_millis(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}

/// A duration as whole milliseconds for a bind parameter, saturating.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

pub(crate) fn token(t: FencingToken) -> i64 {
    // Tokens are drawn below 2^63 (see `codec::fresh_token`).
    t.get() as i64
}

/// The columns of the table `migrate()` makes, on every database.
const TABLE_COLUMNS: &[&str] = &[
    "scope",
    "key",
    "fingerprint",
    "status",
    "lease_token",
    "lease_until",
    "attempts",
    "effect_started",
    "downstream_id",
    "response",
    "created_at",
    "updated_at",
    "expires_at",
    "history",
    "reconcile_on_expiry",
    "resolution_note",
];

/// Whether a table's `columns` (each with whether a row must give it a value: `NOT NULL`
/// without a default, not generated) are the store's, [`TABLE_COLUMNS`] and the database's
/// `own`: none missing, none more that the store's inserts would leave empty. What is wrong,
/// if anything.
pub(crate) fn misshapen(own: &[&str], columns: &[(String, bool)]) -> Option<String> {
    let expected = || TABLE_COLUMNS.iter().chain(own);
    let missing: Vec<&str> = expected()
        .filter(|name| !columns.iter().any(|(column, _)| column == *name))
        .copied()
        .collect();
    let required: Vec<&str> = columns
        .iter()
        .filter(|(column, required)| *required && !expected().any(|name| name == column))
        .map(|(column, _)| column.as_str())
        .collect();
    let mut wrong = Vec::new();
    if !missing.is_empty() {
        wrong.push(format!("missing columns: {}", missing.join(", ")));
    }
    if !required.is_empty() {
        wrong.push(format!(
            "columns the store never writes but a row must have: {}",
            required.join(", ")
        ));
    }
    (!wrong.is_empty()).then(|| wrong.join("; "))
}

/// Any sqlx failure is an unavailable store: the request fails closed.
pub(crate) fn unavailable(e: sqlx::Error) -> StoreError {
    StoreError::unavailable(e)
}

/// Whether a failed statement may have run all the same: its connection broke before the
/// answer came (an I/O or protocol failure, directly or as a batch's), rather than the
/// database answering with an error or a row that does not read.
pub(crate) fn answer_lost(error: &StoreError) -> bool {
    super::unheard::lost(error, |e: &sqlx::Error| {
        matches!(
            e,
            sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed
        )
    })
}

/// Implements everything of a sqlx store except its claim (`claim_one`, which each database
/// does its own way): the fenced writes, the reads and the history appends run the same
/// statements, prepared in the store's `Statements`, on any database.
macro_rules! sql_store {
    ($store:ident, $db:ty, $conn:ty, $row:ty) => {
impl $store {
    /// One claim with `token`, in a batch when batching is on.
    async fn claim_with(
        &self,
        req: &ClaimRequest,
        token: FencingToken,
    ) -> Result<Claim, StoreError> {
        match &self.batches {
            Some(batches) => {
                let store = self.clone();
                batches
                    .claim(req, token, move |ops| store.clone().claim_batch(ops))
                    .await
            }
            None => self.claim_one(req, token).await,
        }
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

    /// Records a milestone on `connection`, typically inside the handler's own transaction, so
    /// the business write and the milestone commit or roll back together:
    ///
    /// ```no_run
    #[doc = concat!(" # async fn handler(store: tower_idempotency::store::", stringify!($store), ", ctx: tower_idempotency::IdempotencyContext)")]
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
    ///
    /// The transaction holds the record's row until it ends, so the lease cannot be renewed
    /// meanwhile: the milestone holds it (and the record) for ten minutes from when it is
    /// written. A transaction held longer than that after its milestone loses the lease; a
    /// holder gone after its commit holds the key until then.
    pub async fn record_milestone_in(
        &self,
        connection: &mut $conn,
        key: &ScopedKey,
        token: FencingToken,
        milestone: &Milestone,
    ) -> Result<(), StoreError> {
        self.milestone_on(&mut *connection, key, token, milestone, true)
            .await
    }

    /// Records the outcome on `connection`, typically inside the handler's own transaction, so
    /// the business write and the recorded response commit or roll back together. The layer
    /// records the live response again afterwards, with the same token; that is allowed.
    pub async fn complete_in(
        &self,
        connection: &mut $conn,
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
        E: sqlx::Executor<'c, Database = $db>,
    {
        self.complete_bytes(executor, key, token, &response.to_bytes(), ttl)
            .await
    }

    /// Sends claims and completions that arrive while others are in flight together (see the
    /// store's documentation for what a batch is on its database), each request answered as
    /// it would be alone: the same fencing, leases and TTLs. No timer: at low load each
    /// operation goes alone, at once, as today's statement.
    ///
    /// ```no_run
    #[doc = concat!(" # async fn run(store: tower_idempotency::store::", stringify!($store), ") {")]
    /// use tower_idempotency::store::Batching;
    ///
    /// let store = store.with_batching(Batching::default());
    /// # }
    /// ```
    pub fn with_batching(mut self, batching: super::Batching) -> Self {
        self.batches = Some(super::batch::Batches::new(batching));
        self
    }

    /// How claims and completions are batched, if they are.
    pub fn batching(&self) -> Option<super::Batching> {
        self.batches.as_ref().map(|b| b.settings())
    }

    /// Keeps `n` of the pool's connections for the requests holding leases: claims (with the
    /// reads of requests waiting for a key in flight, and refusals' notes) take at most the
    /// rest at once, so a holder's renewal or completion queues for a connection behind
    /// other holders' and at worst one claim's statement, never behind a crowd of duplicates
    /// and retries (queued past the lease's end, it would let a duplicate take over a run
    /// still going). By default a quarter of the pool, at least one; none of a pool of one
    /// connection. At most all but one of the connections the store's statements can have
    /// (a `PostgresStore`'s `LISTEN`, for routes that wait for a key in flight, holds one of
    /// the pool's for good): claims always have one. A claim waits for its share at most the
    /// pool's acquire time-out, then fails as the pool does (503, nothing runs); its wait for
    /// a connection comes after, so a claim may wait up to twice that time in all.
    ///
    /// Only the store's own statements are shared out so. The application's use of the same
    /// pool (a handler's own transaction, another store on it) is not: size the pool for
    /// both, or give the store a pool of its own.
    ///
    /// ```no_run
    #[doc = concat!(" # async fn run(store: tower_idempotency::store::", stringify!($store), ") {")]
    /// let store = store.with_holder_connections(2);
    /// assert_eq!(store.holder_connections(), 2);
    /// # }
    /// ```
    pub fn with_holder_connections(mut self, n: u32) -> Self {
        self.reserve = Self::reserve_of(&self.pool, Some(n));
        self
    }

    /// The claims' share of `pool`, keeping `kept` connections (by default a quarter) for
    /// holders, out of those the store's statements can have: a listener's is not one.
    fn reserve_of(
        pool: &sqlx::Pool<$db>,
        kept: Option<u32>,
    ) -> std::sync::Arc<super::reserve::Reserve> {
        let options = pool.options();
        let max = options.get_max_connections();
        std::sync::Arc::new(super::reserve::Reserve::new(
            max.saturating_sub(Self::LISTENERS).max(1),
            kept.unwrap_or_else(|| super::reserve::kept_by_default(max)),
            options.get_acquire_timeout(),
        ))
    }

    /// How many of the pool's connections are kept for lease holders (see
    /// [`with_holder_connections`](Self::with_holder_connections)).
    pub fn holder_connections(&self) -> u32 {
        self.reserve.kept()
    }

    /// What a batch of claims came to. Each claim is answered, or sent again alone on a task
    /// of its own (holding no batch slot): a claim whose row the statement could not see, and
    /// every claim of a batch the database refused (a lock wait ran out, a deadlock, a busy
    /// file). Any other failure (the connection, the pool) is answered to all, as each alone
    /// would have met it.
    fn settle_claims(
        &self,
        ops: Vec<super::batch::ClaimOp>,
        outcome: Result<Vec<Option<Result<Claim, StoreError>>>, sqlx::Error>,
    ) {
        use super::batch;
        match outcome {
            Ok(found) => {
                for (op, outcome) in ops.into_iter().zip(found) {
                    match outcome {
                        Some(outcome) => batch::answer_claim(self, op, outcome),
                        None => self.claim_alone(op),
                    }
                }
            }
            Err(error) if batch::retry_alone(&error) => {
                tracing::debug!(%error, "a batch of claims failed; each goes alone");
                ops.into_iter().for_each(|op| self.claim_alone(op));
            }
            Err(error) => {
                let error = batch::BatchError::new(error);
                for op in ops {
                    batch::answer_claim(self, op, Err(error.to_store()));
                }
            }
        }
    }

    /// `op` claimed on its own, on a task of its own.
    fn claim_alone(&self, op: super::batch::ClaimOp) {
        let store = self.clone();
        tokio::spawn(async move {
            let outcome = store.claim_one(&op.request, op.token).await;
            super::batch::answer_claim(&store, op, outcome);
        });
    }

    /// What a batch of completions came to, as [`settle_claims`](Self::settle_claims): each
    /// sent again alone (with today's statement, which waits for its row as long as the
    /// session allows) when the database refused the batch.
    fn settle_completes(
        &self,
        ops: Vec<super::batch::CompleteOp>,
        outcome: Result<Vec<Result<(), StoreError>>, sqlx::Error>,
    ) {
        match outcome {
            Ok(outcomes) => {
                for (op, outcome) in ops.into_iter().zip(outcomes) {
                    op.answer(outcome);
                }
            }
            Err(error) if super::batch::retry_alone(&error) => {
                tracing::debug!(%error, "a batch of completions failed; each goes alone");
                for op in ops {
                    let store = self.clone();
                    tokio::spawn(async move {
                        let outcome = store.complete_encoded(&op).await;
                        op.answer(outcome);
                    });
                }
            }
            Err(error) => {
                let error = super::batch::BatchError::new(error);
                for op in ops {
                    op.answer(Err(error.to_store()));
                }
            }
        }
    }

    /// A completion of a batch, sent on its own (a batch of one, or a failed batch's).
    async fn complete_encoded(&self, op: &super::batch::CompleteOp) -> Result<(), StoreError> {
        self.complete_bytes(&self.pool, &op.key, op.token, &op.response, op.ttl)
            .await
    }

    async fn complete_bytes<'c, E>(
        &self,
        executor: E,
        key: &ScopedKey,
        token: FencingToken,
        response: &[u8],
        ttl: Duration,
    ) -> Result<(), StoreError>
    where
        E: sqlx::Executor<'c, Database = $db>,
    {
        let rows = self
            .complete_rows(executor, &self.sql.complete, key, token, response, ttl)
            .await
            .map_err(unavailable)?;
        fenced(rows)
    }

    /// Runs a completion `statement` (today's, or one bounded in its lock wait): the rows it
    /// wrote, 0 when fenced off.
    async fn complete_rows<'c, E>(
        &self,
        executor: E,
        statement: &Arc<str>,
        key: &ScopedKey,
        token: FencingToken,
        response: &[u8],
        ttl: Duration,
    ) -> Result<u64, sqlx::Error>
    where
        E: sqlx::Executor<'c, Database = $db>,
    {
        let done = sqlx::query(AssertSqlSafe(statement.clone()))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(sql::token(token))
            .bind(response)
            .bind(millis(ttl))
            .execute(executor)
            .await?;
        Ok(done.rows_affected())
    }

    async fn milestone_on<'c, E>(
        &self,
        executor: E,
        key: &ScopedKey,
        token: FencingToken,
        milestone: &Milestone,
        held: bool,
    ) -> Result<(), StoreError>
    where
        E: sqlx::Executor<'c, Database = $db>,
    {
        let statement = match (milestone, held) {
            (Milestone::EffectStarted, false) => &self.sql.effect_started,
            (Milestone::EffectStarted, true) => &self.sql.effect_started_held,
            (Milestone::DownstreamId(_), false) => &self.sql.downstream_id,
            (Milestone::DownstreamId(_), true) => &self.sql.downstream_id_held,
        };
        let query = sqlx::query(AssertSqlSafe(statement.clone()));
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

fn raw(row: &$row) -> Result<(RawRecord, SystemTime), sqlx::Error> {
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
        updated_at: sql::from_ticks(row.try_get(11)?, $store::CURSOR_TICK),
        expires_at_ms: row.try_get(12)?,
        history: row.try_get(13)?,
        resolution_note: row.try_get(14)?,
    };
    // The store's clock at the cursor's tick too, or a claim's clock could read earlier
    // than the change it answers.
    Ok((record, sql::from_ticks(row.try_get(15)?, $store::CURSOR_TICK)))
}

impl IdempotencyStore for $store {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let token = super::codec::fresh_token();
        // A claim that failed may have landed all the same, its answer lost with the
        // connection: left so, it would hold the key for a request that ran nothing (and, on
        // a route with external effects, send it to reconciliation when the lease ends). Asked
        // again with the same token, it reads as this claim's own (`claim_outcome`).
        // Lost again, what may have landed is given back: the request is refused, nothing ran.
        match self.claim_with(req, token).await {
            Err(error) if sql::answer_lost(&error) => match self.claim_with(req, token).await {
                Err(error) if sql::answer_lost(&error) => {
                    super::unheard::give_back(self, &req.key, token, req.lease);
                    Err(error)
                }
                answered => answered,
            },
            answered => answered,
        }
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
        match &self.batches {
            Some(batches) => {
                let store = self.clone();
                batches
                    .complete(key, token, response.to_bytes(), ttl, move |ops| {
                        store.clone().complete_batch(ops)
                    })
                    .await
            }
            None => {
                self.complete_on(&self.pool, key, token, response, ttl)
                    .await
            }
        }
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
        self.milestone_on(&self.pool, key, token, milestone, false)
            .await
    }

    async fn list_uncertain(&self, query: &UncertainQuery) -> Result<UncertainPage, StoreError> {
        let limit = i64::try_from(query.limit).unwrap_or(i64::MAX);
        let (first, after) = match query.newest_first {
            false => (&self.sql.list_uncertain, &self.sql.list_uncertain_after),
            true => (&self.sql.list_uncertain_desc, &self.sql.list_uncertain_after_desc),
        };
        let rows = match &query.after {
            None => sqlx::query(AssertSqlSafe(first.clone()))
                .bind(limit)
                .fetch_all(&self.pool)
                .await,
            Some(cursor) => sqlx::query(AssertSqlSafe(after.clone()))
                .bind(limit)
                .bind(sql::ticks(cursor.updated_at, Self::CURSOR_TICK))
                .bind(cursor.bytes().0)
                .bind(cursor.bytes().1)
                .fetch_all(&self.pool)
                .await,
        }
        .map_err(unavailable)?;
        let (mut records, mut unreadable, mut last) = (Vec::new(), Vec::new(), None);
        for row in &rows {
            // Where the row stands in the listing: read apart from the rest, so a row that
            // cannot be read is still stepped over, and reported.
            let scope: Vec<u8> = row.try_get(0).map_err(unavailable)?;
            let key: Vec<u8> = row.try_get(1).map_err(unavailable)?;
            let at: i64 = row.try_get(Self::PLACE_COLUMN).map_err(unavailable)?;
            let place = UncertainCursor::stored(sql::from_ticks(at, Self::CURSOR_TICK), scope, key);
            let key = place.key.clone();
            match raw(row).map_err(sql::RowError::column).and_then(|(raw, _)| raw.into_record()) {
                // Its last change is read at the cursor's tick (see `RawRecord::updated_at`):
                // a cursor made from it is just past it, never before it (listed again) or
                // past a neighbour in the same millisecond (skipped).
                Ok(record) => records.push(record),
                Err(error) => {
                    tracing::error!(?key, %error, "an uncertain record cannot be read; skipped");
                    // What is wrong with the row, without the store's "unavailable" framing.
                    let error = match error {
                        StoreError::Unavailable(inner) => inner.to_string(),
                        other => other.to_string(),
                    };
                    unreadable.push(Unreadable { key, error });
                }
            }
            last = Some(place);
        }
        Ok(UncertainPage::new(records, unreadable, last, query.limit))
    }

    async fn count_uncertain(&self) -> Result<UncertainCount, StoreError> {
        let row = sqlx::query(AssertSqlSafe(self.sql.count_uncertain.clone()))
            .fetch_one(&self.pool)
            .await
            .map_err(unavailable)?;
        let count: i64 = row.try_get(0).map_err(unavailable)?;
        let oldest: Option<i64> = row.try_get(1).map_err(unavailable)?;
        Ok(UncertainCount {
            count: u64::try_from(count).unwrap_or_default(),
            oldest: oldest
                .filter(|_| count > 0)
                .map(|at| sql::from_ticks(at, Self::CURSOR_TICK)),
        })
    }

    async fn resolve(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        resolution: &Resolution,
        ttl: Duration,
        note: Option<&str>,
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
            // A resolution is final: a new token fences out the holder it overrules.
            .bind(sql::token(super::codec::fresh_token()))
            .bind(note)
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
        fenced(done.rows_affected())
    }

    async fn append_history(&self, key: &ScopedKey, event: HistoryEvent) -> Result<(), StoreError> {
        // A request's note (it may wait on the row), in the claims' share as its claim was.
        let _turn = self.reserve.claim().await.map_err(unavailable)?;
        sqlx::query(AssertSqlSafe(self.sql.append_history.clone()))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(event.as_str())
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn wait_for_change(
        &self,
        key: &ScopedKey,
        seen: &InFlight,
        round: u32,
        within: Duration,
    ) {
        self.wait_changed(key, seen, round, within).await
    }
}
    };
}

pub(crate) use sql_store;

#[cfg(test)]
mod tests {
    use super::*;

    fn row(status: &str, token: i64) -> Record {
        RawRecord {
            scope: b"s".to_vec(),
            key: b"k".to_vec(),
            fingerprint: vec![7; 32],
            status: status.to_owned(),
            lease_token: token,
            lease_until_ms: 2_000,
            attempts: 2,
            effect_started: false,
            downstream_id: None,
            response: None,
            created_at_ms: 1_000,
            updated_at: from_millis(1_000),
            expires_at_ms: 9_000,
            history: String::new(),
            resolution_note: None,
        }
        .into_record()
        .expect("a readable row")
    }

    /// Issue 23 §4: a claim that finds its own token on a record in progress holds that lease
    /// (a claim sent again after its answer was lost, or after a batch that wrote nothing);
    /// another token, or its own token on a record no longer in progress, is what stands.
    #[test]
    fn s4_a_claim_that_finds_its_own_token_in_progress_holds_the_lease() {
        let now = from_millis(1_500);
        let mine = FencingToken::new(42);
        match claim_outcome(row("in_progress", 42), now, mine) {
            Claim::Acquired(lease) => {
                assert_eq!(lease.token, mine);
                assert_eq!(lease.attempt, 2, "the record's attempt");
                assert_eq!(lease.until, from_millis(2_000), "the record's lease");
            }
            other => panic!("its own lease, got {other:?}"),
        }
        for (status, token) in [
            ("in_progress", 41),
            ("completed", 42),
            ("released", 42),
            ("needs_reconciliation", 42),
        ] {
            assert!(
                matches!(
                    claim_outcome(row(status, token), now, mine),
                    Claim::Existing { .. } | Claim::Completed { .. }
                ),
                "{status} with token {token} is the record that stands"
            );
        }
    }

    /// Issue 15 §8: an index name derived from a 63-byte table name fits PostgreSQL's limit
    /// and differs from the table's own name and from another long table's.
    #[test]
    fn derived_names_fit_and_stay_distinct() {
        let long = "t".repeat(63);
        let other = format!("{}u", "t".repeat(62));
        for table in [long.as_str(), other.as_str(), "short"] {
            let name = derived_name(table, "_expires_at");
            assert!(name.len() <= 63, "{name} is {} bytes", name.len());
            assert_ne!(name, table);
            assert!(name.ends_with("_expires_at"));
        }
        assert_ne!(
            derived_name(&long, "_expires_at"),
            derived_name(&other, "_expires_at")
        );
        assert_eq!(derived_name("short", "_expires_at"), "short_expires_at");
    }

    #[test]
    fn hostile_identifiers_are_refused() {
        for ok in ["idempotency", "_t", "T_1", &"a".repeat(63)] {
            assert!(identifier(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "1abc",
            "a-b",
            "a b",
            "t\"; DROP TABLE x; --",
            "schema.table",
            "tâble",
            &"a".repeat(64),
        ] {
            assert!(identifier(bad).is_err(), "{bad}");
        }
    }
}
