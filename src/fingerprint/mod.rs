//! Step 4 of the pipeline: what makes two requests "the same operation".
//!
//! A fingerprint is SHA-256 (its first four bytes replaced by the scheme that made it: the
//! hashing's version and the settings that decide what counts, so that a mismatch across
//! replicas configured differently is told from another request) over, in order and each
//! length-prefixed: a version tag, the method,
//! the path, the query (an empty one, `/op?`, is not a missing one), the media type of
//! `Content-Type` with its parameters (lower-cased names and `charset` values, sorted; only a
//! multipart `boundary` and JSON's `charset=utf-8` are left out, as they change nothing; a
//! value that does not read strictly counts as sent, see `media`), the
//! configured extra request headers, the request's trailers if it sent any, and the canonical
//! body:
//!
//! | media type | canonical body |
//! |---|---|
//! | `application/json`, `*+json` | RFC 8785 form: member order and whitespace do not count, values do |
//! | `application/x-www-form-urlencoded` | decoded pairs, sorted |
//! | `multipart/form-data` | the parts (sorted headers, content), not the random boundary |
//! | one registered with [`IdempotencyLayer::canonicalize`](crate::IdempotencyLayer::canonicalize) | what its [`Canonicalize`] returns |
//! | `application/grpc*` | the raw message frames as sent (see [`grpc`](crate::grpc)) |
//! | any of these sent with a `Content-Encoding` other than `identity` | the codings and the bytes as sent, never decoded |
//! | anything else, and empty bodies | the raw bytes |
//!
//! A body that claims a structured type and is not one (invalid JSON, invalid UTF-8, nesting
//! deeper than 128 levels, multipart without one boundary in a `Content-Type` that reads, with
//! folded part headers, or with more than padding after its close delimiter) is refused with
//! 400 before anything is claimed. JSON that is valid but has no exact canonical form
//! (duplicate member names, a number whose canonical form names another value: beyond 2^53
//! precision, beyond double range, underflowing to zero; an escaped UTF-16 surrogate without
//! its pair) is hashed as raw bytes in a domain of its own, so it is never merged with another
//! document. Canonicalisation merges only what is provably the same request.

mod fields;
mod form;
mod json;
mod media;
mod multipart;
mod scheme;
#[cfg(test)]
mod v1_digests;

use std::fmt;
use std::sync::Arc;

use http::{HeaderMap, HeaderName, request::Parts};

pub use fields::{InvalidPointer, JsonFields};
pub(crate) use media::{is_json, media_type, media_with_parameters};
pub(crate) use scheme::{PLAIN_HTTP, Scheme, scheme};
use sha2::{Digest, Sha256};

/// The SHA-256 fingerprint of a request: equal fingerprints mean the same operation.
///
/// Equality and hashing are over the 32 bytes alone. A fingerprint also remembers whether its
/// request's body went into the hash exactly as sent (a JSON body already in canonical form):
/// a hint an in-process store may keep with the record, so that a byte-identical retry is
/// recognised by hashing it as sent, without reading it a second time (see
/// [`IdempotencyStore::recorded_fingerprint_now`](crate::store::IdempotencyStore::recorded_fingerprint_now)). A
/// store that keeps only the bytes loses the hint, and nothing else.
#[derive(Clone, Copy)]
pub struct Fingerprint {
    bytes: [u8; 32],
    as_sent: bool,
}

impl PartialEq for Fingerprint {
    fn eq(&self, other: &Self) -> bool {
        self.bytes == other.bytes
    }
}

impl Eq for Fingerprint {}

impl std::hash::Hash for Fingerprint {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.bytes.hash(state);
    }
}

impl Fingerprint {
    /// The fingerprint of a request with these parts and body, as the layer computes it with
    /// its default settings (no extra headers, no custom canonicalisers).
    pub fn of(parts: &Parts, body: &[u8]) -> Result<Self, MalformedBody> {
        fingerprint(parts, body, &FingerprintOptions::default())
    }

