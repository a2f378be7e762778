//! RFC 8785 (JSON Canonicalization Scheme) for fingerprints.
//!
//! A body already in canonical form is recognised in one pass ([`verbatim`]) and hashed as it
//! is. Any other is parsed once into a flat tree (nodes in preorder, strings as ranges of the
//! body, buffers reused per thread) and written out in canonical form: object members sorted
//! by their UTF-16 code units, no whitespace, numbers in ECMAScript's shortest form, strings
//! with the minimal escapes. Nesting is capped at [`MAX_DEPTH`] so hostile input cannot
//! exhaust the stack.

use std::cell::RefCell;
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

/// One node of a parsed document, in preorder. Ranges are byte offsets (bodies past 4 GiB are
/// hashed raw).
#[derive(Clone, Copy)]
enum Node {
    Null,
    True,
    False,
    /// A number to print in ECMAScript form.
    Number(f64),
    /// A number whose text in the body is already its ECMAScript form.
    Raw {
        start: u32,
        end: u32,
    },
    /// A string with no escape in the body: its contents are already canonical.
    Plain {
        start: u32,
        end: u32,
    },
    /// A string with escapes, decoded into the tree's text.
    Decoded {
        start: u32,
        end: u32,
    },
    /// `len` items follow; `next` is the index after the last of them.
    Array {
        len: u32,
        next: u32,
    },
    /// `len` members follow, each a name node then its value; `next` as for arrays.
    Object {
        len: u32,
        next: u32,
    },
}

/// A parsed document, reused by each thread: once its buffers have grown to the documents a
/// thread sees, canonicalising allocates nothing.
#[derive(Default)]
struct Tree {
    nodes: Vec<Node>,
    /// The decoded text of strings with escapes.
    decoded: String,
    /// Members being sorted, one object's run above the next's.
    order: Vec<Member>,
}

/// An object member while its object is written: where its name is, and its name node.
#[derive(Clone, Copy)]
struct Member {
    start: u32,
    end: u32,
    /// Whether the name is in the decoded text rather than the body.
    decoded: bool,
    node: u32,
}

/// Whether this thread's parse tree is destroyed (see [`super::buffers_gone`]).
#[cfg(test)]
pub(super) fn tree_gone() -> bool {
    TREE.try_with(|_| ()).is_err()
}

thread_local! {
    static TREE: RefCell<Tree> = const {
        RefCell::new(Tree {
            nodes: Vec::new(),
            decoded: String::new(),
            order: Vec::new(),
        })
    };
}

/// The most nodes a thread keeps room for between documents.
const KEEP_NODES: usize = 16 * 1024;

/// Writes the RFC 8785 form of `body` into `out`.
pub(crate) fn canonicalize(body: &[u8], out: &mut impl Sink) -> Result<(), JsonError> {
    let text = std::str::from_utf8(body).map_err(|_| JsonError::Malformed(NOT_UTF8))?;
    canonicalize_text(text, out)
}

/// Why a JSON body that is not UTF-8 is refused.
pub(crate) const NOT_UTF8: &str = "body is not UTF-8";

/// [`canonicalize`] for a body already checked to be UTF-8.
pub(crate) fn canonicalize_text(text: &str, out: &mut impl Sink) -> Result<(), JsonError> {
    if u32::try_from(text.len()).is_err() {
        return Err(JsonError::NotCanonical);
    }
    crate::reuse::with(
        &TREE,
        |tree| tree.nodes.capacity() <= KEEP_NODES,
        |tree| {
            tree.nodes.clear();
            tree.decoded.clear();
            tree.order.clear();
            canonicalize_into(text, tree, out)
        },
    )
}

