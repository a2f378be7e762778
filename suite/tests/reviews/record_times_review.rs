use crate::common;

// Adversarial review of three changes: `UncertainPage::scanned` (a page read in two steps
// goes on by what its scan found), the SQL stores reading a record's last change at the
// listing cursor's tick in every statement that returns a record (so that a record read by
// `lookup`, or returned by a claim, stands exactly where `list_uncertain` places it), and the
// seed helper's refactor (tests only). DESIGN §2 (the record's times), §4 (the listing that
// reconciliation and the console page through), §5 (one behaviour for every store, batched
// or not). Each scenario runs on every store: memory, SQLite on a file (alone and batching),
// PostgreSQL (alone and batching), Redis and Redis Cluster; times written by hand on the SQL
// stores. Sleeps only let leases lapse; every walk is bounded and fails the test.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use futures_util::future::join_all;
use serde_json::Value;
use tower_idempotency::console::Console;
use tower_idempotency::reconcile::{Reconciler, Reconciliation, Sweeper};
use tower_idempotency::store::{
    Batching, Claim, ClaimRequest, FencingToken, Milestone, Record, RecordStatus, Resolution,
    ScopedKey, StoreError, StoredResponse, UncertainCursor, UncertainPage, UncertainQuery,
};
use tower_idempotency::{Fingerprint, IdempotencyStore, LeaseExpiry, MemoryStore};

// ---- records -----------------------------------------------------------------------------

const LONG: Duration = Duration::from_secs(3600);
/// A lease that lapses before [`LAPSE`] is over.
const SHORT_LEASE: Duration = Duration::from_millis(40);
const LAPSE: Duration = Duration::from_millis(150);

fn request(key: &ScopedKey, lease: Duration) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        fingerprint: Fingerprint::from_bytes([5; 32]),
        lease,
        ttl: LONG,
        on_lease_expiry: LeaseExpiry::Reclaim,
    }
}

async fn acquire<S: IdempotencyStore>(store: &S, key: &ScopedKey, lease: Duration) -> FencingToken {
    match store.claim(&request(key, lease)).await.expect("claim") {
        Claim::Acquired(lease) => lease.token,
        other => panic!("{key:?}: a fresh key is acquired, got {other:?}"),
    }
}

/// Claims every key, then marks them all uncertain at once: tasks released by one barrier
/// (many land in one millisecond, on PostgreSQL in one millisecond but apart in microseconds).
async fn mark_together<S: IdempotencyStore>(store: &Arc<S>, keys: &[ScopedKey]) {
    let tokens = join_all(keys.iter().map(|key| acquire(&**store, key, LONG))).await;
    let barrier = Arc::new(tokio::sync::Barrier::new(keys.len()));
    let tasks: Vec<_> = keys
        .iter()
        .cloned()
        .zip(tokens)
        .map(|(key, token)| {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                store
                    .mark_uncertain(&key, token)
                    .await
                    .expect("mark_uncertain");
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("a marker");
    }
}

/// Claims and marks each key uncertain, one after another.
async fn mark_each<S: IdempotencyStore>(store: &S, keys: &[ScopedKey]) {
    for key in keys {
        let token = acquire(store, key, LONG).await;
        store
            .mark_uncertain(key, token)
            .await
            .expect("mark_uncertain");
    }
}

/// Records in progress with their effect started, whose leases lapse within [`LAPSE`].
async fn lapsing<S: IdempotencyStore>(store: &S, keys: &[ScopedKey]) {
    for key in keys {
        let token = acquire(store, key, SHORT_LEASE).await;
        store
            .record_milestone(key, token, &Milestone::EffectStarted)
            .await
            .expect("effect started");
    }
}

async fn looked_up<S: IdempotencyStore>(store: &S, key: &ScopedKey) -> Record {
    store
        .lookup(key)
        .await
        .expect("lookup")
        .unwrap_or_else(|| panic!("{key:?}: the record"))
}

/// The record a claim of `key` answers with (it stands: awaiting reconciliation, or sent
/// there by this very claim), and the store's clock the claim read it at.
async fn existing<S: IdempotencyStore>(store: &S, key: &ScopedKey) -> (Record, SystemTime) {
    match store.claim(&request(key, LONG)).await.expect("claim") {
        Claim::Existing { record, now } => (*record, now),
        other => panic!("{key:?}: a claim answers the record that stands, got {other:?}"),
    }
}

fn response() -> StoredResponse {
    StoredResponse {
        status: http::StatusCode::OK,
        headers: http::HeaderMap::new(),
        body: Some(bytes::Bytes::from_static(b"reconciled")),
        trailers: None,
    }
}

// ---- times -------------------------------------------------------------------------------

/// Days from 1970-01-01 to a date of the proleptic Gregorian calendar (year 0 is 1 BC).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Microseconds from the epoch of a UTC date and time.
fn civil_micros(y: i64, mo: i64, d: i64, h: i64, mi: i64, s: i64, us: i64) -> i64 {
    (days_from_civil(y, mo, d) * 86_400 + h * 3_600 + mi * 60 + s) * 1_000_000 + us
}

fn at_micros(n: i64) -> SystemTime {
    match n >= 0 {
        true => UNIX_EPOCH + Duration::from_micros(n.unsigned_abs()),
        false => UNIX_EPOCH - Duration::from_micros(n.unsigned_abs()),
    }
}

fn at_millis(n: i64) -> SystemTime {
    match n >= 0 {
        true => UNIX_EPOCH + Duration::from_millis(n.unsigned_abs()),
        false => UNIX_EPOCH - Duration::from_millis(n.unsigned_abs()),
    }
}

/// A time in whole microseconds from the epoch, rounded down.
fn micros_of(t: SystemTime) -> i128 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(after) => after.as_micros() as i128,
        Err(before) => -(before.duration().as_nanos().div_ceil(1_000) as i128),
    }
}

