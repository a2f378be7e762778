//! The stored forms of a call's outcome, and a stored response re-addressed to a retry's `id`.

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header};

use super::REPLAY_META;
use super::events::is_event_stream;
use super::id::Id;
use crate::store::StoredResponse;

/// A stored final response, re-addressed to the call `id`: the new id's text replaces the
/// stored one, every other byte stays as recorded (numbers, member order). With `mark`,
/// `result._meta` gains `"tower-idempotency/replayed": true` as its first member.
pub(crate) fn readdress(stored: &[u8], id: &Id, mark: bool) -> Option<Bytes> {
    let text = std::str::from_utf8(stored).ok()?.trim();
    if !text.starts_with('{') {
        return None;
    }
    let mut out = String::with_capacity(text.len() + id.raw().len() + 48);
    out.push('{');
    for (i, member) in crate::json_text::children(text).iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(member.raw_name.unwrap_or("\"\""));
        out.push(':');
        match member.name.as_str() {
            "id" => out.push_str(id.raw()),
            "result" if mark => out.push_str(&marked(member.value)),
            _ => out.push_str(member.value),
        }
    }
    out.push('}');
    Some(Bytes::from(out))
}

/// A result object with the replay mark first in its `_meta`; anything else as it is.
fn marked(result: &str) -> String {
    let mark = format!("\"{REPLAY_META}\":true");
    if !result.starts_with('{') {
        return result.to_owned();
    }
    let members = crate::json_text::children(result);
    let is_meta = |m: &crate::json_text::Child<'_>| m.is("_meta");
    let meta_object = |m: &crate::json_text::Child<'_>| is_meta(m) && m.value.starts_with('{');
    // A `_meta` that is not an object (`null`, an array) is replaced by one holding the mark:
    // a second `_meta` member would trip clients that refuse duplicate fields.
    let has_meta = members.iter().any(is_meta);
    let mut out = String::with_capacity(result.len() + mark.len() + 16);
    out.push('{');
    if !has_meta {
        out.push_str(&format!("\"_meta\":{{{mark}}}"));
    }
    for (i, member) in members.iter().enumerate() {
        if i > 0 || !has_meta {
            out.push(',');
        }
        out.push_str(member.raw_name.unwrap_or("\"\""));
        out.push(':');
        if is_meta(member) && !meta_object(member) {
            out.push('{');
            out.push_str(&mark);
            out.push('}');
        } else if meta_object(member) {
            let inner = member.value[1..].trim_start();
            out.push('{');
            out.push_str(&mark);
            if !inner.starts_with('}') {
                out.push(',');
            }
            out.push_str(inner);
        } else {
            out.push_str(member.value);
        }
    }
    out.push('}');
    out
}

/// The stored form of a call the server took whose response this layer could not read: its
/// event stream ended, or broke, without it, or the answer came compressed (a handler that
/// compresses whatever it is asked). Kept without a body, with the head's status, media type
/// and content coding, so that retries are told what happened.
pub(crate) fn stored_unread(parts: &http::response::Parts) -> StoredResponse {
    let mut headers = HeaderMap::new();
    let media = match is_event_stream(&parts.headers) {
        true => "text/event-stream",
        false => "application/json",
    };
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(media));
    match crate::dialect::coding(&parts.headers) {
        Some(coding) => {
            headers.insert(header::CONTENT_ENCODING, coding.clone());
        }
        // Neither compressed nor a stream: a body read whole that is not the call's response.
        None if media != "text/event-stream" => {
            headers.insert(UNREAD.clone(), HeaderValue::from_static("not-the-response"));
        }
        None => {}
    }
    StoredResponse {
        status: parts.status,
        headers,
        body: None,
        trailers: None,
    }
}

/// Marks a record [`stored_unread`] made of a body read whole that is not the call's response
/// (a record too large to keep has no response either, but its outcome is known).
static UNREAD: http::HeaderName = http::HeaderName::from_static("tower-idempotency-unread");

/// What a retry is told of a record [`stored_unread`] made (`None`: another kind of record
/// without its response): why the layer could not read the call's response.
pub(crate) fn unread_detail(headers: &HeaderMap) -> Option<String> {
    if headers.contains_key(&UNREAD) {
        return Some(
            "the server answered this call, but not with its JSON-RPC response (an answer to \
             another id, a notification, JSON that is not JSON-RPC, or a body that is not JSON), \
             so there is no response to replay; it will not run again under this key (a new \
             key would run it again)"
                .to_owned(),
        );
    }
    if let Some(coding) = crate::dialect::coding(headers) {
        let coding = String::from_utf8_lossy(coding.as_bytes());
        return Some(format!(
            "the server answered this call compressed ({coding}) although this layer asked \
             for it uncompressed, so its response could not be read or recorded; it will not \
             run again under this key (a new key would run it again)"
        ));
    }
    is_event_stream(headers).then(|| {
        "the server took this call and answered it on an event stream that ended without the \
         call's response (MCP's SSE polling sends it on a resumed stream, which this layer \
         does not see), so there is no response to replay; it will not run again under this \
         key. Resume the first call's stream for its response: a new key would run it again"
            .to_owned()
    })
}

/// The stored form of a call's final response: `200 application/json`, whatever framing
/// carried it. `None` (too large to keep) keeps the answer's `status`, which retries are told.
pub(crate) fn stored_call(message: Option<Bytes>, status: StatusCode) -> StoredResponse {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    StoredResponse {
        status: match message {
            Some(_) => StatusCode::OK,
            None => status,
        },
        headers,
        body: message,
        trailers: None,
    }
}
