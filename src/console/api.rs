//! The JSON API.

use std::time::SystemTime;

use axum::body::Body;
use axum::extract::{Request, State};
use http::{Response, StatusCode, header};
use serde_json::{Value, json};

use crate::store::IdempotencyStore;

use super::origin::{forbidden, read_body, same_origin};
use super::respond::{json_response, problem, store_failed};
use super::settle::{Settle, key_from, remove_by_hand};
use super::{Console, cursor_text, listing, millis, param, query_pairs, record_json};

pub(super) async fn api_uncertain<St: IdempotencyStore>(
    State(console): State<Console<St>>,
    req: Request,
) -> Response<Body> {
    let pairs = query_pairs(&req);
    let listed = match listing(&console, &pairs).await {
        Ok(listed) => listed,
        Err(error) => return error.into_response(),
    };
    let now = SystemTime::now();
    json_response(
        StatusCode::OK,
        &json!({
            "records": listed.records.iter().map(|r| record_json(r, now)).collect::<Vec<_>>(),
            "unreadable": listed.unreadable.iter().map(|(key, error)| json!({
                "scope": key.scope(), "key": key.key(), "error": error,
            })).collect::<Vec<_>>(),
            "next": listed.next.as_ref().map(cursor_text),
            "count": listed.count,
            "oldest_ms": listed.oldest.map(millis),
        }),
    )
}

pub(super) async fn api_record<St: IdempotencyStore>(
    State(console): State<Console<St>>,
    req: Request,
) -> Response<Body> {
    let pairs = query_pairs(&req);
    let key = match key_from(|n| param(&pairs, n).map(str::to_owned)) {
        Ok(key) => key,
        Err(why) => return problem(StatusCode::BAD_REQUEST, &why),
    };
    match console.store.lookup(&key).await {
        Ok(Some(record)) => json_response(StatusCode::OK, &record_json(&record, SystemTime::now())),
        Ok(None) => problem(StatusCode::NOT_FOUND, "no record for this key"),
        Err(error) => store_failed(&error),
    }
}

/// The fields of a JSON API write, after the same-origin and content-type checks.
pub(super) async fn api_fields<St>(
    console: &Console<St>,
    req: Request,
) -> Result<serde_json::Map<String, Value>, Response<Body>> {
    // A browser says where a request comes from (Sec-Fetch-Site, Origin): from elsewhere is
    // refused. Without either, it is not a browser's cross-site request (a script, curl).
    let says =
        req.headers().contains_key(header::ORIGIN) || req.headers().contains_key("sec-fetch-site");
    if says && !same_origin(&req, &console.origins) {
        return Err(forbidden());
    }
    let is_json = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| {
            ct.split(';')
                .next()
                .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
        });
    if !is_json {
        return Err(problem(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "the JSON API takes Content-Type: application/json",
        ));
    }
    let (_, body) = read_body(req).await?;
    match serde_json::from_slice::<Fields>(&body) {
        Ok(Fields(fields)) => Ok(fields),
        Err(error) if error.is_data() => Err(problem(StatusCode::BAD_REQUEST, &error.to_string())),
        Err(_) => Err(problem(
            StatusCode::BAD_REQUEST,
            "the body is not a JSON object",
        )),
    }
}

/// The fields of an API body as a form would carry them: each named once, each a string, a
/// number or `null` (absent). A map keeps the last of two values of one name, so a body could
/// take back what it said (`"token": "5", "token": null`); and a field of another shape
/// (`{"status": [600]}`, `{"body": {"id": 1}}`) is a mistake to refuse, never one to read as
/// absent and fill with its default (a 200, an empty body, the current attempt).
pub(super) struct Fields(serde_json::Map<String, Value>);

impl<'de> serde::Deserialize<'de> for Fields {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Once;

