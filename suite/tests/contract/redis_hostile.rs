//! Issue 21, RedisStore attacked at the store level: replica waits, dropped stores, damaged and
//! dangling records, odd keys, extreme durations, paging through ties, racing resolutions,
//! cluster wake-ups and huge listing limits. Each asserts what the trait docs promise.

use crate::common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use http::StatusCode;
use tower_idempotency::IdempotencyStore;
use tower_idempotency::store::{
    Claim, ClaimRequest, FencingToken, Fingerprint, InFlight, LeaseExpiry, Milestone, RecordStatus,
    Resolution, ScopedKey, StoreError, StoredResponse, UncertainQuery,
};

const LONG: Duration = Duration::from_secs(60);

fn unique(name: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{name}-{nanos}")
}

fn req(key: &ScopedKey, lease: Duration, ttl: Duration) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        fingerprint: Fingerprint::from_bytes([7; 32]),
        lease,
        ttl,
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

async fn acquire<S: IdempotencyStore>(store: &S, r: &ClaimRequest) -> FencingToken {
    match store.claim(r).await.expect("claim") {
        Claim::Acquired(lease) => lease.token,
        other => panic!("expected a fresh key, got {other:?}"),
    }
}

async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("raw connection")
}

/// `with_wait`: WAIT blocks the connection it runs on, so completions that wait run on
/// connections of their own: no other operation of the store queues behind them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_with_wait_blocks_no_other_operation_of_the_store() {
    let Some(store) = common::redis("wait-hol").await else {
        return;
    };
    // The test server has no replica: WAIT 1 waits out its whole timeout.
    let waiting = store.clone().with_wait(1, Duration::from_secs(2));
    let a = ScopedKey::new("", unique("a"));
    // Claimed without waiting (a claim that waits would fail first, with no replica).
    let token = acquire(&store, &req(&a, LONG, LONG)).await;
    let completing = {
        let waiting = waiting.clone();
        let a = a.clone();
        tokio::spawn(async move { waiting.complete(&a, token, &response("a"), LONG).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    // An unrelated claim, on a clone of the same store (as another request of the layer).
    let b = ScopedKey::new("", unique("b"));
    let started = Instant::now();
    let claimed = store.claim(&req(&b, LONG, LONG)).await;
    let took = started.elapsed();
    println!(
        "unrelated claim during a WAIT took {took:?}: {:?}",
        claimed.is_ok()
    );
    let _ = completing.await;
    assert!(
        took < Duration::from_millis(500),
        "an unrelated claim waited {took:?} behind another request's WAIT"
    );
}

/// `with_wait` and `with_waiting_connections`: writes that wait are lent a waiting connection
/// each, as many at once as the store has connections for them, and one that finds none free
/// within 5 s is refused (the store unavailable for it) rather than queued without end behind
/// `WAIT`s that block their connections. Sixteen claims on a server without a replica, each
/// `WAIT` taking its 2 s: rounds start at 0, 2 and 4 s, within the 5 s a write waits for a
/// connection, so three rounds get one, each claim refused for its replica, and the rest find
/// none free in time. On the default four connections that is twelve and four; on five,
/// fifteen and one (on six or more, sixteen and none); asked for none, the store keeps one:
/// three and thirteen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_writes_that_wait_take_a_waiting_connection_each_or_give_up_after_5s() {
    let Some(store) = common::redis("wait-connections").await else {
        return;
    };
    for (connections, unacknowledged, busy) in [(None, 12, 4), (Some(5), 15, 1), (Some(0), 3, 13)] {
        let mut waiting = store.clone().with_wait(1, Duration::from_secs(2));
        if let Some(connections) = connections {
            waiting = waiting.with_waiting_connections(connections);
        }
        let claims = (0..16).map(|i| {
            let waiting = waiting.clone();
            async move {
                let key = ScopedKey::new("", unique(&format!("c{connections:?}-{i}")));
                waiting.claim(&req(&key, LONG, LONG)).await
            }
        });
        let answers = futures_util::future::join_all(claims).await;
        let said = |what: &str| {
            answers
                .iter()
                .filter(|a| matches!(a, Err(StoreError::Unavailable(e)) if e.to_string().contains(what)))
                .count()
        };
        assert_eq!(
            (
                said("0 of 1 replicas acknowledged the claim"),
                said("stayed busy past the timeout")
            ),
            (unacknowledged, busy),
            "{connections:?} connections: {answers:?}"
        );
    }
}

/// `with_wait`: a write that waits sends its script and its `WAIT` in one pipeline, so a
/// script the server lacks still has its `WAIT` run (a whole timeout when replicas lag), and
/// the pair goes again once the script is loaded. The scripts that wait are therefore loaded
/// when the waiting connections open, and all together when a write finds one missing (a
/// restart, a failover, `SCRIPT FLUSH`): the first completion sends one `WAIT`, not two, and
/// after a flush only the first write that waits pays a second, not the first of each kind.
/// A claim that waits after a flush pays none: its first round trip (without `WAIT`) loads
/// its script before the re-ask. Counted on a server of the test's own, `WAIT`s per write:
/// [1, 2, 1, 1, 1, 2, 1] (loading each script alone when it was missing: [2, 2, 2, 1, 1, 2,
/// 2]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_a_missing_script_costs_one_extra_wait_once_not_once_per_script() {
    enum Write {
        Complete,
        Milestone,
        Claim,
    }
    let Some(server) = common::own_redis::OwnRedis::start(&[]) else {
        return;
    };
    let waits = || async {
        common::own_redis::calls(
            &common::own_redis::info(&server, "commandstats").await,
            "wait",
        )
    };
    let store = common::own_redis::store_on(&server.url(), Some("preload")).await;
    // No replica: each write is refused for it after its 50 ms `WAIT`, having landed.
    let waiting = store.clone().with_wait(1, Duration::from_millis(50));
    // (flush first, the write)
    let steps = [
        (false, Write::Complete),
        (true, Write::Milestone),
        (false, Write::Complete),
        (false, Write::Milestone),
        (true, Write::Claim),
        (false, Write::Complete),
        (false, Write::Milestone),
    ];
    let mut sent = Vec::new();
    for (i, (flush, write)) in steps.iter().enumerate() {
        // Claimed without waiting: the claim script is loaded, the others need not be.
        let key = ScopedKey::new("", unique(&format!("preload{i}")));
        let token = match write {
            Write::Claim => None,
            _ => Some(acquire(&store, &req(&key, LONG, LONG)).await),
        };
        if *flush {
            server
                .cmd(&["SCRIPT", "FLUSH"])
                .await
                .expect("SCRIPT FLUSH");
        }
        let before = waits().await;
        let refused = |e: &StoreError| e.to_string().contains("0 of 1");
        let written = match (write, token) {
            (Write::Complete, Some(token)) => waiting
                .complete(&key, token, &response("done"), LONG)
                .await
                .map(drop),
            (Write::Milestone, Some(token)) => waiting
                .record_milestone(&key, token, &Milestone::EffectStarted)
                .await
                .map(drop),
            _ => waiting.claim(&req(&key, LONG, LONG)).await.map(drop),
        };
        assert!(
            written.as_ref().is_err_and(refused),
            "write {i}: {written:?}"
        );
        sent.push(waits().await - before);
    }
    assert_eq!(
        sent,
        [1, 2, 1, 1, 1, 2, 1],
        "WAITs per write: completion; flush, milestone, completion, milestone; flush, claim, \
         completion, milestone"
    );
}

