//! Step 1 of the pipeline: read and validate the `Idempotency-Key` (step 2 scopes it: see
//! [`crate::scope`]).

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use http::{HeaderMap, HeaderName, HeaderValue};

/// The longest key accepted, in bytes, after removing sf-string quoting.
pub const MAX_KEY_LEN: usize = 255;

/// The default header carrying the key.
pub static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// Why a request's idempotency key was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// The route requires a key and none was sent.
    Missing,
    /// The header appeared more than once, or its value is a list (`a,b`, or two lines folded
    /// into one by an intermediary): the request names two operations.
    Multiple,
    /// The key is empty.
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] bytes.
    TooLong,
    /// The key holds a byte outside visible ASCII, or is a malformed sf-string.
    InvalidCharacter,
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Missing => "this endpoint requires an idempotency key",
            Self::Multiple => {
                "more than one idempotency key was sent (two headers, or a comma-separated list)"
            }
            Self::Empty => "the idempotency key is empty",
            Self::TooLong => "the idempotency key is longer than 255 bytes",
            Self::InvalidCharacter => {
                "the idempotency key must be visible ASCII, as a token or an RFC 8941 string"
            }
        })
    }
}

impl std::error::Error for KeyError {}

/// Reads the key from `headers`: `Ok(None)` when absent.
///
/// Accepts an RFC 8941 sf-string (`"abc"`, with `\"` and `\\` escapes) or a bare value of
/// visible ASCII (`0x21..=0x7E`). Bare values are looser than an sf-token on purpose: UUIDs,
/// which begin with a digit, are the most common key and are not sf-tokens.
pub(crate) fn parse_key<'h>(
    headers: &'h HeaderMap,
    name: &HeaderName,
) -> Result<Option<Cow<'h, str>>, KeyError> {
    let (value, another) = first_two(headers, name);
    let Some(value) = value else {
        return Ok(None);
    };
    if another {
        return Err(KeyError::Multiple);
    }
    let raw = value.as_bytes();
    let key = match raw.first() {
        Some(b'"') => {
            let key = unquote(raw)?;
            if key.is_empty() {
                return Err(KeyError::Empty);
            }
            if key.len() > MAX_KEY_LEN {
                return Err(KeyError::TooLong);
            }
            Cow::Owned(key)
        }
        _ => {
            validate(raw)?;
            Cow::Borrowed(raw)
        }
    };
    // Only ASCII bytes got through both branches.
    match key {
        Cow::Borrowed(raw) => std::str::from_utf8(raw).map(Cow::Borrowed),
        Cow::Owned(raw) => String::from_utf8(raw)
            .map(Cow::Owned)
            .map_err(|e| e.utf8_error()),
    }
    .map(Some)
    .map_err(|_| KeyError::InvalidCharacter)
}

/// The first value of `name` in `headers`, and whether it has another, as `get_all` would
/// give them (read as [`crate::lines`] reads them).
fn first_two<'h>(headers: &'h HeaderMap, name: &HeaderName) -> (Option<&'h HeaderValue>, bool) {
    let mut values = crate::lines::get_all(headers, name);
    (values.next(), values.next().is_some())
}

/// The checks every key passes, wherever it came from (the header, or `params._meta` in
/// JSON-RPC mode): not empty, at most [`MAX_KEY_LEN`] bytes, visible ASCII, not a list.
pub(crate) fn validate(key: &[u8]) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    // One pass without an early exit (vector compares) clears nearly every key; only a key it
    // flags is scanned again for which refusal it earns.
    let flagged = key
        .iter()
        .fold(false, |f, &b| f | !(0x21..=0x7e).contains(&b) | (b == b','));
    if flagged {
        if key.iter().any(|b| !(0x21..=0x7e).contains(b)) {
            return Err(KeyError::InvalidCharacter);
        }
        // A list in RFC 8941 terms, or what an intermediary makes of two key lines folded
        // into one: two operations, refused as two headers are.
        return Err(KeyError::Multiple);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong);
    }
    Ok(())
}

/// Decodes an RFC 8941 sf-string (section 3.3.3): printable ASCII, `\"` and `\\` escapes.
fn unquote(raw: &[u8]) -> Result<Vec<u8>, KeyError> {
    let inner = match raw {
        [b'"', inner @ .., b'"'] if raw.len() >= 2 => inner,
        _ => return Err(KeyError::InvalidCharacter),
    };
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e),
                _ => return Err(KeyError::InvalidCharacter),
            },
            // A quoted key followed by more: a list (`"a", "b"`) is two keys.
            b'"' if bytes.as_slice().trim_ascii_start().starts_with(b",") => {
                return Err(KeyError::Multiple);
            }
            b'"' => return Err(KeyError::InvalidCharacter),
            0x20..=0x7e => out.push(b),
            _ => return Err(KeyError::InvalidCharacter),
        }
    }
    Ok(out)
}

