//! [`RedisStore`]: records shared by a fleet, on Redis or Valkey, a single server or a Cluster.
//!
//! Every operation is one server-side Lua script, one round trip: the decision and every write
//! it implies happen atomically on the server, on the server's clock (`TIME`), fenced by the
//! lease token exactly as the SQL stores fence. Records expire by Redis TTL (`PEXPIREAT` at
//! their `expires_at`), so nothing needs purging; a record whose outcome is unknown has no
//! TTL until it is resolved.
//!
//! # Keys, and Redis Cluster
//!
//! A record is a hash at `{prefix}:{b}:r:{member}`, where `member` is the scope and key
//! (length-prefixed, so no two keys share one) and `b` one of 64 buckets, picked by a hash of
//! `member`. `{prefix}:{b}` is the key's hash tag: a record and its bucket's reconciliation
//! index (`{prefix}:{b}:u`, `{prefix}:{b}:p`) share one slot, so every script touches one slot
//! and a record never spans two. The 64 buckets spread over a cluster's masters; a listing of
//! uncertain records reads each bucket's head and merges them, O(page) per bucket. Records
//! changed in the same millisecond are listed in their members' byte order (the scope's
//! length, in decimal, first), not by scope then key: the member names the record, so it
//! cannot change between versions.
//!
//! # Durability
//!
//! What Redis loses, this store loses. A server with `appendonly yes` and `appendfsync always`
//! loses nothing it acknowledged; with `everysec` (the usual setting) a crash can lose up to a
//! second of acknowledged writes, and without persistence a restart loses every record. A
//! failover to a replica can lose what the replica had not yet received. A lost claim means a
//! retry may run the operation again; a lost completion means the retry waits out the lease
//! and runs again (or, past a started effect, awaits reconciliation on another record). Where
//! that matters, run with `appendfsync always`, or ask for replica acknowledgements of claims,
//! milestones and completions ([`RedisStore::with_wait`]).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

mod connection;

use redis::{Script, Value};

use connection::{Connection, Replaceable, TIMEOUT};

use super::Fingerprint;
use super::codec::fresh_token;
use super::history::{HISTORY_LIMIT, HISTORY_REFUSALS, HistoryEntry};
use super::{
    Claim, ClaimRequest, FencingToken, HistoryEvent, IdempotencyStore, InFlight, Lease,
    LeaseExpiry, Milestone, Record, RecordStatus, Resolution, ScopedKey, StoreError,
    StoredResponse, UncertainCount, UncertainCursor, UncertainPage, UncertainQuery, Unreadable,
};

/// How many buckets the records of one prefix are spread over (see the module docs).
const BUCKETS: u64 = 64;

/// The most records one listing returns (a page asked larger gets this many, and a cursor).
const MAX_PAGE: usize = 10_000;

/// Records in Redis or Valkey, shared by every replica that connects to the same server or
/// cluster (see the [module docs](self) for keys, Cluster and durability).
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_idempotency::{IdempotencyLayer, store::RedisStore};
///
/// let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
/// // or a cluster, from any of its nodes:
/// // let store = RedisStore::connect_cluster(&["redis://127.0.0.1:7000"]).await?;
/// let layer = IdempotencyLayer::new(store.with_prefix("payments")?);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    connection: Connection,
    prefix: Arc<str>,
    scripts: Arc<Scripts>,
    /// Replicas that must acknowledge a completion, and how long to wait for them.
    wait: Option<(u32, Duration)>,
    /// Requests waiting for in-flight keys, and the subscription that wakes them.
    changes: Arc<Changes>,
}

/// The waiters of one store, woken by the records' `PUBLISH`es on `{prefix}:changed`
/// (classic pub/sub reaches every node of a cluster, so one subscription to any node hears
/// them all). Subscribed on the first wait; while it is down, waiters poll.
struct Changes {
    /// Where the subscription connects: any of these (a cluster's nodes), in turn.
    clients: Vec<redis::Client>,
    /// Connections of their own for writes that `WAIT` for replicas (a `WAIT` blocks
    /// its connection), opened on first use.
    waiting: tokio::sync::OnceCell<Arc<Pool>>,
    waiters: super::Waiters<Vec<u8>>,
    started: std::sync::atomic::AtomicBool,
    /// Whether the subscription is up.
    live: std::sync::atomic::AtomicBool,
}

/// How many writes may wait for replicas at once (see [`RedisStore::with_wait`]).
const WAITING_CONNECTIONS: usize = 4;

/// The connections writes that wait for replicas run on, each lent to one write at a time: a
/// `WAIT` blocks its connection, and a write queued behind it there would spend its reply
/// timeout waiting for another's. Writes queue here instead, for at most [`TIMEOUT`].
struct Pool {
    connections: Vec<Arc<Replaceable>>,
    /// Those not lent now, the one free longest first.
    free: std::sync::Mutex<std::collections::VecDeque<usize>>,
    /// One per free connection.
    permits: Arc<tokio::sync::Semaphore>,
}

/// A connection for one write: the store's own, or one of the [`Pool`]'s, lent to this write
/// alone until dropped.
struct Lent {
    connection: Connection,
    slot: Option<Slot>,
}

impl Lent {
    /// The write's replies are in: nothing of it is left on the connection.
    fn done(&mut self) {
        if let Some(slot) = &mut self.slot {
            slot.done = true;
        }
    }
}

/// A pool connection lent out.
struct Slot {
    back: Option<Back>,
    connection: Connection,
    /// Whether its write's replies came in.
    done: bool,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let Some(back) = self.back.take() else { return };
        if self.done {
            return drop(back);
        }
        // Dropped before its replies (a caller gave up, or they could not be read): its
        // `WAIT` may still block the connection on the server. It goes back once a PING sent
        // behind it is answered (or 5 s pass), so no write is lent a connection still blocked
        // by another's.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return drop(back);
        };
        let mut connection = self.connection.clone();
        crate::detached::spawn(&runtime, async move {
            let ping = redis::cmd("PING");
            let _ = tokio::time::timeout(TIMEOUT, ping.query_async::<Value>(&mut connection)).await;
            drop(back);
        });
    }
}

/// A pool connection's way back: to the free ones, then its permit, on drop.
struct Back {
    pool: Arc<Pool>,
    index: usize,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for Back {
    fn drop(&mut self) {
        lock(&self.pool.free).push_back(self.index);
    }
}

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A list of free indices is whole after every push and pop: a poisoned one is still one.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Changes {
    fn new(clients: Vec<redis::Client>) -> Arc<Self> {
        Arc::new(Self {
            clients,
            waiting: tokio::sync::OnceCell::new(),
            waiters: super::Waiters::default(),
            started: std::sync::atomic::AtomicBool::new(false),
            live: std::sync::atomic::AtomicBool::new(false),
        })
    }
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field(
                "connection",
                &match self.connection.is_cluster() {
                    false => "single server",
                    true => "cluster",
                },
            )
            .field("prefix", &self.prefix)
            .field("wait", &self.wait)
            .finish()
    }
}

/// A prefix [`RedisStore::with_prefix`] refuses: empty, or holding `{`, `}` (hash tags) or
/// whitespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidPrefix(pub String);

impl std::fmt::Display for InvalidPrefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "invalid key prefix {:?}: it must be non-empty, without braces or whitespace",
            self.0
        )
    }
}

impl std::error::Error for InvalidPrefix {}

/// Why [`RedisStore::check`] finds a server unfit to keep the store's records.
#[derive(Debug)]
#[non_exhaustive]
pub enum RedisCheckError {
    /// The server could not be reached.
    Unreachable {
        /// The node's address, as the store was given it or as the cluster lists it.
        node: String,
        /// What went wrong.
        error: redis::RedisError,
    },
    /// `CONFIG GET` is refused (a managed service, or an ACL): whether the server evicts keys
    /// cannot be read here; check its `maxmemory-policy` by hand.
    ConfigUnreadable {
        /// The node's address, as the store was given it or as the cluster lists it.
        node: String,
        /// The refusal.
        error: redis::RedisError,
    },
    /// The server may evict keys when its memory is full: a record evicted is a key that runs
    /// again (completed records and claims carry a TTL, which `volatile-*` policies evict
    /// first). Run it with `maxmemory-policy noeviction`, or without `maxmemory`.
    Evicts {
        /// The node's address, as the store was given it or as the cluster lists it.
        node: String,
        /// Its `maxmemory-policy`.
        policy: String,
    },
    /// Fewer replicas follow the server (online) than [`RedisStore::with_wait`] waits for:
    /// every claim that wins would be refused (503) until enough of them do.
    TooFewReplicas {
        /// The server's address, as the store was given it.
        node: String,
        /// Replicas following it now, past their first sync (`state=online`).
        connected: u32,
        /// Replicas the store waits for.
        wanted: u32,
    },
}

impl std::fmt::Display for RedisCheckError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unreachable { node, error } => write!(
                f,
                "the idempotency store's Redis at {node} is unreachable: {error}"
            ),
            Self::ConfigUnreadable { node, error } => write!(
                f,
                "the idempotency store cannot read the maxmemory-policy of its Redis at {node} \
                 ({error}); make sure it is noeviction: an evicted record is a key that runs \
                 again"
            ),
            Self::Evicts { node, policy } => write!(
                f,
                "the idempotency store's Redis at {node} evicts keys when full \
                 (maxmemory-policy {policy}): an evicted record is a key that runs again; set \
                 maxmemory-policy noeviction (a full server then answers 503)"
            ),
            Self::TooFewReplicas {
                node,
                connected,
                wanted,
            } => write!(
                f,
                "the idempotency store waits for {wanted} replicas of its Redis at {node}, which \
                 has {connected} online: every claim that wins is refused until enough \
                 replicas follow it"
            ),
        }
    }
}

