//! [`PostgresStore`]: one record per key, shared by every replica of a service.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions, PgRow};
use sqlx::{AssertSqlSafe, Connection, Row};

use super::batch::{Batches, ClaimOp, CompleteOp};
use super::history::{HISTORY_LIMIT, HISTORY_REFUSALS};
use super::sql::{self, InvalidIdentifier, RawRecord, millis, unavailable};
use super::{
    Claim, ClaimRequest, FencingToken, HistoryEvent, IdempotencyStore, InFlight, LeaseExpiry,
    Milestone, Record, RecordStatus, Resolution, ScopedKey, StoreError, StoredResponse,
    UncertainCount, UncertainCursor, UncertainPage, UncertainQuery, Unreadable,
};

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
}

/// The waiters of one store, woken by `NOTIFY`s that the table's triggers send when an
/// in-flight record moves on (the payload: the hex SHA-256 of its scope, a NUL and its key).
/// One listening connection per store, opened on the first wait; while it is down, waiters
/// poll.
struct Changes {
    waiters: super::Waiters<String>,
    started: std::sync::atomic::AtomicBool,
    live: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Changes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Changes")
            .field("live", &self.live)
            .finish_non_exhaustive()
    }
}

impl Changes {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            waiters: super::Waiters::default(),
            started: std::sync::atomic::AtomicBool::new(false),
            live: std::sync::atomic::AtomicBool::new(false),
        })
    }
}

