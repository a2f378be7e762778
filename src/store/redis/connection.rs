//! The store's connection, to one server or to a cluster, made anew when it stops answering.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::{Cmd, Pipeline, RedisFuture, Value};

/// How long a connection attempt, and a reply, may take before the store counts as down.
pub(super) const TIMEOUT: Duration = Duration::from_secs(5);

/// The store's connection (each command takes the current one), or one of its connections
/// pinned.
#[derive(Clone)]
pub(super) enum Connection {
    /// The store's replaceable connection: each command takes the current one.
    Replaced(Arc<Replaceable>),
    /// One connection of a [`Replaceable`], kept for commands that must follow one another on
    /// it: a write and its `WAIT`; a claim, its asking again and the give-back of what
    /// may have landed. A timeout on it still has the replaceable connect anew.
    Pinned {
        shared: Arc<Replaceable>,
        generation: u64,
        connection: Link,
    },
}

impl Connection {
    /// This connection, pinned to the one it would use now (see [`Connection::Pinned`]).
    pub(super) fn pinned(&self) -> Self {
        match self {
            Self::Replaced(shared) => {
                let (generation, connection) = shared.current();
                Self::Pinned {
                    shared: shared.clone(),
                    generation,
                    connection,
                }
            }
            pinned => pinned.clone(),
        }
    }

    /// Whether this connects to a cluster.
    pub(super) fn is_cluster(&self) -> bool {
        let shared = match self {
            Self::Replaced(shared) | Self::Pinned { shared, .. } => shared,
        };
        matches!(shared.connector, Connector::Cluster(_))
    }
}

/// How a connection is made, and made again.
enum Connector {
    /// To one server: redis-rs's manager, which connects again when its connection breaks
    /// (a command that met the break fails; it is not sent again).
    Server(redis::Client, redis::aio::ConnectionManagerConfig),
    /// To a cluster, through its nodes: redis-rs routes each command by slot, and connects
    /// again to a node whose connection breaks.
    Cluster(redis::cluster::ClusterClient),
}

impl Connector {
    async fn connect(&self) -> redis::RedisResult<Link> {
        match self {
            Self::Server(client, config) => {
                redis::aio::ConnectionManager::new_with_config(client.clone(), config.clone())
                    .await
                    .map(Link::Server)
            }
            Self::Cluster(client) => client.get_async_connection().await.map(Link::Cluster),
        }
    }
}

/// A connection as a [`Connector`] made it.
#[derive(Clone)]
pub(super) enum Link {
    Server(redis::aio::ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
}

/// The store's connection. redis-rs connects again when a connection breaks, but not when it
/// only stops answering (a host gone without a FIN or RST, a frozen VM, a failover that moved
/// the address; on a cluster, any one node's): every command sent there would then time out
/// until the kernel gives the link up, minutes later, while a new connection would be
/// answered. A command that times out has a new connection made in the background (to a
/// cluster: every node's, and its slots read again); the commands after it go there.
/// (Commands still on the old one may land after those: a claim that lands late is held as
/// any whose answers were lost, see `store::unheard`.)
pub(super) struct Replaceable {
    connector: Connector,
    /// The connection, and how many times it was replaced.
    current: std::sync::RwLock<(u64, Link)>,
    /// Whether a replacement is being connected.
    replacing: std::sync::atomic::AtomicBool,
}

impl Replaceable {
    /// A replaceable connection to the server of `client`: connecting and each reply are
    /// bounded by [`TIMEOUT`].
    pub(super) async fn server(client: redis::Client) -> redis::RedisResult<Arc<Self>> {
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(TIMEOUT))
            .set_response_timeout(Some(TIMEOUT))
            .set_number_of_retries(1);
        Self::connect(Connector::Server(client, config)).await
    }

