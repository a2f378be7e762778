//! Adversarial review of the Redis store and of coalescing (`wait_for_in_flight`), over real
//! Redis (127.0.0.1:6379, a prefix of its own per test) and real HTTP on 127.0.0.1:0.
//!
//! A RESP-aware TCP proxy sits between a store and Redis where a test needs it: it can forward
//! one chosen script call (by its SHA) and then drop the connection before the reply comes
//! back (the write landed, the caller never heard), or cut a whole node off (a partition).
//! Two layer instances ("nodes") share one Redis where a test says so. Effects are counted in
//! the handler.

use crate::common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::RawQuery;
use axum::http::StatusCode;
use axum::routing::post;
use bytes::Bytes;
use common::Effects;
use common::resp::RespProxy;
use tokio::sync::Barrier;
use tower_idempotency::store::{
    Claim, ClaimRequest, FencingToken, Fingerprint, LeaseExpiry, Milestone, RecordStatus,
    RedisStore, ScopedKey, StoreError, StoredResponse,
};
use tower_idempotency::{
    CachePolicy, IdempotencyContext, IdempotencyLayer, IdempotencyStore, MakeScope, MemoryStore,
    MissingScope,
};

// ==== helpers ===================================================================================

fn unique(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{name}-{nanos}")
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A prefix of its own and a store on it through `url`, or `None` when Redis is unreachable.
async fn redis_pair(name: &str) -> Option<(String, RedisStore)> {
    let store = common::redis(name).await?;
    let prefix = common::redis_prefix(name);
    let store = store.with_prefix(&prefix).expect("prefix");
    Some((prefix, store))
}

/// Another store (its own connection, its own subscription: another node) on `prefix`.
async fn node(url: &str, prefix: &str) -> RedisStore {
    RedisStore::connect(url)
        .await
        .expect("connect")
        .with_prefix(prefix)
        .expect("prefix")
}

fn fp(byte: u8) -> Fingerprint {
    Fingerprint::from_bytes([byte; 32])
}

fn claim_req(key: &ScopedKey, lease: Duration, expiry: LeaseExpiry) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        fingerprint: fp(7),
        lease,
        ttl: Duration::from_secs(60),
        on_lease_expiry: expiry,
    }
}

fn stored(body: &str) -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: http::HeaderMap::new(),
        body: Some(Bytes::copy_from_slice(body.as_bytes())),
        trailers: None,
    }
}

async fn acquire<S: IdempotencyStore>(store: &S, req: &ClaimRequest) -> FencingToken {
    match store.claim(req).await.expect("claim") {
        Claim::Acquired(lease) => lease.token,
        other => panic!("expected to acquire, got {other:?}"),
    }
}

// ---- an app -----------------------------------------------------------------------------------

/// How the handler behaves, shared by every node of a test: run 1 (counted across nodes) and
/// the runs after it may differ.
#[derive(Clone)]
struct Plan {
    runs: Effects,
    effects: Effects,
    first_ms: u64,
    later_ms: u64,
    first_status: u16,
    later_status: u16,
    /// Marks the effect started before working.
    milestone_first: bool,
    /// Marks the effect started after working, and does nothing (503) if refused.
    milestone_after: bool,
    first_panics: bool,
    body_len: usize,
    /// What the milestones answered, in order.
    milestones: Arc<Mutex<Vec<String>>>,
}

impl Plan {
    fn new(first_ms: u64) -> Self {
        Self {
            runs: Effects::default(),
            effects: Effects::default(),
            first_ms,
            later_ms: 50,
            first_status: 201,
            later_status: 201,
            milestone_first: false,
            milestone_after: false,
            first_panics: false,
            body_len: 0,
            milestones: Arc::default(),
        }
    }
}

#[derive(Clone)]
struct Knobs {
    lease: Duration,
    wait: Option<Duration>,
    policy: Option<CachePolicy>,
    response_limit: Option<usize>,
    external: bool,
    ttl: Option<Duration>,
}

impl Default for Knobs {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(10),
            wait: Some(Duration::from_secs(20)),
            policy: None,
            response_limit: None,
            external: false,
            ttl: None,
        }
    }
}

async fn handle(node: &'static str, plan: Plan, ctx: IdempotencyContext) -> (StatusCode, String) {
    let run = plan.runs.hit();
    let first = run == 1;
    if plan.milestone_first {
        let r = ctx.effect_started().await;
        plan.milestones
            .lock()
            .expect("lock")
            .push(format!("{node}:{run}:{r:?}"));
        if r.is_err() {
            return (StatusCode::SERVICE_UNAVAILABLE, "no milestone".into());
        }
    }
    tokio::time::sleep(ms(if first { plan.first_ms } else { plan.later_ms })).await;
    if first && plan.first_panics {
        panic!("the first run fails");
    }
    if plan.milestone_after {
        let r = ctx.effect_started().await;
        plan.milestones
            .lock()
            .expect("lock")
            .push(format!("{node}:{run}:{r:?}"));
        if r.is_err() {
            return (StatusCode::SERVICE_UNAVAILABLE, "no milestone".into());
        }
    }
    let n = plan.effects.hit();
    let status = if first {
        plan.first_status
    } else {
        plan.later_status
    };
    let mut body = format!("{node} run {run} effect {n} attempt {};", ctx.attempt());
    while body.len() < plan.body_len {
        body.push_str("0123456789abcdef");
    }
    body.truncate(plan.body_len.max(body.find(';').map_or(0, |i| i + 1)));
    (StatusCode::from_u16(status).expect("status"), body)
}

fn app<St: IdempotencyStore>(store: St, node: &'static str, plan: &Plan, knobs: &Knobs) -> Router {
    let plan = plan.clone();
    let mut layer = IdempotencyLayer::new(store)
        .single_tenant()
        .lease(knobs.lease)
        .external_effects(knobs.external);
    if let Some(wait) = knobs.wait {
        layer = layer.wait_for_in_flight(wait);
    }
    if let Some(policy) = &knobs.policy {
        layer = layer.cache_policy(policy.clone());
    }
    if let Some(limit) = knobs.response_limit {
        layer = layer.response_limit(limit);
    }
    if let Some(ttl) = knobs.ttl {
        layer = layer.ttl(ttl);
    }
    Router::new()
        .route(
            "/pay",
            post(move |ctx: IdempotencyContext, _q: RawQuery| {
                let plan = plan.clone();
                async move { handle(node, plan, ctx).await }
            }),
        )
        .layer(layer)
}

#[derive(Debug, Clone)]
struct Answer {
    status: u16,
    replayed: bool,
    body: String,
    problem: Option<String>,
    safe_new_key: Option<bool>,
}

impl Answer {
    fn live(&self) -> bool {
        !self.replayed && self.problem.is_none()
    }
}

async fn read(res: reqwest::Response) -> Answer {
    let status = res.status().as_u16();
    let replayed = res
        .headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let is_problem = res
        .headers()
        .get("content-type")
        .is_some_and(|v| v == "application/problem+json");
    let body = res.text().await.unwrap_or_default();
    let (problem, safe_new_key) = if is_problem {
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        (
            v["type"].as_str().map(|t| {
                t.trim_start_matches("urn:tower-idempotency:problem:")
                    .to_owned()
            }),
            v["safe_new_key"].as_bool(),
        )
    } else {
        (None, None)
    };
    Answer {
        status,
        replayed,
        body,
        problem,
        safe_new_key,
    }
}

