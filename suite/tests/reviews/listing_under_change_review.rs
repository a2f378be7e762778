use crate::common;

// Adversarial review of the reconciliation listing (DESIGN §4: "makes fair progress past
// records it cannot settle", the operator console's list; issue 18 §2, §5 in the kit): the
// store's `list_uncertain` / `count_uncertain`, the `Sweeper`'s walk across passes and the
// console's JSON listing over HTTP, each while other tasks change other records: marking new
// ones uncertain, resolving, removing, milestones that move `updated_at`. Run on every store
// (memory, SQLite on a file, PostgreSQL, Redis, Redis Cluster). A store wrapper injects a
// change at an exact point: right after a `list_uncertain` returns, before its caller reads
// the page. Sleeps only let leases lapse; every loop is bounded and fails the test.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use common::serve;
use serde_json::Value;
use tower_idempotency::console::Console;
use tower_idempotency::reconcile::{Reconciler, Reconciliation, SweepReport, Sweeper};
use tower_idempotency::store::{
    Claim, ClaimRequest, FencingToken, Milestone, Record, RecordStatus, Resolution, ScopedKey,
    StoreError, StoredResponse, UncertainCursor, UncertainPage, UncertainQuery,
};
use tower_idempotency::{Fingerprint, IdempotencyStore, LeaseExpiry};

// ---- records -----------------------------------------------------------------------------

const LONG: Duration = Duration::from_secs(3600);
/// A lease that lapses before [`LAPSE`] is over.
const SHORT_LEASE: Duration = Duration::from_millis(40);
const LAPSE: Duration = Duration::from_millis(150);

fn request(key: &ScopedKey, lease: Duration) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        fingerprint: Fingerprint::from_bytes([9; 32]),
        lease,
        ttl: LONG,
        on_lease_expiry: LeaseExpiry::Reclaim,
    }
}

async fn acquire<S: IdempotencyStore>(store: &S, key: &ScopedKey, lease: Duration) -> FencingToken {
    match store.claim(&request(key, lease)).await.expect("claim") {
        Claim::Acquired(lease) => lease.token,
        _ => panic!("{key:?}: a fresh key is acquired"),
    }
}

/// A record of `key` awaiting reconciliation (marked so by its holder); its token.
async fn mark<S: IdempotencyStore>(store: &S, key: &ScopedKey) -> FencingToken {
    let token = acquire(store, key, LONG).await;
    store
        .mark_uncertain(key, token)
        .await
        .expect("mark_uncertain");
    token
}

/// A record of `key` in progress with its effect started, whose lease lapses within
/// [`LAPSE`]: uncertain from then on, though its status stays in progress.
async fn lapsing<S: IdempotencyStore>(store: &S, key: &ScopedKey) -> FencingToken {
    let token = acquire(store, key, SHORT_LEASE).await;
    store
        .record_milestone(key, token, &Milestone::EffectStarted)
        .await
        .expect("effect started");
    token
}

async fn settle<S: IdempotencyStore>(store: &S, key: &ScopedKey, token: FencingToken) {
    store
        .resolve(key, token, &Resolution::NotApplied, LONG, None)
        .await
        .expect("resolve");
}

fn response() -> StoredResponse {
    StoredResponse {
        status: http::StatusCode::OK,
        headers: http::HeaderMap::new(),
        body: Some(bytes::Bytes::from_static(b"reconciled")),
        trailers: None,
    }
}

/// Keys with odd bytes: an empty scope, an empty key, NUL, `~`, `+`, `%`, non-ASCII, scopes of
/// different lengths, pairs that join to the same bytes ("a" + "ak", "aa" + "k"), a long key.
fn odd_keys(tag: &str) -> Vec<ScopedKey> {
    let long = format!("{tag}-{}", "L".repeat(240));
    let mut keys = Vec::new();
    for scope in [
        "",
        "a",
        "aa",
        "b",
        "a\0",
        "t\u{e9}",
        "ab",
        "tenant-0123456789",
    ] {
        for key in [
            format!("k{tag}"),
            format!("\0{tag}"),
            format!("{tag}~+%"),
            format!("a{tag}"),
        ] {
            keys.push(ScopedKey::new(scope, &key));
        }
    }
    keys.push(ScopedKey::new("x", ""));
    keys.push(ScopedKey::new("x", &long));
    keys.push(ScopedKey::new("x", format!("{long}\0")));
    keys
}

// ---- walking -------------------------------------------------------------------------------

