//! Adversarial review: `RedisStore` under server-side faults real deployments see, each on a
//! redis-server of the test's own (a free port, nothing on disk, killed by a Drop guard), so
//! that killing connections, sleeping, evicting and reconfiguring touch no other test.
//!
//! Effects are counted at a sink in the handler (after its work, past any gate the test
//! holds it at), never from responses. Every wait is bounded (`common::guard`, the client's
//! 30 s timeout, bounded polling loops).

use crate::common;

use std::time::Duration;

use common::valve::Valve;
use common::{guard, serve};
use tower_idempotency::IdempotencyStore;
use tower_idempotency::store::ScopedKey;

use common::own_redis::*;

// ==== 1. A server host that dies without closing its connections ================================

/// DESIGN §7.10 ("Store down -> fail closed (503/UNAVAILABLE), nothing executed, recovery when
/// it returns") and README (Redis: "The connection reconnects by itself"). Fault: the store's
/// established connection goes silent without closing (its host powered off or frozen, or a
/// failover moved the address to a replica: no FIN, no RST), while a new connection to the
/// same address works. The subscription has a heartbeat for exactly this; the command
/// connection must not stay stuck on the dead link either: a request may fail closed (503)
/// while the store finds out, but within three requests one must run, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_10_a_silently_dead_command_connection_is_replaced() {
    let Some(server) = OwnRedis::start(&[]) else {
        return;
    };
    // Links made before the freeze stop carrying anything either way while staying open (a
    // host powered off, a VM frozen, a failover that moved the address: no FIN, no RST); new
    // links work.
    let hole = Valve::start(server.addr()).await;
    let store = store_on(&hole.url(), Some("hole")).await;
    let sink = Sink::open("hole", false);
    let addr = serve(app(store, &sink, &Knobs::default())).await;
    let warm = send(addr, &unique("warm")).await;
    assert!(warm.live_201(), "warm-up: {warm:?}");

    hole.freeze();
    let key = unique("after-freeze");
    let mut answers = Vec::new();
    for _ in 0..3 {
        let a = send(addr, &key).await;
        let done = a.status == 201;
        answers.push(a);
        if done {
            break;
        }
    }
    println!("after the freeze: {answers:?}");
    for a in &answers {
        assert!(
            a.status == 201 || a.status == 503,
            "an answer other than 201 or 503: {a:?}"
        );
    }
    assert!(
        sink.effects.count() <= 2,
        "the key ran twice: {}",
        sink.effects.count()
    );
    assert!(
        answers.iter().any(|a| a.status == 201),
        "the server answers on every new connection, but three requests in a row failed \
         closed on the dead one: {answers:?}"
    );
}

// ==== 2. CLIENT KILL at every step =============================================================

