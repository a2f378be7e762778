//! Adversarial review of `RedisStore`'s replaceable connection (commit 72363ef), its
//! milestone asked again (728452d) and `check()`: each on a redis-server of the test's own (a
//! free port, nothing on disk, killed by a Drop guard), behind a TCP proxy of the test's own
//! ([`Valve`]) whose links can be stalled (bytes held in order, both ways, then delivered or
//! never), refused or slowed, so that the store's old connection's commands can land after
//! newer ones sent on its replacement.
//!
//! Effects are counted at a sink in the handler (after its work, past any gate the test
//! holds it at), never from responses. Every wait is bounded (`common::guard`, the client's
//! 30 s timeout, bounded polling loops).

use crate::common;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{guard, serve};
use tower_idempotency::IdempotencyStore;
use tower_idempotency::store::{RedisCheckError, RedisStore, ScopedKey};

use common::own_redis::*;
use common::valve::Valve;

async fn record(
    server: &OwnRedis,
    prefix: &str,
    key: &str,
) -> Option<tower_idempotency::store::Record> {
    let direct = store_on(&server.url(), Some(prefix)).await;
    guard("lookup", direct.lookup(&ScopedKey::new("", key)))
        .await
        .expect("lookup straight on the server")
}

/// Sends `key` every 250 ms until `done` holds for an answer or `tries` are used up; returns
/// every answer.
async fn poll_until(
    addr: SocketAddr,
    key: &str,
    tries: usize,
    done: impl Fn(&Answer) -> bool,
) -> Vec<Answer> {
    let mut answers = Vec::new();
    for _ in 0..tries {
        let a = send(addr, key).await;
        let stop = done(&a);
        answers.push(a);
        if stop {
            break;
        }
        tokio::time::sleep(ms(250)).await;
    }
    answers
}

fn statuses(answers: &[Answer]) -> Vec<(u16, Option<String>)> {
    let mut out: Vec<(u16, Option<String>)> = Vec::new();
    for a in answers {
        let s = (a.status, a.problem.clone());
        if out.last() != Some(&s) {
            out.push(s);
        }
    }
    out
}

// ==== 1. A claim stuck on the replaced connection ===============================================

/// DESIGN §1 step 6 ("store unreachable / errors -> 503, nothing run (fail closed)") and §4
/// (a `needs_reconciliation` record is for an effect whose outcome is unknown), with
/// `store::unheard`'s promise: a claim whose answers were all lost is given back ("the release
/// follows the lost claim there [on one connection], so one that timed out lands first").
/// Fault: the store's connection stalls (bytes held, as behind a flapping path) on a route with
/// external effects. The request's claim and its second ask time out on it (503, nothing run);
/// meanwhile the connection was replaced, so the give-back's releases go to the new one and
/// find nothing; then the stalled link delivers the two claims. Nothing ever ran under that
/// token: once the store answers again a retry of the key must run it, once, at the sink, and
/// never be told "outcome unknown".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_10_a_claim_stalled_on_the_replaced_connection_is_given_back() {
    let Some(server) = OwnRedis::start(&[]) else {
        return;
    };
    let valve = Valve::start(server.addr()).await;
    let prefix = "stalled-claim";
    let store = store_on(&valve.url(), Some(prefix)).await;
    let sink = Sink::open("stalled", false);
    let knobs = Knobs {
        lease: Duration::from_secs(2),
        wait: None,
        external: true,
    };
    let addr = serve(app(store, &sink, &knobs)).await;
    let warm = send(addr, &unique("warm")).await;
    assert!(warm.live_201(), "warm-up: {warm:?}");
    let before = sink.effects.count();

    valve.freeze();
    let key = unique("k");
    let first = send(addr, &key).await;
    println!("first (its claim stalled): {first:?}");
    // The give-back's three fenced releases take 1.5 s on the new connection.
    tokio::time::sleep(ms(3000)).await;
    valve.thaw();
    // The stalled claims reach the server (bounded).
    let mut landed = None;
    for _ in 0..40 {
        landed = record(&server, prefix, &key).await;
        if landed.is_some() {
            break;
        }
        tokio::time::sleep(ms(50)).await;
    }
    println!(
        "after the thaw the record is {:?}",
        landed
            .as_ref()
            .map(|r| (r.status, r.attempts, r.lease_token))
    );
    // Retries until one is not "in flight" (the stalled claim's lease is 2 s).
    let answers = poll_until(addr, &key, 40, |a| {
        a.status != 409 || a.problem.as_deref() == Some("outcome-unknown")
    })
    .await;
    let last = answers.last().cloned().expect("an answer");
    let after = record(&server, prefix, &key).await;
    println!(
        "retries: {:?}; record now {:?}",
        statuses(&answers),
        after
            .as_ref()
            .map(|r| (r.status, r.attempts, r.effect_started))
    );
    let ran = sink.effects.count() - before;
    if first.status == 201 {
        // Its second ask went to the new connection: not the fault this test is after.
        assert_eq!(ran, 1, "{first:?} {answers:?}");
        return;
    }
    assert_eq!(first.status, 503, "{first:?}");
    assert_eq!(
        ran,
        1,
        "the key's first request was refused 503 and ran nothing; once the store answers, a \
         retry must run it (once). The retries got {:?}, last {last:?}; the record is {:?}",
        statuses(&answers),
        after.map(|r| (r.status, r.attempts, r.effect_started))
    );
}

