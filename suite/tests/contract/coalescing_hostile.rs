//! Issue 21, coalescing attacked (RedisStore's subscription above all): waiters under lease expiry,
//! races with registration, a silently dead subscription, a restarted and an out-of-memory
//! Redis (a private redis-server this test starts and stops), runtimes, and AnyStore URLs.

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use common::own_redis::OwnRedis;
use common::valve::Valve;
use common::{Effects, serve};
use tower_idempotency::store::{
    AnyStore, Claim, ClaimRequest, FencingToken, Fingerprint, InFlight, LeaseExpiry, RecordStatus,
    RedisStore, ScopedKey, StoredResponse,
};
use tower_idempotency::{IdempotencyLayer, IdempotencyStore, MemoryStore};

const LONG: Duration = Duration::from_secs(60);

/// A private server that loses nothing it acknowledged when killed: every write appended and
/// synced.
const AOF: &[&str] = &["--appendonly", "yes", "--appendfsync", "always"];

fn unique(name: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{name}-{nanos}")
}

fn req(key: &ScopedKey, lease: Duration) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        fingerprint: Fingerprint::from_bytes([7; 32]),
        lease,
        ttl: LONG,
        on_lease_expiry: LeaseExpiry::Reclaim,
    }
}

fn response(body: &str) -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: http::HeaderMap::new(),
        body: Some(bytes::Bytes::copy_from_slice(body.as_bytes())),
        trailers: None,
    }
}

/// A write endpoint working `ms` milliseconds (from the query), counting its runs.
fn app<St: IdempotencyStore>(store: St, effects: Effects, wait: Duration) -> Router {
    Router::new()
        .route(
            "/refunds",
            post(move |query: axum::extract::RawQuery| async move {
                let query = query.0.unwrap_or_default();
                let ms = query
                    .split('&')
                    .find_map(|p| p.strip_prefix("ms=")?.parse().ok())
                    .unwrap_or(0);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                let n = effects.hit();
                (StatusCode::CREATED, format!("refund {n}"))
            }),
        )
        .layer(
            IdempotencyLayer::new(store)
                .single_tenant()
                .wait_for_in_flight(wait),
        )
}

async fn send(addr: SocketAddr, key: &str, ms: u64) -> (StatusCode, bool, String, Duration) {
    let started = Instant::now();
    let res = common::client()
        .post(format!("http://{addr}/refunds?ms={ms}"))
        .header("idempotency-key", key)
        .body("refund order 7")
        .send()
        .await
        .expect("request");
    let replayed = res.headers().contains_key("idempotency-replayed");
    (
        res.status(),
        replayed,
        res.text().await.expect("body"),
        started.elapsed(),
    )
}