fn canonicalize_into(text: &str, tree: &mut Tree, out: &mut impl Sink) -> Result<(), JsonError> {
    let Tree {
        nodes,
        decoded,
        order,
    } = tree;
    let mut parser = Parser {
        s: text.as_bytes(),
        text,
        i: 0,
        nodes,
        decoded,
        inexact: false,
    };
    parser.skip_ws();
    parser.value(0)?;
    parser.skip_ws();
    if parser.i != parser.s.len() {
        return Err(JsonError::Malformed(
            "trailing characters after the JSON document",
        ));
    }
    // Read to its end first: a document with no canonical form is still refused if it is
    // not JSON further on.
    if parser.inexact {
        return Err(JsonError::NotCanonical);
    }
    let mut writer = Writer {
        nodes,
        body: text,
        decoded,
        order,
    };
    writer.write(0, out).map(|_| ())
}

struct Parser<'a, 't> {
    s: &'a [u8],
    text: &'a str,
    i: usize,
    nodes: &'t mut Vec<Node>,
    decoded: &'t mut String,
    /// A value read has no exact canonical form (a number no double names exactly, a lone
    /// UTF-16 surrogate): the document is hashed as sent once it is read whole.
    inexact: bool,
}

const SYNTAX: JsonError = JsonError::Malformed("body is not valid JSON");

/// An offset into a body already known to fit `u32`.
fn at(i: usize) -> u32 {
    i as u32
}

impl Parser<'_, '_> {
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

