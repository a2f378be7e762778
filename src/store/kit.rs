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

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};

use super::{
    Claim, ClaimRequest, Fingerprint, HistoryEvent, IdempotencyStore, Lease, LeaseExpiry,
    Milestone, Record, RecordStatus, Resolution, ScopedKey, StoreError, StoredResponse,
    UncertainCursor, UncertainQuery,
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

/// A fresh key is acquired (attempt 1); claiming it again returns the in-progress record with
/// its live lease.
pub async fn claim_then_existing<S: IdempotencyStore>(store: &S) {
    let key = unique_key("fresh");
    let req = request(&key, 1, LONG, LONG);
    let lease = acquire(store, &req, "a fresh key").await;
    assert_eq!(lease.attempt, 1, "the first attempt is number 1");
    let (record, now) = existing(store, &req, "a claimed key").await;
    assert_eq!(record.status, RecordStatus::InProgress);
    assert_eq!(record.lease_token, lease.token);
    assert_eq!(record.fingerprint, fingerprint(1));
    assert!(
        record.lease_until > now,
        "the lease is live on the store's clock"
    );
}

/// Many concurrent claims of one key: exactly one wins.
pub async fn claim_race_has_one_winner<S: IdempotencyStore>(store: &Arc<S>) {
    let key = unique_key("race");
    let tasks: Vec<_> = (0..32)
        .map(|turn| {
            let store = store.clone();
            let req = request(&key, 1, LONG, LONG);
            spawn_in_pass(turn, async move { claim(&*store, &req).await })
        })
        .collect();
    let mut winners = 0;
    for task in tasks {
        match task.await.expect("claim task") {
            Ok(Claim::Acquired(_)) => winners += 1,
            Ok(Claim::Existing { .. } | Claim::Completed { .. }) => {}
            Err(e) => panic!("a racing claim failed: {e}"),
        }
    }
    assert_eq!(winners, 1, "exactly one concurrent claim may win");
}

/// A claim with another fingerprint returns the record with the first fingerprint, in progress
/// and completed alike, and takes nothing over.
pub async fn fingerprint_mismatch_is_reported<S: IdempotencyStore>(store: &S) {
    let key = unique_key("mismatch");
    let lease = acquire(store, &request(&key, 1, LONG, LONG), "a fresh key").await;
    let other = request(&key, 2, LONG, LONG);
    let (record, _) = existing(store, &other, "another fingerprint while in progress").await;
    assert_eq!(record.fingerprint, fingerprint(1));
    store
        .complete(&key, lease.token, &response(), LONG)
        .await
        .expect("complete");
    let (first, _) = completed(store, &other, "another fingerprint once completed").await;
    assert_eq!(first, fingerprint(1));
}

/// A completed record returns its response exactly: status, repeated and binary headers, every
/// byte of the body, trailers.
pub async fn complete_then_replay_exactly<S: IdempotencyStore>(store: &S) {
    let key = unique_key("complete");
    let req = request(&key, 1, LONG, LONG);
    let lease = acquire(store, &req, "a fresh key").await;
    store
        .complete(&key, lease.token, &response(), LONG)
        .await
        .expect("complete");
    let (_, replayed) = completed(store, &req, "a completed key").await;
    assert_eq!(replayed, response(), "the response round-trips exactly");
    let looked_up = store.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(looked_up.response, Some(response()));
    // A marker for a response too large to keep also round-trips.
    let key = unique_key("marker");
    let req = request(&key, 1, LONG, LONG);
    let lease = acquire(store, &req, "a fresh key").await;
    let marker = StoredResponse {
        body: None,
        trailers: None,
        ..response()
    };
    store
        .complete(&key, lease.token, &marker, LONG)
        .await
        .expect("complete");
    let (_, replayed) = completed(store, &req, "a completed key").await;
    assert_eq!(replayed, marker);
}

/// [`IdempotencyStore::completed_now`], where the store answers it, answers a completed,
/// unexpired record exactly as a claim does (the fingerprint with its hint, the response) and
/// nothing else: no record, one in flight, released or awaiting reconciliation, or expired.
/// [`IdempotencyStore::recorded_fingerprint_now`] answers the same records with the same
/// fingerprint (and may answer an expired one). Neither claims: a claim after them still finds
/// the record as it was.
pub async fn completed_now_answers_only_what_a_claim_would<S: IdempotencyStore>(store: &S) {
    let rule = "completed_now";
    let read = |key: &ScopedKey, expired: bool| {
        let fingerprint = store.recorded_fingerprint_now(key);
        let read = match store.completed_now(key) {
            None => None,
            Some(Ok(Claim::Completed {
                fingerprint,
                response,
            })) => Some((fingerprint, *response)),
            Some(other) => {
                panic!("{rule}: a completed record is answered as Completed, got {other:?}")
            }
        };
        if read.is_some() || !expired {
            assert_eq!(
                fingerprint.map(|f| (f, f.body_as_sent())),
                read.as_ref().map(|(f, _)| (*f, f.body_as_sent())),
                "recorded_fingerprint_now: the record completed_now reads, its fingerprint and \
                 hint"
            );
        }
        read
    };
    let key = unique_key("completed-now");
    assert!(read(&key, false).is_none(), "{rule}: no record, no answer");
    let mut req = request(&key, 1, LONG, LONG);
    req.fingerprint = req.fingerprint.with_body_as_sent(true);
    let lease = acquire(store, &req, "a fresh key").await;
    assert!(
        read(&key, false).is_none(),
        "{rule}: a record in flight is claimed, not read"
    );
    store
        .complete(&key, lease.token, &response(), LONG)
        .await
        .expect("complete");
    let answered = match read(&key, false) {
        // A store that cannot answer without I/O never does.
        None => {
            assert!(read(&unique_key("absent"), false).is_none());
            return;
        }
        Some(answered) => answered,
    };
    let (fingerprint, replayed) = completed(store, &req, "a completed key").await;
    assert_eq!(answered.0, fingerprint, "{rule}: the claim's fingerprint");
    assert!(
        answered.0.body_as_sent(),
        "{rule}: the fingerprint's hint is kept with the record"
    );
    assert_eq!(answered.1, replayed, "{rule}: the claim's response");
    assert_eq!(replayed, response());
    // Without the hint, none comes back.
    let plain = unique_key("completed-now-plain");
    let plain_req = request(&plain, 2, LONG, LONG);
    let lease = acquire(store, &plain_req, "a fresh key").await;
    store
        .complete(&plain, lease.token, &response(), LONG)
        .await
        .expect("complete");
    let (fingerprint, _) = read(&plain, false).expect("a completed record is answered");
    assert_eq!(fingerprint, plain_req.fingerprint);
    assert!(!fingerprint.body_as_sent(), "{rule}: no hint, none kept");
    // Released, uncertain: claimed as usual.
    let released = unique_key("completed-now-released");
    let lease = acquire(store, &request(&released, 1, LONG, LONG), "a fresh key").await;
    store
        .release(&released, lease.token)
        .await
        .expect("release");
    assert!(
        read(&released, false).is_none(),
        "{rule}: a released record is claimed"
    );
    let unsure = unique_key("completed-now-uncertain");
    let lease = acquire(store, &request(&unsure, 1, LONG, LONG), "a fresh key").await;
    store
        .mark_uncertain(&unsure, lease.token)
        .await
        .expect("mark_uncertain");
    assert!(
        read(&unsure, false).is_none(),
        "{rule}: an uncertain record is claimed"
    );
    // Expired: absent, and the next claim runs.
    let expiring = unique_key("completed-now-expired");
    let expiring_req = request(&expiring, 1, SHORT, LONG);
    let lease = acquire(store, &expiring_req, "a fresh key").await;
    store
        .complete(&expiring, lease.token, &response(), SHORT)
        .await
        .expect("complete");
    assert!(
        read(&expiring, false).is_some(),
        "{rule}: completed, not yet expired"
    );
    tokio::time::sleep(PAST_SHORT).await;
    assert!(
        read(&expiring, true).is_none(),
        "{rule}: an expired record is absent"
    );
    let again = acquire(store, &expiring_req, "an expired record").await;
    assert_eq!(again.attempt, 1);
}

/// After a release the next claim takes the key over with a new token and `attempts + 1`.
pub async fn release_lets_the_next_claim_take_over<S: IdempotencyStore>(store: &S) {
    let key = unique_key("release");
    let req = request(&key, 1, LONG, LONG);
    let first = acquire(store, &req, "a fresh key").await;
    let status = store.release(&key, first.token).await.expect("release");
    assert_eq!(status, RecordStatus::Released);
    let second = acquire(store, &req, "a released key").await;
    assert_eq!(second.attempt, 2, "a takeover counts the attempt");
    assert_ne!(second.token, first.token, "a takeover gets a new token");
    assert_fenced(store.release(&key, first.token).await, "release");
}

/// A released key, or one whose outcome is unknown, is answered as it stands to a request
/// with another fingerprint (rule 2: the caller refuses it, 422), never taken over by it; only
/// the same request takes a released key over.
pub async fn another_request_never_takes_over_a_released_or_uncertain_key<S: IdempotencyStore>(
    store: &S,
) {
    let rule = "a record with another fingerprint is answered, not taken over";
    let released = unique_key("released-other");
    let lease = acquire(store, &request(&released, 1, LONG, LONG), "a fresh key").await;
    store
        .release(&released, lease.token)
        .await
        .expect("release");
    let (record, _) = existing(store, &request(&released, 2, LONG, LONG), rule).await;
    assert_eq!(record.fingerprint, fingerprint(1), "{rule}: released");
    assert_eq!(record.status, RecordStatus::Released, "{rule}: released");

    let uncertain = unique_key("uncertain-other");
    let lease = acquire(store, &request(&uncertain, 1, LONG, LONG), "a fresh key").await;
    store
        .mark_uncertain(&uncertain, lease.token)
        .await
        .expect("mark_uncertain");
    let (record, _) = existing(store, &request(&uncertain, 2, LONG, LONG), rule).await;
    assert_eq!(record.fingerprint, fingerprint(1), "{rule}: uncertain");
    assert_eq!(
        record.status,
        RecordStatus::NeedsReconciliation,
        "{rule}: uncertain"
    );

    let again = acquire(
        store,
        &request(&released, 1, LONG, LONG),
        "the same request takes a released key over",
    )
    .await;
    assert_eq!(again.attempt, 2, "a takeover counts the attempt");
}

/// After `mark_uncertain` claims return the record as `needs_reconciliation`; the holder that
/// marked it may still settle it with its outcome (a record it could not write at first), but
/// can no longer release it or renew its lease.
pub async fn mark_uncertain_blocks_claims<S: IdempotencyStore>(store: &S) {
    let key = unique_key("uncertain");
    let req = request(&key, 1, LONG, LONG);
    let lease = acquire(store, &req, "a fresh key").await;
    store
        .mark_uncertain(&key, lease.token)
        .await
        .expect("mark_uncertain");
    let (record, _) = existing(store, &req, "an uncertain key").await;
    assert_eq!(record.status, RecordStatus::NeedsReconciliation);
    assert_fenced(
        store.release(&key, lease.token).await.map(drop),
        "release after mark_uncertain",
    );
    assert_fenced(
        store.renew(&key, lease.token, LONG).await.map(drop),
        "renew after mark_uncertain",
    );
    store
        .complete(&key, lease.token, &response(), LONG)
        .await
        .expect("the holder settles its uncertain record with its outcome");
    let (_, replayed) = completed(store, &req, "a settled key").await;
    assert_eq!(replayed, response());
}

/// Issue 15 §5: a resolution is final. Resolving an uncertain record gives it a new token, so
/// a late `complete` from the holder it overrules (whose lease expired) is refused and the
/// resolved outcome stands, applied or not.
pub async fn resolution_fences_out_the_old_holder<S: IdempotencyStore>(store: &S) {
    for applied in [true, false] {
        let key = unique_key(if applied {
            "resolved-applied"
        } else {
            "resolved-not"
        });
        let req = ClaimRequest {
            on_lease_expiry: LeaseExpiry::Reconcile,
            ..request(&key, 1, SHORT, LONG)
        };
        let holder = acquire(store, &req, "a fresh key").await;
        tokio::time::sleep(PAST_SHORT).await;
        let (record, _) = existing(store, &req, "a dead holder's key").await;
        assert_eq!(record.status, RecordStatus::NeedsReconciliation);
        let resolution = if applied {
            Resolution::Applied(Box::new(response()))
        } else {
            Resolution::NotApplied
        };
        store
            .resolve(&key, record.lease_token, &resolution, LONG, None)
            .await
            .expect("resolve");
        let mut late = response();
        late.body = Some(bytes::Bytes::from_static(b"the late holder's answer"));
        assert_fenced(
            store.complete(&key, holder.token, &late, LONG).await,
            "a late complete after the key was resolved",
        );
        let record = store
            .lookup(&key)
            .await
            .expect("lookup")
            .expect("the record");
        if applied {
            assert_eq!(record.status, RecordStatus::Completed);
            assert_eq!(record.response, Some(response()), "the resolution stands");
        } else {
            assert_eq!(record.status, RecordStatus::Released);
            assert_ne!(record.lease_token, holder.token, "a new token fences it");
        }
    }
}

/// When a lease runs out the next claim takes over, and the old holder can no longer renew,
/// complete, release or mark uncertain.
pub async fn fenced_writes_are_refused_after_takeover<S: IdempotencyStore>(store: &S) {
    let key = unique_key("fenced");
    let short = request(&key, 1, SHORT, LONG);
    let stale = acquire(store, &short, "a fresh key").await;
    tokio::time::sleep(PAST_SHORT).await;
    let current = acquire(store, &request(&key, 1, LONG, LONG), "an expired lease").await;
    assert_eq!(current.attempt, 2);
    assert_ne!(current.token, stale.token);
    assert_fenced(store.renew(&key, stale.token, LONG).await, "renew");
    assert_fenced(
        store.complete(&key, stale.token, &response(), LONG).await,
        "complete",
    );
    assert_fenced(store.release(&key, stale.token).await, "release");
    assert_fenced(
        store.mark_uncertain(&key, stale.token).await,
        "mark_uncertain",
    );
    store
        .complete(&key, current.token, &response(), LONG)
        .await
        .expect("the current holder completes");
}

/// With [`LeaseExpiry::Reconcile`] an expired lease moves the record to
/// `needs_reconciliation` instead of being taken over: whichever route asks for it, the
/// holder's or the claimer's (two instances configured differently, as in a rolling deploy,
/// never rerun what either sends to reconciliation).
pub async fn expired_lease_with_reconcile_needs_reconciliation<S: IdempotencyStore>(store: &S) {
    let routes = [
        (LeaseExpiry::Reconcile, LeaseExpiry::Reconcile),
        (LeaseExpiry::Reconcile, LeaseExpiry::Reclaim),
        (LeaseExpiry::Reclaim, LeaseExpiry::Reconcile),
    ];
    for (holder, claimer) in routes {
        let key = unique_key("reconcile");
        let req = |on_lease_expiry| ClaimRequest {
            on_lease_expiry,
            ..request(&key, 1, SHORT, LONG)
        };
        let lease = acquire(store, &req(holder), "a fresh key").await;
        tokio::time::sleep(PAST_SHORT).await;
        let (record, _) = existing(
            store,
            &req(claimer),
            &format!("an expired lease held on {holder:?}, claimed on {claimer:?}"),
        )
        .await;
        assert_eq!(
            (record.status, record.attempts),
            (RecordStatus::NeedsReconciliation, 1),
            "held on {holder:?}, claimed on {claimer:?}: nothing was taken over"
        );
        assert_fenced(
            store.release(&key, lease.token).await.map(drop),
            "release after the move to reconciliation",
        );
        // The slow holder that really ran settles the uncertainty with its outcome.
        store
            .complete(&key, lease.token, &response(), LONG)
            .await
            .expect("the holder completes its record awaiting reconciliation");
        completed(store, &req(claimer), "a settled key").await;
    }
}

/// A renewed lease is not taken over when its first length passes, and a renewal never
/// shortens it: renewals may overlap, and one sent earlier may land later.
pub async fn renew_keeps_the_lease_alive<S: IdempotencyStore>(store: &S) {
    let key = unique_key("renew");
    let req = request(&key, 1, SHORT, LONG);
    let lease = acquire(store, &req, "a fresh key").await;
    let until = store.renew(&key, lease.token, LONG).await.expect("renew");
    assert!(until > lease.until, "renewal moves the lease's end");
    let again = store.renew(&key, lease.token, SHORT).await.expect("renew");
    assert!(again >= until, "a shorter renewal keeps the longer end");
    tokio::time::sleep(PAST_SHORT).await;
    let (record, _) = existing(store, &req, "a renewed lease").await;
    assert_eq!(record.status, RecordStatus::InProgress);
    assert_eq!(record.lease_token, lease.token);
}

/// A completed record past its TTL counts as absent (a new claim is attempt 1) and is purged.
pub async fn ttl_expiry_counts_as_absent_and_is_purged<S: IdempotencyStore>(store: &S) {
    let key = unique_key("ttl");
    let req = request(&key, 1, SHORT, LONG);
    let lease = acquire(store, &req, "a fresh key").await;
    store
        .complete(&key, lease.token, &response(), SHORT)
        .await
        .expect("complete");
    // A second completed record that only purging removes.
    let purged = unique_key("purged");
    let purged_lease = acquire(store, &request(&purged, 1, SHORT, LONG), "a fresh key").await;
    store
        .complete(&purged, purged_lease.token, &response(), SHORT)
        .await
        .expect("complete");
    // And one in flight under a long lease, which must survive the purge.
    let in_flight = unique_key("in-flight");
    acquire(store, &request(&in_flight, 1, LONG, SHORT), "a fresh key").await;
    tokio::time::sleep(PAST_SHORT).await;

    assert!(
        store.lookup(&key).await.expect("lookup").is_none(),
        "lookup hides expired records"
    );
    let again = acquire(store, &req, "an expired record").await;
    assert_eq!(again.attempt, 1, "an expired record counts as absent");
    // Purged, or gone by itself (a store whose records expire on the server, as Redis's do):
    // either way nothing of it is left for `remove` to delete.
    store.purge_expired().await.expect("purge");
    assert!(store.lookup(&purged).await.expect("lookup").is_none());
    assert!(
        !store.remove(&purged).await.expect("remove"),
        "expired records are purged"
    );
    let survivor = store.lookup(&in_flight).await.expect("lookup");
    assert!(
        survivor.is_some_and(|r| r.status == RecordStatus::InProgress),
        "a record under a live lease is never purged"
    );
}

/// Purges race claims of the very keys they would remove, completed records past their TTL:
/// every claim acquires its key afresh (attempt 1, whatever the expired record's fingerprint),
/// and what it acquired stands after the purges and any purge after them, so its holder
/// completes under it. A purge that deleted a key just claimed would leave its holder fenced
/// out and let a retry run the operation again. (A store whose records expire on the server,
/// as Redis's do, has nothing to purge: there the claims race nothing.) A claim answered
/// `Busy` (a row held by the purge past the store's wait) is asked again, as the layer does.
pub async fn purging_races_claims_of_expired_keys_and_loses_none<S: IdempotencyStore>(
    store: &Arc<S>,
) {
    const KEYS: usize = 16;
    const PURGES: usize = 2;
    for round in 0..2 {
        let keys: Vec<ScopedKey> = (0..KEYS).map(|_| unique_key("purge-race")).collect();
        for key in &keys {
            let lease = acquire(&**store, &request(key, 1, SHORT, LONG), "a fresh key").await;
            store
                .complete(key, lease.token, &response(), SHORT)
                .await
                .expect("complete");
        }
        tokio::time::sleep(PAST_SHORT).await;
        let barrier = Arc::new(tokio::sync::Barrier::new(KEYS + PURGES));
        let purges: Vec<_> = (0..PURGES)
            .map(|_| {
                let (store, barrier) = (store.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    store.purge_expired().await
                })
            })
            .collect();
        let claims: Vec<_> = keys
            .iter()
            .enumerate()
            .map(|(turn, key)| {
                let (store, barrier) = (store.clone(), barrier.clone());
                let req = request(key, 2, LONG, LONG);
                spawn_in_pass(turn, async move {
                    barrier.wait().await;
                    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                    loop {
                        match claim(&*store, &req).await {
                            Err(StoreError::Busy) if tokio::time::Instant::now() < deadline => {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                            }
                            answer => break answer,
                        }
                    }
                })
            })
            .collect();
        for purge in purges {
            purge.await.expect("purge task").expect("purge");
        }
        let mut leases = Vec::new();
        for task in claims {
            match task.await.expect("claim task") {
                Ok(Claim::Acquired(lease)) => {
                    assert_eq!(
                        lease.attempt, 1,
                        "round {round}: an expired record counts as absent, purged or not"
                    );
                    leases.push(lease);
                }
                other => panic!(
                    "round {round}: a claim of an expired key raced by a purge must acquire it, \
                     got {other:?}"
                ),
            }
        }
        store.purge_expired().await.expect("purge");
        for (key, lease) in keys.iter().zip(&leases) {
            let Some(record) = store.lookup(key).await.expect("lookup") else {
                panic!("round {round}: a key claimed while a purge ran was lost");
            };
            assert_eq!(
                (record.status, record.lease_token, record.fingerprint),
                (RecordStatus::InProgress, lease.token, fingerprint(2)),
                "round {round}: the claim made while a purge ran is the record that stands"
            );
            store
                .complete(key, lease.token, &response(), LONG)
                .await
                .expect("the claimer completes under the lease it was given");
        }
    }
}

