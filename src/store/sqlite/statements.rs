//! The SQL a [`SqliteStore`] runs, written once per table, and the batch statements cut to
//! the sizes it caches.

use std::sync::{Arc, OnceLock};

use crate::store::history::{HISTORY_LIMIT, HISTORY_REFUSALS};
use crate::store::sql;

#[derive(Debug)]
pub(super) struct Statements {
    pub(super) table: String,
    pub(super) upsert: Arc<str>,
    pub(super) renew: Arc<str>,
    pub(super) complete: Arc<str>,
    pub(super) settle: Arc<str>,
    pub(super) release: Arc<str>,
    pub(super) current: Arc<str>,
    pub(super) lookup: Arc<str>,
    pub(super) remove: Arc<str>,
    pub(super) purge: Arc<str>,
    pub(super) effect_started: Arc<str>,
    pub(super) downstream_id: Arc<str>,
    /// `effect_started` that also holds the lease (and the record) ten minutes from when it is
    /// written: a milestone in the caller's transaction, which holds the write lock.
    pub(super) effect_started_held: Arc<str>,
    /// `downstream_id`, holding likewise.
    pub(super) downstream_id_held: Arc<str>,
    pub(super) list_uncertain: Arc<str>,
    pub(super) list_uncertain_after: Arc<str>,
    pub(super) list_uncertain_desc: Arc<str>,
    pub(super) list_uncertain_after_desc: Arc<str>,
    pub(super) count_uncertain: Arc<str>,
    pub(super) resolve: Arc<str>,
    pub(super) append_history: Arc<str>,
    /// The batch statements, made on first use for each chunk size (see [`chunks`]).
    pub(super) batch: BatchStatements,
}

/// A batch goes to SQLite in chunks of these sizes (largest first: 45 claims are chunks of
/// 32, 8, 4 and 1), each one statement for all of its rows: a handful of statement texts to
/// prepare and keep in sqlx's per-connection cache (100 by default), where one text per batch
/// size would crowd it.
pub(super) const CHUNK_SIZES: [usize; 6] = [64, 32, 16, 8, 4, 2];

/// The chunks `n` operations go in, as ranges of them, largest first; a chunk of 1 goes with
/// the single operation's statements.
pub(super) fn chunks(n: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
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
pub(super) struct BatchStatements {
    pub(super) table: String,
    /// The claim's `ON CONFLICT` clause, whichever the number of rows.
    pub(super) conflict: String,
    pub(super) claims: [OnceLock<Arc<str>>; CHUNK_SIZES.len()],
    pub(super) current: [OnceLock<Arc<str>>; CHUNK_SIZES.len()],
    pub(super) completions: [OnceLock<Arc<str>>; CHUNK_SIZES.len()],
}

/// The statement for a chunk of `size`, made once per size in [`CHUNK_SIZES`] (any other size
/// is made each time: [`chunks`] never asks for one).
pub(super) fn cached(
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
    pub(super) fn claims(&self, size: usize) -> Arc<str> {
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
    pub(super) fn current(&self, size: usize) -> Arc<str> {
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
    pub(super) fn completions(&self, size: usize) -> Arc<str> {
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
pub(super) fn completion(
    table: &str,
    [scope, key, token, response, ttl]: [&str; 5],
    from: &str,
) -> String {
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

/// [`READ`]'s columns in its order, each with how a batch's one-row read carries it (see
/// [`raw_of_json`], which reads them back by place).
pub(super) const CARRIED: [(&str, Carried); 15] = [
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
pub(super) enum Carried {
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
    pub(super) fn carry(self, column: &str) -> String {
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
pub(super) const BIG: usize = 64 * 1024;

/// The `per` numbered parameters of row `i` of a batch statement.
pub(super) fn params(i: usize, per: usize) -> Vec<String> {
    (1..=per).map(|p| format!("?{}", i * per + p)).collect()
}

/// A claim's row of values, from its seven parameters: scope, key, fingerprint, token, lease
/// (ms), whether an expired lease is reclaimed, TTL (ms).
pub(super) fn claim_values(p: &[String]) -> String {
    let (scope, key, fingerprint, token, lease, reclaim, ttl) =
        (&p[0], &p[1], &p[2], &p[3], &p[4], &p[5], &p[6]);
    format!(
        "({scope}, {key}, {fingerprint}, 'in_progress', {token}, {NOW} + {lease}, 1, 0, NULL, \
         NULL, {NOW}, {NOW}, {NOW} + MAX({lease}, {ttl}), {}, NOT {reclaim})",
        entry("1", token, "'claimed'")
    )
}

/// Milliseconds since the Unix epoch on SQLite's clock; fixed within one statement.
pub(super) const NOW: &str = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER)";
pub(super) const COLUMNS: &str = "scope, key, fingerprint, status, lease_token, lease_until, attempts, \
                       effect_started, downstream_id, response, created_at, updated_at, expires_at, \
                       history";
/// What every read returns: the written columns and the resolution's note.
pub(super) const READ: &str = "scope, key, fingerprint, status, lease_token, lease_until, attempts, \
                    effect_started, downstream_id, response, created_at, updated_at, expires_at, \
                    history, resolution_note";

/// A record's place in the uncertain listing: its time, or, for a time that is not an integer
/// (written by hand), the end of the listing, where SQLite sorts text and blobs. A real number
/// written by hand sorts among the integers instead, and a walk in pages that end on it goes
/// on from the end: the records after it are not listed until it is mended (it is reported
/// unreadable on every page that holds it).
pub(super) const CURSOR_MILLIS: &str =
    "(CASE WHEN typeof(r.updated_at) = 'integer' THEN r.updated_at ELSE 9223372036854775807 END)";

/// Records only a reconciliation can settle once their holder is gone: awaiting it, or in
/// progress with the effect started or on a route that reconciles expired leases.
pub(super) const WATCHED: &str = "r.status = 'needs_reconciliation' \
    OR (r.status = 'in_progress' AND (r.effect_started OR r.reconcile_on_expiry))";

/// A history entry written on SQLite's clock (see [`super::HistoryEntry`]).
pub(super) fn entry(attempt: &str, token: &str, event: &str) -> String {
    format!("({attempt}) || ' ' || ({token}) || ' ' || {NOW} || ' ' || ({event}) || ';'")
}

impl Statements {
    pub(super) fn new(table: &str) -> Self {
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