impl std::error::Error for RedisCheckError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Unreachable { error, .. } | Self::ConfigUnreadable { error, .. } => Some(error),
            Self::Evicts { .. } | Self::TooFewReplicas { .. } => None,
        }
    }
}

impl RedisStore {
    /// The key prefix used unless [`with_prefix`](Self::with_prefix) sets another.
    pub const DEFAULT_PREFIX: &'static str = "idempotency";

    /// Connects to one server (`redis://[user:password@]host[:port][/db]`, or `rediss://`
    /// where TLS is compiled into redis-rs). The connection reconnects by itself, when it
    /// breaks and when it stops answering (a reply later than 5 s has a new connection made
    /// for the operations after it); while the server is down every operation fails with
    /// [`StoreError::Unavailable`], so requests fail closed.
    pub async fn connect(url: &str) -> Result<Self, redis::RedisError> {
        let client = redis::Client::open(url)?;
        let connection = Connection::Replaced(Replaceable::server(client.clone()).await?);
        Ok(Self::new(connection, vec![client]))
    }

    /// Connects to a Redis Cluster through any of its nodes (`redis://host:port` each); the
    /// rest of the cluster is discovered, and each operation goes to the node owning its slot.
    /// A node's connection that breaks is made again by redis-rs; one that stops answering (a
    /// reply later than 5 s) has a new connection to the cluster made for the operations
    /// after it, as [`connect`](Self::connect)'s has. While a node is down, operations on its
    /// keys fail with [`StoreError::Unavailable`], so requests fail closed.
    pub async fn connect_cluster(nodes: &[&str]) -> Result<Self, redis::RedisError> {
        let connection = Connection::Replaced(Replaceable::cluster(nodes).await?);
        // Any node hears every PUBLISH of the cluster: the subscription tries each in turn.
        let clients = nodes
            .iter()
            .map(|node| redis::Client::open(*node))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self::new(connection, clients))
    }

    fn new(connection: Connection, clients: Vec<redis::Client>) -> Self {
        Self {
            connection,
            prefix: Self::DEFAULT_PREFIX.into(),
            scripts: Arc::new(Scripts::new()),
            wait: None,
            changes: Changes::new(clients),
        }
    }

    /// Whether the server (on a cluster, every node: those the store was given and those they
    /// list in `CLUSTER NODES`, replicas included, since a replica promoted by a failover
    /// holds the records then) keeps every record until the store lets it go: one with a
    /// `maxmemory` and a policy other than `noeviction` may evict records when full, and a
    /// record evicted is a key that runs again. Call it at start-up, as the SQL stores'
    /// `check()`. Nodes the cluster marks failed, or knows no address of, are skipped. A store
    /// that [waits for replicas](Self::with_wait) also needs that many to follow its server
    /// now ([`RedisCheckError::TooFewReplicas`]).
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = tower_idempotency::store::RedisStore::connect("redis://127.0.0.1:6379").await?;
    /// store.check().await?;
    /// # Ok(()) }
    /// ```
    pub async fn check(&self) -> Result<(), RedisCheckError> {
        let mut nodes = self.changes.clients.clone();
        if self.connection.is_cluster() {
            let mut failure = None;
            let mut listing = None;
            for client in &self.changes.clients {
                match cluster_nodes(client).await {
                    Ok(found) => {
                        listing = Some(found);
                        break;
                    }
                    Err(e) => failure = Some(e),
                }
            }
            let Some((listed, skipped)) = listing else {
                return failure.map_or(Ok(()), Err);
            };
            let addr = |c: &redis::Client| c.get_connection_info().addr().clone();
            // A node given at start-up that the cluster has since marked failed is skipped as
            // a listed one is: a seed list outliving a node must not fail a healthy cluster.
            nodes.retain(|given| !skipped.contains(&addr(given)));
            for node in listed {
                if !nodes.iter().any(|known| addr(known) == addr(&node)) {
                    nodes.push(node);
                }
            }
        }
        for client in &nodes {
            check_node(client).await?;
        }
        if let (Some((wanted, _)), Some(client)) = (self.waits(), self.changes.clients.first()) {
            check_replicas(client, wanted).await?;
        }
        Ok(())
    }

    /// Keeps this store's records under another prefix: stores with different prefixes never
    /// see each other's keys.
    pub fn with_prefix(mut self, prefix: &str) -> Result<Self, InvalidPrefix> {
        let bad = |c: char| c == '{' || c == '}' || c.is_whitespace();
        if prefix.is_empty() || prefix.chars().any(bad) {
            return Err(InvalidPrefix(prefix.to_owned()));
        }
        self.prefix = prefix.into();
        // Its waiters hear its own channel.
        self.changes = Changes::new(self.changes.clients.clone());
        Ok(self)
    }

    /// Makes each write a failover must not lose wait until `replicas` replicas acknowledge it
    /// (`WAIT`), for at most `timeout`: a won claim, a milestone
    /// ([`effect_started`](crate::IdempotencyContext::effect_started), a downstream id) and a
    /// completion. A promoted replica then holds every claim a handler ran under, every effect
    /// a handler said it started, and every outcome the layer recorded: on routes whose
    /// handlers mark their effects started (or that have external effects), its retries find
    /// the key in flight, set aside for reconciliation, or replayed, never free to run again
    /// beside an effect that happened. Off by default. A milestone or completion carries its
    /// `WAIT` in the same flight; a claim that won is asked again with its `WAIT` (a second
    /// round trip), so claims that find a record (replays, keys in flight) never wait.
    ///
    /// What the replicas do not acknowledge in time stays on the primary and fails: a claim
    /// is given back and the request refused (503, nothing run); a milestone's handler is told
    /// the store is down (its effect must not start; the primary holds the milestone, so the
    /// key goes to reconciliation there); a completion is retried by the layer, which holds
    /// the key meanwhile, but the client has its answer already: promoted before the retry
    /// lands, a replica holds that key in flight, and on a route without a started effect or
    /// external effects, a retry runs it again once its lease ends. A `WAIT` the server
    /// refuses (an ACL without it) acknowledges nothing. Renewals, releases (a refused claim's
    /// give-back too), moves to reconciliation and resolutions do not wait: a replica that got
    /// a refused claim late but not its give-back holds the key until the lease ends (on a
    /// route with external effects, for reconciliation). Not available on a cluster
    /// connection (Redis routes `WAIT` to no one shard); there it is ignored.
    ///
    /// A `WAIT` blocks the connection it runs on, and counts the writes of that connection:
    /// these writes run on four connections of their own, each lent to one write at a time
    /// (a write given up on mid-`WAIT` returns its connection once a PING behind the `WAIT`
    /// is answered, or after 5 s), so no
    /// write queues behind another's `WAIT` there. A fifth write waits for one to be free, at
    /// most 5 s (a won claim, at most half its lease, so that nothing sets it aside meanwhile),
    /// then the store is unavailable for it. With a replica down, each takes `timeout`: give
    /// the lease more than `timeout`. `timeout` is kept under the store's 5 s reply timeout.
    pub fn with_wait(mut self, replicas: u32, timeout: Duration) -> Self {
        self.wait = Some((replicas, timeout.min(TIMEOUT - Duration::from_secs(1))));
        self
    }

    /// The replicas to wait for and how long, unless on a cluster (see
    /// [`with_wait`](Self::with_wait)).
    fn waits(&self) -> Option<(u32, Duration)> {
        self.wait.filter(|_| !self.connection.is_cluster())
    }

    /// The connection for a write: with replicas to wait for, one of the pool's, lent to it
    /// alone (waiting at most `within` for a free one, or the store is unavailable for this
    /// write; the pool's opening, at most the store's timeout); else the store's own.
    async fn writing_connection(
        &self,
        waits: Option<(u32, Duration)>,
        within: Duration,
    ) -> Result<Lent, StoreError> {
        if waits.is_none() {
            return Ok(Lent {
                connection: self.connection.clone(),
                slot: None,
            });
        }
        let opening = self.changes.waiting.get_or_try_init(|| async {
            let client = self
                .changes
                .clients
                .first()
                .ok_or_else(|| StoreError::unavailable("no server to connect to"))?;
            let mut connections = Vec::new();
            for _ in 0..WAITING_CONNECTIONS {
                connections.push(
                    Replaceable::server(client.clone())
                        .await
                        .map_err(StoreError::unavailable)?,
                );
            }
            Ok::<_, StoreError>(Arc::new(Pool {
                connections,
                free: std::sync::Mutex::new((0..WAITING_CONNECTIONS).collect()),
                permits: Arc::new(tokio::sync::Semaphore::new(WAITING_CONNECTIONS)),
            }))
        });
        // Opened once, within the store's timeout whatever `within` is: a bound shorter than
        // four connects would cancel the opening every time.
        let pool = tokio::time::timeout(TIMEOUT, opening).await.map_err(|_| {
            StoreError::unavailable("the connections that wait for replicas could not be opened")
        })??;
        let permit = tokio::time::timeout(within, pool.permits.clone().acquire_owned())
            .await
            .map_err(|_| {
                StoreError::unavailable(
                    "every connection that waits for replicas stayed busy past the timeout",
                )
            })?
            .map_err(StoreError::unavailable)?;
        let pool = pool.clone();
        // The one free longest: a connection given back is the last lent again.
        let index = lock(&pool.free)
            .pop_front()
            .ok_or_else(|| odd("a waiting connection's permit without a free connection"))?;
        // Pinned: the write and its `WAIT` run on one connection.
        let connection = Connection::Replaced(pool.connections[index].clone()).pinned();
        Ok(Lent {
            connection: connection.clone(),
            slot: Some(Slot {
                back: Some(Back {
                    pool,
                    index,
                    _permit: permit,
                }),
                connection,
                done: false,
            }),
        })
    }

    /// The Lua source of the claim, as the server runs it: `KEYS` are the record, its bucket's
    /// uncertain and pending sets ([`keys`](Self::keys)); `ARGV` the member, fingerprint,
    /// token, lease and TTL in milliseconds, `1` to reclaim an expired lease (else `0`), scope
    /// and key, and `1` when a claim that won is asked again (else nothing). For inspection,
    /// and for measuring the store against its own scripts.
    pub fn claim_script(&self) -> &str {
        &self.scripts.claim_source
    }

    /// The Lua source of the completion: `KEYS` as for the claim; `ARGV` the member, token,
    /// the response ([`StoredResponse::to_bytes`]) and the TTL in milliseconds.
    pub fn complete_script(&self) -> &str {
        &self.scripts.complete_source
    }

    /// Where the record of `key` lives: its hash, its bucket's uncertain and pending sets (one
    /// hash slot), and its member in those sets.
    pub fn keys(&self, key: &ScopedKey) -> [Vec<u8>; 4] {
        let at = self.locate(key);
        [
            at.record,
            at.uncertain.into_bytes(),
            at.pending.into_bytes(),
            at.member,
        ]
    }

    /// The record's member (its scope and key, length-prefixed) and bucket tag.
    fn locate(&self, key: &ScopedKey) -> Located {
        let member = member(key.scope().as_bytes(), key.key().as_bytes());
        let bucket = bucket_of(&member);
        Located {
            record: self.record_key(bucket, &member),
            uncertain: format!("{}:{{{bucket}}}:u", self.prefix),
            pending: format!("{}:{{{bucket}}}:p", self.prefix),
            member,
        }
    }

    fn record_key(&self, bucket: u64, member: &[u8]) -> Vec<u8> {
        let mut key = self.record_prefix(bucket).into_bytes();
        key.extend_from_slice(member);
        key
    }

    fn record_prefix(&self, bucket: u64) -> String {
        format!("{}:{{{bucket}}}:r:", self.prefix)
    }

    /// Runs `script` on the located record's slot: its record, uncertain and pending keys,
    /// then `args` after the member.
    async fn run(
        &self,
        script: &Script,
        at: &Located,
        args: &[&[u8]],
    ) -> Result<Value, StoreError> {
        self.run_on(&mut self.connection.clone(), script, at, args)
            .await
    }

    /// [`run`](Self::run) on `connection`.
    async fn run_on(
        &self,
        connection: &mut Connection,
        script: &Script,
        at: &Located,
        args: &[&[u8]],
    ) -> Result<Value, StoreError> {
        invocation(script, at, args)
            .invoke_async(connection)
            .await
            .map_err(StoreError::unavailable)
    }

    /// [`run_on`](Self::run_on), then a `WAIT` for `wait`'s replicas: the script's reply, and
    /// whether they acknowledged it (`what` names it in the error).
    ///
    /// The two go in one pipeline, so they reach the server on one connection: a `WAIT` counts
    /// the writes of the connection it runs on, and one sent on its own could meet a
    /// connection made anew meanwhile (the manager reconnects after another caller's command
    /// broke the old one), which wrote nothing and is acknowledged at once. The `WAIT` waits
    /// whether or not the script wrote (Redis counts the connection's last command), so only
    /// writes that always write go through here.
    async fn run_then_wait(
        &self,
        connection: &mut Connection,
        script: &Script,
        at: &Located,
        args: &[&[u8]],
        (replicas, timeout): (u32, Duration),
        what: &str,
    ) -> Result<(Value, Result<(), StoreError>), StoreError> {
        let invocation = invocation(script, at, args);
        let mut pipe = redis::pipe();
        pipe.invoke_script(&invocation)
            .cmd("WAIT")
            .arg(replicas)
            .arg(ms(timeout));
        // Each reply read on its own: the script's error does not hide the `WAIT`'s.
        pipe.ignore_errors();
        let replies = pipe.query_async(connection).await;
        let replies = match two(replies.map_err(StoreError::unavailable)?)? {
            // Not in this server's script cache (a first use, a restart, a promoted replica):
            // loaded, then the pair sent again. Nothing ran.
            (Value::ServerError(e), _) if e.kind() == Some(redis::ServerErrorKind::NoScript) => {
                invocation
                    .load_async(connection)
                    .await
                    .map_err(StoreError::unavailable)?;
                let replies = pipe.query_async(connection).await;
                two(replies.map_err(StoreError::unavailable)?)?
            }
            replies => replies,
        };
        let (reply, acknowledged) = match replies {
            (Value::ServerError(e), _) => {
                return Err(StoreError::unavailable(redis::RedisError::from(e)));
            }
            replies => replies,
        };
        // A `WAIT` refused (an ACL without it, a proxy that does not pass it) acknowledges
        // nothing.
        let acknowledged = match acknowledged {
            Value::ServerError(e) => Err(StoreError::unavailable(format!(
                "the {what}'s WAIT failed: {}",
                redis::RedisError::from(e)
            ))),
            count => match int(&count) {
                Some(n) if n >= i64::from(replicas) => Ok(()),
                Some(n) => Err(StoreError::unavailable(format!(
                    "{n} of {replicas} replicas acknowledged the {what} in time"
                ))),
                None => Err(odd("a WAIT's count")),
            },
        };
        Ok((reply, acknowledged))
    }

    /// A write that waits for replicas when the store does ([`run_then_wait`](Self::run_then_wait)),
    /// else [`run_on`](Self::run_on) (acknowledged by the primary alone).
    async fn write(
        &self,
        connection: &mut Connection,
        script: &Script,
        at: &Located,
        args: &[&[u8]],
        what: &str,
    ) -> Result<(Value, Result<(), StoreError>), StoreError> {
        match self.waits() {
            Some(wait) => {
                self.run_then_wait(connection, script, at, args, wait, what)
                    .await
            }
            None => Ok((self.run_on(connection, script, at, args).await?, Ok(()))),
        }
    }
}

