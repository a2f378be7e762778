//! The conformance kit: every behaviour of [`IdempotencyStore`] as a check a store author runs
//! against their own store (feature `test-kit`).
//!
//! Each check panics with a message naming the rule it found broken. They use their own keys
//! (unique per run), so they can share one store, even a persistent one, and run in any order.
//! Some wait for short leases and TTLs to pass on the store's clock (about a second each).
//!
//! ```
//! # #[cfg(feature = "memory")]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use std::sync::Arc;
//! use tower_idempotency::{MemoryStore, store::kit};
//!
//! kit::run_all(Arc::new(MemoryStore::new())).await;
//! # }
//! # #[cfg(not(feature = "memory"))]
//! # fn main() {}
//! ```

mod claims;
mod expiry;
mod history;
mod leases;
mod uncertain;
mod waiting;

pub use claims::{
    another_request_never_takes_over_a_released_or_uncertain_key, claim_race_has_one_winner,
    claim_then_existing, complete_then_replay_exactly,
    completed_now_answers_only_what_a_claim_would, concurrent_operations_each_get_their_own_answer,
    fingerprint_mismatch_is_reported, keys_round_trip_exactly, lookup_and_remove,
    release_lets_the_next_claim_take_over,
};
pub use expiry::{
    purging_races_claims_of_expired_keys_and_loses_none, ttl_expiry_counts_as_absent_and_is_purged,
    unsettled_records_never_expire,
};
pub use history::{
    history_is_bounded, history_keeps_its_first_attempts_and_its_outcome,
    history_tells_what_happened,
};
pub use leases::{
    a_new_attempt_starts_without_the_last_ones_downstream_id,
    effect_started_turns_an_expired_lease_into_reconciliation,
    expired_lease_with_reconcile_needs_reconciliation, fenced_writes_are_refused_after_takeover,
    milestones_are_fenced_and_durable, reconciling_routes_never_expire_into_a_second_run,
    renew_keeps_the_lease_alive,
};
pub use uncertain::{
    a_resolution_keeps_its_own_note_and_its_record,
    an_unrecorded_answer_reads_as_an_effect_until_resolved, mark_uncertain_blocks_claims,
    resolution_fences_out_the_old_holder, uncertain_records_are_listed_and_resolved,
    uncertain_records_page_in_order,
};
pub use waiting::waiting_for_a_change_ends_when_the_record_moves_on;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};

use super::{
    Claim, ClaimRequest, Fingerprint, IdempotencyStore, Lease, LeaseExpiry, Record, ScopedKey,
    StoreError, StoredResponse, UncertainQuery,
};

const LONG: Duration = Duration::from_secs(60);
const SHORT: Duration = Duration::from_millis(400);
/// Past `SHORT` on any sane clock, with slack for a busy machine.
const PAST_SHORT: Duration = Duration::from_millis(900);

/// Runs every check in turn through [`IdempotencyStore::claim`] and, for a store that answers
/// [`IdempotencyStore::claim_now`], every check again with its claims made at once (in the race
/// checks, every other claim): both are held to every rule, and raced against each other. The
/// two passes run side by side on the one store (each check's keys are its own), so the kit
/// takes the time of one: most of it is waiting for short leases and TTLs to pass.
pub async fn run_all<S: IdempotencyStore>(store: Arc<S>) {
    let probe = request(&unique_key("probe"), 1, SHORT, SHORT);
    if store.claim_now(&probe).is_none() {
        return run_checks(&store).await;
    }
    let at_once = tokio::spawn({
        let store = store.clone();
        claiming_at_once(async move { run_checks(&store).await })
    });
    run_checks(&store).await;
    if let Err(e) = at_once.await {
        // The check's own panic, naming the rule it found broken.
        match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(e) => panic!("the pass that claims at once did not finish: {e}"),
        }
    }
}

/// Runs `check` (any of this module's checks) with its claims made through
/// [`IdempotencyStore::claim_now`] where the store answers it, and in the race checks every
/// other claim: a store that claims at once runs each check this way as well as plainly.
pub async fn claiming_at_once<F: std::future::Future>(check: F) -> F::Output {
    AT_ONCE.scope(true, check).await
}

async fn run_checks<S: IdempotencyStore>(store: &Arc<S>) {
    claim_then_existing(store).await;
    claim_race_has_one_winner(store).await;
    fingerprint_mismatch_is_reported(store).await;
    complete_then_replay_exactly(store).await;
    release_lets_the_next_claim_take_over(store).await;
    another_request_never_takes_over_a_released_or_uncertain_key(store).await;
    mark_uncertain_blocks_claims(store).await;
    fenced_writes_are_refused_after_takeover(store).await;
    expired_lease_with_reconcile_needs_reconciliation(store).await;
    renew_keeps_the_lease_alive(store).await;
    ttl_expiry_counts_as_absent_and_is_purged(store).await;
    purging_races_claims_of_expired_keys_and_loses_none(store).await;
    lookup_and_remove(store).await;
    keys_round_trip_exactly(store).await;
    milestones_are_fenced_and_durable(store).await;
    effect_started_turns_an_expired_lease_into_reconciliation(store).await;
    uncertain_records_are_listed_and_resolved(store).await;
    resolution_fences_out_the_old_holder(store).await;
    a_resolution_keeps_its_own_note_and_its_record(store).await;
    a_new_attempt_starts_without_the_last_ones_downstream_id(store).await;
    an_unrecorded_answer_reads_as_an_effect_until_resolved(store).await;
    history_tells_what_happened(store).await;
    history_is_bounded(store).await;
    history_keeps_its_first_attempts_and_its_outcome(store).await;
    unsettled_records_never_expire(store).await;
    uncertain_records_page_in_order(store).await;
    reconciling_routes_never_expire_into_a_second_run(store).await;
    waiting_for_a_change_ends_when_the_record_moves_on(store).await;
    concurrent_operations_each_get_their_own_answer(store).await;
    completed_now_answers_only_what_a_claim_would(store).await;
}