/// `lookup` returns the record, `remove` deletes it and says whether it existed.
pub async fn lookup_and_remove<S: IdempotencyStore>(store: &S) {
    let key = unique_key("remove");
    assert!(store.lookup(&key).await.expect("lookup").is_none());
    acquire(store, &request(&key, 1, LONG, LONG), "a fresh key").await;
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(record.key, key);
    assert!(
        store.remove(&key).await.expect("remove"),
        "remove reports a deletion"
    );
    assert!(
        !store.remove(&key).await.expect("remove"),
        "nothing left to remove"
    );
    acquire(store, &request(&key, 1, LONG, LONG), "a removed key").await;
}

/// Scopes and keys with any characters (NUL, control, non-ASCII) are kept apart and read back
/// exactly.
pub async fn keys_round_trip_exactly<S: IdempotencyStore>(store: &S) {
    let base = unique_key("bytes");
    let odd = ScopedKey::new(
        format!("{}\0\u{1}\u{1f600}", base.scope()),
        format!("{}\0\r\n\u{7f}\u{e9}", base.key()),
    );
    let plain = ScopedKey::new(base.scope(), base.key());
    let lease = acquire(store, &request(&odd, 1, LONG, LONG), "an unusual key").await;
    acquire(
        store,
        &request(&plain, 2, LONG, LONG),
        "a key that differs only in its tail",
    )
    .await;
    store
        .complete(&odd, lease.token, &response(), LONG)
        .await
        .expect("complete");
    let record = store.lookup(&odd).await.expect("lookup").expect("record");
    assert_eq!(record.key, odd, "scope and key round-trip exactly");
    assert_eq!(record.fingerprint, fingerprint(1));
    let other = store.lookup(&plain).await.expect("lookup").expect("record");
    assert_eq!(
        other.fingerprint,
        fingerprint(2),
        "the two keys are distinct records"
    );
}

