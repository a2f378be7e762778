//! The claim: one shard lock, a record made, taken over or read.

use super::entry::{Entry, span, time};
use super::{MemoryStore, expired, log, watched};
use crate::store::{
    Claim, ClaimRequest, HistoryEvent, Lease, LeaseExpiry, RecordStatus, StoreError,
};

impl MemoryStore {
    /// One claim under one shard lock; [`StoreError::Full`] when a new record does not fit.
    pub(super) fn claim_locked(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let now = self.now();
        let (hash, mut shard) = self.shard(&req.key);
        self.purge_for_claim(&mut shard, now);
        let lease_until = now + span(req.lease);
        // Tokens only for claims that acquire: a replay takes none, so it writes nothing the
        // other threads read.
        if let Some(i) = shard.find(hash, &req.key)
            && let Some(r) = shard.get_mut(i)
        {
            let watched_before = watched(r);
            let claim = self.claim_existing(r, req, now, lease_until);
            let watched_after = watched(r);
            shard.reindex(i, self.inner.base);
            shard.rewatch(&req.key, watched_before, watched_after);
            return claim;
        }
        // The record's room is taken in one step with the check: claims of new keys in other
        // shards (other locks) check at the same time, and a check then an add let two of
        // them take the last room, one record past the bound.
        if !self.take_room() {
            return Err(StoreError::Full);
        }
        let token = self.token();
        let entry = Entry::claimed(req, hash, token, now, lease_until);
        self.weigh(0, entry.weight());
        shard.rewatch(&req.key, None, watched(&entry));
        let i = shard.insert(entry);
        shard.reindex(i, self.inner.base);
        Ok(Claim::Acquired(Lease {
            token,
            attempt: 1,
            until: time(lease_until),
        }))
    }

    /// What [`claim`](IdempotencyStore::claim) and
    /// [`claim_now`](IdempotencyStore::claim_now) answer.
    pub(super) fn claim_at_once(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        match self.claim_locked(req) {
            // Expired records anywhere make room, not only the claiming shard's: sweep them
            // all, one lock at a time (never two at once), then claim afresh. Full only when
            // live records fill the store.
            Err(StoreError::Full) => {
                let now = self.now();
                self.sweep_all(now);
                match self.claim_locked(req) {
                    // What expired within the tick under way makes room too. Swept only when
                    // the claim is refused again, never on a reading of the counts: other
                    // claims may take the room the first sweep made while a sweep of this tick
                    // is still under way in another thread, and the room it has yet to free
                    // is this claim's.
                    Err(StoreError::Full) => {
                        self.sweep_tick_under_way(now);
                        self.claim_locked(req)
                    }
                    other => other,
                }
            }
            other => other,
        }
    }

    /// A claim of a key the shard holds a record for (expired or not).
    pub(super) fn claim_existing(
        &self,
        r: &mut Entry,
        req: &ClaimRequest,
        now: u64,
        lease_until: u64,
    ) -> Result<Claim, StoreError> {
        let acquired = |token, attempt| {
            Ok(Claim::Acquired(Lease {
                token,
                attempt,
                until: time(lease_until),
            }))
        };
        if expired(r, now) {
            // Counts as absent: its slot takes the new claim (and stays where the shard's
            // indexes have it).
            let token = self.token();
            let before = r.weight();
            let (polled, queued) = (r.polled(), r.queued());
            *r = Entry::claimed(req, r.key_hash(), token, now, lease_until);
            r.set_polled(polled);
            r.set_queued(queued);
            self.weigh(before, r.weight());
            return acquired(token, 1);
        }
        let takeover = if !r.fingerprinted(&req.fingerprint) {
            false
        } else {
            match r.status {
                RecordStatus::Released => true,
                RecordStatus::InProgress if r.lease_until <= now => {
                    // Both the holder's route and this claim's must reclaim: an instance
                    // configured otherwise never reruns what the holder's route reconciles.
                    if req.on_lease_expiry == LeaseExpiry::Reclaim
                        && !r.reconcile_on_expiry()
                        && !r.effect_started()
                    {
                        true
                    } else {
                        let before = r.weight();
                        r.touch(now);
                        log(r, now, HistoryEvent::LeaseExpired);
                        r.status = RecordStatus::NeedsReconciliation;
                        self.weigh(before, r.weight());
                        self.inner.waiters.wake(&req.key);
                        false
                    }
                }
                _ => false,
            }
        };
        if !takeover {
            return r.to_claim(&req.key, now);
        }
        let token = self.token();
        let before = r.weight();
        r.set_token(token);
        r.touch(now);
        r.status = RecordStatus::InProgress;
        r.lease_until = lease_until;
        r.attempts += 1;
        // An earlier attempt's id names its effect, not this one's: read as this attempt's,
        // it would have a reconciler check the wrong operation downstream.
        r.clear_downstream_id();
        r.set_reconcile_on_expiry(req.on_lease_expiry);
        r.set_body_as_sent(&req.fingerprint);
        // Only ever later: a retry does not shorten what the record was promised.
        r.expires_at = r.expires_at.max(now + span(req.ttl)).max(lease_until);
        log(r, now, HistoryEvent::Claimed);
        self.weigh(before, r.weight());
        acquired(token, r.attempts)
    }
}
