//! Adversarial review of today's two `RedisStore` changes on a Redis Cluster: the cluster
//! connection made anew when it stops answering (701319f, `store/redis/connection.rs`) and
//! `check()` reading every node `CLUSTER NODES` lists (9bda0f4).
//!
//! Every cluster here is the test's own: two or three cluster-enabled redis-servers on free
//! ports (nothing on disk, killed on drop), slots split between them, joined by `CLUSTER MEET`
//! over their real ports and bus ports. Where links must be stalled, each node sits behind a
//! TCP proxy of the test's own ([`Valve`]) and announces the proxy's port
//! (`cluster-announce-port`), so every connection the store makes to that node, those it makes
//! on discovering the cluster included, goes through that node's proxy: one node's links can be
//! stalled (bytes held in order, then delivered), refused or slowed while the others' carry on.
//!
//! Which node a key lives on is computed from the record's hash tag (CRC16, checked against
//! the node's own `CLUSTER KEYSLOT`). Effects are counted at the sink in the handler, never
//! from responses. Every wait is bounded (`common::guard`, the client's 30 s timeout, bounded
//! polling loops).

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use common::own_redis::*;
use common::{guard, serve};
use tower_idempotency::IdempotencyStore;
use tower_idempotency::store::{RecordStatus, RedisCheckError, RedisStore, ScopedKey};

// The stalling proxy is redis_replace_review's.
use common::valve::Valve;

// ==== clusters of the test's own ================================================================

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// One node of a cluster of the test's own: its server, its bus port, and the valve it
/// announces (if it sits behind one).
struct Node {
    server: OwnRedis,
    bus: u16,
    valve: Option<Valve>,
}

impl Node {
    fn valve(&self) -> &Valve {
        self.valve.as_ref().expect("this node sits behind a valve")
    }

    /// The address clients are given for it: its valve's, or its own.
    fn url(&self) -> String {
        self.valve
            .as_ref()
            .map_or_else(|| self.server.url(), Valve::url)
    }

    async fn id(&self) -> String {
        match self.server.cmd(&["CLUSTER", "MYID"]).await {
            Ok(redis::Value::BulkString(id)) => String::from_utf8_lossy(&id).into_owned(),
            other => panic!("CLUSTER MYID: {other:?}"),
        }
    }