/// DESIGN §1 steps 5-9, §4 and §7.10 on a store on db 3 (`redis://host:port/3`). Fault: the
/// server kills the store's connections (`CLIENT KILL TYPE normal`, as an operator, a proxy
/// restart or `timeout` does) right before each step: the claim, `effect_started()`, the
/// completion, a replay, and a `SCRIPT FLUSH` (a failover to a replica with an empty script
/// cache) before a claim. Each key's effect happens once, retries replay the first answer,
/// and after every reconnection the records are still written to db 3, never db 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_connections_killed_at_every_step_run_each_key_once_on_its_own_db() {
    let Some(server) = OwnRedis::start(&[]) else {
        return;
    };
    let store = store_on(&format!("{}/3", server.url()), Some("kills")).await;
    let sink = Sink::new("kills", true);
    let addr = serve(app(store.clone(), &sink, &Knobs::default())).await;
    let mut surprises = Vec::new();

    // (a) Killed while idle, then a claim.
    sink.gate_a.add_permits(1);
    sink.gate_b.add_permits(1);
    let k1 = unique("k1");
    let n = server.kill("normal").await;
    assert!(n >= 1, "the store's connection was found and killed");
    let a1 = send(addr, &k1).await;
    if !a1.live_201() {
        surprises.push(format!("claim right after a kill: {a1:?}"));
    }

    // (b) Killed while the handler runs, before `effect_started()`.
    let k2 = unique("k2");
    let before = sink.runs.count();
    let k = k2.clone();
    let first2 = tokio::spawn(async move { send(addr, &k).await });
    started(&sink, before + 1).await;
    server.kill("normal").await;
    sink.gate_a.add_permits(1);
    sink.gate_b.add_permits(1);
    let a2 = guard("k2", first2).await.expect("task");
    println!(
        "k2 first: {a2:?}; milestones {:?}",
        sink.milestones.lock().expect("lock")
    );
    if !a2.live_201() {
        surprises.push(format!("effect_started() right after a kill: {a2:?}"));
        // The handler did nothing: a retry may run it (once).
        sink.gate_a.add_permits(1);
        sink.gate_b.add_permits(1);
    }

    // (c) Killed while the handler runs, after its milestone: the completion meets the kill.
    let k3 = unique("k3");
    let before = sink.runs.count();
    let k = k3.clone();
    sink.gate_a.add_permits(1);
    let first3 = tokio::spawn(async move { send(addr, &k).await });
    started(&sink, before + 1).await;
    common::until("the milestone", || {
        sink.milestones.lock().expect("lock").len() > before
    })
    .await;
    server.kill("normal").await;
    sink.gate_b.add_permits(1);
    let a3 = guard("k3", first3).await.expect("task");
    assert!(a3.live_201(), "the holder answers its client: {a3:?}");

    // (d) Killed, then replays.
    server.kill("normal").await;
    let r1 = settled(addr, &k1).await;
    server.kill("normal").await;
    let r3 = settled(addr, &k3).await;
    assert!(
        r3.replay_201() && r3.body == a3.body,
        "k3 replay {r3:?} vs {a3:?}"
    );
    if a1.live_201() {
        assert!(
            r1.replay_201() && r1.body == a1.body,
            "k1 replay {r1:?} vs {a1:?}"
        );
    }
    let r2 = settled(addr, &k2).await;
    assert_eq!(r2.status, 201, "k2 ends with its answer: {r2:?}");

    // (e) The script cache flushed, then the connections killed, then a claim.
    server.cmd(&["SCRIPT", "FLUSH"]).await.expect("flush");
    server.kill("normal").await;
    let k5 = unique("k5");
    sink.gate_a.add_permits(1);
    sink.gate_b.add_permits(1);
    let a5 = settled(addr, &k5).await;
    let r5 = settled(addr, &k5).await;
    assert!(
        a5.status == 201 && r5.replay_201() && r5.body == a5.body,
        "k5 {a5:?} then {r5:?}"
    );

    println!("surprises: {surprises:?}");
    assert_eq!(
        sink.effects.count(),
        4,
        "k1, k2, k3, k5 once each at the sink"
    );
    // Every record where its URL said, after all the reconnections.
    for k in [&k1, &k2, &k3, &k5] {
        let rec = store.lookup(&ScopedKey::new("", k.as_str())).await;
        assert!(matches!(rec, Ok(Some(_))), "{k}: {rec:?}");
    }
    let db0 = server.cmd_on(0, &["DBSIZE"]).await.expect("dbsize 0");
    let db3 = server.cmd_on(3, &["DBSIZE"]).await.expect("dbsize 3");
    assert_eq!(db0, redis::Value::Int(0), "nothing written to db 0");
    assert!(
        matches!(db3, redis::Value::Int(n) if n >= 4),
        "db 3: {db3:?}"
    );
}

// ==== 3. The subscription killed as the outcome is published ===================================

