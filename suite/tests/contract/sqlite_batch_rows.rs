//! Issue 23 §4 (DESIGN §5): a batched `SqliteStore` sends a chunk of a batch as one upsert and
//! reads its records back in one row. Each claim must still get exactly what it would get
//! alone, whatever state its key is in and however the batch is cut into chunks; completions
//! sent together must be fenced one by one; a response too big to read back in the batch's row
//! is answered by a claim of its own, whole.

use crate::common;

use common::batching::{
    LONG, acquired, answer, claim, claim_together, claim_with, complete_together, recorded, unique,
};

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Barrier;
use tower_idempotency::IdempotencyStore;
use tower_idempotency::store::{
    Batching, Claim, ClaimRequest, FencingToken, Fingerprint, HistoryEvent, LeaseExpiry,
    RecordStatus, ScopedKey, SqliteStore, StoreError, StoredResponse,
};

/// How long the short leases and TTLs here last, and how long to wait for them to run out.
const SHORT: Duration = Duration::from_millis(60);
const PAST_SHORT: Duration = Duration::from_millis(250);

/// What a key is left as before the batch claims it.
#[derive(Clone, Copy, Debug)]
enum State {
    Fresh,
    Completed,
    /// Completed, and claimed again with another fingerprint.
    CompletedOtherFingerprint,
    /// Completed with a response too big for the batch's row.
    CompletedBig,
    InProgress,
    Released,
    /// In progress under a lease that ran out: taken over.
    Lapsed,
    /// The same on a route that reconciles instead: awaiting reconciliation.
    LapsedReconcile,
    /// Completed under a TTL that ran out: absent.
    Expired,
    /// In progress, its history made text that is not UTF-8 (a hand-edited row): it fails its
    /// own claim, not the others of its batch.
    Corrupt,
}

const STATES: [State; 10] = [
    State::Fresh,
    State::Completed,
    State::CompletedOtherFingerprint,
    State::CompletedBig,
    State::InProgress,
    State::Released,
    State::Lapsed,
    State::LapsedReconcile,
    State::Expired,
    State::Corrupt,
];

/// A response over the 64 KiB a batch reads back in its row, naming its key.
fn big(key: &ScopedKey) -> StoredResponse {
    let mut body = format!("big answer for {:?};", key.key()).into_bytes();
    body.resize(100 * 1024, b'.');
    StoredResponse {
        body: Some(Bytes::from(body)),
        ..answer(key)
    }
}

/// Leaves `key` in `state` (its lease or TTL still to run out, for the states time makes).
async fn prepare<S: IdempotencyStore>(store: &S, key: &ScopedKey, state: State) {
    match state {
        State::Fresh => {}
        State::Completed | State::CompletedOtherFingerprint => {
            recorded(store, &claim(key), &answer(key), LONG).await;
        }
        State::CompletedBig => {
            recorded(store, &claim(key), &big(key), LONG).await;
        }
        State::InProgress | State::Corrupt => {
            acquired(store, &claim(key)).await;
        }
        State::Released => {
            let token = acquired(store, &claim(key)).await;
            store.release(key, token).await.expect("release");
        }
        State::Lapsed => {
            acquired(store, &claim_with(key, SHORT, LONG, LeaseExpiry::Reclaim)).await;
        }
        State::LapsedReconcile => {
            acquired(store, &claim_with(key, SHORT, LONG, LeaseExpiry::Reconcile)).await;
        }
        State::Expired => {
            recorded(
                store,
                &claim_with(key, SHORT, SHORT, LeaseExpiry::Reclaim),
                &answer(key),
                SHORT,
            )
            .await;
        }
    }
}

/// The claim a key in `state` is sent.
fn claim_for(key: &ScopedKey, state: State) -> ClaimRequest {
    match state {
        State::CompletedOtherFingerprint => ClaimRequest {
            fingerprint: Fingerprint::from_bytes([9; 32]),
            ..claim(key)
        },
        State::LapsedReconcile => claim_with(key, LONG, LONG, LeaseExpiry::Reconcile),
        _ => claim(key),
    }
}

