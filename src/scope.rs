//! Step 2 of the pipeline: whose keys these are.
//!
//! Keys live in a scope: two callers who send the same key in different scopes never meet. The
//! scope must be the caller's stable identity, the authenticated principal or tenant, never a
//! raw credential (a token refreshed between two retries would make the retry a new operation)
//! and never silently shared (an app that authenticates by cookie would otherwise put every
//! caller in one scope, and a second caller sending the first one's key would get the first
//! one's answer). So a layer has no scope until it is given one, and a layer without a scope
//! does not compile:
//!
//! | builder | scope | missing |
//! |---|---|---|
//! | [`scope_by_principal`](crate::IdempotencyLayer::scope_by_principal) | an extension your auth layer sets, typed; the closure's string must name the caller uniquely among all kinds of principal sharing the store (`user:42`, `org:42`) | 500, nothing runs (also for an empty id) |
//! | [`scope_by_header`](crate::IdempotencyLayer::scope_by_header) | a header's value, hashed (a tenant id, an API key) | 500, nothing runs |
//! | [`scope_with`](crate::IdempotencyLayer::scope_with) | what a closure returns (`String`, or `Option<String>` for "missing") | 500 when `None` or empty |
//! | [`single_tenant`](crate::IdempotencyLayer::single_tenant) | one scope for every caller: for services with one client, or behind a gateway that already partitions them | — |
//! | [`scope_by_credential_hash`](crate::IdempotencyLayer::scope_by_credential_hash) | a hash of `Authorization` (see [`CredentialHash`] for why it breaks on token rotation) | 500, nothing runs |
//!
//! A request that reaches the layer without what its scope needs is a server-side wiring
//! mistake (the auth layer runs after this one, or not on this route), not the client's fault:
//! it is answered 500 `scope-missing`, logged, and nothing runs.
//!
//! A layer without a scope is refused by the compiler:
//!
//! ```compile_fail,E0277
//! use axum::{Router, routing::post};
//! use tower_idempotency::{IdempotencyLayer, MemoryStore};
//!
//! let app: Router = Router::new()
//!     .route("/t", post(|| async { "ok" }))
//!     .layer(IdempotencyLayer::new(MemoryStore::new()));
//! ```
//!
//! and accepted once it has one:
//!
//! ```
//! use axum::{Router, routing::post};
//! use tower_idempotency::{IdempotencyLayer, MemoryStore};
//!
//! #[derive(Clone)]
//! struct User {
//!     id: u64,
//! }
//!
//! let app: Router = Router::new()
//!     .route("/t", post(|| async { "ok" }))
//!     .layer(IdempotencyLayer::new(MemoryStore::new()).scope_by_principal(|u: &User| u.id.to_string()));
//! ```

use std::fmt;
use std::marker::PhantomData;

use http::{HeaderName, request::Parts};
use sha2::{Digest, Sha256};

use crate::key::hex;

/// Computes the scope of a request: the partition its keys live in.
///
/// Closures `Fn(&Parts) -> String` and `Fn(&Parts) -> Option<String>` are `MakeScope`s; the
/// layer's `scope_by_*` builders make the common ones.
#[diagnostic::on_unimplemented(
    message = "the idempotency layer has no scope: choose whose keys these are",
    label = "this layer needs a scope",
    note = "call `.scope_by_principal(|user: &User| ..)`, `.scope_by_header(..)`, `.scope_with(..)` or `.single_tenant()` on the layer (see the `scope` module)"
)]
pub trait MakeScope: Clone + Send + Sync + 'static {
    /// The scope of the request with these parts, or why it has none.
    fn make_scope(&self, parts: &Parts) -> Result<String, MissingScope>;
}

/// A request lacks what its layer's scope is made from: the app's wiring is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingScope {
    what: &'static str,
}

impl MissingScope {
    /// The request lacks `what` (for example "the authenticated principal").
    pub const fn new(what: &'static str) -> Self {
        Self { what }
    }
}

impl fmt::Display for MissingScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the idempotency layer scopes keys by {}, and this request does not carry it: the \
             layer that sets it must run before the idempotency layer; nothing was run",
            self.what
        )
    }
}

impl std::error::Error for MissingScope {}

/// What a scope closure may return.
pub trait IntoScope {
    /// The scope, or why there is none.
    fn into_scope(self) -> Result<String, MissingScope>;
}

impl IntoScope for String {
    fn into_scope(self) -> Result<String, MissingScope> {
        Ok(self)
    }
}

impl IntoScope for Option<String> {
    fn into_scope(self) -> Result<String, MissingScope> {
        self.ok_or(MissingScope::new("what its scope closure reads"))
    }
}

impl IntoScope for Result<String, MissingScope> {
    fn into_scope(self) -> Result<String, MissingScope> {
        self
    }
}

