//! A record's history: what happened, bounded, its first attempts and its outcome kept.

use super::{LONG, acquire, request, response, unique_key};
use crate::store::{HISTORY_LIMIT, HISTORY_REFUSALS, HistoryEvent, IdempotencyStore, Milestone};

/// Issue 15 §6: a key's history is bounded. Replays written by routes that record refusals
/// stop at [`HISTORY_REFUSALS`] entries, and what came first (the claim and its outcome)
/// stays.
pub async fn history_is_bounded<S: IdempotencyStore>(store: &S) {
    let key = unique_key("bounded-history");
    let req = request(&key, 1, LONG, LONG);
    let lease = acquire(store, &req, "a fresh key").await;
    store
        .complete(&key, lease.token, &response(), LONG)
        .await
        .expect("complete");
    for _ in 0..HISTORY_REFUSALS + 40 {
        store
            .append_history(&key, HistoryEvent::Replayed)
            .await
            .expect("append_history");
    }
    let record = store
        .lookup(&key)
        .await
        .expect("lookup")
        .expect("the record");
    assert_eq!(
        record.history.len(),
        HISTORY_REFUSALS,
        "the history stops growing at its bound"
    );
    assert_eq!(record.history[0].event, HistoryEvent::Claimed);
    assert_eq!(record.history[1].event, HistoryEvent::Completed);
}

/// Issue 15 §6: a key that runs and is released again and again keeps a bounded history with
/// its first attempts and, always, its latest event: here its final outcome.
pub async fn history_keeps_its_first_attempts_and_its_outcome<S: IdempotencyStore>(store: &S) {
    let key = unique_key("long-history");
    let req = request(&key, 1, LONG, LONG);
    for _ in 0..HISTORY_LIMIT {
        let lease = acquire(store, &req, "a released key").await;
        store.release(&key, lease.token).await.expect("release");
    }
    let lease = acquire(store, &req, "a released key").await;
    store
        .complete(&key, lease.token, &response(), LONG)
        .await
        .expect("complete");
    let record = store
        .lookup(&key)
        .await
        .expect("lookup")
        .expect("the record");
    assert_eq!(record.history.len(), HISTORY_LIMIT);
    assert_eq!(record.history[0].event, HistoryEvent::Claimed);
    assert_eq!(record.history[0].attempt, 1);
    assert_eq!(record.history[1].event, HistoryEvent::Released);
    let last = record.history.last().expect("an entry");
    assert_eq!(
        last.event,
        HistoryEvent::Completed,
        "the outcome is always kept"
    );
    assert_eq!(last.attempt, record.attempts);
}

/// The record's history lists every attempt and what became of it, in order, with each
/// attempt's number and token, on the store's clock.
pub async fn history_tells_what_happened<S: IdempotencyStore>(store: &S) {
    let key = unique_key("history");
    let req = request(&key, 1, LONG, LONG);
    let first = acquire(store, &req, "a fresh key").await;
    store.release(&key, first.token).await.expect("release");
    let second = acquire(store, &req, "a released key").await;
    store
        .record_milestone(&key, second.token, &Milestone::DownstreamId("t-1".into()))
        .await
        .expect("downstream id");
    store
        .complete(&key, second.token, &response(), LONG)
        .await
        .expect("complete");
    store
        .append_history(&key, HistoryEvent::Replayed)
        .await
        .expect("append");
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    let got: Vec<_> = record
        .history
        .iter()
        .map(|e| (e.attempt, e.token, e.event))
        .collect();
    assert_eq!(
        got,
        [
            (1, first.token, HistoryEvent::Claimed),
            (1, first.token, HistoryEvent::Released),
            (2, second.token, HistoryEvent::Claimed),
            (2, second.token, HistoryEvent::DownstreamId),
            (2, second.token, HistoryEvent::Completed),
            (2, second.token, HistoryEvent::Replayed),
        ],
        "the history, in order"
    );
    assert!(
        record.history.windows(2).all(|w| w[0].at <= w[1].at),
        "entries are in time order"
    );
    assert!(record.history.iter().all(|e| e.at >= record.created_at));
    // Appending to a key that has no record does nothing, and is no error.
    store
        .append_history(&unique_key("absent"), HistoryEvent::Conflict)
        .await
        .expect("append to nothing");
}
