//! The parser behind [`canonicalize`](super::canonicalize): a document read once into a flat
//! tree of nodes in preorder.

use super::number::{canonical_number, same_decimal, short_number};
use super::scan::special;
use super::{JsonError, MAX_DEPTH, Node};

pub(super) struct Parser<'a, 't> {
    pub(super) s: &'a [u8],
    pub(super) text: &'a str,
    pub(super) i: usize,
    pub(super) nodes: &'t mut Vec<Node>,
    pub(super) decoded: &'t mut String,
    /// A value read has no exact canonical form (a number no double names exactly, a lone
    /// UTF-16 surrogate): the document is hashed as sent once it is read whole.
    pub(super) inexact: bool,
}

const SYNTAX: JsonError = JsonError::Malformed("body is not valid JSON");

/// An offset into a body already known to fit `u32`.
pub(super) fn at(i: usize) -> u32 {
    i as u32
}

impl Parser<'_, '_> {
    pub(super) fn skip_ws(&mut self) {
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

    pub(super) fn value(&mut self, depth: usize) -> Result<(), JsonError> {
        let node = match self.s.get(self.i) {
            Some(b'n') => self.eat(b"null").map(|()| Node::Null)?,
            Some(b't') => self.eat(b"true").map(|()| Node::True)?,
            Some(b'f') => self.eat(b"false").map(|()| Node::False)?,
            Some(b'"') => self.string()?,
            Some(b'[') => return self.container(depth + 1, b']'),
            Some(b'{') => return self.container(depth + 1, b'}'),
            Some(b'-' | b'0'..=b'9') => self.number()?,
            _ => return Err(SYNTAX),
        };
        self.nodes.push(node);
        Ok(())
    }

    /// An array (`close` is `]`) or an object (`}`): its node, then its items or members.
    fn container(&mut self, depth: usize, close: u8) -> Result<(), JsonError> {
        if depth > MAX_DEPTH {
            return Err(JsonError::Malformed(
                "JSON nesting is deeper than 128 levels",
            ));
        }
        let object = close == b'}';
        self.i += 1;
        let at_node = self.nodes.len();
        self.nodes.push(Node::Null);
        let mut len = 0u32;
        self.skip_ws();
        if self.s.get(self.i) == Some(&close) {
            self.i += 1;
        } else {
            loop {
                self.skip_ws();
                if object {
                    if self.s.get(self.i) != Some(&b'"') {
                        return Err(SYNTAX);
                    }
                    let name = self.string()?;
                    self.nodes.push(name);
                    self.skip_ws();
                    self.eat(b":")?;
                    self.skip_ws();
                }
                self.value(depth)?;
                len += 1;
                self.skip_ws();
                match self.s.get(self.i) {
                    Some(b',') => self.i += 1,
                    Some(&b) if b == close => {
                        self.i += 1;
                        break;
                    }
                    _ => return Err(SYNTAX),
                }
            }
        }
        let next = at(self.nodes.len());
        self.nodes[at_node] = if object {
            Node::Object { len, next }
        } else {
            Node::Array { len, next }
        };
        Ok(())
    }

    fn number(&mut self) -> Result<Node, JsonError> {
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
        let text = &self.text[start..self.i];
        // Most numbers already print as written: keep their text, skip parsing and printing.
        if short_number(text.as_bytes()) == Some(text.len()) {
            return Ok(Node::Raw {
                start: at(start),
                end: at(self.i),
            });
        }
        // The grammar above only admits what Rust's correctly rounded parser accepts.
        let n: f64 = text.parse().map_err(|_| SYNTAX)?;
        // Only a number whose canonical form names exactly the value written may be merged
        // with another text of it: not 2^53 + 1 (read as 2^53), not 1e-400 (read as 0).
        if n.is_finite() && same_decimal(text, &canonical_number(n)) {
            Ok(Node::Number(n))
        } else {
            self.inexact = true;
            Ok(Node::Null)
        }
    }

    fn digits(&mut self) {
        while let Some(b'0'..=b'9') = self.s.get(self.i) {
            self.i += 1;
        }
    }

    fn string(&mut self) -> Result<Node, JsonError> {
        self.i += 1;
        let start = self.i;
        // Fast path: no escapes, the body's bytes are the string.
        let run = special(&self.s[start..]).ok_or(SYNTAX)?;
        self.i = start + run;
        match self.s[self.i] {
            b'"' => {
                self.i += 1;
                return Ok(Node::Plain {
                    start: at(start),
                    end: at(self.i - 1),
                });
            }
            b'\\' => {}
            _ => return Err(SYNTAX),
        }
        let from = self.decoded.len();
        self.decoded.push_str(&self.text[start..self.i]);
        loop {
            let run = self.i;
            self.i += special(&self.s[run..]).unwrap_or(self.s.len() - run);
            self.decoded.push_str(&self.text[run..self.i]);
            match self.s.get(self.i) {
                Some(b'"') => {
                    self.i += 1;
                    // Decoded text is never longer than the body it came from.
                    return Ok(Node::Decoded {
                        start: at(from),
                        end: at(self.decoded.len()),
                    });
                }
                Some(b'\\') => {
                    self.i += 1;
                    let c = self.escape()?;
                    self.decoded.push(c);
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
                    0xd800..=0xdbff => match self.low_surrogate() {
                        Some(lo) => {
                            let c = 0x10000 + ((hi - 0xd800) << 10) + (lo - 0xdc00);
                            char::from_u32(c).ok_or(SYNTAX)?
                        }
                        None => self.lone_surrogate(),
                    },
                    0xdc00..=0xdfff => self.lone_surrogate(),
                    _ => char::from_u32(hi).ok_or(SYNTAX)?,
                }
            }
            _ => return Err(SYNTAX),
        })
    }

    /// The `\\uDC00`–`\\uDFFF` escape that completes a pair, read if it is next.
    fn low_surrogate(&mut self) -> Option<u32> {
        let escape = self.s.get(self.i..self.i + 6)?;
        let digits = std::str::from_utf8(escape.strip_prefix(b"\\u")?).ok()?;
        let lo = u32::from_str_radix(digits, 16).ok()?;
        // `from_str_radix` takes a sign; JSON's four hex digits do not.
        let hex = digits.bytes().all(|d| d.is_ascii_hexdigit());
        (hex && (0xdc00..=0xdfff).contains(&lo)).then(|| {
            self.i += 6;
            lo
        })
    }

    /// An escape of half a UTF-16 pair, alone: valid JSON (RFC 8259 §8.2) that names no
    /// Unicode text, so the document has no canonical form. What stands in for it is never
    /// written.
    fn lone_surrogate(&mut self) -> char {
        self.inexact = true;
        char::REPLACEMENT_CHARACTER
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