/// What a claim's reply says: acquired under `token`, or the record it found.
fn claimed(reply: &Value, token: FencingToken) -> Result<Claim, StoreError> {
    let parts = array(reply).ok_or_else(|| odd("a claim is not an array"))?;
    let [won, now, fields] = parts else {
        return Err(odd("a claim has not three parts"));
    };
    let fields = array(fields).ok_or_else(|| odd("a claimed record is not a hash"))?;
    let record = parse_record(fields).map_err(StoreError::unavailable)?;
    let now = from_ms(int(now).ok_or_else(|| odd("the server's time"))?);
    if int(won) == Some(1)
        && record.lease_token == token
        && record.status == RecordStatus::InProgress
    {
        return Ok(Claim::Acquired(Lease {
            token,
            attempt: record.attempts,
            until: record.lease_until,
        }));
    }
    Ok(Claim::existing(record, now))
}

/// `script`'s invocation on the located record's slot: its record, uncertain and pending
/// keys, then `args` after the member.
fn invocation<'a>(script: &'a Script, at: &Located, args: &[&[u8]]) -> redis::ScriptInvocation<'a> {
    let mut invocation = script.key(&at.record[..]);
    invocation
        .key(&at.uncertain)
        .key(&at.pending)
        .arg(&at.member[..]);
    for arg in args {
        invocation.arg(*arg);
    }
    invocation
}

/// A write's reply and its `WAIT`'s, from their pipeline's.
fn two(replies: Vec<Value>) -> Result<(Value, Value), StoreError> {
    let [reply, acknowledged] = <[Value; 2]>::try_from(replies)
        .map_err(|_| odd("a write and its WAIT, not two replies"))?;
    Ok((reply, acknowledged))
}

/// Whether a failed script may have run all the same: its connection broke or timed out
/// before the reply came, rather than Redis answering with an error.
fn reply_lost(error: &StoreError) -> bool {
    super::unheard::lost(error, |e: &redis::RedisError| {
        e.is_io_error() || e.is_connection_dropped() || e.is_timeout()
    })
}

/// Where a record lives.
struct Located {
    record: Vec<u8>,
    uncertain: String,
    pending: String,
    member: Vec<u8>,
}

/// A scope and key as one binary-safe member: the scope's length, `:`, the scope, the key.
fn member(scope: &[u8], key: &[u8]) -> Vec<u8> {
    let mut out = format!("{}:", scope.len()).into_bytes();
    out.extend_from_slice(scope);
    out.extend_from_slice(key);
    out
}

/// The scope and key of a member, if it is one.
fn split_member(member: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    let colon = member.iter().position(|&b| b == b':')?;
    let len: usize = std::str::from_utf8(&member[..colon]).ok()?.parse().ok()?;
    let rest = &member[colon + 1..];
    (rest.len() >= len).then(|| (rest[..len].to_vec(), rest[len..].to_vec()))
}

