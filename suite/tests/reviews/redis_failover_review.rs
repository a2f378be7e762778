//! Review: a Redis primary lost and its replica promoted (`REPLICAOF NO ONE`) while the
//! replica lagged, under the layer and `RedisStore::with_wait(1, …)`. The replica follows the
//! primary through a link the test stalls (a partition, a replica that fell behind): what the
//! primary took after the stall, the promoted replica never had. Peers (and this store before
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
use std::time::{Duration, SystemTime};

use tower_idempotency::store::{
    Claim, ClaimRequest, FencingToken, Milestone, RecordStatus, RedisCheckError, RedisStore,
    StoreError, StoredResponse,
};
use tower_idempotency::{Fingerprint, IdempotencyStore, LeaseExpiry, ScopedKey};

use common::own_redis::*;
use common::{guard, serve};

use common::valve::Valve;

/// How long a write waits for the replica's acknowledgement.
const WAIT: Duration = Duration::from_millis(500);

/// A primary, and a replica following it through a [`Valve`]. Frozen, the valve passes no
/// byte either way but keeps its links open: the primary still counts the replica as
/// following (until `repl-timeout`, a minute), so only a `WAIT` on the connection that wrote
/// can tell it has not acknowledged. Thawed, the replica catches up.
struct Pair {
    primary: OwnRedis,
    replica: OwnRedis,
    link: Valve,
}

impl Pair {
    async fn start() -> Option<Self> {
        let primary = OwnRedis::start(&[])?;
        let link = Valve::start(primary.addr()).await;
        let port = link.addr.port().to_string();
        let replica = OwnRedis::start(&["--replicaof", "127.0.0.1", &port])?;
        let pair = Self {
            primary,
            replica,
            link,
        };
        pair.in_step().await;
        Some(pair)
    }

    /// Until the replica follows the primary, the primary counts it online, and it has all
    /// the primary wrote.
    async fn in_step(&self) {
        guard("the replica follows its primary", async {
            loop {
                let replica = info(&self.replica, "replication").await;
                let primary = info(&self.primary, "replication").await;
                let offset = |info: &str| field(info, "master_repl_offset").map(str::to_owned);
                // Online: past its first sync, counted by `WAIT` (a diskless sync puts it
                // online at its first acknowledgement, after its own link is up).
                if replica.contains("master_link_status:up")
                    && primary.contains("connected_slaves:1")
                    && primary.contains("state=online")
                    && offset(&primary).is_some()
                    && offset(&primary) == offset(&replica)
                {
                    break;
                }
                tokio::time::sleep(ms(20)).await;
            }
        })
        .await;
    }

    /// Stalls the link: from now on the primary writes what the replica does not get, while
    /// it still counts the replica as following.
    async fn partition(&self) {
        // A link the replica made anew meanwhile would not be frozen: none is let through.
        self.link.refusing(true);
        self.link.freeze();
        let primary = info(&self.primary, "replication").await;
        assert!(
            primary.contains("connected_slaves:1"),
            "the stalled replica is still counted: {primary}"
        );
    }

    /// The partition heals: the valve delivers what it held, and the replica catches up.
    async fn heal(&self) {
        self.link.refusing(false);
        self.link.thaw();
        self.in_step().await;
    }

    /// The primary drops its replica, which cannot follow anew: no replica follows it.
    async fn cut(&self) {
        self.link.refusing(true);
        assert_eq!(
            self.primary.kill("replica").await,
            1,
            "one replica followed"
        );
        guard("the primary loses its replica", async {
            while !info(&self.primary, "replication")
                .await
                .contains("connected_slaves:0")
            {
                tokio::time::sleep(ms(20)).await;
            }
        })
        .await;
    }

    /// The primary dies (SIGKILL) and the replica is promoted: what it had is all there is.
    async fn fail_over(&mut self) {
        // What the frozen link holds is lost with the primary: the link stays frozen, and the
        // replica cannot follow anew (not even a server that takes the dead one's port).
        self.link.refusing(true);
        if let Some(mut primary) = self.primary.child.take() {
            let _ = primary.kill();
            let _ = primary.wait();
        }
        let promoted = self.replica.cmd(&["REPLICAOF", "NO", "ONE"]).await;
        assert!(promoted.is_ok(), "REPLICAOF NO ONE: {promoted:?}");
        let replica = info(&self.replica, "replication").await;
        assert!(
            replica.contains("role:master"),
            "the replica is promoted: {replica}"
        );
    }
}

async fn waiting_store(url: &str, prefix: &str) -> RedisStore {
    store_on(url, Some(prefix)).await.with_wait(1, WAIT)
}

