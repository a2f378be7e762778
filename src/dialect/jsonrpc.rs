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
use http::{HeaderMap, HeaderValue, Response, StatusCode, header, request::Parts};
use serde_json::Value;
use serde_json::value::RawValue;

use super::http::{Admitted, Reading, refuse_body, refuse_key, refuse_scope};
use crate::body::ResponseBody;
use crate::fingerprint::Fingerprint;
use crate::key::{ScopedKey, parse_key};
use crate::observe::{self, Event};
use crate::problem::{Problem, ProblemKind};
use crate::scope::MakeScope;
use crate::store::StoredResponse;

/// The MCP 2026-07-28 header naming a Streamable HTTP request's JSON-RPC method.
pub(crate) static MCP_METHOD: http::HeaderName = http::HeaderName::from_static("mcp-method");

/// What a request's `Mcp-Method` header says, as the check against its body reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HeaderMethod<'a> {
    /// No `Mcp-Method` line.
    Absent,
    /// One line, in visible ASCII.
    One(&'a str),
    /// Several lines, or one that is not visible ASCII: a server may read any of them, or
    /// their join, so it names no one method the body can be held to.
    Unclear,
}

impl<'a> HeaderMethod<'a> {
    /// The `Mcp-Method` lines of `headers`.
    pub(crate) fn of(headers: &'a HeaderMap) -> Self {
        let mut lines = headers.get_all(&MCP_METHOD).iter();
        match (lines.next(), lines.next()) {
            (None, _) => Self::Absent,
            // Whitespace around a value is not part of it (an in-process caller may leave
            // some; hyper strips it).
            (Some(line), None) => line.to_str().map_or(Self::Unclear, |named| {
                Self::One(named.trim_matches([' ', '\t']))
            }),
            (Some(_), Some(_)) => Self::Unclear,
        }
    }

    /// Whether it names another method than the body's `method`.
    fn disagrees(self, method: &str) -> bool {
        match self {
            Self::Absent => false,
            Self::One(named) => named != method,
            Self::Unclear => true,
        }
    }
}

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
    fn new(raw: &str) -> Self {
        Self {
            raw: raw.trim().into(),
            value: serde_json::from_str(raw)
                .ok()
                .filter(|value: &Value| !value.is_null()),
        }
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
    fn answers(&self, id: Option<&Value>) -> bool {
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

/// A guarded JSON-RPC call.
#[derive(Debug, Clone)]
pub(crate) struct Call {
    pub(crate) id: Arc<Id>,
    pub(crate) method: String,
    /// The params' text as sent, if any.
    params: Option<String>,
    /// The key from `params._meta`, validated like the header's.
    pub(crate) meta_key: Option<String>,
}

/// What the mode makes of a request body.
#[derive(Debug)]
pub(crate) enum Parsed {
    /// One call of a guarded method, with an id and a key: guard it.
    Guard(Call),
    /// Not a guarded call, and not asked to be: hand it on untouched.
    PassThrough,
    /// A call that asks for a guarantee (it carries a key) the mode cannot give: refuse it,
    /// answering the request `id` (or `null`).
    Refuse(Problem, Arc<Id>),
}

/// The top-level members of a request, as text. A member given twice is an error; `null`
/// reads as absent.
struct Message<'a> {
    id: Option<&'a RawValue>,
    method: Option<&'a RawValue>,
    params: Option<&'a RawValue>,
    /// Whether it has a `result` or an `error`: a response, which names no method.
    answers: bool,
}

// By hand rather than derived: the one derive in the crate would compile `serde_derive` into
// every user's build.
impl<'de> serde::Deserialize<'de> for Message<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(MessageVisitor)
    }
}

struct MessageVisitor;

impl<'de> serde::de::Visitor<'de> for MessageVisitor {
    type Value = Message<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON-RPC request object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut message = Message {
            id: None,
            method: None,
            params: None,
            answers: false,
        };
        let mut seen = [false; 3];
        while let Some(member) = map.next_key::<Member>()? {
            let (slot, name, i) = match member {
                Member::Id => (&mut message.id, "id", 0),
                Member::Method => (&mut message.method, "method", 1),
                Member::Params => (&mut message.params, "params", 2),
                Member::Answer => {
                    message.answers = true;
                    map.next_value::<serde::de::IgnoredAny>()?;
                    continue;
                }
                Member::Other => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                    continue;
                }
            };
            if std::mem::replace(&mut seen[i], true) {
                return Err(serde::de::Error::duplicate_field(name));
            }
            *slot = map.next_value()?;
        }
        Ok(message)
    }
}

/// A member name of a request, escapes decoded (`"\u0069d"` is `id`).
enum Member {
    Id,
    Method,
    Params,
    /// `result` or `error`.
    Answer,
    Other,
}

impl<'de> serde::Deserialize<'de> for Member {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_identifier(MemberVisitor)
    }
}

struct MemberVisitor;

impl serde::de::Visitor<'_> for MemberVisitor {
    type Value = Member;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a member name")
    }

    fn visit_str<E>(self, name: &str) -> Result<Member, E> {
        Ok(match name {
            "id" => Member::Id,
            "method" => Member::Method,
            "params" => Member::Params,
            "result" | "error" => Member::Answer,
            _ => Member::Other,
        })
    }
}

