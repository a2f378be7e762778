//! Writes, shared by the forms and the JSON API: a resolution by hand, and the key and
//! attempt a form or a JSON body names.

use axum::body::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header};

use crate::reconcile::{Reconciliation, resolve_at};
use crate::store::{
    FencingToken, IdempotencyStore, RecordStatus, ScopedKey, StoreError, StoredResponse,
};

use super::Console;

/// A resolution by hand, as an operator asked for it.
pub(super) struct Settle {
    pub(super) key: ScopedKey,
    token: Option<FencingToken>,
    applied: bool,
    reason: String,
    status: StatusCode,
    content_type: Option<HeaderValue>,
    body: String,
}

/// Why a resolution was not done, as the answer's status says.
pub(super) enum NotDone {
    Missing,
    Moved(String),
    Failed(String),
}

impl NotDone {
    pub(super) fn status(&self) -> StatusCode {
        match self {
            Self::Missing => StatusCode::NOT_FOUND,
            Self::Moved(_) => StatusCode::CONFLICT,
            Self::Failed(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    pub(super) fn why(&self) -> &str {
        match self {
            Self::Moved(why) | Self::Failed(why) => why,
            Self::Missing => "no record for this key",
        }
    }
}

impl Settle {
    pub(super) fn from_fields(get: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        let key = key_from(&get)?;
        let token = token_from(&get)?;
        let applied = match get("outcome").as_deref() {
            Some("applied") => true,
            Some("not_applied") => false,
            _ => return Err("outcome must be applied or not_applied".into()),
        };
        let reason = get("reason")
            .map(|r| r.trim().to_owned())
            .filter(|r| !r.is_empty())
            .ok_or("a reason is required: it is kept with the record for review")?;
        let status = match get("status").filter(|s| !s.is_empty()) {
            Some(status) => status
                .parse::<u16>()
                .ok()
                .and_then(|s| StatusCode::from_u16(s).ok())
                // What a retry can be answered with: no interim (1xx) status, nothing made up.
                .filter(|s| (200..600).contains(&s.as_u16()))
                .ok_or("status must be a final HTTP status, 200 to 599")?,
            None => StatusCode::OK,
        };
        let content_type = match get("content_type").filter(|c| !c.is_empty()) {
            Some(ct) => Some(
                HeaderValue::from_str(&ct)
                    .map_err(|_| "content_type is not a valid header value")?,
            ),
            None => None,
        };
        // A browser sends a textarea's line ends as CRLF: kept as typed, LF.
        let body = get("body").unwrap_or_default().replace("\r\n", "\n");
        if applied && matches!(status.as_u16(), 204 | 304) && !body.is_empty() {
            return Err(format!(
                "a {} answer has no body: leave the body empty",
                status.as_u16()
            ));
        }
        Ok(Self {
            key,
            token,
            applied,
            reason,
            status,
            content_type,
            body,
        })
    }

    pub(super) async fn apply<St: IdempotencyStore>(
        self,
        console: &Console<St>,
    ) -> Result<(), NotDone> {
        let resolution = if self.applied {
            let mut headers = HeaderMap::new();
            if let Some(content_type) = self.content_type {
                headers.insert(header::CONTENT_TYPE, content_type);
            }
            Reconciliation::Applied(Box::new(StoredResponse {
                status: self.status,
                headers,
                body: Some(Bytes::from(self.body)),
                trailers: None,
            }))
        } else {
            Reconciliation::NotApplied
        };
        // The attempt the page was built for, or the one there is now.
        let token = match self.token {
            Some(token) => token,
            None => match console.store.lookup(&self.key).await {
                Ok(Some(record)) => record.lease_token,
                Ok(None) => return Err(NotDone::Missing),
                Err(error) => return Err(NotDone::Failed(format!("the store failed: {error}"))),
            },
        };
        let resolved = resolve_at(
            &*console.store,
            &self.key,
            token,
            resolution,
            console.ttl,
            &self.reason,
        )
        .await;
        match resolved {
            Ok(()) => Ok(()),
            Err(StoreError::Fenced) => Err(NotDone::Moved(
                "the record is not the one this resolution was made for: it is not awaiting \
                 reconciliation, or another attempt holds it now (reload its page)"
                    .into(),
            )),
            Err(error) => Err(NotDone::Failed(format!("the store failed: {error}"))),
        }
    }
}

/// A removal by hand, from the form or the API: the key and a required reason (logged), and
/// the attempt and state it was asked for (`token` and `state`, which a record's page sends):
/// a record that has moved on since (claimed by another attempt, settled by hand, or completed
/// by its own holder under the same token) is not removed, so a stale page cannot delete an
/// outcome its retries must replay. The check is a read just before the
/// removal: it closes the window of a stale page, not a claim racing that one read. Whether a
/// record was there to remove.
pub(super) async fn remove_by_hand<St: IdempotencyStore>(
    console: &Console<St>,
    get: impl Fn(&str) -> Option<String>,
) -> Result<bool, (StatusCode, String)> {
    let key = key_from(&get).map_err(|why| (StatusCode::BAD_REQUEST, why))?;
    let token = token_from(&get).map_err(|why| (StatusCode::BAD_REQUEST, why))?;
    let state = match get("state") {
        Some(state) if state != UNREADABLE && !STATES.iter().any(|s| s.as_str() == state) => {
            return Err((
                StatusCode::BAD_REQUEST,
                "state must be a record's status (in_progress, completed, released, \
                 needs_reconciliation) or unreadable"
                    .to_owned(),
            ));
        }
        state => state,
    };
    let reason = get("reason").filter(|r| !r.trim().is_empty()).ok_or((
        StatusCode::BAD_REQUEST,
        "a reason is required: removing a key lets its next request run as new".to_owned(),
    ))?;
    let failed = |error: StoreError| {
        tracing::error!(%error, "operator console: the store failed");
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the store failed: {error}"),
        )
    };
    if token.is_some() || state.is_some() {
        let moved = |why: &str| (StatusCode::CONFLICT, why.to_owned());
        let asked_for = |record: &crate::store::Record| {
            token.is_none_or(|token| record.lease_token == token)
                && state
                    .as_deref()
                    .is_none_or(|state| record.status.as_str() == state)
        };
        match console.store.lookup(&key).await {
            Ok(Some(record)) if asked_for(&record) => {}
            Ok(Some(_)) => {
                return Err(moved(
                    "the record has moved on since this removal was asked for (settled, or \
                     claimed by another attempt): nothing was removed; reload its page",
                ));
            }
            Ok(None) => return Ok(false),
            // Asked from the page of a record that did not read, and it still does not.
            Err(error)
                if crate::store::is_corrupt(&error) && state.as_deref() == Some(UNREADABLE) => {}
            Err(error) if crate::store::is_corrupt(&error) => {
                return Err(moved(
                    "the record no longer reads as it did when this removal was asked for: \
                     nothing was removed; reload its page",
                ));
            }
            Err(error) => return Err(failed(error)),
        }
    }
    let removed = console.store.remove(&key).await.map_err(failed)?;
    tracing::warn!(?key, removed, reason, "operator console: record removed");
    Ok(removed)
}

/// The `state` of a removal asked from the page of a record that did not read: refused once
/// it reads again (removed and claimed anew since, its new outcome is not the damaged one).
pub(super) const UNREADABLE: &str = "unreadable";

/// Every state a record can be in, as `state` names them.
const STATES: [RecordStatus; 4] = [
    RecordStatus::InProgress,
    RecordStatus::Completed,
    RecordStatus::Released,
    RecordStatus::NeedsReconciliation,
];

pub(super) fn key_from(get: impl Fn(&str) -> Option<String>) -> Result<ScopedKey, String> {
    // The pages' forms name the key by a reference a browser cannot alter (NUL, CR and LF in
    // a hidden input are not sent back as they were): its scope and key percent-encoded.
    if let Some(reference) = get("ref") {
        // One way of naming the key: a `ref` beside a `scope` or `key` that it would silently
        // override (a link edited by hand, another tenant's) is refused.
        if get("scope").is_some() || get("key").is_some() {
            return Err("give ref, or scope and key, not both".to_owned());
        }
        return parse_ref(&reference).ok_or_else(|| "ref is not a key reference".to_owned());
    }
    let scope = get("scope").ok_or("scope is required")?;
    let key = get("key")
        .filter(|k| !k.is_empty())
        .ok_or("key is required")?;
    Ok(ScopedKey::new(scope, key))
}

/// A key as a form field: its scope and key, percent-encoded (ASCII only), joined by `~`.
pub(super) fn key_ref(key: &ScopedKey) -> String {
    bytes_ref(key.scope().as_bytes(), key.key().as_bytes())
}

/// Scope and key bytes, each percent-encoded, joined by `~`: what a browser sends back as it
/// was given, in a hidden input or a link.
pub(super) fn bytes_ref(scope: &[u8], key: &[u8]) -> String {
    let enc = |b: &[u8]| percent_encoding::percent_encode(b, REF).to_string();
    format!("{}~{}", enc(scope), enc(key))
}

/// Everything but unreserved characters is encoded in a key reference.
pub(super) const REF: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.');

pub(super) fn parse_bytes_ref(reference: &str) -> Option<(Vec<u8>, Vec<u8>)> {
    let (scope, key) = reference.split_once('~')?;
    let dec = |s: &str| percent_encoding::percent_decode_str(s).collect::<Vec<u8>>();
    Some((dec(scope), dec(key)))
}

pub(super) fn parse_ref(reference: &str) -> Option<ScopedKey> {
    let (scope, key) = parse_bytes_ref(reference)?;
    let (scope, key) = (String::from_utf8(scope).ok()?, String::from_utf8(key).ok()?);
    (!key.is_empty()).then(|| ScopedKey::new(scope, key))
}

/// The attempt a form was built for, if it says.
pub(super) fn token_from(
    get: impl Fn(&str) -> Option<String>,
) -> Result<Option<FencingToken>, String> {
    match get("token") {
        None => Ok(None),
        // A field sent empty names no attempt: never read as "whichever holds the key now".
        Some(token) if token.is_empty() => {
            Err("token is empty: give the record's lease token, or leave the field out".to_owned())
        }
        Some(token) => token
            .parse::<u64>()
            .map(|t| Some(FencingToken::new(t)))
            .map_err(|_| "token must be the record's lease token".to_owned()),
    }
}
