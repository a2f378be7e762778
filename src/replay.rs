//! Steps 8–9 of the pipeline: capture the handler's response, keep what may be replayed, and
//! rebuild responses (live ones and replays) with identical bytes.

use std::pin::Pin;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, header, response::Parts};
use http_body::Body;
use http_body_util::BodyExt;

use crate::body::{Embed, Gathered, ResponseBody};
use crate::store::BoxError;

/// The header that marks a replay.
pub static IDEMPOTENCY_REPLAYED: HeaderName = HeaderName::from_static("idempotency-replayed");

/// Response headers never recorded: credentials, per-response values, hop-by-hop framing.
pub(crate) fn default_denied_headers() -> Vec<HeaderName> {
    [
        "set-cookie",
        "set-cookie2",
        "authorization",
        "proxy-authorization",
        "www-authenticate",
        "proxy-authenticate",
        "date",
        "x-request-id",
        "request-id",
        "x-correlation-id",
        "traceparent",
        "tracestate",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "idempotency-replayed",
    ]
    .into_iter()
    .map(HeaderName::from_static)
    .collect()
}

/// The names a response never records, with a filter that tells most other names apart
/// without comparing them against the whole list: every recorded response's headers are
/// checked against it.
#[derive(Debug)]
pub(crate) struct DeniedHeaders {
    names: Vec<HeaderName>,
    /// One bit per [`slot`] any denied name falls in.
    filter: [u64; 4],
}

/// A name's place in [`DeniedHeaders`]'s filter: its length and last byte, mixed.
fn slot(name: &HeaderName) -> usize {
    let name = name.as_str().as_bytes();
    let last = name.last().copied().unwrap_or(0);
    usize::from((name.len() as u8).wrapping_mul(13).wrapping_add(last))
}

impl DeniedHeaders {
    pub(crate) fn new(names: Vec<HeaderName>) -> Self {
        let mut filter = [0u64; 4];
        for name in &names {
            let i = slot(name);
            filter[i / 64] |= 1 << (i % 64);
        }
        Self { names, filter }
    }

    /// Whether `name` is denied.
    pub(crate) fn contains(&self, name: &HeaderName) -> bool {
        let i = slot(name);
        self.filter[i / 64] & (1 << (i % 64)) != 0 && self.names.contains(name)
    }
}

/// Takes the headers never recorded out of `headers`, to be put back with [`restore`] once
/// the rest is recorded, so a response's headers are lent to its record rather than copied.
/// With `drop_length`, `Content-Length` is dropped instead of kept: the server recomputes it
/// from the whole body, as it does for every replay.
pub(crate) fn withhold(
    headers: &mut HeaderMap,
    denied: &DeniedHeaders,
    drop_length: bool,
) -> Vec<(HeaderName, HeaderValue)> {
    if drop_length {
        headers.remove(header::CONTENT_LENGTH);
    }
    let mut withheld = Vec::new();
    // `Connection` is denied itself, so a response naming hop-by-hop headers in it has one.
    if headers.keys().any(|name| denied.contains(name)) {
        // Hop-by-hop headers a response names in `Connection` are for this hop alone.
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|value| value.to_str().ok())
            .flat_map(|value| value.split(','))
            .filter_map(|token| HeaderName::from_bytes(token.trim().as_bytes()).ok())
            .collect();
        for name in denied.names.iter().chain(&named) {
            if let header::Entry::Occupied(entry) = headers.entry(name) {
                let (name, values) = entry.remove_entry_mult();
                withheld.extend(values.map(|value| (name.clone(), value)));
            }
        }
    }
    withheld
}

/// Puts back what [`withhold`] took out.
pub(crate) fn restore(headers: &mut HeaderMap, withheld: Vec<(HeaderName, HeaderValue)>) {
    for (name, value) in withheld {
        headers.append(name, value);
    }
}

/// A response read off the inner service; `W` names the call whose stream is watched.
pub(crate) enum Captured<B, W> {
    /// The whole body and trailers, read to the end; `fits` when they and the head are within
    /// the limit (else the response is recorded without them).
    Complete {
        parts: Parts,
        body: Bytes,
        /// Boxed: rare, and its room would be kept in every state of the future recording it.
        trailers: Option<Box<HeaderMap>>,
        fits: bool,
    },
    /// A stream to pass on as it arrives (an SSE answer to the watched call), read by no one
    /// yet.
    Streaming {
        parts: Parts,
        body: Pin<Box<B>>,
        watched: W,
    },
    /// The body failed after the head arrived: the handler answered, so its effect is taken
    /// as done, but the response is lost.
    Broken { parts: Parts, error: BoxError },
    /// The body outgrew the limit: what was read, and the rest still to stream.
    TooLarge {
        parts: Parts,
        prefix: Bytes,
        rest: Pin<Box<B>>,
    },
}