/// The bucket of a member: FNV-1a, stable across processes and versions (it names keys).
fn bucket_of(member: &[u8]) -> u64 {
    let hash = member.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    hash % BUCKETS
}

fn ms(d: Duration) -> String {
    u64::try_from(d.as_millis())
        .unwrap_or(u64::MAX)
        .min(1 << 52)
        .to_string()
}

fn from_ms(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}

/// A reply that is not what the scripts return: the server is not ours, or damaged.
fn odd(what: &str) -> StoreError {
    StoreError::unavailable(format!("unexpected reply from Redis: {what}"))
}

fn int(value: &Value) -> Option<i64> {
    match value {
        Value::Int(n) => Some(*n),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

fn bytes(value: &Value) -> Option<&[u8]> {
    match value {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.as_bytes()),
        _ => None,
    }
}

fn array(value: &Value) -> Option<&[Value]> {
    match value {
        Value::Array(items) => Some(items),
        _ => None,
    }
}

/// A record's fields, as `HGETALL` returns them, read into a [`Record`]; what is wrong with
/// them otherwise.
fn parse_record(flat: &[Value]) -> Result<Record, String> {
    let mut fields = std::collections::HashMap::new();
    for pair in flat.chunks(2) {
        if let [name, value] = pair {
            let name = bytes(name).ok_or("a field name is not a string")?;
            let value = bytes(value).ok_or("a field value is not a string")?;
            fields.insert(name.to_vec(), value);
        }
    }
    let field = |name: &str| {
        fields
            .get(name.as_bytes())
            .copied()
            .ok_or_else(|| format!("the field {name} is missing"))
    };
    let text = |name: &str| -> Result<String, String> {
        String::from_utf8(field(name)?.to_vec())
            .map_err(|_| format!("the field {name} is not UTF-8"))
    };
    let number = |name: &str| -> Result<i64, String> {
        text(name)?
            .parse::<i64>()
            .map_err(|_| format!("the field {name} is not an integer"))
    };
    let fingerprint: [u8; 32] = field("fp")?
        .try_into()
        .map_err(|_| "the field fp is not a SHA-256".to_owned())?;
    let status = match text("st")?.as_str() {
        "in_progress" => RecordStatus::InProgress,
        "completed" => RecordStatus::Completed,
        "released" => RecordStatus::Released,
        "needs_reconciliation" => RecordStatus::NeedsReconciliation,
        other => return Err(format!("the field st holds {other:?}, not a status")),
    };
    let token: u64 = text("tok")?
        .parse()
        .map_err(|_| "the field tok is not a token".to_owned())?;
    let response = match fields.get(&b"resp"[..]) {
        Some(bytes) => Some(
            StoredResponse::from_shared(&bytes::Bytes::copy_from_slice(bytes))
                .map_err(|e| format!("the field resp does not decode: {}", e.0))?,
        ),
        None => None,
    };
    let optional = |name: &str| {
        fields
            .get(name.as_bytes())
            .map(|v| String::from_utf8_lossy(v).into_owned())
    };
    Ok(Record {
        key: ScopedKey::new(text("sc")?, text("ky")?),
        fingerprint: Fingerprint::from_bytes(fingerprint),
        status,
        lease_token: FencingToken::new(token),
        lease_until: from_ms(number("lu")?),
        attempts: u32::try_from(number("at")?).map_err(|_| "the field at is out of range")?,
        effect_started: field("es")? == b"1",
        downstream_id: optional("did"),
        response,
        created_at: from_ms(number("ca")?),
        updated_at: from_ms(number("ua")?),
        expires_at: from_ms(number("ea")?),
        history: HistoryEntry::parse_all(&text("hist")?),
        resolution_note: optional("note"),
    })
}

/// The Lua shared by every script: the server's clock, reading and writing a record, its
/// history, and keeping the bucket's reconciliation index in step with it.
///
/// `KEYS[1]` is the record, `KEYS[2]` the bucket's uncertain set (records awaiting
/// reconciliation, by last change), `KEYS[3]` its pending set (in-progress records that
/// would await reconciliation if their holder died, by lease end; moved to the uncertain set
/// once their lease is over, when the bucket is listed); `ARGV[1]` the record's member.
const PRELUDE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function fmt(n) return string.format('%.0f', n) end
local function load(k)
  local flat = redis.call('HGETALL', k)
  if #flat == 0 then return nil end
  local r = {}
  for i = 1, #flat, 2 do r[flat[i]] = flat[i + 1] end
  return r
end
local function watched(r) return r.es == '1' or r.roe == '1' end
local function expired(r)
  if tonumber(r.ea) > now then return false end
  if r.st == 'completed' or r.st == 'released' then return true end
  return r.st == 'in_progress' and not watched(r)
end
local function uncertain(r)
  return r.st == 'needs_reconciliation'
    or (r.st == 'in_progress' and watched(r) and tonumber(r.lu) <= now)
end
local function entry(attempt, token, event)
  return attempt .. ' ' .. token .. ' ' .. fmt(now) .. ' ' .. event .. ';'
end
local function appended(h, e, cap)
  local _, n = string.gsub(h, ';', '')
  if n < cap then return h .. e end
  if cap == @REFUSALS@ then return h end
  return (string.match(h, '^(.*;)[^;]*;$') or '') .. e
end
local function save(r)
  local flat = {}
  for f, v in pairs(r) do flat[#flat + 1] = f; flat[#flat + 1] = v end
  redis.call('HSET', KEYS[1], unpack(flat))
  local m = ARGV[1]
  if r.st == 'needs_reconciliation' then
    redis.call('ZREM', KEYS[3], m)
    redis.call('ZADD', KEYS[2], r.ua, m)
    redis.call('PERSIST', KEYS[1])
  elseif r.st == 'in_progress' and watched(r) then
    redis.call('ZREM', KEYS[2], m)
    redis.call('ZADD', KEYS[3], r.lu, m)
    redis.call('PERSIST', KEYS[1])
  else
    redis.call('ZREM', KEYS[2], m)
    redis.call('ZREM', KEYS[3], m)
    redis.call('PEXPIREAT', KEYS[1], r.ea)
  end
end
-- Bytewise order, as Redis orders a sorted set's members of one score (Lua's own `<` follows
-- the server's collation locale).
local function before(a, b)
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end
-- Tells the store's waiters (subscribed to `{prefix}:changed`) that this record moved on.
local function changed()
  -- pcall: the write stands whether or not this user may publish (Redis 7 ACLs give a new
  -- user no channels); its waiters then poll.
  redis.pcall('PUBLISH', (string.gsub(KEYS[2], ':{%d+}:u$', ':changed')), ARGV[1])
end
local function fenced(r, token)
  return r == nil or r.st ~= 'in_progress' or r.tok ~= token
end
";

/// `ARGV`: member, fingerprint, token, lease ms, ttl ms, reclaim (`1`/`0`), scope, key, and
/// `1` to ask again a claim that won (else nothing). Returns `{written, now, fields}`.
const CLAIM: &str = r"
local fp, tok = ARGV[2], ARGV[3]
local lease, ttl, reclaim = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6] == '1'
local r = load(KEYS[1])
-- A won claim asked again (for its replicas' acknowledgement) renews its own record in
-- flight, and writes nothing else: landing late, after its give-back, it must not take the
-- key anew for nobody.
if ARGV[9] == '1' and not (r and not expired(r) and r.st == 'in_progress' and r.tok == tok) then
  return {0, fmt(now), redis.call('HGETALL', KEYS[1])}
end
if r and expired(r) then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('ZREM', KEYS[3], ARGV[1])
  r = nil
end
-- This claim's own, landed before (its reply lost, so it is asked again): won, as it was.
-- Nothing ran under it, so even past its lease it is not another attempt's, nor uncertain.
if r and r.st == 'in_progress' and r.tok == tok then
  r.lu = fmt(math.max(tonumber(r.lu), now + lease)); r.ua = fmt(now)
  r.ea = fmt(math.max(tonumber(r.ea), now + math.max(lease, ttl)))
  save(r)
  return {1, fmt(now), redis.call('HGETALL', KEYS[1])}
end
-- This claim's own, already ended (run and recorded or released, or given back): the claim
-- timed out on its way and reached Redis late, after it was asked again. Nothing may start
-- under its token a second time (it would hold the key for nobody).
if r and r.tok == tok then
  return {0, fmt(now), redis.call('HGETALL', KEYS[1])}
end
local written = 0
local roe = '1'
if reclaim then roe = '0' end
if not r then
  r = {sc = ARGV[7], ky = ARGV[8], fp = fp, st = 'in_progress', tok = tok,
       lu = fmt(now + lease), at = '1', es = '0', ca = fmt(now), ua = fmt(now),
       ea = fmt(now + math.max(lease, ttl)), hist = entry('1', tok, 'claimed'), roe = roe}
  save(r)
  written = 1
else
  local same = r.fp == fp
  local lease_over = r.st == 'in_progress' and tonumber(r.lu) <= now
  -- A takeover needs both the holder's route (roe) and this claim's to reclaim.
  if same and (r.st == 'released' or (lease_over and reclaim and r.roe ~= '1' and r.es ~= '1')) then
    r.at = fmt(tonumber(r.at) + 1)
    -- An earlier attempt's downstream id names its effect, not this one's.
    if r.did then redis.call('HDEL', KEYS[1], 'did'); r.did = nil end
    r.st = 'in_progress'; r.tok = tok; r.lu = fmt(now + lease); r.roe = roe; r.ua = fmt(now)
    r.ea = fmt(math.max(tonumber(r.ea), now + math.max(lease, ttl)))
    r.hist = appended(r.hist, entry(r.at, tok, 'claimed'), @LIMIT@)
    save(r)
    written = 1
  elseif same and lease_over then
    r.st = 'needs_reconciliation'; r.ua = fmt(now)
    r.hist = appended(r.hist, entry(r.at, r.tok, 'lease_expired'), @LIMIT@)
    save(r)
    changed()
  end
end
return {written, fmt(now), redis.call('HGETALL', KEYS[1])}
";

/// `ARGV`: member, token, lease ms. Returns the new lease end, or nil when fenced.
const RENEW: &str = r"
local r = load(KEYS[1])
if fenced(r, ARGV[2]) then return false end
local lease = tonumber(ARGV[3])
-- Never shorter: renewals may overlap, and one sent earlier may land later.
r.lu = fmt(math.max(tonumber(r.lu), now + lease))
r.ea = fmt(math.max(tonumber(r.ea), now + lease)); r.ua = fmt(now)
save(r)
return r.lu
";

/// `ARGV`: member, token, response, ttl ms. Returns 1, or 0 when fenced.
const COMPLETE: &str = r"
local r = load(KEYS[1])
if r == nil or r.tok ~= ARGV[2] or not (r.st == 'in_progress' or r.st == 'completed'
    or r.st == 'needs_reconciliation') then
  return 0
end
r.st = 'completed'; r.resp = ARGV[3]; r.ea = fmt(now + tonumber(ARGV[4])); r.ua = fmt(now)
r.hist = appended(r.hist, entry(r.at, r.tok, 'completed'), @LIMIT@)
save(r)
changed()
return 1
";

/// `ARGV`: member, token. Releases (or moves to reconciliation past a started effect);
/// returns the status it ends in, or nil when fenced.
const RELEASE: &str = r"
local r = load(KEYS[1])
if fenced(r, ARGV[2]) then return false end
if r.es == '1' then r.st = 'needs_reconciliation' else r.st = 'released' end
r.ua = fmt(now)
r.hist = appended(r.hist, entry(r.at, r.tok, r.st), @LIMIT@)
save(r)
changed()
return r.st
";

/// `ARGV`: member, token. Returns 1, or 0 when fenced.
const MARK_UNCERTAIN: &str = r"
local r = load(KEYS[1])
if fenced(r, ARGV[2]) then return 0 end
-- The handler answered (only the layer's failed record marks so): its effect took place.
r.st = 'needs_reconciliation'; r.es = '1'; r.ua = fmt(now)
r.hist = appended(r.hist, entry(r.at, r.tok, 'needs_reconciliation'), @LIMIT@)
save(r)
changed()
return 1
";

/// `ARGV`: member, token, `es` or `did`, the downstream id. Returns 1, or 0 when fenced.
const MILESTONE: &str = r"
local r = load(KEYS[1])
if fenced(r, ARGV[2]) then return 0 end
local event = 'downstream_id'
if ARGV[3] == 'es' then r.es = '1'; event = 'effect_started' else r.did = ARGV[4] end
r.ua = fmt(now)
r.hist = appended(r.hist, entry(r.at, r.tok, event), @LIMIT@)
save(r)
return 1
";

/// `ARGV`: member. Returns `{now, fields}`, or nil when there is no live record.
const LOOKUP: &str = r"
local r = load(KEYS[1])
if r == nil or expired(r) then return false end
return {fmt(now), redis.call('HGETALL', KEYS[1])}
";

/// `ARGV`: member. Returns 1 if a record was deleted.
const REMOVE: &str = r"
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
local n = redis.call('DEL', KEYS[1])
if n == 1 then changed() end
return n
";

/// `ARGV`: member, token, `completed` or `released`, response or empty, whether there is a
/// response (`1`), ttl ms, new token, note or empty, whether there is a note. Returns 1, or 0
/// when refused.
const RESOLVE: &str = r"
local r = load(KEYS[1])
if r == nil or r.tok ~= ARGV[2] or not uncertain(r) then return 0 end
r.st = ARGV[3]
if ARGV[5] == '1' then r.resp = ARGV[4] end
-- This resolution's note, or none: never an earlier resolution's.
if ARGV[9] == '1' then
  r.note = ARGV[8]
else
  r.note = nil
  redis.call('HDEL', KEYS[1], 'note')
end
r.tok = ARGV[7]
-- Kept `ttl` from now either way, history and note with it: a record may have waited for its
-- reconciliation past the expiry its claim set.
if r.st == 'completed' then
  r.ea = fmt(now + tonumber(ARGV[6]))
else
  -- Not applied: the next attempt starts with no effect of its own.
  r.es = '0'
  r.ea = fmt(math.max(tonumber(r.ea), now + tonumber(ARGV[6])))
end
r.ua = fmt(now)
local event = 'reconciled_not_applied'
if r.st == 'completed' then event = 'reconciled_applied' end
r.hist = appended(r.hist, entry(r.at, r.tok, event), @LIMIT@)
save(r)
changed()
return 1
";

/// `ARGV`: member, event. Notes what a request saw, unfenced, within the refusal cap.
const APPEND_HISTORY: &str = r"
local r = load(KEYS[1])
if r == nil or expired(r) then return 0 end
redis.call('HSET', KEYS[1], 'hist', appended(r.hist, entry(r.at, r.tok, ARGV[2]), @REFUSALS@))
return 1
";

/// Moves the bucket's pending records whose lease is over to its uncertain set (a dead
/// holder's record is then listed), at most 1000 a call.
const PROMOTE: &str = r"
local function promote(prefix)
  local due = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, 1000)
  for _, m in ipairs(due) do
    redis.call('ZREM', KEYS[3], m)
    local r = load(prefix .. m)
    if r and r.st == 'in_progress' and watched(r) then
      redis.call('ZADD', KEYS[2], r.ua, m)
    end
  end
end
";

/// On a bucket (`KEYS[1]` unused, `KEYS[2]`, `KEYS[3]` its sets). `ARGV`: unused member,
/// record key prefix, cursor score or empty, cursor member, limit, newest first (`1`).
/// Returns `{score, member, fields}` for each record of the page, in its order.
const LIST: &str = r"
promote(ARGV[2])
local limit, newest = tonumber(ARGV[5]), ARGV[6] == '1'
local found, stale = {}, {}
local function take(m, s)
  if #found >= limit then return end
  local r = load(ARGV[2] .. m)
  if r == nil then
    stale[#stale + 1] = m
    return
  end
  -- A damaged record is listed as it is, to be reported unreadable, never failing the page.
  local ok, listed = pcall(uncertain, r)
  if listed or not ok then
    found[#found + 1] = {s, m, redis.call('HGETALL', ARGV[2] .. m)}
  end
end
-- Index entries without a record do not use up the page: read on until it is full.
local function scan(from, to)
  local offset = 0
  while #found < limit do
    local batch
    if newest then
      batch = redis.call('ZREVRANGEBYSCORE', KEYS[2], from, to, 'WITHSCORES', 'LIMIT', offset, limit)
    else
      batch = redis.call('ZRANGEBYSCORE', KEYS[2], from, to, 'WITHSCORES', 'LIMIT', offset, limit)
    end
    if #batch == 0 then return end
    for i = 1, #batch, 2 do take(batch[i], batch[i + 1]) end
    offset = offset + #batch / 2
  end
end
if ARGV[3] == '' then
  if newest then scan('+inf', '-inf') else scan('-inf', '+inf') end
else
  local s, after = ARGV[3], ARGV[4]
  -- Records changed in the cursor's millisecond: past it by member, as Redis orders ties.
  local ties = redis.call('ZRANGEBYSCORE', KEYS[2], s, s, 'WITHSCORES')
  if newest then
    for i = #ties - 1, 1, -2 do
      if before(ties[i], after) then take(ties[i], ties[i + 1]) end
    end
    scan('(' .. s, '-inf')
  else
    for i = 1, #ties, 2 do
      if before(after, ties[i]) then take(ties[i], ties[i + 1]) end
    end
    scan('(' .. s, '+inf')
  end
end
for _, m in ipairs(stale) do redis.call('ZREM', KEYS[2], m) end
return found
";

/// On a bucket, as [`LIST`]. `ARGV`: unused member, record key prefix. Returns
/// `{count, oldest score or -1}`.
const COUNT: &str = r"
promote(ARGV[2])
local n = redis.call('ZCARD', KEYS[2])
local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if #first == 0 then return {n, -1} end
return {n, tonumber(first[2])}
";

/// The scripts, compiled once per store (their SHA-1s are what travels).
struct Scripts {
    /// The claim's and the completion's source, for inspection.
    claim_source: String,
    complete_source: String,
    claim: Script,
    renew: Script,
    complete: Script,
    release: Script,
    mark_uncertain: Script,
    milestone: Script,
    lookup: Script,
    remove: Script,
    resolve: Script,
    append_history: Script,
    list: Script,
    count: Script,
}

impl Scripts {
    fn new() -> Self {
        let source = |body: &str| {
            format!("{PRELUDE}{PROMOTE}{body}")
                .replace("@LIMIT@", &HISTORY_LIMIT.to_string())
                .replace("@REFUSALS@", &HISTORY_REFUSALS.to_string())
        };
        let build = |body: &str| Script::new(&source(body));
        Self {
            claim_source: source(CLAIM),
            complete_source: source(COMPLETE),
            claim: build(CLAIM),
            renew: build(RENEW),
            complete: build(COMPLETE),
            release: build(RELEASE),
            mark_uncertain: build(MARK_UNCERTAIN),
            milestone: build(MILESTONE),
            lookup: build(LOOKUP),
            remove: build(REMOVE),
            resolve: build(RESOLVE),
            append_history: build(APPEND_HISTORY),
            list: build(LIST),
            count: build(COUNT),
        }
    }
}

/// A fenced write's reply: 1 written, 0 fenced.
fn written(value: &Value) -> Result<(), StoreError> {
    match int(value) {
        Some(1) => Ok(()),
        Some(0) => Err(StoreError::Fenced),
        _ => Err(odd("a fenced write answered neither 1 nor 0")),
    }
}

impl RedisStore {
    /// The bucket's keys, for the listing scripts.
    fn bucket(&self, bucket: u64) -> Located {
        Located {
            record: format!("{}:{{{bucket}}}:r:", self.prefix).into_bytes(),
            uncertain: format!("{}:{{{bucket}}}:u", self.prefix),
            pending: format!("{}:{{{bucket}}}:p", self.prefix),
            member: Vec::new(),
        }
    }

    async fn list_bucket(
        &self,
        bucket: u64,
        query: &UncertainQuery,
    ) -> Result<Vec<(i64, Vec<u8>, Result<Record, String>)>, StoreError> {
        let at = self.bucket(bucket);
        let prefix = self.record_prefix(bucket);
        let (score, after) = match &query.after {
            Some(cursor) => {
                let (scope, key) = cursor.bytes();
                let ms = cursor
                    .updated_at
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis());
                (ms.to_string(), member(scope, key))
            }
            None => (String::new(), Vec::new()),
        };
        let limit = query.limit.min(MAX_PAGE).to_string();
        let newest = if query.newest_first { "1" } else { "0" };
        let reply = self
            .run(
                &self.scripts.list,
                &at,
                &[
                    prefix.as_bytes(),
                    score.as_bytes(),
                    &after,
                    limit.as_bytes(),
                    newest.as_bytes(),
                ],
            )
            .await?;
        let rows = array(&reply).ok_or_else(|| odd("a listing is not an array"))?;
        rows.iter()
            .map(|row| {
                let row = array(row).ok_or_else(|| odd("a listed record is not an array"))?;
                let [score, member, fields] = row else {
                    return Err(odd("a listed record has not three parts"));
                };
                let score = int(score)
                    .or_else(|| {
                        bytes(score).and_then(|b| {
                            std::str::from_utf8(b)
                                .ok()?
                                .parse::<f64>()
                                .ok()
                                .map(|f| f as i64)
                        })
                    })
                    .ok_or_else(|| odd("a listed record's score"))?;
                let member = bytes(member).ok_or_else(|| odd("a listed record's member"))?;
                let record = array(fields)
                    .ok_or_else(|| "its fields are not a hash".to_owned())
                    .and_then(parse_record);
                Ok((score, member.to_vec(), record))
            })
            .collect()
    }
}

impl RedisStore {
    /// Asks a won claim again (its own token: it writes again, as it was) with a `WAIT` for
    /// `wait`'s replicas, on a waiting connection: only a claim that won waits, so a replay
    /// never queues behind a lagging replica. Returns the claim as it stands, held and
    /// acknowledged, or why not.
    async fn acknowledged_claim(
        &self,
        at: &Located,
        args: &[&[u8]],
        wait: (u32, Duration),
        token: FencingToken,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        // Asked again within half its lease, or not at all: a re-ask that came later could
        // find the key set aside by a retry that saw the lease run out, though nothing ran.
        let within = (lease / 2).min(TIMEOUT);
        let mut lent = self.writing_connection(Some(wait), within).await?;
        let claim = &self.scripts.claim;
        let mut again = args.to_vec();
        again.push(b"1");
        let asked = self
            .run_then_wait(&mut lent.connection, claim, at, &again, wait, "claim")
            .await;
        asked.and_then(|(reply, acknowledged)| {
            lent.done();
            // The claim as it stands now (its lease renewed by the re-ask), held or not.
            match claimed(&reply, token)? {
                held @ Claim::Acquired(_) => acknowledged.map(|()| held),
                _ => Err(StoreError::unavailable(
                    "a won claim asked again for its acknowledgement was no longer held",
                )),
            }
        })
    }
}

impl IdempotencyStore for RedisStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        let at = self.locate(&request.key);
        let token = fresh_token();
        let reclaim = matches!(request.on_lease_expiry, LeaseExpiry::Reclaim);
        let (token_text, lease, ttl) =
            (token.get().to_string(), ms(request.lease), ms(request.ttl));
        let args: [&[u8]; 7] = [
            request.fingerprint.as_bytes(),
            token_text.as_bytes(),
            lease.as_bytes(),
            ttl.as_bytes(),
            if reclaim { b"1" } else { b"0" },
            request.key.scope().as_bytes(),
            request.key.key().as_bytes(),
        ];
        // A script that ran and whose reply was lost with the connection would hold the key
        // for a request that ran nothing (and, on a route with external effects, send it to
        // reconciliation when the lease ends). Asked again with the same token, a claim that
        // landed answers as this one's (see `CLAIM`).
        // Lost again, what may have landed is given back: the request is refused, nothing ran.
        // All on one connection, pinned: a claim still on its way on it (a stalled link) lands
        // before the give-back that follows it there, never after (commands on one
        // connection run in order; a replaced connection would take the give-back past it).
        let pinned = Self {
            connection: self.connection.pinned(),
            ..self.clone()
        };
        let mut connection = pinned.connection.clone();
        let claim = &self.scripts.claim;
        let reply = match pinned.run_on(&mut connection, claim, &at, &args).await {
            Err(error) if reply_lost(&error) => {
                match pinned.run_on(&mut connection, claim, &at, &args).await {
                    Err(error) if reply_lost(&error) => {
                        super::unheard::give_back(&pinned, &request.key, token, request.lease);
                        return Err(error);
                    }
                    reply => reply?,
                }
            }
            reply => reply?,
        };
        let claimed = claimed(&reply, token)?;
        // Nothing runs under a claim a failover could lose: a promoted replica without it
        // would let a retry run the key beside this holder. Not acknowledged in time, it is
        // given back and the request refused, nothing run.
        match (self.waits(), claimed) {
            // Given back on the claim's own connection, which answers: the waiting one may
            // not (its reply timed out). A re-ask landing after the give-back writes nothing,
            // whoever holds the key by then (see `CLAIM`'s re-ask).
            (Some(wait), Claim::Acquired(_)) => self
                .acknowledged_claim(&at, &args, wait, token, request.lease)
                .await
                .inspect_err(|_| {
                    super::unheard::give_back(&pinned, &request.key, token, request.lease);
                }),
            (_, claimed) => Ok(claimed),
        }
    }

    async fn renew(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<SystemTime, StoreError> {
        let at = self.locate(key);
        let reply = self
            .run(
                &self.scripts.renew,
                &at,
                &[token.get().to_string().as_bytes(), ms(lease).as_bytes()],
            )
            .await?;
        match reply {
            Value::Nil => Err(StoreError::Fenced),
            other => int(&other)
                .map(from_ms)
                .ok_or_else(|| odd("a renewal's lease end")),
        }
    }

    async fn complete(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let at = self.locate(key);
        // A completion that waits for replicas runs on a connection of its own: `WAIT`
        // blocks the connection, and must run on the one that wrote.
        let mut lent = self.writing_connection(self.waits(), TIMEOUT).await?;
        let (token, response, ttl) = (token.get().to_string(), response.to_bytes(), ms(ttl));
        let args: [&[u8]; 3] = [token.as_bytes(), &response, ttl.as_bytes()];
        let complete = &self.scripts.complete;
        let (reply, acknowledged) = self
            .write(&mut lent.connection, complete, &at, &args, "outcome")
            .await?;
        lent.done();
        written(&reply)?;
        acknowledged
    }

    async fn release(
        &self,
        key: &ScopedKey,
        token: FencingToken,
    ) -> Result<RecordStatus, StoreError> {
        let at = self.locate(key);
        let reply = self
            .run(
                &self.scripts.release,
                &at,
                &[token.get().to_string().as_bytes()],
            )
            .await?;
        match bytes(&reply) {
            None if reply == Value::Nil => Err(StoreError::Fenced),
            Some(b"released") => Ok(RecordStatus::Released),
            Some(b"needs_reconciliation") => Ok(RecordStatus::NeedsReconciliation),
            _ => Err(odd("a release's status")),
        }
    }

    async fn mark_uncertain(&self, key: &ScopedKey, token: FencingToken) -> Result<(), StoreError> {
        let at = self.locate(key);
        let reply = self
            .run(
                &self.scripts.mark_uncertain,
                &at,
                &[token.get().to_string().as_bytes()],
            )
            .await?;
        written(&reply)
    }

    async fn lookup(&self, key: &ScopedKey) -> Result<Option<Record>, StoreError> {
        let at = self.locate(key);
        let reply = self.run(&self.scripts.lookup, &at, &[]).await?;
        if reply == Value::Nil {
            return Ok(None);
        }
        let parts = array(&reply).ok_or_else(|| odd("a lookup is not an array"))?;
        let [_now, fields] = parts else {
            return Err(odd("a lookup has not two parts"));
        };
        let fields = array(fields).ok_or_else(|| odd("a record is not a hash"))?;
        parse_record(fields)
            .map(Some)
            .map_err(StoreError::unavailable)
    }

    async fn remove(&self, key: &ScopedKey) -> Result<bool, StoreError> {
        let at = self.locate(key);
        let reply = self.run(&self.scripts.remove, &at, &[]).await?;
        Ok(int(&reply) == Some(1))
    }

    /// Records expire by Redis TTL: nothing is left to purge.
    async fn purge_expired(&self) -> Result<u64, StoreError> {
        Ok(0)
    }

    async fn record_milestone(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        milestone: &Milestone,
    ) -> Result<(), StoreError> {
        let at = self.locate(key);
        let token = token.get().to_string();
        let (kind, value): (&[u8], &[u8]) = match milestone {
            Milestone::EffectStarted => (b"es", b""),
            Milestone::DownstreamId(id) => (b"did", id.as_bytes()),
        };
        let args: [&[u8]; 3] = [token.as_bytes(), kind, value];
        // A milestone a failover could lose would let the promoted replica's next claim run an
        // effect that started: with replicas to wait for, it waits as a completion does, and
        // the handler hears the store is down unless they have it.
        let mut lent = self.writing_connection(self.waits(), TIMEOUT).await?;
        let connection = &mut lent.connection;
        // A connection the server closed while idle (`timeout` in redis.conf, a balancer's
        // idle reset) fails the next command before or after it was sent; the manager then
        // connects again. A milestone is fenced and written twice alike, so it is asked once
        // more, as a claim whose reply was lost is: the handler is told the store is down only
        // when it is.
        let milestone = &self.scripts.milestone;
        let (reply, acknowledged) = match self
            .write(connection, milestone, &at, &args, "milestone")
            .await
        {
            Err(error) if reply_lost(&error) => {
                self.write(connection, milestone, &at, &args, "milestone")
                    .await?
            }
            reply => reply?,
        };
        lent.done();
        written(&reply)?;
        acknowledged
    }

    async fn list_uncertain(&self, query: &UncertainQuery) -> Result<UncertainPage, StoreError> {
        let pages = futures_util::future::try_join_all(
            (0..BUCKETS).map(|bucket| self.list_bucket(bucket, query)),
        )
        .await?;
        let mut rows: Vec<_> = pages.into_iter().flatten().collect();
        // Each bucket's page is in order; merged, by the same order: last change, then member.
        rows.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        if query.newest_first {
            rows.reverse();
        }
        let limit = query.limit.min(MAX_PAGE);
        rows.truncate(limit);
        let mut records = Vec::new();
        let mut unreadable = Vec::new();
        let mut last = None;
        for (score, member, record) in rows {
            let (scope, key) = split_member(&member).unwrap_or_default();
            let cursor = UncertainCursor::stored(from_ms(score), scope, key);
            match record {
                Ok(record) => records.push(record),
                Err(error) => unreadable.push(Unreadable {
                    key: cursor.key.clone(),
                    error,
                }),
            }
            last = Some(cursor);
        }
        Ok(UncertainPage::new(records, unreadable, last, limit))
    }

    async fn count_uncertain(&self) -> Result<UncertainCount, StoreError> {
        let counts = futures_util::future::try_join_all((0..BUCKETS).map(|bucket| async move {
            let at = self.bucket(bucket);
            let prefix = self.record_prefix(bucket);
            self.run(&self.scripts.count, &at, &[prefix.as_bytes()])
                .await
        }))
        .await?;
        let mut count = UncertainCount::default();
        for reply in counts {
            let parts = array(&reply).ok_or_else(|| odd("a count is not an array"))?;
            let [n, oldest] = parts else {
                return Err(odd("a count has not two parts"));
            };
            count.count += int(n).ok_or_else(|| odd("a count"))? as u64;
            if let Some(oldest) = int(oldest).filter(|&o| o >= 0) {
                let oldest = from_ms(oldest);
                count.oldest = Some(count.oldest.map_or(oldest, |o: SystemTime| o.min(oldest)));
            }
        }
        Ok(count)
    }

    async fn resolve(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        resolution: &Resolution,
        ttl: Duration,
        note: Option<&str>,
    ) -> Result<(), StoreError> {
        let at = self.locate(key);
        let (status, response): (&[u8], Option<Vec<u8>>) = match resolution {
            Resolution::Applied(response) => (b"completed", Some(response.to_bytes())),
            Resolution::NotApplied => (b"released", None),
        };
        let new_token = fresh_token().get().to_string();
        let reply = self
            .run(
                &self.scripts.resolve,
                &at,
                &[
                    token.get().to_string().as_bytes(),
                    status,
                    response.as_deref().unwrap_or_default(),
                    if response.is_some() { b"1" } else { b"0" },
                    ms(ttl).as_bytes(),
                    new_token.as_bytes(),
                    note.unwrap_or_default().as_bytes(),
                    if note.is_some() { b"1" } else { b"0" },
                ],
            )
            .await?;
        written(&reply)
    }

    async fn append_history(&self, key: &ScopedKey, event: HistoryEvent) -> Result<(), StoreError> {
        let at = self.locate(key);
        self.run(
            &self.scripts.append_history,
            &at,
            &[event.as_str().as_bytes()],
        )
        .await
        .map(drop)
    }

    /// Woken by the `PUBLISH` of the script that moves the record on, or at the holder's
    /// lease end; polls while the subscription is down.
    async fn wait_for_change(
        &self,
        key: &ScopedKey,
        seen: &InFlight,
        round: u32,
        within: Duration,
    ) {
        if !self.subscribed() {
            super::poll(round, within).await;
            return;
        }
        let member = self.locate(key).member;
        // Checked once registered: a change between the claim and now is not missed.
        let moved_on = async {
            match self.lookup(key).await {
                Ok(Some(record)) => {
                    record.status != RecordStatus::InProgress || record.lease_token != seen.token
                }
                // Gone, or the store is failing: claim again, which answers for either.
                Ok(None) | Err(_) => true,
            }
        };
        self.changes
            .waiters
            .wait(&member, seen, within, moved_on)
            .await;
    }
}

impl RedisStore {
    /// Whether this store's change subscription is up; starts it on first use.
    fn subscribed(&self) -> bool {
        use std::sync::atomic::Ordering;
        if !self.changes.started.swap(true, Ordering::SeqCst)
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let channel = format!("{}:changed", self.prefix);
            runtime.spawn(listen(Arc::downgrade(&self.changes), channel));
        }
        self.changes.live.load(Ordering::SeqCst)
    }
}

/// A node as a `CLUSTER NODES` listing names it.
#[derive(Debug, PartialEq, Eq)]
struct Listed<'a> {
    host: &'a str,
    port: u16,
    /// The hostname it announces, if any.
    hostname: Option<&'a str>,
    /// Marked failed by the cluster.
    failed: bool,
}

