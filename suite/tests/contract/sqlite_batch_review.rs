//! Review of issue 23 §4's chunked batches on `SqliteStore`: a chunk of claims is one upsert and
//! one read answered in a single JSON row, a chunk of completions one `UPDATE … FROM (VALUES …)`.
//! Each test sends a batch whose order (and so whose chunks) it fixes, on a store that batches,
//! and the same operations one by one on a store that does not: every operation must get the
//! answer it gets alone, and every record must end the same.
//!
//! How a batch is made, deterministically: with one batch in flight, a first claim (or
//! completion) of a key of its own goes alone on the caller's task; every operation polled
//! after it, while it is in flight, queues, in the order polled, and the queue goes as one
//! batch when it is done (a write lock held for a moment on the database makes sure the first
//! is still in flight). The chunk statements sqlx ran are counted (from its `sqlx::query`
//! events), so a test that did not batch fails rather than passing vacuously.

use crate::common;

use common::batching::{LONG, acquired, answer, claim, claim_with, recorded, unique};

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use tower_idempotency::IdempotencyStore;
use tower_idempotency::store::{
    Batching, Claim, ClaimRequest, FencingToken, Fingerprint, LeaseExpiry, Milestone, Record,
    RecordStatus, Resolution, ScopedKey, SqliteStore, StoreError, StoredResponse,
};

/// How long the short leases and TTLs here last, and how long to wait for them to run out.
const SHORT: Duration = Duration::from_millis(60);
const PAST_SHORT: Duration = Duration::from_millis(300);

/// Strings a text column holds that JSON has to escape, or that SQLite's JSON might mangle.
const AWKWARD: &str = "q\"uote\\back'single\u{0}nul\u{1}\u{1f}ctl\u{7f}del\u{2028}ls\u{2029}ps\
                       \u{1F600}emoji]}{[,:\"\\u0000 é e\u{301} \u{FEFF}bom";

/// What marks a statement of a batch's chunk (counted with `common::statements`): the chunk's
/// read of claims, the chunk's update of completions.
const CLAIM_CHUNK: &str = "json_group_array";
const COMPLETE_CHUNK: &str = "v.column4";

use common::statements as counted;

/// A store that batches and one that does not, each on a file of its own, in one table name.
struct Pair {
    batched: SqliteStore,
    alone: SqliteStore,
    table: String,
    files: Vec<std::path::PathBuf>,
}

impl Drop for Pair {
    fn drop(&mut self) {
        for file in &self.files {
            for suffix in ["", "-wal", "-shm"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", file.display()));
            }
        }
    }
}

async fn pair(name: &str) -> Pair {
    let table = format!("r_{}", unique(name).replace('-', "_"));
    let open = |suffix: &'static str| {
        let table = table.clone();
        async move {
            let (store, file) = common::sqlite(&format!("{name}-{suffix}")).await;
            let store = store.with_table(&table).expect("a table name");
            store.migrate().await.expect("migrate");
            (store, file)
        }
    };
    let (batched, batched_file) = open("batched").await;
    let batched = batched.with_batching(Batching::default().in_flight(1).max_batch(256));
    let (alone, alone_file) = open("alone").await;
    counted::watch(&table);
    Pair {
        batched,
        alone,
        table,
        files: vec![batched_file, alone_file],
    }
}

/// Polls `futures` in their order until each is ready: the first poll of each, in order, is
/// what queues an operation behind a batch.
async fn in_order<F: Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (future, out) in futures.iter_mut().zip(out.iter_mut()) {
            if out.is_none() {
                match future.as_mut().poll(cx) {
                    Poll::Ready(v) => *out = Some(v),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    out.into_iter().map(|o| o.expect("ready")).collect()
}

/// Polls `futures` in order behind a write lock held on `store`'s database, which it lets go
/// of a moment later: the first operation, gone alone, waits for the lock, so every other one
/// queues behind it, in order, and they go as one batch (per key) when it is done.
async fn behind_a_held_lock<F: Future>(store: &SqliteStore, futures: Vec<F>) -> Vec<F::Output> {
    let lock = store
        .pool()
        .begin_with("BEGIN IMMEDIATE")
        .await
        .expect("hold the write lock");
    let release = async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        lock.commit().await.expect("let go of the write lock");
    };
    let (out, ()) = common::guard("a burst", async {
        tokio::join!(in_order(futures), release)
    })
    .await;
    out
}

/// The sizes of the chunks a batch of `n` is sent in that are read (or written) together: the
/// store's cut (64, 32, …, 2, then a single operation alone).
fn chunks_together(mut n: usize) -> usize {
    let mut count = 0;
    for size in [64, 32, 16, 8, 4, 2] {
        while n >= size {
            n -= size;
            count += 1;
        }
    }
    count
}

/// `reqs` claimed on the batched `store` in one batch (and, for a key claimed twice, the next
/// batch), in this order, behind a first claim of a key of its own that goes alone.
async fn claim_burst(store: &SqliteStore, reqs: &[ClaimRequest]) -> Vec<Result<Claim, StoreError>> {
    let lead = claim(&ScopedKey::new("lead", unique("lead")));
    let all: Vec<&ClaimRequest> = std::iter::once(&lead).chain(reqs).collect();
    let claims = all.iter().map(|req| store.claim(req)).collect();
    let mut out = behind_a_held_lock(store, claims).await;
    let first = out.remove(0);
    assert!(
        matches!(first, Ok(Claim::Acquired(_))),
        "the leading claim: {first:?}"
    );
    out
}

/// A completion to send: the key, the token it carries, the response.
type Completion = (ScopedKey, FencingToken, StoredResponse);

/// `ops` completed on the batched `store` in one batch, in this order, behind a first
/// completion of a key of its own that goes alone.
async fn complete_burst(store: &SqliteStore, ops: &[Completion]) -> Vec<Result<(), StoreError>> {
    let lead = ScopedKey::new("lead", unique("lead-complete"));
    let token = acquired(store, &claim(&lead)).await;
    let lead = (lead.clone(), token, answer(&lead));
    let all: Vec<&Completion> = std::iter::once(&lead).chain(ops).collect();
    let completions = all
        .iter()
        .map(|(key, token, response)| store.complete(key, *token, response, LONG))
        .collect();
    let mut out = behind_a_held_lock(store, completions).await;
    let first = out.remove(0);
    assert!(first.is_ok(), "the leading completion: {first:?}");
    out
}

fn with_fingerprint(req: ClaimRequest, fingerprint: [u8; 32]) -> ClaimRequest {
    ClaimRequest {
        fingerprint: Fingerprint::from_bytes(fingerprint),
        ..req
    }
}

/// A fingerprint that differs from [`claim`]'s in its last byte only.
fn last_byte_differs() -> [u8; 32] {
    let mut fingerprint = [7; 32];
    fingerprint[31] = 8;
    fingerprint
}

/// Names for the tokens a test has seen, per store: a history entry or a record that shows a
/// token shows whose it is (a token of another key would show that key's index).
#[derive(Clone, Default)]
struct Labels(HashMap<u64, String>);

impl Labels {
    fn add(&mut self, token: FencingToken, label: String) {
        self.0.insert(token.get(), label);
    }

    fn of(&self, token: FencingToken) -> String {
        self.0
            .get(&token.get())
            .cloned()
            .unwrap_or_else(|| "?".into())
    }
}

/// FNV-1a, to name a body without printing it.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn describe_response(response: &StoredResponse) -> String {
    format!(
        "{} headers {:?} body {:?} trailers {:?}",
        response.status,
        response.headers,
        response.body.as_ref().map(|b| (b.len(), fnv(b))),
        response.trailers
    )
}

