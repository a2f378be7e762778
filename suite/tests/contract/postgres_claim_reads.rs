//! DESIGN §5 on PostgreSQL: a claim that leaves its record as it is (a replay of a completed
//! record, a duplicate of one in flight, another request's key) is answered from a read. It
//! neither waits for the row's lock (a handler's own transaction, a completion, a crowd of
//! duplicates claiming together) nor writes the row; a claim that changes the record (a
//! released key taken over, an expired one claimed afresh) still takes the lock, and waits
//! for it as long as before. Alone and batched alike.

use crate::common;

use common::batching::{
    LONG, acquire, alone_or_batched, answer, claim, claim_together, claim_with, hold_row,
    through_proxy, unique, within,
};

use std::sync::Arc;
use std::time::Duration;

use sqlx::AssertSqlSafe;
use tower_idempotency::IdempotencyStore;
use tower_idempotency::store::{
    Batching, Claim, ClaimRequest, Fingerprint, LeaseExpiry, PostgresStore, RecordStatus,
    ScopedKey, StoreError,
};

const TABLE: &str = "tower_idempotency_claim_reads";

/// The five kinds of record a claim meets, one key each, in a run of their own.
struct Records {
    /// Completed, replayed by the same request.
    done: ScopedKey,
    /// In progress under a live lease: a duplicate waits for it.
    live: ScopedKey,
    /// Completed by another request (another fingerprint claims it).
    other: ScopedKey,
    /// Released by its holder: the same request takes it over.
    released: ScopedKey,
    /// Completed and expired: a claim starts it afresh.
    expired: ScopedKey,
}

impl Records {
    /// Writes the five records through `store`.
    async fn new(store: &PostgresStore, name: &str) -> Self {
        let run = unique(name);
        let key = |k: &str| ScopedKey::new(run.clone(), k);
        let records = Records {
            done: key("done"),
            live: key("live"),
            other: key("other"),
            released: key("released"),
            expired: key("expired"),
        };
        for k in [&records.done, &records.other, &records.expired] {
            let token = acquire(store, k).await;
            store
                .complete(k, token, &answer(k), LONG)
                .await
                .expect("complete");
        }
        acquire(store, &records.live).await;
        let token = acquire(store, &records.released).await;
        store
            .release(&records.released, token)
            .await
            .expect("release");
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {TABLE} SET expires_at = now() - interval '1 second' \
             WHERE scope = $1 AND key = $2"
        )))
        .bind(records.expired.scope().as_bytes())
        .bind(records.expired.key().as_bytes())
        .execute(store.pool())
        .await
        .expect("expire a record");
        records
    }

    /// The claims, in the order of [`Records::keys`]: `other` under another fingerprint.
    fn claims(&self) -> Vec<ClaimRequest> {
        let mut other = claim(&self.other);
        other.fingerprint = Fingerprint::from_bytes([9; 32]);
        vec![
            claim(&self.done),
            claim(&self.live),
            other,
            claim(&self.released),
            claim(&self.expired),
        ]
    }

    fn keys(&self) -> [&ScopedKey; 5] {
        [
            &self.done,
            &self.live,
            &self.other,
            &self.released,
            &self.expired,
        ]
    }
}

/// The row's physical version and its lock mark: a claim that locks or writes the row
/// changes them.
async fn version(store: &PostgresStore, key: &ScopedKey) -> (String, String) {
    sqlx::query_as(AssertSqlSafe(format!(
        "SELECT ctid::text, xmax::text FROM {TABLE} WHERE scope = $1 AND key = $2"
    )))
    .bind(key.scope().as_bytes())
    .bind(key.key().as_bytes())
    .fetch_one(store.pool())
    .await
    .expect("the row")
}

/// What the three claims that leave their records as they are answer.
fn assert_read(records: &Records, answers: &[Result<Claim, StoreError>], tag: &str) {
    match &answers[0] {
        Ok(Claim::Completed { response, .. }) => {
            assert_eq!(
                response.body,
                answer(&records.done).body,
                "{tag}: its own bytes"
            )
        }
        other => panic!("{tag}: a replay of a completed record, got {other:?}"),
    }
    match &answers[1] {
        Ok(Claim::Existing { record, .. }) => {
            assert_eq!(record.status, RecordStatus::InProgress, "{tag}");
            assert_eq!(record.attempts, 1, "{tag}: not taken over");
        }
        other => panic!("{tag}: a duplicate of a live record is in flight, got {other:?}"),
    }
    match &answers[2] {
        Ok(Claim::Completed { fingerprint, .. }) => assert_eq!(
            *fingerprint,
            Fingerprint::from_bytes([7; 32]),
            "{tag}: the first request's fingerprint, for a 422"
        ),
        other => panic!("{tag}: another request's completed record, got {other:?}"),
    }
}

