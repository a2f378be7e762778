//! Review: a Redis server killed (SIGKILL) and started again on its append-only file, under
//! the layer: every connection the store had is gone (commands, the change subscription), its
//! scripts are unloaded, and its records are what the file kept. A killed process loses
//! nothing the file was written with before each reply (whatever `appendfsync` says: the OS
//! still holds what was not yet synced); only `always` also survives the machine going down,
//! which this cannot show. Peers lost claims and completions over a Redis restart and ran keys
//! again.
//!
//! Expected (DESIGN §1.5–§1.6, §5): a key answered before the restart replays after it and
//! never runs again; a key in flight across the restart runs once, its retries meanwhile are
//! told it is in flight (or that the store is unavailable while the store reconnects), never
//! run; its outcome lands on the restarted server and replays; a request waiting for it is
//! answered with that replay (or, if its wait ended in the store's outage, told so with a 503,
//! and its resend replays). Effects are counted at the handler's sink.

use crate::common;

use std::time::Duration;

use common::own_redis::*;
use common::{guard, serve};

/// A Redis that writes every change to its append-only file before it answers, so a killed
/// server started again loses nothing.
fn durable() -> Option<OwnRedis> {
    OwnRedis::start(&["--appendonly", "yes", "--appendfsync", "always"])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_a_key_answered_before_a_redis_restart_replays_after_it() {
    let Some(mut redis) = durable() else { return };
    let sink = Sink::open("restart-done", false);
    let store = store_on(&redis.url(), Some(&unique("restart-done"))).await;
    let addr = serve(app(store, &sink, &Knobs::default())).await;
    let key = unique("k");
    let first = send(addr, &key).await;
    assert!(first.live_201(), "{first:?}");

    tokio::task::block_in_place(|| redis.restart());
    let again = settled_past(addr, &key, &[409, 503], |a| {
        assert!(
            !a.live_201(),
            "a key answered before the restart ran again: {a:?}"
        );
    })
    .await;
    assert!(again.replay_201(), "{again:?}");
    assert_eq!(again.body, first.body, "the replay is the first answer");
    assert_eq!(sink.effects.count(), 1, "one effect");
    assert_eq!(sink.runs.count(), 1, "one run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_a_key_in_flight_across_a_redis_restart_runs_once_and_its_waiter_replays() {
    let Some(mut redis) = durable() else { return };
    let sink = Sink::new("restart-flight", false);
    let prefix = unique("restart-flight");
    let store = store_on(&redis.url(), Some(&prefix)).await;
    let knobs = Knobs {
        lease: Duration::from_secs(5),
        ..Knobs::default()
    };
    let addr = serve(app(store.clone(), &sink, &knobs)).await;
    // A second app on the same store whose requests wait for a key in flight.
    let waiting = Knobs {
        wait: Some(Duration::from_secs(20)),
        ..knobs.clone()
    };
    let waiter_addr = serve(app(store, &sink, &waiting)).await;
    let key = unique("k");
    let first = tokio::spawn({
        let key = key.clone();
        async move { send(addr, &key).await }
    });
    started(&sink, 1).await;
    let waiter = tokio::spawn({
        let key = key.clone();
        async move { send(waiter_addr, &key).await }
    });
    // The waiter has claimed, been told the key is in flight, and listens for its change.
    let channel = format!("{prefix}:changed");
    guard("the waiter subscribes", async {
        loop {
            let subscribed = redis.cmd(&["PUBSUB", "NUMSUB", &channel]).await;
            if let Ok(redis::Value::Array(reply)) = subscribed
                && matches!(reply.get(1), Some(redis::Value::Int(n)) if *n >= 1)
            {
                break;
            }
            tokio::time::sleep(ms(10)).await;
        }
    })
    .await;

    tokio::task::block_in_place(|| redis.restart());
    // Retries while the holder runs across the restart: in flight, or the store
    // reconnecting; never a run.
    for _ in 0..10 {
        let a = send(addr, &key).await;
        assert!(
            a.status == 409 || a.status == 503,
            "a retry during the run is told to wait: {a:?}"
        );
        tokio::time::sleep(ms(50)).await;
    }
    assert_eq!(
        sink.runs.count(),
        1,
        "no second run while the first holds the key"
    );

    sink.gate_a.add_permits(10_000);
    sink.gate_b.add_permits(10_000);
    let first = guard("the first request", first).await.expect("first");
    assert!(first.live_201(), "{first:?}");
    let waited = guard("the waiting request", waiter).await.expect("waiter");
    let waited = match waited.status {
        // Its wait ended in the outage (the subscription's loss wakes it to claim again).
        503 => send(waiter_addr, &key).await,
        _ => waited,
    };
    assert!(
        waited.replay_201() && waited.body == first.body,
        "the request waiting across the restart gets the replay: {waited:?}"
    );
    let again = settled_past(addr, &key, &[409, 503], |a| {
        assert!(!a.live_201(), "the key ran again: {a:?}");
    })
    .await;
    assert!(again.replay_201() && again.body == first.body, "{again:?}");
    assert_eq!(sink.effects.count(), 1, "one effect");
    assert_eq!(sink.runs.count(), 1, "one run");
}
