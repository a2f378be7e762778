//! Issue 23 §4 (DESIGN §5), attacked: batched claims and completions under held rows, a
//! database that does not answer, a runtime shutting down, answers lost after commit, and
//! hundreds of operations on keys that differ only in their bytes. Written by a review that
//! broke the first version (the `s4_fault_*` tests failed on it); the `s4_held_*` ones held.
//! Waits here are hang guards with wide slack, never measurements.

use crate::common;

use common::batching::{
    LONG, acquire, answer, claim, hold_row, spawn_claim, through_proxy, unique,
};

use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::sync::Barrier;
use tower_idempotency::IdempotencyStore;
use tower_idempotency::store::{
    Batching, Claim, FencingToken, PostgresStore, RecordStatus, ScopedKey, SqliteStore, StoreError,
};

/// `keys.len()` concurrent completes (each with its own token), released by a barrier; the
/// time until the last one answered.
async fn complete_all<S: IdempotencyStore>(
    store: &Arc<S>,
    work: &[(ScopedKey, FencingToken)],
) -> (Vec<Result<(), StoreError>>, Duration) {
    let barrier = Arc::new(Barrier::new(work.len() + 1));
    let tasks: Vec<_> = work
        .iter()
        .map(|(key, token)| {
            let (store, barrier, key, token) =
                (store.clone(), barrier.clone(), key.clone(), *token);
            tokio::spawn(async move {
                barrier.wait().await;
                store.complete(&key, token, &answer(&key), LONG).await
            })
        })
        .collect();
    barrier.wait().await;
    let start = Instant::now();
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.expect("complete task"));
    }
    (out, start.elapsed())
}

// ---------------------------------------------------------------------------------------------
// Fault guarded: a failed batch of completions goes again one at a time, *sequentially*, each
// statement waiting its own pool acquire timeout. With the database gone, 24 concurrent
// completes fail after ~2 s unbatched, but after ~24 x 2 s batched.
// ---------------------------------------------------------------------------------------------

/// A server that accepts connections and never answers (a partitioned network, a proxy whose
/// database is gone): each operation waits out the pool's acquire timeout, then fails closed.
async fn unresponsive_store() -> PostgresStore {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let options: PgConnectOptions = format!("postgres://postgres@127.0.0.1:{port}/test")
        .parse()
        .expect("url");
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(1))
        .connect_lazy_with(options);
    PostgresStore::new(pool)
        .with_table("tower_idempotency_bf_unresponsive")
        .expect("table")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_fault_pg_batched_completes_fail_as_fast_as_unbatched_while_the_database_is_unresponsive()
 {
    let plain = Arc::new(unresponsive_store().await);
    let batched = Arc::new(
        unresponsive_store()
            .await
            .with_batching(Batching::default()),
    );
    let run = unique("unresponsive");
    // Each failing alone would wait out the pool's 1 s acquire timeout; one after another,
    // 64 of them would take a minute.
    let work: Vec<(ScopedKey, FencingToken)> = (0..64)
        .map(|i| {
            (
                ScopedKey::new(run.clone(), format!("k-{i}")),
                FencingToken::new(i + 1),
            )
        })
        .collect();
    let (plain_out, _) = complete_all(&plain, &work).await;
    for out in &plain_out {
        assert!(matches!(out, Err(StoreError::Unavailable(_))), "{out:?}");
    }
    let (batched_out, _) =
        tokio::time::timeout(Duration::from_secs(30), complete_all(&batched, &work))
            .await
            .expect(
                "batched completes fail closed together, not one after another each waiting \
                 out the pool's acquire timeout",
            );
    for out in &batched_out {
        assert!(matches!(out, Err(StoreError::Unavailable(_))), "{out:?}");
    }
}