// ---- walking -------------------------------------------------------------------------------

/// How a walk makes the cursor of its next page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum By {
    /// The page's own `next`.
    Next,
    /// `UncertainCursor::new` from the page's last record as `lookup` reads it.
    Lookup,
    /// `UncertainCursor::new` from the page's last record as a claim of its key answers it.
    Claim,
}

/// Walks the whole listing in pages of `limit` (newest first or not), each next page after a
/// cursor made `by`; a made cursor must be the page's own `next`, exactly. The keys listed
/// (readable or not), in order; fails on a page over its limit or a walk over `bound` pages.
async fn walk<S: IdempotencyStore>(
    store: &S,
    limit: usize,
    newest: bool,
    by: By,
    bound: usize,
    what: &str,
) -> Vec<ScopedKey> {
    let order = |q: UncertainQuery| if newest { q.newest_first() } else { q };
    let mut query = order(UncertainQuery::first(limit));
    let mut listed = Vec::new();
    for _ in 0..bound {
        let page = store.list_uncertain(&query).await.expect("list_uncertain");
        assert!(
            page.records.len() + page.unreadable.len() <= limit,
            "{what}: a page over its limit of {limit}"
        );
        listed.extend(page.records.iter().map(|r| r.key.clone()));
        listed.extend(page.unreadable.iter().map(|u| u.key.clone()));
        let Some(next) = page.next.clone() else {
            return listed;
        };
        let cursor = match by {
            By::Next => next,
            By::Lookup | By::Claim => {
                let last = page
                    .records
                    .last()
                    .unwrap_or_else(|| panic!("{what}: a page that goes on holds a record"));
                let record = match by {
                    By::Lookup => looked_up(store, &last.key).await,
                    _ => existing(store, &last.key).await.0,
                };
                let made = UncertainCursor::new(record.updated_at, record.key.clone());
                assert_eq!(
                    made, next,
                    "{what}: a cursor made from the record {by:?} gave is the page's own next"
                );
                made
            }
        };
        query = order(UncertainQuery::after(cursor, limit));
    }
    panic!("{what}: the walk did not end within {bound} pages; listed {listed:?}");
}

/// The whole listing in one page, in order.
async fn whole<S: IdempotencyStore>(store: &S, newest: bool) -> Vec<Record> {
    let mut query = UncertainQuery::first(10_000);
    if newest {
        query = query.newest_first();
    }
    let page = store.list_uncertain(&query).await.expect("list_uncertain");
    assert!(page.next.is_none(), "one page holds the whole listing");
    assert!(page.unreadable.is_empty(), "every record reads");
    page.records
}

/// Each key of `keys` is in `listed` exactly once, and nothing else is.
fn once_each(listed: &[ScopedKey], keys: &[ScopedKey], what: &str) {
    let mut seen: BTreeMap<&ScopedKey, usize> = BTreeMap::new();
    for key in listed {
        *seen.entry(key).or_default() += 1;
    }
    let wrong: Vec<_> = keys
        .iter()
        .map(|k| (k, seen.get(k).copied().unwrap_or(0)))
        .filter(|(_, n)| *n != 1)
        .collect();
    assert!(
        wrong.is_empty(),
        "{what}: listed other than once (key, times): {wrong:?}; the walk: {listed:?}"
    );
    assert_eq!(listed.len(), keys.len(), "{what}: nothing else listed");
}

// ---- lookup, claims and the listing agree ---------------------------------------------------

