//! Reading and splicing JSON text without re-serialising it: a value's members or elements as
//! slices of the text, so a replay or a fingerprint can keep every byte it does not change
//! (numbers beyond a double's precision, member order, duplicate names).
//!
//! Every function here expects valid JSON (checked before, by a parser); on anything else it
//! returns something harmless, never panics.

/// A member of an object or an element of an array.
pub(crate) struct Child<'a> {
    /// The member's name as written (quotes and escapes included); `None` for an element.
    pub(crate) raw_name: Option<&'a str>,
    /// The member's decoded name, or the element's index; empty for a name that names no
    /// Unicode text (a lone surrogate escape), which [`is`](Self::is) matches with nothing.
    pub(crate) name: String,
    /// Whether `name` is the name as written, decoded.
    named: bool,
    pub(crate) value: &'a str,
}

impl Child<'_> {
    pub(crate) fn is(&self, token: &str) -> bool {
        self.named && self.name == token
    }
}

/// The members or elements of a valid JSON object or array; nothing for a scalar.
pub(crate) fn children(value: &str) -> Vec<Child<'_>> {
    let bytes = value.as_bytes();
    let object = match bytes.first() {
        Some(b'{') => true,
        Some(b'[') => false,
        _ => return Vec::new(),
    };
    let mut out = Vec::new();
    let mut i = skip_ws(bytes, 1);
    let mut index = 0usize;
    while i < bytes.len() && bytes[i] != b'}' && bytes[i] != b']' {
        let (raw_name, name, named) = if object {
            let end = skip_string(bytes, i);
            let raw = &value[i..end];
            let decoded = serde_json::from_str::<String>(raw);
            i = skip_ws(bytes, end);
            // The colon.
            i = skip_ws(bytes, i + 1);
            let named = decoded.is_ok();
            (Some(raw), decoded.unwrap_or_default(), named)
        } else {
            (None, index.to_string(), true)
        };
        let end = skip_value(bytes, i);
        out.push(Child {
            raw_name,
            name,
            named,
            value: &value[i..end],
        });
        index += 1;
        i = skip_ws(bytes, end);
        if bytes.get(i) == Some(&b',') {
            i = skip_ws(bytes, i + 1);
        }
    }
    out
}

/// Whether `text` is one JSON value (RFC 8259), with whitespace around it: any escape of four
/// hex digits (a lone surrogate too), any number the grammar allows (`1e400` too), nested to
/// any depth (read without recursion). For documents serde_json's `Value` cannot hold but
/// that are JSON all the same, which the functions here then read.
pub(crate) fn is_json(text: &str) -> bool {
    let b = text.as_bytes();
    // The closing byte each open container waits for.
    let mut open: Vec<u8> = Vec::new();
    let mut i = skip_ws(b, 0);
    loop {
        // A value at `i`; a container's first member or element is read on the next turn.
        match b.get(i) {
            Some(b'{') => {
                i = skip_ws(b, i + 1);
                if b.get(i) == Some(&b'}') {
                    i += 1;
                } else {
                    open.push(b'}');
                    match member_name_end(b, i) {
                        Some(end) => i = end,
                        None => return false,
                    }
                    continue;
                }
            }
            Some(b'[') => {
                i = skip_ws(b, i + 1);
                if b.get(i) == Some(&b']') {
                    i += 1;
                } else {
                    open.push(b']');
                    continue;
                }
            }
            Some(b'"') => match string_end(b, i) {
                Some(end) => i = end,
                None => return false,
            },
            Some(b't') if b[i..].starts_with(b"true") => i += 4,
            Some(b'f') if b[i..].starts_with(b"false") => i += 5,
            Some(b'n') if b[i..].starts_with(b"null") => i += 4,
            Some(b'-' | b'0'..=b'9') => match number_end(b, i) {
                Some(end) => i = end,
                None => return false,
            },
            _ => return false,
        }
        // After a value: containers close, or a comma leads to the next value.
        loop {
            i = skip_ws(b, i);
            let Some(&close) = open.last() else {
                return i == b.len();
            };
            match b.get(i) {
                Some(&c) if c == close => {
                    open.pop();
                    i += 1;
                }
                Some(b',') => {
                    i = skip_ws(b, i + 1);
                    if close == b'}' {
                        match member_name_end(b, i) {
                            Some(end) => i = end,
                            None => return false,
                        }
                    }
                    break;
                }
                _ => return false,
            }
        }
    }
}

/// Past a member's name, its colon and the whitespace after: where its value starts.
fn member_name_end(b: &[u8], i: usize) -> Option<usize> {
    let i = skip_ws(b, string_end(b, i)?);
    (b.get(i) == Some(&b':')).then(|| skip_ws(b, i + 1))
}