/// Reads `body`. `header_key` is the request's `Idempotency-Key` header, if any: a keyed
/// request asks for a guarantee, so what cannot be guarded is refused rather than run
/// unguarded (a batch with a guarded call, a `null` id, a body this mode cannot read, a `_meta`
/// key that is not a valid key, a header and a `_meta` key that differ, an `Mcp-Method` header
/// that names another method than the body). When the header and `_meta` agree, the key is
/// theirs; either alone is the key. A `coded` body (`Content-Encoding`) is never read: on a
/// route that reads `_meta` keys it may hold one, so it is refused there as any body this mode
/// cannot read that may carry a key.
pub(crate) fn parse(
    body: &[u8],
    settings: &JsonRpc,
    header_key: Option<&str>,
    mcp_method: HeaderMethod<'_>,
    coded: bool,
) -> Parsed {
    let refuse = |kind, detail: &str, id: Arc<Id>| Parsed::Refuse(Problem::new(kind, detail), id);
    // A body this mode cannot read may still carry a `_meta` key that the server reads (after
    // decoding it, if it is coded).
    let may_carry_key = header_key.is_some()
        || (coded && settings.meta_key.is_some())
        || may_hold_meta_key(body, settings);
    let unreadable = |why: &str| match may_carry_key {
        true => refuse(
            ProblemKind::CallUnguardable,
            &format!(
                "this request carries an idempotency key but its body is not one JSON-RPC request \
                 this layer can read ({why}); nothing was run"
            ),
            Arc::new(Id::null()),
        ),
        false => Parsed::PassThrough,
    };
    if coded {
        return unreadable(
            "it is compressed (Content-Encoding); decompress requests before this layer to \
             guard them",
        );
    }
    if body.starts_with(b"\xef\xbb\xbf") {
        return unreadable("it starts with a byte-order mark");
    }
    let Ok(text) = std::str::from_utf8(body) else {
        return unreadable("it is not UTF-8");
    };
    if text.trim_start().starts_with('[') {
        return batch(text, settings, header_key);
    }
    let message: Message<'_> = match serde_json::from_str(text) {
        Ok(message) => message,
        Err(_) => return unreadable("it is not a JSON-RPC object, or repeats a member"),
    };
    let id = message.id.filter(|id| id.get().trim() != "null");
    let reply_to = Arc::new(id.map_or_else(Id::null, |id| Id::new(id.get())));
    let params = message.params.map(|p| p.get());
    let Some(method) = message
        .method
        .and_then(|m| serde_json::from_str::<String>(m.get()).ok())
    else {
        // A response (a client answering the server's request) is no call. Anything else
        // without a method this mode can read, keyed, asked for a guarantee it cannot give: a
        // server may still take it for a call (by its `Mcp-Method` header, say).
        let response = message.method.is_none() && message.answers;
        let keyed = header_key.is_some() || !matches!(meta_key(params, settings), Ok(None));
        return match keyed && !response {
            true => refuse(
                ProblemKind::CallUnguardable,
                "this request carries an idempotency key but names no method (a string) this \
                 layer can read; nothing was run",
                reply_to,
            ),
            false => Parsed::PassThrough,
        };
    };
    // Before the allow-list: a server that routes by the header would run the method it
    // names (a guarded one) for a body naming one that is not.
    if mcp_method.disagrees(&method)
        && (header_key.is_some() || !matches!(meta_key(params, settings), Ok(None)))
    {
        return refuse(
            ProblemKind::HeaderMismatch,
            "the Mcp-Method header names another method than the body, or is given more than \
             once; nothing was run",
            reply_to,
        );
    }
    if !settings.methods.contains(&method) {
        return Parsed::PassThrough;
    }
    let meta_key = match meta_key(params, settings) {
        Ok(key) => key,
        Err(error) => return refuse(ProblemKind::KeyInvalid, &error, reply_to),
    };
    let keyed = header_key.is_some() || meta_key.is_some();
    if let (Some(header), Some(meta)) = (header_key, meta_key.as_deref())
        && header != meta
    {
        return refuse(
            ProblemKind::KeyInvalid,
            "the Idempotency-Key header and params._meta name different keys: one call, one key",
            reply_to,
        );
    }
    if !keyed {
        return Parsed::PassThrough;
    }
    if id.is_none() {
        // A notification, or a null id: its answer could not be matched to a retry.
        return refuse(
            ProblemKind::CallUnguardable,
            "a keyed call needs an id that is not null, to answer its retries; nothing was run",
            reply_to,
        );
    }
    if reply_to.value.is_none() {
        // `1e400`: no response could be found to answer it, and JavaScript writes it back
        // as `null`.
        return refuse(
            ProblemKind::CallUnguardable,
            "a keyed call needs an id whose value this layer can read (a number within a \
             double's range), to find the response that answers it; nothing was run",
            reply_to,
        );
    }
    Parsed::Guard(Call {
        id: reply_to,
        method,
        params: params.map(str::to_owned),
        meta_key,
    })
}

/// Whether `body` might hold a `params._meta` key this route reads: its name appears, or an
/// escape that could spell it (any: `\/` spells a slash as well as `\u002f` does). Only asked
/// of bodies that cannot be parsed, to refuse rather than pass through a call whose key the
/// server would see.
fn may_hold_meta_key(body: &[u8], settings: &JsonRpc) -> bool {
    settings.meta_key.as_deref().is_some_and(|name| {
        body.contains(&b'\\') || body.windows(name.len()).any(|w| w == name.as_bytes())
    })
}

/// A batch passes through unless one of its requests is a guarded call that carries a key
/// (or the batch does, in its header): one key cannot guard many calls.
fn batch(text: &str, settings: &JsonRpc, header_key: Option<&str>) -> Parsed {
    let refuse = |detail: &str| {
        Parsed::Refuse(
            Problem::new(ProblemKind::CallUnguardable, detail),
            Arc::new(Id::null()),
        )
    };
    let Ok(items) = serde_json::from_str::<Vec<&serde_json::value::RawValue>>(text) else {
        return match header_key.is_some() || may_hold_meta_key(text.as_bytes(), settings) {
            true => refuse(
                "this request may carry an idempotency key but its body is not JSON; nothing was \
                 run",
            ),
            false => Parsed::PassThrough,
        };
    };
    let guarded_keyed = items.iter().any(|item| {
        let Ok(message) = serde_json::from_str::<Message<'_>>(item.get()) else {
            // Not one request this mode reads (a member given twice): it may be a guarded
            // call all the same, and carry a key the server reads.
            return header_key.is_some() || may_hold_meta_key(item.get().as_bytes(), settings);
        };
        let guarded = message
            .method
            .and_then(|m| serde_json::from_str::<String>(m.get()).ok())
            .is_some_and(|m| settings.methods.contains(&m));
        guarded
            && (header_key.is_some()
                || !matches!(
                    meta_key(message.params.map(|p| p.get()), settings),
                    Ok(None)
                ))
    });
    if guarded_keyed {
        return refuse(
            "a batch cannot be guarded: send each keyed call as a request of its own; nothing \
             was run",
        );
    }
    Parsed::PassThrough
}

/// The key in `params._meta[name]`, validated as the header's is: `Ok(None)` when there is
/// none, `Err` with the reason when one is there but is not a valid key. Read from the params'
/// text (valid JSON: the message parsed), so that params serde_json's `Value` cannot hold (a
/// lone surrogate escape, a number beyond a double, nesting past 128) never hide a key.
fn meta_key(params: Option<&str>, settings: &JsonRpc) -> Result<Option<String>, String> {
    // A `_meta`, or a key in it, given twice is read differently by different servers: which
    // one the server acts on is not known, so no guarantee can be given.
    fn once<'a>(object: &'a str, member: &str) -> Result<Option<&'a str>, ()> {
        let mut found = crate::json_text::children(object)
            .into_iter()
            .filter(|c| c.is(member));
        match (found.next(), found.next()) {
            (_, Some(_)) => Err(()),
            (one, None) => Ok(one.map(|c| c.value)),
        }
    }
    let (Some(name), Some(params)) = (settings.meta_key.as_deref(), params) else {
        return Ok(None);
    };
    let params = params.trim();
    if !params.starts_with('{') {
        return Ok(None);
    }
    let meta = once(params, "_meta").map_err(|()| "params._meta is given twice".to_owned())?;
    let Some(meta) = meta.filter(|meta| meta.starts_with('{')) else {
        return Ok(None);
    };
    let twice = || format!("params._meta.{name} is given twice");
    match once(meta, name).map_err(|()| twice())? {
        None => Ok(None),
        Some(text) if text.starts_with('"') => match serde_json::from_str::<String>(text) {
            Ok(key) => crate::key::validate(key.as_bytes())
                .map(|()| Some(key))
                .map_err(|e| format!("params._meta.{name}: {e}")),
            Err(_) => Err(format!(
                "params._meta.{name}: not a valid key (an escape that names no character)"
            )),
        },
        Some(text) => Err(format!(
            "params._meta.{name} must be a string, not {}",
            kind_of_text(text)
        )),
    }
}

/// What kind of JSON value `text` is, by its first byte (valid JSON).
fn kind_of_text(text: &str) -> &'static str {
    match text.as_bytes().first() {
        Some(b'n') => "null",
        Some(b't' | b'f') => "a boolean",
        Some(b'"') => "a string",
        Some(b'[') => "an array",
        Some(b'{') => "an object",
        _ => "a number",
    }
}

