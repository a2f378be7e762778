//! Red-team review (session 33): replicas of one service sharing one durable store (PostgreSQL,
//! a SQLite file, Redis) whose layers are configured differently: a rolling deploy, a canary, a
//! misconfigured replica. Two axum apps on 127.0.0.1:0 over one store (each with its own store
//! handle and so its own keeper) are two replicas; retries alternate between them, or race.
//!
//! Already covered elsewhere (not redone here): different `LeaseExpiry` per replica, different
//! `JsonFields::exclude` lists and fingerprint header names, damaged rows
//! (`s33_foreign_records_review.rs`).
//!
//! Effects are counted at the sink (an `Effects` both replicas' handlers bump after their work),
//! never from responses.

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::{Effects, guard, serve, until};
use tokio::sync::Semaphore;
use tower_idempotency::jsonrpc::JsonRpc;
use tower_idempotency::{CachePolicy, IdempotencyLayer, PostgresStore, RedisStore, SqliteStore};

// ---------------------------------------------------------------------------------------------
// Rig
// ---------------------------------------------------------------------------------------------

fn unique(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("skew-{name}-{}-{nanos}", std::process::id())
}

/// What both replicas' handlers share: the sink, a count of handlers that began, and a gate a
/// handler asked to (`x-hold`) waits on before its effect.
#[derive(Clone)]
struct Rig {
    effects: Effects,
    started: Effects,
    gate: Arc<Semaphore>,
}

impl Rig {
    fn new() -> Self {
        Self {
            effects: Effects::default(),
            started: Effects::default(),
            gate: Arc::new(Semaphore::new(0)),
        }
    }

    /// The handler of `POST /op` on replica `instance`: waits on the gate if asked, makes its
    /// effect, answers `x-want-status` (default 201) naming the instance, its run number, the
    /// caller's `x-tenant` and the body (so a replay to the wrong request shows), padded by
    /// `x-pad` bytes, with an `x-internal-token` header the app considers sensitive.
    async fn handle(&self, instance: &'static str, headers: HeaderMap, body: Bytes) -> Response {
        self.started.hit();
        if headers.contains_key("x-hold") {
            self.gate.acquire().await.expect("gate").forget();
        }
        let n = self.effects.hit();
        let number = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<usize>().ok())
        };
        let status =
            StatusCode::from_u16(number("x-want-status").unwrap_or(201) as u16).expect("status");
        let tenant = headers
            .get("x-tenant")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_owned();
        let text = format!(
            "instance {instance} run {n} tenant {tenant} for {}{}",
            String::from_utf8_lossy(&body),
            "x".repeat(number("x-pad").unwrap_or(0))
        );
        let mut res = (status, text).into_response();
        res.headers_mut().insert(
            "x-internal-token",
            HeaderValue::from_str(&format!("secret-{instance}-{n}")).expect("value"),
        );
        res
    }
}

/// `POST /op` on one replica behind `$layer` (scoped already).
macro_rules! replica {
    ($rig:expr, $instance:expr, $layer:expr) => {{
        let rig: Rig = $rig.clone();
        let instance: &'static str = $instance;
        Router::new()
            .route(
                "/op",
                post(move |headers: HeaderMap, body: Bytes| {
                    let rig = rig.clone();
                    async move { rig.handle(instance, headers, body).await }
                }),
            )
            .layer($layer)
    }};
}

#[derive(Debug, Clone)]
struct Answer {
    status: u16,
    replayed: bool,
    content_type: String,
    headers: HeaderMap,
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

    fn state(&self) -> String {
        self.problem()
            .and_then(|p| p["state"].as_str().map(str::to_owned))
            .unwrap_or_default()
    }
}

async fn post_to(
    addr: SocketAddr,
    path: &str,
    key: Option<(&str, &str)>,
    body: &str,
    headers: &[(&str, &str)],
) -> Answer {
    let mut req = common::client()
        .post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(body.to_owned());
    if let Some((name, key)) = key {
        req = req.header(name, key);
    }
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let res = guard("a request", req.send()).await.expect("an answer");
    let status = res.status().as_u16();
    let headers = res.headers().clone();
    let replayed = headers
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let content_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let body = String::from_utf8_lossy(&res.bytes().await.expect("body")).into_owned();
    Answer {
        status,
        replayed,
        content_type,
        headers,
        body,
    }
}

/// `POST /op` with `Idempotency-Key: key`.
async fn send(addr: SocketAddr, key: &str, body: &str, headers: &[(&str, &str)]) -> Answer {
    post_to(addr, "/op", Some(("idempotency-key", key)), body, headers).await
}

/// Two PostgreSQL store handles (two pools, as two processes have) on one fresh table.
async fn pg_pair(name: &str) -> Option<(PostgresStore, PostgresStore)> {
    let table = common::pg_rig::table("s33skew", name);
    let a = common::postgres(&table).await?;
    let b = common::postgres(&table).await?;
    Some((a, b))
}

