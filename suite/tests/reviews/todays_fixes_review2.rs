//! Second adversarial review of today's commits: the JSON-RPC text reading (`json_text`,
//! 948ba1e), the give-back of claims whose answers were lost twice (897f994), and the nested
//! layers' scope check (0f91450). Real sockets for every layer test (effects counted in the
//! handler, never from responses); store-level tests call the store directly. Each test names
//! the DESIGN § it probes.

use crate::common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::post;
use bytes::Bytes;
use common::raw::unique;
use common::{Effects, client, guard, jsonrpc_code, serve};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower_idempotency::jsonrpc::JsonRpc;
use tower_idempotency::store::{
    Claim, ClaimRequest, Fingerprint, LeaseExpiry, PostgresStore, RecordStatus, ScopedKey,
};
use tower_idempotency::{IdempotencyLayer, IdempotencyStore, MemoryStore};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn header_of(headers: &HeaderMap, name: &str) -> String {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

// ---- a lenient tool server ------------------------------------------------------------------

/// The tool: one effect per request that reaches it, whatever the body. It answers with the
/// bytes of `x-reply` (`{ID}` replaced by `x-id`), or, without one, a plain result to the id
/// in `x-id`. With `x-route-by-header` it routes by `Mcp-Method` (a 2026-07-28 server): only
/// `tools/call` has an effect.
async fn tool(State(effects): State<Effects>, headers: HeaderMap, _body: Bytes) -> Response {
    if header_of(&headers, "x-route-by-header") == "1"
        && header_of(&headers, "mcp-method") != "tools/call"
    {
        return Response::builder()
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(
                r#"{"jsonrpc":"2.0","id":1,"result":{"tools":[]}}"#,
            ))
            .expect("response");
    }
    let n = effects.hit();
    let id = match header_of(&headers, "x-id") {
        id if id.is_empty() => "1".to_owned(),
        id => id,
    };
    let reply = match header_of(&headers, "x-reply") {
        r if r.is_empty() => format!(
            r#"{{"jsonrpc":"2.0","id":{id},"result":{{"content":[{{"type":"text","text":"run {n}"}}]}}}}"#
        ),
        r => r.replace("{ID}", &id),
    };
    Response::builder()
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(reply))
        .expect("response")
}

async fn jsonrpc_server(jsonrpc: JsonRpc) -> (SocketAddr, Effects) {
    let effects = Effects::default();
    let app = Router::new()
        .route("/mcp", post(tool))
        .with_state(effects.clone())
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .jsonrpc(jsonrpc),
        );
    (serve(app).await, effects)
}

#[derive(Debug)]
struct Got {
    status: u16,
    replayed: bool,
    text: String,
}

