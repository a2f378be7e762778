//! Issue 23 §4 (DESIGN §5): batched claims and completions on PostgreSQL and SQLite. Each
//! request gets its own answer with the same fencing, leases and TTLs as alone; concurrent
//! operations go in few statements, counted on the wire; a batch that fails, a caller that
//! leaves and a database that goes away lose no effect and run none twice.

use crate::common;

use common::batching::{LONG, answer, claim, claim_together, hold_row, through_proxy, unique};

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use common::{Effects, client, serve};
use tokio::sync::Barrier;
use tower_idempotency::store::{Batching, Claim, RecordStatus, ScopedKey, SqliteStore, StoreError};
use tower_idempotency::{IdempotencyLayer, IdempotencyStore};

/// `n` concurrent claims of fresh keys, released together by a barrier.
async fn claim_all<S: IdempotencyStore + 'static>(
    store: &Arc<S>,
    keys: &[ScopedKey],
) -> Vec<Result<Claim, StoreError>> {
    claim_together(store, keys.iter().map(claim).collect()).await
}

/// Issue 23 §4: 64 concurrent claims and then 64 completions of fresh keys go to PostgreSQL in
/// a few statements each, counted on the wire; unbatched, the same take one statement each.
/// Every key is acquired, and keeps its own answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_concurrent_operations_go_in_few_statements_counted_on_the_wire() {
    let Some((plain, proxy)) = through_proxy("tower_idempotency_batching", 8).await else {
        return;
    };
    let batched = Arc::new(plain.clone().with_batching(Batching::default()));
    let plain = Arc::new(plain);
    let run = unique("wire");
    let keys = |side: &str| -> Vec<ScopedKey> {
        (0..64)
            .map(|i| ScopedKey::new(run.clone(), format!("{side}-{i}")))
            .collect()
    };

    for (store, side) in [(&plain, "plain"), (&batched, "batched")] {
        // A first claim and completion prepare the statements on a connection.
        let warm = ScopedKey::new(run.clone(), format!("{side}-warm"));
        let Ok(Claim::Acquired(lease)) = store.claim(&claim(&warm)).await else {
            panic!("warm-up claim")
        };
        store
            .complete(&warm, lease.token, &answer(&warm), LONG)
            .await
            .expect("warm-up complete");
    }

    let mut counted = Vec::new();
    for (store, side) in [(&plain, "plain"), (&batched, "batched")] {
        let keys = keys(side);
        let before = proxy.statements();
        let claimed = claim_all(store, &keys).await;
        let claims = proxy.statements() - before;
        let mut tokens = Vec::new();
        for claimed in claimed {
            match claimed {
                Ok(Claim::Acquired(lease)) => {
                    assert_eq!(lease.attempt, 1);
                    tokens.push(lease.token);
                }
                other => panic!("{side}: a fresh key answered {other:?}"),
            }
        }
        let before = proxy.statements();
        let tasks: Vec<_> = keys
            .iter()
            .zip(&tokens)
            .map(|(key, token)| {
                let (store, key, token) = (store.clone(), key.clone(), *token);
                tokio::spawn(async move { store.complete(&key, token, &answer(&key), LONG).await })
            })
            .collect();
        for task in tasks {
            task.await
                .expect("complete task")
                .expect("a holder completes");
        }
        let completes = proxy.statements() - before;
        for key in &keys {
            let record = plain
                .lookup(key)
                .await
                .expect("lookup")
                .expect("the record");
            assert_eq!(record.status, RecordStatus::Completed);
            let response = record.response.expect("its response");
            assert_eq!(
                response.body,
                answer(key).body,
                "{side}: each key keeps its own answer"
            );
        }
        counted.push((side, claims, completes));
    }
    let [
        ("plain", plain_claims, plain_completes),
        ("batched", claims, completes),
    ] = counted.as_slice()
    else {
        panic!("two sides")
    };
    assert_eq!(
        (*plain_claims, *plain_completes),
        (64, 64),
        "unbatched: one statement per operation"
    );
    assert!(
        *claims <= 16 && *completes <= 16,
        "batched: 64 claims took {claims} statements and 64 completions {completes}; \
         with two batches in flight they should take a few"
    );
}

