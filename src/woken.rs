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
        let record = read
            .get_or_init(|| async { store.lookup(key).await.ok().flatten() })
            .await
            .clone();
        // The last to leave takes the read away: a later change is read afresh.
        let mut reads = self.lock();
        if Arc::strong_count(&read) == 1
            && reads
                .get(key)
                .is_some_and(|kept| std::ptr::eq(kept.as_ptr(), Arc::as_ptr(&read)))
        {
            reads.remove(key);
        }
        record
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ScopedKey, Weak<Read>>> {
        self.reads
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