/// DESIGN §4, §5: a record read by `lookup`, or answered by a claim (alone or in a batch,
/// one the claim itself sent to reconciliation included), carries exactly the time the
/// listing places it at; a cursor made from it (`UncertainCursor::new`) is the page's own
/// `next`, so pages of 1 and 2, oldest or newest first, list every record once in the
/// listing's order, whichever way the cursors are made. Records marked together by tasks
/// released at once share milliseconds. A listing asked for `usize::MAX` is the whole one;
/// one asked for 0 holds nothing.
async fn s4_looked_up_and_claimed_records_page_exactly_past_themselves<S: IdempotencyStore>(
    store: Arc<S>,
    name: &str,
) {
    let marked: Vec<ScopedKey> = (0..32)
        .map(|i| ScopedKey::new(["", "a", "b"][i % 3], format!("m{i:02}")))
        .collect();
    mark_together(&store, &marked).await;
    let lapsed: Vec<ScopedKey> = (0..8)
        .map(|i| ScopedKey::new("l", format!("l{i}")))
        .collect();
    lapsing(&*store, &lapsed).await;
    tokio::time::sleep(LAPSE).await;
    // Claimed together (a batching store sends them as one statement): each claim finds a
    // lapsed lease whose effect started and sends the record to reconciliation.
    let sent = join_all(lapsed.iter().map(|key| existing(&*store, key))).await;
    let mut keys = marked.clone();
    keys.extend(lapsed.iter().cloned());

    let listing = whole(&*store, false).await;
    let reference: Vec<ScopedKey> = listing.iter().map(|r| r.key.clone()).collect();
    once_each(&reference, &keys, &format!("{name}: the whole listing"));
    let place: HashMap<&ScopedKey, SystemTime> =
        listing.iter().map(|r| (&r.key, r.updated_at)).collect();
    for (key, (record, _)) in lapsed.iter().zip(&sent) {
        assert_eq!(
            record.status,
            RecordStatus::NeedsReconciliation,
            "{name}: {key:?} sent to reconciliation by the claim"
        );
        assert_eq!(
            record.updated_at, place[key],
            "{name}: {key:?} as the claim that sent it to reconciliation answered it stands \
             where the listing places it"
        );
    }
    let claimed = join_all(keys.iter().map(|key| existing(&*store, key))).await;
    for (key, (record, _)) in keys.iter().zip(&claimed) {
        let found = looked_up(&*store, key).await;
        assert_eq!(
            found.updated_at, place[key],
            "{name}: {key:?} as lookup reads it stands where the listing places it"
        );
        assert_eq!(
            record.updated_at, place[key],
            "{name}: {key:?} as a claim answers it stands where the listing places it"
        );
    }

    let bound = 3 * keys.len() + 3;
    for limit in [1, 2] {
        for newest in [false, true] {
            let mut expected = reference.clone();
            if newest {
                expected.reverse();
            }
            for by in [By::Next, By::Lookup, By::Claim] {
                let what = format!("{name}: pages of {limit}, newest first {newest}, by {by:?}");
                let listed = walk(&*store, limit, newest, by, bound, &what).await;
                assert_eq!(
                    listed, expected,
                    "{what}: the listing's records, in its order"
                );
            }
        }
    }

    let all = store
        .list_uncertain(&UncertainQuery::first(usize::MAX))
        .await
        .expect("a listing asked for usize::MAX");
    let all: Vec<ScopedKey> = all.records.iter().map(|r| r.key.clone()).collect();
    assert_eq!(
        all, reference,
        "{name}: usize::MAX asks for the whole listing"
    );
    let none = store
        .list_uncertain(&UncertainQuery::first(0))
        .await
        .expect("a listing asked for 0");
    assert!(
        none.records.is_empty() && none.unreadable.is_empty(),
        "{name}: a page asked for 0 holds nothing"
    );
}

common::on_every_store_afresh!(
    s4_looked_up_and_claimed_records_page_exactly_past_themselves,
    "rtr_agree"
);

// ---- a record's times agree with each other -------------------------------------------------

/// What is wrong with a record's times: created after its last change, or a history entry
/// later than its last change (every write here that logs an entry also sets the record's
/// last change, on one clock reading).
fn times_wrong(record: &Record, what: &str) -> Vec<String> {
    let mut wrong = Vec::new();
    if record.created_at > record.updated_at {
        wrong.push(format!(
            "{what} {:?}: created at {} us, after its last change at {} us",
            record.key,
            micros_of(record.created_at),
            micros_of(record.updated_at)
        ));
    }
    for entry in &record.history {
        if entry.at > record.updated_at {
            wrong.push(format!(
                "{what} {:?}: history entry {:?} at {} us, after its last change at {} us",
                record.key,
                entry.event,
                micros_of(entry.at),
                micros_of(record.updated_at)
            ));
        }
    }
    wrong
}

/// Fails with how many of `of` cases on store `name` went wrong (`what`), and the first few.
fn assert_none_wrong(name: &str, wrong: &[String], of: usize, what: &str) {
    assert!(
        wrong.is_empty(),
        "{name}: {} of {of} {what}, e.g. {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(4)]
    );
}

/// DESIGN §2, §5 (one behaviour): a record is never created after its last change, and no
/// entry of its history (written by the same write, on the same clock) is later than its last
/// change, as `lookup` reads it: freshly claimed (created, changed and logged "claimed" in one
/// statement), then marked uncertain.
async fn s2_a_record_is_never_created_or_logged_after_its_last_change<S: IdempotencyStore>(
    store: Arc<S>,
    name: &str,
) {
    let keys: Vec<ScopedKey> = (0..40)
        .map(|i| ScopedKey::new("times", format!("k{i:02}")))
        .collect();
    let tokens = join_all(keys.iter().map(|key| acquire(&*store, key, LONG))).await;
    let mut wrong = Vec::new();
    for key in &keys {
        wrong.extend(times_wrong(&looked_up(&*store, key).await, "claimed"));
    }
    for (key, token) in keys.iter().zip(tokens) {
        store
            .mark_uncertain(key, token)
            .await
            .expect("mark_uncertain");
    }
    for key in &keys {
        wrong.extend(times_wrong(&looked_up(&*store, key).await, "marked"));
    }
    assert_none_wrong(
        name,
        &wrong,
        2 * keys.len(),
        "reads have times out of order",
    );
}

common::on_every_store_afresh!(
    s2_a_record_is_never_created_or_logged_after_its_last_change,
    "rtr_times"
);