    /// A fingerprint from its 32 bytes (as a store reads it back), without the hint.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self {
            bytes,
            as_sent: false,
        }
    }

    /// The 32 bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.bytes
    }

    /// Whether the request's body went into the hash exactly as sent (see above).
    pub const fn body_as_sent(&self) -> bool {
        self.as_sent
    }

    /// These bytes, with the hint set as given (a store reading back what it kept).
    pub const fn with_body_as_sent(self, as_sent: bool) -> Self {
        Self {
            bytes: self.bytes,
            as_sent,
        }
    }

    /// The digest, its first four bytes replaced by the scheme that made it (see [`scheme`]).
    fn finish(h: Sha256, as_sent: bool, scheme: Scheme) -> Self {
        let mut bytes: [u8; 32] = h.finalize().into();
        bytes[..4].copy_from_slice(&scheme);
        Self { bytes, as_sent }
    }

    /// The four bytes naming how this fingerprint was made: two fingerprints made by other
    /// schemes (another version of this crate, other fingerprint settings) cannot tell whether
    /// their requests are the same.
    pub(crate) fn scheme(&self) -> Scheme {
        [self.bytes[0], self.bytes[1], self.bytes[2], self.bytes[3]]
    }

    /// Whether two fingerprints hashed the same input, whatever their schemes: the rest of
    /// the digest (224 bits) is equal. Every field is tagged and length-prefixed, so one input
    /// is one request however the settings that chose it differ (a canonicaliser for a media
    /// type neither request has; a fingerprint made before schemes were named). Stores compare
    /// all 32 bytes; the layer reads a record through this.
    pub(crate) fn same_input(&self, other: &Self) -> bool {
        self.bytes[4..] == other.bytes[4..]
    }
}

/// The tags hashed first into every fingerprint. Kept while every request that reads as
/// before hashes as before: a retry across an upgrade then still replays.
const HTTP_TAG: &[u8] = b"tower-idempotency/fingerprint/v1";
const JSONRPC_TAG: &[u8] = b"tower-idempotency/jsonrpc/v2";

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", crate::key::hex(&self.bytes[..8]))
    }
}

/// A request body that claims a structured media type and is not well formed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MalformedBody {
    reason: std::borrow::Cow<'static, str>,
    /// Not the body's fault: a custom canonicaliser panicked on it (answered 500).
    panicked: bool,
}

impl MalformedBody {
    /// A malformed-body error with a reason the client will read.
    pub fn new(reason: impl Into<std::borrow::Cow<'static, str>>) -> Self {
        Self {
            reason: reason.into(),
            panicked: false,
        }
    }

    /// Whether a custom canonicaliser panicked, rather than the body being malformed.
    pub(crate) fn panicked(&self) -> bool {
        self.panicked
    }
}

impl fmt::Display for MalformedBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

impl std::error::Error for MalformedBody {}

/// A canonicaliser for a media type of your own: returns the bytes that stand for the body in
/// the fingerprint. Closures `Fn(&[u8]) -> Result<Vec<u8>, MalformedBody>` implement it.
pub trait Canonicalize: Send + Sync + 'static {
    /// The canonical form of `body`, or why it is malformed (answered with 400).
    fn canonicalize(&self, body: &[u8]) -> Result<Vec<u8>, MalformedBody>;
}

impl<F> Canonicalize for F
where
    F: Fn(&[u8]) -> Result<Vec<u8>, MalformedBody> + Send + Sync + 'static,
{
    fn canonicalize(&self, body: &[u8]) -> Result<Vec<u8>, MalformedBody> {
        self(body)
    }
}

/// The RFC 8785 canonical form of a JSON document: `Ok(Some(bytes))`; `Ok(None)` for valid JSON
/// that has no canonical form (duplicate member names, numbers beyond double range, lone
/// UTF-16 surrogate escapes: such bodies are fingerprinted by their raw bytes); `Err` for
/// malformed JSON, wherever in the document.
pub fn canonical_json(body: &[u8]) -> Result<Option<Vec<u8>>, MalformedBody> {
    let mut out = Vec::with_capacity(body.len());
    match json::canonicalize(body, &mut out) {
        Ok(()) => Ok(Some(out)),
        Err(json::JsonError::NotCanonical) => Ok(None),
        Err(json::JsonError::Malformed(reason)) => Err(MalformedBody::new(reason)),
    }
}

