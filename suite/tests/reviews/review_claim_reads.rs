//! Review of 198f889 (PostgresStore: a claim that changes nothing reads its record; one that
//! gave up waiting answers from what is committed). Attacks: the new statement against the
//! old one (derived from the new text by removing the `NOT EXISTS` guard and restoring the old
//! `ON CONFLICT .. WHERE`), every record state, single and batched, in one transaction so
//! `now()` is the same for both; held rows in every state; an uncommitted insert; races
//! across several pools; fencing after takeovers.

use crate::common;

use common::batching::{
    LONG, acquire, alone_or_batched, answer, claim, claim_with, hold_row, unique,
};

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, Column, Row, TypeInfo};
use tower_idempotency::IdempotencyStore;
use tower_idempotency::store::{
    Batching, Claim, Fingerprint, LeaseExpiry, PostgresStore, RecordStatus, ScopedKey, StoreError,
};

const TABLE: &str = "tower_idempotency_review_claim_reads";

/// The old code's `EXPIRED`, with the record alias `r`.
const EXPIRED: &str = "(r.expires_at <= now() AND (r.status IN ('completed', 'released') \
    OR (r.status = 'in_progress' AND NOT r.effect_started AND NOT r.reconcile_on_expiry)))";

/// The upsert as it was before 198f889: the new text without its `NOT EXISTS` guard, and
/// with the conflict's `WHERE` written as the old code wrote it (the fallback read keeps its
/// later filter, which only matters under concurrency).
fn old_statement(new: &str) -> String {
    let guard = "AND NOT EXISTS (SELECT 1 FROM \"";
    let start = new.find(guard).expect("the new guard");
    assert_eq!(new.matches(guard).count(), 1, "one guard");
    let open = start + "AND NOT EXISTS ".len();
    let mut depth = 0;
    let mut end = None;
    for (i, c) in new[open..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    end = Some(open + i + 1);
                    break;
                }
            }
            _ => {}
        }
    }
    let end = end.expect("the guard closes");
    let without = format!("{}{}", &new[..start], &new[end..]);
    let new_where = format!(
        "WHERE ({EXPIRED} OR (r.fingerprint = excluded.fingerprint AND (r.status = 'released' \
         OR (r.status = 'in_progress' AND r.lease_until <= now()))))"
    );
    let old_where = format!(
        "WHERE {EXPIRED} OR (r.fingerprint = excluded.fingerprint AND (r.status = 'released' \
         OR (r.status = 'in_progress' AND r.lease_until <= now())))"
    );
    assert_eq!(
        without.matches(&new_where).count(),
        1,
        "the new conflict WHERE:\n{without}"
    );
    let old = without.replace(&new_where, &old_where);
    assert!(!old.contains(" held"), "no guard left:\n{old}");
    old
}

/// A returned row, column by column, as text.
fn row_text(row: &PgRow) -> Vec<String> {
    row.columns()
        .iter()
        .enumerate()
        .map(|(i, col)| match col.type_info().name() {
            "BYTEA" => format!("{:?}", row.try_get::<Option<Vec<u8>>, _>(i).expect("bytea")),
            "INT8" => format!("{:?}", row.try_get::<Option<i64>, _>(i).expect("int8")),
            "INT4" => format!("{:?}", row.try_get::<Option<i32>, _>(i).expect("int4")),
            "BOOL" => format!("{:?}", row.try_get::<Option<bool>, _>(i).expect("bool")),
            "TEXT" => format!("{:?}", row.try_get::<Option<String>, _>(i).expect("text")),
            other => panic!("column {} of type {other}", col.name()),
        })
        .collect()
}

/// One record state to seed by hand.
#[derive(Clone, Copy, Debug)]
struct State {
    status: &'static str,
    /// Lease end, ms from now() (0: exactly now).
    lease_ms: i64,
    /// Expiry, ms from now() (0: exactly now).
    expires_ms: i64,
    effect_started: bool,
    reconcile_on_expiry: bool,
}