    async fn nodes(&self) -> String {
        match self.server.cmd(&["CLUSTER", "NODES"]).await {
            Ok(redis::Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
            Ok(redis::Value::VerbatimString { text, .. }) => text,
            other => panic!("CLUSTER NODES: {other:?}"),
        }
    }
}

/// A cluster-enabled redis-server (no slots yet) with `extra` arguments, optionally behind a
/// valve whose port it announces. `None` where redis-server cannot be started outside CI.
async fn node(extra: &[&str], behind_valve: bool) -> Option<Node> {
    let bus = free_port();
    let bus_text = bus.to_string();
    let mut args = vec![
        "--cluster-enabled",
        "yes",
        "--cluster-port",
        &bus_text,
        "--cluster-config-file",
        "nodes.conf",
    ];
    args.extend_from_slice(extra);
    let server = OwnRedis::start(&args)?;
    let valve = match behind_valve {
        true => {
            let valve = Valve::start(server.addr()).await;
            let port = valve.addr.port().to_string();
            for set in [
                &["CONFIG", "SET", "cluster-announce-ip", "127.0.0.1"][..],
                &["CONFIG", "SET", "cluster-announce-port", &port],
                &["CONFIG", "SET", "cluster-announce-bus-port", &bus_text],
            ] {
                server
                    .cmd(set)
                    .await
                    .unwrap_or_else(|e| panic!("{set:?}: {e}"));
            }
            Some(valve)
        }
        false => None,
    };
    Some(Node { server, bus, valve })
}

/// The slot ranges of `n` masters, split evenly.
fn ranges(n: usize) -> Vec<(u16, u16)> {
    let n = n as u32;
    (0..n)
        .map(|i| ((16384 * i / n) as u16, (16384 * (i + 1) / n - 1) as u16))
        .collect()
}

/// Joins `node` to the cluster of `first` (over the real port and bus port).
async fn meet(first: &Node, node: &Node) {
    let (port, bus) = (node.server.port.to_string(), node.bus.to_string());
    first
        .server
        .cmd(&["CLUSTER", "MEET", "127.0.0.1", &port, &bus])
        .await
        .expect("CLUSTER MEET");
}

/// Waits until every node says the cluster serves every slot and lists `count` nodes, none in
/// handshake.
async fn settle(nodes: &[&Node], count: usize) {
    for _ in 0..400 {
        let mut ok = true;
        for n in nodes {
            let info = n.server.text(&["CLUSTER", "INFO"]).await;
            let listing = n.nodes().await;
            let known = listing
                .lines()
                .filter(|l| !l.is_empty() && !l.contains("handshake"))
                .count();
            ok &= info.contains("cluster_state:ok") && known == count;
        }
        if ok {
            return;
        }
        tokio::time::sleep(ms(50)).await;
    }
    panic!("the cluster never settled on {count} nodes");
}

/// A cluster of `masters` masters of the test's own, slots split evenly between them, each
/// behind a valve of its own if `valves`; `extra[i]` are node i's arguments.
async fn cluster(masters: usize, valves: bool, extra: &[&[&str]]) -> Option<Vec<Node>> {
    let mut nodes = Vec::new();
    for (i, (from, to)) in ranges(masters).into_iter().enumerate() {
        let node = node(extra.get(i).copied().unwrap_or_default(), valves).await?;
        node.server
            .cmd(&[
                "CLUSTER",
                "ADDSLOTSRANGE",
                &from.to_string(),
                &to.to_string(),
            ])
            .await
            .expect("ADDSLOTSRANGE");
        nodes.push(node);
    }
    for other in &nodes[1..] {
        meet(&nodes[0], other).await;
    }
    settle(&nodes.iter().collect::<Vec<_>>(), masters).await;
    Some(nodes)
}

/// Adds a replica of `nodes[0]` to the cluster (with `extra` arguments), and waits until every
/// node lists it.
async fn add_replica(nodes: &mut Vec<Node>, extra: &[&str]) -> Option<()> {
    let replica = node(extra, false).await?;
    meet(&nodes[0], &replica).await;
    let count = nodes.len() + 1;
    nodes.push(replica);
    settle(&nodes.iter().collect::<Vec<_>>(), count).await;
    let master = nodes[0].id().await;
    nodes[count - 1]
        .server
        .cmd(&["CLUSTER", "REPLICATE", &master])
        .await
        .expect("CLUSTER REPLICATE");
    for _ in 0..400 {
        if nodes[0]
            .nodes()
            .await
            .lines()
            .any(|l| l.contains("slave") && l.contains(&master))
        {
            return Some(());
        }
        tokio::time::sleep(ms(50)).await;
    }
    panic!("the replica never showed as one");
}

/// CRC16 (XMODEM), as Redis Cluster hashes keys.
fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in data {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The slot of a Redis key (its hash tag's, if it has one).
fn slot(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        let close = rest.iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    crc16(tagged.unwrap_or(key)) % 16384
}

/// The slot of the record of `key` (the apps here are single-tenant: scope "").
fn record_slot(store: &RedisStore, key: &str) -> u16 {
    slot(&store.keys(&ScopedKey::new("", key))[0])
}

/// A fresh key whose record lives on master `index` of `masters`.
fn key_on(store: &RedisStore, masters: usize, index: usize, name: &str) -> String {
    let (from, to) = ranges(masters)[index];
    for _ in 0..10_000 {
        let key = unique(name);
        if (from..=to).contains(&record_slot(store, &key)) {
            return key;
        }
    }
    panic!("no key found on master {index}");
}

async fn record(
    server: &OwnRedis,
    prefix: &str,
    key: &str,
) -> Option<tower_idempotency::store::Record> {
    let direct = store_on(&server.url(), Some(prefix)).await;
    guard("lookup", direct.lookup(&ScopedKey::new("", key)))
        .await
        .expect("lookup straight on the node that owns the key")
}

async fn connect(urls: &[String], prefix: &str) -> RedisStore {
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    guard("connect to the cluster", RedisStore::connect_cluster(&urls))
        .await
        .expect("connect to the cluster of the test's own")
        .with_prefix(prefix)
        .expect("prefix")
}

/// How many links one `connect_cluster` through `seeds` makes at each node's valve.
async fn links_per_connect(nodes: &[Node], seeds: &[String]) -> Vec<u64> {
    let before: Vec<u64> = nodes.iter().map(|n| n.valve().links()).collect();
    let probe = connect(seeds, "probe").await;
    guard("probe", probe.lookup(&ScopedKey::new("", "probe")))
        .await
        .expect("the probe's lookup");
    drop(probe);
    nodes
        .iter()
        .zip(before)
        .map(|(n, b)| n.valve().links() - b)
        .collect()
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

fn statuses(answers: &[Answer]) -> Vec<(u16, bool, Option<String>)> {
    let mut out: Vec<(u16, bool, Option<String>)> = Vec::new();
    for a in answers {
        let s = (a.status, a.replayed, a.problem.clone());
        if out.last() != Some(&s) {
            out.push(s);
        }
    }
    out
}

/// Waits (bounded, `tries` x 50 ms) until `valve` has at most `at_most` client sockets open.
async fn open_at_most(valve: &Valve, at_most: usize, tries: usize) -> usize {
    for _ in 0..tries {
        if valve.open() <= at_most {
            break;
        }
        tokio::time::sleep(ms(50)).await;
    }
    valve.open()
}

// ==== a. One node of three stops answering ======================================================

/// README's Redis fault row ("the store's connection (to a server, or to one node of a cluster)
/// stops answering … the request that meets it is refused 503 (nothing run) and a new
/// connection is made … so the next request runs; a claim, its asking again and the give-back
/// … stay on one connection, so what the stalled link delivers late finds the key given back
/// or completed, never runs it twice"), DESIGN §1 step 6 (store unreachable -> 503, nothing
/// run) and §7.10, on a three-master cluster of the test's own where only node C's links stall.
/// Keys on A and B are sent every 250 ms throughout and must all run live; two keys on C meet
/// the stall (503, nothing run); a later key on C runs on the new connection; one of the two is
/// retried before the stalled links deliver (it runs; its late claim must find it completed),
/// the other after (its late claim must find it given back, and its retry run once, never
/// "outcome unknown": the route has external effects). Each key exactly once at the sink, and
/// replays stay correct after the late bytes landed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_10_one_cluster_node_stalls_the_others_run_throughout_and_each_key_runs_once() {
    let Some(nodes) = cluster(3, true, &[]).await else {
        return;
    };
    let prefix = "one-of-three";
    let store = connect(&nodes.iter().map(Node::url).collect::<Vec<_>>(), prefix).await;
    // The keys' nodes are computed here: the cluster agrees.
    let probe = key_on(&store, 3, 2, "probe");
    let probe_key = store.keys(&ScopedKey::new("", &probe))[0].clone();
    let probe_key = String::from_utf8(probe_key).expect("utf-8 key");
    assert_eq!(
        nodes[2]
            .server
            .cmd(&["CLUSTER", "KEYSLOT", &probe_key])
            .await,
        Ok(redis::Value::Int(i64::from(slot(probe_key.as_bytes())))),
        "the test computes slots as Redis does"
    );
    let sink = Sink::open("oneofthree", false);
    let addr = serve(app(
        store.clone(),
        &sink,
        &Knobs {
            lease: Duration::from_secs(3),
            wait: None,
            external: true,
        },
    ))
    .await;
    let mut live = Vec::new();
    for i in 0..3 {
        let key = key_on(&store, 3, i, "warm");
        let a = send(addr, &key).await;
        assert!(a.live_201(), "warm-up on node {i}: {a:?}");
        live.push((key, a));
    }

    let c = nodes[2].valve();
    c.freeze();
    let (met1, met2) = (key_on(&store, 3, 2, "met1"), key_on(&store, 3, 2, "met2"));
    let (k1, k2) = (met1.clone(), met2.clone());
    let t1 = tokio::spawn(async move { send(addr, &k1).await });
    let t2 = tokio::spawn(async move { send(addr, &k2).await });
    // Keys on A and B throughout the stall.
    let mut others = Vec::new();
    for i in 0..120 {
        if t1.is_finished() && t2.is_finished() {
            break;
        }
        let key = key_on(&store, 3, i % 2, "other");
        let a = send(addr, &key).await;
        others.push((key, a));
        tokio::time::sleep(ms(250)).await;
    }
    let first1 = guard("met1", t1).await.expect("task");
    let first2 = guard("met2", t2).await.expect("task");
    println!(
        "keys on A and B during the stall: {:?}; the two that met it: {first1:?} {first2:?}",
        statuses(&others.iter().map(|(_, a)| a.clone()).collect::<Vec<_>>())
    );
    assert!(
        first1.status == 503 && first2.status == 503,
        "the requests that met the stall: {first1:?} {first2:?}"
    );
    assert_eq!(
        sink.effects.count(),
        3 + others.iter().filter(|(_, a)| a.live_201()).count(),
        "nothing ran for the two refused keys"
    );
    assert!(
        others.len() >= 10 && others.iter().all(|(_, a)| a.live_201()),
        "keys on the nodes that kept answering must keep running throughout: {:?}",
        statuses(&others.iter().map(|(_, a)| a.clone()).collect::<Vec<_>>())
    );
    // A later key on C runs on a new connection.
    let after = key_on(&store, 3, 2, "after");
    let answers = poll_until(addr, &after, 4, Answer::live_201).await;
    assert!(
        answers.last().is_some_and(Answer::live_201),
        "a key on the stalled node after the stall: {:?}",
        statuses(&answers)
    );
    // met1 is retried while its stalled claim is still held: it runs now.
    let retried = settled(addr, &met1).await;
    assert!(retried.live_201(), "met1 retried: {retried:?}");
    c.thaw();
    // The late claims and the give-back of met2 land (bounded).
    let mut late = None;
    for _ in 0..100 {
        late = record(&nodes[2].server, prefix, &met2).await;
        if late
            .as_ref()
            .is_some_and(|r| r.status != RecordStatus::InProgress)
        {
            break;
        }
        tokio::time::sleep(ms(50)).await;
    }
    let met1_record = record(&nodes[2].server, prefix, &met1).await;
    println!(
        "after the thaw: met2 {:?}; met1 {:?}",
        late.as_ref().map(|r| (r.status, r.attempts)),
        met1_record.as_ref().map(|r| (r.status, r.attempts))
    );
    assert!(
        met1_record
            .as_ref()
            .is_some_and(|r| r.status == RecordStatus::Completed),
        "met1 ran and completed; its late claim must leave it so: {:?}",
        met1_record.map(|r| (r.status, r.attempts, r.history))
    );
    let again2 = poll_until(addr, &met2, 24, |a| a.status != 409).await;
    assert!(
        again2.last().is_some_and(Answer::live_201),
        "met2 was refused 503 and ran nothing; its late claim must be found given back, so a \
         retry runs it (once), never 'outcome unknown': {:?}; record after the thaw {:?}",
        statuses(&again2),
        late.map(|r| (r.status, r.attempts, r.history))
    );
    let replay1 = send(addr, &met1).await;
    assert!(
        replay1.replay_201() && replay1.body == retried.body,
        "met1 replays its one run: {replay1:?} vs {retried:?}"
    );
    for (key, a) in live.iter().chain(others.iter().take(4)) {
        let r = send(addr, key).await;
        assert!(r.replay_201() && r.body == a.body, "{key}: {r:?} vs {a:?}");
    }
    for key in [&after, &met2] {
        let r = send(addr, key).await;
        assert!(r.replay_201(), "{key}: {r:?}");
    }
    assert_eq!(
        sink.effects.count(),
        3 + others.len() + 3,
        "each key exactly once at the sink (warm-ups, the keys on A and B, after, met1, met2)"
    );
}

// ==== b. A storm of timeouts on one node ========================================================

/// README's fault row ("a new connection is made in the background (once …)") and
/// `Replaceable::replace`'s doc ("Connects a replacement for the connection of `generation`
/// (once), unless it was replaced already"), DESIGN §1 (at most one run per key) and §7.10.
/// Fault: node B of two stops answering while a dozen requests on its slots arrive over a
/// second (100 ms apart: all sent before the first times out). Each is refused 503 or runs;
/// then every key runs exactly once; the old connection's sockets are closed once the stalled
/// links delivered (the valves count open client sockets); and the new links made at node A's
/// valve are those of one replacement (a connection to a cluster connects to every node),
/// bounded: at most two connections' worth, never one per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_10_a_storm_of_timeouts_on_one_cluster_node_makes_one_replacement() {
    let Some(nodes) = cluster(2, true, &[]).await else {
        return;
    };
    let seeds: Vec<String> = nodes.iter().map(Node::url).collect();
    let per_connect = links_per_connect(&nodes, &seeds).await;
    let store = connect(&seeds, "storm").await;
    let sink = Sink::open("clusterstorm", false);
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
    for i in 0..2 {
        let a = send(addr, &key_on(&store, 2, i, "warm")).await;
        assert!(a.live_201(), "warm-up on node {i}: {a:?}");
    }
    let (a_valve, b_valve) = (nodes[0].valve(), nodes[1].valve());
    let open_before = (a_valve.open(), b_valve.open());
    let a_links = a_valve.links();
    b_valve.freeze();
    let mut keys = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..12 {
        let key = key_on(&store, 2, 1, &format!("storm{i}"));
        keys.push(key.clone());
        tasks.push(tokio::spawn(async move { send(addr, &key).await }));
        tokio::time::sleep(ms(100)).await;
    }
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(guard("storm request", t).await.expect("task"));
    }
    let made_at_a = a_valve.links() - a_links;
    println!(
        "storm: {:?}; links made at A's valve {made_at_a} (one connection to the cluster makes \
         {per_connect:?})",
        statuses(&answers)
    );
    for a in &answers {
        assert!(a.status == 201 || a.status == 503, "{a:?}");
    }
    b_valve.thaw();
    let open_after = (
        open_at_most(a_valve, open_before.0, 300).await,
        open_at_most(b_valve, open_before.1, 300).await,
    );
    for key in &keys {
        let a = settled(addr, key).await;
        assert!(a.status == 201, "{key}: {a:?}");
    }
    assert_eq!(
        sink.effects.count(),
        2 + keys.len(),
        "each key once at the sink"
    );
    println!("open sockets at A, B: {open_after:?} (before {open_before:?})");
    assert!(
        open_after.0 <= open_before.0 && open_after.1 <= open_before.1,
        "replaced connections are left open: {open_after:?} client sockets open at A, B; \
         {open_before:?} before the storm"
    );
    assert!(
        made_at_a <= 2 * per_connect[0],
        "one replacement is made for a connection that stopped answering: {made_at_a} links \
         made at node A's valve during a storm of {} timeouts, where one connection to the \
         cluster makes {}",
        keys.len(),
        per_connect[0]
    );
}

// ==== c. A replacement that fails ===============================================================

/// README's fault row ("a new connection is made in the background (once, tried again on a
/// later timeout if it fails), so the next request runs") and DESIGN §7.10 (store down: 503,
/// nothing run; recovery when it returns), on a cluster whose store was given node B alone.
/// Fault: B's links stall and, for a while, every new link to B is refused, so the replacement
/// cannot connect (its only seed refuses). Keys on A keep running meanwhile; the key that met
/// the stall is refused 503; once new links are answered, a later timeout tries again and the
/// next key on B runs; each key exactly once, and no socket left open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_10_a_cluster_replacement_that_failed_is_tried_again() {
    let Some(nodes) = cluster(2, true, &[]).await else {
        return;
    };
    let store = connect(&[nodes[1].url()], "refused").await;
    let sink = Sink::open("clusterrefused", false);
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
    for i in 0..2 {
        let a = send(addr, &key_on(&store, 2, i, "warm")).await;
        assert!(a.live_201(), "warm-up on node {i}: {a:?}");
    }
    let (a_valve, b_valve) = (nodes[0].valve(), nodes[1].valve());
    let open_before = (a_valve.open(), b_valve.open());
    b_valve.refusing(true);
    b_valve.freeze();
    let mark = b_valve.links();
    let met = key_on(&store, 2, 1, "met");
    let m = met.clone();
    let first = tokio::spawn(async move { send(addr, &m).await });
    // The first timeout asks for a replacement: refused at B.
    let mut tried = false;
    for _ in 0..160 {
        if b_valve.links() > mark {
            tried = true;
            break;
        }
        tokio::time::sleep(ms(50)).await;
    }
    tokio::time::sleep(ms(300)).await;
    let on_a = key_on(&store, 2, 0, "on-a");
    let a_meanwhile = send(addr, &on_a).await;
    b_valve.refusing(false);
    let first = guard("the request that met the stall", first)
        .await
        .expect("task");
    println!(
        "replacement tried: {tried} ({} links refused); met: {first:?}; a key on A \
         meanwhile: {a_meanwhile:?}",
        b_valve.links() - mark
    );
    assert!(tried, "a timeout asked for no replacement");
    assert_eq!(first.status, 503, "{first:?}");
    assert!(a_meanwhile.live_201(), "{a_meanwhile:?}");
    // The replacement tried again starts at that request's own last timeout, the moment it is
    // answered 503: a request sent at that very instant may still take the old connection
    // (seen once here: it met the stall, 10 s more). Give the new one a moment.
    tokio::time::sleep(ms(500)).await;
    let mut later = Vec::new();
    for i in 0..3 {
        let key = key_on(&store, 2, 1, &format!("later{i}"));
        let a = send(addr, &key).await;
        let ok = a.live_201();
        later.push((key, a));
        if ok {
            break;
        }
    }
    println!("then: {later:?}");
    assert!(
        later.iter().any(|(_, a)| a.live_201()),
        "new links to B are answered again, yet requests on its slots keep failing: {later:?}"
    );
    b_valve.thaw();
    let again = settled(addr, &met).await;
    assert!(again.live_201(), "the refused key runs on retry: {again:?}");
    for (key, _) in &later {
        let a = settled(addr, key).await;
        assert!(a.status == 201, "{key}: {a:?}");
    }
    assert_eq!(
        sink.effects.count(),
        2 + 1 + 1 + later.len(),
        "each key once at the sink: warm-ups, the key on A, met, the later ones"
    );
    let open_after = (
        open_at_most(a_valve, open_before.0, 300).await,
        open_at_most(b_valve, open_before.1, 300).await,
    );
    assert!(
        open_after.0 <= open_before.0 && open_after.1 <= open_before.1,
        "sockets left open at A, B: {open_after:?}; before {open_before:?}"
    );
}

