//! Waking the requests that wait for a key in flight: the records' `PUBLISH`es on
//! `{prefix}:changed`, heard by one subscription a store keeps up while it lives.

use std::sync::Arc;
use std::time::Duration;

use redis::Value;

use super::RedisStore;

/// The waiters of one store, woken by the records' `PUBLISH`es on `{prefix}:changed`
/// (classic pub/sub reaches every node of a cluster, so one subscription to any node hears
/// them all). Subscribed on the first wait; while it is down, waiters poll.
pub(super) struct Changes {
    /// Where the subscription connects: any of the store's nodes, in turn.
    nodes: Arc<[redis::Client]>,
    pub(super) waiters: crate::store::Waiters<Vec<u8>>,
    started: std::sync::atomic::AtomicBool,
    /// Whether the subscription is up.
    live: std::sync::atomic::AtomicBool,
}

impl Changes {
    pub(super) fn new(nodes: Arc<[redis::Client]>) -> Arc<Self> {
        Arc::new(Self {
            nodes,
            waiters: crate::store::Waiters::default(),
            started: std::sync::atomic::AtomicBool::new(false),
            live: std::sync::atomic::AtomicBool::new(false),
        })
    }
}

impl RedisStore {
    /// Whether this store's change subscription is up; starts it on first use.
    pub(super) fn subscribed(&self) -> bool {
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
            .and_then(|c| c.nodes.get(attempt % c.nodes.len().max(1)).cloned())
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