/// Milestones land on the holder's record and are refused from a stale holder.
pub async fn milestones_are_fenced_and_durable<S: IdempotencyStore>(store: &S) {
    let key = unique_key("milestone");
    let lease = acquire(store, &request(&key, 1, LONG, LONG), "a fresh key").await;
    store
        .record_milestone(&key, lease.token, &Milestone::EffectStarted)
        .await
        .expect("effect started");
    store
        .record_milestone(
            &key,
            lease.token,
            &Milestone::DownstreamId("pay_123".into()),
        )
        .await
        .expect("downstream id");
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    assert!(record.effect_started, "the milestone is durable");
    // A failure after the effect started cannot give the key back: nobody knows what happened.
    let status = store.release(&key, lease.token).await.expect("release");
    assert_eq!(status, RecordStatus::NeedsReconciliation);
    assert_eq!(record.downstream_id.as_deref(), Some("pay_123"));
    let stale = super::FencingToken::new(lease.token.get() ^ 1);
    assert_fenced(
        store
            .record_milestone(&key, stale, &Milestone::EffectStarted)
            .await,
        "record_milestone",
    );

    // Unsettled records never expire: a shared table keeps none of them.
    store.remove(&key).await.expect("remove");
}

/// A new attempt starts without an earlier attempt's downstream id, whether it takes over a
/// lapsed lease or claims a released key: a reconciler reading the record of the new attempt
/// must never check the old attempt's operation downstream.
pub async fn a_new_attempt_starts_without_the_last_ones_downstream_id<S: IdempotencyStore>(
    store: &S,
) {
    let key = unique_key("downstream-id");
    let first = acquire(store, &request(&key, 1, SHORT, LONG), "a fresh key").await;
    store
        .record_milestone(&key, first.token, &Milestone::DownstreamId("ch_1".into()))
        .await
        .expect("downstream id");
    tokio::time::sleep(PAST_SHORT).await;
    let second = acquire(store, &request(&key, 1, LONG, LONG), "a lapsed lease").await;
    assert_eq!(second.attempt, 2);
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(record.downstream_id, None, "taken over: not the first's id");
    store
        .record_milestone(&key, second.token, &Milestone::DownstreamId("ch_2".into()))
        .await
        .expect("downstream id");
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(record.downstream_id.as_deref(), Some("ch_2"));
    store.release(&key, second.token).await.expect("release");
    let third = acquire(store, &request(&key, 1, LONG, LONG), "a released key").await;
    assert_eq!(third.attempt, 3);
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(
        record.downstream_id, None,
        "claimed again: not the second's id"
    );
    store.remove(&key).await.expect("remove");
}

