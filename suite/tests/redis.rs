//! Issue 21, RedisStore over sockets: axum replicas sharing one Redis (and one Redis Cluster)
//! run a key once under a thousand concurrent requests; a replica killed with SIGKILL inside
//! its handler leaves the key in flight, never free; Redis cut off behind a proxy fails closed
//! and nothing runs twice after it returns. Effects are counted in the handler.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use common::proxy::Proxy;
use common::{Effects, problem, problem_type, serve};
use tokio::sync::Barrier;
use tower_idempotency::store::RedisStore;
use tower_idempotency::{IdempotencyLayer, IdempotencyStore, ScopedKey};

/// A write endpoint that works `ms` milliseconds (from the query) before its effect.
fn app<St: IdempotencyStore>(store: St, effects: Effects) -> Router {
    Router::new()
        .route(
            "/refunds",
            post(move |query: axum::extract::RawQuery| async move {
                let ms = query
                    .0
                    .and_then(|q| q.strip_prefix("ms=").and_then(|v| v.parse().ok()))
                    .unwrap_or(0);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                let n = effects.hit();
                (StatusCode::CREATED, format!("refund {n}"))
            }),
        )
        .layer(IdempotencyLayer::new(store).single_tenant())
}

fn unique(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{name}-{nanos}")
}

async fn refund(addr: SocketAddr, key: &str, ms: u64) -> reqwest::Response {
    common::client()
        .post(format!("http://{addr}/refunds?ms={ms}"))
        .header("idempotency-key", key)
        .body("refund order 7")
        .send()
        .await
        .expect("request")
}

/// `n` concurrent requests with one key, spread over `replicas`, released together; the
/// number of first answers (not replayed) and the bodies seen.
async fn burst(replicas: &[SocketAddr], key: &str, n: usize) -> (usize, Vec<String>) {
    let barrier = Arc::new(Barrier::new(n));
    // Connections of their own, many at once: the pool of one client would queue them.
    let clients: Vec<reqwest::Client> = (0..8).map(|_| common::client()).collect();
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let addr = replicas[i % replicas.len()];
            let request = clients[i % clients.len()]
                .post(format!("http://{addr}/refunds?ms=300"))
                .header("idempotency-key", key)
                .body("refund order 7");
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                // A 409 (still running) is retried, as a client would, until it has its answer.
                loop {
                    let res = request
                        .try_clone()
                        .expect("clone")
                        .send()
                        .await
                        .expect("request");
                    match res.status() {
                        StatusCode::CONFLICT => tokio::time::sleep(Duration::from_millis(50)).await,
                        StatusCode::CREATED => {
                            let first = res.headers().get("idempotency-replayed").is_none();
                            return (first, res.text().await.expect("body"));
                        }
                        status => panic!("unexpected {status}"),
                    }
                }
            })
        })
        .collect();
    let (mut firsts, mut bodies) = (0, Vec::new());
    for task in tasks {
        let (first, body) = task.await.expect("task");
        firsts += usize::from(first);
        bodies.push(body);
    }
    (firsts, bodies)
}

async fn replicas_run_a_key_once(stores: Vec<RedisStore>) {
    let effects = Effects::default();
    let mut replicas = Vec::new();
    for store in stores {
        replicas.push(serve(app(store, effects.clone())).await);
    }
    let key = unique("burst");
    let (firsts, bodies) = burst(&replicas, &key, 1000).await;
    assert_eq!(effects.count(), 1, "one effect across the replicas");
    assert_eq!(firsts, 1, "one first answer, every other a replay");
    assert!(
        bodies.iter().all(|b| b == "refund 1"),
        "everyone got the first's answer"
    );
}

/// Three replicas, each with its own connection to one Redis: 1000 concurrent requests with
/// one key make one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_three_replicas_on_one_redis_run_a_key_once() {
    let mut stores = Vec::new();
    for _ in 0..3 {
        let Some(store) = common::redis("replicas").await else {
            return;
        };
        // One prefix for the three, as replicas of one service share it.
        stores.push(store.with_prefix("test-replicas").expect("prefix"));
    }
    replicas_run_a_key_once(stores).await;
}