async fn post_to(
    http: &reqwest::Client,
    addr: SocketAddr,
    headers: &[(&str, &str)],
    body: impl Into<Vec<u8>>,
) -> Got {
    let mut req = http
        .post(format!("http://{addr}/mcp"))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(body.into());
    for (name, value) in headers {
        req = req.header(
            HeaderName::from_bytes(name.as_bytes()).expect("name"),
            *value,
        );
    }
    let res = guard("a request", req.send()).await.expect("request");
    let status = res.status().as_u16();
    let replayed = res
        .headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let bytes = res.bytes().await.unwrap_or_default();
    Got {
        status,
        replayed,
        text: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

// =============================================================================================
// 1. A `_meta` key hidden from the "may hold a key" scan of unreadable bodies (§8: "A call
//    that carries a key but cannot be guarded (… a body the mode cannot read) is refused,
//    never run unguarded").
// =============================================================================================

/// DESIGN §8, README ("a keyed call with … a body the mode cannot read … is refused
/// (`call-unguardable`), never run unguarded"): on a route whose `meta_key` name holds a `/`
/// (MCP `_meta` names are reverse-DNS prefixed: `com.example/idempotency-key`), a call whose
/// body this mode cannot read (a member named twice at the top level, which `JSON.parse` and
/// serde_json's `Value` both read, the last winning) and whose key name is written with JSON's
/// `\/` escape neither contains the name's bytes nor a `\u` escape: the scan for "may hold a
/// key" misses it and the call passes through. Sent twice with one key, it must never run
/// twice. Both the single call and a batch item are tried; the same body without the
/// duplicate member is the control (guarded: one run, one replay).
#[tokio::test]
async fn s8_a_meta_key_name_written_with_an_escaped_slash_never_hides_a_keyed_call() {
    let name = "com.example/idempotency-key";
    let (addr, effects) = jsonrpc_server(JsonRpc::new().meta_key(name)).await;
    let http = client();

    // Control: readable, the escaped name is decoded, the call is guarded.
    let key = unique("slash-ok");
    let body = |id: u32, key: &str, dup: bool| {
        let dup = if dup {
            format!(r#""id":{id},"#)
        } else {
            String::new()
        };
        format!(
            r#"{{"jsonrpc":"2.0",{dup}"id":{id},"method":"tools/call","params":{{"name":"t","arguments":{{}},"_meta":{{"com.example\/idempotency-key":"{key}"}}}}}}"#
        )
    };
    let before = effects.count();
    let a = post_to(&http, addr, &[("x-id", "1")], body(1, &key, false)).await;
    let b = post_to(&http, addr, &[("x-id", "2")], body(2, &key, false)).await;
    assert_eq!(
        effects.count() - before,
        1,
        "control: guarded ({a:?} / {b:?})"
    );
    assert!(b.replayed, "control: the retry is a replay: {b:?}");

    // A member named twice: unreadable here, read by lenient servers.
    let mut outcomes = Vec::new();
    for (what, make) in [
        (
            "single call",
            Box::new(move |id: u32, key: &str| body(id, key, true))
                as Box<dyn Fn(u32, &str) -> String>,
        ),
        (
            "batch item",
            Box::new(move |id: u32, key: &str| format!("[{}]", body(id, key, true))),
        ),
    ] {
        let key = unique("slash-dup");
        let before = effects.count();
        let first = post_to(&http, addr, &[("x-id", "1")], make(1, &key)).await;
        let second = post_to(&http, addr, &[("x-id", "2")], make(2, &key)).await;
        let ran = effects.count() - before;
        outcomes.push(format!(
            "{what}: ran {ran} time(s); answers {} {} / {} {}",
            first.status,
            jsonrpc_code(&first.text),
            second.status,
            jsonrpc_code(&second.text)
        ));
    }
    assert!(
        outcomes.iter().all(|o| o.contains("ran 0 time(s)")),
        "a call keyed in params._meta (name escaped as `\\/`) whose body this mode cannot read \
         must be refused (-31009), never run unguarded: {outcomes:#?}"
    );
}

// =============================================================================================
// 2. Keyed bodies without a `method` (§8 and README: "bodies that are not JSON-RPC pass
//    through untouched, unless they carry a key"; "a keyed request whose `Mcp-Method` header
//    disagrees with its body is refused … whichever of the two is guarded").
// =============================================================================================

/// DESIGN §8 (MCP 2026-07-28: "the header decides"), README: a request with an
/// `Idempotency-Key` and `Mcp-Method: tools/call` whose body names no method (or a method that
/// is not a string) disagrees with its header; a server that routes by the header runs
/// `tools/call`. The layer must refuse it (it carries a key), never pass it through: sent twice
/// under one key it must not run twice.
#[tokio::test]
async fn s8_a_keyed_call_whose_body_names_no_method_is_never_run_unguarded() {
    let (addr, effects) = jsonrpc_server(JsonRpc::new()).await;
    let http = client();
    let mut outcomes = Vec::new();
    for (what, body) in [
        (
            "no method",
            r#"{"jsonrpc":"2.0","id":ID,"params":{"name":"t","arguments":{}}}"#,
        ),
        (
            "method null",
            r#"{"jsonrpc":"2.0","id":ID,"method":null,"params":{"name":"t","arguments":{}}}"#,
        ),
        (
            "method not a string",
            r#"{"jsonrpc":"2.0","id":ID,"method":["tools/call"],"params":{"name":"t","arguments":{}}}"#,
        ),
    ] {
        let key = unique("no-method");
        let before = effects.count();
        let mut codes = Vec::new();
        for id in ["1", "2"] {
            let got = post_to(
                &http,
                addr,
                &[
                    ("idempotency-key", &key),
                    ("mcp-method", "tools/call"),
                    ("mcp-protocol-version", "2026-07-28"),
                    ("x-route-by-header", "1"),
                    ("x-id", id),
                ],
                body.replace("ID", id),
            )
            .await;
            codes.push((got.status, jsonrpc_code(&got.text)));
        }
        outcomes.push((what, effects.count() - before, codes));
    }
    assert!(
        outcomes.iter().all(|(_, ran, _)| *ran == 0),
        "a keyed request (header key, Mcp-Method: tools/call) whose body names no method ran \
         unguarded: (case, runs, answers) {outcomes:?}"
    );
}

// =============================================================================================
// 3. Differential: answers read from their text classify as serde_json's reading does
//    (§8, §3; README: "JSON that serde_json's `Value` cannot hold … is read from its text,
//    recorded and replayed like any other").
// =============================================================================================

/// The id members a generated answer may carry (written as the server would), for a call
/// whose id is `7`.
const IDS: &[&str] = &[
    r#""id":7"#,
    r#""id":7.0"#,
    r#""id":"7""#,
    r#""id":8"#,
    r#""id":null"#,
    r#""\u0069d":7"#,
    r#""i\u0064":7e0"#,
    r#""id":8,"id":7"#,
    r#""id":7,"id":8"#,
    r#""id":7,"id":null"#,
];

/// The rest of a generated answer.
const BODIES: &[&str] = &[
    r#""result":{}"#,
    r#""r\u0065sult":{"content":[]}"#,
    r#""result":{"resultType":"input_required"}"#,
    r#""result":{"resultT\u0079pe":"input_required"}"#,
    r#""result":{"resultType":"input_required","resultType":"complete"}"#,
    r#""result":{"resultType":"complete","resultType":"input_required"}"#,
    r#""result":{"resultType":"input\u005frequired"}"#,
    r#""result":[]"#,
    r#""result":null"#,
    r#""error":{"code":-32603,"message":"x"}"#,
    r#""error":{"code":-32602,"message":"x"}"#,
    r#""error":{"co\u0064e":-32001,"message":"x"}"#,
    r#""error":{"code":-32602,"code":-32603}"#,
    r#""error":{"code":-32603,"code":-32602}"#,
    r#""error":{"code":-32603.0}"#,
    r#""error":null"#,
    r#""result":{},"error":{"code":-32603}"#,
    r#""error":{"code":-32602},"result":{"resultType":"input_required"}"#,
    r#""jsonrpc":"2.0""#,
];

/// What the layer made of one answer: how many runs two calls under one key took, and whether
/// the second was a replay (and with which status).
async fn classify(
    http: &reqwest::Client,
    addr: SocketAddr,
    effects: &Effects,
    reply: &str,
) -> (usize, bool, u16, i64) {
    let key = unique("diff");
    let before = effects.count();
    let call = |id: &str| {
        format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"t","arguments":{{"k":"{key}"}}}}}}"#
        )
    };
    let _first = post_to(
        http,
        addr,
        &[("idempotency-key", &key), ("x-reply", reply), ("x-id", "7")],
        call("7"),
    )
    .await;
    // The retry's answer (if it runs) is a plain final result.
    let second = post_to(
        http,
        addr,
        &[("idempotency-key", &key), ("x-id", "9")],
        call("9"),
    )
    .await;
    (
        effects.count() - before,
        second.replayed,
        second.status,
        jsonrpc_code(&second.text),
    )
}