/// A key together with the scope it belongs to: the unit a store keeps one record for.
///
/// Cheap to clone: a request's key passes through the claim, the execution and the handler's
/// context, and each holds it. Scope and key share one allocation.
#[derive(Clone)]
pub struct ScopedKey {
    /// The scope followed by the key.
    joined: Arc<str>,
    /// Where the key begins in `joined`.
    split: usize,
}

impl ScopedKey {
    /// A key in a scope. Scopes partition keys: equal keys in two scopes never meet.
    pub fn new(scope: impl AsRef<str>, key: impl AsRef<str>) -> Self {
        let (scope, key) = (scope.as_ref(), key.as_ref());
        // One buffer per thread, so the shared allocation is the only one.
        let joined = crate::reuse::with(
            &JOIN,
            |buf| buf.capacity() <= 1024,
            |buf| {
                buf.clear();
                buf.push_str(scope);
                buf.push_str(key);
                Arc::from(buf.as_str())
            },
        );
        Self {
            joined,
            split: scope.len(),
        }
    }

    /// The scope (tenant, account, principal).
    pub fn scope(&self) -> &str {
        &self.joined[..self.split]
    }

    /// The client's key.
    pub fn key(&self) -> &str {
        &self.joined[self.split..]
    }

    fn parts(&self) -> (&str, &str) {
        self.joined.split_at(self.split)
    }

    /// Scope and key as one string, and where the key begins in it: what a store that keeps
    /// keys as bytes compares.
    #[cfg(feature = "memory")]
    pub(crate) fn joined(&self) -> (&str, usize) {
        (&self.joined, self.split)
    }

    /// Whether anything still holds this key's allocation once `self` and its clones are
    /// gone: for tests of what keeps a key.
    #[cfg(all(test, feature = "memory"))]
    pub(crate) fn downgrade(&self) -> std::sync::Weak<str> {
        Arc::downgrade(&self.joined)
    }
}

/// Whether this thread's key buffer is destroyed (its thread is ending): for tests that reach
/// [`crate::reuse`]'s fallback.
#[cfg(test)]
pub(crate) fn buffer_gone() -> bool {
    JOIN.try_with(|_| ()).is_err()
}

thread_local! {
    static JOIN: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

impl PartialEq for ScopedKey {
    fn eq(&self, other: &Self) -> bool {
        self.parts() == other.parts()
    }
}

impl Eq for ScopedKey {}

impl std::hash::Hash for ScopedKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // Scope and key joined, and where the key begins: equal keys, equal both.
        state.write(self.joined.as_bytes());
        state.write_usize(self.split);
    }
}

impl PartialOrd for ScopedKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ScopedKey {
    /// By scope, then by key.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.parts().cmp(&other.parts())
    }
}

impl fmt::Debug for ScopedKey {
    // Keys are not secrets, but scopes may be derived from credentials: keep both short.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ScopedKey({:?}, {:?})", self.scope(), self.key())
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    use fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use proptest::strategy::Just;

    /// §1 step 2: the stored key is `(scope, key)`; equal text split differently is another key.
    #[test]
    fn scoped_keys_are_equal_by_scope_and_key() {
        let key = ScopedKey::new("tenant", "k-1");
        assert_eq!(key, key.clone());
        assert_eq!(key, ScopedKey::new("tenant", "k-1"));
        assert_ne!(key, ScopedKey::new("tenant", "k-2"));
        assert_ne!(key, ScopedKey::new("tenan", "tk-1"));
        // Equal keys hash alike, whichever allocation holds them.
        let state = std::hash::RandomState::new();
        assert_eq!(
            std::hash::BuildHasher::hash_one(&state, &key),
            std::hash::BuildHasher::hash_one(&state, ScopedKey::new("tenant", "k-1")),
        );
    }

    fn parse(values: &[&[u8]]) -> Result<Option<String>, KeyError> {
        let mut headers = HeaderMap::new();
        for v in values {
            headers.append(
                &IDEMPOTENCY_KEY,
                HeaderValue::from_bytes(v).expect("header value"),
            );
        }
        parse_key(&headers, &IDEMPOTENCY_KEY).map(|k| k.map(Cow::into_owned))
    }