/// A record without what differs between two stores (times, tokens: named by `labels`).
fn describe_record(record: &Record, own: &ScopedKey, labels: &Labels) -> String {
    let history: Vec<String> = record
        .history
        .iter()
        .map(|e| format!("{} {} {}", e.attempt, labels.of(e.token), e.event))
        .collect();
    format!(
        "{:?} attempts {} fingerprint {:?} effect {} downstream {:?} note {:?} response {:?} \
         own key {} token {} history {history:?}",
        record.status,
        record.attempts,
        record.fingerprint.as_bytes(),
        record.effect_started,
        record.downstream_id,
        record.resolution_note,
        record.response.as_ref().map(describe_response),
        &record.key == own,
        labels.of(record.lease_token),
    )
}

/// A claim's answer without what differs between two stores.
fn describe_claim(claimed: &Result<Claim, StoreError>, own: &ScopedKey, labels: &Labels) -> String {
    match claimed {
        Ok(Claim::Acquired(lease)) => format!("acquired, attempt {}", lease.attempt),
        Ok(Claim::Completed {
            fingerprint,
            response,
        }) => format!(
            "completed, fingerprint {:?}, {}",
            fingerprint.as_bytes(),
            describe_response(response)
        ),
        Ok(Claim::Existing { record, .. }) => {
            format!("existing {}", describe_record(record, own, labels))
        }
        // By kind: the batch's read and the single claim's word a row that does not read
        // differently.
        Err(error) => format!("error {}", error_kind(error)),
    }
}

fn error_kind(error: &StoreError) -> &'static str {
    match error {
        StoreError::Fenced => "fenced",
        StoreError::Unavailable(_) => "unavailable",
        _ => "other",
    }
}

fn describe_lookup(
    found: &Result<Option<Record>, StoreError>,
    own: &ScopedKey,
    labels: &Labels,
) -> String {
    match found {
        Ok(Some(record)) => describe_record(record, own, labels),
        Ok(None) => "absent".into(),
        Err(error) => format!("error {}", error_kind(error)),
    }
}

