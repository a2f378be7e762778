//! Reading a request in JSON-RPC mode: its `id` as sent, its method, its params, and its key
//! (the header's, or `params._meta`'s), and whether the `Mcp-Method` header agrees.

use std::sync::Arc;

use http::HeaderMap;
use serde_json::value::RawValue;

use super::JsonRpc;
use super::id::Id;
use crate::problem::{Problem, ProblemKind};

/// The MCP 2026-07-28 header naming a Streamable HTTP request's JSON-RPC method.
pub(super) static MCP_METHOD: http::HeaderName = http::HeaderName::from_static("mcp-method");

/// What a request's `Mcp-Method` header says, as the check against its body reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum HeaderMethod<'a> {
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
    pub(super) fn of(headers: &'a HeaderMap) -> Self {
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

/// A guarded JSON-RPC call.
#[derive(Debug, Clone)]
pub(super) struct Call {
    pub(super) id: Arc<Id>,
    pub(super) method: String,
    /// The params' text as sent, if any.
    pub(super) params: Option<String>,
    /// The key from `params._meta`, validated like the header's.
    pub(super) meta_key: Option<String>,
}

/// What the mode makes of a request body.
#[derive(Debug)]
pub(super) enum Parsed {
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
pub(super) struct Message<'a> {
    pub(super) id: Option<&'a RawValue>,
    pub(super) method: Option<&'a RawValue>,
    pub(super) params: Option<&'a RawValue>,
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
pub(super) fn parse(
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
    if !reply_to.readable() {
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