    #[test]
    fn accepts_tokens_uuids_and_sf_strings() {
        assert_eq!(parse(&[b"abc"]), Ok(Some("abc".into())));
        let uuid = "8e03978e-40d5-43e8-bc93-6894a57f9324";
        assert_eq!(parse(&[uuid.as_bytes()]), Ok(Some(uuid.into())));
        assert_eq!(parse(&[br#""a b\"c\\""#]), Ok(Some(r#"a b"c\"#.into())));
        assert_eq!(parse(&[]), Ok(None));
    }

    /// The bare-value reading as it was before its single pass: characters first, then lists.
    fn bare_reference(raw: &[u8]) -> Result<Option<String>, KeyError> {
        if raw.iter().any(|b| !(0x21..=0x7e).contains(b)) {
            return Err(KeyError::InvalidCharacter);
        }
        if raw.contains(&b',') {
            return Err(KeyError::Multiple);
        }
        match raw.len() {
            0 => Err(KeyError::Empty),
            n if n > MAX_KEY_LEN => Err(KeyError::TooLong),
            _ => Ok(Some(String::from_utf8(raw.to_vec()).expect("ascii"))),
        }
    }

    proptest::proptest! {
        #[test]
        fn a_bare_key_is_read_as_the_plain_checks_read_it(
            raw in proptest::collection::vec(
                proptest::prop_oneof![
                    Just(b','), Just(b' '), Just(b'\t'), 0x21u8..0x7f, 0x80u8..=0xff
                ],
                0..40,
            ),
        ) {
            // §3.1: every key is refused or accepted exactly as before (a quoted one has its
            // own reading).
            proptest::prop_assume!(raw.first() != Some(&b'"'));
            proptest::prop_assume!(HeaderValue::from_bytes(&raw).is_ok() || raw.is_empty());
            if raw.is_empty() {
                return Ok(());
            }
            proptest::prop_assert_eq!(parse(&[&raw]), bare_reference(&raw));
        }
    }

    proptest::proptest! {
        #[test]
        fn first_two_reads_what_get_all_reads(
            lines in proptest::collection::vec((0usize..24, 0u8..4), 0..40),
            wanted in 0usize..24,
        ) {
            // §3.1: two key lines are refused; the scan over a small map must see exactly
            // what the hashed lookup sees, on maps below and above the scan's size.
            let name = |i: usize| match i {
                0 => IDEMPOTENCY_KEY.clone(),
                1 => http::header::CONTENT_TYPE,
                i => HeaderName::from_bytes(format!("x-h{i}").as_bytes()).expect("name"),
            };
            let mut headers = HeaderMap::new();
            for (i, v) in &lines {
                headers.append(name(*i), HeaderValue::from(u16::from(*v)));
            }
            let wanted = name(wanted);
            let mut all = headers.get_all(&wanted).iter();
            let expected = (all.next(), all.next().is_some());
            proptest::prop_assert_eq!(first_two(&headers, &wanted), expected);
        }
    }

    #[test]
    fn rejects_bad_keys() {
        assert_eq!(parse(&[b"a", b"b"]), Err(KeyError::Multiple));
        assert_eq!(parse(&[b"\"\""]), Err(KeyError::Empty));
        assert_eq!(parse(&[b""]), Err(KeyError::Empty));
        assert_eq!(parse(&[&[b'k'; 256]]), Err(KeyError::TooLong));
        assert_eq!(
            parse(&[&[b'k'; 255]]).map(|k| k.map(|k| k.len())),
            Ok(Some(255))
        );
        // Issue 16 §2: a list, or two lines folded into one, names two operations.
        assert_eq!(parse(&[b"a,b"]), Err(KeyError::Multiple));
        assert_eq!(parse(&[b"a,"]), Err(KeyError::Multiple));
        assert_eq!(parse(&[br#""a", "b""#]), Err(KeyError::Multiple));
        assert_eq!(
            parse(&[br#""a,b""#]),
            Ok(Some("a,b".into())),
            "quoted, one key"
        );
        assert_eq!(parse(&[b"a\tb"]), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(&[b"a b"]), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(&[b"\"abc"]), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(&[br#""a\nb""#]), Err(KeyError::InvalidCharacter));
        assert_eq!(
            parse(&["caf\u{e9}".as_bytes()]),
            Err(KeyError::InvalidCharacter)
        );
    }
}
