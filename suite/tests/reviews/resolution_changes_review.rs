#![allow(missing_docs)]
use crate::common;

// Review of the five commits on top of ca73716: resolutions' notes and kept records,
// mark_uncertain marking the effect, PostgreSQL listing cursors past 9e18 µs, and the console's
// JSON shapes and origin check. Every wait is bounded and fails the test.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use common::memory::req;
use common::rig::*;
use common::{Effects, serve};
use serde_json::{Value, json};
use tower::ServiceExt;
use tower_idempotency::console::Console;
use tower_idempotency::reconcile::Reconciliation;
use tower_idempotency::store::{
    Claim, ClaimRequest, RecordStatus, Resolution, ScopedKey, UncertainQuery,
};
use tower_idempotency::{IdempotencyStore, MemoryStore};

async fn acquired<S: IdempotencyStore>(store: &S, r: &ClaimRequest) -> (u64, u32) {
    match store.claim(r).await {
        Ok(Claim::Acquired(lease)) => (lease.token.get(), lease.attempt),
        other => panic!("expected acquired for {:?}, got {other:?}", r.key),
    }
}

// ---- PostgreSQL cursor paging -------------------------------------------------------------

/// Pages through every uncertain record one at a time; the keys seen, in order. Fails if it
/// does not end within `bound` pages.
async fn page_all<S: IdempotencyStore>(store: &S, newest: bool, bound: usize) -> Vec<String> {
    let mut seen = Vec::new();
    let mut query = UncertainQuery::first(1);
    if newest {
        query = query.newest_first();
    }
    for _ in 0..bound {
        let page = store.list_uncertain(&query).await.expect("a page");
        for r in &page.records {
            seen.push(r.key.key().to_owned());
        }
        for u in &page.unreadable {
            seen.push(u.key.key().to_owned());
        }
        match page.next {
            None => return seen,
            Some(next) => {
                query = UncertainQuery::after(next, 1);
                if newest {
                    query = query.newest_first();
                }
            }
        }
    }
    panic!("paging (newest first: {newest}) did not end within {bound} pages; saw {seen:?}");
}

async fn pg_damaged(table: &str) -> Option<(tower_idempotency::store::PostgresStore, Vec<String>)> {
    let pool = common::postgres_pool().await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
        .execute(&pool)
        .await
        .expect("drop");
    let store = common::postgres(table).await?;
    let times = [
        ("a-now", None),
        ("b-inf", Some("infinity")),
        ("c-inf", Some("infinity")),
        ("d-far", Some("290000-01-01 00:00:00+00")),
        ("e-below", Some("287000-01-01 00:00:00+00")),
        ("f-ninf", Some("-infinity")),
        ("g-ninf", Some("-infinity")),
        ("h-1900", Some("1900-01-01 00:00:00+00")),
        ("i-1969", Some("1969-06-01 00:00:00+00")),
        ("j-now", None),
    ];
    let keys = uncertain_at(&store, &times, async |name, at| {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {table} SET updated_at = '{at}' WHERE key = '{name}'::bytea"
        )))
        .execute(&pool)
        .await
        .expect("damage");
    })
    .await;
    Some((store, keys))
}

/// Claims each named key and marks it uncertain, then has `damage` write its time by hand
/// (none: its own); the names, in order.
async fn uncertain_at<S: IdempotencyStore>(
    store: &S,
    times: &[(&str, Option<&str>)],
    damage: impl AsyncFn(&str, &str),
) -> Vec<String> {
    let mut keys = Vec::new();
    for &(name, at) in times {
        let key = ScopedKey::new("", name);
        let (token, _) = acquired(store, &req(&key, 60_000, 60_000)).await;
        store
            .mark_uncertain(&key, tower_idempotency::store::FencingToken::new(token))
            .await
            .expect("mark");
        if let Some(at) = at {
            damage(name, at).await;
        }
        keys.push(name.to_owned());
    }
    keys
}