/// DESIGN §5 ("Stores can wake waiters when a record changes ... Redis pub/sub") and README
/// (`wait_for_in_flight`: waiters are woken by the store, by pub/sub on Redis). Fault: the
/// server kills the stores' subscription connections (`CLIENT KILL TYPE pubsub`) and command
/// connections again and again (every 60 ms, ten times) around the moment the holder's outcome
/// is written and published, so the notification is lost. Waiters on two nodes must still
/// reach the replay of the first answer, none hangs, and the effect happens once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_waiters_reach_the_replay_when_the_subscription_is_killed_at_the_completion() {
    let Some(server) = OwnRedis::start(&[]) else {
        return;
    };
    let prefix = "subkill";
    let knobs = Knobs {
        lease: Duration::from_secs(5),
        wait: Some(Duration::from_secs(20)),
        external: false,
    };
    let sink = Sink::new("subkill", false);
    sink.gate_a.add_permits(10_000);
    let node1 = serve(app(
        store_on(&server.url(), Some(prefix)).await,
        &sink,
        &knobs,
    ))
    .await;
    let node2 = serve(app(
        store_on(&server.url(), Some(prefix)).await,
        &sink,
        &knobs,
    ))
    .await;
    // Warm both subscriptions: one wait on each node.
    for node in [node1, node2] {
        let warm = unique("warm");
        let w = warm.clone();
        let before = sink.runs.count();
        let holder = tokio::spawn(async move { send(node, &w).await });
        started(&sink, before + 1).await;
        let w = warm.clone();
        let waiter = tokio::spawn(async move { send(node, &w).await });
        tokio::time::sleep(ms(200)).await;
        sink.gate_b.add_permits(1);
        guard("warm holder", holder).await.expect("task");
        guard("warm waiter", waiter).await.expect("task");
    }
    let effects_before = sink.effects.count();
    tokio::time::sleep(ms(300)).await;

    let key = unique("k");
    let runs_before = sink.runs.count();
    let k = key.clone();
    let holder = tokio::spawn(async move { send(node1, &k).await });
    started(&sink, runs_before + 1).await;
    let waiters: Vec<_> = (0..6)
        .map(|i| {
            let (node, k) = (if i % 2 == 0 { node1 } else { node2 }, key.clone());
            tokio::spawn(async move { send(node, &k).await })
        })
        .collect();
    tokio::time::sleep(ms(400)).await;
    let mut killed = 0;
    for i in 0..10 {
        killed += server.kill("pubsub").await;
        if i == 3 {
            sink.gate_b.add_permits(1);
        }
        if i % 3 == 0 {
            server.kill("normal").await;
        }
        tokio::time::sleep(ms(60)).await;
    }
    println!("subscriptions killed: {killed}");
    let first = guard("holder", holder).await.expect("task");
    assert!(first.live_201(), "holder {first:?}");
    let mut answers = Vec::new();
    for w in waiters {
        answers.push(guard("waiter", w).await.expect("task"));
    }
    println!("waiters: {answers:?}");
    // A waiter might have got the holder's key back only if the holder gave it back: it did
    // not, so every waiter replays (or, at worst, is told 409 / 503 - never a run).
    for a in &answers {
        assert!(
            (a.replay_201() && a.body == first.body) || a.status == 409 || a.status == 503,
            "a waiter got {a:?}, the first answered {first:?}"
        );
    }
    assert!(
        answers.iter().filter(|a| a.replay_201()).count() >= 4,
        "waiters on a live store, with a 20 s wait, mostly did not reach the replay: {answers:?}"
    );
    assert_eq!(
        sink.effects.count(),
        effects_before + 1,
        "the key's effect once at the sink"
    );
    assert!(killed >= 1, "a subscription was killed");
}

// ==== 4. Databases on one server =============================================================

