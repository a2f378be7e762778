//! Waking the requests that wait for a key in flight: the records' `PUBLISH`es on
//! `{prefix}:changed`, heard by one subscription a store keeps up while it lives.

use std::sync::Arc;
use std::time::Duration;

use redis::Value;

use super::RedisStore;
use crate::store::subscription::{Running, Subscription};

/// The waiters of one store, woken by the records' `PUBLISH`es on `{prefix}:changed`
/// (classic pub/sub reaches every node of a cluster, so one subscription to any node hears
/// them all). Subscribed on the first wait; while it is down, waiters poll.
pub(super) type Changes = Subscription<Vec<u8>>;

impl RedisStore {
    /// Whether this store's change subscription is up; starts it on first use, on any of the
    /// store's nodes in turn.
    pub(super) fn subscribed(&self) -> bool {
        self.changes.subscribed(|changes, running| {
            let channel = format!("{}:changed", self.prefix);
            listen(changes, self.nodes.clone(), channel, running)
        })
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
async fn listen(
    changes: std::sync::Weak<Changes>,
    nodes: Arc<[redis::Client]>,
    channel: String,
    // Ended for any reason (its runtime shut down, before or after it first ran), the
    // subscription is down: the next waiter starts another.
    _running: Running<Vec<u8>>,
) {
    use futures_util::StreamExt;
    let mut attempt = 0usize;
    // Between failed subscriptions (a user without the channel, a server down): 1 s doubling
    // to 30 s, reset once one succeeds.
    let mut pause = Duration::from_secs(1);
    loop {
        if changes.strong_count() == 0 {
            return;
        }
        let Some(client) = nodes.get(attempt % nodes.len().max(1)).cloned() else {
            return;
        };
        attempt += 1;
        if let Ok(pubsub) = client.get_async_pubsub().await {
            let (mut sink, mut stream) = pubsub.split();
            match sink.subscribe(&channel).await {
                Ok(()) => {
                    pause = Duration::from_secs(1);
                    if let Some(c) = changes.upgrade() {
                        c.up();
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
        c.down();
        drop(c);
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(30));
    }
}
