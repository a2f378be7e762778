//! JSON-RPC mode (MCP `tools/call` and any JSON-RPC over HTTP): what makes two calls the same,
//! and answers in JSON-RPC form.
//!
//! Every retry of a JSON-RPC call carries a new `id`, and MCP clients add a fresh
//! `_meta.progressToken`, so a plain HTTP fingerprint would call every retry a changed request
//! and a plain replay would answer with the wrong `id`. In this mode:
//!
//! - only single requests (objects with an `id`) whose `method` is on the allow-list (default
//!   `tools/call`) are guarded; notifications, other methods, batches and bodies that are not
//!   JSON-RPC pass through untouched (the server answers them as it would), **unless they carry
//!   a key**: a keyed request asks for a guarantee, and what cannot be guarded (a batch holding a
//!   guarded call, a `null` or missing id, a body this mode cannot read such as one starting
//!   with a byte-order mark) is refused with `call-unguardable`, nothing run;
//! - the key is the `Idempotency-Key` header or, if configured, the string at
//!   `params._meta[name]`, validated exactly as the header is (not empty, at most 255 bytes,
//!   visible ASCII, not a list); a `_meta` key that is not a string is refused; when both are
//!   present they must be the same key (then it is theirs), otherwise the call is refused;
//!   a `_meta` or key given twice, or a body that cannot be parsed but may hold the key, is
//!   refused too (a compressed body on a route that reads `_meta` keys among them: bodies are
//!   never decoded); params serde_json's `Value` cannot hold (a lone surrogate escape, a
//!   number beyond a double, nesting past 128) are read from their text, so they never hide a
//!   key; a guarded call without either passes through;
//! - a request without a key header, on a route that reads no `_meta` keys (the default),
//!   cannot ask for a guarantee: it passes unread, whatever its size (a big `tools/list`, a
//!   batch). Any other request is read to its end within the body limit, since its key may be
//!   anywhere in it; on routes with a `meta_key`, raise the body limit for big requests;
//! - on MCP 2026-07-28 (stateless, `Mcp-Method` and `Mcp-Name` headers), a keyed request whose
//!   `Mcp-Method` header names another method than its body is refused (`header-mismatch`,
//!   MCP's code -32020), nothing run, whichever of the two methods is guarded;
//! - the fingerprint covers what HTTP mode covers (path as sent, query, media type, the
//!   configured fingerprint headers), the `method`, and the `params` exactly as sent, canonical
//!   where exact (see [`crate::fingerprint`]), without `_meta` (progress tokens, trace context,
//!   per-request client info) and MCP's per-round-trip `inputResponses` and `requestState`;
//!   never the `id`; the scope is the layer's scope plus the method;
//! - the recorded outcome is the final JSON-RPC response (from a JSON body, or the response
//!   event of an SSE stream), kept as the bytes the server wrote; progress notifications and
//!   event ids are never recorded. A message serde_json's `Value` cannot hold is read from its
//!   text (of a member given twice, the last, as `Value` keeps it); an answer that is not JSON
//!   at all (a byte-order mark, a body cut or garbled) is a call the server took whose
//!   response cannot be read, as a stream without it is (below). An SSE answer is teed: the client receives it as it streams,
//!   each byte is read once as the WHATWG EventSource parser reads it (CRLF, LF or CR line
//!   ends, a leading byte-order mark; a last event without its blank line still counts), and a
//!   client that hangs up does not stop it being read to its end and recorded; a stream past
//!   the response limit is recorded at once as not stored. An answer too large to keep is
//!   classified as one read whole would be (under `DefinitiveOnly`, kept only under a
//!   success status), and retries are told its own status. An answer compressed all the
//!   same (a handler that compresses whatever it is asked) cannot be read either: under a
//!   success status it is taken as done, and retries are told its coding. The response
//!   answering the call is found by its `id`'s value (a server that writes `1.0` back as
//!   `1`, or an id beyond 2^53 back as the nearest double as JavaScript does, still answers
//!   it; a number and a string holding a number's text compare as that number, `"7"` for
//!   `7` and the reverse; a response with id `null` answers no call). A JSON body that says
//!   the call did not run or is not finished releases the key: MCP's interim results
//!   (`resultType: "input_required"`), whose continuation (with `inputResponses` and
//!   `requestState`, which the fingerprint leaves out) then runs under the same key, and an
//!   error object to a `null` id. Any other body that is not the call's response (an answer
//!   to another id, a notification, JSON that is not JSON-RPC, or not JSON) under a success
//!   status was a call the server took: it is taken as done, its response not stored, and
//!   retries are told so (-31007, `safe_new_key: false`). An event stream that ends, or
//!   breaks, without the call's response releases the key only when it carried such an interim result, or began with an error
//!   object to a `null` id (the server could not read the call); any other stream (MCP's SSE
//!   polling closes one after its priming event and sends the response on a resumed stream
//!   the layer never sees) under a success status was a call the server took: it is taken
//!   as done whatever the route's policy (under an error status the policy decides, as for
//!   any answer), and never run again (-31007 to retries, with `safe_new_key: false`: the
//!   outcome is not known here). Every other result is final, a task handle (`resultType:
//!   "task"`, the tasks extension) included: it is recorded and replayed like any other;
//! - replays are `200 application/json`: the recorded response byte for byte, but for its `id`,
//!   which is the new request's, written exactly as the client sent it
//!   (`123456789012345678901234567890`, `1e2` and `-0` stay as they are), and
//!   `Idempotency-Replayed: true`;
//! - the middleware's own answers are JSON-RPC errors echoing the request's `id` as sent
//!   (`null` where it could not be read: a body too large or unreadable, or not JSON-RPC), with
//!   the HTTP status of the problem (409, 413, 422, 503, …), a code outside the reserved range,
//!   and the problem details in `error.data`:
//!
//! | problem | code |
//! |---|---|
//! | key invalid | -31000 |
//! | in flight | -31001 |
//! | changed arguments (fingerprint mismatch) | -31002 |
//! | outcome unknown | -31003 |
//! | store unavailable | -31004 |
//! | body too large, unreadable or malformed | -31005 |
//! | execution failed | -31006 |
//! | response not stored | -31007 |
//! | scope missing (server misconfiguration) | -31008 |
//! | keyed call cannot be guarded | -31009 |
//! | not guarded (server misconfiguration) | -31010 |
//! | fingerprint failed (server error) | -31011 |
//! | recorded response in an encoding the retry does not accept | -31012 |
//! | `Mcp-Method` header does not match the body | -32020 (MCP's `HeaderMismatchError`) |

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response, header, request::Parts};