/// What a walk saw: every page's records, in order, and each page's next cursor.
#[derive(Default)]
struct Walked {
    keys: Vec<ScopedKey>,
    records: Vec<Record>,
    cursors: Vec<UncertainCursor>,
    pages: usize,
}

/// Changes to other records made between two pages of a walk.
struct Churn {
    tag: String,
    /// Uncertain records it may resolve or remove.
    pool: Vec<(ScopedKey, FencingToken)>,
    /// Lapsed in-progress records whose holder may still record a milestone (moving them).
    lapsed: Vec<(ScopedKey, FencingToken)>,
    fresh: usize,
    /// Rounds of changes left: a walk oldest first cannot end while records are added at its
    /// end faster than it reads them.
    budget: usize,
}

impl Churn {
    fn new(tag: &str) -> Self {
        Self {
            tag: tag.to_owned(),
            pool: Vec::new(),
            lapsed: Vec::new(),
            fresh: 0,
            budget: 12,
        }
    }

    /// Fills the pool: `n` uncertain records and `n` lapsing ones (let lapse by the caller).
    async fn fill<S: IdempotencyStore>(&mut self, store: &S, n: usize) {
        for i in 0..n {
            let key = ScopedKey::new("churn", format!("{}-pool-{}-{i}", self.tag, self.fresh));
            let token = mark(store, &key).await;
            self.pool.push((key, token));
            let key = ScopedKey::new("churn", format!("{}-lapsed-{}-{i}", self.tag, self.fresh));
            let token = lapsing(store, &key).await;
            self.lapsed.push((key, token));
        }
        self.fresh += 1;
    }

    /// One round of changes: resolve one, remove one, move one later by a milestone, mark a
    /// new one uncertain.
    async fn step<S: IdempotencyStore>(&mut self, store: &S) {
        if self.budget == 0 {
            return;
        }
        self.budget -= 1;
        if let Some((key, token)) = self.pool.pop() {
            settle(store, &key, token).await;
        }
        if let Some((key, _)) = self.pool.pop() {
            assert!(store.remove(&key).await.expect("remove"), "removed");
        }
        if let Some((key, token)) = self.lapsed.pop() {
            store
                .record_milestone(&key, token, &Milestone::DownstreamId("moved".into()))
                .await
                .expect("a milestone on a lapsed lease");
            // Still uncertain, now later in the listing; and it may move again.
            self.lapsed.insert(0, (key, token));
        }
        self.fresh += 1;
        let key = ScopedKey::new("churn", format!("{}-new-{}", self.tag, self.fresh));
        let token = mark(store, &key).await;
        self.pool.insert(0, (key, token));
    }
}

/// Walks the whole listing in pages of `limit`, `churn` changing other records between pages.
/// Fails on a page over its limit, a key twice in one page, a cursor that does not move on in
/// the listing's time order, or a walk that does not end.
async fn walk<S: IdempotencyStore>(
    store: &S,
    limit: usize,
    newest: bool,
    mut churn: Option<&mut Churn>,
    what: &str,
) -> Walked {
    let order = |q: UncertainQuery| if newest { q.newest_first() } else { q };
    let mut query = order(UncertainQuery::first(limit));
    let mut walked = Walked::default();
    loop {
        let page = store.list_uncertain(&query).await.expect("list_uncertain");
        walked.pages += 1;
        assert!(
            page.records.len() + page.unreadable.len() <= limit,
            "{what}: a page of {} records and {} unreadable, asked for {limit}",
            page.records.len(),
            page.unreadable.len()
        );
        assert!(page.unreadable.is_empty(), "{what}: nothing is unreadable");
        let in_page: BTreeSet<&ScopedKey> = page.records.iter().map(|r| &r.key).collect();
        assert_eq!(
            in_page.len(),
            page.records.len(),
            "{what}: a key twice in one page: {:?}",
            page.records.iter().map(|r| &r.key).collect::<Vec<_>>()
        );
        for r in &page.records {
            walked.keys.push(r.key.clone());
        }
        walked.records.extend(page.records);
        assert!(
            walked.pages <= 2_000,
            "{what}: the walk does not end ({} pages)",
            walked.pages
        );
        let Some(next) = page.next else {
            return walked;
        };
        if let Some(prev) = walked.cursors.last() {
            let moved_on = if newest {
                next.updated_at <= prev.updated_at
            } else {
                next.updated_at >= prev.updated_at
            };
            assert!(
                moved_on && next != *prev,
                "{what}: the cursor does not move on: {prev:?} then {next:?}"
            );
        }
        walked.cursors.push(next.clone());
        if let Some(churn) = churn.as_deref_mut() {
            churn.step(store).await;
        }
        query = order(UncertainQuery::after(next, limit));
    }
}