/// `with_waiting_connections` set far too high (a million, by mistake) opens 64, the most,
/// not a million inside a request: counted on a server of the test's own, the first write
/// that waits adds exactly 64 clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_waiting_connections_are_capped_at_64() {
    let Some(server) = common::own_redis::OwnRedis::start(&[]) else {
        return;
    };
    let clients = || common::own_redis::number(&server, "clients", "connected_clients");
    let store = common::own_redis::store_on(&server.url(), Some("wait-cap"))
        .await
        .with_wait(0, Duration::from_millis(100))
        .with_waiting_connections(1_000_000);
    let before = clients().await;
    let key = ScopedKey::new("", unique("cap"));
    let claimed = store.claim(&req(&key, LONG, LONG)).await;
    assert!(matches!(claimed, Ok(Claim::Acquired(_))), "{claimed:?}");
    // Exactly: an admin connection of an earlier count may still be closing.
    common::guard("64 waiting connections, no more", async {
        while clients().await - before != 64 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

/// `with_wait`: a write given up on mid-`WAIT` (its caller's future dropped, as a request's
/// when its client hangs up) leaves that `WAIT` blocking its connection on the server, so the
/// connection goes back to the pool only once a PING sent behind the `WAIT` is answered. On a
/// server of the test's own, four milestones hold the four connections in `WAIT`s of 3.5 s
/// (the server counts four blocked clients) and are then given up on. A fifth, sent then,
/// waits for a connection (at most 5 s), gets one as the first `WAIT` ends, and its own
/// `WAIT` answers "0 of 1" within its reply timeout. Lent a connection still blocked, it
/// queues behind the other write's `WAIT`, and its reply times out 5 s after it was sent,
/// before its own `WAIT` could end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_a_write_given_up_on_mid_wait_returns_its_connection_once_the_wait_ends() {
    let Some(server) = common::own_redis::OwnRedis::start(&[]) else {
        return;
    };
    let store = common::own_redis::store_on(&server.url(), Some("wait-dropped")).await;
    let waiting = store.clone().with_wait(1, Duration::from_millis(3500));
    let mut held = Vec::new();
    for i in 0..5 {
        let key = ScopedKey::new("", unique(&format!("dropped{i}")));
        let token = acquire(&store, &req(&key, LONG, LONG)).await;
        held.push((key, token));
    }
    let blocked = || common::own_redis::number(&server, "clients", "blocked_clients");
    let given_up: Vec<_> = held[..4]
        .iter()
        .map(|(key, token)| {
            let (waiting, key, token) = (waiting.clone(), key.clone(), *token);
            tokio::spawn(async move {
                waiting
                    .record_milestone(&key, token, &Milestone::EffectStarted)
                    .await
            })
        })
        .collect();
    common::guard("the four writes block in their WAITs", async {
        while blocked().await < 4 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    for write in &given_up {
        write.abort();
    }
    for write in given_up {
        assert!(write.await.is_err_and(|e| e.is_cancelled()), "given up on");
    }
    assert_eq!(
        blocked().await,
        4,
        "their WAITs still block their connections"
    );
    let (key, token) = &held[4];
    let fifth = waiting
        .record_milestone(key, *token, &Milestone::EffectStarted)
        .await;
    assert!(
        matches!(&fifth, Err(StoreError::Unavailable(e))
            if e.to_string().contains("0 of 1 replicas acknowledged the milestone")),
        "the fifth write ran on a connection of its own, its WAIT answered: {fifth:?}"
    );
}

/// `with_wait` with a timeout under a millisecond: Redis reads `WAIT n 0` as a wait without
/// end, so the store waits 1 ms at the least. On a server without a replica, a claim that
/// waits is refused "0 of 1" at once, not after the store's 5 s reply timeout as "timed out".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_a_wait_of_no_time_is_a_wait_of_one_millisecond_not_one_without_end() {
    let Some(store) = common::redis("wait-zero").await else {
        return;
    };
    for timeout in [Duration::ZERO, Duration::from_micros(500)] {
        let waiting = store.clone().with_wait(1, timeout);
        let key = ScopedKey::new("", unique("zero"));
        let claimed = waiting.claim(&req(&key, LONG, LONG)).await;
        assert!(
            matches!(&claimed, Err(StoreError::Unavailable(e))
                if e.to_string().contains("0 of 1 replicas acknowledged the claim")),
            "a WAIT of {timeout:?}: {claimed:?}"
        );
    }
}

/// The names a store writes in the server are part of its contract across versions: renamed,
/// every record written before an upgrade would be orphaned or unreadable, and a retry across
/// the upgrade would find nothing and run again. Pinned here:
/// - a record's keys for a known scope and key, under the default prefix and another: the
///   member is the scope's length in bytes, `:`, the scope and the key; the bucket is FNV-1a
///   of the member mod 64 (53 and 25 for these members, computed outside the crate);
/// - what a claim writes: the record alone, or with its bucket's pending set when the route
///   reconciles (a record to watch);
/// - the record's field names and its status's spelling;
/// - the channel the store's waiters hear, and what a completion publishes there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_the_names_a_store_writes_never_change() {
    let Some(store) = common::redis("names").await else {
        return;
    };
    assert_eq!(
        tower_idempotency::store::RedisStore::DEFAULT_PREFIX,
        "idempotency"
    );
    let rows = [
        ("tenant-a", "8:tenant-aorder-1", 53),
        ("tenant-\u{e9}", "9:tenant-\u{e9}order-1", 25),
    ];
    for prefix in ["idempotency", "shop"] {
        let named = store.clone().with_prefix(prefix).expect("prefix");
        for (scope, member, bucket) in rows {
            let [record, uncertain, pending, got] = named.keys(&ScopedKey::new(scope, "order-1"));
            assert_eq!(
                (
                    String::from_utf8_lossy(&record),
                    String::from_utf8_lossy(&uncertain),
                    String::from_utf8_lossy(&pending),
                    String::from_utf8_lossy(&got)
                ),
                (
                    format!("{prefix}:{{{bucket}}}:r:{member}").into(),
                    format!("{prefix}:{{{bucket}}}:u").into(),
                    format!("{prefix}:{{{bucket}}}:p").into(),
                    member.into()
                )
            );
        }
    }
    // Under a prefix of this run's own, so a record of another run is never met.
    let prefix = unique("names");
    let named = store.with_prefix(&prefix).expect("prefix");
    let mut conn = raw(&common::redis_url()).await;
    let lister = conn.clone();
    let written = |what: &'static str| {
        let (mut conn, prefix) = (lister.clone(), prefix.clone());
        async move {
            let mut found: Vec<String> = redis::cmd("KEYS")
                .arg(format!("{prefix}:*"))
                .query_async(&mut conn)
                .await
                .expect(what);
            found.sort();
            found
        }
    };
    let plain = ScopedKey::new("tenant-a", "order-1");
    let token = acquire(&named, &req(&plain, LONG, LONG)).await;
    let record = format!("{prefix}:{{53}}:r:8:tenant-aorder-1");
    assert_eq!(
        written("KEYS").await,
        vec![record.clone()],
        "a claim writes its record"
    );
    let fields: Vec<String> = redis::cmd("HKEYS")
        .arg(&record)
        .query_async(&mut conn)
        .await
        .expect("HKEYS");
    let mut fields = fields;
    fields.sort();
    assert_eq!(
        fields,
        [
            "at", "ca", "ea", "es", "fp", "hist", "ky", "lu", "roe", "sc", "st", "tok", "ua"
        ],
        "a claimed record's fields"
    );
    let status = |mut conn: redis::aio::MultiplexedConnection| {
        let record = record.clone();
        async move {
            let status: String = redis::cmd("HGET")
                .arg(&record)
                .arg("st")
                .query_async(&mut conn)
                .await
                .expect("HGET");
            status
        }
    };
    assert_eq!(status(conn.clone()).await, "in_progress");
    // A route that reconciles watches its record: the bucket's pending set holds it.
    let watched = ScopedKey::new("tenant-\u{e9}", "order-1");
    let mut reconciling = req(&watched, LONG, LONG);
    reconciling.on_lease_expiry = LeaseExpiry::Reconcile;
    acquire(&named, &reconciling).await;
    assert_eq!(
        written("KEYS").await,
        vec![
            format!("{prefix}:{{25}}:p"),
            format!("{prefix}:{{25}}:r:9:tenant-\u{e9}order-1"),
            record.clone(),
        ],
        "a claim on a reconciling route writes its record and its bucket's pending set"
    );
    // The waiters' channel, and what a completion says there: the record's member.
    let client = redis::Client::open(common::redis_url()).expect("client");
    let mut heard = client.get_async_pubsub().await.expect("pubsub");
    heard
        .subscribe(format!("{prefix}:changed"))
        .await
        .expect("SUBSCRIBE");
    named
        .complete(&plain, token, &response("done"), LONG)
        .await
        .expect("complete");
    let message = common::guard("the completion published", async {
        use futures_util::StreamExt;
        heard.on_message().next().await
    })
    .await
    .expect("a message");
    assert_eq!(message.get_payload_bytes(), b"8:tenant-aorder-1");
    assert_eq!(status(conn.clone()).await, "completed");
}