/// Held: with the connections cut (refused), batched completes fail closed as fast as alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_held_pg_batched_completes_fail_closed_while_the_database_is_cut() {
    let Some((plain, proxy)) = through_proxy("tower_idempotency_bf_gone", 4).await else {
        return;
    };
    let batched = Arc::new(plain.clone().with_batching(Batching::default()));
    let plain = Arc::new(plain);
    let run = unique("gone");
    let mut work = Vec::new();
    for i in 0..24 {
        let key = ScopedKey::new(run.clone(), format!("k-{i}"));
        let token = acquire(&*plain, &key).await;
        work.push((key, token));
    }
    proxy.cut();
    let (out, _) = tokio::time::timeout(Duration::from_secs(60), complete_all(&batched, &work))
        .await
        .expect("answered");
    for out in &out {
        assert!(matches!(out, Err(StoreError::Unavailable(_))), "{out:?}");
    }
    proxy.restore();
    // Nothing was written: each holder's retry lands.
    let (out, _) = complete_all(&batched, &work).await;
    for out in out {
        out.expect("the holder's retried completion");
    }
}

// ---------------------------------------------------------------------------------------------
// Fault guarded: a row held by another transaction stalls every completion queued behind it in a
// batch: the batch gives up after 100 ms, then goes one by one in order, and the held key's
// single (unbounded) `complete` waits for the lock while the others wait for it.
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_fault_pg_a_held_row_stalls_unrelated_completes_of_its_batch() {
    let table = "tower_idempotency_bf_hol";
    let Some(store) = common::postgres(table).await else {
        return;
    };
    let pool = store.pool().clone();
    let store = Arc::new(store.with_batching(Batching::default().in_flight(1)));
    let run = unique("hol");
    let gate = ScopedKey::new(run.clone(), "gate");
    let held = ScopedKey::new(run.clone(), "held");
    let others: Vec<ScopedKey> = (0..10)
        .map(|i| ScopedKey::new(run.clone(), format!("other-{i}")))
        .collect();
    let gate_token = acquire(&*store, &gate).await;
    let held_token = acquire(&*store, &held).await;
    let mut tokens = Vec::new();
    for key in &others {
        tokens.push(acquire(&*store, key).await);
    }
    let lock = |key: &ScopedKey| {
        let (pool, key) = (pool.clone(), key.clone());
        async move {
            let mut tx = pool.begin().await.expect("begin");
            hold_row(&mut tx, table, &key).await;
            tx
        }
    };
    let gate_tx = lock(&gate).await;
    let held_tx = lock(&held).await;
    // The gate's completion takes the one slot (alone, on its task) and waits for its row.
    let gate_done = {
        let (store, key) = (store.clone(), gate.clone());
        tokio::spawn(async move { store.complete(&key, gate_token, &answer(&key), LONG).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Queued behind it: first the held key, then ten keys nobody holds.
    let held_done = {
        let (store, key) = (store.clone(), held.clone());
        tokio::spawn(async move { store.complete(&key, held_token, &answer(&key), LONG).await })
    };
    tokio::time::sleep(Duration::from_millis(30)).await;
    let tasks: Vec<_> = others
        .iter()
        .zip(&tokens)
        .map(|(key, token)| {
            let (store, key, token) = (store.clone(), key.clone(), *token);
            tokio::spawn(async move {
                let out = store.complete(&key, token, &answer(&key), LONG).await;
                (out, Instant::now())
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(30)).await;
    // The gate opens: the queue goes as one batch, and fails on the held row.
    gate_tx.rollback().await.expect("rollback");
    gate_done.await.expect("task").expect("the gate completes");
    // Every key nobody holds completes while the held row is still held.
    for task in tasks {
        let (out, _) = tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect(
                "a completion of a key nobody holds waits for another key's row lock: the \
                 failed batch's completions must go alone, not behind the held one",
            )
            .expect("task");
        out.expect("an unheld key completes");
    }
    held_tx.rollback().await.expect("rollback");
    held_done
        .await
        .expect("task")
        .expect("the held key completes once let go");
}

// Fault guarded: the same with the default settings (two slots): two held rows being completed
// take both slots, and every other completion of the store queues behind them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_fault_pg_two_held_rows_stall_every_completion_of_the_store() {
    let table = "tower_idempotency_bf_hol2";
    let Some(store) = common::postgres(table).await else {
        return;
    };
    let pool = store.pool().clone();
    let store = Arc::new(store.with_batching(Batching::default()));
    let run = unique("hol2");
    let held: Vec<ScopedKey> = (0..2)
        .map(|i| ScopedKey::new(run.clone(), format!("held-{i}")))
        .collect();
    let free = ScopedKey::new(run.clone(), "free");
    let mut txs = Vec::new();
    let mut held_done = Vec::new();
    for key in &held {
        let token = acquire(&*store, key).await;
        let mut tx = pool.begin().await.expect("begin");
        hold_row(&mut tx, table, key).await;
        txs.push(tx);
        let (store, key) = (store.clone(), key.clone());
        held_done.push(tokio::spawn(async move {
            store.complete(&key, token, &answer(&key), LONG).await
        }));
    }
    let free_token = acquire(&*store, &free).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    // While both rows stay held: a guard, with slack; a stalled completion never answers.
    let free_out = tokio::time::timeout(
        Duration::from_secs(30),
        store.complete(&free, free_token, &answer(&free), LONG),
    )
    .await;
    for tx in txs {
        tx.rollback().await.expect("rollback");
    }
    for done in held_done {
        done.await
            .expect("task")
            .expect("held key completes once let go");
    }
    assert!(
        matches!(free_out, Ok(Ok(()))),
        "a completion of a key nobody holds did not answer (got {free_out:?}): both \
         completion slots wait on other keys' row locks, unbounded"
    );
}

// ---------------------------------------------------------------------------------------------
// Fault guarded: a runtime that shuts down while an operation is queued behind its inline
// operation leaks the batch slot: `Handoff::drop` spawns `drain` on the closing runtime, the
// task is dropped unpolled, its `Slot` is never made, `running` is never given back. The queued
// caller (on another runtime) waits forever, and so does every later operation of the store.
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_fault_a_runtime_shutting_down_leaves_queued_callers_and_the_store_hanging() {
    let (store, path) = common::sqlite("batching-faults-shutdown").await;
    let store = Arc::new(store.with_batching(Batching::default().in_flight(1)));
    let run = unique("shutdown");
    let (first, queued_key, later_key) = (
        ScopedKey::new(run.clone(), "first"),
        ScopedKey::new(run.clone(), "queued"),
        ScopedKey::new(run.clone(), "later"),
    );
    // Another connection holds SQLite's write lock: the first claim waits in the one slot.
    let mut other = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display()))
        .await
        .expect("second connection");
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut other)
        .await
        .expect("write lock");

    let (in_slot_tx, in_slot_rx) = tokio::sync::oneshot::channel::<()>();
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let thread = {
        let store = store.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime A");
            rt.spawn(async move {
                let _ = store.claim(&claim(&first)).await;
            });
            rt.block_on(async { tokio::time::sleep(Duration::from_millis(100)).await });
            let _ = in_slot_tx.send(());
            let _ = stop_rx.recv();
            // Runtime A shuts down: the first claim's task is dropped mid-statement.
            drop(rt);
        })
    };
    in_slot_rx.await.expect("the first claim is in its slot");
    let queued = spawn_claim(&store, &queued_key);
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop_tx.send(()).expect("stop A");
    tokio::task::spawn_blocking(move || thread.join())
        .await
        .expect("join")
        .expect("thread A");
    sqlx::query("ROLLBACK")
        .execute(&mut other)
        .await
        .expect("let go");

    let queued_out = tokio::time::timeout(Duration::from_secs(10), queued).await;
    let later_out =
        tokio::time::timeout(Duration::from_secs(10), store.claim(&claim(&later_key))).await;
    assert!(
        queued_out.is_ok() && later_out.is_ok(),
        "after runtime A shut down with a claim queued behind its inline claim: the queued \
         claim answered: {}, a fresh claim afterwards answered: {} (within 10 s each): the \
         batch slot leaked, the store hangs",
        queued_out.is_ok(),
        later_out.is_ok()
    );
}