// ==== d. Milestones stalled on the replaced cluster connection ==================================

/// DESIGN §4 (milestones are durable writes on the record, fenced by the lease token; "a
/// worker whose lease was taken over can no longer write"; a resolved outcome is final), on a
/// two-master cluster. Fault: node B's links stall while the holder of a key on B marks its
/// effect started (and its lease keeper renews): the first ask times out, the connection to
/// the cluster is made anew; the holder either gets its milestone on the new connection and
/// runs, or is told the store is down and does nothing (503), and a retry runs. Then the
/// stalled link delivers the holder's first milestone and renewals: they are fenced or
/// harmless. The key runs once at the sink and replays that run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_milestones_stalled_on_one_cluster_node_are_fenced_after_the_replacement() {
    let Some(nodes) = cluster(2, true, &[]).await else {
        return;
    };
    let prefix = "cluster-milestone";
    let store = connect(&nodes.iter().map(Node::url).collect::<Vec<_>>(), prefix).await;
    let sink = Sink::new("clustermilestone", true);
    sink.gate_b.add_permits(10_000);
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
    sink.gate_a.add_permits(2);
    for i in 0..2 {
        let a = send(addr, &key_on(&store, 2, i, "warm")).await;
        assert!(a.live_201(), "warm-up on node {i}: {a:?}");
    }
    let key = key_on(&store, 2, 1, "k");
    let k = key.clone();
    let holder = tokio::spawn(async move { send(addr, &k).await });
    started(&sink, 3).await;
    nodes[1].valve().freeze();
    sink.gate_a.add_permits(10_000);
    let first = guard("holder", holder).await.expect("task");
    let retry = settled(addr, &key).await;
    nodes[1].valve().thaw();
    tokio::time::sleep(ms(1000)).await;
    let again = settled(addr, &key).await;
    let rec = record(&nodes[1].server, prefix, &key).await;
    println!(
        "first {first:?}; retry {retry:?}; again {again:?}; milestones {:?}; record {:?}",
        sink.milestones.lock().expect("lock"),
        rec.as_ref()
            .map(|r| (r.status, r.attempts, r.effect_started))
    );
    assert_eq!(
        sink.effects.count(),
        3,
        "the warm-ups and the key, once each at the sink"
    );
    assert!(
        again.replay_201() && (retry.status != 201 || again.body == retry.body),
        "after the stalled milestones landed the key must replay its one run: first {first:?}, \
         retry {retry:?}, again {again:?}"
    );
    assert!(
        rec.is_some_and(|r| r.status == RecordStatus::Completed),
        "the record stays completed"
    );
}

