//! Whether a body is already its own canonical form, in one pass.

use super::number::{json_number_grammar, short_number};
use super::scan::{special, special_or_non_ascii};
use std::cmp::Ordering;

use super::MAX_DEPTH;
use super::write::utf16_cmp_bytes;

/// Whether `body` is already its own RFC 8785 form, so its bytes can be hashed as they are.
///
/// Most clients send compact JSON, and many (`serde_json` with sorted maps, canonicalising
/// SDKs, every retry of a body the client stored) send exactly the canonical form: checking
/// that in one pass costs a fraction of parsing, sorting and writing it again. `false` means
/// only "not proven canonical": the caller takes the full path, which also reports malformed
/// input. Conservative on purpose: escaped member names, and numbers that are not plain short
/// integers unless they print back to the same text, send the body the long way.
///
/// `true` also proves `body` is UTF-8: outside strings only ASCII passes, and the first byte
/// past ASCII in a string has the rest of the body checked, once. A body of ASCII, the common
/// case, is then read once instead of twice.
pub(crate) fn verbatim(body: &[u8]) -> bool {
    let mut check = Verbatim {
        s: body,
        i: 0,
        utf8: false,
    };
    check.value(0) && check.i == body.len()
}

/// The state of [`verbatim`]: a position in the body.
struct Verbatim<'a> {
    s: &'a [u8],
    i: usize,
    /// Whether the body from the first non-ASCII byte on is known to be UTF-8 (everything
    /// before that byte is ASCII).
    utf8: bool,
}

impl<'a> Verbatim<'a> {
    fn value(&mut self, depth: usize) -> bool {
        match self.s.get(self.i) {
            Some(b'n') => self.literal(b"null"),
            Some(b't') => self.literal(b"true"),
            Some(b'f') => self.literal(b"false"),
            Some(b'"') => self.string().is_some(),
            Some(b'[') => depth < MAX_DEPTH && self.container(depth + 1, b']'),
            Some(b'{') => depth < MAX_DEPTH && self.container(depth + 1, b'}'),
            Some(b'-' | b'0'..=b'9') => self.number(),
            _ => false,
        }
    }

    fn literal(&mut self, lit: &[u8]) -> bool {
        let ok = self.s[self.i..].starts_with(lit);
        self.i += lit.len();
        ok
    }

    /// An array (`close` is `]`) or an object (`}`), whose members must come in strictly
    /// ascending order (so no name repeats), names unescaped.
    fn container(&mut self, depth: usize, close: u8) -> bool {
        let object = close == b'}';
        self.i += 1;
        if self.s.get(self.i) == Some(&close) {
            self.i += 1;
            return true;
        }
        let mut previous: Option<&'a [u8]> = None;
        loop {
            if object {
                let Some((name, false)) = self.string() else {
                    return false;
                };
                if previous.is_some_and(|p| utf16_cmp_bytes(p, name) != Ordering::Less) {
                    return false;
                }
                previous = Some(name);
                if self.s.get(self.i) != Some(&b':') {
                    return false;
                }
                self.i += 1;
            }
            if !self.value(depth) {
                return false;
            }
            match self.s.get(self.i) {
                Some(b',') => self.i += 1,
                Some(&b) if b == close => {
                    self.i += 1;
                    return true;
                }
                _ => return false,
            }
        }
    }

    /// A string whose escapes are exactly the ones RFC 8785 writes: its contents and whether
    /// it had any escape.
    fn string(&mut self) -> Option<(&'a [u8], bool)> {
        if self.s.get(self.i) != Some(&b'"') {
            return None;
        }
        self.i += 1;
        let start = self.i;
        let mut escaped = false;
        loop {
            let rest = &self.s[self.i..];
            self.i += if self.utf8 {
                special(rest)?
            } else {
                special_or_non_ascii(rest)?
            };
            match self.s[self.i] {
                b'"' => {
                    self.i += 1;
                    return Some((&self.s[start..self.i - 1], escaped));
                }
                b'\\' => {
                    escaped = true;
                    let len = canonical_escape(&self.s[self.i + 1..])?;
                    self.i += 1 + len;
                }
                0x80.. => {
                    // All before is ASCII: the rest decides, checked once.
                    std::str::from_utf8(&self.s[self.i..]).ok()?;
                    self.utf8 = true;
                }
                _ => return None,
            }
        }
    }

    /// Canonical numbers print back to their own text: short integers do by construction
    /// (below 2^53, no leading zeros, never `-0`); anything else is checked by printing it.
    fn number(&mut self) -> bool {
        let start = self.i;
        if let Some(len) = short_number(&self.s[start..]) {
            self.i += len;
            return true;
        }
        // Anything else: find the number's end, then compare it with its ECMAScript form.
        while let Some(b'0'..=b'9' | b'.' | b'e' | b'E' | b'+' | b'-') = self.s.get(self.i) {
            self.i += 1;
        }
        let Ok(text) = std::str::from_utf8(&self.s[start..self.i]) else {
            return false;
        };
        // Only valid JSON numbers may pass: Rust's parser also takes "1.", ".5", "+1", "inf".
        if !json_number_grammar(text) {
            return false;
        }
        match text.parse::<f64>() {
            Ok(n) if n.is_finite() && n != 0.0 => {
                ryu_js::Buffer::new().format_finite(n).as_bytes() == text.as_bytes()
            }
            _ => false,
        }
    }
}

/// The length of an escape (after its backslash) if it is the one RFC 8785 writes for its
/// character: the short forms, and `\u00xx` in lower-case hex for the other control characters.
fn canonical_escape(rest: &[u8]) -> Option<usize> {
    match rest.first()? {
        b'"' | b'\\' | b'b' | b'f' | b'n' | b'r' | b't' => Some(1),
        b'u' => {
            let hex = rest.get(1..5)?;
            let lower = |b: &u8| matches!(b, b'0'..=b'9' | b'a'..=b'f');
            if hex[0] != b'0' || hex[1] != b'0' || !matches!(hex[2], b'0' | b'1') || !lower(&hex[3])
            {
                return None;
            }
            let value = (hex[2] - b'0') * 16 + (hex[3] as char).to_digit(16)? as u8;
            // These five have short forms, which the canonical writer uses instead.
            (!matches!(value, 0x08 | 0x09 | 0x0a | 0x0c | 0x0d)).then_some(5)
        }
        _ => None,
    }
}
