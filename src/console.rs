//! The operator console: one place to review an operation key and settle what awaits
//! reconciliation, as an axum [`Router`] (feature `console`).
//!
//! **It must sit behind your application's own authentication and authorisation.** It shows
//! stored responses (which may hold personal data) and settles outcomes by hand; it has no
//! login of its own. Mount it under a path your auth layer guards:
//!
//! ```no_run
//! use axum::Router;
//! use axum::extract::Request;
//! use axum::http::StatusCode;
//! use axum::middleware::{self, Next};
//! use axum::response::Response;
//! use tower_idempotency::MemoryStore;
//! use tower_idempotency::console::Console;
//!
//! /// Your auth: only operators get through.
//! async fn operators_only(req: Request, next: Next) -> Result<Response, StatusCode> {
//!     let is_operator = false; // check the session, the token, the role…
//!     if is_operator { Ok(next.run(req).await) } else { Err(StatusCode::UNAUTHORIZED) }
//! }
//!
//! let store = MemoryStore::new();
//! let console = Console::new(store.clone())
//!     .router()
//!     .layer(middleware::from_fn(operators_only));
//! let app: Router = Router::new().nest("/ops/idempotency", console);
//! ```
//!
//! `suite/examples/operator_console.rs` runs one (`cargo run -p suite --example
//! operator_console -- --demo`).
//!
//! | method and path | what |
//! |---|---|
//! | `GET /` | HTML: records awaiting reconciliation (oldest or newest first, paged), a key search |
//! | `GET /record?scope=…&key=…` | HTML: one record, its full history, its stored response and headers as stored, and the forms below |
//! | `POST /resolve` | form: settle by hand (`outcome` `applied` with `status`, `content_type`, `body`, or `not_applied`) with a required `reason` |
//! | `POST /remove`, `POST /purge` | form: delete one record; delete every expired one |
//! | `GET /api/uncertain?order=oldest\|newest&after=…&limit=…` | JSON: a page, the `next` cursor, the count and the oldest |
//! | `GET /api/record?scope=…&key=…` | JSON: one record, with the `token` (a string) of its current attempt |
//! | `POST /api/resolve`, `/api/remove`, `/api/purge` | JSON bodies of the same fields: strings or numbers (`null` is absent); any other shape is a 400 |
//!
//! A resolution sent with the `token` its record was read with settles that attempt only: if
//! another attempt holds the key by then, it is refused (409). Without a `token` it settles
//! whichever attempt awaits reconciliation when it lands. The record keeps the note of its
//! latest resolution only, and a record resolved as not applied stays for the console's TTL
//! from then, so its history and note can be read even after it waited past its own.
//!
//! Keep the idempotency layer off the console's routes (`route_layer` on the routes it
//! guards, before the console is nested): a layer over the whole app would ask the console's
//! own forms for an `Idempotency-Key`. `nest` serves the console at its mount path without a
//! trailing slash.
//!
//! Every write is refused (403) unless the browser says it comes from the console's own
//! origin (`Sec-Fetch-Site: same-origin`, or an `http` or `https` `Origin` naming the
//! request's host, and its scheme where the request names one; behind a proxy, set the
//! origin with [`Console::origin`] and an `Origin` must be it); the JSON
//! API also requires `Content-Type: application/json`, which a cross-site form cannot send.
//! Every stored byte shown in HTML is escaped. The reason of a resolution by hand is kept with
//! the record ([`Record::resolution_note`]) and logged.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{OriginalUri, Request, State};
use axum::routing::{get, post};
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode, header};
use serde_json::{Value, json};

use crate::key::hex;
use crate::reconcile::{Reconciliation, downstream_key, resolve_at};
use crate::store::uncertain::{from_ticks, ticks};
use crate::store::{
    FencingToken, IdempotencyStore, Record, ScopedKey, StoreError, StoredResponse, UncertainCursor,
    UncertainQuery,
};

/// The console over one store (see the [module docs](self)).
#[derive(Debug)]
pub struct Console<St> {
    store: Arc<St>,
    ttl: Duration,
    /// The origins set with [`Console::origin`], each as [`origin_of`] writes it; `None` where
    /// a configured URI has no origin (it matches nothing).
    origins: Arc<[Option<String>]>,
}

impl<St> Clone for Console<St> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            ttl: self.ttl,
            origins: self.origins.clone(),
        }
    }
}

impl<St: IdempotencyStore> Console<St> {
    /// A console over `store`; a response resolved as applied is replayed for 24 h.
    pub fn new(store: St) -> Self {
        Self::from_arc(Arc::new(store))
    }

    /// A console sharing an existing `Arc` of a store.
    pub fn from_arc(store: Arc<St>) -> Self {
        Self {
            store,
            ttl: Duration::from_secs(24 * 60 * 60),
            origins: Arc::new([]),
        }
    }

