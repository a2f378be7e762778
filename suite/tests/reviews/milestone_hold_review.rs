//! Review of 71aa6f6: `record_milestone_in` in the handler's own transaction also holds the
//! lease ten minutes from then (`held_in`), and a renewal that found a lease more than five
//! minutes past its own length brought it back to a lease from now (`sql::renewed`). Three
//! tests failed on it: the renewal rule shortened a long lease a shorter renewal met (dropped:
//! renewals never shorten a lease again), and PostgreSQL's `now()` in a handler's transaction
//! is when it began, so the hold ran from then and a `complete_in` in a long transaction was
//! born expired (both now from `clock_timestamp()`).
//!
//! Effects are counted at the sink: a table the handler inserts into in its own transaction
//! (what committed), never responses. Store-level tests check store state. Each PostgreSQL
//! test has a table of its own and pools named after it; it never locks another session's rows.

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use sqlx::AssertSqlSafe;
use sqlx::postgres::PgPool;
use tower_idempotency::store::{
    Batching, Milestone, Resolution, ScopedKey, SqliteStore, UncertainQuery,
};
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, IdempotencyStore, LeaseExpiry};

use common::batching::{acquired, answer as stored_answer, claim_with};
use common::pg_rig::{self, store as pg_store};
use common::{client, guard};

fn unique(name: &str) -> String {
    common::raw::unique(name)
}

/// A table name of its own for one test run.
fn table(name: &str) -> String {
    pg_rig::table("rv_mh", name)
}

async fn pool(app: &str, max: u32) -> PgPool {
    pg_rig::pool(app, max, &[]).await
}

/// The sink on PostgreSQL: a table of effects, one row per run that committed.
async fn pg_sink(pool: &PgPool, table: &str) -> String {
    let sink = format!("{table}_fx");
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE \"{sink}\" (key text NOT NULL, attempt int8 NOT NULL)"
    )))
    .execute(pool)
    .await
    .expect("sink table");
    sink
}

async fn pg_effects(pool: &PgPool, sink: &str, key: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{sink}\" WHERE key = $1"
    )))
    .bind(key)
    .fetch_one(pool)
    .await
    .expect("count effects")
}

async fn post_key(addr: SocketAddr, key: &str) -> Result<reqwest::Response, reqwest::Error> {
    client()
        .post(format!("http://{addr}/op"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(r#"{"amount":10}"#)
        .send()
        .await
}

/// Status and problem type (empty for a non-problem answer); `(0, error)` for no answer.
async fn answer(res: Result<reqwest::Response, reqwest::Error>) -> (u16, String) {
    let res = match res {
        Ok(res) => res,
        Err(e) => return (0, format!("no answer: {e}")),
    };
    let status = res.status().as_u16();
    let problem = res
        .headers()
        .get("content-type")
        .is_some_and(|v| v == "application/problem+json");
    let body = res.text().await.unwrap_or_default();
    let kind = if problem {
        serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["type"].as_str().map(str::to_owned))
            .unwrap_or_else(|| "<unreadable problem>".to_owned())
    } else {
        String::new()
    };
    (status, kind)
}

/// Retries of `key` from `n` tasks, each posting again 10 ms after its answer, until `stop`.
fn retry_storm(
    addr: SocketAddr,
    key: String,
    n: usize,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Vec<(u16, String)>>> {
    (0..n)
        .map(|i| {
            let (key, stop) = (key.clone(), stop.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(5 * i as u64)).await;
                let mut seen = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    seen.push(answer(post_key(addr, &key).await).await);
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                seen
            })
        })
        .collect()
}

async fn join_storm(
    tasks: Vec<tokio::task::JoinHandle<Vec<(u16, String)>>>,
) -> std::collections::BTreeMap<String, usize> {
    let mut kinds = std::collections::BTreeMap::new();
    for t in tasks {
        for (s, kind) in guard("a retry", t).await.expect("retry task") {
            *kinds.entry(format!("{s} {kind}")).or_default() += 1;
        }
    }
    kinds
}

// ---- 1. A renewal asking for a shorter lease ---------------------------------------------------

/// `IdempotencyStore::renew`'s contract ("never shortening it"; `store::kit`'s
/// `renew_keeps_the_lease_alive`: "a shorter renewal keeps the longer end"), which DESIGN §4's
/// "the holder keeps its lease" rests on. Fault: a record claimed with a 20-minute lease (a route
/// with a long lease), then renewed under its own token with a 30 s lease, as the trait allows
/// (renewals of one lease may differ in length, overlap and land out of order). Expected on
/// every store: the lease's end does not move back. MemoryStore is the control.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_shorter_renewal_never_shortens_a_long_lease_on_any_store() {
    let long = Duration::from_secs(20 * 60);
    let short = Duration::from_secs(30);
    let mut report = Vec::new();
    macro_rules! check {
        ($store:expr, $name:literal) => {{
            let store = $store;
            let key = ScopedKey::new(unique($name), "k");
            let req = claim_with(&key, long, Duration::from_secs(3600), LeaseExpiry::Reclaim);
            let token = acquired(&store, &req).await;
            let before = store.lookup(&key).await.expect("lookup").expect("a record");
            let until = store.renew(&key, token, short).await.expect("renew");
            let after = store.lookup(&key).await.expect("lookup").expect("a record");
            let moved_back = before
                .lease_until
                .duration_since(after.lease_until)
                .unwrap_or_default();
            let returned_back = before.lease_until.duration_since(until).unwrap_or_default();
            report.push(($name, moved_back, returned_back));
        }};
    }
    check!(tower_idempotency::MemoryStore::new(), "memory");
    let (sqlite, _path) = common::sqlite("mh-shorter").await;
    check!(sqlite, "sqlite");
    if common::postgres_pool().await.is_some() {
        let pg = pg_store(pool(&unique("mh-shorter"), 4).await, &table("shorter")).await;
        check!(pg, "postgres");
    }
    let bad: Vec<_> = report
        .iter()
        .filter(|(_, moved, returned)| {
            *moved > Duration::from_secs(1) || *returned > Duration::from_secs(1)
        })
        .collect();
    assert!(
        bad.is_empty(),
        "a renewal under the holder's own token moved a live lease's end back (store, how far \
         the record's lease_until moved back, how far the returned end is before it): {bad:?}"
    );
}

