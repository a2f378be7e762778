//! The writer of the canonical form: members sorted by their UTF-16 code units, strings with
//! the minimal escapes.

use std::cmp::Ordering;

use super::number::write_number;
use super::parse::at;
use super::scan::special;
use super::{JsonError, Member, Node, Sink};

/// Writes a parsed document: object members sorted by name as each object is written.
pub(super) struct Writer<'t> {
    pub(super) nodes: &'t [Node],
    pub(super) body: &'t str,
    pub(super) decoded: &'t str,
    pub(super) order: &'t mut Vec<Member>,
}

impl Writer<'_> {
    /// Writes the value at `i`; returns the index after it.
    pub(super) fn write(&mut self, i: usize, out: &mut impl Sink) -> Result<usize, JsonError> {
        match self.nodes[i] {
            Node::Null => out.put(b"null"),
            Node::True => out.put(b"true"),
            Node::False => out.put(b"false"),
            Node::Number(n) => write_number(n, out),
            Node::Raw { start, end } => {
                out.put(&self.body.as_bytes()[start as usize..end as usize])
            }
            Node::Plain { .. } | Node::Decoded { .. } => self.write_text(i, out),
            Node::Array { len, next } => {
                out.put(b"[");
                let mut item = i + 1;
                for k in 0..len {
                    if k > 0 {
                        out.put(b",");
                    }
                    item = self.write(item, out)?;
                }
                out.put(b"]");
                return Ok(next as usize);
            }
            Node::Object { len, next } => {
                self.write_object(i, len as usize, out)?;
                return Ok(next as usize);
            }
        }
        Ok(i + 1)
    }

    fn write_object(&mut self, i: usize, len: usize, out: &mut impl Sink) -> Result<(), JsonError> {
        // This object's names go above whatever the enclosing objects are sorting.
        let base = self.order.len();
        let mut member = i + 1;
        for _ in 0..len {
            let (start, end, decoded) = match self.nodes[member] {
                Node::Plain { start, end } => (start, end, false),
                Node::Decoded { start, end } => (start, end, true),
                _ => (0, 0, false),
            };
            self.order.push(Member {
                start,
                end,
                decoded,
                node: at(member),
            });
            member = self.skip(member + 1);
        }
        let (body, decoded) = (self.body.as_bytes(), self.decoded.as_bytes());
        let name = |m: &Member| {
            let text = if m.decoded { decoded } else { body };
            &text[m.start as usize..m.end as usize]
        };
        let names = &mut self.order[base..];
        names.sort_unstable_by(|a, b| utf16_cmp_bytes(name(a), name(b)));
        if names.windows(2).any(|w| name(&w[0]) == name(&w[1])) {
            return Err(JsonError::NotCanonical);
        }
        out.put(b"{");
        for m in 0..len {
            if m > 0 {
                out.put(b",");
            }
            let k = self.order[base + m].node as usize;
            self.write_text(k, out);
            out.put(b":");
            self.write(k + 1, out)?;
        }
        out.put(b"}");
        self.order.truncate(base);
        Ok(())
    }

    /// The index after the value at `i`.
    fn skip(&self, i: usize) -> usize {
        match self.nodes[i] {
            Node::Array { next, .. } | Node::Object { next, .. } => next as usize,
            _ => i + 1,
        }
    }

    /// A string node: one with no escape in the body is already canonical.
    fn write_text(&self, i: usize, out: &mut impl Sink) {
        match self.nodes[i] {
            Node::Plain { start, end } => {
                out.put(b"\"");
                out.put(&self.body.as_bytes()[start as usize..end as usize]);
                out.put(b"\"");
            }
            Node::Decoded { start, end } => {
                write_string(&self.decoded[start as usize..end as usize], out);
            }
            _ => {}
        }
    }
}

/// RFC 8785 §3.2.3: members sort by the UTF-16 code units of their names.
///
/// UTF-8 byte order is code point order, which UTF-16 order follows except between U+E000..U+FFFF
/// (lead bytes `EE`, `EF`) and the supplementary planes (lead bytes `F0`..`F4`, surrogates in
/// UTF-16, which sort first). Up to the first differing byte the texts agree, so that byte
/// either leads a character in both or continues characters with the same lead byte.
#[cfg(test)]
pub(super) fn utf16_cmp(a: &str, b: &str) -> Ordering {
    utf16_cmp_bytes(a.as_bytes(), b.as_bytes())
}

/// Orders two valid UTF-8 texts by their UTF-16 code units (RFC 8785 §3.2.3), from their bytes.
pub(super) fn utf16_cmp_bytes(a: &[u8], b: &[u8]) -> Ordering {
    let Some(i) = a.iter().zip(b).position(|(x, y)| x != y) else {
        return a.len().cmp(&b.len());
    };
    let (x, y) = (a[i], b[i]);
    let high_bmp = |b: u8| b == 0xee || b == 0xef;
    if x >= 0xf0 && high_bmp(y) {
        Ordering::Less
    } else if y >= 0xf0 && high_bmp(x) {
        Ordering::Greater
    } else {
        x.cmp(&y)
    }
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
