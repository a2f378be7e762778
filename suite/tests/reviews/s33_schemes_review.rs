//! Session 33 red-team review of 7529ae7..f834577: fingerprint schemes (the first two bytes of
//! a fingerprint name the settings that made it; a mismatch across schemes keeps the key), a
//! keyed body refused while buffering tells its key's state (`Pipeline::told`), replays pass
//! the deny list, cut bodies read as hyper reads `Content-Length`, and keyed HEADs on guarded
//! GET routes. Effects are counted at the sink (the handler bumps an `AtomicUsize`).

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::Response;
use axum::routing::{any, get, post};
use common::{Effects, client, guard, serve, until};
use sha2::{Digest, Sha256};
use tower_idempotency::fingerprint::JsonFields;
use tower_idempotency::jsonrpc::JsonRpc;
use tower_idempotency::scope::SingleTenant;
use tower_idempotency::store::StoredResponse;
use tower_idempotency::{
    Fingerprint, IdempotencyLayer, IdempotencyStore, MalformedBody, MemoryStore, ScopedKey,
};

// ---- shared pieces ----------------------------------------------------------------------------

fn unique(name: &str) -> String {
    common::raw::unique(name)
}

/// What one exchange came to.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: HeaderMap,
    body: String,
    raw: Vec<u8>,
    json: serde_json::Value,
}

impl Answer {
    fn replayed(&self) -> bool {
        self.headers
            .get("idempotency-replayed")
            .is_some_and(|v| v == "true")
    }
    /// `safe_new_key` from a problem body, or a JSON-RPC error's `data`.
    fn safe_new_key(&self) -> Option<bool> {
        self.json["safe_new_key"]
            .as_bool()
            .or_else(|| self.json["error"]["data"]["safe_new_key"].as_bool())
    }
    fn state(&self) -> Option<String> {
        self.json["state"]
            .as_str()
            .or_else(|| self.json["error"]["data"]["state"].as_str())
            .map(str::to_owned)
    }
    fn slug(&self) -> String {
        let t = self.json["type"]
            .as_str()
            .or_else(|| self.json["error"]["data"]["type"].as_str())
            .unwrap_or_default();
        t.rsplit(':').next().unwrap_or_default().to_owned()
    }
}

async fn send(
    addr: SocketAddr,
    method: Method,
    path: &str,
    key: Option<&str>,
    content_type: &str,
    body: impl Into<reqwest::Body>,
    headers: &[(&str, &str)],
) -> Answer {
    guard("an exchange", async {
        let mut req = client()
            .request(method, format!("http://{addr}{path}"))
            .header("content-type", content_type)
            .body(body);
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        for (n, v) in headers {
            req = req.header(*n, *v);
        }
        // A transport failure is an answer too (status 0), for the tests to judge.
        let res = match req.send().await {
            Ok(res) => res,
            Err(error) => {
                return Answer {
                    status: 0,
                    headers: HeaderMap::new(),
                    body: format!("transport error: {error:?}"),
                    raw: Vec::new(),
                    json: serde_json::Value::Null,
                };
            }
        };
        let status = res.status().as_u16();
        let headers = res.headers().clone();
        let bytes = res.bytes().await.unwrap_or_default();
        let body = String::from_utf8_lossy(&bytes).into_owned();
        let json = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
        Answer {
            status,
            headers,
            body,
            raw: bytes.to_vec(),
            json,
        }
    })
    .await
}

async fn post_json(addr: SocketAddr, path: &str, key: &str, body: &str) -> Answer {
    send(
        addr,
        Method::POST,
        path,
        Some(key),
        "application/json",
        body.to_owned(),
        &[],
    )
    .await
}

type L = IdempotencyLayer<MemoryStore, SingleTenant>;