/// A holder that recorded `EffectStarted` and died is never taken over, even on a
/// [`LeaseExpiry::Reclaim`] route: its record needs reconciliation.
pub async fn effect_started_turns_an_expired_lease_into_reconciliation<S: IdempotencyStore>(
    store: &S,
) {
    let key = unique_key("started");
    let req = request(&key, 1, SHORT, LONG);
    let lease = acquire(store, &req, "a fresh key").await;
    store
        .record_milestone(&key, lease.token, &Milestone::EffectStarted)
        .await
        .expect("effect started");
    tokio::time::sleep(PAST_SHORT).await;
    let (record, _) = existing(store, &req, "an expired lease after EffectStarted").await;
    assert_eq!(record.status, RecordStatus::NeedsReconciliation);
    assert_eq!(record.attempts, 1, "no second attempt was allowed");

    // Unsettled records never expire: a shared table keeps none of them.
    store.remove(&key).await.expect("remove");
}

/// `list_uncertain` finds records marked uncertain and the records of dead holders that only a
/// reconciliation can settle (a route that reconciles expired leases, or an effect started),
/// never those the next claim takes over; `resolve` settles them once, with the token it
/// read, and refuses live holders (issue 18 §2).
pub async fn uncertain_records_are_listed_and_resolved<S: IdempotencyStore>(store: &S) {
    let marked = unique_key("marked");
    let lease = acquire(store, &request(&marked, 1, LONG, LONG), "a fresh key").await;
    store
        .mark_uncertain(&marked, lease.token)
        .await
        .expect("mark_uncertain");
    let dead = unique_key("dead");
    let reconciling = ClaimRequest {
        on_lease_expiry: LeaseExpiry::Reconcile,
        ..request(&dead, 1, SHORT, LONG)
    };
    let dead_lease = acquire(store, &reconciling, "a fresh key").await;
    let taken_over = unique_key("taken-over");
    acquire(store, &request(&taken_over, 1, SHORT, LONG), "a fresh key").await;
    let live = unique_key("live");
    let live_lease = acquire(store, &request(&live, 1, LONG, LONG), "a fresh key").await;
    tokio::time::sleep(PAST_SHORT).await;

    let listed = all_uncertain(store, 10_000).await;
    let has = |k: &ScopedKey| listed.iter().any(|r| &r.key == k);
    assert!(has(&marked), "a record marked uncertain is listed");
    assert!(
        has(&dead),
        "a dead holder's record on a reconciling route is listed"
    );
    assert!(
        !has(&taken_over),
        "a dead holder's record the next claim takes over is not reconciliation work"
    );
    assert!(!has(&live), "a live holder's record is not");

    assert_fenced(
        store
            .resolve(&live, live_lease.token, &Resolution::NotApplied, LONG, None)
            .await,
        "resolve of a live holder's record",
    );
    store
        .resolve(
            &marked,
            lease.token,
            &Resolution::Applied(Box::new(response())),
            LONG,
            Some("checked with the provider: charge ch_1 exists"),
        )
        .await
        .expect("resolve applied");
    let (_, replayed) = completed(store, &request(&marked, 1, LONG, LONG), "a resolved key").await;
    assert_eq!(replayed, response());
    let record = store
        .lookup(&marked)
        .await
        .expect("lookup")
        .expect("record");
    assert_eq!(record.status, RecordStatus::Completed);
    assert_eq!(
        record.resolution_note.as_deref(),
        Some("checked with the provider: charge ch_1 exists"),
        "the note is kept with the resolution"
    );
    assert_fenced(
        store
            .resolve(&marked, lease.token, &Resolution::NotApplied, LONG, None)
            .await,
        "a second resolve",
    );

    store
        .resolve(&dead, dead_lease.token, &Resolution::NotApplied, LONG, None)
        .await
        .expect("resolve not applied");
    let again = acquire(
        store,
        &request(&dead, 1, LONG, LONG),
        "a key resolved as not applied",
    )
    .await;
    assert_eq!(again.attempt, 2, "it runs again as the next attempt");

    // Unsettled records never expire: a shared table keeps none of them.
    store.remove(&taken_over).await.expect("remove");
    store.remove(&live).await.expect("remove");
}