// ---------------------------------------------------------------------------------------------
// Fault guarded: SQLite's failed batch of claims is also retried one at a time, sequentially, under
// the writer mutex: with another process holding the write lock, each claim of the batch waits
// out its own busy timeout in turn.
// ---------------------------------------------------------------------------------------------

async fn sqlite_with_busy(path: &std::path::Path, busy: Duration) -> SqliteStore {
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(busy);
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(16)
        .connect_with(options)
        .await
        .expect("sqlite pool");
    let store = SqliteStore::new(pool);
    store.migrate().await.expect("migrate");
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_fault_sqlite_batched_claims_fail_as_fast_as_unbatched_under_a_held_write_lock() {
    let path = common::sqlite_path("batching-faults-busy");
    let plain = Arc::new(sqlite_with_busy(&path, Duration::from_millis(500)).await);
    let batched = Arc::new(
        sqlite_with_busy(&path, Duration::from_millis(500))
            .await
            .with_batching(Batching::default().in_flight(1)),
    );
    let mut other = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display()))
        .await
        .expect("second connection");
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut other)
        .await
        .expect("write lock");
    let run = unique("busy");
    // Each claim alone waits out the 0.5 s busy timeout; one after another, 48 would take 24 s.
    for (store, side) in [(&plain, "plain"), (&batched, "batched")] {
        let keys: Vec<ScopedKey> = (0..48)
            .map(|i| ScopedKey::new(run.clone(), format!("{side}-{i}")))
            .collect();
        let barrier = Arc::new(Barrier::new(keys.len() + 1));
        let tasks: Vec<_> = keys
            .iter()
            .map(|key| {
                let (store, barrier, req) = (store.clone(), barrier.clone(), claim(key));
                tokio::spawn(async move {
                    barrier.wait().await;
                    store.claim(&req).await
                })
            })
            .collect();
        barrier.wait().await;
        let all = async {
            let mut outs = Vec::new();
            for task in tasks {
                outs.push(task.await.expect("task"));
            }
            outs
        };
        let outs = tokio::time::timeout(Duration::from_secs(15), all)
            .await
            .expect(
                "a failed batch's claims go alone together, not one after another under the \
                 writer, each waiting out the busy timeout",
            );
        for out in outs {
            assert!(
                matches!(out, Err(StoreError::Unavailable(_))),
                "{side}: {out:?}"
            );
        }
    }
    sqlx::query("ROLLBACK")
        .execute(&mut other)
        .await
        .expect("let go");
}