async fn send_body(addr: SocketAddr, key: &str, body: &str) -> Answer {
    let res = common::client()
        .post(format!("http://{addr}/pay"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .expect("request");
    read(res).await
}

async fn send(addr: SocketAddr, key: &str) -> Answer {
    send_body(addr, key, r#"{"amount":10}"#).await
}

/// `n` requests with one key, spread over `addrs`, released together.
async fn burst(addrs: &[SocketAddr], key: &str, n: usize) -> Vec<Answer> {
    let barrier = Arc::new(Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let (addr, key, barrier) = (addrs[i % addrs.len()], key.to_owned(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                send(addr, &key).await
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("task"));
    }
    out
}

fn summary(answers: &[Answer]) -> String {
    answers
        .iter()
        .map(|a| {
            format!(
                "{}{}{}",
                a.status,
                if a.replayed { "R" } else { "" },
                a.problem
                    .as_deref()
                    .map(|p| format!("({p})"))
                    .unwrap_or_default()
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Warms Redis's script cache (it is server-wide) so that the first EVALSHA of a store through
/// the proxy is the script call itself, not a NOSCRIPT round.
async fn warm(store: &RedisStore) {
    let key = ScopedKey::new("", unique("warm"));
    let token = acquire(store, &claim_req(&key, ms(60_000), LeaseExpiry::Reclaim)).await;
    store
        .complete(&key, token, &stored("warm"), ms(1000))
        .await
        .expect("warm complete");
}

async fn started(plan: &Plan, n: usize) {
    common::until("the handler started", || plan.runs.count() >= n).await;
}

// ==== 1. Store level: fencing at the lease's end ================================================

#[derive(Debug, Clone, Copy)]
enum Op {
    Renew,
    Complete,
    Milestone,
    MarkUncertain,
}

/// DESIGN §1 step 8 / §4 / §5 (one atomic script per operation, fenced): a late holder's write
/// racing another node's takeover claim exactly at the lease's end. Whatever the interleaving,
/// the two cannot both win: either the holder's write lands (and the claim finds the key held,
/// completed or uncertain) or the claim takes over (and the write is fenced out). 4 writes x 25
/// offsets around the lease end, the two on separate connections, released by a barrier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_holders_write_and_a_takeover_at_the_lease_end_never_both_win() {
    let Some((prefix, a)) = redis_pair("xor").await else {
        return;
    };
    let b = node(&common::redis_url(), &prefix).await;
    let mut both = Vec::new();
    let mut neither = Vec::new();
    let (mut wins, mut takeovers) = (0, 0);
    for op in [Op::Renew, Op::Complete, Op::Milestone, Op::MarkUncertain] {
        for round in 0..25u64 {
            let key = ScopedKey::new("", unique(&format!("xor-{op:?}-{round}")));
            let lease = ms(40);
            let token = acquire(&a, &claim_req(&key, lease, LeaseExpiry::Reclaim)).await;
            tokio::time::sleep(ms(30 + round)).await;
            let barrier = Arc::new(Barrier::new(2));
            let write = {
                let (a, key, barrier) = (a.clone(), key.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    match op {
                        Op::Renew => a.renew(&key, token, ms(40)).await.map(drop),
                        Op::Complete => a.complete(&key, token, &stored("A"), ms(60_000)).await,
                        Op::Milestone => {
                            a.record_milestone(&key, token, &Milestone::EffectStarted)
                                .await
                        }
                        Op::MarkUncertain => a.mark_uncertain(&key, token).await,
                    }
                })
            };
            let take = {
                let (b, key, barrier) = (b.clone(), key.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    b.claim(&claim_req(&key, ms(60_000), LeaseExpiry::Reclaim))
                        .await
                })
            };
            let write = write.await.expect("task");
            let take = take.await.expect("task").expect("claim answered");
            let took = matches!(take, Claim::Acquired(_));
            match (&write, took) {
                (Ok(()), true) => both.push(format!("{op:?}@{round}: {take:?}")),
                (Err(StoreError::Fenced), false) => {
                    neither.push(format!("{op:?}@{round}: {take:?}"));
                }
                (Ok(()), false) => wins += 1,
                (Err(StoreError::Fenced), true) => takeovers += 1,
                (Err(e), _) => panic!("{op:?}@{round}: the write failed: {e}"),
            }
            // The record agrees with whoever won.
            let record = a.lookup(&key).await.expect("lookup").expect("a record");
            if took {
                assert_ne!(record.lease_token, token, "{op:?}@{round}: {record:?}");
            } else {
                assert_eq!(record.lease_token, token, "{op:?}@{round}: {record:?}");
            }
        }
    }
    assert!(
        both.is_empty() && neither.is_empty(),
        "both won: {both:?}; neither won: {neither:?} (holder wins {wins}, takeovers {takeovers})"
    );
}

/// DESIGN §1 step 5 / §4 / §7.3: a dead holder's lapsed lease, claimed at once by 12 nodes
/// (12 connections, a barrier): exactly one takes it over (attempt 2, a new token), every
/// other is told the winner holds it; the dead holder stays fenced out. Five rounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_lapsed_lease_claimed_by_many_nodes_has_one_taker() {
    let Some((prefix, dead)) = redis_pair("takers").await else {
        return;
    };
    let mut nodes = Vec::new();
    for _ in 0..12 {
        nodes.push(node(&common::redis_url(), &prefix).await);
    }
    for round in 0..5 {
        let key = ScopedKey::new("", unique(&format!("takers-{round}")));
        let old = acquire(&dead, &claim_req(&key, ms(50), LeaseExpiry::Reclaim)).await;
        tokio::time::sleep(ms(120)).await;
        let barrier = Arc::new(Barrier::new(nodes.len()));
        let tasks: Vec<_> = nodes
            .iter()
            .map(|n| {
                let (n, key, barrier) = (n.clone(), key.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    n.claim(&claim_req(&key, ms(60_000), LeaseExpiry::Reclaim))
                        .await
                        .expect("claim")
                })
            })
            .collect();
        let mut winners = Vec::new();
        let mut seen = Vec::new();
        for t in tasks {
            match t.await.expect("task") {
                Claim::Acquired(lease) => winners.push(lease),
                Claim::Existing { record, .. } => {
                    seen.push((record.status, record.lease_token, record.attempts));
                }
                other => panic!("round {round}: {other:?}"),
            }
        }
        assert_eq!(winners.len(), 1, "round {round}: winners {winners:?}");
        let winner = winners[0];
        assert_eq!(winner.attempt, 2, "round {round}");
        assert_ne!(winner.token, old);
        for s in &seen {
            assert_eq!(
                *s,
                (RecordStatus::InProgress, winner.token, 2),
                "round {round}: a loser saw something else than the winner's hold"
            );
        }
        assert!(matches!(
            dead.complete(&key, old, &stored("dead"), ms(60_000)).await,
            Err(StoreError::Fenced)
        ));
        assert!(matches!(
            dead.renew(&key, old, ms(60_000)).await,
            Err(StoreError::Fenced)
        ));
    }
}

/// DESIGN §5 / §1 step 8: a record lost from Redis mid-lease (a key deleted, as an eviction or a
/// restart without persistence loses it). The holder's renewals must not resurrect it, and
/// once another claim has the key, the old holder's renew, milestone, release and complete
/// are all fenced: its late write never replaces the new holder's outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_a_record_lost_mid_lease_is_not_resurrected_nor_overwritten_by_its_old_holder() {
    let Some((_prefix, store)) = redis_pair("lost").await else {
        return;
    };
    let key = ScopedKey::new("", unique("lost"));
    let old = acquire(&store, &claim_req(&key, ms(60_000), LeaseExpiry::Reclaim)).await;
    let mut raw = redis::Client::open(common::redis_url())
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("raw");
    let record_key = store.keys(&key)[0].clone();
    let deleted: i64 = redis::cmd("DEL")
        .arg(&record_key)
        .query_async(&mut raw)
        .await
        .expect("DEL");
    assert_eq!(deleted, 1);
    let renewed = store.renew(&key, old, ms(60_000)).await;
    assert!(matches!(renewed, Err(StoreError::Fenced)), "{renewed:?}");
    assert!(
        store.lookup(&key).await.expect("lookup").is_none(),
        "a renewal resurrected the lost record"
    );
    let new = acquire(&store, &claim_req(&key, ms(60_000), LeaseExpiry::Reclaim)).await;
    assert!(matches!(
        store
            .record_milestone(&key, old, &Milestone::EffectStarted)
            .await,
        Err(StoreError::Fenced)
    ));
    assert!(matches!(
        store.release(&key, old).await,
        Err(StoreError::Fenced)
    ));
    assert!(matches!(
        store.mark_uncertain(&key, old).await,
        Err(StoreError::Fenced)
    ));
    assert!(matches!(
        store.complete(&key, old, &stored("old"), ms(60_000)).await,
        Err(StoreError::Fenced)
    ));
    store
        .complete(&key, new, &stored("new"), ms(60_000))
        .await
        .expect("the new holder records");
    assert!(matches!(
        store.complete(&key, old, &stored("old"), ms(60_000)).await,
        Err(StoreError::Fenced)
    ));
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(record.status, RecordStatus::Completed);
    assert_eq!(record.response, Some(stored("new")));
    assert!(!record.effect_started, "the old holder's milestone leaked");
}

/// DESIGN §2 / §3 / §5: a stored response near the size the layer allows (4 MiB of binary body,
/// repeated and opaque header values, trailers) round-trips through Redis exactly: read back by
/// a claim on another connection, and by a lookup.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_a_large_binary_response_round_trips_exactly_through_redis() {
    let Some((prefix, a)) = redis_pair("big").await else {
        return;
    };
    let b = node(&common::redis_url(), &prefix).await;
    let key = ScopedKey::new("", unique("big"));
    let token = acquire(&a, &claim_req(&key, ms(60_000), LeaseExpiry::Reclaim)).await;
    let body: Vec<u8> = (0..4 * 1024 * 1024 - 100)
        .map(|i| (i * 7 % 256) as u8)
        .collect();
    let mut headers = http::HeaderMap::new();
    headers.append("link", http::HeaderValue::from_static("</a>"));
    headers.append("link", http::HeaderValue::from_static("</b>"));
    headers.append(
        "x-bin",
        http::HeaderValue::from_bytes(b"\x80\xff\t").expect("an opaque value"),
    );
    headers.append("x-lua", http::HeaderValue::from_static("'; return 1 --"));
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    let response = StoredResponse {
        status: StatusCode::ACCEPTED,
        headers,
        body: Some(Bytes::from(body)),
        trailers: Some(trailers),
    };
    a.complete(&key, token, &response, ms(60_000))
        .await
        .expect("complete");
    let mut again = claim_req(&key, ms(60_000), LeaseExpiry::Reclaim);
    again.fingerprint = fp(7);
    match b.claim(&again).await.expect("claim") {
        Claim::Completed {
            fingerprint,
            response: got,
        } => {
            assert_eq!(fingerprint, fp(7));
            assert_eq!(*got, response);
        }
        other => panic!("{other:?}"),
    }
    let record = b.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(record.response, Some(response));
}

/// DESIGN §1 step 2 / §5 ("a record never spans slots"; keys binary-safe): scopes and keys
/// holding Redis-special bytes (hash-tag braces, CRLF, RESP markers, NUL, non-ASCII, a colon
/// that could shift the length prefix, 255 bytes) never share a record: each pair claims on
/// its own and reads back its own scope and key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_scopes_and_keys_with_redis_special_bytes_never_share_a_record() {
    let Some((_prefix, store)) = redis_pair("odd").await else {
        return;
    };
    let tag = unique("odd");
    let long = "k".repeat(255);
    let pairs: Vec<(String, String)> = vec![
        ("ab".into(), "c".into()),
        ("a".into(), "bc".into()),
        ("".into(), "abc".into()),
        ("1:a".into(), "b".into()),
        ("1".into(), ":ab".into()),
        ("{x}".into(), "y".into()),
        ("{x".into(), "}y".into()),
        ("s\r\n*3\r\n$4".into(), "k".into()),
        ("s".into(), "\r\n*3\r\n$4k".into()),
        ("\0".into(), "k".into()),
        ("".into(), "\0k".into()),
        ("ü".into(), "k".into()),
        ("".into(), long.clone()),
        (long.clone(), "".into()),
    ];
    let mut tokens = Vec::new();
    for (scope, key) in &pairs {
        let k = ScopedKey::new(format!("{tag}{scope}"), key.clone());
        let token = acquire(&store, &claim_req(&k, ms(60_000), LeaseExpiry::Reclaim)).await;
        tokens.push((k, token));
    }
    for (i, (k, token)) in tokens.iter().enumerate() {
        store
            .complete(k, *token, &stored(&format!("answer {i}")), ms(60_000))
            .await
            .unwrap_or_else(|e| panic!("pair {i}: {e}"));
    }
    for (i, (k, _)) in tokens.iter().enumerate() {
        let record = store.lookup(k).await.expect("lookup").expect("record");
        assert_eq!(record.key, *k, "pair {i}");
        assert_eq!(
            record.response,
            Some(stored(&format!("answer {i}"))),
            "pair {i}"
        );
    }
}

