//! The JSON-RPC mode's unit tests, across its modules: requests read (a call, its id and key),
//! answers read (JSON and event streams), stored forms and replays re-addressed.

use super::answer::*;
use super::call::*;
use super::events::*;
use super::id::*;
use super::stored::*;
use super::*;
use http::StatusCode;
use serde_json::value::RawValue;
use serde_json::{Value, json};

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
        let body = format!(r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{params}}}"#);
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
        let body = format!(r#"{{"jsonrpc":"2.0","id":{raw},"method":"tools/call","params":{{}}}}"#);
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
    let interim =
        br#"{"jsonrpc":"2.0","id":1,"result":{"resultType":"input_required","inputRequests":{}}}"#;
    assert!(final_of(&headers, interim, &id("1")).is_none());
    let done = br#"{"jsonrpc":"2.0","id":1,"result":{"resultType":"complete","content":[]}}"#;
    assert!(final_of(&headers, done, &id("1")).is_some());
    let (parts, ()) = http::Request::post("/mcp")
        .body(())
        .expect("req")
        .into_parts();
    let options = crate::fingerprint::FingerprintOptions::default();
    let first = call(json!({"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t"}}))
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
