//! Step 4 of the pipeline: what makes two requests "the same operation".
//!
//! A fingerprint is SHA-256 over, in order and each length-prefixed: a version tag, the method,
//! the path, the query, the media type of `Content-Type` (lower-cased, without parameters), the
//! configured extra request headers, and the canonical body:
//!
//! | media type | canonical body |
//! |---|---|
//! | `application/json`, `*+json` | RFC 8785 form: member order and whitespace do not count, values do |
//! | `application/x-www-form-urlencoded` | decoded pairs, sorted |
//! | `multipart/form-data` | the parts (sorted headers, content), not the random boundary |
//! | one registered with [`IdempotencyLayer::canonicalize`](crate::IdempotencyLayer::canonicalize) | what its [`Canonicalize`] returns |
//! | `application/grpc*` | the raw message frames as sent (see [`grpc`](crate::grpc)) |
//! | anything else, and empty bodies | the raw bytes |
//!
//! A body that claims a structured type and is not one (invalid JSON, invalid UTF-8, nesting
//! deeper than 128 levels, multipart without its boundary) is refused with 400 before anything
//! is claimed. JSON that is valid but has no RFC 8785 form (duplicate member names, numbers
//! outside double range) is hashed as raw bytes, so it is never merged with another document.

mod form;
mod json;
mod multipart;

use std::fmt;
use std::sync::Arc;

use http::{HeaderName, request::Parts};
use sha2::{Digest, Sha256};

/// The SHA-256 fingerprint of a request: equal fingerprints mean the same operation.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of a request with these parts and body, as the layer computes it with
    /// its default settings (no extra headers, no custom canonicalisers).
    pub fn of(parts: &Parts, body: &[u8]) -> Result<Self, MalformedBody> {
        fingerprint(parts, body, &FingerprintOptions::default())
    }

    /// A fingerprint from its 32 bytes (as a store reads it back).
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The 32 bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", crate::key::hex(&self.0[..8]))
    }
}

/// A request body that claims a structured media type and is not well formed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MalformedBody {
    reason: std::borrow::Cow<'static, str>,
}