// ==== 2. Lost replies: the write landed, the store never heard ==================================

/// DESIGN §1 step 6 and §7.10 (recovery): the claim script runs on Redis but its reply is lost
/// (the connection drops first). The store asks again with the same token and recognises the
/// claim that landed as its own: the request runs once, as attempt 1 (not a takeover of a
/// phantom), and the next retry replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_a_claim_whose_reply_is_lost_fails_closed_then_runs_once() {
    let Some((prefix, direct)) = redis_pair("lost-claim").await else {
        return;
    };
    warm(&direct).await;
    let proxy = RespProxy::start().await;
    let store = node(&proxy.url(), &prefix).await;
    let plan = Plan::new(50);
    let knobs = Knobs {
        lease: ms(300),
        ..Knobs::default()
    };
    let addr = common::serve(app(store.clone(), "A", &plan, &knobs)).await;
    let key = unique("lost-claim");
    proxy.arm(store.claim_script(), 0);
    let first = send(addr, &key).await;
    assert_eq!(proxy.fired(), 1, "the claim's reply was cut");
    assert!(first.live() && first.status == 201, "{first:?}");
    assert!(first.body.contains("attempt 1;"), "{first:?}");
    assert_eq!(plan.runs.count(), 1);
    let second = first.clone();
    let third = send(addr, &key).await;
    assert!(
        third.replayed && third.body == second.body,
        "{third:?} vs {second:?}"
    );
    assert_eq!(plan.effects.count(), 1);
}