fn all_states() -> Vec<Option<State>> {
    let mut out = vec![None];
    for status in [
        "in_progress",
        "completed",
        "released",
        "needs_reconciliation",
    ] {
        for lease_ms in [60_000, 0, -1_000] {
            for expires_ms in [3_600_000, 0, -1_000] {
                for effect_started in [false, true] {
                    for reconcile_on_expiry in [false, true] {
                        out.push(Some(State {
                            status,
                            lease_ms,
                            expires_ms,
                            effect_started,
                            reconcile_on_expiry,
                        }));
                    }
                }
            }
        }
    }
    out
}

const SEED_FP: [u8; 32] = [7; 32];

async fn seed(conn: &mut sqlx::PgConnection, key: &ScopedKey, state: State) {
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {TABLE} (scope, key, fingerprint, status, lease_token, lease_until, attempts, \
         effect_started, downstream_id, response, created_at, updated_at, expires_at, history, \
         reconcile_on_expiry) VALUES ($1, $2, $3, $4, 5, now() + $5 * interval '1 millisecond', \
         2, $6, 'ds', '\\x0102'::bytea, now() - interval '1 hour', now() - interval '1 hour', \
         now() + $7 * interval '1 millisecond', '1 4 1000 claimed;2 5 2000 claimed;', $8)"
    )))
    .bind(key.scope().as_bytes())
    .bind(key.key().as_bytes())
    .bind(SEED_FP.as_slice())
    .bind(state.status)
    .bind(state.lease_ms as f64)
    .bind(state.effect_started)
    .bind(state.expires_ms as f64)
    .bind(state.reconcile_on_expiry)
    .execute(&mut *conn)
    .await
    .expect("seed a record");
}

async fn dump(conn: &mut sqlx::PgConnection, scope: &str) -> Vec<String> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT r::text FROM {TABLE} r WHERE scope = $1 ORDER BY key"
    )))
    .bind(scope.as_bytes())
    .fetch_all(&mut *conn)
    .await
    .expect("dump")
}

/// Runs `statement` for one claim on `conn`: its rows as text.
async fn run_single(
    conn: &mut sqlx::PgConnection,
    statement: &str,
    key: &ScopedKey,
    fp: [u8; 32],
    reclaim: bool,
) -> Vec<Vec<String>> {
    let rows = sqlx::query(AssertSqlSafe(statement.to_owned()))
        .bind(key.scope().as_bytes())
        .bind(key.key().as_bytes())
        .bind(fp.as_slice())
        .bind(424242_i64)
        .bind(30_000_i64)
        .bind(reclaim)
        .bind(90_000_i64)
        .fetch_all(&mut *conn)
        .await
        .expect("the claim statement");
    rows.iter().map(row_text).collect()
}

/// Differential, single statement: for every record state (and none), fingerprint and route,
/// the new statement returns the same rows and leaves the same table as the old one, with the
/// same `now()` (both in one transaction, the old one rolled back to a savepoint).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_new_claim_statement_matches_the_old_one_in_every_state() {
    let Some(store) = common::postgres(TABLE).await else {
        return;
    };
    let new = store.claim_statement().to_owned();
    let old = old_statement(&new);
    assert_ne!(old, new);
    let run = unique("diff-single");
    let mut conn = store.pool().acquire().await.expect("conn");
    let mut cases = 0;
    let mut changed = 0;
    for (n, state) in all_states().into_iter().enumerate() {
        for fp in [SEED_FP, [9; 32]] {
            for reclaim in [true, false] {
                let key = ScopedKey::new(run.clone(), format!("k{n}-{}-{reclaim}", fp[0]));
                let tag = format!("{state:?} fp {} reclaim {reclaim}", fp[0]);
                sqlx::query("BEGIN")
                    .execute(&mut *conn)
                    .await
                    .expect("begin");
                if let Some(state) = state {
                    seed(&mut conn, &key, state).await;
                }
                let before = dump(&mut conn, &run).await;
                sqlx::query("SAVEPOINT a")
                    .execute(&mut *conn)
                    .await
                    .expect("sp");
                let old_rows = run_single(&mut conn, &old, &key, fp, reclaim).await;
                let old_table = dump(&mut conn, &run).await;
                sqlx::query("ROLLBACK TO SAVEPOINT a")
                    .execute(&mut *conn)
                    .await
                    .expect("rollback to");
                let new_rows = run_single(&mut conn, &new, &key, fp, reclaim).await;
                let new_table = dump(&mut conn, &run).await;
                sqlx::query("ROLLBACK")
                    .execute(&mut *conn)
                    .await
                    .expect("rollback");
                assert_eq!(new_rows, old_rows, "{tag}: returned rows");
                assert_eq!(new_table, old_table, "{tag}: the table after");
                assert_eq!(new_rows.len(), 1, "{tag}: one row answers");
                cases += 1;
                if new_table != before {
                    changed += 1;
                }
            }
        }
    }
    // The sweep covered both kinds: claims that wrote and claims that only read.
    assert!(changed > 0 && changed < cases, "{changed} of {cases} wrote");
}

