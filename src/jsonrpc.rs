//! JSON-RPC mode (MCP `tools/call` and any JSON-RPC over HTTP): what makes two calls the same,
//! and answers in JSON-RPC form.
//!
//! Every retry of a JSON-RPC call carries a new `id`, and MCP clients add a fresh
//! `_meta.progressToken`, so a plain HTTP fingerprint would call every retry a changed request
//! and a plain replay would answer with the wrong `id`. In this mode:
//!
//! - only single requests (objects with an `id`) whose `method` is on the allow-list (default
//!   `tools/call`) are guarded; notifications, other methods, **batches (JSON arrays) and bodies
//!   that are not JSON-RPC pass through untouched** (the server answers them as it would);
//! - the key is the `Idempotency-Key` header or, if configured, an entry of `params._meta`;
//!   a guarded call without one passes through;
//! - the fingerprint is the route, the `method` and the canonical `params` without `_meta`;
//!   never the `id`; the scope is the layer's scope plus the method;
//! - the recorded outcome is the final JSON-RPC response (from a JSON body, or the last response
//!   event of an SSE stream); progress notifications and event ids are never recorded. An SSE
//!   answer is teed: the client receives it as it streams, and a client that hangs up does not
//!   stop it being read to its end and recorded. A response with no final JSON-RPC outcome is
//!   not recorded and the key is released: that includes MCP's interim results
//!   (`resultType: "input_required"`), whose continuation (with `inputResponses` and
//!   `requestState`, which the fingerprint leaves out) then runs under the same key;
//! - replays are `200 application/json` with the stored `result` or `error` under the new
//!   request's `id`, and `Idempotency-Replayed: true`;
//! - the middleware's own answers are JSON-RPC errors echoing the request's `id`, with the HTTP
//!   status of the problem (409, 422, 503, …), a code outside the reserved range, and the problem
//!   details in `error.data`:
//!
//! | problem | code |
//! |---|---|
//! | key invalid | -31000 |
//! | in flight | -31001 |
//! | changed arguments (fingerprint mismatch) | -31002 |
//! | outcome unknown | -31003 |
//! | store unavailable | -31004 |
//! | body too large or unreadable | -31005 |
//! | execution failed | -31006 |
//! | response not stored | -31007 |

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response, StatusCode, header, request::Parts};
use serde_json::{Map, Value};

use crate::body::ResponseBody;
use crate::fingerprint::Fingerprint;
use crate::problem::{Problem, ProblemKind};

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

/// `params` fields that change from one round trip of the same call to the next (MCP's
/// multi-round-trip requests), left out of the fingerprint with `_meta`.
const PER_ATTEMPT: &[&str] = &["inputResponses", "requestState"];

/// A guarded JSON-RPC call.
#[derive(Debug, Clone)]
pub(crate) struct Call {
    pub(crate) id: Arc<Value>,
    pub(crate) method: String,
    params: Value,
    pub(crate) meta_key: Option<String>,
}

/// The call in `body`, if it is one this mode guards.
pub(crate) fn parse(body: &[u8], settings: &JsonRpc) -> Option<Call> {
    let Ok(Value::Object(mut message)) = serde_json::from_slice::<Value>(body) else {
        return None; // a batch, or not JSON-RPC: passes through
    };
    let id = message.remove("id").filter(|id| !id.is_null())?;
    let method = match message.get("method") {
        Some(Value::String(m)) if settings.methods.iter().any(|allowed| allowed == m) => m.clone(),
        _ => return None,
    };
    let mut params = message.remove("params").unwrap_or(Value::Null);
    let meta = match &mut params {
        Value::Object(params) => {
            // Per-attempt fields of a multi-round-trip call are not part of the operation.
            for field in PER_ATTEMPT {
                params.remove(*field);
            }
            params.remove("_meta")
        }
        _ => None,
    };
    let meta_key = settings
        .meta_key
        .as_ref()
        .and_then(|name| match meta.as_ref()?.get(name)? {
            Value::String(key) => Some(key.clone()),
            _ => None,
        });
    Some(Call {
        id: Arc::new(id),
        method,
        params,
        meta_key,
    })
}