/// Every claim of `records` while another transaction holds their rows, then the two that
/// change their records once it lets go.
async fn claims_against_held_rows<S: IdempotencyStore + 'static>(
    store: Arc<S>,
    plain: &PostgresStore,
    records: &Records,
    together: bool,
    tag: &str,
) {
    let mut tx = plain.pool().begin().await.expect("begin");
    for key in records.keys() {
        hold_row(&mut tx, TABLE, key).await;
    }
    let answers = if together {
        claim_together(&store, records.claims()).await
    } else {
        let mut answers = Vec::new();
        for req in records.claims() {
            answers.push(store.claim(&req).await);
        }
        answers
    };
    tx.rollback().await.expect("let go");
    assert_read(records, &answers, tag);
    for (i, what) in [(3, "a released key"), (4, "an expired key")] {
        assert!(
            matches!(answers[i], Err(StoreError::Busy)),
            "{tag}: {what} is changed under the row's lock, so it waits for it and answers \
             in flight, got {:?}",
            answers[i]
        );
    }
    // Let go: the claims that change their records take them.
    match store.claim(&claim(&records.released)).await {
        Ok(Claim::Acquired(lease)) => assert_eq!(lease.attempt, 2, "{tag}: taken over"),
        other => panic!("{tag}: the released key is taken over, got {other:?}"),
    }
    match store.claim(&claim(&records.expired)).await {
        Ok(Claim::Acquired(lease)) => assert_eq!(lease.attempt, 1, "{tag}: afresh"),
        other => panic!("{tag}: the expired key is claimed afresh, got {other:?}"),
    }
}

/// A handler's transaction (or a completion, or a crowd of duplicates) holding the rows: the
/// replay, the duplicate in flight and the other request's claim are answered at once from
/// what is committed; the released and expired keys wait for the lock (bounded) and answer in
/// flight. Alone, then batched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_postgres_claims_that_change_nothing_do_not_wait_for_a_held_row() {
    // A table of its own: another test's `migrate()` (DDL) would queue behind the held rows.
    let Some(plain) = common::postgres(TABLE).await else {
        return;
    };
    let records = Records::new(&plain, "held-alone").await;
    claims_against_held_rows(Arc::new(plain.clone()), &plain, &records, false, "alone").await;

    let records = Records::new(&plain, "held-batched").await;
    let batched = Arc::new(plain.clone().with_batching(Batching::default()));
    claims_against_held_rows(batched, &plain, &records, true, "batched").await;
}

/// A claim that leaves its record as it is writes nothing: the row keeps its version and
/// takes no lock mark (a conflict's lock would set its `xmax`), however many duplicates claim
/// it; a claim that takes a record over writes a new version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_postgres_replays_and_duplicates_write_nothing() {
    let Some(plain) = common::postgres(TABLE).await else {
        return;
    };
    let plain = Arc::new(plain);
    let batched = Arc::new((*plain).clone().with_batching(Batching::default()));
    let records = Records::new(&plain, "unwritten").await;
    let read_only = [&records.done, &records.live, &records.other];
    let mut before = Vec::new();
    for key in read_only {
        before.push(version(&plain, key).await);
    }
    // Alone, then many at once through the batched store.
    let claims = records.claims();
    let mut answers = Vec::new();
    for req in &claims[..3] {
        answers.push(plain.claim(req).await);
    }
    assert_read(&records, &answers, "alone");
    let crowd: Vec<ClaimRequest> = (0..30).flat_map(|_| claims[..3].to_vec()).collect();
    let answers = claim_together(&batched, crowd).await;
    for chunk in answers.chunks(3) {
        assert_read(&records, chunk, "batched");
    }
    for (key, before) in read_only.into_iter().zip(before) {
        assert_eq!(
            version(&plain, key).await,
            before,
            "{key:?}: a claim that changes nothing neither writes nor locks the row"
        );
    }
    // A lapsed lease on a reconciling route does change its record: it goes to
    // reconciliation, written under the lock.
    let lapsed = ScopedKey::new(unique("lapsed"), "k");
    let short = claim_with(
        &lapsed,
        Duration::from_millis(1),
        LONG,
        LeaseExpiry::Reconcile,
    );
    acquire(&*plain, &lapsed).await;
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {TABLE} SET lease_until = now() - interval '1 second', \
         reconcile_on_expiry = true WHERE scope = $1 AND key = $2"
    )))
    .bind(lapsed.scope().as_bytes())
    .bind(lapsed.key().as_bytes())
    .execute(plain.pool())
    .await
    .expect("lapse the lease");
    let lapsed_before = version(&plain, &lapsed).await;
    match plain.claim(&short).await {
        Ok(Claim::Existing { record, .. }) => {
            assert_eq!(record.status, RecordStatus::NeedsReconciliation)
        }
        other => panic!("a lapsed lease on a reconciling route, got {other:?}"),
    }
    assert_ne!(
        version(&plain, &lapsed).await,
        lapsed_before,
        "written under the lock"
    );
    // A takeover writes its record.
    let released_before = version(&plain, &records.released).await;
    let Ok(Claim::Acquired(_)) = plain.claim(&claims[3]).await else {
        panic!("the released key is taken over")
    };
    assert_ne!(version(&plain, &records.released).await, released_before);
}