/// A claim's answer without what differs between two stores (tokens, times): the kind, the
/// attempt, the status, the fingerprint, and whether the response is the key's own.
fn shape(key: &ScopedKey, state: State, claimed: Result<Claim, StoreError>) -> String {
    match claimed {
        Ok(Claim::Acquired(lease)) => format!("acquired, attempt {}", lease.attempt),
        Ok(Claim::Completed {
            fingerprint,
            response,
        }) => {
            let own = match state {
                State::CompletedBig => big(key),
                _ => answer(key),
            };
            format!(
                "completed, fingerprint {:?}, its own response: {}",
                fingerprint.as_bytes()[0],
                response.status == own.status && response.body == own.body
            )
        }
        Ok(Claim::Existing { record, .. }) => format!(
            "existing {:?}, attempt {}, its own key: {}",
            record.status,
            record.attempts,
            &record.key == key
        ),
        // By kind: a row that does not read is named in sqlx's words alone, in the store's own
        // in a batch (which reads the chunk's records in one row).
        Err(error) => format!(
            "error {}",
            match error {
                StoreError::Fenced => "fenced",
                StoreError::Full => "full",
                StoreError::Busy => "busy",
                _ => "unavailable",
            }
        ),
    }
}

async fn sqlite(name: &str) -> SqliteStore {
    common::sqlite(name).await.0
}

/// Every state a claim can find, in batches of sizes that cut into chunks every way (one
/// chunk, several, a chunk of one), claimed all at once on a batched store and one by one on a
/// store that does not batch: each key's answer is the same on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_sqlite_a_batch_answers_each_claim_as_alone() {
    let mut seen = Vec::new();
    for size in [2usize, 3, 7, 45, 64, 100] {
        let batched = Arc::new(
            sqlite(&format!("rows-batched-{size}"))
                .await
                .with_batching(Batching::default()),
        );
        let alone = sqlite(&format!("rows-alone-{size}")).await;
        let run = unique(&format!("rows-{size}"));
        let keys: Vec<(ScopedKey, State)> = (0..size)
            .map(|i| {
                // Spread the states over the batch, not in the same order every size.
                let state = STATES[(i * 7 + size) % STATES.len()];
                (ScopedKey::new(run.clone(), format!("{i}-{state:?}")), state)
            })
            .collect();
        for (key, state) in &keys {
            prepare(&*batched, key, *state).await;
            prepare(&alone, key, *state).await;
            if let State::Corrupt = state {
                for pool in [batched.pool(), alone.pool()] {
                    sqlx::query(
                        "UPDATE idempotency_records SET history = CAST(x'ff' AS TEXT)
                         WHERE scope = ?1 AND key = ?2",
                    )
                    .bind(key.scope().as_bytes())
                    .bind(key.key().as_bytes())
                    .execute(pool)
                    .await
                    .expect("corrupt the row");
                }
            }
        }
        tokio::time::sleep(PAST_SHORT).await;

        let reqs = keys.iter().map(|(key, state)| claim_for(key, *state));
        let claimed = claim_together(&batched, reqs.collect()).await;
        let together: Vec<String> = keys
            .iter()
            .zip(claimed)
            .map(|((key, state), claimed)| shape(key, *state, claimed))
            .collect();
        for ((key, state), got) in keys.iter().zip(&together) {
            let expected = shape(key, *state, alone.claim(&claim_for(key, *state)).await);
            assert_eq!(
                got, &expected,
                "{key:?} ({state:?}), in a batch of {size}: answered as alone"
            );
        }
        seen.extend(together);
    }
    // Not vacuous: the batches won keys, replayed, found records standing, and failed a row.
    for kind in ["acquired", "completed", "existing", "error"] {
        assert!(
            seen.iter().any(|s| s.starts_with(kind)),
            "no claim answered {kind}: {seen:?}"
        );
    }
}