/// A first request running `ms`, then `n` duplicates 100 ms later: every answer.
async fn burst(
    addr: SocketAddr,
    key: &str,
    n: usize,
    ms: u64,
) -> Vec<(StatusCode, bool, String, Duration)> {
    let k = key.to_owned();
    let first = tokio::spawn(async move { send(addr, &k, ms).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let rest: Vec<_> = (0..n)
        .map(|_| {
            let k = key.to_owned();
            tokio::spawn(async move { send(addr, &k, ms).await })
        })
        .collect();
    let mut out = vec![first.await.expect("first")];
    for r in rest {
        out.push(r.await.expect("dup"));
    }
    out
}

/// A holder that never finishes: its lease runs out while waiters wait. Exactly one waiter
/// takes the key over, at about the lease end (not at `within`); the others then see the new
/// holder's outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_a_lease_that_runs_out_under_waiters_has_one_taker() {
    for backend in ["memory", "redis", "cluster"] {
        let store: Arc<AnyStore> = Arc::new(match backend {
            "memory" => AnyStore::Memory(MemoryStore::new()),
            "redis" => match common::redis("takeover").await {
                Some(s) => AnyStore::Redis(s),
                None => return,
            },
            _ => match common::redis_cluster("takeover").await {
                Some(s) => AnyStore::Redis(s),
                None => return,
            },
        });
        // Warm the subscription.
        let warm = InFlight {
            token: FencingToken::new(1),
            lease_until: SystemTime::now(),
            now: SystemTime::now(),
        };
        store
            .wait_for_change(&ScopedKey::new("", "warm"), &warm, 0, Duration::ZERO)
            .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let key = ScopedKey::new("", unique("lease"));
        let lease = Duration::from_millis(800);
        let Claim::Acquired(_) = store.claim(&req(&key, lease)).await.expect("claim") else {
            panic!("fresh");
        };
        let won = Arc::new(AtomicUsize::new(0));
        let started = Instant::now();
        let waiters: Vec<_> = (0..30)
            .map(|_| {
                let (store, key, won) = (store.clone(), key.clone(), won.clone());
                tokio::spawn(async move {
                    let deadline = Instant::now() + Duration::from_secs(10);
                    let mut round = 0;
                    loop {
                        match store.claim(&req(&key, lease)).await.expect("claim") {
                            Claim::Acquired(l) => {
                                won.fetch_add(1, Ordering::SeqCst);
                                let took = started.elapsed();
                                tokio::time::sleep(Duration::from_millis(50)).await;
                                store
                                    .complete(&key, l.token, &response("taken"), LONG)
                                    .await
                                    .expect("complete");
                                return ("ran", took);
                            }
                            Claim::Existing { record, now } => match record.status {
                                RecordStatus::InProgress => {
                                    let seen = InFlight {
                                        token: record.lease_token,
                                        lease_until: record.lease_until,
                                        now,
                                    };
                                    let within = deadline.saturating_duration_since(Instant::now());
                                    if within.is_zero() {
                                        return ("timed out", started.elapsed());
                                    }
                                    store.wait_for_change(&key, &seen, round, within).await;
                                    round += 1;
                                }
                                other => panic!("{other:?}"),
                            },
                            Claim::Completed { .. } => return ("replayed", started.elapsed()),
                        }
                    }
                })
            })
            .collect();
        let mut ends = Vec::new();
        for w in waiters {
            ends.push(w.await.expect("waiter"));
        }
        let ran: Vec<_> = ends.iter().filter(|e| e.0 == "ran").collect();
        let slowest = ends.iter().map(|e| e.1).max().unwrap_or_default();
        println!("{backend}: ran {ran:?}; slowest end {slowest:?}");
        assert_eq!(
            won.load(Ordering::SeqCst),
            1,
            "{backend}: exactly one takeover"
        );
        assert!(
            ends.iter().all(|e| e.0 != "timed out"),
            "{backend}: {ends:?}"
        );
        assert!(
            slowest < Duration::from_secs(3),
            "{backend}: slowest {slowest:?}"
        );
    }
}

/// The record moves on in the window between the waiter's claim and its registration, many
/// times over: the wait never lasts until `within`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_no_wakeup_is_lost_at_registration() {
    for backend in ["memory", "redis", "cluster"] {
        let store: Arc<AnyStore> = Arc::new(match backend {
            "memory" => AnyStore::Memory(MemoryStore::new()),
            "redis" => match common::redis("lost").await {
                Some(s) => AnyStore::Redis(s),
                None => return,
            },
            _ => match common::redis_cluster("lost").await {
                Some(s) => AnyStore::Redis(s),
                None => return,
            },
        });
        let warm = InFlight {
            token: FencingToken::new(1),
            lease_until: SystemTime::now(),
            now: SystemTime::now(),
        };
        store
            .wait_for_change(&ScopedKey::new("", "warm"), &warm, 0, Duration::ZERO)
            .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut worst = Duration::ZERO;
        for i in 0..150 {
            let key = ScopedKey::new("", unique(&format!("lost{i}")));
            let Claim::Acquired(l) = store.claim(&req(&key, LONG)).await.expect("claim") else {
                panic!("fresh");
            };
            let Claim::Existing { record, now } = store.claim(&req(&key, LONG)).await.expect("c")
            else {
                panic!("held");
            };
            let seen = InFlight {
                token: record.lease_token,
                lease_until: record.lease_until,
                now,
            };
            let (s, k) = (store.clone(), key.clone());
            let delay = Duration::from_micros((i % 15) * 100);
            let completing = tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                s.complete(&k, l.token, &response("x"), LONG).await
            });
            let started = Instant::now();
            store
                .wait_for_change(&key, &seen, 0, Duration::from_secs(5))
                .await;
            worst = worst.max(started.elapsed());
            completing.await.expect("task").expect("complete");
        }
        println!("{backend}: longest wait {worst:?}");
        assert!(
            worst < Duration::from_secs(2),
            "{backend}: a wake-up was lost ({worst:?})"
        );
    }
}

