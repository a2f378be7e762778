//! Review of the hot path's cuts (issue 23 §2, session 15): the performance commits after
//! 40cce94 (media type fast path, spans entered by the response future, the denied-header
//! filter, the one-pass key check and the small-map key scan, MemoryStore's monotonic clock,
//! stored-response format `TIR3`, and `Pipeline::run` as a function returning an async block).
//! Every test tries to make the layer behave other than it did before: a fingerprint merging
//! two requests, a key line slipping past the duplicate check, a denied header recorded, a
//! replay not byte-for-byte the first answer, a lease expiring at another time, an execution
//! traced outside its span. Effects are counted in the handler.

mod common;

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use bytes::Bytes;
use common::memory::req;
use common::{Effects, guard, serve, until};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_idempotency::store::{Claim, ScopedKey, StoredResponse};
use tower_idempotency::{Fingerprint, IdempotencyLayer, IdempotencyStore, KeyError, MemoryStore};

/// A key no earlier run (PostgreSQL and Redis keep rows) has used.
fn unique(name: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{name}-{}-{nanos}", std::process::id())
}

/// A tiny deterministic generator (xorshift): reproducible "random" cases without a crate.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// The whole body of an in-process response.
async fn body_of(res: Response<Body>) -> Bytes {
    guard("a body", axum::body::to_bytes(res.into_body(), usize::MAX))
        .await
        .expect("body")
}

/// The problem+json body of an in-process answer.
async fn problem_of(res: Response<Body>) -> serde_json::Value {
    assert_eq!(
        res.headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("application/problem+json")
    );
    serde_json::from_slice(&body_of(res).await).expect("problem json")
}

/// Every header line of `headers` in the order they are sent.
fn lines(headers: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    headers
        .iter()
        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect()
}

// =============================================================================================
// 1. Media type (fingerprint/mod.rs `media_type`): DESIGN §1 step 4.
// =============================================================================================

/// The plain reading the fast paths must equal: cut at the first ';', `str::trim`, ASCII
/// lower-case; since session 38 only for a media type that reads (`token/token`): any other
/// value counts as sent, without the whitespace around it.
fn reference_media(content_type: &str) -> String {
    let end = content_type.find(';').unwrap_or(content_type.len());
    let media = content_type[..end].trim();
    let tchar = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    let token = |t: &str| !t.is_empty() && t.chars().all(tchar);
    match media.split_once('/') {
        Some((t, s)) if token(t) && token(s) => media.to_ascii_lowercase(),
        _ => format!("\"{}", content_type.trim()),
    }
}

fn fp(content_type: Option<&str>, body: &[u8]) -> Result<Fingerprint, String> {
    let mut builder = Request::builder().method("POST").uri("/orders?x=1");
    if let Some(ct) = content_type {
        builder = builder.header("content-type", ct);
    }
    let (parts, ()) = builder.body(()).expect("request").into_parts();
    Fingerprint::of(&parts, body).map_err(|e| e.to_string())
}

/// Content types near `application/json`: whitespace a header value may carry (space and tab,
/// the only ones HTTP lets through), case, one byte more or less.
fn media_variants() -> Vec<String> {
    let edges = ["", " ", "\t", " \t ", "\t\t"];
    let cores = [
        "application/json",
        "Application/JSON",
        "APPLICATION/JSON",
        "application/jsoN",
        "application/jsonx",
        "application/jso",
        "xapplication/json",
        "application/ json",
        "application /json",
        "application/json\tx",
        "application/problem+json",
        "application/Problem+JSON",
        "text/plain",
        "Text/Plain",
        "",
    ];
    let mut out = Vec::new();
    for lead in edges {
        for core in cores {
            for tail in edges {
                out.push(format!("{lead}{core}{tail}"));
            }
        }
    }
    out
}

/// §1 step 4 (media type counts, equal requests merge): over every variant, two content types
/// give the same fingerprint exactly when their plain readings are equal.
#[test]
fn s1_4_media_type_fingerprints_merge_exactly_what_the_plain_reading_merges() {
    let variants = media_variants();
    let fps: Vec<Fingerprint> = variants
        .iter()
        .map(|ct| fp(Some(ct), b"").expect("fp of an empty body"))
        .collect();
    for (i, a) in variants.iter().enumerate() {
        for (j, b) in variants.iter().enumerate() {
            assert_eq!(
                fps[i] == fps[j],
                reference_media(a) == reference_media(b),
                "{a:?} vs {b:?}"
            );
        }
    }
    // An empty Content-Type is one that does not read, counted as sent (session 38, found
    // by `strict_media_review`: a handler tells `Some("")` from `None`), and spaces around a
    // value are no part of it.
    assert_ne!(fp(None, b"").expect("fp"), fp(Some(""), b"").expect("fp"));
    assert_eq!(
        fp(Some(""), b"").expect("fp"),
        fp(Some("  "), b"").expect("fp")
    );
}

