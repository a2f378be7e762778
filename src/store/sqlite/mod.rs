//! [`SqliteStore`]: durable records for the processes of one host.

mod file;

use std::str::FromStr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteRow, SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, Connection, Row};

use self::file::OpenedFile;
use super::batch::{Batches, ClaimOp, CompleteOp};
use super::history::{HISTORY_LIMIT, HISTORY_REFUSALS};
use super::sql::{self, InvalidIdentifier, RawRecord, RowError, millis, unavailable};
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
/// for it in SQLite's busy handler. Within it, a chunk of up to 64 claims is one upsert and one
/// read answered in a single row, and a chunk of completions one update: sqlx hands every
/// statement and every row between its connection's thread and the caller, which costs more
/// than SQLite's own work. A batch that fails is sent again one operation at a time.
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
    /// `effect_started` that also holds the lease (and the record) ten minutes from when it is
    /// written: a milestone in the caller's transaction, which holds the write lock.
    effect_started_held: Arc<str>,
    /// `downstream_id`, holding likewise.
    downstream_id_held: Arc<str>,
    list_uncertain: Arc<str>,
    list_uncertain_after: Arc<str>,
    list_uncertain_desc: Arc<str>,
    list_uncertain_after_desc: Arc<str>,
    count_uncertain: Arc<str>,
    resolve: Arc<str>,
    append_history: Arc<str>,
    /// The batch statements, made on first use for each chunk size (see [`chunks`]).
    batch: BatchStatements,
}

/// A batch goes to SQLite in chunks of these sizes (largest first: 45 claims are chunks of
/// 32, 8, 4 and 1), each one statement for all of its rows: a handful of statement texts to
/// prepare and keep in sqlx's per-connection cache (100 by default), where one text per batch
/// size would crowd it.
const CHUNK_SIZES: [usize; 6] = [64, 32, 16, 8, 4, 2];

/// The chunks `n` operations go in, as ranges of them, largest first; a chunk of 1 goes with
/// the single operation's statements.
fn chunks(n: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let mut start = 0;
    std::iter::from_fn(move || {
        let left = n - start;
        let size = CHUNK_SIZES
            .into_iter()
            .find(|&size| size <= left)
            .unwrap_or(left);
        let chunk = start..start + size;
        start += size;
        (size > 0).then_some(chunk)
    })
}

/// Statements for a chunk of claims or completions, one of each per size in [`CHUNK_SIZES`].
#[derive(Debug)]
struct BatchStatements {
    table: String,
    /// The claim's `ON CONFLICT` clause, whichever the number of rows.
    conflict: String,
    claims: [OnceLock<Arc<str>>; CHUNK_SIZES.len()],
    current: [OnceLock<Arc<str>>; CHUNK_SIZES.len()],
    completions: [OnceLock<Arc<str>>; CHUNK_SIZES.len()],
}

/// The statement for a chunk of `size`, made once per size in [`CHUNK_SIZES`] (any other size
/// is made each time: [`chunks`] never asks for one).
fn cached(
    cache: &[OnceLock<Arc<str>>; CHUNK_SIZES.len()],
    size: usize,
    make: impl FnOnce() -> String,
) -> Arc<str> {
    match CHUNK_SIZES.iter().position(|&s| s == size) {
        Some(slot) => cache[slot].get_or_init(|| make().into()).clone(),
        None => make().into(),
    }
}

impl BatchStatements {
    /// `size` claims' upserts in one statement: the single claim's, a row of values each
    /// (parameters `?1`–`?7` for the first, `?8`–`?14` for the second, …).
    fn claims(&self, size: usize) -> Arc<str> {
        cached(&self.claims, size, || {
            let rows = (0..size)
                .map(|i| claim_values(&params(i, 7)))
                .collect::<Vec<_>>()
                .join(", ");
            format!(
                "INSERT INTO \"{}\" AS r ({COLUMNS}, reconcile_on_expiry) VALUES {rows} {}",
                self.table, self.conflict
            )
        })
    }