fn once_each(seen: &[String], keys: &[String], what: &str) {
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for k in seen {
        *counts.entry(k.as_str()).or_default() += 1;
    }
    for k in keys {
        assert_eq!(
            counts.get(k.as_str()).copied().unwrap_or(0),
            1,
            "{what}: {k} must be listed exactly once; saw {seen:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_oldest_first_paging_through_far_and_infinite_times_ends_once_each() {
    let Some((store, keys)) = pg_damaged("rcr_page_oldest").await else {
        return;
    };
    let seen = page_all(&store, false, keys.len() * 3).await;
    once_each(&seen, &keys, "oldest first");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_newest_first_paging_through_far_and_infinite_times_ends_once_each() {
    let Some((store, keys)) = pg_damaged("rcr_page_newest").await else {
        return;
    };
    let seen = page_all(&store, true, keys.len() * 3).await;
    once_each(&seen, &keys, "newest first");
}

// ---- store semantics of the new resolve / mark_uncertain -----------------------------------

async fn resolution_semantics<S: IdempotencyStore>(store: &S, tag: &str) {
    let key = ScopedKey::new("", unique(tag));
    let (t1, a1) = acquired(store, &req(&key, 300, 300)).await;
    assert_eq!(a1, 1);
    let t1 = tower_idempotency::store::FencingToken::new(t1);
    store.mark_uncertain(&key, t1).await.expect("mark");
    let r = store.lookup(&key).await.expect("lookup").expect("record");
    assert!(
        r.effect_started,
        "{tag}: marked uncertain reads as an effect"
    );
    tokio::time::sleep(ms(700)).await;
    store
        .resolve(&key, t1, &Resolution::NotApplied, ms(60_000), Some("N1"))
        .await
        .expect("resolve");
    store.purge_expired().await.expect("purge");
    let r = store
        .lookup(&key)
        .await
        .expect("lookup")
        .expect("kept ttl from the resolution");
    assert_eq!(r.status, RecordStatus::Released, "{tag}");
    assert!(!r.effect_started, "{tag}: not applied clears the effect");
    assert_eq!(r.resolution_note.as_deref(), Some("N1"), "{tag}");
    // Listed? A released record awaits nothing.
    let page = store
        .list_uncertain(&UncertainQuery::first(10_000))
        .await
        .expect("list");
    assert!(
        page.records.iter().all(|x| x.key != key),
        "{tag}: a released record is not listed as uncertain"
    );
    // The next attempt takes over, and its clean failure gives the key back.
    let (t2, a2) = acquired(store, &req(&key, 60_000, 60_000)).await;
    assert_eq!(a2, 2, "{tag}");
    let t2 = tower_idempotency::store::FencingToken::new(t2);
    assert_eq!(
        store.release(&key, t2).await.expect("release"),
        RecordStatus::Released,
        "{tag}: the next attempt starts clean"
    );
    // Claimed again, marked, resolved without a note: the older note is gone.
    let (t3, _) = acquired(store, &req(&key, 60_000, 60_000)).await;
    let t3 = tower_idempotency::store::FencingToken::new(t3);
    store.mark_uncertain(&key, t3).await.expect("mark");
    store
        .resolve(&key, t3, &Resolution::NotApplied, ms(60_000), None)
        .await
        .expect("resolve");
    let r = store.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(r.resolution_note, None, "{tag}: no note wears an old one");
    // A stale holder cannot write after the resolution.
    assert!(
        store
            .complete(&key, t3, &created("late"), ms(60_000))
            .await
            .is_err()
    );
    store.remove(&key).await.expect("remove");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolution_semantics_on_every_store() {
    resolution_semantics(&MemoryStore::new(), "mem").await;
    let (sqlite, _path) = common::sqlite("rcr_sem").await;
    resolution_semantics(&sqlite, "sqlite").await;
    if let Some(redis) = common::redis("rcr_sem").await {
        resolution_semantics(&redis, "redis").await;
    }
    if let Some(pg) = common::postgres("rcr_sem").await {
        resolution_semantics(&pg, "pg").await;
    }
}

// ---- the layer: an unrecorded answer, then a resolution --------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unrecorded_answer_never_runs_twice_until_resolved_not_applied() {
    let rig = Rig::new(MemoryStore::new());
    rig.always("complete", Act::Fail);
    let effects = Effects::default();
    let h = sleep_then_effect(&effects, Duration::ZERO, false);
    let addr = server(&rig, Route::plain(ms(400)).reconcile(), h).await;
    let key = unique("unrecorded");
    let first = ask(addr, &key).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(
        eventually(async || status_of(&rig, &key).await == Some(RecordStatus::NeedsReconciliation))
            .await
    );
    let r = record_of(&rig, &key).await.expect("record");
    assert!(r.effect_started, "an unrecorded answer reads as an effect");
    tokio::time::sleep(ms(1_000)).await;
    for _ in 0..3 {
        let again = ask(addr, &key).await;
        assert_ne!(again.status, 201, "never a second run: {again:?}");
    }
    assert_eq!(effects.count(), 1);
    // Resolved as not applied (by a sweep): the key runs once more, then the holder of the
    // first attempt, still retrying its write, cannot overwrite; a later request is answered
    // by the second attempt's outcome, or in flight, never a third run.
    rig.always("complete", Act::Pass);
    sweep(rig.inner.clone(), Reconciliation::NotApplied).await;
    let r = record_of(&rig, &key).await.expect("record");
    assert_eq!(r.status, RecordStatus::Released);
    assert!(!r.effect_started);
    let second = ask_past_in_flight(addr, &key, Duration::from_secs(10)).await;
    assert_eq!(second.status, 201, "{second:?}");
    assert_eq!(effects.count(), 2);
    let third = ask_past_in_flight(addr, &key, Duration::from_secs(10)).await;
    assert!(third.replayed, "{third:?}");
    tokio::time::sleep(ms(1_000)).await;
    assert_eq!(effects.count(), 2);
}

// ---- the console ---------------------------------------------------------------------------

async fn console_on(store: Arc<MemoryStore>) -> SocketAddr {
    serve(Router::new().nest("/ops", Console::from_arc(store).router())).await
}

async fn api_raw(ops: SocketAddr, path: &str, body: &str) -> u16 {
    reqwest::Client::new()
        .post(format!("http://{ops}/ops{path}"))
        .header("sec-fetch-site", "same-origin")
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .expect("post")
        .status()
        .as_u16()
}

async fn uncertain_key(store: &MemoryStore, name: &str) -> (ScopedKey, u64) {
    let key = ScopedKey::new("", name);
    let (token, _) = acquired(store, &req(&key, 60_000, 60_000)).await;
    store
        .mark_uncertain(&key, tower_idempotency::store::FencingToken::new(token))
        .await
        .expect("mark");
    (key, token)
}

#[tokio::test]
async fn console_refuses_a_misshapen_field_even_when_repeated() {
    let store = Arc::new(MemoryStore::new());
    let (key, _) = uncertain_key(&store, "dup").await;
    let ops = console_on(store.clone()).await;
    let body = r#"{"scope":"","key":"dup","outcome":"applied","reason":"r","status":201,
                   "body":{"id":1},"body":"x"}"#;
    let status = api_raw(ops, "/api/resolve", body).await;
    let after = store.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(
        (status, after.status),
        (400, RecordStatus::NeedsReconciliation),
        "a body with an object field is a 400 ('any other shape is a 400')"
    );
    for bad in [
        r#"{"scope":"","key":"dup","outcome":"applied","reason":"r","status":2.01e2}"#,
        r#"{"scope":"","key":"dup","outcome":"applied","reason":"r","token":-1}"#,
        r#"{"scope":"","key":"dup","outcome":"applied","reason":"r","body":[null]}"#,
        r#"{"scope":"","key":"dup","outcome":"applied","reason":"r","token":1e400}"#,
    ] {
        assert_eq!(api_raw(ops, "/api/resolve", bad).await, 400, "{bad}");
    }
    // The token the record page gives out settles it.
    let (_, json) = {
        let res = reqwest::get(format!("http://{ops}/ops/api/record?scope=&key=dup"))
            .await
            .expect("get");
        (res.status(), res.json::<Value>().await.expect("json"))
    };
    let token = json["token"]
        .as_str()
        .expect("token is a string")
        .to_owned();
    let ok = json!({"scope":"","key":"dup","outcome":"not_applied","reason":"r","token":token});
    assert_eq!(api_raw(ops, "/api/resolve", &ok.to_string()).await, 200);
}

async fn oneshot_status(
    store: Arc<MemoryStore>,
    uri: &str,
    version: http::Version,
    host: Option<&str>,
    origin: &str,
    body: &str,
) -> u16 {
    let app = Router::new().nest("/ops", Console::from_arc(store).router());
    let mut b = http::Request::builder()
        .method("POST")
        .uri(uri)
        .version(version)
        .header("origin", origin)
        .header("content-type", "application/json");
    if let Some(host) = host {
        b = b.header("host", host);
    }
    let req = b
        .body(axum::body::Body::from(body.to_owned()))
        .expect("request");
    app.oneshot(req).await.expect("answer").status().as_u16()
}

#[tokio::test]
async fn console_origin_check_under_http2_and_absolute_uris() {
    let store = Arc::new(MemoryStore::new());
    let (_k1, _) = uncertain_key(&store, "h2a").await;
    let body =
        |k: &str| json!({"scope":"","key":k,"outcome":"not_applied","reason":"r"}).to_string();
    // HTTP/2, no Host header, the authority in the URI: the console's own https page passes.
    let own = oneshot_status(
        store.clone(),
        "https://ops.example/ops/api/resolve",
        http::Version::HTTP_2,
        None,
        "https://ops.example",
        &body("h2a"),
    )
    .await;
    assert_eq!(own, 200, "the console's own origin over HTTP/2");
    let (_k2, _) = uncertain_key(&store, "h2b").await;
    // Same host, the other scheme: refused.
    let http_page = oneshot_status(
        store.clone(),
        "https://ops.example/ops/api/resolve",
        http::Version::HTTP_2,
        None,
        "http://ops.example",
        &body("h2b"),
    )
    .await;
    assert_eq!(http_page, 403, "an http page against an https request");
    // Another host named by the origin, with a Host header that is ours: refused.
    let other = oneshot_status(
        store.clone(),
        "http://ops.example/ops/api/resolve",
        http::Version::HTTP_11,
        Some("ops.example"),
        "http://evil.example",
        &body("h2b"),
    )
    .await;
    assert_eq!(other, 403);
    // An absolute URI naming another host than the Host header, origin = Host: a request
    // whose target is not the origin; the origin-check must not pass on the Host alone when
    // the URI's authority disagrees... (documented: Host is the host as sent) -> only scheme.
    let non_http = oneshot_status(
        store.clone(),
        "/ops/api/resolve",
        http::Version::HTTP_11,
        Some("ops.example"),
        "file://ops.example",
        &body("h2b"),
    )
    .await;
    assert_eq!(non_http, 403, "a file: origin is never the console's");
    let still = store
        .lookup(&ScopedKey::new("", "h2b"))
        .await
        .expect("lookup")
        .expect("record");
    assert_eq!(still.status, RecordStatus::NeedsReconciliation);
}

/// The same on SQLite, whose times are integers of milliseconds: far in the future and before
/// the epoch, written by hand. (A time written as text, which SQLite orders after every
/// integer, is not a place a cursor can name: left for planning, see the session's note.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_paging_through_far_and_negative_times_ends_once_each() {
    let (store, path) = common::sqlite("rcr_page_sqlite").await;
    let pool = sqlx::sqlite::SqlitePool::connect(&format!("sqlite://{}", path.display()))
        .await
        .expect("open");
    let times = [
        ("a-now", None),
        ("b-far", Some("9000000000000000")),
        ("c-far", Some("9000000000000000")),
        ("d-before", Some("-2000000000000")),
        ("e-before", Some("-2000000000000")),
        ("f-now", None),
    ];
    let keys = uncertain_at(&store, &times, async |name, at| {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE idempotency_records SET updated_at = {at} WHERE key = CAST('{name}' AS BLOB)"
        )))
        .execute(&pool)
        .await
        .expect("damage");
    })
    .await;
    for newest in [false, true] {
        let seen = page_all(&store, newest, keys.len() * 3).await;
        once_each(
            &seen,
            &keys,
            if newest {
                "newest first"
            } else {
                "oldest first"
            },
        );
    }
    let _ = std::fs::remove_file(path);
}