/// The store's subscription dies silently (no FIN reaches the client: a NAT or firewall
/// dropped the idle flow, or Redis restarted behind a partition). Its heartbeat finds the dead
/// link within a few seconds: the waiters of that moment are woken to look again (never
/// waiting out their whole wait), and later ones are woken promptly on a new subscription.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_a_silently_dead_subscription_is_found_by_its_heartbeat() {
    if common::redis("silent").await.is_none() {
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
    let proxy = Valve::start(upstream).await;
    let store = RedisStore::connect(&proxy.url())
        .await
        .expect("connect")
        .with_prefix(&common::redis_prefix("silent"))
        .expect("prefix");
    let effects = Effects::default();
    let wait = Duration::from_secs(6);
    let addr = serve(app(store, effects.clone(), wait)).await;
    // Healthy: duplicates replay about when the first ends (300 ms).
    let answers = burst(addr, &unique("before"), 5, 300).await;
    let slowest = answers.iter().map(|a| a.3).max().unwrap_or_default();
    println!("before: slowest duplicate {slowest:?}");
    assert_eq!(
        proxy.links(),
        2,
        "the command connection and the subscription"
    );
    // The subscription (the second connection) dies silently: stalled for good, it carries
    // nothing either way and no FIN reaches the client.
    proxy.freeze_from(1);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let effects_before = effects.count();
    let answers = burst(addr, &unique("after"), 5, 300).await;
    let slowest = answers.iter().map(|a| a.3).max().unwrap_or_default();
    println!(
        "after: {:?}",
        answers
            .iter()
            .map(|a| (a.0.as_u16(), a.1, a.3))
            .collect::<Vec<_>>()
    );
    assert_eq!(effects.count(), effects_before + 1, "one run");
    assert!(
        slowest < wait,
        "duplicates of a 300 ms request waited out their whole wait: {slowest:?}"
    );
    // The heartbeat found the dead link and subscribed again: woken promptly from then on.
    let answers = burst(addr, &unique("again"), 5, 300).await;
    let slowest = answers.iter().map(|a| a.3).max().unwrap_or_default();
    assert!(
        slowest < Duration::from_secs(2),
        "after the heartbeat, duplicates of a 300 ms request waited {slowest:?}"
    );
    assert_eq!(effects.count(), effects_before + 2);
}

/// Redis killed and restarted (AOF, nothing lost) while duplicates wait for a running
/// request: the subscription is lost and restored. Nobody hangs, nothing runs twice, and every
/// duplicate gets the replay or a 503 (never a second run nor a wrong answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_redis_restarted_under_waiters() {
    let Some(mut server) = OwnRedis::start(AOF) else {
        return;
    };
    let store = RedisStore::connect(&server.url())
        .await
        .expect("connect")
        .with_prefix("restart")
        .expect("prefix");
    let effects = Effects::default();
    let addr = serve(app(store, effects.clone(), Duration::from_secs(20))).await;
    // Warm the subscription with one burst.
    let _ = burst(addr, &unique("warm"), 2, 100).await;
    let key = unique("restart");
    let k = key.clone();
    let running = tokio::spawn(async move { burst(addr, &k, 10, 2000).await });
    tokio::time::sleep(Duration::from_millis(600)).await;
    server.stop();
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.start_again();
    let answers = running.await.expect("burst");
    println!(
        "{:?}",
        answers
            .iter()
            .map(|a| (a.0.as_u16(), a.1, &a.2, a.3))
            .collect::<Vec<_>>()
    );
    assert_eq!(effects.count(), 2, "warm-up once + this key once");
    let first = &answers[0];
    for a in &answers[1..] {
        assert!(
            (a.0 == StatusCode::CREATED && a.1 && a.2 == first.2)
                || a.0 == StatusCode::SERVICE_UNAVAILABLE,
            "{a:?}"
        );
        assert!(a.3 < Duration::from_secs(8), "a duplicate hung {:?}", a.3);
    }
    // And the subscription is back: a new burst replays at once.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let again = burst(addr, &unique("after"), 5, 300).await;
    let slowest = again.iter().map(|a| a.3).max().unwrap_or_default();
    println!("after the restart: slowest {slowest:?}");
    assert!(slowest < Duration::from_secs(2));
}

