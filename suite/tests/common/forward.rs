//! [`forward_store!`]: the `IdempotencyStore` methods a test's store wrapper leaves alone, each
//! handed to the store it wraps, so that a wrapper spells out only what it changes.

/// Writes, inside `impl IdempotencyStore for Wrapper`, the named methods as calls on the
/// wrapped store in field `$field`: `forward_store!(inner: renew, complete, lookup);`.
#[allow(unused_macros)]
macro_rules! forward_store {
    ($field:ident: $($method:ident),+ $(,)?) => {
        $( $crate::common::forward::forward_one!($field $method); )+
    };
}

/// One method of [`forward_store!`].
#[allow(unused_macros)]
macro_rules! forward_one {
    ($field:ident claim) => {
        async fn claim(
            &self,
            request: &tower_idempotency::store::ClaimRequest,
        ) -> Result<tower_idempotency::store::Claim, tower_idempotency::store::StoreError> {
            self.$field.claim(request).await
        }
    };
    ($field:ident claim_now) => {
        fn claim_now(
            &self,
            request: &tower_idempotency::store::ClaimRequest,
        ) -> Option<Result<tower_idempotency::store::Claim, tower_idempotency::store::StoreError>> {
            self.$field.claim_now(request)
        }
    };
    ($field:ident recorded_fingerprint_now) => {
        fn recorded_fingerprint_now(
            &self,
            key: &tower_idempotency::store::ScopedKey,
        ) -> Option<tower_idempotency::fingerprint::Fingerprint> {
            self.$field.recorded_fingerprint_now(key)
        }
    };
    ($field:ident completed_now) => {
        fn completed_now(
            &self,
            key: &tower_idempotency::store::ScopedKey,
        ) -> Option<Result<tower_idempotency::store::Claim, tower_idempotency::store::StoreError>> {
            self.$field.completed_now(key)
        }
    };
    ($field:ident renew) => {
        async fn renew(
            &self,
            key: &tower_idempotency::store::ScopedKey,
            token: tower_idempotency::store::FencingToken,
            lease: std::time::Duration,
        ) -> Result<std::time::SystemTime, tower_idempotency::store::StoreError> {
            self.$field.renew(key, token, lease).await
        }
    };
    ($field:ident complete) => {
        async fn complete(
            &self,
            key: &tower_idempotency::store::ScopedKey,
            token: tower_idempotency::store::FencingToken,
            response: &tower_idempotency::store::StoredResponse,
            ttl: std::time::Duration,
        ) -> Result<(), tower_idempotency::store::StoreError> {
            self.$field.complete(key, token, response, ttl).await
        }
    };
    ($field:ident release) => {
        async fn release(
            &self,
            key: &tower_idempotency::store::ScopedKey,
            token: tower_idempotency::store::FencingToken,
        ) -> Result<tower_idempotency::store::RecordStatus, tower_idempotency::store::StoreError> {
            self.$field.release(key, token).await
        }
    };
    ($field:ident mark_uncertain) => {
        async fn mark_uncertain(
            &self,
            key: &tower_idempotency::store::ScopedKey,
            token: tower_idempotency::store::FencingToken,
        ) -> Result<(), tower_idempotency::store::StoreError> {
            self.$field.mark_uncertain(key, token).await
        }
    };
    ($field:ident lookup) => {
        async fn lookup(
            &self,
            key: &tower_idempotency::store::ScopedKey,
        ) -> Result<Option<tower_idempotency::store::Record>, tower_idempotency::store::StoreError>
        {
            self.$field.lookup(key).await
        }
    };
    ($field:ident remove) => {
        async fn remove(
            &self,
            key: &tower_idempotency::store::ScopedKey,
        ) -> Result<bool, tower_idempotency::store::StoreError> {
            self.$field.remove(key).await
        }
    };
    ($field:ident purge_expired) => {
        async fn purge_expired(&self) -> Result<u64, tower_idempotency::store::StoreError> {
            self.$field.purge_expired().await
        }
    };
    ($field:ident record_milestone) => {
        async fn record_milestone(
            &self,
            key: &tower_idempotency::store::ScopedKey,
            token: tower_idempotency::store::FencingToken,
            milestone: &tower_idempotency::store::Milestone,
        ) -> Result<(), tower_idempotency::store::StoreError> {
            self.$field.record_milestone(key, token, milestone).await
        }
    };
    ($field:ident list_uncertain) => {
        async fn list_uncertain(
            &self,
            query: &tower_idempotency::store::UncertainQuery,
        ) -> Result<tower_idempotency::store::UncertainPage, tower_idempotency::store::StoreError> {
            self.$field.list_uncertain(query).await
        }
    };
    ($field:ident count_uncertain) => {
        async fn count_uncertain(
            &self,
        ) -> Result<tower_idempotency::store::UncertainCount, tower_idempotency::store::StoreError>
        {
            self.$field.count_uncertain().await
        }
    };
    ($field:ident resolve) => {
        async fn resolve(
            &self,
            key: &tower_idempotency::store::ScopedKey,
            token: tower_idempotency::store::FencingToken,
            resolution: &tower_idempotency::store::Resolution,
            ttl: std::time::Duration,
            note: Option<&str>,
        ) -> Result<(), tower_idempotency::store::StoreError> {
            self.$field.resolve(key, token, resolution, ttl, note).await
        }
    };
    ($field:ident append_history) => {
        async fn append_history(
            &self,
            key: &tower_idempotency::store::ScopedKey,
            event: tower_idempotency::store::HistoryEvent,
        ) -> Result<(), tower_idempotency::store::StoreError> {
            self.$field.append_history(key, event).await
        }
    };
    ($field:ident wait_for_change) => {
        async fn wait_for_change(
            &self,
            key: &tower_idempotency::store::ScopedKey,
            seen: &tower_idempotency::store::InFlight,
            round: u32,
            within: std::time::Duration,
        ) {
            self.$field.wait_for_change(key, seen, round, within).await;
        }
    };
}

#[allow(unused_imports)]
pub(crate) use {forward_one, forward_store};