/// `with_wait`: the connections that wait for replicas are opened at the first write that
/// waits, together; when the server refuses some of them (its `maxclients` reached), the
/// opening fails whole. The claim that needed them is refused as unavailable (503, nothing
/// run) and given back, the connections that did open are closed, not kept or leaked, and
/// the next write that waits tries the opening again: with room on the server, it opens the
/// four and the same key is claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_a_pool_opening_refused_partway_refuses_the_claim_gives_it_back_and_leaks_nothing() {
    let Some(server) = common::own_redis::OwnRedis::start(&[]) else {
        return;
    };
    let clients = || common::own_redis::number(&server, "clients", "connected_clients");
    let store = common::own_redis::store_on(&server.url(), Some("pool-refused")).await;
    let waiting = store.clone().with_wait(0, Duration::from_millis(100));
    // The store's own connections up (a claim without waiting), then room for two more.
    let warm = ScopedKey::new("", unique("warm"));
    acquire(&store, &req(&warm, LONG, LONG)).await;
    let before = clients().await - 1; // the count's own admin connection closes after it
    let room = (before + 2).to_string();
    server
        .cmd(&["CONFIG", "SET", "maxclients", &room])
        .await
        .expect("CONFIG SET maxclients");
    let key = ScopedKey::new("", unique("refused"));
    let refused = waiting.claim(&req(&key, LONG, LONG)).await;
    assert!(
        matches!(&refused, Err(StoreError::Unavailable(e))
            if e.to_string().contains("the connections that wait for replicas could not be opened")),
        "{refused:?}"
    );
    common::guard("the claim given back", async {
        loop {
            let record = store.lookup(&key).await.expect("lookup");
            if record
                .as_ref()
                .is_some_and(|r| r.status == RecordStatus::Released)
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    common::guard("the connections that opened closed", async {
        while clients().await - 1 != before {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    server
        .cmd(&["CONFIG", "SET", "maxclients", "1000"])
        .await
        .expect("CONFIG SET maxclients");
    let claimed = waiting.claim(&req(&key, LONG, LONG)).await;
    assert!(matches!(claimed, Ok(Claim::Acquired(_))), "{claimed:?}");
    // Exactly: the admin connection of the `CONFIG SET` may still be closing.
    common::guard(
        "the pool opened whole on the next write that waits",
        async {
            while clients().await - 1 - before != 4 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        },
    )
    .await;
}

/// `with_wait`: a won claim is asked again for its replicas' acknowledgement, and, refused, is
/// given back on its first connection; the re-ask, stuck on a waiting connection, may land
/// after that, and after another request's claim of the key was given back in turn. It must
/// then write nothing: taking the released key anew would hold it for nobody. The re-ask is
/// sent here as the store sends it (the claim script with its ninth argument); without that
/// argument, the same call takes the key over, which is what a late re-ask used to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_a_late_re_ask_of_a_claim_given_back_writes_nothing() {
    let Some(store) = common::redis("late-re-ask").await else {
        return;
    };
    let key = ScopedKey::new("", unique("late"));
    let request = req(&key, LONG, LONG);
    // Another request's claim, given back: the key is released under its token.
    let theirs = acquire(&store, &request).await;
    store.release(&key, theirs).await.expect("release");
    let [record, uncertain, pending, member] = store.keys(&key);
    let script = redis::Script::new(store.claim_script());
    let mut conn = raw(&common::redis_url()).await;
    let stale = "424242"; // the re-asked claim's token, given back long ago
    let ask = |again: Option<&'static str>| {
        let mut invocation = script.key(&record[..]);
        invocation
            .key(&uncertain[..])
            .key(&pending[..])
            .arg(&member[..])
            .arg(request.fingerprint.as_bytes())
            .arg(stale)
            .arg(LONG.as_millis().to_string())
            .arg(LONG.as_millis().to_string())
            .arg("1")
            .arg(key.scope())
            .arg(key.key());
        if let Some(flag) = again {
            invocation.arg(flag);
        }
        invocation
    };
    let reply: redis::Value = ask(Some("1"))
        .invoke_async(&mut conn)
        .await
        .expect("re-ask");
    let won = match &reply {
        redis::Value::Array(parts) => parts.first().cloned(),
        _ => None,
    };
    assert_eq!(won, Some(redis::Value::Int(0)), "{reply:?}");
    let after = store.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(after.status, RecordStatus::Released, "{after:?}");
    assert_eq!(
        after.lease_token, theirs,
        "the record is still theirs: {after:?}"
    );
    assert_eq!(after.attempts, 1, "{after:?}");

    // The same call as a first claim (no ninth argument) takes the released key over.
    let reply: redis::Value = ask(None).invoke_async(&mut conn).await.expect("claim");
    let after = store.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(
        (after.status, after.attempts),
        (RecordStatus::InProgress, 2),
        "{reply:?}"
    );
}

/// The same with a WAIT timeout asked past the connection's 5 s response timeout: it is kept
/// under it, and unrelated operations never fail while Redis is healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_with_wait_longer_than_5s_fails_no_unrelated_operation() {
    let Some(store) = common::redis("wait-hol-long").await else {
        return;
    };
    let waiting = store.clone().with_wait(1, Duration::from_secs(8));
    let a = ScopedKey::new("", unique("a"));
    // Claimed without waiting (a claim that waits would fail first, with no replica).
    let token = acquire(&store, &req(&a, LONG, LONG)).await;
    let completing = {
        let waiting = waiting.clone();
        let a = a.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let r = waiting.complete(&a, token, &response("a"), LONG).await;
            (r, started.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let b = ScopedKey::new("", unique("b"));
    let started = Instant::now();
    let claimed = store.claim(&req(&b, LONG, LONG)).await;
    let took = started.elapsed();
    let (completed, complete_took) = completing.await.expect("task");
    println!(
        "unrelated claim: {:?} after {took:?}; the waiting completion: {:?} after {complete_took:?}",
        claimed.as_ref().map(|_| ()).map_err(|e| e.to_string()),
        completed.as_ref().map_err(|e| e.to_string())
    );
    assert!(
        claimed.is_ok(),
        "an unrelated claim failed while Redis was healthy: {:?}",
        claimed.err()
    );
}

/// The subscription of a store that waited once ends with the store: its connection leaves
/// the channel at the next heartbeat after every clone is dropped, with no message needed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_the_subscription_ends_with_its_store() {
    let Some(store) = common::redis("dropped").await else {
        return;
    };
    let prefix = format!("{:?}", store);
    let prefix = prefix
        .split("prefix: \"")
        .nth(1)
        .and_then(|p| p.split('"').next())
        .expect("prefix in Debug")
        .to_owned();
    let channel = format!("{prefix}:changed");
    let conn = raw(&common::redis_url()).await;
    let numsub = |mut conn: redis::aio::MultiplexedConnection, channel: String| async move {
        let v: Vec<redis::Value> = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(&channel)
            .query_async(&mut conn)
            .await
            .expect("numsub");
        match &v[1] {
            redis::Value::Int(n) => *n,
            other => panic!("{other:?}"),
        }
    };
    // One wait starts the subscription.
    let key = ScopedKey::new("", unique("k"));
    let seen = InFlight {
        token: FencingToken::new(1),
        lease_until: SystemTime::now(),
        now: SystemTime::now(),
    };
    store
        .wait_for_change(&key, &seen, 0, Duration::from_millis(1))
        .await;
    for _ in 0..50 {
        if numsub(conn.clone(), channel.clone()).await == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(numsub(conn.clone(), channel.clone()).await, 1, "subscribed");
    drop(store);
    // The subscription notices at its next heartbeat, with no message on its channel.
    let mut left = 1;
    for _ in 0..100 {
        left = numsub(conn.clone(), channel.clone()).await;
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        left, 0,
        "a dropped store still holds a subscribed connection"
    );
}

/// A record damaged by hand (a non-numeric lease end on an in-progress record whose effect
/// started) is "not an error of the listing" per the trait docs: it is reported unreadable,
/// and listing and counting go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_one_damaged_record_is_reported_not_fatal() {
    let Some(store) = common::redis("damaged").await else {
        return;
    };
    // A healthy uncertain record, which an operator must still see.
    let good = ScopedKey::new("", unique("good"));
    let t = acquire(&store, &req(&good, LONG, LONG)).await;
    store.mark_uncertain(&good, t).await.expect("uncertain");
    // A damaged one: effect started, then its lease end overwritten.
    let bad = ScopedKey::new("", unique("bad"));
    let t = acquire(&store, &req(&bad, Duration::from_millis(100), LONG)).await;
    store
        .record_milestone(&bad, t, &Milestone::EffectStarted)
        .await
        .expect("milestone");
    let [record_key, ..] = store.keys(&bad);
    let mut conn = raw(&common::redis_url()).await;
    let _: i64 = redis::cmd("HSET")
        .arg(&record_key[..])
        .arg("lu")
        .arg("not-a-number")
        .query_async(&mut conn)
        .await
        .expect("hset");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let listed = store.list_uncertain(&UncertainQuery::first(100)).await;
    let counted = store.count_uncertain().await;
    println!(
        "list: {:?}",
        listed
            .as_ref()
            .map(|p| (p.records.len(), p.unreadable.len()))
            .map_err(|e| e.to_string())
    );
    println!("count: {:?}", counted.as_ref().map_err(|e| e.to_string()));
    let page = listed.expect("a damaged record is not an error of the listing");
    assert!(
        page.records.iter().any(|r| r.key == good),
        "the healthy record is listed"
    );
    counted.expect("count");
}

/// Index entries without a record (deleted by hand, or evicted under an allkeys policy) do not
/// use up a bucket's page: the listing reads on, and no live record is skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_dangling_index_entries_hide_no_record() {
    let Some(store) = common::redis("dangling").await else {
        return;
    };
    // Find keys in one bucket: 3 to dangle, 1 to keep, and one in another bucket, newer.
    let bucket = |k: &ScopedKey| String::from_utf8_lossy(&store.keys(k)[1]).into_owned();
    let first = ScopedKey::new("", unique("d0"));
    let mut same = vec![first.clone()];
    let mut other = None;
    let mut i = 0;
    while same.len() < 4 || other.is_none() {
        i += 1;
        let k = ScopedKey::new("", format!("{}-{i}", first.key()));
        if bucket(&k) == bucket(&first) {
            if same.len() < 4 {
                same.push(k);
            }
        } else if other.is_none() {
            other = Some(k);
        }
    }
    let other = other.expect("other");
    for k in same.iter().chain(std::iter::once(&other)) {
        let t = acquire(&store, &req(k, LONG, LONG)).await;
        store.mark_uncertain(k, t).await.expect("uncertain");
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    let mut conn = raw(&common::redis_url()).await;
    for k in &same[..3] {
        let _: i64 = redis::cmd("DEL")
            .arg(&store.keys(k)[0][..])
            .query_async(&mut conn)
            .await
            .expect("del");
    }
    // Two records remain: same[3] (older) and other. Page by 3.
    let mut seen = Vec::new();
    let mut query = UncertainQuery::first(3);
    loop {
        let page = store.list_uncertain(&query).await.expect("list");
        seen.extend(page.records.iter().map(|r| r.key.key().to_owned()));
        match page.next {
            Some(next) => query = UncertainQuery::after(next, 3),
            None => break,
        }
    }
    println!("listed {seen:?}");
    assert!(
        seen.contains(&same[3].key().to_owned()),
        "a live uncertain record was never listed"
    );
    assert!(seen.contains(&other.key().to_owned()));
}

/// Keys and scopes with braces, colons, NUL, non-ASCII, a long one: claimed, listed (with the
/// cursor built from them), resolved, replayed, each separately.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_odd_keys_round_trip_through_every_operation() {
    for cluster in [false, true] {
        let store = match cluster {
            false => common::redis("odd").await,
            true => common::redis_cluster("odd").await,
        };
        let Some(store) = store else {
            return;
        };
        let tag = unique("");
        let long = "k".repeat(200_000);
        let odd: Vec<(String, String)> = vec![
            (String::new(), format!("{{x}}{tag}")),
            ("{".into(), format!("}}{tag}")),
            ("}".into(), format!("{{{tag}")),
            ("1:".into(), format!("a{tag}")),
            ("1".into(), format!(":a{tag}")),
            (String::new(), format!("1:a{tag}")),
            ("\0".into(), format!("\0{tag}")),
            ("é".into(), format!("✓\u{10ffff}{tag}")),
            ("10".into(), tag.to_string()),
            ("9".into(), tag.to_string()),
            ("t".into(), format!("{long}{tag}")),
            ("%d".into(), format!(":{{1}}:u{tag}")),
        ];
        let keys: Vec<ScopedKey> = odd.iter().map(|(s, k)| ScopedKey::new(s, k)).collect();
        let mut tokens = Vec::new();
        for k in &keys {
            let t = acquire(&store, &req(k, LONG, LONG)).await;
            store.mark_uncertain(k, t).await.expect("uncertain");
            tokens.push(t);
        }
        // Each is distinct, and a second claim sees it.
        for k in &keys {
            match store.claim(&req(k, LONG, LONG)).await.expect("claim") {
                Claim::Existing { record, .. } => {
                    assert_eq!(record.status, RecordStatus::NeedsReconciliation);
                    assert_eq!(record.key, *k);
                }
                other => panic!("{cluster}: a second claim of {:?}: {other:?}", k.key()),
            }
        }
        // Paged one at a time both ways: exactly our keys (plus none of theirs).
        let ours: BTreeSet<(String, String)> = odd.iter().cloned().collect();
        for newest in [false, true] {
            let mut got = Vec::new();
            let mut q = UncertainQuery::first(1);
            if newest {
                q = q.newest_first();
            }
            loop {
                let page = store.list_uncertain(&q).await.expect("list");
                assert!(page.unreadable.is_empty(), "{:?}", page.unreadable);
                got.extend(
                    page.records
                        .iter()
                        .map(|r| (r.key.scope().to_owned(), r.key.key().to_owned())),
                );
                match page.next {
                    Some(next) => {
                        q = UncertainQuery::after(next, 1);
                        if newest {
                            q = q.newest_first();
                        }
                    }
                    None => break,
                }
                assert!(got.len() <= 100, "the listing loops");
            }
            let set: BTreeSet<_> = got.iter().cloned().collect();
            assert_eq!(
                set.len(),
                got.len(),
                "{cluster} newest={newest}: a key listed twice"
            );
            assert_eq!(set, ours, "{cluster} newest={newest}");
        }
        let count = store.count_uncertain().await.expect("count");
        assert_eq!(count.count as usize, keys.len(), "{cluster}: count");
        for (k, t) in keys.iter().zip(&tokens) {
            store
                .resolve(
                    k,
                    *t,
                    &Resolution::Applied(Box::new(response(k.key()))),
                    LONG,
                    Some("n\0;{}"),
                )
                .await
                .expect("resolve");
            let r = store.lookup(k).await.expect("lookup").expect("record");
            assert_eq!(r.status, RecordStatus::Completed);
            assert_eq!(
                r.response.and_then(|r| r.body).as_deref(),
                Some(k.key().as_bytes())
            );
            assert_eq!(r.resolution_note.as_deref(), Some("n\0;{}"));
        }
        assert_eq!(store.count_uncertain().await.expect("count").count, 0);
    }
}

/// Durations the layer never sends but the store API takes: `Duration::MAX`, zero, sub-ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_extreme_durations() {
    let Some(store) = common::redis("durations").await else {
        return;
    };
    let k = ScopedKey::new("", unique("max"));
    let t = acquire(&store, &req(&k, Duration::MAX, Duration::MAX)).await;
    let r = store.lookup(&k).await.expect("lookup").expect("record");
    println!(
        "lease_until {:?}, expires_at {:?}",
        r.lease_until, r.expires_at
    );
    assert!(r.lease_until > SystemTime::now() + Duration::from_secs(100 * 365 * 86400));
    assert!(r.expires_at >= r.lease_until);
    let until = store.renew(&k, t, Duration::MAX).await.expect("renew");
    assert!(until > SystemTime::now() + Duration::from_secs(100 * 365 * 86400));
    store
        .complete(&k, t, &response("max"), Duration::MAX)
        .await
        .expect("complete");
    let r = store.lookup(&k).await.expect("lookup").expect("record");
    assert_eq!(r.status, RecordStatus::Completed);
    // Zero lease: taken over at once by the next claim (lease over), attempt 2.
    let z = ScopedKey::new("", unique("zero"));
    let t1 = acquire(&store, &req(&z, Duration::ZERO, LONG)).await;
    let t2 = acquire(&store, &req(&z, Duration::ZERO, LONG)).await;
    assert_ne!(t1, t2);
    assert!(matches!(
        store.complete(&z, t1, &response("z"), LONG).await,
        Err(StoreError::Fenced)
    ));
    // Sub-millisecond TTL on completion: it expires, and a lookup says so.
    let s = ScopedKey::new("", unique("sub"));
    let t = acquire(&store, &req(&s, LONG, LONG)).await;
    store
        .complete(&s, t, &response("s"), Duration::from_micros(500))
        .await
        .expect("complete");
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(store.lookup(&s).await.expect("lookup").is_none(), "expired");
    // TTL expiry of a completed record: the next claim is a fresh attempt 1.
    match store.claim(&req(&s, LONG, LONG)).await.expect("claim") {
        Claim::Acquired(lease) => assert_eq!(lease.attempt, 1),
        other => panic!("{other:?}"),
    }
}

/// Many records changed in the same milliseconds, spread over every bucket, paged through with
/// odd limits both ways on one server and on the cluster: every record once, in order; count
/// agrees; a cursor whose record has changed since still pages on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_paging_many_records_changed_in_the_same_millisecond() {
    for cluster in [false, true] {
        let store = match cluster {
            false => common::redis("paging").await,
            true => common::redis_cluster("paging").await,
        };
        let Some(store) = store else {
            return;
        };
        let store = Arc::new(store);
        let tag = unique("p");
        let n = 400;
        let keys: Vec<ScopedKey> = (0..n)
            .map(|i| ScopedKey::new(["", "a", "bb"][i % 3], format!("{tag}-{i}")))
            .collect();
        let mut tokens = Vec::new();
        for k in &keys {
            tokens.push(acquire(store.as_ref(), &req(k, LONG, LONG)).await);
        }
        // Uncertain in bursts, so many share a millisecond.
        let tasks: Vec<_> = keys
            .iter()
            .zip(&tokens)
            .map(|(k, t)| {
                let (store, k, t) = (store.clone(), k.clone(), *t);
                tokio::spawn(async move { store.mark_uncertain(&k, t).await })
            })
            .collect();
        for t in tasks {
            t.await.expect("task").expect("uncertain");
        }
        let all = |newest: bool, limit: usize| {
            let store = store.clone();
            async move {
                let mut got = Vec::new();
                let mut q = UncertainQuery::first(limit);
                if newest {
                    q = q.newest_first();
                }
                loop {
                    let page = store.list_uncertain(&q).await.expect("list");
                    got.extend(page.records.iter().map(|r| (r.updated_at, r.key.clone())));
                    match page.next {
                        Some(next) => {
                            q = UncertainQuery::after(next, limit);
                            if newest {
                                q = q.newest_first();
                            }
                        }
                        None => break,
                    }
                }
                got
            }
        };
        let mut ms = BTreeSet::new();
        for limit in [1, 7, 64, 65, 399, 400, 1000] {
            for newest in [false, true] {
                let got = all(newest, limit).await;
                let keys_got: BTreeSet<_> = got.iter().map(|(_, k)| k.clone()).collect();
                assert_eq!(
                    keys_got.len(),
                    got.len(),
                    "{cluster} {limit} {newest}: listed twice"
                );
                assert_eq!(got.len(), n, "{cluster} limit {limit} newest {newest}");
                for w in got.windows(2) {
                    if newest {
                        assert!(w[0].0 >= w[1].0, "order");
                    } else {
                        assert!(w[0].0 <= w[1].0, "order");
                    }
                }
                ms.extend(got.iter().map(|(t, _)| *t));
            }
        }
        println!(
            "{cluster}: {n} records over {} distinct milliseconds",
            ms.len()
        );
        assert_eq!(
            store.count_uncertain().await.expect("count").count as usize,
            n
        );
        // A cursor from a record that changes between pages: the rest still page exactly once.
        let page = store
            .list_uncertain(&UncertainQuery::first(10))
            .await
            .expect("list");
        let cursor = page.next.expect("full page");
        let last = page.records.last().expect("records").key.clone();
        let i = keys.iter().position(|k| *k == last).expect("ours");
        store
            .resolve(&last, tokens[i], &Resolution::NotApplied, LONG, None)
            .await
            .expect("resolve");
        let mut rest = Vec::new();
        let mut q = UncertainQuery::after(cursor, 13);
        loop {
            let page = store.list_uncertain(&q).await.expect("list");
            rest.extend(page.records.iter().map(|r| r.key.clone()));
            match page.next {
                Some(next) => q = UncertainQuery::after(next, 13),
                None => break,
            }
        }
        assert_eq!(
            rest.len(),
            n - 10,
            "{cluster}: the rest after a changed cursor"
        );
        assert_eq!(
            store.count_uncertain().await.expect("count").count as usize,
            n - 1
        );
    }
}