/// The same on a three-master Redis Cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_three_replicas_on_one_redis_cluster_run_a_key_once() {
    let mut stores = Vec::new();
    for _ in 0..3 {
        let Some(store) = common::redis_cluster("replicas").await else {
            return;
        };
        stores.push(store.with_prefix("test-replicas").expect("prefix"));
    }
    replicas_run_a_key_once(stores).await;
}

/// The quickstart example on `store_url`, killed with SIGKILL when dropped.
struct Replica {
    child: std::process::Child,
    addr: SocketAddr,
}

impl Replica {
    fn start(store_url: &str) -> Self {
        use std::io::BufRead;
        let exe = std::env::current_exe().expect("test binary path");
        let quickstart = exe
            .parent()
            .and_then(|deps| deps.parent())
            .map(|profile| profile.join("examples").join("quickstart"))
            .expect("target directory");
        let mut child = std::process::Command::new(quickstart)
            .args(["--store", store_url])
            .env("ADDR", "127.0.0.1:0")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn the quickstart (built with the workspace's tests)");
        let mut reader = std::io::BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        reader.read_line(&mut line).expect("banner");
        std::thread::spawn(move || std::io::copy(&mut reader, &mut std::io::sink()));
        let addr = line
            .split("http://")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no address in the banner {line:?}"));
        Self { child, addr }
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A replica killed with SIGKILL inside its handler: on Redis the key stays in flight (409 to
/// every retry while the lease holds), never free for a second run; once the lease is over,
/// the next claim takes it over and runs it, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_a_replica_killed_mid_handler_leaves_the_key_in_flight() {
    let Some(store) = common::redis("killed").await else {
        return;
    };
    let url = common::redis_url();
    let key = unique("killed");
    let body = serde_json::json!({ "title": "killed", "work_ms": 600_000 });
    let holder = Replica::start(&url);
    let addr = holder.addr;
    let (k, b) = (key.clone(), body.clone());
    let pending = tokio::spawn(async move {
        common::client()
            .post(format!("http://{addr}/tools/create_ticket"))
            .bearer_auth("agent-1")
            .header("idempotency-key", k)
            .json(&b)
            .send()
            .await
    });
    // The quickstart keeps its records under the default prefix, scoped by principal.
    let store = store
        .with_prefix(RedisStore::DEFAULT_PREFIX)
        .expect("prefix");
    let scoped = ScopedKey::new("principal:agent-1", key.clone());
    let mut claimed = false;
    for _ in 0..300 {
        if store.lookup(&scoped).await.expect("lookup").is_some() {
            claimed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(claimed, "the holder never claimed the key");
    drop(holder);
    let _ = pending.await;

    let replica = Replica::start(&url);
    for _ in 0..3 {
        let res = common::client()
            .post(format!("http://{}/tools/create_ticket", replica.addr))
            .bearer_auth("agent-1")
            .header("idempotency-key", &key)
            .json(&body)
            .send()
            .await
            .expect("retry");
        assert_eq!(res.status(), StatusCode::CONFLICT);
        assert_eq!(problem(res).await["type"], problem_type("in-flight"));
    }
    let record = store
        .lookup(&scoped)
        .await
        .expect("lookup")
        .expect("record");
    assert_eq!(
        record.attempts, 1,
        "never run a second time while in flight"
    );
}

/// Redis cut off behind a proxy: every request answers 503 and runs nothing; once Redis is
/// back, the pending key runs once and the finished one replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_redis_outage_fails_closed_and_recovers() {
    if common::redis("outage").await.is_none() {
        return;
    }
    let url: reqwest::Url = common::redis_url().parse().expect("url");
    let upstream = tokio::net::lookup_host((
        url.host_str().unwrap_or("127.0.0.1"),
        url.port().unwrap_or(6379),
    ))
    .await
    .expect("resolve")
    .next()
    .expect("an address");
    let proxy = Proxy::start(upstream).await;
    let store = RedisStore::connect(&format!("redis://{}", proxy.addr))
        .await
        .expect("connect through the proxy")
        .with_prefix(&common::redis_prefix("outage"))
        .expect("prefix");
    let effects = Effects::default();
    let addr = serve(app(store, effects.clone())).await;
    let (done, pending) = (unique("before"), unique("during"));

    assert_eq!(refund(addr, &done, 0).await.status(), StatusCode::CREATED);
    proxy.cut();
    for key in [&done, &pending, &pending] {
        let res = refund(addr, key, 0).await;
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(res.headers().contains_key("retry-after"));
        assert_eq!(
            problem(res).await["type"],
            problem_type("store-unavailable")
        );
    }
    assert_eq!(
        effects.count(),
        1,
        "nothing runs while Redis is unreachable"
    );

    proxy.restore();
    let mut recovered = None;
    for _ in 0..100 {
        let res = refund(addr, &pending, 0).await;
        if res.status() != StatusCode::SERVICE_UNAVAILABLE {
            recovered = Some(res);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        recovered.expect("service resumes").status(),
        StatusCode::CREATED
    );
    for key in [&done, &pending] {
        let replay = refund(addr, key, 0).await;
        assert_eq!(replay.headers()["idempotency-replayed"], "true");
    }
    assert_eq!(effects.count(), 2, "each key ran once across the outage");
}

/// `with_wait`: a claim and a completion wait for replica acknowledgements. The test server
/// has no replica, so asking for one fails the claim (given back: the key can be claimed
/// again) and the completion (the layer would keep retrying it, holding the key), and asking
/// for none passes; either way the outcome itself is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_completions_can_wait_for_replicas() {
    use tower_idempotency::store::{
        Claim, ClaimRequest, Fingerprint, LeaseExpiry, RecordStatus, StoreError, StoredResponse,
    };
    let Some(store) = common::redis("wait").await else {
        return;
    };
    let response = StoredResponse {
        status: StatusCode::CREATED,
        headers: http::HeaderMap::new(),
        body: Some(bytes::Bytes::from_static(b"refund 1")),
        trailers: None,
    };
    let unwaiting = store.clone();
    for (replicas, acknowledged) in [(1, false), (0, true)] {
        let store = store
            .clone()
            .with_wait(replicas, Duration::from_millis(100));
        let key = ScopedKey::new("", unique("wait"));
        let request = ClaimRequest {
            key: key.clone(),
            fingerprint: Fingerprint::from_bytes([7; 32]),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
            on_lease_expiry: LeaseExpiry::Reclaim,
        };
        let claimed = match acknowledged {
            true => store.claim(&request).await,
            false => {
                // A claim waits too: unacknowledged, nothing may run under it, so it is
                // refused and given back. The key is claimed again without waiting, to try
                // its completion.
                let refused = store.claim(&request).await;
                let error = refused.expect_err("no replica to acknowledge the claim");
                assert!(error.to_string().contains("0 of 1 replicas"), "{error}");
                settled_claim(&unwaiting, &request).await
            }
        };
        let Claim::Acquired(lease) = claimed.expect("claim") else {
            panic!("a fresh key");
        };
        let completed = store
            .complete(&key, lease.token, &response, Duration::from_secs(60))
            .await;
        match acknowledged {
            true => completed.expect("no replica asked for"),
            false => {
                let error = completed.expect_err("no replica to acknowledge");
                assert!(matches!(error, StoreError::Unavailable(_)), "{error}");
                assert!(error.to_string().contains("0 of 1 replicas"), "{error}");
            }
        }
        let record = store.lookup(&key).await.expect("lookup").expect("record");
        assert_eq!(record.status, RecordStatus::Completed);
    }
}

/// Claims `request` until it is acquired (a claim given back lands a moment later).
async fn settled_claim(
    store: &RedisStore,
    request: &tower_idempotency::store::ClaimRequest,
) -> Result<tower_idempotency::store::Claim, tower_idempotency::store::StoreError> {
    use tower_idempotency::store::Claim;
    for _ in 0..200 {
        let claimed = store.claim(request).await?;
        if matches!(claimed, Claim::Acquired(_)) {
            return Ok(claimed);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the key given back was never claimed again");
}
