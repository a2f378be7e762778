//! Review: a record's row (or SQLite's write lock) held past the lease. Session 32 first
//! fixed this on PostgreSQL with renewals that waited for the row holding an advisory lock a
//! takeover needed; this review broke that (renewals starved of pool connections, 32-bit lock
//! collisions holding a dead holder's key, SQLite untouched), and the fix became: a milestone
//! written in the handler's own transaction holds the lease for ten minutes from when it is
//! written. Every test runs real axum servers over TCP, a real client, a real database,
//! and counts effects per key at the sink (in the handler, after its work), never responses.
//!
//! Each PostgreSQL test has a table of its own and pools named after it; it never terminates
//! or locks anything of another session.

use crate::common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use sqlx::AssertSqlSafe;
use sqlx::postgres::{PgPool, PgPoolOptions};
use tokio::sync::mpsc;
use tower_idempotency::store::{Milestone, PostgresStore, ScopedKey, SqliteStore};
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, IdempotencyStore, LeaseExpiry};

use common::pg_rig::{self, Sink, store as pg_store};
use common::{client, guard};

fn unique(name: &str) -> String {
    common::raw::unique(name)
}

/// A table name of its own for one test run.
fn table(name: &str) -> String {
    pg_rig::table("rv_rh", name)
}

async fn pool(app: &str, max: u32) -> PgPool {
    pg_rig::pool(app, max, &[]).await
}

async fn serve(app: Router) -> SocketAddr {
    common::serve(app).await
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
) -> HashMap<String, usize> {
    let mut kinds = HashMap::new();
    for t in tasks {
        for (s, kind) in guard("a retry", t).await.expect("retry task") {
            *kinds.entry(format!("{s} {kind}")).or_default() += 1;
        }
    }
    kinds
}

/// Posts `key` every 100 ms, at most `tries` times, until one is answered 201: every answer.
async fn until_created(addr: SocketAddr, key: &str, tries: usize) -> Vec<(u16, String)> {
    let mut seen = Vec::new();
    for _ in 0..tries {
        let a = answer(post_key(addr, key).await).await;
        let done = a.0 == 201;
        seen.push(a);
        if done {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    seen
}

/// A route whose handler reports its key, waits `hold` (unless its key is `quick`), then
/// counts its effect at the sink.
fn slow_route<S>(
    layer: IdempotencyLayer<S, tower_idempotency::scope::SingleTenant>,
    sink: Sink,
    keys: mpsc::UnboundedSender<ScopedKey>,
    hold: Duration,
    quick: fn(&str) -> bool,
) -> Router
where
    S: tower_idempotency::IdempotencyStore + Clone + Send + Sync + 'static,
{
    Router::new().route(
        "/op",
        post(move |ctx: IdempotencyContext| {
            let (sink, keys) = (sink.clone(), keys.clone());
            async move {
                let _ = keys.send(ctx.scoped_key().clone());
                if !quick(ctx.key()) {
                    tokio::time::sleep(hold).await;
                }
                let n = sink.hit(ctx.key());
                (StatusCode::CREATED, format!("effect {n}"))
            }
        })
        .layer(layer),
    )
}

/// Another replica of the service, in a "process" of its own (a runtime on a thread of its
/// own, with its own pool) on the same table; killed as a crash kills one: its runtime is shut
/// down under its running handlers, keeper and statements.
struct Replica {
    addr: SocketAddr,
    kill: std::sync::mpsc::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

fn replica(
    app: String,
    table: String,
    lease: Duration,
    sink: Sink,
    keys: mpsc::UnboundedSender<ScopedKey>,
) -> Replica {
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (kill, killed) = std::sync::mpsc::channel::<()>();
    let thread = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async move {
            let store = PostgresStore::new(pool(&app, 10).await)
                .with_table(&table)
                .expect("table");
            let layer = IdempotencyLayer::new(store)
                .single_tenant()
                .lease(lease)
                .on_lease_expiry(LeaseExpiry::Reclaim);
            // Its handlers never finish on their own: the replica dies under them.
            let addr = serve(slow_route(
                layer,
                sink,
                keys,
                Duration::from_secs(120),
                |_| false,
            ))
            .await;
            addr_tx.send(addr).expect("addr");
        });
        let _ = killed.recv();
        runtime.shutdown_background();
    });
    let addr = addr_rx.recv().expect("the replica's address");
    Replica { addr, kill, thread }
}

impl Replica {
    fn kill(self) {
        let _ = self.kill.send(());
        self.thread.join().expect("the replica's thread");
    }
}

