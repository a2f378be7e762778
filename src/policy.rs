//! Step 8 of the pipeline: which outcomes become the key's permanent answer.

use std::fmt;
use std::sync::Arc;

use http::{HeaderMap, StatusCode};

use crate::dialect::{grpc, jsonrpc};

/// A finished response, as the cache policy sees it.
#[derive(Debug, Clone, Copy)]
pub struct Outcome<'a> {
    /// The HTTP status.
    pub status: StatusCode,
    /// The response headers (a trailers-only gRPC response carries `grpc-status` here).
    pub headers: &'a HeaderMap,
    /// The trailers, if the response had any.
    pub trailers: Option<&'a HeaderMap>,
    /// On routes in JSON-RPC mode, the call's final JSON-RPC response.
    pub jsonrpc: Option<&'a [u8]>,
}

impl Outcome<'_> {
    /// The gRPC status code, read as gRPC clients read it: from a trailers-only response's
    /// headers first (a client stops there), else from the trailers; a value that is not a
    /// code (`00`, `+0`, `0 `, `17`) is UNKNOWN (2).
    pub fn grpc_status(&self) -> Option<u16> {
        let from = |h: &HeaderMap| crate::lines::get(h, &grpc::STATUS).map(grpc::parse_status);
        from(self.headers).or_else(|| self.trailers.and_then(from))
    }

    /// Whether this outcome is definitive: an answer about the operation rather than a
    /// technical failure that a retry may get past (DESIGN §3). For JSON-RPC, results are
    /// (tool errors included) and protocol errors are, except internal and server errors.
    pub fn is_definitive(&self) -> bool {
        // The call's own message, else the gRPC status, else the HTTP status: each dialect
        // classifies its own.
        if let Some(message) = self.jsonrpc {
            return self.status.is_success() && jsonrpc::is_definitive(message);
        }
        match self.grpc_status() {
            Some(code) => grpc::is_definitive(code),
            None => crate::dialect::http::is_definitive(self.status),
        }
    }
}

