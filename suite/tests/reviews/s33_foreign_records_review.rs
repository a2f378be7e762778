//! Red-team review (session 33): what a store holds that this process did not write, and
//! several app instances with different settings sharing one store (a rolling deploy, a
//! misconfigured replica).
//!
//! 1. Records damaged by hand or by another tool in PostgreSQL, SQLite and Redis: the layer must
//!    answer a typed error (problem+json) and run nothing; never treat the record as absent,
//!    replay garbage, or panic.
//! 2. Two layers on one store with different route settings (lease expiry, fingerprinted JSON
//!    fields): never a second run for one key, never another request's answer.
//!
//! Effects are counted at the sink (the handler bumps an `Effects`), never from responses.

use crate::common;

use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::http::StatusCode;
use axum::routing::post;
use common::{Effects, guard, serve};
use tower_idempotency::fingerprint::JsonFields;
use tower_idempotency::store::{Claim, ClaimRequest, ScopedKey};
use tower_idempotency::{
    Fingerprint, IdempotencyLayer, IdempotencyStore, LeaseExpiry, PostgresStore, RedisStore,
};

// ---------------------------------------------------------------------------------------------
// Rig
// ---------------------------------------------------------------------------------------------

fn unique(name: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("s33-{name}-{}-{nanos}", std::process::id())
}

/// `POST /op` on one "instance": the handler bumps the sink, then answers 201 naming the
/// instance, its run number and the body it was given (so a replay to the wrong request shows).
fn app<St: IdempotencyStore>(
    store: St,
    effects: Effects,
    instance: &'static str,
    configure: impl FnOnce(IdempotencyLayer<St>) -> IdempotencyLayer<St>,
) -> Router {
    Router::new()
        .route(
            "/op",
            post(move |body: Bytes| {
                let effects = effects.clone();
                async move {
                    let n = effects.hit();
                    (
                        StatusCode::CREATED,
                        format!(
                            "instance {instance} run {n} for {}",
                            String::from_utf8_lossy(&body)
                        ),
                    )
                }
            }),
        )
        .layer(configure(IdempotencyLayer::new(store)).single_tenant())
}

#[derive(Debug)]
struct Answer {
    status: u16,
    replayed: bool,
    content_type: String,
    body: String,
}

impl Answer {
    fn problem(&self) -> Option<serde_json::Value> {
        (self.content_type == "application/problem+json")
            .then(|| serde_json::from_str(&self.body).ok())
            .flatten()
    }

    fn slug(&self) -> String {
        self.problem()
            .and_then(|p| p["type"].as_str().map(str::to_owned))
            .unwrap_or_default()
            .trim_start_matches("urn:tower-idempotency:problem:")
            .to_owned()
    }

    fn safe_new_key(&self) -> Option<bool> {
        self.problem().and_then(|p| p["safe_new_key"].as_bool())
    }
}

async fn send(addr: SocketAddr, key: &str, body: &str) -> Answer {
    let res = guard(
        "a request",
        common::client()
            .post(format!("http://{addr}/op"))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send(),
    )
    .await
    .expect("an answer");
    let status = res.status().as_u16();
    let replayed = res
        .headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let content_type = res
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let body = String::from_utf8_lossy(&res.bytes().await.expect("body")).into_owned();
    Answer {
        status,
        replayed,
        content_type,
        body,
    }
}

/// The parts of the request [`send`] makes, as the layer sees them.
fn sent_parts() -> http::request::Parts {
    http::Request::builder()
        .method("POST")
        .uri("/op")
        .header("content-type", "application/json")
        .body(())
        .expect("request")
        .into_parts()
        .0
}

/// A PostgreSQL store in its own table, emptied first (so `count_uncertain` is this test's).
async fn pg(table: &str) -> Option<PostgresStore> {
    let store = common::postgres(table).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("DELETE FROM {table}")))
        .execute(store.pool())
        .await
        .expect("empty the table");
    Some(store)
}

async fn redis_conn() -> redis::aio::MultiplexedConnection {
    redis::Client::open(common::redis_url())
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .expect("redis connection")
}

async fn redis_cmd(conn: &mut redis::aio::MultiplexedConnection, args: &[&[u8]]) -> redis::Value {
    let mut cmd = redis::cmd(std::str::from_utf8(args[0]).expect("command"));
    for arg in &args[1..] {
        cmd.arg(*arg);
    }
    cmd.query_async(conn).await.expect("redis command")
}