/// Completions sent together, some of them with a token that lost its key: each written or
/// fenced by its own token, and the fenced keys' records untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_sqlite_completions_sent_together_are_fenced_one_by_one() {
    let store = Arc::new(
        sqlite("rows-fenced")
            .await
            .with_batching(Batching::default()),
    );
    let run = unique("rows-fenced");
    let mut held = Vec::new();
    for i in 0..48 {
        let key = ScopedKey::new(run.clone(), format!("{i}"));
        let token = acquired(&*store, &claim(&key)).await;
        held.push((key, token));
    }
    // Every third completion carries a token that is not the holder's.
    let stale = |i: usize| i % 3 == 1;
    let sent: Vec<(ScopedKey, FencingToken)> = held
        .iter()
        .enumerate()
        .map(|(i, (key, token))| match stale(i) {
            true => (key.clone(), FencingToken::new(token.get() ^ 1)),
            false => (key.clone(), *token),
        })
        .collect();
    for (i, completed) in complete_together(&store, &sent)
        .await
        .into_iter()
        .enumerate()
    {
        match stale(i) {
            true => assert!(
                matches!(completed, Err(StoreError::Fenced)),
                "completion {i} with a stale token: {completed:?}"
            ),
            false => assert!(completed.is_ok(), "completion {i}: {completed:?}"),
        }
    }
    for (i, (key, _)) in held.iter().enumerate() {
        let record = store.lookup(key).await.expect("lookup").expect("record");
        match stale(i) {
            true => {
                assert_eq!(record.status, RecordStatus::InProgress, "{key:?}");
                assert!(record.response.is_none(), "{key:?}: nothing written");
            }
            false => {
                assert_eq!(record.status, RecordStatus::Completed, "{key:?}");
                assert_eq!(
                    record.response.map(|r| r.body),
                    Some(answer(key).body),
                    "{key:?}: its own answer"
                );
            }
        }
    }
}