    /// How long a response resolved as applied is replayed, and the least a record resolved
    /// as not applied is kept from then, for review (default 24 hours).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// A URL the console is served at, as browsers see it: writes must then come from its
    /// origin (scheme, host and port; the path is not part of it) or from another one set
    /// this way, and the request's own `Host` no longer decides. Set it when a proxy stands
    /// in front: one that ends TLS and speaks HTTP/1.1 on leaves a request no way to say it
    /// came over `https`, and one that rewrites `Host` would otherwise refuse every write.
    /// A URI that has no origin (no `http` or `https` scheme, no host) matches no page, so
    /// every write from a browser is refused until it is mended.
    ///
    /// ```
    /// # use tower_idempotency::{MemoryStore, console::Console};
    /// let console = Console::new(MemoryStore::new())
    ///     .origin(http::Uri::from_static("https://ops.example.com/idempotency"));
    /// # let _ = console;
    /// ```
    pub fn origin(mut self, url: http::Uri) -> Self {
        let mut origins = self.origins.to_vec();
        // An origin has no user info (RFC 6454 §4): `https://admin@host` is served at
        // `https://host`. (An `Origin` a browser sends never has any: `origin_of` refuses it.)
        let host = |authority: &http::uri::Authority| match authority.port() {
            Some(port) => format!("{}:{port}", authority.host()),
            None => authority.host().to_owned(),
        };
        origins.push(
            url.scheme_str()
                .zip(url.authority())
                .and_then(|(scheme, authority)| origin_of(scheme, &host(authority))),
        );
        self.origins = origins.into();
        self
    }

    /// The console's routes, to `nest` under a path your auth layer guards.
    pub fn router(self) -> Router {
        Router::new()
            .route("/", get(page_list::<St>))
            .route("/record", get(page_record::<St>))
            .route("/resolve", post(form_resolve::<St>))
            .route("/remove", post(form_remove::<St>))
            .route("/purge", post(form_purge::<St>))
            .route("/api/uncertain", get(api_uncertain::<St>))
            .route("/api/record", get(api_record::<St>))
            .route("/api/resolve", post(api_resolve::<St>))
            .route("/api/remove", post(api_remove::<St>))
            .route("/api/purge", post(api_purge::<St>))
            .with_state(self)
    }
}

/// The most records a page lists.
const MAX_PAGE: usize = 500;

/// Where the console is mounted: the path the client sent, less what the console's own router
/// saw (axum strips a `nest` prefix).
fn base(original: &OriginalUri, req: &Request) -> String {
    let sent = original.0.path();
    let inner = req.uri().path();
    // `nest` hands its own path (without a trailing slash) to the inner `/` route.
    let prefix = match inner {
        "/" => sent,
        inner => sent.strip_suffix(inner).unwrap_or(""),
    };
    prefix.trim_end_matches('/').to_owned()
}

fn query_pairs(req: &Request) -> Vec<(String, String)> {
    req.uri()
        .query()
        .map(|q| form_urlencoded::parse(q.as_bytes()).into_owned().collect())
        .unwrap_or_default()
}

fn param<'a>(pairs: &'a [(String, String)], name: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

/// A listing cursor as text: the time in microseconds from the epoch (negative before it: a
/// time written by hand into a SQL store may be), then the key as a [`key_ref`] of its bytes
/// as stored.
fn cursor_text(cursor: &UncertainCursor) -> String {
    let micros = ticks(cursor.updated_at, MICRO);
    let (scope, key) = cursor.bytes();
    format!("{micros}~{}", bytes_ref(scope, key))
}

fn parse_cursor(text: &str) -> Option<UncertainCursor> {
    let (micros, reference) = text.split_once('~')?;
    let at = from_ticks(micros.parse().ok()?, MICRO);
    let (scope, key) = parse_bytes_ref(reference)?;
    Some(UncertainCursor::stored(at, scope, key))
}

/// A cursor's unit of time.
const MICRO: Duration = Duration::from_micros(1);