/// A POST handler at each of `paths` that makes one effect and answers 201 naming the path.
fn counting(paths: &[&'static str], effects: &Effects) -> Router {
    let mut router = Router::new();
    for &path in paths {
        let effects = effects.clone();
        router = router.route(
            path,
            any(move || {
                let effects = effects.clone();
                async move { (StatusCode::CREATED, format!("{path} run {}", effects.hit())) }
            }),
        );
    }
    router
}

// ---- 1: fingerprint schemes ---------------------------------------------------------------------

/// Attacks: `decide::mismatch`'s new scheme test with one layer, one store, one scope, two
/// routes: `/a` counts JSON fields of its own (`for_path(.., fingerprint_json(..))`), `/b` the
/// defaults. A client reuses a key on the other route: a genuinely different request (another
/// path) under the very same settings. Its fingerprint's scheme is the other route's, so the
/// answer says "made under other fingerprint settings ... do not send it again with a new key"
/// (`safe_new_key: false`), though the server's configuration never changed and the request
/// never ran: the client is told to keep a key that can never run its operation. DESIGN §1
/// step 6 (a different fingerprint is another request: 422, nothing run) and §1 problem
/// details (`safe_new_key`: true when the outcome is definite, here: nothing ran).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_reused_on_a_route_with_other_json_fields_is_a_plain_mismatch() {
    let effects = Effects::default();
    let store = MemoryStore::new();
    let layer = IdempotencyLayer::new(store.clone())
        .single_tenant()
        .for_path("/a", |r| {
            r.fingerprint_json(JsonFields::exclude(["/ts"]).expect("pointer"))
        });
    let addr = serve(counting(&["/a", "/b"], &effects).layer(layer)).await;
    let mut broken = Vec::new();
    for (first, second) in [("/a", "/b"), ("/b", "/a")] {
        let key = unique("cross-route");
        let one = post_json(addr, first, &key, r#"{"amount":1,"ts":1}"#).await;
        assert_eq!(one.status, 201, "{first}: {one:?}");
        let before = effects.count();
        let two = post_json(addr, second, &key, r#"{"amount":1,"ts":1}"#).await;
        assert_eq!(
            (two.status, two.slug().as_str(), effects.count()),
            (422, "fingerprint-mismatch", before),
            "{first} then {second}: {two:?}"
        );
        if two.safe_new_key() != Some(true) {
            broken.push(format!(
                "key used on {first}, then on {second} (another path, same layer, same \
                 settings): 422 safe_new_key {:?}, detail {:?}",
                two.safe_new_key(),
                two.json["detail"]
            ));
        }
    }
    assert!(
        broken.is_empty(),
        "a different request under unchanged settings is told not to use a new key:\n{}",
        broken.join("\n")
    );
}

/// Attacks: the scheme's naming of custom canonicalisers (`fingerprint::scheme` feeds
/// `options.custom` in registration order; `IdempotencyLayer::canonicalize` pushes onto a
/// list). Header and field lists were made sets by 7529ae7 so that replicas configured alike
/// in another order read one request alike; two replicas registering the same canonicalisers
/// in another order (or one of them twice) name two schemes, so a byte-identical retry on the
/// other replica is a cross-scheme 422 with `safe_new_key: false`: never a replay, the key
/// stuck until its TTL. DESIGN §1 step 4 (a fingerprint says what the request is, not how the
/// config was written) and §1 step 6 (completed, same request -> replay).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_canonicalisers_registered_in_another_order_read_one_request_alike() {
    fn ident(body: &[u8]) -> Result<Vec<u8>, MalformedBody> {
        Ok(body.to_vec())
    }
    fn upper(body: &[u8]) -> Result<Vec<u8>, MalformedBody> {
        Ok(body.to_ascii_uppercase())
    }
    type Case = (&'static str, fn(L) -> L, fn(L) -> L);
    let cases: Vec<Case> = vec![
        (
            "x-a, x-b vs x-b, x-a",
            |l| {
                l.canonicalize("application/x-a", ident)
                    .canonicalize("application/x-b", upper)
            },
            |l| {
                l.canonicalize("application/x-b", upper)
                    .canonicalize("application/x-a", ident)
            },
        ),
        (
            "x-a vs x-a, x-a",
            |l| l.canonicalize("application/x-a", ident),
            |l| {
                l.canonicalize("application/x-a", ident)
                    .canonicalize("application/x-a", ident)
            },
        ),
    ];
    let mut broken = Vec::new();
    for (name, one, other) in cases {
        let store = MemoryStore::new();
        let effects = Effects::default();
        let base = || IdempotencyLayer::new(store.clone()).single_tenant();
        let a = serve(counting(&["/op"], &effects).layer(one(base()))).await;
        let b = serve(counting(&["/op"], &effects).layer(other(base()))).await;
        let key = unique("canon");
        let first = send(
            a,
            Method::POST,
            "/op",
            Some(&key),
            "application/x-a",
            "abc",
            &[],
        )
        .await;
        assert_eq!(first.status, 201, "{name}: {first:?}");
        let retry = send(
            b,
            Method::POST,
            "/op",
            Some(&key),
            "application/x-a",
            "abc",
            &[],
        )
        .await;
        assert_eq!(effects.count(), 1, "{name}: B ran nothing: {retry:?}");
        if !(retry.replayed() && retry.body == first.body) {
            broken.push(format!(
                "{name}: the same request on the other replica got {} {} (safe_new_key {:?})",
                retry.status,
                retry.slug(),
                retry.safe_new_key()
            ));
        }
    }
    assert!(
        broken.is_empty(),
        "canonicalisers registered alike in another order read one request as another:\n{}",
        broken.join("\n")
    );
}

/// The fingerprint as the crate computed it before 7529ae7 (the whole SHA-256, no scheme
/// bytes) for `POST /op`, `Content-Type: application/octet-stream`, raw `body`, default
/// settings: each field length-prefixed (u64 LE), as `fingerprint_fields` feeds them.
fn pre_scheme_fingerprint(body: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    let mut field = |bytes: &[u8]| {
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    field(b"tower-idempotency/fingerprint/v1");
    field(b"POST");
    field(b"/op");
    field(b"");
    field(b"application/octet-stream");
    field(b"raw");
    field(body);
    h.finalize().into()
}

/// Attacks: the scheme bytes on an upgrade. A record in a durable store (SQLite) written by the
/// previous version (its
/// fingerprint the whole digest) for the very request a client now retries: the new version's
/// fingerprint differs only in its first four bytes (the other 28 are the same digest of the
/// same input). It was answered as a cross-scheme mismatch: 422, `safe_new_key: false`, and
/// every later retry the same until the record's TTL (24 h) ran out: the operation ran, its
/// answer was stored, and the client could neither get it nor move on. The digest's tail tells
/// "same input" apart from "read another way": replayed. DESIGN §1 step 6 (completed, same
/// request -> replay) and the worst outcome "a key stuck".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_written_before_the_scheme_bytes_is_replayed_to_its_retry() {
    let body = b"pay 10 EUR".as_slice();
    // The test's own hashing must be the crate's, but for the scheme bytes.
    let (parts, ()) = http::Request::builder()
        .method("POST")
        .uri("/op")
        .header("content-type", "application/octet-stream")
        .body(())
        .expect("request")
        .into_parts();
    let now = Fingerprint::of(&parts, body).expect("fingerprint");
    let old = pre_scheme_fingerprint(body);
    assert_eq!(
        now.as_bytes()[4..],
        old[4..],
        "precondition: the test replicates the pre-scheme hashing"
    );
    // A durable store, as a rolling upgrade finds it.
    let (store, _path) = common::sqlite("s33-schemes-upgrade").await;
    let key_text = unique("upgrade");
    let key = ScopedKey::new("", &key_text);
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("text/plain"));
    let stored = StoredResponse {
        status: StatusCode::CREATED,
        headers,
        body: Some(Bytes::from_static(b"old version's run")),
        trailers: None,
    };
    common::schemes::seed(&store, &key, old, &stored).await;
    let effects = Effects::default();
    let addr = serve(
        counting(&["/op"], &effects).layer(IdempotencyLayer::new(store.clone()).single_tenant()),
    )
    .await;
    let retry = send(
        addr,
        Method::POST,
        "/op",
        Some(&key_text),
        "application/octet-stream",
        body.to_vec(),
        &[],
    )
    .await;
    assert_eq!(effects.count(), 0, "nothing runs again: {retry:?}");
    assert!(
        retry.replayed() && retry.body == "old version's run",
        "the byte-identical retry of a request the previous version ran and recorded is not \
         replayed after the upgrade: {} {} safe_new_key {:?} (the fingerprints differ only in \
         the four scheme bytes; the client can neither get its answer nor use a new key)",
        retry.status,
        retry.slug(),
        retry.safe_new_key()
    );
}

// ---- JSON-RPC: the new answers in JSON-RPC framing ----------------------------------------------

/// A tool server at `/mcp` that makes one effect per call and answers the call's id.
fn tools(effects: &Effects) -> Router {
    let effects = effects.clone();
    Router::new().route(
        "/mcp",
        post(move |body: Bytes| {
            let effects = effects.clone();
            async move {
                let call: serde_json::Value = serde_json::from_slice(&body).expect("a call");
                let n = effects.hit();
                let answer = serde_json::json!({
                    "jsonrpc": "2.0", "id": call["id"],
                    "result": {"content": [{"type": "text", "text": format!("run {n}")}]}
                });
                (
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    answer.to_string(),
                )
            }
        }),
    )
}

fn tool_call(id: u32, pad: usize) -> String {
    serde_json::json!({
        "jsonrpc": "2.0", "id": id, "method": "tools/call",
        "params": {"name": "charge", "arguments": {"amount": 8, "memo": "m".repeat(pad)}}
    })
    .to_string()
}

/// Attacks: `told` on a JSON-RPC route. The key comes in the `Idempotency-Key` header, but the
/// route's head is `Pending::Call` (the method joins the scope only once the body is read),
/// so `pending.key()` is `None` and a body refused while buffering is answered as before:
/// -31005 with `safe_new_key: true`. Replica A (default 1 MiB) runs a 2 KiB `tools/call`;
/// its byte-identical retry lands on replica B (`body_limit(512)`), one store: told a new key
/// is safe, the client sends the call again under a new key, A runs it a second time. The
/// HTTP twin of this was fixed in 12fc824. DESIGN §8 (JSON-RPC errors carry the same facts as
/// the problem bodies) and §1 (`safe_new_key` only where the outcome is definite).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jsonrpc_body_too_large_on_a_smaller_replica_does_not_advise_a_new_key() {
    let store = MemoryStore::new();
    let effects = Effects::default();
    let base = || {
        IdempotencyLayer::new(store.clone())
            .jsonrpc(JsonRpc::new())
            .single_tenant()
    };
    let a = serve(tools(&effects).layer(base())).await;
    let b = serve(tools(&effects).layer(base().body_limit(512))).await;
    let key = unique("rpc-big");
    let call = tool_call(1, 2048);
    let first = post_json(a, "/mcp", &key, &call).await;
    assert_eq!((first.status, effects.count()), (200, 1), "{first:?}");
    let retry = post_json(b, "/mcp", &key, &tool_call(2, 2048)).await;
    assert_eq!(effects.count(), 1, "B runs nothing: {retry:?}");
    assert!(
        retry.json["error"].is_object(),
        "a JSON-RPC error: {retry:?}"
    );
    if retry.safe_new_key() == Some(true) {
        // The client does as it is told: the same call under a new key, served by A.
        let _ = post_json(a, "/mcp", &unique("rpc-followed"), &tool_call(3, 2048)).await;
    }
    assert_ne!(
        retry.safe_new_key(),
        Some(true),
        "replica B's body-too-large answer to a keyed tools/call says safe_new_key: true \
         (state {:?}, code {}) for a key whose call ran and is recorded; following it ran the \
         call again (effects now {})",
        retry.state(),
        retry.json["error"]["code"],
        effects.count()
    );
}