/// A resolution racing the holder's late completion (both with the holder's token): exactly
/// one wins, and the record ends in the winner's outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_resolve_races_a_late_complete() {
    let Some(store) = common::redis("race").await else {
        return;
    };
    let store = Arc::new(store);
    let mut outcomes = [0usize; 3];
    for i in 0..200 {
        let k = ScopedKey::new("", unique(&format!("race-{i}")));
        let t = acquire(store.as_ref(), &req(&k, LONG, LONG)).await;
        store.mark_uncertain(&k, t).await.expect("uncertain");
        let (s1, k1) = (store.clone(), k.clone());
        let (s2, k2) = (store.clone(), k.clone());
        let complete =
            tokio::spawn(async move { s1.complete(&k1, t, &response("holder"), LONG).await });
        let resolve = tokio::spawn(async move {
            s2.resolve(&k2, t, &Resolution::NotApplied, LONG, Some("op"))
                .await
        });
        let (c, r) = (complete.await.expect("c"), resolve.await.expect("r"));
        let rec = store.lookup(&k).await.expect("lookup");
        match (c.is_ok(), r.is_ok()) {
            (true, false) => {
                outcomes[0] += 1;
                assert_eq!(rec.expect("record").status, RecordStatus::Completed);
            }
            (false, true) => {
                outcomes[1] += 1;
                assert!(matches!(c, Err(StoreError::Fenced)));
                assert!(rec.is_none_or(|r| r.status == RecordStatus::Released));
            }
            (true, true) => {
                let _ = outcomes[2];
                panic!("both won: {:?}", rec.map(|r| r.status));
            }
            (false, false) => panic!("neither: {c:?} {r:?}"),
        }
    }
    println!("complete won {}, resolve won {}", outcomes[0], outcomes[1]);
}

