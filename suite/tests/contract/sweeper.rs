//! Issue 18 §1–§3, §5: reconciliation that never stalls. One bad record costs one record, every
//! record gets its turn, a record that cannot be read is set aside, purging always runs, and
//! the gauges tell the true count. On every store.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::faulty::Faulty;
use tower_idempotency::reconcile::{Reconciler, Reconciliation, Sweeper};
use tower_idempotency::store::{
    Claim, ClaimRequest, Fingerprint, LeaseExpiry, Record, RecordStatus, ScopedKey, StoredResponse,
    UncertainQuery,
};
use tower_idempotency::{IdempotencyStore, MemoryStore};

/// A SQL store whose rows a test damages from outside, as an operator or a bug would.
trait Damage {
    async fn damage(&self, sql: String);
}

impl Damage for tower_idempotency::store::SqliteStore {
    async fn damage(&self, sql: String) {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(self.pool())
            .await
            .expect("damage");
    }
}

impl Damage for tower_idempotency::store::PostgresStore {
    async fn damage(&self, sql: String) {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(self.pool())
            .await
            .expect("damage");
    }
}

/// A fresh PostgreSQL table: unsettled records never expire, so a table reused across runs
/// would hold earlier runs' records.
async fn fresh_postgres(table: &str) -> Option<tower_idempotency::store::PostgresStore> {
    let pool = common::postgres_pool().await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
        .execute(&pool)
        .await
        .expect("drop");
    common::postgres(table).await
}