/// Route, method and canonical params: never the id, never `_meta`.
pub(crate) fn fingerprint(parts: &Parts, call: &Call) -> Fingerprint {
    crate::fingerprint::jsonrpc(parts, &call.method, &call.params)
}

/// The JSON-RPC error code for a problem: outside the reserved −32768..−32000 range.
fn code(kind: ProblemKind) -> i64 {
    match kind {
        ProblemKind::KeyMissing | ProblemKind::KeyInvalid => -31000,
        ProblemKind::InFlight => -31001,
        ProblemKind::FingerprintMismatch | ProblemKind::BodyMalformed => -31002,
        ProblemKind::OutcomeUnknown => -31003,
        ProblemKind::StoreUnavailable => -31004,
        ProblemKind::BodyTooLarge | ProblemKind::BodyUnreadable => -31005,
        ProblemKind::ExecutionFailed => -31006,
        ProblemKind::ResponseNotStored => -31007,
        ProblemKind::ScopeMissing => -31008,
    }
}

/// A problem as a JSON-RPC error response for the call `id`.
pub(crate) fn error_response<B>(problem: &Problem, id: &Value) -> Response<ResponseBody<B>> {
    let message = serde_json::json!({
        "jsonrpc": "2.0",
        "id": id,
        "error": {
            "code": code(problem.kind),
            "message": problem.kind.title(),
            "data": problem.to_json(),
        },
    });
    let mut res = Response::new(ResponseBody::full(Bytes::from(message.to_string()), None));
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

/// The final JSON-RPC response to the call `id` in a captured body: the body itself for JSON,
/// the last response event for SSE. `None` when there is none (an interim answer).
pub(crate) fn final_response(headers: &HeaderMap, body: &[u8], id: &Value) -> Option<Bytes> {
    let is_sse = headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|ct| ct.as_bytes().starts_with(b"text/event-stream"));
    if !is_sse {
        return is_response(serde_json::from_slice(body).ok()?, id)
            .then(|| Bytes::copy_from_slice(body));
    }
    let text = std::str::from_utf8(body).ok()?;
    let mut last = None;
    for event in text.split("\n\n").flat_map(|e| e.split("\r\n\r\n")) {
        let data: Vec<&str> = event
            .lines()
            .filter_map(|line| line.strip_prefix("data:"))
            .map(|d| d.strip_prefix(' ').unwrap_or(d))
            .collect();
        if data.is_empty() {
            continue;
        }
        let data = data.join("\n");
        if let Ok(message) = serde_json::from_str::<Value>(&data)
            && is_response(message.clone(), id)
        {
            last = Some(Bytes::from(data));
        }
    }
    last
}

/// A final response (not a notification, a request or an interim result) to `id`.
fn is_response(message: Value, id: &Value) -> bool {
    let Value::Object(message) = message else {
        return false;
    };
    if message.get("id") != Some(id) {
        return false;
    }
    match message.get("result") {
        // MCP: a result asking for more input (`resultType: "input_required"`) is a step, not
        // the outcome; only "complete" (or no type, for older peers) is final.
        Some(result) => match result.get("resultType") {
            None => true,
            Some(kind) => kind == "complete",
        },
        None => message.contains_key("error"),
    }
}

/// Whether a final response is definitive (DESIGN §3 for JSON-RPC): results are, tool errors
/// included (`isError`); protocol errors are, except internal and server errors.
pub(crate) fn is_definitive(message: &[u8]) -> bool {
    let Ok(Value::Object(message)) = serde_json::from_slice::<Value>(message) else {
        return false;
    };
    match message
        .get("error")
        .and_then(|e| e.get("code"))
        .and_then(Value::as_i64)
    {
        None => true,
        Some(code) => !(code == -32603 || (-32099..=-32000).contains(&code)),
    }
}

/// A stored final response, re-addressed to the call `id`.
pub(crate) fn readdress(stored: &[u8], id: &Value, mark: bool) -> Option<Bytes> {
    let Ok(Value::Object(mut message)) = serde_json::from_slice::<Value>(stored) else {
        return None;
    };
    message.insert("id".to_owned(), id.clone());
    if mark && let Some(Value::Object(result)) = message.get_mut("result") {
        let meta = result
            .entry("_meta")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(meta) = meta {
            meta.insert(REPLAY_META.to_owned(), Value::Bool(true));
        }
    }
    Some(Bytes::from(Value::Object(message).to_string()))
}