/// What the triggers send for a key: the hex SHA-256 of its scope, a NUL and its key.
fn change_payload(key: &ScopedKey) -> String {
    use sha2::Digest;
    let mut hash = sha2::Sha256::new();
    hash.update(key.scope().as_bytes());
    hash.update([0]);
    hash.update(key.key().as_bytes());
    hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

#[derive(Debug)]
struct Statements {
    schema: String,
    table: String,
    claim: Arc<str>,
    /// A batch of claims in one statement (arrays of each parameter of `claim`).
    claim_batch: Arc<str>,
    renew: Arc<str>,
    complete: Arc<str>,
    /// A batch of completions in one statement.
    complete_batch: Arc<str>,
    /// `complete`, waiting at most 100 ms for the row: a batched store's lone completion.
    complete_bounded: Arc<str>,
    settle: Arc<str>,
    release: Arc<str>,
    lookup: Arc<str>,
    /// The record of `$1`/`$2` if a claim with fingerprint `$3` would leave it as it is.
    unchanged: Arc<str>,
    remove: Arc<str>,
    purge: Arc<str>,
    effect_started: Arc<str>,
    downstream_id: Arc<str>,
    /// `effect_started` that also holds the lease (and the record) ten minutes from when it is
    /// written: a milestone in the caller's transaction, which holds the row from renewals.
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
    /// Whether a waiter's record is still the holder's, and whether it is marked waited on.
    waited: Arc<str>,
    /// Marks it waited on.
    mark_waited: Arc<str>,
}

/// Whether the record aliased `r` counts as absent: past its TTL, unless its outcome is
/// unknown (one awaiting reconciliation, or whose holder marked its effect started, never
/// expires into a new run; it stays until it is resolved, DESIGN §4).
fn expired(r: &str) -> String {
    format!(
        "({r}.expires_at <= now() AND ({r}.status IN ('completed', 'released') \
         OR ({r}.status = 'in_progress' AND NOT {r}.effect_started AND NOT {r}.reconcile_on_expiry)))"
    )
}

/// How long a claim, a renewal or a refusal note waits for a record locked by another
/// transaction (a handler recording its milestone in its own transaction) before giving up: a
/// claim then answers from what is committed if it would change nothing there, and "in
/// flight" otherwise; none queues behind a long transaction holding a pooled connection. A
/// one-row subquery sets the lock wait before any row is locked (the row comes from a join
/// with it); `set_config(.., true)` lasts the statement's own transaction, so it is
/// only in statements that never run inside a caller's transaction.
const BOUNDED: &str = "(SELECT set_config('lock_timeout', '100ms', true) AS wait) AS bounded";

/// How long [`PostgresStore::connect`] waits for a server to answer.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Session limits on the connections [`PostgresStore::connect`] opens: no statement of the
/// store waits on a lock, or runs, without bound.
const SESSION_LIMITS: [(&str, &str); 2] = [("lock_timeout", "5s"), ("statement_timeout", "30s")];
/// A record's place in the uncertain listing, in microseconds, exact: `infinity` and
/// `-infinity` written by hand are `i64`'s ends, which [`CURSOR_TIME`] reads back as them. The
/// last three decades of PostgreSQL's range (after 294247-01-10, past `i64` microseconds; only
/// a time written by hand) are placed at its end, one before `infinity`, where a cursor
/// cannot tell them apart from the times before them: a walk oldest first lists such a record
/// again on every page that starts there, up to the walker's bound, and of two such records a
/// walk newest first lists only the latest.
const CURSOR_MICROS: &str = "(CASE WHEN r.updated_at = 'infinity' THEN 9223372036854775807 \
    WHEN r.updated_at = '-infinity' THEN -9223372036854775807 - 1 \
    ELSE LEAST(extract(epoch from r.updated_at) * 1000000, 9223372036854775806)::int8 END)";

/// A listing cursor's time (`$2`, microseconds) as the database's, exactly: the place a
/// record's [`CURSOR_MICROS`] gave, or a cursor made by hand (any `i64`). Whole days and
/// microseconds as intervals on a `timestamp` (no time zone: a day is 24 hours), each exact,
/// where microseconds as a float lose precision past the year 2255; bounded to what the type
/// holds in every arm, since a planner may fold the arm not taken.
const CURSOR_TIME: &str = "(CASE WHEN $2 = 9223372036854775807 THEN timestamptz 'infinity' \
    WHEN $2 = -9223372036854775807 - 1 THEN timestamptz '-infinity' \
    ELSE (timestamp 'epoch' \
      + (GREATEST(LEAST($2, 9223372036854775806), -210866803200000000) / 86400000000) * interval '1 day' \
      + (GREATEST(LEAST($2, 9223372036854775806), -210866803200000000) % 86400000000) * interval '1 microsecond') \
      AT TIME ZONE 'UTC' END)";

/// Records only a reconciliation can settle once their holder is gone: awaiting it, or in
/// progress with the effect started or on a route that reconciles expired leases. The partial
/// index over them keeps listing and counting them from reading the table.
const WATCHED: &str = "r.status = 'needs_reconciliation' \
    OR (r.status = 'in_progress' AND (r.effect_started OR r.reconcile_on_expiry))";
/// Nobody knows the outcome and only a reconciliation can tell: marked so, or a watched
/// record's holder's lease ran out.
const UNCERTAIN: &str = "r.status = 'needs_reconciliation' \
    OR (r.status = 'in_progress' AND (r.effect_started OR r.reconcile_on_expiry) \
        AND r.lease_until <= now())";

/// A history entry written on the database's clock (see [`super::HistoryEntry`]).
fn entry(attempt: &str, token: &str, event: &str) -> String {
    format!(
        "({attempt})::text || ' ' || ({token})::text || ' ' || \
         (floor(extract(epoch from now()) * 1000)::int8)::text || ' ' || ({event}) || ';'"
    )
}

impl Statements {
    fn new(schema: &str, table: &str) -> Self {
        let t = format!("\"{schema}\".\"{table}\"");
        let cols = |a: &str| {
            // An operator may write `infinity` into a time: read as the far future (or past),
            // never an error that fails every listing. Rounded down (`::int8` alone rounds to
            // nearest): a time written on the same clock reading as the last change, which is
            // read to the microsecond, never reads later than it.
            let ms = |c: &str| {
                format!(
                    "(CASE WHEN isfinite({a}.{c}) THEN floor(extract(epoch from {a}.{c}) * 1000)::int8 \
                     WHEN {a}.{c} > now() THEN 9223372036854775807 ELSE 0 END)"
                )
            };
            format!(
                "{a}.scope, {a}.key, {a}.fingerprint, {a}.status, {a}.lease_token, {}, \
                 {a}.attempts::int8, {a}.effect_started, {a}.downstream_id, {a}.response, {}, {}, {}, \
                 {a}.history, {a}.resolution_note, (extract(epoch from now()) * 1000000)::int8",
                ms("lease_until"),
                ms("created_at"),
                // At the listing's tick: a record read here stands where the listing places it.
                CURSOR_MICROS.replace("r.updated_at", &format!("{a}.updated_at")),
                ms("expires_at"),
            )
        };
        let expired_r = expired("r");
        let lease_over =
            |r: &str| format!("{r}.status = 'in_progress' AND {r}.lease_until <= now()");
        // Whether the claimer takes over an expired lease: only where both the holder's route
        // (the record's flag) and the claimer's (the row it would insert, so one statement
        // serves a batch of claims) reclaim; an instance configured otherwise, as in a rolling
        // deploy, never reruns what its holder's route sends to reconciliation.
        let takeover = format!(
            "(r.fingerprint = excluded.fingerprint AND (r.status = 'released' OR ({} \
             AND NOT excluded.reconcile_on_expiry AND NOT r.reconcile_on_expiry \
             AND NOT r.effect_started)))",
            lease_over("r")
        );
        let fresh_or_takeover = format!("({expired_r} OR {takeover})");
        // The claim's own row, made by this same claim before its answer was lost (it is asked
        // again with the same token): nothing ran under it, so it is this claim's still, even
        // past its lease; not another attempt, nor uncertain.
        let own = "(r.status = 'in_progress' AND r.lease_token = excluded.lease_token)";
        // Whether a claim with `fingerprint` changes the record `r`: it has expired, or it is
        // the same request's and released or past its lease (taken over, or sent to
        // reconciliation).
        let changes = |r: &str, fingerprint: &str| {
            format!(
                "({} OR ({r}.fingerprint = {fingerprint} AND ({r}.status = 'released' OR ({}))))",
                expired(r),
                lease_over(r)
            )
        };
        let cols_r = cols("r");
        // The upsert, for the values `v` (scope, key, fingerprint, token, lease ms, reclaim,
        // TTL ms) selected `from` a source, in an `order` that locks rows in one order.
        let upsert = |v: [&str; 7], from: &str, order: &str| {
            let [scope, key, fingerprint, token, lease, reclaim, ttl] = v;
            format!(
                "INSERT INTO {t} AS r (scope, key, fingerprint, status, lease_token, lease_until,
                   attempts, effect_started, downstream_id, response, created_at, updated_at, expires_at,
                   history, reconcile_on_expiry)
               SELECT {scope}, {key}, {fingerprint}, 'in_progress', {token},
                   now() + make_interval(secs => {lease}::float8 / 1000),
                   1, false, NULL, NULL, now(), now(),
                   now() + make_interval(secs => GREATEST({lease}, {ttl})::float8 / 1000), {claimed_first},
                   NOT {reclaim}
               FROM {from}{BOUNDED}
               WHERE bounded.wait IS NOT NULL
                 AND NOT EXISTS (SELECT 1 FROM {t} held WHERE held.scope = {scope} AND held.key = {key}
                                   AND NOT {held_changes})
               {order}
               ON CONFLICT (scope, key) DO UPDATE SET
                 fingerprint = CASE WHEN {expired_r} THEN excluded.fingerprint ELSE r.fingerprint END,
                 status = CASE WHEN {own} OR {fresh_or_takeover} THEN 'in_progress' ELSE 'needs_reconciliation' END,
                 lease_token = CASE WHEN {fresh_or_takeover} THEN excluded.lease_token ELSE r.lease_token END,
                 lease_until = CASE WHEN {own} OR {fresh_or_takeover} THEN excluded.lease_until ELSE r.lease_until END,
                 attempts = CASE WHEN {expired_r} THEN 1 WHEN {own} THEN r.attempts WHEN {takeover} THEN r.attempts + 1 ELSE r.attempts END,
                 effect_started = CASE WHEN {expired_r} THEN false ELSE r.effect_started END,
                 reconcile_on_expiry = CASE WHEN {fresh_or_takeover} THEN excluded.reconcile_on_expiry
                                            ELSE r.reconcile_on_expiry END,
                 downstream_id = CASE WHEN {fresh_or_takeover} AND NOT {own} THEN NULL ELSE r.downstream_id END,
                 resolution_note = CASE WHEN {expired_r} THEN NULL ELSE r.resolution_note END,
                 response = CASE WHEN {expired_r} THEN NULL ELSE r.response END,
                 created_at = CASE WHEN {expired_r} THEN now() ELSE r.created_at END,
                 updated_at = now(),
                 expires_at = CASE WHEN {expired_r} THEN excluded.expires_at
                                   WHEN {own} OR {takeover} THEN GREATEST(r.expires_at, excluded.expires_at)
                                   ELSE r.expires_at END,
                 history = CASE WHEN {expired_r} THEN excluded.history
                                WHEN {own} THEN r.history
                                WHEN {takeover} THEN {claimed_again}
                                ELSE {lease_expired} END
               WHERE {changes}
               RETURNING {cols_r}",
                // A record the claim would leave as it is (live, or another request's) is
                // answered from the read, without the conflict's row lock: replays and waiting
                // duplicates neither queue on the row nor write its tuple.
                held_changes = changes("held", fingerprint),
                changes = changes("r", "excluded.fingerprint"),
                claimed_first = entry("1", token, "'claimed'"),
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
            )
        };
        // The record of `$1`/`$2` if a claim with fingerprint `$3` leaves it as it is.
        let unchanged = format!(
            "SELECT {cols_r} FROM {t} r WHERE r.scope = $1 AND r.key = $2 AND NOT {}",
            changes("r", "$3")
        );
        // Unclaimed, the record is answered as the statement read it, but only one the claim
        // leaves as it is: a record it would change (expired, released, lapsed) was changed
        // by another claim while this one waited for its lock, and the statement's snapshot
        // holds the version before. No row then, and the claim goes again on a fresh one
        // (an expired response is never replayed, a takeover never missed).
        let claim = format!(
            "WITH claimed AS ({})
             SELECT * FROM claimed
             UNION ALL
             {unchanged} AND NOT EXISTS (SELECT 1 FROM claimed)",
            upsert(["$1", "$2", "$3", "$4", "$5", "$6", "$7"], "", ""),
        );
        // A batch: the same upsert for every row of the arrays, in key order (two batches
        // lock their rows in one order), each row answered with its place in the arrays.
        let claim_batch = format!(
            "WITH input AS (
               SELECT * FROM unnest($1::bytea[], $2::bytea[], $3::bytea[], $4::int8[], $5::int8[],
                                    $6::bool[], $7::int8[])
                 WITH ORDINALITY AS i(scope, key, fingerprint, token, lease_ms, reclaim, ttl_ms, n)
             ),
             claimed AS ({})
             SELECT c.*, i.n FROM claimed c JOIN input i ON i.scope = c.scope AND i.key = c.key
             UNION ALL
             SELECT {cols_r}, i.n FROM input i JOIN {t} r ON r.scope = i.scope AND r.key = i.key
              WHERE NOT EXISTS (SELECT 1 FROM claimed c WHERE c.scope = i.scope AND c.key = i.key)
                AND NOT {changed}",
            upsert(
                [
                    "i.scope",
                    "i.key",
                    "i.fingerprint",
                    "i.token",
                    "i.lease_ms",
                    "i.reclaim",
                    "i.ttl_ms"
                ],
                "input i, ",
                "ORDER BY i.scope, i.key"
            ),
            changed = changes("r", "i.fingerprint"),
        );
        let log_capped = |event: &str, cap: usize| {
            format!(
                "history = {}",
                sql::appended("history", &entry("attempts", "lease_token", event), cap)
            )
        };
        let log = |event: &str| log_capped(event, HISTORY_LIMIT);
        let fenced = "scope = $1 AND key = $2 AND lease_token = $3 AND status = 'in_progress'";
        // A milestone, and the `hold` one written in the caller's transaction sets too.
        let milestone = |set: &str, event: &str, hold: &str| {
            format!(
                "UPDATE {t} SET {set}, updated_at = now(){hold}, {} WHERE {fenced}",
                log(event)
            )
        };
        let held = format!(
            ", lease_until = GREATEST(lease_until, clock_timestamp() + {hold}),
               expires_at = GREATEST(expires_at, clock_timestamp() + {hold})",
            hold = format_args!(
                "make_interval(secs => {}::float8 / 1000)",
                sql::HELD_IN_TRANSACTION_MS
            )
        );
        // The holder may complete again what it completed in its own transaction.
        let completer = "scope = $1 AND key = $2 AND lease_token = $3 \
                         AND status IN ('in_progress', 'completed', 'needs_reconciliation')";
        // A record's place is its last change, column 11, already read at the cursor's tick.
        let list_first = format!(
            "SELECT {} FROM {t} r
                 WHERE ({UNCERTAIN}) ORDER BY r.updated_at, r.scope, r.key LIMIT $1",
            cols("r"),
        );
        let list_after = format!(
            "SELECT {} FROM {t} r
                 WHERE ({UNCERTAIN})
                   AND (r.updated_at, r.scope, r.key) > ({CURSOR_TIME}, $3, $4)
                 ORDER BY r.updated_at, r.scope, r.key LIMIT $1",
            cols("r"),
        );
        Self {
            schema: schema.to_owned(),
            table: table.to_owned(),
            claim: claim.into(),
            claim_batch: claim_batch.into(),
            // Renewals and refusal notes run while a handler may hold the row in its own
            // transaction: they wait for it no longer than a claim does (`{BOUNDED}`). A
            // renewal never shortens the lease: `now()` is when its statement began, and one
            // that waited on the row may land after a later one (they overlap, see `hold`).
            renew: format!(
                "UPDATE {t} SET lease_until = GREATEST(lease_until,
                     now() + make_interval(secs => $4::float8 / 1000)),
                   expires_at = GREATEST(expires_at, now() + make_interval(secs => $4::float8 / 1000)),
                   updated_at = now()
                 FROM {BOUNDED}
                 WHERE {fenced} AND bounded.wait IS NOT NULL
                 RETURNING floor(extract(epoch from lease_until) * 1000)::int8"
            )
            .into(),
            // `clock_timestamp()`: in a handler's own transaction (`complete_in`), `now()` is
            // when the transaction began, and a record completed in a long one would be born
            // expired.
            complete: format!(
                "UPDATE {t} SET status = 'completed', response = $4,
                   expires_at = clock_timestamp() + make_interval(secs => $5::float8 / 1000), updated_at = now(),
                   {}
                 WHERE {completer}",
                log("'completed'")
            )
            .into(),
            complete_bounded: format!(
                "UPDATE {t} SET status = 'completed', response = $4,
                   expires_at = clock_timestamp() + make_interval(secs => $5::float8 / 1000), updated_at = now(),
                   {}
                 FROM {BOUNDED}
                 WHERE {completer} AND bounded.wait IS NOT NULL",
                log("'completed'")
            )
            .into(),
            // Bounded like a claim: a row held in a handler's own transaction makes the batch
            // give up after 100 ms, and its completions go one by one.
            complete_batch: format!(
                "UPDATE {t} AS r SET status = 'completed', response = v.response,
                   expires_at = clock_timestamp() + make_interval(secs => v.ttl_ms::float8 / 1000),
                   updated_at = now(), {}
                 FROM unnest($1::bytea[], $2::bytea[], $3::int8[], $4::bytea[], $5::int8[])
                   WITH ORDINALITY AS v(scope, key, token, response, ttl_ms, n), {BOUNDED}
                 WHERE r.scope = v.scope AND r.key = v.key AND r.lease_token = v.token
                   AND r.status IN ('in_progress', 'completed', 'needs_reconciliation')
                   AND bounded.wait IS NOT NULL
                 RETURNING v.n",
                log("'completed'")
            )
            .into(),
            // Only `mark_uncertain` settles so: the handler answered, so its effect took place.
            settle: format!(
                "UPDATE {t} SET status = $4, effect_started = true, updated_at = now(), {} WHERE {fenced}",
                log("$4")
            )
            .into(),
            release: format!(
                "UPDATE {t} SET status = CASE WHEN effect_started THEN 'needs_reconciliation'
                   ELSE 'released' END, updated_at = now(), {}
                 WHERE {fenced} RETURNING status",
                log("CASE WHEN effect_started THEN 'needs_reconciliation' ELSE 'released' END")
            )
            .into(),
            lookup: format!(
                "SELECT {} FROM {t} r WHERE r.scope = $1 AND r.key = $2 AND NOT {expired_r}",
                cols("r")
            )
            .into(),
            unchanged: unchanged.into(),
            remove: format!("DELETE FROM {t} WHERE scope = $1 AND key = $2").into(),
            purge: format!("DELETE FROM {t} r WHERE {expired_r}").into(),
            effect_started: milestone("effect_started = true", "'effect_started'", "").into(),
            downstream_id: milestone("downstream_id = $4", "'downstream_id'", "").into(),
            effect_started_held: milestone("effect_started = true", "'effect_started'", &held)
                .into(),
            downstream_id_held: milestone("downstream_id = $4", "'downstream_id'", &held).into(),
            list_uncertain: list_first.as_str().into(),
            list_uncertain_after: list_after.as_str().into(),
            list_uncertain_desc: sql::descending(&list_first).into(),
            list_uncertain_after_desc: sql::descending(&list_after).into(),
            count_uncertain: format!(
                "SELECT count(*), {} FROM {t} r WHERE {UNCERTAIN}",
                CURSOR_MICROS.replace("r.updated_at", "min(r.updated_at)")
            )
            .into(),
            resolve: format!(
                "UPDATE {t} r SET status = $4, response = COALESCE($5, r.response), lease_token = $7,
                   effect_started = CASE WHEN $4 = 'completed' THEN r.effect_started ELSE false END,
                   resolution_note = $8,
                   expires_at = CASE WHEN $4 = 'completed'
                     THEN now() + make_interval(secs => $6::float8 / 1000)
                     ELSE GREATEST(r.expires_at, now() + make_interval(secs => $6::float8 / 1000)) END,
                   updated_at = now(),
                   history = {}
                 WHERE r.scope = $1 AND r.key = $2 AND r.lease_token = $3 AND ({UNCERTAIN})",
                sql::appended(
                    "r.history",
                    &entry(
                    "r.attempts",
                    "$7",
                    "CASE WHEN $4 = 'completed' THEN 'reconciled_applied' ELSE 'reconciled_not_applied' END"
                ),
                    HISTORY_LIMIT
                )
            )
            .into(),
            append_history: format!(
                "UPDATE {t} SET {} FROM {BOUNDED}
                 WHERE {t}.scope = $1 AND {t}.key = $2 AND NOT {expired_here}
                   AND bounded.wait IS NOT NULL",
                log_capped("$3", HISTORY_REFUSALS),
                expired_here = expired(&t)
            )
            .into(),
            waited: format!(
                "SELECT waited FROM {t} WHERE scope = $1 AND key = $2
                   AND status = 'in_progress' AND lease_token = $3"
            )
            .into(),
            mark_waited: format!(
                "UPDATE {t} SET waited = true FROM {BOUNDED}
                 WHERE scope = $1 AND key = $2 AND status = 'in_progress'
                   AND lease_token = $3 AND bounded.wait IS NOT NULL"
            )
            .into(),
        }
    }
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

    /// The channel this store's triggers notify and its waiters listen on.
    fn channel(&self) -> String {
        sql::derived_name(
            &format!("{}_{}", self.sql.schema, self.sql.table),
            "_changed",
        )
    }

    /// Waits for a change of `key` (see [`IdempotencyStore::wait_for_change`]): woken by the
    /// triggers' `NOTIFY` through one `LISTEN` connection per store, or at the holder's lease
    /// end; polls while that connection is down.
    async fn wait_changed(&self, key: &ScopedKey, seen: &InFlight, round: u32, within: Duration) {
        if !self.subscribed() {
            super::poll(round, within).await;
            return;
        }
        // Checked once registered, so a change between the claim and now is not missed; and
        // the record marked as waited on, so that its change notifies.
        let moved_on = self.mark_waited(key, seen.token);
        self.changes
            .waiters
            .wait(&change_payload(key), seen, within, moved_on)
            .await;
    }

    /// Whether the record of `key` has moved on from the holder `token`; if not, marks it as
    /// waited on (once: later waiters only read), so its triggers notify when it does. A
    /// record locked by its holder's transaction counts as moved on: the caller claims again,
    /// which answers for it.
    async fn mark_waited(&self, key: &ScopedKey, token: FencingToken) -> bool {
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
    fn subscribed(&self) -> bool {
        use std::sync::atomic::Ordering;
        if !self.changes.started.swap(true, Ordering::SeqCst)
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(listen(
                Arc::downgrade(&self.changes),
                self.pool.clone(),
                self.channel(),
            ));
        }
        self.changes.live.load(Ordering::SeqCst)
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

    /// A batch of claims: one statement. A batch of one (all there is at low load) goes as
    /// today's single statement, which PostgreSQL plans and runs faster than the batch's.
    async fn claim_batch(self, ops: Vec<ClaimOp>) {
        let outcome = match ops.as_slice() {
            [op] => Ok(vec![Some(self.claim_one(&op.request, op.token).await)]),
            _ => self.claim_together(&ops).await,
        };
        self.settle_claims(ops, outcome);
    }

    /// Each claim in the one statement; `None` for a claim whose row it could not see.
    async fn claim_together(
        &self,
        ops: &[ClaimOp],
    ) -> Result<Vec<Option<Result<Claim, StoreError>>>, sqlx::Error> {
        let column = |f: fn(&ClaimOp) -> &[u8]| ops.iter().map(f).collect::<Vec<_>>();
        let rows = sqlx::query(AssertSqlSafe(self.sql.claim_batch.clone()))
            .bind(column(|op| op.request.key.scope().as_bytes()))
            .bind(column(|op| op.request.key.key().as_bytes()))
            .bind(column(|op| op.request.fingerprint.as_bytes().as_slice()))
            .bind(
                ops.iter()
                    .map(|op| sql::token(op.token))
                    .collect::<Vec<_>>(),
            )
            .bind(
                ops.iter()
                    .map(|op| millis(op.request.lease))
                    .collect::<Vec<_>>(),
            )
            .bind(
                ops.iter()
                    .map(|op| op.request.on_lease_expiry == LeaseExpiry::Reclaim)
                    .collect::<Vec<_>>(),
            )
            .bind(
                ops.iter()
                    .map(|op| millis(op.request.ttl))
                    .collect::<Vec<_>>(),
            )
            .fetch_all(&self.pool)
            .await?;
        let mut found: Vec<Option<Result<Claim, StoreError>>> = ops.iter().map(|_| None).collect();
        for row in rows {
            // `n` counts from 1, in the order of `ops`.
            let n: i64 = row.try_get(16)?;
            let Some(i) = usize::try_from(n - 1).ok().filter(|&i| i < ops.len()) else {
                continue;
            };
            // A row that does not read fails its own claim, not the batch's others.
            found[i] = Some(claim_answer(&row, ops[i].token));
        }
        Ok(found)
    }

    /// A batch of completions: one statement, its row locks waited for at most 100 ms. The
    /// completions of a batch that gives up go alone, each on a task of its own with today's
    /// statement (which waits as long as the session allows), holding no batch slot: a row
    /// held elsewhere delays its own completion, never another's.
    async fn complete_batch(self, ops: Vec<CompleteOp>) {
        let outcome = match ops.as_slice() {
            [op] => self.complete_bounded(op).await.map(|done| vec![done]),
            _ => self.complete_together(&ops).await,
        };
        self.settle_completes(ops, outcome);
    }

    /// One completion, waiting at most 100 ms for its row.
    async fn complete_bounded(
        &self,
        op: &CompleteOp,
    ) -> Result<Result<(), StoreError>, sqlx::Error> {
        let rows = self
            .complete_rows(
                &self.pool,
                &self.sql.complete_bounded,
                &op.key,
                op.token,
                &op.response,
                op.ttl,
            )
            .await?;
        Ok(fenced(rows))
    }

    /// The completions in one statement: each not written was fenced off.
    async fn complete_together(
        &self,
        ops: &[CompleteOp],
    ) -> Result<Vec<Result<(), StoreError>>, sqlx::Error> {
        let written: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(self.sql.complete_batch.clone()))
            .bind(
                ops.iter()
                    .map(|op| op.key.scope().as_bytes())
                    .collect::<Vec<_>>(),
            )
            .bind(
                ops.iter()
                    .map(|op| op.key.key().as_bytes())
                    .collect::<Vec<_>>(),
            )
            .bind(
                ops.iter()
                    .map(|op| sql::token(op.token))
                    .collect::<Vec<_>>(),
            )
            .bind(
                ops.iter()
                    .map(|op| op.response.as_slice())
                    .collect::<Vec<_>>(),
            )
            .bind(ops.iter().map(|op| millis(op.ttl)).collect::<Vec<_>>())
            .fetch_all(&self.pool)
            .await?;
        let mut outcomes: Vec<Result<(), StoreError>> =
            ops.iter().map(|_| Err(StoreError::Fenced)).collect();
        for n in written {
            if let Some(outcome) = usize::try_from(n - 1)
                .ok()
                .and_then(|i| outcomes.get_mut(i))
            {
                *outcome = Ok(());
            }
        }
        Ok(outcomes)
    }

    /// A claim whose statement failed with `error`. One that gave up waiting for the row's
    /// lock (queued behind a crowd of duplicates, or a handler's transaction) reads what is
    /// committed: if the claim would leave that record as it is, the read answers it (no lock
    /// needed); otherwise the key is in flight.
    async fn claim_gave_up(
        &self,
        req: &ClaimRequest,
        token: FencingToken,
        error: sqlx::Error,
    ) -> Result<Claim, StoreError> {
        if !lock_not_available(&error) {
            return Err(unavailable(error));
        }
        let row = sqlx::query(AssertSqlSafe(self.sql.unchanged.clone()))
            .bind(req.key.scope().as_bytes())
            .bind(req.key.key().as_bytes())
            .bind(req.fingerprint.as_bytes().as_slice())
            .fetch_optional(&self.pool)
            .await
            .map_err(unavailable)?;
        row.map_or(Err(StoreError::Busy), |row| claim_answer(&row, token))
    }

    async fn claim_one(
        &self,
        req: &ClaimRequest,
        token: FencingToken,
    ) -> Result<Claim, StoreError> {
        // A second attempt only when a concurrent claim committed between our snapshot and
        // our conflict check (a new row, or a change to the one the snapshot holds); a third
        // would mean that happened twice in between.
        for _ in 0..3 {
            let row = match sqlx::query(AssertSqlSafe(self.sql.claim.clone()))
                .bind(req.key.scope().as_bytes())
                .bind(req.key.key().as_bytes())
                .bind(req.fingerprint.as_bytes().as_slice())
                .bind(sql::token(token))
                .bind(millis(req.lease))
                .bind(req.on_lease_expiry == LeaseExpiry::Reclaim)
                .bind(millis(req.ttl))
                .fetch_optional(&self.pool)
                .await
            {
                Ok(row) => row,
                Err(error) => return self.claim_gave_up(req, token, error).await,
            };
            let Some(row) = row else { continue };
            return claim_answer(&row, token);
        }
        Err(StoreError::unavailable(
            "claim kept racing with concurrent deletes",
        ))
    }
}