/// Differential, batched statement: every state (each its own key, both fingerprints, both
/// routes) in ONE batch, old statement against new, same `now()`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_new_batch_statement_matches_the_old_one_with_every_state_in_one_batch() {
    let Some(store) = common::postgres(TABLE).await else {
        return;
    };
    let new = store.claim_batch_statement().to_owned();
    let old = old_statement(&new);
    let run = unique("diff-batch");
    let mut conn = store.pool().acquire().await.expect("conn");
    sqlx::query("BEGIN")
        .execute(&mut *conn)
        .await
        .expect("begin");
    let (mut scopes, mut keys, mut fps, mut tokens, mut leases, mut reclaims, mut ttls) =
        (vec![], vec![], vec![], vec![], vec![], vec![], vec![]);
    let mut n = 0i64;
    for (s, state) in all_states().into_iter().enumerate() {
        for fp in [SEED_FP, [9; 32]] {
            for reclaim in [true, false] {
                let key = ScopedKey::new(run.clone(), format!("k{s:04}-{}-{reclaim}", fp[0]));
                if let Some(state) = state {
                    seed(&mut conn, &key, state).await;
                }
                n += 1;
                scopes.push(key.scope().as_bytes().to_vec());
                keys.push(key.key().as_bytes().to_vec());
                fps.push(fp.to_vec());
                tokens.push(1_000_000 + n);
                leases.push(30_000_i64);
                reclaims.push(reclaim);
                ttls.push(90_000_i64);
            }
        }
    }
    // The batcher sends in arrival order; reverse it so the rows' lock order (by key) differs.
    for v in [&mut scopes, &mut keys, &mut fps] {
        v.reverse();
    }
    tokens.reverse();
    reclaims.reverse();
    let mut results = Vec::new();
    for statement in [&old, &new] {
        sqlx::query("SAVEPOINT a")
            .execute(&mut *conn)
            .await
            .expect("sp");
        let rows = sqlx::query(AssertSqlSafe(statement.clone()))
            .bind(&scopes)
            .bind(&keys)
            .bind(&fps)
            .bind(&tokens)
            .bind(&leases)
            .bind(&reclaims)
            .bind(&ttls)
            .fetch_all(&mut *conn)
            .await
            .expect("the batch statement");
        let mut rows: Vec<Vec<String>> = rows.iter().map(row_text).collect();
        rows.sort_by_key(|r| r.last().cloned());
        let table = dump(&mut conn, &run).await;
        sqlx::query("ROLLBACK TO SAVEPOINT a")
            .execute(&mut *conn)
            .await
            .expect("rollback to");
        results.push((rows, table));
    }
    sqlx::query("ROLLBACK")
        .execute(&mut *conn)
        .await
        .expect("rollback");
    let (old_rows, old_table) = &results[0];
    let (new_rows, new_table) = &results[1];
    assert_eq!(old_rows.len(), n as usize, "old: one row per claim");
    assert_eq!(new_rows.len(), n as usize, "new: one row per claim");
    for (o, nw) in old_rows.iter().zip(new_rows) {
        assert_eq!(nw, o, "batched claim answered differently");
    }
    assert_eq!(new_table, old_table, "the table after the batch");
}

/// Whether a claim (`same` fingerprint) changes a record, as the brief's predicate says.
fn changes(status: RecordStatus, lapsed: bool, expired: bool, same: bool) -> bool {
    let expired = expired
        && matches!(
            status,
            RecordStatus::Completed | RecordStatus::Released | RecordStatus::InProgress
        );
    expired
        || (same
            && (status == RecordStatus::Released || (status == RecordStatus::InProgress && lapsed)))
}

