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
    /// The member's decoded name, or the element's index.
    pub(crate) name: String,
    pub(crate) value: &'a str,
}

impl Child<'_> {
    pub(crate) fn is(&self, token: &str) -> bool {
        self.name == token
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
        let (raw_name, name) = if object {
            let end = skip_string(bytes, i);
            let raw = &value[i..end];
            let decoded = serde_json::from_str::<String>(raw).unwrap_or_default();
            i = skip_ws(bytes, end);
            // The colon.
            i = skip_ws(bytes, i + 1);
            (Some(raw), decoded)
        } else {
            (None, index.to_string())
        };
        let end = skip_value(bytes, i);
        out.push(Child {
            raw_name,
            name,
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

/// The top-level member `name` of an object whose text may be cut short (a body's first
/// bytes), as its raw value: `Some(Some(value))` when found whole, `Some(None)` when the object
/// is known not to have it, `None` when the text ends before that is known. Values are
/// skipped, not read.
pub(crate) fn member_in_prefix<'a>(text: &'a [u8], name: &str) -> Option<Option<&'a [u8]>> {
    let mut i = skip_ws(text, 0);
    if text.get(i)? != &b'{' {
        return Some(None);
    }
    i = skip_ws(text, i + 1);
    loop {
        match text.get(i)? {
            b'}' => return Some(None),
            b'"' => {}
            _ => return Some(None),
        }
        let end = skip_string(text, i);
        if end > text.len() || text.get(end - 1) != Some(&b'"') || end == i + 1 {
            return None;
        }
        let key = serde_json::from_slice::<String>(&text[i..end]).ok();
        i = skip_ws(text, end);
        if text.get(i)? != &b':' {
            return Some(None);
        }
        i = skip_ws(text, i + 1);
        text.get(i)?;
        let value_end = skip_value(text, i);
        // A value that runs to the end of the text may be cut short.
        if value_end >= text.len() {
            return None;
        }
        if key.as_deref() == Some(name) {
            return Some(Some(&text[i..value_end]));
        }
        i = skip_ws(text, value_end);
        match text.get(i)? {
            b',' => i = skip_ws(text, i + 1),
            _ => return Some(None),
        }
    }
}

fn skip_ws(bytes: &[u8], mut i: usize) -> usize {
    while matches!(bytes.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
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
    i
}

/// The index after the value that starts at `i`.
fn skip_value(bytes: &[u8], i: usize) -> usize {
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

    #[test]
    fn a_member_is_found_in_a_prefix_or_reported_undecided() {
        let full = br#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"x":[1,2]}}"#;
        for cut in 0..full.len() {
            let found = member_in_prefix(&full[..cut], "method");
            if let Some(Some(value)) = found {
                assert_eq!(value, br#""tools/list""#, "cut at {cut}");
            }
            // Never a wrong "absent" for a text that does hold it.
            assert_ne!(found, Some(None), "cut at {cut}");
        }
        assert_eq!(
            member_in_prefix(full, "method"),
            Some(Some(&br#""tools/list""#[..]))
        );
        assert_eq!(member_in_prefix(br#"{"a":1}"#, "method"), Some(None));
        assert_eq!(member_in_prefix(br#"[1,2"#, "method"), Some(None));
        assert_eq!(
            member_in_prefix(br#"{"params":{"method":"x"},"method":"y","#, "method"),
            Some(Some(&br#""y""#[..])),
            "only top-level members count"
        );
    }
}