/// Two Redis store handles (two connections) under one fresh prefix.
async fn redis_pair(name: &str) -> Option<(RedisStore, RedisStore)> {
    // Reachability, reported as the suite reports it.
    common::redis(name).await?;
    let prefix = common::redis_prefix(name);
    let open = || async {
        RedisStore::connect(&common::redis_url())
            .await
            .expect("redis")
            .with_prefix(&prefix)
            .expect("prefix")
    };
    Some((open().await, open().await))
}

/// Two SQLite store handles (two pools) on one fresh file.
async fn sqlite_pair(name: &str) -> (SqliteStore, SqliteStore) {
    let (a, path) = common::sqlite(name).await;
    let b = SqliteStore::connect(&format!("sqlite://{}", path.display()))
        .await
        .expect("open the same sqlite file");
    (a, b)
}

// ---------------------------------------------------------------------------------------------
// 1. Cache policy: DefinitiveOnly on one replica, Everything on the other
// ---------------------------------------------------------------------------------------------

/// Attacks: replica A records everything (`CachePolicy::Everything`), replica B only definitive
/// outcomes (the default), on one PostgreSQL table. A 500 recorded by A must be B's answer too
/// (B replays it; it does not run the handler again because its own policy would have
/// released), and a 500 that B released may be re-attempted once by A, whose recorded outcome
/// B then replays. Checks DESIGN §3 (Everything: the first outcome is the answer forever;
/// DefinitiveOnly: a 5xx releases the claim) and §1 step 6 (completed -> stored response).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_policy_skew_a_recorded_500_is_replayed_by_the_definitive_only_replica() {
    let Some((sa, sb)) = pg_pair("policy").await else {
        return;
    };
    let rig = Rig::new();
    let a = serve(replica!(
        rig,
        "A",
        IdempotencyLayer::new(sa)
            .cache_policy(CachePolicy::Everything)
            .single_tenant()
    ))
    .await;
    let b = serve(replica!(
        rig,
        "B",
        IdempotencyLayer::new(sb).single_tenant()
    ))
    .await;
    let body = r#"{"amount":1}"#;
    let fail = [("x-want-status", "500")];

    // Recorded by A (Everything), retried on B (DefinitiveOnly).
    let k1 = unique("everything-first");
    let first = send(a, &k1, body, &fail).await;
    assert_eq!((first.status, rig.effects.count()), (500, 1), "{first:?}");
    for (name, addr) in [("B", b), ("A", a), ("B", b)] {
        let retry = send(addr, &k1, body, &fail).await;
        assert_eq!(
            rig.effects.count(),
            1,
            "replica {name} ran the handler again for a 500 that replica A (Everything) \
             recorded: {retry:?}"
        );
        assert!(
            retry.replayed && retry.status == 500 && retry.body == first.body,
            "replica {name} must replay A's recorded 500: {retry:?}"
        );
    }

    // Released by B, re-attempted once by A (allowed), then A's record is the answer.
    let k2 = unique("definitive-first");
    let base = rig.effects.count();
    let first = send(b, &k2, body, &fail).await;
    assert_eq!(first.status, 500, "{first:?}");
    let second = send(a, &k2, body, &fail).await;
    assert_eq!(
        (second.status, second.replayed),
        (500, false),
        "B released its 500, so A re-attempts: {second:?}"
    );
    for addr in [b, a, b] {
        let retry = send(addr, &k2, body, &fail).await;
        assert!(
            retry.replayed && retry.body == second.body,
            "A's recorded 500 is the answer on both replicas: {retry:?}"
        );
    }
    assert_eq!(
        rig.effects.count(),
        base + 2,
        "B's released run and A's recorded one, nothing more"
    );
}

// ---------------------------------------------------------------------------------------------
// 2. TTL: one short, one long
// ---------------------------------------------------------------------------------------------

