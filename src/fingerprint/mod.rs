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
#[cfg(test)]
mod v1_digests;

use std::fmt;
use std::sync::Arc;

use http::{HeaderMap, HeaderName, request::Parts};

pub use fields::{InvalidPointer, JsonFields};
pub(crate) use media::{is_json, media_type, media_with_parameters};
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

/// Hashing's versions, which name the schemes: bumped whenever what a fingerprint counts
/// changes, even for a few requests, so that a retry of one recorded under the old reading is
/// told "read another way", never "another request, use a new key". `r2`: `Content-Type`
/// values and multipart bodies read strictly (a value that does not read counts as sent).
const HTTP_SCHEME: &[u8] = b"tower-idempotency/fingerprint/v1/r2";
const JSONRPC_SCHEME: &[u8] = b"tower-idempotency/jsonrpc/v2/r2";

/// How a fingerprint was made: the hashing's version and the settings that decide what counts.
pub(crate) type Scheme = [u8; 4];

/// The scheme of a route's fingerprints: the hashing's version and the settings that decide
/// what counts (fingerprint headers by name, the media types with canonicalisers of their own,
/// the JSON fields the route counts; in the JSON-RPC mode, the headers alone). Four bytes take
/// the place of the digest's first four, so replicas configured differently, or running
/// different versions, tell "another request" apart from "a request read another way", where
/// a client told to use a new key could run an operation a second time. Two schemes share
/// their bytes one time in four billion; a canonicaliser's code cannot be named, only its
/// media type.
pub(crate) fn scheme(
    options: &FingerprintOptions,
    fields: Option<&JsonFields>,
    jsonrpc: bool,
) -> Scheme {
    let (version, custom, fields) = match jsonrpc {
        true => (JSONRPC_SCHEME, &[][..], None),
        false => (HTTP_SCHEME, &options.custom[..], fields),
    };
    // Nearly every route counts no headers, fields or media types of its own: a constant.
    if options.headers.is_empty() && custom.is_empty() && fields.is_none() {
        return match jsonrpc {
            true => PLAIN_JSONRPC,
            false => PLAIN_HTTP,
        };
    }
    let mut hash = fnv(FNV_BASIS, version);
    for name in &options.headers {
        hash = fnv(hash, name.as_str().as_bytes());
    }
    hash = fnv(hash, b"custom");
    for (media, _) in custom {
        hash = fnv(hash, media.as_bytes());
    }
    if let Some(fields) = fields {
        hash = fnv(hash, b"fields");
        fields.name_into(&mut |bytes| hash = fnv(hash, bytes));
    }
    hash.to_be_bytes()
}

/// The scheme of a plain HTTP route that counts nothing of its own (a route's until the layer
/// is built).
pub(crate) const PLAIN_HTTP: Scheme = fnv(fnv(FNV_BASIS, HTTP_SCHEME), b"custom").to_be_bytes();
const PLAIN_JSONRPC: Scheme = fnv(fnv(FNV_BASIS, JSONRPC_SCHEME), b"custom").to_be_bytes();
const FNV_BASIS: u32 = 0x811c_9dc5;

/// FNV-1a over `bytes`' length and `bytes`: stable across processes and versions (it names
/// stored records).
const fn fnv(mut hash: u32, bytes: &[u8]) -> u32 {
    let len = (bytes.len() as u64).to_le_bytes();
    let mut i = 0;
    while i < len.len() {
        hash = (hash ^ len[i] as u32).wrapping_mul(0x0100_0193);
        i += 1;
    }
    let mut i = 0;
    while i < bytes.len() {
        hash = (hash ^ bytes[i] as u32).wrapping_mul(0x0100_0193);
        i += 1;
    }
    hash
}

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
mod tests {
    use super::*;
    use http::Request;
    use proptest::prelude::*;
    use serde_json::{Map, Value};

