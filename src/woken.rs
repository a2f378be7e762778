//! Requests woken together by one record's change read it once: the first reads, the others
//! share its answer (a hundred waiters on PostgreSQL would otherwise queue a hundred reads on
//! the pool). A read is shared only while a request still waits on it, and only a settled
//! answer is acted on as final: a record still in flight sends each request on to claim.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::OnceCell;

use crate::store::{IdempotencyStore, Record, ScopedKey};

type Read = OnceCell<Option<Record>>;

/// The reads in progress, by key.
#[derive(Debug, Default)]
pub(crate) struct WokenReads {
    reads: Mutex<HashMap<ScopedKey, Weak<Read>>>,
}

impl WokenReads {
    /// The record of `key`, read once for every request that asks while the read is shared.
    pub(crate) async fn lookup<St: IdempotencyStore>(
        &self,
        store: &St,
        key: &ScopedKey,
    ) -> Option<Record> {
        let read = {
            let mut reads = self.lock();
            match reads.get(key).and_then(Weak::upgrade) {
                Some(read) => read,
                None => {
                    let read = Arc::new(Read::new());
                    reads.insert(key.clone(), Arc::downgrade(&read));
                    read
                }
            }
        };
        // Left also when the request is dropped while it reads (its client hung up).
        let leaving = Leaving {
            reads: self,
            key,
            read,
        };
        leaving
            .read
            .get_or_init(|| async { store.lookup(key).await.ok().flatten() })
            .await
            .clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ScopedKey, Weak<Read>>> {
        self.reads
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A request's hold on a shared read: the last to leave takes the read away, so a later
/// change is read afresh and no key stays in the map.
struct Leaving<'a> {
    reads: &'a WokenReads,
    key: &'a ScopedKey,
    read: Arc<Read>,
}

impl Drop for Leaving<'_> {
    fn drop(&mut self) {
        let mut reads = self.reads.lock();
        let ours = reads
            .get(self.key)
            .is_some_and(|kept| std::ptr::eq(kept.as_ptr(), Arc::as_ptr(&self.read)));
        if ours && Arc::strong_count(&self.read) == 1 {
            reads.remove(self.key);
        }
    }
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use super::*;
    use crate::store::{Claim, ClaimRequest, Fingerprint, LeaseExpiry};
    use std::time::Duration;

    #[tokio::test]
    async fn reads_are_shared_while_held_and_leave_nothing_behind() {
        let store = crate::MemoryStore::new();
        let key = ScopedKey::new("", "k");
        let request = ClaimRequest {
            key: key.clone(),
            fingerprint: Fingerprint::from_bytes([1; 32]),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
            on_lease_expiry: LeaseExpiry::Reclaim,
        };
        assert!(matches!(
            store.claim(&request).await,
            Ok(Claim::Acquired(_))
        ));
        let reads = WokenReads::default();
        let record = reads.lookup(&store, &key).await.expect("the record");
        assert_eq!(record.key, key);
        assert!(reads.lock().is_empty(), "nothing left once read");
        assert_eq!(
            reads
                .lookup(&store, &ScopedKey::new("", "none"))
                .await
                .map(|r| r.key),
            None
        );
        assert!(reads.lock().is_empty());
    }
}