/// DESIGN §1.6 and §5: a claim whose reply is lost twice (it landed, and so did its asking
/// again with the same token) is refused, and what landed is given back at once: released,
/// not held in flight for its lease (a minute here) by a claim nobody heard and then, on a
/// route that reconciles, set aside as "outcome unknown" though nothing ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_a_claim_unheard_twice_is_refused_and_given_back() {
    let Some((prefix, direct)) = redis_pair("unheard-twice").await else {
        return;
    };
    warm(&direct).await;
    let proxy = RespProxy::start().await;
    let store = node(&proxy.url(), &prefix).await;
    let key = ScopedKey::new("", unique("unheard-twice"));
    proxy.arm_times(store.claim_script(), 0, 2);
    let claimed = store
        .claim(&claim_req(&key, ms(60_000), LeaseExpiry::Reconcile))
        .await;
    assert!(
        matches!(claimed, Err(StoreError::Unavailable(_))),
        "{claimed:?}"
    );
    assert_eq!(proxy.fired(), 2, "both replies were lost");
    let mut record = None;
    for _ in 0..100 {
        record = direct.lookup(&key).await.expect("lookup");
        if record
            .as_ref()
            .is_some_and(|r| r.status != RecordStatus::InProgress)
        {
            break;
        }
        tokio::time::sleep(ms(50)).await;
    }
    let record = record.expect("the claim landed");
    assert_eq!(
        (record.status, record.attempts),
        (RecordStatus::Released, 1),
        "what landed is given back"
    );
    match direct
        .claim(&claim_req(&key, ms(60_000), LeaseExpiry::Reconcile))
        .await
    {
        Ok(Claim::Acquired(lease)) => assert_eq!(lease.attempt, 2),
        other => panic!("the retry: {other:?}"),
    }
}

/// DESIGN §1.6 and §5: a claim that timed out on its way and reaches Redis only after it was
/// asked again, run and released under its token (a stalled link, then a new one) takes
/// nothing: the key stays released for the retry, not in flight for nobody. The late call is
/// the store's own claim script, run with the token it gave out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_a_claim_reaching_redis_after_its_own_end_takes_nothing() {
    let Some((_, store)) = redis_pair("late-own").await else {
        return;
    };
    let mut raw = redis::Client::open(common::redis_url())
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    for released in [true, false] {
        let key = ScopedKey::new("", unique("late-own"));
        let req = claim_req(&key, ms(60_000), LeaseExpiry::Reconcile);
        let token = acquire(&store, &req).await;
        if released {
            store.release(&key, token).await.expect("release");
        } else {
            store
                .complete(&key, token, &stored("done"), ms(60_000))
                .await
                .expect("complete");
        }
        let before = store.lookup(&key).await.expect("lookup").expect("record");
        let [record, uncertain, pending, member] = store.keys(&key);
        let _: redis::Value = redis::Script::new(store.claim_script())
            .key(record)
            .key(uncertain)
            .key(pending)
            .arg(member)
            .arg(req.fingerprint.as_bytes().as_slice())
            .arg(token.get().to_string())
            .arg("60000")
            .arg("60000")
            .arg("0")
            .arg(key.scope())
            .arg(key.key())
            .invoke_async(&mut raw)
            .await
            .expect("the late claim runs");
        let after = store.lookup(&key).await.expect("lookup").expect("record");
        assert_eq!(
            (after.status, after.attempts, after.lease_token),
            (before.status, before.attempts, before.lease_token),
            "released {released}: the late claim changed the record"
        );
    }
}

/// DESIGN §1 step 6 + §4, on a route with external effects (`external_effects(true)`): the
/// claim's reply is lost, so the client is told 503 "the request was not run; retry with the
/// same key". Nothing ran, so the same key must eventually run (or at worst keep answering
/// in-flight/503): it must never be parked as "outcome unknown" awaiting reconciliation of an
/// attempt that never executed. The store asks again with the same token, so the request runs
/// once and its retries replay it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_lost_claim_reply_on_an_external_effects_route_is_not_outcome_unknown() {
    let Some((prefix, direct)) = redis_pair("lost-claim-ext").await else {
        return;
    };
    warm(&direct).await;
    let proxy = RespProxy::start().await;
    let store = node(&proxy.url(), &prefix).await;
    let plan = Plan::new(50);
    let knobs = Knobs {
        lease: ms(300),
        wait: None,
        external: true,
        ..Knobs::default()
    };
    let addr = common::serve(app(store.clone(), "A", &plan, &knobs)).await;
    let key = unique("lost-claim-ext");
    proxy.arm(store.claim_script(), 0);
    let first = send(addr, &key).await;
    assert_eq!(proxy.fired(), 1);
    // The claim asked again with its token is its own: it runs, not parked as uncertain.
    assert!(first.live() && first.status == 201, "{first:?}");
    // Past the claim's lease: a retry replays it.
    tokio::time::sleep(ms(700)).await;
    let mut answers = vec![first.clone()];
    for _ in 0..5 {
        let a = send(addr, &key).await;
        let done = a.status == 201;
        answers.push(a);
        if done {
            break;
        }
        tokio::time::sleep(ms(200)).await;
    }
    assert_eq!(
        plan.runs.count(),
        answers.iter().filter(|a| a.live()).count()
    );
    assert_eq!(plan.runs.count(), 1);
    assert!(
        answers.last().is_some_and(|a| a.replayed),
        "{}",
        summary(&answers)
    );
    assert!(
        answers
            .iter()
            .all(|a| a.problem.as_deref() != Some("outcome-unknown")),
        "after a 503 that said nothing ran (first: {:?}), retries of the same key are told \
         outcome unknown: {}",
        first,
        summary(&answers)
    );
}

/// DESIGN §1 steps 8-9, §4 ("retrying the write") and §7.1, across two nodes: the holder's
/// `complete` lands on Redis but its reply is lost. The holder's client still gets its answer,
/// the waiters on the other node replay it, the record ends completed (not parked as outcome
/// unknown), and the handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_complete_whose_reply_is_lost_is_recorded_and_replayed_across_nodes() {
    let Some((prefix, direct)) = redis_pair("lost-complete").await else {
        return;
    };
    warm(&direct).await;
    let proxy = RespProxy::start().await;
    let a_store = node(&proxy.url(), &prefix).await;
    let plan = Plan::new(600);
    let knobs = Knobs::default();
    let a = common::serve(app(a_store.clone(), "A", &plan, &knobs)).await;
    let b = common::serve(app(direct.clone(), "B", &plan, &knobs)).await;
    let key = unique("lost-complete");
    proxy.arm(a_store.complete_script(), 0);
    let first = tokio::spawn({
        let key = key.clone();
        async move { send(a, &key).await }
    });
    started(&plan, 1).await;
    let waiters = burst(&[b], &key, 10).await;
    let first = first.await.expect("first");
    assert_eq!(proxy.fired(), 1, "the completion's reply was cut");
    assert!(first.live() && first.status == 201, "{first:?}");
    for w in &waiters {
        assert!(
            w.replayed && w.body == first.body,
            "waiter: {w:?}; all {}",
            summary(&waiters)
        );
    }
    let record = direct
        .lookup(&ScopedKey::new("", key.clone()))
        .await
        .expect("lookup")
        .expect("record");
    assert_eq!(record.status, RecordStatus::Completed, "{record:?}");
    let again = send(a, &key).await;
    assert!(again.replayed && again.body == first.body, "{again:?}");
    assert_eq!(plan.effects.count(), 1);
}

