//! `Content-Type` values as they count in a fingerprint: the request's own, and a multipart
//! part's.
//!
//! A value is read strictly (RFC 9110 §8.3.1 and §5.6.6, with the whitespace around `=` that
//! MIME allows, RFC 2045 §5.1): `type/subtype`, then `;`-separated parameters, each a token
//! name and a token or quoted-string value. One leniency: an unquoted value may hold any
//! visible ASCII but `"`, `;` and `\` (clients send `profile=https://example.com/v2`), which
//! no reader takes for anything but its text. Only such a value has a reading two spellings
//! provably share (case, quoting, order, whitespace around separators). Anything else (a
//! parameter without a value or a name, a stray quote, a control or non-ASCII byte outside a
//! quoted string) counts as sent, in a domain of its own: a lenient reading would merge values
//! a reader of the request may tell apart.

use std::borrow::Cow;

/// The media type of a `Content-Type` value: lower-cased, parameters dropped. What picks the
/// body's canonical form; what counts of the value is [`media_with_parameters`].
pub(crate) fn media_type(content_type: &str) -> Cow<'_, str> {
    // The type nearly every guarded request sends, answered by one comparison.
    if content_type == "application/json" {
        return content_type.into();
    }
    // `;` is ASCII, so the cut is at a character boundary.
    let end = content_type
        .bytes()
        .position(|b| b == b';')
        .unwrap_or(content_type.len());
    let head = &content_type[..end];
    // `trim` decodes characters; on ASCII (every header value read as a string) the same
    // whitespace is trimmed byte by byte.
    let media = match head.is_ascii() {
        true => trim_ascii_whitespace(head),
        false => head.trim(),
    };
    if media.bytes().any(|b| b.is_ascii_uppercase()) {
        media.to_ascii_lowercase().into()
    } else {
        media.into()
    }
}

/// `str::trim` on an ASCII `text`, without decoding characters: the ASCII bytes that are
/// `char::is_whitespace` are space and `\t` to `\r` (vertical tab among them).
fn trim_ascii_whitespace(text: &str) -> &str {
    let space = |b: &u8| matches!(b, b' ' | b'\t'..=b'\r');
    let bytes = text.as_bytes();
    let start = bytes.iter().position(|b| !space(b)).unwrap_or(bytes.len());
    let end = bytes
        .iter()
        .rposition(|b| !space(b))
        .map_or(start, |i| i + 1);
    // ASCII: every byte offset is a character boundary.
    text.get(start..end).unwrap_or_default()
}

pub(crate) fn is_json(media_type: &str) -> bool {
    media_type == "application/json" || media_type.ends_with("+json")
}

/// The media type and parameters of a `Content-Type` value, as they count in a fingerprint:
/// type, parameter names and `charset` values lower-cased, quoted values unquoted, parameters
/// sorted; dropped are only those that provably change nothing: the one `boundary` of a
/// multipart body read by its parts (`framed`: the request's own `Content-Type`, its body
/// read by the multipart reading, not hashed as sent nor by a canonicaliser of the
/// application's; a part's `boundary` frames a nested body hashed as it is) and the one
/// `charset` of JSON when it is `utf-8` (JSON is UTF-8 by definition; beside another
/// `charset`, a reader may take either). `text/plain; charset=latin1` and `text/plain` are
/// different requests. `media` is the value's [`media_type`], read once by the caller, which
/// the body's fingerprint uses too.
///
/// A value that does not read strictly (see the module), an empty one among them, is itself
/// (without the spaces and tabs around it), after a `"` no reading can begin with.
pub(crate) fn media_with_parameters<'m>(
    content_type: &str,
    media: &'m str,
    framed: bool,
) -> Cow<'m, str> {
    // Nearly every request: no parameters, nothing to allocate.
    if content_type == "application/json" {
        return media.into();
    }
    let Some(mut parameters) = parameters(content_type) else {
        // The spaces and tabs around a field's value are not part of it (RFC 9110 §5.5).
        return format!("\"{}", content_type.trim_matches([' ', '\t'])).into();
    };
    let one = |name: &str, parameters: &[(String, String)]| {
        parameters.iter().filter(|(n, _)| n == name).count() == 1
    };
    let boundary = framed && media == "multipart/form-data" && one("boundary", &parameters);
    let charset = is_json(media) && one("charset", &parameters);
    parameters.retain_mut(|(name, value)| {
        // RFC 9110 §8.3.2: a charset's name is case-insensitive (`LATIN1` is `latin1`);
        // other parameters' values may not be (a boundary is not).
        if name == "charset" {
            value.make_ascii_lowercase();
        }
        let redundant =
            (boundary && name == "boundary") || (charset && name == "charset" && value == "utf-8");
        !redundant
    });
    if parameters.is_empty() {
        return media.into();
    }
    // By name only, and stable: a repeated parameter keeps its order, which may be data.
    parameters.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = media.to_owned();
    for (name, value) in parameters {
        // Length-framed, so no value can imitate another parameter.
        out.push_str(&format!(";{}:{name}={}:{value}", name.len(), value.len()));
    }
    out.into()
}