/// Issue 23 §4: a record held in another transaction fails only its own claim: the batch gives
/// up after its bounded lock wait, its claims go again one by one, the held key answers
/// `Busy` (in flight) and every other key is acquired once. The held record is released, so
/// its claim would take it over and must wait for the lock (a claim that changes nothing
/// reads the record without it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_row_held_elsewhere_fails_only_its_own_claim() {
    // A table of its own: another test's `migrate()` (DDL) would queue behind the held row's
    // transaction, and every statement on the table behind it, before any lock wait is bounded.
    let Some(store) = common::postgres("tower_idempotency_batching_held").await else {
        return;
    };
    let store = Arc::new(store.with_batching(Batching::default().in_flight(1)));
    let run = unique("held");
    let held = ScopedKey::new(run.clone(), "held");
    let Ok(Claim::Acquired(lease)) = store.claim(&claim(&held)).await else {
        panic!("claim the held key")
    };
    store.release(&held, lease.token).await.expect("release");
    // Another transaction holds the record's row, as a handler's own transaction does.
    let mut tx = store.pool().begin().await.expect("begin");
    hold_row(&mut tx, "tower_idempotency_batching_held", &held).await;

    let mut keys: Vec<ScopedKey> = (0..15)
        .map(|i| ScopedKey::new(run.clone(), format!("free-{i}")))
        .collect();
    keys.insert(7, held.clone());
    let claimed = claim_all(&store, &keys).await;
    tx.rollback().await.expect("rollback");
    for (key, claimed) in keys.iter().zip(claimed) {
        if *key == held {
            assert!(
                matches!(claimed, Err(StoreError::Busy)),
                "the held key is in flight, got {claimed:?}"
            );
        } else {
            assert!(
                matches!(claimed, Ok(Claim::Acquired(ref lease)) if lease.attempt == 1),
                "a free key is acquired once, got {claimed:?}"
            );
        }
    }
}