/// The store on the promoted replica, which has no replica of its own: it waits for none,
/// but still sends each write with its `WAIT`, on a server whose script cache is empty.
async fn promoted_store(pair: &Pair, prefix: &str) -> RedisStore {
    store_on(&pair.replica.url(), Some(prefix))
        .await
        .with_wait(0, WAIT)
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
    let promoted = promoted_store(&pair, &prefix).await;
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
    let held = MilestoneStall::run(&pair, "failover-milestone").await;
    let (sink, key, first) = (&held.sink, &held.key, &held.first);
    let effects_before = sink.effects.count();

    pair.fail_over().await;
    let promoted = promoted_store(&pair, &held.prefix).await;
    let after = serve(app(promoted, sink, &held.knobs)).await;
    let answer = settled_past(after, key, &[409, 503], |_| {}).await;
    assert_eq!(sink.effects.count(), 1, "one effect across the failover");
    assert_eq!(effects_before, 0, "no effect without its milestone");
    assert_eq!(first.status, 503, "{first:?}");
    let said = sink.milestones.lock().expect("lock").clone();
    assert!(
        said.len() == 2 && said[0].contains("0 of 1") && said[1].contains("Ok"),
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
    let held = MilestoneStall::run(&pair, "failover-heal").await;
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

    pair.heal().await;
    // Given back, not left to its lease: the first resend runs.
    let answer = send(addr, &claimed).await;
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

    // Claimed while it follows, then stalled (still counted as following): the milestone and
    // the completion are refused, as is a new claim, which is given back on the primary.
    let held = acquired(&store, &cut_off).await;
    pair.partition().await;
    let refused = |what: &str, result: Result<(), StoreError>| {
        assert!(
            matches!(&result, Err(StoreError::Unavailable(e)) if e.to_string().contains("0 of 1")),
            "a {what} the replica did not acknowledge: {result:?}"
        );
    };
    let milestone = store
        .record_milestone(&cut_off, held, &Milestone::EffectStarted)
        .await;
    refused("milestone", milestone);
    let completed = store
        .complete(&cut_off, held, &response, Duration::from_secs(60))
        .await;
    refused("completion", completed);
    let other = ScopedKey::new("t", "other");
    let claimed = store.claim(&request(&other)).await.map(|_| ());
    refused("claim", claimed);
    // A claim that finds a record (a replay) sends no `WAIT`: it never waits for the replica.
    let waits_before = waits_sent(&pair.primary).await;
    assert!(
        waits_before > 0,
        "the writes before waited, and INFO counts them"
    );
    let replay = store.claim(&request(&kept)).await;
    assert!(matches!(&replay, Ok(Claim::Completed { .. })), "{replay:?}");
    assert_eq!(
        waits_sent(&pair.primary).await,
        waits_before,
        "a replay sent a WAIT"
    );
    given_back(&store, &other).await;

    // Cut: no replica follows, and `check()` says so.
    pair.cut().await;
    let alone = store.check().await;
    assert!(
        matches!(
            &alone,
            Err(RedisCheckError::TooFewReplicas { connected: 0, .. })
        ),
        "{alone:?}"
    );
    assert!(alone.is_err_and(|e| e.to_string().contains("every claim that wins is refused")));

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
        "the unacknowledged milestone and completion are not on the replica: {record:?}"
    );
    assert!(!record.effect_started, "{record:?}");
    assert!(
        promoted.lookup(&other).await.expect("lookup").is_none(),
        "the unacknowledged claim is not on the replica"
    );
}

/// A request whose handler needs its milestone (`effect_started()`) before its effect, on an
/// app over a store that waits for the replica: held before the milestone while the link
/// stalls, then let through.
struct MilestoneStall {
    sink: Sink,
    knobs: Knobs,
    prefix: String,
    addr: SocketAddr,
    key: String,
    /// The request's answer.
    first: Answer,
}

impl MilestoneStall {
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

/// Until the refused claim of `key` is given back on `store`'s server (released).
async fn given_back(store: &RedisStore, key: &ScopedKey) {
    guard("the refused claim is given back", async {
        loop {
            let record = store.lookup(key).await.expect("lookup on the primary");
            match record.map(|r| r.status) {
                Some(RecordStatus::Released) => break,
                Some(RecordStatus::InProgress) => tokio::time::sleep(ms(10)).await,
                other => panic!("the refused claim's record: {other:?}"),
            }
        }
    })
    .await;
}

/// How many `WAIT`s `server` has run.
async fn waits_sent(server: &OwnRedis) -> u64 {
    calls(&info(server, "commandstats").await, "wait")
}

/// A `WAIT` the server refuses (an ACL user without it) acknowledges nothing: a claim that
/// won is refused and given back on the primary, nothing held for nobody until its lease
/// ends, and the error names the refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_a_claim_whose_wait_the_server_refuses_is_given_back() {
    let Some(pair) = Pair::start().await else {
        return;
    };
    let acl = pair
        .primary
        .cmd(&[
            "ACL", "SETUSER", "nowait", "on", "nopass", "~*", "&*", "+@all", "-wait",
        ])
        .await;
    assert!(acl.is_ok(), "ACL SETUSER: {acl:?}");
    let prefix = unique("failover-acl");
    let url = format!("redis://nowait:any@127.0.0.1:{}", pair.primary.port);
    let store = waiting_store(&url, &prefix).await;
    let key = ScopedKey::new("t", "refused");
    let claimed = store.claim(&request(&key)).await;
    assert!(
        matches!(&claimed, Err(StoreError::Unavailable(e)) if e.to_string().contains("WAIT failed")),
        "{claimed:?}"
    );
    let admin = store_on(&pair.primary.url(), Some(&prefix)).await;
    given_back(&admin, &key).await;
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