macro_rules! on_every_store {
    ($($name:ident => $scenario:ident, $table:literal;)*) => {$(
        mod $name {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_memory() {
                $scenario(MemoryStore::new()).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_sqlite() {
                $scenario(common::sqlite($table).await.0).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_postgres() {
                let Some(store) = fresh_postgres($table).await else {
                    return;
                };
                $scenario(store).await;
            }
        }
    )*};
}

on_every_store! {
    s18_1_one_bad_record_costs_one_record => one_bad_record_costs_one_record, "sweep_isolation";
    s18_1_purging_runs_when_the_listing_fails => purging_runs_when_the_listing_fails, "sweep_purge";
    s18_1_a_spawned_sweeper_survives_a_panicking_pass => spawned_sweeper_survives, "sweep_survives";
    s18_2_stubborn_records_do_not_starve_newer_ones => stubborn_records_do_not_starve, "sweep_fair";
    s18_2_records_a_claim_takes_over_are_not_reconciliation_work => takeovers_are_not_listed, "sweep_takeover";
    s18_5_the_gauge_counts_every_uncertain_record => true_count, "sweep_count";
    s18_5_pages_of_any_size_list_exactly_the_uncertain_records => pages_are_exact, "sweep_pages";
}

const LONG: Duration = Duration::from_secs(60);

fn key(name: &str) -> ScopedKey {
    ScopedKey::new("sweeper", name)
}

fn response(body: &'static str) -> StoredResponse {
    StoredResponse {
        status: http::StatusCode::CREATED,
        headers: http::HeaderMap::new(),
        body: Some(body.into()),
        trailers: None,
    }
}

/// A record awaiting reconciliation for `name`.
async fn uncertain<St: IdempotencyStore>(store: &St, name: &str) -> ScopedKey {
    let key = key(name);
    let claim = store
        .claim(&ClaimRequest {
            key: key.clone(),
            fingerprint: Fingerprint::from_bytes([7; 32]),
            lease: LONG,
            ttl: LONG,
            on_lease_expiry: LeaseExpiry::Reclaim,
        })
        .await
        .expect("claim");
    let Claim::Acquired(lease) = claim else {
        panic!("{name}: a fresh key is acquired, got {claim:?}");
    };
    store
        .mark_uncertain(&key, lease.token)
        .await
        .expect("mark_uncertain");
    key
}

async fn status<St: IdempotencyStore>(store: &St, key: &ScopedKey) -> Option<RecordStatus> {
    store.lookup(key).await.expect("lookup").map(|r| r.status)
}

/// Answers by key: `panic-*` panics, `hang-*` never answers, `unknown-*` cannot tell, the
/// rest happened. Counts what it is asked, per key.
#[derive(Clone, Default)]
struct ByName {
    asked: Arc<std::sync::Mutex<Vec<String>>>,
}

impl Reconciler for ByName {
    async fn reconcile(&self, record: &Record) -> Reconciliation {
        let name = record.key.key().to_owned();
        self.asked.lock().expect("lock").push(name.clone());
        if name.starts_with("panic") {
            panic!("a reconciler bug on {name}");
        }
        if name.starts_with("hang") {
            std::future::pending::<()>().await;
        }
        if name.starts_with("unknown") {
            return Reconciliation::Unknown;
        }
        Reconciliation::Applied(Box::new(response("settled")))
    }
}

impl ByName {
    fn asked(&self) -> Vec<String> {
        self.asked.lock().expect("lock").clone()
    }
}

/// §1: a reconciler that panics on one record and hangs on another costs those two records,
/// counted; the third is settled in the same pass, and the expired records are purged.
async fn one_bad_record_costs_one_record<St: IdempotencyStore + Clone>(store: St) {
    let panics = uncertain(&store, "panic-1").await;
    let hangs = uncertain(&store, "hang-1").await;
    let fine = uncertain(&store, "fine-1").await;
    // An expired, settled record for the purge to find.
    let done = key("done-1");
    let claim = store
        .claim(&ClaimRequest {
            key: done.clone(),
            fingerprint: Fingerprint::from_bytes([1; 32]),
            lease: LONG,
            ttl: Duration::from_millis(1),
            on_lease_expiry: LeaseExpiry::Reclaim,
        })
        .await
        .expect("claim");
    let Claim::Acquired(lease) = claim else {
        panic!("acquired");
    };
    store
        .complete(
            &done,
            lease.token,
            &response("done"),
            Duration::from_millis(1),
        )
        .await
        .expect("complete");
    tokio::time::sleep(Duration::from_millis(20)).await;

    let reconciler = ByName::default();
    let sweeper =
        Sweeper::new(store.clone(), reconciler.clone()).record_timeout(Duration::from_millis(300));
    let report = sweeper.run_once().await.expect("the pass goes on");
    assert_eq!(report.failed, 2, "{report:?}");
    assert_eq!(report.applied, 1, "{report:?}");
    assert!(report.purged >= 1, "the purge ran: {report:?}");
    assert_eq!(status(&store, &fine).await, Some(RecordStatus::Completed));
    for key in [&panics, &hangs] {
        assert_eq!(
            status(&store, key).await,
            Some(RecordStatus::NeedsReconciliation),
            "a failed record stays for the next pass"
        );
    }
    assert_eq!(report.awaiting, 2, "{report:?}");
    assert_eq!(status(&store, &done).await, None, "purged");
}

/// §1: a listing that fails does not stop the purge.
async fn purging_runs_when_the_listing_fails<St: IdempotencyStore + Clone>(store: St) {
    let faulty = Faulty::new(store.clone());
    faulty.fail_list.store(true, Ordering::SeqCst);
    let done = key("purged-anyway");
    let Claim::Acquired(lease) = store
        .claim(&ClaimRequest {
            key: done.clone(),
            fingerprint: Fingerprint::from_bytes([1; 32]),
            lease: LONG,
            ttl: Duration::from_millis(1),
            on_lease_expiry: LeaseExpiry::Reclaim,
        })
        .await
        .expect("claim")
    else {
        panic!("acquired");
    };
    store
        .complete(
            &done,
            lease.token,
            &response("done"),
            Duration::from_millis(1),
        )
        .await
        .expect("complete");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let pass = Sweeper::new(faulty, ByName::default()).run_once().await;
    assert!(pass.is_err(), "the listing's failure is the pass's error");
    assert_eq!(status(&store, &done).await, None, "purged all the same");
}

/// §1: a pass that panics (here in the store) is logged, and the spawned sweeper carries on:
/// its next pass settles the record.
async fn spawned_sweeper_survives<St: IdempotencyStore + Clone>(store: St) {
    let fine = uncertain(&store, "fine-after-a-panic").await;
    let passes = Arc::new(AtomicUsize::new(0));
    let mut faulty = Faulty::new(store.clone());
    let seen = passes.clone();
    faulty.at_step = Some(Arc::new(move |step| {
        if step == "list_uncertain" && seen.fetch_add(1, Ordering::SeqCst) == 0 {
            panic!("a store bug in the first pass");
        }
    }));
    let handle = Sweeper::new(faulty, ByName::default())
        .interval(Duration::from_millis(50))
        .spawn();
    for _ in 0..200 {
        if status(&store, &fine).await == Some(RecordStatus::Completed) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!handle.is_finished(), "the sweeper is still running");
    handle.abort();
    assert!(passes.load(Ordering::SeqCst) >= 2, "a pass after the panic");
    assert_eq!(status(&store, &fine).await, Some(RecordStatus::Completed));
}

/// §2: records the reconciler cannot settle yet do not keep newer ones waiting: with a batch
/// of two, two stubborn records ahead of two settleable ones, the second pass reaches them.
async fn stubborn_records_do_not_starve<St: IdempotencyStore + Clone>(store: St) {
    let stubborn = [
        uncertain(&store, "unknown-a").await,
        uncertain(&store, "unknown-b").await,
    ];
    tokio::time::sleep(Duration::from_millis(5)).await;
    let newer = [
        uncertain(&store, "newer-a").await,
        uncertain(&store, "newer-b").await,
    ];
    let reconciler = ByName::default();
    let sweeper = Sweeper::new(store.clone(), reconciler.clone()).batch(2);
    let first = sweeper.run_once().await.expect("pass");
    assert_eq!(first.unknown, 2, "{first:?}");
    let second = sweeper.run_once().await.expect("pass");
    assert_eq!(
        second.applied, 2,
        "the next page, not the same stubborn one: {second:?}"
    );
    for key in &newer {
        assert_eq!(status(&store, key).await, Some(RecordStatus::Completed));
    }
    // Round again: the stubborn ones come back, asked once per round.
    sweeper.run_once().await.expect("pass");
    let asked = reconciler.asked();
    for key in &stubborn {
        let times = asked.iter().filter(|k| *k == key.key()).count();
        assert_eq!(times, 2, "{} asked once a round: {asked:?}", key.key());
    }
}

/// §2: a dead holder's record that the next claim simply takes over (in progress, lease run
/// out, `Reclaim`, no effect started) is not listed, so it never fills a batch.
async fn takeovers_are_not_listed<St: IdempotencyStore + Clone>(store: St) {
    for i in 0..3 {
        store
            .claim(&ClaimRequest {
                key: key(&format!("crashed-{i}")),
                fingerprint: Fingerprint::from_bytes([1; 32]),
                lease: Duration::from_millis(10),
                ttl: LONG,
                on_lease_expiry: LeaseExpiry::Reclaim,
            })
            .await
            .expect("claim");
    }
    let real = uncertain(&store, "real-work").await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let page = store
        .list_uncertain(&UncertainQuery::first(1))
        .await
        .expect("list");
    let keys: Vec<_> = page.records.iter().map(|r| r.key.clone()).collect();
    assert_eq!(keys, vec![real], "only reconciliation work fills the batch");
    assert_eq!(store.count_uncertain().await.expect("count").count, 1);
}

/// §5: the awaiting gauge is the true count, not the batch size, and the oldest is known.
async fn true_count<St: IdempotencyStore + Clone>(store: St) {
    for i in 0..5 {
        uncertain(&store, &format!("unknown-{i}")).await;
    }
    let sweeper = Sweeper::new(store.clone(), ByName::default()).batch(2);
    let report = sweeper.run_once().await.expect("pass");
    assert_eq!(report.unknown, 2, "one batch asked: {report:?}");
    assert_eq!(
        report.awaiting, 5,
        "every uncertain record counted: {report:?}"
    );
    let count = store.count_uncertain().await.expect("count");
    assert_eq!(count.count, 5);
    assert!(
        count
            .oldest
            .is_some_and(|at| at <= std::time::SystemTime::now())
    );
}

/// §5, differential: 300 records in every state, listed in pages of any size, come out as
/// exactly the uncertain ones, each once, in (last change, key) order: what a plain filter and
/// sort of every record says.
async fn pages_are_exact<St: IdempotencyStore + Clone>(store: St) {
    let mut expected = Vec::new();
    let mut all = Vec::new();
    for i in 0..300usize {
        let key = key(&format!("mixed-{i:03}"));
        let (lease, expiry) = match i % 5 {
            // Dies and is taken over by the next claim: not listed.
            3 => (Duration::from_millis(1), LeaseExpiry::Reclaim),
            // Dies on a reconciling route: listed.
            4 => (Duration::from_millis(1), LeaseExpiry::Reconcile),
            _ => (LONG, LeaseExpiry::Reclaim),
        };
        let claim = store
            .claim(&ClaimRequest {
                key: key.clone(),
                fingerprint: Fingerprint::from_bytes([3; 32]),
                lease,
                ttl: LONG,
                on_lease_expiry: expiry,
            })
            .await
            .expect("claim");
        let Claim::Acquired(lease) = claim else {
            panic!("acquired");
        };
        match i % 5 {
            0 => store.mark_uncertain(&key, lease.token).await.expect("mark"),
            1 => store
                .complete(&key, lease.token, &response("done"), LONG)
                .await
                .expect("complete"),
            // 2: live, in progress; 3 and 4: their holders die.
            _ => {}
        }
        if matches!(i % 5, 0 | 4) {
            expected.push(key.clone());
        }
        all.push(key);
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut reference = Vec::new();
    for key in &expected {
        let record = store.lookup(key).await.expect("lookup").expect("record");
        reference.push((record.updated_at, key.clone()));
    }
    reference.sort();
    let reference: Vec<ScopedKey> = reference.into_iter().map(|(_, key)| key).collect();
    for page in [1, 7, 64, 100, 1000] {
        let mut query = UncertainQuery::first(page);
        let mut listed = Vec::new();
        loop {
            let got = store.list_uncertain(&query).await.expect("list");
            assert!(got.records.len() <= page);
            listed.extend(got.records.into_iter().map(|r| r.key));
            match got.next {
                Some(next) => query = UncertainQuery::after(next, page),
                None => break,
            }
        }
        assert_eq!(listed, reference, "pages of {page}");
    }
    assert_eq!(
        store.count_uncertain().await.expect("count").count,
        expected.len() as u64
    );
}

/// §3: a row that cannot be read is skipped, counted and reported with what is wrong with it;
/// the rest of the page is reconciled and the purge runs. On the SQL stores, where a row can be
/// damaged from outside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s18_3_an_unreadable_record_is_quarantined_not_fatal_on_sqlite() {
    let (store, _path) = common::sqlite("sweep_corrupt").await;
    let damage = |table: &'static str| {
        format!("UPDATE {table} SET fingerprint = x'00' WHERE key = CAST('corrupt' AS BLOB)")
    };
    quarantined(store, damage("idempotency_records")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s18_3_an_unreadable_record_is_quarantined_not_fatal_on_postgres() {
    let Some(store) = fresh_postgres("sweep_corrupt").await else {
        return;
    };
    quarantined(
        store,
        "UPDATE sweep_corrupt SET fingerprint = '\\x00'::bytea WHERE key = 'corrupt'::bytea"
            .to_owned(),
    )
    .await;
}

async fn quarantined<St: IdempotencyStore + Clone + Damage>(store: St, damage: String) {
    let corrupt = uncertain(&store, "corrupt").await;
    let fine = uncertain(&store, "fine").await;
    store.damage(damage).await;
    let page = store
        .list_uncertain(&UncertainQuery::first(10))
        .await
        .expect("a listing with a bad row still lists");
    assert_eq!(page.unreadable.len(), 1, "{page:?}");
    assert_eq!(page.unreadable[0].key, corrupt);
    let error = &page.unreadable[0].error;
    assert!(
        error.contains("fingerprint column") && error.contains("1 bytes"),
        "the error names what is wrong: {error}"
    );
    assert!(!error.contains("stored response"), "{error}");
    let report = Sweeper::new(store.clone(), ByName::default())
        .run_once()
        .await
        .expect("the pass goes on");
    assert_eq!(report.unreadable, 1, "{report:?}");
    assert_eq!(report.applied, 1, "{report:?}");
    assert_eq!(status(&store, &fine).await, Some(RecordStatus::Completed));
    // Kept for an operator: still there, still failing the same way when looked up.
    let lookup = store.lookup(&corrupt).await.expect_err("unreadable");
    assert!(
        lookup.to_string().contains("fingerprint column"),
        "{lookup}"
    );
}

/// §5: the listing is O(page) on the SQL stores: its statement reads the partial index of
/// watched records in order, never the table. Read off the planners, which say which index
/// they use.
#[tokio::test]
async fn s18_5_the_sql_listing_reads_its_index() {
    let (sqlite, _path) = common::sqlite("sweep_plan").await;
    let rows: Vec<(i64, i64, i64, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "EXPLAIN QUERY PLAN {}",
        sqlite.uncertain_statement()
    )))
    .bind(10_i64)
    .bind(0_i64)
    .bind(b"".as_slice())
    .bind(b"".as_slice())
    .fetch_all(sqlite.pool())
    .await
    .expect("plan");
    let detail: Vec<&str> = rows.iter().map(|r| r.3.as_str()).collect();
    assert!(
        detail
            .iter()
            .any(|d| d.contains("idempotency_records_watched")),
        "SQLite reads the watched index: {detail:?}"
    );
    assert!(
        !detail.iter().any(|d| d.contains("TEMP B-TREE")),
        "in the index's order, unsorted: {detail:?}"
    );

    let Some(store) = fresh_postgres("sweep_plan").await else {
        return;
    };
    let mut tx = store.pool().begin().await.expect("tx");
    // A planner on an empty table may prefer to read it whole; the point is that the index
    // can serve the listing, so the table is taken off the menu.
    sqlx::query("SET LOCAL enable_seqscan = off")
        .execute(&mut *tx)
        .await
        .expect("set");
    let lines: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "EXPLAIN {}",
        store.uncertain_statement()
    )))
    .bind(10_i64)
    .bind(0_i64)
    .bind(b"".as_slice())
    .bind(b"".as_slice())
    .fetch_all(&mut *tx)
    .await
    .expect("plan");
    let plan = lines.join("\n");
    assert!(
        plan.contains("sweep_plan_watched"),
        "PostgreSQL reads the watched index:\n{plan}"
    );
    assert!(!plan.contains("Sort"), "in the index's order:\n{plan}");
}