/// What a claim that met the key taken over (by token 999) while it waited answers: the
/// record under the new holder, never the released record its statement first saw (it would
/// take that over: the claim goes again instead). In flight.
fn in_flight(record: &tower_idempotency::store::Record) -> bool {
    record.status == RecordStatus::InProgress && record.lease_token.get() == 999
}

/// The table of the queued claims' test: statements waiting on it are counted.
const QUEUED: &str = "tower_idempotency_claim_reads_queued";

/// Waits until at least `n` statements on `table` wait for a lock (an ordering aid, not a
/// measure: after 10 s it goes on, and the test's answers do not depend on it).
async fn waiting_for(plain: &PostgresStore, table: &str, n: i64) {
    for _ in 0..2000 {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND datname = current_database() AND position($1 in query) > 0",
        )
        .bind(table)
        .fetch_one(plain.pool())
        .await
        .expect("pg_stat_activity");
        if waiting >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits until no other session runs a statement on `table` (one whose client is gone ends
/// when it answers); an ordering aid like [`waiting_for`].
async fn no_statement_on(plain: &PostgresStore, table: &str) {
    for _ in 0..2000 {
        let running: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' \
             AND pid <> pg_backend_pid() AND datname = current_database() \
             AND position($1 in query) > 0",
        )
        .bind(table)
        .fetch_one(plain.pool())
        .await
        .expect("pg_stat_activity");
        if running == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The takeover the queued claims meet: another holder (token 999) under a live lease.
const TAKEN_OVER: &str = "status = 'in_progress', lease_token = 999, attempts = attempts + 1, \
                          lease_until = now() + interval '1 minute'";

/// `n` claims of a released key through `store`, queued behind two transactions on its row:
/// `first` holds it and writes `change` (a `SET` list), `second` queues for it, then the
/// claims; `first` commits while they wait, `second` gets the lock and keeps it past their
/// wait. The key and the claims' answers.
async fn queued_claims(
    plain: &PostgresStore,
    store: Arc<PostgresStore>,
    n: usize,
    change: &str,
) -> (ScopedKey, Vec<Result<Claim, StoreError>>) {
    let key = ScopedKey::new(unique("queued"), "k");
    let token = acquire(&*store, &key).await;
    store.release(&key, token).await.expect("release");
    let mut first = plain.pool().begin().await.expect("begin");
    hold_row(&mut first, QUEUED, &key).await;
    // The change, written now and committed while the claims wait (they see the record
    // released, which they would take over, so they queue for its lock).
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {QUEUED} SET {change} WHERE scope = $1 AND key = $2"
    )))
    .bind(key.scope().as_bytes())
    .bind(key.key().as_bytes())
    .execute(&mut *first)
    .await
    .expect("first changes the record");
    let (held_tx, held_rx) = tokio::sync::oneshot::channel();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let second = {
        let (pool, key) = (plain.pool().clone(), key.clone());
        tokio::spawn(async move {
            let mut second = pool.begin().await.expect("begin");
            // Queues behind `first`, then holds the row.
            hold_row(&mut second, QUEUED, &key).await;
            let _ = held_tx.send(());
            // Held until the claims have answered.
            let _ = done_rx.await;
            second.rollback().await.expect("second lets go");
        })
    };
    // Queued behind `first` before the claims.
    waiting_for(plain, QUEUED, 1).await;
    let claims: Vec<_> = (0..n)
        .map(|_| {
            let (store, req) = (store.clone(), claim(&key));
            tokio::spawn(async move { store.claim(&req).await })
        })
        .collect();
    // The claims queued too (or some of them: a batch waits as one statement), well
    // within their wait: `first` commits its change at once.
    waiting_for(plain, QUEUED, 2).await;
    first.commit().await.expect("first commits");
    held_rx.await.expect("second holds the row");
    let mut answers = Vec::new();
    for claim in claims {
        answers.push(claim.await.expect("claim task"));
    }
    let _ = done_tx.send(());
    second.await.expect("second");
    (key, answers)
}