    /// A replaceable connection to the cluster of `nodes`: connecting and each reply are
    /// bounded by [`TIMEOUT`].
    pub(super) async fn cluster(nodes: &[&str]) -> redis::RedisResult<Arc<Self>> {
        let client = redis::cluster::ClusterClientBuilder::new(nodes.to_vec())
            .connection_timeout(TIMEOUT)
            .response_timeout(TIMEOUT)
            .build()?;
        Self::connect(Connector::Cluster(client)).await
    }

    async fn connect(connector: Connector) -> redis::RedisResult<Arc<Self>> {
        let first = connector.connect().await?;
        Ok(Arc::new(Self {
            connector,
            current: std::sync::RwLock::new((0, first)),
            replacing: std::sync::atomic::AtomicBool::new(false),
        }))
    }

    fn current(&self) -> (u64, Link) {
        let current = self
            .current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (current.0, current.1.clone())
    }

    /// Connects a replacement for the connection of `generation` (one at a time), unless it
    /// was replaced already: the commands that time out on a connection replaced meanwhile
    /// (a storm of them, each asked again) make no connection of their own.
    fn replace(self: &Arc<Self>, generation: u64) {
        use std::sync::atomic::Ordering;
        if self.current().0 != generation || self.replacing.swap(true, Ordering::AcqRel) {
            return;
        }
        // Let go however the attempt ends: its runtime may shut down in the middle of it.
        let replacing = Replacing(self.clone());
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            let this = &replacing.0;
            if this.current().0 != generation {
                return;
            }
            if let Ok(Ok(fresh)) = tokio::time::timeout(TIMEOUT, this.connector.connect()).await {
                let mut current = this
                    .current
                    .write()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if current.0 == generation {
                    *current = (generation + 1, fresh);
                }
            }
        });
    }

    /// `reply`, having asked for a new connection if the one of `generation` is of no more
    /// use: it timed out, or (a cluster's) its task is gone. redis-rs runs a cluster
    /// connection on a task of the runtime it was made on, and does not make it again when
    /// that runtime shuts down while another goes on serving: every command would fail at
    /// once (a broken pipe to the task), for good. A server's connection manager connects
    /// again by itself; a refused connection is a node down, which a new one would not mend.
    fn after<T>(
        self: &Arc<Self>,
        generation: u64,
        reply: redis::RedisResult<T>,
    ) -> redis::RedisResult<T> {
        if let Err(error) = &reply {
            let gone = matches!(self.connector, Connector::Cluster(_))
                && error.is_connection_dropped()
                && !error.is_connection_refusal();
            if error.is_timeout() || gone {
                self.replace(generation);
            }
        }
        reply
    }
}

/// A replacement being connected: lets the next one be tried once it is dropped, whether it
/// ran to its end or its runtime shut down first.
struct Replacing(Arc<Replaceable>);

impl Drop for Replacing {
    fn drop(&mut self) {
        self.0
            .replacing
            .store(false, std::sync::atomic::Ordering::Release);
    }
}

impl ConnectionLike for Link {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Server(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Server(c) => c.req_packed_commands(cmd, offset, count),
            Self::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Server(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            // The current connection, for this command.
            Self::Replaced(_) => {
                let mut pinned = self.pinned();
                Box::pin(async move { pinned.req_packed_command(cmd).await })
            }
            Self::Pinned {
                shared,
                generation,
                connection,
            } => {
                let (shared, generation) = (shared.clone(), *generation);
                Box::pin(async move {
                    let reply = connection.req_packed_command(cmd).await;
                    shared.after(generation, reply)
                })
            }
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Replaced(_) => {
                let mut pinned = self.pinned();
                Box::pin(async move { pinned.req_packed_commands(cmd, offset, count).await })
            }
            Self::Pinned {
                shared,
                generation,
                connection,
            } => {
                let (shared, generation) = (shared.clone(), *generation);
                Box::pin(async move {
                    let reply = connection.req_packed_commands(cmd, offset, count).await;
                    shared.after(generation, reply)
                })
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Replaced(shared) => shared.current().1.get_db(),
            Self::Pinned { connection, .. } => connection.get_db(),
        }
    }
}