    /// `size` records read in one statement and answered in one row: a JSON array of each
    /// record's place and columns (blobs in hex; a response over [`BIG`] bytes left out), and
    /// the statement's time. One row, where a row per record would be a hand-off per record
    /// between sqlx's connection thread and the caller, which costs more than SQLite's work.
    /// Parameters: `?1`, `?2` the first record's scope and key, `?3`, `?4` the second's, ….
    fn current(&self, size: usize) -> Arc<str> {
        cached(&self.current, size, || {
            let rows = (0..size)
                .map(|i| {
                    let p = params(i, 2);
                    format!("({}, {}, {i})", p[0], p[1])
                })
                .collect::<Vec<_>>()
                .join(", ");
            let columns = CARRIED
                .iter()
                .map(|&(column, how)| how.carry(column))
                .collect::<Vec<_>>()
                .join(", ");
            format!(
                "SELECT json_group_array(json_array(v.column3, {columns})), {NOW}
                 FROM (VALUES {rows}) AS v
                   JOIN \"{}\" r ON r.scope = v.column1 AND r.key = v.column2",
                self.table
            )
        })
    }

    /// `size` completions in one statement (parameters as the single completion's, five a
    /// row). It writes every row whose holder still holds it: when it writes fewer than
    /// `size`, the others were fenced off.
    fn completions(&self, size: usize) -> Arc<str> {
        cached(&self.completions, size, || {
            let rows = (0..size)
                .map(|i| format!("({})", params(i, 5).join(", ")))
                .collect::<Vec<_>>()
                .join(", ");
            completion(
                &self.table,
                [
                    "v.column1",
                    "v.column2",
                    "v.column3",
                    "v.column4",
                    "v.column5",
                ],
                &format!("FROM (VALUES {rows}) AS v"),
            )
        })
    }
}

/// A completion: of one key (`?1`–`?5`), or of each row of a chunk's values (named in `from`),
/// given scope, key, token, response and TTL (ms). It writes a record its token still holds,
/// which the holder may complete again (in its own transaction, say).
fn completion(table: &str, [scope, key, token, response, ttl]: [&str; 5], from: &str) -> String {
    format!(
        "UPDATE \"{table}\" AS r SET status = 'completed', response = {response},
           expires_at = {NOW} + {ttl}, updated_at = {NOW}, history = {}
         {from}
         WHERE r.scope = {scope} AND r.key = {key} AND r.lease_token = {token}
           AND r.status IN ('in_progress', 'completed', 'needs_reconciliation')",
        sql::appended(
            "r.history",
            &entry("r.attempts", "r.lease_token", "'completed'"),
            HISTORY_LIMIT
        )
    )
}

/// A record as the batch read gives it: a JSON array of its place and [`READ`]'s columns, as
/// [`CARRIED`] says.
fn raw_of_json(v: &serde_json::Value) -> Result<RawRecord, StoreError> {
    let bad = |i: usize| {
        let column = CARRIED.get(i - 1).map_or("?", |&(column, _)| column);
        StoreError::unavailable(RowError(format!("column {column} does not read")))
    };
    let blob = |i: usize| -> Result<Vec<u8>, StoreError> {
        let hex = v[i].as_str().ok_or_else(|| bad(i))?;
        (0..hex.len())
            .step_by(2)
            .map(|j| {
                hex.get(j..j + 2)
                    .and_then(|b| u8::from_str_radix(b, 16).ok())
                    .ok_or_else(|| bad(i))
            })
            .collect()
    };
    let int = |i: usize| v[i].as_i64().ok_or_else(|| bad(i));
    let text = |i: usize| String::from_utf8(blob(i)?).map_err(|_| bad(i));
    let optional_text = |i: usize| match &v[i] {
        serde_json::Value::Null => Ok(None),
        _ => text(i).map(Some),
    };
    Ok(RawRecord {
        scope: blob(1)?,
        key: blob(2)?,
        fingerprint: blob(3)?,
        status: text(4)?,
        lease_token: int(5)?,
        lease_until_ms: int(6)?,
        attempts: int(7)?,
        effect_started: int(8)? != 0,
        downstream_id: optional_text(9)?,
        response: match &v[10] {
            serde_json::Value::Null => None,
            _ => Some(blob(10)?),
        },
        created_at_ms: int(11)?,
        updated_at: sql::from_ticks(int(12)?, SqliteStore::CURSOR_TICK),
        expires_at_ms: int(13)?,
        history: text(14)?,
        resolution_note: optional_text(15)?,
    })
}