/// The index after the string that opens at `i`, if it is one: no control characters, only
/// JSON's escapes.
fn string_end(b: &[u8], mut i: usize) -> Option<usize> {
    if b.get(i) != Some(&b'"') {
        return None;
    }
    i += 1;
    loop {
        match *b.get(i)? {
            b'"' => return Some(i + 1),
            b'\\' => match *b.get(i + 1)? {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => i += 2,
                b'u' if b.get(i + 2..i + 6)?.iter().all(u8::is_ascii_hexdigit) => i += 6,
                _ => return None,
            },
            0..0x20 => return None,
            _ => i += 1,
        }
    }
}

/// The index after the number that starts at `i`, if it is one (RFC 8259 §6's grammar).
fn number_end(b: &[u8], mut i: usize) -> Option<usize> {
    let digits = |from: usize| {
        let n = b[from.min(b.len())..]
            .iter()
            .take_while(|c| c.is_ascii_digit())
            .count();
        (n > 0).then_some(from + n)
    };
    if b.get(i) == Some(&b'-') {
        i += 1;
    }
    i = match b.get(i)? {
        b'0' => i + 1,
        b'1'..=b'9' => digits(i)?,
        _ => return None,
    };
    if b.get(i) == Some(&b'.') {
        i = digits(i + 1)?;
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(b.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        i = digits(i)?;
    }
    Some(i)
}

fn skip_ws(bytes: &[u8], mut i: usize) -> usize {
    while matches!(bytes.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i.min(bytes.len())
}

/// The index after the string that opens at `i`.
fn skip_string(bytes: &[u8], mut i: usize) -> usize {
    i += 1;
    while let Some(&b) = bytes.get(i) {
        match b {
            b'\\' => i += 2,
            b'"' => return i + 1,
            _ => i += 1,
        }
    }
    // Never past the end, even for a string cut short after a backslash.
    i.min(bytes.len())
}

/// The index after the value that starts at `i`.
fn skip_value(bytes: &[u8], i: usize) -> usize {
    let i = i.min(bytes.len());
    match bytes.get(i) {
        Some(b'"') => skip_string(bytes, i),
        Some(b'{' | b'[') => {
            let mut depth = 0usize;
            let mut j = i;
            while let Some(&b) = bytes.get(j) {
                match b {
                    b'"' => {
                        j = skip_string(bytes, j);
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return j + 1;
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            j
        }
        _ => {
            let mut j = i;
            while let Some(&b) = bytes.get(j) {
                if matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                    break;
                }
                j += 1;
            }
            j
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Text that is not JSON (a corrupt stored record) gives something harmless, never a panic.
    #[test]
    fn text_cut_short_never_panics() {
        let whole = br#"{"id":"\"x","result":{"a":[1,{"b":"\\"}]},"n":12}"#;
        for end in 0..=whole.len() {
            let text = String::from_utf8_lossy(&whole[..end]);
            let _ = children(&text);
            for child in children(&text) {
                let _ = children(child.value);
            }
        }
        let _ = children(r#"{"id":"\"#);
        let _ = children(r#"{"id":"#);
        let _ = children(r#"{"#);
    }

    /// `is_json` agrees with serde_json wherever serde_json can answer, and reads what its
    /// `Value` cannot hold: lone surrogate escapes, numbers beyond a double, deep nesting.
    #[test]
    fn is_json_reads_rfc_8259() {
        let valid = [
            "0",
            "-0",
            "1.5e-3",
            "-12E+4",
            "1e400",
            "true",
            " null ",
            "\"\"",
            r#""a\"b\\\/\u00e9""#,
            "\"\\ud800\"",
            "[]",
            "{}",
            "[1,[2,{}],\"x\"]",
            r#"{"a":{"b":[]},"a":1}"#,
            "\"é\"",
        ];
        for text in valid {
            assert!(is_json(text), "{text}");
        }
        let deep = format!("{}1{}", "[".repeat(10_000), "]".repeat(10_000));
        assert!(is_json(&deep));
        let invalid = [
            "",
            " ",
            "01",
            "-",
            "1.",
            ".5",
            "1e",
            "+1",
            "tru",
            "nul",
            "[1,]",
            "{,}",
            "{\"a\"}",
            r#"{"a":1,}"#,
            "[1 2]",
            "{1:2}",
            "\"\\x\"",
            "\"\\u12\"",
            "\"a\nb\"",
            "1 2",
            "[",
            "\u{feff}1",
            r#"{"a":1}}"#,
            "[1]]",
            "NaN",
            "Infinity",
        ];
        for text in invalid {
            assert!(!is_json(text), "{text:?}");
        }
        let whole = r#"{"id":"\"x","result":{"a":[1,{"b":"\\"}],"c":-1.5e3},"n":12}"#;
        assert!(is_json(whole));
        for end in 0..whole.len() {
            assert!(!is_json(&whole[..end]), "{}", &whole[..end]);
        }
        for text in valid.iter().chain(invalid.iter()) {
            if serde_json::from_str::<serde_json::Value>(text).is_ok() {
                assert!(is_json(text), "serde_json reads {text:?}");
            }
        }
    }
}