/// DESIGN §1 step 2 / §5 and README (`redis://host[:port][/db]`). Fault: two deployments on
/// one server, on db 3 and db 5, both with the default prefix, so both publish their changes
/// on the one server-wide channel `idempotency:changed` (pub/sub ignores databases). The same
/// key is in flight on both; db 5's holder finishes first, waking db 3's waiters with db 5's
/// event. Each waiter must replay its own database's first answer, never the other's, and each
/// database runs the key once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_waiters_on_db_3_never_replay_db_5s_answer() {
    let Some(server) = OwnRedis::start(&[]) else {
        return;
    };
    let knobs = Knobs {
        lease: Duration::from_secs(5),
        wait: Some(Duration::from_secs(20)),
        external: false,
    };
    let sink3 = Sink::new("db3", false);
    let sink5 = Sink::new("db5", false);
    for s in [&sink3, &sink5] {
        s.gate_a.add_permits(10_000);
    }
    let a3 = serve(app(
        store_on(&format!("{}/3", server.url()), None).await,
        &sink3,
        &knobs,
    ))
    .await;
    let a5 = serve(app(
        store_on(&format!("{}/5", server.url()), None).await,
        &sink5,
        &knobs,
    ))
    .await;
    let key = unique("shared");
    let k = key.clone();
    let h3 = tokio::spawn(async move { send(a3, &k).await });
    let k = key.clone();
    let h5 = tokio::spawn(async move { send(a5, &k).await });
    started(&sink3, 1).await;
    started(&sink5, 1).await;
    let w3: Vec<_> = (0..4)
        .map(|_| {
            let k = key.clone();
            tokio::spawn(async move { send(a3, &k).await })
        })
        .collect();
    let w5: Vec<_> = (0..4)
        .map(|_| {
            let k = key.clone();
            tokio::spawn(async move { send(a5, &k).await })
        })
        .collect();
    tokio::time::sleep(ms(400)).await;
    sink5.gate_b.add_permits(1);
    let first5 = guard("h5", h5).await.expect("task");
    tokio::time::sleep(ms(300)).await;
    sink3.gate_b.add_permits(1);
    let first3 = guard("h3", h3).await.expect("task");
    assert!(
        first3.live_201() && first5.live_201(),
        "{first3:?} {first5:?}"
    );
    for (waiters, first, other) in [(w3, &first3, &first5), (w5, &first5, &first3)] {
        for w in waiters {
            let a = guard("waiter", w).await.expect("task");
            assert!(
                a.body != other.body,
                "a waiter replayed the other database's answer: {a:?}"
            );
            assert!(
                (a.replay_201() && a.body == first.body) || a.status == 409,
                "waiter {a:?}, its first {first:?}"
            );
        }
    }
    assert_eq!(sink3.effects.count(), 1, "db 3 ran the key once");
    assert_eq!(sink5.effects.count(), 1, "db 5 ran the key once");
}

// ==== 5. The server sleeps past a lease ========================================================

/// DESIGN §4 (lease expiry with the route reconciling -> `needs_reconciliation`, never a second
/// run) and README row "the outage outlasts the lease" (with `LeaseExpiry::Reconcile` retries
/// get `outcome-unknown`, never a second run, and the holder's own outcome replaces it once the
/// store is back). Fault: the server stalls (`DEBUG SLEEP 1.5`, as a fork, a swap storm or a
/// slow `KEYS` does) past a 500 ms lease while the holder runs on an `external_effects` route,
/// and another node's retry reaches the server during the stall: its claim and the holder's
/// renewals run in whatever order once the server wakes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_server_stall_past_the_lease_never_runs_a_reconciling_route_twice() {
    let Some(server) = OwnRedis::start(&["--enable-debug-command", "yes"]) else {
        return;
    };
    let prefix = "stall";
    let knobs = Knobs {
        lease: ms(500),
        wait: None,
        external: true,
    };
    let sink = Sink::new("stall", false);
    sink.gate_a.add_permits(10_000);
    let node1 = serve(app(
        store_on(&server.url(), Some(prefix)).await,
        &sink,
        &knobs,
    ))
    .await;
    let node2 = serve(app(
        store_on(&server.url(), Some(prefix)).await,
        &sink,
        &knobs,
    ))
    .await;
    let mut answers = Vec::new();
    let mut firsts = Vec::new();
    for round in 0..3 {
        let key = unique("k");
        let runs = sink.runs.count();
        let k = key.clone();
        let holder = tokio::spawn(async move { send(node1, &k).await });
        started(&sink, runs + 1).await;
        let url = server.url();
        let sleeper = tokio::spawn(async move {
            let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
            let mut conn = redis::Client::open(url)
                .expect("url")
                .get_multiplexed_async_connection_with_config(&config)
                .await
                .expect("admin");
            redis::cmd("DEBUG")
                .arg("SLEEP")
                .arg("1.5")
                .query_async::<redis::Value>(&mut conn)
                .await
        });
        tokio::time::sleep(ms(100 + 100 * round)).await;
        let k = key.clone();
        let retry = tokio::spawn(async move { send(node2, &k).await });
        guard("sleep", sleeper)
            .await
            .expect("task")
            .expect("DEBUG SLEEP");
        let during = guard("retry", retry).await.expect("task");
        sink.gate_b.add_permits(1);
        let first = guard("holder", holder).await.expect("task");
        let after = settled(node2, &key).await;
        println!("round {round}: during {during:?}; first {first:?}; after {after:?}");
        assert!(
            !during.live_201(),
            "the retry during the stall ran: {during:?}"
        );
        assert!(first.live_201(), "{first:?}");
        answers.push((during, after));
        firsts.push(first);
    }
    for ((during, after), first) in answers.iter().zip(&firsts) {
        assert!(
            during.status == 409 || during.status == 503,
            "during the stall: {during:?} ({:?})",
            during.problem
        );
        assert!(
            after.replay_201() && after.body == first.body,
            "after the holder answered, the retry gets {after:?}, the first was {first:?}"
        );
    }
    assert_eq!(sink.effects.count(), 3, "three keys, once each at the sink");
}