/// The nodes a `CLUSTER NODES` listing names, but those still in handshake or without an
/// address.
fn endpoints(listing: &str) -> Vec<Listed<'_>> {
    let mut found = Vec::new();
    for line in listing.lines() {
        let mut fields = line.split(' ');
        let (Some(address), Some(flags)) = (fields.nth(1), fields.next()) else {
            continue;
        };
        if flags
            .split(',')
            .any(|f| matches!(f, "noaddr" | "handshake"))
        {
            continue;
        }
        // `host:port@bus[,hostname[,field=value]...]` (Redis 7.2 adds the fields); an IPv6
        // host has colons of its own.
        let mut parts = address.split(',');
        let endpoint = parts.next().unwrap_or_default();
        let hostname = parts.next().filter(|h| !h.is_empty() && !h.contains('='));
        let endpoint = endpoint.split('@').next().unwrap_or_default();
        let Some((host, Ok(port))) = endpoint
            .rsplit_once(':')
            .map(|(host, port)| (host, port.parse::<u16>()))
        else {
            continue;
        };
        if !host.is_empty() && port != 0 {
            let failed = flags.split(',').any(|f| f == "fail");
            found.push(Listed {
                host,
                port,
                hostname,
                failed,
            });
        }
    }
    found
}

/// A connection to `client`'s server (at `node`) for `check()`, on the store's own bounds
/// (not redis-rs's half-second reply timeout: a slow link is not a refused `CONFIG`).
async fn checking(
    client: &redis::Client,
    node: &str,
) -> Result<redis::aio::MultiplexedConnection, RedisCheckError> {
    let bounds = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(TIMEOUT))
        .set_response_timeout(Some(TIMEOUT));
    client
        .get_multiplexed_async_connection_with_config(&bounds)
        .await
        .map_err(|error| RedisCheckError::Unreachable {
            node: node.to_owned(),
            error,
        })
}

