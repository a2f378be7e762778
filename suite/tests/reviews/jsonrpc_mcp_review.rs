//! Review of the JSON-RPC / MCP mode (DESIGN §8, with §1 steps 1–6, §2 scope, §3 outcomes,
//! §4 fingerprint) against the fingerprint changes of session 30 (coded bodies hashed as sent,
//! request trailers hashed, lone surrogate escapes accepted and hashed as sent), which were
//! attacked for plain HTTP only. Over real sockets; effects counted in the handler (the sink),
//! never from responses.
//!
//! The tool server here is a lenient one, as a JavaScript server (`JSON.parse`) or a server
//! behind a request-decompression layer is: it runs every call that reaches it, reading its id
//! from the text, so a call the layer lets through unguarded shows up as a second effect.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, header};
use axum::response::Response;
use axum::routing::post;
use bytes::Bytes;
use common::raw::unique;
use common::{Effects, client, gunzip, gzip, jsonrpc_code, serve};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};
use serde_json::{Value, json};
use tower_idempotency::jsonrpc::JsonRpc;
use tower_idempotency::{IdempotencyLayer, IdempotencyStore, MemoryStore};

// ---- the tool server -------------------------------------------------------------------------

/// The id's text in a body written `{"jsonrpc":"2.0","id":ID,"method":...}` (how every call
/// in this file is written), as a lenient server reads it.
fn id_text(text: &str) -> Option<String> {
    let at = text.find(r#""id":"#)? + 5;
    let rest = &text[at..];
    let end = rest.find(r#","method""#)?;
    Some(rest[..end].to_owned())
}

/// `depth` nested arrays around `inner`.
fn nested(depth: usize, inner: &str) -> String {
    format!("{}{inner}{}", "[".repeat(depth), "]".repeat(depth))
}

/// The call's final response as a server writes it, per `x-answer`.
fn answer(mode: &str, id: &str, n: usize) -> (&'static str, Vec<u8>) {
    let plain = |result: String| format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{result}}}"#);
    let text = |t: &str| format!(r#"{{"content":[{{"type":"text","text":"{t}"}}]}}"#);
    let sse = "text/event-stream";
    let json = "application/json";
    let progress = r#"{"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken":1,"progress":1}}"#;
    match mode {
        // A JavaScript server that cut a tool's text at a UTF-16 boundary: `JSON.stringify`
        // writes the lone half as an escape (ES2019 well-formed stringify).
        "surrogate" => (json, plain(text(&format!("run {n} \\ud83d"))).into_bytes()),
        "sse-surrogate" => (
            sse,
            format!("data: {}\n\n", plain(text(&format!("run {n} \\ud83d")))).into_bytes(),
        ),
        // A number beyond a double's range in structured content (valid JSON, RFC 8259 §6).
        "big" => (
            json,
            plain(format!(
                r#"{{"content":[],"structuredContent":{{"v":1e400,"n":{n}}}}}"#
            ))
            .into_bytes(),
        ),
        // A deep tree in structured content (140 levels; serde_json reads 128).
        "deep" => (
            json,
            plain(format!(
                r#"{{"content":[],"structuredContent":{{"tree":{},"n":{n}}}}}"#,
                nested(140, "1")
            ))
            .into_bytes(),
        ),
        // A server that starts its JSON with a byte-order mark (RFC 8259 §8.1: a reader MAY
        // ignore it).
        "bom" => (json, {
            let mut b = "\u{feff}".as_bytes().to_vec();
            b.extend(plain(text(&format!("run {n}"))).into_bytes());
            b
        }),
        // The response event cut short and the stream ended (cleanly).
        "sse-cut" => (
            sse,
            format!(
                "data: {progress}\n\ndata: {{\"jsonrpc\":\"2.0\",\"id\":{id},\"result\":{{\"content\":[{{\"type\":\"text\",\"text\":\"par"
            )
            .into_bytes(),
        ),
        // The id written last, and an inner `id` in the result that is not the call's.
        "inner-id" => (
            json,
            format!(r#"{{"jsonrpc":"2.0","result":{{"id":"inner","n":{n},"amount":10.50}},"id":{id}}}"#)
                .into_bytes(),
        ),
        _ => (json, plain(text(&format!("run {n}"))).into_bytes()),
    }
}

fn header_of(headers: &HeaderMap, name: &str) -> String {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// The tool: one effect per request that reaches it. A gzip body is decompressed first, as a
/// `RequestDecompressionLayer` inside the idempotency layer would. It answers under the id it
/// read from the text (or `x-write-id`), as `x-answer` says; with `x-route-by-header`, it
/// routes by the `Mcp-Method` header as a 2026-07-28 server may, answering `tools/list` with no
/// effect.
async fn tool(State(effects): State<Effects>, headers: HeaderMap, body: Bytes) -> Response {
    let coded = header_of(&headers, "content-encoding").eq_ignore_ascii_case("gzip");
    let body = if coded { gunzip(&body) } else { body.to_vec() };
    let text = String::from_utf8_lossy(&body).into_owned();
    if header_of(&headers, "x-route-by-header") == "1"
        && header_of(&headers, "mcp-method") != "tools/call"
    {
        let id = id_text(&text).unwrap_or_else(|| "null".into());
        return Response::builder()
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(format!(
                r#"{{"jsonrpc":"2.0","id":{id},"result":{{"tools":[]}}}}"#
            )))
            .expect("response");
    }
    let n = effects.hit();
    let id = match header_of(&headers, "x-write-id") {
        written if !written.is_empty() => written,
        _ => id_text(&text).unwrap_or_else(|| "null".into()),
    };
    let (content_type, bytes) = answer(&header_of(&headers, "x-answer"), &id, n);
    Response::builder()
        .header(header::CONTENT_TYPE, content_type)
        .body(Body::from(bytes))
        .expect("response")
}

async fn server_on<St: IdempotencyStore>(store: St, jsonrpc: JsonRpc) -> (SocketAddr, Effects) {
    let effects = Effects::default();
    let app = Router::new()
        .route("/mcp", post(tool))
        .with_state(effects.clone())
        .layer(
            IdempotencyLayer::new(store)
                .single_tenant()
                .jsonrpc(jsonrpc),
        );
    (serve(app).await, effects)
}

async fn server(jsonrpc: JsonRpc) -> (SocketAddr, Effects) {
    server_on(MemoryStore::new(), jsonrpc).await
}

fn meta() -> JsonRpc {
    JsonRpc::new().meta_key("idempotencyKey")
}

// ---- the client ------------------------------------------------------------------------------

#[derive(Debug)]
struct Got {
    status: u16,
    replayed: bool,
    content_type: String,
    text: String,
}

impl Got {
    fn code(&self) -> i64 {
        jsonrpc_code(&self.text)
    }
}

async fn post_to(addr: SocketAddr, headers: &[(&str, &str)], body: impl Into<Vec<u8>>) -> Got {
    let mut req = client()
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
    let res = req.send().await.expect("request");
    let status = res.status().as_u16();
    let replayed = res
        .headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let content_type = res
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let bytes = res.bytes().await.unwrap_or_default();
    Got {
        status,
        replayed,
        content_type,
        text: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

/// A `tools/call` written `{"jsonrpc":"2.0","id":ID,"method":"tools/call","params":PARAMS}`.
fn call(id: &str, params: &str) -> String {
    format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{params}}}"#)
}

/// `tools/call` params for tool `t` with `args`, a progress token, and a `_meta` key if given.
fn params(args: &str, progress: &str, key: Option<&str>) -> String {
    let key = key.map_or(String::new(), |k| format!(r#","idempotencyKey":"{k}""#));
    format!(r#"{{"name":"t","arguments":{args},"_meta":{{"progressToken":"{progress}"{key}}}}}"#)
}

// =============================================================================================
// 1. A keyed call is never run unguarded (§8: "A call that carries a key but cannot be guarded
//    ... is refused, never run unguarded"; module docs: "a body that cannot be parsed but may
//    hold the key, is refused too").
// =============================================================================================

/// DESIGN §8 / §1 step 1: a call keyed only in `params._meta` whose arguments hold a value
/// serde_json's `Value` cannot hold (a lone surrogate escape, accepted since session 30; a
/// number beyond a double's range; nesting past 128) is still a keyed call. Sent twice with one
/// key it must run at most once (replayed or refused), never twice.
#[tokio::test]
async fn s8_meta_keyed_call_with_unusual_arguments_is_never_run_unguarded() {
    let (addr, effects) = server(meta()).await;
    let mut ran_twice = Vec::new();
    for (name, args) in [
        ("lone surrogate", r#"{"title":"a\ud800b"}"#.to_owned()),
        ("number beyond a double", r#"{"amount":1e400}"#.to_owned()),
        (
            "nesting 130 deep",
            format!(r#"{{"tree":{}}}"#, nested(130, "1")),
        ),
        (
            "control: plain arguments",
            r#"{"title":"plain"}"#.to_owned(),
        ),
    ] {
        let key = unique("meta-odd");
        let before = effects.count();
        let mut answers = Vec::new();
        for attempt in 0..2 {
            let body = call(
                &format!("{}", attempt + 1),
                &params(&args, &format!("p{attempt}"), Some(&key)),
            );
            answers.push(post_to(addr, &[], body).await);
        }
        let runs = effects.count() - before;
        if runs > 1 {
            ran_twice.push(format!(
                "{name}: {runs} runs; answers {:?}",
                answers
                    .iter()
                    .map(|g| (g.status, g.replayed, g.code()))
                    .collect::<Vec<_>>()
            ));
        }
    }
    assert!(
        ran_twice.is_empty(),
        "a _meta-keyed call ran twice under one key: {ran_twice:#?}"
    );
}

/// DESIGN §8 and README "Compression" (a compressed request is fingerprinted as sent; a keyed
/// body the mode cannot read is refused): a gzip request keyed only in `params._meta`, behind a
/// server that decompresses requests inside the layer, must never run twice under one key.
/// With the key in the header it is refused (`call-unguardable`), nothing run.
#[tokio::test]
async fn s8_a_gzip_call_keyed_in_meta_is_never_run_unguarded() {
    let (addr, effects) = server(meta()).await;
    // Header-keyed: refused, nothing run (a body the mode cannot read).
    let key = unique("gz-header");
    let plain = call("1", &params(r#"{"title":"x"}"#, "p", None));
    let got = post_to(
        addr,
        &[("idempotency-key", &key), ("content-encoding", "gzip")],
        gzip(plain.as_bytes()),
    )
    .await;
    assert_eq!((got.status, got.code()), (400, -31009), "{got:?}");
    assert_eq!(effects.count(), 0, "a header-keyed gzip call is refused");

    // `Content-Encoding: identity` is no coding: the same call, replayed.
    let key = unique("identity");
    let first = post_to(
        addr,
        &[("idempotency-key", &key), ("content-encoding", "identity")],
        plain.clone(),
    )
    .await;
    let retry = post_to(addr, &[("idempotency-key", &key)], plain.clone()).await;
    assert_eq!(first.status, 200, "{first:?}");
    assert!(retry.replayed, "identity is no coding: {retry:?}");
    assert_eq!(effects.count(), 1);

    // Keyed in `_meta` only.
    let key = unique("gz-meta");
    let before = effects.count();
    let mut answers = Vec::new();
    for attempt in 0..2 {
        let body = call(
            &format!("{}", attempt + 1),
            &params(r#"{"title":"x"}"#, "p", Some(&key)),
        );
        answers.push(post_to(addr, &[("content-encoding", "gzip")], gzip(body.as_bytes())).await);
    }
    assert!(
        effects.count() - before <= 1,
        "a gzip tools/call keyed in params._meta ran {} times under one key: {:?}",
        effects.count() - before,
        answers
            .iter()
            .map(|g| (g.status, g.replayed, g.code()))
            .collect::<Vec<_>>()
    );
}

/// README (JSON-RPC): "On MCP 2026-07-28, a keyed request whose `Mcp-Method` header disagrees
/// with its body is refused with MCP's `HeaderMismatchError` (-32020)" — also when the header
/// names the guarded method and the body an unguarded one. A server that routes by the header
/// (DESIGN §8: "the header decides") would run the tool unguarded on every retry.
#[tokio::test]
async fn s8_a_guarded_mcp_method_header_over_an_unguarded_body_is_refused() {
    let (addr, effects) = server(JsonRpc::new()).await;
    let key = unique("hdr-mismatch");
    let mut answers = Vec::new();
    for attempt in 0..2 {
        let body = format!(
            r#"{{"jsonrpc":"2.0","id":{},"method":"tools/list","params":{{"name":"t","arguments":{{}}}}}}"#,
            attempt + 1
        );
        answers.push(
            post_to(
                addr,
                &[
                    ("idempotency-key", &key),
                    ("mcp-method", "tools/call"),
                    ("mcp-name", "t"),
                    ("x-route-by-header", "1"),
                ],
                body,
            )
            .await,
        );
    }
    let codes: Vec<(u16, i64)> = answers.iter().map(|g| (g.status, g.code())).collect();
    assert_eq!(
        (effects.count(), codes.clone()),
        (0, vec![(400, -32020), (400, -32020)]),
        "header tools/call, body tools/list, keyed: {answers:?}"
    );
}

/// DESIGN §8 ("a batch ... is refused, never run unguarded"): a batch item that is a guarded
/// call keyed in `_meta` is refused even when the layer cannot read the item itself (a member
/// given twice, as the single-request path refuses; a lone surrogate in its arguments).
/// A lenient server (JavaScript, last member wins) runs it.
#[tokio::test]
async fn s8_batch_items_carrying_a_meta_key_are_refused_even_when_odd() {
    let (addr, effects) = server(meta()).await;
    let mut ran = Vec::new();
    for (name, item) in [
        (
            "id given twice",
            r#"{"jsonrpc":"2.0","id":1,"id":1,"method":"tools/call","params":{"name":"t","_meta":{"idempotencyKey":"KEY"}}}"#,
        ),
        (
            "lone surrogate in arguments",
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t","arguments":{"s":"\ud800"},"_meta":{"idempotencyKey":"KEY"}}}"#,
        ),
        (
            "control: plain item",
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t","_meta":{"idempotencyKey":"KEY"}}}"#,
        ),
    ] {
        let key = unique("batch-odd");
        let body = format!(
            r#"[{{"jsonrpc":"2.0","method":"notifications/initialized"}},{}]"#,
            item.replace("KEY", &key)
        );
        let before = effects.count();
        let got = post_to(addr, &[], body).await;
        if effects.count() != before || got.code() != -31009 {
            ran.push(format!(
                "{name}: ran {} time(s), answer {} {}",
                effects.count() - before,
                got.status,
                got.text
            ));
        }
    }
    assert!(
        ran.is_empty(),
        "a keyed batch item reached the server unguarded: {ran:#?}"
    );
}

// =============================================================================================
// 2. A call the server answered is never run again (§3: once the handler answered, the effect
//    is done; §8: "the outcome recorded is the call's final JSON-RPC response, as the bytes the
//    server wrote").
// =============================================================================================

/// Runs `mode` twice under one key; the number of runs and the two answers.
async fn twice(addr: SocketAddr, effects: &Effects, mode: &str) -> (usize, Got, Got) {
    let key = unique(mode);
    let before = effects.count();
    let first = post_to(
        addr,
        &[("idempotency-key", &key), ("x-answer", mode)],
        call("1", &params(r#"{"title":"x"}"#, "a", None)),
    )
    .await;
    let retry = post_to(
        addr,
        &[("idempotency-key", &key), ("x-answer", mode)],
        call("2", &params(r#"{"title":"x"}"#, "b", None)),
    )
    .await;
    (effects.count() - before, first, retry)
}

/// DESIGN §3/§8, §7.1: a final JSON response whose bytes are valid JSON that serde_json's
/// `Value` does not hold (a lone surrogate escape written by `JSON.stringify`, a number beyond
/// a double, a tree deeper than 128), or that starts with a byte-order mark, is still the
/// call's answer: the tool ran. A retry under the same key must not run it again.
#[tokio::test]
async fn s3_a_final_answer_with_unusual_json_is_never_run_again() {
    let (addr, effects) = server(JsonRpc::new()).await;
    let mut twice_run = Vec::new();
    for mode in ["surrogate", "big", "deep", "bom", "sse-surrogate", "plain"] {
        let (runs, first, retry) = twice(addr, &effects, mode).await;
        assert_eq!(first.status, 200, "{mode}: {first:?}");
        if runs != 1 {
            twice_run.push(format!(
                "{mode}: {runs} runs; retry {} replayed={} code={} {}",
                retry.status,
                retry.replayed,
                retry.code(),
                &retry.text[..retry.text.len().min(160)]
            ));
        }
    }
    assert!(
        twice_run.is_empty(),
        "an answered call ran again under its key: {twice_run:#?}"
    );
}

/// DESIGN §8: "A stream that ends without the response ... under a success status means the
/// server took the call ... retries get `response-not-stored` (-31007) ..., never a second
/// run." An event whose data is cut mid-JSON is not a response: never recorded as complete,
/// never replayed as truncated bytes.
#[tokio::test]
async fn s8_an_sse_answer_cut_mid_event_is_not_recorded_as_complete() {
    let (addr, effects) = server(JsonRpc::new()).await;
    let (runs, first, retry) = twice(addr, &effects, "sse-cut").await;
    assert_eq!(runs, 1, "{first:?} {retry:?}");
    assert!(
        first.text.contains(r#""text":"par"#),
        "the live stream reached the client: {first:?}"
    );
    assert!(
        !retry.text.contains(r#""text":"par"#),
        "the truncated bytes are no answer: {retry:?}"
    );
    assert_eq!((retry.status, retry.code()), (409, -31007), "{retry:?}");
    let v: Value = serde_json::from_str(&retry.text).expect("a JSON-RPC error");
    assert_eq!(v["id"], 2, "the refusal answers the retry's id");
    assert_eq!(v["error"]["data"]["safe_new_key"], false, "{v}");
}

/// DESIGN §8 / §5: the worst rows above, on SQLite with a real file.
#[tokio::test]
async fn s5_s8_on_sqlite_answers_and_meta_keys_run_once() {
    let (store, path) = common::sqlite("jsonrpc-mcp-review").await;
    let (addr, effects) = server_on(store, meta()).await;
    assert!(path.exists(), "a real file");
    let mut bad = Vec::new();
    for mode in ["plain", "surrogate"] {
        let (runs, _, retry) = twice(addr, &effects, mode).await;
        if runs != 1 {
            bad.push(format!(
                "answer {mode}: {runs} runs, retry {} {}",
                retry.status,
                retry.code()
            ));
        }
    }
    for (name, args) in [
        ("meta key, lone surrogate", r#"{"title":"a\ud800b"}"#),
        ("meta key, plain", r#"{"title":"plain"}"#),
    ] {
        let key = unique("sqlite-meta");
        let before = effects.count();
        for attempt in 0..2 {
            let body = call(&format!("{}", attempt + 1), &params(args, "p", Some(&key)));
            post_to(addr, &[], body).await;
        }
        let runs = effects.count() - before;
        if runs > 1 {
            bad.push(format!("{name}: {runs} runs"));
        }
    }
    let _ = std::fs::remove_file(&path);
    assert!(bad.is_empty(), "on SQLite: {bad:#?}");
}

// =============================================================================================
// 3. Two different calls are never merged (§1 step 4: "Canonicalisation may only merge what is
//    provably the same request"; §8: "the exact params (without _meta)").
// =============================================================================================

/// DESIGN §1 step 4 and §8: pairs of arguments under one key. Different calls get 422
/// (-31002) and run nothing; the same call written otherwise (RFC 8785) is replayed.
/// Rows marked "documented" are the sharp edges: RFC 8785 merges `-0` and `0`, `1e2` and
/// `100`; a document with no canonical form (a lone surrogate) is hashed as sent, so the same
/// value spelled `\uD800` or with members reordered is a mismatch, not a replay.
#[tokio::test]
async fn s4_s8_params_that_differ_are_never_merged() {
    let (addr, effects) = server(JsonRpc::new()).await;
    let rows: &[(&str, &str, &str, bool)] = &[
        (
            "lone surrogates differ",
            r#"{"s":"\ud800"}"#,
            r#"{"s":"\ud801"}"#,
            false,
        ),
        (
            "lone surrogate vs U+FFFD",
            r#"{"s":"\ud800"}"#,
            r#"{"s":"\ufffd"}"#,
            false,
        ),
        (
            "lone surrogate vs U+FFFD raw",
            r#"{"s":"\ud800"}"#,
            "{\"s\":\"\u{fffd}\"}",
            false,
        ),
        (
            "lone low vs pair",
            r#"{"s":"\ude00"}"#,
            r#"{"s":"\ud83d\ude00"}"#,
            false,
        ),
        (
            "surrogate name",
            r#"{"\ud800":1}"#,
            r#"{"\ud801":1}"#,
            false,
        ),
        ("duplicate vs last", r#"{"x":1,"x":2}"#, r#"{"x":2}"#, false),
        (
            "duplicate vs first",
            r#"{"x":1,"x":2}"#,
            r#"{"x":1}"#,
            false,
        ),
        (
            "duplicate reordered",
            r#"{"x":1,"x":2}"#,
            r#"{"x":2,"x":1}"#,
            false,
        ),
        (
            "2^53+1",
            r#"{"n":9007199254740993}"#,
            r#"{"n":9007199254740992}"#,
            false,
        ),
        (
            "30 digits",
            r#"{"n":123456789012345678901234567890}"#,
            r#"{"n":123456789012345678901234567891}"#,
            false,
        ),
        ("1e400 vs 1e401", r#"{"n":1e400}"#, r#"{"n":1e401}"#, false),
        ("1e-400 vs 0", r#"{"n":1e-400}"#, r#"{"n":0}"#, false),
        (
            "0.1 vs 0.10000000000000001",
            r#"{"n":0.1}"#,
            r#"{"n":0.10000000000000001}"#,
            false,
        ),
        (
            "nested _meta counts",
            r#"{"_meta":1}"#,
            r#"{"_meta":2}"#,
            false,
        ),
        (
            "NUL vs SOH",
            r#"{"s":"\u0000"}"#,
            r#"{"s":"\u0001"}"#,
            false,
        ),
        ("string vs number", r#"{"n":"1"}"#, r#"{"n":1}"#, false),
        ("1 vs 1.0 (documented)", r#"{"n":1}"#, r#"{"n":1.0}"#, true),
        (
            "1e2 vs 100 (documented)",
            r#"{"n":1e2}"#,
            r#"{"n":100}"#,
            true,
        ),
        ("-0 vs 0 (documented)", r#"{"n":-0}"#, r#"{"n":0}"#, true),
        (
            "escape vs letter",
            r#"{"s":"\u0041"}"#,
            r#"{"s":"A"}"#,
            true,
        ),
        (
            "pair vs emoji",
            r#"{"s":"\uD83D\uDE00"}"#,
            "{\"s\":\"\u{1F600}\"}",
            true,
        ),
        (
            "reordered",
            r#"{"a":1,"b":[1,2]}"#,
            r#"{ "b" : [1,2], "a" : 1 }"#,
            true,
        ),
        (
            "surrogate, hex case (documented)",
            r#"{"s":"\ud800"}"#,
            r#"{"s":"\uD800"}"#,
            false,
        ),
        (
            "surrogate, reordered (documented)",
            r#"{"a":"\ud800","b":1}"#,
            r#"{"b":1,"a":"\ud800"}"#,
            false,
        ),
    ];
    let mut wrong = Vec::new();
    for (name, a, b, same) in rows {
        let key = unique("pairs");
        let before = effects.count();
        let first = post_to(
            addr,
            &[("idempotency-key", &key)],
            call("1", &params(a, "x", None)),
        )
        .await;
        let retry = post_to(
            addr,
            &[("idempotency-key", &key)],
            call("2", &params(b, "y", None)),
        )
        .await;
        let runs = effects.count() - before;
        let ok = first.status == 200
            && runs == 1
            && if *same {
                retry.replayed && retry.status == 200
            } else {
                !retry.replayed && retry.status == 422 && retry.code() == -31002
            };
        if !ok {
            wrong.push(format!(
                "{name} (same: {same}): first {} runs {runs}; retry {} replayed={} code={}",
                first.status,
                retry.status,
                retry.replayed,
                retry.code()
            ));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// DESIGN §8 (method in the scope; the member names and the method decoded as JSON): a call
/// written `"m\u0065thod":"tools/c\u0061ll"` is the same call as `"method":"tools/call"` and
/// replays; the method's case is another method (documented: not on the allow-list, so a keyed
/// `Tools/Call` passes through untouched and runs each time — a sharp edge).
#[tokio::test]
async fn s8_method_escapes_are_the_same_call_and_case_is_another_method() {
    let (addr, effects) = server(JsonRpc::new()).await;
    let key = unique("escaped");
    let args = params(r#"{"title":"x"}"#, "p", None);
    let escaped = format!(
        r#"{{"jsonrpc":"2.0","\u0069d":1,"m\u0065thod":"tools/c\u0061ll","params":{args}}}"#
    );
    // The lenient server finds no `"id":` here; it answers `x-write-id`.
    let first = post_to(
        addr,
        &[("idempotency-key", &key), ("x-write-id", "1")],
        escaped,
    )
    .await;
    assert_eq!(first.status, 200, "{first:?}");
    let retry = post_to(addr, &[("idempotency-key", &key)], call("2", &args)).await;
    assert!(retry.replayed, "{retry:?}");
    assert!(retry.text.contains(r#""id":2"#), "{retry:?}");
    assert_eq!(effects.count(), 1);

    let key = unique("case");
    let upper = format!(r#"{{"jsonrpc":"2.0","id":1,"method":"Tools/Call","params":{args}}}"#);
    for _ in 0..2 {
        let got = post_to(addr, &[("idempotency-key", &key)], upper.clone()).await;
        assert!(!got.replayed, "another method is not guarded: {got:?}");
    }
    assert_eq!(
        effects.count(),
        3,
        "documented: a keyed Tools/Call passes through, each time"
    );
}

/// DESIGN §8 (module docs: "without `_meta` ... and MCP's per-round-trip `inputResponses` and
/// `requestState`"): two calls differing only in those top-level params members are one call
/// (documented; a sharp edge for JSON-RPC methods other than MCP's, where those names may be
/// arguments). Differing in any other top-level member is another call.
#[tokio::test]
async fn s8_round_trip_members_are_left_out_as_documented() {
    let (addr, effects) = server(JsonRpc::new().methods(["tools/call"])).await;
    let key = unique("state");
    let a = r#"{"name":"t","arguments":{},"requestState":"transfer-to-alice","inputResponses":{"x":1}}"#;
    let b =
        r#"{"name":"t","arguments":{},"requestState":"transfer-to-bob","inputResponses":{"x":2}}"#;
    post_to(addr, &[("idempotency-key", &key)], call("1", a)).await;
    let retry = post_to(addr, &[("idempotency-key", &key)], call("2", b)).await;
    assert!(
        retry.replayed,
        "documented: left out of the fingerprint: {retry:?}"
    );
    let c = r#"{"name":"t","arguments":{},"requestStates":"x"}"#;
    let other = post_to(addr, &[("idempotency-key", &key)], call("3", c)).await;
    assert_eq!((other.status, other.code()), (422, -31002), "{other:?}");
    assert_eq!(effects.count(), 1);
}

// =============================================================================================
// 4. Replays answer the retry's own id (§8: "a replay carries the new request's id exactly as
//    it was sent, and the recorded result bytes unchanged").
// =============================================================================================

/// DESIGN §8: each retry of one call gets the recorded answer under its own id text, byte for
/// byte (escapes, exponent forms, 30 digits, a 40 KB string), the inner `id` of the result
/// untouched; an id the layer cannot read (a lone surrogate escape) is refused, nothing run.
#[tokio::test]
async fn s8_a_replay_answers_the_retrys_own_id_as_sent() {
    let (addr, effects) = server(JsonRpc::new()).await;
    let key = unique("ids");
    let args = params(r#"{"title":"x"}"#, "p", None);
    // A server writes the id back decoded: "ab" for "a\u0062".
    let first = post_to(
        addr,
        &[
            ("idempotency-key", &key),
            ("x-answer", "inner-id"),
            ("x-write-id", r#""ab""#),
        ],
        call(r#""a\u0062""#, &args),
    )
    .await;
    assert_eq!(first.status, 200, "{first:?}");
    assert!(!first.replayed);
    let big = format!(r#""{}""#, "z".repeat(40_000));
    let mut wrong = Vec::new();
    for id in [
        r#""x""#,
        "2.50",
        "-0",
        "1E2",
        r#""\u00e9""#,
        "123456789012345678901234567890",
        r#""a\u0062""#,
        big.as_str(),
    ] {
        let got = post_to(
            addr,
            &[("idempotency-key", &key), ("x-answer", "inner-id")],
            call(id, &args),
        )
        .await;
        let want = format!(
            r#"{{"jsonrpc":"2.0","result":{{"id":"inner","n":1,"amount":10.50}},"id":{id}}}"#
        );
        if !(got.replayed && got.text == want && got.content_type == "application/json") {
            wrong.push(format!(
                "{}: {} {}",
                &id[..id.len().min(20)],
                got.status,
                &got.text[..got.text.len().min(200)]
            ));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    let odd = post_to(
        addr,
        &[("idempotency-key", &key)],
        call(r#""\ud800""#, &args),
    )
    .await;
    assert_eq!((odd.status, odd.code()), (400, -31009), "{odd:?}");
    assert!(
        odd.text.contains(r#""id":"\ud800""#),
        "the refusal echoes the id as sent: {odd:?}"
    );
    assert_eq!(effects.count(), 1);
}

// =============================================================================================
// 5. Scopes (§1 step 2: "Two principals using the same key can never see each other's records
//    or responses").
// =============================================================================================

/// DESIGN §1 step 2 / §8: two tenants (scope by header), the same key, the same id and the
/// same params: each runs once and is replayed its own answer. A keyed call without the tenant
/// header runs nothing. Two `Mcp-Session-Id`s of one tenant share the key (documented: the
/// scope is the principal, not the transport session — a sharp edge), unless the session id is
/// a fingerprint header, then the second is a 422.
#[tokio::test]
async fn s2_two_tenants_never_share_and_sessions_share_as_documented() {
    let effects = Effects::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .scope_by_header(HeaderName::from_static("x-tenant"))
        .jsonrpc(JsonRpc::new());
    let app = Router::new()
        .route("/mcp", post(tool))
        .with_state(effects.clone())
        .layer(layer);
    let addr = serve(app).await;
    let key = unique("tenants");
    let body = call("1", &params(r#"{"title":"x"}"#, "p", None));
    let a1 = post_to(
        addr,
        &[("idempotency-key", &key), ("x-tenant", "a")],
        body.clone(),
    )
    .await;
    let b1 = post_to(
        addr,
        &[("idempotency-key", &key), ("x-tenant", "b")],
        body.clone(),
    )
    .await;
    let a2 = post_to(
        addr,
        &[("idempotency-key", &key), ("x-tenant", "a")],
        body.clone(),
    )
    .await;
    let b2 = post_to(
        addr,
        &[("idempotency-key", &key), ("x-tenant", "b")],
        body.clone(),
    )
    .await;
    assert_eq!(effects.count(), 2, "one run per tenant");
    assert!(!b1.replayed, "b never sees a's answer: {b1:?}");
    assert!(
        a1.text.contains("run 1") && b1.text.contains("run 2"),
        "{a1:?} {b1:?}"
    );
    assert_eq!((a2.replayed, a2.text.clone()), (true, a1.text.clone()));
    assert_eq!((b2.replayed, b2.text.clone()), (true, b1.text.clone()));
    let none = post_to(addr, &[("idempotency-key", &key)], body.clone()).await;
    assert!(none.status >= 400 && none.code() != 0, "{none:?}");
    assert_eq!(effects.count(), 2, "no scope, nothing run");

    // Sessions of one tenant.
    let key = unique("sessions");
    let s1 = post_to(
        addr,
        &[
            ("idempotency-key", &key),
            ("x-tenant", "a"),
            ("mcp-session-id", "s-1"),
        ],
        body.clone(),
    )
    .await;
    let s2 = post_to(
        addr,
        &[
            ("idempotency-key", &key),
            ("x-tenant", "a"),
            ("mcp-session-id", "s-2"),
        ],
        call("9", &params(r#"{"title":"x"}"#, "q", None)),
    )
    .await;
    assert!(
        !s1.replayed && s2.replayed,
        "documented: one tenant, one key: {s2:?}"
    );
    assert!(
        s2.text.contains(r#""id":9"#),
        "under the retry's id: {s2:?}"
    );
    assert_eq!(effects.count(), 3);

    let effects2 = Effects::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .scope_by_header(HeaderName::from_static("x-tenant"))
        .fingerprint_header(HeaderName::from_static("mcp-session-id"))
        .jsonrpc(JsonRpc::new());
    let app = Router::new()
        .route("/mcp", post(tool))
        .with_state(effects2.clone())
        .layer(layer);
    let addr = serve(app).await;
    let key = unique("sessions-fp");
    post_to(
        addr,
        &[
            ("idempotency-key", &key),
            ("x-tenant", "a"),
            ("mcp-session-id", "s-1"),
        ],
        body.clone(),
    )
    .await;
    let s2 = post_to(
        addr,
        &[
            ("idempotency-key", &key),
            ("x-tenant", "a"),
            ("mcp-session-id", "s-2"),
        ],
        body.clone(),
    )
    .await;
    assert_eq!((s2.status, s2.code()), (422, -31002), "{s2:?}");
    assert_eq!(effects2.count(), 1);
}

// =============================================================================================
// 6. Notifications, batches, hostile bytes (§8: errors travel as JSON-RPC error objects; a
//    keyed call that cannot be guarded is refused; notifications are never recorded).
// =============================================================================================

/// DESIGN §8: a keyed notification is refused (`call-unguardable`, id `null`), nothing run; an
/// unkeyed one passes each time and is never replayed; a batch mixing notifications and a
/// `_meta`-keyed call is refused; a batch of unguarded methods passes.
#[tokio::test]
async fn s8_notifications_and_mixed_batches() {
    let (addr, effects) = server(meta()).await;
    let note = r#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"t","arguments":{}}}"#;
    let key = unique("note");
    for _ in 0..2 {
        let got = post_to(addr, &[("idempotency-key", &key)], note).await;
        assert_eq!((got.status, got.code()), (400, -31009), "{got:?}");
        let v: Value = serde_json::from_str(&got.text).expect("json");
        assert!(v["id"].is_null(), "{v}");
    }
    assert_eq!(effects.count(), 0);
    for _ in 0..2 {
        let got = post_to(addr, &[], note).await;
        assert!(!got.replayed);
    }
    assert_eq!(effects.count(), 2, "unkeyed notifications pass, each time");
    let key = unique("mixed");
    let mixed = format!(
        r#"[{{"jsonrpc":"2.0","method":"notifications/progress"}},{}]"#,
        call("1", &params("{}", "p", Some(&key)))
    );
    let got = post_to(addr, &[], mixed).await;
    assert_eq!((got.status, got.code()), (400, -31009), "{got:?}");
    let listing = r#"[{"jsonrpc":"2.0","method":"notifications/initialized"},{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"_meta":{"idempotencyKey":"k"}}}]"#;
    let got = post_to(addr, &[], listing).await;
    assert!(!got.replayed && got.status == 200, "{got:?}");
    assert_eq!(effects.count(), 3);
}

/// DESIGN §8 / §1 step 3–4: hostile bodies on a keyed route get a JSON-RPC error object
/// (`application/json`, a 4xx, a code outside the reserved range), never a panic, a hang or a
/// non-JSON-RPC answer, and nothing runs; the server still serves afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s8_hostile_bodies_get_jsonrpc_errors_and_run_nothing() {
    let (addr, effects) = server(meta()).await;
    let args = params("{}", "p", None);
    let batch_10k = {
        let mut items: Vec<String> = (0..10_000)
            .map(|i| {
                format!(
                    r#"{{"jsonrpc":"2.0","id":{i},"method":"tools/call","params":{{"name":"t"}}}}"#
                )
            })
            .collect();
        items.push(call("10001", &params("{}", "p", Some("k-10k"))));
        format!("[{}]", items.join(","))
    };
    let cases: Vec<(&str, bool, Vec<u8>)> = vec![
        ("invalid UTF-8", true, {
            let mut b = call("1", &args).into_bytes();
            b.insert(40, 0xff);
            b
        }),
        ("BOM", true, format!("\u{feff}{}", call("1", &args)).into_bytes()),
        ("raw NUL in a string", true, call("1", r#"{"name":"t","arguments":{"s":"a\u0000b"}}"#).replace("\\u0000", "\0").into_bytes()),
        ("params 100 000 deep", true, call("1", &format!(r#"{{"name":"t","arguments":{}}}"#, nested(100_000, "1"))).into_bytes()),
        ("id 100 000 deep", true, call(&nested(100_000, "1"), &args).into_bytes()),
        ("id of 100 000 digits", true, call(&"9".repeat(100_000), &args).into_bytes()),
        ("id 1e400", true, call("1e400", &args).into_bytes()),
        ("truncated", true, call("1", &args).as_bytes()[..50].to_vec()),
        ("empty", true, Vec::new()),
        ("null", true, b"null".to_vec()),
        ("a string", true, br#""tools/call""#.to_vec()),
        ("_meta key in a deep unparsable body", false, format!(r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"_meta":{{"idempotencyKey":"k-deep"}},"x":{}"#, "[".repeat(50_000)).into_bytes()),
        ("10 000-item batch, last keyed in _meta", false, batch_10k.into_bytes()),
    ];
    let mut wrong = Vec::new();
    for (name, header_keyed, body) in cases {
        let key = unique("hostile");
        let headers: Vec<(&str, &str)> = if header_keyed {
            vec![("idempotency-key", key.as_str())]
        } else {
            vec![]
        };
        let before = effects.count();
        let got = tokio::time::timeout(Duration::from_secs(40), post_to(addr, &headers, body))
            .await
            .unwrap_or_else(|_| panic!("{name}: the layer hung"));
        let code = got.code();
        let reads = serde_json::from_str::<Value>(&got.text)
            .map(|v| v.get("jsonrpc") == Some(&json!("2.0")) && v.get("error").is_some())
            // An id echoed as sent (1e400, 100 000 digits) is not read by serde_json.
            .unwrap_or(got.text.starts_with(r#"{"jsonrpc":"2.0","id":"#));
        if !((400..500).contains(&got.status)
            && got.content_type == "application/json"
            && reads
            && (-31999..=-31000).contains(&code)
            && effects.count() == before)
        {
            wrong.push(format!(
                "{name}: {} {} code {code}, ran {}: {}",
                got.status,
                got.content_type,
                effects.count() - before,
                &got.text[..got.text.len().min(200)]
            ));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    let key = unique("after");
    let got = post_to(addr, &[("idempotency-key", &key)], call("1", &args)).await;
    assert_eq!(got.status, 200, "still serving: {got:?}");
}

/// DESIGN §1 step 4 (session 30: request trailers are kept and hashed) in JSON-RPC mode: the
/// same call with the same trailer replays; another trailer value is another call (422), never
/// a merge; nothing runs twice.
#[tokio::test]
async fn s4_s8_request_trailers_count_in_jsonrpc_mode() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (addr, effects) = server(JsonRpc::new()).await;
    let key = unique("trailers");
    let send = |id: &'static str, sig: &'static str| {
        let key = key.clone();
        async move {
            let body = call(id, &params(r#"{"title":"x"}"#, "p", None));
            let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
            let head = format!(
                "POST /mcp HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\
                 content-type: application/json\r\ntrailer: x-sig\r\nidempotency-key: {key}\r\n\r\n\
                 {:x}\r\n{body}\r\n0\r\nx-sig: {sig}\r\n\r\n",
                body.len()
            );
            stream.write_all(head.as_bytes()).await.expect("write");
            let mut buf = Vec::new();
            let _ = stream.read_to_end(&mut buf).await;
            common::raw::parse_raw(&buf)
        }
    };
    let first = send("1", "aaa").await;
    let same = send("2", "aaa").await;
    let other = send("3", "bbb").await;
    assert_eq!(first.status, 200, "{first:?}");
    assert!(same.replayed(), "{same:?}");
    assert_eq!(
        (other.status, jsonrpc_code(&other.text())),
        (422, -31002),
        "another trailer is another call: {other:?}"
    );
    assert_eq!(effects.count(), 1);
}

// =============================================================================================
// 7. Differential: the fingerprint against an independent RFC 8785 implementation.
// =============================================================================================

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        (-1_000_000i64..1_000_000).prop_map(|n| json!(n)),
        (-100_000i64..100_000).prop_map(|k| json!(k as f64 / 100.0)),
        "[a-z0-9 é\u{1F600}\"\\\\\n\u{1}\u{e000}]{0,6}".prop_map(Value::String),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-c_é\u{1F600}\u{e000}]{1,2}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A deterministic stream of choices.
struct Choices(u64);

impl Choices {
    fn pick(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

fn ws(c: &mut Choices) -> &'static str {
    ["", " ", "\n\t", "\r\n  "][c.pick(4) as usize]
}

fn render_str(s: &str, c: &mut Choices) -> String {
    let mut out = String::from("\"");
    for ch in s.chars() {
        let code = ch as u32;
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str(if c.pick(2) == 0 { "\\\\" } else { "\\u005c" }),
            _ if code < 0x20 => out.push_str(&format!("\\u{code:04x}")),
            _ if c.pick(3) == 0 => {
                if code > 0xffff {
                    let v = code - 0x10000;
                    let (hi, lo) = (0xd800 + (v >> 10), 0xdc00 + (v & 0x3ff));
                    if c.pick(2) == 0 {
                        out.push_str(&format!("\\u{hi:04x}\\u{lo:04x}"));
                    } else {
                        out.push_str(&format!("\\u{hi:04X}\\u{lo:04X}"));
                    }
                } else {
                    out.push_str(&format!("\\u{code:04x}"));
                }
            }
            _ => out.push(ch),
        }
    }
    out.push('"');
    out
}

/// `v` written another way: member order, whitespace, escapes and number spellings chosen by
/// `c`; the same JSON value.
fn render(v: &Value, c: &mut Choices) -> String {
    match v {
        Value::Null | Value::Bool(_) => v.to_string(),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                match c.pick(5) {
                    0 => format!("{i}.0"),
                    1 => format!("{i}e0"),
                    2 => format!("{i}E+0"),
                    3 if i != 0 && i % 10 == 0 => format!("{}e1", i / 10),
                    _ => format!("{i}"),
                }
            } else {
                let f = n.as_f64().expect("f64");
                match c.pick(3) {
                    0 => format!("{f:e}"),
                    1 => format!("{f:E}"),
                    _ => format!("{f}"),
                }
            }
        }
        Value::String(s) => render_str(s, c),
        Value::Array(items) => {
            let parts: Vec<String> = items
                .iter()
                .map(|i| format!("{}{}{}", ws(c), render(i, c), ws(c)))
                .collect();
            format!("[{}]", parts.join(","))
        }
        Value::Object(map) => {
            let mut members: Vec<(&String, &Value)> = map.iter().collect();
            let rot = if members.is_empty() {
                0
            } else {
                c.pick(members.len() as u64) as usize
            };
            members.rotate_left(rot);
            if c.pick(2) == 0 {
                members.reverse();
            }
            let parts: Vec<String> = members
                .into_iter()
                .map(|(k, v)| {
                    format!(
                        "{}{}{}:{}{}",
                        ws(c),
                        render_str(k, c),
                        ws(c),
                        ws(c),
                        render(v, c)
                    )
                })
                .collect();
            format!("{{{}}}", parts.join(","))
        }
    }
}

/// `v` with one leaf changed (or grown), chosen by `c`.
fn perturb(v: &mut Value, c: &mut Choices) {
    match v {
        Value::Null => *v = json!(0),
        Value::Bool(b) => *b = !*b,
        Value::Number(n) => {
            *v = match n.as_i64() {
                Some(i) if c.pick(2) == 0 => json!(i + 1),
                Some(i) => json!(i.to_string()),
                None => json!(n.as_f64().expect("f64") + 0.5),
            }
        }
        Value::String(s) => s.push('x'),
        Value::Array(items) => {
            if items.is_empty() || c.pick(4) == 0 {
                items.push(Value::Null);
            } else {
                let at = c.pick(items.len() as u64) as usize;
                perturb(&mut items[at], c);
            }
        }
        Value::Object(map) => {
            if map.is_empty() || c.pick(4) == 0 {
                map.insert("zz".into(), json!(1));
            } else {
                let at = c.pick(map.len() as u64) as usize;
                let key = map.keys().nth(at).expect("key").clone();
                perturb(map.get_mut(&key).expect("member"), c);
            }
        }
    }
}

fn jcs(text: &str) -> Vec<u8> {
    let v: Value = serde_json::from_str(text).expect("the reference reads it");
    serde_json_canonicalizer::to_vec(&v).expect("canonical")
}

/// DESIGN §1 step 4 / §8, differentially: arguments written two ways (members reordered,
/// whitespace, `\u` escapes and surrogate pairs, `1e1`/`10.0`/`1E+0` spellings) replay;
/// arguments changed anywhere get 422 unless RFC 8785 (serde_json_canonicalizer, independent)
/// says they are the same. `_meta` differs on every attempt. Effects counted in the handler.
#[test]
fn s4_s8_differential_params_against_rfc8785() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (addr, effects) = rt.block_on(server(JsonRpc::new()));
    let mut runner = TestRunner::new(ProptestConfig {
        cases: 48,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    runner
        .run(&(value(), any::<u64>()), |(v, seed)| {
            rt.block_on(async {
                let mut c = Choices(seed);
                let first_args = render(&v, &mut c);
                let same_args = render(&v, &mut c);
                let mut changed = v.clone();
                perturb(&mut changed, &mut c);
                let changed_args = render(&changed, &mut c);
                prop_assert_eq!(jcs(&first_args), jcs(&same_args), "the generator");
                let key = unique("diff");
                let before = effects.count();
                let h = [("idempotency-key", key.as_str())];
                let first = post_to(addr, &h, call("1", &params(&first_args, "a", None))).await;
                prop_assert_eq!(first.status, 200, "{:?}", first);
                let same = post_to(addr, &h, call("\"r2\"", &params(&same_args, "b", None))).await;
                prop_assert!(
                    same.replayed,
                    "{} then {}: {:?}",
                    first_args,
                    same_args,
                    same
                );
                let other = post_to(addr, &h, call("3", &params(&changed_args, "c", None))).await;
                if jcs(&first_args) == jcs(&changed_args) {
                    prop_assert!(
                        other.replayed,
                        "{} vs {}: {:?}",
                        first_args,
                        changed_args,
                        other
                    );
                } else {
                    prop_assert_eq!(
                        (other.status, other.code(), other.replayed),
                        (422, -31002, false),
                        "{} vs {}",
                        first_args,
                        changed_args
                    );
                }
                prop_assert_eq!(effects.count(), before + 1, "one run a key");
                Ok(())
            })
        })
        .unwrap();
}

// =============================================================================================
// 8. With rmcp's own server and client.
// =============================================================================================

/// An rmcp tool whose structured result is a tree 140 levels deep: valid JSON that rmcp writes
/// and serde_json's `Value` (128 levels) does not read back.
#[derive(Clone)]
struct Trees {
    effects: Effects,
}

impl rmcp::ServerHandler for Trees {
    #[allow(deprecated)]
    fn get_info(&self) -> rmcp::model::ServerConfig {
        rmcp::model::ServerConfig::new(
            rmcp::model::ServerCapabilities::builder()
                .enable_tools()
                .build(),
        )
    }

    async fn call_tool(
        &self,
        request: rmcp::model::CallToolRequestParams,
        _: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<rmcp::model::CallToolResponse, rmcp::ErrorData> {
        let n = self.effects.hit();
        let depth = if request.name == "shallow" { 10 } else { 140 };
        let mut tree = json!(n);
        for _ in 0..depth {
            tree = Value::Array(vec![tree]);
        }
        Ok(rmcp::model::CallToolResult::structured(json!({ "tree": tree })).into())
    }
}

/// DESIGN §3/§7.1 with rmcp (JSON responses, stateless): a tool that returned a deep
/// structured result ran; the agent's retry under the same key (a fresh rmcp client, as after
/// a timeout) must not run it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_s8_rmcp_deep_structured_result_runs_once_per_key() {
    use rmcp::ServiceExt;
    use rmcp::transport::StreamableHttpClientTransport;
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService,
    };
    let effects = Effects::default();
    let trees = Trees {
        effects: effects.clone(),
    };
    let service: StreamableHttpService<Trees, LocalSessionManager> = StreamableHttpService::new(
        move || Ok(trees.clone()),
        std::sync::Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default()
            .with_legacy_session_mode(false)
            .with_json_response(true),
    );
    let app = Router::new().nest_service("/mcp", service).layer(
        IdempotencyLayer::new(MemoryStore::new())
            .single_tenant()
            .jsonrpc(JsonRpc::new()),
    );
    let addr = serve(app).await;
    let mut runs = Vec::new();
    for tool in ["shallow", "tree"] {
        let key = unique("rmcp-deep");
        let before = effects.count();
        for attempt in 0..2 {
            let mut headers = std::collections::HashMap::new();
            headers.insert(
                HeaderName::from_static("idempotency-key"),
                axum::http::HeaderValue::from_str(&key).expect("key"),
            );
            let config =
                StreamableHttpClientTransportConfig::with_uri(format!("http://{addr}/mcp"))
                    .custom_headers(headers);
            let Ok(Ok(client)) = tokio::time::timeout(
                Duration::from_secs(20),
                ().serve(StreamableHttpClientTransport::from_config(config)),
            )
            .await
            else {
                panic!("{tool} attempt {attempt}: the rmcp client could not connect");
            };
            // The answer may not be readable by the client either; only the runs count.
            let _ = tokio::time::timeout(
                Duration::from_secs(10),
                client.call_tool(rmcp::model::CallToolRequestParams::new(tool)),
            )
            .await;
            let _ = client.cancel().await;
        }
        runs.push((tool, effects.count() - before));
    }
    assert_eq!(
        runs,
        [("shallow", 1), ("tree", 1)],
        "rmcp's tool runs per key (the shallow one is the control)"
    );
}