// ---- 2. Ten minutes from when the milestone is written -----------------------------------------

/// README's fault table ("a milestone written in the handler's own transaction ... holds the
/// lease for ten minutes from then") and `record_milestone_in`'s doc ("holds it for ten minutes
/// from now"); DESIGN §4 (the holder keeps its lease while it lives). Fault: the handler's
/// transaction begins, does 3 s of work (its business writes, a downstream call) and only then
/// records its milestone. Expected on both SQL stores: the lease (and `expires_at`) run at least
/// ten minutes from when the milestone was written, not from when the transaction began: a
/// transaction opened T before its milestone would otherwise hold the key only 10 min − T past
/// it, and one opened ten minutes before holds nothing (its commit, past the lease, is taken
/// over on a `Reclaim` route while its handler runs on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_milestone_holds_ten_minutes_from_when_it_is_written_not_from_begin() {
    let lease = Duration::from_secs(2);
    let ten = Duration::from_secs(600);
    let mut report = Vec::new();
    macro_rules! check {
        ($store:expr, $name:literal) => {{
            let store = $store;
            let key = ScopedKey::new(unique($name), "k");
            let req = claim_with(&key, lease, Duration::from_secs(60), LeaseExpiry::Reclaim);
            let token = acquired(&store, &req).await;
            let mut tx = store.pool().begin().await.expect("begin");
            // The transaction is under way: a first statement, then its slow work.
            sqlx::query("SELECT 1")
                .execute(&mut *tx)
                .await
                .expect("a first statement");
            tokio::time::sleep(Duration::from_secs(3)).await;
            let written = SystemTime::now();
            store
                .record_milestone_in(&mut tx, &key, token, &Milestone::DownstreamId("d".into()))
                .await
                .expect("milestone");
            tx.commit().await.expect("commit");
            let record = store.lookup(&key).await.expect("lookup").expect("a record");
            let short_by = (written + ten)
                .duration_since(record.lease_until)
                .unwrap_or_default();
            let expiry_short_by = (written + ten)
                .duration_since(record.expires_at)
                .unwrap_or_default();
            report.push(($name, short_by, expiry_short_by));
        }};
    }
    let (sqlite, _path) = common::sqlite("mh-from-then").await;
    let postgres = match common::postgres_pool().await {
        Some(_) => Some(pg_store(pool(&unique("mh-from-then"), 4).await, &table("fromthen")).await),
        None => None,
    };
    check!(sqlite, "sqlite");
    if let Some(postgres) = postgres {
        check!(postgres, "postgres");
    }
    let bad: Vec<_> = report
        .iter()
        .filter(|(_, lease, expiry)| {
            *lease > Duration::from_millis(800) || *expiry > Duration::from_millis(800)
        })
        .collect();
    assert!(
        bad.is_empty(),
        "a milestone written 3 s into its transaction held the lease less than ten minutes \
         from when it was written (store, lease_until short by, expires_at short by): {bad:?}"
    );
}

