//! [`RedisStore::check`]: whether the servers keep every record until the store lets it go
//! (no eviction), on every node of a cluster, and whether as many replicas follow the server
//! as the store [waits for](RedisStore::with_wait).

use super::RedisStore;
use super::connection::TIMEOUT;

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
        let mut nodes = self.nodes.to_vec();
        if self.connection.is_cluster() {
            let mut failure = None;
            let mut listing = None;
            for client in self.nodes.iter() {
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
        if let (Some((wanted, _)), Some(client)) = (self.waits(), self.nodes.first()) {
            check_replicas(client, wanted).await?;
        }
        Ok(())
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
}
