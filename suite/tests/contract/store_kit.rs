//! DESIGN §5: every store passes the public conformance kit, one test per rule and store.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::TestClock;

use tower_idempotency::store::{
    Batching, Claim, ClaimRequest, Fingerprint, LeaseExpiry, RecordStatus, ScopedKey, StoreError,
    StoredResponse, kit,
};
use tower_idempotency::{IdempotencyStore, MemoryStore};

macro_rules! conformance {
    ($backend:ident, $make:expr, $how:ident; $($check:ident),* $(,)?) => {
        mod $backend {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $check() {
                    let Some(store) = $make(stringify!($check)).await else { return };
                    conformance!(@$how kit::$check(&Arc::new(store)));
                }
            )*
        }
    };
    (@plain $check:expr) => { $check.await };
    // Claims through `claim_now`, for a store that answers it.
    (@at_once $check:expr) => { kit::claiming_at_once($check).await };
}

macro_rules! all_checks {
    ($backend:ident, $make:expr) => {
        all_checks!($backend, $make, plain);
    };
    ($backend:ident, $make:expr, $how:ident) => {
        conformance!($backend, $make, $how;
            claim_then_existing,
            claim_race_has_one_winner,
            fingerprint_mismatch_is_reported,
            complete_then_replay_exactly,
            release_lets_the_next_claim_take_over,
            another_request_never_takes_over_a_released_or_uncertain_key,
            mark_uncertain_blocks_claims,
            fenced_writes_are_refused_after_takeover,
            expired_lease_with_reconcile_needs_reconciliation,
            renew_keeps_the_lease_alive,
            ttl_expiry_counts_as_absent_and_is_purged,
            purging_races_claims_of_expired_keys_and_loses_none,
            lookup_and_remove,
            keys_round_trip_exactly,
            milestones_are_fenced_and_durable,
            effect_started_turns_an_expired_lease_into_reconciliation,
            uncertain_records_are_listed_and_resolved,
            resolution_fences_out_the_old_holder,
            a_resolution_keeps_its_own_note_and_its_record,
            a_new_attempt_starts_without_the_last_ones_downstream_id,
            an_unrecorded_answer_reads_as_an_effect_until_resolved,
            history_tells_what_happened,
            history_is_bounded,
            history_keeps_its_first_attempts_and_its_outcome,
            unsettled_records_never_expire,
            uncertain_records_page_in_order,
            reconciling_routes_never_expire_into_a_second_run,
            waiting_for_a_change_ends_when_the_record_moves_on,
            concurrent_operations_each_get_their_own_answer,
            completed_now_answers_only_what_a_claim_would,
        );
    };
}

async fn memory(_: &str) -> Option<MemoryStore> {
    Some(MemoryStore::new())
}

all_checks!(memory_store, memory);
// Every check again with its claims made at once (`claim_now`), as `kit::run_all` runs them.
all_checks!(memory_store_at_once, memory, at_once);

async fn sqlite(name: &str) -> Option<tower_idempotency::store::SqliteStore> {
    Some(common::sqlite(name).await.0)
}

all_checks!(sqlite_store, sqlite);

async fn sqlite_batched(name: &str) -> Option<tower_idempotency::store::SqliteStore> {
    let store = common::sqlite(&format!("batched-{name}")).await.0;
    Some(store.with_batching(Batching::default().in_flight(1)))
}

all_checks!(sqlite_batched_store, sqlite_batched);

async fn postgres(_: &str) -> Option<tower_idempotency::store::PostgresStore> {
    // One table for the kit: its checks use keys unique to each run.
    common::postgres("tower_idempotency_kit").await
}

all_checks!(postgres_store, postgres);

/// §5, issue 23 §4: the batched path passes every check; one batch in flight makes the
/// concurrent checks' operations queue and go together.
async fn postgres_batched(_: &str) -> Option<tower_idempotency::store::PostgresStore> {
    let store = common::postgres("tower_idempotency_kit").await?;
    Some(store.with_batching(Batching::default().in_flight(1)))
}

all_checks!(postgres_batched_store, postgres_batched);

async fn redis(name: &str) -> Option<tower_idempotency::store::RedisStore> {
    common::redis(name).await
}

all_checks!(redis_store, redis);

async fn redis_cluster(name: &str) -> Option<tower_idempotency::store::RedisStore> {
    common::redis_cluster(name).await
}

all_checks!(redis_cluster_store, redis_cluster);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_all_on_one_shared_store() {
    kit::run_all(Arc::new(MemoryStore::new())).await;
}

/// A claim of `key` by the request with fingerprint `[fingerprint; 32]`, times in seconds.
fn claim(key: &ScopedKey, fingerprint: u8, lease: u64, ttl: u64) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        fingerprint: Fingerprint::from_bytes([fingerprint; 32]),
        lease: Duration::from_secs(lease),
        ttl: Duration::from_secs(ttl),
        on_lease_expiry: LeaseExpiry::Reclaim,
    }
}