tokio::task_local! {
    /// Set for the kit's pass that claims through `claim_now`.
    static AT_ONCE: bool;
}

/// Whether this task's claims go through `claim_now` (see [`run_all`]).
fn at_once() -> bool {
    AT_ONCE.try_with(|at_once| *at_once).unwrap_or(false)
}

/// Spawns `check`'s task in this pass's mode; `turn` alternates the mode among tasks raced
/// against each other in the pass that claims at once.
fn spawn_in_pass<F>(turn: usize, check: F) -> tokio::task::JoinHandle<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    tokio::spawn(AT_ONCE.scope(at_once() && turn.is_multiple_of(2), check))
}

fn unique_key(name: &str) -> ScopedKey {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let n = N.fetch_add(1, Ordering::Relaxed);
    ScopedKey::new(format!("kit-scope-{nanos}"), format!("{name}-{n}"))
}

fn fingerprint(byte: u8) -> Fingerprint {
    Fingerprint::from_bytes([byte; 32])
}

fn request(key: &ScopedKey, fp: u8, lease: Duration, ttl: Duration) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        fingerprint: fingerprint(fp),
        lease,
        ttl,
        on_lease_expiry: LeaseExpiry::Reclaim,
    }
}

/// Every record the store lists as uncertain, page by page (pages of `page`).
async fn all_uncertain<S: IdempotencyStore>(store: &S, page: usize) -> Vec<Record> {
    let mut query = UncertainQuery::first(page);
    let mut all = Vec::new();
    loop {
        let listed = store.list_uncertain(&query).await.expect("list_uncertain");
        assert!(
            listed.records.len() + listed.unreadable.len() <= page,
            "a page holds at most its limit"
        );
        all.extend(listed.records);
        match listed.next {
            Some(next) => query = UncertainQuery::after(next, page),
            None => return all,
        }
    }
}

/// A claim through [`IdempotencyStore::claim_now`] in the pass that claims at once (where the
/// store answers it), else through [`IdempotencyStore::claim`].
async fn claim<S: IdempotencyStore>(store: &S, req: &ClaimRequest) -> Result<Claim, StoreError> {
    if at_once()
        && let Some(made) = store.claim_now(req)
    {
        return made;
    }
    store.claim(req).await
}

async fn acquire<S: IdempotencyStore>(store: &S, req: &ClaimRequest, rule: &str) -> Lease {
    match claim(store, req).await {
        Ok(Claim::Acquired(lease)) => lease,
        other => panic!("{rule}: expected Acquired, got {other:?}"),
    }
}

async fn existing<S: IdempotencyStore>(
    store: &S,
    req: &ClaimRequest,
    rule: &str,
) -> (super::Record, SystemTime) {
    match claim(store, req).await {
        Ok(Claim::Existing { record, now }) => (*record, now),
        other => panic!("{rule}: expected Existing, got {other:?}"),
    }
}

/// A claim of a completed key: what a replay reads, the first fingerprint and the response.
async fn completed<S: IdempotencyStore>(
    store: &S,
    req: &ClaimRequest,
    rule: &str,
) -> (super::Fingerprint, StoredResponse) {
    match claim(store, req).await {
        Ok(Claim::Completed {
            fingerprint,
            response,
        }) => (fingerprint, *response),
        other => panic!("{rule}: expected Completed, got {other:?}"),
    }
}

fn response() -> StoredResponse {
    let mut headers = HeaderMap::new();
    headers.insert("location", HeaderValue::from_static("/tickets/7"));
    headers.append("link", HeaderValue::from_static("</a>; rel=a"));
    headers.append("link", HeaderValue::from_static("</b>; rel=b"));
    headers.insert(
        "x-binary",
        HeaderValue::from_bytes(b"\x80\xff opaque").unwrap_or(HeaderValue::from_static("x")),
    );
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    StoredResponse {
        status: StatusCode::CREATED,
        headers,
        body: Some(Bytes::from((0..=255u8).collect::<Vec<u8>>())),
        trailers: Some(trailers),
    }
}

fn assert_fenced<T: std::fmt::Debug>(result: Result<T, StoreError>, what: &str) {
    assert!(
        matches!(result, Err(StoreError::Fenced)),
        "{what} with a stale token must be refused as Fenced, got {result:?}"
    );
}