/// DESIGN §8 / §3: for every generated answer serde_json CAN read (escaped member names, ids
/// spelled every way, members given twice, interim and error results), the same answer made
/// unreadable to serde_json's `Value` by one unrelated member (a lone surrogate escape, first
/// or last; or a number beyond a double) must be classified alike by the layer: recorded and
/// replayed, or given back, the same number of runs. A difference is the text path reading
/// an answer otherwise than serde_json (a second run, or a key kept for an interim answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s8_answers_read_from_their_text_classify_as_serde_json_reads_them() {
    let (addr, effects) = jsonrpc_server(JsonRpc::new()).await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client");
    let mut differences = Vec::new();
    let mut checked = 0;
    let mut kinds = std::collections::BTreeSet::new();
    for id in IDS {
        for body in BODIES {
            let readable = format!(r#"{{{id},{body}}}"#);
            assert!(
                serde_json::from_str::<Value>(&readable).is_ok(),
                "{readable}"
            );
            let odd = [
                format!(r#"{{"zz":"\ud800",{id},{body}}}"#),
                format!(r#"{{{id},{body},"zz":[1e400]}}"#),
            ];
            let expected = classify(&http, addr, &effects, &readable).await;
            kinds.insert((expected.0, expected.1));
            for odd in odd {
                assert!(serde_json::from_str::<Value>(&odd).is_err(), "{odd}");
                let got = classify(&http, addr, &effects, &odd).await;
                checked += 1;
                if got != expected {
                    differences.push(format!(
                        "{odd}\n   text path (runs, replayed, status, code) {got:?} vs serde_json \
                         path {expected:?} for {readable}"
                    ));
                }
            }
        }
    }
    assert!(checked > 300, "{checked}");
    // Not vacuous: the generated answers are recorded and replayed, and given back.
    assert!(
        kinds.contains(&(1, true)) && kinds.contains(&(2, false)),
        "{kinds:?}"
    );
    assert!(
        differences.is_empty(),
        "{} of {checked} answers read from their text were classified otherwise than \
         serde_json reads them:\n{}",
        differences.len(),
        differences.join("\n")
    );
}

/// README (JSON-RPC): an answer that is not JSON, "or JSON that is not the call's response
/// … under a success status it is taken as done (-31007 to retries), never run again". A 200
/// whose body is garbled and one whose body is JSON yet not an object (a bare string, `null`,
/// an array holding the very response) are classified alike: one run, retries told
/// -31007. (Before session 32 the JSON ones gave the key back and the retry ran the tool
/// again: the less readable answer was the safer one.)
#[tokio::test]
async fn s8_a_json_answer_that_is_not_an_object_is_taken_as_done() {
    let (addr, effects) = jsonrpc_server(JsonRpc::new()).await;
    let http = client();
    let garbled = classify(&http, addr, &effects, "<html>ok</html>").await;
    assert_eq!(garbled.0, 1, "garbled: taken as done {garbled:?}");
    assert_eq!(
        garbled.3, -31007,
        "garbled: response-not-stored {garbled:?}"
    );
    for reply in [
        r#""done""#,
        "null",
        r#"[{"jsonrpc":"2.0","id":{ID},"result":{}}]"#,
    ] {
        let got = classify(&http, addr, &effects, reply).await;
        assert_eq!(got.0, 1, "{reply}: taken as done {got:?}");
        assert_eq!(got.3, -31007, "{reply}: response-not-stored {got:?}");
    }
}

// =============================================================================================
// 4. Nested layers and their scopes (README: "Their scopes must agree: where the inner layer's
//    scope for the request is not the outer's … the inner one answers 500 `scope-missing` and
//    nothing runs"; DESIGN §1 step 2: "Two principals using the same key can never see each
//    other's records or responses").
// =============================================================================================

#[derive(Clone)]
struct User(String);

/// The auth layer: the principal from `x-user`, percent-decoded (as a token's claim may hold
/// any text, a NUL too).
async fn auth(mut req: Request, next: Next) -> Response {
    if let Some(user) = req.headers().get("x-user").and_then(|v| v.to_str().ok()) {
        let decoded = percent_decode(user);
        req.extensions_mut().insert(User(decoded));
    }
    next.run(req).await
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Ok(b) = u8::from_str_radix(&text[i + 1..i + 3], 16)
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8(out).expect("utf-8")
}

/// The HTTP tool: one effect per run, answering with the principal it ran for.
async fn whose(State(effects): State<Effects>, req: Request) -> Response {
    let user = req
        .extensions()
        .get::<User>()
        .map(|u| u.0.replace('\0', "\\0"))
        .unwrap_or_default();
    let n = effects.hit();
    Response::builder()
        .status(StatusCode::CREATED)
        .body(Body::from(format!("ran {n} for {user}")))
        .expect("response")
}

/// README (nested layers), DESIGN §1 step 2: an outer layer whose scope is a fixed composite
/// text holding a NUL (`scope_with(|_| "shared\0v1")`, a separator many write between the parts
/// of a scope) over a route layer scoped per principal (`scope_with` of the principal). For
/// principal `shared` the inner scope (`custom:shared`) is a prefix of the outer's up to the
/// NUL, which the check takes for a JSON-RPC method suffix, so it agrees; for principal
/// `shared\0v1` the two are equal. The two principals then share the outer's claim: one must
/// never be replayed the other's answer.
#[tokio::test]
async fn s1_2_nested_scopes_that_differ_are_never_taken_for_a_method_suffix() {
    let effects = Effects::default();
    let app = Router::new()
        .route("/t", post(whose))
        .with_state(effects.clone())
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).scope_with(
            |parts: &http::request::Parts| parts.extensions.get::<User>().map(|u| u.0.clone()),
        ))
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .scope_with(|_: &http::request::Parts| "shared\0v1".to_owned()),
        )
        .layer(middleware::from_fn(auth));
    let addr = serve(app).await;
    let http = client();
    let mut answers = Vec::new();
    for user in ["shared", "shared%00v1"] {
        let res = http
            .post(format!("http://{addr}/t"))
            .header("idempotency-key", "one-key")
            .header("x-user", user)
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .expect("request");
        let status = res.status().as_u16();
        let replayed = res
            .headers()
            .get("idempotency-replayed")
            .is_some_and(|v| v == "true");
        answers.push((user, status, replayed, res.text().await.unwrap_or_default()));
    }
    let crossed = answers.iter().any(|(user, _, replayed, text)| {
        *user == "shared%00v1" && *replayed && text.ends_with("for shared")
    });
    assert!(
        !crossed,
        "principal `shared\\0v1` was replayed principal `shared`'s answer through nested layers \
         whose scopes differ (outer `custom:shared\\0v1`, inner `custom:shared`): {answers:?}"
    );
}