/// Reads a response body to its end, or until it outgrows `limit`; when a call is `watched`
/// (JSON-RPC), an event stream is handed back unread, to be forwarded as it arrives.
pub(crate) async fn capture<B, W>(
    res: Response<B>,
    limit: usize,
    head: bool,
    watched: Option<W>,
) -> Captured<B, W>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let (mut parts, body) = res.into_parts();
    // An informational status is no final answer: hyper sends the client a bare 500 for it, and
    // a record of it could not be read back. Taken as that 500, its body as broken.
    if parts.status.is_informational() {
        parts.status = http::StatusCode::INTERNAL_SERVER_ERROR;
        return Captured::Broken {
            parts,
            error: "the handler answered with an informational status, not a final one".into(),
        };
    }
    let mut body = Box::pin(body);
    if let Some(watched) = watched
        && crate::dialect::jsonrpc::is_event_stream(&parts.headers)
    {
        return Captured::Streaming {
            parts,
            body,
            watched,
        };
    }
    // An answer to a HEAD keeps the length of the body it stands for (RFC 9110 §9.3.2), as may
    // a body that says it is empty (a 304's).
    let declared_empty = head || body.size_hint().exact() == Some(0);
    let mut data = Gathered::default();
    let mut trailers: Option<HeaderMap> = None;
    // Every stored byte counts against the limit: the head's and the trailers' too.
    let head = header_bytes(&parts.headers);
    let body_limit = limit.saturating_sub(head);
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(error) => {
                let error = error.into();
                return Captured::Broken { parts, error };
            }
        };
        match frame.into_data() {
            Ok(chunk) => {
                data.push(chunk);
                if data.len() > body_limit {
                    return Captured::TooLarge {
                        parts,
                        prefix: data.freeze(),
                        rest: body,
                    };
                }
            }
            Err(frame) => {
                if let Ok(t) = frame.into_trailers() {
                    trailers.get_or_insert_with(HeaderMap::new).extend(t);
                }
            }
        }
    }
    // A body that ended short of (or past) its declared length was cut: recorded as it
    // ended, every retry would be replayed the cut as a whole answer (the replay's length is
    // the stored bytes'), where the live client would have seen the connection fail.
    if !declared_empty
        && !matches!(
            parts.status,
            http::StatusCode::NO_CONTENT | http::StatusCode::NOT_MODIFIED
        )
    {
        let cut = match content_length(&parts.headers) {
            Ok(Some(declared)) if declared != data.len() as u64 => Some(format!(
                "the response body ended after {} bytes; its Content-Length says {declared}",
                data.len()
            )),
            Ok(_) => None,
            Err(()) => Some("the response's Content-Length is not one length".to_owned()),
        };
        if let Some(error) = cut {
            return Captured::Broken {
                parts,
                error: error.into(),
            };
        }
    }
    let stored = head + data.len() + trailers.as_ref().map_or(0, header_bytes);
    Captured::Complete {
        parts,
        body: data.freeze(),
        trailers: trailers.map(Box::new),
        fits: stored <= limit,
    }
}

/// The length a response's `Content-Length` declares, read as hyper reads it (RFC 9110 §8.6):
/// every comma-separated value of every line, digits only, all equal. `Err` where it declares
/// none hyper could send (values that differ, or are not numbers): a body cannot keep it.
fn content_length(headers: &HeaderMap) -> Result<Option<u64>, ()> {
    let mut declared = None;
    for line in headers.get_all(header::CONTENT_LENGTH) {
        for value in line.as_bytes().split(|&b| b == b',') {
            let value = value.trim_ascii();
            if value.is_empty() || !value.iter().all(u8::is_ascii_digit) {
                return Err(());
            }
            let n = std::str::from_utf8(value)
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
                .ok_or(())?;
            if declared.is_some_and(|d| d != n) {
                return Err(());
            }
            declared = Some(n);
        }
    }
    Ok(declared)
}

/// What a header map weighs as stored: its names and values.
pub(crate) fn header_bytes(headers: &HeaderMap) -> usize {
    headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum()
}

/// How a response leaves the middleware: the replay marker, and the optional envelope.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Presentation {
    pub(crate) replayed: bool,
    pub(crate) mark: bool,
    pub(crate) envelope: bool,
}

/// Whether a response is wrapped in the envelope: 204 and 304 have no body, wrapped or not.
fn wraps(status: http::StatusCode, how: Presentation) -> bool {
    how.envelope
        && status != http::StatusCode::NO_CONTENT
        && status != http::StatusCode::NOT_MODIFIED
}

