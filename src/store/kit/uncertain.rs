//! Records whose outcome is unknown: blocking claims, listed in pages, resolved and fenced.

use std::time::{Duration, SystemTime};

use super::{
    LONG, PAST_SHORT, SHORT, acquire, all_uncertain, assert_fenced, completed, existing, request,
    response, unique_key,
};
use crate::store::{
    ClaimRequest, IdempotencyStore, LeaseExpiry, Record, RecordStatus, Resolution, ScopedKey,
    UncertainCursor, UncertainQuery,
};

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
