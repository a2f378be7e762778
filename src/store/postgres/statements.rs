//! The SQL a [`PostgresStore`] runs, written once per table.

use std::sync::Arc;

use crate::store::history::{HISTORY_LIMIT, HISTORY_REFUSALS};
use crate::store::sql;

#[derive(Debug)]
pub(super) struct Statements {
    pub(super) schema: String,
    pub(super) table: String,
    pub(super) claim: Arc<str>,
    /// A batch of claims in one statement (arrays of each parameter of `claim`).
    pub(super) claim_batch: Arc<str>,
    pub(super) renew: Arc<str>,
    pub(super) complete: Arc<str>,
    /// A batch of completions in one statement.
    pub(super) complete_batch: Arc<str>,
    /// `complete`, waiting at most 100 ms for the row: a batched store's lone completion.
    pub(super) complete_bounded: Arc<str>,
    pub(super) settle: Arc<str>,
    pub(super) release: Arc<str>,
    pub(super) lookup: Arc<str>,
    /// The record of `$1`/`$2` if a claim with fingerprint `$3` would leave it as it is.
    pub(super) unchanged: Arc<str>,
    pub(super) remove: Arc<str>,
    pub(super) purge: Arc<str>,
    pub(super) effect_started: Arc<str>,
    pub(super) downstream_id: Arc<str>,
    /// `effect_started` that also holds the lease (and the record) ten minutes from when it is
    /// written: a milestone in the caller's transaction, which holds the row from renewals.
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
    /// Whether a waiter's record is still the holder's, and whether it is marked waited on.
    pub(super) waited: Arc<str>,
    /// Marks it waited on.
    pub(super) mark_waited: Arc<str>,
}

/// Whether the record aliased `r` counts as absent: past its TTL, unless its outcome is
/// unknown (one awaiting reconciliation, or whose holder marked its effect started, never
/// expires into a new run; it stays until it is resolved, DESIGN §4).
pub(super) fn expired(r: &str) -> String {
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
pub(super) const BOUNDED: &str =
    "(SELECT set_config('lock_timeout', '100ms', true) AS wait) AS bounded";

/// A record's place in the uncertain listing, in microseconds, exact: `infinity` and
/// `-infinity` written by hand are `i64`'s ends, which [`CURSOR_TIME`] reads back as them. The
/// last three decades of PostgreSQL's range (after 294247-01-10, past `i64` microseconds; only
/// a time written by hand) are placed at its end, one before `infinity`, where a cursor
/// cannot tell them apart from the times before them: a walk oldest first lists such a record
/// again on every page that starts there, up to the walker's bound, and of two such records a
/// walk newest first lists only the latest.
pub(super) const CURSOR_MICROS: &str = "(CASE WHEN r.updated_at = 'infinity' THEN 9223372036854775807 \
    WHEN r.updated_at = '-infinity' THEN -9223372036854775807 - 1 \
    ELSE LEAST(extract(epoch from r.updated_at) * 1000000, 9223372036854775806)::int8 END)";

/// A listing cursor's time (`$2`, microseconds) as the database's, exactly: the place a
/// record's [`CURSOR_MICROS`] gave, or a cursor made by hand (any `i64`). Whole days and
/// microseconds as intervals on a `timestamp` (no time zone: a day is 24 hours), each exact,
/// where microseconds as a float lose precision past the year 2255; bounded to what the type
/// holds in every arm, since a planner may fold the arm not taken.
pub(super) const CURSOR_TIME: &str = "(CASE WHEN $2 = 9223372036854775807 THEN timestamptz 'infinity' \
    WHEN $2 = -9223372036854775807 - 1 THEN timestamptz '-infinity' \
    ELSE (timestamp 'epoch' \
      + (GREATEST(LEAST($2, 9223372036854775806), -210866803200000000) / 86400000000) * interval '1 day' \
      + (GREATEST(LEAST($2, 9223372036854775806), -210866803200000000) % 86400000000) * interval '1 microsecond') \
      AT TIME ZONE 'UTC' END)";

/// Records only a reconciliation can settle once their holder is gone: awaiting it, or in
/// progress with the effect started or on a route that reconciles expired leases. The partial
/// index over them keeps listing and counting them from reading the table.
pub(super) const WATCHED: &str = "r.status = 'needs_reconciliation' \
    OR (r.status = 'in_progress' AND (r.effect_started OR r.reconcile_on_expiry))";
/// Nobody knows the outcome and only a reconciliation can tell: marked so, or a watched
/// record's holder's lease ran out.
pub(super) const UNCERTAIN: &str = "r.status = 'needs_reconciliation' \
    OR (r.status = 'in_progress' AND (r.effect_started OR r.reconcile_on_expiry) \
        AND r.lease_until <= now())";

/// A history entry written on the database's clock (see [`crate::store::HistoryEntry`]).
pub(super) fn entry(attempt: &str, token: &str, event: &str) -> String {
    format!(
        "({attempt})::text || ' ' || ({token})::text || ' ' || \
         (floor(extract(epoch from now()) * 1000)::int8)::text || ' ' || ({event}) || ';'"
    )
}

impl Statements {
    pub(super) fn new(schema: &str, table: &str) -> Self {
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