// ==== e. check() on a cluster of the test's own =================================================

/// README ("`RedisStore::check()` reports a server (on a cluster, every node it lists) that
/// may evict, or whose `CONFIG` it cannot read") and `RedisCheckError::ConfigUnreadable`.
/// Fault: node B, never given, refuses `CONFIG` (`rename-command CONFIG ""`, as managed
/// services do); a `CLUSTER MEET` to nowhere leaves a node in handshake in the listing, which
/// is skipped. `check()` through A alone says `ConfigUnreadable`, never Ok.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_check_reports_a_listed_node_that_refuses_config() {
    let Some(nodes) = cluster(2, false, &[&[], &["--rename-command", "CONFIG", ""]]).await else {
        return;
    };
    let store = connect(&[nodes[0].url()], "noconfig").await;
    // A node in handshake (nothing answers there): skipped.
    let (nowhere, nowhere_bus) = (free_port().to_string(), free_port().to_string());
    nodes[0]
        .server
        .cmd(&["CLUSTER", "MEET", "127.0.0.1", &nowhere, &nowhere_bus])
        .await
        .expect("MEET nowhere");
    let checked = guard("check", store.check()).await;
    println!("{checked:?}");
    assert!(
        matches!(checked, Err(RedisCheckError::ConfigUnreadable { .. })),
        "node B refuses CONFIG: {checked:?}"
    );
}