// ==== 2. Completions that wait for replicas, on a connection that stops answering ===============

/// README's Redis paragraph ("a connection that stops answering without closing (its host
/// gone, a frozen VM, a failover that moved the address) is replaced after its first 5 s
/// timeout: the request that met it is refused 503, the next one runs on a new connection")
/// and DESIGN §4 (the holder retries recording its outcome until it lands). Fault: on a store
/// `with_wait`, the connections the completions wait on stop answering without closing, while
/// a new connection would be answered (and the store's own connection still answers). A won
/// claim's acknowledgement goes there too: each such claim is refused 503 and given back on
/// the store's own connection, and each refusal has a waiting connection replaced. The key
/// runs once; its outcome must land on some connection in the end, and a retry replay it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_10_completions_that_wait_are_not_stuck_on_a_dead_connection() {
    let Some(server) = OwnRedis::start(&[]) else {
        return;
    };
    let valve = Valve::start(server.addr()).await;
    let prefix = "wait-dead";
    let store = store_on(&valve.url(), Some(prefix))
        .await
        .with_wait(0, ms(200));
    let sink = Sink::open("waitdead", false);
    let knobs = Knobs {
        // Each try of the record is given half a lease at first (6 s): the store's 5 s
        // timeout is met on the first one.
        lease: Duration::from_secs(12),
        wait: None,
        external: false,
    };
    let addr = serve(app(store, &sink, &knobs)).await;
    // The store's own connection is made; the warm-up's completion makes the waiting ones.
    let mark = valve.links();
    let warm = send(addr, &unique("warm")).await;
    assert!(warm.live_201(), "warm-up: {warm:?}");
    let warm2 = send(addr, &unique("warm")).await;
    assert!(warm2.live_201(), "warm-up: {warm2:?}");
    valve.freeze_from(mark);
    println!("links {mark}..{} stalled for good", valve.links());

    let key = unique("k");
    let first = send(addr, &key).await;
    println!("first: {first:?}");
    let answers = poll_until(addr, &key, 80, Answer::replay_201).await;
    let rec = record(&server, prefix, &key).await;
    println!(
        "retries: {:?}; record {:?}",
        statuses(&answers),
        rec.as_ref().map(|r| (r.status, r.attempts))
    );
    assert_eq!(sink.effects.count(), 3, "each key once at the sink");
    assert!(
        answers.last().is_some_and(Answer::replay_201),
        "the key ran (once) and the server answers every new connection, but its outcome never \
         landed: the completions' own connections are never replaced; {} retries over 20 s got \
         {:?}, the record is {:?}",
        answers.len(),
        statuses(&answers),
        rec.map(|r| (r.status, r.attempts))
    );
}

// ==== 3. A storm of timeouts =====================================================================