use super::http::{Admitted, Reading, refuse_body, refuse_key, refuse_scope};
use crate::body::ResponseBody;
use crate::fingerprint::Fingerprint;
use crate::key::{ScopedKey, parse_key};
use crate::observe::{self, Event};
use crate::problem::{Problem, ProblemKind};
use crate::scope::MakeScope;

mod answer;
mod call;
mod events;
mod id;
mod reply;
mod stored;

pub(crate) use answer::{Answer, final_response, is_definitive};
use call::{Call, HeaderMethod, Message, Parsed, parse};
pub(crate) use events::{Events, is_event_stream};
pub(crate) use id::Id;
pub(crate) use stored::{readdress, stored_call, stored_unread, unread_detail};

/// The `_meta` entry set on replayed results when [`JsonRpc::mark_replay_in_meta`] is on.
pub const REPLAY_META: &str = "tower-idempotency/replayed";

/// Settings of the JSON-RPC mode for a route (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct JsonRpc {
    pub(crate) methods: Vec<String>,
    pub(crate) meta_key: Option<String>,
    pub(crate) mark_replay_in_meta: bool,
}

impl Default for JsonRpc {
    fn default() -> Self {
        Self {
            methods: vec!["tools/call".to_owned()],
            meta_key: None,
            mark_replay_in_meta: false,
        }
    }
}