/// `check()`'s doc ("every node: those the store was given and those they list in `CLUSTER
/// NODES`, replicas included, since a replica promoted by a failover holds the records then";
/// "Nodes the cluster marks failed … are skipped") and README. A replica of A that may evict is
/// reported by its address; the same node killed (before the cluster marks it failed, with
/// the default 15 s node timeout) is reported `Unreachable`, never Ok: its policy cannot be
/// read, and it may hold the records after a failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_check_reports_a_replica_that_evicts_and_one_that_is_down() {
    let Some(mut nodes) = cluster(2, false, &[]).await else {
        return;
    };
    let replica = ["--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"];
    if add_replica(&mut nodes, &replica).await.is_none() {
        return;
    }
    // Given A twice, and as localhost: no false error from either.
    let given = [
        nodes[0].url(),
        nodes[0].url(),
        format!("redis://localhost:{}", nodes[0].server.port),
    ];
    let store = connect(&given, "replica").await;
    let port = nodes[2].server.port;
    match guard("check", store.check()).await {
        Err(RedisCheckError::Evicts { node, policy }) => {
            assert!(node.ends_with(&format!(":{port}")), "{node}");
            assert_eq!(policy, "allkeys-lru");
        }
        other => panic!("the replica (never given) evicts: {other:?}"),
    }
    // The replica dies; the cluster has not yet marked it failed.
    let mut replica = nodes.pop().expect("the replica");
    if let Some(mut child) = replica.server.child.take() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let listing = nodes[0].nodes().await;
    let checked = guard("check", store.check()).await;
    println!("{checked:?} (the error names no node: {})", {
        match &checked {
            Err(e) => !e.to_string().contains(&port.to_string()),
            Ok(()) => false,
        }
    });
    let line = listing
        .lines()
        .find(|l| l.contains(&format!(":{port}@")))
        .unwrap_or_default()
        .to_owned();
    assert!(
        !line.contains(",fail ") && !line.contains(" fail"),
        "{line}"
    );
    assert!(
        matches!(checked, Err(RedisCheckError::Unreachable { .. })),
        "a listed node that is down, not yet marked failed: {checked:?}"
    );
}