/// Attacks: the cross-scheme answer in JSON-RPC framing. Replica A counts the request header
/// `x-api-version`, replica B does not; one store. A byte-identical `tools/call` retried on B
/// must be refused (-31002, nothing run) with `error.data.safe_new_key: false`; a genuinely
/// changed call on A itself (same scheme) keeps `safe_new_key: true`. DESIGN §8 (the same facts
/// as problem bodies, in `error.data`) and §1 step 6.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jsonrpc_mismatch_across_schemes_keeps_the_key_in_error_data() {
    let store = MemoryStore::new();
    let effects = Effects::default();
    let base = || {
        IdempotencyLayer::new(store.clone())
            .jsonrpc(JsonRpc::new())
            .single_tenant()
    };
    let a = serve(
        tools(&effects).layer(base().fingerprint_header(HeaderName::from_static("x-api-version"))),
    )
    .await;
    let b = serve(tools(&effects).layer(base())).await;
    let key = unique("rpc-scheme");
    let v = [("x-api-version", "1")];
    let first = send(
        a,
        Method::POST,
        "/mcp",
        Some(&key),
        "application/json",
        tool_call(1, 4),
        &v,
    )
    .await;
    assert_eq!((first.status, effects.count()), (200, 1), "{first:?}");
    let on_b = send(
        b,
        Method::POST,
        "/mcp",
        Some(&key),
        "application/json",
        tool_call(2, 4),
        &v,
    )
    .await;
    assert_eq!(
        (
            on_b.json["error"]["code"].as_i64(),
            on_b.safe_new_key(),
            effects.count()
        ),
        (Some(-31002), Some(false), 1),
        "cross-scheme mismatch in JSON-RPC: {on_b:?}"
    );
    let changed = send(
        a,
        Method::POST,
        "/mcp",
        Some(&key),
        "application/json",
        tool_call(3, 5),
        &v,
    )
    .await;
    assert_eq!(
        (
            changed.json["error"]["code"].as_i64(),
            changed.safe_new_key(),
            effects.count()
        ),
        (Some(-31002), Some(true), 1),
        "a changed call under one scheme: {changed:?}"
    );
}