// ---- 3. A milestone rolled back holds nothing ---------------------------------------------------

/// README's fault table (the milestone's hold commits or rolls back with the handler's
/// transaction) and DESIGN §4 (a dead holder's lease is taken over). Fault: the handler's
/// transaction records its milestone and then rolls back (its business write failed). Expected
/// on both SQL stores: the record's lease is back to the claim's (at most a lease from now), and
/// no milestone is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_milestone_rolled_back_with_its_transaction_holds_nothing() {
    let lease = Duration::from_secs(2);
    let mut report = Vec::new();
    macro_rules! check {
        ($store:expr, $name:literal) => {{
            let store = $store;
            let key = ScopedKey::new(unique($name), "k");
            let req = claim_with(&key, lease, Duration::from_secs(60), LeaseExpiry::Reclaim);
            let token = acquired(&store, &req).await;
            let claimed = store.lookup(&key).await.expect("lookup").expect("a record");
            let mut tx = store.pool().begin().await.expect("begin");
            store
                .record_milestone_in(&mut tx, &key, token, &Milestone::EffectStarted)
                .await
                .expect("milestone");
            tx.rollback().await.expect("rollback");
            let record = store.lookup(&key).await.expect("lookup").expect("a record");
            report.push((
                $name,
                record.lease_until == claimed.lease_until,
                record.expires_at == claimed.expires_at,
                record.effect_started,
            ));
        }};
    }
    let (sqlite, _path) = common::sqlite("mh-rolled-back").await;
    check!(sqlite, "sqlite");
    if common::postgres_pool().await.is_some() {
        let pg = pg_store(pool(&unique("mh-rolled"), 4).await, &table("rolled")).await;
        check!(pg, "postgres");
    }
    assert!(
        report
            .iter()
            .all(|(_, lease, expiry, started)| *lease && *expiry && !*started),
        "a rolled-back milestone left something behind (store, lease unchanged, expiry \
         unchanged, effect_started): {report:?}"
    );
}

// ---- 4/5. PostgreSQL: complete_in after the milestone, in one transaction past the lease -------