/// How many times each of `keys` was listed.
fn tally(walked: &[ScopedKey], keys: &[ScopedKey]) -> BTreeMap<ScopedKey, usize> {
    let mut seen: BTreeMap<ScopedKey, usize> = keys.iter().map(|k| (k.clone(), 0)).collect();
    for key in walked {
        if let Some(n) = seen.get_mut(key) {
            *n += 1;
        }
    }
    seen
}

fn ours(walked: &[ScopedKey], keys: &BTreeSet<ScopedKey>) -> Vec<ScopedKey> {
    walked
        .iter()
        .filter(|k| keys.contains(*k))
        .cloned()
        .collect()
}

/// Each of `steady` is in `listed` exactly once, and they come in `reference`'s order (the
/// quiet oldest-first listing's), reversed for `newest` first.
fn assert_listed_once_in_order(
    what: &str,
    listed: &[ScopedKey],
    steady: &[ScopedKey],
    reference: &[ScopedKey],
    newest: bool,
) {
    let seen = tally(listed, steady);
    let wrong: Vec<_> = seen.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        wrong.is_empty(),
        "{what}: steady records not listed exactly once (key, times): {wrong:?}"
    );
    let mut expected = reference.to_vec();
    if newest {
        expected.reverse();
    }
    let steady: BTreeSet<ScopedKey> = steady.iter().cloned().collect();
    assert_eq!(
        ours(listed, &steady),
        expected,
        "{what}: in the quiet listing's order"
    );
}

/// Marks every key uncertain; returns them in the order given.
async fn mark_all<S: IdempotencyStore>(store: &S, keys: &[ScopedKey]) -> Vec<FencingToken> {
    let mut tokens = Vec::new();
    for key in keys {
        tokens.push(mark(store, key).await);
    }
    tokens
}

// ---- the walk under change -----------------------------------------------------------------

/// Issue 18 §2, DESIGN §4: a walk of the listing, in pages of 1, 2, 3, 5 and of all, oldest
/// or newest first, lists every record that stays uncertain and untouched exactly once, in
/// the quiescent listing's order, and none settled before it started; while between its pages
/// others are resolved, removed, moved by a milestone and marked, and two more tasks mark and
/// settle records of their own throughout.
async fn s4_walk_lists_each_untouched_record_once_under_change<S: IdempotencyStore>(
    store: Arc<S>,
    name: &str,
) {
    // Steady records: odd keys marked in a tight loop (many share a millisecond), and lapsed
    // leases whose holder recorded a milestone.
    let mut steady = odd_keys("steady");
    mark_all(&*store, &steady).await;
    let mut lapsed_steady = Vec::new();
    for i in 0..4 {
        let key = ScopedKey::new("lapsed", format!("steady-{i}"));
        lapsing(&*store, &key).await;
        lapsed_steady.push(key);
    }
    steady.extend(lapsed_steady);
    // Settled before any walk: never listed.
    let mut gone = Vec::new();
    for i in 0..6 {
        let key = ScopedKey::new("gone", format!("resolved-{i}"));
        let token = mark(&*store, &key).await;
        settle(&*store, &key, token).await;
        gone.push(key);
        let key = ScopedKey::new("gone", format!("removed-{i}"));
        mark(&*store, &key).await;
        assert!(store.remove(&key).await.expect("remove"));
        gone.push(key);
    }
    tokio::time::sleep(LAPSE).await;
    let steady_set: BTreeSet<ScopedKey> = steady.iter().cloned().collect();

    let quiet = walk(&*store, 10_000, false, None, &format!("{name}: quiescent")).await;
    let reference = ours(&quiet.keys, &steady_set);
    assert_eq!(
        reference.len(),
        steady.len(),
        "{name}: a quiescent walk lists every steady record once"
    );

    // Two tasks mark and settle records of their own for as long as the walks go on.
    let stop = Arc::new(AtomicBool::new(false));
    let mut background = Vec::new();
    for t in 0..2 {
        let (store, stop) = (store.clone(), stop.clone());
        background.push(tokio::spawn(async move {
            let mut n = 0usize;
            while !stop.load(Ordering::SeqCst) && n < 400 {
                let key = ScopedKey::new("bg", format!("{t}-{n}"));
                let token = mark(&*store, &key).await;
                if n.is_multiple_of(2) {
                    settle(&*store, &key, token).await;
                } else {
                    store.remove(&key).await.expect("remove");
                }
                n += 1;
            }
        }));
    }

    for limit in [1, 2, 3, 5, 10_000] {
        for newest in [false, true] {
            let what = format!("{name}: pages of {limit}, newest first {newest}");
            let mut churn = Churn::new(&format!("{limit}-{newest}"));
            churn.fill(&*store, 6).await;
            tokio::time::sleep(LAPSE).await;
            let walked = walk(&*store, limit, newest, Some(&mut churn), &what).await;
            assert_listed_once_in_order(&what, &walked.keys, &steady, &reference, newest);
            for key in &gone {
                assert!(
                    !walked.keys.contains(key),
                    "{what}: {key:?}, settled before the walk, is listed"
                );
            }
            // Leave no churn behind for the next walk's count.
            for (key, token) in churn.pool.drain(..) {
                settle(&*store, &key, token).await;
            }
            for (key, _) in churn.lapsed.drain(..) {
                store.remove(&key).await.expect("remove");
            }
        }
    }
    stop.store(true, Ordering::SeqCst);
    for task in background {
        task.await.expect("a background task");
    }
    // Quiescent again: the count is what a walk lists.
    let count = store.count_uncertain().await.expect("count_uncertain");
    for limit in [1, 3, 10_000] {
        let walked = walk(&*store, limit, false, None, name).await;
        assert_eq!(
            count.count,
            walked.keys.len() as u64,
            "{name}: count_uncertain agrees with a quiescent walk in pages of {limit}"
        );
    }
}

