//! Waiting for a change: a waiter ends when the record moves on.

use std::sync::Arc;
use std::time::Duration;

use super::{LONG, acquire, claim, existing, request, response, spawn_in_pass, unique_key};
use crate::store::{Claim, IdempotencyStore, InFlight, RecordStatus};

/// `wait_for_change` returns once the record it saw in flight moves on (woken or by polling:
/// either way never later than its `within`, and never stuck past a completion), and returns
/// at once, or nearly, for a record that already moved on; the next claim then sees the change.
pub async fn waiting_for_a_change_ends_when_the_record_moves_on<S: IdempotencyStore>(
    store: &Arc<S>,
) {
    let key = unique_key("wait");
    let req = request(&key, 1, LONG, LONG);
    let lease = acquire(store.as_ref(), &req, "a fresh key").await;
    let (record, now) = existing(store.as_ref(), &req, "a key in flight").await;
    let seen = InFlight {
        token: record.lease_token,
        lease_until: record.lease_until,
        now,
    };
    // A bound for the check only: a wait stuck past the change fails it rather than hanging.
    let bound = Duration::from_secs(20);
    // Several waiters, as a burst of retries would be.
    let waiters: Vec<_> = (0..4)
        .map(|round| {
            let (store, key) = (store.clone(), key.clone());
            spawn_in_pass(round as usize, async move {
                loop {
                    store.wait_for_change(&key, &seen, round, LONG).await;
                    match claim(&*store, &request(&key, 1, LONG, LONG)).await {
                        Ok(Claim::Existing { record, .. })
                            if record.status == RecordStatus::InProgress =>
                        {
                            continue;
                        }
                        other => return other.map(|_| ()),
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    store
        .complete(&key, lease.token, &response(), LONG)
        .await
        .expect("complete");
    for waiter in waiters {
        let ended = tokio::time::timeout(bound, waiter)
            .await
            .expect("wait_for_change: a waiter is still waiting after the record moved on")
            .expect("waiter task");
        ended.expect("wait_for_change: the claim after the wait");
    }
    // Already moved on: returns without waiting out `within`.
    tokio::time::timeout(bound, store.wait_for_change(&key, &seen, 0, LONG))
        .await
        .expect("wait_for_change: waited on a record that had already moved on");
    // Never longer than `within`, on a record still in flight.
    let other = unique_key("wait-within");
    let other_req = request(&other, 1, LONG, LONG);
    acquire(store.as_ref(), &other_req, "a fresh key").await;
    let (record, now) = existing(store.as_ref(), &other_req, "a key in flight").await;
    let seen = InFlight {
        token: record.lease_token,
        lease_until: record.lease_until,
        now,
    };
    tokio::time::timeout(
        bound,
        store.wait_for_change(&other, &seen, 0, Duration::from_millis(100)),
    )
    .await
    .expect("wait_for_change: waited past `within`");
}