/// What a key is left as before the batch claims it, and how it is then claimed.
#[derive(Clone, Copy, Debug)]
enum State {
    Fresh,
    Completed,
    /// Completed, and claimed again with another fingerprint.
    CompletedOtherFingerprint,
    /// Completed, and claimed again with a fingerprint one byte off.
    CompletedLastByte,
    /// Completed, then completed again by its holder with another answer.
    CompletedTwice,
    /// Completed with a response of exactly this many stored bytes.
    CompletedSized(usize),
    InProgress,
    /// In progress under a lease that ran out, claimed with another fingerprint.
    LapsedOtherFingerprint,
    Released,
    ReleasedOtherFingerprint,
    /// In progress under a lease that ran out (its route, then the claim's route).
    Lapsed(LeaseExpiry, LeaseExpiry),
    /// The same with its effect started: never taken over.
    LapsedEffectStarted,
    /// Completed under a TTL that ran out: absent.
    Expired,
    /// In progress under a lease and TTL that ran out: absent.
    ExpiredInProgress,
    /// Awaiting reconciliation.
    Uncertain,
    /// Reconciled as not applied (released) with an awkward note, claimed with another
    /// fingerprint (so the record and its note are answered).
    ResolvedNotApplied,
    /// Reconciled as applied, with an awkward note.
    ResolvedApplied,
    /// In progress, with an awkward downstream id.
    Downstream,
    /// A text column made bytes that are not UTF-8 (a hand-edited row).
    Corrupt(&'static str),
    /// Edited by hand with this `SET` clause (a completed row if it sets the response, one in
    /// progress otherwise).
    Hand(&'static str),
}

const STATES: [State; 31] = [
    State::Fresh,
    State::Completed,
    State::CompletedOtherFingerprint,
    State::CompletedLastByte,
    State::CompletedTwice,
    State::CompletedSized(65_536),
    State::CompletedSized(65_537),
    State::InProgress,
    State::LapsedOtherFingerprint,
    State::Released,
    State::ReleasedOtherFingerprint,
    State::Lapsed(LeaseExpiry::Reclaim, LeaseExpiry::Reclaim),
    State::Lapsed(LeaseExpiry::Reclaim, LeaseExpiry::Reconcile),
    State::Lapsed(LeaseExpiry::Reconcile, LeaseExpiry::Reclaim),
    State::Lapsed(LeaseExpiry::Reconcile, LeaseExpiry::Reconcile),
    State::LapsedEffectStarted,
    State::Expired,
    State::ExpiredInProgress,
    State::Uncertain,
    State::ResolvedNotApplied,
    State::ResolvedApplied,
    State::Downstream,
    State::Corrupt("history"),
    State::Corrupt("downstream_id"),
    State::Hand("fingerprint = x'00'"),
    State::Hand("response = x''"),
    State::Hand("response = x'0102'"),
    State::Hand("lease_until = 'soon'"),
    State::Hand("attempts = -1"),
    State::Hand("attempts = 4294967296"),
    State::Hand("effect_started = 2, downstream_id = 42, history = 7"),
];

/// A response of exactly `stored` bytes as the store keeps it, its body (with NUL bytes) naming
/// its key.
fn sized(key: &ScopedKey, stored: usize) -> StoredResponse {
    let mut headers = http::HeaderMap::new();
    headers.insert("x-key", http::HeaderValue::from_static("sized"));
    let make = |len: usize| {
        let mut body = format!("{:?}/{:?}\0", key.scope(), key.key()).into_bytes();
        body.extend((0..).map(|i: usize| (i % 251) as u8).take(len));
        body.truncate(len);
        StoredResponse {
            status: http::StatusCode::OK,
            headers: headers.clone(),
            body: Some(Bytes::from(body)),
            trailers: None,
        }
    };
    let mut len = stored;
    for _ in 0..8 {
        let encoded = make(len).to_bytes().len();
        if encoded == stored {
            return make(len);
        }
        len = (len + stored)
            .checked_sub(encoded)
            .expect("a body that fits");
    }
    panic!("no body makes {stored} stored bytes");
}

/// Leaves `key` in `state` (the states time makes still to run out); the tokens it took.
async fn prepare<S: IdempotencyStore>(
    store: &S,
    key: &ScopedKey,
    state: State,
) -> Vec<FencingToken> {
    let short = |route| claim_with(key, SHORT, LONG, route);
    match state {
        State::Fresh => vec![],
        State::Completed | State::CompletedOtherFingerprint | State::CompletedLastByte => {
            let token = recorded(store, &claim(key), &answer(key), LONG).await;
            vec![token]
        }
        State::CompletedTwice => {
            let token = recorded(store, &claim(key), &answer(key), LONG).await;
            let again = sized(key, 300);
            store
                .complete(key, token, &again, LONG)
                .await
                .expect("complete again");
            vec![token]
        }
        State::CompletedSized(stored) => {
            let token = acquired(store, &claim(key)).await;
            store
                .complete(key, token, &sized(key, stored), LONG)
                .await
                .expect("complete");
            vec![token]
        }
        State::InProgress | State::Corrupt(_) => vec![acquired(store, &claim(key)).await],
        State::Hand(set) => {
            let token = acquired(store, &claim(key)).await;
            if set.starts_with("response") {
                store
                    .complete(key, token, &answer(key), LONG)
                    .await
                    .expect("complete");
            }
            vec![token]
        }
        State::LapsedOtherFingerprint => vec![acquired(store, &short(LeaseExpiry::Reclaim)).await],
        State::Released | State::ReleasedOtherFingerprint => {
            let token = acquired(store, &claim(key)).await;
            store.release(key, token).await.expect("release");
            vec![token]
        }
        State::Lapsed(route, _) => vec![acquired(store, &short(route)).await],
        State::LapsedEffectStarted => {
            let token = acquired(store, &short(LeaseExpiry::Reclaim)).await;
            store
                .record_milestone(key, token, &Milestone::EffectStarted)
                .await
                .expect("effect started");
            vec![token]
        }
        State::Expired => {
            let token = recorded(
                store,
                &claim_with(key, SHORT, SHORT, LeaseExpiry::Reclaim),
                &answer(key),
                SHORT,
            )
            .await;
            vec![token]
        }
        State::ExpiredInProgress => {
            vec![acquired(store, &claim_with(key, SHORT, SHORT, LeaseExpiry::Reclaim)).await]
        }
        State::Uncertain => {
            let token = acquired(store, &claim(key)).await;
            store.mark_uncertain(key, token).await.expect("uncertain");
            vec![token]
        }
        State::ResolvedNotApplied | State::ResolvedApplied => {
            let token = acquired(store, &claim(key)).await;
            store.mark_uncertain(key, token).await.expect("uncertain");
            let resolution = match state {
                State::ResolvedApplied => Resolution::Applied(Box::new(answer(key))),
                _ => Resolution::NotApplied,
            };
            store
                .resolve(key, token, &resolution, LONG, Some(AWKWARD))
                .await
                .expect("resolve");
            vec![token]
        }
        State::Downstream => {
            let token = acquired(store, &claim(key)).await;
            store
                .record_milestone(key, token, &Milestone::DownstreamId(AWKWARD.into()))
                .await
                .expect("downstream id");
            vec![token]
        }
    }
}

/// Makes `column` of `key`'s row bytes that are not UTF-8.
async fn corrupt(store: &SqliteStore, table: &str, key: &ScopedKey, column: &str) {
    let sql = format!(
        "UPDATE \"{table}\" SET {column} = CAST(x'ff' AS TEXT) || COALESCE({column}, '')
         WHERE scope = ?1 AND key = ?2"
    );
    let done = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(key.scope().as_bytes())
        .bind(key.key().as_bytes())
        .execute(store.pool())
        .await
        .expect("corrupt the row");
    assert_eq!(done.rows_affected(), 1, "{key:?}: a row to corrupt");
}

/// Edits `key`'s row by hand with the `SET` clause `set`.
async fn edit(store: &SqliteStore, table: &str, key: &ScopedKey, set: &str) {
    let sql = format!("UPDATE \"{table}\" SET {set} WHERE scope = ?1 AND key = ?2");
    let done = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(key.scope().as_bytes())
        .bind(key.key().as_bytes())
        .execute(store.pool())
        .await
        .expect("edit the row");
    assert_eq!(done.rows_affected(), 1, "{key:?}: a row to edit");
}

/// The claim a key in `state` is sent.
fn claim_for(key: &ScopedKey, state: State) -> ClaimRequest {
    match state {
        State::CompletedOtherFingerprint
        | State::LapsedOtherFingerprint
        | State::ReleasedOtherFingerprint
        | State::ResolvedNotApplied => with_fingerprint(claim(key), [9; 32]),
        State::CompletedLastByte => with_fingerprint(claim(key), last_byte_differs()),
        State::Lapsed(_, route) => claim_with(key, LONG, LONG, route),
        _ => claim(key),
    }
}

/// Scopes and keys that differ only subtly: prefixes, the split between scope and key, NUL
/// bytes, quotes and JSON's own characters, case, Unicode forms, lengths around the key limit.
fn subtle_keys() -> Vec<ScopedKey> {
    let long = |c: &str, n: usize| c.repeat(n);
    let pairs: Vec<(String, String)> = vec![
        ("s".into(), "k".into()),
        ("sk".into(), String::new()),
        (String::new(), "sk".into()),
        (String::new(), String::new()),
        ("s".into(), "k\0".into()),
        ("s\0".into(), "k".into()),
        ("s".into(), "\0k".into()),
        ("s".into(), "k ".into()),
        ("s ".into(), "k".into()),
        ("S".into(), "k".into()),
        ("s".into(), "K".into()),
        ("s\"".into(), "k".into()),
        ("s".into(), "\"k\"".into()),
        ("s'".into(), "k'".into()),
        ("s\\".into(), "k".into()),
        ("s".into(), "\\k".into()),
        ("s".into(), "\\u0000".into()),
        ("s".into(), "[1,2]".into()),
        ("{\"a\":1}".into(), "k".into()),
        ("s".into(), "null".into()),
        ("s".into(), "0".into()),
        ("s".into(), "6b".into()),
        ("s".into(), "k%".into()),
        ("s".into(), "k_".into()),
        ("s".into(), "k;".into()),
        ("s".into(), "k\n".into()),
        ("s".into(), "k\r\n".into()),
        ("é".into(), "k".into()),
        ("e\u{301}".into(), "k".into()),
        ("s".into(), "\u{1F600}".into()),
        ("s".into(), "\u{2028}".into()),
        ("s".into(), "\u{FEFF}k".into()),
        ("s".into(), long("a", 255)),
        ("s".into(), long("a", 256)),
        ("s".into(), long("a", 254)),
        (long("s", 255), "k".into()),
        ("s".into(), long("b", 10_000)),
        ("s".into(), AWKWARD.into()),
        (AWKWARD.into(), "k".into()),
    ];
    pairs
        .into_iter()
        .map(|(scope, key)| ScopedKey::new(scope, key))
        .collect()
}

/// The first `n` keys of a run: the subtle ones, then plain ones.
fn keys(n: usize) -> Vec<ScopedKey> {
    let mut keys = subtle_keys();
    keys.extend((keys.len()..n).map(|i| ScopedKey::new("plain", format!("{i}"))));
    keys.truncate(n);
    keys
}

/// Prepares `keys` in their states on both stores of `pair`, then lets short leases run out;
/// the tokens' names on each store.
async fn prepare_both(pair: &Pair, keys: &[(ScopedKey, State)]) -> (Labels, Labels) {
    let (mut batched, mut alone) = (Labels::default(), Labels::default());
    for (i, (key, state)) in keys.iter().enumerate() {
        for (store, labels) in [(&pair.batched, &mut batched), (&pair.alone, &mut alone)] {
            for (j, token) in prepare(store, key, *state).await.into_iter().enumerate() {
                labels.add(token, format!("{i}:prep{j}"));
            }
            match state {
                State::Corrupt(column) => corrupt(store, &pair.table, key, column).await,
                State::Hand(set) => edit(store, &pair.table, key, set).await,
                _ => {}
            }
        }
    }
    tokio::time::sleep(PAST_SHORT).await;
    (batched, alone)
}

/// Every state a claim can find, on keys that differ subtly, in batches that cut into chunks
/// every way (a chunk of one beside bigger ones), each key claimed twice in one burst (the
/// second claim in the next batch): each answer, and each record after, is as alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_of_subtle_keys_in_every_state_answer_as_alone() {
    let mut kinds = HashMap::<String, usize>::new();
    for size in [2usize, 3, 5, 7, 39, 65, 127] {
        let pair = pair(&format!("subtle-{size}")).await;
        let keys: Vec<(ScopedKey, State)> = keys(size)
            .into_iter()
            .enumerate()
            .map(|(i, key)| (key, STATES[(i * 5 + size) % STATES.len()]))
            .collect();
        let (mut batched_labels, mut alone_labels) = prepare_both(&pair, &keys).await;

        let reqs: Vec<ClaimRequest> = keys
            .iter()
            .chain(&keys)
            .map(|(key, state)| claim_for(key, *state))
            .collect();
        let before = counted::count(&pair.table, CLAIM_CHUNK);
        let together = claim_burst(&pair.batched, &reqs).await;
        assert_eq!(
            counted::count(&pair.table, CLAIM_CHUNK) - before,
            2 * chunks_together(size),
            "a batch of {size}, twice: each chunk read together"
        );
        let mut alone = Vec::new();
        for req in &reqs {
            alone.push(pair.alone.claim(req).await);
        }
        for (n, (batched, alone)) in together.iter().zip(&alone).enumerate() {
            let i = n % size;
            for (claimed, labels) in [(batched, &mut batched_labels), (alone, &mut alone_labels)] {
                if let Ok(Claim::Acquired(lease)) = claimed {
                    labels.add(lease.token, format!("{i}:burst"));
                }
            }
        }
        for (n, ((batched, alone), req)) in together.iter().zip(&alone).zip(&reqs).enumerate() {
            let (key, state) = &keys[n % size];
            let got = describe_claim(batched, key, &batched_labels);
            let expected = describe_claim(alone, key, &alone_labels);
            assert_eq!(
                got,
                expected,
                "{key:?} ({state:?}), claim {} of 2 in a batch of {size}: answered as alone",
                n / size + 1
            );
            assert_eq!(&req.key, key);
            let kind = got.split([',', ' ']).next().unwrap_or_default().to_owned();
            *kinds.entry(kind).or_default() += 1;
        }
        for (key, state) in &keys {
            let got = describe_lookup(&pair.batched.lookup(key).await, key, &batched_labels);
            let expected = describe_lookup(&pair.alone.lookup(key).await, key, &alone_labels);
            assert_eq!(
                got, expected,
                "{key:?} ({state:?}) in a batch of {size}: its record after"
            );
        }
    }
    for kind in ["acquired", "completed", "existing", "error"] {
        assert!(
            kinds.contains_key(kind),
            "no claim answered {kind}: {kinds:?}"
        );
    }
}

/// Lapsed leases in one chunk, each record's own route and each claim's own route mixed row
/// by row: a claim that reclaims a record whose route reclaims takes over; where either
/// reconciles, the record goes to reconciliation, whatever its neighbours in the statement ask.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reclaim_flag_is_each_rows_own() {
    for size in [2usize, 3, 8, 64, 65] {
        let pair = pair(&format!("routes-{size}")).await;
        let route = |on: bool| match on {
            true => LeaseExpiry::Reconcile,
            false => LeaseExpiry::Reclaim,
        };
        let keys: Vec<(ScopedKey, State)> = (0..size)
            .map(|i| {
                let state = State::Lapsed(route(i % 2 == 1), route((i / 2) % 2 == 1 || i % 7 == 3));
                (ScopedKey::new("routes", format!("{i}")), state)
            })
            .collect();
        let (batched_labels, alone_labels) = prepare_both(&pair, &keys).await;
        let reqs: Vec<ClaimRequest> = keys.iter().map(|(k, s)| claim_for(k, *s)).collect();
        let together = claim_burst(&pair.batched, &reqs).await;
        assert_eq!(
            counted::count(&pair.table, CLAIM_CHUNK),
            chunks_together(size),
            "a batch of {size}: each chunk read together"
        );
        for ((key, state), (claimed, req)) in keys.iter().zip(together.iter().zip(&reqs)) {
            // Only where both the record's route and the claim's reclaim is it taken over.
            let reclaims = matches!(
                state,
                State::Lapsed(LeaseExpiry::Reclaim, LeaseExpiry::Reclaim)
            );
            match (reclaims, claimed) {
                (true, Ok(Claim::Acquired(lease))) => {
                    assert_eq!(lease.attempt, 2, "{key:?} ({state:?}): a takeover")
                }
                (false, Ok(Claim::Existing { record, .. })) => {
                    assert_eq!(
                        (record.status, record.attempts),
                        (RecordStatus::NeedsReconciliation, 1),
                        "{key:?} ({state:?})"
                    )
                }
                (reclaims, other) => panic!("{key:?} ({state:?}), reclaims: {reclaims}: {other:?}"),
            }
            let alone = pair.alone.claim(req).await;
            let mut batched_labels_now = batched_labels.clone();
            let mut alone_labels_now = alone_labels.clone();
            if let Ok(Claim::Acquired(lease)) = claimed {
                batched_labels_now.add(lease.token, "burst".into());
            }
            if let Ok(Claim::Acquired(lease)) = &alone {
                alone_labels_now.add(lease.token, "burst".into());
            }
            assert_eq!(
                describe_claim(claimed, key, &batched_labels_now),
                describe_claim(&alone, key, &alone_labels_now),
                "{key:?} ({state:?}) in a batch of {size}"
            );
            assert_eq!(
                describe_lookup(&pair.batched.lookup(key).await, key, &batched_labels_now),
                describe_lookup(&pair.alone.lookup(key).await, key, &alone_labels_now),
                "{key:?} ({state:?}) in a batch of {size}: its record after"
            );
        }
    }
}