/// Issue 18 §1, §3: a record marked uncertain (a handler answered, its outcome not recorded)
/// reads as an attempt whose effect took place, never as one that did nothing: a reconciler
/// or an operator who reads "no effect started" would let the key run again. Resolved as not
/// applied, the key's next attempt starts with no effect of its own: a clean failure of it
/// releases the key instead of sending it back to reconciliation.
pub async fn an_unrecorded_answer_reads_as_an_effect_until_resolved<S: IdempotencyStore>(
    store: &S,
) {
    let key = unique_key("unrecorded");
    let lease = acquire(store, &request(&key, 1, LONG, LONG), "a fresh key").await;
    store
        .mark_uncertain(&key, lease.token)
        .await
        .expect("mark_uncertain");
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(record.status, RecordStatus::NeedsReconciliation);
    assert!(
        record.effect_started,
        "an answer that could not be recorded had its effect"
    );
    let listed = all_uncertain(store, 10_000).await;
    let listed = listed.iter().find(|r| r.key == key).expect("listed");
    assert!(listed.effect_started, "and is listed so");
    store
        .resolve(&key, lease.token, &Resolution::NotApplied, LONG, None)
        .await
        .expect("resolve not applied");
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    assert!(
        !record.effect_started,
        "not applied: no effect is left marked"
    );
    let again = acquire(
        store,
        &request(&key, 1, LONG, LONG),
        "a key resolved as not applied",
    )
    .await;
    assert_eq!(
        store.release(&key, again.token).await.expect("release"),
        RecordStatus::Released,
        "the next attempt's clean failure gives the key back, not to reconciliation again"
    );
    store.remove(&key).await.expect("remove");
}

