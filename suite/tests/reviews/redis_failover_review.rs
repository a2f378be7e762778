//! Review: a Redis primary lost and its replica promoted (`REPLICAOF NO ONE`) while the
//! replica lagged, under the layer and `RedisStore::with_wait(1, …)`. The replica follows the
//! primary through a link the test cuts (a partition, a replica that fell behind): what the
//! primary took after the cut, the promoted replica never had. Peers (and this store before
//! claims and milestones waited) ran an effect a second time after a failover: the claim, or
//! the milestone saying the effect started, was acknowledged to the layer by the primary alone.
//!
//! Expected (DESIGN §1.5–§1.6, §5; `with_wait`'s documentation): nothing runs under a claim the
//! replica did not acknowledge (the request is refused 503, nothing run); a handler is told the
//! store is down when the replica did not acknowledge its `effect_started()`, so its effect
//! does not start; a completion the replica did not acknowledge fails at the store; and after
//! the failover each key runs at most once in all, counted at the handler's sink, while what
//! was acknowledged replays from the promoted replica.

use crate::common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tower_idempotency::store::{
    Claim, ClaimRequest, FencingToken, Milestone, RecordStatus, RedisCheckError, RedisStore,
    StoreError, StoredResponse,
};
use tower_idempotency::{Fingerprint, IdempotencyStore, LeaseExpiry, ScopedKey};

use common::own_redis::*;
use common::{guard, serve};

/// How long a write waits for the replica's acknowledgement.
const WAIT: Duration = Duration::from_millis(500);

/// A TCP link the replica follows its primary through: cut, it closes every connection and
/// refuses new ones, so the replica falls behind; restored, the replica catches up.
#[derive(Clone)]
struct Link {
    port: u16,
    down: Arc<AtomicBool>,
    relays: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Link {
    async fn to(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind link");
        let link = Self {
            port: listener.local_addr().expect("addr").port(),
            down: Arc::default(),
            relays: Arc::default(),
        };
        let l = link.clone();
        tokio::spawn(async move {
            while let Ok((mut near, _)) = listener.accept().await {
                if l.down.load(Ordering::SeqCst) {
                    continue; // refused while cut
                }
                let Ok(mut far) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let relay = tokio::spawn(async move {
                    let _ = tokio::io::copy_bidirectional(&mut near, &mut far).await;
                });
                l.relays.lock().expect("lock").push(relay);
            }
        });
        link
    }

    fn cut(&self) {
        self.down.store(true, Ordering::SeqCst);
        for relay in self.relays.lock().expect("lock").drain(..) {
            relay.abort();
        }
    }

    fn restore(&self) {
        self.down.store(false, Ordering::SeqCst);
    }
}

/// A primary, and a replica following it through a [`Link`].
struct Pair {
    primary: OwnRedis,
    replica: OwnRedis,
    link: Link,
}

impl Pair {
    async fn start() -> Option<Self> {
        let primary = OwnRedis::start(&[])?;
        let link = Link::to(primary.addr()).await;
        let port = link.port.to_string();
        let replica = OwnRedis::start(&["--replicaof", "127.0.0.1", &port])?;
        let pair = Self {
            primary,
            replica,
            link,
        };
        pair.in_step().await;
        Some(pair)
    }

    /// Until the replica follows the primary and the primary counts it.
    async fn in_step(&self) {
        guard("the replica follows its primary", async {
            loop {
                let replica = info(&self.replica).await;
                let primary = info(&self.primary).await;
                if replica.contains("master_link_status:up")
                    && primary.contains("connected_slaves:1")
                {
                    break;
                }
                tokio::time::sleep(ms(20)).await;
            }
        })
        .await;
    }

    /// Cuts the link and waits until the primary has noticed: from then on, it writes what
    /// the replica does not get.
    async fn partition(&self) {
        self.link.cut();
        guard("the primary loses its replica", async {
            while !info(&self.primary).await.contains("connected_slaves:0") {
                tokio::time::sleep(ms(20)).await;
            }
        })
        .await;
    }