// ---- gRPC-Web: told and the scheme answer in metadata -----------------------------------------

fn grpc_frame(flag: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![flag];
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// A gRPC-Web unary method at `/pkg.Svc/Do`: one effect, one message, `grpc-status: 0` in the
/// trailer frame.
fn grpc_web_app(effects: &Effects) -> Router {
    let effects = effects.clone();
    Router::new().route(
        "/pkg.Svc/Do",
        post(move || {
            let effects = effects.clone();
            async move {
                let n = effects.hit();
                let mut body = grpc_frame(0, format!("run {n}").as_bytes());
                body.extend(grpc_frame(0x80, b"grpc-status:0\r\n"));
                Response::builder()
                    .header("content-type", "application/grpc-web+proto")
                    .body(Body::from(body))
                    .expect("response")
            }
        }),
    )
}

/// A metadata entry of a gRPC-Web answer: from its headers (trailers-only) or its trailer frame.
fn grpc_meta(answer: &Answer, name: &str) -> Option<String> {
    if let Some(v) = answer.headers.get(name) {
        return v.to_str().ok().map(str::to_owned);
    }
    let mut rest = &answer.raw[..];
    while rest.len() >= 5 {
        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        let payload = rest.get(5..5 + len)?;
        if rest[0] & 0x80 != 0 {
            let text = String::from_utf8_lossy(payload);
            for line in text.split("\r\n") {
                if let Some((n, v)) = line.split_once(':')
                    && n.trim().eq_ignore_ascii_case(name)
                {
                    return Some(v.trim().to_owned());
                }
            }
        }
        rest = &rest[5 + len..];
    }
    None
}

/// An entry of the `ErrorInfo` metadata map (`state`, `safe_new_key`) in the answer's
/// `grpc-status-details-bin` (a `google.rpc.Status`, base64): found as its map entry's bytes,
/// key (field 1) then value (field 2).
fn grpc_info(answer: &Answer, key: &str) -> Option<String> {
    let text = grpc_meta(answer, "grpc-status-details-bin")?;
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let (mut bits, mut n, mut bytes) = (0u32, 0u32, Vec::new());
    for c in text.bytes().take_while(|&c| c != b'=') {
        bits = (bits << 6) | A.iter().position(|&a| a == c)? as u32;
        n += 6;
        if n >= 8 {
            n -= 8;
            bytes.push((bits >> n) as u8);
            bits &= (1 << n) - 1;
        }
    }
    let mut entry = vec![0x0a, key.len() as u8];
    entry.extend_from_slice(key.as_bytes());
    entry.push(0x12);
    let at = bytes
        .windows(entry.len())
        .position(|w| w == entry.as_slice())?
        + entry.len();
    let len = usize::from(*bytes.get(at)?);
    Some(String::from_utf8_lossy(bytes.get(at + 1..at + 1 + len)?).into_owned())
}

async fn grpc_web_call(
    addr: SocketAddr,
    key: &str,
    message: &[u8],
    headers: &[(&str, &str)],
) -> Answer {
    send(
        addr,
        Method::POST,
        "/pkg.Svc/Do",
        Some(key),
        "application/grpc-web+proto",
        grpc_frame(0, message),
        headers,
    )
    .await
}

/// Attacks: `told` and the cross-scheme mismatch in gRPC framing (gRPC-Web over HTTP/1.1, the
/// key in metadata). Replica A (defaults) runs a 600-byte message; replica B (`body_limit(64)`)
/// refuses its retry while reading it: `RESOURCE_EXHAUSTED` with `ErrorInfo` metadata `state`
/// naming the record and `safe_new_key: false`. Replica C counts a fingerprint header: the same retry is
/// `FAILED_PRECONDITION` with `safe_new_key: false`. Nothing runs twice. DESIGN §1 (the same
/// facts travel in gRPC metadata) and §1 step 6.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_web_refusals_carry_the_keys_state_and_keep_the_key() {
    let store = MemoryStore::new();
    let effects = Effects::default();
    let base = || IdempotencyLayer::new(store.clone()).single_tenant();
    let a = serve(grpc_web_app(&effects).layer(base())).await;
    let b = serve(grpc_web_app(&effects).layer(base().body_limit(64))).await;
    let c = serve(
        grpc_web_app(&effects).layer(base().fingerprint_header(HeaderName::from_static("x-v"))),
    )
    .await;
    let key = unique("grpc-web");
    let message = vec![b'm'; 600];
    let first = grpc_web_call(a, &key, &message, &[]).await;
    assert_eq!(
        (grpc_meta(&first, "grpc-status").as_deref(), effects.count()),
        (Some("0"), 1),
        "{first:?}"
    );
    let on_b = grpc_web_call(b, &key, &message, &[]).await;
    assert_eq!(
        (
            grpc_meta(&on_b, "grpc-status").as_deref(),
            grpc_info(&on_b, "safe_new_key").as_deref(),
            grpc_info(&on_b, "state").as_deref(),
            effects.count()
        ),
        (Some("8"), Some("false"), Some("completed"), 1),
        "body refused on B: {on_b:?}"
    );
    let on_c = grpc_web_call(c, &key, &message, &[]).await;
    assert_eq!(
        (
            grpc_meta(&on_c, "grpc-status").as_deref(),
            grpc_info(&on_c, "safe_new_key").as_deref(),
            effects.count()
        ),
        (Some("9"), Some("false"), 1),
        "cross-scheme mismatch on C: {on_c:?}"
    );
}