/// Attacks: replica A keeps records 1 s, replica B 24 h, on one Redis prefix (TTL-native,
/// `PEXPIREAT`). (a) B's record must outlive A's TTL when A reads it: the reader's TTL never
/// shortens the writer's record. (b) A's short-lived record is replayed by B within its TTL and
/// executes again after it (the contract's expiry). (c) An in-flight claim made on the 1 s route
/// whose handler outlives that second is not "expired" for B: B gets 409, never a second run.
/// Checks DESIGN §1 step 6 (completed but expired -> absent; in_progress lease live -> 409),
/// §2 (a completed record lives until its `expires_at`), §3 (TTL per route), §7.4.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_ttl_skew_short_ttl_replica_neither_shortens_records_nor_expires_live_runs() {
    let Some((sa, sb)) = redis_pair("s33-ttl-skew").await else {
        return;
    };
    let rig = Rig::new();
    let a = serve(replica!(
        rig,
        "A",
        IdempotencyLayer::new(sa)
            .ttl(Duration::from_secs(1))
            .single_tenant()
    ))
    .await;
    let b = serve(replica!(
        rig,
        "B",
        IdempotencyLayer::new(sb).single_tenant()
    ))
    .await;
    let body = r#"{"amount":2}"#;

    // (a) B's 24 h record, read by A after A's own TTL has passed.
    let k1 = unique("long-record");
    let first = send(b, &k1, body, &[]).await;
    assert_eq!(first.status, 201, "{first:?}");
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    let retry = send(a, &k1, body, &[]).await;
    assert_eq!(
        rig.effects.count(),
        1,
        "replica A (TTL 1 s) treated replica B's 24 h record as expired and ran again: {retry:?}"
    );
    assert!(retry.replayed && retry.body == first.body, "{retry:?}");

    // (b) A's 1 s record: replayed by B within it, a new run after it.
    let k2 = unique("short-record");
    let first = send(a, &k2, body, &[]).await;
    assert_eq!(first.status, 201, "{first:?}");
    let retry = send(b, &k2, body, &[]).await;
    assert!(
        retry.replayed && retry.body == first.body && rig.effects.count() == 2,
        "B replays A's record within A's TTL: {retry:?}"
    );
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    let after = send(b, &k2, body, &[]).await;
    assert_eq!(
        (after.status, after.replayed, rig.effects.count()),
        (201, false, 3),
        "past A's TTL the key executes again (DESIGN §7.4): {after:?}"
    );
    let again = send(a, &k2, body, &[]).await;
    assert!(
        again.replayed && again.body == after.body && rig.effects.count() == 3,
        "B's new (24 h) record is A's answer: {again:?}"
    );

    // (c) A live run on the 1 s route outlives its TTL; B must see it in flight.
    let k3 = unique("live-past-ttl");
    let started = rig.started.count();
    let holder = {
        let k3 = k3.clone();
        tokio::spawn(async move { send(a, &k3, body, &[("x-hold", "1")]).await })
    };
    until("A's handler starts", || rig.started.count() == started + 1).await;
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    let during = send(b, &k3, body, &[]).await;
    let ran_during = rig.started.count() - started - 1;
    rig.gate.add_permits(1);
    let answered = guard("A's answer", holder).await.expect("holder");
    assert_eq!(
        ran_during, 0,
        "replica B started the handler again while A's run (lease live, past A's 1 s TTL) was \
         still going: B got {during:?}"
    );
    assert_eq!(
        (during.status, during.slug().as_str()),
        (409, "in-flight"),
        "{during:?}"
    );
    assert_eq!(answered.status, 201, "{answered:?}");
    let retry = send(b, &k3, body, &[]).await;
    assert!(
        retry.replayed && retry.body == answered.body && rig.effects.count() == 4,
        "{retry:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// 3. Lease length: one long, one short
// ---------------------------------------------------------------------------------------------

/// Retries of `key` on `addr` every 150 ms while another replica's handler holds it, `n` times:
/// each must be 409 in flight and start nothing.
async fn hammer_in_flight(
    rig: &Rig,
    addr: SocketAddr,
    key: &str,
    body: &str,
    n: usize,
    what: &str,
) {
    let started = rig.started.count();
    for i in 0..n {
        let retry = send(addr, key, body, &[]).await;
        assert_eq!(
            rig.started.count(),
            started,
            "{what}: retry {i} started the handler a second time while the first run was live \
             and renewed: {retry:?}"
        );
        assert_eq!(
            (retry.status, retry.slug().as_str()),
            (409, "in-flight"),
            "{what}: retry {i}: {retry:?}"
        );
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
}

/// Attacks: replica A leases for 30 s, replica B for 300 ms, on one PostgreSQL table. A
/// short-lease replica must not take over a long-lease replica's live run (its own lease length
/// is not the holder's), and a short-lease holder's renewals (every 100 ms, by B's keeper) must
/// keep a long-lease replica's retries out for as long as its handler runs (well past 300 ms).
/// Then eight first requests for one key, split across both replicas and released together:
/// exactly one run. Checks DESIGN §1 step 6 (in_progress, lease live -> 409, nothing run), §4
/// (the holder keeps its lease for as long as its process lives), §7.3 and §7.9.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_lease_skew_neither_replica_takes_over_the_others_live_run() {
    let Some((sa, sb)) = pg_pair("lease").await else {
        return;
    };
    let rig = Rig::new();
    let a = serve(replica!(
        rig,
        "A",
        IdempotencyLayer::new(sa)
            .lease(Duration::from_secs(30))
            .single_tenant()
    ))
    .await;
    let b = serve(replica!(
        rig,
        "B",
        IdempotencyLayer::new(sb)
            .lease(Duration::from_millis(300))
            .single_tenant()
    ))
    .await;
    let body = r#"{"amount":3}"#;

    for (holder, retrier, what) in [
        (a, b, "A (30 s lease) holds, B (300 ms) retries"),
        (b, a, "B (300 ms lease) holds, A (30 s) retries"),
    ] {
        let key = unique("lease");
        let before = rig.effects.count();
        let started = rig.started.count();
        let first = {
            let key = key.clone();
            tokio::spawn(async move { send(holder, &key, body, &[("x-hold", "1")]).await })
        };
        until("the holder's handler starts", || {
            rig.started.count() == started + 1
        })
        .await;
        hammer_in_flight(&rig, retrier, &key, body, 10, what).await;
        rig.gate.add_permits(1);
        let first = guard("the holder's answer", first).await.expect("holder");
        assert_eq!(first.status, 201, "{what}: {first:?}");
        let retry = send(retrier, &key, body, &[]).await;
        assert!(
            retry.replayed && retry.body == first.body,
            "{what}: the retry replays the holder's answer: {retry:?}"
        );
        assert_eq!(rig.effects.count(), before + 1, "{what}: one run");
    }

    // Racing first requests, split across the replicas.
    let key = unique("lease-race");
    let before = rig.effects.count();
    let barrier = Arc::new(tokio::sync::Barrier::new(8));
    let mut tasks = Vec::new();
    for i in 0..8 {
        let (barrier, key) = (barrier.clone(), key.clone());
        let addr = if i % 2 == 0 { a } else { b };
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            send(addr, &key, body, &[]).await
        }));
    }
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(guard("a racing request", task).await.expect("task"));
    }
    assert_eq!(
        rig.effects.count(),
        before + 1,
        "eight racing first requests across a 30 s-lease and a 300 ms-lease replica ran the \
         handler more than once: {answers:#?}"
    );
    for answer in &answers {
        assert!(
            answer.status == 201 || (answer.status == 409 && answer.slug() == "in-flight"),
            "every other answer is a replay or a 409: {answer:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 4. Response size limit
// ---------------------------------------------------------------------------------------------

/// Attacks: replica A records responses up to 256 bytes, replica B up to 1 MiB, on one SQLite
/// file (two pools). A's 1 KiB answer is kept as a marker without its body: B must not read
/// the marker as absent (a second run) nor replay anything, but answer `response-not-stored`.
/// B's 1 KiB record, read by A, is a replay (A's limit is on what it records, not on what it
/// replays) or at worst the same refusal, never a second run. Checks DESIGN §3 (a response
/// over the cache size limit is never silently re-executed; the key stays consumed and replays
/// get a documented answer) and §1 step 6.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_response_limit_skew_never_reruns_and_never_replays_a_cut_body() {
    let (sa, sb) = sqlite_pair("s33-limit-skew").await;
    let rig = Rig::new();
    let a = serve(replica!(
        rig,
        "A",
        IdempotencyLayer::new(sa)
            .response_limit(256)
            .single_tenant()
    ))
    .await;
    let b = serve(replica!(
        rig,
        "B",
        IdempotencyLayer::new(sb).single_tenant()
    ))
    .await;
    let body = r#"{"amount":4}"#;
    let big = [("x-pad", "1024")];

    let k1 = unique("too-large-on-a");
    let first = send(a, &k1, body, &big).await;
    assert!(first.status == 201 && first.body.len() > 1024, "{first:?}");
    for (name, addr) in [("B", b), ("A", a)] {
        let retry = send(addr, &k1, body, &big).await;
        assert_eq!(
            rig.effects.count(),
            1,
            "replica {name} ran again for a key whose response A kept without its body: \
             {retry:?}"
        );
        assert_eq!(
            (retry.status, retry.slug().as_str(), retry.state().as_str()),
            (409, "response-not-stored", "completed"),
            "replica {name}: {retry:?}"
        );
    }

    let k2 = unique("fits-on-b");
    let first = send(b, &k2, body, &big).await;
    assert!(first.status == 201 && first.body.len() > 1024, "{first:?}");
    let retry = send(a, &k2, body, &big).await;
    assert_eq!(
        rig.effects.count(),
        2,
        "replica A (256-byte limit) ran again for B's 1 KiB record: {retry:?}"
    );
    assert!(
        retry.replayed && retry.body == first.body,
        "A replays B's recorded answer whole: {retry:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// 5. wait_for_in_flight and record_refusals on one replica only
// ---------------------------------------------------------------------------------------------

/// Attacks: replica A waits for in-flight holders (`wait_for_in_flight(20 s)`) and writes every
/// refusal into the key's history (`record_refusals(true)`); replica B does neither, on one
/// PostgreSQL table. While B's handler runs, four concurrent waiters on A and B's own retries
/// must start nothing; A's history notes (unfenced writes on B's row) must not disturb B's
/// lease nor its record; when B answers, A's waiters replay B's bytes. Then the other way: A
/// holds, B answers 409 at once. Checks DESIGN §1 step 6 (409, or wait and replay if the route
/// opts in), §4 (fencing: only the holder records), §6 (history capped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_wait_and_refusal_notes_on_one_replica_never_disturb_the_others_run() {
    let Some((sa, sb)) = pg_pair("wait").await else {
        return;
    };
    let store = sa.clone();
    let rig = Rig::new();
    let a = serve(replica!(
        rig,
        "A",
        IdempotencyLayer::new(sa)
            .wait_for_in_flight(Duration::from_secs(20))
            .record_refusals(true)
            .single_tenant()
    ))
    .await;
    let b = serve(replica!(
        rig,
        "B",
        IdempotencyLayer::new(sb)
            .lease(Duration::from_millis(600))
            .single_tenant()
    ))
    .await;
    let body = r#"{"amount":5}"#;

    // B holds; A's waiters wait, B's own retries are refused.
    let key = unique("b-holds");
    let started = rig.started.count();
    let first = {
        let key = key.clone();
        tokio::spawn(async move { send(b, &key, body, &[("x-hold", "1")]).await })
    };
    until("B's handler starts", || rig.started.count() == started + 1).await;
    let mut waiters = Vec::new();
    for _ in 0..4 {
        let key = key.clone();
        waiters.push(tokio::spawn(async move { send(a, &key, body, &[]).await }));
    }
    hammer_in_flight(&rig, b, &key, body, 8, "B holds, B's own retries").await;
    rig.gate.add_permits(1);
    let first = guard("B's answer", first).await.expect("holder");
    assert_eq!(first.status, 201, "{first:?}");
    for waiter in waiters {
        let waited = guard("a waiter on A", waiter).await.expect("waiter");
        assert!(
            waited.replayed && waited.body == first.body,
            "A's waiter replays B's answer: {waited:?}"
        );
    }
    assert_eq!(
        rig.effects.count(),
        1,
        "one run for one key across a waiting and a refusing replica"
    );
    // A few more replays noted on A, then the record is still B's, completed.
    for _ in 0..3 {
        let retry = send(a, &key, body, &[]).await;
        assert!(retry.replayed && retry.body == first.body, "{retry:?}");
    }
    let record = tower_idempotency::IdempotencyStore::lookup(
        &store,
        &tower_idempotency::ScopedKey::new("", key.as_str()),
    )
    .await
    .expect("lookup")
    .expect("the record");
    assert_eq!(
        (record.status.as_str(), record.attempts),
        ("completed", 1),
        "{record:?}"
    );

    // A holds; B answers 409 at once, A's own second request waits and replays.
    let key = unique("a-holds");
    let started = rig.started.count();
    let first = {
        let key = key.clone();
        tokio::spawn(async move { send(a, &key, body, &[("x-hold", "1")]).await })
    };
    until("A's handler starts", || rig.started.count() == started + 1).await;
    let waiter = {
        let key = key.clone();
        tokio::spawn(async move { send(a, &key, body, &[]).await })
    };
    hammer_in_flight(&rig, b, &key, body, 5, "A holds, B retries").await;
    rig.gate.add_permits(1);
    let first = guard("A's answer", first).await.expect("holder");
    let waited = guard("A's waiter", waiter).await.expect("waiter");
    assert!(
        waited.replayed && waited.body == first.body,
        "A's waiter replays A's answer: {waited:?}"
    );
    assert_eq!(rig.effects.count(), 2, "one run per key");
}

// ---------------------------------------------------------------------------------------------
// 6. deny_header on one replica only
// ---------------------------------------------------------------------------------------------

/// Attacks: replica A denies the response header `x-internal-token` (`deny_header`: "Never
/// records nor replays this response header"), replica B (an older build, or one missing the
/// setting) does not, on one PostgreSQL table. B records the header with its answer; a retry
/// routed to A is a replay, and A must not hand the denied header to the client. The reverse
/// (A records without it, B replays) is checked too. Checks DESIGN §1 (replays never carry
/// `Set-Cookie`, `WWW-Authenticate`, ...) and §3 (sensitive response headers, "and a
/// configurable deny list", are never stored), and `IdempotencyLayer::deny_header`'s doc
/// ("never records nor replays").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_deny_header_skew_a_denied_header_is_never_replayed_by_the_replica_that_denies_it() {
    let Some((sa, sb)) = pg_pair("deny").await else {
        return;
    };
    let rig = Rig::new();
    let a = serve(replica!(
        rig,
        "A",
        IdempotencyLayer::new(sa)
            .deny_header(HeaderName::from_static("x-internal-token"))
            .single_tenant()
    ))
    .await;
    let b = serve(replica!(
        rig,
        "B",
        IdempotencyLayer::new(sb).single_tenant()
    ))
    .await;
    let body = r#"{"amount":6}"#;

    // A records without it; B replays without it.
    let k1 = unique("deny-on-writer");
    let first = send(a, &k1, body, &[]).await;
    assert_eq!(first.status, 201, "{first:?}");
    let retry = send(b, &k1, body, &[]).await;
    assert!(retry.replayed && retry.body == first.body, "{retry:?}");
    assert!(
        !retry.headers.contains_key("x-internal-token"),
        "A never stored the header, so B cannot replay it: {retry:?}"
    );

    // B records it; A replays.
    let k2 = unique("deny-on-reader");
    let first = send(b, &k2, body, &[]).await;
    assert_eq!(first.status, 201, "{first:?}");
    let retry = send(a, &k2, body, &[]).await;
    assert!(retry.replayed && retry.body == first.body, "{retry:?}");
    assert_eq!(rig.effects.count(), 2, "one run per key");
    assert!(
        !retry.headers.contains_key("x-internal-token"),
        "replica A (deny_header x-internal-token) replayed the denied header {:?} from a record \
         replica B wrote: a replay filters trailers through the deny list again (\"a record may \
         predate it\") but not headers",
        retry.headers.get("x-internal-token")
    );
}

// ---------------------------------------------------------------------------------------------
// 7. Scope: single_tenant on one replica, scope_by_header on the other
// ---------------------------------------------------------------------------------------------

/// Attacks: replica A is `single_tenant`, replica B scopes by `x-tenant`, on one PostgreSQL
/// table (a canary that added tenant scoping). Tenant T1's answer recorded on B must never
/// reach tenant T2, on either replica: B puts T2 in a scope of its own, and A's shared scope
/// (`""`) can never equal B's `header:x-tenant:<hash>` scopes. Checks DESIGN §1 step 2 (two
/// principals using the same key can never see each other's records or responses; the
/// single-tenant sharing is A's own documented choice, not a path into B's records).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_2_scope_skew_no_tenants_answer_crosses_into_another_tenant() {
    let Some((sa, sb)) = pg_pair("scope").await else {
        return;
    };
    let rig = Rig::new();
    let a = serve(replica!(
        rig,
        "A",
        IdempotencyLayer::new(sa).single_tenant()
    ))
    .await;
    let b = serve(replica!(
        rig,
        "B",
        IdempotencyLayer::new(sb).scope_by_header(HeaderName::from_static("x-tenant"))
    ))
    .await;
    let body = r#"{"amount":7}"#;
    let key = unique("shared-key");
    let t1 = [("x-tenant", "t1")];
    let t2 = [("x-tenant", "t2")];

    let t1_on_b = send(b, &key, body, &t1).await;
    assert!(
        t1_on_b.status == 201 && t1_on_b.body.contains("tenant t1"),
        "{t1_on_b:?}"
    );
    let t2_on_b = send(b, &key, body, &t2).await;
    let t2_on_a = send(a, &key, body, &t2).await;
    for (what, answer) in [("T2 on B", &t2_on_b), ("T2 on A", &t2_on_a)] {
        assert!(
            !answer.body.contains("tenant t1"),
            "{what} got tenant T1's answer recorded on the scoped replica B: {answer:?}"
        );
        assert_eq!(answer.status, 201, "{what}: its own run: {answer:?}");
    }
    // Each tenant's retry on the scoped replica replays its own answer.
    for (tenant, first) in [(&t1, &t1_on_b), (&t2, &t2_on_b)] {
        let retry = send(b, &key, body, tenant).await;
        assert!(
            retry.replayed && retry.body == first.body,
            "{tenant:?}: {retry:?}"
        );
    }
    assert_eq!(
        rig.effects.count(),
        3,
        "T1 on B, T2 on B, the shared scope on A"
    );
}

