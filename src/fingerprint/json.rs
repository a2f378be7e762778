//! RFC 8785 (JSON Canonicalization Scheme) for fingerprints.
//!
//! The document is parsed once into a borrowed tree and written out in canonical form straight
//! into the hasher: object members sorted by their UTF-16 code units, no whitespace, numbers in
//! ECMAScript's shortest form, strings with the minimal escapes. Nesting is capped at
//! [`MAX_DEPTH`] so hostile input cannot exhaust the stack.

use std::borrow::Cow;
use std::cmp::Ordering;

use super::Sink;

/// The deepest nesting of arrays and objects accepted.
pub(crate) const MAX_DEPTH: usize = 128;

/// Why a JSON body has no canonical form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum JsonError {
    /// Not JSON, or not UTF-8: the request is malformed.
    Malformed(&'static str),
    /// Valid JSON that RFC 8785 cannot canonicalise without losing information (duplicate
    /// member names, numbers beyond IEEE 754 double range). Hashed as raw bytes instead, so
    /// such documents are never merged into another document's fingerprint.
    NotCanonical,
}

#[derive(Debug)]
enum Value<'a> {
    Null,
    Bool(bool),
    Number(f64),
    String(Cow<'a, str>),
    Array(Vec<Value<'a>>),
    Object(Vec<(Cow<'a, str>, Value<'a>)>),
}

/// Writes the RFC 8785 form of `body` into `out`.
pub(crate) fn canonicalize(body: &[u8], out: &mut impl Sink) -> Result<(), JsonError> {
    let text = std::str::from_utf8(body).map_err(|_| JsonError::Malformed("body is not UTF-8"))?;
    let mut parser = Parser {
        s: text.as_bytes(),
        text,
        i: 0,
    };
    parser.skip_ws();
    let value = parser.value(0)?;
    parser.skip_ws();
    if parser.i != parser.s.len() {
        return Err(JsonError::Malformed(
            "trailing characters after the JSON document",
        ));
    }
    write_value(&value, out)
}

struct Parser<'a> {
    s: &'a [u8],
    text: &'a str,
    i: usize,
}

const SYNTAX: JsonError = JsonError::Malformed("body is not valid JSON");