/// Completed records whose responses are stored in 0 to 128 KiB, around the 64 KiB a batch
/// reads back in its row (bodies with NUL bytes, an empty body, no body, trailers), claimed
/// in batches beside fresh keys: each replays its own response, byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_around_64_kib_replay_whole() {
    let pair = pair("sizes").await;
    let key = |i: usize| ScopedKey::new("sizes", format!("{i}"));
    let mut responses: Vec<StoredResponse> = [
        65_533usize,
        65_534,
        65_535,
        65_536,
        65_537,
        65_538,
        131_071,
        131_072,
        131_073,
        32_768,
    ]
    .into_iter()
    .enumerate()
    .map(|(i, stored)| sized(&key(i), stored))
    .collect();
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    let base = responses.len();
    responses.push(StoredResponse {
        body: None,
        ..answer(&key(base))
    });
    responses.push(StoredResponse {
        body: Some(Bytes::new()),
        ..answer(&key(base + 1))
    });
    responses.push(StoredResponse {
        body: Some(Bytes::from_static(b"\0\0\0")),
        trailers: Some(trailers),
        ..answer(&key(base + 2))
    });
    let mut stored_lengths = Vec::new();
    for (i, response) in responses.iter().enumerate() {
        for store in [&pair.batched, &pair.alone] {
            let token = acquired(store, &claim(&key(i))).await;
            store
                .complete(&key(i), token, response, LONG)
                .await
                .expect("complete");
        }
        let length: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT length(response) FROM \"{}\" WHERE scope = ?1 AND key = ?2",
            pair.table
        )))
        .bind(b"sizes".as_slice())
        .bind(format!("{i}").into_bytes())
        .fetch_one(pair.batched.pool())
        .await
        .expect("length");
        stored_lengths.push(length);
    }
    // Not vacuous: the boundaries are what is stored.
    for boundary in [65_535, 65_536, 65_537] {
        assert!(stored_lengths.contains(&boundary), "{stored_lengths:?}");
    }
    // Each response beside fresh keys, in several orders (so in chunks of several sizes).
    let n = responses.len();
    let mut round = 0;
    for order in [
        (0..n).collect::<Vec<_>>(),
        (0..n).rev().collect(),
        (0..n)
            .filter(|i| i % 2 == 0)
            .chain((0..n).filter(|i| i % 2 == 1))
            .collect(),
    ] {
        round += 1;
        let mut reqs = Vec::new();
        let mut expect = Vec::new();
        for (j, i) in order.iter().enumerate() {
            reqs.push(claim(&key(*i)));
            expect.push(Some(*i));
            if j % 3 == 0 {
                let fresh = ScopedKey::new("sizes", format!("fresh-{round}-{j}"));
                reqs.push(claim(&fresh));
                expect.push(None);
            }
        }
        let together = claim_burst(&pair.batched, &reqs).await;
        for ((req, expect), claimed) in reqs.iter().zip(&expect).zip(together) {
            match (expect, claimed) {
                (Some(i), Ok(Claim::Completed { response, .. })) => {
                    assert!(
                        *response == responses[*i],
                        "{:?} (stored {} bytes) replays its own response: got {}",
                        req.key,
                        stored_lengths[*i],
                        describe_response(&response)
                    );
                    match pair.alone.claim(req).await {
                        Ok(Claim::Completed {
                            response: alone, ..
                        }) => {
                            assert!(alone == response, "{:?}: as alone", req.key)
                        }
                        other => panic!("{:?} alone: {other:?}", req.key),
                    }
                }
                (None, Ok(Claim::Acquired(lease))) => assert_eq!(lease.attempt, 1),
                (_, other) => panic!("{:?}: {other:?}", req.key),
            }
        }
    }
    assert!(counted::count(&pair.table, CLAIM_CHUNK) > 0, "not batched");
}

