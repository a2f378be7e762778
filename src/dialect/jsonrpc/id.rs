//! A request's `id` as it was sent, and which responses answer it.

use serde_json::Value;

/// A request's `id` as it was sent: its text, written back byte for byte, and its value, to
/// find the response that answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Id {
    raw: Box<str>,
    /// `None` for `null`, and for an id that is not a value this layer can read (a number
    /// beyond a double's range, `1e400`): such an id answers no call.
    value: Option<Value>,
}

impl Id {
    pub(super) fn new(raw: &str) -> Self {
        Self {
            raw: raw.trim().into(),
            value: serde_json::from_str(raw)
                .ok()
                .filter(|value: &Value| !value.is_null()),
        }
    }

    /// Whether this layer can read the id's value, so that a response can be found to
    /// answer it (not `null`, not a number beyond a double's range).
    pub(super) fn readable(&self) -> bool {
        self.value.is_some()
    }

    /// `null`: for refusals of bodies whose id cannot be read.
    pub(crate) fn null() -> Self {
        Self::new("null")
    }

    /// The id's text as the client sent it.
    pub(crate) fn raw(&self) -> &str {
        &self.raw
    }

    /// Whether a response's `id` member answers this request: the same value, numbers by the
    /// double nearest their value. Numbers of one value are (a server may write `1.0` back as
    /// `1`, `1e2` as `100`), and so is an id beyond 2^53 that a server reading numbers as
    /// doubles (JavaScript's `JSON.parse`) writes back rounded: its answer can only be to
    /// this call, and not finding it would give the key back and run the call again. For the
    /// same reason a number and a string holding a number's text compare as that number (a
    /// server that keeps ids as text writes `7` back as `"7"`, one that reads such text as a
    /// number writes `"7"` back as `7`); two strings compare as they are.
    /// A response with id `null` (written where a server could not read the call's id) answers
    /// no call, and an id this layer cannot read is answered by none.
    pub(super) fn answers(&self, id: Option<&Value>) -> bool {
        match (id, &self.value) {
            (Some(Value::Null) | None, _) | (_, None) => false,
            (Some(theirs), Some(ours)) if theirs.is_number() || ours.is_number() => {
                match (number(theirs), number(ours)) {
                    (Some(theirs), Some(ours)) => theirs == ours,
                    _ => false,
                }
            }
            (Some(theirs), Some(ours)) => theirs == ours,
        }
    }
}

/// The double nearest a number, or a string holding exactly a JSON number's text.
fn number(value: &Value) -> Option<f64> {
    match value {
        Value::Number(n) => n.as_f64(),
        Value::String(text) if text.trim() == text => {
            serde_json::from_str::<serde_json::Number>(text)
                .ok()?
                .as_f64()
        }
        _ => None,
    }
}