/// Claims queued behind other transactions on their row give up after their bounded wait, as
/// before; if what is then committed is a record they would leave as it is, that answers them
/// (a crowd of duplicates queued on one row is answered, not refused: the kit's race, DESIGN
/// §5, at its worst). Here the row is released (a claim would take it over) and held by
/// `first`; `second` queues for it, then the claims; `first` takes the key over for another
/// holder and commits, `second` gets the lock and keeps it past the claims' wait: each claim
/// answers the key in flight, never an error, and none takes it over. One claim and a crowd
/// of 32, alone and batched (in the crowd, a claim may give up before the commit and answer
/// `Busy`: at least one answers from the committed record).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_postgres_claims_that_give_up_waiting_answer_from_what_is_committed() {
    let Some(plain) = common::postgres(QUEUED).await else {
        return;
    };
    // A connection for each claim, opened before they race: all of them queue on the row.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(40)
        .min_connections(36)
        .connect(&common::postgres_url())
        .await
        .expect("a pool");
    let mut open = Vec::new();
    for _ in 0..36 {
        open.push(pool.acquire().await.expect("a connection"));
    }
    drop(open);
    let wide = PostgresStore::new(pool).with_table(QUEUED).expect("table");
    for (batched, n) in [(false, 1), (true, 1), (false, 32), (true, 32)] {
        let tag = format!("batched {batched}, {n} claims");
        let store = alone_or_batched(&wide, batched);
        let (key, answers) = queued_claims(&plain, store.clone(), n, TAKEN_OVER).await;
        let mut answered = 0;
        for (i, answer) in answers.into_iter().enumerate() {
            match answer {
                Ok(Claim::Existing { record, .. }) => {
                    assert!(
                        in_flight(&record),
                        "{tag}: claim {i} in flight, got {record:?}"
                    );
                    answered += 1;
                }
                // In a crowd, a claim whose wait ran out before the commit (32 statements
                // planned at once on two cores can delay it) met a record it would change,
                // still held: in flight, as before.
                Err(StoreError::Busy) if n > 1 => {}
                other => panic!("{tag}: claim {i}: the key is in flight, got {other:?}"),
            }
        }
        // Every claim queued behind the lock answered `Busy` before the change.
        assert!(
            answered > 0,
            "{tag}: no claim answered from what is committed"
        );
        let record = store.lookup(&key).await.expect("lookup").expect("record");
        assert_eq!(
            (record.lease_token.get(), record.attempts),
            (999, 2),
            "{tag}: nothing taken over"
        );
    }
}

/// The read a claim makes after giving up waiting meets hostile bytes: the record committed
/// while it waited is completed with a response that does not decode. The claim fails closed
/// (unavailable: never `Busy` on a record it cannot read, never a replay of what it cannot
/// read, never a takeover), alone and batched, and the record stays as written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_postgres_a_claim_that_gives_up_and_reads_an_unreadable_record_fails_closed() {
    let Some(plain) = common::postgres(QUEUED).await else {
        return;
    };
    for batched in [false, true] {
        let store = alone_or_batched(&plain, batched);
        let (key, answers) = queued_claims(
            &plain,
            store,
            1,
            "status = 'completed', lease_token = 999, response = '\\xff'::bytea, \
             expires_at = now() + interval '1 hour'",
        )
        .await;
        assert!(
            matches!(answers[0], Err(StoreError::Unavailable(_))),
            "batched {batched}: an unreadable record fails the claim closed, got {:?}",
            answers[0]
        );
        let (status, token): (String, i64) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT status, lease_token FROM {QUEUED} WHERE scope = $1 AND key = $2"
        )))
        .bind(key.scope().as_bytes())
        .bind(key.key().as_bytes())
        .fetch_one(plain.pool())
        .await
        .expect("the row");
        assert_eq!(
            (status.as_str(), token),
            ("completed", 999),
            "batched {batched}: nothing written"
        );
    }
}