/// What a claim with `token` came to, from its record's `row`. A row that does not read fails
/// this claim alone, not the transaction: in a batch, the other keys' claims go on.
fn claimed(row: &SqliteRow, token: FencingToken) -> Result<Claim, StoreError> {
    raw(row).map_err(unavailable).and_then(|(raw, now)| {
        raw.into_record()
            .map(|record| sql::claim_outcome(record, now, token))
    })
}

/// [`READ`]'s columns in its order, each with how a batch's one-row read carries it (see
/// [`raw_of_json`], which reads them back by place).
const CARRIED: [(&str, Carried); 15] = [
    ("scope", Carried::Blob),
    ("key", Carried::Blob),
    ("fingerprint", Carried::Blob),
    ("status", Carried::Text),
    ("lease_token", Carried::Integer),
    ("lease_until", Carried::Integer),
    ("attempts", Carried::Integer),
    ("effect_started", Carried::Integer),
    ("downstream_id", Carried::Text),
    ("response", Carried::Response),
    ("created_at", Carried::Integer),
    ("updated_at", Carried::Integer),
    ("expires_at", Carried::Integer),
    ("history", Carried::Text),
    ("resolution_note", Carried::Text),
];

/// How a column travels in JSON, which holds neither blobs nor text that is not UTF-8.
#[derive(Clone, Copy, Debug)]
enum Carried {
    /// Its bytes in hex.
    Blob,
    /// Its bytes in hex, `null`, or `0` for a value that is neither text nor null, which does
    /// not read, as it would not alone.
    Text,
    /// As it is: a value that is not an integer does not read.
    Integer,
    /// A blob, or `0` past [`BIG`] bytes: read alone.
    Response,
}

impl Carried {
    /// The expression carrying `column` of the record `r`.
    fn carry(self, column: &str) -> String {
        let c = format!("r.{column}");
        match self {
            Carried::Blob => format!("hex({c})"),
            Carried::Text => {
                format!(
                    "CASE typeof({c}) WHEN 'text' THEN hex({c}) WHEN 'null' THEN NULL ELSE 0 END"
                )
            }
            Carried::Integer => c,
            Carried::Response => format!(
                "CASE WHEN {c} IS NULL THEN NULL WHEN length({c}) > {BIG} THEN 0 ELSE hex({c}) END"
            ),
        }
    }
}

/// A response longer than this is not read back in a batch's one row (hex doubles it): its
/// claim goes alone.
const BIG: usize = 64 * 1024;

/// The `per` numbered parameters of row `i` of a batch statement.
fn params(i: usize, per: usize) -> Vec<String> {
    (1..=per).map(|p| format!("?{}", i * per + p)).collect()
}