// ==== 3. Partitions and lapsed leases under waiters =============================================

/// DESIGN §1 step 8 ("a worker whose lease was taken over can no longer write") and §4, over
/// two nodes: node A's link to Redis is cut while its handler runs, so its lease lapses; a
/// waiter on node B takes the key over (no milestone yet, Reclaim) and records its answer.
/// When A's link returns, A's late milestone is refused, its late writes are fenced, and
/// every replay on either node is B's answer. The effect happened once (B's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_partitioned_holder_is_fenced_out_after_a_waiter_takes_over() {
    let Some((prefix, direct)) = redis_pair("partition").await else {
        return;
    };
    let proxy = RespProxy::start().await;
    let a_store = node(&proxy.url(), &prefix).await;
    let mut plan = Plan::new(1_500);
    plan.milestone_after = true;
    let knobs = Knobs {
        lease: ms(300),
        ..Knobs::default()
    };
    let a = common::serve(app(a_store, "A", &plan, &knobs)).await;
    let b = common::serve(app(direct.clone(), "B", &plan, &knobs)).await;
    let key = unique("partition");
    let first = tokio::spawn({
        let key = key.clone();
        async move { send(a, &key).await }
    });
    started(&plan, 1).await;
    proxy.cut();
    let waiter = send(b, &key).await;
    assert!(
        waiter.live() && waiter.status == 201 && waiter.body.starts_with("B "),
        "the waiter took over: {waiter:?}"
    );
    proxy.restore();
    let first = first.await.expect("first");
    let milestones = plan.milestones.lock().expect("lock").clone();
    assert!(
        milestones
            .iter()
            .any(|m| m.starts_with("A:1:") && m.contains("Fenced")),
        "A's late milestone must be fenced: {milestones:?}; A answered {first:?}"
    );
    // Give A's background writes (release / recorder) time to try, then check nothing moved.
    tokio::time::sleep(ms(1_500)).await;
    for addr in [a, b] {
        let replay = send(addr, &key).await;
        assert!(
            replay.replayed && replay.body == waiter.body,
            "replay {replay:?} is not B's answer {waiter:?}"
        );
    }
    assert_eq!(plan.effects.count(), 1, "milestones {milestones:?}");
}

/// DESIGN §4 (a lease runs out after `effect_started` -> needs_reconciliation; the holder that
/// ran settles it with its outcome) and §1 step 6, over two nodes: A marks its effect started,
/// then its link to Redis is cut until well past its lease. B's waiter must be told "outcome
/// unknown" (never run it); once A's link returns, A's recorded outcome is what every replay
/// gets. The effect happened once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_partitioned_holder_past_its_milestone_is_never_run_again_and_settles_it() {
    let Some((prefix, direct)) = redis_pair("partition-es").await else {
        return;
    };
    let proxy = RespProxy::start().await;
    let a_store = node(&proxy.url(), &prefix).await;
    let mut plan = Plan::new(1_200);
    plan.milestone_first = true;
    let knobs = Knobs {
        lease: ms(300),
        ..Knobs::default()
    };
    let a = common::serve(app(a_store, "A", &plan, &knobs)).await;
    let b = common::serve(app(direct.clone(), "B", &plan, &knobs)).await;
    let key = unique("partition-es");
    let first = tokio::spawn({
        let key = key.clone();
        async move { send(a, &key).await }
    });
    common::until("A's milestone", || {
        !plan.milestones.lock().expect("lock").is_empty()
    })
    .await;
    proxy.cut();
    let waiter = send(b, &key).await;
    assert_eq!(
        (
            waiter.status,
            waiter.problem.as_deref(),
            waiter.safe_new_key
        ),
        (409, Some("outcome-unknown"), Some(false)),
        "{waiter:?}"
    );
    proxy.restore();
    let first = first.await.expect("first");
    assert!(first.live() && first.status == 201, "{first:?}");
    let scoped = ScopedKey::new("", key.clone());
    let mut settled = false;
    for _ in 0..100 {
        if let Some(r) = direct.lookup(&scoped).await.expect("lookup")
            && r.status == RecordStatus::Completed
        {
            settled = true;
            break;
        }
        tokio::time::sleep(ms(50)).await;
    }
    assert!(settled, "A's outcome was never recorded");
    for addr in [a, b] {
        let replay = send(addr, &key).await;
        assert!(replay.replayed && replay.body == first.body, "{replay:?}");
    }
    assert_eq!(plan.effects.count(), 1);
}

/// DESIGN §4 ("the holder keeps its lease for as long as its process lives") with waiters on
/// another node: a 100 ms lease and a handler that runs 1.5 s. The waiters on node B wake at
/// every lease end and claim again; the holder's renewals through Redis must keep every one of
/// them out: one run, every waiter replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_short_lease_renewed_through_redis_keeps_waiters_on_another_node_out() {
    let Some((prefix, direct)) = redis_pair("short-lease").await else {
        return;
    };
    let b_store = node(&common::redis_url(), &prefix).await;
    let plan = Plan::new(1_500);
    let knobs = Knobs {
        lease: ms(100),
        ..Knobs::default()
    };
    let a = common::serve(app(direct, "A", &plan, &knobs)).await;
    let b = common::serve(app(b_store, "B", &plan, &knobs)).await;
    let key = unique("short-lease");
    let first = tokio::spawn({
        let key = key.clone();
        async move { send(a, &key).await }
    });
    started(&plan, 1).await;
    let waiters = burst(&[b], &key, 10).await;
    let first = first.await.expect("first");
    assert!(first.live(), "{first:?}");
    assert!(
        waiters.iter().all(|w| w.replayed && w.body == first.body),
        "{}",
        summary(&waiters)
    );
    assert_eq!(plan.runs.count(), 1);
}

// ==== 4. Coalescing: how the first ends, what the waiters get ====================================