/// A claim that waits for a held row's lock loses its connection there (the proxy cut while it
/// waits, or while it reads what is committed after giving up): it fails closed, never
/// acquired nor answered from a record, alone and batched. The server may still finish the
/// statement once the row is let go (it learns of the lost client only when it answers): the
/// store gives that claim back (its answers were lost), or, where the give-back gave up before
/// the statement ran, the key is held by a lease nobody holds, and no claim takes it over
/// before that lease runs out; either way exactly one later claim takes the key over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_postgres_a_claim_cut_off_while_it_waits_for_a_lock_fails_closed() {
    // A table of its own: the proxy's store migrates it, and DDL would queue behind held rows.
    const CUT: &str = "tower_idempotency_claim_reads_cut";
    const LEASE: Duration = Duration::from_millis(500);
    let Some(plain) = common::postgres(CUT).await else {
        return;
    };
    let Some((through, proxy)) = through_proxy(CUT, 2).await else {
        return;
    };
    for batched in [false, true] {
        let store = alone_or_batched(&through, batched);
        let key = ScopedKey::new(unique("cut-mid-wait"), "k");
        let token = acquire(&plain, &key).await;
        plain.release(&key, token).await.expect("release");
        // Released: the claim would take it over, so it waits for the row.
        let mut tx = plain.pool().begin().await.expect("begin");
        hold_row(&mut tx, CUT, &key).await;
        let waiting = {
            let (store, req) = (
                store.clone(),
                claim_with(&key, LEASE, LONG, LeaseExpiry::Reclaim),
            );
            tokio::spawn(async move { store.claim(&req).await })
        };
        waiting_for(&plain, CUT, 1).await;
        proxy.cut();
        let answer = within(Duration::from_secs(30), waiting).await;
        // Cut while it waits or reads: unavailable. A host slow enough to let the wait run out
        // and the read finish before the cut answers in flight (the record would change).
        assert!(
            matches!(answer, Err(StoreError::Unavailable(_) | StoreError::Busy)),
            "batched {batched}: a claim cut off fails closed, got {answer:?}"
        );
        proxy.restore();
        tx.rollback().await.expect("let the row go");
        // The cut-off statement, if the server still ran it, finishes once the row is free.
        no_statement_on(&plain, CUT).await;
        let read = || async {
            let row: (String, i32) = sqlx::query_as(AssertSqlSafe(format!(
                "SELECT status, attempts FROM {CUT} WHERE scope = $1 AND key = $2"
            )))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .fetch_one(plain.pool())
            .await
            .expect("the row");
            row
        };
        // The give-back, if it is still trying, lands within a few hundred milliseconds.
        let mut row = read().await;
        for _ in 0..40 {
            if row.0 != "in_progress" {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            row = read().await;
        }
        let next = match (row.0.as_str(), row.1) {
            ("released", 1) => 2,
            // The orphan, given back.
            ("released", 2) => 3,
            ("in_progress", 2) => {
                // The orphan's lease: nobody runs the key while it lasts.
                let racers = claim_together(&store, (0..8).map(|_| claim(&key)).collect()).await;
                assert!(
                    racers.iter().all(|answer| matches!(
                        answer,
                        Ok(Claim::Existing { record, .. }) if record.status == RecordStatus::InProgress
                    )),
                    "batched {batched}: in flight under the orphan's lease: {racers:?}"
                );
                tokio::time::sleep(LEASE + Duration::from_millis(100)).await;
                3
            }
            other => panic!("batched {batched}: the record after the cut: {other:?}"),
        };
        let takeovers = claim_together(&store, (0..8).map(|_| claim(&key)).collect()).await;
        let acquired: Vec<u32> = takeovers
            .iter()
            .filter_map(|answer| match answer {
                Ok(Claim::Acquired(lease)) => Some(lease.attempt),
                _ => None,
            })
            .collect();
        assert_eq!(
            acquired,
            vec![next],
            "batched {batched}: one takeover: {takeovers:?}"
        );
    }
}