/// 64 claims and then 64 completions of fresh keys, all at once: a batched store sends each
/// chunk of a batch as one statement (claims: an upsert and a read), where a store that does
/// not batch sends a statement per operation. Counted from sqlx's own log of what it ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_sqlite_a_batch_goes_in_few_statements() {
    let mut sent = Vec::new();
    for batching in [false, true] {
        let table = format!(
            "counted_{}",
            unique(if batching { "batched" } else { "alone" })
        )
        .replace('-', "_");
        let store = sqlite(&table)
            .await
            .with_table(&table)
            .expect("a table name");
        store.migrate().await.expect("migrate");
        let store = Arc::new(match batching {
            true => store.with_batching(Batching::default()),
            false => store,
        });
        common::statements::watch(&table);
        let keys: Vec<ScopedKey> = (0..64)
            .map(|i| ScopedKey::new(table.clone(), format!("{i}")))
            .collect();
        let barrier = Arc::new(Barrier::new(keys.len()));
        let tasks: Vec<_> = keys
            .iter()
            .map(|key| {
                let (store, barrier, key) = (store.clone(), barrier.clone(), key.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    let token = acquired(&*store, &claim(&key)).await;
                    store.complete(&key, token, &answer(&key), LONG).await
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("task").expect("completed");
        }
        for key in &keys {
            let record = store.lookup(key).await.expect("lookup").expect("record");
            assert_eq!(record.status, RecordStatus::Completed, "{key:?}");
        }
        // The lookups above name the table too: leave them out.
        sent.push(count(&table) - keys.len());
    }
    let (alone, batched) = (sent[0], sent[1]);
    assert!(
        alone >= 128,
        "a store that does not batch: a statement per claim and per completion, {alone} counted"
    );
    assert!(
        batched * 4 <= alone,
        "a batched store: {batched} statements against {alone} one by one"
    );
}

fn count(table: &str) -> usize {
    common::statements::count(table, "")
}

/// A batch that fails at its very last step, the commit, after its chunks' upserts and reads
/// ran: nothing of it stays, and each of its operations goes alone, as if the batch had never
/// been. A key whose own commit fails is answered unavailable and left as it was; every other
/// key is claimed once (attempt 1, one `claimed` in its history) and completed once, with its
/// own answer. The commit is made to fail by SQLite itself: triggers that, for some keys,
/// break a deferred foreign key, which SQLite checks only when the transaction commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_sqlite_a_batch_whose_commit_fails_leaves_nothing_and_goes_alone() {
    let table = format!("doomed_{}", unique("commit")).replace('-', "_");
    let store = sqlite(&table)
        .await
        .with_table(&table)
        .expect("a table name");
    store.migrate().await.expect("migrate");
    for statement in [
        "CREATE TABLE doom_parent (id INTEGER PRIMARY KEY)".to_owned(),
        "CREATE TABLE doom_child (parent INTEGER REFERENCES doom_parent (id)
           DEFERRABLE INITIALLY DEFERRED)"
            .to_owned(),
        format!(
            "CREATE TRIGGER doom_claim AFTER INSERT ON \"{table}\"
               WHEN CAST(NEW.key AS TEXT) LIKE 'doomed-claim%'
             BEGIN INSERT INTO doom_child VALUES (1); END"
        ),
        format!(
            "CREATE TRIGGER doom_complete AFTER UPDATE OF status ON \"{table}\"
               WHEN NEW.status = 'completed' AND CAST(NEW.key AS TEXT) LIKE 'doomed-complete%'
             BEGIN INSERT INTO doom_child VALUES (1); END"
        ),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(statement))
            .execute(store.pool())
            .await
            .expect("set up the doom");
    }
    let store = Arc::new(store.with_batching(Batching::default()));
    common::statements::watch(&table);
    let key = |name: String| ScopedKey::new("doom", name);
    // Not vacuous: a doomed key fails alone, at its commit.
    let alone = store.claim(&claim(&key("doomed-claim-alone".into()))).await;
    assert!(
        matches!(alone, Err(StoreError::Unavailable(_))),
        "the trigger fails a doomed claim's commit: {alone:?}"
    );

    // Claims: 36 that commit alone, 4 whose commit fails, 4 whose completion will.
    let keys: Vec<ScopedKey> = (0..44)
        .map(|i| match i % 11 {
            3 => key(format!("doomed-claim-{i}")),
            7 => key(format!("doomed-complete-{i}")),
            _ => key(format!("fine-{i}")),
        })
        .collect();
    let claims_before = common::statements::count(&table, "json_group_array");
    let claimed = claim_together(&store, keys.iter().map(claim).collect()).await;
    let mut held = Vec::new();
    for (key, claimed) in keys.iter().zip(claimed) {
        if key.key().starts_with("doomed-claim") {
            assert!(
                matches!(claimed, Err(StoreError::Unavailable(_))),
                "{key:?}: its commit fails, alone too: {claimed:?}"
            );
            assert!(
                store.lookup(key).await.expect("lookup").is_none(),
                "{key:?}: nothing of the failed commit stays"
            );
            continue;
        }
        match claimed {
            Ok(Claim::Acquired(lease)) => {
                assert_eq!(lease.attempt, 1, "{key:?}: claimed once");
                held.push((key.clone(), lease.token));
            }
            other => panic!("{key:?}: expected Acquired, got {other:?}"),
        }
    }
    assert!(
        common::statements::count(&table, "json_group_array") > claims_before,
        "the claims went in a batch whose chunk ran before its commit failed"
    );

    // Completions: those of the doomed-complete keys fail their batch's commit.
    let completes_before = common::statements::count(&table, "v.column4");
    let completed = complete_together(&store, &held).await;
    for ((key, _), completed) in held.iter().zip(completed) {
        let record = store.lookup(key).await.expect("lookup").expect("record");
        let claimed = record
            .history
            .iter()
            .filter(|entry| entry.event == HistoryEvent::Claimed)
            .count();
        assert_eq!(claimed, 1, "{key:?}: one claim in its history");
        assert_eq!(record.attempts, 1, "{key:?}");
        if key.key().starts_with("doomed-complete") {
            assert!(
                matches!(completed, Err(StoreError::Unavailable(_))),
                "{key:?}: its commit fails, alone too: {completed:?}"
            );
            assert_eq!(
                record.status,
                RecordStatus::InProgress,
                "{key:?}: left as it was"
            );
            assert!(record.response.is_none(), "{key:?}");
        } else {
            assert!(completed.is_ok(), "{key:?}: {completed:?}");
            assert_eq!(record.status, RecordStatus::Completed, "{key:?}");
            assert_eq!(
                record.response.map(|r| r.body),
                Some(answer(key).body),
                "{key:?}: its own answer, once"
            );
        }
    }
    assert!(
        common::statements::count(&table, "v.column4") > completes_before,
        "the completions went in a batch whose chunk ran before its commit failed"
    );
}