/// An error of a command `check()` sent to `node`: the server unreachable, or the command
/// refused.
fn refused(node: &str, error: redis::RedisError) -> RedisCheckError {
    let node = node.to_owned();
    match error.is_timeout() || error.is_io_error() || error.is_connection_dropped() {
        true => RedisCheckError::Unreachable { node, error },
        false => RedisCheckError::ConfigUnreadable { node, error },
    }
}

/// Whether the server of `client` may evict keys (see [`RedisStore::check`]).
async fn check_node(client: &redis::Client) -> Result<(), RedisCheckError> {
    let node = client.get_connection_info().addr().to_string();
    let mut connection = checking(client, &node).await?;
    let config: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory*")
        .query_async(&mut connection)
        .await
        .map_err(|error| refused(&node, error))?;
    let value = |name: &str| {
        config
            .chunks(2)
            .find(|pair| pair[0] == name)
            .and_then(|pair| pair.get(1))
            .cloned()
    };
    let limited = value("maxmemory").is_some_and(|bytes| bytes != "0");
    let policy = value("maxmemory-policy").unwrap_or_default();
    if limited && policy != "noeviction" {
        return Err(RedisCheckError::Evicts { node, policy });
    }
    Ok(())
}

/// Whether at least `wanted` replicas follow the server of `client` (see
/// [`RedisStore::with_wait`]).
async fn check_replicas(client: &redis::Client, wanted: u32) -> Result<(), RedisCheckError> {
    let node = client.get_connection_info().addr().to_string();
    let mut connection = checking(client, &node).await?;
    let info: String = redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut connection)
        .await
        .map_err(|error| refused(&node, error))?;
    // Those a `WAIT` counts: online, not still in their first sync (`slaveN:…,state=online,…`).
    let online = |line: &str| {
        line.strip_prefix("slave")
            .and_then(|rest| rest.split_once(':'))
            .is_some_and(|(n, fields)| {
                n.parse::<u32>().is_ok() && fields.split(',').any(|f| f == "state=online")
            })
    };
    let connected = info.lines().filter(|line| online(line)).count();
    let connected = u32::try_from(connected).unwrap_or(u32::MAX);
    match connected < wanted {
        true => Err(RedisCheckError::TooFewReplicas {
            node,
            connected,
            wanted,
        }),
        false => Ok(()),
    }
}

