//! The row a SQL store reads back, the values it binds, and what its errors mean.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::store::history::HISTORY_REFUSALS;
use crate::store::{
    Claim, FencingToken, Fingerprint, HistoryEntry, Lease, Record, RecordStatus, ScopedKey,
    StoreError, StoredResponse,
};

pub(crate) use crate::store::codec::RowError;

impl RowError {
    /// A column the database could not hand over as its type.
    pub(crate) fn column(error: sqlx::Error) -> StoreError {
        StoreError::unavailable(Self(format!("a column does not read: {error}")))
    }
}

/// The listing `ascending` in the reverse order, newest first: its order reversed and, past a
/// cursor, the records before it.
pub(crate) fn descending(ascending: &str) -> String {
    ascending
        .replace(
            "ORDER BY r.updated_at, r.scope, r.key",
            "ORDER BY r.updated_at DESC, r.scope DESC, r.key DESC",
        )
        .replace(
            "(r.updated_at, r.scope, r.key) > (",
            "(r.updated_at, r.scope, r.key) < (",
        )
}

pub(crate) use crate::store::uncertain::{from_ticks, ticks};

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
    /// Read at the store's cursor tick, not in milliseconds: a record read by `lookup` then
    /// stands where the listing places it, and a cursor made from it pages on exactly.
    pub(crate) updated_at: SystemTime,
    pub(crate) expires_at_ms: i64,
    pub(crate) history: String,
    pub(crate) resolution_note: Option<String>,
}

impl RawRecord {
    pub(crate) fn into_record(self) -> Result<Record, StoreError> {
        let corrupt = |what: String| StoreError::unavailable(RowError(what));
        let text = |bytes: Vec<u8>, column: &str| {
            String::from_utf8(bytes)
                .map_err(|_| corrupt(format!("the {column} column is not UTF-8")))
        };
        let fingerprint: [u8; 32] = self.fingerprint.try_into().map_err(|bytes: Vec<u8>| {
            corrupt(format!(
                "the fingerprint column holds {} bytes where a SHA-256 has 32",
                bytes.len()
            ))
        })?;
        let status = match self.status.as_str() {
            "in_progress" => RecordStatus::InProgress,
            "completed" => RecordStatus::Completed,
            "released" => RecordStatus::Released,
            "needs_reconciliation" => RecordStatus::NeedsReconciliation,
            other => {
                return Err(corrupt(format!(
                    "the status column holds {other:?}, not a status"
                )));
            }
        };
        let response = match self.response {
            // The row's bytes become the body and header values, uncopied.
            Some(bytes) => Some(
                StoredResponse::from_shared(&bytes::Bytes::from(bytes)).map_err(|e| {
                    corrupt(format!("the response column does not decode: {}", e.0))
                })?,
            ),
            None => None,
        };
        Ok(Record {
            key: ScopedKey::new(text(self.scope, "scope")?, text(self.key, "key")?),
            fingerprint: Fingerprint::from_bytes(fingerprint),
            status,
            lease_token: FencingToken::new(self.lease_token as u64),
            lease_until: from_millis(self.lease_until_ms),
            attempts: u32::try_from(self.attempts).map_err(|_| {
                corrupt(format!(
                    "the attempts column holds {}, out of range",
                    self.attempts
                ))
            })?,
            effect_started: self.effect_started,
            downstream_id: self.downstream_id,
            response,
            created_at: from_millis(self.created_at_ms),
            updated_at: self.updated_at,
            expires_at: from_millis(self.expires_at_ms),
            history: HistoryEntry::parse_all(&self.history),
            resolution_note: self.resolution_note,
        })
    }
}

/// What a claim statement's row means: the caller's claim won if the row holds the caller's
/// token and is in progress; otherwise it is the record that stands. Tokens are drawn fresh for
/// each claim, so a row with the caller's token was written by this claim, by this statement
/// or by an earlier send of it whose answer was lost: either way the lease is the caller's.
pub(crate) fn claim_outcome(record: Record, now: SystemTime, token: FencingToken) -> Claim {
    if record.lease_token == token && record.status == RecordStatus::InProgress {
        return Claim::Acquired(Lease {
            token,
            attempt: record.attempts,
            until: record.lease_until,
        });
    }
    Claim::existing(record, now)
}

/// `history` with `entry` appended while it holds fewer than `cap` entries (each ends in `;`),
/// in SQL both databases speak. At the cap, a refusal note is dropped; any other event takes
/// the last entry's place, so a history keeps its first attempts and always its latest event
/// (`rtrim` of the characters an entry is made of removes exactly the last one).
pub(crate) fn appended(history: &str, entry: &str, cap: usize) -> String {
    let full = if cap == HISTORY_REFUSALS {
        history.to_owned()
    } else {
        format!("rtrim(rtrim({history}, ';'), '{ENTRY_CHARS}') || {entry}")
    };
    format!(
        "(CASE WHEN length({history}) - length(replace({history}, ';', '')) < {cap} \
         THEN {history} || {entry} ELSE {full} END)"
    )
}

/// How long a milestone written in a handler's own transaction holds its lease, in ms, from
/// when it is written: the transaction holds the record's row, so no renewal can land until it
/// ends, and a lease lapsed meanwhile would be taken over by the first claim to get the row
/// once it commits, while its holder runs on. Renewals never shorten a lease, so a holder gone
/// after its commit holds the key this long from its milestone.
pub(crate) const HELD_IN_TRANSACTION_MS: i64 = 10 * 60 * 1000;

/// The characters of a history entry (`attempt token ms event`), `;` excluded.
const ENTRY_CHARS: &str = "0123456789 -_abcdefghijklmnopqrstuvwxyz";

pub(crate) fn from_millis(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}

/// A duration as whole milliseconds for a bind parameter, at most [`LONGEST`](crate::LONGEST):
/// a lease or TTL past it would overflow the database's time arithmetic (`now() + interval`
/// out of range in PostgreSQL; a `REAL` written into an `INTEGER` column in SQLite, a row
/// that no longer reads), whoever asked for it.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.min(crate::LONGEST).as_millis()).unwrap_or(i64::MAX)
}

pub(crate) fn token(t: FencingToken) -> i64 {
    // Tokens are drawn below 2^63 (see `codec::fresh_token`).
    t.get() as i64
}

/// Any sqlx failure is an unavailable store: the request fails closed.
pub(crate) fn unavailable(e: sqlx::Error) -> StoreError {
    StoreError::unavailable(e)
}

/// Whether a failed statement may have run all the same: its connection broke before the
/// answer came (an I/O or protocol failure, directly or as a batch's), rather than the
/// database answering with an error or a row that does not read.
pub(crate) fn answer_lost(error: &StoreError) -> bool {
    crate::store::unheard::lost(error, |e: &sqlx::Error| {
        matches!(
            e,
            sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed
        )
    })
}