impl<'a> Parser<'a> {
    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.s.get(self.i) {
            self.i += 1;
        }
    }

    fn eat(&mut self, lit: &[u8]) -> Result<(), JsonError> {
        if self.s[self.i..].starts_with(lit) {
            self.i += lit.len();
            Ok(())
        } else {
            Err(SYNTAX)
        }
    }

    fn value(&mut self, depth: usize) -> Result<Value<'a>, JsonError> {
        match self.s.get(self.i) {
            Some(b'n') => self.eat(b"null").map(|()| Value::Null),
            Some(b't') => self.eat(b"true").map(|()| Value::Bool(true)),
            Some(b'f') => self.eat(b"false").map(|()| Value::Bool(false)),
            Some(b'"') => self.string().map(Value::String),
            Some(b'[') => self.array(depth + 1),
            Some(b'{') => self.object(depth + 1),
            Some(b'-' | b'0'..=b'9') => self.number(),
            _ => Err(SYNTAX),
        }
    }

    fn array(&mut self, depth: usize) -> Result<Value<'a>, JsonError> {
        if depth > MAX_DEPTH {
            return Err(JsonError::Malformed(
                "JSON nesting is deeper than 128 levels",
            ));
        }
        self.i += 1;
        let mut items = Vec::new();
        self.skip_ws();
        if self.s.get(self.i) == Some(&b']') {
            self.i += 1;
            return Ok(Value::Array(items));
        }
        loop {
            self.skip_ws();
            items.push(self.value(depth)?);
            self.skip_ws();
            match self.s.get(self.i) {
                Some(b',') => self.i += 1,
                Some(b']') => {
                    self.i += 1;
                    return Ok(Value::Array(items));
                }
                _ => return Err(SYNTAX),
            }
        }
    }

    fn object(&mut self, depth: usize) -> Result<Value<'a>, JsonError> {
        if depth > MAX_DEPTH {
            return Err(JsonError::Malformed(
                "JSON nesting is deeper than 128 levels",
            ));
        }
        self.i += 1;
        let mut members = Vec::new();
        self.skip_ws();
        if self.s.get(self.i) == Some(&b'}') {
            self.i += 1;
            return Ok(Value::Object(members));
        }
        loop {
            self.skip_ws();
            if self.s.get(self.i) != Some(&b'"') {
                return Err(SYNTAX);
            }
            let name = self.string()?;
            self.skip_ws();
            self.eat(b":")?;
            self.skip_ws();
            members.push((name, self.value(depth)?));
            self.skip_ws();
            match self.s.get(self.i) {
                Some(b',') => self.i += 1,
                Some(b'}') => {
                    self.i += 1;
                    // Sort now, in place: the writer then walks members in order.
                    members.sort_unstable_by(|a, b| utf16_cmp(&a.0, &b.0));
                    if members.windows(2).any(|w| w[0].0 == w[1].0) {
                        return Err(JsonError::NotCanonical);
                    }
                    return Ok(Value::Object(members));
                }
                _ => return Err(SYNTAX),
            }
        }
    }

    fn number(&mut self) -> Result<Value<'a>, JsonError> {
        let start = self.i;
        if self.s.get(self.i) == Some(&b'-') {
            self.i += 1;
        }
        match self.s.get(self.i) {
            Some(b'0') => self.i += 1,
            Some(b'1'..=b'9') => self.digits(),
            _ => return Err(SYNTAX),
        }
        if self.s.get(self.i) == Some(&b'.') {
            self.i += 1;
            if !matches!(self.s.get(self.i), Some(b'0'..=b'9')) {
                return Err(SYNTAX);
            }
            self.digits();
        }
        if let Some(b'e' | b'E') = self.s.get(self.i) {
            self.i += 1;
            if let Some(b'+' | b'-') = self.s.get(self.i) {
                self.i += 1;
            }
            if !matches!(self.s.get(self.i), Some(b'0'..=b'9')) {
                return Err(SYNTAX);
            }
            self.digits();
        }
        // The grammar above only admits what Rust's correctly rounded parser accepts.
        let n: f64 = self.text[start..self.i].parse().map_err(|_| SYNTAX)?;
        if n.is_finite() {
            Ok(Value::Number(n))
        } else {
            Err(JsonError::NotCanonical)
        }
    }

    fn digits(&mut self) {
        while let Some(b'0'..=b'9') = self.s.get(self.i) {
            self.i += 1;
        }
    }

    fn string(&mut self) -> Result<Cow<'a, str>, JsonError> {
        self.i += 1;
        let start = self.i;
        // Fast path: no escapes, borrow straight from the body.
        let run = special(&self.s[start..]).ok_or(SYNTAX)?;
        self.i = start + run;
        match self.s[self.i] {
            b'"' => {
                let s = &self.text[start..self.i];
                self.i += 1;
                return Ok(Cow::Borrowed(s));
            }
            b'\\' => {}
            _ => return Err(SYNTAX),
        }
        let mut out = String::from(&self.text[start..self.i]);
        loop {
            let run = self.i;
            self.i += special(&self.s[run..]).unwrap_or(self.s.len() - run);
            out.push_str(&self.text[run..self.i]);
            match self.s.get(self.i) {
                Some(b'"') => {
                    self.i += 1;
                    return Ok(Cow::Owned(out));
                }
                Some(b'\\') => {
                    self.i += 1;
                    let c = self.escape()?;
                    out.push(c);
                }
                _ => return Err(SYNTAX),
            }
        }
    }

    fn escape(&mut self) -> Result<char, JsonError> {
        let b = *self.s.get(self.i).ok_or(SYNTAX)?;
        self.i += 1;
        Ok(match b {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let hi = self.hex4()?;
                match hi {
                    0xd800..=0xdbff => {
                        self.eat(b"\\u")?;
                        let lo = self.hex4()?;
                        if !(0xdc00..=0xdfff).contains(&lo) {
                            return Err(JsonError::Malformed("lone UTF-16 surrogate in a string"));
                        }
                        let c = 0x10000 + ((hi - 0xd800) << 10) + (lo - 0xdc00);
                        char::from_u32(c).ok_or(SYNTAX)?
                    }
                    0xdc00..=0xdfff => {
                        return Err(JsonError::Malformed("lone UTF-16 surrogate in a string"));
                    }
                    _ => char::from_u32(hi).ok_or(SYNTAX)?,
                }
            }
            _ => return Err(SYNTAX),
        })
    }

    fn hex4(&mut self) -> Result<u32, JsonError> {
        let digits = self.s.get(self.i..self.i + 4).ok_or(SYNTAX)?;
        let mut v = 0;
        for &d in digits {
            let n = (d as char).to_digit(16).ok_or(SYNTAX)?;
            v = v * 16 + n;
        }
        self.i += 4;
        Ok(v)
    }
}