/// A summary of a claim's answer that does not depend on the clock.
fn summary(c: &Result<Claim, StoreError>) -> String {
    match c {
        Ok(Claim::Acquired(lease)) => format!("acquired attempt {}", lease.attempt),
        Ok(Claim::Completed {
            fingerprint,
            response,
        }) => format!("completed {fingerprint:?} {:?}", response.body),
        Ok(Claim::Existing { record, .. }) => format!(
            "existing {:?} token {} attempts {} fp {:?} history {:?}",
            record.status,
            record.lease_token.get(),
            record.attempts,
            record.fingerprint,
            record
                .history
                .iter()
                .map(|h| format!("{:?}/{}/{}", h.event, h.attempt, h.token.get()))
                .collect::<Vec<_>>()
        ),
        Err(e) => format!("error {e:?}"),
    }
}

/// Builds a record of `status` for `key` through the store, then sets its lease and expiry.
async fn build(
    store: &PostgresStore,
    key: &ScopedKey,
    status: RecordStatus,
    lapsed: bool,
    expired: bool,
) {
    let token = acquire(store, key).await;
    match status {
        RecordStatus::Completed => {
            store
                .complete(key, token, &answer(key), LONG)
                .await
                .expect("complete");
        }
        RecordStatus::Released => {
            store.release(key, token).await.expect("release");
        }
        RecordStatus::NeedsReconciliation => {
            sqlx::query(AssertSqlSafe(format!(
                "UPDATE {TABLE} SET status = 'needs_reconciliation' WHERE scope = $1 AND key = $2"
            )))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .execute(store.pool())
            .await
            .expect("needs reconciliation");
        }
        _ => {}
    }
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {TABLE} SET lease_until = now() + CASE WHEN $3 THEN interval '-5 seconds' \
         ELSE interval '1 minute' END, expires_at = now() + CASE WHEN $4 THEN interval '-5 seconds' \
         ELSE interval '1 hour' END WHERE scope = $1 AND key = $2"
    )))
    .bind(key.scope().as_bytes())
    .bind(key.key().as_bytes())
    .bind(lapsed)
    .bind(expired)
    .execute(store.pool())
    .await
    .expect("set the times");
}

async fn row_version(store: &PostgresStore, key: &ScopedKey) -> Option<String> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT r::text FROM {TABLE} r WHERE scope = $1 AND key = $2"
    )))
    .bind(key.scope().as_bytes())
    .bind(key.key().as_bytes())
    .fetch_optional(store.pool())
    .await
    .expect("row")
}