/// The headers of a wrapped response: those that describe the unwrapped bytes would lie.
fn wrap_headers(headers: &mut HeaderMap) {
    headers.remove(header::CONTENT_LENGTH);
    headers.remove(header::CONTENT_ENCODING);
    for name in [
        "etag",
        "content-md5",
        "digest",
        "content-digest",
        "repr-digest",
    ] {
        headers.remove(name);
    }
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
}

/// A first response too large to record, streamed to the client as it arrives: wrapped in
/// the envelope like any other when the route asks, its JSON embedded as its bytes, text as a
/// string escaped on the way, anything else as `null`.
pub(crate) fn present_streaming<B>(
    mut parts: Parts,
    prefix: Bytes,
    rest: Pin<Box<B>>,
    how: Presentation,
    timing: crate::window::Timing,
) -> Response<ResponseBody<B>> {
    if how.mark {
        parts.headers.insert(
            IDEMPOTENCY_REPLAYED.clone(),
            HeaderValue::from_static("false"),
        );
    }
    if !wraps(parts.status, how) {
        return Response::from_parts(parts, ResponseBody::resumed(prefix, rest, timing));
    }
    let media = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|ct| crate::fingerprint::media_type(ct).into_owned())
        .unwrap_or_default();
    let mode = if crate::fingerprint::is_json(&media) {
        Embed::Raw
    } else if media.starts_with("text/") {
        Embed::Escaped
    } else {
        Embed::Dropped
    };
    let mut head = format!(
        r#"{{"ok":{},"status":{},"idempotent_replay":false,"original_response":"#,
        parts.status.is_success(),
        parts.status.as_u16(),
    )
    .into_bytes();
    let tail: &[u8] = match mode {
        Embed::Raw => b"}",
        Embed::Escaped => b"\"}",
        Embed::Dropped => b"null}",
    };
    if mode == Embed::Escaped {
        head.push(b'"');
    }
    head.extend_from_slice(&mode.apply(prefix));
    wrap_headers(&mut parts.headers);
    let body = ResponseBody::enveloped(
        Bytes::from(head),
        rest,
        mode,
        Bytes::from_static(tail),
        timing,
    );
    Response::from_parts(parts, body)
}

/// Builds the response the client receives, from recorded or live parts.
pub(crate) fn present<B>(
    status: http::StatusCode,
    mut headers: HeaderMap,
    body: Bytes,
    trailers: Option<HeaderMap>,
    how: Presentation,
) -> Response<ResponseBody<B>> {
    let body = if wraps(status, how) {
        let wrapped = envelope(status, &headers, &body, how.replayed);
        wrap_headers(&mut headers);
        wrapped
    } else {
        body
    };
    if how.replayed || how.mark {
        let flag = if how.replayed { "true" } else { "false" };
        headers.insert(IDEMPOTENCY_REPLAYED.clone(), HeaderValue::from_static(flag));
    }
    let mut res = Response::new(ResponseBody::full(body, trailers));
    *res.status_mut() = status;
    *res.headers_mut() = headers;
    res
}

/// `{"ok", "status", "idempotent_replay", "original_response"}`: the handler's JSON embedded as
/// its own bytes (never re-serialised: numbers, member order and duplicate names stay as
/// written), other UTF-8 as a JSON string, anything else (binary bodies) as `null`; an empty
/// body is `null` too.
fn envelope(status: http::StatusCode, headers: &HeaderMap, body: &Bytes, replayed: bool) -> Bytes {
    let is_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| crate::fingerprint::is_json(&crate::fingerprint::media_type(ct)));
    let valid_json = || {
        serde_json::from_slice::<serde::de::IgnoredAny>(body).is_ok()
            && std::str::from_utf8(body).is_ok()
    };
    let original = if body.is_empty() {
        "null".to_owned()
    } else if is_json && valid_json() {
        String::from_utf8_lossy(body.trim_ascii()).into_owned()
    } else {
        lossless_text(body).to_string()
    };
    Bytes::from(format!(
        r#"{{"ok":{},"status":{},"idempotent_replay":{replayed},"original_response":{original}}}"#,
        status.is_success(),
        status.as_u16(),
    ))
}