    fn fp(method: &str, uri: &str, ct: &str, body: &[u8]) -> Result<Fingerprint, MalformedBody> {
        let (parts, ()) = Request::builder()
            .method(method)
            .uri(uri)
            .header("content-type", ct)
            .body(())
            .expect("request")
            .into_parts();
        fingerprint(&parts, body, &FingerprintOptions::default())
    }

    fn fp_with(headers: &[(&str, &str)], uri: &str, body: &[u8]) -> Fingerprint {
        let mut req = Request::builder().method("POST").uri(uri);
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let (parts, ()) = req.body(()).expect("request").into_parts();
        fingerprint(&parts, body, &FingerprintOptions::default()).expect("fingerprint")
    }

    /// DESIGN §1.4: a compressed body is hashed as sent, with its codings, never decoded nor
    /// refused: the same bytes without the coding, or under another, are other requests.
    #[test]
    fn content_codings_count_and_coded_bodies_are_hashed_as_sent() {
        let json = [("content-type", "application/json")];
        let gz = [
            ("content-type", "application/json"),
            ("content-encoding", "gzip"),
        ];
        // Not JSON, and not refused: it is compressed.
        let coded = fp_with(&gz, "/a", b"\x1f\x8b\x08\x00");
        assert_eq!(coded, fp_with(&gz, "/a", b"\x1f\x8b\x08\x00"));
        assert_ne!(coded, fp_with(&gz, "/a", b"\x1f\x8b\x08\x01"));
        let plain = [("content-type", "application/octet-stream")];
        let plain_gz = [
            ("content-type", "application/octet-stream"),
            ("content-encoding", "gzip"),
        ];
        assert_ne!(fp_with(&plain, "/a", b"x"), fp_with(&plain_gz, "/a", b"x"));
        // Codings are names without case, in their order, lines and list elements alike.
        let spelled = |value: &'static str| {
            fp_with(
                &[
                    ("content-type", "application/octet-stream"),
                    ("content-encoding", value),
                ],
                "/a",
                b"x",
            )
        };
        assert_eq!(spelled("gzip"), spelled("GZip"));
        assert_eq!(spelled("gzip, br"), spelled(" gzip ,br"));
        assert_ne!(spelled("gzip, br"), spelled("br, gzip"));
        assert_ne!(spelled("gzip"), spelled("br"));
        // `identity` is no coding: JSON is read as JSON.
        let identity = [
            ("content-type", "application/json"),
            ("content-encoding", "identity"),
        ];
        assert_eq!(
            fp_with(&identity, "/a", br#"{"b":1, "a":2}"#),
            fp_with(&json, "/a", br#"{"a":2,"b":1}"#)
        );
        // A coded JSON body hashes as sent: key order counts.
        assert_ne!(
            fp_with(&gz, "/a", br#"{"b":1,"a":2}"#),
            fp_with(&gz, "/a", br#"{"a":2,"b":1}"#)
        );
    }

    /// DESIGN §1.3–4: a request's trailers count, by name, repeated names in their order;
    /// a request without them (or with none in its trailers frame) hashes as before.
    #[test]
    fn trailers_count_when_sent() {
        let (parts, ()) = Request::builder()
            .method("POST")
            .uri("/a")
            .body(())
            .expect("request")
            .into_parts();
        let options = FingerprintOptions::default();
        let with = |lines: &[(&'static str, &'static str)]| {
            let mut trailers = HeaderMap::new();
            for (name, value) in lines {
                trailers.append(*name, http::HeaderValue::from_static(value));
            }
            fingerprint_fields(
                &parts,
                Some(&trailers),
                b"x",
                &options,
                None,
                None,
                scheme(&options, None, false),
            )
            .expect("fingerprint")
        };
        let none = fingerprint(&parts, b"x", &options).expect("fingerprint");
        assert_eq!(with(&[]), none);
        assert_ne!(with(&[("x-checksum", "1")]), none);
        assert_ne!(with(&[("x-checksum", "1")]), with(&[("x-checksum", "2")]));
        assert_eq!(
            with(&[("x-a", "1"), ("x-b", "2")]),
            with(&[("x-b", "2"), ("x-a", "1")])
        );
        assert_ne!(
            with(&[("x-a", "1"), ("x-a", "2")]),
            with(&[("x-a", "2"), ("x-a", "1")])
        );
    }

    /// DESIGN §1.4: `/op?` is not `/op`; every other query hashes as it did.
    #[test]
    fn an_empty_query_is_not_no_query() {
        let ct = [("content-type", "text/plain")];
        assert_ne!(fp_with(&ct, "/op?", b"x"), fp_with(&ct, "/op", b"x"));
        assert_ne!(fp_with(&ct, "/op?", b"x"), fp_with(&ct, "/op??", b"x"));
        assert_ne!(fp_with(&ct, "/op?a", b"x"), fp_with(&ct, "/op", b"x"));
    }

    #[test]
    fn method_path_query_and_type_count() {
        let base = fp("POST", "/a?x=1", "application/json", b"{}").expect("fp");
        assert_eq!(
            base,
            fp("POST", "/a?x=1", "Application/JSON; charset=utf-8", b"{ }").expect("fp")
        );
        assert_ne!(
            base,
            fp("PATCH", "/a?x=1", "application/json", b"{}").expect("fp")
        );
        assert_ne!(
            base,
            fp("POST", "/b?x=1", "application/json", b"{}").expect("fp")
        );
        assert_ne!(
            base,
            fp("POST", "/a?x=2", "application/json", b"{}").expect("fp")
        );
        assert_ne!(base, fp("POST", "/a?x=1", "text/plain", b"{}").expect("fp"));
    }

    /// Issue 16 §3: fingerprint headers are compared as HTTP field values.
    #[test]
    fn fingerprint_headers_count_as_field_values() {
        let options = FingerprintOptions {
            headers: vec![HeaderName::from_static("x-api-version")],
            ..Default::default()
        };
        let with = |lines: &[&str]| {
            let mut req = Request::post("/").header("content-type", "application/json");
            for line in lines {
                req = req.header("x-api-version", *line);
            }
            let (parts, ()) = req.body(()).expect("request").into_parts();
            fingerprint(&parts, b"{}", &options).expect("fp")
        };
        let one_line = with(&["a, b"]);
        assert_eq!(one_line, with(&["a", "b"]));
        assert_eq!(one_line, with(&["a ,b"]));
        assert_eq!(one_line, with(&["a,\tb", ""]));
        assert_ne!(one_line, with(&["b, a"]), "order counts");
        assert_ne!(one_line, with(&["a b"]));
        assert_ne!(
            with(&["\"a,b\""]),
            with(&["\"a\", \"b\""]),
            "a quoted comma is data"
        );
        assert_eq!(with(&[]), with(&[""]), "missing and empty count the same");
        assert_ne!(with(&[]), with(&["a"]));
    }

    /// Issue 16 §2: media-type parameters count, but for those that provably change nothing.
    #[test]
    fn content_type_parameters_count() {
        let plain = fp("POST", "/", "text/plain", b"caf\xe9").expect("fp");
        assert_ne!(
            plain,
            fp("POST", "/", "text/plain; charset=latin1", b"caf\xe9").expect("fp")
        );
        assert_ne!(
            fp("POST", "/", "text/csv; header=present", b"a,b").expect("fp"),
            fp("POST", "/", "text/csv; header=absent", b"a,b").expect("fp")
        );
        assert_eq!(
            fp(
                "POST",
                "/",
                "text/plain; charset=latin1; format=flowed",
                b"x"
            )
            .expect("fp"),
            fp(
                "POST",
                "/",
                "TEXT/plain;Format=\"flowed\" ; CHARSET=latin1",
                b"x"
            )
            .expect("fp"),
            "parameter order, name case and quoting do not count"
        );
        assert_eq!(
            fp("POST", "/", "application/json; charset=UTF-8", b"{}").expect("fp"),
            fp("POST", "/", "application/json", b"{}").expect("fp"),
            "JSON is UTF-8 by definition"
        );
        assert_ne!(
            fp("POST", "/", "application/json; profile=a", b"{}").expect("fp"),
            fp("POST", "/", "application/json", b"{}").expect("fp"),
        );
        // RFC 9110 §8.3.2: a charset's name has no case; other values keep theirs.
        assert_eq!(
            fp("POST", "/", "text/plain; charset=LATIN1", b"x").expect("fp"),
            fp("POST", "/", "text/plain; charset=\"latin1\"", b"x").expect("fp"),
        );
        assert_ne!(
            fp("POST", "/", "text/plain; charset=latin1", b"x").expect("fp"),
            fp("POST", "/", "text/plain; charset=latin2", b"x").expect("fp"),
        );
        assert_ne!(
            fp("POST", "/", "text/csv; header=Present", b"a,b").expect("fp"),
            fp("POST", "/", "text/csv; header=present", b"a,b").expect("fp"),
        );
        // A `;` inside a quoted value is data, and a repeated parameter keeps its order.
        assert_ne!(
            fp("POST", "/", r#"text/plain; a="x;b=y""#, b"hi").expect("fp"),
            fp("POST", "/", r#"text/plain; a="\"x"; b="y\"""#, b"hi").expect("fp"),
        );
        assert_ne!(
            fp("POST", "/", "text/plain; a=1; a=2", b"hi").expect("fp"),
            fp("POST", "/", "text/plain; a=2; a=1", b"hi").expect("fp"),
        );
    }

    /// The media type as it was read before its fast paths: every parameter dropped, `trim`
    /// (Unicode whitespace), lower-cased.
    fn media_type_reference(content_type: &str) -> String {
        let end = content_type.find(';').unwrap_or(content_type.len());
        content_type[..end].trim().to_ascii_lowercase()
    }

    #[test]
    fn media_type_agrees_with_the_plain_reading() {
        // §3.2: the media type is part of the fingerprint, so a fast path must read exactly
        // what the plain reading does, on every whitespace and case.
        let cases = [
            "application/json",
            "Application/JSON",
            "application/json; charset=utf-8",
            " application/json ",
            "\x0bapplication/json\x0c",
            "\t\r\napplication/json\t;x=1",
            "application/json\u{a0}",
            "\u{a0}Text/Plain ; q",
            "",
            " ",
            ";",
            "application/json;",
            "application/jsonx",
            "APPLICATION/JSON",
            "application/problem+json",
        ];
        for case in cases {
            assert_eq!(media_type(case), media_type_reference(case), "{case:?}");
        }
    }

    proptest! {
        #[test]
        fn media_type_agrees_on_any_text(text in "[ \t\n\x0b\x0c\ra-zA-Z/+;=\u{a0}\u{2003}é]{0,24}") {
            prop_assert_eq!(media_type(&text), media_type_reference(&text));
        }
    }

    /// §1 step 4: a fingerprint names its scheme (the hashing's version and the settings that
    /// decide what counts) in its first four bytes: the same settings in any spelling name one
    /// scheme, other settings another, so a replica configured otherwise can tell "another
    /// request" from "a request read another way".
    #[test]
    fn fingerprints_name_the_settings_that_made_them() {
        let (parts, ()) = Request::builder()
            .method("POST")
            .uri("/op")
            .header("content-type", "application/json")
            .header("x-api-version", "2")
            .body(())
            .expect("request")
            .into_parts();
        let body = br#"{"a":1,"ts":2,"b":3}"#;
        let with = |options: &FingerprintOptions, fields: Option<&JsonFields>| {
            fingerprint_fields(
                &parts,
                None,
                body,
                options,
                fields,
                None,
                scheme(options, fields, false),
            )
            .expect("fingerprint")
        };
        let plain = FingerprintOptions::default();
        let header = |name: &'static str| FingerprintOptions {
            headers: vec![HeaderName::from_static(name)],
            ..FingerprintOptions::default()
        };
        let exclude = |list: &[&str]| JsonFields::exclude(list.iter().copied()).expect("pointers");
        let include = |list: &[&str]| JsonFields::include(list.iter().copied()).expect("pointers");
        let default = with(&plain, None);
        assert_eq!(default.scheme(), PLAIN_HTTP);
        assert_eq!(
            default,
            fp("POST", "/op", "application/json", body).expect("fp")
        );
        // Other settings, another scheme, whatever the request.
        let others = [
            with(&header("x-api-version"), None),
            with(&header("x-tenant"), None),
            with(&plain, Some(&exclude(&["/ts"]))),
            with(&plain, Some(&exclude(&["/ts", "/b"]))),
            with(&plain, Some(&include(&["/ts"]))),
            with(&plain, Some(&include(&["/a", "/b"]))),
        ];
        let mut schemes: Vec<Scheme> = others.iter().map(Fingerprint::scheme).collect();
        schemes.push(default.scheme());
        let count = schemes.len();
        schemes.sort_unstable();
        schemes.dedup();
        assert_eq!(schemes.len(), count, "each setting names its own scheme");
        // A list of fields in any order, once each, is one setting.
        assert_eq!(
            with(&plain, Some(&exclude(&["/ts", "/b"]))),
            with(&plain, Some(&exclude(&["/b", "/ts", "/b"])))
        );
        assert_eq!(
            with(&plain, Some(&include(&["/a", "/b"]))),
            with(&plain, Some(&include(&["/b", "/a", "/a"])))
        );
        // The JSON-RPC mode is a scheme of its own.
        let call = jsonrpc(
            &parts,
            None,
            "tools/call",
            Some("{}"),
            &[],
            &plain,
            scheme(&plain, None, true),
        )
        .expect("call");
        assert_eq!(call.scheme(), PLAIN_JSONRPC);
        assert_ne!(PLAIN_JSONRPC, PLAIN_HTTP);
    }

    /// The hint is not part of the fingerprint: equal bytes, equal fingerprints, one hash.
    #[test]
    fn the_hint_is_not_part_of_the_fingerprint() {
        use std::hash::BuildHasher;
        let a = Fingerprint::from_bytes([9; 32]);
        let b = a.with_body_as_sent(true);
        assert!(!a.body_as_sent() && b.body_as_sent());
        assert_eq!(a, b);
        let state = std::hash::RandomState::new();
        assert_eq!(state.hash_one(a), state.hash_one(b));
        assert_ne!(a, Fingerprint::from_bytes([8; 32]).with_body_as_sent(true));
        // Hashed as sent only where the body went in as sent.
        let canonical = fp("POST", "/", "application/json", br#"{"a":1}"#).expect("fp");
        let spaced = fp("POST", "/", "application/json", br#"{ "a": 1 }"#).expect("fp");
        assert_eq!(canonical, spaced);
        assert!(canonical.body_as_sent() && !spaced.body_as_sent());
        assert!(
            !fp("POST", "/", "text/plain", b"x")
                .expect("fp")
                .body_as_sent()
        );
    }

    #[test]
    fn non_canonical_json_is_hashed_raw_never_merged() {
        let dup = fp("POST", "/", "application/json", br#"{"a":1,"a":2}"#).expect("fp");
        let last_wins = fp("POST", "/", "application/json", br#"{"a":2}"#).expect("fp");
        assert_ne!(dup, last_wins);
    }

    #[test]
    fn custom_canonicaliser_is_used() {
        let (parts, ()) = Request::post("/")
            .header("content-type", "text/x-upper")
            .body(())
            .expect("request")
            .into_parts();
        let options = FingerprintOptions {
            custom: vec![(
                "text/x-upper".into(),
                Arc::new(|b: &[u8]| Ok(b.to_ascii_uppercase())) as Arc<dyn Canonicalize>,
            )],
            ..Default::default()
        };
        let a = fingerprint(&parts, b"abc", &options).expect("fp");
        assert_eq!(a, fingerprint(&parts, b"ABC", &options).expect("fp"));
        assert_ne!(a, fingerprint(&parts, b"abd", &options).expect("fp"));
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            // Integers a double holds exactly: beyond 2^53 a number has no canonical form.
            (-(1i64 << 53)..=(1i64 << 53)).prop_map(Value::from),
            (-1e300f64..1e300).prop_map(Value::from),
            "[a-z\u{e9}\u{1f600}\u{7f}\u{2028}\u{0}-\u{1f}\"\\\\\n ]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::btree_map("[a-zA-Z\u{fb33}\u{1f600}]{1,6}", inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
            ]
        })
    }

    /// JSON number texts crowded around the places doubles round: few digits, many digits,
    /// near 2^53, tiny and huge exponents, zeros written many ways.
    fn number_text() -> impl Strategy<Value = String> {
        (
            any::<bool>(),
            prop_oneof![
                "[0-9]{1,3}",
                "[1-9][0-9]{14,22}",
                Just("9007199254740992".to_owned()),
                Just("9007199254740993".to_owned()),
                Just("0".to_owned()),
            ],
            prop::option::of("[0-9]{1,20}"),
            prop::option::of(prop_oneof![-400i32..-300, -30i32..30, 300i32..330]),
        )
            .prop_map(|(negative, int, frac, exp)| {
                let int = if int.len() > 1 {
                    int.trim_start_matches('0').to_owned()
                } else {
                    int
                };
                let int = if int.is_empty() { "0".to_owned() } else { int };
                let mut text = format!("{}{int}", if negative { "-" } else { "" });
                if let Some(frac) = frac {
                    text += &format!(".{frac}");
                }
                if let Some(exp) = exp {
                    text += &format!("e{exp}");
                }
                text
            })
    }

    /// Writes `v` with members in reverse order and generous whitespace.
    fn reorder(v: &Value) -> String {
        match v {
            Value::Object(m) => {
                let members: Vec<String> = m
                    .iter()
                    .rev()
                    .map(|(k, v)| format!("\n  {} :\t{}", Value::String(k.clone()), reorder(v)))
                    .collect();
                format!("{{ {} }}", members.join(" , "))
            }
            Value::Array(items) => {
                format!(
                    "[ {} ]",
                    items.iter().map(reorder).collect::<Vec<_>>().join(" ,\n")
                )
            }
            other => other.to_string(),
        }
    }

    /// Changes one leaf (the first found, depth first), or adds one where there is none.
    fn perturb(v: &mut Value) -> bool {
        match v {
            Value::Null => *v = Value::Bool(false),
            Value::Bool(b) => *b = !*b,
            Value::Number(n) => {
                let x = n.as_f64().unwrap_or(0.0);
                *v = Value::from(if x.abs() > 1e15 { x * 2.0 } else { x + 1.0 });
            }
            Value::String(s) => s.push('x'),
            // A container without leaves changes by gaining one.
            Value::Array(items) => {
                if !items.iter_mut().any(perturb) {
                    items.push(Value::Null);
                }
            }
            Value::Object(m) => {
                if !m.values_mut().any(perturb) {
                    m.insert("added".into(), Value::Null);
                }
            }
        }
        true
    }

    proptest! {
        #[test]
        fn json_fingerprint_ignores_order_and_whitespace(v in json_value()) {
            let compact = serde_json::to_vec(&v).expect("serialize");
            let a = fp("POST", "/t", "application/json", &compact).expect("fp");
            let b = fp("POST", "/t", "application/json", reorder(&v).as_bytes()).expect("fp");
            prop_assert_eq!(a, b);
        }

        #[test]
        fn canonical_json_matches_the_reference_implementation(v in json_value()) {
            let compact = serde_json::to_vec(&v).expect("serialize");
            let ours = canonical_json(&compact).expect("valid").expect("canonical");
            let reference = serde_json_canonicalizer::to_vec(&v).expect("reference");
            prop_assert_eq!(String::from_utf8_lossy(&ours), String::from_utf8_lossy(&reference));
        }

        #[test]
        fn verbatim_fast_path_takes_only_canonical_bodies(v in json_value()) {
            // serde_json writes compact JSON with members in UTF-8 order: canonical unless a
            // name outside the BMP meets one above U+E000, or a number prints differently.
            let compact = serde_json::to_vec(&v).expect("serialize");
            let reference = serde_json_canonicalizer::to_vec(&v).expect("reference");
            if json::verbatim(&compact) {
                prop_assert_eq!(&compact, &reference);
            }
            prop_assert!(json::verbatim(&reference));
            // Either path, the same fingerprint.
            let a = fp("POST", "/t", "application/json", &compact).expect("fp");
            let b = fp("POST", "/t", "application/json", &reference).expect("fp");
            prop_assert_eq!(a, b);
        }

        /// The fingerprint of a retry is the same with the recorded fingerprint's hint as
        /// without it, whatever the first body and the retry (the same bytes, reordered,
        /// changed, broken, not UTF-8, in another media type): the hint only saves reading a
        /// body sent again as it was recorded.
        #[test]
        fn a_recorded_fingerprint_changes_no_fingerprint(
            v in json_value(),
            shape in 0..7u8,
            at in any::<prop::sample::Index>(),
            byte in any::<u8>(),
        ) {
            let canonical = serde_json_canonicalizer::to_vec(&v).expect("reference");
            let mut changed = v.clone();
            perturb(&mut changed);
            let retry: Vec<u8> = match shape {
                0 => canonical.clone(),
                1 => reorder(&v).into_bytes(),
                2 => serde_json_canonicalizer::to_vec(&changed).expect("reference"),
                3 => { let mut b = canonical.clone(); let i = at.index(b.len()); b[i] = byte; b }
                4 => canonical[..at.index(canonical.len())].to_vec(),
                5 => [&canonical[..], b" "].concat(),
                _ => [&b" "[..], &canonical[..]].concat(),
            };
            let parts = |ct: &str| Request::post("/t").header("content-type", ct).body(()).expect("request").into_parts().0;
            let options = FingerprintOptions::default();
            let json = parts("application/json");
            let recorded = fingerprint_fields(&json, None, &canonical, &options, None, None, scheme(&options, None, false)).expect("fp");
            prop_assert!(recorded.body_as_sent(), "a canonical body is hashed as sent");
            for ct in ["application/json", "application/problem+json", "text/plain"] {
                let parts = parts(ct);
                let plain = fingerprint_fields(&parts, None, &retry, &options, None, None, scheme(&options, None, false));
                let hinted = fingerprint_fields(&parts, None, &retry, &options, None, Some(&recorded), scheme(&options, None, false));
                match (&plain, &hinted) {
                    (Ok(a), Ok(b)) => {
                        prop_assert_eq!(a.as_bytes(), b.as_bytes());
                        prop_assert_eq!(a.body_as_sent(), b.body_as_sent());
                    }
                    (Err(a), Err(b)) => prop_assert_eq!(a, b),
                    _ => prop_assert!(false, "{plain:?} / {hinted:?}"),
                }
                // A hint from a record whose body was not hashed as sent is not used.
                let other = Fingerprint::from_bytes(*recorded.as_bytes());
                let unhinted = fingerprint_fields(&parts, None, &retry, &options, None, Some(&other), scheme(&options, None, false));
                prop_assert_eq!(plain.map(|f| *f.as_bytes()), unhinted.map(|f| *f.as_bytes()));
            }
            prop_assert_eq!(
                fingerprint_fields(&json, None, &retry, &options, None, Some(&recorded), scheme(&options, None, false)).ok() == Some(recorded),
                retry == canonical || serde_json::from_slice::<Value>(&retry).ok()
                    .and_then(|r| serde_json_canonicalizer::to_vec(&r).ok()) == Some(canonical.clone()),
                "a retry matches exactly when it is the same JSON"
            );
        }

        #[test]
        fn verbatim_passes_no_body_that_is_not_utf8(
            v in json_value(),
            at in any::<prop::sample::Index>(),
            byte in 0x80u8..=0xff,
        ) {
            // A canonical body with one byte past ASCII written over any of its bytes: where
            // the check still says canonical the body must be UTF-8, and a body that is not
            // UTF-8 must fail to fingerprint, whichever path sees it.
            let mut body = serde_json_canonicalizer::to_vec(&v).expect("reference");
            let i = at.index(body.len());
            body[i] = byte;
            let utf8 = std::str::from_utf8(&body).is_ok();
            if json::verbatim(&body) {
                prop_assert!(utf8, "{:?}", String::from_utf8_lossy(&body));
            }
            let fingerprinted = fp("POST", "/t", "application/json", &body);
            if !utf8 {
                prop_assert!(fingerprinted.is_err());
            }
        }

        #[test]
        fn verbatim_numbers_are_exactly_the_canonical_ones(
            negative in any::<bool>(),
            mantissa in 0u64..10_000_000_000_000_000,
            point in 0usize..20,
            zeros in 0usize..8,
            exponent in prop::option::of(-30i32..30),
        ) {
            // Decimals of every length, point position and leading or trailing zeros.
            let digits = mantissa.to_string();
            let point = point.min(digits.len());
            let mut text = String::from(if negative { "-" } else { "" });
            if point == 0 {
                text += "0.";
                text += &"0".repeat(zeros);
                text += &digits;
            } else if point == digits.len() {
                text += &digits;
            } else {
                text += &digits[..point];
                text += ".";
                text += &digits[point..];
            }
            if let Some(e) = exponent {
                text += &format!("e{e}");
            }
            let value: Value = serde_json::from_str(&text).expect("json");
            let reference = serde_json_canonicalizer::to_vec(&value).expect("reference");
            let Some(canonical) = canonical_json(text.as_bytes()).expect("valid") else {
                // More digits than a double holds: RFC 8785 would round it into another
                // number's form, so it has none here (issue 16 §2).
                prop_assert!(!json::verbatim(text.as_bytes()), "{}", text);
                let round_trip: f64 = String::from_utf8_lossy(&reference).parse().expect("number");
                let exact: f64 = text.parse().expect("number");
                prop_assert_eq!(round_trip, exact);
                return Ok(());
            };
            prop_assert_eq!(json::verbatim(text.as_bytes()), canonical == text.as_bytes(), "{}", text);
            // And the full path writes what the reference writes, by either route.
            prop_assert_eq!(String::from_utf8_lossy(&canonical), String::from_utf8_lossy(&reference), "{}", text);
        }

        #[test]
        fn numbers_fingerprint_alike_only_when_exactly_equal(
            a in number_text(),
            b in number_text(),
        ) {
            let same = fp("POST", "/", "application/json", a.as_bytes()).expect("fp")
                == fp("POST", "/", "application/json", b.as_bytes()).expect("fp");
            let exact = |t: &str| t.parse::<bigdecimal::BigDecimal>().expect("decimal");
            if same {
                prop_assert_eq!(exact(&a), exact(&b), "{} and {}", a, b);
            }
            // And a number equal to its own canonical form always merges with it.
            if let Some(canonical) = canonical_json(a.as_bytes()).expect("valid") {
                let canonical = String::from_utf8(canonical).expect("utf-8");
                prop_assert_eq!(exact(&a), exact(&canonical), "{} canonicalised to {}", a, canonical);
            }
        }

        #[test]
        fn json_fingerprint_changes_with_any_value(v in json_value()) {
            let mut changed = v.clone();
            prop_assume!(perturb(&mut changed));
            let a = fp("POST", "/t", "application/json", &serde_json::to_vec(&v).expect("ser")).expect("fp");
            let b = fp("POST", "/t", "application/json", &serde_json::to_vec(&changed).expect("ser")).expect("fp");
            prop_assert_ne!(a, b);
        }
    }
}