common::on_every_store_afresh!(
    s4_walk_lists_each_untouched_record_once_under_change,
    "luc_walk"
);

// ---- order at ties and count -----------------------------------------------------------------

/// Issue 18 §2, §5: records marked in a tight loop (many in one millisecond, scopes of
/// different lengths, keys that join to the same bytes) list in the documented order, oldest
/// change first, then in the store's order of keys (scope, then key; for Redis the stored
/// member's bytes, the scope's length in decimal first), in pages of one;
/// a cursor made by hand at every tie boundary pages on from exactly there; newest first is
/// the exact reverse; and `count_uncertain` agrees with every quiescent walk.
async fn s4_ties_list_in_key_order_and_count_agrees<S: IdempotencyStore>(
    store: Arc<S>,
    name: &str,
) {
    let mut keys = Vec::new();
    for i in 0..12 {
        for scope in ["b", "aa", "a", "", "tenant-0123456789", "tenant-9"] {
            keys.push(ScopedKey::new(scope, format!("k{i:02}")));
            keys.push(ScopedKey::new(scope, format!("ak{i:02}")));
        }
    }
    // Twelve at a time, concurrently: many share a millisecond.
    for chunk in keys.chunks(12) {
        futures_util::future::join_all(chunk.iter().map(|key| mark(&*store, key))).await;
    }
    let all: BTreeSet<ScopedKey> = keys.iter().cloned().collect();

    // Pages of one: each next cursor is exactly the place of the record the page held.
    let ones = walk(&*store, 1, false, None, &format!("{name}: pages of 1")).await;
    assert_eq!(ones.keys.len(), keys.len(), "{name}: all listed");
    assert_eq!(
        ones.keys.iter().collect::<BTreeSet<_>>().len(),
        keys.len(),
        "{name}: none twice"
    );
    let places: Vec<&UncertainCursor> = ones.cursors.iter().collect();
    let mut ties = 0;
    let mut out_of_order = Vec::new();
    // The documented order of keys changed in the same instant.
    let redis = name.starts_with("redis");
    let stored = |key: &ScopedKey| {
        let mut member = format!("{}:", key.scope().len()).into_bytes();
        member.extend_from_slice(key.scope().as_bytes());
        member.extend_from_slice(key.key().as_bytes());
        member
    };
    let before = |a: &ScopedKey, b: &ScopedKey| match redis {
        true => stored(a) < stored(b),
        false => a < b,
    };
    for w in places.windows(2) {
        if w[0].updated_at == w[1].updated_at {
            ties += 1;
        }
        let in_order = w[0].updated_at < w[1].updated_at
            || (w[0].updated_at == w[1].updated_at && before(&w[0].key, &w[1].key));
        if !in_order {
            out_of_order.push((w[0].key.clone(), w[1].key.clone()));
        }
    }
    assert!(
        out_of_order.is_empty(),
        "{name}: listed out of the documented order at {} of {ties} ties, e.g. {:?}",
        out_of_order.len(),
        out_of_order.iter().take(3).collect::<Vec<_>>()
    );

    // A hand-made cursor at every place pages on from exactly there, both ways.
    for (i, place) in ones.cursors.iter().enumerate() {
        let made = UncertainCursor::new(place.updated_at, place.key.clone());
        let after = store
            .list_uncertain(&UncertainQuery::after(made.clone(), 1))
            .await
            .expect("list after");
        let expected_after = ones.keys.get(i + 1);
        assert_eq!(
            after.records.first().map(|r| &r.key),
            expected_after,
            "{name}: the page after a hand-made cursor at {:?}",
            place.key
        );
        let before = store
            .list_uncertain(&UncertainQuery::after(made, 1).newest_first())
            .await
            .expect("list before");
        let expected_before = i.checked_sub(1).map(|j| &ones.keys[j]);
        assert_eq!(
            before.records.first().map(|r| &r.key),
            expected_before,
            "{name}: the page before a hand-made cursor at {:?}",
            place.key
        );
    }

    let count = store.count_uncertain().await.expect("count_uncertain");
    for limit in [1, 2, 3, 7, 10_000] {
        for newest in [false, true] {
            let what = format!("{name}: pages of {limit}, newest first {newest}");
            let walked = walk(&*store, limit, newest, None, &what).await;
            let mut expected = ones.keys.clone();
            if newest {
                expected.reverse();
            }
            assert_eq!(walked.keys, expected, "{what}: the same listing");
            assert_eq!(
                count.count,
                walked.keys.len() as u64,
                "{what}: count_uncertain agrees with the walk"
            );
        }
    }
    assert_eq!(
        count.oldest,
        ones.cursors.first().map(|c| c.updated_at),
        "{name}: the oldest is the first record's place"
    );
    assert_eq!(ours(&ones.keys, &all).len(), keys.len());
}