fn lossless_text(body: &[u8]) -> serde_json::Value {
    std::str::from_utf8(body).map_or(serde_json::Value::Null, |s| s.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Standard names and names like the denied ones (same length, same last byte).
    const NAMES: &[&str] = &[
        "accept",
        "accept-encoding",
        "age",
        "cache-control",
        "content-encoding",
        "content-language",
        "content-location",
        "content-type",
        "etag",
        "expires",
        "last-modified",
        "link",
        "location",
        "retry-after",
        "server",
        "vary",
        "via",
        "x-request-ie",
        "x-request-id",
        "set-cookie",
        "set-cookiee",
        "date",
        "data",
        "grpc-status",
        "grpc-message",
        "idempotency-replayed",
        "idempotency-key",
        "te",
        "tf",
        "x-custom",
        "connection",
        "keep-alive",
        "content-length",
        "transfer-encoding",
        "trailer",
        "upgrade",
        "traceparent",
        "tracestate",
        "www-authenticate",
    ];

    #[test]
    fn the_denied_filter_agrees_with_the_list() {
        // §5: a denied header is never recorded. The filter may only skip the list's
        // comparisons for names the list does not hold.
        let names = default_denied_headers();
        let denied = DeniedHeaders::new(names.clone());
        for name in NAMES
            .iter()
            .map(|n| HeaderName::from_static(n))
            .chain(names.clone())
        {
            assert_eq!(denied.contains(&name), names.contains(&name), "{name}");
        }
        let added = DeniedHeaders::new(vec![HeaderName::from_static("x-secret")]);
        assert!(added.contains(&HeaderName::from_static("x-secret")));
        assert!(!added.contains(&HeaderName::from_static("x-secrets")));
    }

    proptest! {
        #[test]
        fn the_denied_filter_agrees_on_any_name(
            list in proptest::collection::vec("[a-z0-9-]{1,24}", 0..8),
            name in "[a-z0-9-]{1,24}",
        ) {
            let list: Vec<HeaderName> =
                list.iter().filter_map(|n| HeaderName::from_bytes(n.as_bytes()).ok()).collect();
            let Ok(name) = HeaderName::from_bytes(name.as_bytes()) else {
                return Ok(());
            };
            let denied = DeniedHeaders::new(list.clone());
            prop_assert_eq!(denied.contains(&name), list.contains(&name));
            for listed in &list {
                prop_assert!(denied.contains(listed));
            }
        }
    }

    #[test]
    fn withheld_headers_are_not_recorded_and_come_back() {
        let mut h = HeaderMap::new();
        h.append("set-cookie", "a=1".parse().expect("v"));
        h.append("location", "/t/1".parse().expect("v"));
        h.append("x-tag", "one".parse().expect("v"));
        h.append("set-cookie", "b=2".parse().expect("v"));
        h.append("x-tag", "two".parse().expect("v"));
        h.append("date", "now".parse().expect("v"));
        h.append("content-length", "3".parse().expect("v"));
        let mut kept = h.clone();
        let withheld = withhold(
            &mut kept,
            &DeniedHeaders::new(default_denied_headers()),
            false,
        );
        restore(&mut kept, withheld);
        assert_eq!(kept["content-length"], "3", "kept unless the body is whole");
        let withheld = withhold(&mut h, &DeniedHeaders::new(default_denied_headers()), true);
        // What is recorded: no secrets, no per-response values, repeats in order.
        assert!(h.get("set-cookie").is_none());
        assert!(h.get("date").is_none());
        assert!(h.get("content-length").is_none());
        assert_eq!(
            h.get_all("x-tag").iter().collect::<Vec<_>>(),
            ["one", "two"]
        );
        assert_eq!(h["location"], "/t/1");
        // What the live response keeps: all of it but the length the server recomputes.
        restore(&mut h, withheld);
        assert_eq!(
            h.get_all("set-cookie").iter().collect::<Vec<_>>(),
            ["a=1", "b=2"]
        );
        assert_eq!(h["date"], "now");
        assert!(h.get("content-length").is_none());
        assert_eq!(h.len(), 6);
    }

    /// Issue 16 §4: hop-by-hop headers are never recorded, those named in `Connection` too.
    #[test]
    fn hop_by_hop_headers_are_withheld() {
        let mut h = HeaderMap::new();
        for (name, value) in [
            ("connection", "close, X-Hop"),
            ("connection", "x-other-hop"),
            ("x-hop", "1"),
            ("x-other-hop", "2"),
            ("te", "trailers"),
            ("trailer", "grpc-status"),
            ("proxy-connection", "keep-alive"),
            ("keep-alive", "timeout=5"),
            ("upgrade", "h2c"),
            ("x-kept", "3"),
        ] {
            h.append(name, value.parse().expect("v"));
        }
        let withheld = withhold(&mut h, &DeniedHeaders::new(default_denied_headers()), true);
        assert_eq!(h.keys().map(|n| n.as_str()).collect::<Vec<_>>(), ["x-kept"]);
        assert_eq!(withheld.len(), 9);
    }
}