/// DESIGN §1 step 6 ("a fingerprint mismatch is reported before any in-flight state") on a
/// waiting route over two nodes: while the first runs on A, requests on B with the same key and
/// a different body get 422 at once (the first is still running when they are answered), never
/// the first's answer; same-body waiters replay it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_waiters_with_another_body_get_422_at_once_never_the_first_answer() {
    let Some((prefix, direct)) = redis_pair("mismatch").await else {
        return;
    };
    let b_store = node(&common::redis_url(), &prefix).await;
    let plan = Plan::new(1_500);
    let knobs = Knobs::default();
    let a = common::serve(app(direct, "A", &plan, &knobs)).await;
    let b = common::serve(app(b_store, "B", &plan, &knobs)).await;
    let key = unique("mismatch");
    let first = tokio::spawn({
        let key = key.clone();
        async move { send(a, &key).await }
    });
    started(&plan, 1).await;
    let same = tokio::spawn({
        let key = key.clone();
        async move { send(b, &key).await }
    });
    let mut others = Vec::new();
    for i in 0..5 {
        others.push(send_body(b, &key, &format!(r#"{{"amount":{}}}"#, 11 + i)).await);
    }
    let still_running = !first.is_finished();
    for o in &others {
        assert_eq!(
            (o.status, o.problem.as_deref(), o.replayed),
            (422, Some("fingerprint-mismatch"), false),
            "{o:?}"
        );
    }
    assert!(
        still_running,
        "the mismatches were answered only after the first finished"
    );
    let first = first.await.expect("first");
    let same = same.await.expect("same");
    assert!(same.replayed && same.body == first.body, "{same:?}");
    assert_eq!(plan.runs.count(), 1);
}

/// DESIGN §3 ("a response over the cache size limit is never silently re-executed ... replays
/// get a documented answer") with waiters on another node: the first answers 64 KiB on a route
/// recording 8 KiB. Its client gets the whole body; every waiter is told `response-not-stored`
/// (409), none runs it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_waiters_of_a_too_large_first_answer_get_response_not_stored_never_a_run() {
    let Some((prefix, direct)) = redis_pair("too-large").await else {
        return;
    };
    let b_store = node(&common::redis_url(), &prefix).await;
    let mut plan = Plan::new(800);
    plan.body_len = 64 * 1024;
    let knobs = Knobs {
        response_limit: Some(8 * 1024),
        ..Knobs::default()
    };
    let a = common::serve(app(direct, "A", &plan, &knobs)).await;
    let b = common::serve(app(b_store, "B", &plan, &knobs)).await;
    let key = unique("too-large");
    let first = tokio::spawn({
        let key = key.clone();
        async move { send(a, &key).await }
    });
    started(&plan, 1).await;
    let waiters = burst(&[a, b], &key, 10).await;
    let first = first.await.expect("first");
    assert!(
        first.live() && first.body.len() == 64 * 1024,
        "{}",
        first.status
    );
    for w in &waiters {
        assert_eq!(
            (w.status, w.problem.as_deref()),
            (409, Some("response-not-stored")),
            "all: {}",
            summary(&waiters)
        );
    }
    assert_eq!(plan.runs.count(), 1);
}

/// DESIGN §3 / §5: a response just under the recording limit (3 MiB with its head) is stored in
/// Redis whole and replayed byte for byte to waiters on both nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_waiters_replay_a_response_just_under_the_limit_byte_for_byte() {
    let Some((prefix, direct)) = redis_pair("near-limit").await else {
        return;
    };
    let b_store = node(&common::redis_url(), &prefix).await;
    let mut plan = Plan::new(600);
    plan.body_len = 3 * 1024 * 1024 - 4 * 1024;
    let knobs = Knobs {
        response_limit: Some(3 * 1024 * 1024),
        ..Knobs::default()
    };
    let a = common::serve(app(direct, "A", &plan, &knobs)).await;
    let b = common::serve(app(b_store, "B", &plan, &knobs)).await;
    let key = unique("near-limit");
    let first = tokio::spawn({
        let key = key.clone();
        async move { send(a, &key).await }
    });
    started(&plan, 1).await;
    let waiters = burst(&[a, b], &key, 6).await;
    let first = first.await.expect("first");
    assert!(
        first.live() && first.body.len() == plan.body_len,
        "{}",
        first.status
    );
    for w in &waiters {
        assert!(
            w.replayed && w.status == 201 && w.body == first.body,
            "{} {} {}",
            w.status,
            w.replayed,
            w.body.len()
        );
    }
    assert_eq!(plan.runs.count(), 1);
}

/// DESIGN §4 / §3 with waiters on two nodes: the first marks its effect started and then fails
/// (500). The key goes to `needs_reconciliation`; every waiter, on either node, is told
/// `outcome-unknown` with `safe_new_key: false`, and nothing runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_waiters_of_a_first_that_started_its_effect_and_failed_are_told_outcome_unknown() {
    let Some((prefix, direct)) = redis_pair("nr-waiters").await else {
        return;
    };
    let b_store = node(&common::redis_url(), &prefix).await;
    let mut plan = Plan::new(700);
    plan.milestone_first = true;
    plan.first_status = 500;
    let knobs = Knobs::default();
    let a = common::serve(app(direct, "A", &plan, &knobs)).await;
    let b = common::serve(app(b_store, "B", &plan, &knobs)).await;
    let key = unique("nr-waiters");
    let first = tokio::spawn({
        let key = key.clone();
        async move { send(a, &key).await }
    });
    started(&plan, 1).await;
    let waiters = burst(&[a, b], &key, 12).await;
    let first = first.await.expect("first");
    assert_eq!(first.status, 500, "{first:?}");
    for w in &waiters {
        assert_eq!(
            (w.status, w.problem.as_deref(), w.safe_new_key),
            (409, Some("outcome-unknown"), Some(false)),
            "all: {}",
            summary(&waiters)
        );
    }
    assert_eq!(plan.runs.count(), 1);
}

/// DESIGN §3 (`CachePolicy::Everything`: "the first outcome, whatever it is, is the answer
/// forever") with waiters on two nodes: the first answers 500; every waiter replays that 500,
/// and nothing runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_everything_waiters_replay_the_first_500() {
    let Some((prefix, direct)) = redis_pair("everything-500").await else {
        return;
    };
    let b_store = node(&common::redis_url(), &prefix).await;
    let mut plan = Plan::new(600);
    plan.first_status = 500;
    let knobs = Knobs {
        policy: Some(CachePolicy::Everything),
        ..Knobs::default()
    };
    let a = common::serve(app(direct, "A", &plan, &knobs)).await;
    let b = common::serve(app(b_store, "B", &plan, &knobs)).await;
    let key = unique("everything-500");
    let first = tokio::spawn({
        let key = key.clone();
        async move { send(a, &key).await }
    });
    started(&plan, 1).await;
    let waiters = burst(&[a, b], &key, 10).await;
    let first = first.await.expect("first");
    assert_eq!(first.status, 500);
    for w in &waiters {
        assert!(
            w.replayed && w.status == 500 && w.body == first.body,
            "all: {}",
            summary(&waiters)
        );
    }
    assert_eq!(plan.runs.count(), 1);
}

/// DESIGN §3 ("Panics ... still never cache a fabricated body", under `Everything` too) with
/// waiters on two nodes: the first panics; the key is given back, exactly one waiter runs it,
/// every other waiter replays that run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_everything_a_panicking_first_lets_exactly_one_waiter_run() {
    let Some((prefix, direct)) = redis_pair("everything-panic").await else {
        return;
    };
    let b_store = node(&common::redis_url(), &prefix).await;
    let mut plan = Plan::new(600);
    plan.first_panics = true;
    let knobs = Knobs {
        policy: Some(CachePolicy::Everything),
        ..Knobs::default()
    };
    let a = common::serve(app(direct, "A", &plan, &knobs)).await;
    let b = common::serve(app(b_store, "B", &plan, &knobs)).await;
    let key = unique("everything-panic");
    let first = tokio::spawn({
        let key = key.clone();
        async move { send(a, &key).await }
    });
    started(&plan, 1).await;
    let waiters = burst(&[a, b], &key, 10).await;
    let first = first.await.expect("first");
    assert_eq!(first.status, 500, "{first:?}");
    assert!(!first.replayed);
    let live: Vec<_> = waiters.iter().filter(|w| w.live()).collect();
    assert_eq!(live.len(), 1, "all: {}", summary(&waiters));
    let body = live[0].body.clone();
    for w in &waiters {
        assert!(
            w.status == 201 && w.body == body,
            "all: {}",
            summary(&waiters)
        );
    }
    assert_eq!(plan.runs.count(), 2);
    assert_eq!(plan.effects.count(), 1);
}

