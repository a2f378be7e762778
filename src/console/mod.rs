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
//! | `POST /api/resolve`, `/api/remove`, `/api/purge` | JSON bodies of the same fields: strings or numbers (`null` is absent); any other shape, a field the write does not take, or an empty `token` is a 400 |
//!
//! A resolution or a removal sent with the `token` its record was read with (the record's
//! page sends it) acts on that attempt only: if the record has moved on by then (another
//! attempt holds the key, or it was settled), it is refused (409) and nothing changes. A
//! removal also takes the `state` it was read in (the page sends it too), so a record its
//! own holder completed since, under the same token, is not removed either. Without a
//! `token` it acts on whichever attempt is there when it lands. A key is named by
//! `scope` and `key`, or by the page's `ref`, never both. A record's page read while the
//! store fails is a 503 with nothing to act on; a record that is there but does not decode
//! gets a page that says so, and a form to remove it. The record keeps the note of its
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
//! The origin checks guard writes, not reads, and they do not replace the application's
//! auth: a console trusted by network alone (a VPN, an address allow-list) can be read by a
//! page whose name is rebound to its address (DNS rebinding), so mount it behind auth that a
//! browser does not send to another origin. Every stored byte shown in HTML is escaped. The reason of a resolution by hand is kept with
//! the record ([`Record::resolution_note`]) and logged.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::Body;
use axum::extract::{OriginalUri, Request};
use axum::routing::{get, post};
use http::{HeaderMap, Response, StatusCode};
use serde_json::{Value, json};

use crate::key::hex;
use crate::reconcile::downstream_key;
use crate::store::uncertain::{from_ticks, ticks};
use crate::store::{
    IdempotencyStore, Record, ScopedKey, StoreError, StoredResponse, UncertainCursor,
    UncertainQuery,
};

mod api;
mod origin;
mod page;
mod respond;
mod settle;
#[cfg(test)]
mod tests;

use api::{api_purge, api_record, api_remove, api_resolve, api_uncertain};
use origin::origin_of;
use page::{form_purge, form_remove, form_resolve, page_list, page_record};
use respond::{problem, store_failed};
use settle::{bytes_ref, parse_bytes_ref};

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
    /// as not applied is kept from then, for review (default 24 hours; at most
    /// [`LONGEST`](crate::LONGEST), as a route's). Give it at least the routes' TTL: a response
    /// resolved as applied that expires first lets a late retry run the operation again.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl.min(crate::LONGEST);
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