/// What a completion does to its key in [`completions_of_every_kind_answer_as_alone`].
#[derive(Clone, Copy, Debug)]
enum Case {
    /// Its holder completes it.
    Holder,
    /// A token one bit off the holder's.
    Stale,
    /// Tokens at the ends of the range a token is bound in.
    Token(u64),
    /// Its holder completes it again (after completing it once), with another answer.
    Again,
    /// Released by its holder first.
    Released,
    /// Marked uncertain by its holder first (a holder may still complete it).
    Uncertain,
    /// Removed first.
    Removed,
    /// Its lease ran out and another claim took it over: the first holder completes it.
    TakenOver,
    /// Its lease ran out, nobody took it: its holder completes it.
    Lapsed,
    /// Its holder completes it with a response over 64 KiB.
    Big,
    /// Its holder completes it with an empty body.
    Empty,
}

const CASES: [Case; 15] = [
    Case::Holder,
    Case::Stale,
    Case::Token(u64::MAX),
    Case::Token(1 << 63),
    Case::Token(i64::MAX as u64),
    Case::Token(0),
    Case::Again,
    Case::Released,
    Case::Uncertain,
    Case::Removed,
    Case::TakenOver,
    Case::Lapsed,
    Case::Big,
    Case::Empty,
    Case::Holder,
];