/// One PostgreSQL key: the handler inserts its effect, records its downstream id
/// (`record_milestone_in`), works 1.5 s (past the 600 ms lease), records its outcome with
/// `complete_in` (the route's TTL) in the same transaction, commits, then works on 700 ms before
/// answering (its answer is the first request's). 3 tasks retry the key from when the handler
/// starts until the first request is answered. Committed effects and the retries' answers.
async fn complete_in_past_the_lease(
    name: &str,
    ttl: Duration,
    batched: bool,
) -> Option<(
    i64,
    (u16, String),
    std::collections::BTreeMap<String, usize>,
)> {
    common::postgres_pool().await?;
    let app = unique(&format!("mh-{name}"));
    let t = table(name);
    let pool = pool(&app, 4).await;
    let sink = pg_sink(&pool, &t).await;
    let store = pg_store(pool.clone(), &t).await;
    let store = if batched {
        store.with_batching(Batching::default())
    } else {
        store
    };
    let layer = IdempotencyLayer::new(store.clone())
        .single_tenant()
        .lease(Duration::from_millis(600))
        .on_lease_expiry(LeaseExpiry::Reclaim)
        .defaults(move |route| route.ttl(ttl));
    let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel::<()>();
    let sink_in = sink.clone();
    let router = Router::new().route(
        "/op",
        post(move |ctx: IdempotencyContext| {
            let (s, sink, started_tx) = (store.clone(), sink_in.clone(), started_tx.clone());
            async move {
                let mut tx = s.pool().begin().await.expect("begin");
                sqlx::query(AssertSqlSafe(format!(
                    "INSERT INTO \"{sink}\" (key, attempt) VALUES ($1, $2)"
                )))
                .bind(ctx.key())
                .bind(i64::from(ctx.attempt()))
                .execute(&mut *tx)
                .await
                .expect("the effect");
                if s.record_milestone_in(
                    &mut tx,
                    ctx.scoped_key(),
                    ctx.fencing_token(),
                    &Milestone::DownstreamId(format!("dl-{}", ctx.attempt())),
                )
                .await
                .is_err()
                {
                    return (StatusCode::SERVICE_UNAVAILABLE, "no milestone".to_owned());
                }
                let _ = started_tx.send(());
                tokio::time::sleep(Duration::from_millis(1_500)).await;
                let body = stored_answer(ctx.scoped_key());
                if s.complete_in(&mut tx, ctx.scoped_key(), ctx.fencing_token(), &body, ttl)
                    .await
                    .is_err()
                {
                    return (StatusCode::SERVICE_UNAVAILABLE, "not recorded".to_owned());
                }
                if tx.commit().await.is_err() {
                    return (StatusCode::SERVICE_UNAVAILABLE, "not committed".to_owned());
                }
                tokio::time::sleep(Duration::from_millis(700)).await;
                (StatusCode::CREATED, "done".to_owned())
            }
        })
        .layer(layer),
    );
    let addr = common::serve(router).await;
    let key = unique(name);
    let k = key.clone();
    let first = tokio::spawn(async move { answer(post_key(addr, &k).await).await });
    guard("the handler starts", started.recv()).await;
    let stop = Arc::new(AtomicBool::new(false));
    let storm = retry_storm(addr, key.clone(), 3, stop.clone());
    let first = guard("the first request", first).await.expect("first");
    stop.store(true, Ordering::SeqCst);
    // Every retry's request answered: any run a retry started has committed by now.
    let kinds = join_storm(storm).await;
    let effects = pg_effects(&pool, &sink, &key).await;
    Some((effects, first, kinds))
}

/// DESIGN §1 (completed, same fingerprint: replayed; only "completed but expired (past TTL)"
/// is new), §2 (a completed record lives until `expires_at`, TTL) and `complete_in`'s
/// contract ("lives for `ttl` from now"), with README's fault table (a handler's own
/// transaction holding the row past the lease, the pattern `record_milestone_in` now holds the
/// lease for). Fault: on PostgreSQL the handler writes its milestone and then its outcome
/// (`complete_in`, TTL 1 s, the route's) in one transaction held 1.5 s, and answers 700 ms
/// after its commit; retries keep coming meanwhile. Expected: one committed effect: a retry
/// within the TTL of the commit finds the outcome and never runs the key again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_pg_complete_in_after_a_milestone_in_a_long_transaction_is_not_born_expired() {
    let Some((effects, first, kinds)) =
        complete_in_past_the_lease("bornexp", Duration::from_secs(1), false).await
    else {
        return;
    };
    assert_eq!(
        effects, 1,
        "the key ran again while its first request was still being answered, within a TTL of \
         its commit: first {first:?}; retries {kinds:?}"
    );
}

/// README's fault table (a handler's own PostgreSQL transaction on the record's row past the
/// lease, a milestone written with its effect; batched stores wait at most 100 ms for a held
/// row) and DESIGN §4. Fault: a batched store (`with_batching`) on a pool of 4; the handler
/// writes its milestone and its outcome (`complete_in`, default-like TTL of an hour) in one
/// transaction held 1.5 s under a 600 ms lease; 3 tasks retry. Expected: one committed effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_pg_batched_complete_in_after_a_milestone_past_the_lease_runs_once() {
    let Some((effects, first, kinds)) =
        complete_in_past_the_lease("batched", Duration::from_secs(3600), true).await
    else {
        return;
    };
    assert_eq!(
        effects, 1,
        "a live handler's key ran twice: first {first:?}; retries {kinds:?}"
    );
    assert_eq!(first.0, 201, "the first request's own answer: {first:?}");
}

// ---- 6. SQLite: the write lock taken before the milestone ---------------------------------------