/// DESIGN §1 (the store's clock), §4: a claim that finds a lapsed lease whose effect started
/// sends the record to reconciliation and answers it `Existing`, with "the store's clock when
/// it read the record": the record's last change (this very claim's) is never after that
/// clock. In eight rounds of four keys claimed together (a batching store answers a round
/// from one or two statements, which share one clock reading).
async fn s4_a_claims_clock_is_never_before_the_change_it_answers<S: IdempotencyStore>(
    store: Arc<S>,
    name: &str,
) {
    let mut wrong = Vec::new();
    let mut claims = 0;
    for round in 0..8 {
        let keys: Vec<ScopedKey> = (0..4)
            .map(|i| ScopedKey::new("clock", format!("r{round}-k{i}")))
            .collect();
        lapsing(&*store, &keys).await;
        tokio::time::sleep(LAPSE).await;
        let answers = join_all(keys.iter().map(|key| existing(&*store, key))).await;
        for (key, (record, now)) in keys.iter().zip(&answers) {
            claims += 1;
            assert_eq!(
                record.status,
                RecordStatus::NeedsReconciliation,
                "{name}: {key:?} sent to reconciliation by the claim"
            );
            assert_eq!(
                looked_up(&*store, key).await.updated_at,
                record.updated_at,
                "{name}: {key:?}: the claim answers the record as it now stands"
            );
            if *now < record.updated_at {
                wrong.push(format!(
                    "{key:?}: read at {} us, last changed at {} us",
                    micros_of(*now),
                    micros_of(record.updated_at)
                ));
            }
        }
    }
    assert_none_wrong(
        name,
        &wrong,
        claims,
        "claims answer a record changed after the clock they read it at",
    );
}

common::on_every_store_afresh!(
    s4_a_claims_clock_is_never_before_the_change_it_answers,
    "rtr_clock"
);

// ---- the console -----------------------------------------------------------------------------

/// DESIGN §4 (the console): paging the console's JSON listing in pages of 1, oldest or newest
/// first, lists each record once; each `next` names the time of the record its page ended on,
/// as `lookup` reads it, to the microsecond; and the console shows no record created, nor any
/// history entry, after its last change (`created_at_ms`, `at_ms`, `updated_at_ms`).
async fn s4_console_cursors_name_the_looked_up_time<S: IdempotencyStore>(
    store: Arc<S>,
    name: &str,
) {
    let keys: Vec<ScopedKey> = (0..24)
        .map(|i| ScopedKey::new(["", "t"][i % 2], format!("c{i:02}")))
        .collect();
    mark_together(&store, &keys).await;
    let ops =
        common::serve(Router::new().nest("/ops", Console::from_arc(store.clone()).router())).await;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client");
    let mut shown_wrong = Vec::new();
    for newest in [false, true] {
        let what = format!("{name}: the console, newest first {newest}");
        let mut after: Option<String> = None;
        let mut listed = Vec::new();
        let mut ended = false;
        for _ in 0..(3 * keys.len()) {
            let mut query = form_urlencoded::Serializer::new(String::new());
            query.append_pair("limit", "1");
            query.append_pair("order", if newest { "newest" } else { "oldest" });
            if let Some(after) = &after {
                query.append_pair("after", after);
            }
            let url = format!("http://{ops}/ops/api/uncertain?{}", query.finish());
            let res = client.get(url).send().await.expect("get");
            assert_eq!(res.status(), 200, "{what}: the console lists");
            let page: Value = res.json().await.expect("JSON");
            for r in page["records"].as_array().expect("records") {
                let key = ScopedKey::new(
                    r["scope"].as_str().expect("scope"),
                    r["key"].as_str().expect("key"),
                );
                let updated = r["updated_at_ms"].as_u64().expect("updated_at_ms");
                let created = r["created_at_ms"].as_u64().expect("created_at_ms");
                if created > updated {
                    shown_wrong.push(format!("{key:?}: created_at_ms {created} > {updated}"));
                }
                for h in r["history"].as_array().expect("history") {
                    let at = h["at_ms"].as_u64().expect("at_ms");
                    if at > updated {
                        shown_wrong.push(format!("{key:?}: {} at_ms {at} > {updated}", h["event"]));
                    }
                }
                listed.push(key);
            }
            match page["next"].as_str() {
                Some(next) => {
                    let last = listed.last().expect("a page that goes on holds a record");
                    let record = looked_up(&*store, last).await;
                    let (micros, _) = next.split_once('~').expect("a cursor");
                    assert_eq!(
                        micros.parse::<i128>().expect("microseconds"),
                        micros_of(record.updated_at),
                        "{what}: the cursor after {last:?} names its looked-up time"
                    );
                    after = Some(next.to_owned());
                }
                None => {
                    ended = true;
                    break;
                }
            }
        }
        assert!(ended, "{what}: the listing ends");
        once_each(&listed, &keys, &what);
    }
    assert!(
        shown_wrong.is_empty(),
        "{name}: the console shows {} times out of order, e.g. {:?}",
        shown_wrong.len(),
        &shown_wrong[..shown_wrong.len().min(4)]
    );
}

common::on_every_store_afresh!(s4_console_cursors_name_the_looked_up_time, "rtr_console");

// ---- times written by hand: PostgreSQL --------------------------------------------------------

/// Writes `at` (SQL text) as the last change of each named key of `table`.
async fn pg_write_times(pool: &sqlx::PgPool, table: &str, times: &[(&str, &str)]) {
    for (name, at) in times {
        let done = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {table} SET updated_at = '{at}' WHERE key = '{name}'::bytea"
        )))
        .execute(pool)
        .await
        .expect("write a time by hand");
        assert_eq!(done.rows_affected(), 1, "{name}: one row");
    }
}