/// `check()`'s doc ("Nodes the cluster marks failed … are skipped") and the brief's "given
/// node down but another given node up -> discovery still works". Fault: the store was given
/// a replica C and master A; C dies and the cluster marks it `fail` (node timeout 1 s), as a
/// seed list outlives a node. The store itself works (connects through A); `check()` must
/// still discover the cluster through A, skip the failed node, and pass while nothing evicts
/// (then report B once B may evict), not fail on the node the cluster already gave up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_check_skips_a_given_node_the_cluster_marks_failed() {
    let timeout: &[&str] = &["--cluster-node-timeout", "1000"];
    let Some(mut nodes) = cluster(2, false, &[timeout, timeout]).await else {
        return;
    };
    if add_replica(&mut nodes, timeout).await.is_none() {
        return;
    }
    let store = connect(&[nodes[2].url(), nodes[0].url()], "failed").await;
    assert!(
        guard("check", store.check()).await.is_ok(),
        "nothing evicts"
    );
    let mut c = nodes.pop().expect("the replica");
    let port = c.server.port;
    if let Some(mut child) = c.server.child.take() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let mut marked = false;
    for _ in 0..300 {
        let listing = nodes[0].nodes().await;
        marked = listing
            .lines()
            .filter(|l| l.contains(&format!(":{port}@")))
            .any(|l| {
                l.split(' ')
                    .nth(2)
                    .is_some_and(|f| f.split(',').any(|f| f == "fail"))
            });
        if marked {
            break;
        }
        tokio::time::sleep(ms(50)).await;
    }
    assert!(marked, "the cluster never marked the dead replica failed");
    // The store works through A.
    let sink = Sink::open("failedseed", false);
    let addr = serve(app(store.clone(), &sink, &Knobs::default())).await;
    let a = send(addr, &unique("k")).await;
    assert!(a.live_201(), "{a:?}");
    let checked = guard("check", store.check()).await;
    println!("with the given replica failed: {checked:?}");
    assert!(
        checked.is_ok(),
        "the cluster marked the given node {port} failed (check() skips such nodes, says its \
         doc), nothing evicts, the store works: {checked:?}"
    );
    for args in [
        &["CONFIG", "SET", "maxmemory", "100mb"][..],
        &["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"],
    ] {
        nodes[1]
            .server
            .cmd(args)
            .await
            .expect("B's memory settings");
    }
    match guard("check", store.check()).await {
        Err(RedisCheckError::Evicts { node, .. }) => {
            assert!(
                node.ends_with(&format!(":{}", nodes[1].server.port)),
                "{node}"
            );
        }
        other => panic!("node B, never given, evicts: {other:?}"),
    }
}