/// Issue 18 §3: a resolution's record says what that resolution said, and stays to say it. A
/// record that waited for its reconciliation past its TTL and is resolved as not applied is
/// kept `ttl` from the resolution, its note with it; a later resolution without a note (a
/// sweeper's) clears the earlier one's rather than wearing it; a record claimed afresh once
/// expired carries no note at all.
pub async fn a_resolution_keeps_its_own_note_and_its_record<S: IdempotencyStore>(store: &S) {
    let key = unique_key("resolved-late");
    let lease = acquire(store, &request(&key, 1, SHORT, SHORT), "a fresh key").await;
    store
        .mark_uncertain(&key, lease.token)
        .await
        .expect("mark_uncertain");
    // Past its TTL: an unsettled record stays, and is resolved now.
    tokio::time::sleep(PAST_SHORT).await;
    store
        .resolve(&key, lease.token, &Resolution::NotApplied, LONG, Some("N1"))
        .await
        .expect("resolve not applied");
    store.purge_expired().await.expect("purge");
    let record = store
        .lookup(&key)
        .await
        .expect("lookup")
        .expect("a record resolved as not applied is kept ttl from its resolution");
    assert_eq!(record.status, RecordStatus::Released);
    assert_eq!(record.resolution_note.as_deref(), Some("N1"));

    let again = acquire(store, &request(&key, 1, LONG, LONG), "a released key").await;
    assert_eq!(again.attempt, 2);
    store
        .mark_uncertain(&key, again.token)
        .await
        .expect("mark_uncertain");
    store
        .resolve(
            &key,
            again.token,
            &Resolution::Applied(Box::new(response())),
            SHORT,
            None,
        )
        .await
        .expect("resolve applied");
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(record.status, RecordStatus::Completed);
    assert_eq!(
        record.resolution_note, None,
        "a resolution without a note does not wear the one before it"
    );

    let noted = unique_key("resolved-noted");
    let lease = acquire(store, &request(&noted, 1, SHORT, SHORT), "a fresh key").await;
    store
        .mark_uncertain(&noted, lease.token)
        .await
        .expect("mark_uncertain");
    let resolution = Resolution::Applied(Box::new(response()));
    store
        .resolve(&noted, lease.token, &resolution, SHORT, Some("OLD"))
        .await
        .expect("resolve applied");
    tokio::time::sleep(PAST_SHORT).await;
    for key in [&key, &noted] {
        let fresh = acquire(store, &request(key, 2, LONG, LONG), "an expired key").await;
        assert_eq!(fresh.attempt, 1, "claimed afresh");
        let record = store.lookup(key).await.expect("lookup").expect("record");
        assert_eq!(
            record.resolution_note, None,
            "a record claimed afresh carries no earlier record's note"
        );
        store.remove(key).await.expect("remove");
    }
}

/// Issue 18 §4: uncertainty never expires into a second run. A record awaiting
/// reconciliation, or one whose holder died after its effect started, outlives its TTL: a
/// claim after it finds the record (attempt 1, its history), never a fresh key, and neither a
/// purge nor a lookup loses it. A settled record past its TTL is absent, as before.
pub async fn unsettled_records_never_expire<S: IdempotencyStore>(store: &S) {
    let marked = unique_key("unsettled-marked");
    let lease = acquire(store, &request(&marked, 1, SHORT, SHORT), "a fresh key").await;
    store
        .mark_uncertain(&marked, lease.token)
        .await
        .expect("mark_uncertain");
    let started = unique_key("unsettled-started");
    let lease = acquire(store, &request(&started, 1, SHORT, SHORT), "a fresh key").await;
    store
        .record_milestone(&started, lease.token, &Milestone::EffectStarted)
        .await
        .expect("milestone");
    let settled = unique_key("settled");
    let lease = acquire(store, &request(&settled, 1, SHORT, SHORT), "a fresh key").await;
    store
        .complete(&settled, lease.token, &response(), SHORT)
        .await
        .expect("complete");
    tokio::time::sleep(PAST_SHORT).await;
    store.purge_expired().await.expect("purge");
    for key in [&marked, &started] {
        let (record, _) = existing(store, &request(key, 1, SHORT, SHORT), "an unsettled key").await;
        assert_eq!(
            record.status,
            RecordStatus::NeedsReconciliation,
            "past its TTL, still awaiting reconciliation: {key:?}"
        );
        assert_eq!(record.attempts, 1, "never claimed as new");
        assert!(store.lookup(key).await.expect("lookup").is_some());
    }
    let listed = all_uncertain(store, 10_000).await;
    assert!(
        listed.iter().any(|r| r.key == marked),
        "still listed for reconciliation"
    );
    assert!(
        store.lookup(&settled).await.expect("lookup").is_none(),
        "a settled record expires"
    );

    // Unsettled records never expire: a shared table keeps none of them.
    store.remove(&marked).await.expect("remove");
    store.remove(&started).await.expect("remove");
}

