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
    /// `{run}:{step}`: the key of `step` in the workflow run `run`.
    ///
    /// ```
    /// use tower_idempotency::client::OperationKey;
    ///
    /// let key = OperationKey::step("run-42", "refund-order-7")?;
    /// assert_eq!(key.as_str(), "run-42:refund-order-7");
    /// # Ok::<_, tower_idempotency::KeyError>(())
    /// ```
    pub fn step(run: &str, step: &str) -> Result<Self, KeyError> {
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
}
