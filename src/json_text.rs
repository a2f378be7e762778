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
}