/// Issue 18 §2, §5: the listing pages in order (oldest change, then the store's order of keys)
/// without skipping or repeating a record, however small the pages; `count_uncertain` counts
/// them all and knows the oldest.
pub async fn uncertain_records_page_in_order<S: IdempotencyStore>(store: &S) {
    let mut keys = Vec::new();
    for i in 0..7 {
        let key = unique_key(&format!("paged-{i}"));
        let lease = acquire(store, &request(&key, 1, LONG, LONG), "a fresh key").await;
        store
            .mark_uncertain(&key, lease.token)
            .await
            .expect("mark_uncertain");
        keys.push(key);
    }
    // Other checks may share the store and write meanwhile: what is asserted is about this
    // check's own records, and the order every listing keeps.
    let ours = |records: &[Record]| -> Vec<ScopedKey> {
        records
            .iter()
            .filter(|r| keys.contains(&r.key))
            .map(|r| r.key.clone())
            .collect()
    };
    let whole = all_uncertain(store, 10_000).await;
    assert_eq!(ours(&whole).len(), keys.len(), "every record listed once");
    for page in [1, 2, 3] {
        let paged = all_uncertain(store, page).await;
        assert_eq!(
            ours(&paged),
            ours(&whole),
            "pages of {page} list the same, in order"
        );
        // Ties in the store's order of keys (see `list_uncertain`): the same in every listing,
        // which comparing with `whole` above shows.
        assert!(
            paged.windows(2).all(|w| w[0].updated_at <= w[1].updated_at),
            "pages of {page}: oldest change first"
        );
        // None of this check's records twice; another check's record changed meanwhile
        // moves to its new place and may be listed again.
        let mine = ours(&paged);
        let distinct: std::collections::HashSet<&ScopedKey> = mine.iter().collect();
        assert_eq!(distinct.len(), mine.len(), "pages of {page}: none twice");
    }
    // Newest first is the same listing, reversed, in pages of any size.
    for page in [1, 3, 10_000] {
        let mut query = UncertainQuery::first(page).newest_first();
        let mut newest = Vec::new();
        loop {
            let listed = store.list_uncertain(&query).await.expect("list_uncertain");
            newest.extend(listed.records);
            match listed.next {
                Some(next) => query = UncertainQuery::after(next, page).newest_first(),
                None => break,
            }
        }
        let mut reversed = ours(&whole);
        reversed.reverse();
        assert_eq!(ours(&newest), reversed, "newest first, pages of {page}");
    }
    // A cursor past any time a store keeps (a caller's, made by hand) pages on: nothing after
    // it, everything before it, never an error.
    let far = SystemTime::UNIX_EPOCH + Duration::from_micros(u64::MAX);
    let last = UncertainCursor::new(far, ScopedKey::new("", "~"));
    let after = store
        .list_uncertain(&UncertainQuery::after(last.clone(), 10_000))
        .await
        .expect("a listing after a cursor past any time");
    assert!(
        after.records.iter().all(|r| !keys.contains(&r.key)),
        "nothing of ours after it"
    );
    let before = store
        .list_uncertain(&UncertainQuery::after(last, 10_000).newest_first())
        .await
        .expect("a listing before a cursor past any time");
    assert!(
        keys.iter()
            .all(|k| before.records.iter().any(|r| &r.key == k)),
        "all of ours before it"
    );
    let count = store.count_uncertain().await.expect("count_uncertain");
    assert!(count.count >= keys.len() as u64, "the count includes these");
    let first_of_ours = whole
        .iter()
        .filter(|r| keys.contains(&r.key))
        .map(|r| r.updated_at)
        .min();
    // A listed record carries its place in the listing, exactly (PostgreSQL keeps
    // microseconds where its records are read in milliseconds), as the count does.
    assert!(
        count.oldest.is_some() && count.oldest <= first_of_ours,
        "the oldest is no later than any of these"
    );
    // Settled records leave the listing.
    for key in &keys {
        let record = store
            .lookup(key)
            .await
            .expect("lookup")
            .expect("the record");
        // A record read by `lookup` stands where the listing places it: a cursor made from
        // it pages on just past it (PostgreSQL read its times in milliseconds once, and such
        // a cursor sat before the record, which was listed again).
        let listed = whole.iter().find(|r| &r.key == key).expect("listed");
        assert_eq!(
            record.updated_at, listed.updated_at,
            "lookup and listing agree"
        );
        let past = UncertainCursor::new(record.updated_at, key.clone());
        for query in [
            UncertainQuery::after(past.clone(), 10_000),
            UncertainQuery::after(past, 10_000).newest_first(),
        ] {
            let page = store.list_uncertain(&query).await.expect("list_uncertain");
            assert!(
                page.records.iter().all(|r| &r.key != key),
                "a cursor made from a looked-up record is past it either way"
            );
        }
        store
            .resolve(key, record.lease_token, &Resolution::NotApplied, LONG, None)
            .await
            .expect("resolve");
    }
    assert!(ours(&all_uncertain(store, 3).await).is_empty());
}

/// Issue 18 §4: on a route that reconciles expired leases, a dead holder's record never
/// expires into a second run, even without a milestone: past its TTL a claim finds it awaiting
/// reconciliation, attempt 1.
pub async fn reconciling_routes_never_expire_into_a_second_run<S: IdempotencyStore>(store: &S) {
    let key = unique_key("reconciling-no-milestone");
    let req = ClaimRequest {
        on_lease_expiry: LeaseExpiry::Reconcile,
        ..request(&key, 1, SHORT, SHORT)
    };
    acquire(store, &req, "a fresh key").await;
    tokio::time::sleep(PAST_SHORT).await;
    store.purge_expired().await.expect("purge");
    let (record, _) = existing(store, &req, "a dead holder's key on a reconciling route").await;
    assert_eq!(record.status, RecordStatus::NeedsReconciliation);
    assert_eq!(record.attempts, 1, "never claimed as new");
    assert!(
        all_uncertain(store, 10_000)
            .await
            .iter()
            .any(|r| r.key == key)
    );

    // Unsettled records never expire: a shared table keeps none of them.
    store.remove(&key).await.expect("remove");
}