        impl<'de> serde::de::Visitor<'de> for Once {
            type Value = Fields;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Fields, A::Error> {
                let mut fields = serde_json::Map::new();
                while let Some((name, value)) = map.next_entry::<String, Value>()? {
                    if fields.contains_key(&name) {
                        return Err(serde::de::Error::custom(format_args!(
                            "{name} is given twice"
                        )));
                    }
                    if !matches!(value, Value::String(_) | Value::Number(_) | Value::Null) {
                        return Err(serde::de::Error::custom(format_args!(
                            "{name} must be a string, a number or null (a response body is \
                             sent as text)"
                        )));
                    }
                    fields.insert(name, value);
                }
                Ok(Fields(fields))
            }
        }

        deserializer.deserialize_map(Once)
    }
}

/// What `POST /api/resolve` reads.
const RESOLVE_FIELDS: &[&str] = &[
    "ref",
    "scope",
    "key",
    "token",
    "outcome",
    "reason",
    "status",
    "content_type",
    "body",
];

/// What `POST /api/remove` reads.
const REMOVE_FIELDS: &[&str] = &["ref", "scope", "key", "token", "state", "reason"];

/// What `POST /api/purge` reads: nothing.
const PURGE_FIELDS: &[&str] = &[];

/// Refuses a field the write does not read: a misspelt `token` (`lease_token`, `Token`) read
/// as absent would settle whichever attempt holds the key now, not the one asked for.
fn unknown_field(
    fields: &serde_json::Map<String, Value>,
    known: &[&str],
) -> Option<Response<Body>> {
    let name = fields.keys().find(|name| !known.contains(&name.as_str()))?;
    Some(problem(
        StatusCode::BAD_REQUEST,
        &format!(
            "{name} is not a field of this write (it takes {}): nothing was changed",
            known.join(", ")
        ),
    ))
}

/// A field of an API body as its form would carry it: a string, a number written out, or
/// absent (left out, or `null`). [`api_fields`] refused every other shape.
pub(super) fn json_field(fields: &serde_json::Map<String, Value>, name: &str) -> Option<String> {
    match fields.get(name)? {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

pub(super) async fn api_resolve<St: IdempotencyStore>(
    State(console): State<Console<St>>,
    req: Request,
) -> Response<Body> {
    let fields = match api_fields(&console, req).await {
        Ok(fields) => fields,
        Err(res) => return res,
    };
    if let Some(res) = unknown_field(&fields, RESOLVE_FIELDS) {
        return res;
    }
    let settle = match Settle::from_fields(|n| json_field(&fields, n)) {
        Ok(settle) => settle,
        Err(why) => return problem(StatusCode::BAD_REQUEST, &why),
    };
    let key = settle.key.clone();
    match settle.apply(&console).await {
        Ok(()) => match console.store.lookup(&key).await {
            Ok(Some(record)) => {
                json_response(StatusCode::OK, &record_json(&record, SystemTime::now()))
            }
            // Resolved all the same: a 503 here would read as "not done", and a caller that
            // resolves again without its token could settle a later attempt.
            Ok(None) | Err(_) => json_response(StatusCode::OK, &json!({ "resolved": true })),
        },
        Err(not_done) => problem(not_done.status(), not_done.why()),
    }
}

pub(super) async fn api_remove<St: IdempotencyStore>(
    State(console): State<Console<St>>,
    req: Request,
) -> Response<Body> {
    let fields = match api_fields(&console, req).await {
        Ok(fields) => fields,
        Err(res) => return res,
    };
    if let Some(res) = unknown_field(&fields, REMOVE_FIELDS) {
        return res;
    }
    match remove_by_hand(&console, |n| json_field(&fields, n)).await {
        Ok(removed) => json_response(StatusCode::OK, &json!({ "removed": removed })),
        Err((status, why)) => problem(status, &why),
    }
}

pub(super) async fn api_purge<St: IdempotencyStore>(
    State(console): State<Console<St>>,
    req: Request,
) -> Response<Body> {
    match api_fields(&console, req).await {
        Err(res) => return res,
        Ok(fields) => {
            if let Some(res) = unknown_field(&fields, PURGE_FIELDS) {
                return res;
            }
        }
    }
    match console.store.purge_expired().await {
        Ok(purged) => json_response(StatusCode::OK, &json!({ "purged": purged })),
        Err(error) => store_failed(&error),
    }
}