/// Leaves `key` as `case` needs it; the tokens it took (the holder's first).
async fn prepare_completion<S: IdempotencyStore>(
    store: &S,
    key: &ScopedKey,
    case: Case,
) -> Vec<FencingToken> {
    let lapsing = matches!(case, Case::TakenOver | Case::Lapsed);
    let lease = if lapsing { SHORT } else { LONG };
    let token = acquired(store, &claim_with(key, lease, LONG, LeaseExpiry::Reclaim)).await;
    match case {
        Case::Again => store
            .complete(key, token, &answer(key), LONG)
            .await
            .expect("complete"),
        Case::Released => {
            store.release(key, token).await.expect("release");
        }
        Case::Uncertain => store.mark_uncertain(key, token).await.expect("uncertain"),
        Case::Removed => assert!(store.remove(key).await.expect("remove")),
        _ => {}
    }
    vec![token]
}

/// The completion `case` sends, with the tokens `prepare_completion` took.
fn completion_for(key: &ScopedKey, case: Case, tokens: &[FencingToken]) -> Completion {
    let token = match case {
        Case::Stale => FencingToken::new(tokens[0].get() ^ 1),
        Case::Token(t) => FencingToken::new(t),
        _ => tokens[0],
    };
    let response = match case {
        Case::Again => sized(key, 500),
        Case::Big => sized(key, 70_000),
        Case::Empty => StoredResponse {
            body: Some(Bytes::new()),
            ..answer(key)
        },
        _ => answer(key),
    };
    (key.clone(), token, response)
}

/// Completions of every kind (the holder's, stale tokens, tokens at the ends of the range, a
/// holder's second completion, released, uncertain, removed, taken-over and lapsed keys)
/// mixed in batches that cut into chunks every way: each answered as alone, each record after
/// as alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_of_every_kind_answer_as_alone() {
    let mut outcomes = HashMap::<bool, usize>::new();
    for size in [2usize, 3, 5, 7, 17, 65, 127] {
        let pair = pair(&format!("completions-{size}")).await;
        let keys: Vec<(ScopedKey, Case)> = keys(size)
            .into_iter()
            .enumerate()
            .map(|(i, key)| (key, CASES[(i * 4 + size) % CASES.len()]))
            .collect();
        let (mut batched_labels, mut alone_labels) = (Labels::default(), Labels::default());
        let (mut batched_ops, mut alone_ops) = (Vec::new(), Vec::new());
        for (i, (key, case)) in keys.iter().enumerate() {
            for (store, labels, ops) in [
                (&pair.batched, &mut batched_labels, &mut batched_ops),
                (&pair.alone, &mut alone_labels, &mut alone_ops),
            ] {
                let tokens = prepare_completion(store, key, *case).await;
                labels.add(tokens[0], format!("{i}:holder"));
                ops.push(completion_for(key, *case, &tokens));
            }
        }
        tokio::time::sleep(PAST_SHORT).await;
        for (i, (key, case)) in keys.iter().enumerate() {
            if let Case::TakenOver = case {
                for (store, labels) in [
                    (&pair.batched, &mut batched_labels),
                    (&pair.alone, &mut alone_labels),
                ] {
                    labels.add(acquired(store, &claim(key)).await, format!("{i}:taker"));
                }
            }
        }
        let before = counted::count(&pair.table, COMPLETE_CHUNK);
        let together = complete_burst(&pair.batched, &batched_ops).await;
        assert_eq!(
            counted::count(&pair.table, COMPLETE_CHUNK) - before,
            chunks_together(size),
            "a batch of {size}: each chunk written together"
        );
        for (((key, case), got), (_, token, response)) in keys.iter().zip(&together).zip(&alone_ops)
        {
            let expected = pair.alone.complete(key, *token, response, LONG).await;
            assert_eq!(
                format!("{got:?}"),
                format!("{expected:?}"),
                "{key:?} ({case:?}) in a batch of {size}: answered as alone"
            );
            *outcomes.entry(got.is_ok()).or_default() += 1;
        }
        for (key, case) in &keys {
            assert_eq!(
                describe_lookup(&pair.batched.lookup(key).await, key, &batched_labels),
                describe_lookup(&pair.alone.lookup(key).await, key, &alone_labels),
                "{key:?} ({case:?}) in a batch of {size}: its record after"
            );
        }
    }
    assert!(
        outcomes.get(&true).is_some_and(|n| *n > 0) && outcomes.get(&false).is_some_and(|n| *n > 0),
        "both written and fenced completions: {outcomes:?}"
    );
}