/// DESIGN §1.6 and §5: a claim that committed but whose reply was lost with its connection
/// is asked again with the same token, and answers as this claim's own (attempt 1, the
/// lease its holder can write under), alone and batched, on a route that reconciles an
/// expired lease too. Before, the request was refused 503 and the key held for a lease by
/// a claim nobody heard: in flight for nothing, then (reconciling) "outcome unknown".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_postgres_a_claim_whose_reply_is_lost_is_asked_again_as_its_own() {
    const LOST: &str = "tower_idempotency_claim_reads_lost";
    for batched in [false, true] {
        for expiry in [LeaseExpiry::Reclaim, LeaseExpiry::Reconcile] {
            // A pool of its own, whose connections have not prepared the claim yet.
            let Some((through, proxy)) = through_proxy(LOST, 2).await else {
                return;
            };
            let store = alone_or_batched(&through, batched);
            let key = ScopedKey::new(unique("lost-reply"), "k");
            // The claim's text, as the statement's Parse carries it.
            proxy.lose_reply_to(b"AS r (scope, key, fingerprint, status");
            let before = proxy.statements();
            let claimed = store.claim(&claim_with(&key, LONG, LONG, expiry)).await;
            let ran = proxy.statements() - before;
            let lease = match claimed {
                Ok(Claim::Acquired(lease)) => lease,
                other => panic!("batched {batched}, {expiry:?}: {other:?}"),
            };
            assert_eq!(proxy.lost(), 1, "batched {batched}: a reply was lost");
            // The claim ran before its reply was lost, and was asked again.
            assert_eq!(ran, 2, "batched {batched}, {expiry:?}: the claim ran twice");
            assert_eq!(lease.attempt, 1, "batched {batched}, {expiry:?}");
            let record = store.lookup(&key).await.expect("lookup").expect("record");
            assert_eq!(
                (record.status, record.lease_token, record.attempts),
                (RecordStatus::InProgress, lease.token, 1),
                "batched {batched}, {expiry:?}"
            );
            store
                .complete(&key, lease.token, &answer(&key), LONG)
                .await
                .expect("its holder records");
        }
    }
}

/// DESIGN §1.6 and §5: a claim whose reply is lost twice (it landed, and so did its asking
/// again with the same token) is refused, and what landed is given back at once: released,
/// not held in flight for its lease by a claim nobody heard and then, on a route that
/// reconciles, set aside as "outcome unknown" though nothing ran. Alone and batched. Before,
/// the record stayed in flight until its (here one-minute) lease ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_postgres_a_claim_unheard_twice_is_refused_and_given_back() {
    const UNHEARD: &str = "tower_idempotency_claim_reads_unheard";
    for batched in [false, true] {
        let Some((through, proxy)) = through_proxy(UNHEARD, 2).await else {
            return;
        };
        let store = alone_or_batched(&through, batched);
        let key = ScopedKey::new(unique("unheard"), "k");
        proxy.lose_replies_to(b"AS r (scope, key, fingerprint, status", 2);
        let claimed = store
            .claim(&claim_with(&key, LONG, LONG, LeaseExpiry::Reconcile))
            .await;
        assert!(
            matches!(claimed, Err(StoreError::Unavailable(_))),
            "batched {batched}: {claimed:?}"
        );
        assert_eq!(proxy.lost(), 2, "batched {batched}: both replies were lost");
        // Given back on a task of its own, within a few tries; the lease is a minute.
        let mut record = None;
        for _ in 0..100 {
            record = store.lookup(&key).await.expect("lookup");
            if record
                .as_ref()
                .is_some_and(|r| r.status != RecordStatus::InProgress)
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let record = record.expect("the claim landed");
        assert_eq!(
            (record.status, record.attempts),
            (RecordStatus::Released, 1),
            "batched {batched}: what landed is given back"
        );
        // The retry runs as the next attempt, on a route that reconciles.
        match store
            .claim(&claim_with(&key, LONG, LONG, LeaseExpiry::Reconcile))
            .await
        {
            Ok(Claim::Acquired(lease)) => assert_eq!(lease.attempt, 2, "batched {batched}"),
            other => panic!("batched {batched}: the retry: {other:?}"),
        }
    }
}