/// `wait_for_change` on the cluster, keys on every master: woken by the completion (well
/// before the lease end), not polling and not sleeping to the lease end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_cluster_waiters_are_woken_on_every_master() {
    for cluster in [false, true] {
        let store = match cluster {
            false => common::redis("wake").await,
            true => common::redis_cluster("wake").await,
        };
        let Some(store) = store else {
            return;
        };
        // Start the subscription.
        let warm = ScopedKey::new("", unique("warm"));
        let seen0 = InFlight {
            token: FencingToken::new(1),
            lease_until: SystemTime::now(),
            now: SystemTime::now(),
        };
        store
            .wait_for_change(&warm, &seen0, 0, Duration::ZERO)
            .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut worst = Duration::ZERO;
        for i in 0..24 {
            let k = ScopedKey::new("", unique(&format!("w{i}")));
            let lease = Duration::from_secs(8);
            let t = acquire(&store, &req(&k, lease, LONG)).await;
            let Claim::Existing { record, now } =
                store.claim(&req(&k, lease, LONG)).await.expect("c")
            else {
                panic!("in flight");
            };
            let seen = InFlight {
                token: record.lease_token,
                lease_until: record.lease_until,
                now,
            };
            let s = store.clone();
            let k2 = k.clone();
            let waiter = tokio::spawn(async move {
                let started = Instant::now();
                s.wait_for_change(&k2, &seen, 0, Duration::from_secs(10))
                    .await;
                started.elapsed()
            });
            tokio::time::sleep(Duration::from_millis(100)).await;
            let done = Instant::now();
            store
                .complete(&k, t, &response("x"), LONG)
                .await
                .expect("complete");
            let waited = waiter.await.expect("waiter");
            let after = waited.saturating_sub(Duration::from_millis(100));
            worst = worst.max(after);
            let _ = done;
        }
        println!("cluster={cluster}: worst wake after completion {worst:?}");
        assert!(
            worst < Duration::from_secs(1),
            "cluster={cluster}: a waiter was not woken ({worst:?})"
        );
    }
}