// ==== 6. Records evicted under memory pressure ==================================================

/// README's Redis paragraph ("records must never be evicted: run with `maxmemory-policy
/// noeviction` … `RedisStore::check()` reports a server that may evict them"). A server with a
/// `maxmemory` and `volatile-lru` (the default of some managed offerings) evicts completed
/// records and claims, which carry a TTL: this review saw a completed key and a running key
/// both run again there. `check()` refuses it and passes `noeviction` and no `maxmemory`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_check_reports_a_server_that_evicts_records() {
    let Some(evicting) =
        OwnRedis::start(&["--maxmemory", "4mb", "--maxmemory-policy", "volatile-lru"])
    else {
        return;
    };
    let store = store_on(&evicting.url(), Some("check")).await;
    match store.check().await {
        Err(tower_idempotency::store::RedisCheckError::Evicts { policy, .. }) => {
            assert_eq!(policy, "volatile-lru")
        }
        other => panic!("a server that evicts must be reported: {other:?}"),
    }
    let Some(keeping) =
        OwnRedis::start(&["--maxmemory", "4mb", "--maxmemory-policy", "noeviction"])
    else {
        return;
    };
    let store = store_on(&keeping.url(), Some("check")).await;
    store.check().await.expect("noeviction keeps every record");
    let Some(unlimited) = OwnRedis::start(&["--maxmemory-policy", "allkeys-lru"]) else {
        return;
    };
    let store = store_on(&unlimited.url(), Some("check")).await;
    store
        .check()
        .await
        .expect("without maxmemory nothing is evicted");
}