/// The fingerprint of a JSON-RPC call: route, method and the exact params without the
/// members named in `not_the_operation` (`_meta`, per-attempt fields); never the request's
/// `id`.
pub(crate) fn jsonrpc(
    parts: &Parts,
    trailers: Option<&HeaderMap>,
    method: &str,
    params: Option<&str>,
    not_the_operation: &[&str],
    options: &FingerprintOptions,
    scheme: Scheme,
) -> Result<Fingerprint, MalformedBody> {
    let mut h = Sha256::new();
    put_field(&mut h, JSONRPC_TAG);
    // Everything the HTTP mode counts (path, query, media type, fingerprint headers)...
    head_into(&mut h, parts, trailers, options, None)?;
    // A body its handler must decode first is another request than the same text sent plain.
    codings_into(&mut h, parts);
    // ...then the call: its method and its params, exact, without `_meta` and the fields a
    // multi-round-trip call changes on each attempt; never its id.
    put_field(&mut h, method.as_bytes());
    match params {
        None => put_field(&mut h, b"no-params"),
        Some(params) => {
            let kept = fields::without_members(params, not_the_operation);
            canonical_field(&mut h, b"params", |buf| fields::exact(&kept, buf))?;
        }
    }
    Ok(Fingerprint::finish(h, false, scheme))
}

/// What goes into a fingerprint besides method, path, query and body.
#[derive(Clone, Default)]
pub(crate) struct FingerprintOptions {
    pub(crate) headers: Vec<HeaderName>,
    pub(crate) custom: Vec<(String, Arc<dyn Canonicalize>)>,
}