/// The record's hash key of single-tenant `key` in `store`.
fn redis_record(store: &RedisStore, key: &str) -> Vec<u8> {
    let [record, ..] = store.keys(&ScopedKey::new("", key));
    record
}

/// The stored response bytes of a single-tenant key, read straight from PostgreSQL.
async fn pg_response(store: &PostgresStore, table: &str, key: &str) -> Vec<u8> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT response FROM {table} WHERE scope = $1 AND key = $2"
    )))
    .bind(&b""[..])
    .bind(key.as_bytes())
    .fetch_one(store.pool())
    .await
    .expect("the stored response")
}

async fn pg_exec(store: &PostgresStore, sql: String, key: &str) {
    let done = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(key.as_bytes())
        .execute(store.pool())
        .await
        .expect("damage the row");
    assert_eq!(done.rows_affected(), 1, "one row damaged");
}

async fn pg_set_response(store: &PostgresStore, table: &str, key: &str, bytes: &[u8]) {
    let done = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {table} SET response = $1 WHERE scope = ''::bytea AND key = $2"
    )))
    .bind(bytes)
    .bind(key.as_bytes())
    .execute(store.pool())
    .await
    .expect("rewrite the response");
    assert_eq!(done.rows_affected(), 1, "one row rewritten");
}

/// `stored` (a `TIR3` record) with its status code replaced by `status`.
fn with_status(stored: &[u8], status: u16) -> Vec<u8> {
    let mut out = stored.to_vec();
    out[4..6].copy_from_slice(&status.to_be_bytes());
    out
}

/// A key that completed once (one effect) on `addr`, with body `body`.
async fn completed(addr: SocketAddr, effects: &Effects, key: &str, body: &str) {
    let before = effects.count();
    let first = send(addr, key, body).await;
    assert_eq!(first.status, 201, "the first request runs: {first:?}");
    assert_eq!(effects.count(), before + 1, "one effect");
}

/// After the record of `key` was damaged (`what`): the identical retry and a retry with another
/// body each run nothing and get a typed, fail-closed answer (503 problem+json telling the
/// client to keep its key), and the server still serves a fresh key (no panic took it down).
async fn fails_closed(addr: SocketAddr, effects: &Effects, key: &str, body: &str, what: &str) {
    let before = effects.count();
    for (label, retry_body) in [
        ("identical retry", body),
        ("other body", r#"{"other":true}"#),
    ] {
        let retry = send(addr, key, retry_body).await;
        assert_eq!(
            effects.count(),
            before,
            "{what}, {label}: the handler ran again for a key whose record is unreadable \
             (treated as absent): {retry:?}"
        );
        assert!(
            !retry.replayed,
            "{what}, {label}: something was replayed from an unreadable record: {retry:?}"
        );
        assert_eq!(
            (retry.status, retry.slug().as_str(), retry.safe_new_key()),
            (503, "store-unavailable", Some(false)),
            "{what}, {label}: not a typed fail-closed answer: {retry:?}"
        );
    }
    let fresh = unique("after-damage");
    let answer = send(addr, &fresh, body).await;
    assert_eq!(
        answer.status, 201,
        "{what}: the server no longer serves a fresh key: {answer:?}"
    );
    assert_eq!(
        effects.count(),
        before + 1,
        "{what}: the fresh key ran once"
    );
}

// ---------------------------------------------------------------------------------------------
// 1. Foreign and damaged records
// ---------------------------------------------------------------------------------------------

/// Attacks: a PostgreSQL row whose response column was damaged by another tool (garbage,
/// empty, cut short, trailing bytes, a future format magic, status codes 0 and 1000), whose
/// fingerprint is not 32 bytes, or whose attempts are negative. Checks DESIGN §1 step 6 (store
/// errors -> 503, nothing run, fail closed) and §2 (the record is the key's, never absent while
/// it stands): no second run, no replay, a typed 503, the server still up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_6_damaged_postgres_rows_fail_closed_and_run_nothing() {
    let table = "s33_damaged_rows";
    let Some(store) = pg(table).await else {
        return;
    };
    let effects = Effects::default();
    let addr = serve(app(store.clone(), effects.clone(), "pg", |l| l)).await;
    let body = r#"{"amount":1}"#;
    let probe = unique("probe");
    completed(addr, &effects, &probe, body).await;
    let stored = pg_response(&store, table, &probe).await;
    assert_eq!(&stored[..4], b"TIR3", "the current format");
    let mut future = stored.clone();
    future[..4].copy_from_slice(b"TIR9");
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "garbage response",
            b"\xde\xad\xbe\xef not a record".to_vec(),
        ),
        ("empty response", Vec::new()),
        ("response cut short", stored[..stored.len() - 3].to_vec()),
        (
            "response with trailing bytes",
            [&stored[..], b"\x00"].concat(),
        ),
        ("future format magic", future),
        ("status code 0", with_status(&stored, 0)),
        ("status code 1000", with_status(&stored, 1000)),
    ];
    for (what, bytes) in cases {
        let key = unique("bytes");
        completed(addr, &effects, &key, body).await;
        pg_set_response(&store, table, &key, &bytes).await;
        fails_closed(addr, &effects, &key, body, what).await;
    }
    for (what, sql) in [
        (
            "a 1-byte fingerprint",
            format!("UPDATE {table} SET fingerprint = '\\x00'::bytea WHERE key = $1"),
        ),
        (
            "negative attempts",
            format!("UPDATE {table} SET attempts = -1 WHERE key = $1"),
        ),
    ] {
        let key = unique("column");
        completed(addr, &effects, &key, body).await;
        pg_exec(&store, sql, &key).await;
        fails_closed(addr, &effects, &key, body, what).await;
    }
}

