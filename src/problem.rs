//! Every answer the middleware gives on its own, as RFC 9457 problem details.
//!
//! Each body is `application/problem+json` with these members:
//!
//! - `type`: a stable URI, `urn:tower-idempotency:problem:<slug>` (see [`ProblemKind`]);
//! - `title`, `status`, `detail`: for people;
//! - `state`: the key's state as the middleware saw it (`none`, `in_progress`, `completed`,
//!   `released`, `needs_reconciliation`; `unknown` where a refusal could not read it);
//! - `safe_new_key`: `true` when the outcome for this key is definite (nothing ran, or the
//!   outcome is recorded) so the client may move on to a new key; `false` when the client must
//!   keep retrying *this* key (the outcome is not known yet, or the store could not tell), or
//!   find its outcome elsewhere (a JSON-RPC call answered on a stream this layer did not see);
//! - `retry_after`: seconds, when a retry is expected to help (also sent as `Retry-After`).
//!
//! No header value of the request (key, credentials) is ever echoed.
//!
//! | slug | status | when |
//! |---|---|---|
//! | `key-missing` | 400 | the route requires a key and none was sent |
//! | `key-invalid` | 400 | empty, over 255 bytes, not visible ASCII, or sent twice |
//! | `body-too-large` | 413 | the request body is over the route's limit; nothing was claimed |
//! | `body-malformed` | 400 | the body is not what its `Content-Type` says (invalid JSON, not UTF-8, nested over 128 levels) |
//! | `body-unreadable` | 400 | the request body stream failed |
//! | `fingerprint-mismatch` | 422 | the key was used for a different request; nothing ran |
//! | `in-flight` | 409 | the first request with this key is still running; retry after `Retry-After` |
//! | `outcome-unknown` | 409 | it is unknown whether the operation took effect; it awaits reconciliation |
//! | `response-not-stored` | 409 | the operation completed but its response was over the size limit, so it cannot be replayed; or (JSON-RPC) the server took the call and its event stream ended without the response (`safe_new_key: false`) |
//! | `encoding-not-accepted` | 406 | the operation completed, but its recorded response is in a content coding (`Content-Encoding`, `grpc-encoding`) this retry does not accept; retry accepting it |
//! | `store-unavailable` | 503 | the record store failed; nothing ran; retry with the same key |
//! | `execution-failed` | 500 | the handler panicked (the key was released), or its response body failed after it answered (`state: completed`: it will not run again) |
//! | `call-unguardable` | 400 | a JSON-RPC call carries a key but cannot be guarded (a batch, a `null` id, a body the mode cannot read); nothing ran |
//! | `header-mismatch` | 400 | the MCP `Mcp-Method` header names another method than the body; nothing ran |
//! | `not-guarded` | 500 | a handler extracts `IdempotencyContext` on a request the layer did not guard (route outside the layer, or an optional key not sent): a server misconfiguration |
//! | `scope-missing` | 500 | the request lacks what the layer's scope is made from (the auth layer did not run before it): a server misconfiguration; nothing ran |
//! | `fingerprint-failed` | 500 | a custom canonicaliser panicked on this body: a server bug; nothing was claimed or run |

use http::StatusCode;

/// The failures the middleware answers itself, each with a stable `type` URI.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemKind {
    /// 400: the route requires an idempotency key and none was sent.
    KeyMissing,
    /// 400: the key is empty, too long, not visible ASCII, or was sent more than once.
    KeyInvalid,
    /// 413: the request body is larger than the route's limit.
    BodyTooLarge,
    /// 400: the body is not what its `Content-Type` declares.
    BodyMalformed,
    /// 400: the request body could not be read.
    BodyUnreadable,
    /// 422: the key was first used with a different request.
    FingerprintMismatch,
    /// 409: the first request with this key is still running.
    InFlight,
    /// 409: whether the operation took effect is unknown; it awaits reconciliation.
    OutcomeUnknown,
    /// 409: the operation completed, but its response was too large to keep.
    ResponseNotStored,
    /// 406: the operation completed, but its recorded response is in a content coding this
    /// retry does not accept (its `Accept-Encoding`, or gRPC's `grpc-accept-encoding`).
    EncodingNotAccepted,
    /// 503: the record store failed; nothing ran.
    StoreUnavailable,
    /// 500: the execution panicked or its response body failed; the key was released.
    ExecutionFailed,
    /// 500: the request lacks what the layer's scope is made from: the server is wired wrong
    /// (see [`scope`](crate::scope)); nothing ran.
    ScopeMissing,
    /// 400: a JSON-RPC call carries a key but cannot be guarded (a batch, a `null` id, a body
    /// the mode cannot read); nothing ran.
    CallUnguardable,
    /// 400: the MCP `Mcp-Method` header names another method than the body; nothing ran.
    HeaderMismatch,
    /// 500: a handler needs an `IdempotencyContext` on a request the layer did not guard: the
    /// server is wired wrong.
    NotGuarded,
    /// 500: a custom [`Canonicalize`](crate::Canonicalize) panicked on the body: a server bug;
    /// nothing was claimed or run.
    FingerprintFailed,
}

