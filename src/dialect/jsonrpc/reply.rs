//! What one JSON-RPC message is to a call: its final response, an interim result, an error to
//! a `null` id (the server could not read the call), or anything else; read by serde_json, or
//! from its text where serde_json's `Value` cannot hold it.

use serde_json::Value;

use super::id::Id;

/// What one JSON-RPC message is to the call `id`.
pub(super) enum Reply {
    /// Its final response.
    Final,
    /// An interim result to it (MCP's `input_required`): its continuation runs under the key.
    Interim,
    /// An error object to a `null` id: a server writes it where it could not read a request.
    NotRead,
    /// Anything else: a notification, a request, an answer to another id.
    Other,
}

/// What a message is to the call `id`, read by serde_json or, where its `Value` cannot hold
/// the message though it is JSON (a lone surrogate escape, as JavaScript writes half of a cut
/// emoji; a number beyond a double; nesting past 128), from its text; `None` when it is not
/// JSON. A final response serde_json cannot read is a final response all the same: the call
/// ran, and must not run again.
pub(super) fn read(bytes: &[u8], id: &Id) -> Option<Reply> {
    if let Ok(message) = serde_json::from_slice::<Value>(bytes) {
        return Some(reply(message, id));
    }
    json(bytes).map(|text| reply_text(text, id))
}

/// `bytes` as JSON text, whitespace around it trimmed, if they are JSON (whatever serde_json's
/// `Value` can hold).
pub(super) fn json(bytes: &[u8]) -> Option<&str> {
    let text = std::str::from_utf8(bytes).ok()?;
    crate::json_text::is_json(text).then(|| text.trim())
}

/// [`reply`], read from a message's text (valid JSON): of a member given twice, the last, as
/// serde_json's `Value` keeps it.
fn reply_text(text: &str, id: &Id) -> Reply {
    if !text.starts_with('{') {
        return Reply::Other;
    }
    let member = |name: &str| last_member(text, name);
    let Ok(message_id) = member("id").map(serde_json::from_str::<Value>).transpose() else {
        // An id that cannot be read answers no call.
        return Reply::Other;
    };
    if !id.answers(message_id.as_ref()) {
        return match (message_id, member("error")) {
            (Some(Value::Null), Some(error)) if error.starts_with('{') => Reply::NotRead,
            _ => Reply::Other,
        };
    }
    match member("result") {
        Some(result) => {
            let interim = last_member(result, "resultType").is_some_and(|kind| {
                serde_json::from_str::<String>(kind).is_ok_and(|k| k == "input_required")
            });
            match interim {
                true => Reply::Interim,
                false => Reply::Final,
            }
        }
        None if member("error").is_some() => Reply::Final,
        None => Reply::Other,
    }
}

/// The value of the last member `name` of the object `text` (valid JSON; nothing for anything
/// else), as serde_json's `Value` keeps a member given twice.
pub(super) fn last_member<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    crate::json_text::children(text)
        .into_iter()
        .rev()
        .find(|c| c.is(name))
        .map(|c| c.value)
}

/// What `message` is to the call `id`.
fn reply(message: Value, id: &Id) -> Reply {
    let Value::Object(message) = message else {
        return Reply::Other;
    };
    if !id.answers(message.get("id")) {
        return match (message.get("id"), message.get("error")) {
            (Some(Value::Null), Some(Value::Object(_))) => Reply::NotRead,
            _ => Reply::Other,
        };
    }
    match message.get("result") {
        // MCP: only a result asking for more input (`resultType: "input_required"`) is a step;
        // "complete", a task handle ("task") and results of older peers (no type) are final.
        Some(result)
            if result
                .get("resultType")
                .is_some_and(|k| k == "input_required") =>
        {
            Reply::Interim
        }
        Some(_) => Reply::Final,
        None if message.contains_key("error") => Reply::Final,
        None => Reply::Other,
    }
}
