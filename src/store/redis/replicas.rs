//! Writes that wait for replicas ([`RedisStore::with_wait`]): the connections they run on, each
//! lent to one write at a time, a write sent with its `WAIT` in one flight, and a won claim
//! asked again to be acknowledged.

use std::sync::Arc;
use std::time::Duration;

use redis::{Script, Value};

use super::connection::{Connection, Replaceable, TIMEOUT};
use super::reply::{claimed, int, odd};
use super::scripts::invocation;
use super::{Located, RedisStore, ms};
use crate::store::{Claim, FencingToken, StoreError};

/// How many writes may wait for replicas at once unless
/// [`with_waiting_connections`](RedisStore::with_waiting_connections) says otherwise.
pub(super) const WAITING_CONNECTIONS: usize = 4;

/// The most a store opens: beyond, a number set by mistake would open connections by the
/// thousand inside a request, past the server's accept queue and `maxclients`.
pub(super) const MOST_WAITING_CONNECTIONS: usize = 64;

/// How long the pool's opening gives loading the scripts that wait (see
/// [`Scripts::waited`](super::scripts::Scripts::waited)): a server slow to load them does not
/// hold the first write that waits for the whole of the store's timeout.
const PRELOAD: Duration = Duration::from_secs(1);

/// The connections writes that wait for replicas run on, each lent to one write at a time: a
/// `WAIT` blocks its connection, and a write queued behind it there would spend its reply
/// timeout waiting for another's. Writes queue here instead, for at most [`TIMEOUT`].
pub(super) struct Pool {
    connections: Vec<Arc<Replaceable>>,
    /// Those not lent now, the one free longest first.
    free: std::sync::Mutex<std::collections::VecDeque<usize>>,
    /// One per free connection.
    permits: Arc<tokio::sync::Semaphore>,
}

/// A connection for one write: the store's own, or one of the [`Pool`]'s, lent to this write
/// alone until dropped.
pub(super) struct Lent {
    pub(super) connection: Connection,
    slot: Option<Slot>,
}

impl Lent {
    /// The write's replies are in: nothing of it is left on the connection.
    pub(super) fn done(&mut self) {
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
        // behind it is answered, so no write is lent a connection still blocked by another's;
        // or once the PING's reply times out (5 s, longer than any `WAIT`: the link is dead,
        // not blocked), which starts a new connection in the background; a write lent this
        // one before that is made times out in turn. The bound here is a second longer, so
        // that the reply's own timeout, which starts the new connection, comes first.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return drop(back);
        };
        let mut connection = self.connection.clone();
        crate::detached::spawn(&runtime, async move {
            let ping = redis::cmd("PING");
            let bound = TIMEOUT + Duration::from_secs(1);
            let _ = tokio::time::timeout(bound, ping.query_async::<Value>(&mut connection)).await;
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

impl RedisStore {
    /// The replicas to wait for and how long, unless on a cluster (see
    /// [`with_wait`](Self::with_wait)).
    pub(super) fn waits(&self) -> Option<(u32, Duration)> {
        self.wait.filter(|_| !self.connection.is_cluster())
    }

    /// The connection for a write: with replicas to wait for, one of the pool's, lent to it
    /// alone (waiting at most `within` for a free one, or the store is unavailable for this
    /// write; the pool's opening, at most the store's timeout); else the store's own.
    pub(super) async fn writing_connection(
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
        let began = tokio::time::Instant::now();
        let opening = self.waiting.get_or_try_init(|| async {
            let client = self
                .nodes
                .first()
                .ok_or_else(|| StoreError::unavailable("no server to connect to"))?;
            let size = self.waiting_connections;
            // Connected together: one at a time, many would not fit the bound below.
            let connections = futures_util::future::try_join_all(
                (0..size).map(|_| Replaceable::server(client.clone())),
            )
            .await
            .map_err(|e| {
                StoreError::unavailable(format!(
                    "the connections that wait for replicas could not be opened: {e}"
                ))
            })?;
            // Best effort, within half the time the opening has left, so connections slow to
            // open are not given up on for it: a script still missing is loaded when a write
            // meets its absence.
            if let Some(first) = connections.first() {
                let mut first = Connection::Replaced(first.clone());
                let left = TIMEOUT.saturating_sub(began.elapsed()) / 2;
                let preload = self.load_waited(&mut first, None);
                let _ = tokio::time::timeout(PRELOAD.min(left), preload).await;
            }
            Ok::<_, StoreError>(Arc::new(Pool {
                connections,
                free: std::sync::Mutex::new((0..size).collect()),
                permits: Arc::new(tokio::sync::Semaphore::new(size)),
            }))
        });
        // Opened once, within the store's timeout whatever `within` is: a bound shorter than
        // a connect would cancel the opening every time.
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
            // All of the scripts that wait are loaded at once, so after a restart or a failover
            // only the first write that waits pays a second `WAIT`, not the first of each kind.
            (Value::ServerError(e), _) if e.kind() == Some(redis::ServerErrorKind::NoScript) => {
                self.load_waited(connection, Some(script)).await?;
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

    /// Loads [`Scripts::waited`], and `also` if it is not one of them, into the server
    /// `connection` reaches, in one round trip.
    async fn load_waited(
        &self,
        connection: &mut Connection,
        also: Option<&Script>,
    ) -> Result<(), StoreError> {
        let waited = self.scripts.waited();
        let also = also.filter(|also| waited.iter().all(|w| w.get_hash() != also.get_hash()));
        let loads = waited.into_iter().chain(also).map(|script| {
            let mut connection = connection.clone();
            async move { script.load_async(&mut connection).await }
        });
        futures_util::future::try_join_all(loads)
            .await
            .map_err(StoreError::unavailable)?;
        Ok(())
    }

    /// A write that waits for replicas when the store does ([`run_then_wait`](Self::run_then_wait)),
    /// else [`run_on`](Self::run_on) (acknowledged by the primary alone).
    pub(super) async fn write(
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

    /// Asks a won claim again (its own token: it writes again, as it was) with a `WAIT` for
    /// `wait`'s replicas, on a waiting connection: only a claim that won waits, so a replay
    /// never queues behind a lagging replica. Returns the claim as it stands, held and
    /// acknowledged, or why not.
    pub(super) async fn acknowledged_claim(
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

/// A write's reply and its `WAIT`'s, from their pipeline's.
fn two(replies: Vec<Value>) -> Result<(Value, Value), StoreError> {
    let [reply, acknowledged] = <[Value; 2]>::try_from(replies)
        .map_err(|_| odd("a write and its WAIT, not two replies"))?;
    Ok((reply, acknowledged))
}
