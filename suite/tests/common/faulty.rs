//! A store wrapper that injects faults into any store, as a third-party store would be written
//! against the public trait: fail exactly the k-th operation, go down for a while, fail
//! renewals, pause a claim after it committed, fail the response write. It logs the
//! operations it counts, by name.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use tower_idempotency::IdempotencyStore;
use tower_idempotency::store::{
    Claim, ClaimRequest, FencingToken, HistoryEvent, InFlight, Milestone, Record, RecordStatus,
    Resolution, ScopedKey, StoreError, StoredResponse, UncertainCount, UncertainPage,
    UncertainQuery,
};

/// Cloning shares the faults: a test keeps one clone and hands another to the layer.
#[derive(Clone)]
pub struct Faulty<S> {
    pub inner: S,
    /// Every operation fails while set, reads included.
    pub down: Arc<AtomicBool>,
    /// Only `complete` fails while set (the response write of DESIGN §7.7).
    pub fail_complete: Arc<AtomicBool>,
    /// Keys whose next `complete` fails, once each.
    pub fail_complete_once: Arc<Mutex<HashSet<String>>>,
    /// The 1-based number of the counted operation that fails (0: none). Counted: the writes
    /// and claims the pipeline makes, not the reads and removals a test makes.
    pub fail_at: Arc<AtomicUsize>,
    ops: Arc<AtomicUsize>,
    log: Arc<Mutex<Vec<&'static str>>>,
    down_until: Arc<Mutex<Option<Instant>>>,
    /// Every `renew` fails while set (the holder's lease runs out as if it were dead).
    pub fail_renew: Arc<AtomicBool>,
    /// A claim that acquired pauses this long before answering, after it committed.
    pub pause_after_claim: Arc<Mutex<Option<Duration>>>,
    /// The first `complete` takes the store down for this long, itself included.
    pub down_on_complete: Arc<Mutex<Option<Duration>>>,
    /// Every `complete` waits this long before it writes.
    pub pause_before_complete: Arc<Mutex<Option<Duration>>>,
    /// Called at each step around the claim and the record (`before_claim`, `after_claim`,
    /// `before_record`, `after_record`): a crash test stops its process there.
    pub at_step: Option<Arc<dyn Fn(&'static str) + Send + Sync>>,
    /// Only `list_uncertain` fails while set.
    pub fail_list: Arc<AtomicBool>,
    /// Only `lookup` fails while set (a record that cannot be read, writes that land).
    pub fail_lookup: Arc<AtomicBool>,
    /// The next listing that resumes after a cursor finds its whole page settled meanwhile:
    /// it answers no records, and the page after as its next (once).
    pub settle_next_resumed_page: Arc<AtomicBool>,
    /// While set, `wait_for_change` is the inner store's (woken); else the trait's default
    /// (polling), as a store that does not implement it.
    pub wake: Arc<AtomicBool>,
}

impl<S: Default> Default for Faulty<S> {
    fn default() -> Self {
        Self::new(S::default())
    }
}

impl<S> Faulty<S> {
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            down: Arc::default(),
            fail_complete: Arc::default(),
            fail_complete_once: Arc::default(),
            fail_at: Arc::default(),
            ops: Arc::default(),
            log: Arc::default(),
            down_until: Arc::default(),
            fail_renew: Arc::default(),
            pause_after_claim: Arc::default(),
            down_on_complete: Arc::default(),
            pause_before_complete: Arc::default(),
            at_step: None,
            fail_list: Arc::default(),
            fail_lookup: Arc::default(),
            settle_next_resumed_page: Arc::default(),
            wake: Arc::default(),
        }
    }

    /// The store is down (every operation fails) for `d` from now.
    pub fn down_for(&self, d: Duration) {
        *self.down_until.lock().expect("lock") = Some(Instant::now() + d);
    }

    /// The names of the counted operations seen so far, in order.
    pub fn log(&self) -> Vec<&'static str> {
        self.log.lock().expect("lock").clone()
    }

    fn is_down(&self) -> bool {
        self.down.load(Ordering::SeqCst)
            || self
                .down_until
                .lock()
                .expect("lock")
                .is_some_and(|until| Instant::now() < until)
    }

    /// A read or removal: fails only while the store is down.
    fn read(&self, name: &'static str) -> Result<(), StoreError> {
        if self.is_down() {
            return Err(injected(name));
        }
        Ok(())
    }

    fn step(&self, name: &'static str) {
        if let Some(at_step) = &self.at_step {
            at_step(name);
        }
    }

    fn op(&self, name: &'static str) -> Result<(), StoreError> {
        let n = self.ops.fetch_add(1, Ordering::SeqCst) + 1;
        self.log.lock().expect("lock").push(name);
        if n == self.fail_at.load(Ordering::SeqCst) {
            return Err(injected(name));
        }
        self.read(name)
    }
}