common::on_every_store_afresh!(s4_ties_list_in_key_order_and_count_agrees, "luc_ties");

// ---- the sweeper ---------------------------------------------------------------------------

/// A store that, right after each listing returns and before its caller reads the page,
/// settles a record of that very page (when it holds a churn record), removes another churn
/// record ahead, and marks a new one uncertain.
struct Racing<S> {
    inner: Arc<S>,
    pool: Mutex<Vec<(ScopedKey, FencingToken)>>,
    fresh: AtomicUsize,
    lists: AtomicUsize,
    /// Every churn key ever settled or removed by the race.
    settled: Mutex<BTreeSet<ScopedKey>>,
}

impl<S: IdempotencyStore> Racing<S> {
    fn new(inner: Arc<S>, pool: Vec<(ScopedKey, FencingToken)>) -> Self {
        Self {
            inner,
            pool: Mutex::new(pool),
            fresh: AtomicUsize::new(0),
            lists: AtomicUsize::new(0),
            settled: Mutex::new(BTreeSet::new()),
        }
    }

    fn take(&self, key: &ScopedKey) -> Option<FencingToken> {
        let mut pool = self.pool.lock().expect("pool");
        let i = pool.iter().position(|(k, _)| k == key)?;
        Some(pool.remove(i).1)
    }

    async fn race(&self, page: &UncertainPage) {
        self.lists.fetch_add(1, Ordering::SeqCst);
        // One of the page's own churn records, settled before the sweeper asks about it.
        let in_page = page
            .records
            .iter()
            .rev()
            .find_map(|r| self.take(&r.key).map(|t| (r.key.clone(), t)));
        if let Some((key, token)) = in_page {
            settle(&*self.inner, &key, token).await;
            self.settled.lock().expect("settled").insert(key);
        }
        // One ahead, removed.
        let ahead = self.pool.lock().expect("pool").pop();
        if let Some((key, _)) = ahead {
            self.inner.remove(&key).await.expect("remove");
            self.settled.lock().expect("settled").insert(key);
        }
        let n = self.fresh.fetch_add(1, Ordering::SeqCst);
        let key = ScopedKey::new("churn", format!("raced-{n}"));
        let token = mark(&*self.inner, &key).await;
        self.pool.lock().expect("pool").insert(0, (key, token));
    }
}

impl<S: IdempotencyStore> IdempotencyStore for Racing<S> {
    async fn list_uncertain(&self, query: &UncertainQuery) -> Result<UncertainPage, StoreError> {
        let page = self.inner.list_uncertain(query).await?;
        self.race(&page).await;
        Ok(page)
    }