/// README ("is replaced after its first 5 s timeout … the next one runs on a new
/// connection") and DESIGN §1 (one key, at most one run). Fault: the store's connection
/// stalls for good while a dozen requests are in flight on it, twice over: a dozen timeouts at
/// once. One replacement is made at a time and the old sockets are closed (no pile-up of open
/// connections: a claim whose replies were lost gives back what may have landed on the
/// connection it was sent on, so that one stays open until the claim's lease, 3 s here, ends),
/// the requests are refused 503 or run, and every key then runs exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_10_a_storm_of_timeouts_leaves_one_connection_and_runs_each_key_once() {
    let Some(server) = OwnRedis::start(&[]) else {
        return;
    };
    let valve = Valve::start(server.addr()).await;
    let store = store_on(&valve.url(), Some("storm")).await;
    let sink = Sink::open("storm", false);
    let addr = serve(app(
        store,
        &sink,
        &Knobs {
            lease: Duration::from_secs(3),
            wait: None,
            external: false,
        },
    ))
    .await;
    let warm = send(addr, &unique("warm")).await;
    assert!(warm.live_201(), "warm-up: {warm:?}");
    let mut keys = Vec::new();
    let mut opened = Vec::new();
    for round in 0..2 {
        let open_before = valve.open();
        let links_before = valve.links();
        valve.freeze();
        let tasks: Vec<_> = (0..12)
            .map(|i| {
                let key = unique(&format!("storm{round}-{i}"));
                keys.push(key.clone());
                tokio::spawn(async move { send(addr, &key).await })
            })
            .collect();
        let mut answers = Vec::new();
        for t in tasks {
            answers.push(guard("storm request", t).await.expect("task"));
        }
        for a in &answers {
            assert!(a.status == 201 || a.status == 503, "{a:?}");
        }
        // Whatever lingers closes (bounded).
        for _ in 0..300 {
            if valve.open() <= open_before {
                break;
            }
            tokio::time::sleep(ms(50)).await;
        }
        println!(
            "round {round}: {:?}; links made {}; open {} (before {open_before})",
            statuses(&answers),
            valve.links() - links_before,
            valve.open()
        );
        opened.push((valve.links() - links_before, valve.open(), open_before));
    }
    for key in &keys {
        let a = settled(addr, key).await;
        assert!(a.status == 201, "{key}: {a:?}");
    }
    assert_eq!(
        sink.effects.count(),
        1 + keys.len(),
        "each key once at the sink"
    );
    for (made, open, before) in opened {
        assert!(
            open <= before,
            "replaced connections are left open: {open} client sockets open, {before} before \
             the storm ({made} links made)"
        );
    }
}

// ==== 4. Replacement while new connections fail ==================================================

/// README ("a connection that stops answering … is replaced after its first 5 s timeout") and
/// DESIGN §7.10 (store down: 503, nothing run; recovery when it returns). Fault: the store's
/// connection stalls for good and, for a while, every new connection is refused too (the
/// failover not done yet): the replacement fails. It is tried again on a later timeout; once
/// new connections are answered, requests run again, each key once, and no socket is left
/// (once the 3 s lease of the claims given back on the stalled connection has ended).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_10_a_replacement_that_failed_is_tried_again() {
    let Some(server) = OwnRedis::start(&[]) else {
        return;
    };
    let valve = Valve::start(server.addr()).await;
    let store = store_on(&valve.url(), Some("refused")).await;
    let sink = Sink::open("refused", false);
    let addr = serve(app(
        store.clone(),
        &sink,
        &Knobs {
            lease: Duration::from_secs(3),
            wait: None,
            external: false,
        },
    ))
    .await;
    let warm = send(addr, &unique("warm")).await;
    assert!(warm.live_201(), "warm-up: {warm:?}");
    let open_before = valve.open();
    valve.refuse.store(true, Ordering::SeqCst);
    valve.freeze();
    let probe = ScopedKey::new("", "probe");
    let mut seen = Vec::new();
    for _ in 0..2 {
        let r = guard("lookup", store.lookup(&probe)).await;
        seen.push(format!("{r:?}"));
        assert!(r.is_err(), "a lookup on the stalled link answered: {r:?}");
    }
    // The replacement the second timeout asked for fails too before new links are answered.
    tokio::time::sleep(ms(500)).await;
    valve.refuse.store(false, Ordering::SeqCst);
    let mut answers = Vec::new();
    for i in 0..3 {
        let key = unique(&format!("after{i}"));
        let a = send(addr, &key).await;
        let ok = a.status == 201;
        answers.push((key, a));
        if ok {
            break;
        }
    }
    println!("while refused: {seen:?}; then {answers:?}");
    for (key, a) in &answers {
        assert!(a.status == 201 || a.status == 503, "{a:?}");
        let again = settled(addr, key).await;
        assert!(again.status == 201, "{key}: {again:?}");
    }
    assert_eq!(
        sink.effects.count(),
        1 + answers.len(),
        "each key once at the sink"
    );
    assert!(
        answers.iter().any(|(_, a)| a.status == 201),
        "new connections are answered again, but three requests in a row were refused: \
         {answers:?}"
    );
    for _ in 0..300 {
        if valve.open() <= open_before {
            break;
        }
        tokio::time::sleep(ms(50)).await;
    }
    assert!(
        valve.open() <= open_before,
        "connections pile up: {} open, {open_before} before",
        valve.open()
    );
}