/// A completion by its holder of a row with a text column that is not UTF-8 (a hand-edited
/// row) is written alone, and answered `Ok`: the completion does not read the row. Sent in a
/// chunk beside a completion with a stale token (so the chunk writes fewer rows than it holds
/// and reads each record back to tell which), it must be answered the same, and the stale one
/// alone fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holders_completion_of_an_unreadable_row_is_answered_as_alone() {
    let pair = pair("unreadable-complete").await;
    let mut failures = Vec::new();
    for column in ["history", "downstream_id", "resolution_note"] {
        let keys: Vec<ScopedKey> = ["bad", "stale", "good"]
            .iter()
            .map(|k| ScopedKey::new(column, *k))
            .collect();
        let (mut batched_ops, mut alone_ops) = (Vec::new(), Vec::new());
        for (store, ops) in [
            (&pair.batched, &mut batched_ops),
            (&pair.alone, &mut alone_ops),
        ] {
            for (i, key) in keys.iter().enumerate() {
                let token = acquired(store, &claim(key)).await;
                let token = if i == 1 {
                    FencingToken::new(token.get() ^ 1)
                } else {
                    token
                };
                ops.push((key.clone(), token, answer(key)));
            }
            corrupt(store, &pair.table, &keys[0], column).await;
        }
        let together = complete_burst(&pair.batched, &batched_ops).await;
        let mut alone = Vec::new();
        for (key, token, response) in &alone_ops {
            alone.push(pair.alone.complete(key, *token, response, LONG).await);
        }
        assert!(
            alone[0].is_ok(),
            "{column}: alone, the holder's completion is written"
        );
        assert!(matches!(alone[1], Err(StoreError::Fenced)));
        // What the batch did to the unreadable row, read without decoding it.
        let written: (String, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT status, lease_token FROM \"{}\" WHERE scope = ?1 AND key = ?2",
            pair.table
        )))
        .bind(keys[0].scope().as_bytes())
        .bind(keys[0].key().as_bytes())
        .fetch_one(pair.batched.pool())
        .await
        .expect("the row");
        let got: Vec<String> = together.iter().map(|r| format!("{r:?}")).collect();
        let expected: Vec<String> = alone.iter().map(|r| format!("{r:?}")).collect();
        if got != expected {
            failures.push(format!(
                "{column} not UTF-8: batched {got:?}, alone {expected:?}; the batched row \
                 is now {:?} with the holder's token: {}",
                written.0,
                written.1 as u64 == batched_ops[0].1.get()
            ));
        }
    }
    assert!(
        counted::count(&pair.table, COMPLETE_CHUNK) > 0,
        "not batched"
    );
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Claims under a lease that is over as soon as it is granted (zero: the store takes any
/// lease) are won alone, attempt 1, and a claim of the reconciling route is won too. Sent in a
/// chunk beside a key whose row is not UTF-8 (which sends the chunk's claims again alone after
/// the batch's commit), each must still be won once, attempt 1, with one `claimed` entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_beside_an_unreadable_row_are_not_claimed_twice() {
    let pair = pair("resent").await;
    let bad = ScopedKey::new("resent", "bad");
    for store in [&pair.batched, &pair.alone] {
        acquired(store, &claim(&bad)).await;
        corrupt(store, &pair.table, &bad, "history").await;
    }
    let mut reqs = vec![claim(&bad)];
    for i in 0..7 {
        let route = match i % 2 {
            0 => LeaseExpiry::Reclaim,
            _ => LeaseExpiry::Reconcile,
        };
        let key = ScopedKey::new("resent", format!("zero-{i}"));
        reqs.push(claim_with(&key, Duration::ZERO, LONG, route));
    }
    let together = claim_burst(&pair.batched, &reqs).await;
    assert_eq!(
        counted::count(&pair.table, CLAIM_CHUNK),
        1,
        "the eight claims read together, in one chunk"
    );
    let mut failures = Vec::new();
    for (req, got) in reqs.iter().zip(&together).skip(1) {
        let alone = pair.alone.claim(req).await;
        match &alone {
            Ok(Claim::Acquired(lease)) => assert_eq!(lease.attempt, 1, "alone"),
            other => panic!("{:?} alone: {other:?}", req.key),
        }
        let history = pair
            .batched
            .lookup(&req.key)
            .await
            .expect("lookup")
            .map(|r| {
                r.history
                    .iter()
                    .map(|e| format!("{} {}", e.attempt, e.event))
                    .collect::<Vec<_>>()
            });
        let answered = match got {
            Ok(Claim::Acquired(lease)) => format!("acquired, attempt {}", lease.attempt),
            Ok(Claim::Existing { record, .. }) => {
                format!("existing {:?}, attempt {}", record.status, record.attempts)
            }
            other => format!("{other:?}"),
        };
        if answered != "acquired, attempt 1" {
            failures.push(format!(
                "{:?} ({:?}): alone acquired, attempt 1; in the batch {answered}; history {history:?}",
                req.key, req.on_lease_expiry
            ));
        }
    }
    assert!(
        matches!(together[0], Err(StoreError::Unavailable(_))),
        "the unreadable row fails its own claim: {:?}",
        together[0]
    );
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Histories at and around the cap (written by hand): a takeover, a lease handed to
/// reconciliation and a completion, sent in batches, leave each history as alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn histories_at_the_cap_end_as_alone() {
    let pair = pair("cap").await;
    let lengths = [63usize, 64, 65, 254, 255, 256, 257, 300];
    let kinds = ["released", "lapsed-reconcile", "held"];
    let mut plan = Vec::new();
    for (i, n) in lengths.iter().enumerate() {
        for kind in kinds {
            plan.push((ScopedKey::new(kind, format!("{n}")), kind, *n, i));
        }
    }
    let (mut batched_labels, mut alone_labels) = (Labels::default(), Labels::default());
    let (mut batched_ops, mut alone_ops) = (Vec::new(), Vec::new());
    for (j, (key, kind, n, _)) in plan.iter().enumerate() {
        for (store, labels, ops) in [
            (&pair.batched, &mut batched_labels, &mut batched_ops),
            (&pair.alone, &mut alone_labels, &mut alone_ops),
        ] {
            let lease = if *kind == "lapsed-reconcile" {
                SHORT
            } else {
                LONG
            };
            let route = if *kind == "lapsed-reconcile" {
                LeaseExpiry::Reconcile
            } else {
                LeaseExpiry::Reclaim
            };
            let token = acquired(store, &claim_with(key, lease, LONG, route)).await;
            labels.add(token, format!("{j}:holder"));
            if *kind == "released" {
                store.release(key, token).await.expect("release");
            }
            let history = "1 5 1000 claimed;".repeat(*n);
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "UPDATE \"{}\" SET history = ?3 WHERE scope = ?1 AND key = ?2",
                pair.table
            )))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(history)
            .execute(store.pool())
            .await
            .expect("history");
            if *kind == "held" {
                ops.push((key.clone(), token, answer(key)));
            }
        }
    }
    tokio::time::sleep(PAST_SHORT).await;
    let reqs: Vec<ClaimRequest> = plan
        .iter()
        .filter(|(_, kind, _, _)| *kind != "held")
        .map(|(key, kind, _, _)| match *kind {
            "lapsed-reconcile" => claim_with(key, LONG, LONG, LeaseExpiry::Reconcile),
            _ => claim(key),
        })
        .collect();
    let together = claim_burst(&pair.batched, &reqs).await;
    for (req, got) in reqs.iter().zip(&together) {
        let alone = pair.alone.claim(req).await;
        for (claimed, labels) in [(got, &mut batched_labels), (&alone, &mut alone_labels)] {
            if let Ok(Claim::Acquired(lease)) = claimed {
                labels.add(lease.token, "burst".into());
            }
        }
        assert_eq!(
            describe_claim(got, &req.key, &batched_labels),
            describe_claim(&alone, &req.key, &alone_labels),
            "{:?}",
            req.key
        );
    }
    let completed = complete_burst(&pair.batched, &batched_ops).await;
    for ((key, token, response), got) in alone_ops.iter().zip(&completed) {
        let alone = pair.alone.complete(key, *token, response, LONG).await;
        assert_eq!(format!("{got:?}"), format!("{alone:?}"), "{key:?}");
    }
    for (key, kind, n, _) in &plan {
        let got = pair
            .batched
            .lookup(key)
            .await
            .expect("lookup")
            .expect("record");
        let expected = pair
            .alone
            .lookup(key)
            .await
            .expect("lookup")
            .expect("record");
        assert_eq!(
            describe_record(&got, key, &batched_labels),
            describe_record(&expected, key, &alone_labels),
            "{kind} with {n} entries: its record after"
        );
    }
    assert!(
        counted::count(&pair.table, CLAIM_CHUNK) > 0,
        "claims not batched"
    );
    assert!(
        counted::count(&pair.table, COMPLETE_CHUNK) > 0,
        "completions not batched"
    );
}