/// DESIGN §4, §5: on PostgreSQL, records whose last change was written by hand within one
/// millisecond (a microsecond apart, three at the very same microsecond, the microseconds
/// either side of a millisecond), just before the epoch, in year 1, far in the future and as
/// `-infinity`/`infinity` (two each): `lookup`, a claim alone and claims batched together
/// read each exactly at the time written; the listing places them so, in that order (then by
/// key); cursors made from looked-up or claimed records page on exactly, in pages of 1 and 3,
/// both ways; and the count's oldest is `-infinity`'s place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_postgres_times_written_within_a_millisecond_page_exactly() {
    let table = "rtr_pg_micro";
    let Some(store) = common::fresh_postgres(table).await else {
        return;
    };
    let Some(pool) = common::postgres_pool().await else {
        return;
    };
    let base = civil_micros(2021, 3, 4, 5, 6, 7, 123_000);
    let times: Vec<(&str, &str, i64)> = vec![
        ("p999", "2021-03-04 05:06:07.122999+00", base - 1),
        ("m000", "2021-03-04 05:06:07.123+00", base),
        ("m001", "2021-03-04 05:06:07.123001+00", base + 1),
        ("m002", "2021-03-04 05:06:07.123002+00", base + 2),
        ("m004", "2021-03-04 05:06:07.123004+00", base + 4),
        ("t004a", "2021-03-04 05:06:07.123004+00", base + 4),
        ("t004b", "2021-03-04 05:06:07.123004+00", base + 4),
        ("m499", "2021-03-04 05:06:07.123499+00", base + 499),
        ("m500", "2021-03-04 05:06:07.1235+00", base + 500),
        ("m999", "2021-03-04 05:06:07.123999+00", base + 999),
        ("n000", "2021-03-04 05:06:07.124+00", base + 1_000),
        ("pre1", "1969-12-31 23:59:59.999999+00", -1),
        ("pre500", "1969-12-31 23:59:59.9995+00", -500),
        (
            "year1",
            "0001-01-01 00:00:00.000001+00",
            civil_micros(1, 1, 1, 0, 0, 0, 1),
        ),
        (
            "far",
            "290000-01-01 00:00:00.000007+00",
            civil_micros(290_000, 1, 1, 0, 0, 0, 7),
        ),
        ("ninf-a", "-infinity", i64::MIN),
        ("ninf-b", "-infinity", i64::MIN),
        ("inf-a", "infinity", i64::MAX),
        ("inf-b", "infinity", i64::MAX),
    ];
    let keys: Vec<ScopedKey> = times
        .iter()
        .map(|(n, _, _)| ScopedKey::new("", *n))
        .collect();
    mark_each(&store, &keys).await;
    let written: Vec<(&str, &str)> = times.iter().map(|(n, at, _)| (*n, *at)).collect();
    pg_write_times(&pool, table, &written).await;
    let expected_at: HashMap<ScopedKey, SystemTime> = times
        .iter()
        .map(|(n, _, us)| (ScopedKey::new("", *n), at_micros(*us)))
        .collect();
    let mut order = times.clone();
    order.sort_by(|a, b| (a.2, a.0).cmp(&(b.2, b.0)));
    let expected: Vec<ScopedKey> = order
        .iter()
        .map(|(n, _, _)| ScopedKey::new("", *n))
        .collect();

    let batched = store.clone().with_batching(Batching::default());
    let together = join_all(keys.iter().map(|key| existing(&batched, key))).await;
    for (key, (record, _)) in keys.iter().zip(&together) {
        assert_eq!(
            micros_of(record.updated_at),
            micros_of(expected_at[key]),
            "{key:?}: as claims batched together answer it, at the time written"
        );
        assert_eq!(
            micros_of(looked_up(&store, key).await.updated_at),
            micros_of(expected_at[key]),
            "{key:?}: as lookup reads it, at the time written"
        );
        assert_eq!(
            micros_of(existing(&store, key).await.0.updated_at),
            micros_of(expected_at[key]),
            "{key:?}: as a claim alone answers it, at the time written"
        );
    }
    let listing = whole(&store, false).await;
    let listed: Vec<ScopedKey> = listing.iter().map(|r| r.key.clone()).collect();
    assert_eq!(
        listed, expected,
        "the listing's order: time written, then key"
    );
    for record in &listing {
        assert_eq!(
            micros_of(record.updated_at),
            micros_of(expected_at[&record.key]),
            "{:?}: listed at the time written",
            record.key
        );
    }
    let bound = 3 * keys.len() + 3;
    for limit in [1, 3] {
        for newest in [false, true] {
            let mut expected = expected.clone();
            if newest {
                expected.reverse();
            }
            for by in [By::Next, By::Lookup, By::Claim] {
                let what = format!("postgres: pages of {limit}, newest first {newest}, by {by:?}");
                for store in [&store, &batched] {
                    let listed = walk(store, limit, newest, by, bound, &what).await;
                    assert_eq!(listed, expected, "{what}: each once, in order");
                }
            }
        }
    }
    let count = store.count_uncertain().await.expect("count_uncertain");
    assert_eq!(count.count, keys.len() as u64, "the count");
    assert_eq!(
        count.oldest,
        Some(at_micros(i64::MIN)),
        "the oldest is -infinity's place"
    );
}

/// Walks by `next` in pages of 1, both ways, over records whose times were written by hand:
/// each is listed exactly once.
async fn pg_pages_once_each(table: &str, times: &[(&str, &str)]) {
    let Some(store) = common::fresh_postgres(table).await else {
        return;
    };
    let Some(pool) = common::postgres_pool().await else {
        return;
    };
    let keys: Vec<ScopedKey> = times.iter().map(|(n, _)| ScopedKey::new("", *n)).collect();
    mark_each(&store, &keys).await;
    pg_write_times(&pool, table, times).await;
    for newest in [false, true] {
        for by in [By::Next, By::Lookup] {
            let what = format!("postgres {table}: pages of 1, newest first {newest}, by {by:?}");
            let listed = walk(&store, 1, newest, by, 3 * keys.len(), &what).await;
            once_each(&listed, &keys, &what);
        }
    }
}