fn millis(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// One page of the listing, oldest first or newest first.
struct Listing {
    limit: usize,
    records: Vec<Record>,
    unreadable: Vec<(ScopedKey, String)>,
    next: Option<UncertainCursor>,
    count: u64,
    oldest: Option<SystemTime>,
}

/// Why a listing was not made.
enum ListingError {
    Cursor,
    Store(StoreError),
}

impl From<StoreError> for ListingError {
    fn from(error: StoreError) -> Self {
        Self::Store(error)
    }
}

impl ListingError {
    fn into_response(self) -> Response<Body> {
        match self {
            Self::Cursor => problem(
                StatusCode::BAD_REQUEST,
                "after is not a cursor this console gave out",
            ),
            Self::Store(error) => store_failed(&error),
        }
    }
}

async fn listing<St: IdempotencyStore>(
    console: &Console<St>,
    pairs: &[(String, String)],
) -> Result<Listing, ListingError> {
    let limit = param(pairs, "limit")
        .and_then(|l| l.parse().ok())
        .unwrap_or(50)
        .clamp(1, MAX_PAGE);
    let after = match param(pairs, "after") {
        Some(text) => Some(parse_cursor(text).ok_or(ListingError::Cursor)?),
        None => None,
    };
    let query = UncertainQuery {
        after,
        limit,
        newest_first: param(pairs, "order") == Some("newest"),
    };
    let page = console.store.list_uncertain(&query).await?;
    let count = console.store.count_uncertain().await?;
    Ok(Listing {
        limit,
        records: page.records,
        unreadable: page
            .unreadable
            .into_iter()
            .map(|u| (u.key, u.error))
            .collect(),
        next: page.next,
        count: count.count,
        oldest: count.oldest,
    })
}

fn record_json(record: &Record, now: SystemTime) -> Value {
    let response = record.response.as_ref().map(response_json);
    let resolved_at = last_resolution(record);
    let history: Vec<Value> = record
        .history
        .iter()
        .enumerate()
        .map(|(i, h)| {
            json!({
                "attempt": h.attempt,
                "attempt_id": hex(&h.token.get().to_be_bytes()),
                "at_ms": millis(h.at),
                "event": h.event.as_str(),
                "note": (Some(i) == resolved_at).then_some(record.resolution_note.as_deref()).flatten(),
            })
        })
        .collect();
    json!({
        "scope": record.key.scope(),
        "key": record.key.key(),
        "status": record.status.as_str(),
        "attempts": record.attempts,
        "effect_started": record.effect_started,
        "downstream_id": record.downstream_id,
        "downstream_key": downstream_key(&record.key),
        "fingerprint": hex(record.fingerprint.as_bytes()),
        // What `POST /api/resolve` takes as `token`, so that a resolution made from this read
        // settles this attempt and no later one. A string: it may pass 2^53.
        "token": record.lease_token.get().to_string(),
        "created_at_ms": millis(record.created_at),
        "updated_at_ms": millis(record.updated_at),
        "expires_at_ms": millis(record.expires_at),
        "lease_until_ms": millis(record.lease_until),
        "age_seconds": now.duration_since(record.updated_at).map_or(0, |d| d.as_secs()),
        "last_event": record.history.last().map(|h| h.event.as_str()),
        "resolution_note": record.resolution_note,
        "history": history,
        "response": response,
    })
}

/// Where in its history a record was last resolved: the reason kept with the record belongs
/// to that entry.
fn last_resolution(record: &Record) -> Option<usize> {
    use crate::store::HistoryEvent::{ReconciledApplied, ReconciledNotApplied};
    record
        .history
        .iter()
        .rposition(|h| matches!(h.event, ReconciledApplied | ReconciledNotApplied))
}

fn header_pairs(headers: &HeaderMap) -> Vec<Value> {
    headers
        .iter()
        .map(|(name, value)| json!([name.as_str(), String::from_utf8_lossy(value.as_bytes())]))
        .collect()
}

fn response_json(response: &StoredResponse) -> Value {
    let body = response.body.as_ref();
    json!({
        "status": response.status.as_u16(),
        "headers": header_pairs(&response.headers),
        "trailers": response.trailers.as_ref().map(header_pairs),
        "body_utf8": body.and_then(|b| std::str::from_utf8(b).ok()),
        "body_bytes": body.map(|b| b.len()),
    })
}

// ---------------------------------------------------------------------------------------------
// Responses.

fn json_response(status: StatusCode, value: &Value) -> Response<Body> {
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

fn problem(status: StatusCode, detail: &str) -> Response<Body> {
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

fn store_failed(error: &StoreError) -> Response<Body> {
    tracing::error!(%error, "operator console: the store failed");
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        &format!("the store failed: {error}"),
    )
}

fn html(status: StatusCode, title: &str, body: &str) -> Response<Body> {
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

fn see_other(location: &str) -> Response<Body> {
    let mut res = Response::new(Body::empty());
    *res.status_mut() = StatusCode::SEE_OTHER;
    if let Ok(value) = HeaderValue::from_str(location) {
        res.headers_mut().insert(header::LOCATION, value);
    }
    res
}

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:2em;max-width:70em}\
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.3em .5em;text-align:left;\
vertical-align:top}pre{background:#f6f6f6;padding:.5em;white-space:pre-wrap;word-break:break-all}\
form{margin:1em 0;padding:.5em;border:1px solid #ddd}label{display:block;margin:.3em 0}\
.warn{color:#a00}";

/// HTML-escapes `text`: every stored byte shown goes through here.
fn esc(text: &str) -> String {
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
fn list_url(base: &str) -> String {
    if base.is_empty() {
        "/".to_owned()
    } else {
        base.to_owned()
    }
}

fn enc(text: &str) -> String {
    form_urlencoded::byte_serialize(text.as_bytes()).collect()
}

fn record_link(base: &str, key: &ScopedKey) -> String {
    format!(
        "{base}/record?scope={}&key={}",
        enc(key.scope()),
        enc(key.key())
    )
}

// ---------------------------------------------------------------------------------------------
// Cross-site request forgery: writes come from the console's own pages, or not at all.

/// An origin as one text, to compare: `http` or `https` only, no user info, the host in
/// lower case, a default port left out (`Host: x:80` and `Origin: http://x` name one origin).
fn origin_of(scheme: &str, authority: &str) -> Option<String> {
    let scheme = scheme.to_ascii_lowercase();
    let default_port = match scheme.as_str() {
        "http" => ":80",
        "https" => ":443",
        _ => return None,
    };
    if authority.is_empty() || authority.contains(['@', '/', '?', '#']) {
        return None;
    }
    let host = authority.strip_suffix(default_port).unwrap_or(authority);
    Some(format!("{scheme}://{}", host.to_ascii_lowercase()))
}

/// Whether a browser says `req` comes from the console's own origin.
///
/// With origins set ([`Console::origin`]), an `Origin` must be one of them, and without one
/// `Sec-Fetch-Site` must say `same-origin`. Otherwise: `Sec-Fetch-Site`, or without it an
/// `Origin` of the request's host. An origin is its scheme too: only `http` and `https`
/// pages can be the console's, and where the request names its scheme (HTTP/2, an absolute
/// URI) the origin's must be it. Over HTTP/1.1 the scheme is not sent, so a page of the same
/// host and port over the other scheme passes; `Sec-Fetch-Site`, which every current browser
/// sends, tells them apart.
fn same_origin(req: &Request, origins: &[Option<String>]) -> bool {
    let headers = req.headers();
    let site = headers.get("sec-fetch-site");
    let origin = headers.get(header::ORIGIN).map(|o| {
        o.to_str()
            .ok()
            .and_then(|o| o.split_once("://"))
            .and_then(|(scheme, authority)| origin_of(scheme, authority))
    });
    if !origins.is_empty() {
        return match origin {
            Some(origin) => origin.is_some() && origins.contains(&origin),
            None => site.is_some_and(|site| site == "same-origin"),
        };
    }
    if let Some(site) = site {
        return site == "same-origin";
    }
    // The host as sent: its header, or (HTTP/2) the request's authority.
    let host = match headers.get(header::HOST) {
        Some(host) => host.to_str().ok(),
        None => req.uri().authority().map(|a| a.as_str()),
    };
    let (Some(Some(origin)), Some(host)) = (origin, host) else {
        return false;
    };
    let Some((scheme, _)) = origin.split_once("://") else {
        return false;
    };
    if req.uri().scheme_str().is_some_and(|sent| sent != scheme) {
        return false;
    }
    origin_of(scheme, host).is_some_and(|host| host == origin)
}

fn forbidden() -> Response<Body> {
    problem(
        StatusCode::FORBIDDEN,
        "this write does not come from the console's own origin (Sec-Fetch-Site or Origin): \
         refused as a possible cross-site request",
    )
}

async fn read_body(req: Request) -> Result<(HeaderMap, Bytes), Response<Body>> {
    let (parts, body) = req.into_parts();
    match axum::body::to_bytes(body, 1 << 20).await {
        Ok(bytes) => Ok((parts.headers, bytes)),
        Err(_) => Err(problem(
            StatusCode::PAYLOAD_TOO_LARGE,
            "the request body is over 1 MiB",
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// Writes, shared by the forms and the JSON API.

/// A resolution by hand, as an operator asked for it.
struct Settle {
    key: ScopedKey,
    token: Option<FencingToken>,
    applied: bool,
    reason: String,
    status: StatusCode,
    content_type: Option<HeaderValue>,
    body: String,
}

/// Why a resolution was not done, as the answer's status says.
enum NotDone {
    Missing,
    Moved(String),
    Failed(String),
}

impl NotDone {
    fn status(&self) -> StatusCode {
        match self {
            Self::Missing => StatusCode::NOT_FOUND,
            Self::Moved(_) => StatusCode::CONFLICT,
            Self::Failed(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    fn why(&self) -> &str {
        match self {
            Self::Moved(why) | Self::Failed(why) => why,
            Self::Missing => "no record for this key",
        }
    }
}

impl Settle {
    fn from_fields(get: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
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

    async fn apply<St: IdempotencyStore>(self, console: &Console<St>) -> Result<(), NotDone> {
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

fn key_from(get: impl Fn(&str) -> Option<String>) -> Result<ScopedKey, String> {
    // The pages' forms name the key by a reference a browser cannot alter (NUL, CR and LF in
    // a hidden input are not sent back as they were): its scope and key percent-encoded.
    if let Some(reference) = get("ref") {
        return parse_ref(&reference).ok_or_else(|| "ref is not a key reference".to_owned());
    }
    let scope = get("scope").ok_or("scope is required")?;
    let key = get("key")
        .filter(|k| !k.is_empty())
        .ok_or("key is required")?;
    Ok(ScopedKey::new(scope, key))
}

/// A key as a form field: its scope and key, percent-encoded (ASCII only), joined by `~`.
fn key_ref(key: &ScopedKey) -> String {
    bytes_ref(key.scope().as_bytes(), key.key().as_bytes())
}

/// Scope and key bytes, each percent-encoded, joined by `~`: what a browser sends back as it
/// was given, in a hidden input or a link.
fn bytes_ref(scope: &[u8], key: &[u8]) -> String {
    let enc = |b: &[u8]| percent_encoding::percent_encode(b, REF).to_string();
    format!("{}~{}", enc(scope), enc(key))
}

/// Everything but unreserved characters is encoded in a key reference.
const REF: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.');

fn parse_bytes_ref(reference: &str) -> Option<(Vec<u8>, Vec<u8>)> {
    let (scope, key) = reference.split_once('~')?;
    let dec = |s: &str| percent_encoding::percent_decode_str(s).collect::<Vec<u8>>();
    Some((dec(scope), dec(key)))
}

fn parse_ref(reference: &str) -> Option<ScopedKey> {
    let (scope, key) = parse_bytes_ref(reference)?;
    let (scope, key) = (String::from_utf8(scope).ok()?, String::from_utf8(key).ok()?);
    (!key.is_empty()).then(|| ScopedKey::new(scope, key))
}

/// The attempt a form was built for, if it says.
fn token_from(get: impl Fn(&str) -> Option<String>) -> Result<Option<FencingToken>, String> {
    match get("token").filter(|t| !t.is_empty()) {
        None => Ok(None),
        Some(token) => token
            .parse::<u64>()
            .map(|t| Some(FencingToken::new(t)))
            .map_err(|_| "token must be the record's lease token".to_owned()),
    }
}

// ---------------------------------------------------------------------------------------------
// The JSON API.

async fn api_uncertain<St: IdempotencyStore>(
    State(console): State<Console<St>>,
    req: Request,
) -> Response<Body> {
    let pairs = query_pairs(&req);
    let listed = match listing(&console, &pairs).await {
        Ok(listed) => listed,
        Err(error) => return error.into_response(),
    };
    let now = SystemTime::now();
    json_response(
        StatusCode::OK,
        &json!({
            "records": listed.records.iter().map(|r| record_json(r, now)).collect::<Vec<_>>(),
            "unreadable": listed.unreadable.iter().map(|(key, error)| json!({
                "scope": key.scope(), "key": key.key(), "error": error,
            })).collect::<Vec<_>>(),
            "next": listed.next.as_ref().map(cursor_text),
            "count": listed.count,
            "oldest_ms": listed.oldest.map(millis),
        }),
    )
}

async fn api_record<St: IdempotencyStore>(
    State(console): State<Console<St>>,
    req: Request,
) -> Response<Body> {
    let pairs = query_pairs(&req);
    let key = match key_from(|n| param(&pairs, n).map(str::to_owned)) {
        Ok(key) => key,
        Err(why) => return problem(StatusCode::BAD_REQUEST, &why),
    };
    match console.store.lookup(&key).await {
        Ok(Some(record)) => json_response(StatusCode::OK, &record_json(&record, SystemTime::now())),
        Ok(None) => problem(StatusCode::NOT_FOUND, "no record for this key"),
        Err(error) => store_failed(&error),
    }
}

/// The fields of a JSON API write, after the same-origin and content-type checks.
async fn api_fields<St>(
    console: &Console<St>,
    req: Request,
) -> Result<serde_json::Map<String, Value>, Response<Body>> {
    // A browser says where a request comes from (Sec-Fetch-Site, Origin): from elsewhere is
    // refused. Without either, it is not a browser's cross-site request (a script, curl).
    let says =
        req.headers().contains_key(header::ORIGIN) || req.headers().contains_key("sec-fetch-site");
    if says && !same_origin(&req, &console.origins) {
        return Err(forbidden());
    }
    let is_json = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| {
            ct.split(';')
                .next()
                .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
        });
    if !is_json {
        return Err(problem(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "the JSON API takes Content-Type: application/json",
        ));
    }
    let (_, body) = read_body(req).await?;
    match serde_json::from_slice::<Fields>(&body) {
        Ok(Fields(fields)) => Ok(fields),
        Err(error) if error.is_data() => Err(problem(StatusCode::BAD_REQUEST, &error.to_string())),
        Err(_) => Err(problem(
            StatusCode::BAD_REQUEST,
            "the body is not a JSON object",
        )),
    }
}

/// The fields of an API body as a form would carry them: each named once, each a string, a
/// number or `null` (absent). A map keeps the last of two values of one name, so a body could
/// take back what it said (`"token": "5", "token": null`); and a field of another shape
/// (`{"status": [600]}`, `{"body": {"id": 1}}`) is a mistake to refuse, never one to read as
/// absent and fill with its default (a 200, an empty body, the current attempt).
struct Fields(serde_json::Map<String, Value>);

impl<'de> serde::Deserialize<'de> for Fields {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Once;

        impl<'de> serde::de::Visitor<'de> for Once {
            type Value = Fields;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Fields, A::Error> {
                let mut fields = serde_json::Map::new();
                while let Some((name, value)) = map.next_entry::<String, Value>()? {
                    if fields.contains_key(&name) {
                        return Err(serde::de::Error::custom(format_args!(
                            "{name} is given twice"
                        )));
                    }
                    if !matches!(value, Value::String(_) | Value::Number(_) | Value::Null) {
                        return Err(serde::de::Error::custom(format_args!(
                            "{name} must be a string, a number or null (a response body is \
                             sent as text)"
                        )));
                    }
                    fields.insert(name, value);
                }
                Ok(Fields(fields))
            }
        }

        deserializer.deserialize_map(Once)
    }
}

/// A field of an API body as its form would carry it: a string, a number written out, or
/// absent (left out, or `null`). [`api_fields`] refused every other shape.
fn json_field(fields: &serde_json::Map<String, Value>, name: &str) -> Option<String> {
    match fields.get(name)? {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

async fn api_resolve<St: IdempotencyStore>(
    State(console): State<Console<St>>,
    req: Request,
) -> Response<Body> {
    let fields = match api_fields(&console, req).await {
        Ok(fields) => fields,
        Err(res) => return res,
    };
    let settle = match Settle::from_fields(|n| json_field(&fields, n)) {
        Ok(settle) => settle,
        Err(why) => return problem(StatusCode::BAD_REQUEST, &why),
    };
    let key = settle.key.clone();
    match settle.apply(&console).await {
        Ok(()) => match console.store.lookup(&key).await {
            Ok(Some(record)) => {
                json_response(StatusCode::OK, &record_json(&record, SystemTime::now()))
            }
            Ok(None) => json_response(StatusCode::OK, &json!({ "resolved": true })),
            Err(error) => store_failed(&error),
        },
        Err(not_done) => problem(not_done.status(), not_done.why()),
    }
}

async fn api_remove<St: IdempotencyStore>(
    State(console): State<Console<St>>,
    req: Request,
) -> Response<Body> {
    let fields = match api_fields(&console, req).await {
        Ok(fields) => fields,
        Err(res) => return res,
    };
    match remove_by_hand(&console, |n| json_field(&fields, n)).await {
        Ok(removed) => json_response(StatusCode::OK, &json!({ "removed": removed })),
        Err((status, why)) => problem(status, &why),
    }
}

/// A removal by hand, from the form or the API: the key and a required reason (logged).
/// Whether a record was there to remove.
async fn remove_by_hand<St: IdempotencyStore>(
    console: &Console<St>,
    get: impl Fn(&str) -> Option<String>,
) -> Result<bool, (StatusCode, String)> {
    let key = key_from(&get).map_err(|why| (StatusCode::BAD_REQUEST, why))?;
    let reason = get("reason").filter(|r| !r.trim().is_empty()).ok_or((
        StatusCode::BAD_REQUEST,
        "a reason is required: removing a key lets its next request run as new".to_owned(),
    ))?;
    let removed = console.store.remove(&key).await.map_err(|error| {
        tracing::error!(%error, "operator console: the store failed");
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the store failed: {error}"),
        )
    })?;
    tracing::warn!(?key, removed, reason, "operator console: record removed");
    Ok(removed)
}

async fn api_purge<St: IdempotencyStore>(
    State(console): State<Console<St>>,
    req: Request,
) -> Response<Body> {
    if let Err(res) = api_fields(&console, req).await {
        return res;
    }
    match console.store.purge_expired().await {
        Ok(purged) => json_response(StatusCode::OK, &json!({ "purged": purged })),
        Err(error) => store_failed(&error),
    }
}

// ---------------------------------------------------------------------------------------------
// The pages.

async fn page_list<St: IdempotencyStore>(
    State(console): State<Console<St>>,
    original: OriginalUri,
    req: Request,
) -> Response<Body> {
    let base = base(&original, &req);
    let pairs = query_pairs(&req);
    let newest = param(&pairs, "order") == Some("newest");
    let list = list_url(&base);
    let listed = match listing(&console, &pairs).await {
        Ok(listed) => listed,
        Err(error) => return error.into_response(),
    };
    let now = SystemTime::now();
    let mut out = String::new();
    let _ = write!(
        out,
        "<h1>Awaiting reconciliation</h1><p><strong id=\"count\">{}</strong> records{}. \
         Order: <a href=\"{list}?order=oldest\">oldest first</a> · \
         <a href=\"{list}?order=newest\">newest first</a></p>",
        listed.count,
        listed.oldest.map_or(String::new(), |oldest| format!(
            ", the oldest waiting {} s",
            now.duration_since(oldest).map_or(0, |d| d.as_secs())
        )),
    );
    let _ = write!(
        out,
        "<form method=\"get\" action=\"{base}/record\"><strong>Find a key</strong>\
         <label>Scope <input name=\"scope\" id=\"find-scope\"></label>\
         <label>Key <input name=\"key\" id=\"find-key\" required></label>\
         <button type=\"submit\">Inspect</button></form>"
    );
    out.push_str(
        "<table id=\"uncertain\"><tr><th>key</th><th>scope</th><th>age</th><th>attempts</th>\
         <th>downstream id</th><th>last event</th></tr>",
    );
    for record in &listed.records {
        let _ = write!(
            out,
            "<tr><td><a class=\"record\" href=\"{}\">{}</a></td><td>{}</td><td>{} s</td><td>{}</td>\
             <td>{}</td><td>{}</td></tr>",
            esc(&record_link(&base, &record.key)),
            esc(record.key.key()),
            esc(record.key.scope()),
            now.duration_since(record.updated_at)
                .map_or(0, |d| d.as_secs()),
            record.attempts,
            esc(record.downstream_id.as_deref().unwrap_or("")),
            esc(record.history.last().map_or("", |h| h.event.as_str())),
        );
    }
    out.push_str("</table>");
    for (key, error) in &listed.unreadable {
        let _ = write!(
            out,
            "<p class=\"warn\">Unreadable record {} / {}: {}</p>",
            esc(key.scope()),
            esc(key.key()),
            esc(error)
        );
    }
    if let Some(next) = &listed.next {
        let order = if newest { "newest" } else { "oldest" };
        let _ = write!(
            out,
            "<p><a id=\"next\" href=\"{list}?order={order}&amp;limit={}&amp;after={}\">next page</a></p>",
            listed.limit,
            esc(&enc(&cursor_text(next)))
        );
    }
    let _ = write!(
        out,
        "<form method=\"post\" action=\"{base}/purge\"><button type=\"submit\">Purge expired \
         records</button></form>"
    );
    html(StatusCode::OK, "Awaiting reconciliation", &out)
}

async fn page_record<St: IdempotencyStore>(
    State(console): State<Console<St>>,
    original: OriginalUri,
    req: Request,
) -> Response<Body> {
    let base = base(&original, &req);
    let pairs = query_pairs(&req);
    let key = match key_from(|n| param(&pairs, n).map(str::to_owned)) {
        Ok(key) => key,
        Err(why) => return html(StatusCode::BAD_REQUEST, "Bad request", &esc(&why)),
    };
    let record = match console.store.lookup(&key).await {
        Ok(Some(record)) => record,
        Ok(None) => {
            let body = format!(
                "<h1>No record</h1><p>No record for key {} in scope {}.</p><p><a href=\"{}\">back</a></p>",
                esc(key.key()),
                esc(key.scope()),
                list_url(&base)
            );
            return html(StatusCode::NOT_FOUND, "No record", &body);
        }
        Err(error) => {
            // A row that cannot be read is kept for an operator: say what is wrong with it,
            // and let it be removed.
            let body = format!(
                "<p><a href=\"{}\">← awaiting reconciliation</a></p><h1>Key {}</h1>\
                 <p class=\"warn\" id=\"error\">This record cannot be read: {}</p>\
                 <form id=\"remove\" method=\"post\" action=\"{base}/remove\">\
                 <input type=\"hidden\" name=\"ref\" value=\"{}\">\
                 <label>Reason (required) <input name=\"reason\" required size=\"60\"></label>\
                 <button type=\"submit\">Remove this record</button></form>",
                list_url(&base),
                esc(key.key()),
                esc(&error.to_string()),
                esc(&key_ref(&key)),
            );
            return html(StatusCode::OK, "Unreadable record", &body);
        }
    };
    let mut out = String::new();
    let _ = write!(
        out,
        "<p><a href=\"{}\">← awaiting reconciliation</a></p><h1>Key {}</h1>\
         <table id=\"record\"><tr><th>scope</th><td>{}</td></tr>\
         <tr><th>status</th><td id=\"status\">{}</td></tr><tr><th>attempts</th><td>{}</td></tr>\
         <tr><th>effect started</th><td>{}</td></tr><tr><th>downstream id</th><td>{}</td></tr>\
         <tr><th>downstream key</th><td>{}</td></tr><tr><th>fingerprint</th><td>{}</td></tr>\
         <tr><th>resolution note</th><td id=\"note\">{}</td></tr></table>",
        list_url(&base),
        esc(record.key.key()),
        esc(record.key.scope()),
        record.status.as_str(),
        record.attempts,
        record.effect_started,
        esc(record.downstream_id.as_deref().unwrap_or("")),
        esc(&downstream_key(&record.key)),
        hex(record.fingerprint.as_bytes()),
        esc(record.resolution_note.as_deref().unwrap_or("")),
    );
    out.push_str(
        "<h2>History</h2><table id=\"history\"><tr><th>attempt</th><th>attempt id</th>\
         <th>at (ms)</th><th>event</th><th>reason</th></tr>",
    );
    let resolved_at = last_resolution(&record);
    for (i, h) in record.history.iter().enumerate() {
        let note = match Some(i) == resolved_at {
            true => record.resolution_note.as_deref().unwrap_or(""),
            false => "",
        };
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"reason\">{}</td></tr>",
            h.attempt,
            hex(&h.token.get().to_be_bytes()),
            millis(h.at),
            h.event.as_str(),
            esc(note)
        );
    }
    out.push_str("</table><h2>Stored response</h2>");
    match &record.response {
        Some(response) => {
            let _ = write!(
                out,
                "<p>Status {}</p><pre id=\"headers\">",
                response.status.as_u16()
            );
            for (name, value) in &response.headers {
                let _ = writeln!(
                    out,
                    "{}: {}",
                    esc(name.as_str()),
                    esc(&String::from_utf8_lossy(value.as_bytes()))
                );
            }
            out.push_str("</pre>");
            match response.body.as_ref().map(|b| std::str::from_utf8(b)) {
                Some(Ok(text)) => {
                    let _ = write!(out, "<pre id=\"body\">{}</pre>", esc(text));
                }
                Some(Err(_)) => {
                    let len = response.body.as_ref().map_or(0, Bytes::len);
                    let _ = write!(out, "<p>binary body, {len} bytes</p>");
                }
                None => out.push_str("<p>no body recorded</p>"),
            }
        }
        None => out.push_str("<p>none</p>"),
    }
    // The key as a reference a browser sends back intact, and the attempt this page shows:
    // a resolution made here cannot settle a later attempt.
    let hidden = format!(
        "<input type=\"hidden\" name=\"ref\" value=\"{}\">\
         <input type=\"hidden\" name=\"token\" value=\"{}\">",
        esc(&key_ref(&record.key)),
        record.lease_token.get()
    );
    // A holder under a live lease cannot be overruled (the store refuses): no forms to fail.
    let held = record.status == crate::store::RecordStatus::InProgress
        && record.lease_until > SystemTime::now();
    if held {
        let _ = write!(
            out,
            "<p id=\"held\">A holder runs this key under a lease until {} (ms since the \
             epoch): it can be resolved by hand once that lease has run out.</p>",
            millis(record.lease_until)
        );
    } else if record.status == crate::store::RecordStatus::NeedsReconciliation
        || record.status == crate::store::RecordStatus::InProgress
    {
        let _ = write!(
            out,
            "<h2>Resolve by hand</h2>\
             <form id=\"resolve-applied\" method=\"post\" action=\"{base}/resolve\">{hidden}\
             <input type=\"hidden\" name=\"outcome\" value=\"applied\">\
             <strong>It happened</strong>: retries get this response.\
             <label>Status <input name=\"status\" value=\"200\" size=\"4\"></label>\
             <label>Content-Type <input name=\"content_type\" value=\"application/json\"></label>\
             <label>Body <textarea name=\"body\" rows=\"4\" cols=\"60\"></textarea></label>\
             <label>Reason (required) <input name=\"reason\" required size=\"60\"></label>\
             <button type=\"submit\">Resolve as applied</button></form>\
             <form id=\"resolve-not-applied\" method=\"post\" action=\"{base}/resolve\">{hidden}\
             <input type=\"hidden\" name=\"outcome\" value=\"not_applied\">\
             <strong>It did not happen</strong>: the next retry runs it.\
             <label>Reason (required) <input name=\"reason\" required size=\"60\"></label>\
             <button type=\"submit\">Resolve as not applied</button></form>"
        );
    }
    let _ = write!(
        out,
        "<form id=\"remove\" method=\"post\" action=\"{base}/remove\">{hidden}\
         <label>Reason (required) <input name=\"reason\" required size=\"60\"></label>\
         <button type=\"submit\">Remove this record</button> (its next request runs as new)</form>"
    );
    html(StatusCode::OK, &format!("Key {}", record.key.key()), &out)
}

/// The fields of a form post, after the same-origin check.
async fn form_fields<St>(
    console: &Console<St>,
    req: Request,
) -> Result<Vec<(String, String)>, Response<Body>> {
    if req.method() != Method::POST || !same_origin(&req, &console.origins) {
        return Err(forbidden());
    }
    let (_, body) = read_body(req).await?;
    Ok(form_urlencoded::parse(&body).into_owned().collect())
}

fn form_error(base: &str, status: StatusCode, why: &str) -> Response<Body> {
    let body = format!(
        "<h1>Not done</h1><p class=\"warn\" id=\"error\">{}</p><p><a href=\"{}\">back</a></p>",
        esc(why),
        list_url(base)
    );
    html(status, "Not done", &body)
}

async fn form_resolve<St: IdempotencyStore>(
    State(console): State<Console<St>>,
    original: OriginalUri,
    req: Request,
) -> Response<Body> {
    let base = base(&original, &req);
    let fields = match form_fields(&console, req).await {
        Ok(fields) => fields,
        Err(res) => return res,
    };
    let settle = match Settle::from_fields(|n| param(&fields, n).map(str::to_owned)) {
        Ok(settle) => settle,
        Err(why) => return form_error(&base, StatusCode::BAD_REQUEST, &why),
    };
    let link = record_link(&base, &settle.key);
    match settle.apply(&console).await {
        Ok(()) => see_other(&link),
        Err(not_done) => form_error(&base, not_done.status(), not_done.why()),
    }
}

async fn form_remove<St: IdempotencyStore>(
    State(console): State<Console<St>>,
    original: OriginalUri,
    req: Request,
) -> Response<Body> {
    let base = base(&original, &req);
    let fields = match form_fields(&console, req).await {
        Ok(fields) => fields,
        Err(res) => return res,
    };
    match remove_by_hand(&console, |n| param(&fields, n).map(str::to_owned)).await {
        Ok(true) => see_other(&list_url(&base)),
        Ok(false) => form_error(
            &base,
            StatusCode::NOT_FOUND,
            "no record was removed: there is none for this key",
        ),
        Err((status, why)) => form_error(&base, status, &why),
    }
}

async fn form_purge<St: IdempotencyStore>(
    State(console): State<Console<St>>,
    original: OriginalUri,
    req: Request,
) -> Response<Body> {
    let base = base(&original, &req);
    if let Err(res) = form_fields(&console, req).await {
        return res;
    }
    match console.store.purge_expired().await {
        Ok(_) => see_other(&list_url(&base)),
        Err(error) => form_error(&base, StatusCode::SERVICE_UNAVAILABLE, &error.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys and cursors survive their text form whatever their bytes: `~`, `+`, `%`, NUL, CR,
    /// quotes, non-UTF-8 (a damaged row's key, in a cursor).
    #[test]
    fn key_references_and_cursors_round_trip_any_bytes() {
        let hostile: [&[u8]; 7] = [
            b"",
            b"a~b",
            b"+ %2B%",
            b"\0tools/call\r\n",
            b"\"'<&>",
            "caf\u{e9}".as_bytes(),
            b"k\xff\x80",
        ];
        for scope in hostile {
            for key in hostile {
                let text = bytes_ref(scope, key);
                assert!(text.is_ascii() && text.matches('~').count() == 1, "{text}");
                assert_eq!(parse_bytes_ref(&text), Some((scope.to_vec(), key.to_vec())));
                let at = SystemTime::UNIX_EPOCH + Duration::from_micros(1_700_000_000_123_456);
                let cursor = UncertainCursor::stored(at, scope.to_vec(), key.to_vec());
                let parsed = parse_cursor(&cursor_text(&cursor)).expect("a cursor");
                assert_eq!(parsed, cursor);
                if let (Ok(s), Ok(k)) = (std::str::from_utf8(scope), std::str::from_utf8(key))
                    && !k.is_empty()
                {
                    assert_eq!(
                        parse_ref(&key_ref(&ScopedKey::new(s, k))),
                        Some(ScopedKey::new(s, k))
                    );
                }
            }
        }
    }
}