fn response(body: &'static [u8]) -> StoredResponse {
    StoredResponse {
        status: http::StatusCode::OK,
        headers: http::HeaderMap::new(),
        body: Some(bytes::Bytes::from_static(body)),
        trailers: None,
    }
}

#[tokio::test]
async fn memory_store_is_bounded_and_never_evicts_in_flight_keys() {
    let store = MemoryStore::new().max_records(3);
    let claim = |key: &str| claim(&ScopedKey::new("", key), 0, 60, 60);
    for key in ["a", "b", "c"] {
        assert!(matches!(
            store.claim(&claim(key)).await,
            Ok(Claim::Acquired(_))
        ));
    }
    assert!(
        matches!(store.claim(&claim("d")).await, Err(StoreError::Full)),
        "the bound holds"
    );
    assert_eq!(
        store.purge_expired().await.expect("purge"),
        0,
        "in-flight records stay"
    );
    assert_eq!(store.len(), 3);
    assert!(
        store
            .remove(&ScopedKey::new("", "a"))
            .await
            .expect("remove")
    );
    assert!(matches!(
        store.claim(&claim("d")).await,
        Ok(Claim::Acquired(_))
    ));
}

/// DESIGN §5 (memory store): claims alone sweep what expired, so memory stays bounded without
/// `purge_expired`: records claimed with a short TTL after the shards last swept...
#[tokio::test]
async fn memory_store_sweeps_short_lived_claims_as_claims_arrive() {
    sweeps_as_claims_arrive(false).await;
}

/// ...and a record whose expiry a later write brought forward (completed with a TTL shorter
/// than its lease).
#[tokio::test]
async fn memory_store_sweeps_records_whose_expiry_came_forward() {
    sweeps_as_claims_arrive(true).await;
}

async fn sweeps_as_claims_arrive(shorten_by_completion: bool) {
    let clock = TestClock::default();
    let store = clock.store();
    let claim = |key: String, ttl: u64| claim(&ScopedKey::new("", key), 0, ttl, ttl);
    // Claims sweep every shard once, so each knows its next expiry is an hour away.
    let Ok(Claim::Acquired(lease)) = store.claim(&claim("shortened".into(), 3600)).await else {
        panic!("claim");
    };
    let fresh = 100_000;
    for i in 0..fresh {
        let key = format!("early-{i}");
        store.claim(&claim(key, 3600)).await.expect("claim");
    }
    let expiring = if shorten_by_completion {
        let key = ScopedKey::new("", "shortened");
        let ttl = Duration::from_secs(1);
        store
            .complete(&key, lease.token, &response(b"done"), ttl)
            .await
            .expect("complete");
        1
    } else {
        for i in 0..100 {
            let key = format!("short-{i}");
            store.claim(&claim(key, 1)).await.expect("claim");
        }
        100
    };
    assert_eq!(
        store.len(),
        1 + fresh + expiring - usize::from(shorten_by_completion)
    );
    clock.advance(Duration::from_secs(5));
    // Enough claims that every shard passes another sweep interval.
    for i in 0..fresh {
        let key = format!("late-{i}");
        store.claim(&claim(key, 3600)).await.expect("claim");
    }
    let kept = 2 * fresh + usize::from(!shorten_by_completion);
    assert_eq!(store.len(), kept, "every expired record was swept");
    assert_eq!(store.purge_expired().await.expect("purge"), 0);
}

/// DESIGN §5 (memory store): a key whose record expired is claimed anew in the same place, so
/// the store holds one record per key: the new one, which is what lookups and writes find.
#[tokio::test]
async fn memory_store_reclaims_an_expired_key_in_place() {
    let clock = TestClock::default();
    let store = clock.store();
    let key = ScopedKey::new("tenant", "expires");
    let response = response(b"first");
    let Ok(Claim::Acquired(first)) = store.claim(&claim(&key, 1, 1, 10)).await else {
        panic!("first claim");
    };
    store
        .complete(&key, first.token, &response, Duration::from_secs(10))
        .await
        .expect("complete");

    clock.advance(Duration::from_secs(60));
    // A different request under the same key: the expired record does not answer it.
    let Ok(Claim::Acquired(second)) = store.claim(&claim(&key, 2, 1, 3600)).await else {
        panic!("an expired record counts as absent");
    };
    assert_eq!(second.attempt, 1);
    assert_eq!(store.len(), 1, "one record per key");
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(record.fingerprint, Fingerprint::from_bytes([2; 32]));
    assert_eq!(record.status, RecordStatus::InProgress);
    assert_eq!(record.history.len(), 1, "the old history went with it");
    assert!(
        store
            .complete(&key, first.token, &response, Duration::from_secs(10))
            .await
            .is_err(),
        "the expired holder is fenced out"
    );
    store
        .complete(&key, second.token, &response, Duration::from_secs(3600))
        .await
        .expect("complete");
    assert_eq!(store.purge_expired().await.expect("purge"), 0);
    assert!(store.remove(&key).await.expect("remove"));
    assert!(store.lookup(&key).await.expect("lookup").is_none());
    assert!(store.is_empty());
}