/// Pages of 1, oldest first, at most `bound` of them: the keys listed (readable or not), in
/// order, whether or not the walk ended.
async fn first_pages<S: IdempotencyStore>(store: &S, bound: usize) -> Vec<ScopedKey> {
    let mut query = UncertainQuery::first(1);
    let mut listed = Vec::new();
    for _ in 0..bound {
        let page = store.list_uncertain(&query).await.expect("list_uncertain");
        listed.extend(page.records.iter().map(|r| r.key.clone()));
        listed.extend(page.unreadable.iter().map(|u| u.key.clone()));
        match page.next {
            Some(next) => query = UncertainQuery::after(next, 1),
            None => break,
        }
    }
    listed
}

/// DESIGN §4, a documented limit (`CURSOR_MICROS`): a last change written by hand past what
/// `i64` microseconds hold (PostgreSQL's timestamps run to 294276; `i64` microseconds end in
/// January 294247) is placed at the listing's end. With one such record, newest first lists
/// each record once; oldest first lists every record before it once, in order, then only it
/// (again, on every page that starts there). Two such records page wrongly both ways; see
/// `CURSOR_MICROS`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_postgres_times_past_i64_microseconds_come_last_and_hold_back_no_record() {
    let table = "rtr_pg_past_i64";
    let times = [
        ("a-2021", "2021-03-04 05:06:07+00"),
        ("a-2022", "2022-03-04 05:06:07+00"),
        ("b-294250", "294250-01-01 00:00:00+00"),
    ];
    let Some(store) = common::fresh_postgres(table).await else {
        return;
    };
    let Some(pool) = common::postgres_pool().await else {
        return;
    };
    let keys: Vec<ScopedKey> = times.iter().map(|(n, _)| ScopedKey::new("", *n)).collect();
    mark_each(&store, &keys).await;
    pg_write_times(&pool, table, &times).await;
    let what = "postgres past i64: pages of 1, newest first";
    let listed = walk(&store, 1, true, By::Next, 3 * keys.len(), what).await;
    once_each(&listed, &keys, what);
    let listed = first_pages(&store, 12).await;
    assert_eq!(
        listed[..2],
        keys[..2],
        "oldest first: the ordinary times first, once each"
    );
    assert!(
        listed.len() > 2 && listed[2..].iter().all(|k| *k == keys[2]),
        "then only the far one: {listed:?}"
    );
}

/// DESIGN §4: records whose last change was written by hand at the very start of
/// PostgreSQL's range (4714-11-24 BC, two of them) or a year after it are each listed exactly
/// once by a walk in pages of 1, both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_postgres_times_at_the_start_of_its_range_are_listed_once_each() {
    pg_pages_once_each(
        "rtr_pg_4714bc",
        &[
            ("a-4714bc", "4714-11-24 00:00:00+00 BC"),
            ("b-4714bc", "4714-11-24 00:00:00+00 BC"),
            ("c-4713bc", "4713-11-24 00:00:00+00 BC"),
            ("d-2021", "2021-03-04 05:06:07+00"),
        ],
    )
    .await;
}

// ---- times written by hand: SQLite ------------------------------------------------------------

async fn sqlite_pool(path: &std::path::Path) -> sqlx::SqlitePool {
    sqlx::sqlite::SqlitePool::connect(&format!("sqlite://{}", path.display()))
        .await
        .expect("open the file")
}

/// DESIGN §4, §5: on SQLite, records whose last change was written by hand at `i64`'s ends
/// (two at each), one millisecond inside them, just before the epoch and at it: `lookup`, a
/// claim alone and claims batched together (one JSON row) read each at the time written; the
/// listing places them so; cursors made from looked-up or claimed records page on exactly, in
/// pages of 1 and 2, both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_sqlite_integer_extremes_page_exactly_from_looked_up_records() {
    let (store, path) = common::sqlite("rtr_sqlite_ends").await;
    let pool = sqlite_pool(&path).await;
    let times: Vec<(&str, i64)> = vec![
        ("min-a", i64::MIN),
        ("min-b", i64::MIN),
        ("min1", i64::MIN + 1),
        ("neg", -1),
        ("zero", 0),
        ("max1", i64::MAX - 1),
        ("max-a", i64::MAX),
        ("max-b", i64::MAX),
    ];
    let keys: Vec<ScopedKey> = times.iter().map(|(n, _)| ScopedKey::new("", *n)).collect();
    mark_each(&store, &keys).await;
    for (name, at) in &times {
        let done = sqlx::query("UPDATE idempotency_records SET updated_at = ?1 WHERE key = ?2")
            .bind(*at)
            .bind(name.as_bytes())
            .execute(&pool)
            .await
            .expect("write a time by hand");
        assert_eq!(done.rows_affected(), 1, "{name}: one row");
    }
    let expected_at: HashMap<ScopedKey, SystemTime> = times
        .iter()
        .map(|(n, ms)| (ScopedKey::new("", *n), at_millis(*ms)))
        .collect();
    let mut order = times.clone();
    order.sort_by(|a, b| (a.1, a.0).cmp(&(b.1, b.0)));
    let expected: Vec<ScopedKey> = order.iter().map(|(n, _)| ScopedKey::new("", *n)).collect();
    let batched = store
        .clone()
        .with_batching(Batching::default().in_flight(1));
    let together = join_all(keys.iter().map(|key| existing(&batched, key))).await;
    for (key, (record, _)) in keys.iter().zip(&together) {
        assert_eq!(
            record.updated_at, expected_at[key],
            "{key:?}: claims batched together"
        );
        assert_eq!(
            looked_up(&store, key).await.updated_at,
            expected_at[key],
            "{key:?}: lookup"
        );
        assert_eq!(
            existing(&store, key).await.0.updated_at,
            expected_at[key],
            "{key:?}: a claim alone"
        );
    }
    let listing = whole(&store, false).await;
    let listed: Vec<ScopedKey> = listing.iter().map(|r| r.key.clone()).collect();
    assert_eq!(
        listed, expected,
        "the listing's order: time written, then key"
    );
    for record in &listing {
        assert_eq!(
            record.updated_at, expected_at[&record.key],
            "{:?}",
            record.key
        );
    }
    for limit in [1, 2] {
        for newest in [false, true] {
            let mut expected = expected.clone();
            if newest {
                expected.reverse();
            }
            for by in [By::Next, By::Lookup, By::Claim] {
                let what = format!("sqlite: pages of {limit}, newest first {newest}, by {by:?}");
                let listed = walk(&store, limit, newest, by, 3 * keys.len(), &what).await;
                assert_eq!(listed, expected, "{what}: each once, in order");
            }
        }
    }
    let _ = std::fs::remove_file(path);
}