/// DESIGN §3 ("inner `Err` ... release the claim") with waiters, over Redis: the inner service
/// fails with an error (no response) after 400 ms; exactly one of the waiting requests runs it
/// again, and every other one replays that run. Driven through the tower service directly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_an_inner_error_gives_the_key_to_exactly_one_waiter() {
    use http_body_util::{BodyExt, Full};
    use tower::{Layer, ServiceExt};
    let Some((_prefix, store)) = redis_pair("inner-err").await else {
        return;
    };
    let runs = Effects::default();
    let inner = {
        let runs = runs.clone();
        tower::service_fn(
            move |_req: http::Request<tower_idempotency::RequestBody<Full<Bytes>>>| {
                let runs = runs.clone();
                async move {
                    let n = runs.hit();
                    tokio::time::sleep(ms(if n == 1 { 400 } else { 50 })).await;
                    if n == 1 {
                        return Err(std::io::Error::other("the first run fails"));
                    }
                    let mut res = http::Response::new(Full::new(Bytes::from(format!("run {n}"))));
                    *res.status_mut() = StatusCode::CREATED;
                    Ok(res)
                }
            },
        )
    };
    let svc = IdempotencyLayer::new(store)
        .single_tenant()
        .wait_for_in_flight(Duration::from_secs(20))
        .layer(inner);
    let key = unique("inner-err");
    let request = || {
        http::Request::post("/pay")
            .header("idempotency-key", key.as_str())
            .body(Full::new(Bytes::from_static(b"pay 10")))
            .expect("request")
    };
    let first = tokio::spawn(svc.clone().oneshot(request()));
    common::until("the first run", || runs.count() >= 1).await;
    let barrier = Arc::new(Barrier::new(8));
    let waiters: Vec<_> = (0..8)
        .map(|_| {
            let (svc, req, barrier) = (svc.clone(), request(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let res = svc.oneshot(req).await.expect("a waiter's answer");
                let replayed = res.headers().contains_key("idempotency-replayed");
                let status = res.status();
                let body = res.into_body().collect().await.expect("body").to_bytes();
                (status, replayed, body)
            })
        })
        .collect();
    let first = first.await.expect("task");
    assert!(first.is_err(), "the first's error reaches its caller");
    let mut answers = Vec::new();
    for w in waiters {
        answers.push(w.await.expect("task"));
    }
    let live: Vec<_> = answers.iter().filter(|a| !a.1).collect();
    assert_eq!(live.len(), 1, "{answers:?}");
    for a in &answers {
        assert_eq!(
            (a.0, &a.2),
            (StatusCode::CREATED, &live[0].2),
            "{answers:?}"
        );
    }
    assert_eq!(runs.count(), 2);
}

/// DESIGN §1 step 7 (a client hanging up never cancels the handler) and the waiting route over
/// two nodes: the first's client on A and 20 waiters on B all hang up mid-wait. The first still
/// completes and records; later retries on both nodes replay it; nothing ran twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_everyone_hangs_up_mid_wait_the_first_still_records_once() {
    let Some((prefix, direct)) = redis_pair("hang-ups").await else {
        return;
    };
    let b_store = node(&common::redis_url(), &prefix).await;
    let plan = Plan::new(1_000);
    let knobs = Knobs::default();
    let a = common::serve(app(direct.clone(), "A", &plan, &knobs)).await;
    let b = common::serve(app(b_store, "B", &plan, &knobs)).await;
    let key = unique("hang-ups");
    let impatient = reqwest::Client::builder()
        .timeout(ms(200))
        .pool_max_idle_per_host(0)
        .build()
        .expect("client");
    let post = |addr: SocketAddr| {
        impatient
            .post(format!("http://{addr}/pay"))
            .header("idempotency-key", &key)
            .header("content-type", "application/json")
            .body(r#"{"amount":10}"#)
            .send()
    };
    assert!(post(a).await.is_err(), "the first's client gave up");
    let gone: Vec<_> = (0..20).map(|_| tokio::spawn(post(b))).collect();
    for g in gone {
        assert!(g.await.expect("task").is_err());
    }
    let scoped = ScopedKey::new("", key.clone());
    let mut done = false;
    for _ in 0..100 {
        if let Some(r) = direct.lookup(&scoped).await.expect("lookup")
            && r.status == RecordStatus::Completed
        {
            done = true;
            break;
        }
        tokio::time::sleep(ms(50)).await;
    }
    assert!(done, "the first's outcome was recorded");
    let (ra, rb) = (send(a, &key).await, send(b, &key).await);
    assert!(
        ra.replayed && rb.replayed && ra.body == rb.body,
        "{ra:?} {rb:?}"
    );
    assert!(ra.body.starts_with("A run 1"), "{ra:?}");
    assert_eq!(plan.runs.count(), 1);
}

/// DESIGN §1 ("Retry-After ... computed with the store's clock") on a route that does not wait:
/// a duplicate of a request holding a 20 s lease gets 409 in-flight with a Retry-After of at
/// least 1 and at most the lease, whose problem says the state is in progress and that a new key
/// is not safe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_an_in_flight_answer_from_redis_carries_a_retry_after_within_the_lease() {
    let Some((_prefix, store)) = redis_pair("retry-after").await else {
        return;
    };
    let plan = Plan::new(1_000);
    let knobs = Knobs {
        lease: Duration::from_secs(20),
        wait: None,
        ..Knobs::default()
    };
    let addr = common::serve(app(store, "A", &plan, &knobs)).await;
    let key = unique("retry-after");
    let first = tokio::spawn({
        let key = key.clone();
        async move { send(addr, &key).await }
    });
    started(&plan, 1).await;
    let res = common::client()
        .post(format!("http://{addr}/pay"))
        .header("idempotency-key", &key)
        .header("content-type", "application/json")
        .body(r#"{"amount":10}"#)
        .send()
        .await
        .expect("request");
    let retry_after: u64 = res
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .expect("a Retry-After in seconds");
    let answer = read(res).await;
    assert_eq!(
        (answer.status, answer.problem.as_deref()),
        (409, Some("in-flight"))
    );
    assert!((1..=20).contains(&retry_after), "Retry-After {retry_after}");
    assert_eq!(answer.safe_new_key, Some(false), "{answer:?}");
    let first = first.await.expect("first");
    assert!(first.live());
}

// ==== 5. Scopes with Redis-special bytes through the layer =======================================

/// A scope made by the app from a header, verbatim, wrapped in bytes Redis and Lua care about.
#[derive(Clone)]
struct RawScope;