    crate::common::forward::forward_store!(inner: claim, claim_now, recorded_fingerprint_now, completed_now, renew, complete, release, mark_uncertain, lookup, remove, purge_expired, record_milestone, count_uncertain, resolve, append_history, wait_for_change);
}

/// Applies what is steady, knows nothing of the rest; counts what it was asked.
#[derive(Clone, Default)]
struct Steady(Arc<Mutex<HashMap<ScopedKey, usize>>>);

impl Reconciler for Steady {
    async fn reconcile(&self, record: &Record) -> Reconciliation {
        *self
            .0
            .lock()
            .expect("asked")
            .entry(record.key.clone())
            .or_default() += 1;
        if record.key.scope() == "steady" {
            Reconciliation::Applied(Box::new(response()))
        } else {
            Reconciliation::Unknown
        }
    }
}

/// DESIGN §4 ("makes fair progress past records it cannot settle"): a sweeper in batches of
/// 1, 2, 3 and 50 reconciles every steady record, each asked and resolved exactly once, within
/// a bounded number of passes, while records it cannot settle pile up, and others are settled
/// and marked right after each of its listings (one of them in the very page it reads).
async fn s4_sweeper_reconciles_each_steady_record_once_while_others_settle<S: IdempotencyStore>(
    store: Arc<S>,
    name: &str,
) {
    for batch in [1, 2, 3, 50] {
        let what = format!("{name}: batches of {batch}");
        // Interleaved, in tight loops: steady and churn records share milliseconds.
        let mut steady = Vec::new();
        let mut pool = Vec::new();
        for i in 0..12usize {
            let key = ScopedKey::new("steady", format!("{batch}-{i}"));
            mark(&*store, &key).await;
            steady.push(key);
            for j in 0..2 {
                let key = ScopedKey::new("churn", format!("{batch}-{i}-{j}"));
                let token = mark(&*store, &key).await;
                pool.push((key, token));
            }
            if i.is_multiple_of(4) {
                let key = ScopedKey::new("steady", format!("{batch}-lapsed-{i}"));
                lapsing(&*store, &key).await;
                steady.push(key);
            }
        }
        tokio::time::sleep(LAPSE).await;
        let before = store.count_uncertain().await.expect("count").count as usize;
        let racing = Racing::new(store.clone(), pool);
        let asked = Steady::default();
        let sweeper = Sweeper::new(racing, asked.clone())
            .batch(batch)
            .ttl(LONG)
            .record_timeout(Duration::from_secs(10));
        // A round takes at most (records / batch) + 1 passes, and every record but the ones
        // raced in after it started is older than the steady ones' end: two rounds suffice.
        let bound = 2 * (before / batch + 2) + 4;
        let mut total = SweepReport::default();
        let mut passes = 0;
        let done = |asked: &Steady| {
            let asked = asked.0.lock().expect("asked");
            steady
                .iter()
                .all(|k| asked.get(k).copied().unwrap_or(0) >= 1)
        };
        while !done(&asked) && passes < bound {
            let report = sweeper.run_once().await.expect("a pass");
            total.applied += report.applied;
            total.raced += report.raced;
            total.failed += report.failed;
            total.unreadable += report.unreadable;
            passes += 1;
        }
        let asked = asked.0.lock().expect("asked").clone();
        let missing: Vec<_> = steady.iter().filter(|k| !asked.contains_key(*k)).collect();
        assert!(
            missing.is_empty(),
            "{what}: after {passes} passes (bound {bound}, {before} uncertain at the start), \
             never asked about {missing:?}"
        );
        let twice: Vec<_> = steady
            .iter()
            .filter(|k| asked.get(*k).copied().unwrap_or(0) > 1)
            .collect();
        assert!(
            twice.is_empty(),
            "{what}: asked more than once about {twice:?}"
        );
        assert_eq!(
            total.applied,
            steady.len(),
            "{what}: each steady record resolved once"
        );
        assert_eq!(total.failed, 0, "{what}: no failure");
        for key in &steady {
            let record = store
                .lookup(key)
                .await
                .expect("lookup")
                .expect("the record");
            assert_eq!(record.status, RecordStatus::Completed, "{what}: {key:?}");
        }
        // Settle what is left for the next batch size.
        let mut left = Vec::new();
        let mut query = UncertainQuery::first(500);
        loop {
            let page = store.list_uncertain(&query).await.expect("list");
            left.extend(page.records);
            match page.next {
                Some(next) => query = UncertainQuery::after(next, 500),
                None => break,
            }
        }
        for record in left {
            store.remove(&record.key).await.expect("remove");
        }
    }
}

