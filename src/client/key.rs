//! The key of one logical operation, derived from the durable step it performs.

use std::fmt;
use std::sync::Arc;

use crate::key::KeyError;

/// The idempotency key of one logical operation, put on a request's extensions for the
/// [`IdempotentClientLayer`](super::IdempotentClientLayer) to send with every attempt.
///
/// Derive it from what the workflow engine, queue or agent loop already records durably (a run
/// id and a step), never from randomness at call time: a caller that crashes and starts the
/// step again then reaches the same outcome instead of a second one.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OperationKey(Arc<str>);

impl OperationKey {
    /// `{run}:{step}`: the key of `step` in the workflow run `run`, with `:` and `%` in `run`
    /// written `%3A` and `%25`, so that two different steps never share a key (`order:7` and
    /// `refund` against `order` and `7:refund`).
    ///
    /// ```
    /// use tower_idempotency::client::OperationKey;
    ///
    /// let key = OperationKey::step("run-42", "refund-order-7")?;
    /// assert_eq!(key.as_str(), "run-42:refund-order-7");
    /// let key = OperationKey::step("order:7", "refund")?;
    /// assert_eq!(key.as_str(), "order%3A7:refund");
    /// # Ok::<_, tower_idempotency::KeyError>(())
    /// ```
    pub fn step(run: &str, step: &str) -> Result<Self, KeyError> {
        let run = run.replace('%', "%25").replace(':', "%3A");
        Self::new(format!("{run}:{step}"))
    }

    /// A key as it is: at most 255 bytes of visible ASCII, without commas (a server reads a
    /// comma as a list of keys).
    pub fn new(key: impl Into<String>) -> Result<Self, KeyError> {
        let key = key.into();
        crate::key::validate(key.as_bytes())?;
        Ok(Self(key.into()))
    }

    /// The key's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for OperationKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked_as_servers_check_them() {
        assert!(OperationKey::step("run-1", "step-2").is_ok());
        assert_eq!(OperationKey::new(""), Err(KeyError::Empty));
        assert_eq!(
            OperationKey::step("a b", "c"),
            Err(KeyError::InvalidCharacter)
        );
        assert_eq!(OperationKey::step("a,b", "c"), Err(KeyError::Multiple));
        assert_eq!(OperationKey::new("k".repeat(256)), Err(KeyError::TooLong));
    }

    /// DESIGN §9: a key per durable step. Where the run ends and the step begins is part of
    /// the key: steps that only join alike never share one.
    #[test]
    fn different_steps_never_share_a_key() {
        let pairs = [
            (("order:7", "refund"), ("order", "7:refund")),
            (("a%3A", "b"), ("a:", "b")),
            (("a%", "3A:b"), ("a", "%3A:b")),
            (("", ":x"), (":", "x")),
        ];
        for ((run_a, step_a), (run_b, step_b)) in pairs {
            let a = OperationKey::step(run_a, step_a).expect("key");
            let b = OperationKey::step(run_b, step_b).expect("key");
            assert_ne!(a, b, "{run_a:?}/{step_a:?} and {run_b:?}/{step_b:?}");
        }
    }
}
