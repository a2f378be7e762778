//! Whose a record is, read after a write under a lease was fenced.
//!
//! The store trait says `Fenced` means the record is no longer in progress under the caller's
//! token. A store or a proxy that fenced by mistake must not make a holder drop an outcome,
//! stop renewing under a running handler, or leave a key it never ran in flight: so the holder
//! reads the record before it believes the fence. The keeper (a renewal), the record's writes
//! and the give-backs each read it through [`whose`] (or, on a task of their own, [`read_as`]),
//! and each decides from the same answer.

use std::time::{Duration, SystemTime};

use crate::bounded::bounded;
use crate::store::{FencingToken, IdempotencyStore, Record, RecordStatus, ScopedKey, StoreError};

/// What a read of a record shows to the holder of `token`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Whose {
    /// Still in progress under the token: the fence was a mistake.
    InFlight {
        /// Where the store has the lease end (by the store's clock).
        lease_until: SystemTime,
    },
    /// Set aside for reconciliation under the token (by a retry after its lease ran out, or by
    /// the holder itself, marking it uncertain).
    SetAside {
        effect_started: bool,
        expires_at: SystemTime,
    },
    /// Under another token: taken over, or resolved (a resolution bumps the token).
    Theirs,
    /// Settled under the token (recorded, given back), or gone.
    Settled,
}

impl Whose {
    /// Whether the holder may still write its outcome (in flight, or set aside under its own
    /// token, which a record may still settle with the truth).
    pub(crate) fn ours(self) -> bool {
        matches!(self, Whose::InFlight { .. } | Whose::SetAside { .. })
    }
}

/// Reads the record of `key` for the holder of `token`, the read bounded by `limit`.
pub(crate) async fn whose<St: IdempotencyStore>(
    store: &St,
    key: &ScopedKey,
    token: FencingToken,
    limit: Duration,
) -> Result<Whose, StoreError> {
    Ok(read_as(bounded(limit, store.lookup(key)).await?, token))
}

/// What `record` (`None`: there is none) shows to the holder of `token`.
pub(crate) fn read_as(record: Option<Record>, token: FencingToken) -> Whose {
    let Some(record) = record else {
        return Whose::Settled;
    };
    match record.status {
        _ if record.lease_token != token => Whose::Theirs,
        RecordStatus::InProgress => Whose::InFlight {
            lease_until: record.lease_until,
        },
        RecordStatus::NeedsReconciliation => Whose::SetAside {
            effect_started: record.effect_started,
            expires_at: record.expires_at,
        },
        _ => Whose::Settled,
    }
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use super::*;
    use crate::store::{Claim, ClaimRequest, MemoryStore, StoredResponse};

    async fn claimed(store: &MemoryStore, key: &ScopedKey) -> FencingToken {
        match store.claim(&ClaimRequest::a_minute(key)).await {
            Ok(Claim::Acquired(lease)) => lease.token,
            _ => panic!("not acquired"),
        }
    }

    #[tokio::test]
    async fn each_state_reads_as_whose_it_is() {
        let store = MemoryStore::new();
        let limit = Duration::from_secs(5);
        let key = ScopedKey::new("", "whose");
        let read = |token| whose(&store, &key, token, limit);
        let absent = FencingToken::new(1);
        assert_eq!(read(absent).await.ok(), Some(Whose::Settled), "no record");

        let token = claimed(&store, &key).await;
        assert!(matches!(read(token).await, Ok(Whose::InFlight { .. })));
        assert_eq!(read(absent).await.ok(), Some(Whose::Theirs));

        // Marked uncertain by its holder (an answer it could not record): its effect is
        // marked started with it.
        store.mark_uncertain(&key, token).await.expect("mark");
        let aside = read(token).await.expect("read");
        assert!(
            matches!(
                aside,
                Whose::SetAside {
                    effect_started: true,
                    ..
                }
            ),
            "{aside:?}"
        );
        assert!(aside.ours());

        let done = StoredResponse {
            status: http::StatusCode::CREATED,
            headers: Default::default(),
            body: None,
            trailers: None,
        };
        let ttl = Duration::from_secs(60);
        store
            .complete(&key, token, &done, ttl)
            .await
            .expect("complete");
        let settled = read(token).await.expect("read");
        assert_eq!(settled, Whose::Settled);
        assert!(!settled.ours() && !Whose::Theirs.ours());
    }
}