fn write_value(value: &Value<'_>, out: &mut impl Sink) -> Result<(), JsonError> {
    match value {
        Value::Null => out.put(b"null"),
        Value::Bool(true) => out.put(b"true"),
        Value::Bool(false) => out.put(b"false"),
        Value::Number(n) => write_number(*n, out),
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.put(b"[");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.put(b",");
                }
                write_value(item, out)?;
            }
            out.put(b"]");
        }
        Value::Object(members) => {
            // Members were sorted, and checked for duplicates, as they were parsed.
            out.put(b"{");
            for (i, (name, member)) in members.iter().enumerate() {
                if i > 0 {
                    out.put(b",");
                }
                write_string(name, out);
                out.put(b":");
                write_value(member, out)?;
            }
            out.put(b"}");
        }
    }
    Ok(())
}

/// The index of the first byte that ends a plain run inside a JSON string: `"`, `\\` or a
/// control character. Eight bytes at a time (SWAR), since strings are most of most bodies.
fn special(bytes: &[u8]) -> Option<usize> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    // Nonzero iff some byte of `v` is zero / below `n` (n <= 128).
    let zero = |v: u64| v.wrapping_sub(ONES) & !v & HIGH;
    let below = |v: u64, n: u64| v.wrapping_sub(ONES * n) & !v & HIGH;
    let mut at = 0;
    for chunk in bytes.chunks_exact(8) {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let x = u64::from_le_bytes(word);
        if zero(x ^ (ONES * u64::from(b'"'))) | zero(x ^ (ONES * u64::from(b'\\'))) | below(x, 0x20)
            != 0
        {
            break;
        }
        at += 8;
    }
    bytes[at..]
        .iter()
        .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
        .map(|i| at + i)
}

/// Writes the RFC 8785 form of an already parsed `serde_json` value (whose maps cannot hold
/// duplicate names, and whose numbers are finite).
pub(crate) fn write_parsed(value: &serde_json::Value, out: &mut impl Sink) {
    use serde_json::Value as V;
    match value {
        V::Null => out.put(b"null"),
        V::Bool(true) => out.put(b"true"),
        V::Bool(false) => out.put(b"false"),
        // RFC 8785 reads every number as a double, integers included.
        V::Number(n) => write_number(n.as_f64().unwrap_or(0.0), out),
        V::String(s) => write_string(s, out),
        V::Array(items) => {
            out.put(b"[");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.put(b",");
                }
                write_parsed(item, out);
            }
            out.put(b"]");
        }
        V::Object(members) => {
            let mut sorted: Vec<_> = members.iter().collect();
            sorted.sort_unstable_by(|a, b| utf16_cmp(a.0, b.0));
            out.put(b"{");
            for (i, (name, member)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.put(b",");
                }
                write_string(name, out);
                out.put(b":");
                write_parsed(member, out);
            }
            out.put(b"}");
        }
    }
}

/// RFC 8785 §3.2.3: members sort by the UTF-16 code units of their names.
fn utf16_cmp(a: &str, b: &str) -> Ordering {
    if a.is_ascii() && b.is_ascii() {
        return a.cmp(b);
    }
    a.encode_utf16().cmp(b.encode_utf16())
}

/// ECMAScript `Number.prototype.toString`, which RFC 8785 §3.2.2.3 adopts.
fn write_number(n: f64, out: &mut impl Sink) {
    if n == 0.0 {
        // Both zeros print as "0".
        out.put(b"0");
        return;
    }
    let mut buf = ryu_js::Buffer::new();
    out.put(buf.format_finite(n).as_bytes());
}