/// Which outcomes a route records (DESIGN §3). Outcomes not recorded release the key, so a
/// later retry runs the operation again.
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum CachePolicy {
    /// Record definitive outcomes: 2xx, 301, 302 and 303 (a POST answered with a redirect to
    /// its result did its work; 307 and 308 ask for the request again elsewhere and release
    /// the key) and 4xx except 408, 409, 425 and 429 (for gRPC: OK,
    /// INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, PERMISSION_DENIED, FAILED_PRECONDITION,
    /// OUT_OF_RANGE, UNIMPLEMENTED, UNAUTHENTICATED). 5xx and the rest release the key.
    ///
    /// Pick it when a retry after a server error should get another chance: the operation
    /// either did not happen or is itself idempotent downstream.
    #[default]
    DefinitiveOnly,
    /// Record the first outcome, whatever it is, as Stripe does: a 500 is replayed as a 500.
    ///
    /// Pick it when a failed attempt may have done part of its work and running it again
    /// is worse than reporting the failure forever. Errors of the inner service, panics and
    /// dropped executions are still never recorded: there is no real response to replay.
    Everything,
    /// Record what the function says to record. A function that panics records the answer:
    /// the handler has answered, so its effect is taken as done and never run again (DESIGN
    /// §3); the panic is logged.
    Custom(Arc<dyn Fn(&Outcome<'_>) -> bool + Send + Sync>),
}

impl CachePolicy {
    /// A policy from a function deciding whether to record an outcome.
    pub fn custom(f: impl Fn(&Outcome<'_>) -> bool + Send + Sync + 'static) -> Self {
        Self::Custom(Arc::new(f))
    }

    /// Whether `outcome` is recorded under this policy.
    pub fn records(&self, outcome: &Outcome<'_>) -> bool {
        match self {
            Self::DefinitiveOnly => outcome.is_definitive(),
            Self::Everything => true,
            // The application's code, run after its handler answered: a panic here must not
            // unwind through the recording and leave the key to be run again.
            Self::Custom(f) => {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(outcome)))
                    .unwrap_or_else(|_panic| {
                        tracing::error!(
                            status = %outcome.status,
                            "the custom cache policy panicked; the answer is recorded as the \
                             key's outcome"
                        );
                        true
                    })
            }
        }
    }
}

impl fmt::Debug for CachePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::DefinitiveOnly => f.write_str("DefinitiveOnly"),
            Self::Everything => f.write_str("Everything"),
            Self::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn http(status: u16) -> bool {
        let headers = HeaderMap::new();
        Outcome {
            status: StatusCode::from_u16(status).expect("status"),
            headers: &headers,
            trailers: None,
            jsonrpc: None,
        }
        .is_definitive()
    }

    fn grpc(code: &str, trailers_only: bool) -> bool {
        let mut h = HeaderMap::new();
        h.insert("grpc-status", code.parse().expect("value"));
        let empty = HeaderMap::new();
        let (headers, trailers) = if trailers_only {
            (&h, None)
        } else {
            (&empty, Some(&h))
        };
        Outcome {
            status: StatusCode::OK,
            headers,
            trailers,
            jsonrpc: None,
        }
        .is_definitive()
    }

    #[test]
    fn definitive_jsonrpc_outcomes_follow_the_message_not_the_status() {
        let headers = HeaderMap::new();
        let outcome = |status: u16, message: &'static [u8]| Outcome {
            status: StatusCode::from_u16(status).expect("status"),
            headers: &headers,
            trailers: None,
            jsonrpc: Some(message),
        };
        let result = br#"{"jsonrpc":"2.0","id":1,"result":{"isError":true}}"#;
        let internal = br#"{"jsonrpc":"2.0","id":1,"error":{"code":-32603,"message":"x"}}"#;
        assert!(outcome(200, result).is_definitive());
        assert!(!outcome(200, internal).is_definitive());
        assert!(!outcome(500, result).is_definitive());
        assert!(!CachePolicy::DefinitiveOnly.records(&outcome(200, internal)));
        assert!(CachePolicy::Everything.records(&outcome(200, internal)));
    }

    #[test]
    fn definitive_http_outcomes() {
        // Issue 16 §4: redirects are definitive (a POST answered 303 did its work).
        for s in [200, 201, 204, 301, 302, 303, 400, 404, 422] {
            assert!(http(s), "{s}");
        }
        // 307 and 308 ask for the same request again at another URI: nothing was done here.
        for s in [300, 304, 307, 308, 408, 409, 425, 429, 500, 502, 503] {
            assert!(!http(s), "{s}");
        }
    }

    #[test]
    fn definitive_grpc_outcomes_from_trailers_or_headers() {
        for only in [false, true] {
            for c in ["0", "3", "5", "6", "7", "9", "11", "12", "16"] {
                assert!(grpc(c, only), "{c}");
            }
            for c in ["1", "2", "4", "8", "10", "13", "14", "15"] {
                assert!(!grpc(c, only), "{c}");
            }
        }
    }

    /// DESIGN §3: a custom policy that panics records the answer (the handler answered; it
    /// is never run again), and the panic does not unwind into the recording.
    #[test]
    fn a_custom_policy_that_panics_records_the_answer() {
        let policy = CachePolicy::custom(|outcome| {
            assert!(outcome.status.is_success(), "a classifier bug");
            false
        });
        let headers = HeaderMap::new();
        let outcome = |status: u16| Outcome {
            status: StatusCode::from_u16(status).expect("status"),
            headers: &headers,
            trailers: None,
            jsonrpc: None,
        };
        assert!(
            !policy.records(&outcome(200)),
            "its own answer when it has one"
        );
        assert!(policy.records(&outcome(500)), "recorded when it panics");
    }
}