// ---- 2: told over HTTP --------------------------------------------------------------------------

/// Attacks: `told` while the key is in flight on another replica, then once it completed, then
/// for a key whose run was given back (released). Replica A (defaults) holds its handler on a
/// gate; replica B (`body_limit(128)`) gets the retry with the 1 KiB body: 413 naming the key's
/// state, `safe_new_key: false` (in flight, then completed); a released key (A's handler
/// answered 503, so the key was given back) is `safe_new_key: true` again, and so is a key
/// never used. The sink counts one run per answer A gave. DESIGN §1 step 3 (over the limit ->
/// 413, nothing claimed) and §1 problem details (`safe_new_key`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_too_large_tells_in_flight_completed_released_and_absent_keys_apart() {
    let store = MemoryStore::new();
    let effects = Effects::default();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let app = {
        let effects = effects.clone();
        let gate = gate.clone();
        Router::new().route(
            "/op",
            post(move |body: Bytes| {
                let effects = effects.clone();
                let gate = gate.clone();
                async move {
                    if body.starts_with(b"{\"fail\"") {
                        effects.hit();
                        return (StatusCode::SERVICE_UNAVAILABLE, "try later".to_owned());
                    }
                    gate.acquire().await.expect("gate").forget();
                    (StatusCode::CREATED, format!("run {}", effects.hit()))
                }
            }),
        )
    };
    let a = serve(
        app.clone()
            .layer(IdempotencyLayer::new(store.clone()).single_tenant()),
    )
    .await;
    let b = serve(
        app.layer(
            IdempotencyLayer::new(store.clone())
                .body_limit(128)
                .single_tenant(),
        ),
    )
    .await;
    let big = format!(r#"{{"amount":1,"memo":"{}"}}"#, "m".repeat(1024));
    let key = unique("told");
    let first = tokio::spawn({
        let (key, big) = (key.clone(), big.clone());
        async move { post_json(a, "/op", &key, &big).await }
    });
    until("A claims the key", || {
        futures_util::FutureExt::now_or_never(store.lookup(&ScopedKey::new("", &key)))
            .and_then(Result::ok)
            .flatten()
            .is_some()
    })
    .await;
    let in_flight = post_json(b, "/op", &key, &big).await;
    assert_eq!(
        (
            in_flight.status,
            in_flight.safe_new_key(),
            in_flight.state().as_deref()
        ),
        (413, Some(false), Some("in_progress")),
        "in flight on A: {in_flight:?}"
    );
    gate.add_permits(1);
    let first = guard("A's answer", first).await.expect("task");
    assert_eq!((first.status, effects.count()), (201, 1), "{first:?}");
    let done = post_json(b, "/op", &key, &big).await;
    assert_eq!(
        (done.status, done.safe_new_key(), done.state().as_deref()),
        (413, Some(false), Some("completed")),
        "completed on A: {done:?}"
    );
    // Released: the key is free again, and a new key too is safe.
    let failing = format!(r#"{{"fail":1,"memo":"{}"}}"#, "m".repeat(1024));
    let released = unique("told-released");
    let one = post_json(a, "/op", &released, &failing).await;
    assert_eq!((one.status, effects.count()), (503, 2), "{one:?}");
    let after = post_json(b, "/op", &released, &failing).await;
    assert_eq!(
        (after.status, after.safe_new_key()),
        (413, Some(true)),
        "released on A: {after:?}"
    );
    let fresh = post_json(b, "/op", &unique("told-fresh"), &big).await;
    assert_eq!(
        (fresh.status, fresh.safe_new_key(), effects.count()),
        (413, Some(true), 2),
        "never used: {fresh:?}"
    );
}

// ---- 3: replays pass the deny list ----------------------------------------------------------------

/// Attacks: `Dialect::replay`'s new `withhold` over a record written by another replica or
/// version that let denied headers through: `Set-Cookie`, a per-request id, a stale
/// `Content-Length`, `Connection` naming a hop-by-hop header. The replay must carry none of
/// them, keep the headers the answer needs (`Content-Type`, `Location`, a repeated `Link`), a
/// `Content-Length` matching the body it sends, in plain mode and in the envelope. DESIGN §1
/// ("never `Set-Cookie`... or per-request ids"; a 201 stays a 201, `Location` stays, repeated
/// headers stay repeated) and §3 (sensitive headers never stored).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_of_foreign_records_drop_denied_and_hop_by_hop_headers_only() {
    let body = br#"{"amount":1}"#;
    let (parts, ()) = http::Request::builder()
        .method("POST")
        .uri("/op")
        .header("content-type", "application/json")
        .body(())
        .expect("request")
        .into_parts();
    let fingerprint = Fingerprint::of(&parts, body).expect("fingerprint");
    let store = MemoryStore::new();
    let mut keys = Vec::new();
    for _ in 0..2 {
        let key_text = unique("foreign");
        let key = ScopedKey::new("", &key_text);
        let mut headers = HeaderMap::new();
        for (n, v) in [
            ("content-type", "text/plain"),
            ("location", "/orders/7"),
            ("link", "</a>; rel=a"),
            ("link", "</b>; rel=b"),
            ("set-cookie", "session=secret"),
            ("x-request-id", "req-1"),
            ("content-length", "999"),
            ("connection", "x-hop"),
            ("x-hop", "for this hop only"),
        ] {
            headers.append(
                HeaderName::from_static(n),
                HeaderValue::from_str(v).expect("value"),
            );
        }
        let stored = StoredResponse {
            status: StatusCode::CREATED,
            headers,
            body: Some(Bytes::from_static(b"order 7")),
            trailers: None,
        };
        common::schemes::seed(&store, &key, *fingerprint.as_bytes(), &stored).await;
        keys.push(key_text);
    }
    let effects = Effects::default();
    let plain = serve(
        counting(&["/op"], &effects).layer(IdempotencyLayer::new(store.clone()).single_tenant()),
    )
    .await;
    let wrapped = serve(
        counting(&["/op"], &effects).layer(
            IdempotencyLayer::new(store.clone())
                .envelope(true)
                .single_tenant(),
        ),
    )
    .await;
    for (mode, addr, key) in [("plain", plain, &keys[0]), ("envelope", wrapped, &keys[1])] {
        let r = send(
            addr,
            Method::POST,
            "/op",
            Some(key),
            "application/json",
            body.to_vec(),
            &[],
        )
        .await;
        assert!(r.replayed() && r.status == 201, "{mode}: {r:?}");
        for gone in ["set-cookie", "x-request-id", "x-hop"] {
            assert!(
                r.headers.get(gone).is_none(),
                "{mode}: {gone} replayed: {r:?}"
            );
        }
        assert!(
            r.headers
                .get_all("connection")
                .iter()
                .all(|v| !v.as_bytes().eq_ignore_ascii_case(b"x-hop")),
            "{mode}: the stored Connection line replayed: {r:?}"
        );
        assert_eq!(
            r.headers
                .get("content-length")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned),
            Some(r.body.len().to_string()),
            "{mode}: Content-Length matches the body sent: {r:?}"
        );
        assert_eq!(
            (
                r.headers.get("location").map(|v| v.as_bytes().to_vec()),
                r.headers.get_all("link").iter().count()
            ),
            (Some(b"/orders/7".to_vec()), 2),
            "{mode}: Location and repeated Link stay: {r:?}"
        );
        match mode {
            "plain" => assert_eq!(r.body, "order 7", "{r:?}"),
            _ => assert_eq!(r.json["original_response"], "order 7", "{r:?}"),
        }
    }
    assert_eq!(effects.count(), 0, "nothing ran");
}