    fn value(&mut self, depth: usize) -> Result<(), JsonError> {
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

/// Writes a parsed document: object members sorted by name as each object is written.
struct Writer<'t> {
    nodes: &'t [Node],
    body: &'t str,
    decoded: &'t str,
    order: &'t mut Vec<Member>,
}

impl Writer<'_> {
    /// Writes the value at `i`; returns the index after it.
    fn write(&mut self, i: usize, out: &mut impl Sink) -> Result<usize, JsonError> {
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

/// The length of the number at the start of `s` if ECMAScript prints it exactly as written,
/// by construction: a plain integer of at most 15 digits without leading zeros (never `-0`),
/// or a decimal with at most 15 significant digits (so no other decimal that short is the
/// same double, and the text is the shortest form), no trailing zero, no exponent and a value
/// of at least 1e-6 (smaller ones print in exponent form). `None` says only "not proven".
fn short_number(s: &[u8]) -> Option<usize> {
    let negative = s.first() == Some(&b'-');
    let digits = usize::from(negative);
    let mut i = digits;
    while let Some(b'0'..=b'9') = s.get(i) {
        i += 1;
    }
    let int = &s[digits..i];
    if int.is_empty() || (int[0] == b'0' && int.len() > 1) {
        return None;
    }
    match s.get(i) {
        Some(b'.') => {}
        Some(b'e' | b'E') => return None,
        _ => return (int.len() <= 15 && !(negative && int == b"0")).then_some(i),
    }
    let start = i + 1;
    let mut end = start;
    while let Some(b'0'..=b'9') = s.get(end) {
        end += 1;
    }
    let frac = &s[start..end];
    if frac.last().is_none_or(|&d| d == b'0') || matches!(s.get(end), Some(b'e' | b'E')) {
        return None;
    }
    let significant = if int == b"0" {
        let zeros = frac.iter().take_while(|&&d| d == b'0').count();
        if zeros > 5 {
            return None;
        }
        frac.len() - zeros
    } else {
        int.len() + frac.len()
    };
    (significant <= 15).then_some(end)
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

/// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`, the whole of `text`.
fn json_number_grammar(text: &str) -> bool {
    let mut s = text.as_bytes();
    let digits = |s: &mut &[u8]| {
        let n = s.iter().take_while(|b| b.is_ascii_digit()).count();
        *s = &s[n..];
        n
    };
    if let [b'-', rest @ ..] = s {
        s = rest;
    }
    if digits(&mut s) == 0 {
        return false;
    }
    if let [b'.', rest @ ..] = s {
        s = rest;
        if digits(&mut s) == 0 {
            return false;
        }
    }
    if let [b'e' | b'E', rest @ ..] = s {
        s = rest;
        if let [b'+' | b'-', rest @ ..] = s {
            s = rest;
        }
        if digits(&mut s) == 0 {
            return false;
        }
    }
    s.is_empty()
}

/// The index of the first byte that ends a plain run inside a JSON string: `"`, `\\` or a
/// control character. A block of 64 bytes at a time, then sixteen (SWAR on two words, one
/// branch), since strings are most of most bodies.
fn special(bytes: &[u8]) -> Option<usize> {
    find::<false>(bytes)
}

/// [`special`], or the first byte past ASCII: a string scan that checks UTF-8 only where
/// there is something to check.
fn special_or_non_ascii(bytes: &[u8]) -> Option<usize> {
    find::<true>(bytes)
}

/// The scan behind [`special`] and (`NON_ASCII`) [`special_or_non_ascii`]: long runs a block of
/// 64 bytes at a time, then the words where the first hit (or the end) is.
fn find<const NON_ASCII: bool>(bytes: &[u8]) -> Option<usize> {
    let ends_run = |b: u8| (b == b'"') | (b == b'\\') | (b < 0x20) | (NON_ASCII & (b >= 0x80));
    let mut blocks = bytes.chunks_exact(BLOCK);
    let mut at = 0;
    for block in &mut blocks {
        // No early exit inside a block, so LLVM compiles the test to vector compares and one
        // branch (SSE2, the x86-64 baseline): half the instructions of the words' scan.
        if block.iter().fold(false, |hit, &b| hit | ends_run(b)) {
            break;
        }
        at += BLOCK;
    }
    find_in_words::<NON_ASCII>(&bytes[at..]).map(|i| at + i)
}

/// The bytes [`find`] tests at once.
const BLOCK: usize = 64;

/// [`find`] on a short run, or inside the block that holds the first hit.
fn find_in_words<const NON_ASCII: bool>(bytes: &[u8]) -> Option<usize> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    // The high bit of each byte of `v` that is zero / below `n` (n <= 128). A borrow can also
    // flag bytes above a true hit, never below one, so the lowest flag is exact.
    let zero = |v: u64| v.wrapping_sub(ONES) & !v & HIGH;
    let below = |v: u64, n: u64| v.wrapping_sub(ONES * n) & !v & HIGH;
    let hits = |chunk: &[u8]| {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let x = u64::from_le_bytes(word);
        let high = if NON_ASCII { x & HIGH } else { 0 };
        zero(x ^ (ONES * u64::from(b'"')))
            | zero(x ^ (ONES * u64::from(b'\\')))
            | below(x, 0x20)
            | high
    };
    let first = |hits: u64| (hits.trailing_zeros() / 8) as usize;
    let mut pairs = bytes.chunks_exact(16);
    let mut at = 0;
    for pair in &mut pairs {
        let (low, high) = (hits(&pair[..8]), hits(&pair[8..]));
        if low | high != 0 {
            return Some(
                at + if low != 0 {
                    first(low)
                } else {
                    8 + first(high)
                },
            );
        }
        at += 16;
    }
    let mut rest = pairs.remainder();
    if rest.len() >= 8 {
        let h = hits(&rest[..8]);
        if h != 0 {
            return Some(at + first(h));
        }
        rest = &rest[8..];
        at += 8;
    }
    rest.iter()
        .position(|&b| b == b'"' || b == b'\\' || b < 0x20 || (NON_ASCII && b >= 0x80))
        .map(|i| at + i)
}

/// RFC 8785 §3.2.3: members sort by the UTF-16 code units of their names.
///
/// UTF-8 byte order is code point order, which UTF-16 order follows except between U+E000..U+FFFF
/// (lead bytes `EE`, `EF`) and the supplementary planes (lead bytes `F0`..`F4`, surrogates in
/// UTF-16, which sort first). Up to the first differing byte the texts agree, so that byte
/// either leads a character in both or continues characters with the same lead byte.
#[cfg(test)]
fn utf16_cmp(a: &str, b: &str) -> Ordering {
    utf16_cmp_bytes(a.as_bytes(), b.as_bytes())
}

/// Orders two valid UTF-8 texts by their UTF-16 code units (RFC 8785 §3.2.3), from their bytes.
fn utf16_cmp_bytes(a: &[u8], b: &[u8]) -> Ordering {
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

/// The canonical text of a finite number (see [`write_number`]).
fn canonical_number(n: f64) -> String {
    if n == 0.0 {
        return "0".to_owned();
    }
    ryu_js::Buffer::new().format_finite(n).to_owned()
}

/// A decimal number's exact value: its sign, its significant digits (no leading or trailing
/// zeros) and the power of ten of its last digit; `None` for zero, whatever its sign.
#[derive(PartialEq, Eq)]
struct Decimal<'a> {
    negative: bool,
    digits: Vec<&'a u8>,
    exponent: i128,
}

/// Whether two number texts (JSON grammar, or ECMAScript's form) name exactly the same value.
/// An exponent too large to read is never the same as anything.
pub(crate) fn same_decimal(a: &str, b: &str) -> bool {
    match (decimal(a), decimal(b)) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

/// `Some(None)` for zero, `Some(Some(value))` otherwise, `None` when the exponent overflows.
fn decimal(text: &str) -> Option<Option<Decimal<'_>>> {
    let (negative, unsigned) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exponent) = match unsigned.find(['e', 'E']) {
        Some(at) => (&unsigned[..at], unsigned[at + 1..].parse::<i128>().ok()?),
        None => (unsigned, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let all: Vec<&u8> = int.as_bytes().iter().chain(frac.as_bytes()).collect();
    let first = all.iter().position(|&&d| d != b'0');
    let Some(first) = first else {
        return Some(None);
    };
    let last = all.iter().rposition(|&&d| d != b'0').unwrap_or(first);
    let trailing = (all.len() - 1 - last) as i128;
    Some(Some(Decimal {
        negative,
        digits: all[first..=last].to_vec(),
        exponent: exponent
            .checked_sub(frac.len() as i128)?
            .checked_add(trailing)?,
    }))
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

    proptest::proptest! {
        /// The word-at-a-time scan agrees with a byte-at-a-time one on any bytes: runs of
        /// every length, several special bytes, bytes above 0x7f that could fool a borrow.
        #[test]
        fn special_agrees_with_a_plain_scan(
            bytes in proptest::collection::vec(
                proptest::prop_oneof![
                    4 => 0x20u8..0x7f,
                    1 => proptest::prelude::Just(b'"'),
                    1 => proptest::prelude::Just(b'\\'),
                    1 => 0u8..0x20,
                    2 => 0x80u8..=0xff,
                ],
                0..200,
            ),
        ) {
            let plain = bytes.iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20);
            proptest::prop_assert_eq!(special(&bytes), plain);
            let or_high = bytes.iter().position(|&b| b == b'"' || b == b'\\' || !(0x20..0x80).contains(&b));
            proptest::prop_assert_eq!(special_or_non_ascii(&bytes), or_high);
        }
    }

    /// Every pair of adjacent bytes at every position of a word pair (borrows run from a byte
    /// into the next, and across the two words): the scans agree with a byte-at-a-time one.
    #[test]
    fn special_agrees_with_a_plain_scan_on_every_pair_of_bytes() {
        let plain = |v: &[u8]| v.iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20);
        let or_high = |v: &[u8]| {
            v.iter()
                .position(|&b| b == b'"' || b == b'\\' || !(0x20..0x80).contains(&b))
        };
        let mut v = [b'a'; 17];
        for at in 0..16 {
            for first in 0..=255u8 {
                for second in 0..=255u8 {
                    v[at] = first;
                    v[at + 1] = second;
                    assert_eq!(special(&v), plain(&v), "{v:?}");
                    assert_eq!(special_or_non_ascii(&v), or_high(&v), "{v:?}");
                }
            }
            v[at] = b'a';
            v[at + 1] = b'a';
        }
    }

    /// Every byte at every position of runs that span one, two and three blocks and a tail,
    /// with a later hit behind it: the block test and the words agree with a plain scan.
    #[test]
    fn special_agrees_with_a_plain_scan_across_blocks() {
        let plain = |v: &[u8]| v.iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20);
        let or_high = |v: &[u8]| {
            v.iter()
                .position(|&b| b == b'"' || b == b'\\' || !(0x20..0x80).contains(&b))
        };
        for len in [BLOCK, BLOCK + 1, 2 * BLOCK + 15, 3 * BLOCK + 7] {
            let mut v = vec![b'a'; len];
            v[len - 1] = b'"';
            for at in 0..len {
                let kept = v[at];
                for byte in 0..=255u8 {
                    v[at] = byte;
                    assert_eq!(special(&v), plain(&v), "{len} {at} {byte}");
                    assert_eq!(special_or_non_ascii(&v), or_high(&v), "{len} {at} {byte}");
                }
                v[at] = kept;
            }
        }
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
    fn verbatim_accepts_exactly_the_canonical_form() {
        // Each of these is its own RFC 8785 form.
        for canonical in [
            "{}",
            "[]",
            "0",
            "-1",
            "123456789012345",
            "1234567890123456",
            "1e+21",
            "5e-324",
            "-1.5",
            "0.000001",
            "0.1",
            "-0.5",
            "123456789.012345",
            "1e-7",
            r#""""#,
            r#""\"\\\b\f\n\r\t\u0000\u001f""#,
            "\"\u{e9}\u{2028}\u{1f600}\"",
            r#"{"a":[null,true,false],"b":{"":1,"x":"y"}}"#,
            "{\"\\r\":4,\"a\":3,\"\u{1f600}\":2,\"\u{fb33}\":1}",
        ] {
            let canon = canon(canonical).expect(canonical);
            // Names with escapes are left to the full path; everything else here is accepted.
            let want = !canonical.starts_with("{\"\\r");
            assert_eq!(verbatim(canonical.as_bytes()), want, "{canonical}");
            assert_eq!(canon, canonical, "the full path agrees: {canonical}");
        }
        // Each of these differs from its canonical form, or is not JSON at all.
        for other in [
            " {}",
            "{} ",
            "[1, 2]",
            "{\"a\" :1}",
            r#"{"b":1,"a":2}"#,
            r#"{"a":1,"a":1}"#,
            "-0",
            "1.0",
            "1e21",
            "1E+21",
            "01",
            "1.",
            "9007199254740993",
            "0.1e1",
            "0.10",
            "0.0000001",
            "1234567890.12345678",
            "00.5",
            "-.5",
            r#""\/""#,
            r#""\u001F""#,
            r#""\u000a""#,
            r#""\u00e9""#,
            r#""\u007f""#,
            "\"\u{1f600}\"x",
            "{\"\u{fb33}\":1,\"\u{1f600}\":2}",
            "[1-2]",
            "nul",
            "\"a\u{1}\"",
            "",
            "[",
        ] {
            assert!(!verbatim(other.as_bytes()), "{other:?}");
            if let Ok(canon) = canon(other) {
                assert_ne!(canon, other, "the full path rewrites it");
            }
        }
        let deep = "[".repeat(129) + &"]".repeat(129);
        assert!(!verbatim(deep.as_bytes()));
        let deep = "[".repeat(128) + &"]".repeat(128);
        assert!(verbatim(deep.as_bytes()));
    }

    #[test]
    fn verbatim_accepts_only_utf8() {
        let long = "x".repeat(40);
        for (body, utf8) in [
            (
                format!("[\"{long}\u{e9}{long}\",\"\u{1f600}\"]").into_bytes(),
                true,
            ),
            (b"[\"\xff\"]".to_vec(), false),
            // Overlong, a surrogate, beyond U+10FFFF, cut short at the end.
            (b"[\"\xc0\xaf\"]".to_vec(), false),
            (b"[\"\xed\xa0\x80\"]".to_vec(), false),
            (b"[\"\xf4\x90\x80\x80\"]".to_vec(), false),
            (b"[\"\xc3".to_vec(), false),
            // Valid where the first byte past ASCII is, not further on.
            (
                [&b"[\"\xc3\xa9\",\""[..], long.as_bytes(), b"\xe9\"]"].concat(),
                false,
            ),
            // Outside strings, no byte past ASCII passes.
            (b"[1,\xc3\xa9]".to_vec(), false),
        ] {
            assert_eq!(verbatim(&body), utf8, "{}", String::from_utf8_lossy(&body));
            assert_eq!(
                std::str::from_utf8(&body).is_ok(),
                utf8 || body.starts_with(b"[1,")
            );
        }
    }

    #[test]
    fn utf16_order_agrees_with_encode_utf16() {
        let chars = [
            'a',
            '~',
            '\u{7f}',
            '\u{80}',
            '\u{7ff}',
            '\u{800}',
            '\u{d7ff}',
            '\u{e000}',
            '\u{fb33}',
            '\u{ffff}',
            '\u{10000}',
            '\u{1f600}',
            '\u{10ffff}',
        ];
        let texts: Vec<String> = chars
            .iter()
            .flat_map(|&c| {
                chars
                    .iter()
                    .map(move |&d| format!("{c}{d}"))
                    .chain([c.to_string(), format!("x{c}")])
            })
            .collect();
        for a in &texts {
            for b in &texts {
                assert_eq!(
                    utf16_cmp(a, b),
                    a.encode_utf16().cmp(b.encode_utf16()),
                    "{a:?} vs {b:?}"
                );
            }
        }
    }

    #[test]
    fn rfc8785_example() {
        // RFC 8785 §3.2.2 sample input and output, but for its first number: 333333333.33333329
        // is not a double, so RFC 8785 would merge it with 333333333.3333333 (issue 16 §2).
        let input = r#"{
          "numbers": [333333333.3333333, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
          "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
          "literals": [null, true, false]
        }"#;
        assert_eq!(
            canon(input).expect("valid"),
            r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#
        );
        assert_eq!(
            canon(&input.replace("333333333.3333333", "333333333.33333329")),
            Err(JsonError::NotCanonical)
        );
    }

    /// DESIGN §1.4: an escape of half a UTF-16 pair is valid JSON with no canonical form
    /// (hashed as sent, never merged with the replacement character or another half); a
    /// document with one, or with an inexact number, is still read to its end and refused
    /// if it is not JSON further on.
    #[test]
    fn lone_surrogates_have_no_canonical_form_and_the_rest_is_still_read() {
        for text in [
            r#""\ud800""#,
            r#""\udc00""#,
            r#"["\ud800\u0041"]"#,
            r#"{"a":"x\uDBFF\uDBFF\uDC00"}"#,
            r#""\ud800\ud800""#,
        ] {
            assert_eq!(canon(text), Err(JsonError::NotCanonical), "{text}");
        }
        assert_eq!(canon(r#""\ud83d\ude00""#).expect("a pair"), "\"\u{1f600}\"");
        assert_eq!(
            canon(r#""\uD83D\uDE00x""#).expect("a pair"),
            "\"\u{1f600}x\""
        );
        for bad in [
            r#"["\ud800", x]"#,
            r#"["\ud800""#,
            r#"[1e400, x]"#,
            r#"{"a":1e400,}"#,
            r#""\ud800\u12""#,
            r#""\ud800\u+c00""#,
        ] {
            assert!(matches!(canon(bad), Err(JsonError::Malformed(_))), "{bad}");
        }
    }

    /// Issue 16 §2: numbers merge only when their canonical form names exactly their value.
    #[test]
    fn numbers_a_double_cannot_hold_have_no_canonical_form() {
        for text in [
            "9007199254740993",
            "18446744073709551616",
            "123456789012345678901234567890",
            "1e-400",
            "-1e-400",
            "0.10000000000000001",
            "1e400",
        ] {
            assert_eq!(canon(text), Err(JsonError::NotCanonical), "{text}");
        }
        for (text, canonical) in [
            ("9007199254740992", "9007199254740992"),
            ("1.0", "1"),
            ("1E2", "100"),
            ("-0", "0"),
            ("0.000", "0"),
            ("100e-2", "1"),
            ("1.5e+300", "1.5e+300"),
        ] {
            assert_eq!(canon(text).as_deref(), Ok(canonical), "{text}");
        }
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
            "\"\\ud800",
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