/// What a claim with `token` answers, from the record row it returned.
fn claim_answer(row: &PgRow, token: FencingToken) -> Result<Claim, StoreError> {
    let (raw, now) = raw(row).map_err(unavailable)?;
    Ok(sql::claim_outcome(raw.into_record()?, now, token))
}

/// Whether a statement gave up waiting for a lock (`lock_timeout`).
fn lock_not_available(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|e| e.code())
        .is_some_and(|code| code == "55P03")
}

/// How often a quiet `LISTEN` is checked: that its store still lives, and that its
/// connection still answers (a link dropped without a close shows only then).
const HEARTBEAT: Duration = Duration::from_secs(2);

/// Keeps a store's `LISTEN` on `channel` up while the store lives (a connection of its own,
/// outside the pool), waking the waiters of each key notified; after a lost connection
/// (notifications may have been missed) every waiter is woken to look again.
async fn listen(changes: std::sync::Weak<Changes>, pool: PgPool, channel: String) {
    use std::sync::atomic::Ordering;
    // Ended for any reason (its runtime shut down), the `LISTEN` is down: the next waiter
    // starts another.
    let _running = Running(changes.clone());
    loop {
        if changes.strong_count() == 0 {
            return;
        }
        if let Ok(mut listener) = sqlx::postgres::PgListener::connect_with(&pool).await
            && listener.listen(&channel).await.is_ok()
        {
            if let Some(c) = changes.upgrade() {
                c.live.store(true, Ordering::SeqCst);
                c.waiters.wake_all();
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
        c.live.store(false, Ordering::SeqCst);
        c.waiters.wake_all();
        drop(c);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Marks a store's `LISTEN` down when its task ends.
struct Running(std::sync::Weak<Changes>);

impl Drop for Running {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering;
        if let Some(c) = self.0.upgrade() {
            c.live.store(false, Ordering::SeqCst);
            c.started.store(false, Ordering::SeqCst);
            c.waiters.wake_all();
        }
    }
}

sql::sql_store!(PostgresStore, sqlx::Postgres, sqlx::PgConnection, PgRow);