// ==== 4b. A cluster node's connection that stops answering ========================================

/// A cluster-enabled redis-server of the test's own, no slots yet, and its cluster bus port.
fn cluster_node() -> Option<(OwnRedis, u16)> {
    let bus = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port for the cluster bus")
        .port();
    let server = OwnRedis::start(&[
        "--cluster-enabled",
        "yes",
        "--cluster-port",
        &bus.to_string(),
        "--cluster-config-file",
        "nodes.conf",
    ])?;
    Some((server, bus))
}

/// Waits until `node` says its cluster serves every slot.
async fn cluster_ok(node: &OwnRedis) {
    for _ in 0..400 {
        if node
            .text(&["CLUSTER", "INFO"])
            .await
            .contains("cluster_state:ok")
        {
            return;
        }
        tokio::time::sleep(ms(50)).await;
    }
    panic!("the cluster of {} never came up", node.url());
}

/// A one-node Redis Cluster of the test's own (every slot on it) that announces `valve`'s port
/// to clients, so the store's connections to the node, those it makes on discovering the
/// cluster included, go through the valve. `None` where it could not be set up outside CI.
async fn cluster_behind_a_valve() -> Option<(OwnRedis, Valve)> {
    let (server, _) = cluster_node()?;
    let valve = Valve::start(server.addr()).await;
    let port = valve.addr.port().to_string();
    for args in [
        &["CONFIG", "SET", "cluster-announce-ip", "127.0.0.1"][..],
        &["CONFIG", "SET", "cluster-announce-port", &port],
        &["CLUSTER", "ADDSLOTSRANGE", "0", "16383"],
    ] {
        server
            .cmd(args)
            .await
            .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    }
    cluster_ok(&server).await;
    Some((server, valve))
}

/// README's Redis paragraph ("a connection that stops answering … is replaced after its first
/// 5 s timeout"), on a cluster, and DESIGN §7.10 (store down: 503, nothing run; recovery when
/// it returns). Fault: every link to a cluster node made so far stalls for good (its host gone
/// without a FIN or RST, a frozen VM), while a new connection would be answered. The request
/// that meets the stall is refused 503 and runs nothing; a new connection to the cluster is
/// made, so later requests run, each key once at the sink, and keep running and replaying once
/// the stalled links deliver what they held. Before cluster connections were replaced, every
/// request on the node's slots timed out until the kernel gave the link up, minutes later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_10_a_cluster_node_that_stops_answering_has_its_connection_made_anew() {
    let Some((_server, valve)) = cluster_behind_a_valve().await else {
        return;
    };
    let store = guard(
        "connect to the cluster",
        RedisStore::connect_cluster(&[&valve.url()]),
    )
    .await
    .expect("connect to the one-node cluster")
    .with_prefix("cluster-stall")
    .expect("prefix");
    let sink = Sink::open("clusterstall", false);
    let addr = serve(app(
        store,
        &sink,
        &Knobs {
            lease: Duration::from_secs(3),
            wait: None,
            external: false,
        },
    ))
    .await;
    let warm = send(addr, &unique("warm")).await;
    assert!(warm.live_201(), "warm-up: {warm:?}");
    let links_before = valve.links();
    valve.freeze();
    let met = unique("met");
    let first = send(addr, &met).await;
    assert_eq!(
        first.status, 503,
        "the request that met the stall: {first:?}"
    );
    assert_eq!(sink.effects.count(), 1, "nothing ran for it");
    // Each try that meets the stall takes the store's 5 s: ten are more than enough for a
    // replacement, far fewer than the kernel takes to give the link up.
    let after = unique("after");
    let answers = poll_until(addr, &after, 10, Answer::live_201).await;
    println!(
        "after the stall: {:?}; links made since {}",
        statuses(&answers),
        valve.links() - links_before
    );
    assert!(
        answers.last().is_some_and(Answer::live_201),
        "requests after the stall must run on a new connection to the cluster: {:?}",
        statuses(&answers)
    );
    let again = settled(addr, &met).await;
    assert!(again.live_201(), "the refused key runs on retry: {again:?}");
    assert_eq!(
        sink.effects.count(),
        3,
        "warm-up, the refused key, the later key"
    );
    // What the stalled links held reaches the node now: nothing runs again.
    valve.thaw();
    tokio::time::sleep(ms(500)).await;
    for key in [&met, &after] {
        let replay = send(addr, key).await;
        assert!(replay.replay_201(), "{key}: {replay:?}");
    }
    let later = send(addr, &unique("later")).await;
    assert!(later.live_201(), "{later:?}");
    assert_eq!(sink.effects.count(), 4, "each key once at the sink");
}