// ---------------------------------------------------------------------------------------------
// 8. JSON-RPC mode on one replica, plain HTTP on the other
// ---------------------------------------------------------------------------------------------

/// An MCP-ish tool server at `POST /mcp`: makes its effect and answers the call's `id`.
fn tool_replica(rig: &Rig, instance: &'static str) -> Router<()> {
    let rig = rig.clone();
    Router::new().route(
        "/mcp",
        post(move |body: Bytes| {
            let rig = rig.clone();
            async move {
                let call: serde_json::Value = serde_json::from_slice(&body).expect("a call");
                let n = rig.effects.hit();
                let answer = serde_json::json!({
                    "jsonrpc": "2.0",
                    "id": call["id"],
                    "result": {"content": [{"type": "text", "text": format!("instance {instance} run {n}")}]}
                });
                (
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    answer.to_string(),
                )
            }
        }),
    )
}

/// Attacks: the same path guarded in JSON-RPC mode on replica A and as plain HTTP on replica B
/// (a rolling deploy that turns the mode on), one PostgreSQL table, one scope (single tenant).
/// A client sends one `tools/call`, byte for byte the same (same `id` even), with the same
/// `Idempotency-Key`, first to one replica, then, as a retry, to the other.
///
/// A documented sharp edge (README, "Once per key under every fault"): the JSON-RPC mode files
/// a key under its scope and the call's method (a key names one operation of one method), the
/// HTTP mode under its scope, so a retry that crosses a switch of the mode runs again; drain
/// a route's retries (or wait out their TTL) before switching it. Asserted as documented: each
/// mode replays its own key (DESIGN §1, §8), and the crossing is a second run, so a change
/// that closes the edge fails here and the README is updated with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s8_sharp_edge_a_retry_across_a_switch_to_the_jsonrpc_mode_runs_again() {
    let Some((sa, sb)) = pg_pair("jsonrpc").await else {
        return;
    };
    let rig = Rig::new();
    let a = serve(
        tool_replica(&rig, "A").layer(
            IdempotencyLayer::new(sa)
                .jsonrpc(JsonRpc::new())
                .single_tenant(),
        ),
    )
    .await;
    let b = serve(tool_replica(&rig, "B").layer(IdempotencyLayer::new(sb).single_tenant())).await;
    let call = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge","arguments":{"amount":8}}}"#;

    for (order, first, second) in [("A then B", a, b), ("B then A", b, a)] {
        let key = unique("mode");
        let before = rig.effects.count();
        let one = post_to(first, "/mcp", Some(("idempotency-key", &key)), call, &[]).await;
        assert_eq!(one.status, 200, "{order}: {one:?}");
        // The same mode replays its own key.
        let again = post_to(first, "/mcp", Some(("idempotency-key", &key)), call, &[]).await;
        assert_eq!(again.status, 200, "{order}: {again:?}");
        assert_eq!(
            rig.effects.count(),
            before + 1,
            "{order}: one run in one mode"
        );
        let two = post_to(second, "/mcp", Some(("idempotency-key", &key)), call, &[]).await;
        assert_eq!(two.status, 200, "{order}: {two:?}");
        assert_eq!(
            rig.effects.count(),
            before + 2,
            "{order}: the documented edge (a retry across the switch runs again) changed: \
             update the README's row with this test"
        );
        // And each replays what it ran, from then on.
        let three = post_to(second, "/mcp", Some(("idempotency-key", &key)), call, &[]).await;
        assert_eq!(three.status, 200, "{order}: {three:?}");
        assert_eq!(rig.effects.count(), before + 2, "{order}");
    }
}