/// Redis out of memory (noeviction): new keys fail closed with 503 and run nothing; a holder
/// whose completion is refused keeps its key (409 to retries, never a second run), and its
/// outcome lands once memory is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_redis_out_of_memory_fails_closed() {
    let Some(server) = OwnRedis::start(AOF) else {
        return;
    };
    let store = RedisStore::connect(&server.url())
        .await
        .expect("connect")
        .with_prefix("oom")
        .expect("prefix");
    let effects = Effects::default();
    let addr = serve(app(store.clone(), effects.clone(), Duration::ZERO)).await;
    let held = unique("held");
    let h = held.clone();
    let holder = tokio::spawn(async move { send(addr, &h, 800).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    server
        .cmd(&["CONFIG", "SET", "maxmemory", "1"])
        .await
        .expect("config");
    let fresh = unique("fresh");
    let a = send(addr, &fresh, 0).await;
    println!("fresh key under OOM: {:?}", (a.0, &a.2));
    assert_eq!(a.0, StatusCode::SERVICE_UNAVAILABLE);
    let b = send(addr, &held, 800).await;
    println!("held key under OOM: {:?}", (b.0, &b.2));
    assert_ne!(b.0, StatusCode::CREATED);
    let h = holder.await.expect("holder");
    println!("holder: {:?}", (h.0, &h.2));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let c = send(addr, &held, 800).await;
    println!(
        "held key after the holder answered, still OOM: {:?}",
        (c.0, &c.2)
    );
    assert!(c.0 != StatusCode::CREATED || c.1, "ran twice under OOM");
    server
        .cmd(&["CONFIG", "SET", "maxmemory", "0"])
        .await
        .expect("config");
    let mut landed = false;
    for _ in 0..100 {
        if let Ok(Some(r)) = store.lookup(&ScopedKey::new("", &held)).await
            && r.status == RecordStatus::Completed
        {
            landed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(landed, "the outcome landed once memory was back");
    let d = send(addr, &held, 800).await;
    assert_eq!(
        (d.0, d.1, d.2.as_str()),
        (StatusCode::CREATED, true, h.2.as_str())
    );
    let e = send(addr, &fresh, 0).await;
    assert_eq!((e.0, e.1), (StatusCode::CREATED, false));
    assert_eq!(
        effects.count(),
        2,
        "the held key once, the fresh key once (after OOM)"
    );
}

/// The subscription task lives on the runtime of the first wait. A store shared across
/// runtimes (a static store in tests, or runtimes per worker) whose first waiter's runtime
/// ends: the subscription counts as down, and the next waiter, on another runtime, starts it
/// again there and is woken, never sleeping to `within`.
#[test]
fn s21_the_subscription_outlives_the_first_waiters_runtime() {
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let Some(store) = main.block_on(common::redis("runtime")) else {
        return;
    };
    {
        let other = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        other.block_on(async {
            let warm = InFlight {
                token: FencingToken::new(1),
                lease_until: SystemTime::now(),
                now: SystemTime::now(),
            };
            store
                .wait_for_change(&ScopedKey::new("", "warm"), &warm, 0, Duration::ZERO)
                .await;
            tokio::time::sleep(Duration::from_millis(500)).await;
        });
    }
    let waited = main.block_on(async {
        let key = ScopedKey::new("", unique("rt"));
        let Claim::Acquired(l) = store.claim(&req(&key, LONG)).await.expect("claim") else {
            panic!("fresh");
        };
        let Claim::Existing { record, now } = store.claim(&req(&key, LONG)).await.expect("c")
        else {
            panic!("held");
        };
        let seen = InFlight {
            token: record.lease_token,
            lease_until: record.lease_until,
            now,
        };
        let (s, k) = (store.clone(), key.clone());
        let completing = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            s.complete(&k, l.token, &response("x"), LONG).await
        });
        let started = Instant::now();
        store
            .wait_for_change(&key, &seen, 0, Duration::from_secs(5))
            .await;
        completing.await.expect("task").expect("complete");
        started.elapsed()
    });
    println!("waited {waited:?} for a change 100 ms away");
    assert!(
        waited < Duration::from_secs(2),
        "slept to within: {waited:?}"
    );
}

/// AnyStore URLs: several cluster nodes, a trailing slash, a password never shown in errors;
/// a first cluster node that is down (the subscription tries the next).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_anystore_redis_urls() {
    if common::redis_cluster("urls").await.is_none() {
        return;
    }
    for url in [
        "redis+cluster://127.0.0.1:7000,127.0.0.1:7001",
        "redis+cluster://127.0.0.1:7001/",
        "REDIS+CLUSTER://127.0.0.1:7002",
        "redis://127.0.0.1:6379/2",
    ] {
        let store = AnyStore::connect(url)
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        let key = ScopedKey::new("", unique("url"));
        assert!(matches!(
            store.claim(&req(&key, LONG)).await.expect("claim"),
            Claim::Acquired(_)
        ));
        store.remove(&key).await.expect("remove");
    }
    for url in [
        "redis+cluster://:s3cr3t-pw@127.0.0.1:7000,127.0.0.1:7001",
        "redis://user:s3cr3t-pw@127.0.0.1:6379",
        "redis+cluster://:s3cr3t-pw@127.0.0.1:1",
        "redis://:s3cr3t/pw@127.0.0.1:6379",
    ] {
        match AnyStore::connect(url).await {
            Ok(_) => println!("{url}: connected"),
            Err(e) => {
                let text = format!("{e} / {e:?}");
                println!("{url}: {e}");
                assert!(!text.contains("s3cr3t"), "the password leaks: {text}");
            }
        }
    }
    for url in ["redis+cluster://127.0.0.1:7000, 127.0.0.1:7001"] {
        println!(
            "{url}: {:?}",
            AnyStore::connect(url)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        );
    }
    // A first node that is down: the cluster connects through the others, but the
    // subscription only ever tries the first: waiters poll forever.
    let store = AnyStore::connect("redis+cluster://127.0.0.1:1,127.0.0.1:7000")
        .await
        .map_err(|e| e.to_string());
    println!("first node down: {:?}", store.as_ref().map(|_| ()));
    if let Ok(store) = store {
        let AnyStore::Redis(store) = store else {
            panic!()
        };
        let store = store
            .with_prefix(&common::redis_prefix("firstdown"))
            .expect("prefix");
        let warm = InFlight {
            token: FencingToken::new(1),
            lease_until: SystemTime::now(),
            now: SystemTime::now(),
        };
        store
            .wait_for_change(&ScopedKey::new("", "warm"), &warm, 0, Duration::ZERO)
            .await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let dbg = format!("{store:?}");
        let prefix = dbg
            .split("prefix: \"")
            .nth(1)
            .and_then(|p| p.split('"').next())
            .expect("p");
        let mut subscribers = 0;
        for port in [7000, 7001, 7002] {
            let mut conn = redis::Client::open(format!("redis://127.0.0.1:{port}"))
                .expect("client")
                .get_multiplexed_async_connection()
                .await
                .expect("conn");
            let v: Vec<redis::Value> = redis::cmd("PUBSUB")
                .arg("NUMSUB")
                .arg(format!("{prefix}:changed"))
                .query_async(&mut conn)
                .await
                .expect("numsub");
            if let redis::Value::Int(n) = v[1] {
                subscribers += n;
            }
        }
        println!("subscribers with the first node down: {subscribers}");
        assert_eq!(
            subscribers, 1,
            "no subscription: waiters poll for the store's life"
        );
    }
}