/// Issue 23 §4: a caller that leaves while its claim waits in a batch does not leave the key
/// in progress until its lease runs out: the batch gives the won claim back. `hold` keeps the
/// first claim (sent alone, on its caller's task) in flight while the second queues behind
/// it, and returns what lets it go.
async fn a_caller_who_leaves_gets_its_claim_given_back<S, H, F>(store: S, hold: H)
where
    S: IdempotencyStore,
    H: FnOnce(ScopedKey) -> F,
    F: std::future::Future<Output = Box<dyn FnOnce() + Send>>,
{
    let store = Arc::new(store);
    let run = unique("leaves");
    let (first, key) = (
        ScopedKey::new(run.clone(), "first"),
        ScopedKey::new(run, "k"),
    );
    let release = hold(first.clone()).await;
    let ahead = {
        let (store, req) = (store.clone(), claim(&first));
        tokio::spawn(async move { store.claim(&req).await })
    };
    // The first claim is now waiting for the held lock, in the batch slot.
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Polled once (queued behind it), then dropped.
    let left = tokio::time::timeout(Duration::ZERO, store.claim(&claim(&key))).await;
    assert!(left.is_err(), "the caller left before the answer");
    release();
    let _ = ahead.await.expect("the first claim's task");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let status = store.lookup(&key).await.expect("lookup").map(|r| r.status);
        if status == Some(RecordStatus::Released) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the claim was not given back: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    match store.claim(&claim(&key)).await {
        Ok(Claim::Acquired(lease)) => assert_eq!(lease.attempt, 2, "taken over at once"),
        other => panic!("the next caller takes the key at once, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_postgres_a_caller_who_leaves_gets_its_claim_given_back() {
    let Some(store) = common::postgres("tower_idempotency_batching_leaves").await else {
        return;
    };
    let pool = store.pool().clone();
    let hold = |first: ScopedKey| async move {
        // The first key's row, expired and held by another transaction: its claim (which
        // would start it afresh) waits for the lock (at most 100 ms, then answers in flight),
        // in the one batch slot.
        sqlx::query(
            "INSERT INTO tower_idempotency_batching_leaves (scope, key, fingerprint, status, \
             lease_token, lease_until, attempts, created_at, updated_at, expires_at) \
             VALUES ($1, $2, $3, 'completed', 1, now(), 1, now(), now(), now() - interval '1 hour')",
        )
        .bind(first.scope().as_bytes())
        .bind(first.key().as_bytes())
        .bind(vec![7u8; 32])
        .execute(&pool)
        .await
        .expect("the first key's record");
        let mut tx = pool.begin().await.expect("begin");
        hold_row(&mut tx, "tower_idempotency_batching_leaves", &first).await;
        Box::new(move || drop(tx)) as Box<dyn FnOnce() + Send>
    };
    let store = store.with_batching(Batching::default().in_flight(1));
    a_caller_who_leaves_gets_its_claim_given_back(store, hold).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_sqlite_a_caller_who_leaves_gets_its_claim_given_back() {
    let (store, path) = common::sqlite("batching-leaves").await;
    let hold = |_first: ScopedKey| async move {
        // SQLite's write lock, held by another connection: the first claim waits for it (busy
        // timeout 5 s) in the one batch slot.
        let mut other = <sqlx::SqliteConnection as sqlx::Connection>::connect(&format!(
            "sqlite://{}",
            path.display()
        ))
        .await
        .expect("a second connection");
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut other)
            .await
            .expect("take the write lock");
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        // Let go from a thread of its own: the closure that releases it is not async.
        tokio::spawn(async move {
            let _ = tokio::task::spawn_blocking(move || rx.recv()).await;
            let _ = sqlx::query("ROLLBACK").execute(&mut other).await;
        });
        Box::new(move || {
            let _ = tx.send(());
        }) as Box<dyn FnOnce() + Send>
    };
    let store = store.with_batching(Batching::default().in_flight(1));
    a_caller_who_leaves_gets_its_claim_given_back(store, hold).await;
}

/// Issue 23 §4: with the database gone, every batched claim fails closed (an error, never a
/// hang, never acquired); once it is back, each key is acquired exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_batches_fail_closed_while_the_database_is_gone() {
    let Some((store, proxy)) = through_proxy("tower_idempotency_batching", 4).await else {
        return;
    };
    let store = Arc::new(store.with_batching(Batching::default()));
    let run = unique("gone");
    let keys: Vec<ScopedKey> = (0..24)
        .map(|i| ScopedKey::new(run.clone(), format!("k-{i}")))
        .collect();
    proxy.cut();
    let claimed = tokio::time::timeout(Duration::from_secs(60), claim_all(&store, &keys))
        .await
        .expect("no batched claim hangs while the database is gone");
    for claimed in claimed {
        assert!(
            matches!(claimed, Err(StoreError::Unavailable(_))),
            "fails closed, got {claimed:?}"
        );
    }
    proxy.restore();
    let claimed = claim_all(&store, &keys).await;
    for claimed in &claimed {
        assert!(
            matches!(claimed, Ok(Claim::Acquired(lease)) if lease.attempt == 1),
            "nothing was claimed while the database was gone, got {claimed:?}"
        );
    }
}

/// Issue 23 §4 over HTTP: 50 keys, four concurrent requests each, through the layer on a
/// batched store: one effect per key at the sink, and every request of a key gets its answer.
async fn one_effect_per_key_over_http<S: IdempotencyStore>(store: S) {
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/charge",
            post(move |body: String| async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                let n = sink.hit();
                (StatusCode::CREATED, format!("effect {n} for {body}"))
            }),
        )
        .layer(
            IdempotencyLayer::new(store)
                .single_tenant()
                .wait_for_in_flight(Duration::from_secs(10)),
        );
    let addr = serve(app).await;
    let run = unique("http");
    const KEYS: usize = 50;
    const EACH: usize = 4;
    let barrier = Arc::new(Barrier::new(KEYS * EACH));
    let tasks: Vec<_> = (0..KEYS * EACH)
        .map(|i| {
            let (barrier, key) = (barrier.clone(), format!("{run}-{}", i % KEYS));
            tokio::spawn(async move {
                let request = client()
                    .post(format!("http://{addr}/charge"))
                    .header("idempotency-key", &key)
                    .body(key.clone());
                barrier.wait().await;
                let res = request.send().await.expect("request");
                (key, res.status(), res.text().await.expect("body"))
            })
        })
        .collect();
    let mut answers = std::collections::HashMap::new();
    for task in tasks {
        let (key, status, body) = task.await.expect("request task");
        assert_eq!(status, StatusCode::CREATED, "{key}: {body}");
        assert!(body.ends_with(&format!("for {key}")), "{key} got {body}");
        let first = answers.entry(key.clone()).or_insert_with(|| body.clone());
        assert_eq!(*first, body, "{key}: every request gets the one answer");
    }
    assert_eq!(answers.len(), KEYS);
    assert_eq!(
        effects.count(),
        KEYS,
        "one effect per key, counted at the sink"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_postgres_batched_one_effect_per_key_over_http() {
    let Some(store) = common::postgres("tower_idempotency_batching").await else {
        return;
    };
    one_effect_per_key_over_http(store.with_batching(Batching::default())).await;
}

/// `AnyStore::with_batching` batches the SQL store a URL names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_any_store_batched_one_effect_per_key_over_http() {
    let path = common::sqlite_path("batching-any");
    let store = tower_idempotency::AnyStore::connect(&format!("sqlite://{}", path.display()))
        .await
        .expect("connect")
        .with_batching(Batching::default());
    let tower_idempotency::AnyStore::Sqlite(sqlite) = &store else {
        panic!("a SQLite store")
    };
    assert_eq!(sqlite.batching(), Some(Batching::default()));
    one_effect_per_key_over_http(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_sqlite_batched_one_effect_per_key_over_http() {
    let (store, _path) = common::sqlite("batching-http").await;
    one_effect_per_key_over_http::<SqliteStore>(store.with_batching(Batching::default())).await;
}