/// DESIGN §1 ("one operation key produces at most one execution of the handler") and §7.10
/// (store down: 503, nothing run), on a server run as the README asks (`maxmemory-policy
/// noeviction`). Fault: other keys fill its memory while one key is completed and another's
/// holder is still running. Writes then fail with OOM: the retries are refused or replayed,
/// never run, and each key's effect is made once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_a_full_noeviction_server_never_runs_a_key_twice() {
    let Some(server) = OwnRedis::start(&["--maxmemory", "4mb", "--maxmemory-policy", "noeviction"])
    else {
        return;
    };
    let store = store_on(&server.url(), Some("evict")).await;
    let sink = Sink::new("evict", false);
    sink.gate_a.add_permits(10_000);
    let addr = serve(app(
        store.clone(),
        &sink,
        &Knobs {
            lease: Duration::from_secs(30),
            wait: None,
            external: false,
        },
    ))
    .await;
    let done = unique("done");
    sink.gate_b.add_permits(1);
    let first_done = send(addr, &done).await;
    assert!(first_done.live_201(), "{first_done:?}");
    let running = unique("running");
    let r = running.clone();
    let holder = tokio::spawn(async move { send(addr, &r).await });
    started(&sink, 2).await;

    // Other keys with a TTL, until both records are gone (bounded).
    let mut conn = redis::Client::open(server.url())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("admin");
    let value = "x".repeat(1024);
    let gone = |k: &str| {
        let store = store.clone();
        let k = ScopedKey::new("", k);
        async move { matches!(store.lookup(&k).await, Ok(None)) }
    };
    let mut written = 0;
    let mut full = false;
    while written < 60_000 && !full {
        let mut pipe = redis::pipe();
        for _ in 0..500 {
            pipe.cmd("SET")
                .arg(format!("other:{written}"))
                .arg(&value)
                .arg("EX")
                .arg(3600)
                .ignore();
            written += 1;
        }
        let filled: Result<(), redis::RedisError> =
            guard("fill", pipe.query_async(&mut conn)).await;
        full = filled.is_err();
    }
    assert!(full, "the server filled up ({written} keys)");
    let (done_gone, running_gone) = (gone(&done).await, gone(&running).await);
    println!("{written} other keys written; evicted: done {done_gone}, running {running_gone}");
    assert!(!done_gone && !running_gone, "noeviction keeps every record");

    // The retry of the running key first, while its holder is still at its gate; then the
    // holder, and any run a retry starts, go on.
    let runs = sink.runs.count();
    let r = running.clone();
    let retry_running = tokio::spawn(async move { send(addr, &r).await });
    for _ in 0..40 {
        if sink.runs.count() > runs {
            break;
        }
        tokio::time::sleep(ms(25)).await;
    }
    sink.gate_b.add_permits(3);
    let retry_done = send(addr, &done).await;
    let first_running = guard("holder", holder).await.expect("task");
    let retry_running = guard("retry", retry_running).await.expect("task");
    println!(
        "done: first {first_done:?}, retry {retry_done:?}; running: first {first_running:?}, \
         retry {retry_running:?}"
    );
    assert_eq!(
        sink.effects.count(),
        2,
        "each key once at the sink; the retries got: done {retry_done:?}, running \
         {retry_running:?} (records evicted: done {done_gone}, running {running_gone})"
    );
}

// ==== 7. A milestone after the server closed an idle connection ================================

/// DESIGN §4 (`effect_started()` writes a durable milestone on the record; the handler sees
/// the store's answer) and §7.10 (503 means the store is down). Fault: the server closes idle
/// client connections (`timeout 1` in redis.conf, as many deployments set, or a load
/// balancer's idle reset) while a handler works for a few seconds before its effect; then the
/// handler marks its effect started. The server is up and answers every new connection: the
/// milestone must land (the claim, renewals and completions already survive a connection that
/// broke before their command was sent; the milestone is the handler's only way to proceed
/// safely, so an error here makes it give up work a healthy store would have let it do).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_effect_started_after_the_server_closed_an_idle_connection_lands() {
    let Some(server) = OwnRedis::start(&["--timeout", "1"]) else {
        return;
    };
    let store = store_on(&server.url(), Some("idle")).await;
    let sink = Sink::new("idle", true);
    sink.gate_b.add_permits(10_000);
    let addr = serve(app(
        store,
        &sink,
        &Knobs {
            lease: Duration::from_secs(30),
            wait: None,
            external: false,
        },
    ))
    .await;
    let key = unique("k");
    let k = key.clone();
    let first = tokio::spawn(async move { send(addr, &k).await });
    started(&sink, 1).await;
    // Idle past the server's `timeout` (the keeper renews a 30 s lease only after 10 s).
    tokio::time::sleep(ms(3000)).await;
    sink.gate_a.add_permits(10_000);
    let first = guard("first", first).await.expect("task");
    let milestones = sink.milestones.lock().expect("lock").clone();
    println!("first {first:?}; milestones {milestones:?}");
    let again = settled(addr, &key).await;
    println!(
        "retry {again:?}; milestones {:?}",
        sink.milestones.lock().expect("lock")
    );
    assert_eq!(sink.effects.count(), 1, "the key's effect once at the sink");
    assert!(
        milestones.first().is_some_and(|m| m.ends_with("Ok(())")),
        "the first run's effect_started() failed on a live server: {milestones:?}"
    );
    assert!(first.live_201(), "{first:?}");
}