/// RFC 8785 §3.2.2.2: escape only `"`, `\` and control characters, the short forms where JSON
/// has them, `\u00xx` in lower-case hex otherwise.
fn write_string(s: &str, out: &mut impl Sink) {
    out.put(b"\"");
    let mut rest = s.as_bytes();
    // Copy runs that need no escape in one piece.
    while let Some(at) = special(rest) {
        out.put(&rest[..at]);
        let b = rest[at];
        match b {
            b'"' => out.put(b"\\\""),
            b'\\' => out.put(b"\\\\"),
            0x08 => out.put(b"\\b"),
            0x09 => out.put(b"\\t"),
            0x0a => out.put(b"\\n"),
            0x0c => out.put(b"\\f"),
            0x0d => out.put(b"\\r"),
            _ => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.put(&[
                    b'\\',
                    b'u',
                    b'0',
                    b'0',
                    HEX[(b >> 4) as usize],
                    HEX[(b & 15) as usize],
                ]);
            }
        }
        rest = &rest[at + 1..];
    }
    out.put(rest);
    out.put(b"\"");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(s: &str) -> Result<String, JsonError> {
        let mut out = Vec::new();
        canonicalize(s.as_bytes(), &mut out)?;
        Ok(String::from_utf8(out).expect("canonical JSON is UTF-8"))
    }

    #[test]
    fn special_finds_the_first_quote_backslash_or_control() {
        for (input, want) in [
            (&b""[..], None),
            (b"abcdefgh", None),
            (b"abcdefghijklmnop\"", Some(16)),
            (b"abc\\", Some(3)),
            (b"0123456789\x1f", Some(10)),
            (b"\x7f\x80\xffplain text\"", Some(13)),
            (b"x", None),
        ] {
            assert_eq!(special(input), want, "{input:?}");
        }
        // Every position, every special byte, in a longer run.
        for len in 0..40 {
            for b in [b'"', b'\\', 0x00, 0x1f] {
                let mut v = vec![b'a'; len + 1];
                v[len] = b;
                assert_eq!(special(&v), Some(len));
            }
        }
    }

    #[test]
    fn parsed_values_canonicalise_like_their_text() {
        let text = r#"{"b":[1,2.50,-0,1e21,"\u00e9\n"],"a":{"\ufb33":null,"\ud83d\ude00":true}}"#;
        let mut from_parsed = Vec::new();
        write_parsed(&serde_json::from_str(text).expect("json"), &mut from_parsed);
        assert_eq!(
            String::from_utf8(from_parsed).expect("utf8"),
            canon(text).expect("valid")
        );
    }

    #[test]
    fn rfc8785_example() {
        // RFC 8785 §3.2.2 sample input and output.
        let input = r#"{
          "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
          "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
          "literals": [null, true, false]
        }"#;
        assert_eq!(
            canon(input).expect("valid"),
            r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#
        );
    }

    #[test]
    fn sorts_by_utf16_code_units() {
        // RFC 8785 §3.2.3: U+1F600 (surrogates D83D DE00) sorts before U+FB33.
        let input = "{\"\u{fb33}\":1,\"\u{1f600}\":2,\"a\":3,\"\\r\":4}";
        assert_eq!(
            canon(input).expect("valid"),
            "{\"\\r\":4,\"a\":3,\"\u{1f600}\":2,\"\u{fb33}\":1}"
        );
    }

    #[test]
    fn numbers_in_ecmascript_form() {
        for (input, want) in [
            ("-0", "0"),
            ("0.0", "0"),
            ("1e21", "1e+21"),
            ("1e20", "100000000000000000000"),
            ("5e-324", "5e-324"),
            ("1e-7", "1e-7"),
            ("0.000001", "0.000001"),
            ("123.0", "123"),
            ("-1.5E3", "-1500"),
            ("9007199254740993", "9007199254740992"),
            ("1.7976931348623157e308", "1.7976931348623157e+308"),
        ] {
            assert_eq!(canon(input).expect(input), want, "{input}");
        }
    }

    #[test]
    fn refuses_what_it_cannot_canonicalise() {
        assert_eq!(canon(r#"{"a":1,"a":2}"#), Err(JsonError::NotCanonical));
        assert_eq!(canon("1e400"), Err(JsonError::NotCanonical));
        for bad in [
            "",
            "{",
            "[1,]",
            "01",
            "1.",
            "\"\\ud800\"",
            "\"a\u{1}\"",
            "nul",
            "{} x",
        ] {
            assert!(
                matches!(canon(bad), Err(JsonError::Malformed(_))),
                "{bad:?}"
            );
        }
        let deep = "[".repeat(100_000) + &"]".repeat(100_000);
        assert!(matches!(canon(&deep), Err(JsonError::Malformed(_))));
        let mut out = Vec::new();
        assert!(matches!(
            canonicalize(b"\"\xff\"", &mut out),
            Err(JsonError::Malformed(_))
        ));
    }
}