impl JsonRpc {
    /// The default: guard `tools/call`, key from the `Idempotency-Key` header only.
    pub fn new() -> Self {
        Self::default()
    }

    /// The methods guarded (default `tools/call`).
    pub fn methods<I, S>(mut self, methods: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.methods = methods.into_iter().map(Into::into).collect();
        self
    }

    /// Also accepts the key from `params._meta[name]` when the header is absent.
    pub fn meta_key(mut self, name: impl Into<String>) -> Self {
        self.meta_key = Some(name.into());
        self
    }

    /// Adds `"tower-idempotency/replayed": true` to `result._meta` of replays (default off).
    pub fn mark_replay_in_meta(mut self, on: bool) -> Self {
        self.mark_replay_in_meta = on;
        self
    }
}

/// `params` members that are not part of the operation: `_meta` (progress tokens, trace
/// context, MCP 2026-07-28's per-request client info) and the fields MCP's multi-round-trip
/// requests change on each round trip.
pub(crate) const NOT_THE_OPERATION: &[&str] = &["_meta", "inputResponses", "requestState"];

/// Everything the HTTP mode counts, the method and the exact params without `_meta` and the
/// per-round-trip fields; never the id.
fn fingerprint(
    parts: &Parts,
    trailers: Option<&HeaderMap>,
    call: &Call,
    options: &crate::fingerprint::FingerprintOptions,
    scheme: crate::fingerprint::Scheme,
) -> Result<Fingerprint, crate::fingerprint::MalformedBody> {
    let params = call.params.as_deref();
    let method = &call.method;
    crate::fingerprint::jsonrpc(
        parts,
        trailers,
        method,
        params,
        NOT_THE_OPERATION,
        options,
        scheme,
    )
}

/// What a fingerprint mismatch tells the client its call differs in.
pub(crate) const COVERS: &str = "params, path, query or content type";

/// Step 1 in JSON-RPC mode: whether the body must be read to know. A request with no key
/// header, on a route that reads no `_meta` keys, cannot ask for a guarantee: whatever it is
/// (a big `tools/list`, a batch), it passes unread. Any other is read to its end, within the
/// body limit: a key may sit anywhere in it.
pub(crate) fn reads_body<M>(reading: &Reading<'_, M>, settings: &JsonRpc, parts: &Parts) -> bool {
    parts.headers.contains_key(reading.header) || settings.meta_key.is_some()
}

/// The keys a call may be filed under whose body could not be read (too large, or cut off):
/// its header key under each guarded method (the one `Mcp-Method` names, if it names one of
/// them). None where the key could only be in the unread body, or the scope is missing.
pub(crate) fn unread_call_keys<M: MakeScope>(
    reading: &Reading<'_, M>,
    settings: &JsonRpc,
    parts: &Parts,
) -> Vec<ScopedKey> {
    let Ok(Some(key)) = parse_key(&parts.headers, reading.header) else {
        return Vec::new();
    };
    let Ok(scope) = reading.make_scope.make_scope(parts) else {
        return Vec::new();
    };
    let named = match HeaderMethod::of(&parts.headers) {
        HeaderMethod::One(method) if settings.methods.iter().any(|m| m == method) => Some(method),
        _ => None,
    };
    settings
        .methods
        .iter()
        .map(String::as_str)
        .filter(|method| named.is_none_or(|named| named == *method))
        .map(|method| ScopedKey::new(format!("{scope}\u{0}{method}"), key.as_ref()))
        .collect()
}