/// An outsider's transaction holding `key`'s row `FOR UPDATE` (its own connection, off any
/// store's pool).
async fn hold_row(
    app: &str,
    table: &str,
    key: &ScopedKey,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(pg_rig::options(&format!("{app}-outsider"), &[]))
        .await
        .expect("outsider pool");
    let mut tx = admin.begin().await.expect("begin");
    sqlx::query(AssertSqlSafe(format!(
        "SELECT 1 FROM \"{table}\" WHERE scope = $1 AND key = $2 FOR UPDATE"
    )))
    .bind(key.scope().as_bytes())
    .bind(key.key().as_bytes())
    .execute(&mut *tx)
    .await
    .expect("lock the row");
    tx
}

// ---- 1. SQLite: the handler's own transaction holds the write lock past the lease -----------

/// The SQLite route: the handler records its downstream id in its own transaction (which
/// takes SQLite's one write lock), keeps it open 1.6 s (a slow downstream call), commits, then
/// counts its effect.
fn sqlite_route(
    store: SqliteStore,
    sink: Sink,
    started: mpsc::UnboundedSender<()>,
    committing: mpsc::UnboundedSender<()>,
) -> Router {
    let layer = IdempotencyLayer::new(store.clone())
        .single_tenant()
        .lease(Duration::from_millis(600))
        .on_lease_expiry(LeaseExpiry::Reclaim);
    Router::new().route(
        "/op",
        post(move |ctx: IdempotencyContext| {
            let (s, sink, started, committing) = (
                store.clone(),
                sink.clone(),
                started.clone(),
                committing.clone(),
            );
            async move {
                let mut tx = s.pool().begin().await.expect("begin");
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
                let _ = started.send(());
                tokio::time::sleep(Duration::from_millis(1_600)).await;
                // Retries arrive as it commits, as they will under load.
                let _ = committing.send(());
                tokio::time::sleep(Duration::from_millis(15)).await;
                tx.commit().await.expect("commit");
                tokio::time::sleep(Duration::from_millis(300)).await;
                let n = sink.hit(ctx.key());
                (StatusCode::CREATED, format!("effect {n}"))
            }
        })
        .layer(layer),
    )
}

/// DESIGN §4 ("The holder keeps its lease for as long as its process lives"; "it can record its
/// milestone ... inside its own sqlx transaction"), on `SqliteStore` (a real file). Fault: the
/// handler records its downstream id with `record_milestone_in` in its own transaction (which
/// takes SQLite's one write lock) and keeps that transaction open for 1.6 s under a 600 ms lease
/// (route `Reclaim`), while 6 tasks retry the key on a second replica (another store and layer
/// on the same file, so no in-process coalescing answers them). Every renewal waits in SQLite's
/// busy handler behind that lock; when it is let go (8 more retries arrive as it commits), a
/// retry's claim may get the lock first,
/// find the lease lapsed and take the key over. Three rounds. Expected: each key's effect exactly
/// once at the sink.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_sqlite_handlers_own_transaction_past_the_lease_never_runs_the_key_twice() {
    let mut report = Vec::new();
    let sink = Sink::default();
    for round in 0..3 {
        let (store, path) = common::sqlite(&format!("row-hold-{round}")).await;
        let other = SqliteStore::connect(&format!("sqlite://{}", path.display()))
            .await
            .expect("a second store on the file");
        let (started_tx, mut started) = mpsc::unbounded_channel::<()>();
        let (committing_tx, mut committing) = mpsc::unbounded_channel::<()>();
        let addr = serve(sqlite_route(
            store,
            sink.clone(),
            started_tx.clone(),
            committing_tx.clone(),
        ))
        .await;
        let retries = serve(sqlite_route(other, sink.clone(), started_tx, committing_tx)).await;
        let key = unique(&format!("sqlite-own-tx-{round}"));
        let k = key.clone();
        let first = tokio::spawn(async move { answer(post_key(addr, &k).await).await });
        guard("the handler starts", started.recv()).await;
        let stop = Arc::new(AtomicBool::new(false));
        let storm = retry_storm(retries, key.clone(), 6, stop.clone());
        // A burst of 8 more retries as the first handler commits.
        guard("the handler commits", committing.recv()).await;
        let burst: Vec<_> = (0..8)
            .map(|_| {
                let k = key.clone();
                tokio::spawn(async move { answer(post_key(retries, &k).await).await })
            })
            .collect();
        let first = guard("the first request", first).await.expect("first");
        // Past every run a takeover could have started.
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        stop.store(true, Ordering::SeqCst);
        let mut kinds = join_storm(storm).await;
        for b in burst {
            let (s, kind) = guard("a burst retry", b).await.expect("burst");
            *kinds.entry(format!("{s} {kind} (burst)")).or_default() += 1;
        }
        report.push((key.clone(), sink.of(&key), first, kinds));
    }
    assert!(
        report.iter().all(|(_, effects, _, _)| *effects == 1),
        "a live handler's key ran again after its own SQLite transaction held the write lock \
         past the lease (key, effects, first answer, retries' answers): {report:#?}"
    );
}