// ==== 5. Milestones and renewals landing after a takeover =======================================

/// DESIGN §4 (milestones are durable writes on the record, fenced by the lease token; "a
/// worker whose lease was taken over can no longer write") and 728452d's milestone asked once
/// more. Fault: the holder's connection stalls as its handler marks its effect started: both
/// asks time out on it, the handler gives up (503, nothing done), the key is released on the
/// replacement, a retry takes it over and runs; then the stalled link delivers the first
/// holder's two milestones and renewals. They are fenced: the record stays the retry's
/// (completed, replayed), the effect made once at the sink.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_milestones_stalled_on_the_replaced_connection_are_fenced_after_a_takeover() {
    let Some(server) = OwnRedis::start(&[]) else {
        return;
    };
    let valve = Valve::start(server.addr()).await;
    let prefix = "late-milestone";
    let store = store_on(&valve.url(), Some(prefix)).await;
    let sink = Sink::new("late", true);
    sink.gate_b.add_permits(10_000);
    let addr = serve(app(
        store,
        &sink,
        &Knobs {
            lease: Duration::from_secs(3),
            wait: None,
            external: false,
        },
    ))
    .await;
    sink.gate_a.add_permits(1);
    let warm = send(addr, &unique("warm")).await;
    assert!(warm.live_201(), "warm-up: {warm:?}");

    let key = unique("k");
    let k = key.clone();
    let holder = tokio::spawn(async move { send(addr, &k).await });
    started(&sink, 2).await;
    valve.freeze();
    sink.gate_a.add_permits(10_000);
    let first = guard("holder", holder).await.expect("task");
    let retry = settled(addr, &key).await;
    valve.thaw();
    tokio::time::sleep(ms(1000)).await;
    let again = settled(addr, &key).await;
    let rec = record(&server, prefix, &key).await;
    println!(
        "first {first:?}; retry {retry:?}; again {again:?}; milestones {:?}; record {:?}",
        sink.milestones.lock().expect("lock"),
        rec.as_ref()
            .map(|r| (r.status, r.attempts, r.effect_started))
    );
    assert_eq!(
        sink.effects.count(),
        2,
        "the warm-up and the key, once each at the sink"
    );
    assert!(
        again.replay_201() && (retry.status != 201 || again.body == retry.body),
        "after the stalled milestones landed the key must replay its one run: retry {retry:?}, \
         again {again:?}"
    );
}

// ==== 6. check() =================================================================================

/// README ("`RedisStore::check()` reports a server … whose `CONFIG` it cannot read") and
/// `RedisCheckError::ConfigUnreadable` ("`CONFIG GET` is refused (a managed service, or an
/// ACL)"). Fault: `CONFIG` renamed away (`rename-command CONFIG ""`, as managed services do):
/// `ConfigUnreadable`, never Ok. A store on it still runs a key once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_check_on_a_server_without_config_is_config_unreadable() {
    let Some(server) = OwnRedis::start(&["--rename-command", "CONFIG", ""]) else {
        return;
    };
    let store = store_on(&server.url(), Some("noconfig")).await;
    let checked = guard("check", store.check()).await;
    println!("{checked:?}");
    assert!(
        matches!(checked, Err(RedisCheckError::ConfigUnreadable { .. })),
        "{checked:?}"
    );
    let sink = Sink::open("noconfig", false);
    let addr = serve(app(store, &sink, &Knobs::default())).await;
    let key = unique("k");
    let a = send(addr, &key).await;
    let b = send(addr, &key).await;
    assert!(a.live_201() && b.replay_201(), "{a:?} {b:?}");
    assert_eq!(sink.effects.count(), 1);
}