// ---------------------------------------------------------------------------------------------
// 9. body_limit: the smaller replica's 413 and `safe_new_key`
// ---------------------------------------------------------------------------------------------

/// Attacks: replica A buffers request bodies up to the default 1 MiB, replica B (a deploy that
/// lowered it) up to 512 bytes, on one PostgreSQL table. A 2 KiB request runs on A; its
/// identical retry lands on B and is refused 413 before any claim. The refusal must tell the
/// truth about the key: it says `state: "none"` and `safe_new_key: true` ("the outcome is
/// definite: nothing ran"), though B never looked, and this key's operation ran and is
/// recorded. A client that follows it takes a new key, and the load balancer sends that to A:
/// the operation runs a second time. Checks DESIGN §1 (problem details: `safe_new_key` says
/// whether the client may now use a new key) and the brief's worst outcome "an error a client
/// cannot act on".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_body_limit_skew_a_413_does_not_tell_the_client_a_new_key_is_safe() {
    let Some((sa, sb)) = pg_pair("bodylimit").await else {
        return;
    };
    let rig = Rig::new();
    let a = serve(replica!(
        rig,
        "A",
        IdempotencyLayer::new(sa).single_tenant()
    ))
    .await;
    let b = serve(replica!(
        rig,
        "B",
        IdempotencyLayer::new(sb).body_limit(512).single_tenant()
    ))
    .await;
    let body = format!(r#"{{"amount":9,"memo":"{}"}}"#, "m".repeat(2048));
    let key = unique("big-body");
    let first = send(a, &key, &body, &[]).await;
    assert_eq!((first.status, rig.effects.count()), (201, 1), "{first:?}");
    let retry = send(b, &key, &body, &[]).await;
    assert_eq!(rig.effects.count(), 1, "B runs nothing: {retry:?}");
    assert_eq!(retry.status, 413, "{retry:?}");
    // What a client following the refusal does: a new key for the same request, served by A.
    let followed = if retry.safe_new_key() == Some(true) {
        let answer = send(a, &unique("followed-advice"), &body, &[]).await;
        Some((
            answer.status,
            answer.replayed,
            answer.body.chars().take(40).collect::<String>(),
        ))
    } else {
        None
    };
    assert_ne!(
        retry.safe_new_key(),
        Some(true),
        "replica B's 413 says safe_new_key: true, state {:?}, for a key whose operation ran and \
         is recorded (on A); following it ran the operation a second time (effects now {}, \
         answer {followed:?})",
        retry.state(),
        rig.effects.count()
    );
}

