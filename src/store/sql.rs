//! What the SQL stores share: identifier validation and the row they read back.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::codec::CorruptRecord;
use super::{
    FencingToken, Fingerprint, HistoryEntry, Record, RecordStatus, ScopedKey, StoreError,
    StoredResponse,
};

/// A schema or table name that is not a plain SQL identifier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidIdentifier(String);

impl fmt::Display for InvalidIdentifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} is not a valid identifier: use 1 to 63 ASCII letters, digits and underscores, \
             not starting with a digit",
            self.0
        )
    }
}

impl std::error::Error for InvalidIdentifier {}

/// Accepts `[A-Za-z_][A-Za-z0-9_]{0,62}`: names that need no quoting and cannot smuggle SQL.
pub(crate) fn identifier(name: &str) -> Result<&str, InvalidIdentifier> {
    let mut chars = name.chars();
    let valid = name.len() <= 63
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if valid {
        Ok(name)
    } else {
        Err(InvalidIdentifier(name.to_owned()))
    }
}

/// The columns every claim or lookup reads, in this order.
pub(crate) struct RawRecord {
    pub(crate) scope: Vec<u8>,
    pub(crate) key: Vec<u8>,
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) status: String,
    pub(crate) lease_token: i64,
    pub(crate) lease_until_ms: i64,
    pub(crate) attempts: i64,
    pub(crate) effect_started: bool,
    pub(crate) downstream_id: Option<String>,
    pub(crate) response: Option<Vec<u8>>,
    pub(crate) created_at_ms: i64,
    pub(crate) updated_at_ms: i64,
    pub(crate) expires_at_ms: i64,
    pub(crate) history: String,
}

impl RawRecord {
    pub(crate) fn into_record(self) -> Result<Record, StoreError> {
        let corrupt = |what: &'static str| StoreError::unavailable(CorruptRecord(what));
        let text =
            |bytes: Vec<u8>| String::from_utf8(bytes).map_err(|_| corrupt("key is not UTF-8"));
        let fingerprint: [u8; 32] = self
            .fingerprint
            .try_into()
            .map_err(|_| corrupt("fingerprint is not 32 bytes"))?;
        let status = match self.status.as_str() {
            "in_progress" => RecordStatus::InProgress,
            "completed" => RecordStatus::Completed,
            "released" => RecordStatus::Released,
            "needs_reconciliation" => RecordStatus::NeedsReconciliation,
            _ => return Err(corrupt("unknown status")),
        };
        let response = match self.response {
            Some(bytes) => {
                Some(StoredResponse::from_bytes(&bytes).map_err(StoreError::unavailable)?)
            }
            None => None,
        };
        Ok(Record {
            key: ScopedKey::new(text(self.scope)?, text(self.key)?),
            fingerprint: Fingerprint::from_bytes(fingerprint),
            status,
            lease_token: FencingToken::new(self.lease_token as u64),
            lease_until: from_millis(self.lease_until_ms),
            attempts: u32::try_from(self.attempts).map_err(|_| corrupt("attempts"))?,
            effect_started: self.effect_started,
            downstream_id: self.downstream_id,
            response,
            created_at: from_millis(self.created_at_ms),
            updated_at: from_millis(self.updated_at_ms),
            expires_at: from_millis(self.expires_at_ms),
            history: HistoryEntry::parse_all(&self.history),
        })
    }
}

pub(crate) fn from_millis(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}

/// A duration as whole milliseconds for a bind parameter, saturating.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

pub(crate) fn token(t: FencingToken) -> i64 {
    // Tokens are drawn below 2^63 (see `codec::fresh_token`).
    t.get() as i64
}

/// Any sqlx failure is an unavailable store: the request fails closed.
pub(crate) fn unavailable(e: sqlx::Error) -> StoreError {
    StoreError::unavailable(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_identifiers_are_refused() {
        for ok in ["idempotency", "_t", "T_1", &"a".repeat(63)] {
            assert!(identifier(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "1abc",
            "a-b",
            "a b",
            "t\"; DROP TABLE x; --",
            "schema.table",
            "tâble",
            &"a".repeat(64),
        ] {
            assert!(identifier(bad).is_err(), "{bad}");
        }
    }
}