/// The nodes of the cluster `client`'s server is part of, as its `CLUSTER NODES` lists them:
/// those to check (masters and replicas), each a client with `client`'s settings
/// (credentials, TLS) at the node's address; and the addresses of those marked failed.
async fn cluster_nodes(
    client: &redis::Client,
) -> Result<(Vec<redis::Client>, Vec<redis::ConnectionAddr>), RedisCheckError> {
    let given = client.get_connection_info();
    let node = given.addr().to_string();
    let mut connection = checking(client, &node).await?;
    let listing: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async(&mut connection)
        .await
        .map_err(|error| refused(&node, error))?;
    let (mut nodes, mut failed) = (Vec::new(), Vec::new());
    for listed in endpoints(&listing) {
        let addr = match given.addr() {
            redis::ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => redis::ConnectionAddr::TcpTls {
                // The name its certificate is for, where the cluster announces one.
                host: listed.hostname.unwrap_or(listed.host).to_owned(),
                port: listed.port,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => redis::ConnectionAddr::Tcp(listed.host.to_owned(), listed.port),
        };
        if listed.failed {
            // As the store may have been given it: by its address, or by its hostname.
            failed.push(redis::ConnectionAddr::Tcp(
                listed.host.to_owned(),
                listed.port,
            ));
            if let Some(hostname) = listed.hostname {
                failed.push(redis::ConnectionAddr::Tcp(hostname.to_owned(), listed.port));
            }
            failed.push(addr);
            continue;
        }
        let info = given.clone().set_addr(addr);
        let node = info.addr().to_string();
        let client = redis::Client::open(info)
            .map_err(|error| RedisCheckError::Unreachable { node, error })?;
        nodes.push(client);
    }
    Ok((nodes, failed))
}

/// How often a quiet subscription is checked: that its store still lives, and that its
/// connection still answers (a link a NAT dropped without closing it shows only then).
const HEARTBEAT: Duration = Duration::from_secs(2);
/// How long its ping may take before the link counts as dead.
const PING_TIMEOUT: Duration = Duration::from_secs(1);

/// Keeps a store's subscription to `channel` up while the store lives, waking the waiters of
/// each member published, on any of the store's nodes in turn; after a lost subscription
/// (changes may have been missed) every waiter is woken to look again.
async fn listen(changes: std::sync::Weak<Changes>, channel: String) {
    use futures_util::StreamExt;
    use std::sync::atomic::Ordering;
    // Ended for any reason (its runtime shut down), the subscription is down: the next
    // waiter starts another.
    let _running = Running(changes.clone());
    let mut attempt = 0usize;
    // Between failed subscriptions (a user without the channel, a server down): 1 s doubling
    // to 30 s, reset once one succeeds.
    let mut pause = Duration::from_secs(1);
    loop {
        let Some(client) = changes
            .upgrade()
            .and_then(|c| c.clients.get(attempt % c.clients.len().max(1)).cloned())
        else {
            return;
        };
        attempt += 1;
        if let Ok(pubsub) = client.get_async_pubsub().await {
            let (mut sink, mut stream) = pubsub.split();
            match sink.subscribe(&channel).await {
                Ok(()) => {
                    pause = Duration::from_secs(1);
                    if let Some(c) = changes.upgrade() {
                        c.live.store(true, Ordering::SeqCst);
                        c.waiters.wake_all();
                    }
                    loop {
                        match tokio::time::timeout(HEARTBEAT, stream.next()).await {
                            Ok(Some(message)) => {
                                let Some(c) = changes.upgrade() else {
                                    return;
                                };
                                c.waiters.wake(&message.get_payload_bytes().to_vec());
                            }
                            Ok(None) => break,
                            Err(_) => {
                                if changes.strong_count() == 0 {
                                    return;
                                }
                                let ping = sink.ping::<Value>();
                                let answered = tokio::time::timeout(PING_TIMEOUT, ping).await;
                                if !matches!(answered, Ok(Ok(_))) {
                                    break;
                                }
                            }
                        }
                    }
                    tracing::warn!(
                        "the Redis change subscription was lost; waiters poll until it is back"
                    );
                }
                Err(error) => tracing::warn!(
                    %error,
                    "could not subscribe to {channel} (does this Redis user have the channel?); \
                     waiters poll"
                ),
            }
        }
        let Some(c) = changes.upgrade() else {
            return;
        };
        c.live.store(false, Ordering::SeqCst);
        c.waiters.wake_all();
        drop(c);
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(30));
    }
}