/// Every state with its row held by another transaction (lock_timeout path): a claim that
/// would change the record answers Busy and writes nothing; one that would not answers at
/// once what the same claim answers once the row is free (a read), alone and batched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_held_rows_in_every_state_answer_like_free_ones_or_busy() {
    let Some(plain) = common::postgres(TABLE).await else {
        return;
    };
    let batched = plain.clone().with_batching(Batching::default());
    let run = unique("held-states");
    let mut n = 0;
    for status in [
        RecordStatus::InProgress,
        RecordStatus::Completed,
        RecordStatus::Released,
        RecordStatus::NeedsReconciliation,
    ] {
        for lapsed in [false, true] {
            for expired in [false, true] {
                for same in [true, false] {
                    for reclaim in [true, false] {
                        for use_batch in [false, true] {
                            n += 1;
                            let key = ScopedKey::new(run.clone(), format!("k{n}"));
                            build(&plain, &key, status, lapsed, expired).await;
                            let tag = format!(
                                "{status:?} lapsed {lapsed} expired {expired} same {same} \
                                 reclaim {reclaim} batched {use_batch}"
                            );
                            let mut req = claim_with(
                                &key,
                                LONG,
                                LONG,
                                if reclaim {
                                    LeaseExpiry::Reclaim
                                } else {
                                    LeaseExpiry::Reconcile
                                },
                            );
                            if !same {
                                req.fingerprint = Fingerprint::from_bytes([9; 32]);
                            }
                            let before = row_version(&plain, &key).await;
                            let mut tx = plain.pool().begin().await.expect("begin");
                            hold_row(&mut tx, TABLE, &key).await;
                            let held = if use_batch {
                                batched.claim(&req).await
                            } else {
                                plain.claim(&req).await
                            };
                            tx.rollback().await.expect("let go");
                            let after_held = row_version(&plain, &key).await;
                            assert_eq!(after_held, before, "{tag}: nothing written while held");
                            if changes(status, lapsed, expired, same) {
                                assert!(
                                    matches!(held, Err(StoreError::Busy)),
                                    "{tag}: a claim that changes the record waits, then \
                                     answers in flight; got {}",
                                    summary(&held)
                                );
                                // Free: it changes the record now.
                                let free = plain.claim(&req).await;
                                assert!(free.is_ok(), "{tag}: free claim {}", summary(&free));
                                assert_ne!(
                                    row_version(&plain, &key).await,
                                    before,
                                    "{tag}: the free claim writes"
                                );
                            } else {
                                let free = plain.claim(&req).await;
                                assert_eq!(
                                    summary(&held),
                                    summary(&free),
                                    "{tag}: held and free answer alike"
                                );
                                assert!(held.is_ok(), "{tag}: {}", summary(&held));
                                assert_eq!(
                                    row_version(&plain, &key).await,
                                    before,
                                    "{tag}: a read writes nothing"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// A row being inserted by another, uncommitted transaction: the claim waits (bounded), then
/// answers Busy, never an error; after a commit it reads that record; after a rollback it
/// acquires the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_a_claim_behind_an_uncommitted_insert() {
    let Some(plain) = common::postgres(TABLE).await else {
        return;
    };
    let batched = plain.clone().with_batching(Batching::default());
    for (i, (status, lease, commit)) in [
        ("in_progress", "1 minute", true),
        ("in_progress", "1 minute", false),
        ("released", "1 minute", true),
        ("in_progress", "-1 minute", true),
    ]
    .into_iter()
    .enumerate()
    {
        for use_batch in [false, true] {
            let key = ScopedKey::new(unique("uncommitted"), format!("k{i}"));
            let tag = format!("{status} lease {lease} commit {commit} batched {use_batch}");
            let mut tx = plain.pool().begin().await.expect("begin");
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {TABLE} (scope, key, fingerprint, status, lease_token, lease_until, \
                 attempts, created_at, updated_at, expires_at) VALUES ($1, $2, $3, $4, 77, \
                 now() + interval '{lease}', 1, now(), now(), now() + interval '1 hour')"
            )))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind([7u8; 32].as_slice())
            .bind(status)
            .execute(&mut *tx)
            .await
            .expect("insert, uncommitted");
            let req = claim(&key);
            let held = if use_batch {
                batched.claim(&req).await
            } else {
                plain.claim(&req).await
            };
            assert!(
                matches!(held, Err(StoreError::Busy)),
                "{tag}: behind an uncommitted insert, got {}",
                summary(&held)
            );
            if commit {
                tx.commit().await.expect("commit");
            } else {
                tx.rollback().await.expect("rollback");
            }
            let after = plain.claim(&req).await;
            match (status, lease, commit) {
                (_, _, false) => assert!(
                    matches!(after, Ok(Claim::Acquired(ref l)) if l.attempt == 1),
                    "{tag}: {}",
                    summary(&after)
                ),
                ("in_progress", "1 minute", true) => assert!(
                    matches!(&after, Ok(Claim::Existing { record, .. })
                        if record.lease_token.get() == 77),
                    "{tag}: {}",
                    summary(&after)
                ),
                _ => assert!(
                    matches!(after, Ok(Claim::Acquired(ref l)) if l.attempt == 2),
                    "{tag}: taken over, {}",
                    summary(&after)
                ),
            }
        }
    }
}

/// A claim waiting on an uncommitted insert whose transaction commits while it waits: it
/// answers the committed record (never an error, never a second winner).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_a_claim_behind_an_insert_that_commits_while_it_waits() {
    let Some(plain) = common::postgres(TABLE).await else {
        return;
    };
    for use_batch in [false, true] {
        let store = alone_or_batched(&plain, use_batch);
        let key = ScopedKey::new(unique("commits-mid-wait"), "k");
        let mut tx = plain.pool().begin().await.expect("begin");
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {TABLE} (scope, key, fingerprint, status, lease_token, lease_until, \
             attempts, created_at, updated_at, expires_at) VALUES ($1, $2, $3, 'in_progress', 77, \
             now() + interval '1 minute', 1, now(), now(), now() + interval '1 hour')"
        )))
        .bind(key.scope().as_bytes())
        .bind(key.key().as_bytes())
        .bind([7u8; 32].as_slice())
        .execute(&mut *tx)
        .await
        .expect("insert");
        let task = {
            let (store, req) = (store.clone(), claim(&key));
            tokio::spawn(async move { store.claim(&req).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        tx.commit().await.expect("commit");
        let got = task.await.expect("task");
        match &got {
            Ok(Claim::Existing { record, .. }) => {
                assert_eq!(record.lease_token.get(), 77, "batched {use_batch}")
            }
            // The commit may have come after the bounded wait.
            Err(StoreError::Busy) => {}
            other => panic!("batched {use_batch}: {}", summary(other)),
        }
    }
}

/// Three stores on [`TABLE`], each on its own pool of `connections`; the one at `batched`
/// batches.
async fn three_pools(connections: u32, batched: usize) -> Vec<Arc<PostgresStore>> {
    let mut stores = Vec::new();
    for i in 0..3 {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(connections)
            .connect(&common::postgres_url())
            .await
            .expect("pool");
        let store = PostgresStore::new(pool).with_table(TABLE).expect("table");
        stores.push(Arc::new(match i == batched {
            true => store.with_batching(Batching::default()),
            false => store,
        }));
    }
    stores
}

/// Several pools, many claims on one key, per starting state: exactly one Acquired (with the
/// right attempt), the others in flight on the winner or Busy, never another error, never a
/// stale Completed; a lapsed lease on a reconciling route is sent to reconciliation exactly
/// once, with one `lease_expired` entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_races_across_pools_have_one_winner_in_every_starting_state() {
    let Some(plain) = common::postgres(TABLE).await else {
        return;
    };
    let stores = three_pools(12, 2).await;
    for round in 0..6 {
        for start in [
            "fresh",
            "expired",
            "released",
            "lapsed-reclaim",
            "lapsed-reconcile",
        ] {
            let key = ScopedKey::new(unique("race"), format!("{start}-{round}"));
            let reconcile = start == "lapsed-reconcile";
            let mut old_token = None;
            if start != "fresh" {
                let req = claim_with(
                    &key,
                    LONG,
                    LONG,
                    if reconcile {
                        LeaseExpiry::Reconcile
                    } else {
                        LeaseExpiry::Reclaim
                    },
                );
                let token = common::batching::acquired(&plain, &req).await;
                old_token = Some(token);
                match start {
                    "expired" => {
                        plain
                            .complete(&key, token, &answer(&key), LONG)
                            .await
                            .expect("complete");
                        sqlx::query(AssertSqlSafe(format!(
                            "UPDATE {TABLE} SET expires_at = now() - interval '1 second' \
                             WHERE scope = $1 AND key = $2"
                        )))
                        .bind(key.scope().as_bytes())
                        .bind(key.key().as_bytes())
                        .execute(plain.pool())
                        .await
                        .expect("expire");
                    }
                    "released" => {
                        plain.release(&key, token).await.expect("release");
                    }
                    _ => {
                        sqlx::query(AssertSqlSafe(format!(
                            "UPDATE {TABLE} SET lease_until = now() - interval '1 second' \
                             WHERE scope = $1 AND key = $2"
                        )))
                        .bind(key.scope().as_bytes())
                        .bind(key.key().as_bytes())
                        .execute(plain.pool())
                        .await
                        .expect("lapse");
                    }
                }
            }
            let n = 24;
            let barrier = Arc::new(tokio::sync::Barrier::new(n));
            let tasks: Vec<_> = (0..n)
                .map(|i| {
                    let store = stores[i % stores.len()].clone();
                    let barrier = barrier.clone();
                    let req = claim_with(
                        &key,
                        LONG,
                        LONG,
                        if reconcile {
                            LeaseExpiry::Reconcile
                        } else {
                            LeaseExpiry::Reclaim
                        },
                    );
                    tokio::spawn(async move {
                        barrier.wait().await;
                        store.claim(&req).await
                    })
                })
                .collect();
            let mut answers = Vec::new();
            for t in tasks {
                answers.push(t.await.expect("task"));
            }
            let tag = format!("{start} round {round}");
            let record = plain.lookup(&key).await.expect("lookup").expect("record");
            let winners: Vec<_> = answers
                .iter()
                .filter_map(|a| match a {
                    Ok(Claim::Acquired(l)) => Some(*l),
                    _ => None,
                })
                .collect();
            for a in &answers {
                match a {
                    Ok(Claim::Acquired(_)) | Err(StoreError::Busy) => {}
                    Ok(Claim::Existing { record: r, .. }) => {
                        assert!(
                            matches!(
                                r.status,
                                RecordStatus::InProgress
                                    | RecordStatus::NeedsReconciliation
                                    | RecordStatus::Released
                            ),
                            "{tag}: {}",
                            summary(a)
                        );
                    }
                    other => panic!("{tag}: unexpected answer {}", summary(other)),
                }
            }
            if reconcile {
                assert!(
                    winners.is_empty(),
                    "{tag}: nobody takes a reconciling key over"
                );
                assert_eq!(record.status, RecordStatus::NeedsReconciliation, "{tag}");
                let expired_entries = record
                    .history
                    .iter()
                    .filter(|h| format!("{:?}", h.event).to_lowercase().contains("expired"))
                    .count();
                assert_eq!(
                    expired_entries, 1,
                    "{tag}: one lease_expired entry: {:?}",
                    record.history
                );
                assert_eq!(record.lease_token, old_token.expect("token"), "{tag}");
            } else {
                assert_eq!(
                    winners.len(),
                    1,
                    "{tag}: one winner: {:?}",
                    answers.iter().map(summary).collect::<Vec<_>>()
                );
                let w = &winners[0];
                assert_eq!(
                    record.lease_token, w.token,
                    "{tag}: the record is the winner's"
                );
                assert_eq!(record.status, RecordStatus::InProgress, "{tag}");
                let expected_attempt = match start {
                    "fresh" | "expired" => 1,
                    _ => 2,
                };
                assert_eq!(w.attempt, expected_attempt, "{tag}");
                assert_eq!(record.attempts, expected_attempt, "{tag}");
                if let Some(old) = old_token {
                    // Fencing: the old holder can no longer complete.
                    let done = plain.complete(&key, old, &answer(&key), LONG).await;
                    assert!(
                        matches!(done, Err(StoreError::Fenced)),
                        "{tag}: the old holder is fenced off, got {done:?}"
                    );
                }
                plain
                    .complete(&key, w.token, &answer(&key), LONG)
                    .await
                    .expect("the winner completes");
                // A replay now reads the completion.
                let again = plain.claim(&claim(&key)).await;
                assert!(
                    matches!(again, Ok(Claim::Completed { .. })),
                    "{tag}: replay {}",
                    summary(&again)
                );
            }
        }
    }
}

/// A race in which the key is released (or expires) by its holder in the middle: at most one
/// Acquired per state the key passed through, every winner holds a distinct token, the final
/// record is the last winner's, only Busy as error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_races_with_the_key_released_or_expiring_mid_race() {
    let Some(plain) = common::postgres(TABLE).await else {
        return;
    };
    let stores = three_pools(10, 1).await;
    for round in 0..8 {
        let expire = round % 2 == 1;
        let key = ScopedKey::new(unique("midrace"), format!("k{round}"));
        let holder = acquire(&plain, &key).await;
        if expire {
            plain
                .complete(&key, holder, &answer(&key), LONG)
                .await
                .expect("complete");
        }
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut tasks = Vec::new();
        for i in 0..12 {
            let store = stores[i % stores.len()].clone();
            let key = key.clone();
            let stop = stop.clone();
            tasks.push(tokio::spawn(async move {
                let mut answers = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    answers.push(store.claim(&claim(&key)).await);
                    tokio::task::yield_now().await;
                }
                answers
            }));
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
        if expire {
            sqlx::query(AssertSqlSafe(format!(
                "UPDATE {TABLE} SET expires_at = now() WHERE scope = $1 AND key = $2"
            )))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .execute(plain.pool())
            .await
            .expect("expire mid-race");
        } else {
            plain.release(&key, holder).await.expect("release mid-race");
        }
        tokio::time::sleep(Duration::from_millis(60)).await;
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut answers = Vec::new();
        for t in tasks {
            answers.extend(t.await.expect("task"));
        }
        let tag = format!("round {round} expire {expire}");
        let winners: Vec<_> = answers
            .iter()
            .filter_map(|a| match a {
                Ok(Claim::Acquired(l)) => Some(l.token),
                _ => None,
            })
            .collect();
        for a in &answers {
            assert!(
                matches!(
                    a,
                    Ok(Claim::Acquired(_))
                        | Ok(Claim::Existing { .. })
                        | Ok(Claim::Completed { .. })
                        | Err(StoreError::Busy)
                ),
                "{tag}: {}",
                summary(a)
            );
        }
        assert_eq!(
            winners.len(),
            1,
            "{tag}: exactly one claim takes the key over (its lease is long)"
        );
        let record = plain.lookup(&key).await.expect("lookup").expect("record");
        assert_eq!(record.lease_token, winners[0], "{tag}");
        assert_eq!(record.status, RecordStatus::InProgress, "{tag}");
        let done = plain.complete(&key, holder, &answer(&key), LONG).await;
        assert!(
            matches!(done, Err(StoreError::Fenced)),
            "{tag}: the first holder is fenced off, got {done:?}"
        );
    }
}

/// An expired completed record counts as absent. A claim whose snapshot saw it expired queues
/// on the row behind a transaction that takes the key over (as the winner of a race does) and
/// commits within the claim's bounded wait: the conflict's WHERE is false on the new version.
/// The statement's fallback read, from its own snapshot, would give the EXPIRED completed
/// record (a replay of an expired response while another request runs the key afresh: what
/// the statement did before this review). It answers only a record the claim leaves as it is,
/// so the claim goes again and answers the key in flight under the new holder. Alone and
/// batched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_a_claim_queued_behind_a_takeover_of_an_expired_record_does_not_replay_it() {
    let Some(plain) = common::postgres(TABLE).await else {
        return;
    };
    for batched in [false, true] {
        let store = alone_or_batched(&plain, batched);
        let key = ScopedKey::new(unique("stale-replay"), "k");
        let token = acquire(&plain, &key).await;
        plain
            .complete(&key, token, &answer(&key), LONG)
            .await
            .expect("complete");
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {TABLE} SET expires_at = now() - interval '1 second' \
             WHERE scope = $1 AND key = $2"
        )))
        .bind(key.scope().as_bytes())
        .bind(key.key().as_bytes())
        .execute(plain.pool())
        .await
        .expect("expire");
        // The winner's takeover, uncommitted, holding the row.
        let mut tx = plain.pool().begin().await.expect("begin");
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {TABLE} SET status = 'in_progress', lease_token = 999, attempts = 1, \
             response = NULL, lease_until = now() + interval '1 minute', \
             expires_at = now() + interval '1 hour' WHERE scope = $1 AND key = $2"
        )))
        .bind(key.scope().as_bytes())
        .bind(key.key().as_bytes())
        .execute(&mut *tx)
        .await
        .expect("take over");
        let task = {
            let (store, req) = (store.clone(), claim(&key));
            tokio::spawn(async move { store.claim(&req).await })
        };
        // An ordering aid: the claim queues on the row before the takeover commits.
        tokio::time::sleep(Duration::from_millis(30)).await;
        tx.commit().await.expect("commit the takeover");
        match task.await.expect("task") {
            Ok(Claim::Existing { record, .. }) => {
                assert_eq!(record.status, RecordStatus::InProgress, "batched {batched}");
                assert_eq!(record.lease_token.get(), 999, "batched {batched}");
            }
            other => panic!(
                "batched {batched}: the key is in flight under the winner, never the expired \
                 replay: {}",
                summary(&other)
            ),
        }
    }
}