// ---------------------------------------------------------------------------------------------
// 10. The envelope on one replica only
// ---------------------------------------------------------------------------------------------

/// Attacks: replica A wraps answers in the JSON envelope, replica B does not, on one Redis
/// prefix. What either records must be the handler's own bytes: B replays A's record unwrapped
/// (never the envelope, never a double wrap), A replays B's record wrapped once, marked
/// `idempotent_replay: true`, its `original_response` the handler's text. Checks DESIGN §1
/// step 9 (the live response has the same body bytes a replay returns) and `RouteConfig::
/// envelope` (first responses and replays alike, the body embedded as its own bytes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_9_envelope_skew_records_the_handlers_bytes_and_wraps_only_where_asked() {
    let Some((sa, sb)) = redis_pair("s33-envelope-skew").await else {
        return;
    };
    let rig = Rig::new();
    let a = serve(replica!(
        rig,
        "A",
        IdempotencyLayer::new(sa).envelope(true).single_tenant()
    ))
    .await;
    let b = serve(replica!(
        rig,
        "B",
        IdempotencyLayer::new(sb).single_tenant()
    ))
    .await;
    let body = r#"{"amount":10}"#;
    let wrapped = |answer: &Answer| -> (bool, String) {
        let v: serde_json::Value = serde_json::from_str(&answer.body)
            .unwrap_or_else(|e| panic!("an envelope ({e}): {answer:?}"));
        (
            v["idempotent_replay"].as_bool().expect("flag"),
            v["original_response"].as_str().expect("text").to_owned(),
        )
    };

    let k1 = unique("wrapped-first");
    let first = send(a, &k1, body, &[]).await;
    let (flag, original) = wrapped(&first);
    assert!(
        !flag && original.starts_with("instance A run 1"),
        "{first:?}"
    );
    let on_b = send(b, &k1, body, &[]).await;
    assert!(
        on_b.replayed && on_b.body == original,
        "B replays the handler's own bytes, not A's envelope: {on_b:?}"
    );
    let on_a = send(a, &k1, body, &[]).await;
    assert_eq!(wrapped(&on_a), (true, original.clone()), "{on_a:?}");

    let k2 = unique("plain-first");
    let first = send(b, &k2, body, &[]).await;
    assert_eq!(first.status, 201, "{first:?}");
    let on_a = send(a, &k2, body, &[]).await;
    assert_eq!(
        wrapped(&on_a),
        (true, first.body.clone()),
        "A wraps B's record once: {on_a:?}"
    );
    assert_eq!(rig.effects.count(), 2, "one run per key");
}