fn injected(what: &str) -> StoreError {
    StoreError::unavailable(std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        format!("{what}: store unavailable (injected)"),
    ))
}

impl<S: IdempotencyStore> IdempotencyStore for Faulty<S> {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        self.step("before_claim");
        self.op("claim")?;
        let claim = self.inner.claim(request).await;
        self.step("after_claim");
        let claim = claim?;
        let pause = *self.pause_after_claim.lock().expect("lock");
        if let (Claim::Acquired(_), Some(pause)) = (&claim, pause) {
            tokio::time::sleep(pause).await;
        }
        Ok(claim)
    }

    async fn renew(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<SystemTime, StoreError> {
        self.op("renew")?;
        if self.fail_renew.load(Ordering::SeqCst) {
            return Err(injected("renew"));
        }
        self.inner.renew(key, token, lease).await
    }

    async fn complete(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        if let Some(d) = self.down_on_complete.lock().expect("lock").take() {
            self.down_for(d);
        }
        let pause = *self.pause_before_complete.lock().expect("lock");
        if let Some(pause) = pause {
            tokio::time::sleep(pause).await;
        }
        self.step("before_record");
        self.op("complete")?;
        let once = self
            .fail_complete_once
            .lock()
            .expect("lock")
            .remove(key.key());
        if once || self.fail_complete.load(Ordering::SeqCst) {
            return Err(StoreError::unavailable("response write failed (injected)"));
        }
        let done = self.inner.complete(key, token, response, ttl).await;
        self.step("after_record");
        done
    }

    async fn release(
        &self,
        key: &ScopedKey,
        token: FencingToken,
    ) -> Result<RecordStatus, StoreError> {
        self.op("release")?;
        self.inner.release(key, token).await
    }

    async fn mark_uncertain(&self, key: &ScopedKey, token: FencingToken) -> Result<(), StoreError> {
        self.op("mark_uncertain")?;
        self.inner.mark_uncertain(key, token).await
    }

    async fn lookup(&self, key: &ScopedKey) -> Result<Option<Record>, StoreError> {
        self.read("lookup")?;
        if self.fail_lookup.load(Ordering::SeqCst) {
            return Err(injected("lookup"));
        }
        self.inner.lookup(key).await
    }

    async fn remove(&self, key: &ScopedKey) -> Result<bool, StoreError> {
        self.read("remove")?;
        self.inner.remove(key).await
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        self.op("purge_expired")?;
        self.inner.purge_expired().await
    }

    async fn record_milestone(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        milestone: &Milestone,
    ) -> Result<(), StoreError> {
        self.op("record_milestone")?;
        self.inner.record_milestone(key, token, milestone).await
    }

    async fn list_uncertain(&self, query: &UncertainQuery) -> Result<UncertainPage, StoreError> {
        self.step("list_uncertain");
        if self.fail_list.load(Ordering::SeqCst) {
            return Err(injected("list_uncertain"));
        }
        self.read("list_uncertain")?;
        let mut page = self.inner.list_uncertain(query).await?;
        if query.after.is_some() && self.settle_next_resumed_page.swap(false, Ordering::SeqCst) {
            page.records.clear();
            page.unreadable.clear();
        }
        Ok(page)
    }

    async fn count_uncertain(&self) -> Result<UncertainCount, StoreError> {
        self.read("count_uncertain")?;
        self.inner.count_uncertain().await
    }

    async fn resolve(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        resolution: &Resolution,
        ttl: Duration,
        note: Option<&str>,
    ) -> Result<(), StoreError> {
        self.read("resolve")?;
        self.inner.resolve(key, token, resolution, ttl, note).await
    }

    async fn append_history(&self, key: &ScopedKey, event: HistoryEvent) -> Result<(), StoreError> {
        self.op("append_history")?;
        self.inner.append_history(key, event).await
    }

    async fn wait_for_change(
        &self,
        key: &ScopedKey,
        seen: &InFlight,
        round: u32,
        within: Duration,
    ) {
        if self.wake.load(Ordering::SeqCst) {
            self.inner.wait_for_change(key, seen, round, within).await;
        } else {
            tokio::time::sleep(Duration::from_millis(10u64 << round.min(5)).min(within)).await;
        }
    }
}