impl MalformedBody {
    /// A malformed-body error with a reason the client will read.
    pub fn new(reason: impl Into<std::borrow::Cow<'static, str>>) -> Self {
        Self {
            reason: reason.into(),
        }
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
/// that has no canonical form (duplicate member names, numbers beyond double range: such
/// bodies are fingerprinted by their raw bytes); `Err` for malformed JSON.
pub fn canonical_json(body: &[u8]) -> Result<Option<Vec<u8>>, MalformedBody> {
    let mut out = Vec::with_capacity(body.len());
    match json::canonicalize(body, &mut out) {
        Ok(()) => Ok(Some(out)),
        Err(json::JsonError::NotCanonical) => Ok(None),
        Err(json::JsonError::Malformed(reason)) => Err(MalformedBody::new(reason)),
    }
}

/// The fingerprint of a JSON-RPC call: route, method and the canonical params (already
/// stripped of `_meta` and per-attempt fields); never the request's `id`.
pub(crate) fn jsonrpc(parts: &Parts, method: &str, params: &serde_json::Value) -> Fingerprint {
    let mut h = Sha256::new();
    put_field(&mut h, b"tower-idempotency/jsonrpc/v1");
    put_field(&mut h, parts.uri.path().as_bytes());
    put_field(&mut h, method.as_bytes());
    // Written straight from the parsed params: no second serialisation and parse.
    let written: Result<(), std::convert::Infallible> = canonical_field(&mut h, b"params", |buf| {
        json::write_parsed(params, buf);
        Ok(())
    });
    let Ok(()) = written;
    Fingerprint(h.finalize().into())
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

fn put_len(out: &mut impl Sink, len: usize) {
    out.put(&(len as u64).to_le_bytes());
}

/// A length-prefixed field, so that no two field sequences hash alike.
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
    SCRATCH.with_borrow_mut(|buf| {
        buf.clear();
        let result = canonicalize(buf);
        if result.is_ok() {
            put_field(h, tag);
            put_field(h, buf);
        }
        // Do not let one huge body pin its buffer for the thread's lifetime.
        if buf.capacity() > SCRATCH_KEEP {
            *buf = Vec::new();
        }
        result
    })
}

thread_local! {
    /// The canonical form of the JSON body being fingerprinted on this thread.
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The largest scratch buffer kept between requests.
const SCRATCH_KEEP: usize = 64 * 1024;

/// The media type of a `Content-Type` value: lower-cased, parameters dropped.
pub(crate) fn media_type(content_type: &str) -> std::borrow::Cow<'_, str> {
    let media = content_type.split(';').next().unwrap_or_default().trim();
    if media.bytes().any(|b| b.is_ascii_uppercase()) {
        media.to_ascii_lowercase().into()
    } else {
        media.into()
    }
}

pub(crate) fn is_json(media_type: &str) -> bool {
    media_type == "application/json" || media_type.ends_with("+json")
}

/// Fingerprints a request from its parts and buffered body.
pub(crate) fn fingerprint(
    parts: &Parts,
    body: &[u8],
    options: &FingerprintOptions,
) -> Result<Fingerprint, MalformedBody> {
    let mut h = Sha256::new();
    put_field(&mut h, b"tower-idempotency/fingerprint/v1");
    put_field(&mut h, parts.method.as_str().as_bytes());
    put_field(&mut h, parts.uri.path().as_bytes());
    put_field(&mut h, parts.uri.query().unwrap_or_default().as_bytes());
    let content_type = match parts.headers.get(http::header::CONTENT_TYPE) {
        Some(value) => value
            .to_str()
            .map_err(|_| MalformedBody::new("Content-Type is not visible ASCII"))?,
        None => "",
    };
    let media = media_type(content_type);
    put_field(&mut h, media.as_bytes());
    for name in &options.headers {
        let values = parts.headers.get_all(name);
        put_len(&mut h, values.iter().count());
        for value in values {
            put_field(&mut h, value.as_bytes());
        }
    }
    body_into(&mut h, &media, content_type, body, options)?;
    Ok(Fingerprint(h.finalize().into()))
}

fn body_into(
    h: &mut Sha256,
    media: &str,
    content_type: &str,
    body: &[u8],
    options: &FingerprintOptions,
) -> Result<(), MalformedBody> {
    if let Some((_, custom)) = options.custom.iter().find(|(m, _)| m == media) {
        put_field(h, b"custom");
        put_field(h, &custom.canonicalize(body)?);
        return Ok(());
    }
    if body.is_empty() {
        put_field(h, b"raw");
        put_field(h, body);
        return Ok(());
    }
    if is_json(media) {
        // A body already in canonical form is its own canonical form: hash it as it is (the
        // check also proves it UTF-8).
        if json::verbatim(body) {
            put_field(h, b"json");
            put_field(h, body);
            return Ok(());
        }
        let text = std::str::from_utf8(body).map_err(|_| MalformedBody::new(json::NOT_UTF8))?;
        match canonical_field(h, b"json", |buf| json::canonicalize_text(text, buf)) {
            Ok(()) => return Ok(()),
            Err(json::JsonError::Malformed(reason)) => return Err(MalformedBody::new(reason)),
            Err(json::JsonError::NotCanonical) => {}
        }
    } else if media == "application/x-www-form-urlencoded" {
        put_field(h, b"form");
        form::canonicalize(body, h);
        return Ok(());
    } else if media == "multipart/form-data" {
        return canonical_field(h, b"multipart", |buf| {
            multipart::canonicalize(content_type, body, buf)
        });
    }
    put_field(h, b"raw");
    put_field(h, body);
    Ok(())
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
            any::<i64>().prop_map(Value::from),
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
            let canonical = canonical_json(text.as_bytes()).expect("valid").expect("finite");
            prop_assert_eq!(json::verbatim(text.as_bytes()), canonical == text.as_bytes(), "{}", text);
            // And the full path writes what the reference writes, by either route.
            let value: Value = serde_json::from_str(&text).expect("json");
            let reference = serde_json_canonicalizer::to_vec(&value).expect("reference");
            prop_assert_eq!(String::from_utf8_lossy(&canonical), String::from_utf8_lossy(&reference), "{}", text);
        }

        #[test]
        fn parsed_values_canonicalise_like_their_text(v in json_value()) {
            let text = serde_json::to_vec(&v).expect("serialize");
            let mut parsed = Vec::new();
            json::write_parsed(&v, &mut parsed);
            prop_assert_eq!(Some(parsed), canonical_json(&text).expect("valid"));
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