/// Leases and TTLs at the ends of what a claim may ask (zero, a millisecond, the longest a
/// `Duration` holds, whose milliseconds saturate): each claim answered as alone, and its
/// completion too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extreme_leases_and_ttls_answer_as_alone() {
    let pair = pair("extremes").await;
    let durations = [
        Duration::ZERO,
        Duration::from_millis(1),
        LONG,
        Duration::from_secs(u64::MAX / 1000),
        Duration::MAX,
    ];
    let mut reqs = Vec::new();
    for (i, lease) in durations.iter().enumerate() {
        for (j, ttl) in durations.iter().enumerate() {
            // A lease that is over at once with a TTL that is too: the key is absent again
            // at once, which a batch need not match to the millisecond.
            if *ttl < LONG && *lease < LONG {
                continue;
            }
            let key = ScopedKey::new("extremes", format!("{i}-{j}"));
            reqs.push(claim_with(&key, *lease, *ttl, LeaseExpiry::Reclaim));
        }
    }
    let together = claim_burst(&pair.batched, &reqs).await;
    assert!(counted::count(&pair.table, CLAIM_CHUNK) > 0, "not batched");
    let mut failures = Vec::new();
    let (mut batched_ops, mut alone_ops) = (Vec::new(), Vec::new());
    for (req, got) in reqs.iter().zip(&together) {
        let alone = pair.alone.claim(req).await;
        // Errors by kind: the two paths word a row that does not read differently.
        let describe = |c: &Result<Claim, StoreError>| match c {
            Ok(Claim::Acquired(lease)) => format!("acquired, attempt {}", lease.attempt),
            Ok(other) => format!("{other:?}"),
            Err(StoreError::Unavailable(_)) => "unavailable".into(),
            Err(other) => format!("{other:?}"),
        };
        if describe(got) != describe(&alone) {
            failures.push(format!(
                "lease {:?} ttl {:?}: batched {}, alone {}",
                req.lease,
                req.ttl,
                describe(got),
                describe(&alone)
            ));
        }
        if let (Ok(Claim::Acquired(b)), Ok(Claim::Acquired(a))) = (got, &alone) {
            batched_ops.push((req.key.clone(), b.token, answer(&req.key)));
            alone_ops.push((req.key.clone(), a.token, answer(&req.key)));
        }
    }
    let completed = complete_burst(&pair.batched, &batched_ops).await;
    for ((key, token, response), got) in alone_ops.iter().zip(&completed) {
        let alone = pair.alone.complete(key, *token, response, LONG).await;
        if format!("{got:?}") != format!("{alone:?}") {
            failures.push(format!(
                "{key:?} completed: batched {got:?}, alone {alone:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A row holding a blob where a text column belongs (a hand-edited row) cannot go into the
/// batch's JSON row at all. Alone, its claim fails on its own; in a batch, it must fail alone
/// too, and every other claim must be answered as queued: the first claim of a key wins it,
/// the second (queued behind it, for the next batch) finds it held by the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_in_a_text_column_fails_only_its_own_claim() {
    let pair = pair("blob-text").await;
    let mut failures = Vec::new();
    for (round, set) in [
        "downstream_id = x'41'",
        "history = x'41'",
        "resolution_note = x'41'",
    ]
    .into_iter()
    .enumerate()
    {
        let bad = ScopedKey::new("blob", format!("bad-{round}"));
        for store in [&pair.batched, &pair.alone] {
            acquired(store, &claim(&bad)).await;
            edit(store, &pair.table, &bad, set).await;
        }
        let fresh: Vec<ScopedKey> = (0..15)
            .map(|i| ScopedKey::new("blob", format!("{round}-{i}")))
            .collect();
        let reqs: Vec<ClaimRequest> = std::iter::once(&bad)
            .chain(&fresh)
            .chain(&fresh)
            .map(claim)
            .collect();
        let together = claim_burst(&pair.batched, &reqs).await;
        let alone = pair.alone.claim(&reqs[0]).await;
        if error_kind_of(&together[0]) != error_kind_of(&alone) {
            failures.push(format!(
                "{set}: the bad row's claim: batched {:?}, alone {alone:?}",
                together[0]
            ));
        }
        for (i, key) in fresh.iter().enumerate() {
            let (first, second) = (&together[1 + i], &together[1 + fresh.len() + i]);
            let won = match first {
                Ok(Claim::Acquired(lease)) if lease.attempt == 1 => Some(lease.token),
                _ => None,
            };
            let held_by_first = matches!(
                second,
                Ok(Claim::Existing { record, .. })
                    if record.status == RecordStatus::InProgress
                        && Some(record.lease_token) == won
            );
            if won.is_none() || !held_by_first {
                failures.push(format!(
                    "{set}: {key:?}: first claim {}, second {}",
                    short(first),
                    short(second)
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

fn error_kind_of(claimed: &Result<Claim, StoreError>) -> &'static str {
    match claimed {
        Ok(_) => "ok",
        Err(error) => error_kind(error),
    }
}

fn short(claimed: &Result<Claim, StoreError>) -> String {
    match claimed {
        Ok(Claim::Acquired(lease)) => format!("acquired, attempt {}", lease.attempt),
        Ok(Claim::Existing { record, .. }) => format!("existing {:?}", record.status),
        Ok(Claim::Completed { .. }) => "completed".into(),
        Err(error) => format!("error {error}"),
    }
}
