//! What a captured answer holds for a call: its final response, a sign it did not run or is
//! not finished, or nothing this layer can read; and whether a final response is definitive.

use bytes::Bytes;
use http::HeaderMap;
use serde_json::Value;

use super::events::{Events, is_event_stream};
use super::id::Id;
use super::reply::{Reply, json, last_member, read};

/// What an answer holds for a call.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    /// The call's final response, as the server wrote it.
    Final(Bytes),
    /// No outcome to keep: an answer (a JSON body, or a stream's events) carrying an interim
    /// result (MCP's `input_required`), or beginning with an error to a `null` id (the server
    /// could not read the call). The key is given back.
    NotFinal,
    /// An answer without the call's response and without a sign that it was not run: the
    /// server took the call, and its response went where the layer cannot see it (MCP's SSE
    /// polling closes a stream after its priming event and sends the response on a resumed
    /// one), or cannot be read (not JSON; JSON that answers another id or is not JSON-RPC).
    /// Taken as done, its response not stored: a retry never runs it again.
    Unseen,
}

/// What a captured body holds for the call `id`: the body itself for JSON, the first final
/// response event for SSE (see [`Answer`]).
pub(crate) fn final_response(headers: &HeaderMap, body: &[u8], id: &Id) -> Answer {
    if !is_event_stream(headers) {
        return match read(body, id) {
            Some(Reply::Final) => Answer::Final(Bytes::copy_from_slice(body)),
            // Only a sign that the call did not run, or is not finished, gives the key back.
            Some(Reply::Interim | Reply::NotRead) => Answer::NotFinal,
            // JSON that is not the call's response (an answer to another id, a notification,
            // not JSON-RPC at all), or not JSON (it starts with a byte-order mark, or is cut or
            // garbled): the server answered the call, but what it said cannot be read. Taken
            // as done (DESIGN §3), as a stream that ends without the response is: the less
            // readable answer is never the safer one.
            Some(Reply::Other) | None => Answer::Unseen,
        };
    }
    // The first final response in the stream, as the tee records it.
    let mut events = Events::default();
    match events.feed(body, id).or_else(|| events.finish(id)) {
        Some(message) => Answer::Final(message),
        None if events.gives_back() => Answer::NotFinal,
        None => Answer::Unseen,
    }
}

/// Whether a final response is definitive (DESIGN §3 for JSON-RPC): results are, tool errors
/// included (`isError`); protocol errors are, except internal and server errors.
pub(crate) fn is_definitive(message: &[u8]) -> bool {
    let code = match serde_json::from_slice::<Value>(message) {
        Ok(Value::Object(message)) => message
            .get("error")
            .and_then(|e| e.get("code"))
            .and_then(Value::as_i64),
        Ok(_) => return false,
        // JSON serde_json's `Value` cannot hold (see `read`): its error's code from the text.
        Err(_) => {
            let Some(text) = json(message).filter(|text| text.starts_with('{')) else {
                return false;
            };
            last_member(text, "error")
                .and_then(|error| last_member(error, "code"))
                .and_then(|code| serde_json::from_str::<i64>(code).ok())
        }
    };
    match code {
        None => true,
        Some(code) => !(code == -32603 || (-32099..=-32000).contains(&code)),
    }
}