    /// The primary dies (SIGKILL) and the replica is promoted: what it had is all there is.
    async fn fail_over(&mut self) {
        if let Some(mut primary) = self.primary.child.take() {
            let _ = primary.kill();
            let _ = primary.wait();
        }
        self.link.cut();
        let promoted = self.replica.cmd(&["REPLICAOF", "NO", "ONE"]).await;
        assert!(promoted.is_ok(), "REPLICAOF NO ONE: {promoted:?}");
        assert!(
            info(&self.replica).await.contains("role:master"),
            "the replica is promoted"
        );
    }
}

async fn info(server: &OwnRedis) -> String {
    match server.cmd(&["INFO", "replication"]).await {
        Ok(redis::Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
        Ok(redis::Value::VerbatimString { text, .. }) => text,
        other => panic!("INFO replication: {other:?}"),
    }
}

async fn waiting_store(url: &str, prefix: &str) -> RedisStore {
    store_on(url, Some(prefix)).await.with_wait(1, WAIT)
}

/// The first request's claim reaches the primary after the partition: the replica never has
/// it. Under `with_wait(1, …)` nothing runs under that claim; after the failover the key runs
/// once on the promoted replica. Without the claim's wait, the handler ran on the primary,
/// and the promoted replica let the retry run it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_a_claim_the_replica_never_had_runs_nothing_and_the_key_runs_once_after_failover() {
    let Some(mut pair) = Pair::start().await else {
        return;
    };
    let prefix = unique("failover-claim");
    let sink = Sink::open("failover-claim", false);
    let knobs = Knobs {
        lease: Duration::from_secs(2),
        external: true,
        ..Knobs::default()
    };
    let store = waiting_store(&pair.primary.url(), &prefix).await;
    let addr = serve(app(store, &sink, &knobs)).await;
    let key = unique("k");

    pair.partition().await;
    let refused = send(addr, &key).await;
    let ran_before = sink.runs.count();

    pair.fail_over().await;
    let promoted = store_on(&pair.replica.url(), Some(&prefix)).await;
    let after = serve(app(promoted, &sink, &knobs)).await;
    let answer = settled_past(after, &key, &[409, 503], |_| {}).await;
    assert_eq!(sink.effects.count(), 1, "one effect across the failover");
    assert_eq!(ran_before, 0, "nothing ran under the unacknowledged claim");
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(
        refused.problem.as_deref(),
        Some("store-unavailable"),
        "{refused:?}"
    );
    assert!(answer.live_201(), "{answer:?}");
    let again = send(after, &key).await;
    assert!(again.replay_201(), "{again:?}");
    assert_eq!(sink.runs.count(), 1, "one run across the failover");
}

/// The claim reached the replica; the partition comes before the handler says its effect
/// started. Under `with_wait(1, …)` the handler is told the store is down and does nothing;
/// after the failover the replica's lease runs out and the key runs once. Without the
/// milestone's wait, the handler did its effect on the primary's word, and the promoted
/// replica (no milestone, a lease that ran out) let a retry take the key over and do it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_a_milestone_the_replica_never_had_starts_no_effect_and_the_key_runs_once_after_failover()
 {
    let Some(mut pair) = Pair::start().await else {
        return;
    };
    let held = MilestoneCut::run(&pair, "failover-milestone").await;
    let (sink, key, first) = (&held.sink, &held.key, &held.first);
    let effects_before = sink.effects.count();

    pair.fail_over().await;
    let promoted = store_on(&pair.replica.url(), Some(&held.prefix)).await;
    let after = serve(app(promoted, sink, &held.knobs)).await;
    let answer = settled_past(after, key, &[409, 503], |_| {}).await;
    assert_eq!(sink.effects.count(), 1, "one effect across the failover");
    assert_eq!(effects_before, 0, "no effect without its milestone");
    assert_eq!(first.status, 503, "{first:?}");
    let said = sink.milestones.lock().expect("lock").clone();
    assert!(
        said.len() == 2 && said[0].contains("Err") && said[1].contains("Ok"),
        "effect_started() failed on the primary, then held on the promoted replica: {said:?}"
    );
    assert!(answer.live_201(), "{answer:?}");
    assert!(answer.body.ends_with("attempt 2"), "{answer:?}");
    assert_eq!(
        sink.runs.count(),
        2,
        "the second run is the only one with an effect"
    );
}

/// No failover: the link comes back. A request refused because its claim was not acknowledged
/// left nothing held (the claim was given back), so its resend runs once and replays; a key
/// whose milestone was not acknowledged is held by the primary as possibly started, so it
/// awaits reconciliation and never runs again on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_after_a_partition_heals_a_refused_claim_runs_once_and_a_refused_milestone_awaits_reconciliation()
 {
    let Some(pair) = Pair::start().await else {
        return;
    };
    let held = MilestoneCut::run(&pair, "failover-heal").await;
    let (sink, addr, first) = (&held.sink, held.addr, &held.first);
    let claimed = unique("claim");
    assert_eq!(first.status, 503, "{first:?}");
    let refused = send(addr, &claimed).await;
    assert_eq!(
        refused.problem.as_deref(),
        Some("store-unavailable"),
        "{refused:?}"
    );
    assert_eq!(sink.runs.count(), 1, "only the milestone's request ran");

    pair.link.restore();
    pair.in_step().await;
    let answer = settled_past(addr, &claimed, &[409], |_| {}).await;
    assert!(answer.live_201(), "{answer:?}");
    assert!(send(addr, &claimed).await.replay_201());
    let unknown = send(addr, &held.key).await;
    assert_eq!(unknown.status, 409, "{unknown:?}");
    assert_eq!(
        unknown.problem.as_deref(),
        Some("outcome-unknown"),
        "{unknown:?}"
    );
    assert_eq!(
        sink.effects.count(),
        1,
        "the refused claim's key ran once, the other never"
    );
    assert_eq!(sink.runs.count(), 2);
}

/// Every write that waits, at the store: acknowledged while the replica follows, refused while
/// it is cut off, and what was acknowledged is what the promoted replica has. Without the
/// wait, the completion under the partition would have been reported as recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_writes_that_wait_are_acknowledged_only_with_the_replica_and_survive_failover() {
    let Some(mut pair) = Pair::start().await else {
        return;
    };
    let prefix = unique("failover-store");
    let store = waiting_store(&pair.primary.url(), &prefix).await;
    let (kept, cut_off) = (ScopedKey::new("t", "kept"), ScopedKey::new("t", "cut-off"));
    let response = StoredResponse {
        status: axum::http::StatusCode::CREATED,
        headers: axum::http::HeaderMap::new(),
        body: Some(bytes::Bytes::from_static(b"kept")),
        trailers: None,
    };