/// DESIGN §4 ("The holder keeps its lease for as long as its process lives") and README's
/// fault table ("`record_milestone_in`, on SQLite too"). Fault: on SQLite the handler's own
/// transaction takes the write lock with its business insert *before* its milestone (the
/// documented order: effect, then milestone), works 1.6 s past a 600 ms lease (`Reclaim`)
/// holding it, records its downstream id, commits; 6 tasks retry the key on a second replica
/// (another store and layer on the same file). Expected: one committed effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_sqlite_write_lock_taken_before_the_milestone_never_runs_the_key_twice() {
    let (store, path) = common::sqlite("mh-before").await;
    sqlx::query("CREATE TABLE effects (key TEXT NOT NULL, attempt INTEGER NOT NULL)")
        .execute(store.pool())
        .await
        .expect("sink table");
    let other = SqliteStore::connect(&format!("sqlite://{}", path.display()))
        .await
        .expect("a second store on the file");
    let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel::<()>();
    let route = |store: SqliteStore, started_tx: tokio::sync::mpsc::UnboundedSender<()>| {
        let layer = IdempotencyLayer::new(store.clone())
            .single_tenant()
            .lease(Duration::from_millis(600))
            .on_lease_expiry(LeaseExpiry::Reclaim);
        Router::new().route(
            "/op",
            post(move |ctx: IdempotencyContext| {
                let (s, started_tx) = (store.clone(), started_tx.clone());
                async move {
                    let Ok(mut tx) = s.pool().begin().await else {
                        return (StatusCode::SERVICE_UNAVAILABLE, "no tx".to_owned());
                    };
                    if sqlx::query("INSERT INTO effects (key, attempt) VALUES (?1, ?2)")
                        .bind(ctx.key().to_owned())
                        .bind(i64::from(ctx.attempt()))
                        .execute(&mut *tx)
                        .await
                        .is_err()
                    {
                        return (StatusCode::SERVICE_UNAVAILABLE, "no effect".to_owned());
                    }
                    let _ = started_tx.send(());
                    tokio::time::sleep(Duration::from_millis(1_600)).await;
                    if s.record_milestone_in(
                        &mut tx,
                        ctx.scoped_key(),
                        ctx.fencing_token(),
                        &Milestone::DownstreamId(format!("dl-{}", ctx.attempt())),
                    )
                    .await
                    .is_err()
                    {
                        return (StatusCode::SERVICE_UNAVAILABLE, "no milestone".to_owned());
                    }
                    if tx.commit().await.is_err() {
                        return (StatusCode::SERVICE_UNAVAILABLE, "not committed".to_owned());
                    }
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    (StatusCode::CREATED, "done".to_owned())
                }
            })
            .layer(layer),
        )
    };
    let addr = common::serve(route(store.clone(), started_tx.clone())).await;
    let retries = common::serve(route(other, started_tx)).await;
    let key = unique("sqlite-before");
    let k = key.clone();
    let first = tokio::spawn(async move { answer(post_key(addr, &k).await).await });
    guard("the handler starts", started.recv()).await;
    let stop = Arc::new(AtomicBool::new(false));
    let storm = retry_storm(retries, key.clone(), 6, stop.clone());
    let first = guard("the first request", first).await.expect("first");
    // Past every run a takeover could have started.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    stop.store(true, Ordering::SeqCst);
    let kinds = join_storm(storm).await;
    // Let any run a late retry started commit.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects WHERE key = ?1")
        .bind(&key)
        .fetch_one(store.pool())
        .await
        .expect("count");
    assert_eq!(
        effects, 1,
        "a live handler's key ran twice after its transaction held SQLite's write lock from \
         its business write, past the lease, to its milestone: first {first:?}; retries {kinds:?}"
    );
}

// ---- 7. PostgreSQL: a reconciler meets a live holder's held row ---------------------------------