// ==== f. The replacement and the runtimes it is made on =========================================

/// README's fault table (the layer serves on several runtimes: "a runtime per core, or one that
/// shuts down while another goes on") and the Redis fault row (a connection that stops
/// answering is replaced, "so the next request runs"). Fault: node B stalls; the command that
/// meets the timeout ran on a runtime of the app's that then shuts down (its replacement was
/// made there). Once B answers again, the store must serve requests on the runtime that goes
/// on, not fail every command for good. (A single server's store recovers from the same
/// sequence: redis-rs's `ConnectionManager` connects again after one broken pipe. The cluster
/// connection's task died with that runtime, every command then fails at once with "Unable
/// to send command", which is no timeout, so nothing ever replaces it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_10_a_replacement_made_on_a_runtime_that_ends_does_not_kill_the_store() {
    let Some(nodes) = cluster(2, true, &[]).await else {
        return;
    };
    let store = connect(&nodes.iter().map(Node::url).collect::<Vec<_>>(), "runtimes").await;
    let (ka, kb) = (
        ScopedKey::new("", key_on(&store, 2, 0, "a")),
        ScopedKey::new("", key_on(&store, 2, 1, "b")),
    );
    for k in [&ka, &kb] {
        guard("lookup", store.lookup(k)).await.expect("lookup");
    }
    let b_valve = nodes[1].valve().clone();
    b_valve.freeze();
    let mark = nodes[0].valve().links();
    let (s, a_valve, key) = (store.clone(), nodes[0].valve().clone(), kb.clone());
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let rt = common::runtimes::current_thread();
        let out = rt.block_on(async {
            let met = s.lookup(&key).await;
            // The replacement connects (bounded).
            for _ in 0..100 {
                if a_valve.links() > mark {
                    break;
                }
                tokio::time::sleep(ms(20)).await;
            }
            tokio::time::sleep(ms(300)).await;
            format!("{met:?}")
        });
        drop(rt);
        let _ = tx.send(out);
    });
    let met = guard("the runtime that ends", rx).await.expect("thread");
    println!(
        "on the runtime that ended: {met}; links made at A since: {}",
        nodes[0].valve().links() - mark
    );
    b_valve.thaw();
    let mut seen = Vec::new();
    let mut ok = false;
    for _ in 0..12 {
        let a = guard("lookup", store.lookup(&ka)).await;
        let b = guard("lookup", store.lookup(&kb)).await;
        ok = a.is_ok() && b.is_ok();
        seen.push(format!("{a:?} / {b:?}"));
        if ok {
            break;
        }
        tokio::time::sleep(ms(250)).await;
    }
    seen.dedup();
    println!("then: {seen:?}");
    assert!(
        ok,
        "every node answers and this runtime goes on, but the store fails every command: {seen:?}"
    );
}