/// A claim's row of values, from its seven parameters: scope, key, fingerprint, token, lease
/// (ms), whether an expired lease is reclaimed, TTL (ms).
fn claim_values(p: &[String]) -> String {
    let (scope, key, fingerprint, token, lease, reclaim, ttl) =
        (&p[0], &p[1], &p[2], &p[3], &p[4], &p[5], &p[6]);
    format!(
        "({scope}, {key}, {fingerprint}, 'in_progress', {token}, {NOW} + {lease}, 1, 0, NULL, \
         NULL, {NOW}, {NOW}, {NOW} + MAX({lease}, {ttl}), {}, NOT {reclaim})",
        entry("1", token, "'claimed'")
    )
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
/// (written by hand), the end of the listing, where SQLite sorts text and blobs. A real number
/// written by hand sorts among the integers instead, and a walk in pages that end on it goes
/// on from the end: the records after it are not listed until it is mended (it is reported
/// unreadable on every page that holds it).
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
        // Whether this claim reclaims an expired lease: only where both the holder's route (the
        // record's flag) and this claim's (its own row of values, so that a batch's rows each
        // keep their own) reclaim; an instance configured otherwise never reruns what its
        // holder's route sends to reconciliation.
        let takeover = format!(
            "({same} AND (r.status = 'released' OR ({lease_over} \
             AND NOT excluded.reconcile_on_expiry AND NOT r.reconcile_on_expiry \
             AND NOT r.effect_started)))"
        );
        let fresh_or_takeover = format!("({expired} OR {takeover})");
        // The claim's own row, made by this same claim before its answer was lost (it is asked
        // again with the same token): nothing ran under it, so it is this claim's still, even
        // past its lease; not another attempt, nor uncertain.
        let own = "(r.status = 'in_progress' AND r.lease_token = excluded.lease_token)";
        let conflict = format!(
            "ON CONFLICT (scope, key) DO UPDATE SET
               fingerprint = CASE WHEN {expired} THEN excluded.fingerprint ELSE r.fingerprint END,
               status = CASE WHEN {own} OR {fresh_or_takeover} THEN 'in_progress' ELSE 'needs_reconciliation' END,
               lease_token = CASE WHEN {fresh_or_takeover} THEN excluded.lease_token ELSE r.lease_token END,
               lease_until = CASE WHEN {own} OR {fresh_or_takeover} THEN excluded.lease_until ELSE r.lease_until END,
               attempts = CASE WHEN {expired} THEN 1 WHEN {own} THEN r.attempts WHEN {takeover} THEN r.attempts + 1 ELSE r.attempts END,
               effect_started = CASE WHEN {expired} THEN 0 ELSE r.effect_started END,
               reconcile_on_expiry = CASE WHEN {fresh_or_takeover} THEN excluded.reconcile_on_expiry
                                          ELSE r.reconcile_on_expiry END,
               downstream_id = CASE WHEN {fresh_or_takeover} AND NOT {own} THEN NULL ELSE r.downstream_id END,
               resolution_note = CASE WHEN {expired} THEN NULL ELSE r.resolution_note END,
               response = CASE WHEN {expired} THEN NULL ELSE r.response END,
               created_at = CASE WHEN {expired} THEN {NOW} ELSE r.created_at END,
               updated_at = {NOW},
               expires_at = CASE WHEN {expired} THEN excluded.expires_at
                                 WHEN {own} OR {takeover} THEN MAX(r.expires_at, excluded.expires_at)
                                 ELSE r.expires_at END,
               history = CASE WHEN {expired} THEN excluded.history
                              WHEN {own} THEN r.history
                              WHEN {takeover} THEN {claimed_again}
                              ELSE {lease_expired} END
             WHERE {expired} OR ({same} AND (r.status = 'released' OR ({lease_over})))",
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
        let upsert = format!(
            "INSERT INTO {t} AS r ({COLUMNS}, reconcile_on_expiry) VALUES {} {conflict}
             RETURNING {READ}, {NOW}",
            claim_values(&params(0, 7))
        );
        let log_capped = |event: &str, cap: usize| {
            format!(
                "history = {}",
                sql::appended("history", &entry("attempts", "lease_token", event), cap)
            )
        };
        let log = |event: &str| log_capped(event, HISTORY_LIMIT);
        let fenced = "scope = ?1 AND key = ?2 AND lease_token = ?3 AND status = 'in_progress'";
        // A milestone, and the `hold` one written in the caller's transaction sets too.
        let milestone = |set: &str, event: &str, hold: &str| {
            format!(
                "UPDATE {t} SET {set}, updated_at = {NOW}{hold}, {} WHERE {fenced}",
                log(event)
            )
        };
        let held = format!(
            ", lease_until = MAX(lease_until, {NOW} + {hold}),
               expires_at = MAX(expires_at, {NOW} + {hold})",
            hold = sql::HELD_IN_TRANSACTION_MS
        );
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
                "UPDATE {t} SET lease_until = MAX(lease_until, {NOW} + ?4), expires_at = MAX(expires_at, {NOW} + ?4),
                   updated_at = {NOW}
                 WHERE {fenced} RETURNING lease_until"
            )
            .into(),
            complete: completion(table, ["?1", "?2", "?3", "?4", "?5"], "").into(),
            // Only `mark_uncertain` settles so: the handler answered, so its effect took place.
            settle: format!(
                "UPDATE {t} SET status = ?4, effect_started = 1, updated_at = {NOW}, {} WHERE {fenced}",
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
            effect_started: milestone("effect_started = 1", "'effect_started'", "").into(),
            downstream_id: milestone("downstream_id = ?4", "'downstream_id'", "").into(),
            effect_started_held: milestone("effect_started = 1", "'effect_started'", &held).into(),
            downstream_id_held: milestone("downstream_id = ?4", "'downstream_id'", &held).into(),
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
                   effect_started = CASE WHEN ?4 = 'completed' THEN r.effect_started ELSE 0 END,
                   resolution_note = ?8,
                   expires_at = CASE WHEN ?4 = 'completed' THEN {NOW} + ?6
                                     ELSE MAX(r.expires_at, {NOW} + ?6) END,
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
            batch: BatchStatements {
                table: table.to_owned(),
                conflict,
                claims: Default::default(),
                current: Default::default(),
                completions: Default::default(),
            },
        }
    }
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
        match written {
            Some(row) => Ok(claimed(&row, token)),
            None => self.read_claimed(connection, &req.key, token).await,
        }
    }

    /// What a claim with `token` came to, read from `key`'s record on `connection` (inside
    /// the claim's transaction).
    async fn read_claimed(
        &self,
        connection: &mut SqliteConnection,
        key: &ScopedKey,
        token: FencingToken,
    ) -> Result<Result<Claim, StoreError>, sqlx::Error> {
        let row = sqlx::query(AssertSqlSafe(self.sql.current.clone()))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .fetch_one(&mut *connection)
            .await?;
        Ok(claimed(&row, token))
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

    /// A batch of claims: one transaction, two statements for each chunk of it (the upserts,
    /// then the records as they stand). If it fails, its claims go alone, each on a task of
    /// its own (and its own transaction), holding neither the writer nor a batch slot.
    async fn claim_batch(self, ops: Vec<ClaimOp>) {
        let writer = self.writer.lock().await;
        let outcomes = match ops.as_slice() {
            [op] => Ok(vec![Some(self.claim_one(&op.request, op.token).await)]),
            _ => self.claim_together(&ops).await,
        };
        drop(writer);
        self.settle_claims(ops, outcomes);
    }

    /// Each claim of the batch, every one answered here (never `None`, which would send it
    /// alone: claimed again, after this commit).
    async fn claim_together(
        &self,
        ops: &[ClaimOp],
    ) -> Result<Vec<Option<Result<Claim, StoreError>>>, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let mut outcomes: Vec<Option<Result<Claim, StoreError>>> =
            ops.iter().map(|_| None).collect();
        for range in chunks(ops.len()) {
            let size = range.len();
            let (chunk, found) = (&ops[range.clone()], &mut outcomes[range]);
            if let [op] = chunk {
                found[0] = Some(self.claim_in(&mut tx, &op.request, op.token).await?);
                continue;
            }
            let mut upsert = sqlx::query(AssertSqlSafe(self.sql.batch.claims(size)));
            for op in chunk {
                let req = &op.request;
                upsert = upsert
                    .bind(req.key.scope().as_bytes())
                    .bind(req.key.key().as_bytes())
                    .bind(req.fingerprint.as_bytes().as_slice())
                    .bind(sql::token(op.token))
                    .bind(millis(req.lease))
                    .bind(req.on_lease_expiry == LeaseExpiry::Reclaim)
                    .bind(millis(req.ttl));
            }
            upsert.execute(&mut *tx).await?;
            // Whether a claim won is read from its record, as alone: its own token in progress.
            let mut current = sqlx::query(AssertSqlSafe(self.sql.batch.current(size)));
            for op in chunk {
                current = current
                    .bind(op.request.key.scope().as_bytes())
                    .bind(op.request.key.key().as_bytes());
            }
            let row = current.fetch_one(&mut *tx).await?;
            let read = row
                .try_get::<String, _>(0)
                .ok()
                .and_then(|records| serde_json::from_str::<Vec<serde_json::Value>>(&records).ok());
            if let (Some(records), Ok(now)) = (read, row.try_get::<i64, _>(1)) {
                let now = sql::from_millis(now);
                for record in records {
                    let Some(i) = record[0]
                        .as_u64()
                        .and_then(|i| usize::try_from(i).ok())
                        .filter(|&i| i < size)
                    else {
                        continue;
                    };
                    // A response too big to read back here: read below.
                    if record[10].is_number() {
                        continue;
                    }
                    // A record that does not read fails its own claim, not the batch's others.
                    found[i] = Some(raw_of_json(&record).and_then(|raw| {
                        raw.into_record()
                            .map(|record| sql::claim_outcome(record, now, chunk[i].token))
                    }));
                }
            }
            // What the one row did not give (a response too big for it), read one by one in
            // this transaction: never claimed again, which a lease run out meanwhile would turn
            // into a takeover of the claim's own key.
            for (op, found) in chunk.iter().zip(found.iter_mut()) {
                if found.is_none() {
                    *found = Some(
                        self.read_claimed(&mut tx, &op.request.key, op.token)
                            .await?,
                    );
                }
            }
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

    /// The completions of a batch, one statement for each chunk of it: each not written was
    /// fenced off.
    async fn complete_together(
        &self,
        ops: &[CompleteOp],
    ) -> Result<Vec<Result<(), StoreError>>, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let mut outcomes: Vec<Result<(), StoreError>> =
            ops.iter().map(|_| Err(StoreError::Fenced)).collect();
        for range in chunks(ops.len()) {
            let size = range.len();
            let (chunk, done) = (&ops[range.clone()], &mut outcomes[range]);
            if let [op] = chunk {
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
                done[0] = fenced(rows);
                continue;
            }
            let mut complete = sqlx::query(AssertSqlSafe(self.sql.batch.completions(size)));
            for op in chunk {
                complete = complete
                    .bind(op.key.scope().as_bytes())
                    .bind(op.key.key().as_bytes())
                    .bind(sql::token(op.token))
                    .bind(op.response.as_slice())
                    .bind(millis(op.ttl));
            }
            let written = complete.execute(&mut *tx).await?.rows_affected();
            if written == size as u64 {
                done.iter_mut().for_each(|d| *d = Ok(()));
                continue;
            }
            // Some were fenced off: which, read record by record (rare).
            for (op, d) in chunk.iter().zip(done.iter_mut()) {
                let row = sqlx::query(AssertSqlSafe(self.sql.current.clone()))
                    .bind(op.key.scope().as_bytes())
                    .bind(op.key.key().as_bytes())
                    .fetch_optional(&mut *tx)
                    .await?;
                // Only the status and the token: a holder's completion of a row whose other
                // columns do not read was written all the same.
                let mine = row.is_some_and(|row| {
                    row.try_get::<i64, _>(4).ok() == Some(sql::token(op.token))
                        && row.try_get::<&str, _>(3).ok() == Some("completed")
                });
                if mine {
                    *d = Ok(());
                }
            }
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

#[cfg(test)]
mod tests {
    use super::{CHUNK_SIZES, chunks};

    /// SQLite's busy codes, extended ones included, and no other.
    #[test]
    fn s1_6_busy_codes_are_told_from_read_only_ones() {
        for busy in ["5", "261", "517", "773"] {
            assert!(super::busy(busy), "{busy}");
        }
        for other in ["8", "264", "520", "1032", "1544", "6", "0", "", "busy"] {
            assert!(!super::busy(other), "{other}");
        }
    }

    /// §1.6: a store connects while another connection holds the file's write lock (its
    /// connections are tried as the pool opens them, once the lock is free). The check leaves
    /// the file as it was. A file in a missing directory is refused.
    #[tokio::test]
    async fn s1_6_a_store_connects_while_another_holds_the_write_lock() {
        use sqlx::{Connection, Executor};
        let dir = std::env::temp_dir().join(format!(
            "sqlite-writable-{}-{:?}",
            std::process::id(),
            std::time::SystemTime::now()
        ));
        std::fs::create_dir_all(&dir).expect("dir");
        let url = format!("sqlite://{}", dir.join("db.sqlite").display());
        let store = super::SqliteStore::connect(&url).await.expect("connect");
        store.migrate().await.expect("migrate");
        sqlx::query("PRAGMA user_version = 42")
            .execute(store.pool())
            .await
            .expect("a version");
        let mut holder = sqlx::SqliteConnection::connect(&url).await.expect("holder");
        holder.execute("BEGIN IMMEDIATE").await.expect("lock");
        let other = tokio::time::timeout(
            std::time::Duration::from_secs(60),
            super::SqliteStore::connect(&url),
        )
        .await
        .expect("connect within a minute")
        .expect("connect while the lock is held");
        holder.execute("ROLLBACK").await.expect("unlock");
        let version: i64 = sqlx::query_scalar("PRAGMA user_version")
            .fetch_one(other.pool())
            .await
            .expect("read");
        assert_eq!(version, 42, "the check leaves the file as it was");
        let missing = format!("sqlite://{}", dir.join("no/such/dir/db.sqlite").display());
        assert!(super::SqliteStore::connect(&missing).await.is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// §1.6: a pool of one's own, given to `SqliteStore::new`, refuses the read-only
    /// connections SQLite opens without an error once it runs `check_writable` on each: its
    /// store answers unavailable instead of keeping a connection that fails every write. The
    /// same pool without the check hands such a connection out; on a writable file the check
    /// passes and leaves the file as it was.
    #[tokio::test]
    async fn s1_6_a_pool_of_ones_own_refuses_read_only_connections_with_the_check() {
        use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
        use std::str::FromStr;
        use std::time::Duration;
        let dir = std::env::temp_dir().join(format!(
            "sqlite-own-pool-{}-{:?}",
            std::process::id(),
            std::time::SystemTime::now()
        ));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("db.sqlite");
        let url = format!("sqlite://{}", file.display());
        let made = super::SqliteStore::connect(&url).await.expect("connect");
        made.migrate().await.expect("migrate");
        sqlx::query("PRAGMA user_version = 7")
            .execute(made.pool())
            .await
            .expect("a version");
        made.pool().close().await;
        let pool = |url: &str, checked: bool| {
            let options = SqliteConnectOptions::from_str(url).expect("options");
            let pool = SqlitePoolOptions::new()
                .max_connections(2)
                .acquire_timeout(Duration::from_millis(500));
            if checked {
                pool.after_connect(|c, _| Box::pin(super::SqliteStore::check_writable(c)))
                    .connect_lazy_with(options)
            } else {
                pool.connect_lazy_with(options)
            }
        };
        let read_only = format!("{url}?mode=ro");
        let unchecked = pool(&read_only, false);
        assert!(
            unchecked.acquire().await.is_ok(),
            "without the check SQLite hands out a read-only connection"
        );
        let checked = pool(&read_only, true);
        assert!(
            checked.acquire().await.is_err(),
            "the check refuses a read-only connection"
        );
        let store = super::SqliteStore::new(checked);
        let request = crate::store::ClaimRequest {
            key: crate::store::ScopedKey::new("", "own-pool"),
            fingerprint: crate::Fingerprint::from_bytes([1; 32]),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
            on_lease_expiry: crate::LeaseExpiry::Reclaim,
        };
        use crate::store::IdempotencyStore;
        assert!(
            store.claim(&request).await.is_err(),
            "its store answers unavailable, never a claim"
        );
        let writable = pool(&url, true);
        let version: i64 = sqlx::query_scalar("PRAGMA user_version")
            .fetch_one(&writable)
            .await
            .expect("a checked writable connection");
        assert_eq!(version, 7, "the check leaves the file as it was");
        let store = super::SqliteStore::new(writable);
        assert!(matches!(
            store.claim(&request).await,
            Ok(crate::store::Claim::Acquired(_))
        ));
        for p in [unchecked, store.pool().clone()] {
            p.close().await;
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The batch's one-row read carries exactly `READ`'s columns, in its order: `raw_of_json`
    /// reads them back by place.
    #[test]
    fn s4_a_batch_read_carries_what_every_read_returns() {
        let read: Vec<&str> = super::READ.split(',').map(str::trim).collect();
        let carried: Vec<&str> = super::CARRIED.iter().map(|&(c, _)| c).collect();
        assert_eq!(carried, read);
    }

    /// A batch of any size is cut into chunks that add up to it, each a size whose statement
    /// is made once (or a single operation), largest first.
    #[test]
    fn s4_a_batch_is_cut_into_chunks_of_the_cached_sizes() {
        let sizes = |n| chunks(n).map(|r| r.len()).collect::<Vec<_>>();
        assert_eq!(sizes(45), [32, 8, 4, 1]);
        assert_eq!(sizes(100), [64, 32, 4]);
        assert_eq!(chunks(0).count(), 0);
        for n in 1..=300 {
            // The ranges follow one another from 0 to n.
            let ranges: Vec<_> = chunks(n).collect();
            assert!(
                ranges.windows(2).all(|w| w[0].end == w[1].start),
                "{n}: {ranges:?}"
            );
            assert_eq!(ranges.first().map(|r| r.start), Some(0), "{n}: {ranges:?}");
            let sizes = sizes(n);
            assert_eq!(sizes.iter().sum::<usize>(), n, "{n}: {sizes:?}");
            assert!(sizes.is_sorted_by(|a, b| a >= b), "{n}: {sizes:?}");
            assert!(
                sizes.iter().all(|s| *s == 1 || CHUNK_SIZES.contains(s)),
                "{n}: {sizes:?}"
            );
            assert!(
                sizes.iter().filter(|s| **s == 1).count() <= 1,
                "{n}: {sizes:?}"
            );
        }
    }
}