/// DESIGN §4 (a `Reconciler` settles stale records; "A resolved outcome is final"; the holder
/// keeps its lease while it lives) and README's fault table (a handler's own transaction on the
/// record's row past the lease). Fault: a `Reconcile` route; the handler inserts its effect and
/// records `EffectStarted` in its own transaction, held 2 s under a 600 ms lease. Meanwhile a
/// reconciler pages `list_uncertain` every 50 ms (on a store of its own, as a sweeper on another
/// replica), looks the effect up downstream (not visible: uncommitted) and resolves whatever it
/// lists as not applied; retries keep coming. Expected: one committed effect, the record ends
/// completed (never released for a second run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_pg_a_reconciler_never_releases_a_live_holders_row_held_past_the_lease() {
    if common::postgres_pool().await.is_none() {
        return;
    }
    let app = unique("mh-reconciler");
    let t = table("reconciler");
    let pool_main = pool(&app, 6).await;
    let sink = pg_sink(&pool_main, &t).await;
    let store = pg_store(pool_main.clone(), &t).await;
    let sweeper = pg_store(pool(&format!("{app}-sweeper"), 4).await, &t).await;
    let layer = IdempotencyLayer::new(store.clone())
        .single_tenant()
        .lease(Duration::from_millis(600))
        .on_lease_expiry(LeaseExpiry::Reconcile);
    let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel::<ScopedKey>();
    let sink_in = sink.clone();
    let router = Router::new().route(
        "/op",
        post(move |ctx: IdempotencyContext| {
            let (s, sink, started_tx) = (store.clone(), sink_in.clone(), started_tx.clone());
            async move {
                let mut tx = s.pool().begin().await.expect("begin");
                sqlx::query(AssertSqlSafe(format!(
                    "INSERT INTO \"{sink}\" (key, attempt) VALUES ($1, $2)"
                )))
                .bind(ctx.key())
                .bind(i64::from(ctx.attempt()))
                .execute(&mut *tx)
                .await
                .expect("the effect");
                if s.record_milestone_in(
                    &mut tx,
                    ctx.scoped_key(),
                    ctx.fencing_token(),
                    &Milestone::EffectStarted,
                )
                .await
                .is_err()
                {
                    return (StatusCode::SERVICE_UNAVAILABLE, "no milestone".to_owned());
                }
                let _ = started_tx.send(ctx.scoped_key().clone());
                tokio::time::sleep(Duration::from_millis(2_000)).await;
                if tx.commit().await.is_err() {
                    return (StatusCode::SERVICE_UNAVAILABLE, "not committed".to_owned());
                }
                (StatusCode::CREATED, "done".to_owned())
            }
        })
        .layer(layer),
    );
    let addr = common::serve(router).await;
    let key = unique("reconciler");
    let k = key.clone();
    let first = tokio::spawn(async move { answer(post_key(addr, &k).await).await });
    let scoped = guard("the handler starts", started.recv())
        .await
        .expect("key");
    let stop = Arc::new(AtomicBool::new(false));
    let storm = retry_storm(addr, key.clone(), 3, stop.clone());
    // The reconciler.
    let (rstop, rsink, rpool, rkey) = (stop.clone(), sink.clone(), pool_main.clone(), key.clone());
    let reconciler = tokio::spawn(async move {
        let mut listed = 0usize;
        let mut resolved = Vec::new();
        while !rstop.load(Ordering::SeqCst) {
            if let Ok(page) = sweeper.list_uncertain(&UncertainQuery::first(50)).await {
                for record in page.records {
                    if record.key.key() != rkey {
                        continue;
                    }
                    listed += 1;
                    if pg_effects(&rpool, &rsink, &rkey).await == 0 {
                        let r = sweeper
                            .resolve(
                                &record.key,
                                record.lease_token,
                                &Resolution::NotApplied,
                                Duration::from_secs(60),
                                Some("not found downstream"),
                            )
                            .await;
                        resolved.push(format!("{r:?}"));
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        (listed, resolved)
    });
    let first = guard("the first request", first).await.expect("first");
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    stop.store(true, Ordering::SeqCst);
    let kinds = join_storm(storm).await;
    let (listed, resolved) = guard("the reconciler", reconciler)
        .await
        .expect("reconciler");
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let effects = pg_effects(&pool_main, &sink, &key).await;
    let record = sweeper_lookup(&pool_main, &t, &scoped).await;
    eprintln!("reconciler: listed {listed}, resolutions {resolved:?}; retries {kinds:?}");
    assert_eq!(
        (effects, record.as_deref()),
        (1, Some("completed")),
        "a live holder's key was released by a reconciler while its own transaction held the \
         row past the lease: first {first:?}; retries {kinds:?}; listed {listed} times, \
         resolutions {resolved:?}"
    );
}

async fn sweeper_lookup(pool: &PgPool, table: &str, key: &ScopedKey) -> Option<String> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT status FROM \"{table}\" WHERE scope = $1 AND key = $2"
    )))
    .bind(key.scope().as_bytes())
    .bind(key.key().as_bytes())
    .fetch_optional(pool)
    .await
    .expect("status")
}