// ---------------------------------------------------------------------------------------------
// 11. The key header's name
// ---------------------------------------------------------------------------------------------

/// Attacks: replica A reads `Idempotency-Key`, replica B `X-Request-Key` (its key required), on
/// one Redis prefix. A retry of A's key sent to B with only A's header must run nothing (400
/// `key-missing`); one that carries the key in both headers is the same operation to B (the
/// header's name is neither scope nor fingerprint) and replays A's answer. Checks DESIGN §1
/// step 1 (missing key -> 400 where the route requires one) and §1 step 6.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_1_key_header_skew_runs_nothing_without_the_replicas_header_and_replays_with_it() {
    let Some((sa, sb)) = redis_pair("s33-header-skew").await else {
        return;
    };
    let rig = Rig::new();
    let a = serve(replica!(
        rig,
        "A",
        IdempotencyLayer::new(sa).single_tenant()
    ))
    .await;
    let b = serve(replica!(
        rig,
        "B",
        IdempotencyLayer::new(sb)
            .header_name(HeaderName::from_static("x-request-key"))
            .single_tenant()
    ))
    .await;
    let body = r#"{"amount":11}"#;
    let key = unique("header");
    let first = send(a, &key, body, &[]).await;
    assert_eq!((first.status, rig.effects.count()), (201, 1), "{first:?}");
    let missing = send(b, &key, body, &[]).await;
    assert_eq!(
        (missing.status, missing.slug().as_str(), rig.effects.count()),
        (400, "key-missing", 1),
        "{missing:?}"
    );
    let both = send(b, &key, body, &[("x-request-key", key.as_str())]).await;
    assert!(
        both.replayed && both.body == first.body && rig.effects.count() == 1,
        "B finds A's record under the same key: {both:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// 12. A 422 caused by the replicas' settings, not by the client
// ---------------------------------------------------------------------------------------------

/// Attacks: replica A fingerprints the request header `x-api-version`, replica B (a deploy that
/// dropped the setting) does not, on one PostgreSQL table. Since today's fix the header's name
/// counts, so B computes another fingerprint for a byte-identical retry and refuses it 422:
/// no second run there, as it should be. But the refusal must still tell the truth: it says
/// `safe_new_key: true` ("the key was used for a different request; use a new key"), while the
/// request is the very one that ran; a client that follows it sends the same operation under
/// a new key, and the load balancer hands it to A: a second run. Checks DESIGN §1 (problem
/// details: `safe_new_key`) and §1 step 6 (a mismatch is a *different* request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_6_a_mismatch_made_by_settings_skew_does_not_advise_a_new_key() {
    let Some((sa, sb)) = pg_pair("mismatch").await else {
        return;
    };
    let rig = Rig::new();
    let a = serve(replica!(
        rig,
        "A",
        IdempotencyLayer::new(sa)
            .fingerprint_header(HeaderName::from_static("x-api-version"))
            .single_tenant()
    ))
    .await;
    let b = serve(replica!(
        rig,
        "B",
        IdempotencyLayer::new(sb).single_tenant()
    ))
    .await;
    let body = r#"{"amount":12}"#;
    let version = [("x-api-version", "1")];
    let key = unique("skewed-mismatch");
    let first = send(a, &key, body, &version).await;
    assert_eq!((first.status, rig.effects.count()), (201, 1), "{first:?}");
    let retry = send(b, &key, body, &version).await;
    assert_eq!(rig.effects.count(), 1, "B runs nothing: {retry:?}");
    assert_eq!(
        (retry.status, retry.slug().as_str()),
        (422, "fingerprint-mismatch"),
        "{retry:?}"
    );
    let followed = if retry.safe_new_key() == Some(true) {
        let answer = send(a, &unique("followed-422"), body, &version).await;
        Some((answer.status, answer.replayed, answer.body))
    } else {
        None
    };
    assert_ne!(
        retry.safe_new_key(),
        Some(true),
        "replica B's 422 for a byte-identical retry (its fingerprint settings differ from A's) \
         says safe_new_key: true; following it ran the operation a second time (effects now \
         {}, answer {followed:?})",
        rig.effects.count()
    );
}