/// README (nested layers): layers that agree pass through as before; in JSON-RPC mode the
/// outer's scope is `scope\0method`. Two JSON-RPC layers scoped by the same principal: one run
/// per principal and key, each replayed its own; an outer `single_tenant()` JSON-RPC layer over
/// a principal-scoped JSON-RPC route answers 500 scope-missing (-31008), nothing runs, and the
/// key is not stranded by the refusal (the outer gives it back: the same key runs on a mended
/// app sharing the outer store).
#[tokio::test]
async fn s1_2_nested_jsonrpc_layers_agreeing_run_once_and_disagreeing_refuse() {
    let http = client();
    let call = |id: u32| {
        format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"t","arguments":{{}}}}}}"#
        )
    };
    // Agreeing.
    let effects = Effects::default();
    let scoped = || {
        IdempotencyLayer::new(MemoryStore::new())
            .scope_by_principal(|u: &User| u.0.clone())
            .jsonrpc(JsonRpc::new())
    };
    let app = Router::new()
        .route("/mcp", post(tool))
        .with_state(effects.clone())
        .route_layer(scoped())
        .layer(scoped())
        .layer(middleware::from_fn(auth));
    let addr = serve(app).await;
    let mut got = Vec::new();
    for (user, id) in [("alice", 1), ("bob", 2), ("alice", 3), ("bob", 4)] {
        let g = post_to(
            &http,
            addr,
            &[
                ("idempotency-key", "nk"),
                ("x-user", user),
                ("x-id", &id.to_string()),
            ],
            call(id),
        )
        .await;
        got.push(g);
    }
    assert_eq!(effects.count(), 2, "{got:#?}");
    assert!(got[2].replayed && got[3].replayed, "{got:#?}");
    assert!(got.iter().all(|g| g.status == 200), "{got:#?}");

    // Disagreeing: the outer single-tenant JSON-RPC layer, sharing its store with a mended app.
    let outer_store = MemoryStore::new();
    let effects = Effects::default();
    let app = Router::new()
        .route("/mcp", post(tool))
        .with_state(effects.clone())
        .route_layer(
            IdempotencyLayer::new(MemoryStore::new())
                .scope_by_principal(|u: &User| u.0.clone())
                .jsonrpc(JsonRpc::new()),
        )
        .layer(
            IdempotencyLayer::new(outer_store.clone())
                .single_tenant()
                .jsonrpc(JsonRpc::new()),
        )
        .layer(middleware::from_fn(auth));
    let addr = serve(app).await;
    for (user, id) in [("alice", 1), ("bob", 2)] {
        let g = post_to(
            &http,
            addr,
            &[
                ("idempotency-key", "dk"),
                ("x-user", user),
                ("x-id", &id.to_string()),
            ],
            call(id),
        )
        .await;
        assert_eq!(g.status, 500, "{user}: {g:?}");
        assert_eq!(jsonrpc_code(&g.text), -31008, "{user}: {g:?}");
    }
    assert_eq!(effects.count(), 0, "nothing ran");
    let mended_effects = Effects::default();
    let mended = Router::new()
        .route("/mcp", post(tool))
        .with_state(mended_effects.clone())
        .layer(
            IdempotencyLayer::new(outer_store)
                .single_tenant()
                .jsonrpc(JsonRpc::new()),
        );
    let addr = serve(mended).await;
    let g = post_to(
        &http,
        addr,
        &[("idempotency-key", "dk"), ("x-id", "5")],
        call(5),
    )
    .await;
    assert_eq!(g.status, 200, "the refused key was given back: {g:?}");
    assert_eq!(mended_effects.count(), 1, "{g:?}");
}