common::on_every_store_afresh!(
    s4_sweeper_reconciles_each_steady_record_once_while_others_settle,
    "luc_sweep"
);

// ---- the console ---------------------------------------------------------------------------

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

async fn console_page(
    client: &reqwest::Client,
    ops: SocketAddr,
    limit: usize,
    newest: bool,
    after: Option<&str>,
) -> Value {
    let mut query = form_urlencoded::Serializer::new(String::new());
    query.append_pair("limit", &limit.to_string());
    query.append_pair("order", if newest { "newest" } else { "oldest" });
    if let Some(after) = after {
        query.append_pair("after", after);
    }
    let url = format!("http://{ops}/ops/api/uncertain?{}", query.finish());
    let res = client.get(url).send().await.expect("get");
    let status = res.status();
    let text = res.text().await.expect("body");
    assert_eq!(status, 200, "the console lists: {text}");
    serde_json::from_str(&text).expect("JSON")
}

/// DESIGN §4 (the console lists for incident review): the console's JSON listing over HTTP,
/// following its `next` cursor in pages of 1, 2, 3 and 500, oldest or newest first, lists
/// every steady record (odd keys included) exactly once, in the store's order, while others
/// change between its pages; and quiescent, its count is the walk's length.
async fn s4_console_pages_like_the_store_under_change<S: IdempotencyStore>(
    store: Arc<S>,
    name: &str,
) {
    let steady = odd_keys("console");
    mark_all(&*store, &steady).await;
    let steady_set: BTreeSet<ScopedKey> = steady.iter().cloned().collect();
    let ops = serve(Router::new().nest("/ops", Console::from_arc(store.clone()).router())).await;
    let client = http();
    let reference = walk(&*store, 10_000, false, None, name).await;
    let reference = ours(&reference.keys, &steady_set);
    for limit in [1, 2, 3, 500] {
        for newest in [false, true] {
            let what = format!("{name}: the console in pages of {limit}, newest first {newest}");
            let mut churn = Churn::new(&format!("console-{limit}-{newest}"));
            churn.fill(&*store, 4).await;
            tokio::time::sleep(LAPSE).await;
            let mut listed = Vec::new();
            let mut after: Option<String> = None;
            let mut pages = 0;
            loop {
                let page = console_page(&client, ops, limit, newest, after.as_deref()).await;
                pages += 1;
                let records = page["records"].as_array().expect("records");
                assert!(records.len() <= limit, "{what}: a page over its limit");
                for r in records {
                    let scope = r["scope"].as_str().expect("scope");
                    let key = r["key"].as_str().expect("key");
                    listed.push(ScopedKey::new(scope, key));
                }
                assert!(pages <= 1_000, "{what}: the listing does not end");
                match page["next"].as_str() {
                    Some(next) => {
                        assert_ne!(after.as_deref(), Some(next), "{what}: the cursor stands");
                        after = Some(next.to_owned());
                    }
                    None => break,
                }
                churn.step(&*store).await;
            }
            assert_listed_once_in_order(&what, &listed, &steady, &reference, newest);
            for (key, token) in churn.pool.drain(..) {
                settle(&*store, &key, token).await;
            }
            for (key, _) in churn.lapsed.drain(..) {
                store.remove(&key).await.expect("remove");
            }
        }
    }
    // Quiescent: the console's count is what its own walk lists.
    let mut listed = 0u64;
    let mut after: Option<String> = None;
    let mut count = None;
    for _ in 0..1_000 {
        let page = console_page(&client, ops, 3, false, after.as_deref()).await;
        listed += page["records"].as_array().expect("records").len() as u64;
        count = page["count"].as_u64();
        match page["next"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(
        count,
        Some(listed),
        "{name}: the console's count is its walk's"
    );
}

common::on_every_store_afresh!(s4_console_pages_like_the_store_under_change, "luc_console");

// ---- many tasks racing one walker ----------------------------------------------------------

/// Issue 18 §2 under a barrier: eight tasks start together with three walkers: four move lapsed
/// records later by milestones over and over, four mark and settle records; three walkers
/// (pages of 1, 2 and 3, one newest first) each list every steady record exactly once and no
/// page repeats a key.
async fn s4_walkers_and_writers_released_together<S: IdempotencyStore>(store: Arc<S>, name: &str) {
    let steady = odd_keys("race");
    mark_all(&*store, &steady).await;
    let mut movers = Vec::new();
    for i in 0..24 {
        let key = ScopedKey::new("mover", format!("{i}"));
        let token = lapsing(&*store, &key).await;
        movers.push((key, token));
    }
    tokio::time::sleep(LAPSE).await;
    let barrier = Arc::new(tokio::sync::Barrier::new(12));
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for t in 0..8 {
        let (store, stop, barrier) = (store.clone(), stop.clone(), barrier.clone());
        let mine: Vec<_> = movers.iter().skip(t % 4).step_by(4).cloned().collect();
        writers.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut n = 0usize;
            while !stop.load(Ordering::SeqCst) && n < 150 {
                if t < 4 {
                    let (key, token) = &mine[n % mine.len()];
                    store
                        .record_milestone(key, *token, &Milestone::DownstreamId(n.to_string()))
                        .await
                        .expect("milestone");
                } else {
                    let key = ScopedKey::new("writer", format!("{t}-{n}"));
                    let token = mark(&*store, &key).await;
                    settle(&*store, &key, token).await;
                }
                n += 1;
                tokio::task::yield_now().await;
            }
        }));
    }
    let mut walkers = Vec::new();
    for (limit, newest) in [(1, false), (2, false), (3, true)] {
        let (store, barrier) = (store.clone(), barrier.clone());
        let what = format!("{name}: racing walker, pages of {limit}, newest first {newest}");
        walkers.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut all = Vec::new();
            for _ in 0..3 {
                all.push(walk(&*store, limit, newest, None, &what).await.keys);
            }
            (what, all)
        }));
    }
    barrier.wait().await;
    let mut results = Vec::new();
    for walker in walkers {
        results.push(walker.await.expect("a walker"));
    }
    stop.store(true, Ordering::SeqCst);
    for writer in writers {
        writer.await.expect("a writer");
    }
    for (what, walks) in results {
        for keys in walks {
            let seen = tally(&keys, &steady);
            let wrong: Vec<_> = seen.iter().filter(|(_, n)| **n != 1).collect();
            assert!(
                wrong.is_empty(),
                "{what}: steady records not listed exactly once (key, times): {wrong:?}"
            );
        }
    }
}

