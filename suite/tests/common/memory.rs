//! Helpers for the MemoryStore's review tests: heap counting (the binary installs
//! `stats_alloc`'s allocator), one test at a time, a clock the test moves, and claims.

use std::alloc::System;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use stats_alloc::Region;
use tower_idempotency::store::{
    Claim, ClaimRequest, FencingToken, Fingerprint, LeaseExpiry, Record, ScopedKey, StoreError,
    StoredResponse,
};
use tower_idempotency::{IdempotencyStore, MemoryStore};

/// What the heap holds now beyond what it held when `region` began.
pub fn live_heap(region: &Region<'_, System>) -> i64 {
    let stats = region.change();
    stats.bytes_allocated as i64 - stats.bytes_deallocated as i64
}

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// One test at a time: the allocation counts are global.
pub async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    SERIAL.lock().await
}

/// [`serial`], for a test that builds its own runtime.
pub fn serial_blocking() -> tokio::sync::MutexGuard<'static, ()> {
    SERIAL.blocking_lock()
}

pub const START_MS: u64 = 1_800_000_000_000;

/// A clock starting at a whole number of 16 ms ticks since the epoch, moved by the test (also
/// backwards, below where the store started).
#[derive(Clone)]
pub struct Clock {
    offset: Arc<AtomicI64>,
}

impl Clock {
    pub fn new() -> Self {
        Self {
            offset: Arc::new(AtomicI64::new(0)),
        }
    }

    /// An unbounded store on this clock.
    pub fn store(&self) -> MemoryStore {
        let offset = self.offset.clone();
        MemoryStore::with_clock(move || {
            let ms = START_MS as i64 + offset.load(Ordering::SeqCst);
            SystemTime::UNIX_EPOCH + Duration::from_millis(ms as u64)
        })
        .max_records(usize::MAX)
        .max_bytes(usize::MAX)
    }

    pub fn advance(&self, ms: i64) {
        self.offset.fetch_add(ms, Ordering::SeqCst);
    }

    pub fn now(&self) -> SystemTime {
        SystemTime::UNIX_EPOCH
            + Duration::from_millis((START_MS as i64 + self.offset.load(Ordering::SeqCst)) as u64)
    }

    /// Milliseconds since the store's start.
    pub fn elapsed(&self) -> u64 {
        self.offset.load(Ordering::SeqCst) as u64
    }
}

pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

pub fn req(key: &ScopedKey, lease: u64, ttl: u64) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        fingerprint: Fingerprint::from_bytes([7; 32]),
        lease: ms(lease),
        ttl: ms(ttl),
        on_lease_expiry: LeaseExpiry::Reclaim,
    }
}

pub fn reconcile_req(key: &ScopedKey, lease: u64, ttl: u64) -> ClaimRequest {
    ClaimRequest {
        on_lease_expiry: LeaseExpiry::Reconcile,
        ..req(key, lease, ttl)
    }
}

pub fn response(body: impl AsRef<[u8]>) -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: HeaderMap::new(),
        body: Some(Bytes::copy_from_slice(body.as_ref())),
        trailers: None,
    }
}

pub async fn acquire(store: &MemoryStore, request: &ClaimRequest) -> FencingToken {
    match store.claim(request).await {
        Ok(Claim::Acquired(lease)) => lease.token,
        other => panic!("expected {:?} acquired, got {other:?}", request.key),
    }
}

/// The record a claim of a key that is not completed reports.
pub async fn existing(store: &MemoryStore, request: &ClaimRequest) -> Record {
    match store.claim(request).await {
        Ok(Claim::Existing { record, .. }) => *record,
        other => panic!("expected {:?} existing, got {other:?}", request.key),
    }
}

/// The response a claim of a completed key replays.
pub async fn replayed(store: &MemoryStore, request: &ClaimRequest) -> StoredResponse {
    match store.claim(request).await {
        Ok(Claim::Completed { response, .. }) => *response,
        other => panic!("expected {:?} completed, got {other:?}", request.key),
    }
}

pub async fn record(store: &MemoryStore, key: &ScopedKey) -> Record {
    store
        .lookup(key)
        .await
        .expect("lookup")
        .unwrap_or_else(|| panic!("{key:?} has a record"))
}

/// How many of racing claims of new keys acquired, after checking that every one either
/// acquired or was refused `Full` (`what` names the race in the failure).
pub fn acquired_or_full(answers: &[Result<Claim, StoreError>], what: &str) -> usize {
    assert!(
        answers
            .iter()
            .all(|a| matches!(a, Ok(Claim::Acquired(_)) | Err(StoreError::Full))),
        "{what}: {answers:?}"
    );
    answers
        .iter()
        .filter(|a| matches!(a, Ok(Claim::Acquired(_))))
        .count()
}