impl MakeScope for RawScope {
    fn make_scope(&self, parts: &http::request::Parts) -> Result<String, MissingScope> {
        let v = parts
            .headers
            .get("x-tenant")
            .ok_or_else(|| MissingScope::new("x-tenant"))?;
        Ok(format!(
            "{{{}}}\r\n*\0ü",
            String::from_utf8_lossy(v.as_bytes())
        ))
    }
}

/// DESIGN §1 step 2 ("Two principals using the same key can never see each other's records or
/// responses") over Redis, with scopes holding hash-tag braces, CRLF, NUL and non-ASCII, and
/// keys holding braces, colons and RESP markers (as sf-strings): each (tenant, key) runs once
/// and replays its own answer; the same key under another tenant runs on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_tenants_and_keys_with_redis_special_bytes_stay_apart() {
    let Some((_prefix, store)) = redis_pair("odd-scopes").await else {
        return;
    };
    let runs = Effects::default();
    let app = {
        let runs = runs.clone();
        Router::new()
            .route(
                "/pay",
                post(move |ctx: IdempotencyContext| {
                    let runs = runs.clone();
                    async move {
                        let n = runs.hit();
                        (StatusCode::CREATED, format!("run {n} key {}", ctx.key()))
                    }
                }),
            )
            .layer(IdempotencyLayer::new(store).scope_with(RawScope))
    };
    let addr = common::serve(app).await;
    let tag = unique("t");
    let tenants = [format!("{tag}a"), format!("{tag}a:"), format!("{tag}{{x}}")];
    let keys = [
        "\"{k}\"".to_owned(),
        "\"k}\"".to_owned(),
        "\"1:k\"".to_owned(),
        "\"*3 $4\"".to_owned(),
        format!("\"{}\"", "z".repeat(255)),
    ];
    let call = |tenant: String, key: String| {
        common::client()
            .post(format!("http://{addr}/pay"))
            .header("x-tenant", tenant)
            .header("idempotency-key", key)
            .body("pay")
            .send()
    };
    let mut firsts = Vec::new();
    for t in &tenants {
        for k in &keys {
            let a = read(call(t.clone(), k.clone()).await.expect("request")).await;
            assert!(a.live() && a.status == 201, "{t} {k}: {a:?}");
            firsts.push((t.clone(), k.clone(), a.body));
        }
    }
    assert_eq!(runs.count(), tenants.len() * keys.len());
    for (t, k, body) in &firsts {
        let a = read(call(t.clone(), k.clone()).await.expect("request")).await;
        assert!(a.replayed && &a.body == body, "{t} {k}: {a:?} vs {body}");
    }
    assert_eq!(runs.count(), tenants.len() * keys.len());
}

// ==== 6. TTL edges, the same on every store ======================================================

/// What two sequential requests with one key get on a route with `ttl` and a 5 s lease: whether
/// the second replays.
async fn second_replays<St: IdempotencyStore>(store: St, ttl: Duration) -> bool {
    let plan = Plan::new(20);
    let knobs = Knobs {
        lease: Duration::from_secs(5),
        wait: None,
        ttl: Some(ttl),
        ..Knobs::default()
    };
    let addr = common::serve(app(store, "A", &plan, &knobs)).await;
    let key = unique("ttl");
    let first = send(addr, &key).await;
    assert!(first.live(), "{first:?}");
    let second = send(addr, &key).await;
    assert!(
        second.status == 201 && (second.replayed || second.live()),
        "{second:?}"
    );
    if second.replayed {
        assert_eq!(second.body, first.body);
    }
    second.replayed
}

/// DESIGN §5 ("one trait, one behaviour") and §2 (TTL): a TTL of zero (under a lease far longer
/// than it), and the longest a route takes (100 years, which Redis must represent as a
/// `PEXPIREAT`), give the same answers on MemoryStore, RedisStore and PostgresStore: the
/// longest replays, and the store never fails (no 503).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_ttl_edges_answer_alike_on_memory_redis_and_postgres() {
    let Some((_prefix, redis)) = redis_pair("ttl").await else {
        return;
    };
    let postgres = common::postgres("tower_idempotency_rcr_ttl").await;
    let mut table = Vec::new();
    for ttl in [Duration::ZERO, tower_idempotency::LONGEST] {
        let m = second_replays(MemoryStore::new(), ttl).await;
        let r = second_replays(redis.clone(), ttl).await;
        let p = match &postgres {
            Some(pg) => second_replays(pg.clone(), ttl).await,
            None => m,
        };
        table.push((ttl, m, r, p));
    }
    for (ttl, m, r, p) in &table {
        assert!(
            m == r && r == p,
            "ttl {ttl:?}: memory {m}, redis {r}, postgres {p}"
        );
    }
    assert!(table[1].1, "the longest TTL replays");
}

/// DESIGN §1 step 2 with the waiting route over two nodes: the same key used by another tenant
/// while the first tenant's request runs is a different operation. It must neither wait for
/// the first (it is answered while the first still runs) nor get its answer: it runs on its
/// own, and each tenant's replay is its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_the_same_key_in_another_tenant_never_waits_for_nor_replays_the_first() {
    let Some((prefix, direct)) = redis_pair("tenants-wait").await else {
        return;
    };
    let b_store = node(&common::redis_url(), &prefix).await;
    let runs = Effects::default();
    let make = |store: RedisStore, node: &'static str| {
        let runs = runs.clone();
        Router::new()
            .route(
                "/pay",
                post(move |ctx: IdempotencyContext| {
                    let runs = runs.clone();
                    async move {
                        let n = runs.hit();
                        tokio::time::sleep(ms(if n == 1 { 1_500 } else { 50 })).await;
                        (
                            StatusCode::CREATED,
                            format!("{node} run {n} {}", ctx.scope()),
                        )
                    }
                }),
            )
            .layer(
                IdempotencyLayer::new(store)
                    .scope_with(RawScope)
                    .wait_for_in_flight(Duration::from_secs(20)),
            )
    };
    let a = common::serve(make(direct, "A")).await;
    let b = common::serve(make(b_store, "B")).await;
    let key = unique("shared-key");
    let tag = unique("tenant");
    let call = |addr: SocketAddr, tenant: String| {
        let key = key.clone();
        async move {
            read(
                common::client()
                    .post(format!("http://{addr}/pay"))
                    .header("x-tenant", tenant)
                    .header("idempotency-key", key)
                    .body("pay")
                    .send()
                    .await
                    .expect("request"),
            )
            .await
        }
    };
    let first = tokio::spawn(call(a, format!("{tag}-1")));
    common::until("the first runs", || runs.count() >= 1).await;
    let other = call(b, format!("{tag}-2")).await;
    let still_running = !first.is_finished();
    assert!(other.live() && other.status == 201, "{other:?}");
    assert!(
        still_running,
        "the other tenant waited for the first tenant's request"
    );
    let first = first.await.expect("first");
    assert!(first.live(), "{first:?}");
    assert_ne!(first.body, other.body);
    let again = call(a, format!("{tag}-2")).await;
    assert!(again.replayed && again.body == other.body, "{again:?}");
    let again = call(b, format!("{tag}-1")).await;
    assert!(again.replayed && again.body == first.body, "{again:?}");
    assert_eq!(runs.count(), 2);
}
