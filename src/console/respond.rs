//! The console's answers: JSON, problem documents, HTML pages and redirects, and the
//! escaping and links the pages are built with.

use axum::body::Body;
use http::{HeaderValue, Response, StatusCode, header};
use serde_json::{Value, json};

use crate::store::{ScopedKey, StoreError};

pub(super) fn json_response(status: StatusCode, value: &Value) -> Response<Body> {
    let mut res = Response::new(Body::from(value.to_string()));
    *res.status_mut() = status;
    let headers = res.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    // Stored responses are in here: nothing cached, nothing sniffed.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    res
}

pub(super) fn problem(status: StatusCode, detail: &str) -> Response<Body> {
    let mut res = json_response(
        status,
        &json!({
            "type": format!("urn:tower-idempotency:console:{}", status.as_u16()),
            "title": status.canonical_reason(),
            "status": status.as_u16(),
            "detail": detail,
        }),
    );
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    res
}

pub(super) fn store_failed(error: &StoreError) -> Response<Body> {
    tracing::error!(%error, "operator console: the store failed");
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        &format!("the store failed: {error}"),
    )
}

pub(super) fn html(status: StatusCode, title: &str, body: &str) -> Response<Body> {
    let page = format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"referrer\" content=\"same-origin\">\
         <title>{} · idempotency console</title><style>{STYLE}</style></head><body>{body}</body></html>",
        esc(title)
    );
    let mut res = Response::new(Body::from(page));
    *res.status_mut() = status;
    let headers = res.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    // No scripts at all, no framing by other sites, nothing cached of stored data.
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'",
        ),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    res
}

pub(super) fn see_other(location: &str) -> Response<Body> {
    let mut res = Response::new(Body::empty());
    *res.status_mut() = StatusCode::SEE_OTHER;
    if let Ok(value) = HeaderValue::from_str(location) {
        res.headers_mut().insert(header::LOCATION, value);
    }
    res
}

pub(super) const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:2em;max-width:70em}\
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.3em .5em;text-align:left;\
vertical-align:top}pre{background:#f6f6f6;padding:.5em;white-space:pre-wrap;word-break:break-all}\
form{margin:1em 0;padding:.5em;border:1px solid #ddd}label{display:block;margin:.3em 0}\
.warn{color:#a00}";

/// HTML-escapes `text`: every stored byte shown goes through here.
pub(super) fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// The list page's address under `base` (the mount point itself: axum's `nest` answers it
/// without a trailing slash).
pub(super) fn list_url(base: &str) -> String {
    if base.is_empty() {
        "/".to_owned()
    } else {
        base.to_owned()
    }
}

pub(super) fn enc(text: &str) -> String {
    form_urlencoded::byte_serialize(text.as_bytes()).collect()
}

pub(super) fn record_link(base: &str, key: &ScopedKey) -> String {
    format!(
        "{base}/record?scope={}&key={}",
        enc(key.scope()),
        enc(key.key())
    )
}