/// Marks a store's subscription down when its task ends.
struct Running(std::sync::Weak<Changes>);

impl Drop for Running {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering;
        if let Some(c) = self.0.upgrade() {
            c.live.store(false, Ordering::SeqCst);
            c.started.store(false, Ordering::SeqCst);
            c.waiters.wake_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// §2 (`check()` reads every node of a cluster): each node a `CLUSTER NODES` listing names
    /// is checked, replicas and IPv6 hosts included, under its announced hostname where TLS
    /// needs one; failed nodes are told apart (skipped, given or not); nodes in handshake and
    /// nodes without an address are not listed.
    #[test]
    fn s2_check_reads_the_nodes_a_cluster_lists() {
        let listing = "\
07c3 127.0.0.1:30004@31004,db-4.example slave e7d1 0 1426238317239 4 connected
67ed 127.0.0.1:30002@31002,,shard-id=9f2c master - 0 1426238316232 2 connected 5461-10922
5a5a 127.0.0.1:30007@31007,db-7.example,tls-port=0,shard-id=9f2c slave 67ed 0 0 2 connected
292f ::1:30003@31003 myself,master - 0 0 3 connected 10923-16383
6ec2 127.0.0.1:30005@31005 master,fail 67ed 1426238316232 1426238315228 5 disconnected
824f :0@0 master,noaddr - 1426238316232 1426238315228 5 disconnected
a1b2 127.0.0.1:30006@31006 handshake - 0 0 0 connected
e7d1 127.0.0.1:0@0 master - 0 0 0 connected
garbage
";
        let listed = |host, port, hostname, failed| Listed {
            host,
            port,
            hostname,
            failed,
        };
        assert_eq!(
            endpoints(listing),
            vec![
                listed("127.0.0.1", 30004, Some("db-4.example"), false),
                listed("127.0.0.1", 30002, None, false),
                listed("127.0.0.1", 30007, Some("db-7.example"), false),
                listed("::1", 30003, None, false),
                listed("127.0.0.1", 30005, None, true),
            ]
        );
    }

    #[test]
    fn members_are_unambiguous_and_split_back() {
        let a = member(b"ab", b"c");
        let b = member(b"a", b"bc");
        assert_ne!(a, b);
        assert_eq!(split_member(&a), Some((b"ab".to_vec(), b"c".to_vec())));
        assert_eq!(
            split_member(&member(b"", b"k\0{x}")),
            Some((Vec::new(), b"k\0{x}".to_vec()))
        );
        assert_eq!(split_member(b"9:ab"), None);
        assert_eq!(split_member(b"x"), None);
    }

    #[test]
    fn buckets_are_stable_and_spread() {
        // The bucket names keys in a server: it must never change between versions.
        assert_eq!(bucket_of(b"0:order-1"), bucket_of(b"0:order-1"));
        let mut seen = std::collections::HashSet::new();
        for i in 0..2000 {
            seen.insert(bucket_of(&member(b"", format!("k-{i}").as_bytes())));
        }
        assert_eq!(seen.len(), BUCKETS as usize, "2000 keys reach every bucket");
    }

    #[test]
    fn prefixes_that_would_break_hash_tags_are_refused() {
        for bad in ["", "a{b", "a}b", "a b", "a\nb"] {
            assert!(InvalidPrefix(bad.into()).to_string().contains("invalid"));
        }
    }
}