// ---- 4: Content-Length read as hyper reads it ---------------------------------------------------

/// Attacks: `replay::content_length` with spellings of a whole 5-byte body's length: leading
/// zeros (`005`), a list (`5, 5`), surrounding spaces, and ones hyper refuses to send (`+5`,
/// `5, 6`, a value past u64, `0x5`). A spelling hyper reads as 5 must be answered live and
/// replayed whole; whatever the verdict, the handler runs once per key and a retry never gets
/// another body than the handler's (a replay of `hello`, or `response-not-stored`). DESIGN §3 (a broken body is "completed, response not available";
/// never re-run) and §1 step 9.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_length_spellings_never_rerun_nor_replay_another_body() {
    let effects = Effects::default();
    let store = MemoryStore::new();
    let app = {
        let effects = effects.clone();
        Router::new().route(
            "/op",
            post(move |headers: axum::http::HeaderMap| {
                let effects = effects.clone();
                async move {
                    effects.hit();
                    // `_` stands for a space (a request header's edges are trimmed on the way).
                    let length = headers["x-length"]
                        .to_str()
                        .expect("ascii")
                        .replace('_', " ");
                    Response::builder()
                        .status(StatusCode::CREATED)
                        .header("content-length", length)
                        .body(Body::from_stream(futures_util::stream::iter([Ok::<
                            _,
                            std::io::Error,
                        >(
                            Bytes::from_static(b"hello"),
                        )])))
                        .expect("response")
                }
            }),
        )
    };
    let addr = serve(app.layer(IdempotencyLayer::new(store).single_tenant())).await;
    let mut broken = Vec::new();
    for (length, whole) in [
        ("005", true),
        ("5, 5", true),
        ("5,5", true),
        ("_5_", true),
        ("5_,_5", true),
        ("+5", false),
        ("5, 6", false),
        ("18446744073709551621", false),
        ("0x5", false),
    ] {
        let key = unique("length");
        let before = effects.count();
        let h = [("x-length", length)];
        let one = send(addr, Method::POST, "/op", Some(&key), "text/plain", "x", &h).await;
        let two = send(addr, Method::POST, "/op", Some(&key), "text/plain", "x", &h).await;
        let runs = effects.count() - before;
        let replayed_whole = two.replayed() && two.status == 201 && two.body == "hello";
        let not_stored = two.slug() == "response-not-stored";
        if runs != 1 || !(replayed_whole || not_stored) {
            broken.push(format!(
                "Content-Length {length:?}: {runs} runs; retry {} {:?} {:?}",
                two.status,
                two.slug(),
                two.body
            ));
        } else if whole && !(one.status == 201 && one.body == "hello" && replayed_whole) {
            broken.push(format!(
                "Content-Length {length:?} (hyper reads 5): live {} {:?}, retry {} {:?}",
                one.status, one.body, two.status, two.body
            ));
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

// ---- 5: keyed HEAD on guarded GET routes, nested and templated ------------------------------------

/// Attacks: `head_of_guarded_get` where the layer sits inside a `nest` (its `for_path` names the
/// full path the client sent) and on a template route: a keyed HEAD to a guarded GET is 400
/// `call-unguardable`, an unkeyed one 400 `key-missing`, neither runs the GET handler; a HEAD to
/// a path whose GET is not guarded passes through to it. DESIGN §1 step 1 and
/// `RouteConfig::methods`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_on_nested_and_templated_guarded_gets_is_refused_and_runs_nothing() {
    let effects = Effects::default();
    let handler = {
        let effects = effects.clone();
        move || {
            let effects = effects.clone();
            async move { format!("run {}", effects.hit()) }
        }
    };
    let inner = Router::new()
        .route("/items/{id}", get(handler.clone()))
        .route("/free", get(handler))
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .for_path("/v1/items/{id}", |r| r.methods([Method::GET])),
        );
    let addr = serve(Router::new().nest("/v1", inner)).await;
    let keyed = send(
        addr,
        Method::HEAD,
        "/v1/items/7",
        Some(&unique("head")),
        "text/plain",
        "",
        &[],
    )
    .await;
    assert_eq!(
        (keyed.status, effects.count()),
        (400, 0),
        "keyed HEAD on a nested guarded GET: {keyed:?}"
    );
    let unkeyed = send(
        addr,
        Method::HEAD,
        "/v1/items/7",
        None,
        "text/plain",
        "",
        &[],
    )
    .await;
    assert_eq!(
        (unkeyed.status, effects.count()),
        (400, 0),
        "unkeyed HEAD: {unkeyed:?}"
    );
    let free = send(addr, Method::HEAD, "/v1/free", None, "text/plain", "", &[]).await;
    assert_eq!(
        (free.status, effects.count()),
        (200, 1),
        "a HEAD to an unguarded GET passes through: {free:?}"
    );
    let get_keyed = send(
        addr,
        Method::GET,
        "/v1/items/7",
        Some(&unique("get")),
        "text/plain",
        "",
        &[],
    )
    .await;
    assert_eq!(
        (get_keyed.status, effects.count()),
        (200, 2),
        "the keyed GET itself runs once: {get_keyed:?}"
    );
}