// =============================================================================================
// 5. A claim given back after its answers were lost twice, landing after the give-back
//    (PostgreSQL; DESIGN §5, §4; README: "the client hangs up while the claim is in flight |
//    … since nothing ran, the key is given back"; commit 897f994: "What may have landed is now
//    released").
// =============================================================================================

/// A PostgreSQL proxy that, armed, holds back the client's bytes that carry the claim's
/// Execute (after its statement was prepared), closes the client's side at once (the store
/// hears a broken connection: its answer lost), and hands the held bytes to the server only
/// after `delay`: a statement the database ran late, after the client gave up on it (a backend
/// slow to read its socket, or waiting on a lock).
#[derive(Clone)]
struct LateForward {
    addr: SocketAddr,
    /// How many more claims to hold, and for how long.
    armed: Arc<Mutex<(usize, Duration)>>,
    held: Arc<AtomicUsize>,
    landed: Arc<AtomicUsize>,
}

impl LateForward {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let proxy = Self {
            addr: listener.local_addr().expect("addr"),
            armed: Arc::new(Mutex::new((0, Duration::ZERO))),
            held: Arc::default(),
            landed: Arc::default(),
        };
        let p = proxy.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                tokio::spawn(p.clone().relay(client, server));
            }
        });
        proxy
    }

    fn arm(&self, times: usize, delay: Duration) {
        *self.armed.lock().expect("lock") = (times, delay);
    }

    async fn relay(self, client: TcpStream, server: TcpStream) {
        let (mut client_r, client_w) = client.into_split();
        let (mut server_r, mut server_w) = server.into_split();
        let client_w = Arc::new(tokio::sync::Mutex::new(Some(client_w)))
            as Arc<tokio::sync::Mutex<Option<tokio::net::tcp::OwnedWriteHalf>>>;
        let down_w = client_w.clone();
        let downstream = async move {
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                let n = match server_r.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                let mut w = down_w.lock().await;
                match w.as_mut() {
                    Some(w) => {
                        if w.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    // Cut: the server's replies go nowhere.
                    None => continue,
                }
            }
        };
        let (armed, held, landed) = (self.armed.clone(), self.held.clone(), self.landed.clone());
        let upstream = async move {
            let mut buf = vec![0u8; 16 * 1024];
            let mut pending: Vec<u8> = Vec::new();
            let mut started = false;
            let mut parsed_claim = false;
            loop {
                let n = match client_r.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                pending.extend_from_slice(&buf[..n]);
                let mut hold = None;
                loop {
                    if !started {
                        if pending.len() < 8 {
                            break;
                        }
                        let len = u32::from_be_bytes(pending[..4].try_into().expect("4")) as usize;
                        if pending.len() < len {
                            break;
                        }
                        let code = u32::from_be_bytes(pending[4..8].try_into().expect("4"));
                        started = code != 80877103 && code != 80877104;
                        pending.drain(..len);
                        continue;
                    }
                    if pending.len() < 5 {
                        break;
                    }
                    let len = u32::from_be_bytes(pending[1..5].try_into().expect("4")) as usize;
                    if pending.len() < 1 + len {
                        break;
                    }
                    let message: Vec<u8> = pending.drain(..1 + len).collect();
                    if message[0] == b'P'
                        && message
                            .windows(PG_CLAIM_TEXT.len())
                            .any(|w| w == PG_CLAIM_TEXT)
                    {
                        parsed_claim = true;
                    }
                    if message[0] == b'E' && parsed_claim {
                        let mut armed = armed.lock().expect("lock");
                        if armed.0 > 0 {
                            armed.0 -= 1;
                            hold = Some(armed.1);
                        }
                    }
                }
                if let Some(delay) = hold {
                    held.fetch_add(1, Ordering::SeqCst);
                    // The client hears a broken connection now…
                    if let Some(mut w) = client_w.lock().await.take() {
                        let _ = w.shutdown().await;
                    }
                    // …and the database gets the statement later.
                    tokio::time::sleep(delay).await;
                    let _ = server_w.write_all(&buf[..n]).await;
                    landed.fetch_add(1, Ordering::SeqCst);
                    // Keep the server's side open while it runs the statement.
                    tokio::time::sleep(ms(2000)).await;
                    return;
                }
                if server_w.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        };
        tokio::join!(upstream, downstream);
    }
}