// ---- 2. PostgreSQL: renewals starved of connections -------------------------------------------

/// DESIGN §4 (the holder keeps its lease while it lives) and README's fault table ("a
/// milestone written in the handler's own transaction holds the lease for ten minutes").
/// Fault: a store on a pool of 2 connections; the handler records its downstream id in its own
/// transaction on that pool and keeps it open 2.4 s (four leases of 600 ms), while 4 tasks
/// retry the key: renewals wait for a connection and for the row, and fail. Expected: the
/// key's effect exactly once at the sink.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_pg_renewals_starved_of_connections_never_let_a_retry_run_a_live_key_twice() {
    let Some(_) = common::postgres_pool().await else {
        return;
    };
    let app = unique("rh-starved");
    let t = table("starved");
    let store = pg_store(pool(&app, 2).await, &t).await;
    let sink = Sink::default();
    let layer = IdempotencyLayer::new(store.clone())
        .single_tenant()
        .lease(Duration::from_millis(600))
        .on_lease_expiry(LeaseExpiry::Reclaim);
    let (started_tx, mut started) = mpsc::unbounded_channel::<ScopedKey>();
    let (s, sink2) = (store.clone(), sink.clone());
    let router = Router::new().route(
        "/op",
        post(move |ctx: IdempotencyContext| {
            let (s, sink, started_tx) = (s.clone(), sink2.clone(), started_tx.clone());
            async move {
                let mut tx = s.pool().begin().await.expect("begin");
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
                let _ = started_tx.send(ctx.scoped_key().clone());
                // The slow downstream call, inside the transaction: four leases.
                tokio::time::sleep(Duration::from_millis(2_400)).await;
                tx.commit().await.expect("commit");
                tokio::time::sleep(Duration::from_millis(600)).await;
                let n = sink.hit(ctx.key());
                (StatusCode::CREATED, format!("effect {n}"))
            }
        })
        .layer(layer),
    );
    let addr = serve(router).await;
    let key = unique("starved");
    let k = key.clone();
    let first = tokio::spawn(async move { answer(post_key(addr, &k).await).await });
    let scoped = guard("the handler starts", started.recv())
        .await
        .expect("key");
    let stop = Arc::new(AtomicBool::new(false));
    let storm = retry_storm(addr, key.clone(), 4, stop.clone());
    let first = guard("the first request", first).await.expect("first");
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    stop.store(true, Ordering::SeqCst);
    let kinds = join_storm(storm).await;
    let record = store.lookup(&scoped).await.ok().flatten();
    assert_eq!(
        sink.of(&key),
        1,
        "a live handler's key ran twice after its own transaction held the row past the lease; \
         first {first:?}; retries {kinds:?}; record attempts {:?}, history {:?}",
        record.as_ref().map(|r| r.attempts),
        record.as_ref().map(|r| r.history.clone()),
    );
}

// ---- 3. PostgreSQL: a holder killed while its renewals wait on a held row --------------------