/// Attacks: Redis records edited by hand or by another tool: a garbage `resp`, a missing or
/// non-numeric expiry (`ea`), a missing fingerprint, an unknown status, attempts out of range,
/// and the record's key replaced by a string or a list (another Redis type). Checks DESIGN §1
/// step 6 (store errors -> 503, nothing run) and §5 (one atomic script per operation): no
/// second run, no replay, a typed 503, the server still up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_6_damaged_redis_hashes_fail_closed_and_run_nothing() {
    let Some(store) = common::redis("s33-damaged").await else {
        return;
    };
    let effects = Effects::default();
    let addr = serve(app(store.clone(), effects.clone(), "redis", |l| l)).await;
    let mut conn = redis_conn().await;
    let body = r#"{"amount":1}"#;
    type Damage = &'static [&'static [u8]];
    let cases: [(&str, Damage); 8] = [
        (
            "garbage resp",
            &[b"HSET", b"@", b"resp", b"\xde\xadnot a record"],
        ),
        ("missing ea", &[b"HDEL", b"@", b"ea"]),
        ("non-numeric ea", &[b"HSET", b"@", b"ea", b"tomorrow"]),
        ("missing fp", &[b"HDEL", b"@", b"fp"]),
        ("unknown status", &[b"HSET", b"@", b"st", b"done"]),
        ("attempts out of range", &[b"HSET", b"@", b"at", b"-1"]),
        ("a string in its place", &[b"SET", b"@", b"not a hash"]),
        ("a list in its place", &[b"RPUSH", b"@", b"x"]),
    ];
    for (what, damage) in cases {
        let key = unique("hash");
        completed(addr, &effects, &key, body).await;
        let record = redis_record(&store, &key);
        if damage[0] == b"SET" || damage[0] == b"RPUSH" {
            redis_cmd(&mut conn, &[b"DEL", &record]).await;
        }
        let args: Vec<&[u8]> = damage
            .iter()
            .map(|a| if *a == b"@" { &record[..] } else { *a })
            .collect();
        redis_cmd(&mut conn, &args).await;
        fails_closed(addr, &effects, &key, body, what).await;
    }
}

