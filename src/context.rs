//! What a handler learns about the operation it runs: [`IdempotencyContext`].

use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::key::{ScopedKey, hex};
use crate::store::Lease;

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
#[derive(Debug, Clone)]
pub struct IdempotencyContext {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    key: ScopedKey,
    attempt: u32,
    attempt_id: String,
}

impl IdempotencyContext {
    pub(crate) fn new(key: ScopedKey, lease: &Lease) -> Self {
        Self {
            inner: Arc::new(Inner {
                key,
                attempt: lease.attempt,
                attempt_id: format!("{:016x}", lease.token.get()),
            }),
        }
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
    pub fn attempt_id(&self) -> &str {
        &self.inner.attempt_id
    }

    /// A key derived from scope and key, stable across attempts and safe to send downstream
    /// (it reveals neither): pass it to a provider's own idempotency contract so a retried
    /// attempt cannot repeat the provider's effect.
    pub fn downstream_key(&self) -> String {
        let mut h = Sha256::new();
        for part in [self.scope(), self.key()] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        hex(&h.finalize()[..16])
    }
}

#[cfg(feature = "axum")]
mod extract {
    use axum_core::extract::{FromRequestParts, OptionalFromRequestParts};
    use axum_core::response::{IntoResponse, Response};
    use http::request::Parts;

    use super::IdempotencyContext;
    use crate::problem::{Problem, ProblemKind};

    /// The handler asked for an [`IdempotencyContext`] on a request the layer did not guard
    /// (no layer, a passed-through method, or an optional key that was absent).
    #[derive(Debug, Clone, Copy)]
    pub struct MissingIdempotencyContext;

    impl IntoResponse for MissingIdempotencyContext {
        fn into_response(self) -> Response {
            let problem = Problem::new(
                ProblemKind::KeyMissing,
                "this handler runs only for requests guarded by an idempotency key",
            );
            problem
                .into_response::<axum_core::body::Body>()
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
