//! What a handler learns about the operation it runs: [`IdempotencyContext`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::key::{ScopedKey, hex};
use crate::store::{FencingToken, IdempotencyStore, Lease, Milestone, StoreError};

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The store, as the context needs it: an object-safe view of [`IdempotencyStore`] that only
/// writes milestones.
pub(crate) trait MilestoneSink: Send + Sync {
    fn record<'a>(
        &'a self,
        key: &'a ScopedKey,
        token: FencingToken,
        milestone: &'a Milestone,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
}

impl<St: IdempotencyStore> MilestoneSink for St {
    fn record<'a>(
        &'a self,
        key: &'a ScopedKey,
        token: FencingToken,
        milestone: &'a Milestone,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.record_milestone(key, token, milestone))
    }
}

/// The operation a guarded handler is running, found in the request's extensions (and, with the
/// `axum` feature, an extractor).
///
/// ```
/// use tower_idempotency::IdempotencyContext;
///
/// async fn create_ticket(ctx: IdempotencyContext) -> String {
///     // Pass the derived key to a provider's own idempotency contract.
///     format!("attempt {} for {}", ctx.attempt(), ctx.downstream_key())
/// }
/// ```
#[derive(Clone)]
pub struct IdempotencyContext {
    // Held by value: the request's extensions box it once, and a clone is two reference counts.
    inner: Inner,
}

#[derive(Clone)]
struct Inner {
    key: ScopedKey,
    attempt: u32,
    token: FencingToken,
    store: Arc<dyn MilestoneSink>,
}

impl fmt::Debug for IdempotencyContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyContext")
            .field("key", &self.inner.key)
            .field("attempt", &self.inner.attempt)
            .field("attempt_id", &self.attempt_id())
            .finish_non_exhaustive()
    }
}

impl IdempotencyContext {
    pub(crate) fn new(key: ScopedKey, lease: &Lease, store: Arc<dyn MilestoneSink>) -> Self {
        Self {
            inner: Inner {
                key,
                attempt: lease.attempt,
                token: lease.token,
                store,
            },
        }
    }

    /// Records, durably and before returning, that the external effect is about to begin.
    ///
    /// Call it right before the first call that changes the world (the payment request, the
    /// email send). From then on a failure of this attempt, or its death, leaves the key
    /// `needs_reconciliation` instead of letting a retry run it again. If it fails (the store is
    /// down, or this attempt lost its lease), do not start the effect.
    pub async fn effect_started(&self) -> Result<(), StoreError> {
        self.milestone(Milestone::EffectStarted).await
    }

    /// Records, durably, the effect's identifier downstream (a payment id, a ticket number), so
    /// a [`Reconciler`](crate::reconcile::Reconciler) can look it up.
    pub async fn set_downstream_id(&self, id: impl Into<String>) -> Result<(), StoreError> {
        self.milestone(Milestone::DownstreamId(id.into())).await
    }

    async fn milestone(&self, milestone: Milestone) -> Result<(), StoreError> {
        let inner = &self.inner;
        inner
            .store
            .record(&inner.key, inner.token, &milestone)
            .await
    }

    /// The key with its scope, as the store keeps it: for recording a milestone inside your own
    /// database transaction (see `PostgresStore::record_milestone_in`).
    pub fn scoped_key(&self) -> &ScopedKey {
        &self.inner.key
    }

    /// This attempt's fencing token: writes carrying it are refused once the lease is lost.
    pub fn fencing_token(&self) -> FencingToken {
        self.inner.token
    }

    /// The client's idempotency key.
    pub fn key(&self) -> &str {
        self.inner.key.key()
    }

    /// The scope the key lives in.
    pub fn scope(&self) -> &str {
        self.inner.key.scope()
    }

    /// Which attempt this is, from 1: above 1 when an earlier attempt was released or its lease
    /// was taken over.
    pub fn attempt(&self) -> u32 {
        self.inner.attempt
    }

    /// An identifier unique to this attempt (its fencing token, in hex): for logs.
    pub fn attempt_id(&self) -> String {
        format!("{:016x}", self.inner.token.get())
    }

    /// A key derived from scope and key, stable across attempts and safe to send downstream
    /// (it reveals neither): pass it to a provider's own idempotency contract so a retried
    /// attempt cannot repeat the provider's effect.
    pub fn downstream_key(&self) -> String {
        derive_downstream_key(&self.inner.key)
    }
}

/// SHA-256 over scope and key, length-prefixed, first 16 bytes in hex.
pub(crate) fn derive_downstream_key(key: &ScopedKey) -> String {
    let mut h = Sha256::new();
    for part in [key.scope(), key.key()] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    hex(&h.finalize()[..16])
}

#[cfg(feature = "axum")]
mod extract {
    use axum_core::extract::{FromRequestParts, OptionalFromRequestParts};
    use axum_core::response::{IntoResponse, Response};
    use http::request::Parts;

    use super::IdempotencyContext;
    use crate::problem::{Problem, ProblemKind};

    /// The handler asked for an [`IdempotencyContext`] on a request the layer did not guard
    /// (no layer on the route, a passed-through method, or an optional key that was absent).
    /// That is the server's wiring, not the client's request: answered 500 `not-guarded`.
    /// Extract `Option<IdempotencyContext>` where guarding is optional.
    #[derive(Debug, Clone, Copy)]
    pub struct MissingIdempotencyContext;

    impl IntoResponse for MissingIdempotencyContext {
        fn into_response(self) -> Response {
            tracing::error!(
                "misconfiguration: a handler extracts IdempotencyContext on a request the \
                 idempotency layer did not guard"
            );
            let problem = Problem::new(
                ProblemKind::NotGuarded,
                "this handler needs an idempotency context, but the request was not guarded \
                 by the idempotency layer (the route is outside the layer, or its key is \
                 optional and was not sent): a server misconfiguration. Handlers on such routes \
                 extract Option<IdempotencyContext>",
            );
            crate::dialect::http::problem_response::<axum_core::body::Body>(&problem)
                .map(axum_core::body::Body::new)
        }
    }

    impl<S: Send + Sync> FromRequestParts<S> for IdempotencyContext {
        type Rejection = MissingIdempotencyContext;

        async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
            parts
                .extensions
                .get::<IdempotencyContext>()
                .cloned()
                .ok_or(MissingIdempotencyContext)
        }
    }

    impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyContext {
        type Rejection = std::convert::Infallible;

        async fn from_request_parts(
            parts: &mut Parts,
            _: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts.extensions.get::<IdempotencyContext>().cloned())
        }
    }
}

#[cfg(feature = "axum")]
pub use extract::MissingIdempotencyContext;