/// DESIGN §4 (a dead holder's lease is taken over on a `Reclaim` route). Fault: a replica
/// holding a key dies while its renewals wait on the record's row, held by another session
/// (their backends go on waiting after the replica is gone); the
/// row is let go 300 ms later. The key is then retried every 100 ms on another replica for 4 s
/// (about 7 leases). Expected: taken over, its effect counted once at the sink.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_pg_a_holder_killed_while_its_renewals_wait_on_a_held_row_is_taken_over() {
    let Some(_) = common::postgres_pool().await else {
        return;
    };
    let app = unique("rh-killed");
    let t = table("killed");
    let lease = Duration::from_millis(600);
    let store = pg_store(pool(&app, 10).await, &t).await;
    let sink = Sink::default();
    let (keys_tx, _keys) = mpsc::unbounded_channel::<ScopedKey>();
    let layer = IdempotencyLayer::new(store.clone())
        .single_tenant()
        .lease(lease)
        .on_lease_expiry(LeaseExpiry::Reclaim);
    let addr = serve(slow_route(
        layer,
        sink.clone(),
        keys_tx,
        Duration::ZERO,
        |_| true,
    ))
    .await;

    let key = unique("killed");
    let (rkeys_tx, mut rkeys) = mpsc::unbounded_channel::<ScopedKey>();
    let dead = replica(
        format!("{app}-replica"),
        t.clone(),
        lease,
        sink.clone(),
        rkeys_tx,
    );
    let (raddr, k) = (dead.addr, key.clone());
    let first = tokio::spawn(async move { answer(post_key(raddr, &k).await).await });
    let scoped = guard("the handler starts on the replica", rkeys.recv())
        .await
        .expect("key");
    let outsider = hold_row(&app, &t, &scoped).await;
    // Two renewals wait on the row by now.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    dead.kill();
    let _ = first.await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    outsider.commit().await.expect("let the row go");
    let tries = until_created(addr, &key, 40).await;
    let record = store.lookup(&scoped).await.ok().flatten();
    assert_eq!(
        sink.of(&key),
        1,
        "a dead holder's key was not taken over (exactly once) within ~7 leases: {tries:?}; \
         record attempts {:?}, history {:?}",
        record.as_ref().map(|r| r.attempts),
        record.as_ref().map(|r| r.history.clone()),
    );
}

// ---- 4. The hold a milestone in a transaction gives ------------------------------------------

/// README's fault table ("a milestone written in the handler's own transaction holds the lease
/// for ten minutes from when it is written") on both SQL stores: after `record_milestone_in`
/// commits, the record's lease runs ten minutes ahead, and renewals never shorten it (a
/// shorter renewal keeps the longer end, as `store::kit` asks of every store). A milestone
/// under another token is refused and holds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_milestone_in_a_transaction_holds_the_lease_ten_minutes() {
    use common::batching::{acquired, claim_with};
    let lease = Duration::from_secs(2);
    let (sqlite, _path) = common::sqlite("row-hold-renewed").await;
    let postgres = match common::postgres_pool().await {
        Some(_) => Some(pg_store(pool(&unique("rh-renewed"), 4).await, &table("renewed")).await),
        None => None,
    };
    async fn lease_left<S: IdempotencyStore>(store: &S, key: &ScopedKey) -> Duration {
        let record = store.lookup(key).await.expect("lookup").expect("a record");
        record
            .lease_until
            .duration_since(std::time::SystemTime::now())
            .unwrap_or_default()
    }
    macro_rules! check {
        ($store:expr, $name:literal) => {{
            let store = $store;
            let key = ScopedKey::new(unique($name), "k");
            let req = claim_with(&key, lease, Duration::from_secs(60), LeaseExpiry::Reclaim);
            let token = acquired(&store, &req).await;
            assert!(
                lease_left(&store, &key).await <= lease,
                "{}: a lease",
                $name
            );
            let mut tx = store.pool().begin().await.expect("begin");
            store
                .record_milestone_in(&mut tx, &key, token, &Milestone::DownstreamId("d".into()))
                .await
                .expect("milestone");
            tx.commit().await.expect("commit");
            let held = lease_left(&store, &key).await;
            assert!(
                held > Duration::from_secs(9 * 60),
                "{}: held ten minutes after the milestone, {held:?}",
                $name
            );
            store.renew(&key, token, lease).await.expect("renew");
            let kept = lease_left(&store, &key).await;
            assert!(
                kept > Duration::from_secs(9 * 60),
                "{}: a renewal never shortens it, {kept:?}",
                $name
            );
            // Another key, its milestone refused: it holds nothing.
            let other = ScopedKey::new(unique($name), "other");
            let req = claim_with(&other, lease, Duration::from_secs(60), LeaseExpiry::Reclaim);
            let token = acquired(&store, &req).await;
            let mut tx = store.pool().begin().await.expect("begin");
            let stale = store
                .record_milestone_in(
                    &mut tx,
                    &other,
                    tower_idempotency::store::FencingToken::new(token.get() ^ 1),
                    &Milestone::EffectStarted,
                )
                .await;
            tx.commit().await.expect("commit");
            assert!(stale.is_err(), "{}: fenced", $name);
            assert!(
                lease_left(&store, &other).await <= lease,
                "{}: holds nothing",
                $name
            );
        }};
    }
    check!(sqlite, "sqlite");
    if let Some(postgres) = postgres {
        check!(postgres, "postgres");
    }
}