/// Everything the HTTP mode counts, the method and the exact params without `_meta` and the
/// per-round-trip fields; never the id.
pub(crate) fn fingerprint(
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

/// Whether a response is an event stream (`text/event-stream`, in any case: media types are
/// case-insensitive).
pub(crate) fn is_event_stream(headers: &HeaderMap) -> bool {
    const SSE: &[u8] = b"text/event-stream";
    crate::lines::get(headers, &header::CONTENT_TYPE).is_some_and(|ct| {
        // Whitespace around a value is not part of it (an in-process service may leave some).
        let ct = ct.as_bytes().trim_ascii_start();
        ct.len() >= SSE.len()
            && ct[..SSE.len()].eq_ignore_ascii_case(SSE)
            && matches!(ct.get(SSE.len()), None | Some(b';' | b' ' | b'\t'))
    })
}

/// An event stream read as it arrives, as the WHATWG EventSource parser reads it: lines end in
/// CRLF, LF or CR; `data` fields gather; a blank line ends an event. Each byte is looked at
/// once, so the cost is linear however the stream is cut into chunks.
#[derive(Debug, Default)]
pub(crate) struct Events {
    /// The line being read.
    line: Vec<u8>,
    /// The `data` of the event being read, lines joined by `\n`.
    data: Vec<u8>,
    /// Whether the event has a `data` field at all.
    has_data: bool,
    /// The last byte was a CR: a LF right after it ends no second line.
    after_cr: bool,
    /// Whether a line has ended yet: the stream's first line may start with a byte-order mark.
    past_first_line: bool,
    /// Whether an event said the call's key goes back: an interim result to it, or an error
    /// to a `null` id before any other message (after one, the server had read the call).
    gives_back: bool,
    /// Whether an event has carried a JSON-RPC message yet (a priming event carries none).
    spoke: bool,
}

impl Events {
    /// Takes the next bytes of the stream; the final response to `id`, the first time an
    /// event carrying one is complete.
    pub(crate) fn feed(&mut self, data: &[u8], id: &Id) -> Option<Bytes> {
        let mut found = None;
        for &b in data {
            if self.after_cr {
                self.after_cr = false;
                if b == b'\n' {
                    continue;
                }
            }
            let event = match b {
                b'\r' => {
                    self.after_cr = true;
                    self.end_line()
                }
                b'\n' => self.end_line(),
                _ => {
                    self.line.push(b);
                    None
                }
            };
            if found.is_none()
                && let Some(event) = event
            {
                found = self.final_message(&event, id);
            }
        }
        found
    }

    /// Whether a stream that ended without the call's final response gives the key back
    /// ([`Answer::NotFinal`]) rather than being taken as done ([`Answer::Unseen`]).
    pub(crate) fn gives_back(&self) -> bool {
        self.gives_back
    }

    /// The stream ended: an event cut short of its blank line still counts (the server
    /// answered; readers that wait for the blank line would lose it).
    pub(crate) fn finish(&mut self, id: &Id) -> Option<Bytes> {
        let pending = if self.line.is_empty() {
            None
        } else {
            self.end_line()
        };
        let event = pending.or_else(|| self.dispatch());
        event.and_then(|event| self.final_message(&event, id))
    }

    /// The final response to `id` in one event's data, if it is one; notes an event that
    /// gives the key back.
    fn final_message(&mut self, data: &[u8], id: &Id) -> Option<Bytes> {
        let reply = read(data, id)?;
        let first = !self.spoke;
        self.spoke |= data.trim_ascii_start().starts_with(b"{");
        match reply {
            Reply::Final => return Some(Bytes::copy_from_slice(data)),
            Reply::Interim => self.gives_back = true,
            Reply::NotRead if first => self.gives_back = true,
            Reply::NotRead | Reply::Other => {}
        }
        None
    }

    /// Ends the current line: a field, or (when empty) the end of an event, whose data it
    /// hands back.
    fn end_line(&mut self) -> Option<Vec<u8>> {
        if self.line.is_empty() {
            self.past_first_line = true;
            return self.dispatch();
        }
        let line = std::mem::take(&mut self.line);
        let first = !std::mem::replace(&mut self.past_first_line, true);
        // The stream may start with a byte-order mark: not part of the first field's name.
        let line = match line.strip_prefix(b"\xef\xbb\xbf") {
            Some(rest) if first => rest,
            _ => &line[..],
        };
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(colon) => {
                let value = &line[colon + 1..];
                (&line[..colon], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &b""[..]),
        };
        if field == b"data" {
            if self.has_data {
                self.data.push(b'\n');
            }
            self.data.extend_from_slice(value);
            self.has_data = true;
        }
        None
    }

    fn dispatch(&mut self) -> Option<Vec<u8>> {
        if !self.has_data {
            return None;
        }
        self.has_data = false;
        Some(std::mem::take(&mut self.data))
    }
}

/// What one JSON-RPC message is to the call `id`.
enum Reply {
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
fn read(bytes: &[u8], id: &Id) -> Option<Reply> {
    if let Ok(message) = serde_json::from_slice::<Value>(bytes) {
        return Some(reply(message, id));
    }
    json(bytes).map(|text| reply_text(text, id))
}

/// `bytes` as JSON text, whitespace around it trimmed, if they are JSON (whatever serde_json's
/// `Value` can hold).
fn json(bytes: &[u8]) -> Option<&str> {
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
fn last_member<'a>(text: &'a str, name: &str) -> Option<&'a str> {
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

/// A stored final response, re-addressed to the call `id`: the new id's text replaces the
/// stored one, every other byte stays as recorded (numbers, member order). With `mark`,
/// `result._meta` gains `"tower-idempotency/replayed": true` as its first member.
pub(crate) fn readdress(stored: &[u8], id: &Id, mark: bool) -> Option<Bytes> {
    let text = std::str::from_utf8(stored).ok()?.trim();
    if !text.starts_with('{') {
        return None;
    }
    let mut out = String::with_capacity(text.len() + id.raw().len() + 48);
    out.push('{');
    for (i, member) in crate::json_text::children(text).iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(member.raw_name.unwrap_or("\"\""));
        out.push(':');
        match member.name.as_str() {
            "id" => out.push_str(id.raw()),
            "result" if mark => out.push_str(&marked(member.value)),
            _ => out.push_str(member.value),
        }
    }
    out.push('}');
    Some(Bytes::from(out))
}

/// A result object with the replay mark first in its `_meta`; anything else as it is.
fn marked(result: &str) -> String {
    let mark = format!("\"{REPLAY_META}\":true");
    if !result.starts_with('{') {
        return result.to_owned();
    }
    let members = crate::json_text::children(result);
    let is_meta = |m: &crate::json_text::Child<'_>| m.is("_meta");
    let meta_object = |m: &crate::json_text::Child<'_>| is_meta(m) && m.value.starts_with('{');
    // A `_meta` that is not an object (`null`, an array) is replaced by one holding the mark:
    // a second `_meta` member would trip clients that refuse duplicate fields.
    let has_meta = members.iter().any(is_meta);
    let mut out = String::with_capacity(result.len() + mark.len() + 16);
    out.push('{');
    if !has_meta {
        out.push_str(&format!("\"_meta\":{{{mark}}}"));
    }
    for (i, member) in members.iter().enumerate() {
        if i > 0 || !has_meta {
            out.push(',');
        }
        out.push_str(member.raw_name.unwrap_or("\"\""));
        out.push(':');
        if is_meta(member) && !meta_object(member) {
            out.push('{');
            out.push_str(&mark);
            out.push('}');
        } else if meta_object(member) {
            let inner = member.value[1..].trim_start();
            out.push('{');
            out.push_str(&mark);
            if !inner.starts_with('}') {
                out.push(',');
            }
            out.push_str(inner);
        } else {
            out.push_str(member.value);
        }
    }
    out.push('}');
    out
}

/// The stored form of a call the server took whose response this layer could not read: its
/// event stream ended, or broke, without it, or the answer came compressed (a handler that
/// compresses whatever it is asked). Kept without a body, with the head's status, media type
/// and content coding, so that retries are told what happened.
pub(crate) fn stored_unread(parts: &http::response::Parts) -> StoredResponse {
    let mut headers = HeaderMap::new();
    let media = match is_event_stream(&parts.headers) {
        true => "text/event-stream",
        false => "application/json",
    };
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(media));
    match super::coding(&parts.headers) {
        Some(coding) => {
            headers.insert(header::CONTENT_ENCODING, coding.clone());
        }
        // Neither compressed nor a stream: a body read whole that is not the call's response.
        None if media != "text/event-stream" => {
            headers.insert(UNREAD.clone(), HeaderValue::from_static("not-the-response"));
        }
        None => {}
    }
    StoredResponse {
        status: parts.status,
        headers,
        body: None,
        trailers: None,
    }
}

/// Marks a record [`stored_unread`] made of a body read whole that is not the call's response
/// (a record too large to keep has no response either, but its outcome is known).
static UNREAD: http::HeaderName = http::HeaderName::from_static("tower-idempotency-unread");

/// What a retry is told of a record [`stored_unread`] made (`None`: another kind of record
/// without its response): why the layer could not read the call's response.
pub(crate) fn unread_detail(headers: &HeaderMap) -> Option<String> {
    if headers.contains_key(&UNREAD) {
        return Some(
            "the server answered this call, but not with its JSON-RPC response (an answer to \
             another id, a notification, JSON that is not JSON-RPC, or a body that is not JSON), \
             so there is no response to replay; it will not run again under this key (a new \
             key would run it again)"
                .to_owned(),
        );
    }
    if let Some(coding) = super::coding(headers) {
        let coding = String::from_utf8_lossy(coding.as_bytes());
        return Some(format!(
            "the server answered this call compressed ({coding}) although this layer asked \
             for it uncompressed, so its response could not be read or recorded; it will not \
             run again under this key (a new key would run it again)"
        ));
    }
    is_event_stream(headers).then(|| {
        "the server took this call and answered it on an event stream that ended without the \
         call's response (MCP's SSE polling sends it on a resumed stream, which this layer \
         does not see), so there is no response to replay; it will not run again under this \
         key. Resume the first call's stream for its response: a new key would run it again"
            .to_owned()
    })
}

/// The stored form of a call's final response: `200 application/json`, whatever framing
/// carried it. `None` (too large to keep) keeps the answer's `status`, which retries are told.
pub(crate) fn stored_call(message: Option<Bytes>, status: StatusCode) -> StoredResponse {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    StoredResponse {
        status: match message {
            Some(_) => StatusCode::OK,
            None => status,
        },
        headers,
        body: message,
        trailers: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn settings() -> JsonRpc {
        JsonRpc::new().meta_key("idempotencyKey")
    }

    fn parsed(body: &str, header: Option<&str>) -> Parsed {
        parse(
            body.as_bytes(),
            &settings(),
            header,
            HeaderMethod::Absent,
            false,
        )
    }

    fn call(body: Value) -> Option<Call> {
        match parsed(&body.to_string(), Some("k")) {
            Parsed::Guard(call) => Some(call),
            _ => None,
        }
    }

    fn refused(parsed: &Parsed) -> Option<ProblemKind> {
        match parsed {
            Parsed::Refuse(problem, _) => Some(problem.kind),
            _ => None,
        }
    }

    fn passes(parsed: &Parsed) -> bool {
        matches!(parsed, Parsed::PassThrough)
    }

    /// The call's final response in a captured body, if any.
    fn final_of(headers: &HeaderMap, body: &[u8], id: &Id) -> Option<Bytes> {
        match final_response(headers, body, id) {
            Answer::Final(message) => Some(message),
            Answer::NotFinal | Answer::Unseen => None,
        }
    }

    fn id(raw: &str) -> Id {
        Id::new(raw)
    }

    #[test]
    fn only_single_allowlisted_requests_are_guarded() {
        assert!(call(json!({"jsonrpc":"2.0","id":1,"method":"tools/call","params":{}})).is_some());
        let list = parsed(
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
            Some("k"),
        );
        assert!(passes(&list), "an unguarded method passes, keyed or not");
        let unkeyed = parsed(r#"{"jsonrpc":"2.0","id":1,"method":"tools/call"}"#, None);
        assert!(passes(&unkeyed), "no key, no guarantee asked");
        assert!(passes(&parsed("{not json", None)));
        assert!(passes(&parsed(
            r#"[{"jsonrpc":"2.0","id":1,"method":"tools/call"}]"#,
            None
        )));
    }

    /// Issue 17 §1: a keyed call the mode cannot guard is refused, never run unguarded.
    #[test]
    fn keyed_calls_that_cannot_be_guarded_are_refused() {
        let unguardable = Some(ProblemKind::CallUnguardable);
        let batch = r#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{}}]"#;
        assert_eq!(
            refused(&parsed(batch, Some("k"))),
            unguardable,
            "header key"
        );
        let meta_batch = r#"[{"jsonrpc":"2.0","id":1,"method":"tools/list"},
            {"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"_meta":{"idempotencyKey":"k"}}}]"#;
        assert_eq!(refused(&parsed(meta_batch, None)), unguardable, "_meta key");
        let null_id = r#"{"jsonrpc":"2.0","id":null,"method":"tools/call","params":{}}"#;
        assert_eq!(refused(&parsed(null_id, Some("k"))), unguardable);
        let notification =
            r#"{"jsonrpc":"2.0","method":"tools/call","params":{"_meta":{"idempotencyKey":"k"}}}"#;
        assert_eq!(refused(&parsed(notification, None)), unguardable);
        let bom = "\u{feff}{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/call\"}";
        assert_eq!(refused(&parsed(bom, Some("k"))), unguardable);
        assert_eq!(refused(&parsed("{not json", Some("k"))), unguardable);
        let twice = r#"{"jsonrpc":"2.0","id":1,"id":2,"method":"tools/call"}"#;
        assert_eq!(
            refused(&parsed(twice, Some("k"))),
            unguardable,
            "a repeated member"
        );
        // Unreadable, with the key's name spelled with any escape (`\/` for `/`).
        let settings = JsonRpc::new().meta_key("com.example/key");
        let escaped = r#"{"jsonrpc":"2.0","id":1,"id":1,"method":"tools/call",
            "params":{"_meta":{"com.example\/key":"k"}}}"#;
        let parse = |body: &str, header| {
            parse(
                body.as_bytes(),
                &settings,
                header,
                HeaderMethod::Absent,
                false,
            )
        };
        assert_eq!(refused(&parse(escaped, None)), unguardable, "escaped name");
        // Keyed, with no method this mode reads: refused; a response (no method, a result)
        // is no call and passes.
        for body in [
            r#"{"jsonrpc":"2.0","id":1,"params":{}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":null,"params":{}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":["tools/call"],"params":{}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":7,"result":{}}"#,
        ] {
            assert_eq!(refused(&parse(body, Some("k"))), unguardable, "{body}");
            assert!(matches!(parse(body, None), Parsed::PassThrough), "{body}");
        }
        let meta = r#"{"jsonrpc":"2.0","id":1,"params":{"_meta":{"com.example/key":"k"}}}"#;
        assert_eq!(refused(&parse(meta, None)), unguardable, "a _meta key");
        for response in [
            r#"{"jsonrpc":"2.0","id":1,"result":{}}"#,
            r#"{"jsonrpc":"2.0","id":1,"error":{"code":1,"message":"x"}}"#,
        ] {
            assert!(
                matches!(parse(response, Some("k")), Parsed::PassThrough),
                "{response}"
            );
        }
        // A compressed body on a route reading `_meta` keys may hold one.
        let coded = parse_coded(&settings);
        assert_eq!(refused(&coded), unguardable, "coded");
        assert!(matches!(
            super::parse(
                b"\x1f\x8b",
                &JsonRpc::new(),
                None,
                HeaderMethod::Absent,
                true
            ),
            Parsed::PassThrough
        ));
    }

    fn parse_coded(settings: &JsonRpc) -> Parsed {
        super::parse(
            b"\x1f\x8b\x08\x00",
            settings,
            None,
            HeaderMethod::Absent,
            true,
        )
    }

    /// Issue 17 §1: `_meta` keys get the header's validation, and the two sources must agree.
    #[test]
    fn meta_keys_are_validated_like_header_keys() {
        let with_meta = |key: &str| {
            format!(
                r#"{{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{{"_meta":{{"idempotencyKey":{key}}}}}}}"#
            )
        };
        let invalid = Some(ProblemKind::KeyInvalid);
        assert_eq!(
            refused(&parsed(&with_meta("42"), None)),
            invalid,
            "not a string"
        );
        assert_eq!(
            refused(&parsed(&with_meta(r#""""#), None)),
            invalid,
            "empty"
        );
        assert_eq!(
            refused(&parsed(&with_meta(r#""a\u0000b""#), None)),
            invalid,
            "NUL"
        );
        assert_eq!(
            refused(&parsed(&with_meta(r#""a\nb""#), None)),
            invalid,
            "newline"
        );
        assert_eq!(
            refused(&parsed(&with_meta(r#""caf\u00e9""#), None)),
            invalid,
            "non-ASCII"
        );
        let long = format!(r#""{}""#, "k".repeat(256));
        assert_eq!(
            refused(&parsed(&with_meta(&long), None)),
            invalid,
            "too long"
        );
        let Parsed::Refuse(empty, reply) = parsed(&with_meta(r#""""#), None) else {
            panic!("refused");
        };
        assert!(empty.detail.contains("empty"), "{}", empty.detail);
        assert_eq!(reply.raw(), "7", "the refusal answers the request's id");
        assert_eq!(
            refused(&parsed(&with_meta(r#""a""#), Some("b"))),
            invalid,
            "header and _meta differ"
        );
        let Parsed::Guard(agreed) = parsed(&with_meta(r#""a""#), Some("a")) else {
            panic!("agreeing sources guard the call");
        };
        assert_eq!(agreed.meta_key.as_deref(), Some("a"));
    }

    /// Issue 17 §5: a keyed request whose `Mcp-Method` header names another method is refused.
    #[test]
    fn a_method_header_that_disagrees_with_the_body_is_refused() {
        let body = br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{}}"#;
        let with = |header| parse(body, &settings(), Some("k"), header, false);
        assert_eq!(
            refused(&with(HeaderMethod::One("tools/list"))),
            Some(ProblemKind::HeaderMismatch)
        );
        assert_eq!(
            refused(&with(HeaderMethod::Unclear)),
            Some(ProblemKind::HeaderMismatch)
        );
        assert!(matches!(
            with(HeaderMethod::One("tools/call")),
            Parsed::Guard(_)
        ));
        assert!(matches!(with(HeaderMethod::Absent), Parsed::Guard(_)));
    }

    /// DESIGN §8: `Mcp-Method` given twice, or in bytes that are not visible ASCII, names no
    /// one method: a server may read the first line, the last, or their join.
    #[test]
    fn a_method_header_read_is_one_visible_line() {
        let headers = |lines: &[&[u8]]| {
            let mut map = HeaderMap::new();
            for line in lines {
                map.append(
                    MCP_METHOD.clone(),
                    HeaderValue::from_bytes(line).expect("a header value"),
                );
            }
            map
        };
        let of = |lines: &[&[u8]]| HeaderMethod::of(&headers(lines)) == HeaderMethod::Unclear;
        assert_eq!(HeaderMethod::of(&HeaderMap::new()), HeaderMethod::Absent);
        assert_eq!(
            HeaderMethod::of(&headers(&[b"tools/call"])),
            HeaderMethod::One("tools/call")
        );
        assert!(of(&[b"tools/call", b"tools/list"]));
        assert!(of(&[b"tools/call", b"tools/call"]));
        assert!(of(&[b"tools/call\xff"]));
    }

    #[test]
    fn fingerprint_ignores_id_and_meta_but_not_arguments_query_or_headers() {
        let parts = |uri: &str| {
            http::Request::post(uri)
                .body(())
                .expect("req")
                .into_parts()
                .0
        };
        let options = crate::fingerprint::FingerprintOptions::default();
        let fp = |uri: &str, v: Value| {
            fingerprint(
                &parts(uri),
                None,
                &call(v).expect("call"),
                &options,
                crate::fingerprint::scheme(&options, None, true),
            )
            .expect("fp")
        };
        let a = fp(
            "/mcp",
            json!({"jsonrpc":"2.0","id":1,"method":"tools/call",
            "params":{"name":"t","arguments":{"x":1,"y":2},"_meta":{"progressToken":"a"}}}),
        );
        let b = fp(
            "/mcp",
            json!({"jsonrpc":"2.0","id":"retry-7","method":"tools/call",
            "params":{"arguments":{"y":2,"x":1},"name":"t","_meta":{"progressToken":"b"}}}),
        );
        let c = fp(
            "/mcp",
            json!({"jsonrpc":"2.0","id":1,"method":"tools/call",
            "params":{"name":"t","arguments":{"x":1,"y":3}}}),
        );
        assert_eq!(a, b);
        assert_ne!(a, c);
        let tenant = |q: &str| {
            fp(
                &format!("/mcp?tenant={q}"),
                json!({"jsonrpc":"2.0","id":1,"method":"tools/call","params":{}}),
            )
        };
        assert_ne!(tenant("a"), tenant("b"), "issue 17 §2: the query counts");
    }

    /// Issue 17 §2: params are fingerprinted exactly, from their text.
    #[test]
    fn params_are_fingerprinted_exactly() {
        let (parts, ()) = http::Request::post("/mcp")
            .body(())
            .expect("req")
            .into_parts();
        let options = crate::fingerprint::FingerprintOptions::default();
        let fp = |params: &str| {
            let body =
                format!(r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{params}}}"#);
            let Parsed::Guard(call) = parsed(&body, Some("k")) else {
                panic!("guarded");
            };
            fingerprint(
                &parts,
                None,
                &call,
                &options,
                crate::fingerprint::scheme(&options, None, true),
            )
            .expect("fp")
        };
        assert_ne!(
            fp(r#"{"amount":9007199254740993}"#),
            fp(r#"{"amount":9007199254740992}"#)
        );
        assert_ne!(fp(r#"{"amount":1e-400}"#), fp(r#"{"amount":0}"#));
        assert_eq!(fp(r#"{"amount":10.50}"#), fp(r#"{ "amount" : 10.5 }"#));
    }

    #[test]
    fn key_can_come_from_meta() {
        let body = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"_meta":{"idempotencyKey":"k-1"}}}"#;
        let Parsed::Guard(c) = parsed(body, None) else {
            panic!("guarded");
        };
        assert_eq!(c.meta_key.as_deref(), Some("k-1"));
    }

    #[test]
    fn final_response_from_sse_skips_notifications() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        let body = "id: 1\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\n\n\
                    id: 2\ndata: {\"jsonrpc\":\"2.0\",\"id\":5,\"result\":{\"ok\":true}}\n\n";
        let last = final_of(&headers, body.as_bytes(), &id("5")).expect("final");
        assert_eq!(
            serde_json::from_slice::<Value>(&last).expect("json")["result"]["ok"],
            true
        );
        assert!(
            final_of(
                &headers,
                b"data: {\"jsonrpc\":\"2.0\",\"method\":\"x\"}\n\n",
                &id("5")
            )
            .is_none()
        );
    }

    /// Issue 17 §4: events split anywhere across chunks are found once, as they complete.
    #[test]
    fn events_are_found_across_any_chunking() {
        let stream = "data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\"}\r\n\r\n\
                      data: {\"jsonrpc\":\"2.0\",\"id\":5,\"result\":{\"n\":10.50}}\n\n";
        for size in 1..stream.len() {
            let mut events = Events::default();
            let found: Vec<Bytes> = stream
                .as_bytes()
                .chunks(size)
                .filter_map(|chunk| events.feed(chunk, &id("5")))
                .collect();
            assert_eq!(found.len(), 1, "chunks of {size}");
            assert_eq!(
                &found[0][..],
                br#"{"jsonrpc":"2.0","id":5,"result":{"n":10.50}}"#
            );
        }
    }

    /// The WHATWG EventSource steps, written plainly over the whole stream: the reference the
    /// incremental parser must agree with. Returns each event's data; a last event without its
    /// blank line counts, as it does for the tee.
    fn reference_events(stream: &str) -> Vec<String> {
        let stream = stream.strip_prefix('\u{feff}').unwrap_or(stream);
        let mut lines = Vec::new();
        let mut rest = stream;
        while let Some(at) = rest.find(['\r', '\n']) {
            lines.push(&rest[..at]);
            let skip = if rest[at..].starts_with("\r\n") { 2 } else { 1 };
            rest = &rest[at + skip..];
        }
        lines.push(rest);
        let (mut events, mut data, mut has) = (Vec::new(), String::new(), false);
        for line in lines {
            if line.is_empty() {
                if has {
                    events.push(std::mem::take(&mut data));
                }
                has = false;
                continue;
            }
            let (field, value) = line.split_once(':').unwrap_or((line, ""));
            if field == "data" {
                if has {
                    data.push('\n');
                }
                data.push_str(value.strip_prefix(' ').unwrap_or(value));
                has = true;
            }
        }
        if has {
            events.push(data);
        }
        events
    }

    proptest::proptest! {
        /// Differential: however a stream is written (line ends, `data:` with or without its
        /// space, comments, ids, a byte-order mark, a missing last blank line) and however it
        /// is cut into chunks, the tee's parser finds the final response the plain steps find.
        #[test]
        fn events_agree_with_the_eventsource_steps(
            events in proptest::collection::vec((0u8..3, proptest::bool::ANY, proptest::bool::ANY), 1..6),
            ending in 0usize..3,
            bom in proptest::bool::ANY,
            trailing in proptest::bool::ANY,
            chunk in 1usize..40,
        ) {
            let eol = ["\n", "\r\n", "\r"][ending];
            let mut stream = String::from(if bom { "\u{feff}" } else { "" });
            for (i, (kind, space, comment)) in events.iter().enumerate() {
                let message = match kind {
                    0 => r#"{"jsonrpc":"2.0","method":"notifications/progress"}"#.to_owned(),
                    1 => format!(r#"{{"jsonrpc":"2.0","id":5,"result":{{"n":{i}}}}}"#),
                    _ => format!(r#"{{"jsonrpc":"2.0","id":6,"result":{{"n":{i}}}}}"#),
                };
                if *comment {
                    stream += &format!(": keep-alive{eol}id: {i}{eol}");
                }
                stream += &format!("data:{}{message}{eol}", if *space { " " } else { "" });
                if i + 1 < events.len() || trailing {
                    stream += eol;
                }
            }
            let want = reference_events(&stream)
                .into_iter()
                .find_map(|data| Events::default().final_message(data.as_bytes(), &id("5")));
            let mut parser = Events::default();
            let mut got = None;
            for piece in stream.as_bytes().chunks(chunk) {
                if let Some(found) = parser.feed(piece, &id("5")) {
                    got.get_or_insert(found);
                }
            }
            if got.is_none() {
                got = parser.finish(&id("5"));
            }
            proptest::prop_assert_eq!(got, want, "{:?}", stream);
        }
    }

    /// The hand-written reader agrees with what the derive did: escaped names decode, a
    /// repeated member is an error, `null` is absent, other members are skipped.
    #[test]
    fn message_reads_members_as_serde_derive_would() {
        let m: Message<'_> =
            serde_json::from_str(r#"{"\u0069d":7,"method":"m","x":[1,{"id":2}],"params":{"a":1}}"#)
                .expect("object");
        assert_eq!(m.id.map(RawValue::get), Some("7"));
        assert_eq!(m.method.map(RawValue::get), Some(r#""m""#));
        assert_eq!(m.params.map(RawValue::get), Some(r#"{"a":1}"#));
        let m: Message<'_> = serde_json::from_str(r#"{"id":null}"#).expect("object");
        assert!(m.id.is_none() && m.method.is_none() && m.params.is_none());
        for repeated in [
            r#"{"id":1,"id":2}"#,
            r#"{"method":"a","\u006dethod":"b"}"#,
            r#"{"params":1,"params":1}"#,
        ] {
            assert!(
                serde_json::from_str::<Message<'_>>(repeated).is_err(),
                "{repeated}"
            );
        }
        for not_an_object in ["[1]", "1", "\"id\"", "{\"id\":1"] {
            assert!(
                serde_json::from_str::<Message<'_>>(not_an_object).is_err(),
                "{not_an_object}"
            );
        }
    }

    /// Issue 17 §3: a replay carries the new id exactly as sent, and the recorded bytes.
    #[test]
    fn readdress_writes_the_id_as_sent_and_keeps_every_other_byte() {
        let stored = br#"{"jsonrpc":"2.0","id":1,"result":{"z":1,"amount":10.50,"big":123456789012345678901234567890}}"#;
        for raw in ["123456789012345678901234567890", "1e2", "-0", r#""r-7""#] {
            let out = readdress(stored, &id(raw), false).expect("json");
            assert_eq!(
                std::str::from_utf8(&out).expect("utf-8"),
                format!(
                    r#"{{"jsonrpc":"2.0","id":{raw},"result":{{"z":1,"amount":10.50,"big":123456789012345678901234567890}}}}"#
                )
            );
        }
        let marked = readdress(stored, &id("2"), true).expect("json");
        let v: Value = serde_json::from_slice(&marked).expect("json");
        assert_eq!(v["result"]["_meta"][REPLAY_META], true);
        assert!(
            std::str::from_utf8(&marked)
                .expect("utf-8")
                .contains("10.50")
        );
        let null_meta = br#"{"jsonrpc":"2.0","id":1,"result":{"_meta":null,"x":2}}"#;
        let marked_null = readdress(null_meta, &id("4"), true).expect("json");
        assert_eq!(
            std::str::from_utf8(&marked_null).expect("utf-8"),
            r#"{"jsonrpc":"2.0","id":4,"result":{"_meta":{"tower-idempotency/replayed":true},"x":2}}"#,
            "one _meta, never two"
        );
        let with_meta = br#"{"jsonrpc":"2.0","id":1,"result":{"_meta":{"a":1},"x":2}}"#;
        let marked = readdress(with_meta, &id("3"), true).expect("json");
        assert_eq!(
            std::str::from_utf8(&marked).expect("utf-8"),
            r#"{"jsonrpc":"2.0","id":3,"result":{"_meta":{"tower-idempotency/replayed":true,"a":1},"x":2}}"#
        );
    }

    #[test]
    fn an_id_written_back_as_a_double_answers_the_call() {
        let headers = HeaderMap::new();
        for (sent, written) in [
            ("123456789012345678901234567890", "1.2345678901234568e29"),
            ("9007199254740993", "9007199254740992"),
            ("1e2", "100"),
        ] {
            let body = format!(r#"{{"jsonrpc":"2.0","id":{written},"result":{{}}}}"#);
            assert!(
                final_of(&headers, body.as_bytes(), &id(sent)).is_some(),
                "{sent} written back as {written}"
            );
        }
        let body = br#"{"jsonrpc":"2.0","id":9007199254740994,"result":{}}"#;
        assert!(final_of(&headers, body, &id("9007199254740992")).is_none());
        // A number written back as its text, or text as a number: compared as numbers; two
        // strings as they are.
        for (sent, written, answers) in [
            ("1", r#""1""#, true),
            ("1e2", r#""1e2""#, true),
            ("1e2", r#""100""#, true),
            ("1", r#""1.0""#, true),
            (r#""7""#, "7", true),
            (r#""1.0""#, "1.0", true),
            (r#""100.0""#, "1e2", true),
            (r#""9007199254740993""#, "9007199254740992", true),
            ("1", r#""01""#, false),
            ("1", r#"" 1""#, false),
            ("1", r#""2""#, false),
            (r#""07""#, "7", false),
            (r#""a""#, "7", false),
            (r#""1e400""#, "1e300", false),
            (r#""7""#, r#""7.0""#, false),
        ] {
            let body = format!(r#"{{"jsonrpc":"2.0","id":{written},"result":{{}}}}"#);
            assert_eq!(
                final_of(&headers, body.as_bytes(), &id(sent)).is_some(),
                answers,
                "{sent} written back as {written}"
            );
        }
    }

    /// DESIGN §8 and §3: a stream that ends without the call's response gives the key back
    /// only on an interim result or an error to a `null` id; otherwise the server took the
    /// call (SEP-1699's priming event, then the response on a resumed stream). A JSON body
    /// follows the same rule.
    #[test]
    fn a_stream_without_the_response_is_unseen_unless_it_says_not_run() {
        let mut sse = HeaderMap::new();
        sse.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        let progress = r#"{"jsonrpc":"2.0","method":"notifications/progress","params":{}}"#;
        let interim = r#"{"jsonrpc":"2.0","id":7,"result":{"resultType":"input_required"}}"#;
        let null_error = r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"x"}}"#;
        let as_string = r#"{"jsonrpc":"2.0","id":"07","result":{}}"#;
        let other_id = r#"{"jsonrpc":"2.0","id":8,"result":{}}"#;
        let answer = |body: String| final_response(&sse, body.as_bytes(), &id("7"));
        assert_eq!(
            answer("id: 0\nretry: 3000\ndata: \n\n".into()),
            Answer::Unseen
        );
        assert_eq!(answer(String::new()), Answer::Unseen);
        assert_eq!(answer(format!("data: {progress}\n\n")), Answer::Unseen);
        assert_eq!(answer(format!("data: {as_string}\n\n")), Answer::Unseen);
        assert_eq!(answer(format!("data: {other_id}\n\n")), Answer::Unseen);
        assert_eq!(answer(format!("data: {interim}\n\n")), Answer::NotFinal);
        assert_eq!(answer(format!("data: {interim}")), Answer::NotFinal);
        assert_eq!(answer(format!("data: {null_error}\n\n")), Answer::NotFinal);
        assert_eq!(
            answer(format!("id: 0\ndata:\n\ndata: {null_error}\n\n")),
            Answer::NotFinal,
            "a priming event is not a message"
        );
        // After another message the server had read the call: the null-id error is not a
        // sign that it did not run.
        assert_eq!(
            answer(format!("data: {progress}\n\ndata: {null_error}\n\n")),
            Answer::Unseen
        );
        let error_null = r#"{"jsonrpc":"2.0","id":null,"error":null}"#;
        assert_eq!(answer(format!("data: {error_null}\n\n")), Answer::Unseen);
        let done = r#"{"jsonrpc":"2.0","id":7,"result":{}}"#;
        assert_eq!(
            answer(format!("data: {interim}\n\ndata: {done}\n\n")),
            Answer::Final(Bytes::from(done))
        );
        let json = HeaderMap::new();
        for body in [null_error, interim] {
            assert_eq!(
                final_response(&json, body.as_bytes(), &id("7")),
                Answer::NotFinal,
                "{body}"
            );
        }
        // Not the response, or not JSON: the server answered, but what it said cannot be
        // read; taken as done.
        let batch = format!("[{done}]");
        for body in [
            "",
            "\u{feff}{}",
            r#"{"jsonrpc":"2.0","id":7,"result":{"#,
            "<html>",
            progress,
            as_string,
            other_id,
            error_null,
            r#"{"ok":true}"#,
            r#""done""#,
            "null",
            "[]",
            &batch,
        ] {
            assert_eq!(
                final_response(&json, body.as_bytes(), &id("7")),
                Answer::Unseen,
                "{body}"
            );
        }
    }

    /// A final response serde_json's `Value` cannot hold (a lone surrogate escape, a number
    /// beyond a double, nesting past 128) is a final response all the same, in a JSON body or
    /// an event; read from its text as serde_json would (the last of a member given twice).
    #[test]
    fn final_responses_serde_json_cannot_hold_are_final() {
        let deep = format!("{}1{}", "[".repeat(140), "]".repeat(140));
        let sse = HeaderMap::from_iter([(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        )]);
        for odd in [r#""\ud83d""#, "1e400", &deep] {
            let done = format!(r#"{{"jsonrpc":"2.0","id":7,"result":{{"v":{odd}}}}}"#);
            let interim = format!(
                r#"{{"jsonrpc":"2.0","id":7,"result":{{"v":{odd},"resultType":"input_required"}}}}"#
            );
            let other = format!(r#"{{"jsonrpc":"2.0","id":8,"result":{{"v":{odd}}}}}"#);
            let failed =
                format!(r#"{{"jsonrpc":"2.0","id":7,"error":{{"code":-32603,"data":{odd}}}}}"#);
            let refused =
                format!(r#"{{"jsonrpc":"2.0","id":7,"error":{{"code":-32602,"data":{odd}}}}}"#);
            let not_read =
                format!(r#"{{"jsonrpc":"2.0","id":null,"error":{{"code":-32700,"data":{odd}}}}}"#);
            let twice = format!(r#"{{"id":8,"result":{{"v":{odd}}},"id":7}}"#);
            let json = HeaderMap::new();
            let answer = |body: &str| final_response(&json, body.as_bytes(), &id("7"));
            let event =
                |body: &str| final_response(&sse, format!("data: {body}\n\n").as_bytes(), &id("7"));
            for body in [&done, &failed, &refused, &twice] {
                assert_eq!(
                    answer(body),
                    Answer::Final(Bytes::from(body.clone())),
                    "{body}"
                );
                assert_eq!(
                    event(body),
                    Answer::Final(Bytes::from(body.clone())),
                    "{body}"
                );
            }
            for body in [&interim, &not_read] {
                assert_eq!(answer(body), Answer::NotFinal, "{body}");
                assert_eq!(event(body), Answer::NotFinal, "{body}");
            }
            assert_eq!(answer(&other), Answer::Unseen);
            assert_eq!(event(&other), Answer::Unseen);
            assert!(is_definitive(done.as_bytes()));
            assert!(is_definitive(refused.as_bytes()));
            assert!(!is_definitive(failed.as_bytes()));
            assert!(serde_json::from_str::<Value>(&done).is_err(), "{done}");
        }
    }

    /// A record made without the call's response tells why: compressed (the coding named),
    /// or an event stream without it; `identity` is no coding, and a plain record is neither.
    #[test]
    fn an_unread_record_tells_why() {
        let head = |pairs: &[(&'static str, &'static str)]| {
            let (mut parts, ()) = http::Response::new(()).into_parts();
            for (name, value) in pairs {
                parts.headers.append(*name, HeaderValue::from_static(value));
            }
            stored_unread(&parts).headers
        };
        let sse = ("content-type", "text/event-stream");
        let why = |pairs: &[(&'static str, &'static str)]| unread_detail(&head(pairs));
        assert!(why(&[sse]).is_some_and(|d| d.contains("event stream")));
        let identity = why(&[sse, ("content-encoding", "identity")]);
        assert!(identity.is_some_and(|d| d.contains("event stream") && !d.contains("compressed")));
        let gzip = why(&[
            ("content-encoding", "identity"),
            ("content-encoding", "gzip"),
        ]);
        assert!(gzip.is_some_and(|d| d.contains("compressed (gzip)")));
        // A body read whole that is not the call's response: its outcome is not known.
        assert!(why(&[]).is_some_and(|d| d.contains("not with its JSON-RPC response")));
        // Too large to keep: the response was read, the outcome is known.
        assert!(unread_detail(&stored_call(None, StatusCode::OK).headers).is_none());
    }

    /// RFC 9110 §8.3.1: media types are case-insensitive; a longer subtype is another type.
    #[test]
    fn event_streams_are_known_in_any_case() {
        for (value, is) in [
            ("text/event-stream", true),
            ("Text/Event-Stream", true),
            ("TEXT/EVENT-STREAM;charset=utf-8", true),
            ("text/event-stream ; charset=utf-8", true),
            (" \ttext/event-stream", true),
            ("text/event-streams", false),
            ("text/event", false),
            ("application/json", false),
        ] {
            let mut headers = HeaderMap::new();
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_str(value).expect("value"),
            );
            assert_eq!(is_event_stream(&headers), is, "{value}");
        }
        assert!(!is_event_stream(&HeaderMap::new()));
    }

    /// DESIGN §8: a null id answers no call, and a keyed call whose id cannot be read back
    /// (beyond a double's range) is refused rather than run with no response to find.
    #[test]
    fn null_answers_nothing_and_unreadable_ids_are_refused() {
        for ours in ["1e400", "-1e400", "7", "\"a\""] {
            assert!(!id(ours).answers(Some(&Value::Null)), "{ours}");
        }
        assert!(!id("1e400").answers(Some(&json!(1e300))));
        for raw in ["1e400", "-1E+999"] {
            let body =
                format!(r#"{{"jsonrpc":"2.0","id":{raw},"method":"tools/call","params":{{}}}}"#);
            assert_eq!(
                refused(&parsed(&body, Some("k"))),
                Some(ProblemKind::CallUnguardable),
                "{raw}"
            );
            assert!(passes(&parsed(&body, None)), "{raw}: unkeyed passes");
        }
    }

    #[test]
    fn interim_results_are_not_outcomes_and_continuations_match() {
        let headers = HeaderMap::new();
        let interim = br#"{"jsonrpc":"2.0","id":1,"result":{"resultType":"input_required","inputRequests":{}}}"#;
        assert!(final_of(&headers, interim, &id("1")).is_none());
        let done = br#"{"jsonrpc":"2.0","id":1,"result":{"resultType":"complete","content":[]}}"#;
        assert!(final_of(&headers, done, &id("1")).is_some());
        let (parts, ()) = http::Request::post("/mcp")
            .body(())
            .expect("req")
            .into_parts();
        let options = crate::fingerprint::FingerprintOptions::default();
        let first =
            call(json!({"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t"}}))
                .expect("call");
        let next = call(json!({"jsonrpc":"2.0","id":2,"method":"tools/call",
            "params":{"name":"t","inputResponses":{"a":1},"requestState":"opaque"}}))
        .expect("call");
        assert_eq!(
            fingerprint(
                &parts,
                None,
                &first,
                &options,
                crate::fingerprint::scheme(&options, None, true)
            )
            .expect("fp"),
            fingerprint(
                &parts,
                None,
                &next,
                &options,
                crate::fingerprint::scheme(&options, None, true)
            )
            .expect("fp")
        );
    }

    /// A malformed body is answered as unreadable (-31005), never as changed arguments
    /// (-31002), which tells a client its call differs from the key's first.
    #[test]
    fn malformed_bodies_are_not_changed_arguments() {
        assert_eq!(code(ProblemKind::BodyMalformed), -31005);
        assert_eq!(code(ProblemKind::BodyUnreadable), -31005);
        assert_eq!(code(ProblemKind::FingerprintMismatch), -31002);
    }

    #[test]
    fn internal_errors_are_not_definitive() {
        assert!(is_definitive(
            br#"{"jsonrpc":"2.0","id":1,"result":{"isError":true}}"#
        ));
        assert!(is_definitive(
            br#"{"jsonrpc":"2.0","id":1,"error":{"code":-32602,"message":"x"}}"#
        ));
        assert!(!is_definitive(
            br#"{"jsonrpc":"2.0","id":1,"error":{"code":-32603,"message":"x"}}"#
        ));
        assert!(!is_definitive(
            br#"{"jsonrpc":"2.0","id":1,"error":{"code":-32001,"message":"x"}}"#
        ));
    }
}