/// §1 step 4: every spelling of `application/json` (the fast path's exact string or not)
/// canonicalises JSON the same way; one byte more is another media type, hashed raw.
#[test]
fn s1_4_every_spelling_of_json_canonicalises_like_the_fast_path() {
    let canonical = fp(Some("application/json"), br#"{"a":1,"b":2}"#).expect("fp");
    for ct in media_variants() {
        let reference = reference_media(&ct);
        for params in ["", ";", "; charset=utf-8", ";charset=UTF-8"] {
            let ct = format!("{ct}{params}");
            let reordered = fp(Some(&ct), br#"{ "b": 2, "a": 1 }"#);
            if reference == "application/json" {
                assert_eq!(reordered, Ok(canonical), "{ct:?}");
                // Malformed JSON is refused under every spelling, as under the exact one.
                assert!(fp(Some(&ct), b"{\"a\":").is_err(), "{ct:?}");
            } else {
                assert_ne!(reordered, Ok(canonical), "{ct:?}");
            }
        }
    }
    // Parameters still count after the fast path's media type.
    assert_ne!(
        fp(
            Some("application/json; charset=latin1"),
            br#"{"a":1,"b":2}"#
        ),
        Ok(canonical)
    );
}

proptest::proptest! {
    /// §1 step 4 on any text a header value can hold (no parameters): fingerprints are equal
    /// exactly when the plain readings are.
    #[test]
    fn s1_4_media_type_agrees_with_the_plain_reading_on_any_value(
        a in "[ \taApPjJsSoOnN/+x]{0,18}",
        b in "[ \taApPjJsSoOnN/+x]{0,18}",
    ) {
        let (fa, fb) = (fp(Some(&a), b"").expect("fp"), fp(Some(&b), b"").expect("fp"));
        proptest::prop_assert_eq!(fa == fb, reference_media(&a) == reference_media(&b));
        let json = fp(Some("application/json"), b"").expect("fp");
        proptest::prop_assert_eq!(fa == json, reference_media(&a) == "application/json");
    }
}

/// §7.2 over real HTTP: a retry whose Content-Type is `application/json` spelled otherwise
/// replays (one effect); one whose media type differs by a byte is refused with 422, nothing
/// run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_2_json_spelled_otherwise_replays_and_a_byte_more_is_refused() {
    let effects = Effects::default();
    let app = {
        let effects = effects.clone();
        Router::new()
            .route(
                "/m",
                post(move |body: Bytes| {
                    let effects = effects.clone();
                    async move { format!("run {} ({} bytes)", effects.hit(), body.len()) }
                }),
            )
            .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant())
    };
    let addr = serve(app).await;
    let client = common::client();
    let key = unique("media");
    let send = |ct: &'static str, body: &'static str| {
        let request = client
            .post(format!("http://{addr}/m"))
            .header("idempotency-key", &key)
            .header("content-type", ct)
            .body(body)
            .send();
        async move { guard("a request", request).await.expect("response") }
    };
    let first = send("Application/JSON ; charset=UTF-8", r#"{"a":1,"b":[2,3]}"#).await;
    assert_eq!(first.status(), StatusCode::OK);
    let first = first.text().await.expect("body");
    for ct in [
        "application/json",
        "APPLICATION/JSON",
        "application/json;charset=utf-8",
    ] {
        let replay = send(ct, r#"{ "b": [2, 3], "a": 1 }"#).await;
        assert_eq!(replay.status(), StatusCode::OK, "{ct}");
        assert_eq!(replay.headers()["idempotency-replayed"], "true", "{ct}");
        assert_eq!(replay.text().await.expect("body"), first, "{ct}");
    }
    for ct in [
        "application/jsonx",
        "application/jso",
        "application/json; charset=latin1",
    ] {
        let refused = send(ct, r#"{"a":1,"b":[2,3]}"#).await;
        assert_eq!(refused.status(), StatusCode::UNPROCESSABLE_ENTITY, "{ct}");
    }
    assert_eq!(effects.count(), 1);
}

// =============================================================================================
// 2. Keys (key.rs `parse_key`, `first_two`): DESIGN §1 step 1.
// =============================================================================================

/// A guarded route that counts its runs, its layer reading the key from `header` if given.
fn keyed_app(effects: Effects, header: Option<HeaderName>) -> Router {
    let mut layer = IdempotencyLayer::new(MemoryStore::new());
    if let Some(header) = header {
        layer = layer.header_name(header);
    }
    Router::new()
        .route(
            "/k",
            post(move || {
                let effects = effects.clone();
                async move { format!("run {}", effects.hit()) }
            }),
        )
        .layer(layer.single_tenant())
}

/// What the layer must make of a request's key lines, read the plain way: every line of the
/// name (`get_all`), then the bare checks in their old order.
#[derive(Debug, PartialEq)]
enum Expect {
    Run,
    Missing,
    Refused(KeyError),
}

fn expect_for(values: &[&[u8]]) -> Expect {
    match values {
        [] => Expect::Missing,
        [_, _, ..] => Expect::Refused(KeyError::Multiple),
        [raw] => {
            if raw.first() == Some(&b'"') {
                // Only well-formed sf-strings are generated here.
                return Expect::Run;
            }
            if raw.iter().any(|b| !(0x21..=0x7e).contains(b)) {
                Expect::Refused(KeyError::InvalidCharacter)
            } else if raw.contains(&b',') {
                Expect::Refused(KeyError::Multiple)
            } else if raw.is_empty() {
                Expect::Refused(KeyError::Empty)
            } else if raw.len() > 255 {
                Expect::Refused(KeyError::TooLong)
            } else {
                Expect::Run
            }
        }
    }
}

/// Sends `headers` to the app in process and checks the answer against `expected`; returns
/// whether the handler was asked to run.
async fn check_key(app: &Router, headers: HeaderMap, expected: &Expect, what: &str) {
    let mut request = Request::post("/k").body(Body::from("{}")).expect("request");
    *request.headers_mut() = headers;
    let res = guard("a keyed request", app.clone().oneshot(request))
        .await
        .expect("infallible");
    match expected {
        Expect::Run => assert_eq!(res.status(), StatusCode::OK, "{what}"),
        Expect::Missing => {
            assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{what}");
            let problem = problem_of(res).await;
            assert_eq!(
                problem["type"],
                common::problem_type("key-missing"),
                "{what}"
            );
        }
        Expect::Refused(error) => {
            assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{what}");
            let problem = problem_of(res).await;
            assert_eq!(
                problem["type"],
                common::problem_type("key-invalid"),
                "{what}"
            );
            assert_eq!(problem["detail"], error.to_string(), "{what}: {problem}");
        }
    }
}

/// §1 step 1 (two key lines are two operations, refused): maps of 0 to 14 other names (the
/// scan covers up to 8 names, hashing above), filler names repeated, 0 to 3 key lines spelled
/// in any case and put anywhere, one of them possibly empty. Each map is answered as the plain
/// `get_all` reading says, and only a single valid key runs the handler.
#[tokio::test]
async fn s1_1_key_lines_are_found_in_maps_of_every_size() {
    for custom in [None, Some(HeaderName::from_static("x-operation-key"))] {
        let effects = Effects::default();
        let app = keyed_app(effects.clone(), custom.clone());
        let key_name = custom
            .clone()
            .unwrap_or(HeaderName::from_static("idempotency-key"));
        let spellings: Vec<String> = {
            let name = key_name.as_str();
            vec![
                name.to_owned(),
                name.to_ascii_uppercase(),
                name.split('-')
                    .map(|w| {
                        let mut c = w.chars();
                        c.next()
                            .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                            .unwrap_or_default()
                    })
                    .collect::<Vec<_>>()
                    .join("-"),
            ]
        };
        let mut rng = Rng(0x5eed_1500 + u64::from(custom.is_some()));
        let mut runs = 0;
        for case in 0..400 {
            let fillers = rng.below(15);
            let key_lines = match rng.below(6) {
                0 => 0,
                1 | 2 => 1,
                3 | 4 => 2,
                _ => 3,
            };
            let mut entries: Vec<(HeaderName, HeaderValue)> = Vec::new();
            for i in 0..fillers {
                let name = match i % 5 {
                    // Names near the key's (one byte off), and ordinary ones.
                    0 => format!("{}s", key_name.as_str()),
                    1 => key_name.as_str()[1..].to_owned(),
                    _ => format!("x-f{i}"),
                };
                let name =
                    HeaderName::from_bytes(format!("{name}{}", i / 5).as_bytes()).expect("name");
                entries.push((name.clone(), HeaderValue::from_static("f")));
                // Repeated values: more lines than names.
                if rng.below(3) == 0 {
                    entries.push((name, HeaderValue::from_static("g")));
                }
            }
            let mut values: Vec<Vec<u8>> = Vec::new();
            for line in 0..key_lines {
                let value = match rng.below(5) {
                    0 if line > 0 => Vec::new(),
                    1 => format!("\"q-{case}-{line}\"").into_bytes(),
                    _ => format!("k-{case}-{line}").into_bytes(),
                };
                let spelled = &spellings[rng.below(spellings.len())];
                let name = HeaderName::from_bytes(spelled.as_bytes()).expect("key name");
                let at = rng.below(entries.len() + 1);
                entries.insert(at, (name, HeaderValue::from_bytes(&value).expect("value")));
                values.push(value);
            }
            let mut headers = HeaderMap::new();
            for (name, value) in entries {
                headers.append(name, value);
            }
            // The map as hyper would hand it over: its own lines in their own order.
            let seen: Vec<&[u8]> = headers
                .get_all(&key_name)
                .iter()
                .map(HeaderValue::as_bytes)
                .collect();
            assert_eq!(seen.len(), key_lines, "case {case}");
            let expected = expect_for(&seen);
            let what = format!(
                "case {case}: {} names, {} lines, keys {seen:?}",
                headers.keys_len(),
                headers.len()
            );
            check_key(&app, headers, &expected, &what).await;
            if expected == Expect::Run {
                runs += 1;
            }
            assert_eq!(effects.count(), runs, "{what}");
        }
        assert!(runs > 50, "the cases ran something ({runs})");
    }
}

/// §1 step 1 byte by byte: a bare key with any byte a header value can hold, at its start, in
/// its middle or at its end, is accepted or refused (invalid, list, empty, too long) exactly
/// as the two-pass check did, and only an accepted one runs.
#[tokio::test]
async fn s1_1_every_byte_of_a_bare_key_is_judged_as_before() {
    let effects = Effects::default();
    let app = keyed_app(effects.clone(), None);
    let mut runs = 0;
    let bytes: Vec<u8> = std::iter::once(b'\t')
        .chain(0x20..=0x7e)
        .chain([0x80, 0xa0, 0xc3, 0xff])
        .collect();
    let mut cases: Vec<Vec<u8>> = Vec::new();
    for &b in &bytes {
        cases.push(vec![b'a', b, b'z']);
        cases.push(vec![b'k', b'-', b]);
        if b != b'"' {
            cases.push(vec![b, b'k']);
        }
        // Two offending bytes: which refusal wins.
        cases.push(vec![b'a', b',', b]);
        cases.push(vec![b, b',', b'a']);
    }
    for len in [254, 255, 256, 300] {
        cases.push(vec![b'a'; len]);
        let mut with_comma = vec![b'a'; len];
        with_comma[len - 1] = b',';
        cases.push(with_comma);
        let mut with_space = vec![b'a'; len];
        with_space[len / 2] = b' ';
        cases.push(with_space);
    }
    for (i, mut raw) in cases.into_iter().enumerate() {
        // Unique per case where accepted (runs are counted).
        if raw.len() < 200 && !raw.is_empty() && raw[0] != b'"' {
            raw.extend_from_slice(format!("{i}").as_bytes());
        }
        // sf-strings have their own reading, unchanged by this work.
        if raw.first() == Some(&b'"') {
            continue;
        }
        let Ok(value) = HeaderValue::from_bytes(&raw) else {
            continue;
        };
        let expected = expect_for(&[&raw]);
        let mut headers = HeaderMap::new();
        headers.insert("idempotency-key", value);
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        check_key(&app, headers, &expected, &format!("key {raw:?}")).await;
        if expected == Expect::Run {
            runs += 1;
        }
        assert_eq!(effects.count(), runs, "key {raw:?}");
    }
}

/// Sends `head` (a raw HTTP/1.1 request without body) and returns the whole answer as text.
async fn raw_exchange(addr: SocketAddr, head: &str, body: &str) -> String {
    guard("a raw exchange", async {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let request = format!(
            "{head}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await.expect("write");
        let mut out = Vec::new();
        stream.read_to_end(&mut out).await.expect("read");
        String::from_utf8_lossy(&out).into_owned()
    })
    .await
}

/// §1 step 1 over a real socket: two `Idempotency-Key` lines in different case (one of them
/// empty, or both equal), in heads of few and of many header names, are refused as two
/// operations; nothing runs. One line in odd case runs once and replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_1_two_key_lines_over_http_in_any_case_are_refused() {
    let effects = Effects::default();
    let addr = serve(keyed_app(effects.clone(), None)).await;
    let many: String = (0..12).map(|i| format!("X-Filler-{i}: v\r\n")).collect();
    for fillers in ["", "X-A: 1\r\n", many.as_str()] {
        for (a, b) in [
            ("IDEMPOTENCY-KEY: k1", "idempotency-key: k2"),
            ("Idempotency-Key: same", "idempotency-KEY: same"),
            ("Idempotency-Key:", "Idempotency-Key: k3"),
            ("Idempotency-Key: k4", "IDEMPOTENCY-key:"),
        ] {
            let head = format!(
                "POST /k HTTP/1.1\r\nHost: x\r\n{a}\r\nContent-Type: application/json\r\n{fillers}{b}\r\n"
            );
            let answer = raw_exchange(addr, &head, "{}").await;
            assert!(answer.starts_with("HTTP/1.1 400"), "{head}\n{answer}");
            assert!(
                answer.contains(&KeyError::Multiple.to_string()),
                "{head}\n{answer}"
            );
        }
    }
    assert_eq!(effects.count(), 0, "no key pair ran anything");
    // A list folded into one line is two operations too, and a tab inside a key is invalid.
    for (line, error) in [
        ("Idempotency-Key: a,b", KeyError::Multiple),
        ("Idempotency-Key: a, b", KeyError::InvalidCharacter),
        ("Idempotency-Key: a\tb", KeyError::InvalidCharacter),
    ] {
        let head = format!("POST /k HTTP/1.1\r\nHost: x\r\n{many}{line}\r\n");
        let answer = raw_exchange(addr, &head, "{}").await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{line}\n{answer}");
        assert!(answer.contains(&error.to_string()), "{line}\n{answer}");
    }
    assert_eq!(effects.count(), 0);
    let key = unique("case");
    for spelled in ["IDEMPOTENCY-KEY", "idempotency-key", "IdEmPoTeNcY-kEy"] {
        let head = format!("POST /k HTTP/1.1\r\nHost: x\r\n{spelled}: {key}\r\n{many}");
        let answer = raw_exchange(addr, &head, "{}").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{spelled}\n{answer}");
        assert!(answer.contains("run 1"), "{spelled}\n{answer}");
    }
    assert_eq!(effects.count(), 1);
}

// =============================================================================================
// 3. Denied headers (replay.rs `DeniedHeaders`): DESIGN §1 (replays never carry Set-Cookie,
//    WWW-Authenticate, Date, request ids), §3 (configurable deny list never stored).
// =============================================================================================

/// The default deny list, as documented.
const DEFAULT_DENIED: &[&str] = &[
    "set-cookie",
    "set-cookie2",
    "authorization",
    "proxy-authorization",
    "www-authenticate",
    "proxy-authenticate",
    "date",
    "x-request-id",
    "request-id",
    "x-correlation-id",
    "traceparent",
    "tracestate",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "idempotency-replayed",
];

/// The filter's slot of a name: its length and last byte, mixed as the filter mixes them.
fn slot(name: &str) -> u8 {
    (name.len() as u8)
        .wrapping_mul(13)
        .wrapping_add(*name.as_bytes().last().expect("a name"))
}

/// Names that are not denied and fall in a denied name's slot: the same length and last byte,
/// and other lengths whose mix lands on the same bit.
fn colliders(denied: &[&str]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let alphabet = b"abcdefghijklmnopqrstuvwxyz0123456789-";
    for d in denied {
        let s = slot(d);
        let same = format!("q{}", &d[1..]);
        let mut found = vec![same];
        let mut other = 0;
        for len in 1..=60usize {
            for &c in alphabet {
                if other < 3 && (len as u8).wrapping_mul(13).wrapping_add(c) == s && len != d.len()
                {
                    found.push(format!("{}{}", "q".repeat(len - 1), c as char));
                    other += 1;
                }
            }
        }
        for name in found {
            assert_eq!(slot(&name), s);
            if !denied.contains(&name.as_str())
                && !out.contains(&name)
                && HeaderName::from_bytes(name.as_bytes()).is_ok()
            {
                out.push(name);
            }
        }
    }
    out
}

/// A route answering with `lines` (in order), counting its runs.
fn answering(effects: Effects, lines: Vec<(String, String)>, deny: &[&str]) -> Router {
    let mut layer = IdempotencyLayer::new(MemoryStore::new());
    for name in deny {
        layer = layer.deny_header(HeaderName::from_bytes(name.as_bytes()).expect("name"));
    }
    Router::new()
        .route(
            "/r",
            post(move || {
                let (effects, lines) = (effects.clone(), lines.clone());
                async move {
                    effects.hit();
                    let mut res = Response::builder().status(StatusCode::CREATED);
                    for (name, value) in &lines {
                        res = res.header(name.as_str(), value.as_str());
                    }
                    res.body(Body::from("ok")).expect("response")
                }
            }),
        )
        .layer(layer.single_tenant())
}

async fn post_in_process(app: &Router, key: &str) -> Response<Body> {
    let request = Request::post("/r")
        .header("idempotency-key", key)
        .body(Body::empty())
        .expect("request");
    guard("a request", app.clone().oneshot(request))
        .await
        .expect("infallible")
}

/// §1/§3: a response carrying every denied header and, beside them, names that fall in the
/// same filter slots (same length and last byte, or another length mixed to the same bit),
/// repeated: the replay carries none of the denied ones (nor the hop-by-hop names Connection
/// lists) and every other one, with every value in order.
#[tokio::test]
async fn s3_denied_headers_are_never_replayed_and_their_neighbours_always_are() {
    let added = ["x-secret", "x-api-token-2"];
    let mut denied: Vec<&str> = DEFAULT_DENIED.to_vec();
    denied.extend(added);
    let neighbours = colliders(&denied);
    assert!(neighbours.len() > 60, "{neighbours:?}");
    let mut lines: Vec<(String, String)> = Vec::new();
    for name in &denied {
        let value = match *name {
            "content-length" => "2".to_owned(),
            "connection" => "x-hop, Q-Hop-Two".to_owned(),
            "transfer-encoding" => "identity".to_owned(),
            _ => format!("secret-{name}"),
        };
        lines.push(((*name).to_owned(), value));
    }
    for (i, name) in neighbours.iter().enumerate() {
        lines.push((name.clone(), format!("kept-{i}-a")));
        lines.push((name.clone(), format!("kept-{i}-b")));
    }
    lines.push(("x-hop".to_owned(), "hop".to_owned()));
    lines.push(("q-hop-two".to_owned(), "hop".to_owned()));
    let effects = Effects::default();
    let app = answering(effects.clone(), lines, &added);
    let key = unique("denied");

    let first = post_in_process(&app, &key).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let first_lines = lines_of(first.headers(), &neighbours);
    assert_eq!(body_of(first).await, "ok");

    let replay = post_in_process(&app, &key).await;
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(effects.count(), 1);
    let headers = replay.headers().clone();
    assert_eq!(
        headers
            .get_all("idempotency-replayed")
            .iter()
            .collect::<Vec<_>>(),
        ["true"]
    );
    for name in denied.iter().chain(&["x-hop", "q-hop-two"]) {
        if *name == "idempotency-replayed" {
            continue;
        }
        let values: Vec<_> = headers.get_all(*name).iter().collect();
        let leaked = values
            .iter()
            .any(|v| v.as_bytes().starts_with(b"secret-") || v.as_bytes() == b"hop")
            || (*name == "connection" && !values.is_empty());
        assert!(!leaked, "{name} was replayed: {values:?}");
    }
    for (i, name) in neighbours.iter().enumerate() {
        let values: Vec<&[u8]> = headers
            .get_all(name.as_str())
            .iter()
            .map(HeaderValue::as_bytes)
            .collect();
        assert_eq!(
            values,
            [
                format!("kept-{i}-a").as_bytes(),
                format!("kept-{i}-b").as_bytes()
            ],
            "{name} (slot {})",
            slot(name)
        );
    }
    // The replay repeats the first answer's kept lines in the same order.
    assert_eq!(lines_of(&headers, &neighbours), first_lines);
    assert_eq!(body_of(replay).await, "ok");
}

/// The lines of `headers` whose names are in `names`, in order.
fn lines_of(headers: &HeaderMap, names: &[String]) -> Vec<(String, Vec<u8>)> {
    lines(headers)
        .into_iter()
        .filter(|(n, _)| names.contains(n))
        .collect()
}

/// §3: random deny lists (added with `deny_header`) against random response names, many of
/// them in a denied name's slot: each name is replayed exactly when it is not denied.
#[tokio::test]
async fn s3_random_deny_lists_keep_exactly_the_names_they_do_not_list() {
    let mut rng = Rng(0x00de_adbe_ef15);
    let alphabet = b"abcdefghijklmnopqrstuvwxyz0123456789-";
    let name = |rng: &mut Rng| {
        let len = 1 + rng.below(12);
        let mut s: String = (0..len)
            .map(|_| alphabet[rng.below(alphabet.len())] as char)
            .collect();
        // Never a name the defaults deny, nor a framing one: this test is about `deny_header`.
        s.insert(0, 'z');
        s
    };
    for case in 0..40 {
        let listed: Vec<String> = (0..rng.below(6)).map(|_| name(&mut rng)).collect();
        let listed_refs: Vec<&str> = listed.iter().map(String::as_str).collect();
        let mut names: Vec<String> = (0..8).map(|_| name(&mut rng)).collect();
        names.extend(colliders(&listed_refs));
        names.extend(listed.iter().cloned());
        names.sort();
        names.dedup();
        let lines: Vec<(String, String)> = names
            .iter()
            .map(|n| (n.clone(), format!("v-{n}")))
            .collect();
        let effects = Effects::default();
        let app = answering(effects.clone(), lines, &listed_refs);
        let key = unique(&format!("deny-{case}"));
        assert_eq!(
            post_in_process(&app, &key).await.status(),
            StatusCode::CREATED
        );
        let replay = post_in_process(&app, &key).await;
        assert_eq!(replay.headers()["idempotency-replayed"], "true");
        for n in &names {
            let replayed = replay.headers().get(n.as_str()).is_some();
            assert_eq!(
                replayed,
                !listed.contains(n),
                "case {case}: {n} (slot {}) with deny list {listed:?}",
                slot(n)
            );
        }
        assert_eq!(effects.count(), 1);
    }
}

/// §1 over real HTTP: the replay never carries the handler's Set-Cookie, Authorization,
/// WWW-Authenticate, request id, Date or an added denied header; every neighbour in the
/// filter is replayed with its values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_replays_over_http_leave_out_denied_headers_only() {
    let denied = [
        "set-cookie",
        "authorization",
        "www-authenticate",
        "x-request-id",
        "traceparent",
        "date",
        "x-secret",
    ];
    let neighbours = colliders(&denied);
    let mut lines: Vec<(String, String)> = denied
        .iter()
        .map(|n| {
            let value = match *n {
                "date" => "Mon, 01 Jan 2001 00:00:00 GMT".to_owned(),
                _ => format!("secret-{n}"),
            };
            ((*n).to_owned(), value)
        })
        .collect();
    lines.push(("set-cookie".to_owned(), "secret-second=1".to_owned()));
    for (i, n) in neighbours.iter().enumerate() {
        lines.push((n.clone(), format!("kept-{i}")));
    }
    let effects = Effects::default();
    let addr = serve(answering(effects.clone(), lines, &["x-secret"])).await;
    let client = common::client();
    let key = unique("denied-http");
    let send = || {
        let request = client
            .post(format!("http://{addr}/r"))
            .header("idempotency-key", &key)
            .send();
        async { guard("a request", request).await.expect("response") }
    };
    let first = send().await;
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(first.headers().get_all("set-cookie").iter().count(), 2);
    let replay = send().await;
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    for name in denied {
        for value in replay.headers().get_all(name) {
            assert!(
                !value.as_bytes().starts_with(b"secret-")
                    && value != "Mon, 01 Jan 2001 00:00:00 GMT",
                "{name}: {value:?} replayed"
            );
        }
    }
    for (i, n) in neighbours.iter().enumerate() {
        assert_eq!(
            replay.headers().get(n.as_str()).map(HeaderValue::as_bytes),
            Some(format!("kept-{i}").as_bytes()),
            "{n}"
        );
    }
    assert_eq!(replay.text().await.expect("body"), "ok");
    assert_eq!(effects.count(), 1);
}

// =============================================================================================
// 4. Stored responses (codec.rs `TIR3`): DESIGN §1 (replays are the original bytes), §2.
// =============================================================================================

/// The 24 names `TIR3` writes as an index, in their stored order (append only: a record names
/// a header by its place).
const KNOWN: [&str; 24] = [
    "content-type",
    "content-encoding",
    "cache-control",
    "etag",
    "last-modified",
    "location",
    "vary",
    "content-language",
    "content-disposition",
    "expires",
    "link",
    "retry-after",
    "server",
    "access-control-allow-origin",
    "content-location",
    "age",
    "allow",
    "accept-ranges",
    "content-range",
    "x-content-type-options",
    "strict-transport-security",
    "grpc-status",
    "grpc-message",
    "grpc-status-details-bin",
];

/// Names one byte away from a known one (or known by a prefix): spelled out, never indexed.
const NEAR_KNOWN: &[&str] = &[
    "content-typ",
    "content-typf",
    "content-types",
    "xontent-type",
    "ontent-type",
    "etaf",
    "etagg",
    "ag",
    "agf",
    "grpc-statu",
    "grpc-statut",
    "grpc-status-details-bim",
    "grpc-status-details",
    "vary-",
    "link2",
    "x-content-type",
    "server-timing",
    "allow-",
];

fn varint(out: &mut Vec<u8>, mut n: usize) {
    while n >= 0x80 {
        out.push(n as u8 | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// A reference writer of the three formats, written from their documented layout: `TIR1`
/// (fixed-width lengths), `TIR2` (varints, names spelled), `TIR3` (varints, known names as a
/// zero length and their index).
fn reference_bytes(r: &StoredResponse, format: u8) -> Vec<u8> {
    let mut out = match format {
        1 => b"TIR1".to_vec(),
        2 => b"TIR2".to_vec(),
        _ => b"TIR3".to_vec(),
    };
    out.extend_from_slice(&r.status.as_u16().to_be_bytes());
    let len = |out: &mut Vec<u8>, n: usize, width: usize| match format {
        1 => out.extend_from_slice(&(n as u64).to_be_bytes()[8 - width..]),
        _ => varint(out, n),
    };
    let headers = |out: &mut Vec<u8>, h: &HeaderMap| {
        len(out, h.len(), 4);
        for (n, v) in h {
            match KNOWN.iter().position(|k| *k == n.as_str()) {
                Some(i) if format == 3 => out.extend_from_slice(&[0, i as u8]),
                _ => {
                    len(out, n.as_str().len(), 4);
                    out.extend_from_slice(n.as_str().as_bytes());
                }
            }
            len(out, v.len(), 4);
            out.extend_from_slice(v.as_bytes());
        }
    };
    headers(&mut out, &r.headers);
    match &r.body {
        Some(body) => {
            out.push(1);
            len(&mut out, body.len(), 8);
            out.extend_from_slice(body);
        }
        None => out.push(0),
    }
    match &r.trailers {
        Some(t) => {
            out.push(1);
            headers(&mut out, t);
        }
        None => out.push(0),
    }
    out
}

/// A response with `names` (known, near-known, others), each possibly repeated, values with
/// opaque bytes or empty, and trailers.
fn hostile_response(rng: &mut Rng) -> StoredResponse {
    let pick = |rng: &mut Rng| -> String {
        match rng.below(3) {
            0 => KNOWN[rng.below(KNOWN.len())].to_owned(),
            1 => NEAR_KNOWN[rng.below(NEAR_KNOWN.len())].to_owned(),
            _ => format!("x-h{}", rng.below(300)),
        }
    };
    let value = |rng: &mut Rng| -> HeaderValue {
        let len = match rng.below(4) {
            0 => 0,
            1 => 200 + rng.below(300),
            _ => rng.below(20),
        };
        let bytes: Vec<u8> = (0..len)
            .map(|_| match rng.below(5) {
                0 => 0x80 + rng.below(0x80) as u8,
                1 => b'\t',
                _ => 0x20 + rng.below(0x5f) as u8,
            })
            .collect();
        HeaderValue::from_bytes(&bytes).unwrap_or(HeaderValue::from_static("x"))
    };
    let map = |rng: &mut Rng, n: usize| {
        let mut h = HeaderMap::new();
        for _ in 0..n {
            let name = HeaderName::from_bytes(pick(rng).as_bytes()).expect("name");
            for _ in 0..1 + rng.below(3) {
                h.append(name.clone(), value(rng));
            }
        }
        h
    };
    // Final answers only: an informational status is no record (its bytes read as corrupt).
    let statuses = [200u16, 201, 204, 303, 404, 422, 999, 599];
    let n = rng.below(40);
    StoredResponse {
        status: StatusCode::from_u16(statuses[rng.below(statuses.len())]).expect("status"),
        headers: map(rng, n),
        body: match rng.below(4) {
            0 => None,
            1 => Some(Bytes::new()),
            _ => Some(Bytes::from(
                (0..rng.below(3000)).map(|i| i as u8).collect::<Vec<_>>(),
            )),
        },
        trailers: match rng.below(3) {
            0 => None,
            _ => {
                let n = rng.below(5);
                let mut t = map(rng, n);
                t.append("grpc-status", HeaderValue::from_static("3"));
                Some(t)
            }
        },
    }
}

/// Equal, and every line in the same order (`HeaderMap`'s `==` ignores the order of names).
fn assert_same(a: &StoredResponse, b: &StoredResponse, what: &str) {
    assert_eq!(a, b, "{what}");
    assert_eq!(lines(&a.headers), lines(&b.headers), "{what}: header order");
    assert_eq!(
        a.trailers.as_ref().map(lines),
        b.trailers.as_ref().map(lines),
        "{what}: trailer order"
    );
}

/// §2 (the record keeps status, headers, body, trailers exactly): hostile responses (every
/// known name, names one byte off, repeats, opaque and empty values, trailers) are written
/// byte for byte as the reference `TIR3` writer writes them, read back equal in order, and
/// read the same from the `TIR1` and `TIR2` bytes of the same response.
#[test]
fn s2_tir3_is_written_as_documented_and_every_format_reads_back_the_same() {
    let mut rng = Rng(0x7193);
    for case in 0..400 {
        let response = hostile_response(&mut rng);
        let written = response.to_bytes();
        assert_eq!(written, reference_bytes(&response, 3), "case {case}");
        let read = StoredResponse::from_bytes(&written).expect("decodes");
        assert_same(&read, &response, &format!("case {case} TIR3"));
        let shared = StoredResponse::from_shared(&Bytes::from(written)).expect("decodes");
        assert_same(&shared, &response, &format!("case {case} TIR3 shared"));
        for format in [1u8, 2] {
            let old = reference_bytes(&response, format);
            let read = StoredResponse::from_bytes(&old).expect("an old format decodes");
            assert_same(&read, &response, &format!("case {case} TIR{format}"));
        }
    }
    // Every known name is two bytes, every near one is spelled out.
    for (i, name) in KNOWN.iter().enumerate() {
        let mut headers = HeaderMap::new();
        headers.insert(*name, HeaderValue::from_static(""));
        let r = StoredResponse {
            status: StatusCode::OK,
            headers,
            body: None,
            trailers: None,
        };
        assert_eq!(&r.to_bytes()[6..], &[1, 0, i as u8, 0, 0, 0], "{name}");
    }
    for name in NEAR_KNOWN {
        let mut headers = HeaderMap::new();
        headers.insert(*name, HeaderValue::from_static("v"));
        let r = StoredResponse {
            status: StatusCode::OK,
            headers,
            body: None,
            trailers: None,
        };
        let bytes = r.to_bytes();
        assert_eq!(bytes[7] as usize, name.len(), "{name}");
        assert_eq!(StoredResponse::from_bytes(&bytes), Ok(r), "{name}");
    }
}

/// §2: bytes that are not a record stay corrupt in every format: an index past the table, an
/// index in a format without indexes, a zero-length name in the fixed-width one.
#[test]
fn s2_indexes_outside_the_table_or_the_format_are_corrupt() {
    for index in [24u8, 25, 0x7f, 0xff] {
        let bytes = [&b"TIR3\x00\xc8\x01\x00"[..], &[index], b"\x01v\x00\x00"].concat();
        assert!(StoredResponse::from_bytes(&bytes).is_err(), "index {index}");
    }
    let tir2 = b"TIR2\x00\xc8\x01\x00\x00\x01v\x00\x00";
    assert!(StoredResponse::from_bytes(tir2).is_err());
    let tir1 = b"TIR1\x00\xc8\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00\x01v\x00\x00";
    assert!(StoredResponse::from_bytes(tir1).is_err());
    // A truncated index.
    assert!(StoredResponse::from_bytes(b"TIR3\x00\xc8\x01\x00").is_err());
    // The last index is the last name.
    let last = [&b"TIR3\x00\xc8\x01\x00"[..], &[23u8], b"\x01v\x00\x00"].concat();
    let r = StoredResponse::from_bytes(&last).expect("decodes");
    assert_eq!(r.headers["grpc-status-details-bin"], "v");
}

/// Completes a fresh key with each of `responses` in `store` and reads each back by a claim
/// and by a lookup: the same response, in order.
async fn round_trip_in<St: IdempotencyStore>(store: St, name: &str) {
    let store = &store;
    let mut rng = Rng(0x51_0e + name.len() as u64);
    for case in 0..30 {
        let response = hostile_response(&mut rng);
        let key = ScopedKey::new("s15", unique(&format!("{name}-{case}")));
        let request = req(&key, 30_000, 600_000);
        let lease = match guard("a claim", store.claim(&request))
            .await
            .expect("claim")
        {
            Claim::Acquired(lease) => lease,
            other => panic!("{name}: a fresh key was not acquired: {other:?}"),
        };
        guard(
            "a complete",
            store.complete(&key, lease.token, &response, Duration::from_secs(600)),
        )
        .await
        .expect("complete");
        match guard("a claim", store.claim(&request))
            .await
            .expect("claim")
        {
            Claim::Completed { response: read, .. } => {
                assert_same(&read, &response, &format!("{name} case {case} (claim)"));
            }
            other => panic!("{name}: not completed: {other:?}"),
        }
        let record = guard("a lookup", store.lookup(&key))
            .await
            .expect("lookup")
            .expect("a record");
        assert_same(
            record.response.as_ref().expect("a response"),
            &response,
            &format!("{name} case {case} (lookup)"),
        );
    }
}

// §5 (one behaviour for every store) with §2: hostile responses round-trip exactly through
// every store.
common::on_every_store!(round_trip_in);

/// The lines a replay must repeat: known names (repeated), near-known ones, others.
fn replayed_lines() -> Vec<(&'static str, &'static str)> {
    vec![
        ("content-type", "application/vnd.s15+json"),
        ("etag", "\"v1\""),
        ("location", "/orders/15"),
        ("vary", "accept"),
        ("vary", "accept-encoding"),
        ("link", "</a>; rel=next"),
        ("link", "</b>; rel=prev"),
        ("cache-control", "no-store"),
        ("content-typf", "near"),
        ("grpc-statu", "near"),
        ("etagg", "near"),
        ("x-content-type-options", "nosniff"),
        ("retry-after", "7"),
        ("server", "s15"),
        ("age", "0"),
        ("allow", "POST"),
        ("x-custom", "one"),
        ("x-custom", ""),
        ("x-custom", "three"),
        ("strict-transport-security", "max-age=1"),
        ("access-control-allow-origin", "*"),
        ("content-language", "fr"),
    ]
}

/// A route answering 201 with `replayed_lines` and a binary body.
fn replay_app<St: IdempotencyStore + Clone>(store: St, effects: Effects) -> Router {
    Router::new()
        .route(
            "/o",
            post(move || {
                let effects = effects.clone();
                async move {
                    effects.hit();
                    let mut res = Response::builder().status(StatusCode::CREATED);
                    for (n, v) in replayed_lines() {
                        res = res.header(n, v);
                    }
                    res.body(Body::from((0u8..=255).collect::<Vec<_>>()))
                        .expect("response")
                }
            }),
        )
        .layer(IdempotencyLayer::new(store).single_tenant())
}

/// §7.1 over real HTTP for one store: the replay has the first answer's status, every kept
/// line in order (known names as indexes, near ones spelled), and body bytes; one effect.
async fn replays_over_http<St: IdempotencyStore + Clone>(store: St, name: &str) {
    let effects = Effects::default();
    let addr = serve(replay_app(store, effects.clone())).await;
    let client = common::client();
    let key = unique(name);
    let send = || {
        let request = client
            .post(format!("http://{addr}/o"))
            .header("idempotency-key", &key)
            .send();
        async { guard("a request", request).await.expect("response") }
    };
    let names: Vec<String> = replayed_lines()
        .iter()
        .map(|(n, _)| (*n).to_owned())
        .collect();
    let first = send().await;
    assert_eq!(first.status(), StatusCode::CREATED, "{name}");
    let first_lines = lines_of(first.headers(), &names);
    let expected: Vec<(String, Vec<u8>)> = {
        // The handler's lines, grouped by name in first-seen order as a header map sends them.
        let mut map = HeaderMap::new();
        for (n, v) in replayed_lines() {
            map.append(n, HeaderValue::from_static(v));
        }
        lines(&map)
    };
    assert_eq!(first_lines, expected, "{name}: the first answer");
    let first_body = first.bytes().await.expect("body");
    for _ in 0..2 {
        let replay = send().await;
        assert_eq!(replay.status(), StatusCode::CREATED, "{name}");
        assert_eq!(replay.headers()["idempotency-replayed"], "true", "{name}");
        assert_eq!(lines_of(replay.headers(), &names), expected, "{name}");
        assert_eq!(replay.bytes().await.expect("body"), first_body, "{name}");
    }
    assert_eq!(effects.count(), 1, "{name}");
}

// §7.1 with §5: replays over HTTP are the first answer, from every store.
common::on_every_store!(replays_over_http);

// =============================================================================================
// 5. MemoryStore's clock (`Clock::Monotonic`, `with_clock`): DESIGN §1 step 6 (in flight while
//    the lease lives, absent past the TTL), §2, §4.
// =============================================================================================

fn ms_since_epoch(t: SystemTime) -> u128 {
    t.duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_millis()
}

/// §2/§4 on the default clock: times read as wall-clock times (not since the process start
/// or the epoch), a lease ends `lease` after the claim and a completed record `ttl` after it
/// completed, to the millisecond.
#[tokio::test]
async fn s4_the_default_clock_reads_wall_time_and_sets_exact_lease_and_ttl() {
    let store = MemoryStore::new();
    let key = ScopedKey::new("s15", unique("clock"));
    let (lease, ttl) = (Duration::from_millis(30_000), Duration::from_millis(7_000));
    let request = req(&key, 30_000, 7_000);
    let before = SystemTime::now();
    let Claim::Acquired(held) = store.claim(&request).await.expect("claim") else {
        panic!("a fresh key");
    };
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    // Within a day of the wall clock: a clock counting from zero or from the process start
    // would be decades off.
    let day = Duration::from_secs(86_400);
    assert!(record.created_at + day > before && record.created_at < before + day);
    assert_eq!(record.lease_until, held.until);
    assert_eq!(
        ms_since_epoch(record.lease_until) - ms_since_epoch(record.created_at),
        lease.as_millis()
    );
    assert_eq!(held.attempt, 1);
    let response = StoredResponse {
        status: StatusCode::OK,
        headers: HeaderMap::new(),
        body: Some(Bytes::from_static(b"done")),
        trailers: None,
    };
    store
        .complete(&key, held.token, &response, ttl)
        .await
        .expect("complete");
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(
        ms_since_epoch(record.expires_at) - ms_since_epoch(record.updated_at),
        ttl.as_millis()
    );
    assert!(record.updated_at >= record.created_at);
}

/// §1 step 6 on the default clock: a live lease is in flight; once it has run out (waited for
/// with a bounded poll, never a timing assertion) the next claim takes it over as attempt 2; a
/// completed record replays until its TTL, then is absent.
#[tokio::test]
async fn s1_6_leases_and_ttls_run_out_on_the_default_clock() {
    let store = MemoryStore::new();
    let long = ScopedKey::new("s15", unique("long"));
    let request = req(&long, 60_000, 60_000);
    assert!(matches!(
        store.claim(&request).await,
        Ok(Claim::Acquired(_))
    ));
    for _ in 0..3 {
        assert!(
            matches!(store.claim(&request).await, Ok(Claim::Existing { .. })),
            "a live lease is in flight"
        );
    }

    let short = ScopedKey::new("s15", unique("short"));
    // A long TTL: the record outlives the lease, so the claim finds an expired lease, not
    // an expired record.
    let request = req(&short, 80, 60_000);
    let Ok(Claim::Acquired(first)) = store.claim(&request).await else {
        panic!("a fresh key");
    };
    let taken = Arc::new(Mutex::new(None));
    guard("the lease to run out", async {
        loop {
            match store.claim(&request).await.expect("claim") {
                Claim::Acquired(lease) => {
                    *taken.lock().expect("lock") = Some(lease);
                    break;
                }
                Claim::Existing { record, now } => {
                    // In flight only while the store's clock is before the lease's end.
                    assert!(
                        now < record.lease_until,
                        "an expired lease answered in flight"
                    );
                    assert_eq!(record.lease_token, first.token);
                }
                Claim::Completed { .. } => panic!("never completed"),
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    let taken = taken.lock().expect("lock").take().expect("taken over");
    assert_eq!(taken.attempt, 2);
    assert_ne!(taken.token, first.token);

    let done = ScopedKey::new("s15", unique("ttl"));
    let request = req(&done, 60_000, 100);
    let Ok(Claim::Acquired(held)) = store.claim(&request).await else {
        panic!("a fresh key");
    };
    let response = StoredResponse {
        status: StatusCode::OK,
        headers: HeaderMap::new(),
        body: Some(Bytes::from_static(b"x")),
        trailers: None,
    };
    store
        .complete(&done, held.token, &response, Duration::from_millis(100))
        .await
        .expect("complete");
    guard("the TTL to run out", async {
        loop {
            match store.claim(&request).await.expect("claim") {
                Claim::Acquired(lease) => {
                    assert_eq!(lease.attempt, 1, "an expired record counts as absent");
                    break;
                }
                Claim::Completed { response: r, .. } => assert_eq!(*r, response),
                Claim::Existing { .. } => panic!("a completed record is not in flight"),
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
}

/// §1 step 6 on a clock the application moves (`with_clock`, kept as a closure): to the
/// millisecond, a lease is in flight one millisecond before its end and taken over one after;
/// a completed record replays one millisecond before its TTL and is absent one after.
#[tokio::test]
async fn s1_6_a_given_clock_expires_leases_and_ttls_to_the_millisecond() {
    let now = Arc::new(AtomicU64::new(1_800_000_000_000));
    let store = {
        let now = now.clone();
        MemoryStore::with_clock(move || {
            UNIX_EPOCH + Duration::from_millis(now.load(Ordering::SeqCst))
        })
    };
    let t0 = now.load(Ordering::SeqCst);
    let key = ScopedKey::new("s15", "given");
    let request = req(&key, 1_000, 5_000);
    let Ok(Claim::Acquired(first)) = store.claim(&request).await else {
        panic!("a fresh key");
    };
    assert_eq!(
        first.until,
        UNIX_EPOCH + Duration::from_millis(t0 + 1_000),
        "the lease ends on the given clock"
    );
    now.store(t0 + 999, Ordering::SeqCst);
    assert!(matches!(
        store.claim(&request).await,
        Ok(Claim::Existing { .. })
    ));
    now.store(t0 + 1_001, Ordering::SeqCst);
    let Ok(Claim::Acquired(second)) = store.claim(&request).await else {
        panic!("a lease past its end is taken over");
    };
    assert_eq!(second.attempt, 2);

    let t1 = t0 + 2_000;
    now.store(t1, Ordering::SeqCst);
    let response = StoredResponse {
        status: StatusCode::CREATED,
        headers: HeaderMap::new(),
        body: Some(Bytes::from_static(b"ok")),
        trailers: None,
    };
    store
        .complete(&key, second.token, &response, Duration::from_millis(5_000))
        .await
        .expect("complete");
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(
        record.expires_at,
        UNIX_EPOCH + Duration::from_millis(t1 + 5_000)
    );
    now.store(t1 + 4_999, Ordering::SeqCst);
    assert!(matches!(
        store.claim(&request).await,
        Ok(Claim::Completed { .. })
    ));
    now.store(t1 + 5_001, Ordering::SeqCst);
    assert!(store.lookup(&key).await.expect("lookup").is_none());
    let Ok(Claim::Acquired(third)) = store.claim(&request).await else {
        panic!("a record past its TTL is absent");
    };
    assert_eq!(third.attempt, 1);
}

/// §7.4 over real HTTP on the default clock: within the TTL a retry replays; after it (waited
/// for by polling) the key runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_4_after_the_ttl_the_key_runs_again_on_the_default_clock() {
    let effects = Effects::default();
    let app = {
        let effects = effects.clone();
        Router::new()
            .route(
                "/t",
                post(move || {
                    let effects = effects.clone();
                    async move { format!("run {}", effects.hit()) }
                }),
            )
            .layer(
                IdempotencyLayer::new(MemoryStore::new())
                    .single_tenant()
                    .ttl(Duration::from_millis(300)),
            )
    };
    let addr = serve(app).await;
    let client = common::client();
    let key = unique("ttl-http");
    let send = || {
        let request = client
            .post(format!("http://{addr}/t"))
            .header("idempotency-key", &key)
            .send();
        async { guard("a request", request).await.expect("response") }
    };
    assert_eq!(send().await.text().await.expect("body"), "run 1");
    let mut last = String::new();
    guard("the TTL to run out", async {
        loop {
            let res = send().await;
            let replayed = res.headers().get("idempotency-replayed").is_some();
            last = res.text().await.expect("body");
            if !replayed {
                break;
            }
            assert_eq!(last, "run 1", "a replay within the TTL");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(last, "run 2");
    assert_eq!(effects.count(), 2);
}

// =============================================================================================
// 6. Spans (future.rs, service.rs): DESIGN §6 (spans per request) with §1 step 7.
// =============================================================================================

/// A span's name and its `path`, if it has one.
type Named = (&'static str, Option<String>);

/// One process-wide subscriber (worker threads need it too), with an entered-span stack per
/// thread: each event is kept with the `idempotency` spans around it (their `path`).
struct Shared {
    next: AtomicU64,
    spans: Mutex<HashMap<u64, Named>>,
    events: Mutex<Vec<(String, Vec<Named>)>>,
}

thread_local! {
    static STACK: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

struct Recorder(Arc<Shared>);

struct Fields<'a> {
    message: &'a mut String,
    path: &'a mut Option<String>,
}

impl tracing::field::Visit for Fields<'_> {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        match field.name() {
            "path" => *self.path = Some(value.to_owned()),
            "message" => *self.message = value.to_owned(),
            _ => {}
        }
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            "path" => *self.path = Some(format!("{value:?}").trim_matches('"').to_owned()),
            "message" => *self.message = format!("{value:?}"),
            _ => {}
        }
    }
}

impl tracing::Subscriber for Recorder {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, attributes: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        let id = self.0.next.fetch_add(1, Ordering::SeqCst) + 1;
        let (mut message, mut path) = (String::new(), None);
        attributes.record(&mut Fields {
            message: &mut message,
            path: &mut path,
        });
        self.0
            .spans
            .lock()
            .expect("lock")
            .insert(id, (attributes.metadata().name(), path));
        tracing::span::Id::from_u64(id)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        let (mut message, mut path) = (String::new(), None);
        event.record(&mut Fields {
            message: &mut message,
            path: &mut path,
        });
        let stack = STACK.with(|s| s.borrow().clone());
        let spans = self.0.spans.lock().expect("lock");
        let around = stack
            .iter()
            .filter_map(|id| spans.get(id).cloned())
            .collect();
        self.0.events.lock().expect("lock").push((message, around));
    }

    fn enter(&self, id: &tracing::span::Id) {
        STACK.with(|s| s.borrow_mut().push(id.into_u64()));
    }

    fn exit(&self, id: &tracing::span::Id) {
        STACK.with(|s| {
            let mut s = s.borrow_mut();
            if let Some(at) = s.iter().rposition(|e| *e == id.into_u64()) {
                s.remove(at);
            }
        });
    }
}

fn recorder() -> Arc<Shared> {
    static SHARED: OnceLock<Arc<Shared>> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            let shared = Arc::new(Shared {
                next: AtomicU64::new(0),
                spans: Mutex::default(),
                events: Mutex::default(),
            });
            tracing::subscriber::set_global_default(Recorder(shared.clone()))
                .expect("the only global subscriber");
            shared
        })
        .clone()
}

/// The spans around the first event whose message is `message`, if it was seen.
fn spans_of(shared: &Shared, message: &str) -> Option<Vec<(&'static str, Option<String>)>> {
    shared
        .events
        .lock()
        .expect("lock")
        .iter()
        .find(|(m, _)| m == message)
        .map(|(_, around)| around.clone())
}

/// Whether the request span of `path` is around an event.
fn inside(around: &[(&'static str, Option<String>)], path: &str) -> bool {
    around
        .iter()
        .any(|(name, p)| *name == "idempotency" && p.as_deref() == Some(path))
}

/// Traces `message` when dropped (a handler cancelled mid-way).
struct OnDrop(String);

impl Drop for OnDrop {
    fn drop(&mut self) {
        tracing::info!("{}", self.0);
    }
}

/// A handler that traces, says it started, waits for `go`, then (per `then`) answers or panics.
fn blocking_handler(
    effects: Effects,
    started: Effects,
    go: Arc<Notify>,
    tag: &'static str,
    panic_first: bool,
) -> Router {
    let calls = Arc::new(AtomicUsize::new(0));
    Router::new().route(
        &format!("/{tag}"),
        post(move || {
            let (effects, started, go, calls) =
                (effects.clone(), started.clone(), go.clone(), calls.clone());
            async move {
                let call = calls.fetch_add(1, Ordering::SeqCst);
                if call > 0 {
                    tracing::info!("{}", format!("{tag}: retry ran"));
                    return format!("run {}", effects.hit());
                }
                let _dropped = OnDrop(format!("{tag}: handler dropped"));
                tracing::info!("{}", format!("{tag}: handler started"));
                started.hit();
                go.notified().await;
                tracing::info!("{}", format!("{tag}: handler resumed"));
                if panic_first {
                    panic!("{tag}: the handler fails after its client left");
                }
                std::mem::forget(_dropped);
                format!("run {}", effects.hit())
            }
        }),
    )
}

/// Starts `request` on `app` in process, polls it until the handler started, then drops it:
/// a client hanging up mid-execution, without a socket's timing.
async fn hang_up_mid_execution(app: &Router, request: Request<Body>, started: &Effects) {
    let mut call = Box::pin(app.clone().oneshot(request));
    tokio::select! {
        _ = &mut call => panic!("the handler answered before it was told to"),
        () = until("the handler to start", || started.count() == 1) => {}
    }
    drop(call);
}

fn keyed(path: &str, key: &str) -> Request<Body> {
    Request::post(path)
        .header("idempotency-key", key)
        .body(Body::from("{}"))
        .expect("request")
}

/// §6 with §1 step 7 on a multi-threaded runtime: an execution whose client hung up runs on
/// in its own task, and what it traces there (resuming on any worker) is inside the request's
/// `idempotency` span; so is the layer's own event when the detached handler panics (it gives
/// the key back, and the retry runs once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_a_detached_execution_traces_inside_its_span_on_any_worker() {
    let shared = recorder();
    for (tag, panic_first) in [("s15-detached", false), ("s15-detached-panic", true)] {
        let (effects, started, go) = (
            Effects::default(),
            Effects::default(),
            Arc::new(Notify::new()),
        );
        let app = blocking_handler(
            effects.clone(),
            started.clone(),
            go.clone(),
            tag,
            panic_first,
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
        let path = format!("/{tag}");
        let key = unique(tag);
        hang_up_mid_execution(&app, keyed(&path, &key), &started).await;
        go.notify_one();
        let resumed = format!("{tag}: handler resumed");
        until("the detached handler to resume", || {
            spans_of(&shared, &resumed).is_some()
        })
        .await;
        let around = spans_of(&shared, &resumed).expect("seen");
        assert!(inside(&around, &path), "{tag}: resumed in {around:?}");
        let started_in = spans_of(&shared, &format!("{tag}: handler started")).expect("seen");
        assert!(
            inside(&started_in, &path),
            "{tag}: started in {started_in:?}"
        );
        if panic_first {
            // The layer's own report of the panic, written where the execution finishes.
            let report = "the idempotent handler panicked; releasing the key";
            until("the panic to be reported", || {
                shared
                    .events
                    .lock()
                    .expect("lock")
                    .iter()
                    .any(|(m, around)| m == report && inside(around, &path))
            })
            .await;
            // Released: the retry runs (once), and is then replayed.
            let mut retry = None;
            guard("the key to be released", async {
                loop {
                    let res = app.clone().oneshot(keyed(&path, &key)).await.expect("ok");
                    if res.status() == StatusCode::OK {
                        retry = Some(body_of(res).await);
                        break;
                    }
                    assert_eq!(res.status(), StatusCode::CONFLICT);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
            .await;
            assert_eq!(retry.as_deref(), Some(&b"run 1"[..]));
        } else {
            until("the detached execution to finish", || effects.count() == 1).await;
        }
        // The recorded outcome replays, and nothing runs again.
        let mut replay = None;
        guard("the outcome to be recorded", async {
            loop {
                let res = app.clone().oneshot(keyed(&path, &key)).await.expect("ok");
                if res.headers().get("idempotency-replayed").is_some() {
                    replay = Some(body_of(res).await);
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        assert_eq!(replay.as_deref(), Some(&b"run 1"[..]), "{tag}");
        assert_eq!(effects.count(), 1, "{tag}");
    }
}

/// §6 with a route that treats a hang-up as cancellation: the handler's future is dropped
/// inside the request's span (what it traces on drop belongs to the request), the key is given
/// back, and the retry runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_a_cancelled_execution_is_dropped_inside_its_span() {
    let shared = recorder();
    let tag = "s15-cancelled";
    let (effects, started, go) = (
        Effects::default(),
        Effects::default(),
        Arc::new(Notify::new()),
    );
    let app = blocking_handler(effects.clone(), started.clone(), go.clone(), tag, false).layer(
        IdempotencyLayer::new(MemoryStore::new())
            .single_tenant()
            .cancel_on_disconnect(true),
    );
    let path = format!("/{tag}");
    let key = unique(tag);
    hang_up_mid_execution(&app, keyed(&path, &key), &started).await;
    // Dropped synchronously with the response future.
    let around = spans_of(&shared, &format!("{tag}: handler dropped"))
        .expect("the handler was dropped with its request");
    assert!(inside(&around, &path), "dropped in {around:?}");
    assert!(spans_of(&shared, &format!("{tag}: handler resumed")).is_none());
    let mut body = None;
    guard("the key to be given back", async {
        loop {
            let res = app.clone().oneshot(keyed(&path, &key)).await.expect("ok");
            if res.status() == StatusCode::OK {
                body = Some(body_of(res).await);
                break;
            }
            assert_eq!(res.status(), StatusCode::CONFLICT);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert_eq!(body.as_deref(), Some(&b"run 1"[..]));
    let retried = spans_of(&shared, &format!("{tag}: retry ran")).expect("seen");
    assert!(inside(&retried, &path), "{retried:?}");
    assert_eq!(effects.count(), 1);
}

/// §1 step 6 (a route that waits for the in-flight first request): a waiting retry dropped
/// while it decides changes nothing; the first request's answer is then replayed to the next
/// retry, one effect in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_6_a_retry_dropped_while_it_waits_changes_nothing() {
    let tag = "s15-waiting";
    let (effects, started, go) = (
        Effects::default(),
        Effects::default(),
        Arc::new(Notify::new()),
    );
    let app = blocking_handler(effects.clone(), started.clone(), go.clone(), tag, false).layer(
        IdempotencyLayer::new(MemoryStore::new())
            .single_tenant()
            .wait_for_in_flight(Duration::from_secs(30)),
    );
    let path = format!("/{tag}");
    let key = unique(tag);
    let first = tokio::spawn(app.clone().oneshot(keyed(&path, &key)));
    until("the first to start", || started.count() == 1).await;
    // The waiting retry: polled a while (it waits), then dropped.
    let waiting = app.clone().oneshot(keyed(&path, &key));
    tokio::select! {
        res = waiting => panic!("the retry answered while the first ran: {:?}", res.map(|r| r.status())),
        () = tokio::time::sleep(Duration::from_millis(100)) => {}
    }
    go.notify_one();
    let first = guard("the first", first).await.expect("join").expect("ok");
    assert_eq!(body_of(first).await, "run 1");
    let replay = app.clone().oneshot(keyed(&path, &key)).await.expect("ok");
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(body_of(replay).await, "run 1");
    assert_eq!(effects.count(), 1);
}

// =============================================================================================
// 7. gRPC trailers through the stored format: DESIGN §1 (gRPC replays carry the stored
//    response and trailers), §2.
// =============================================================================================

#[derive(Clone, PartialEq, prost::Message)]
struct Empty {}

const REJECT: &str = "/s15.Trail/Reject";

/// A unary service that answers one empty message and then INVALID_ARGUMENT trailers with the
/// known gRPC names (indexed in `TIR3`), names one byte off them, and repeats.
#[derive(Clone, Default)]
struct Trail {
    effects: Effects,
}

impl tonic::server::NamedService for Trail {
    const NAME: &'static str = "s15.Trail";
}

impl<B: Send + 'static> tower::Service<Request<B>> for Trail {
    type Response = Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<B>) -> Self::Future {
        let n = self.effects.hit();
        Box::pin(async move {
            let mut t = HeaderMap::new();
            t.append("grpc-status", HeaderValue::from_static("3"));
            t.append("grpc-message", HeaderValue::from_static("bad%20ticket"));
            t.append(
                "grpc-status-details-bin",
                HeaderValue::from_static("CAMSCmJhZCB0aWNrZXQ"),
            );
            t.append("grpc-statu", HeaderValue::from_static("near"));
            t.append("grpc-messages", HeaderValue::from_static("near"));
            t.append("x-trailer", HeaderValue::from_static("one"));
            t.append("x-trailer", HeaderValue::from_static("two"));
            t.append(
                "x-run",
                HeaderValue::from_str(&format!("run {n}")).expect("value"),
            );
            let frames = vec![
                Ok::<_, std::convert::Infallible>(http_body::Frame::data(Bytes::from_static(&[
                    0, 0, 0, 0, 0,
                ]))),
                Ok(http_body::Frame::trailers(t)),
            ];
            let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
            let mut res = Response::new(tonic::body::Body::new(body));
            res.headers_mut()
                .insert("content-type", HeaderValue::from_static("application/grpc"));
            res.headers_mut()
                .insert("etag", HeaderValue::from_static("\"g1\""));
            Ok(res)
        })
    }
}

async fn grpc_call(addr: SocketAddr, key: &str) -> tonic::Status {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let mut request = tonic::Request::new(Empty {});
    request
        .metadata_mut()
        .insert("idempotency-key", key.parse().expect("ascii"));
    let answer: Result<tonic::Response<Empty>, tonic::Status> = grpc
        .unary(
            request,
            http::uri::PathAndQuery::from_static(REJECT),
            tonic_prost::ProstCodec::default(),
        )
        .await;
    answer.expect_err("INVALID_ARGUMENT")
}

/// The metadata lines a replay must repeat, in order.
fn grpc_lines(status: &tonic::Status) -> Vec<(String, Vec<u8>)> {
    let names = ["grpc-statu", "grpc-messages", "x-trailer", "x-run"];
    lines(&status.metadata().clone().into_headers())
        .into_iter()
        .filter(|(n, _)| names.contains(&n.as_str()))
        .collect()
}

async fn grpc_replays<St: IdempotencyStore + Clone>(store: St, name: &str) {
    let trail = Trail::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let layer = IdempotencyLayer::new_for_grpc(store)
        .single_tenant()
        .grpc_method(REJECT, |m| m);
    let server = tonic::transport::Server::builder()
        .layer(layer)
        .add_service(trail.clone())
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    tokio::spawn(async move { server.await.expect("grpc server") });
    let key = unique(name);
    let first = guard("the first call", grpc_call(addr, &key)).await;
    assert_eq!(first.code(), tonic::Code::InvalidArgument, "{name}");
    assert_eq!(first.message(), "bad ticket", "{name}");
    let first_lines = grpc_lines(&first);
    assert_eq!(first_lines.len(), 5, "{name}: {first_lines:?}");
    assert_eq!(
        first_lines
            .iter()
            .filter(|(n, _)| n == "x-trailer")
            .map(|(_, v)| v.as_slice())
            .collect::<Vec<_>>(),
        [&b"one"[..], b"two"],
        "{name}: {first_lines:?}"
    );
    for _ in 0..2 {
        let replay = guard("a retry", grpc_call(addr, &key)).await;
        assert_eq!(replay.code(), first.code(), "{name}");
        assert_eq!(replay.message(), first.message(), "{name}");
        assert_eq!(replay.details(), first.details(), "{name}");
        // A failed call's status carries its trailers only (tonic), so the replay marker, a
        // header, is not seen here: the effect count says it was replayed.
        assert_eq!(grpc_lines(&replay), first_lines, "{name}");
    }
    assert_eq!(trail.effects.count(), 1, "{name}");
}

// §1 (gRPC: stored response + trailers) from every store: a rejected call's status, message,
// details and every trailer line (known gRPC names, names one byte off, repeats) replay as
// first sent; one effect.
common::on_every_store!(grpc_replays);

/// §5 (MemoryStore bounds its memory): what records weigh is counted from their stored bytes
/// (now `TIR3`), both ways: completing and removing hostile records brings the weight back to
/// where it started, and a completed record weighs what an in-flight one weighs plus its
/// response's bytes at most.
#[tokio::test]
async fn s5_memory_weight_returns_to_its_start_after_tir3_records_go() {
    let store = MemoryStore::new();
    let start = store.bytes();
    let mut rng = Rng(0xb17e5);
    let mut keys = Vec::new();
    for case in 0..50 {
        let response = hostile_response(&mut rng);
        let key = ScopedKey::new("s15", format!("weight-{case}"));
        let request = req(&key, 30_000, 600_000);
        let Ok(Claim::Acquired(lease)) = store.claim(&request).await else {
            panic!("a fresh key");
        };
        let in_flight = store.bytes();
        store
            .complete(&key, lease.token, &response, Duration::from_secs(600))
            .await
            .expect("complete");
        let grown = store.bytes() - in_flight;
        assert!(
            grown <= response.to_bytes().len() + 64,
            "case {case}: {grown} bytes for a {}-byte response",
            response.to_bytes().len()
        );
        keys.push(key);
    }
    assert!(store.bytes() > start);
    for key in &keys {
        assert!(store.remove(key).await.expect("remove"));
    }
    assert_eq!(store.bytes(), start);
}

// =============================================================================================
// 8. Records written before `TIR3`, read by this version from every durable store: DESIGN §2
//    (records survive; replays are the original bytes).
// =============================================================================================

/// Which durable store, and how to overwrite the response bytes of a single-tenant key there.
enum Durable {
    Sqlite(tower_idempotency::SqliteStore),
    Postgres(tower_idempotency::PostgresStore, &'static str),
    Redis(tower_idempotency::RedisStore),
}

impl Durable {
    async fn rewrite(&self, key: &str, bytes: Vec<u8>) {
        match self {
            Self::Sqlite(store) => {
                let n = sqlx::query(
                    "UPDATE idempotency_records SET response = ? WHERE scope = ? AND key = ?",
                )
                .bind(bytes)
                .bind(&b""[..])
                .bind(key.as_bytes())
                .execute(store.pool())
                .await
                .expect("rewrite")
                .rows_affected();
                assert_eq!(n, 1, "one sqlite row");
            }
            Self::Postgres(store, table) => {
                let n = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "UPDATE {table} SET response = $1 WHERE scope = $2 AND key = $3"
                )))
                .bind(bytes)
                .bind(&b""[..])
                .bind(key.as_bytes())
                .execute(store.pool())
                .await
                .expect("rewrite")
                .rows_affected();
                assert_eq!(n, 1, "one postgres row");
            }
            Self::Redis(store) => {
                let [record, ..] = store.keys(&ScopedKey::new("", key));
                let client = redis::Client::open(common::redis_url()).expect("redis url");
                let mut conn = client
                    .get_multiplexed_async_connection()
                    .await
                    .expect("redis connection");
                let existed: bool = redis::cmd("HEXISTS")
                    .arg(&record)
                    .arg("resp")
                    .query_async(&mut conn)
                    .await
                    .expect("hexists");
                assert!(existed, "the redis record holds a response");
                let () = redis::cmd("HSET")
                    .arg(&record)
                    .arg("resp")
                    .arg(bytes)
                    .query_async(&mut conn)
                    .await
                    .map(|_: i64| ())
                    .expect("hset");
            }
        }
    }

    async fn lookup(&self, key: &str) -> StoredResponse {
        let key = ScopedKey::new("", key);
        let record = match self {
            Self::Sqlite(s) => s.lookup(&key).await,
            Self::Postgres(s, _) => s.lookup(&key).await,
            Self::Redis(s) => s.lookup(&key).await,
        };
        record
            .expect("lookup")
            .expect("a record")
            .response
            .expect("a response")
    }
}

/// §2: a response recorded now, rewritten in the store as `TIR1` and as `TIR2` would have
/// written it (every known name spelled out, repeats), replays over HTTP exactly as first sent,
/// running nothing.
async fn legacy_records_replay(durable: Durable, addr: SocketAddr, effects: Effects, name: &str) {
    let client = common::client();
    let names: Vec<String> = replayed_lines()
        .iter()
        .map(|(n, _)| (*n).to_owned())
        .collect();
    for format in [1u8, 2, 3] {
        let key = unique(&format!("{name}-tir{format}"));
        let send = || {
            let request = client
                .post(format!("http://{addr}/o"))
                .header("idempotency-key", &key)
                .send();
            async { guard("a request", request).await.expect("response") }
        };
        let before = effects.count();
        let first = send().await;
        assert_eq!(first.status(), StatusCode::CREATED, "{name}");
        let first_lines = lines_of(first.headers(), &names);
        let first_body = first.bytes().await.expect("body");
        let stored = guard("a lookup", durable.lookup(&key)).await;
        guard(
            "a rewrite",
            durable.rewrite(&key, reference_bytes(&stored, format)),
        )
        .await;
        assert_same(
            &guard("a lookup", durable.lookup(&key)).await,
            &stored,
            &format!("{name} TIR{format} read back"),
        );
        let replay = send().await;
        assert_eq!(replay.status(), StatusCode::CREATED, "{name} TIR{format}");
        assert_eq!(replay.headers()["idempotency-replayed"], "true");
        assert_eq!(
            lines_of(replay.headers(), &names),
            first_lines,
            "{name} TIR{format}"
        );
        assert_eq!(replay.bytes().await.expect("body"), first_body);
        assert_eq!(effects.count(), before + 1, "{name} TIR{format}");
    }
}

/// §2 with SQLite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_records_in_every_format_replay_from_sqlite() {
    let (store, _path) = common::sqlite("s15-legacy").await;
    let effects = Effects::default();
    let addr = serve(replay_app(store.clone(), effects.clone())).await;
    legacy_records_replay(Durable::Sqlite(store), addr, effects, "legacy-sqlite").await;
}

/// §2 with PostgreSQL (skipped visibly when down).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_records_in_every_format_replay_from_postgres() {
    let table = "tower_idempotency_s15_legacy";
    let Some(store) = common::postgres(table).await else {
        return;
    };
    let effects = Effects::default();
    let addr = serve(replay_app(store.clone(), effects.clone())).await;
    legacy_records_replay(Durable::Postgres(store, table), addr, effects, "legacy-pg").await;
}

/// §2 with Redis (skipped visibly when down).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_records_in_every_format_replay_from_redis() {
    let Some(store) = common::redis("s15-legacy").await else {
        return;
    };
    let effects = Effects::default();
    let addr = serve(replay_app(store.clone(), effects.clone())).await;
    legacy_records_replay(Durable::Redis(store), addr, effects, "legacy-redis").await;
}