/// Issue 15 §6: a key's history is bounded. Replays written by routes that record refusals
/// stop at [`HISTORY_REFUSALS`](super::HISTORY_REFUSALS) entries, and what came first (the
/// claim and its outcome) stays.
pub async fn history_is_bounded<S: IdempotencyStore>(store: &S) {
    let key = unique_key("bounded-history");
    let req = request(&key, 1, LONG, LONG);
    let lease = acquire(store, &req, "a fresh key").await;
    store
        .complete(&key, lease.token, &response(), LONG)
        .await
        .expect("complete");
    for _ in 0..super::HISTORY_REFUSALS + 40 {
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
        super::HISTORY_REFUSALS,
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
    for _ in 0..super::HISTORY_LIMIT {
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
    assert_eq!(record.history.len(), super::HISTORY_LIMIT);
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
    let seen = super::InFlight {
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
    let seen = super::InFlight {
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

/// Claims and completions of many keys at once, in every state a claim can find (fresh,
/// completed, in progress, released, another fingerprint, one key twice), each get the answer
/// they would get alone: a store that sends concurrent operations together (batches) must not
/// cross one key's answer with another's, nor let one key's state decide another's.
pub async fn concurrent_operations_each_get_their_own_answer<S: IdempotencyStore>(store: &Arc<S>) {
    let body = |key: &ScopedKey| {
        let mut r = response();
        r.body = Some(Bytes::from(format!("the answer for {}", key.key())));
        r
    };
    // The standing records, made one at a time.
    let done = unique_key("together-done");
    let lease = acquire(&**store, &request(&done, 1, LONG, LONG), "a fresh key").await;
    store
        .complete(&done, lease.token, &body(&done), LONG)
        .await
        .expect("complete");
    let busy = unique_key("together-busy");
    let busy_lease = acquire(&**store, &request(&busy, 1, LONG, LONG), "a fresh key").await;
    let released = unique_key("together-released");
    let lease = acquire(&**store, &request(&released, 1, LONG, LONG), "a fresh key").await;
    store
        .release(&released, lease.token)
        .await
        .expect("release");
    let twice = unique_key("together-twice");
    let fresh: Vec<ScopedKey> = (0..24).map(|_| unique_key("together-fresh")).collect();
    // And the states that time makes: a lease run out (taken over, or on a reconciling route
    // awaiting reconciliation), a record past its TTL (absent).
    let lapsed = unique_key("together-lapsed");
    acquire(&**store, &request(&lapsed, 1, SHORT, LONG), "a fresh key").await;
    let reconcile = |key: &ScopedKey| ClaimRequest {
        on_lease_expiry: LeaseExpiry::Reconcile,
        ..request(key, 1, SHORT, LONG)
    };
    let unknown = unique_key("together-unknown");
    acquire(&**store, &reconcile(&unknown), "a fresh key").await;
    let expired = unique_key("together-expired");
    let lease = acquire(&**store, &request(&expired, 1, SHORT, LONG), "a fresh key").await;
    store
        .complete(&expired, lease.token, &body(&expired), SHORT)
        .await
        .expect("complete");
    tokio::time::sleep(PAST_SHORT).await;

    // Then every claim at once.
    let mut claims: Vec<(ClaimRequest, &str)> = vec![
        (request(&done, 1, LONG, LONG), "done"),
        (request(&done, 2, LONG, LONG), "done, another fingerprint"),
        (request(&busy, 1, LONG, LONG), "busy"),
        (request(&released, 1, LONG, LONG), "released"),
        (request(&twice, 1, LONG, LONG), "twice"),
        (request(&twice, 1, LONG, LONG), "twice"),
        (request(&lapsed, 1, LONG, LONG), "lapsed"),
        (reconcile(&unknown), "unknown"),
        (request(&expired, 2, LONG, LONG), "expired"),
    ];
    claims.extend(fresh.iter().map(|k| (request(k, 3, LONG, LONG), "fresh")));
    let tasks: Vec<_> = claims
        .iter()
        .enumerate()
        .map(|(turn, (req, _))| {
            let (store, req) = (store.clone(), req.clone());
            spawn_in_pass(turn, async move { claim(&*store, &req).await })
        })
        .collect();
    let mut leases = Vec::new();
    let mut twice_won = 0;
    for ((req, what), task) in claims.iter().zip(tasks) {
        let claimed = task.await.expect("claim task");
        match (*what, claimed) {
            ("fresh", Ok(Claim::Acquired(lease))) => {
                assert_eq!(lease.attempt, 1, "a fresh key is attempt 1");
                leases.push((req.key.clone(), lease));
            }
            ("lapsed", Ok(Claim::Acquired(lease))) => {
                assert_eq!(
                    lease.attempt, 2,
                    "a lapsed lease is taken over as attempt 2"
                );
            }
            ("unknown", Ok(Claim::Existing { record, .. })) => {
                assert_eq!(record.key, unknown, "a claim gets its own key's record");
                assert_eq!(record.status, RecordStatus::NeedsReconciliation);
                assert_eq!(record.attempts, 1, "nothing was taken over");
            }
            ("expired", Ok(Claim::Acquired(lease))) => {
                assert_eq!(lease.attempt, 1, "a record past its TTL counts as absent");
            }
            ("released", Ok(Claim::Acquired(lease))) => {
                assert_eq!(
                    lease.attempt, 2,
                    "a released key is taken over as attempt 2"
                );
            }
            ("twice", Ok(Claim::Acquired(_))) => twice_won += 1,
            ("twice", Ok(Claim::Existing { record, .. })) => {
                assert_eq!(record.key, req.key, "the record of the key claimed");
                assert_eq!(record.status, RecordStatus::InProgress);
            }
            (
                "done" | "done, another fingerprint",
                Ok(Claim::Completed {
                    fingerprint: first,
                    response,
                }),
            ) => {
                assert_eq!(first, fingerprint(1), "the first fingerprint stands");
                assert_eq!(response.body, body(&done).body, "its own key's answer");
            }
            ("busy", Ok(Claim::Existing { record, .. })) => {
                assert_eq!(record.key, busy, "a claim gets its own key's record");
                assert_eq!(record.status, RecordStatus::InProgress);
                assert_eq!(
                    record.lease_token, busy_lease.token,
                    "the holder keeps its lease"
                );
            }
            (what, other) => panic!("a concurrent claim ({what}) answered {other:?}"),
        }
    }
    assert_eq!(twice_won, 1, "one of two concurrent claims of a key wins");
    assert_eq!(leases.len(), fresh.len(), "every fresh key is acquired");

    // Every completion at once, and one with a stale token among them.
    let mut tasks: Vec<_> = leases
        .iter()
        .map(|(key, lease)| {
            let (store, key, token, answer) = (store.clone(), key.clone(), lease.token, body(key));
            tokio::spawn(async move { store.complete(&key, token, &answer, LONG).await })
        })
        .collect();
    let stale = {
        let (store, busy) = (store.clone(), busy.clone());
        let token = super::FencingToken::new(busy_lease.token.get() ^ 1);
        tokio::spawn(async move { store.complete(&busy, token, &response(), LONG).await })
    };
    for task in tasks.drain(..) {
        task.await
            .expect("complete task")
            .expect("a holder's completion is written");
    }
    assert_fenced(
        stale.await.expect("complete task"),
        "a completion among others",
    );
    for (key, _) in &leases {
        let (_, replayed) = completed(&**store, &request(key, 3, LONG, LONG), "a replay").await;
        assert_eq!(
            replayed.body,
            body(key).body,
            "each key keeps its own answer"
        );
    }
    let (record, _) = existing(&**store, &request(&busy, 1, LONG, LONG), "still busy").await;
    assert_eq!(
        record.status,
        RecordStatus::InProgress,
        "a fenced completion changed nothing"
    );
}