// ---------------------------------------------------------------------------------------------
// Attacks that held (kept as tests).
// ---------------------------------------------------------------------------------------------

/// Keys whose scope and key differ only in where the split falls, in NUL bytes, in non-ASCII
/// and in length; four concurrent claims of each (600 ops), then completes by the winner and
/// by a stale token at once: exactly one winner per key, every loser sees the winner's token,
/// each winner's completion lands on its own key, every stale one is fenced.
async fn many_keys_in_bytes<S: IdempotencyStore>(stores: Vec<Arc<S>>) {
    let pick = |n: usize| stores[n % stores.len()].clone();
    let store = stores[0].clone();
    let run = unique("bytes");
    let mut keys = Vec::new();
    for i in 0..150 {
        let key = match i % 6 {
            0 => ScopedKey::new(format!("{run}a"), format!("b{i}")),
            1 => ScopedKey::new(run.clone(), format!("ab{i}")),
            2 => ScopedKey::new(format!("{run}\0"), format!("\0{i}")),
            3 => ScopedKey::new(run.clone(), format!("\0\0{i}")),
            4 => ScopedKey::new(format!("{run}é"), format!("ключ-{i}-\u{10FFFF}")),
            _ => ScopedKey::new(run.clone(), format!("{i}-{}", "x".repeat(1500))),
        };
        keys.push(key);
    }
    let ops: Vec<(usize, ScopedKey)> = (0..4)
        .flat_map(|_| keys.iter().cloned().enumerate())
        .collect();
    let barrier = Arc::new(Barrier::new(ops.len()));
    let tasks: Vec<_> = ops
        .into_iter()
        .enumerate()
        .map(|(n, (i, key))| {
            let (store, barrier) = (pick(n), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                (i, store.claim(&claim(&key)).await)
            })
        })
        .collect();
    let mut winners: Vec<Vec<FencingToken>> = vec![Vec::new(); keys.len()];
    let mut seen: Vec<Vec<FencingToken>> = vec![Vec::new(); keys.len()];
    for task in tasks {
        match task.await.expect("task") {
            (i, Ok(Claim::Acquired(lease))) => {
                assert_eq!(lease.attempt, 1);
                winners[i].push(lease.token);
            }
            (i, Ok(Claim::Existing { record, .. })) => {
                assert_eq!(record.key, keys[i], "an answer for another key");
                assert_eq!(record.status, RecordStatus::InProgress);
                seen[i].push(record.lease_token);
            }
            (i, Err(StoreError::Busy)) => seen[i].push(FencingToken::new(0)),
            (i, other) => panic!("{:?}: {other:?}", keys[i]),
        }
    }
    for (i, won) in winners.iter().enumerate() {
        assert_eq!(won.len(), 1, "{:?}: {} winners", keys[i], won.len());
        for token in &seen[i] {
            assert!(
                token.get() == 0 || *token == won[0],
                "{:?}: a loser saw another token",
                keys[i]
            );
        }
    }
    // Completions: the winner's and a stale one per key, all at once.
    let mut work = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        work.push((key.clone(), winners[i][0], true));
        work.push((
            key.clone(),
            FencingToken::new(winners[i][0].get() ^ 1),
            false,
        ));
    }
    let barrier = Arc::new(Barrier::new(work.len()));
    let tasks: Vec<_> = work
        .into_iter()
        .enumerate()
        .map(|(n, (key, token, good))| {
            let (store, barrier) = (pick(n + 1), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let out = store.complete(&key, token, &answer(&key), LONG).await;
                (key, good, out)
            })
        })
        .collect();
    for task in tasks {
        let (key, good, out) = task.await.expect("task");
        if good {
            out.unwrap_or_else(|e| panic!("{key:?}: the holder's completion failed: {e:?}"));
        } else {
            assert!(
                matches!(out, Err(StoreError::Fenced)),
                "{key:?}: stale complete gave {out:?}"
            );
        }
    }
    for key in &keys {
        let record = store.lookup(key).await.expect("lookup").expect("record");
        assert_eq!(record.status, RecordStatus::Completed);
        assert_eq!(
            record.response.expect("response").body,
            answer(key).body,
            "{key:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_held_pg_600_ops_on_keys_that_differ_in_bytes() {
    let Some(store) = common::postgres("tower_idempotency_bf_bytes").await else {
        return;
    };
    many_keys_in_bytes(vec![Arc::new(store.with_batching(Batching::default()))]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_held_pg_600_ops_max_batch_1_in_flight_1() {
    let Some(store) = common::postgres("tower_idempotency_bf_bytes").await else {
        return;
    };
    many_keys_in_bytes(vec![Arc::new(
        store.with_batching(Batching::default().in_flight(1).max_batch(1)),
    )])
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_held_sqlite_600_ops_on_keys_that_differ_in_bytes_three_stores_one_file() {
    let (store, path) = common::sqlite("batching-faults-bytes").await;
    // Three stores (own pools, own writer mutexes) on one file, answers checked on the first.
    let second = SqliteStore::connect(&format!("sqlite://{}", path.display()))
        .await
        .expect("second store")
        .with_batching(Batching::default());
    let third = SqliteStore::connect(&format!("sqlite://{}", path.display()))
        .await
        .expect("third store")
        .with_batching(Batching::default().in_flight(1));
    let store = store.with_batching(Batching::default());
    many_keys_in_bytes(vec![Arc::new(store), Arc::new(second), Arc::new(third)]).await;
}

/// Held: the inline claim's caller hangs up mid-statement (its row held elsewhere) while ten
/// claims queue behind it: they are all answered (Acquired), and the slot is free afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_held_pg_inline_caller_cancelled_while_others_queue() {
    let table = "tower_idempotency_bf_cancel";
    let Some(store) = common::postgres(table).await else {
        return;
    };
    let pool = store.pool().clone();
    let store = Arc::new(store.with_batching(Batching::default().in_flight(1)));
    let run = unique("cancel");
    let first = ScopedKey::new(run.clone(), "first");
    // Released, so the inline claim would take it over: it waits for the row's lock (a claim
    // that changes nothing reads the record without it).
    let token = acquire(&*store, &first).await;
    store.release(&first, token).await.expect("release");
    let mut tx = pool.begin().await.expect("begin");
    hold_row(&mut tx, table, &first).await;
    let inline = spawn_claim(&store, &first);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let keys: Vec<ScopedKey> = (0..10)
        .map(|i| ScopedKey::new(run.clone(), format!("k-{i}")))
        .collect();
    let tasks: Vec<_> = keys
        .iter()
        .map(|key| {
            let (store, req) = (store.clone(), claim(key));
            tokio::spawn(async move { store.claim(&req).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(20)).await;
    inline.abort();
    let _ = inline.await;
    for task in tasks {
        let out = tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("a queued claim answered")
            .expect("task");
        assert!(
            matches!(out, Ok(Claim::Acquired(ref l)) if l.attempt == 1),
            "{out:?}"
        );
    }
    tx.rollback().await.expect("rollback");
    let later = ScopedKey::new(run, "later");
    tokio::time::timeout(Duration::from_secs(5), acquire(&*store, &later))
        .await
        .expect("the slot is free again");
}

/// Held: claim batches and completion batches on the same keys at once (holders completing
/// while retries claim; locks taken in different orders): every holder's completion lands,
/// every retry sees the holder's record (or Busy), never Acquired, nothing hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_held_pg_claim_and_complete_batches_cross_on_the_same_keys() {
    let Some(store) = common::postgres("tower_idempotency_bf_cross").await else {
        return;
    };
    let store = Arc::new(store.with_batching(Batching::default().max_batch(16)));
    let run = unique("cross");
    // Keys whose order in the batch differs from their sort order.
    let keys: Vec<ScopedKey> = (0..120)
        .map(|i| ScopedKey::new(run.clone(), format!("{:03}", (i * 37) % 120)))
        .collect();
    let mut tokens = Vec::new();
    for key in &keys {
        tokens.push(acquire(&*store, key).await);
    }
    let barrier = Arc::new(Barrier::new(keys.len() * 3));
    let mut tasks = Vec::new();
    for (key, token) in keys.iter().zip(&tokens) {
        for role in 0..3 {
            let (store, barrier, key, token) =
                (store.clone(), barrier.clone(), key.clone(), *token);
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                if role == 0 {
                    let out = store.complete(&key, token, &answer(&key), LONG).await;
                    assert!(out.is_ok(), "{key:?}: the holder's completion: {out:?}");
                } else {
                    match store.claim(&claim(&key)).await {
                        Ok(Claim::Existing { record, .. }) => {
                            assert_eq!(record.key, key);
                            assert_eq!(record.lease_token, token, "{key:?}");
                        }
                        Ok(Claim::Completed { response, .. }) => {
                            assert_eq!(*response, answer(&key), "{key:?}: its own answer");
                        }
                        Err(StoreError::Busy) => {}
                        other => panic!("{key:?}: a retry got {other:?}"),
                    }
                }
            }));
        }
    }
    let all = async {
        for task in tasks {
            task.await.expect("task");
        }
    };
    tokio::time::timeout(Duration::from_secs(60), all)
        .await
        .expect("nothing hangs");
    for key in &keys {
        let record = store.lookup(key).await.expect("lookup").expect("record");
        assert_eq!(record.status, RecordStatus::Completed);
        assert_eq!(record.response.expect("response").body, answer(key).body);
    }
}

// ---------------------------------------------------------------------------------------------
// Fault guarded: a batch of claims that committed but whose answer was lost on the wire is sent
// again one by one with the same tokens: each finds its own live claim and answers `Existing`
// (in flight), not an error. Alone, the same fault answers `Unavailable`.
// ---------------------------------------------------------------------------------------------

/// A relay to PostgreSQL that, once armed, lets the next client write containing `pattern`
/// reach the server (which runs and commits it) and then closes the client's side unanswered.
async fn deafening_proxy(
    upstream: std::net::SocketAddr,
    pattern: &'static [u8],
) -> (std::net::SocketAddr, Arc<std::sync::atomic::AtomicBool>) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let armed = Arc::new(AtomicBool::new(false));
    let armed_accept = armed.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                continue;
            };
            let armed = armed_accept.clone();
            tokio::spawn(async move {
                let (mut client_r, client_w) = client.into_split();
                let (mut server_r, mut server_w) = server.into_split();
                let client_w = Arc::new(tokio::sync::Mutex::new(Some(client_w)));
                let deaf = Arc::new(AtomicBool::new(false));
                let down = {
                    let (client_w, deaf) = (client_w.clone(), deaf.clone());
                    tokio::spawn(async move {
                        let mut buf = vec![0u8; 64 * 1024];
                        loop {
                            let n = match server_r.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            if deaf.load(Ordering::SeqCst) {
                                continue;
                            }
                            let mut w = client_w.lock().await;
                            let Some(w) = w.as_mut() else { break };
                            if w.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                    })
                };
                let mut buf = vec![0u8; 64 * 1024];
                let mut prepared = false;
                loop {
                    let n = match client_r.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    // sqlx first prepares the statement (Parse, Describe, Sync) and waits
                    // for its description; the next write on the link runs it.
                    let hit = prepared;
                    prepared = !prepared
                        && buf[..n].windows(pattern.len()).any(|w| w == pattern)
                        && armed.swap(false, Ordering::SeqCst);
                    if hit {
                        deaf.store(true, Ordering::SeqCst);
                    }
                    if server_w.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                    if hit {
                        // The server runs and commits it; the client hears nothing, then EOF.
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        client_w.lock().await.take();
                        break;
                    }
                }
                let _ = down.await;
            });
        }
    });
    (addr, armed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_fault_pg_a_claim_batch_whose_answer_is_lost_answers_in_flight_for_its_own_claims() {
    let table = "tower_idempotency_bf_lost";
    let Some(direct) = common::postgres(table).await else {
        return;
    };
    let options: PgConnectOptions = common::postgres_url().parse().expect("postgres url");
    let upstream = tokio::net::lookup_host((options.get_host(), options.get_port()))
        .await
        .expect("resolve")
        .next()
        .expect("an address");
    let (addr, armed) = deafening_proxy(upstream, b"WITH ORDINALITY AS i(scope").await;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(options.host("127.0.0.1").port(addr.port()))
        .await
        .expect("connect through the relay");
    let store = Arc::new(
        PostgresStore::new(pool)
            .with_table(table)
            .expect("table")
            .with_batching(Batching::default().in_flight(1)),
    );
    let run = unique("lost");
    // The gate: a claim alone in the one slot, waiting (100 ms) for a row held elsewhere.
    let gate = ScopedKey::new(run.clone(), "gate");
    // Released, so the gate's claim would take it over and waits for the lock.
    let token = acquire(&direct, &gate).await;
    direct.release(&gate, token).await.expect("release");
    let mut tx = direct.pool().begin().await.expect("begin");
    hold_row(&mut tx, table, &gate).await;
    let gated = spawn_claim(&store, &gate);
    tokio::time::sleep(Duration::from_millis(20)).await;
    armed.store(true, std::sync::atomic::Ordering::SeqCst);
    let keys: Vec<ScopedKey> = (0..5)
        .map(|i| ScopedKey::new(run.clone(), format!("k-{i}")))
        .collect();
    let tasks: Vec<_> = keys
        .iter()
        .map(|key| {
            let (store, req) = (store.clone(), claim(key));
            tokio::spawn(async move { store.claim(&req).await })
        })
        .collect();
    let _ = gated.await;
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.expect("task"));
    }
    tx.rollback().await.expect("rollback");
    assert!(
        !armed.load(std::sync::atomic::Ordering::SeqCst),
        "the batch statement went through the relay"
    );
    for (key, out) in keys.iter().zip(&answers) {
        let record = direct.lookup(key).await.expect("lookup");
        eprintln!(
            "{key:?}: {:?} / stored {:?}",
            out.as_ref().map(|c| matches!(c, Claim::Acquired(_))),
            record.map(|r| r.status)
        );
    }
    for (key, out) in keys.iter().zip(answers) {
        assert!(
            matches!(
                out,
                Ok(Claim::Acquired(_)) | Err(StoreError::Unavailable(_))
            ),
            "{key:?}: the batch committed this claim but its answer was lost; alone the caller \
             gets Unavailable, batched it got {out:?}: told \"in flight\" about its own \
             orphaned claim (no one holds it until the lease runs out)"
        );
    }
}
