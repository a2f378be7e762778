//! Reading the scripts' replies: a claim's, a fenced write's, a record's fields. A reply that
//! is not what the scripts return is [`odd`]: the server is not ours, or damaged.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis::Value;

use crate::store::Fingerprint;
use crate::store::history::HistoryEntry;
use crate::store::{
    Claim, FencingToken, Lease, Record, RecordStatus, ScopedKey, StoreError, StoredResponse,
};

/// What a claim's reply says: acquired under `token`, or the record it found.
pub(super) fn claimed(reply: &Value, token: FencingToken) -> Result<Claim, StoreError> {
    let parts = array(reply).ok_or_else(|| odd("a claim is not an array"))?;
    let [won, now, fields] = parts else {
        return Err(odd("a claim has not three parts"));
    };
    let fields = array(fields).ok_or_else(|| odd("a claimed record is not a hash"))?;
    let record = parse_record(fields).map_err(StoreError::unavailable)?;
    let now = from_ms(int(now).ok_or_else(|| odd("the server's time"))?);
    if int(won) == Some(1)
        && record.lease_token == token
        && record.status == RecordStatus::InProgress
    {
        return Ok(Claim::Acquired(Lease {
            token,
            attempt: record.attempts,
            until: record.lease_until,
        }));
    }
    Ok(Claim::existing(record, now))
}

/// A fenced write's reply: 1 written, 0 fenced.
pub(super) fn written(value: &Value) -> Result<(), StoreError> {
    match int(value) {
        Some(1) => Ok(()),
        Some(0) => Err(StoreError::Fenced),
        _ => Err(odd("a fenced write answered neither 1 nor 0")),
    }
}

/// A reply that is not what the scripts return: the server is not ours, or damaged.
pub(super) fn odd(what: &str) -> StoreError {
    StoreError::unavailable(format!("unexpected reply from Redis: {what}"))
}

pub(super) fn int(value: &Value) -> Option<i64> {
    match value {
        Value::Int(n) => Some(*n),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

pub(super) fn bytes(value: &Value) -> Option<&[u8]> {
    match value {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.as_bytes()),
        _ => None,
    }
}

pub(super) fn array(value: &Value) -> Option<&[Value]> {
    match value {
        Value::Array(items) => Some(items),
        _ => None,
    }
}

/// A record's fields, as `HGETALL` returns them, read into a [`Record`]; what is wrong with
/// them otherwise.
pub(super) fn parse_record(flat: &[Value]) -> Result<Record, String> {
    let mut fields = std::collections::HashMap::new();
    for pair in flat.chunks(2) {
        if let [name, value] = pair {
            let name = bytes(name).ok_or("a field name is not a string")?;
            let value = bytes(value).ok_or("a field value is not a string")?;
            fields.insert(name.to_vec(), value);
        }
    }
    let field = |name: &str| {
        fields
            .get(name.as_bytes())
            .copied()
            .ok_or_else(|| format!("the field {name} is missing"))
    };
    let text = |name: &str| -> Result<String, String> {
        String::from_utf8(field(name)?.to_vec())
            .map_err(|_| format!("the field {name} is not UTF-8"))
    };
    let number = |name: &str| -> Result<i64, String> {
        text(name)?
            .parse::<i64>()
            .map_err(|_| format!("the field {name} is not an integer"))
    };
    let fingerprint: [u8; 32] = field("fp")?
        .try_into()
        .map_err(|_| "the field fp is not a SHA-256".to_owned())?;
    let status = match text("st")?.as_str() {
        "in_progress" => RecordStatus::InProgress,
        "completed" => RecordStatus::Completed,
        "released" => RecordStatus::Released,
        "needs_reconciliation" => RecordStatus::NeedsReconciliation,
        other => return Err(format!("the field st holds {other:?}, not a status")),
    };
    let token: u64 = text("tok")?
        .parse()
        .map_err(|_| "the field tok is not a token".to_owned())?;
    let response = match fields.get(&b"resp"[..]) {
        Some(bytes) => Some(
            StoredResponse::from_shared(&bytes::Bytes::copy_from_slice(bytes))
                .map_err(|e| format!("the field resp does not decode: {}", e.0))?,
        ),
        None => None,
    };
    let optional = |name: &str| {
        fields
            .get(name.as_bytes())
            .map(|v| String::from_utf8_lossy(v).into_owned())
    };
    Ok(Record {
        key: ScopedKey::new(text("sc")?, text("ky")?),
        fingerprint: Fingerprint::from_bytes(fingerprint),
        status,
        lease_token: FencingToken::new(token),
        lease_until: from_ms(number("lu")?),
        attempts: u32::try_from(number("at")?).map_err(|_| "the field at is out of range")?,
        effect_started: field("es")? == b"1",
        downstream_id: optional("did"),
        response,
        created_at: from_ms(number("ca")?),
        updated_at: from_ms(number("ua")?),
        expires_at: from_ms(number("ea")?),
        history: HistoryEntry::parse_all(&text("hist")?),
        resolution_note: optional("note"),
    })
}

/// A time the scripts write (milliseconds since the epoch, the server's clock).
pub(super) fn from_ms(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}