common::on_every_store_afresh!(s4_walkers_and_writers_released_together, "luc_race");

// ---- a cursor made from a listed record ------------------------------------------------------

/// Issue 18 §2: `UncertainCursor::new(updated_at, key)` is "a cursor just past the record of
/// `key` last changed at `updated_at`": made from the last record a page listed (its
/// `updated_at` and key), it pages on exactly as the page's own `next` does, neither listing
/// that record again nor skipping any, in pages of 1 and 2, both orders.
async fn s4_a_cursor_made_from_a_listed_record_pages_on<S: IdempotencyStore>(
    store: Arc<S>,
    name: &str,
) {
    let mut keys = Vec::new();
    for i in 0..40 {
        keys.push(ScopedKey::new("made", format!("k{i:02}")));
    }
    for chunk in keys.chunks(4) {
        futures_util::future::join_all(chunk.iter().map(|key| mark(&*store, key))).await;
        tokio::time::sleep(Duration::from_micros(300)).await;
    }
    for limit in [1, 2] {
        for newest in [false, true] {
            let what = format!(
                "{name}: cursors made from records, pages of {limit}, newest first {newest}"
            );
            let reference = walk(&*store, limit, newest, None, &what).await.keys;
            let order = |q: UncertainQuery| if newest { q.newest_first() } else { q };
            let mut query = order(UncertainQuery::first(limit));
            let mut listed = Vec::new();
            for _ in 0..(3 * keys.len()) {
                let page = store.list_uncertain(&query).await.expect("list_uncertain");
                listed.extend(page.records.iter().map(|r| r.key.clone()));
                let (Some(_), Some(last)) = (page.next, page.records.last()) else {
                    break;
                };
                let made = UncertainCursor::new(last.updated_at, last.key.clone());
                query = order(UncertainQuery::after(made, limit));
            }
            assert_eq!(
                listed.len(),
                reference.len(),
                "{what}: as many records as the walk by `next` (first differences: {:?})",
                listed
                    .iter()
                    .zip(&reference)
                    .filter(|(a, b)| a != b)
                    .take(3)
                    .collect::<Vec<_>>()
            );
            assert_eq!(listed, reference, "{what}: the same records, in order");
        }
    }
}

common::on_every_store_afresh!(s4_a_cursor_made_from_a_listed_record_pages_on, "luc_made");