/// `Replaceable::replace`'s doc ("Connects a replacement … (once)") and the README fault row
/// ("tried again on a later timeout if it fails"). Fault: the replacement is still connecting
/// (the nodes answer slowly) when the runtime it was spawned on shuts down, so it never
/// finishes; node B's old link stays mute for good. A later timeout on the runtime that goes
/// on must try again, so the request after it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_10_a_replacement_cut_short_by_its_runtime_is_tried_again() {
    let Some(nodes) = cluster(2, true, &[]).await else {
        return;
    };
    let store = connect(&nodes.iter().map(Node::url).collect::<Vec<_>>(), "cutshort").await;
    let kb = ScopedKey::new("", key_on(&store, 2, 1, "b"));
    guard("lookup", store.lookup(&kb)).await.expect("lookup");
    let (a_valve, b_valve) = (nodes[0].valve().clone(), nodes[1].valve().clone());
    b_valve.freeze();
    let mark = a_valve.links();
    let (s, a, b, key) = (store.clone(), a_valve.clone(), b_valve.clone(), kb.clone());
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let rt = common::runtimes::current_thread();
        let out = rt.block_on(async {
            // New links answer slowly: the replacement is still connecting when this ends.
            a.slow(1500);
            b.slow(1500);
            let met = s.lookup(&key).await;
            for _ in 0..100 {
                if a.links() > mark {
                    break;
                }
                tokio::time::sleep(ms(20)).await;
            }
            tokio::time::sleep(ms(200)).await;
            format!("{met:?}")
        });
        drop(rt);
        let _ = tx.send(out);
    });
    let met = guard("the runtime that ends", rx).await.expect("thread");
    a_valve.slow(0);
    b_valve.slow(0);
    println!(
        "on the runtime that ended: {met}; links made at A since: {}",
        a_valve.links() - mark
    );
    // B's old link stays mute. The first lookup here meets it (5 s) and asks again for a
    // replacement; the second, once the replacement had the moment it takes to connect (one
    // sent in that moment still takes the old link, as in the test above), must run on it.
    let first = guard("lookup", store.lookup(&kb)).await;
    tokio::time::sleep(ms(500)).await;
    let second = guard("lookup", store.lookup(&kb)).await;
    println!(
        "then: {first:?}; {second:?}; links made at A: {}",
        a_valve.links() - mark
    );
    assert!(
        second.is_ok(),
        "a timeout after the cut-short replacement asked for none: the store keeps timing out on \
         B's mute link ({first:?}, then {second:?})"
    );
    b_valve.thaw();
}