    // `check()` counts the replicas the store waits for.
    store
        .check()
        .await
        .expect("one replica follows, one is waited for");
    let two = store.clone().with_wait(2, WAIT).check().await;
    assert!(
        matches!(
            two,
            Err(RedisCheckError::TooFewReplicas {
                connected: 1,
                wanted: 2,
                ..
            })
        ),
        "{two:?}"
    );

    // While the replica follows: claim, milestone and completion acknowledged.
    let lease = acquired(&store, &kept).await;
    store
        .record_milestone(&kept, lease, &Milestone::EffectStarted)
        .await
        .expect("a milestone the replica acknowledged");
    store
        .complete(&kept, lease, &response, Duration::from_secs(60))
        .await
        .expect("a completion the replica acknowledged");

    // Claimed while it follows, then cut off: the completion is refused, as is a new claim.
    let held = acquired(&store, &cut_off).await;
    pair.partition().await;
    let alone = store.check().await;
    assert!(
        matches!(
            &alone,
            Err(RedisCheckError::TooFewReplicas { connected: 0, .. })
        ),
        "{alone:?}"
    );
    assert!(alone.is_err_and(|e| e.to_string().contains("every claim is refused")));
    let completed = store
        .complete(&cut_off, held, &response, Duration::from_secs(60))
        .await;
    assert!(
        matches!(&completed, Err(StoreError::Unavailable(e)) if e.to_string().contains("0 of 1")),
        "a completion the replica did not acknowledge: {completed:?}"
    );
    let other = ScopedKey::new("t", "other");
    let claimed = store.claim(&request(&other)).await;
    assert!(
        matches!(claimed, Err(StoreError::Unavailable(_))),
        "a claim the replica did not acknowledge: {claimed:?}"
    );

    pair.fail_over().await;
    let promoted = store_on(&pair.replica.url(), Some(&prefix)).await;
    let record = promoted.lookup(&kept).await.expect("lookup").expect("kept");
    assert_eq!(record.status, RecordStatus::Completed, "{record:?}");
    let record = promoted
        .lookup(&cut_off)
        .await
        .expect("lookup")
        .expect("its claim was acknowledged");
    assert_eq!(
        record.status,
        RecordStatus::InProgress,
        "the unacknowledged completion is not on the replica: {record:?}"
    );
    assert!(
        promoted.lookup(&other).await.expect("lookup").is_none(),
        "the unacknowledged claim is not on the replica"
    );
}

/// A request whose handler needs its milestone (`effect_started()`) before its effect, on an
/// app over a store that waits for the replica: held before the milestone while the link is
/// cut, then let through.
struct MilestoneCut {
    sink: Sink,
    knobs: Knobs,
    prefix: String,
    addr: SocketAddr,
    key: String,
    /// The request's answer.
    first: Answer,
}

impl MilestoneCut {
    async fn run(pair: &Pair, tag: &'static str) -> Self {
        let prefix = unique(tag);
        let sink = Sink::new(tag, true);
        sink.gate_b.add_permits(10_000);
        let knobs = Knobs {
            lease: Duration::from_secs(2),
            ..Knobs::default()
        };
        let store = waiting_store(&pair.primary.url(), &prefix).await;
        let addr = serve(app(store, &sink, &knobs)).await;
        let key = unique("k");
        let first = tokio::spawn({
            let key = key.clone();
            async move { send(addr, &key).await }
        });
        started(&sink, 1).await;
        pair.partition().await;
        sink.gate_a.add_permits(10_000);
        let first = guard("the milestone's request", first)
            .await
            .expect("first");
        Self {
            sink,
            knobs,
            prefix,
            addr,
            key,
            first,
        }
    }
}

fn request(key: &ScopedKey) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        fingerprint: Fingerprint::from_bytes([9; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(60),
        on_lease_expiry: LeaseExpiry::Reclaim,
    }
}

async fn acquired(store: &RedisStore, key: &ScopedKey) -> FencingToken {
    match store.claim(&request(key)).await {
        Ok(Claim::Acquired(lease)) => {
            assert!(lease.until > SystemTime::UNIX_EPOCH);
            lease.token
        }
        other => panic!("claim of {key:?}: {other:?}"),
    }
}