/// DESIGN §4 ("skips and reports unreadable rows"), a documented limit (`CURSOR_MILLIS`): on
/// SQLite, a last change written by hand as a real number (`1000.5`, as arithmetic on the
/// column gives) between records at 1000, 1001 and 1002 ms is reported unreadable, and the
/// record before it is listed once, before it. (A walk that ends a page on it goes on from the
/// listing's end: the records after it wait until it is mended.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_sqlite_a_time_written_as_a_real_number_is_reported_after_the_record_before_it() {
    let (store, path) = common::sqlite("rtr_sqlite_real").await;
    let pool = sqlite_pool(&path).await;
    let keys: Vec<ScopedKey> = ["a", "b", "c", "d"]
        .iter()
        .map(|n| ScopedKey::new("", *n))
        .collect();
    mark_each(&store, &keys).await;
    for (name, at) in [("a", "1000"), ("b", "1000.5"), ("c", "1001"), ("d", "1002")] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE idempotency_records SET updated_at = {at} WHERE key = CAST('{name}' AS BLOB)"
        )))
        .execute(&pool)
        .await
        .expect("write a time by hand");
    }
    let kind: String = sqlx::query_scalar(
        "SELECT typeof(updated_at) FROM idempotency_records WHERE key = CAST('b' AS BLOB)",
    )
    .fetch_one(&pool)
    .await
    .expect("typeof");
    assert_eq!(kind, "real", "the premise: stored as a real number");
    let page = store
        .list_uncertain(&UncertainQuery::first(10))
        .await
        .expect("list_uncertain");
    assert!(
        page.unreadable.iter().any(|u| u.key == keys[1]),
        "the real time is reported unreadable"
    );
    let listed = first_pages(&store, 12).await;
    assert_eq!(
        listed[..2],
        keys[..2],
        "the record before it, then it: {listed:?}"
    );
    let _ = std::fs::remove_file(path);
}

// ---- a store that lists in two steps -----------------------------------------------------------

/// A store that lists in two steps, as a third-party store over an index would: it scans
/// (the memory store's listing, for the keys and places of a page), then reads each record
/// found, leaving out those no longer awaiting reconciliation, and builds its page with
/// `UncertainPage::scanned`. Between the two steps it settles every churn record the scan
/// found, so whole pages come back empty.
struct TwoStep {
    inner: Arc<MemoryStore>,
    churn: Mutex<HashMap<ScopedKey, FencingToken>>,
}

impl IdempotencyStore for TwoStep {
    async fn list_uncertain(&self, query: &UncertainQuery) -> Result<UncertainPage, StoreError> {
        let scan = self.inner.list_uncertain(query).await?;
        let found: Vec<(ScopedKey, SystemTime)> = scan
            .records
            .iter()
            .map(|r| (r.key.clone(), r.updated_at))
            .collect();
        for (key, _) in &found {
            let token = self.churn.lock().expect("churn").remove(key);
            if let Some(token) = token {
                self.inner
                    .resolve(key, token, &Resolution::NotApplied, LONG, None)
                    .await?;
            }
        }
        let mut records = Vec::new();
        for (key, _) in &found {
            if let Some(record) = self.inner.lookup(key).await?
                && record.status == RecordStatus::NeedsReconciliation
            {
                records.push(record);
            }
        }
        let last = found
            .last()
            .map(|(key, at)| UncertainCursor::new(*at, key.clone()));
        Ok(UncertainPage::scanned(
            found.len(),
            records,
            Vec::new(),
            last,
            query.limit,
        ))
    }

    crate::common::forward::forward_store!(inner: claim, claim_now, recorded_fingerprint_now, completed_now, renew, complete, release, mark_uncertain, lookup, remove, purge_expired, record_milestone, count_uncertain, resolve, append_history, wait_for_change);
}