// ---- 1 (again): the scheme's width --------------------------------------------------------

/// `fingerprint::fnv` as the crate writes it: FNV-1a over the length (u64 LE), then the bytes.
fn fnv(mut hash: u32, bytes: &[u8]) -> u32 {
    for b in (bytes.len() as u64).to_le_bytes().iter().chain(bytes) {
        hash = (hash ^ u32::from(*b)).wrapping_mul(0x0100_0193);
    }
    hash
}

/// Attacks: the scheme's width. With two bytes, one configuration in 65 536 named the same
/// scheme as another, and a name that did was found by trying `x-api-version-N` in well under
/// a second (`x-api-version-127125` shared the defaults' scheme): there the cross-scheme guard
/// was blind, a mismatch made by settings skew was again `safe_new_key: true`, and a client
/// that followed it ran the operation a second time. Four bytes now: none of the first 200 000
/// such names shares the defaults' scheme, and the name that did is told apart end to end
/// (replica A counts it, replica B the defaults; B refuses A's byte-identical retry with 422
/// and `safe_new_key: false`, one run). DESIGN §1 (`safe_new_key` only where the outcome is
/// definite) and the worst outcome "a handler run twice for one key".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sixteen_bit_scheme_collision_advises_a_new_key_for_a_retry() {
    const BASIS: u32 = 0x811c_9dc5;
    const VERSION: &[u8] = b"tower-idempotency/fingerprint/v1/r2";
    let plain = fnv(fnv(BASIS, VERSION), b"custom").to_be_bytes();
    let of_header = |name: &str| fnv(fnv(fnv(BASIS, VERSION), name.as_bytes()), b"custom");
    let body = br#"{"amount":12}"#;
    let (parts, ()) = http::Request::builder()
        .method("POST")
        .uri("/op")
        .header("content-type", "application/json")
        .body(())
        .expect("request")
        .into_parts();
    let default = Fingerprint::of(&parts, body).expect("fingerprint");
    assert_eq!(
        default.as_bytes()[..4],
        plain,
        "precondition: the test computes PLAIN_HTTP as the crate does"
    );
    let colliding: Vec<String> = (0u32..200_000)
        .map(|n| format!("x-api-version-{n}"))
        .filter(|name| of_header(name).to_be_bytes() == plain)
        .collect();
    assert!(
        colliding.is_empty(),
        "names sharing the defaults' scheme: {colliding:?}"
    );

    let name = "x-api-version-127125";
    let store = MemoryStore::new();
    let effects = Effects::default();
    let base = || IdempotencyLayer::new(store.clone()).single_tenant();
    let header = HeaderName::from_bytes(name.as_bytes()).expect("name");
    let a = serve(counting(&["/op"], &effects).layer(base().fingerprint_header(header))).await;
    let b = serve(counting(&["/op"], &effects).layer(base())).await;
    let key = unique("collision");
    let h = [(name, "1")];
    let send_to = |addr: SocketAddr, key: String| async move {
        send(
            addr,
            Method::POST,
            "/op",
            Some(&key),
            "application/json",
            body.to_vec(),
            &h,
        )
        .await
    };
    let first = send_to(a, key.clone()).await;
    assert_eq!((first.status, effects.count()), (201, 1), "{first:?}");
    let record = store
        .lookup(&ScopedKey::new("", &key))
        .await
        .expect("lookup")
        .expect("a record");
    assert_eq!(
        record.fingerprint.as_bytes()[..4],
        of_header(name).to_be_bytes(),
        "precondition: the test computes A's scheme as the crate does"
    );
    let retry = send_to(b, key.clone()).await;
    assert_eq!(
        (retry.status, retry.slug().as_str(), effects.count()),
        (422, "fingerprint-mismatch", 1),
        "{retry:?}"
    );
    assert_eq!(
        retry.safe_new_key(),
        Some(false),
        "replica B (no fingerprint headers) refuses the byte-identical retry of A's request \
         (fingerprint header {name:?}) and must not advise a new key: {retry:?}"
    );
}

