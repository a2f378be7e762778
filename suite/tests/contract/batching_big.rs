//! Issue 23 §4 (DESIGN §5): a batch is bounded in bytes (`Batching::max_bytes`, 16 MiB by
//! default). Each completion here is well within what PostgreSQL accepts alone; together, in
//! one statement, they would pass its 1 GB message limit and fail every one of them. The
//! `s4_fault_*` test failed before the bound; `s4_held_*` held. Gigabytes of memory each: the
//! tests take turns.

use crate::common;

use common::batching::{acquire, unique};

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tower_idempotency::IdempotencyStore;
use tower_idempotency::store::{Batching, FencingToken, PostgresStore, ScopedKey, StoredResponse};

const LONG: Duration = Duration::from_secs(600);
const GUARD: Duration = Duration::from_secs(300);

fn answer(body: &bytes::Bytes) -> StoredResponse {
    StoredResponse {
        status: http::StatusCode::CREATED,
        headers: http::HeaderMap::new(),
        body: Some(body.clone()),
        trailers: None,
    }
}

/// Completions of `count` keys, `size` bytes each, queued behind a held inline completion so
/// they go in one batch; every one must succeed, as each does alone.
/// One big test at a time, whatever the harness's threads.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn big_batch(count: usize, size: usize) {
    let _turn = ONE_AT_A_TIME.lock().await;
    let Some(_) = common::postgres_pool().await else {
        return;
    };
    let options: PgConnectOptions = common::postgres_url().parse().expect("url");
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(120))
        .connect_with(options)
        .await
        .expect("pool");
    let plain = PostgresStore::new(pool.clone())
        .with_table("tower_idempotency_bb_big")
        .expect("table");
    plain.migrate().await.expect("migrate");
    let run = unique("big");
    let body = bytes::Bytes::from(vec![b'x'; size]);
    // Alone: one such completion is accepted.
    let lone = ScopedKey::new(run.clone(), "lone");
    let token = acquire(&plain, &lone).await;
    plain
        .complete(&lone, token, &answer(&body), LONG)
        .await
        .expect("a completion of this size, alone, is accepted");
    let mut work: Vec<(ScopedKey, FencingToken)> = Vec::new();
    for i in 0..=count {
        let key = ScopedKey::new(run.clone(), format!("k{i}"));
        let token = acquire(&plain, &key).await;
        work.push((key, token));
    }
    let store = Arc::new(plain.with_batching(Batching::default().in_flight(1).max_batch(count)));
    let held = pool.acquire().await.expect("hold the connection");
    let (first, rest) = work.split_first().expect("work");
    let first_task = {
        let (store, (key, token), body) = (store.clone(), first.clone(), body.clone());
        tokio::spawn(async move { store.complete(&key, token, &answer(&body), LONG).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let tasks: Vec<_> = rest
        .iter()
        .map(|(key, token)| {
            let (store, key, token, body) = (store.clone(), key.clone(), *token, body.clone());
            tokio::spawn(async move {
                let out = store.complete(&key, token, &answer(&body), LONG).await;
                (key, out)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(held);
    tokio::time::timeout(GUARD, first_task)
        .await
        .expect("hang guard")
        .expect("task")
        .expect("the inline completion");
    let mut failed = Vec::new();
    for task in tasks {
        let (key, out) = tokio::time::timeout(GUARD, task)
            .await
            .expect("hang guard")
            .expect("task");
        if let Err(e) = out {
            failed.push((key.key().to_owned(), e.to_string(), format!("{e:?}")));
        }
    }
    let sample = failed.first().cloned();
    assert!(
        failed.is_empty(),
        "{} of {count} completions of {size} bytes, each accepted alone, failed together; \
         first: {sample:?}",
        failed.len()
    );
}

/// 72 completions of 15 MiB (about 1.05 GiB in one statement).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_fault_pg_a_batch_of_big_completions_fails_every_one_of_them() {
    big_batch(72, 15 << 20).await;
}

/// Held: 64 completions of 1 MiB (the layer's default response limit, the default batch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_held_pg_64_completions_of_1_mib_in_one_batch() {
    big_batch(64, 1 << 20).await;
}