/// A two-step store over a fresh memory store: runs of four churn records between steady
/// ones, marked one millisecond apart so the listing's order is the order of marking. The
/// steady keys, in order.
async fn two_step() -> (Arc<TwoStep>, Vec<ScopedKey>) {
    let inner = Arc::new(MemoryStore::new());
    let mut steady = Vec::new();
    let mut churn = HashMap::new();
    for i in 0..24usize {
        let key = ScopedKey::new("two", format!("{i:02}"));
        let token = acquire(&*inner, &key, LONG).await;
        inner.mark_uncertain(&key, token).await.expect("mark");
        if i % 5 == 0 {
            steady.push(key);
        } else {
            churn.insert(key, token);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let store = TwoStep {
        inner,
        churn: Mutex::new(churn),
    };
    (Arc::new(store), steady)
}

/// Unit level: `UncertainPage::scanned` goes on after `last` exactly when the scan found at
/// least `limit` entries, whatever the reads left (limit 0, 1, more found than asked, and
/// `usize::MAX`), and keeps what it is given; `new` counts what it holds.
#[tokio::test]
async fn s4_scanned_pages_go_on_by_what_the_scan_found_at_any_limit() {
    let store = MemoryStore::new();
    let key = ScopedKey::new("unit", "k");
    mark_each(&store, std::slice::from_ref(&key)).await;
    let record = looked_up(&store, &key).await;
    let last = UncertainCursor::new(record.updated_at, key.clone());
    let scanned = |found, records: Vec<Record>, limit| {
        UncertainPage::scanned(found, records, Vec::new(), Some(last.clone()), limit).next
    };
    assert_eq!(
        UncertainPage::scanned(0, Vec::new(), Vec::new(), None, 0).next,
        None
    );
    assert_eq!(
        scanned(1, Vec::new(), 1),
        Some(last.clone()),
        "found 1 of 1"
    );
    assert_eq!(scanned(0, Vec::new(), 1), None, "found 0 of 1");
    assert_eq!(scanned(5, Vec::new(), 3), Some(last.clone()), "found more");
    assert_eq!(scanned(4, vec![record.clone()], 5), None, "found 4 of 5");
    assert_eq!(scanned(usize::MAX - 1, Vec::new(), usize::MAX), None);
    assert_eq!(
        scanned(usize::MAX, Vec::new(), usize::MAX),
        Some(last.clone())
    );
    let page = UncertainPage::scanned(2, vec![record.clone()], Vec::new(), Some(last.clone()), 2);
    assert_eq!(page.records.len(), 1, "the records given");
    assert_eq!(page.records[0].key, key);
    let one = UncertainPage::new(vec![record.clone()], Vec::new(), Some(last.clone()), 1);
    assert_eq!(one.next, Some(last.clone()), "new: one held of one");
    let short = UncertainPage::new(vec![record], Vec::new(), Some(last), 2);
    assert_eq!(short.next, None, "new: one held of two");
}

/// DESIGN §4: over a store that lists in two steps and builds its pages with `scanned`,
/// while every churn record is settled between a page's scan and its reads (so whole pages
/// come back empty but name the next), a walk in pages of 1 to 5, oldest or newest first,
/// lists every steady record exactly once, in order, and no churn record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_two_step_store_lists_every_steady_record_past_emptied_pages() {
    for limit in 1..=5 {
        for newest in [false, true] {
            let (store, steady) = two_step().await;
            let what = format!("two steps: pages of {limit}, newest first {newest}");
            let listed = walk(&*store, limit, newest, By::Next, 60, &what).await;
            let mut expected = steady.clone();
            if newest {
                expected.reverse();
            }
            assert_eq!(
                listed, expected,
                "{what}: the steady records, once, in order"
            );
            assert!(
                store.churn.lock().expect("churn").is_empty(),
                "{what}: the walk reached every churn record"
            );
        }
    }
}

/// Applies every record it is asked about; counts what it was asked.
#[derive(Clone, Default)]
struct Applies(Arc<Mutex<HashMap<ScopedKey, usize>>>, Arc<AtomicUsize>);

impl Reconciler for Applies {
    async fn reconcile(&self, record: &Record) -> Reconciliation {
        *self
            .0
            .lock()
            .expect("asked")
            .entry(record.key.clone())
            .or_default() += 1;
        self.1.fetch_add(1, Ordering::SeqCst);
        Reconciliation::Applied(Box::new(response()))
    }
}

/// DESIGN §4 ("makes fair progress"): a sweeper in batches of 1, 2 and 3 over the two-step
/// store reconciles every steady record exactly once within one round's passes, though most of
/// its pages come back emptied, and is never asked about a churn record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_sweeper_over_a_two_step_store_goes_on_past_emptied_pages() {
    for batch in [1, 2, 3] {
        let (store, steady) = two_step().await;
        let inner = store.inner.clone();
        let asked = Applies::default();
        let sweeper = Sweeper::new(store, asked.clone()).batch(batch).ttl(LONG);
        // One round: a page per pass over 24 records, plus the pass that finds the end.
        let passes = 24 / batch + 2;
        for _ in 0..passes {
            sweeper.run_once().await.expect("a pass");
        }
        let asked_about = asked.0.lock().expect("asked").clone();
        let wrong: Vec<_> = asked_about
            .iter()
            .filter(|(k, n)| !steady.contains(k) || **n != 1)
            .collect();
        assert!(
            wrong.is_empty(),
            "batches of {batch}: asked other than once about a steady record, or about churn: \
             {wrong:?}"
        );
        for key in &steady {
            assert_eq!(
                looked_up(&*inner, key).await.status,
                RecordStatus::Completed,
                "batches of {batch}: {key:?} reconciled within {passes} passes"
            );
        }
        assert_eq!(asked.1.load(Ordering::SeqCst), steady.len());
    }
}
