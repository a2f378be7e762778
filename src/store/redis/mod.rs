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

mod changes;
mod check;
mod connection;
mod keys;
mod replicas;
mod reply;
mod scripts;

pub use check::RedisCheckError;

use redis::{Script, Value};

use changes::Changes;
use connection::{Connection, Replaceable, TIMEOUT};
use keys::{BUCKETS, Located, member, split_member};
use replicas::Pool;
use reply::{array, bytes, claimed, from_ms, int, odd, parse_record, written};
use scripts::{Scripts, invocation};

use super::codec::fresh_token;
use super::{
    Claim, ClaimRequest, FencingToken, HistoryEvent, IdempotencyStore, InFlight, LeaseExpiry,
    Milestone, Record, RecordStatus, Resolution, ScopedKey, StoreError, StoredResponse,
    UncertainCount, UncertainCursor, UncertainPage, UncertainQuery, Unreadable,
};

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
    /// The nodes the store was given (a cluster's seeds): where `check()`, the change
    /// subscription and the connections that wait for replicas connect.
    nodes: Arc<[redis::Client]>,
    prefix: Arc<str>,
    scripts: Arc<Scripts>,
    /// Replicas that must acknowledge a won claim, a milestone and a completion, and how long
    /// to wait for them ([`with_wait`](Self::with_wait)).
    wait: Option<(u32, Duration)>,
    /// The connections of writes that wait for replicas, opened on first use.
    waiting: Arc<tokio::sync::OnceCell<Arc<Pool>>>,
    /// How many [`waiting`](Self::waiting) opens.
    waiting_connections: usize,
    /// Requests waiting for in-flight keys, and the subscription that wakes them.
    changes: Arc<Changes>,
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
            .field("waiting_connections", &self.waiting_connections)
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

    fn new(connection: Connection, nodes: Vec<redis::Client>) -> Self {
        let nodes: Arc<[redis::Client]> = nodes.into();
        Self {
            connection,
            nodes,
            prefix: Self::DEFAULT_PREFIX.into(),
            scripts: Arc::new(Scripts::new()),
            wait: None,
            waiting: Arc::default(),
            waiting_connections: replicas::WAITING_CONNECTIONS,
            changes: Changes::new(),
        }
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
        self.changes = Changes::new();
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
    /// these writes run on connections of their own (four, or
    /// [as many as set](Self::with_waiting_connections)), each lent to one write at a time
    /// (a write given up on mid-`WAIT` returns its connection once a PING behind the `WAIT`
    /// is answered, or its reply times out), so no write queues behind another's `WAIT`
    /// there. A write that finds them all lent waits for one to be free, at most 5 s (a won
    /// claim, at most half its lease, so that nothing sets it aside meanwhile), then the
    /// store is unavailable for it. With a replica down, each takes `timeout`: give
    /// the lease more than `timeout`. `timeout` is kept under the store's 5 s reply timeout,
    /// and at 1 ms at least (Redis reads a `WAIT` of 0 ms as one without end).
    pub fn with_wait(mut self, replicas: u32, timeout: Duration) -> Self {
        let timeout = timeout.clamp(Duration::from_millis(1), TIMEOUT - Duration::from_secs(1));
        self.wait = Some((replicas, timeout));
        self
    }

    /// How many writes may [wait for replicas](Self::with_wait) at once (default 4; 0 counts
    /// as 1, more than 64 as 64): each holds a connection of its own while its script and
    /// `WAIT` run, and a write that finds every one lent waits for one. With replicas that
    /// take `L` to acknowledge, the store makes at most `connections / L` such writes a
    /// second (four at 1 ms: 4 000; a request that runs makes two, its claim and its
    /// completion, three with a milestone). The connections are opened together, at the
    /// first write that waits; a store that does not wait (no `with_wait`, or a cluster,
    /// where it is ignored) opens none. Clones share them: set this before the store is
    /// cloned into layers, since the store it returns opens connections of its own (clones
    /// made before keep theirs).
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use tower_idempotency::store::RedisStore;
    ///
    /// let store = RedisStore::connect("redis://127.0.0.1:6379")
    ///     .await?
    ///     .with_wait(1, Duration::from_millis(200))
    ///     .with_waiting_connections(16);
    /// # Ok(()) }
    /// ```
    pub fn with_waiting_connections(mut self, connections: usize) -> Self {
        self.waiting_connections = connections.clamp(1, replicas::MOST_WAITING_CONNECTIONS);
        // A pool of its own, of that size: clones made before keep theirs.
        self.waiting = Arc::default();
        self
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
}

/// Whether a failed script may have run all the same: its connection broke or timed out
/// before the reply came, rather than Redis answering with an error.
fn reply_lost(error: &StoreError) -> bool {
    super::unheard::lost(error, |e: &redis::RedisError| {
        e.is_io_error() || e.is_connection_dropped() || e.is_timeout()
    })
}

fn ms(d: Duration) -> String {
    u64::try_from(d.as_millis())
        .unwrap_or(u64::MAX)
        .min(1 << 52)
        .to_string()
}

impl RedisStore {
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
                let (score, member, fields, wrong) = match row {
                    [score, member, fields] => (score, member, fields, None),
                    [score, member, fields, wrong] => (score, member, fields, Some(wrong)),
                    _ => return Err(odd("a listed record has not three parts")),
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
                let record = match wrong {
                    // Something other than a record at its key: said as the script found it.
                    Some(wrong) => Err(bytes(wrong)
                        .map(|w| String::from_utf8_lossy(w).into_owned())
                        .unwrap_or_else(|| "something other than a record is at its key".into())),
                    None => array(fields)
                        .ok_or_else(|| "its fields are not a hash".to_owned())
                        .and_then(parse_record),
                };
                Ok((score, member.to_vec(), record))
            })
            .collect()
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
        // landed answers as this one's (see `scripts::CLAIM`).
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
            // whoever holds the key by then (see the re-ask in `scripts::CLAIM`).
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
        let damaged = |what: String| StoreError::unavailable(super::codec::RowError(what));
        let fields = match parts {
            [_now, fields] => fields,
            // The script found something at the key that is not a record it can read.
            [_now, fields, what] => {
                let what = bytes(what).map(String::from_utf8_lossy).unwrap_or_default();
                return match array(fields).map(parse_record) {
                    Some(Err(error)) => Err(damaged(format!("{what}: {error}"))),
                    _ => Err(damaged(what.into_owned())),
                };
            }
            _ => return Err(odd("a lookup has not two parts")),
        };
        let fields = array(fields).ok_or_else(|| odd("a record is not a hash"))?;
        parse_record(fields).map(Some).map_err(damaged)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_that_would_break_hash_tags_are_refused() {
        for bad in ["", "a{b", "a}b", "a b", "a\nb"] {
            assert!(InvalidPrefix(bad.into()).to_string().contains("invalid"));
        }
    }
}