impl ProblemKind {
    /// The last segment of the `type` URI.
    pub const fn slug(self) -> &'static str {
        match self {
            Self::KeyMissing => "key-missing",
            Self::KeyInvalid => "key-invalid",
            Self::BodyTooLarge => "body-too-large",
            Self::BodyMalformed => "body-malformed",
            Self::BodyUnreadable => "body-unreadable",
            Self::FingerprintMismatch => "fingerprint-mismatch",
            Self::InFlight => "in-flight",
            Self::OutcomeUnknown => "outcome-unknown",
            Self::ResponseNotStored => "response-not-stored",
            Self::EncodingNotAccepted => "encoding-not-accepted",
            Self::StoreUnavailable => "store-unavailable",
            Self::ExecutionFailed => "execution-failed",
            Self::ScopeMissing => "scope-missing",
            Self::CallUnguardable => "call-unguardable",
            Self::HeaderMismatch => "header-mismatch",
            Self::NotGuarded => "not-guarded",
            Self::FingerprintFailed => "fingerprint-failed",
        }
    }

    /// The stable `type` URI.
    pub fn type_uri(self) -> String {
        format!("urn:tower-idempotency:problem:{}", self.slug())
    }

    /// The HTTP status.
    pub const fn status(self) -> StatusCode {
        match self {
            Self::KeyMissing
            | Self::KeyInvalid
            | Self::BodyMalformed
            | Self::BodyUnreadable
            | Self::CallUnguardable
            | Self::HeaderMismatch => StatusCode::BAD_REQUEST,
            Self::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::FingerprintMismatch => StatusCode::UNPROCESSABLE_ENTITY,
            Self::EncodingNotAccepted => StatusCode::NOT_ACCEPTABLE,
            Self::InFlight | Self::OutcomeUnknown | Self::ResponseNotStored => StatusCode::CONFLICT,
            Self::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Self::ExecutionFailed
            | Self::ScopeMissing
            | Self::NotGuarded
            | Self::FingerprintFailed => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// A short human summary.
    pub const fn title(self) -> &'static str {
        match self {
            Self::KeyMissing => "Idempotency key required",
            Self::KeyInvalid => "Invalid idempotency key",
            Self::BodyTooLarge => "Request body too large",
            Self::BodyMalformed => "Malformed request body",
            Self::BodyUnreadable => "Request body could not be read",
            Self::FingerprintMismatch => "Idempotency key reused with a different request",
            Self::InFlight => "Request with this idempotency key is in progress",
            Self::OutcomeUnknown => "Outcome unknown",
            Self::ResponseNotStored => "Response not stored",
            Self::EncodingNotAccepted => "Recorded response in an encoding not accepted",
            Self::StoreUnavailable => "Idempotency store unavailable",
            Self::ScopeMissing => "Caller's identity missing (server misconfiguration)",
            Self::CallUnguardable => "Keyed call cannot be guarded",
            Self::HeaderMismatch => "Mcp-Method header does not match the body",
            Self::NotGuarded => "Request not guarded (server misconfiguration)",
            Self::FingerprintFailed => "Request could not be fingerprinted (server error)",
            Self::ExecutionFailed => "Execution failed",
        }
    }

    /// Whether a client may move on to a new key after this answer.
    pub const fn safe_new_key(self) -> bool {
        !matches!(
            self,
            Self::InFlight | Self::OutcomeUnknown | Self::StoreUnavailable | Self::ExecutionFailed
        )
    }
}

/// One problem answer, ready to be framed in the request's dialect (`crate::dialect`).
#[derive(Debug, Clone)]
pub(crate) struct Problem {
    pub(crate) kind: ProblemKind,
    pub(crate) detail: String,
    pub(crate) state: &'static str,
    pub(crate) retry_after: Option<u64>,
    /// The outcome is not known here, whatever the state: not safe to move on to a new key.
    keep_key: bool,
}

impl Problem {
    pub(crate) fn new(kind: ProblemKind, detail: impl Into<String>) -> Self {
        Self {
            kind,
            detail: detail.into(),
            state: "none",
            retry_after: None,
            keep_key: false,
        }
    }

    /// Marks an answer whose outcome this layer does not know, though the key will not run
    /// again: a new key would run the operation a second time.
    pub(crate) fn keep_key(mut self) -> Self {
        self.keep_key = true;
        self
    }

    pub(crate) fn state(mut self, state: &'static str) -> Self {
        self.state = state;
        self
    }

    pub(crate) fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    /// Whether a client may move on to a new key: the kind says so, or the outcome is
    /// recorded (an execution that failed after it answered is completed, and final).
    pub(crate) fn safe_new_key(&self) -> bool {
        !self.keep_key && (self.kind.safe_new_key() || self.state == "completed")
    }

    pub(crate) fn to_json(&self) -> serde_json::Value {
        let mut body = serde_json::json!({
            "type": self.kind.type_uri(),
            "title": self.kind.title(),
            "status": self.kind.status().as_u16(),
            "detail": self.detail,
            "state": self.state,
            "safe_new_key": self.safe_new_key(),
        });
        if let Some(seconds) = self.retry_after {
            body["retry_after"] = seconds.into();
        }
        body
    }
}