/// The brief's question, at the layer on the cluster: are waiters woken by pub/sub, or
/// silently polling? Claims counted at the store (common::faulty with `wake`), a first that
/// runs 2 s, 20 waiters spread over three replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_cluster_waiters_claim_a_bounded_number_of_times() {
    const WAITERS: usize = 20;
    let prefix = common::redis_prefix("count-cluster");
    let mut stores = Vec::new();
    let mut addrs = Vec::new();
    let effects = Effects::default();
    for _ in 0..3 {
        let Some(store) = common::redis_cluster("count").await else {
            return;
        };
        let store = common::faulty::Faulty::new(store.with_prefix(&prefix).expect("prefix"));
        store.wake.store(true, Ordering::SeqCst);
        addrs.push(serve(app(store.clone(), effects.clone(), Duration::from_secs(20))).await);
        stores.push(store);
    }
    // Warm each replica's subscription.
    for (i, a) in addrs.iter().enumerate() {
        let _ = burst(*a, &unique(&format!("warm{i}")), 1, 200).await;
    }
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let before: usize = stores
        .iter()
        .map(|s| s.log().iter().filter(|op| **op == "claim").count())
        .sum();
    let key = unique("count");
    let k = key.clone();
    let a0 = addrs[0];
    let first = tokio::spawn(async move { send(a0, &k, 2000).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let rest: Vec<_> = (0..WAITERS)
        .map(|i| {
            let (a, k) = (addrs[i % 3], key.clone());
            tokio::spawn(async move { send(a, &k, 2000).await })
        })
        .collect();
    let first = first.await.expect("first");
    let mut slowest = Duration::ZERO;
    for r in rest {
        let r = r.await.expect("waiter");
        assert_eq!((r.0, r.1, &r.2), (StatusCode::CREATED, true, &first.2));
        slowest = slowest.max(r.3);
    }
    let claims: usize = stores
        .iter()
        .map(|s| s.log().iter().filter(|op| **op == "claim").count())
        .sum::<usize>()
        - before;
    println!("cluster: {claims} claims for 1 first + {WAITERS} waiters; slowest {slowest:?}");
    assert!(
        claims <= 1 + 2 * WAITERS + 2,
        "{claims} claims: polling, not woken"
    );
    assert!(slowest < Duration::from_secs(3));
}

/// A least-privilege ACL user (`~* +@all`, no channel rule): since Redis 7 a new user has no
/// pub/sub channels (`acl-pubsub-default resetchannels`). A script's `PUBLISH` may then fail:
/// the write it made stands and is reported as made (nothing retries it), and waiters poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_an_acl_user_without_channels() {
    let Some(server) = OwnRedis::start(AOF) else {
        return;
    };
    println!(
        "acl-pubsub-default: {:?}",
        server.cmd(&["CONFIG", "GET", "acl-pubsub-default"]).await
    );
    server
        .cmd(&["ACL", "SETUSER", "app", "on", ">pw", "~*", "+@all"])
        .await
        .expect("acl");
    let url = format!("redis://app:pw@127.0.0.1:{}", server.addr().port());
    let store = RedisStore::connect(&url)
        .await
        .expect("connect")
        .with_prefix("acl")
        .expect("prefix");
    // Store level: a completion that is reported failed, and the record.
    let key = ScopedKey::new("", unique("acl"));
    let Claim::Acquired(l) = store.claim(&req(&key, LONG)).await.expect("claim") else {
        panic!("fresh");
    };
    let completed = store.complete(&key, l.token, &response("x"), LONG).await;
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    println!(
        "complete: {:?}; the record is {:?}",
        completed.as_ref().map_err(|e| e.to_string()),
        record.status
    );
    // Release, mark_uncertain and resolve: each lands and is reported failed.
    let k2 = ScopedKey::new("", unique("acl2"));
    let Claim::Acquired(l2) = store.claim(&req(&k2, LONG)).await.expect("claim") else {
        panic!("fresh");
    };
    let released = store.release(&k2, l2.token).await;
    let r2 = store.lookup(&k2).await.expect("lookup").expect("record");
    println!(
        "release: {:?}; the record is {:?}",
        released.as_ref().map_err(|e| e.to_string()),
        r2.status
    );
    let Claim::Acquired(l3) = store.claim(&req(&k2, LONG)).await.expect("claim") else {
        panic!("released");
    };
    let marked = store.mark_uncertain(&k2, l3.token).await;
    let resolved = store
        .resolve(
            &k2,
            l3.token,
            &tower_idempotency::store::Resolution::NotApplied,
            LONG,
            Some("by hand"),
        )
        .await;
    let r3 = store.lookup(&k2).await.expect("lookup").expect("record");
    println!(
        "mark_uncertain: {:?}; resolve: {:?}; the record is {:?} with note {:?}",
        marked.is_ok(),
        resolved.is_ok(),
        r3.status,
        r3.resolution_note
    );
    // Layer level: the request's answer, and what keeps running afterwards.
    let effects = Effects::default();
    let addr = serve(app(store.clone(), effects.clone(), Duration::ZERO)).await;
    let k = unique("acl-http");
    let a = send(addr, &k, 0).await;
    let b = send(addr, &k, 0).await;
    println!("first {:?}, retry {:?}", (a.0, a.1), (b.0, b.1));
    // No write is retried in the background: the script calls stay as they are.
    let scripts = || async {
        let text = common::own_redis::info(&server, "commandstats").await;
        assert!(
            text.contains("cmdstat_"),
            "INFO commandstats answered: {text:?}"
        );
        common::own_redis::calls(&text, "evalsha") + common::own_redis::calls(&text, "eval")
    };
    let before = scripts().await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let after = scripts().await;
    assert_eq!(effects.count(), 1);
    completed.expect("a completion that landed is reported as landed");
    assert_eq!(
        before, after,
        "something keeps retrying a write that lands every time"
    );
}