/// Steps 1–4 in JSON-RPC mode, once the body is read: the method decides what is guarded, the
/// key comes from the header or `params._meta`, the method joins the scope, and the
/// fingerprint covers method and params but not the `id`. A refusal answers the call's `id`.
pub(crate) fn admit<M: MakeScope>(
    reading: &Reading<'_, M>,
    settings: &JsonRpc,
    parts: &Parts,
    trailers: Option<&HeaderMap>,
    bytes: &[u8],
) -> Admitted<Arc<Id>> {
    let mcp_method = HeaderMethod::of(&parts.headers);
    // An invalid header key is refused as in HTTP mode, with a JSON-RPC error answering the
    // call's id where the body has one to read.
    let header_key = match parse_key(&parts.headers, reading.header) {
        Ok(key) => key,
        Err(error) => {
            let id = std::str::from_utf8(bytes)
                .ok()
                .and_then(|text| serde_json::from_str::<Message<'_>>(text).ok())
                .and_then(|message| message.id)
                .map_or_else(Id::null, |id| Id::new(id.get()));
            return Admitted::Refuse(refuse_key(&error, Arc::new(id)));
        }
    };
    let coded = super::coding(&parts.headers).is_some();
    let call = match parse(bytes, settings, header_key.as_deref(), mcp_method, coded) {
        Parsed::Guard(call) => call,
        Parsed::PassThrough => return Admitted::PassThrough,
        Parsed::Refuse(problem, id) => return Admitted::Refuse(refuse_body(problem, id)),
    };
    // The header and `_meta` agree when both are there (`parse` refuses otherwise).
    let Some(key) = header_key.map(|k| k.into_owned()).or(call.meta_key.clone()) else {
        return Admitted::PassThrough;
    };
    observe::count(Event::Attempt);
    let scope = match reading.make_scope.make_scope(parts) {
        Ok(scope) => scope,
        Err(missing) => return Admitted::Refuse(refuse_scope(&missing, call.id)),
    };
    // The method joins the scope: a key names one operation of one tool method.
    let scope = format!("{scope}\u{0}{}", call.method);
    match fingerprint(parts, trailers, &call, reading.fingerprint, reading.scheme) {
        Ok(fingerprint) => Admitted::Guard {
            key: ScopedKey::new(scope, key),
            fingerprint,
            reply: call.id,
        },
        Err(error) => {
            let problem = Problem::new(ProblemKind::BodyMalformed, error.to_string());
            Admitted::RefuseKeyed(refuse_body(problem, call.id), ScopedKey::new(scope, key))
        }
    }
}

/// The JSON-RPC error code for a problem: outside the reserved −32768..−32000 range.
fn code(kind: ProblemKind) -> i64 {
    match kind {
        ProblemKind::KeyMissing | ProblemKind::KeyInvalid => -31000,
        ProblemKind::InFlight => -31001,
        ProblemKind::FingerprintMismatch => -31002,
        ProblemKind::OutcomeUnknown => -31003,
        ProblemKind::StoreUnavailable => -31004,
        // A malformed body is no changed call: a client told -31002 would take a new key.
        ProblemKind::BodyTooLarge | ProblemKind::BodyUnreadable | ProblemKind::BodyMalformed => {
            -31005
        }
        ProblemKind::ExecutionFailed => -31006,
        ProblemKind::ResponseNotStored => -31007,
        ProblemKind::ScopeMissing => -31008,
        ProblemKind::CallUnguardable => -31009,
        ProblemKind::NotGuarded => -31010,
        ProblemKind::FingerprintFailed => -31011,
        ProblemKind::EncodingNotAccepted => -31012,
        // MCP's own code for it (HeaderMismatchError, 2026-07-28).
        ProblemKind::HeaderMismatch => -32020,
    }
}

/// A problem as a JSON-RPC error response for the call `id`, written back as it was sent.
pub(crate) fn error_response<B>(problem: &Problem, id: &Id) -> Response<ResponseBody<B>> {
    let error = serde_json::json!({
        "code": code(problem.kind),
        "message": problem.kind.title(),
        "data": problem.to_json(),
    });
    let message = format!(r#"{{"jsonrpc":"2.0","id":{},"error":{error}}}"#, id.raw());
    let mut res = Response::new(ResponseBody::full(Bytes::from(message), None));
    *res.status_mut() = problem.kind.status();
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(seconds) = problem.retry_after {
        res.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    res
}

#[cfg(test)]
mod tests;