const PG_TABLE: &str = "tower_idempotency_todays_review2";
const PG_CLAIM_TEXT: &[u8] = b"AS r (scope, key, fingerprint, status";

/// DESIGN §4/§5, README ("the client hangs up while the claim is in flight | … since nothing
/// ran, the key is given back"; "Only reconciliation work is listed"), commit 897f994: a claim
/// whose answer is lost twice is refused and "what may have landed is given back". Here both
/// sendings of the claim reach the database only after the store gave up on them and its
/// give-back found nothing to release (the statements ran late: a backend slow to read them).
/// The request was refused and ran nothing, so on a route that reconciles expired leases its
/// key must not end `needs_reconciliation` ("outcome unknown" for a request that never ran)
/// once the late claim's lease runs out: the next claim of the same request must run it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_postgres_a_claim_landing_after_its_give_back_never_strands_the_key() {
    let Some(direct) = common::postgres(PG_TABLE).await else {
        return;
    };
    let options: sqlx::postgres::PgConnectOptions =
        common::postgres_url().parse().expect("postgres url");
    let upstream = tokio::net::lookup_host((options.get_host(), options.get_port()))
        .await
        .expect("resolve")
        .next()
        .expect("an address");
    let proxy = LateForward::start(upstream).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(3)
        .acquire_timeout(Duration::from_secs(3))
        .connect_with(options.host("127.0.0.1").port(proxy.addr.port()))
        .await
        .expect("connect through the proxy");
    let through = PostgresStore::new(pool)
        .with_table(PG_TABLE)
        .expect("table");
    let key = ScopedKey::new(unique("pg-late-give-back"), "k");
    let request = ClaimRequest {
        key: key.clone(),
        fingerprint: Fingerprint::from_bytes([7; 32]),
        lease: ms(1500),
        ttl: Duration::from_secs(60),
        on_lease_expiry: LeaseExpiry::Reconcile,
    };
    proxy.arm(2, ms(700));
    let claimed = guard("the claim", through.claim(&request)).await;
    assert!(
        claimed.is_err(),
        "both answers lost: the claim is refused ({claimed:?})"
    );
    assert_eq!(proxy.held.load(Ordering::SeqCst), 2, "both sendings held");
    // The give-back runs at once (nothing there yet); then the held claims land.
    common::until("the held claims land", || {
        proxy.landed.load(Ordering::SeqCst) == 2
    })
    .await;
    tokio::time::sleep(ms(400)).await;
    let landed = direct.lookup(&key).await.expect("lookup");
    // Past the late claim's lease, the same request claims again.
    tokio::time::sleep(ms(1700)).await;
    let again = direct.claim(&request).await.expect("claim");
    let record = direct.lookup(&key).await.expect("lookup");
    let status = record.as_ref().map(|r| r.status);
    assert!(
        matches!(again, Claim::Acquired(_)),
        "a request refused 503 that ran nothing left its key {:?} (after landing: {:?}); the \
         next claim of the same request got {}",
        status,
        landed.as_ref().map(|r| r.status),
        match &again {
            Claim::Acquired(_) => "acquired".to_owned(),
            Claim::Completed { .. } => "completed".to_owned(),
            Claim::Existing { record, .. } => format!("existing {:?}", record.status),
        }
    );
    assert_ne!(status, Some(RecordStatus::NeedsReconciliation));
}