/// Attacks: `told` when the store cannot be read (`Ok(Err(_))`: "unknown: not a key to
/// leave"). Replica A runs a 1 KiB request; replica B (`body_limit(128)`), its store down,
/// refuses the retry 413 without running it. It must not advise a new key (the key ran), and
/// the facts it gives must be ones a client can act on: not `state: "none"` (a record read and
/// found absent) where nothing was read, and a `Retry-After`/`retry_after` for a store that is
/// down (DESIGN §1 step 6: store errors -> 503 + Retry-After; §1 problem details: the
/// operation's state). When the store is back, the same retry says `completed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_too_large_while_the_store_is_down_does_not_claim_the_key_is_unused() {
    let store = MemoryStore::new();
    let faulty = common::faulty::Faulty::new(store.clone());
    let effects = Effects::default();
    let a = serve(
        counting(&["/op"], &effects).layer(IdempotencyLayer::new(store.clone()).single_tenant()),
    )
    .await;
    let b = serve(
        counting(&["/op"], &effects).layer(
            IdempotencyLayer::new(faulty.clone())
                .body_limit(128)
                .single_tenant(),
        ),
    )
    .await;
    let big = format!(r#"{{"amount":1,"memo":"{}"}}"#, "m".repeat(1024));
    let key = unique("told-down");
    let first = post_json(a, "/op", &key, &big).await;
    assert_eq!((first.status, effects.count()), (201, 1), "{first:?}");
    faulty.down.store(true, std::sync::atomic::Ordering::SeqCst);
    let down = post_json(b, "/op", &key, &big).await;
    faulty
        .down
        .store(false, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        (down.status, down.safe_new_key(), effects.count()),
        (413, Some(false), 1),
        "B's store down: {down:?}"
    );
    let back = post_json(b, "/op", &key, &big).await;
    assert_eq!(
        (back.status, back.safe_new_key(), back.state().as_deref()),
        (413, Some(false), Some("completed")),
        "B's store back: {back:?}"
    );
    assert!(
        down.state().as_deref() != Some("none")
            && (down.headers.contains_key("retry-after") || down.json["retry_after"].is_u64()),
        "with the store unreadable, B's 413 says state {:?} (as if the key's record had been \
         read and found absent) and gives no Retry-After: {}",
        down.state(),
        down.body
    );
}

/// Attacks: `Execution.head` end to end: a route that guards HEAD (`methods([GET, HEAD])`),
/// axum answering the HEAD with the GET handler (`Content-Length: 5`, the GET body's, over no
/// body). Since 12fc824 the answer is recorded rather than taken for a cut body; the
/// `Content-Length` it stands for (RFC 9110 §9.3.2: a HEAD's header fields are the GET's) must
/// still reach the client, live and replayed, as it does with no layer, though the layer drops
/// `Content-Length` while recording and denies it on replays. DESIGN §1 step 9 (the live
/// response is the handler's) and §1 (replays return the original headers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guarded_heads_content_length_reaches_the_client_live_and_replayed() {
    let effects = Effects::default();
    let app = |effects: &Effects| {
        let effects = effects.clone();
        Router::new().route(
            "/r",
            get(move || {
                let effects = effects.clone();
                async move {
                    effects.hit();
                    "hello"
                }
            }),
        )
    };
    let bare = serve(app(&effects)).await;
    let guarded = serve(
        app(&effects).layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .methods([Method::GET, Method::HEAD]),
        ),
    )
    .await;
    let length = |a: &Answer| {
        a.headers
            .get("content-length")
            .map(|v| v.to_str().unwrap_or("?").to_owned())
    };
    let control = send(bare, Method::HEAD, "/r", None, "text/plain", "", &[]).await;
    assert_eq!(
        (control.status, length(&control).as_deref()),
        (200, Some("5")),
        "control, no layer: {control:?}"
    );
    let key = unique("head-length");
    let first = send(
        guarded,
        Method::HEAD,
        "/r",
        Some(&key),
        "text/plain",
        "",
        &[],
    )
    .await;
    let retry = send(
        guarded,
        Method::HEAD,
        "/r",
        Some(&key),
        "text/plain",
        "",
        &[],
    )
    .await;
    assert_eq!(
        effects.count(),
        2,
        "one run for the key (and the control's)"
    );
    assert_eq!(
        (
            first.status,
            length(&first).as_deref(),
            retry.status,
            retry.replayed(),
            length(&retry).as_deref()
        ),
        (200, Some("5"), 200, true, Some("5")),
        "a guarded HEAD's Content-Length (the GET's) is lost: live {:?}, replayed {:?}",
        first.headers,
        retry.headers
    );
}