/// README ("`RedisStore::check()` reports a server … that may evict, or whose `CONFIG` it
/// cannot read") and `ConfigUnreadable`'s doc (`CONFIG GET` *refused*). Fault: the server is
/// 700 ms away (a loaded server, a far region): the store itself works over that link (its
/// replies may take 5 s), a key runs once; `check()` of a `noeviction` server must say Ok (or,
/// at worst, that it is unreachable), never that its `CONFIG` is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_check_on_a_slow_link_does_not_report_config_refused() {
    let Some(server) =
        OwnRedis::start(&["--maxmemory", "64mb", "--maxmemory-policy", "noeviction"])
    else {
        return;
    };
    let valve = Valve::start(server.addr()).await;
    valve.delay_ms.store(700, Ordering::SeqCst);
    let store = store_on(&valve.url(), Some("slow")).await;
    let sink = Sink::open("slow", false);
    let addr = serve(app(store.clone(), &sink, &Knobs::default())).await;
    let key = unique("k");
    let a = send(addr, &key).await;
    assert!(a.live_201(), "the store works over the slow link: {a:?}");
    assert_eq!(sink.effects.count(), 1);
    let checked = guard("check", store.check()).await;
    println!("{checked:?}");
    assert!(
        !matches!(checked, Err(RedisCheckError::ConfigUnreadable { .. })),
        "the server's CONFIG is readable (it answers in 700 ms, the store waits 5 s), but \
         check() reports it refused: {checked:?}"
    );
}

/// README ("`RedisStore::check()` reports a server (each node it was given)"). The suite's
/// cluster (127.0.0.1:7000-7002, read only here): check() agrees with each node's own
/// `CONFIG GET maxmemory*`.
/// DESIGN §2 (`check()` reports a store that may lose records) on a cluster: records live on
/// every master, not only on the node the store was given. A two-node cluster of the test's
/// own, the store given node A alone: `check()` passes while neither evicts, and reports
/// node B (by its address) once B may evict. Before, it read only the nodes it was given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_check_on_a_cluster_reads_the_nodes_it_was_not_given() {
    let (Some((a, _)), Some((b, b_bus))) = (cluster_node(), cluster_node()) else {
        return;
    };
    a.cmd(&["CLUSTER", "ADDSLOTSRANGE", "0", "8191"])
        .await
        .expect("A's slots");
    b.cmd(&["CLUSTER", "ADDSLOTSRANGE", "8192", "16383"])
        .await
        .expect("B's slots");
    let (b_port, b_bus) = (b.port.to_string(), b_bus.to_string());
    a.cmd(&["CLUSTER", "MEET", "127.0.0.1", &b_port, &b_bus])
        .await
        .expect("MEET");
    cluster_ok(&a).await;
    cluster_ok(&b).await;
    let store = guard("connect", RedisStore::connect_cluster(&[&a.url()]))
        .await
        .expect("connect through A");
    let checked = guard("check", store.check()).await;
    assert!(checked.is_ok(), "neither node evicts: {checked:?}");
    for args in [
        &["CONFIG", "SET", "maxmemory", "100mb"][..],
        &["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"],
    ] {
        b.cmd(args).await.expect("B's memory settings");
    }
    match guard("check", store.check()).await {
        Err(RedisCheckError::Evicts { node, policy }) => {
            assert!(node.ends_with(&format!(":{b_port}")), "{node}");
            assert_eq!(policy, "allkeys-lru");
        }
        other => panic!("node B, never given, evicts: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_check_on_the_cluster_agrees_with_each_node() {
    let nodes = [
        "redis://127.0.0.1:7000",
        "redis://127.0.0.1:7001",
        "redis://127.0.0.1:7002",
    ];
    let store = match guard("cluster", RedisStore::connect_cluster(&nodes)).await {
        Ok(store) => store,
        Err(e) => {
            common::unreachable("the Redis cluster on 7000-7002", &e);
            return;
        }
    };
    let mut evicts = false;
    for node in nodes {
        let mut conn = guard(
            "node",
            redis::Client::open(node)
                .expect("url")
                .get_multiplexed_async_connection(),
        )
        .await
        .expect("node");
        let config: Vec<String> = guard(
            "config",
            redis::cmd("CONFIG")
                .arg("GET")
                .arg("maxmemory*")
                .query_async(&mut conn),
        )
        .await
        .expect("CONFIG GET");
        let value = |name: &str| {
            config
                .chunks(2)
                .find(|p| p[0] == name)
                .map(|p| p[1].clone())
                .unwrap_or_default()
        };
        evicts |= value("maxmemory") != "0" && value("maxmemory-policy") != "noeviction";
    }
    let checked = guard("check", store.check()).await;
    println!("cluster: evicts {evicts}; check {checked:?}");
    match checked {
        Ok(()) => assert!(!evicts),
        Err(RedisCheckError::Evicts { .. }) => assert!(evicts),
        other => panic!("{other:?}"),
    }
}