// Not suggested when a layer has no scope: the trait's own message says what to do.
#[diagnostic::do_not_recommend]
impl<F, R> MakeScope for F
where
    F: Fn(&Parts) -> R + Clone + Send + Sync + 'static,
    R: IntoScope,
{
    fn make_scope(&self, parts: &Parts) -> Result<String, MissingScope> {
        let scope = self(parts).into_scope()?;
        // An empty scope is none, as an empty principal id is: read as a scope, every request
        // whose closure falls back to "" (a header it lacks, `unwrap_or_default()`) would share
        // one, and be replayed each other's answers.
        if scope.is_empty() {
            return Err(MissingScope::new(
                "what its scope closure reads (it gave none)",
            ));
        }
        // Prefixed, so a computed scope never equals another builder's.
        Ok(format!("custom:{scope}"))
    }
}

/// A layer that has not been given a scope yet; it cannot serve (see the [module](self)).
#[derive(Debug, Clone, Copy, Default)]
pub struct Unscoped;

/// One scope for every caller, chosen explicitly.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleTenant;

impl MakeScope for SingleTenant {
    fn make_scope(&self, _: &Parts) -> Result<String, MissingScope> {
        Ok(String::new())
    }
}

/// The authenticated principal: an extension of type `T` that the app's auth layer sets,
/// turned into a scope by `F`.
pub struct ByPrincipal<T, F> {
    scope: F,
    principal: PhantomData<fn(&T)>,
}

impl<T, F: Clone> Clone for ByPrincipal<T, F> {
    fn clone(&self) -> Self {
        Self {
            scope: self.scope.clone(),
            principal: PhantomData,
        }
    }
}

impl<T, F> fmt::Debug for ByPrincipal<T, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ByPrincipal")
            .field("type", &std::any::type_name::<T>())
            .finish()
    }
}

impl<T, F> ByPrincipal<T, F> {
    pub(crate) fn new(scope: F) -> Self {
        Self {
            scope,
            principal: PhantomData,
        }
    }
}

impl<T, F> MakeScope for ByPrincipal<T, F>
where
    T: Send + Sync + 'static,
    F: Fn(&T) -> String + Clone + Send + Sync + 'static,
{
    fn make_scope(&self, parts: &Parts) -> Result<String, MissingScope> {
        let missing = MissingScope::new("the authenticated principal");
        let principal = parts.extensions.get::<T>().ok_or(missing.clone())?;
        let id = (self.scope)(principal);
        if id.is_empty() {
            return Err(missing);
        }
        // Prefixed, so a principal's scope never equals another builder's. Not with the type's
        // name: that changes when the type moves, and records must outlive a refactor.
        Ok(format!("principal:{id}"))
    }
}

/// A header's value (a tenant id, an API key), hashed so a credential is never stored.
#[derive(Debug, Clone)]
pub struct ByHeader {
    name: HeaderName,
}

impl ByHeader {
    pub(crate) fn new(name: HeaderName) -> Self {
        Self { name }
    }
}

impl MakeScope for ByHeader {
    fn make_scope(&self, parts: &Parts) -> Result<String, MissingScope> {
        let mut values = parts.headers.get_all(&self.name).iter();
        match (values.next(), values.next()) {
            (Some(value), None) if !value.is_empty() => Ok(format!(
                "header:{}:{}",
                self.name,
                hex(&Sha256::digest(value.as_bytes())[..16])
            )),
            _ => Err(MissingScope::new("a header (one, not empty)")),
        }
    }
}

/// A hash of the `Authorization` header: the credential, not the caller.
///
/// Kept for services whose only notion of a caller is its token. It breaks on token rotation:
/// a retry sent with a refreshed token (an orchestrator restarted the next morning, an OAuth
/// access token renewed mid-retry) lands in a new scope, so it runs the handler again. Scope by
/// the principal the token authenticates instead
/// ([`scope_by_principal`](crate::IdempotencyLayer::scope_by_principal)) where you can. A
/// request without `Authorization`, or with two lines of it, is refused here (500, nothing
/// runs), never the shared empty scope nor the scope of one line when the app's auth may read
/// the other.
#[derive(Debug, Clone, Copy, Default)]
pub struct CredentialHash;

impl MakeScope for CredentialHash {
    fn make_scope(&self, parts: &Parts) -> Result<String, MissingScope> {
        // One line, as for a header scope: with two, the layer and the app's auth could each
        // read another caller's credential.
        let mut lines = parts.headers.get_all(http::header::AUTHORIZATION).iter();
        let auth = match (lines.next(), lines.next()) {
            (Some(auth), None) if !auth.is_empty() => auth,
            _ => {
                return Err(MissingScope::new(
                    "the Authorization header (one, not empty)",
                ));
            }
        };
        Ok(format!(
            "auth:{}",
            hex(&Sha256::digest(auth.as_bytes())[..16])
        ))
    }
}