impl fmt::Debug for FingerprintOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FingerprintOptions")
            .field("headers", &self.headers)
            .field(
                "custom",
                &self.custom.iter().map(|(m, _)| m).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// Where canonical bytes go: the hasher, or a `Vec` in tests.
pub(crate) trait Sink {
    fn put(&mut self, bytes: &[u8]);
}

impl Sink for Sha256 {
    fn put(&mut self, bytes: &[u8]) {
        self.update(bytes);
    }
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

#[inline]
fn put_len(out: &mut impl Sink, len: usize) {
    out.put(&(len as u64).to_le_bytes());
}

/// A length-prefixed field, so that no two field sequences hash alike.
#[inline]
fn put_field(out: &mut impl Sink, bytes: &[u8]) {
    put_len(out, bytes.len());
    out.put(bytes);
}

/// Canonicalises into this thread's reused buffer and, if that succeeds, hashes the result as
/// one tagged field: a refusal half-way leaves `h` untouched, and one hasher update costs less
/// than many small ones.
fn canonical_field<E>(
    h: &mut Sha256,
    tag: &[u8],
    canonicalize: impl FnOnce(&mut Vec<u8>) -> Result<(), E>,
) -> Result<(), E> {
    // Do not let one huge body pin its buffer for the thread's lifetime.
    crate::reuse::with(
        &SCRATCH,
        |buf| buf.capacity() <= SCRATCH_KEEP,
        |buf| {
            buf.clear();
            let result = canonicalize(buf);
            if result.is_ok() {
                put_field(h, tag);
                put_field(h, buf);
            }
            result
        },
    )
}

/// Whether this thread's fingerprint buffers are destroyed (its thread is ending): for tests
/// that reach [`crate::reuse`]'s fallback.
#[cfg(test)]
pub(crate) fn buffers_gone() -> bool {
    SCRATCH.try_with(|_| ()).is_err() && json::tree_gone()
}

thread_local! {
    /// The canonical form of the JSON body being fingerprinted on this thread.
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The largest scratch buffer kept between requests.
const SCRATCH_KEEP: usize = 64 * 1024;

/// `text` split at `separator`, except inside quoted strings (RFC 9110 §5.6.4).
fn split_outside_quotes(text: &[u8], separator: u8) -> Vec<&[u8]> {
    let (mut pieces, mut start, mut quoted, mut escaped) = (Vec::new(), 0, false, false);
    for (i, &b) in text.iter().enumerate() {
        match b {
            _ if escaped => escaped = false,
            b'\\' if quoted => escaped = true,
            b'"' => quoted = !quoted,
            _ if b == separator && !quoted => {
                pieces.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    pieces.push(&text[start..]);
    pieces
}

/// The elements of a field's lines taken as one comma-separated list; a comma inside a
/// quoted string does not split it.
fn field_elements<'a>(lines: impl Iterator<Item = &'a [u8]>) -> Vec<&'a [u8]> {
    lines
        .flat_map(|line| split_outside_quotes(line, b','))
        .map(<[u8]>::trim_ascii)
        .filter(|element| !element.is_empty())
        .collect()
}

/// Fingerprints a request from its parts and buffered body.
pub(crate) fn fingerprint(
    parts: &Parts,
    body: &[u8],
    options: &FingerprintOptions,
) -> Result<Fingerprint, MalformedBody> {
    fingerprint_fields(
        parts,
        None,
        body,
        options,
        None,
        None,
        scheme(options, None, false),
    )
}

/// Fingerprints a request, counting only the JSON `fields` a route chose, if any, under the
/// route's `scheme` (see [`scheme`]).
///
/// `recorded` is the fingerprint of the outcome already recorded under the request's key, if
/// any. Where its body went into the hash as sent, a JSON body is hashed as sent first: equal,
/// these bytes are that request's canonical body, so they need no reading. The answer is the
/// same either way; only a retry whose bytes changed and are not canonical pays a second hash.
pub(crate) fn fingerprint_fields(
    parts: &Parts,
    trailers: Option<&HeaderMap>,
    body: &[u8],
    options: &FingerprintOptions,
    fields: Option<&JsonFields>,
    recorded: Option<&Fingerprint>,
    scheme: Scheme,
) -> Result<Fingerprint, MalformedBody> {
    let mut h = Sha256::new();
    put_field(&mut h, HTTP_TAG);
    put_field(&mut h, parts.method.as_str().as_bytes());
    let (content_type, media) = head_into(&mut h, parts, trailers, options, Some(body))?;
    if coded_into(&mut h, parts, body) {
        return Ok(Fingerprint::finish(h, false, scheme));
    }
    let recorded = recorded.filter(|r| r.as_sent);
    match body_into(
        &mut h,
        &media,
        content_type,
        body,
        options,
        fields,
        recorded.map(|recorded| (recorded, scheme)),
    )? {
        Hashed::Fed { as_sent } => Ok(Fingerprint::finish(h, as_sent, scheme)),
        Hashed::Done(fingerprint) => Ok(fingerprint),
    }
}

/// What [`body_into`] did with the hash.
enum Hashed {
    /// Fed it the body (`as_sent`: the JSON body exactly as sent).
    Fed { as_sent: bool },
    /// Finished a copy of it: the fingerprint of a JSON body hashed as sent.
    Done(Fingerprint),
}

/// Path, query, media type, fingerprint headers and the request's trailers; hands back
/// `Content-Type` and its media type. `body`: the body [`body_into`] will hash (`None` in the
/// JSON-RPC mode, which reads the call instead).
fn head_into<'p>(
    h: &mut Sha256,
    parts: &'p Parts,
    trailers: Option<&HeaderMap>,
    options: &FingerprintOptions,
    body: Option<&[u8]>,
) -> Result<(&'p str, std::borrow::Cow<'p, str>), MalformedBody> {
    // The path the client sent: a `nest` prefix axum stripped still counts.
    let uri = crate::uri::sent(&parts.extensions, &parts.uri);
    put_field(h, uri.path().as_bytes());
    match uri.query() {
        // `/op?` is not `/op` (RFC 3986 §6.2.3 keeps an empty query): a length no field can
        // have stands for it, so every other request hashes as it always did.
        Some("") => h.put(&u64::MAX.to_le_bytes()),
        query => put_field(h, query.unwrap_or_default().as_bytes()),
    }
    let mut lines = crate::lines::get_all(&parts.headers, &http::header::CONTENT_TYPE);
    let first = lines.next();
    let content_type = match first {
        Some(value) => value
            .to_str()
            .map_err(|_| MalformedBody::new("Content-Type is not visible ASCII"))?,
        None => "",
    };
    // The body is read as the first line says, as `HeaderMap::get` gives it to handlers.
    let media = media_type(content_type);
    match (first, lines.next()) {
        // Absent: as it always hashed.
        (None, _) => put_field(h, b""),
        (Some(_), None) => {
            // The boundary frames the parts only where the parts are what is hashed.
            let framed = media == "multipart/form-data"
                && body.is_some_and(|body| !body.is_empty())
                && !options.custom.iter().any(|(m, _)| *m == *media)
                && !coded(parts);
            put_field(
                h,
                media_with_parameters(content_type, &media, framed).as_bytes(),
            );
        }
        // A field that must be one line sent as several: handlers may read any of them, so
        // each counts as sent, after a NUL that no one line's reading begins with.
        (Some(first), Some(second)) => {
            let all: Vec<&http::HeaderValue> = [first, second].into_iter().chain(lines).collect();
            let mut field = vec![0];
            for line in all {
                field.extend_from_slice(&(line.len() as u64).to_le_bytes());
                field.extend_from_slice(line.as_bytes());
            }
            put_field(h, &field);
        }
    }
    for name in &options.headers {
        // As an HTTP field value (RFC 9110 §5.3, §5.6.1): lines joined by commas, each list
        // element without the whitespace around it, empty elements ignored. One line `a, b`
        // is two lines `a` and `b`; a missing header and an empty one count the same.
        // By name too: instances counting different headers never read two requests as one.
        put_field(h, name.as_str().as_bytes());
        let elements =
            field_elements(crate::lines::get_all(&parts.headers, name).map(|v| v.as_bytes()));
        put_len(h, elements.len());
        for element in elements {
            put_field(h, element);
        }
    }
    // Trailers a client sends after its body (a checksum, a signature) are rare and, when
    // there, part of what it asks: each line counts, by name, repeated names in their order.
    // A request without them hashes as it always did.
    if let Some(trailers) = trailers.filter(|t| !t.is_empty()) {
        let mut lines: Vec<(&HeaderName, &http::HeaderValue)> = trailers.iter().collect();
        lines.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
        put_field(h, b"trailers");
        put_len(h, lines.len());
        for (name, value) in lines {
            put_field(h, name.as_str().as_bytes());
            put_field(h, value.as_bytes());
        }
    }
    Ok((content_type, media))
}

/// A body sent with a `Content-Encoding` (other than `identity`) is hashed as sent, with its
/// codings in order (names without case), and never decoded: `gzip` bytes and the same bytes
/// sent plain are two requests, and what a compressed body means is for the handler to read.
/// Whether it was.
fn coded_into(h: &mut Sha256, parts: &Parts, body: &[u8]) -> bool {
    if !codings_into(h, parts) {
        return false;
    }
    put_field(h, body);
    true
}

/// Whether the request has a content coding other than `identity` (its body is hashed as
/// sent).
fn coded(parts: &Parts) -> bool {
    !codings(parts).is_empty()
}

/// The request's content codings other than `identity`, in order: one reading for both
/// what is hashed and whether a body is read by its parts, so the two always agree.
fn codings(parts: &Parts) -> Vec<&[u8]> {
    // Nearly every request has no coding: answered by the one scan, before any list is built.
    let mut lines =
        crate::lines::get_all(&parts.headers, &http::header::CONTENT_ENCODING).peekable();
    if lines.peek().is_none() {
        return Vec::new();
    }
    field_elements(lines.map(|v| v.as_bytes()))
        .into_iter()
        .filter(|coding| !coding.eq_ignore_ascii_case(b"identity"))
        .collect()
}

/// The request's content codings (other than `identity`), in order and without case, if it
/// has any; whether it had.
fn codings_into(h: &mut Sha256, parts: &Parts) -> bool {
    let codings = codings(parts);
    if codings.is_empty() {
        return false;
    }
    put_field(h, b"coded");
    put_len(h, codings.len());
    for coding in codings {
        put_field(h, &coding.to_ascii_lowercase());
    }
    true
}

fn body_into(
    h: &mut Sha256,
    media: &str,
    content_type: &str,
    body: &[u8],
    options: &FingerprintOptions,
    fields: Option<&JsonFields>,
    // The recorded fingerprint, and this request's scheme.
    recorded: Option<(&Fingerprint, Scheme)>,
) -> Result<Hashed, MalformedBody> {
    const FED: Result<Hashed, MalformedBody> = Ok(Hashed::Fed { as_sent: false });
    if let Some((_, custom)) = options.custom.iter().find(|(m, _)| m == media) {
        put_field(h, b"custom");
        // The application's code: a panic in it is a server error answered as such, not a
        // dropped connection.
        let canonical =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| custom.canonicalize(body)))
                .map_err(|_panic| {
                tracing::error!(media, "the custom canonicaliser panicked");
                MalformedBody {
                    reason: format!("the canonicaliser for {media} failed on this body").into(),
                    panicked: true,
                }
            })??;
        put_field(h, &canonical);
        return FED;
    }
    if body.is_empty() {
        put_field(h, b"raw");
        put_field(h, body);
        return FED;
    }
    if let Some(fields) = fields.filter(|_| is_json(media)) {
        // Valid JSON first: a malformed body is refused whatever fields count.
        canonical_json(body)?;
        let text = std::str::from_utf8(body).map_err(|_| MalformedBody::new(json::NOT_UTF8))?;
        canonical_field(h, b"json-fields", |buf| fields.canonicalize(text, buf))?;
        return FED;
    }
    if is_json(media) {
        // A retry of a body recorded as sent is hashed as sent before anything reads it: the
        // same hash means the same framed bytes in the same domain, so this body is the
        // recorded request's canonical body, and canonical itself. Otherwise the hash goes on
        // from where it was.
        let before = recorded.map(|_| h.clone());
        // A body already in canonical form is its own canonical form: hash it as it is (the
        // check also proves it UTF-8).
        if before.is_some() || json::verbatim(body) {
            put_field(h, b"json");
            put_field(h, body);
            let (Some((recorded, scheme)), Some(before)) = (recorded, before) else {
                return Ok(Hashed::Fed { as_sent: true });
            };
            let sent = Fingerprint::finish(h.clone(), true, scheme);
            if sent == *recorded || json::verbatim(body) {
                return Ok(Hashed::Done(sent));
            }
            *h = before;
        }
        let text = std::str::from_utf8(body).map_err(|_| MalformedBody::new(json::NOT_UTF8))?;
        match canonical_field(h, b"json", |buf| json::canonicalize_text(text, buf)) {
            Ok(()) => return FED,
            Err(json::JsonError::Malformed(reason)) => return Err(MalformedBody::new(reason)),
            Err(json::JsonError::NotCanonical) => {
                // Its own domain: never equal to a body of another media type's raw bytes.
                put_field(h, b"json-raw");
                put_field(h, body);
                return FED;
            }
        }
    } else if media == "application/x-www-form-urlencoded" {
        put_field(h, b"form");
        form::canonicalize(body, h);
        return FED;
    } else if media == "multipart/form-data" {
        canonical_field(h, b"multipart", |buf| {
            multipart::canonicalize(content_type, body, buf)
        })?;
        return FED;
    }
    put_field(h, b"raw");
    put_field(h, body);
    FED
}

#[cfg(test)]
mod tests;