/// A reconciler that panics in the call itself, before its future exists (review finding):
/// caught like any other panic, one record's cost.
struct PanicsBeforeItsFuture;

impl Reconciler for PanicsBeforeItsFuture {
    #[allow(clippy::manual_async_fn)]
    fn reconcile(
        &self,
        record: &Record,
    ) -> impl std::future::Future<Output = Reconciliation> + Send {
        assert!(
            !record.key.key().starts_with("sync-panic"),
            "a reconciler bug before any await"
        );
        async { Reconciliation::Applied(Box::new(response("settled"))) }
    }
}

#[tokio::test]
async fn s18_1_a_reconciler_panicking_before_its_future_costs_one_record() {
    let store = MemoryStore::new();
    let bad = uncertain(&store, "sync-panic").await;
    let good = uncertain(&store, "fine-too").await;
    let report = Sweeper::new(store.clone(), PanicsBeforeItsFuture)
        .run_once()
        .await
        .expect("the pass goes on");
    assert_eq!((report.failed, report.applied), (1, 1), "{report:?}");
    assert_eq!(status(&store, &good).await, Some(RecordStatus::Completed));
    assert_eq!(
        status(&store, &bad).await,
        Some(RecordStatus::NeedsReconciliation)
    );
}

/// Review findings on the SQL stores: a time written as `infinity`, and a key that is not
/// UTF-8, neither fail the listing nor hold its cursor: a batch of one still reaches every
/// record in a few passes.
async fn damaged_rows_do_not_hold_the_cursor<St>(store: St, damage: Vec<String>)
where
    St: IdempotencyStore + Clone + Damage,
{
    uncertain(&store, "kx").await;
    uncertain(&store, "forever").await;
    let last = uncertain(&store, "z").await;
    for sql in damage {
        store.damage(sql).await;
    }
    let sweeper = Sweeper::new(store.clone(), ByName::default()).batch(1);
    for _ in 0..6 {
        sweeper.run_once().await.expect("every pass works");
    }
    assert_eq!(
        status(&store, &last).await,
        Some(RecordStatus::Completed),
        "the record after the damaged ones is reached"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s18_3_damaged_rows_do_not_hold_the_cursor_on_postgres() {
    let Some(store) = fresh_postgres("sweep_damaged").await else {
        return;
    };
    damaged_rows_do_not_hold_the_cursor(
        store,
        vec![
            "UPDATE sweep_damaged SET key = '\\x6bff'::bytea WHERE key = 'kx'::bytea".to_owned(),
            "UPDATE sweep_damaged SET expires_at = 'infinity', updated_at = '-infinity' \
             WHERE key = 'forever'::bytea"
                .to_owned(),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s18_3_damaged_rows_do_not_hold_the_cursor_on_sqlite() {
    let (store, _path) = common::sqlite("sweep_damaged").await;
    damaged_rows_do_not_hold_the_cursor(
        store,
        vec![
            "UPDATE idempotency_records SET key = x'6bff' WHERE key = CAST('kx' AS BLOB)"
                .to_owned(),
            "UPDATE idempotency_records SET updated_at = 'yesterday' \
             WHERE key = CAST('forever' AS BLOB)"
                .to_owned(),
        ],
    )
    .await;
}

/// Review finding: processes migrating one SQLite file made by the previous release at once
/// take turns; none fails on a locked database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s18_sqlite_migrations_of_an_old_table_at_once_all_succeed() {
    use tower_idempotency::store::SqliteStore;
    let path = common::sqlite_path("old-schema");
    let url = format!("sqlite://{}", path.display());
    let first = SqliteStore::connect(&url).await.expect("open");
    // The table as the previous release made it: no reconcile_on_expiry, no resolution_note.
    sqlx::query(
        "CREATE TABLE idempotency_records (
           scope BLOB NOT NULL, key BLOB NOT NULL, fingerprint BLOB NOT NULL,
           status TEXT NOT NULL, lease_token INTEGER NOT NULL, lease_until INTEGER NOT NULL,
           attempts INTEGER NOT NULL, effect_started INTEGER NOT NULL DEFAULT 0,
           downstream_id TEXT, response BLOB, created_at INTEGER NOT NULL,
           updated_at INTEGER NOT NULL, expires_at INTEGER NOT NULL,
           history TEXT NOT NULL DEFAULT '', PRIMARY KEY (scope, key)) WITHOUT ROWID",
    )
    .execute(first.pool())
    .await
    .expect("old table");
    let mut stores = vec![first];
    for _ in 0..2 {
        stores.push(SqliteStore::connect(&url).await.expect("open"));
    }
    let (a, b, c) = tokio::join!(
        stores[0].migrate(),
        stores[1].migrate(),
        stores[2].migrate()
    );
    for (i, migrated) in [a, b, c].into_iter().enumerate() {
        migrated.unwrap_or_else(|e| panic!("migration {i}: {e}"));
    }
    stores[0].check().await.expect("migrated");
}

/// §5, differential: MemoryStore keeps an index of what awaits reconciliation beside its
/// records, updated by every write. Random operations (claims under both policies and both
/// fingerprints, marks, milestones, releases, completions, resolutions, removals, purges, time
/// passing on a frozen clock) and, after each, the paged listing and the count must equal a
/// plain filter of every record, in (last change, key) order.
#[tokio::test]
async fn s18_5_the_memory_index_agrees_with_a_plain_filter_under_random_writes() {
    use std::collections::HashMap;
    use std::sync::atomic::AtomicU64;
    use tower_idempotency::store::{FencingToken, Milestone, Resolution};

    let offset = Arc::new(AtomicU64::new(0));
    let base = std::time::SystemTime::now();
    let clock = offset.clone();
    let store =
        MemoryStore::with_clock(move || base + Duration::from_millis(clock.load(Ordering::SeqCst)));
    let now = || base + Duration::from_millis(offset.load(Ordering::SeqCst));
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let keys: Vec<ScopedKey> = (0..12).map(|i| key(&format!("rand-{i:02}"))).collect();
    // What the model knows that a record does not show: the policy of the claim that holds it.
    let mut reconciles: HashMap<ScopedKey, bool> = HashMap::new();
    let mut tokens: HashMap<ScopedKey, FencingToken> = HashMap::new();
    for step in 0..600 {
        let k = &keys[next(keys.len() as u64) as usize];
        match next(10) {
            0 | 1 => {
                let policy = if next(2) == 0 {
                    LeaseExpiry::Reclaim
                } else {
                    LeaseExpiry::Reconcile
                };
                let claim = store
                    .claim(&ClaimRequest {
                        key: k.clone(),
                        fingerprint: Fingerprint::from_bytes([next(2) as u8; 32]),
                        lease: Duration::from_millis(if next(2) == 0 { 5 } else { 5_000 }),
                        ttl: Duration::from_millis(50),
                        on_lease_expiry: policy,
                    })
                    .await
                    .expect("claim");
                if let Claim::Acquired(lease) = claim {
                    reconciles.insert(k.clone(), policy == LeaseExpiry::Reconcile);
                    tokens.insert(k.clone(), lease.token);
                }
            }
            2 => {
                offset.fetch_add(next(20), Ordering::SeqCst);
            }
            3 => {
                let _ = store.purge_expired().await;
            }
            4 if next(4) == 0 => {
                let _ = store.remove(k).await;
            }
            op => {
                let Some(&token) = tokens.get(k) else {
                    continue;
                };
                let _ = match op {
                    4 | 5 => store.mark_uncertain(k, token).await,
                    6 => {
                        store
                            .record_milestone(k, token, &Milestone::EffectStarted)
                            .await
                    }
                    7 => store.release(k, token).await.map(drop),
                    8 => {
                        store
                            .complete(k, token, &response("done"), Duration::from_millis(50))
                            .await
                    }
                    _ => {
                        let current = store
                            .lookup(k)
                            .await
                            .expect("lookup")
                            .map(|r| r.lease_token);
                        let resolution = if next(2) == 0 {
                            Resolution::NotApplied
                        } else {
                            Resolution::Applied(Box::new(response("settled")))
                        };
                        store
                            .resolve(
                                k,
                                current.unwrap_or(token),
                                &resolution,
                                Duration::from_millis(50),
                                None,
                            )
                            .await
                    }
                };
            }
        }
        // The plain filter, over every record.
        let mut expected = Vec::new();
        for k in &keys {
            let Some(r) = store.lookup(k).await.expect("lookup") else {
                continue;
            };
            let dead = r.lease_until <= now();
            let watched = r.effect_started || reconciles.get(k).copied().unwrap_or(false);
            let uncertain = r.status == RecordStatus::NeedsReconciliation
                || (r.status == RecordStatus::InProgress && dead && watched);
            if uncertain {
                expected.push((r.updated_at, k.clone()));
            }
        }
        expected.sort();
        let expected: Vec<ScopedKey> = expected.into_iter().map(|(_, k)| k).collect();
        let page = 1 + next(4) as usize;
        let mut query = UncertainQuery::first(page);
        let mut listed = Vec::new();
        loop {
            let got = store.list_uncertain(&query).await.expect("list");
            listed.extend(got.records.into_iter().map(|r| r.key));
            match got.next {
                Some(cursor) => query = UncertainQuery::after(cursor, page),
                None => break,
            }
        }
        assert_eq!(listed, expected, "step {step}, pages of {page}");
        let count = store.count_uncertain().await.expect("count").count;
        assert_eq!(count, expected.len() as u64, "step {step}");
    }
}

/// §2 (every record gets its turn): a page whose records were all settled while it was read
/// comes back empty but names the page after it; the sweeper goes on from there, as from any
/// page, and does not take it for the end of the listing (which would start the round over and
/// ask the first records again before the rest had their turn).
#[tokio::test]
async fn s18_2_an_emptied_page_that_goes_on_does_not_end_the_round() {
    let store = Faulty::new(MemoryStore::new());
    let mut keys = Vec::new();
    for i in 0..4 {
        keys.push(uncertain(&store, &format!("unknown-{i}")).await);
        // Apart in time, so the listing's order is the order of marking.
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    let reconciler = ByName::default();
    let sweeper = Sweeper::new(store.clone(), reconciler.clone()).batch(1);
    sweeper.run_once().await.expect("first pass");
    assert_eq!(reconciler.asked(), ["unknown-0"]);
    // The next page's record is settled while it is read (the wrapper leaves it uncertain:
    // it is the next round's).
    store.settle_next_resumed_page.store(true, Ordering::SeqCst);
    sweeper.run_once().await.expect("the emptied page");
    assert!(
        !store.settle_next_resumed_page.load(Ordering::SeqCst),
        "the pass resumed after a cursor"
    );
    sweeper.run_once().await.expect("third pass");
    sweeper.run_once().await.expect("fourth pass");
    assert_eq!(
        reconciler.asked(),
        ["unknown-0", "unknown-2", "unknown-3"],
        "the round goes on past the emptied page; nothing is asked twice in it"
    );
    // The round then ends, the next one starts over at once, and the record left out of the
    // emptied page has its turn.
    sweeper.run_once().await.expect("the next round");
    sweeper.run_once().await.expect("its second page");
    assert_eq!(
        reconciler.asked()[3..],
        ["unknown-0", "unknown-1"],
        "the next round, from the first record"
    );
    for k in &keys {
        assert_eq!(
            status(&store, k).await,
            Some(RecordStatus::NeedsReconciliation),
            "an unknown outcome stays for reconciliation"
        );
    }
}