/// Attacks: a completed record whose response is gone (PostgreSQL `response` set to NULL by a
/// tool; a Redis hash without its `resp` field), so there is nothing to replay. Checks DESIGN
/// §1 (problem details: `safe_new_key` says whether a new key is safe; "retry with the same
/// key" for a store failure) and the problem table in src/problem.rs (`store-unavailable`:
/// "nothing ran; retry with the same key"). The handler must not run again, and the answer must
/// not contradict itself: a 503 `store-unavailable` with `Retry-After` that also says
/// `safe_new_key: true` and `state: completed` tells a client both "retry this key" (which will
/// never succeed) and "move on to a new key" (which runs the operation a second time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_completed_record_without_response_gets_a_consistent_answer() {
    let table = "s33_no_response";
    let Some(pg_store) = pg(table).await else {
        return;
    };
    let Some(redis_store) = common::redis("s33-no-response").await else {
        return;
    };
    let body = r#"{"amount":1}"#;
    let mut found = Vec::new();
    for name in ["postgres", "redis"] {
        let effects = Effects::default();
        let key = unique("no-response");
        let addr = match name {
            "postgres" => {
                let addr = serve(app(pg_store.clone(), effects.clone(), "pg", |l| l)).await;
                completed(addr, &effects, &key, body).await;
                pg_exec(
                    &pg_store,
                    format!("UPDATE {table} SET response = NULL WHERE key = $1"),
                    &key,
                )
                .await;
                addr
            }
            _ => {
                let addr = serve(app(redis_store.clone(), effects.clone(), "rd", |l| l)).await;
                completed(addr, &effects, &key, body).await;
                let record = redis_record(&redis_store, &key);
                let mut conn = redis_conn().await;
                redis_cmd(&mut conn, &[b"HDEL", &record, b"resp"]).await;
                addr
            }
        };
        let retry = send(addr, &key, body).await;
        assert_eq!(
            effects.count(),
            1,
            "{name}: the handler ran again: {retry:?}"
        );
        assert!(!retry.replayed, "{name}: {retry:?}");
        let problem = retry.problem().expect("a problem+json answer");
        let contradictory = retry.status == 503
            && retry.slug() == "store-unavailable"
            && problem["safe_new_key"] == serde_json::json!(true);
        if contradictory {
            found.push(format!(
                "{name}: a completed record without a response is answered 503 store-unavailable \
             (documented as 'nothing ran; retry with the same key', with Retry-After) yet \
             safe_new_key: true and state {}: the same key will fail this way until the record \
             expires, and a client that follows safe_new_key runs the operation again: {retry:?}",
                problem["state"]
            ));
        }
    }
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// Attacks: a completed PostgreSQL record whose stored status was rewritten to an informational
/// code (100, 103): `StoredResponse::from_bytes` accepts any code `http` does (100..=999), so
/// the record "decodes" and is replayed as a final response, which hyper refuses to send and
/// turns into a bare 500 without a body. Checks DESIGN §1 (replays return the original status;
/// every error the middleware gives is a problem+json) and the brief's "never replay garbage":
/// the handler must not run again and the client must get either a real replay or a typed
/// problem, never an untyped 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_a_stored_informational_status_is_not_replayed_as_an_untyped_500() {
    let table = "s33_informational";
    let Some(store) = pg(table).await else {
        return;
    };
    let effects = Effects::default();
    let addr = serve(app(store.clone(), effects.clone(), "pg", |l| l)).await;
    let body = r#"{"amount":1}"#;
    let mut found = Vec::new();
    for status in [100u16, 103] {
        let key = unique("informational");
        completed(addr, &effects, &key, body).await;
        let before = effects.count();
        let stored = pg_response(&store, table, &key).await;
        pg_set_response(&store, table, &key, &with_status(&stored, status)).await;
        let retry = send(addr, &key, body).await;
        assert_eq!(
            effects.count(),
            before,
            "status {status}: ran again: {retry:?}"
        );
        if !(retry.problem().is_some() || (retry.replayed && retry.status == status)) {
            found.push(format!(
                "status {status}: a stored informational status is replayed as garbage (an \
             untyped {} with body {:?}, no problem+json, no replay marker) instead of being \
             refused as a corrupt record: {retry:?}",
                retry.status, retry.body
            ));
        }
    }
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// Attacks: a SQLite file whose `scope`/`key` columns were rewritten as TEXT instead of BLOB
/// (a CSV export and `.import`, a hand-written `UPDATE ... SET key = 'k'`, another tool): the
/// record still stands for that key, but SQLite never finds TEXT equal to the BLOB the store
/// binds, so the claim's upsert would insert a second row beside it and run the key again.
/// The table refuses such writes (CHECK constraints), so the record stays visible. Checks
/// DESIGN §1 step 5 (one atomic claim that creates a record *or returns the existing one*),
/// §2 (one row per scoped key) and §7.1 (same key twice -> exactly one effect).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_1_sqlite_record_with_text_typed_key_is_not_treated_as_absent() {
    let (store, path) = common::sqlite("s33-text-key").await;
    let effects = Effects::default();
    let addr = serve(app(store.clone(), effects.clone(), "sqlite", |l| l)).await;
    let body = r#"{"amount":1}"#;
    let key = unique("text-key");
    completed(addr, &effects, &key, body).await;
    let retyped = sqlx::query(
        "UPDATE idempotency_records SET scope = CAST(scope AS TEXT), key = CAST(key AS TEXT) \
         WHERE key = CAST(?1 AS BLOB)",
    )
    .bind(key.as_bytes())
    .execute(store.pool())
    .await;
    let fingerprint = sqlx::query(
        "UPDATE idempotency_records SET fingerprint = hex(fingerprint) WHERE key = CAST(?1 AS BLOB)",
    )
    .bind(key.as_bytes())
    .execute(store.pool())
    .await;
    let inserted = sqlx::query(
        "INSERT INTO idempotency_records (scope, key, fingerprint, status, lease_token, \
         lease_until, attempts, created_at, updated_at, expires_at) \
         VALUES ('', ?1, x'00', 'released', 1, 0, 1, 0, 0, 0)",
    )
    .bind(format!("{key}-text"))
    .execute(store.pool())
    .await;
    let retry = send(addr, &key, body).await;
    let rows: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_records WHERE CAST(key AS BLOB) = CAST(?1 AS BLOB)",
    )
    .bind(key.as_bytes())
    .fetch_one(store.pool())
    .await
    .expect("count rows");
    let _ = std::fs::remove_file(&path);
    for (what, result) in [
        ("scope and key retyped as TEXT", &retyped),
        ("the fingerprint rewritten as TEXT", &fingerprint),
        ("a record inserted with a TEXT key", &inserted),
    ] {
        assert!(
            result
                .as_ref()
                .is_err_and(|e| e.to_string().contains("CHECK")),
            "{what}: the table should refuse it (a CHECK constraint), got {result:?}"
        );
    }
    assert_eq!(
        (effects.count(), rows),
        (1, 1),
        "the completed record of key {key:?} stays visible: one run, one row; the retry got \
         {retry:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// 2. Instances with different settings on one store
// ---------------------------------------------------------------------------------------------

/// Instance A (a route with `external_effects(true)`, i.e. `LeaseExpiry::Reconcile`: effects
/// whose start cannot be observed, so a dead holder must go to reconciliation) claims a key,
/// makes its effect and dies (its claim is made here through the store, exactly as A's layer
/// makes it, and its effect counted at the sink). Instance B on the same store runs the same
/// route with the default `LeaseExpiry::Reclaim` (a rolling deploy that changed the setting, or
/// a misconfigured replica). After A's lease lapses the store itself counts the record as
/// uncertain (`count_uncertain`), yet B's claim takes it over and runs the handler again.
/// Checks DESIGN §4 (`Reconcile`: "the record always goes to needs_reconciliation"; a record
/// whose outcome is unknown never turns into a new run), §7.6 (crash after claim: never seen as
/// new) and §7.9 (several instances on one store -> one effect per key). Run on PostgreSQL and
/// Redis, the stores replicas share.
async fn reconcile_lease_of_a_dead_holder<St: IdempotencyStore + Clone>(store: St, name: &str) {
    let effects = Effects::default();
    let b = serve(app(store.clone(), effects.clone(), "B", |l| l)).await;
    let body = r#"{"amount":7}"#;
    // Self-check: `Fingerprint::of` is what the layer records for this request.
    let probe = unique("probe");
    completed(b, &effects, &probe, body).await;
    let fingerprint = Fingerprint::of(&sent_parts(), body.as_bytes()).expect("fingerprint");
    let recorded = store
        .lookup(&ScopedKey::new("", probe.as_str()))
        .await
        .expect("lookup")
        .expect("the probe's record");
    assert_eq!(
        recorded.fingerprint, fingerprint,
        "{name}: test rig: Fingerprint::of differs from the layer's"
    );
    let base = effects.count();

    // Instance A, on a Reconcile route, claims, makes its effect, and dies.
    let key = unique("dead-reconcile-holder");
    let claimed = store
        .claim(&ClaimRequest {
            key: ScopedKey::new("", key.as_str()),
            fingerprint,
            lease: Duration::from_millis(300),
            ttl: Duration::from_secs(3600),
            on_lease_expiry: LeaseExpiry::Reconcile,
        })
        .await
        .expect("A's claim");
    assert!(matches!(claimed, Claim::Acquired(_)), "{name}: {claimed:?}");
    effects.hit();
    // Its lease lapses: nobody renews it.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let uncertain = store.count_uncertain().await.map(|c| c.count);

    let retry = send(b, &key, body).await;
    let after = store
        .lookup(&ScopedKey::new("", key.as_str()))
        .await
        .ok()
        .flatten()
        .map(|r| (r.status, r.attempts));
    assert_eq!(
        effects.count(),
        base + 1,
        "{name}: instance A (LeaseExpiry::Reconcile) made its effect and died; the store \
         counted its record uncertain ({uncertain:?}), yet instance B (LeaseExpiry::Reclaim) \
         took the lapsed lease over and ran the handler a second time: B got {retry:?}, the \
         record is now {after:?}"
    );
    assert_eq!(
        (retry.status, retry.slug().as_str()),
        (409, "outcome-unknown"),
        "{name}: {retry:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_postgres_reconcile_lease_of_a_dead_holder_is_not_reclaimed_by_another_instance() {
    let Some(store) = pg("s33_mixed_expiry").await else {
        return;
    };
    reconcile_lease_of_a_dead_holder(store, "postgres").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_redis_reconcile_lease_of_a_dead_holder_is_not_reclaimed_by_another_instance() {
    let Some(store) = common::redis("s33-mixed-expiry").await else {
        return;
    };
    reconcile_lease_of_a_dead_holder(store, "redis").await;
}

/// Two instances on one PostgreSQL store fingerprint the same route's JSON with different
/// `JsonFields::exclude` lists (a rolling deploy that stopped ignoring `/currency`). The
/// exclude form hashes only what is left, not which pointers were left out (the include form
/// hashes its pointer list), so A's fingerprint of `{amount:1, currency:"USD"}` equals B's of
/// `{amount:1}`, two requests B itself tells apart (shown first, on B alone: 422). B then
/// replays A's "USD" answer to a request without a currency. Checks DESIGN §1 step 6 (a
/// different request is a 422, nothing run) and the brief's worst outcome "one request's stored
/// answer replayed to a different request"; §1 step 4 (canonicalisation may only merge what is
/// provably the same request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_4_instances_with_different_excluded_fields_never_replay_anothers_answer() {
    let Some(store) = pg("s33_exclude_drift").await else {
        return;
    };
    let effects = Effects::default();
    let exclude = |pointers: &'static [&'static str]| {
        move |l: IdempotencyLayer<PostgresStore>| {
            l.defaults(|r| r.fingerprint_json(JsonFields::exclude(pointers).expect("pointers")))
        }
    };
    let a = serve(app(
        store.clone(),
        effects.clone(),
        "A",
        exclude(&["/ts", "/currency"]),
    ))
    .await;
    let b = serve(app(store.clone(), effects.clone(), "B", exclude(&["/ts"]))).await;
    let usd = r#"{"amount":1,"currency":"USD","ts":1}"#;
    let default_currency = r#"{"amount":1,"ts":2}"#;

    // Control: B alone tells the two requests apart.
    let control = unique("control");
    completed(b, &effects, &control, usd).await;
    let other = send(b, &control, default_currency).await;
    assert_eq!(
        (other.status, other.slug().as_str()),
        (422, "fingerprint-mismatch"),
        "control: B counts /currency: {other:?}"
    );

    let key = unique("drift");
    completed(a, &effects, &key, usd).await;
    let before = effects.count();
    let retry = send(b, &key, default_currency).await;
    let wrong_replay = retry.replayed && retry.body.contains("USD");
    assert!(
        !wrong_replay,
        "instance B (exclude [/ts]) replayed instance A's answer for a USD request (exclude \
         [/ts, /currency]) to a request without a currency, which B itself treats as a different \
         request (422 in the control): {retry:?}"
    );
    assert!(effects.count() <= before + 1, "at most B's own run");
}