/// The stored form of a final response: `200 application/json`, whatever the original framing.
pub(crate) fn stored_headers() -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers
}

/// The status a replay answers with.
pub(crate) const REPLAY_STATUS: StatusCode = StatusCode::OK;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(body: Value) -> Option<Call> {
        parse(
            &serde_json::to_vec(&body).expect("json"),
            &JsonRpc::new().meta_key("idempotencyKey"),
        )
    }

    #[test]
    fn only_single_allowlisted_requests_are_guarded() {
        assert!(call(json!({"jsonrpc":"2.0","id":1,"method":"tools/call","params":{}})).is_some());
        assert!(
            call(json!({"jsonrpc":"2.0","method":"tools/call","params":{}})).is_none(),
            "notification"
        );
        assert!(call(json!({"jsonrpc":"2.0","id":1,"method":"tools/list"})).is_none());
        assert!(
            call(json!([{"jsonrpc":"2.0","id":1,"method":"tools/call"}])).is_none(),
            "batch"
        );
        assert!(parse(b"{not json", &JsonRpc::new()).is_none());
    }

    #[test]
    fn fingerprint_ignores_id_and_meta_but_not_arguments() {
        let (parts, ()) = http::Request::post("/mcp")
            .body(())
            .expect("req")
            .into_parts();
        let fp = |v: Value| fingerprint(&parts, &call(v).expect("call"));
        let a = fp(json!({"jsonrpc":"2.0","id":1,"method":"tools/call",
            "params":{"name":"t","arguments":{"x":1,"y":2},"_meta":{"progressToken":"a"}}}));
        let b = fp(json!({"jsonrpc":"2.0","id":"retry-7","method":"tools/call",
            "params":{"arguments":{"y":2,"x":1},"name":"t","_meta":{"progressToken":"b"}}}));
        let c = fp(json!({"jsonrpc":"2.0","id":1,"method":"tools/call",
            "params":{"name":"t","arguments":{"x":1,"y":3}}}));
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn key_can_come_from_meta() {
        let c = call(json!({"jsonrpc":"2.0","id":1,"method":"tools/call",
            "params":{"_meta":{"idempotencyKey":"k-1"}}}))
        .expect("call");
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
        let last = final_response(&headers, body.as_bytes(), &json!(5)).expect("final");
        assert_eq!(
            serde_json::from_slice::<Value>(&last).expect("json")["result"]["ok"],
            true
        );
        assert!(
            final_response(
                &headers,
                b"data: {\"jsonrpc\":\"2.0\",\"method\":\"x\"}\n\n",
                &json!(5)
            )
            .is_none()
        );
    }

    #[test]
    fn readdress_sets_the_new_id_and_marks() {
        let stored = br#"{"jsonrpc":"2.0","id":1,"result":{"content":[]}}"#;
        let out = readdress(stored, &json!("new"), true).expect("json");
        let v: Value = serde_json::from_slice(&out).expect("json");
        assert_eq!(v["id"], "new");
        assert_eq!(v["result"]["_meta"][REPLAY_META], true);
    }

    #[test]
    fn interim_results_are_not_outcomes_and_continuations_match() {
        let headers = HeaderMap::new();
        let interim = br#"{"jsonrpc":"2.0","id":1,"result":{"resultType":"input_required","inputRequests":{}}}"#;
        assert!(final_response(&headers, interim, &json!(1)).is_none());
        let done = br#"{"jsonrpc":"2.0","id":1,"result":{"resultType":"complete","content":[]}}"#;
        assert!(final_response(&headers, done, &json!(1)).is_some());
        let (parts, ()) = http::Request::post("/mcp")
            .body(())
            .expect("req")
            .into_parts();
        let first =
            call(json!({"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t"}}))
                .expect("call");
        let next = call(json!({"jsonrpc":"2.0","id":2,"method":"tools/call",
            "params":{"name":"t","inputResponses":{"a":1},"requestState":"opaque"}}))
        .expect("call");
        assert_eq!(fingerprint(&parts, &first), fingerprint(&parts, &next));
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