/// A listing asked for "everything" (`usize::MAX`, or any limit of 10^17 and more, as a
/// sweeper's `batch` may be set) lists a bounded page and a cursor, as MemoryStore does,
/// instead of failing on a limit Lua cannot hand back to Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s21_a_huge_listing_limit() {
    let Some(store) = common::redis("limit").await else {
        return;
    };
    let k = ScopedKey::new("", unique("lim"));
    let t = acquire(&store, &req(&k, LONG, LONG)).await;
    store.mark_uncertain(&k, t).await.expect("uncertain");
    let memory = tower_idempotency::MemoryStore::new();
    let t = acquire(&memory, &req(&k, LONG, LONG)).await;
    memory.mark_uncertain(&k, t).await.expect("uncertain");
    for limit in [
        99_999_999_999_999usize,
        10_000_000_000_000_000,
        100_000_000_000_000_000,
        1 << 62,
        usize::MAX,
    ] {
        let m = memory.list_uncertain(&UncertainQuery::first(limit)).await;
        let r = store.list_uncertain(&UncertainQuery::first(limit)).await;
        println!(
            "limit {limit}: memory {:?}, redis {:?}",
            m.as_ref()
                .map(|p| p.records.len())
                .map_err(|e| e.to_string()),
            r.as_ref()
                .map(|p| p.records.len())
                .map_err(|e| e.to_string())
        );
        assert_eq!(r.expect("redis lists").records.len(), 1, "limit {limit}");
    }
}