/// The parameters of a `Content-Type` value that reads strictly (see the module), in order:
/// names lower-cased, quoted values unquoted. `None` if it does not read.
pub(crate) fn parameters(content_type: &str) -> Option<Vec<(String, String)>> {
    let mut read = Reader {
        text: content_type.as_bytes(),
        at: 0,
    };
    read.space();
    read.token()?;
    read.byte(b'/')?;
    read.token()?;
    let mut parameters = Vec::new();
    loop {
        read.space();
        if read.done() {
            return Some(parameters);
        }
        read.byte(b';')?;
        read.space();
        // An empty parameter (`;;`, a `;` at the end) is allowed, and is nothing.
        if read.done() || read.peek() == Some(b';') {
            continue;
        }
        let name = read.token()?.to_ascii_lowercase();
        read.space();
        read.byte(b'=')?;
        read.space();
        let value = match read.peek() {
            Some(b'"') => read.quoted()?,
            _ => read.bare()?.to_owned(),
        };
        parameters.push((name, value));
    }
}

/// A cursor over a header value's bytes.
struct Reader<'a> {
    text: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn done(&self) -> bool {
        self.at == self.text.len()
    }

    fn peek(&self) -> Option<u8> {
        self.text.get(self.at).copied()
    }

    /// Spaces and tabs (RFC 9110's OWS).
    fn space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t')) {
            self.at += 1;
        }
    }

    fn byte(&mut self, expected: u8) -> Option<()> {
        (self.peek() == Some(expected)).then(|| self.at += 1)
    }

    /// One or more `tchar`s (RFC 9110 §5.6.2).
    fn token(&mut self) -> Option<&'a str> {
        let start = self.at;
        while self.peek().is_some_and(is_tchar) {
            self.at += 1;
        }
        // Only ASCII was taken, so the piece is UTF-8.
        (self.at > start)
            .then(|| std::str::from_utf8(&self.text[start..self.at]).ok())
            .flatten()
    }

    /// An unquoted value: a token, or any visible ASCII but `"`, `;` and `\` (see the module).
    fn bare(&mut self) -> Option<&'a str> {
        let start = self.at;
        while self
            .peek()
            .is_some_and(|b| matches!(b, 0x21..=0x7e) && !matches!(b, b'"' | b';' | b'\\'))
        {
            self.at += 1;
        }
        // Only ASCII was taken, so the piece is UTF-8.
        (self.at > start)
            .then(|| std::str::from_utf8(&self.text[start..self.at]).ok())
            .flatten()
    }

    /// A quoted string (RFC 9110 §5.6.4), unquoted: `\x` stands for `x`.
    fn quoted(&mut self) -> Option<String> {
        self.byte(b'"')?;
        let mut out = Vec::new();
        loop {
            match self.peek()? {
                b'"' => {
                    self.at += 1;
                    // The value is a `str`'s bytes with ASCII taken out: UTF-8 still.
                    return String::from_utf8(out).ok();
                }
                b'\\' => {
                    let escaped = *self.text.get(self.at + 1)?;
                    if !is_quotable(escaped) {
                        return None;
                    }
                    out.push(escaped);
                    self.at += 2;
                }
                b if is_quotable(b) => {
                    out.push(b);
                    self.at += 1;
                }
                _ => return None,
            }
        }
    }
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// What a quoted string may hold, escaped or not (`qdtext` and `quoted-pair` without the
/// quote and backslash that frame them): tab, space, visible ASCII and `obs-text`.
fn is_quotable(b: u8) -> bool {
    matches!(b, b'\t' | b' ' | 0x21..=0x7e | 0x80..=0xff)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DESIGN §1.4: only values that read strictly share a reading; every other value counts
    /// as sent, and never as a value that reads.
    #[test]
    fn only_a_value_that_reads_has_a_reading_two_spellings_share() {
        let counted = |ct: &str| media_with_parameters(ct, &media_type(ct), false).into_owned();
        for (a, b) in [
            ("application/json; charset=UTF-8", "application/json"),
            (
                "application/problem+json;charset=\"utf-8\"",
                "application/problem+json",
            ),
            ("text/plain; charset=UTF-8", "Text/Plain;charset=\"utf-8\""),
            ("text/plain; a=1; b=2", "text/plain ; b=2 ;a=1"),
            ("text/plain; a = 1", "text/plain; a=1"),
            ("text/plain;", "text/plain"),
            (
                "application/json;profile=https://example.com/v2",
                "application/json; profile=\"https://example.com/v2\"",
            ),
            ("text/plain; a=\"x\\\"y\"", "text/plain; a=\"x\\\"\\y\""),
        ] {
            assert_eq!(counted(a), counted(b), "{a:?} and {b:?} read alike");
        }
        for (a, b) in [
            ("text/plain; foo", "text/plain; foo=\"\""),
            ("text/plain; =x", "text/plain"),
            (
                "text/plain\"; charset=utf-8\"",
                "text/plain\"; charset=latin1\"",
            ),
            ("text/plain\x0b", "text/plain"),
            ("text/plain\u{a0}", "text/plain"),
            ("\u{3000}text/plain", "text/plain"),
            (
                "text/plain; charset=utf-8\u{a0}",
                "text/plain; charset=utf-8",
            ),
            (
                "text/plain;\u{2003}charset=utf-8",
                "text/plain; charset=utf-8",
            ),
            ("text plain", "textplain"),
            ("text/plain; a=\"1", "text/plain; a=1"),
            ("text/plain; a=1 2", "text/plain; a=\"1 2\""),
            ("", "\""),
            // Found by review: `utf-8` beside another charset is not redundant.
            (
                "application/json;charset=utf-16",
                "application/json;charset=utf-16;charset=utf-8",
            ),
            (
                "application/json; charset=utf-8; charset=latin1",
                "application/json; charset=latin1",
            ),
        ] {
            assert_ne!(counted(a), counted(b), "{a:?} and {b:?} must not merge");
        }
        assert!(parameters("text/plain; a=1 2").is_none());
        assert_eq!(
            parameters("multipart/form-data; x=\"; boundary=EVIL; y=\"; boundary=REAL"),
            Some(vec![
                ("x".to_owned(), "; boundary=EVIL; y=".to_owned()),
                ("boundary".to_owned(), "REAL".to_owned()),
            ])
        );
    }

    proptest::proptest! {
        /// Two values count alike only when both read (and then as their parameters say) or
        /// both are the same text (without the spaces and tabs around it).
        #[test]
        fn values_that_do_not_read_count_as_sent(
            a in "[ \ta-cA-C/;=\"\\\\\x0b\u{a0}]{0,14}",
            b in "[ \ta-cA-C/;=\"\\\\\x0b\u{a0}]{0,14}",
        ) {
            let counted = |ct: &str| media_with_parameters(ct, &media_type(ct), false).into_owned();
            if counted(&a) == counted(&b) {
                match (parameters(&a), parameters(&b)) {
                    (Some(pa), Some(pb)) => {
                        proptest::prop_assert_eq!(media_type(&a), media_type(&b));
                        let norm = |mut p: Vec<(String, String)>| {
                            for (n, v) in &mut p {
                                if n == "charset" {
                                    v.make_ascii_lowercase();
                                }
                            }
                            p.sort_by(|x, y| x.0.cmp(&y.0));
                            p
                        };
                        proptest::prop_assert_eq!(norm(pa), norm(pb));
                    }
                    (None, None) => proptest::prop_assert_eq!(
                        a.trim_matches([' ', '\t']),
                        b.trim_matches([' ', '\t'])
                    ),
                    _ => proptest::prop_assert!(false, "{a:?} reads and {b:?} does not"),
                }
            }
        }
    }
}
