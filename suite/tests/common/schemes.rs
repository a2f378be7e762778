//! Fingerprints as an earlier version of the crate wrote them, and stores holding their
//! records: what a retry across an upgrade meets. Also the small helpers the fingerprint
//! reviews share (proptest settings, escaped bytes).

use std::time::Duration;

use axum::http::StatusCode;
use sha2::{Digest, Sha256};
use tower_idempotency::store::{Claim, ClaimRequest, ScopedKey, StoredResponse};
use tower_idempotency::{Fingerprint, IdempotencyStore, LeaseExpiry, MemoryStore};

/// One length-prefixed field (u64 LE), as the crate feeds its hash.
pub fn field(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_le_bytes());
    h.update(bytes);
}

/// One length-prefixed field into a canonical form being built.
pub fn put_field(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// FNV-1a over `bytes`' length (u64 LE) and `bytes`, as schemes are named.
pub fn fnv(mut hash: u32, bytes: &[u8]) -> u32 {
    for b in (bytes.len() as u64).to_le_bytes().iter().chain(bytes) {
        hash = (hash ^ u32::from(*b)).wrapping_mul(0x0100_0193);
    }
    hash
}

/// The scheme bytes of the default settings under a hashing version's name.
pub fn plain_scheme(version: &[u8]) -> [u8; 4] {
    fnv(fnv(0x811c_9dc5, version), b"custom").to_be_bytes()
}

/// A store holding `key` completed with `response` under `fingerprint`, as an earlier
/// version left it.
pub async fn seeded(
    key: &ScopedKey,
    fingerprint: [u8; 32],
    response: StoredResponse,
) -> MemoryStore {
    let store = MemoryStore::new();
    seed(&store, key, fingerprint, &response).await;
    store
}

/// `key` claimed under `fingerprint` and completed with `response` in `store`, as an earlier
/// version (or another process) left it.
pub async fn seed(
    store: &impl IdempotencyStore,
    key: &ScopedKey,
    fingerprint: [u8; 32],
    response: &StoredResponse,
) {
    let claim = ClaimRequest {
        key: key.clone(),
        fingerprint: Fingerprint::from_bytes(fingerprint),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
        on_lease_expiry: LeaseExpiry::Reclaim,
    };
    let token = match store.claim(&claim).await.expect("claim") {
        Claim::Acquired(lease) => lease.token,
        other => panic!("acquired: {other:?}"),
    };
    store
        .complete(key, token, response, Duration::from_secs(3600))
        .await
        .expect("complete");
}

/// The answer an earlier version recorded: 201, `the previous version's run`.
pub fn old_response() -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: http::HeaderMap::new(),
        body: Some(bytes::Bytes::from_static(b"the previous version's run")),
        trailers: None,
    }
}

/// Proptest settings: `n` cases, no regression files written into the tree.
pub fn cases(n: u32) -> proptest::test_runner::Config {
    proptest::test_runner::Config {
        cases: n,
        failure_persistence: None,
        ..proptest::test_runner::Config::default()
    }
}

/// Bytes escaped for a message.
pub fn esc(bytes: &[u8]) -> String {
    bytes.escape_ascii().to_string()
}
