//! Review: fingerprint exactness (DESIGN §1 step 4) and scope isolation (§1 step 2, §2), written
//! to break them.
//!
//! The worst outcomes attacked here: one request's stored answer replayed to a DIFFERENT
//! request (two meanings merged into one fingerprint), and one principal's answer replayed to
//! another (scope bleed). Every claimed merge is shown over real HTTP on 127.0.0.1 with the
//! crate's layer in front of a handler that records what it was asked to do: the second,
//! different request must run (or be refused 422), never be answered with the first one's
//! replay. The differential property tests compare `Fingerprint::of` against independent,
//! strict readers of the same bodies.

use crate::common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::raw::{Raw, parse_raw, raw_post, unique};
use common::{gunzip, gzip, serve};
use http_body_util::BodyExt;
use proptest::prelude::*;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower_idempotency::{Fingerprint, IdempotencyLayer, IdempotencyStore, MemoryStore};

// ---- the sink: what the handler was asked to do -------------------------------------------

/// Every run of the handler, as it understood its request.
#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<String>>>);

impl Sink {
    fn push(&self, what: String) -> usize {
        let mut runs = self.0.lock().expect("sink");
        runs.push(what);
        runs.len()
    }

    fn runs(&self) -> Vec<String> {
        self.0.lock().expect("sink").clone()
    }

    fn count(&self) -> usize {
        self.0.lock().expect("sink").len()
    }
}

/// What a careful handler reads out of a request: its method, the URI it was sent, its media
/// type, and its body decoded as its `Content-Encoding` says and, for forms and multipart
/// bodies, parsed into fields.
async fn understand(req: Request) -> String {
    let (parts, body) = req.into_parts();
    let collected = body.collect().await.expect("body");
    let trailers = collected.trailers().cloned();
    let mut bytes = collected.to_bytes().to_vec();
    let header = |name: &str| {
        parts
            .headers
            .get_all(name)
            .iter()
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .collect::<Vec<_>>()
    };
    let encoding = header("content-encoding");
    if encoding.iter().any(|e| e.eq_ignore_ascii_case("gzip")) {
        bytes = gunzip(&bytes);
    }
    let content_type = header("content-type").join(" | ");
    let media = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    let body = if media == "multipart/form-data" {
        match boundary_of(&content_type) {
            Some(b) => fields_of(&b, &bytes),
            None => "multipart without boundary".to_owned(),
        }
    } else if media == "application/x-www-form-urlencoded" {
        format!("{:?}", strict_form(&bytes))
    } else {
        String::from_utf8_lossy(&bytes).into_owned()
    };
    let trailers = trailers
        .map(|t| {
            t.iter()
                .map(|(n, v)| format!("{n}={}", String::from_utf8_lossy(v.as_bytes())))
                .collect::<Vec<_>>()
                .join(",")
        })
        .unwrap_or_default();
    format!(
        "{} {} [{content_type}] enc={encoding:?} body={body} trailers={trailers}",
        parts.method, parts.uri
    )
}

/// A route (`/op`, `/files/{*rest}`) that records what it understood and answers 201 with
/// its run number and a digest of it.
fn sink_app(sink: &Sink) -> Router {
    let handler = {
        let sink = sink.clone();
        move |req: Request| {
            let sink = sink.clone();
            async move {
                let what = understand(req).await;
                let n = sink.push(what.clone());
                (StatusCode::CREATED, format!("run {n}: {}", short(&what)))
            }
        }
    };
    Router::new()
        .route("/op", post(handler.clone()).patch(handler.clone()))
        .route("/files/{*rest}", post(handler))
}

/// A short, stable digest of a text, for answers that name what they ran.
fn short(text: &str) -> String {
    hex(&Sha256::digest(text.as_bytes())[..6])
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

static KEYS: AtomicUsize = AtomicUsize::new(0);

/// A key no other request of this run uses.
fn fresh_key(what: &str) -> String {
    unique(&format!("{what}-{}", KEYS.fetch_add(1, Ordering::SeqCst)))
}

async fn send(
    addr: SocketAddr,
    path: &str,
    key: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Raw {
    let mut all = vec![("idempotency-key", key)];
    all.extend_from_slice(headers);
    raw_post(addr, path, &all, body).await
}

/// One request as a test names it: path, header lines, body.
#[derive(Clone)]
struct Req {
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Req {
    fn new(path: &str, headers: &[(&str, &str)], body: impl AsRef<[u8]>) -> Self {
        Self {
            path: path.to_owned(),
            headers: headers
                .iter()
                .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
                .collect(),
            body: body.as_ref().to_vec(),
        }
    }

    fn typed(content_type: &str, body: impl AsRef<[u8]>) -> Self {
        Self::new("/op", &[("content-type", content_type)], body)
    }

    async fn send(&self, addr: SocketAddr, key: &str) -> Raw {
        let headers: Vec<(&str, &str)> = self
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        send(addr, &self.path, key, &headers, &self.body).await
    }

    fn describe(&self) -> String {
        format!(
            "{} {:?} {:?}",
            self.path,
            self.headers,
            String::from_utf8_lossy(&self.body)
        )
    }
}

/// Sends `first`, then `second` under the same key. `second` differs from `first` as data
/// (the handler understands it differently), so it must run or be refused 422, never be
/// answered with `first`'s replay. Returns a failure message instead of panicking, so one test
/// can report every pair.
async fn differing_pair(
    addr: SocketAddr,
    sink: &Sink,
    first: &Req,
    second: &Req,
) -> Option<String> {
    let key = fresh_key("pair");
    let before = sink.count();
    let a = first.send(addr, &key).await;
    if a.status != 201 {
        return Some(format!(
            "first request {} answered {} {:?}",
            first.describe(),
            a.status,
            a.text()
        ));
    }
    let b = second.send(addr, &key).await;
    if b.replayed() || (b.status == 201 && b.body == a.body) {
        let runs = sink.runs();
        return Some(format!(
            "MERGED: {} was answered with the replay of {} ({:?}); the handler ran {} time(s): {:?}",
            second.describe(),
            first.describe(),
            b.text(),
            runs.len() - before,
            &runs[before..]
        ));
    }
    if b.status != 201 && b.status != 422 {
        return Some(format!(
            "second request {} answered {} {:?}",
            second.describe(),
            b.status,
            b.text()
        ));
    }
    None
}

/// `first` then `second` under one key: the same request by the contract, so the second is
/// a replay of the first and the handler runs once.
async fn same_pair(addr: SocketAddr, sink: &Sink, first: &Req, second: &Req) -> Option<String> {
    let key = fresh_key("same");
    let before = sink.count();
    let a = first.send(addr, &key).await;
    if a.status != 201 {
        return Some(format!(
            "first {} answered {} {:?}",
            first.describe(),
            a.status,
            a.text()
        ));
    }
    let b = second.send(addr, &key).await;
    if !(b.replayed() && b.body == a.body && sink.count() == before + 1) {
        return Some(format!(
            "{} was not a replay of {}: {} {:?}",
            second.describe(),
            first.describe(),
            b.status,
            b.text()
        ));
    }
    None
}

fn report(failures: Vec<String>) {
    assert!(
        failures.is_empty(),
        "{} failure(s):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

async fn single_tenant_sink() -> (SocketAddr, Sink) {
    let sink = Sink::default();
    let app = sink_app(&sink).layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    (serve(app).await, sink)
}

// ---- a strict multipart reader (RFC 2046 §5.1.1, RFC 7578), written for this review ----------

/// The `boundary` parameter of a Content-Type, as the handler reads it.
fn boundary_of(content_type: &str) -> Option<String> {
    content_type.split(';').skip(1).find_map(|p| {
        let (n, v) = p.split_once('=')?;
        n.trim()
            .eq_ignore_ascii_case("boundary")
            .then(|| v.trim().trim_matches('"').to_owned())
    })
}

/// One part: header lines in the order sent (names lower-cased, values trimmed), content.
type Part = (Vec<(String, String)>, Vec<u8>);

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The parts of a multipart body, or `None` when it does not follow its boundary.
fn strict_parts(boundary: &str, body: &[u8]) -> Option<Vec<Part>> {
    let mut framed = b"\r\n".to_vec();
    framed.extend_from_slice(body);
    let delimiter = [b"\r\n--", boundary.as_bytes()].concat();
    let mut at = find(&framed, &delimiter)? + delimiter.len();
    let mut parts = Vec::new();
    loop {
        let rest = &framed[at..];
        if rest.starts_with(b"--") {
            return Some(parts);
        }
        let pad = rest
            .iter()
            .take_while(|&&b| b == b' ' || b == b'\t')
            .count();
        let rest = rest[pad..].strip_prefix(b"\r\n")?;
        let end = find(rest, &delimiter)?;
        let part = &rest[..end];
        let (head, content) = if let Some(content) = part.strip_prefix(b"\r\n") {
            (&b""[..], content)
        } else {
            let at = find(part, b"\r\n\r\n")?;
            (&part[..at], &part[at + 4..])
        };
        let mut headers = Vec::new();
        if !head.is_empty() {
            let text = std::str::from_utf8(head).ok()?;
            for line in text.split("\r\n") {
                let (name, value) = line.split_once(':')?;
                headers.push((name.to_ascii_lowercase(), value.trim().to_owned()));
            }
        }
        parts.push((headers, content.to_vec()));
        at = framed.len() - rest.len() + end + delimiter.len();
    }
}

/// The `name` parameter of a Content-Disposition value.
fn disposition_name(value: &str) -> Option<String> {
    value.split(';').skip(1).find_map(|p| {
        let (n, v) = p.split_once('=')?;
        (n.trim() == "name").then(|| v.trim().trim_matches('"').to_owned())
    })
}

/// The fields of a multipart body as a handler reads them: each part's name from its first
/// Content-Disposition (as `HeaderMap::get` gives it), its content, and a nested
/// `multipart/form-data` part read with the boundary its own Content-Type declares.
fn fields_of(boundary: &str, body: &[u8]) -> String {
    let Some(parts) = strict_parts(boundary, body) else {
        return "malformed multipart".to_owned();
    };
    let mut out = Vec::new();
    for (headers, content) in parts {
        let first = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        };
        let name = first("content-disposition")
            .and_then(|d| disposition_name(&d))
            .unwrap_or_default();
        let part_type = first("content-type").unwrap_or_default();
        let value = if part_type
            .to_ascii_lowercase()
            .starts_with("multipart/form-data")
        {
            match boundary_of(&part_type) {
                Some(inner) => format!("{{{}}}", fields_of(&inner, &content)),
                None => "nested without boundary".to_owned(),
            }
        } else {
            String::from_utf8_lossy(&content).into_owned()
        };
        out.push(format!("{name}[{part_type}]={value}"));
    }
    out.join("&")
}

// ---- a strict form reader (WHATWG urlencoded parsing, on bytes, no lossy step) --------------

fn strict_form(body: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    let decode = |s: &[u8]| -> Vec<u8> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < s.len() {
            match s[i] {
                b'+' => out.push(b' '),
                b'%' if s.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
                    && s.get(i + 2).is_some_and(u8::is_ascii_hexdigit) =>
                {
                    let h = |b: u8| (b as char).to_digit(16).expect("hex") as u8;
                    out.push(h(s[i + 1]) << 4 | h(s[i + 2]));
                    i += 2;
                }
                b => out.push(b),
            }
            i += 1;
        }
        out
    };
    body.split(|&b| b == b'&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.iter().position(|&b| b == b'=') {
            Some(at) => (decode(&p[..at]), decode(&p[at + 1..])),
            None => (decode(p), Vec::new()),
        })
        .collect()
}

/// Pairs sorted by name only, stably: the order of a repeated name's values is data.
fn by_name<T: Clone + Ord>(mut pairs: Vec<(T, T)>) -> Vec<(T, T)> {
    pairs.sort_by(|a, b| a.0.cmp(&b.0));
    pairs
}

fn fp(content_type: &str, body: &[u8]) -> Option<Fingerprint> {
    let (parts, ()) = http::Request::post("/op")
        .header("content-type", content_type)
        .body(())
        .expect("request")
        .into_parts();
    Fingerprint::of(&parts, body).ok()
}

// ================================================================================================
// §1 step 4: bodies
// ================================================================================================

/// §1 step 4 ("Canonicalisation may only merge what is provably the same request"; README:
/// "A compressed *request* is fingerprinted as sent"): a body sent with `Content-Encoding:
/// gzip` and the same bytes sent without it (an opaque `.gz` upload) are two different
/// requests: the handler decodes the first and stores the second as it is. The second must not
/// be answered with the first's replay.
#[tokio::test]
async fn s1_4_content_encoding_of_the_request_counts() {
    let (addr, sink) = single_tenant_sink().await;
    let compressed = gzip(b"transfer 100 EUR to alice");
    let first = Req::new(
        "/op",
        &[
            ("content-type", "application/octet-stream"),
            ("content-encoding", "gzip"),
        ],
        &compressed,
    );
    let second = Req::new(
        "/op",
        &[("content-type", "application/octet-stream")],
        &compressed,
    );
    let mut failures = Vec::new();
    failures.extend(differing_pair(addr, &sink, &first, &second).await);
    failures.extend(differing_pair(addr, &sink, &second, &first).await);
    report(failures);
}

/// §1 step 4 / README "Compression": a JSON body sent gzip-compressed (`Content-Encoding:
/// gzip`) is a well-formed request, "fingerprinted as sent"; it must reach its handler (and
/// its retry be replayed), not be refused 400 as malformed JSON because the layer parsed the
/// compressed bytes as JSON.
#[tokio::test]
async fn s1_4_a_gzip_json_request_is_fingerprinted_as_sent_not_refused() {
    let (addr, sink) = single_tenant_sink().await;
    let body = gzip(br#"{"amount":100,"to":"alice"}"#);
    let req = Req::new(
        "/op",
        &[
            ("content-type", "application/json"),
            ("content-encoding", "gzip"),
        ],
        &body,
    );
    let key = fresh_key("gzip-json");
    let first = req.send(addr, &key).await;
    assert_eq!(
        first.status,
        201,
        "a gzip-encoded JSON request: {} {:?}",
        first.status,
        first.text()
    );
    let again = req.send(addr, &key).await;
    assert!(again.replayed() && again.body == first.body, "{again:?}");
    assert_eq!(sink.count(), 1);
}

/// §1 step 4 ("multipart/form-data by its parts"; "may only merge what is provably the same
/// request"): inside one part, two lines of the same header name in another order are another
/// part: a reader takes the first `Content-Disposition` (as `HeaderMap::get` does), so the
/// field is `to` in one request and `cc` in the other. Sorting a part's header lines
/// (name, value) merges them.
#[tokio::test]
async fn s1_4_multipart_repeated_part_headers_keep_their_order() {
    let (addr, sink) = single_tenant_sink().await;
    let ct = "multipart/form-data; boundary=b0undary";
    let body = |first: &str, second: &str| {
        format!(
            "--b0undary\r\nContent-Disposition: form-data; name=\"{first}\"\r\n\
             Content-Disposition: form-data; name=\"{second}\"\r\n\r\nalice@example.com\r\n\
             --b0undary--\r\n"
        )
    };
    let a = Req::typed(ct, body("to", "cc"));
    let b = Req::typed(ct, body("cc", "to"));
    let mut failures = Vec::new();
    failures.extend(differing_pair(addr, &sink, &a, &b).await);
    // Same with a part's own header that is not Content-Disposition.
    let tagged = |first: &str, second: &str| {
        Req::typed(
            ct,
            format!(
                "--b0undary\r\nContent-Disposition: form-data; name=\"x\"\r\nContent-Type: {first}\r\n\
                 Content-Type: {second}\r\n\r\n{{}}\r\n--b0undary--\r\n"
            ),
        )
    };
    failures.extend(
        differing_pair(
            addr,
            &sink,
            &tagged("application/json", "text/plain"),
            &tagged("text/plain", "application/json"),
        )
        .await,
    );
    report(failures);
}

/// §1 step 4 ("media-type parameters count"; only "a multipart `boundary`" of the request is
/// dropped, "as [it changes] nothing"): a part whose own Content-Type is
/// `multipart/form-data; boundary=X` has content that is read with X. The same content under
/// `boundary=Y` holds other fields (here: amount 100 vs amount 999999), so the part's boundary
/// is data; dropping it merges two different requests.
#[tokio::test]
async fn s1_4_a_nested_parts_boundary_is_data() {
    let (addr, sink) = single_tenant_sink().await;
    let nested = "--X\r\nContent-Disposition: form-data; name=\"amount\"\r\n\r\n100\r\n--X--\r\n\
                  --Y\r\nContent-Disposition: form-data; name=\"amount\"\r\n\r\n999999\r\n--Y--";
    let outer = |inner: &str| {
        Req::typed(
            "multipart/form-data; boundary=outer",
            format!(
                "--outer\r\nContent-Disposition: form-data; name=\"bundle\"\r\n\
                 Content-Type: multipart/form-data; boundary={inner}\r\n\r\n{nested}\r\n--outer--\r\n"
            ),
        )
    };
    let (x, y) = (outer("X"), outer("Y"));
    let failures: Vec<String> = differing_pair(addr, &sink, &x, &y)
        .await
        .into_iter()
        .collect();
    // What the handler understood, for the report.
    let runs = sink.runs();
    assert!(
        runs.first().is_some_and(|r| r.contains("amount[]=100")),
        "the handler reads the nested part with its own boundary: {runs:?}"
    );
    report(failures);
}

/// §1 step 4 ("a value with no exact canonical form (... an undecodable escape ...) is hashed
/// by its raw bytes in its own domain"): a JSON string holding a lone surrogate escape
/// (`"\ud800"`, valid JSON grammar per RFC 8259 §7) has no canonical form; it must be
/// fingerprinted by its bytes and run, its byte-identical retry replayed, and `"\ud801"` kept
/// apart. Refusing it 400 is not what the contract says.
#[tokio::test]
async fn s1_4_a_lone_surrogate_is_hashed_raw_not_refused() {
    let (addr, sink) = single_tenant_sink().await;
    let a = Req::typed("application/json", br#"{"note":"\ud800"}"#);
    let key = fresh_key("surrogate");
    let first = a.send(addr, &key).await;
    assert_eq!(
        first.status,
        201,
        "a lone surrogate escape: {} {:?}",
        first.status,
        first.text()
    );
    let again = a.send(addr, &key).await;
    assert!(again.replayed(), "{again:?}");
    let other = Req::typed("application/json", br#"{"note":"\ud801"}"#);
    let b = other.send(addr, &key).await;
    assert!(!b.replayed() && b.status == 422, "{b:?}");
    assert_eq!(sink.count(), 1);
}

/// §1 step 4 (JSON "values do [matter]"; no exact canonical form -> raw bytes, own domain):
/// pairs of JSON bodies that differ as data must never share an answer: NUL vs empty string,
/// duplicate names in either order, numbers a double cannot hold, values that underflow or
/// overflow, NFC vs NFD, `\/` vs `\\/`, array order, type changes, escaped duplicate names.
#[tokio::test]
async fn s1_4_json_bodies_that_differ_as_data_never_share_an_answer() {
    let (addr, sink) = single_tenant_sink().await;
    let pairs: &[(&str, &str)] = &[
        (r#"{"a":"\u0000"}"#, r#"{"a":""}"#),
        (r#"{"a":1,"a":2}"#, r#"{"a":2,"a":1}"#),
        (r#"{"a":1,"\u0061":2}"#, r#"{"a":2,"\u0061":1}"#),
        (r#"{"a":0.1}"#, r#"{"a":0.10000000000000001}"#),
        (
            r#"{"a":123456789012345678901234567890}"#,
            r#"{"a":123456789012345678901234567891}"#,
        ),
        (r#"{"a":1e400}"#, r#"{"a":1e401}"#),
        (r#"{"a":1e-400}"#, r#"{"a":-1e-400}"#),
        (r#"{"a":5e-324}"#, r#"{"a":4e-324}"#),
        (r#"{"a":2.5e-324}"#, r#"{"a":0}"#),
        (r#"{"a":"\u00e9"}"#, r#"{"a":"e\u0301"}"#),
        (r#"{"a":"\/"}"#, r#"{"a":"\\/"}"#),
        (r#"["a","b"]"#, r#"["b","a"]"#),
        (r#"{"a":[1,{"b":2}]}"#, r#"{"a":[1,{"b":"2"}]}"#),
        (r#"{"a":true}"#, r#"{"a":"true"}"#),
        (r#"{"":1}"#, r#"{" ":1}"#),
        (r#"{"a":null}"#, r#"{}"#),
        (
            r#"{"a":17976931348623157e292}"#,
            r#"{"a":17976931348623158e292}"#,
        ),
        (r#"{"a":"\ud83d\ude00"}"#, r#"{"a":"\ud83d\ude01"}"#),
    ];
    let mut failures = Vec::new();
    for (first, second) in pairs {
        let a = Req::typed("application/json", first);
        let b = Req::typed("application/json", second);
        failures.extend(differing_pair(addr, &sink, &a, &b).await);
    }
    report(failures);
}

/// §1 step 4 and §7.2 ("Same key, same JSON with keys reordered -> replay"; RFC 8785): the
/// same document written differently (escapes for plain characters, member order, whitespace,
/// exponent form, a `*+json` type, `charset=utf-8` and the type's case) is one request.
#[tokio::test]
async fn s1_4_json_written_differently_is_one_request() {
    let (addr, sink) = single_tenant_sink().await;
    let pairs: &[(&str, &str, &str, &str)] = &[
        (
            "application/json",
            r#"{"a":"\u002F"}"#,
            "application/json",
            r#"{"a":"/"}"#,
        ),
        (
            "application/json",
            r#"{"\u0061":1}"#,
            "application/json",
            r#"{"a":1}"#,
        ),
        (
            "application/json",
            r#"{"a":1E2}"#,
            "application/json",
            r#"{"a":100}"#,
        ),
        (
            "application/json",
            r#"{"a":"\u00E9"}"#,
            "application/json",
            "{\"a\":\"\u{e9}\"}",
        ),
        (
            "application/json",
            "{\"b\":1, \"a\":[ 1 ,\n 2 ]}",
            "application/json",
            r#"{"a":[1,2],"b":1}"#,
        ),
        (
            "application/vnd.api+json",
            r#"{"b":1,"a":2}"#,
            "application/vnd.api+json",
            r#"{"a":2,"b":1}"#,
        ),
        (
            "application/json; charset=utf-8",
            r#"{"a":1}"#,
            "APPLICATION/JSON",
            r#"{ "a" : 1 }"#,
        ),
    ];
    let mut failures = Vec::new();
    for (t1, b1, t2, b2) in pairs {
        failures.extend(same_pair(addr, &sink, &Req::typed(t1, b1), &Req::typed(t2, b2)).await);
    }
    report(failures);
}

/// §1 step 4 ("x-www-form-urlencoded as sorted pairs"; module docs: a repeated name's values
/// keep their order, escapes stay the bytes they name): form bodies that decode to different
/// pairs never share an answer; the strict reader in this file says what each one means.
#[tokio::test]
async fn s1_4_form_bodies_that_decode_differently_never_share_an_answer() {
    let (addr, sink) = single_tenant_sink().await;
    let form = "application/x-www-form-urlencoded";
    let differ: &[(&[u8], &[u8])] = &[
        (b"a=1&a=2", b"a=2&a=1"),
        (b"a=%2B", b"a=+"),
        (b"a=%2B", b"a=%20"),
        (b"x=%FF", b"x=%C3%BF"),
        (b"a=%zz", b"a=zz"),
        (b"a%3Db=c", b"a=b%3Dc"),
        (b"a=1%26b=2", b"a=1&b=2"),
        (b"to=alice&x=1&to=bob", b"to=bob&x=1&to=alice"),
        (b"a=\xff", b"a=\xfe"),
        (b"a=1;b=2", b"b=2;a=1"),
    ];
    let mut failures = Vec::new();
    for (first, second) in differ {
        assert_ne!(
            by_name(strict_form(first)),
            by_name(strict_form(second)),
            "the pair is meant to differ"
        );
        failures.extend(
            differing_pair(
                addr,
                &sink,
                &Req::typed(form, first),
                &Req::typed(form, second),
            )
            .await,
        );
    }
    let same: &[(&[u8], &[u8])] = &[
        (b"a=1&b=2", b"b=2&a=1"),
        (b"a=%41", b"a=A"),
        (b"a+b=1", b"a%20b=1"),
        (b"a=1&&b=2", b"a=1&b=2"),
        (b"a=%e9", b"a=%E9"),
    ];
    for (first, second) in same {
        failures.extend(
            same_pair(
                addr,
                &sink,
                &Req::typed(form, first),
                &Req::typed(form, second),
            )
            .await,
        );
    }
    report(failures);
}

/// §1 step 4 ("multipart/form-data by its parts"): parts that differ in what a reader takes
/// from them (file name, the part's media type, its charset, the field name, content bytes
/// including CRLF vs LF, the number of parts) never share an answer, whatever the boundary.
#[tokio::test]
async fn s1_4_multipart_parts_that_differ_never_share_an_answer() {
    let (addr, sink) = single_tenant_sink().await;
    let part = |boundary: &str, disposition: &str, part_type: Option<&str>, content: &str| {
        let typed = part_type.map_or(String::new(), |t| format!("Content-Type: {t}\r\n"));
        Req::typed(
            &format!("multipart/form-data; boundary={boundary}"),
            format!(
                "--{boundary}\r\nContent-Disposition: {disposition}\r\n{typed}\r\n{content}\r\n--{boundary}--\r\n"
            ),
        )
    };
    let file = r#"form-data; name="f"; filename="a.txt""#;
    let pairs = [
        (
            part("b1", file, None, "x"),
            part("b2", r#"form-data; name="f"; filename="b.txt""#, None, "x"),
        ),
        (
            part("b1", file, Some("text/plain"), "x"),
            part("b2", file, Some("application/octet-stream"), "x"),
        ),
        (
            part("b1", file, Some("text/plain; charset=utf-8"), "x"),
            part("b2", file, Some("text/plain; charset=iso-8859-1"), "x"),
        ),
        (
            part("b1", r#"form-data; name="f""#, None, "x"),
            part("b2", r#"form-data; name="g""#, None, "x"),
        ),
        (
            part("b1", file, None, "line1\r\nline2"),
            part("b2", file, None, "line1\nline2"),
        ),
        (part("b1", file, None, "x "), part("b1", file, None, "x")),
    ];
    let mut failures = Vec::new();
    for (a, b) in &pairs {
        failures.extend(differing_pair(addr, &sink, a, b).await);
    }
    // The boundary, preamble and epilogue are not data.
    let with = |boundary: &str, preamble: &str, epilogue: &str| {
        Req::typed(
            &format!("multipart/form-data; boundary=\"{boundary}\""),
            format!(
                "{preamble}--{boundary}\r\nContent-Disposition: form-data; name=\"f\"\r\n\r\nv\r\n--{boundary}--\r\n{epilogue}"
            ),
        )
    };
    failures.extend(
        same_pair(
            addr,
            &sink,
            &with("AaB03x", "", ""),
            &with("----random-7MA4YWxkTrZu0gW", "ignored\r\n", "also ignored"),
        )
        .await,
    );
    report(failures);
}

/// §1 step 4 ("media-type parameters count"; only JSON's `charset=utf-8` and a multipart
/// `boundary` are dropped): parameters that change meaning keep two requests apart.
#[tokio::test]
async fn s1_4_media_type_parameters_keep_requests_apart() {
    let (addr, sink) = single_tenant_sink().await;
    let pairs: &[(&str, &str, &str)] = &[
        ("application/merge-patch+json", "application/json", "{}"),
        (
            "application/json; profile=\"a\"",
            "application/json; profile=\"b\"",
            "{}",
        ),
        (
            "text/plain; charset=utf-8",
            "text/plain; charset=utf-16",
            "hi",
        ),
        (
            "text/plain; format=flowed",
            "text/plain; format=fixed",
            "hi",
        ),
        (
            "application/x-www-form-urlencoded; charset=iso-8859-1",
            "application/x-www-form-urlencoded",
            "a=%E9",
        ),
        ("text/plain", "application/octet-stream", "hi"),
        ("application/json; charset=utf-16", "application/json", "{}"),
    ];
    let mut failures = Vec::new();
    for (t1, t2, body) in pairs {
        failures.extend(
            differing_pair(addr, &sink, &Req::typed(t1, body), &Req::typed(t2, body)).await,
        );
    }
    report(failures);
}

/// §1 step 4 ("the full path the client sent ... and query"): `/files/a%2Fb` (one segment
/// holding a slash) and `/files/a/b` (two segments) are different resources; query order and
/// method count as sent.
#[tokio::test]
async fn s1_4_path_query_and_method_count_as_sent() {
    let (addr, sink) = single_tenant_sink().await;
    let ct = [("content-type", "text/plain")];
    let mut failures = Vec::new();
    failures.extend(
        differing_pair(
            addr,
            &sink,
            &Req::new("/files/a%2Fb", &ct, "x"),
            &Req::new("/files/a/b", &ct, "x"),
        )
        .await,
    );
    failures.extend(
        differing_pair(
            addr,
            &sink,
            &Req::new("/op?a=1&b=2", &ct, "x"),
            &Req::new("/op?a=1&b=3", &ct, "x"),
        )
        .await,
    );
    failures.extend(
        differing_pair(
            addr,
            &sink,
            &Req::new("/op?to=alice&to=bob", &ct, "x"),
            &Req::new("/op?to=bob&to=alice", &ct, "x"),
        )
        .await,
    );
    // PATCH and POST on one route, one key.
    let key = fresh_key("method");
    let first = Req::new("/op", &ct, "x").send(addr, &key).await;
    assert_eq!(first.status, 201);
    let patch = {
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let head = format!(
            "PATCH /op HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\nidempotency-key: {key}\r\n\
             content-type: text/plain\r\ncontent-length: 1\r\n\r\nx"
        );
        stream.write_all(head.as_bytes()).await.expect("write");
        let mut buf = Vec::new();
        stream.read_to_end(&mut buf).await.expect("read");
        parse_raw(&buf)
    };
    if patch.replayed() {
        failures.push(format!("PATCH got POST's replay: {patch:?}"));
    }
    report(failures);
}

/// §1 step 4 ("the full path the client sent ... and query"): `/op?` (an empty query, which
/// RFC 3986 §6.2.3 does not license removing) and `/op` are different request targets, and a
/// handler reading the raw URI (axum `RawQuery`: `Some("")` vs `None`) sees them differently.
#[tokio::test]
async fn s1_4_an_empty_query_is_not_no_query() {
    let (addr, sink) = single_tenant_sink().await;
    let ct = [("content-type", "text/plain")];
    let failures = differing_pair(
        addr,
        &sink,
        &Req::new("/op?", &ct, "x"),
        &Req::new("/op", &ct, "x"),
    )
    .await;
    report(failures.into_iter().collect());
}

/// §1 step 3 ("The inner service receives an identical request (same ... body bytes)") and
/// step 4: a chunked request's trailer fields reach the handler exactly as they do without the
/// layer, and two requests differing only in a trailer the handler reads (a checksum) are not
/// one request.
#[tokio::test]
async fn s1_3_request_trailers_reach_the_handler_and_count() {
    let sink = Sink::default();
    let guarded = sink_app(&sink).layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let plain_sink = Sink::default();
    let app = Router::new()
        .nest("/guarded", guarded)
        .nest("/plain", sink_app(&plain_sink));
    let addr = serve(app).await;
    let chunked = |path: &str, key: &str, sum: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\nidempotency-key: {key}\r\n\
             content-type: text/plain\r\ntransfer-encoding: chunked\r\ntrailer: x-checksum\r\n\r\n\
             5\r\nhello\r\n0\r\nx-checksum: {sum}\r\n\r\n"
        )
    };
    let raw = |text: String| async move {
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        stream.write_all(text.as_bytes()).await.expect("write");
        let mut buf = Vec::new();
        stream.read_to_end(&mut buf).await.expect("read");
        parse_raw(&buf)
    };
    let key = fresh_key("trailers");
    let p = raw(chunked("/plain/op", &key, "sum-1")).await;
    assert_eq!(p.status, 201, "{p:?}");
    let g = raw(chunked("/guarded/op", &key, "sum-1")).await;
    assert_eq!(g.status, 201, "{g:?}");
    let (seen_plain, seen_guarded) = (plain_sink.runs(), sink.runs());
    let trailers = |s: &str| s.split("trailers=").nth(1).unwrap_or_default().to_owned();
    assert_eq!(
        trailers(&seen_guarded[0]),
        trailers(&seen_plain[0]),
        "the handler behind the layer sees the trailers it sees without it"
    );
    let g2 = raw(chunked("/guarded/op", &key, "sum-2")).await;
    if trailers(&seen_plain[0]).contains("sum-1") {
        assert!(
            !g2.replayed(),
            "a request with another checksum trailer got the first one's replay: {g2:?}"
        );
    }
}

// ================================================================================================
// Differential property tests against strict readers
// ================================================================================================

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    /// §1 step 4, differential: two form bodies share a fingerprint exactly when a strict
    /// byte-level reader (and `form_urlencoded`, lossy) sees the same pairs, sorted by name
    /// with each name's values in order.
    #[test]
    fn form_fingerprints_match_a_strict_reader(
        a in prop::collection::vec(prop::sample::select(b"ab=&+%2B3dF;\xff\xe9".to_vec()), 0..14),
        b in prop::collection::vec(prop::sample::select(b"ab=&+%2B3dF;\xff\xe9".to_vec()), 0..14),
    ) {
        let ct = "application/x-www-form-urlencoded";
        let same = fp(ct, &a).expect("fp") == fp(ct, &b).expect("fp");
        let strict = by_name(strict_form(&a)) == by_name(strict_form(&b));
        let lossy = |x: &[u8]| by_name(form_urlencoded::parse(x).map(|(n, v)| (n.into_owned(), v.into_owned())).collect::<Vec<_>>());
        if same {
            prop_assert_eq!(lossy(&a), lossy(&b));
            prop_assert!(strict, "merged: {:?} / {:?}", String::from_utf8_lossy(&a), String::from_utf8_lossy(&b));
        }
        // An empty body is hashed as raw bytes, whatever its type: the converse only for
        // bodies with something in them.
        if !a.is_empty() && !b.is_empty() {
            prop_assert_eq!(same, strict, "{:?} / {:?}", String::from_utf8_lossy(&a), String::from_utf8_lossy(&b));
        }
    }
}

/// A multipart part as generated: header (name, value) pairs with distinct names, content.
type GenPart = (Vec<(String, String)>, Vec<u8>);

/// How one encoder writes the parts: its boundary, preamble, epilogue, header-name case,
/// spaces after the colon, transport padding after each delimiter.
#[derive(Debug, Clone)]
struct Encoding {
    boundary: String,
    preamble: String,
    epilogue: String,
    upper: bool,
    space: &'static str,
    pad: &'static str,
}

fn encoding() -> impl Strategy<Value = Encoding> {
    (
        prop::sample::select(vec![
            "b",
            "XyZ-0",
            "----WebKitFormBoundary7MA4YWxkTrZu0gW",
            "a.b_c",
        ]),
        prop::sample::select(vec!["", "preamble\r\n", "\r\n", "--x\r\n"]),
        prop::sample::select(vec!["", "\r\n", "epilogue --b\r\n"]),
        any::<bool>(),
        prop::sample::select(vec!["", " ", "  \t"]),
        prop::sample::select(vec!["", " ", "\t "]),
    )
        .prop_map(
            |(boundary, preamble, epilogue, upper, space, pad)| Encoding {
                boundary: boundary.to_owned(),
                preamble: preamble.to_owned(),
                epilogue: epilogue.to_owned(),
                upper,
                space,
                pad,
            },
        )
}

fn gen_parts() -> impl Strategy<Value = Vec<GenPart>> {
    let headers = prop::sample::subsequence(vec!["content-disposition", "x-a", "x-b"], 0..=3)
        .prop_flat_map(|names| {
            let n = names.len();
            (Just(names), prop::collection::vec("[a-z=; \"]{0,5}", n..=n))
        })
        .prop_map(|(names, values)| {
            names
                .into_iter()
                .zip(values)
                .map(|(n, v)| (n.to_owned(), v.trim().to_owned()))
                .collect::<Vec<_>>()
        });
    let content = prop::collection::vec(prop::sample::select(b"ab-:\r\n \x00\xff".to_vec()), 0..10);
    prop::collection::vec((headers, content), 0..4)
}

fn write_multipart(parts: &[GenPart], e: &Encoding) -> (String, Vec<u8>) {
    let mut out = e.preamble.clone().into_bytes();
    for (headers, content) in parts {
        out.extend_from_slice(format!("--{}{}\r\n", e.boundary, e.pad).as_bytes());
        for (name, value) in headers {
            let name = if e.upper {
                name.to_ascii_uppercase()
            } else {
                name.clone()
            };
            out.extend_from_slice(format!("{name}:{}{value}\r\n", e.space).as_bytes());
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(content);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(format!("--{}--{}\r\n{}", e.boundary, e.pad, e.epilogue).as_bytes());
    (
        format!("multipart/form-data; boundary=\"{}\"", e.boundary),
        out,
    )
}

/// The meaning of a multipart body by the strict reader: parts in order, each part's headers
/// sorted (names are distinct here), content bytes.
fn multipart_meaning(content_type: &str, body: &[u8]) -> Option<Vec<Part>> {
    let boundary = boundary_of(content_type)?;
    let mut parts = strict_parts(&boundary, body)?;
    for (headers, _) in &mut parts {
        headers.sort();
    }
    Some(parts)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// §1 step 4, differential: two multipart bodies, written by encoders that differ in
    /// boundary, preamble, epilogue, header case, spacing and padding, share a fingerprint only
    /// when the strict reader sees the same parts; and the same parts always share one.
    #[test]
    fn multipart_fingerprints_match_a_strict_reader(
        a in gen_parts(),
        b in prop_oneof![gen_parts(), Just(Vec::new())],
        same_parts in any::<bool>(),
        ea in encoding(),
        eb in encoding(),
    ) {
        let b = if same_parts { a.clone() } else { b };
        let (ta, xa) = write_multipart(&a, &ea);
        let (tb, xb) = write_multipart(&b, &eb);
        let (fa, fb) = (fp(&ta, &xa), fp(&tb, &xb));
        let (ma, mb) = (multipart_meaning(&ta, &xa), multipart_meaning(&tb, &xb));
        // What the layer accepts, the strict reader reads.
        if fa.is_some() {
            prop_assert!(ma.is_some(), "accepted but not multipart: {:?}", String::from_utf8_lossy(&xa));
        }
        if let (Some(fa), Some(fb), Some(ma), Some(mb)) = (fa, fb, ma, mb) {
            prop_assert_eq!(fa == fb, ma == mb, "{:?}\n{:?}", String::from_utf8_lossy(&xa), String::from_utf8_lossy(&xb));
        }
    }
}

/// A JSON value as generated, with exact numbers: (negative, significant digits without
/// leading or trailing zeros, power of ten of the last digit); zero is `None`.
#[derive(Debug, Clone, PartialEq)]
enum J {
    Null,
    Bool(bool),
    Num(Option<(bool, String, i32)>),
    Str(String),
    Arr(Vec<J>),
    Obj(Vec<(String, J)>),
}

fn j_string() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop::sample::select(vec![
            'a',
            'b',
            '"',
            '\\',
            '/',
            '\u{0}',
            '\u{1f}',
            '\n',
            '\u{7f}',
            '\u{e9}',
            '\u{2028}',
            '\u{e000}',
            '\u{fb33}',
            '\u{1f600}',
        ]),
        0..4,
    )
    .prop_map(|chars| chars.into_iter().collect())
}

fn j_number() -> impl Strategy<Value = Option<(bool, String, i32)>> {
    prop_oneof![
        1 => Just(None),
        6 => (any::<bool>(), "[1-9]([0-9]{0,13}[1-9])?", -20i32..20)
            .prop_map(|(n, d, e)| Some((n, d, e))),
    ]
}

fn j_value() -> impl Strategy<Value = J> {
    let leaf = prop_oneof![
        Just(J::Null),
        any::<bool>().prop_map(J::Bool),
        j_number().prop_map(J::Num),
        j_string().prop_map(J::Str),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(J::Arr),
            prop::collection::btree_map(j_string(), inner, 0..4)
                .prop_map(|m| J::Obj(m.into_iter().collect())),
        ]
    })
}

/// Choices one writer makes: a stream of small numbers read as needed.
struct Choices(Vec<u8>, usize);

impl Choices {
    fn next(&mut self, n: u8) -> u8 {
        let c = self
            .0
            .get(self.1 % self.0.len().max(1))
            .copied()
            .unwrap_or(0);
        self.1 += 1;
        c % n
    }
}

fn write_string(s: &str, c: &mut Choices, out: &mut String) {
    out.push('"');
    for ch in s.chars() {
        let short = match ch {
            '"' => Some("\\\""),
            '\\' => Some("\\\\"),
            '\n' => Some("\\n"),
            '/' => Some("\\/"),
            _ => None,
        };
        let must_escape = matches!(ch, '"' | '\\') || (ch as u32) < 0x20;
        let pick = c.next(3);
        if pick == 0 && !must_escape {
            out.push(ch);
        } else if pick == 1 && short.is_some() {
            out.push_str(short.expect("short"));
        } else {
            let mut units = [0u16; 2];
            for unit in ch.encode_utf16(&mut units) {
                if c.next(2) == 0 {
                    out.push_str(&format!("\\u{unit:04x}"));
                } else {
                    out.push_str(&format!("\\u{unit:04X}"));
                }
            }
        }
    }
    out.push('"');
}

fn write_number(n: &Option<(bool, String, i32)>, c: &mut Choices, out: &mut String) {
    let Some((negative, digits, exp)) = n else {
        out.push_str(["0", "-0", "0.0", "0e5", "-0.000E-2"][usize::from(c.next(5))]);
        return;
    };
    if *negative {
        out.push('-');
    }
    match c.next(3) {
        // digits e exp
        0 => out.push_str(&format!("{digits}e{exp}")),
        // d.ddd E (exp + len - 1), with a trailing zero
        1 => {
            let (first, rest) = digits.split_at(1);
            let e = exp + digits.len() as i32 - 1;
            out.push_str(&format!(
                "{first}.{rest}0E{}{e}",
                if e >= 0 { "+" } else { "" }
            ));
        }
        // plain decimal where short enough
        _ => {
            if *exp >= 0 && *exp < 6 {
                out.push_str(digits);
                out.push_str(&"0".repeat(*exp as usize));
            } else if *exp < 0 && -*exp <= digits.len() as i32 + 5 {
                let point = digits.len() as i32 + exp;
                if point > 0 {
                    out.push_str(&digits[..point as usize]);
                    out.push('.');
                    out.push_str(&digits[point as usize..]);
                } else {
                    out.push_str("0.");
                    out.push_str(&"0".repeat((-point) as usize));
                    out.push_str(digits);
                }
            } else {
                out.push_str(&format!("{digits}e{exp}"));
            }
        }
    }
}

fn write_json(v: &J, c: &mut Choices, out: &mut String) {
    let ws = |c: &mut Choices, out: &mut String| {
        out.push_str(["", " ", "\n\t", "\r\n "][usize::from(c.next(4))])
    };
    match v {
        J::Null => out.push_str("null"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Num(n) => write_number(n, c, out),
        J::Str(s) => write_string(s, c, out),
        J::Arr(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                ws(c, out);
                write_json(item, c, out);
                ws(c, out);
            }
            out.push(']');
        }
        J::Obj(members) => {
            out.push('{');
            let mut order: Vec<usize> = (0..members.len()).collect();
            let rotate = usize::from(c.next(4));
            if !order.is_empty() {
                let len = order.len();
                order.rotate_left(rotate % len);
                if c.next(2) == 0 {
                    order.reverse();
                }
            }
            for (i, &m) in order.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                ws(c, out);
                write_string(&members[m].0, c, out);
                ws(c, out);
                out.push(':');
                ws(c, out);
                write_json(&members[m].1, c, out);
            }
            ws(c, out);
            out.push('}');
        }
    }
}

/// Meaning of a generated value: objects as sorted maps (names are unique), numbers exact.
fn meaning(v: &J) -> J {
    match v {
        J::Obj(members) => {
            let mut m: Vec<(String, J)> = members
                .iter()
                .map(|(k, v)| (k.clone(), meaning(v)))
                .collect();
            m.sort_by(|a, b| a.0.cmp(&b.0));
            J::Obj(m)
        }
        J::Arr(items) => J::Arr(items.iter().map(meaning).collect()),
        other => other.clone(),
    }
}

/// Perturbs the first leaf found: a different meaning.
fn perturb(v: &mut J) -> bool {
    match v {
        J::Null => *v = J::Bool(false),
        J::Bool(b) => *b = !*b,
        J::Num(None) => *v = J::Num(Some((false, "1".into(), -20))),
        // Ten times the value.
        J::Num(Some((_, _, exp))) => *exp += 1,
        J::Str(s) => s.push('\u{0}'),
        J::Arr(items) => {
            if !items.iter_mut().any(perturb) {
                items.push(J::Null);
            }
        }
        J::Obj(members) => {
            if !members.iter_mut().any(|(_, v)| perturb(v)) {
                members.push(("\u{1f600}new".into(), J::Null));
            }
        }
    }
    true
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    /// §1 step 4 and §7.2, differential: one document written by two writers (escapes, member
    /// order, whitespace, number forms with at most 15 significant digits, `-0`) shares one
    /// fingerprint; a document that differs in one leaf never shares it; and the reference
    /// reader (`serde_json` + `serde_json_canonicalizer`) agrees the written texts are JSON.
    #[test]
    fn json_fingerprints_follow_meaning(
        v in j_value(),
        c1 in prop::collection::vec(any::<u8>(), 1..64),
        c2 in prop::collection::vec(any::<u8>(), 1..64),
    ) {
        let (mut t1, mut t2) = (String::new(), String::new());
        write_json(&v, &mut Choices(c1, 0), &mut t1);
        write_json(&v, &mut Choices(c2.clone(), 0), &mut t2);
        let parsed: serde_json::Value = serde_json::from_str(&t1).expect("the writer writes JSON");
        prop_assert!(serde_json_canonicalizer::to_vec(&parsed).is_ok());
        let ct = "application/json";
        let (f1, f2) = (fp(ct, t1.as_bytes()), fp(ct, t2.as_bytes()));
        prop_assert!(f1.is_some() && f2.is_some(), "{} / {}", t1, t2);
        prop_assert_eq!(f1, f2, "one document: {} / {}", t1, t2);
        let mut changed = v.clone();
        perturb(&mut changed);
        prop_assume!(meaning(&changed) != meaning(&v));
        let mut t3 = String::new();
        write_json(&changed, &mut Choices(c2, 0), &mut t3);
        prop_assert_ne!(f1, fp(ct, t3.as_bytes()), "another document: {} / {}", t1, t3);
    }
}

// ================================================================================================
// §1 step 2: scopes
// ================================================================================================

/// The caller, as an app's auth layer knows it.
#[derive(Clone)]
struct User(String);

/// A principal id from the `x-user` header; `long:<n>:<seed>[+<suffix>]` stands for an
/// n-character id that does not compress (hex of a SHA-256 chain), then the suffix.
fn principal_of(header: &str) -> String {
    if let Some(spec) = header.strip_prefix("long:") {
        let (spec, suffix) = spec.split_once('+').unwrap_or((spec, ""));
        let (n, seed) = spec.split_once(':').expect("long:<n>:<seed>");
        let n: usize = n.parse().expect("length");
        let mut out = String::with_capacity(n + 64);
        let mut block = Sha256::digest(seed.as_bytes());
        while out.len() < n {
            out.push_str(&hex(&block));
            block = Sha256::digest(block);
        }
        out.truncate(n);
        out.push_str(suffix);
        return out;
    }
    header.to_owned()
}

async fn auth(mut req: Request, next: Next) -> Response {
    let Some(user) = req
        .headers()
        .get("x-user")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    else {
        return StatusCode::UNAUTHORIZED.into_response();
    };
    req.extensions_mut().insert(User(principal_of(&user)));
    next.run(req).await
}

/// A charge route whose answer names the principal it ran for (by digest).
fn principal_app<St: IdempotencyStore>(store: St, sink: &Sink) -> Router {
    let sink = sink.clone();
    Router::new()
        .route(
            "/charge",
            post(move |req: Request| {
                let sink = sink.clone();
                async move {
                    let who = req
                        .extensions()
                        .get::<User>()
                        .map_or("nobody".to_owned(), |u| u.0.clone());
                    let n = sink.push(who.clone());
                    (
                        StatusCode::CREATED,
                        format!("charge run {n} for {}", short(&who)),
                    )
                }
            }),
        )
        .layer(IdempotencyLayer::new(store).scope_by_principal(|u: &User| u.0.clone()))
        .layer(middleware::from_fn(auth))
}

/// Principals and keys whose scope and key join to the same text (`principal:ab` + `c`,
/// `principal:a` + `bc`), non-ASCII ids in two normal forms, ids holding the `:` a store might
/// split on: each pair must run twice (once per principal) and each retry replay its own.
async fn principals_never_meet(addr: SocketAddr, sink: &Sink, cases: &[(String, String)]) {
    let mut failures = Vec::new();
    let mut firsts = Vec::new();
    for (user, key) in cases {
        let before = sink.count();
        let res = raw_post(
            addr,
            "/charge",
            &[("x-user", user), ("idempotency-key", key)],
            b"{}",
        )
        .await;
        let principal = principal_of(user);
        if res.status != 201 || res.replayed() || sink.count() != before + 1 {
            failures.push(format!(
                "principal {:?} key {key:?}: {} replayed={} runs {} -> {}: {:?}",
                &user[..user.len().min(40)],
                res.status,
                res.replayed(),
                before,
                sink.count(),
                res.text()
            ));
        } else if !res.text().ends_with(&short(&principal)) {
            failures.push(format!(
                "principal {user:?} got another's answer {:?}",
                res.text()
            ));
        }
        firsts.push(res);
    }
    for ((user, key), first) in cases.iter().zip(&firsts) {
        if first.status != 201 {
            continue;
        }
        let again = raw_post(
            addr,
            "/charge",
            &[("x-user", user), ("idempotency-key", key)],
            b"{}",
        )
        .await;
        if !(again.replayed() && again.body == first.body) {
            failures.push(format!(
                "principal {:?} key {key:?}: retry {} {:?}, first {:?}",
                &user[..user.len().min(40)],
                again.status,
                again.text(),
                first.text()
            ));
        }
    }
    report(failures);
}

fn split_cases() -> Vec<(String, String)> {
    let k = fresh_key("split");
    vec![
        ("ab".into(), format!("c{k}")),
        ("a".into(), format!("bc{k}")),
        ("abc".into(), k.clone()),
        ("a:b".into(), format!("c:{k}")),
        ("a".into(), format!(":bc:{k}")),
        ("a:bc".into(), format!(":{k}")),
        ("\u{e9}".into(), k.clone()),
        ("e\u{301}".into(), k.clone()),
        ("1".into(), format!(":{k}")),
        ("1:".into(), k.clone()),
    ]
}

/// §1 step 2 ("Two principals using the same key can never see each other's records or
/// responses") on the MemoryStore, plus builders sharing one store: a principal `x`, a closure
/// scope that returns `principal:x`, and the single tenant never share a record.
#[tokio::test]
async fn s1_2_principals_never_meet_on_memory_and_builders_never_collide() {
    let store = MemoryStore::new();
    let sink = Sink::default();
    let addr = serve(principal_app(store.clone(), &sink)).await;
    principals_never_meet(addr, &sink, &split_cases()).await;

    // Three builders on one store, same path, same body, same key.
    let closure_sink = Sink::default();
    let closure = {
        let sink = closure_sink.clone();
        Router::new()
            .route(
                "/charge",
                post(move || {
                    let sink = sink.clone();
                    async move {
                        let n = sink.push("closure".into());
                        (StatusCode::CREATED, format!("closure run {n}"))
                    }
                }),
            )
            .layer(
                IdempotencyLayer::new(store.clone()).scope_with(|p: &http::request::Parts| {
                    p.headers
                        .get("x-user")
                        .and_then(|v| v.to_str().ok())
                        .map(|u| format!("principal:{u}"))
                }),
            )
    };
    let tenant_sink = Sink::default();
    let tenant = {
        let sink = tenant_sink.clone();
        Router::new()
            .route(
                "/charge",
                post(move || {
                    let sink = sink.clone();
                    async move {
                        let n = sink.push("tenant".into());
                        (StatusCode::CREATED, format!("tenant run {n}"))
                    }
                }),
            )
            .layer(IdempotencyLayer::new(store.clone()).single_tenant())
    };
    let (closure_addr, tenant_addr) = (serve(closure).await, serve(tenant).await);
    let key = fresh_key("builders");
    let headers = [("x-user", "x"), ("idempotency-key", key.as_str())];
    let p = raw_post(addr, "/charge", &headers, b"{}").await;
    let c = raw_post(closure_addr, "/charge", &headers, b"{}").await;
    let t = raw_post(tenant_addr, "/charge", &headers, b"{}").await;
    for (what, res) in [("principal", &p), ("closure", &c), ("single tenant", &t)] {
        assert!(
            res.status == 201 && !res.replayed(),
            "{what} builder: {res:?}"
        );
    }
    assert_eq!((closure_sink.count(), tenant_sink.count()), (1, 1));
}

/// §1 step 2 and §2 on SQLite (a real file): scope and key are two columns; equal joined text
/// split elsewhere is another record.
#[tokio::test]
async fn s1_2_principals_never_meet_on_sqlite() {
    let (store, path) = common::sqlite("fsr-scope").await;
    let sink = Sink::default();
    let addr = serve(principal_app(store, &sink)).await;
    principals_never_meet(addr, &sink, &split_cases()).await;
    let _ = std::fs::remove_file(path);
}

/// §1 step 2 and §2 on PostgreSQL: as on SQLite.
#[tokio::test]
async fn s1_2_principals_never_meet_on_postgres() {
    let Some(store) = common::postgres("tower_idempotency_fsr_scope").await else {
        return;
    };
    let sink = Sink::default();
    let addr = serve(principal_app(store, &sink)).await;
    principals_never_meet(addr, &sink, &split_cases()).await;
}

/// §1 step 2 and §2 on Redis: the member is `len:scope key`; equal joined text split elsewhere,
/// and scopes holding `:` and digits, are other records.
#[tokio::test]
async fn s1_2_principals_never_meet_on_redis() {
    let Some(store) = common::redis("fsr-scope").await else {
        return;
    };
    let sink = Sink::default();
    let addr = serve(principal_app(store, &sink)).await;
    principals_never_meet(addr, &sink, &split_cases()).await;
}

fn long_cases(len: usize) -> Vec<(String, String)> {
    let k = fresh_key("long");
    vec![
        (format!("long:{len}:alice"), k.clone()),
        (format!("long:{len}:bob"), k.clone()),
        // The same long id, differing in its last character only.
        (format!("long:{}:alice+x", len - 1), k.clone()),
    ]
}

/// §1 step 2 (the scope is the principal's id, whatever its length) on the MemoryStore: ids
/// past 64 KiB (the record's wide head) that differ in their last character each keep their
/// own record, and each is replayed its own answer.
#[tokio::test]
async fn s1_2_very_long_principals_never_meet_on_memory() {
    let sink = Sink::default();
    let addr = serve(principal_app(MemoryStore::new(), &sink)).await;
    principals_never_meet(addr, &sink, &long_cases(70_000)).await;
}

/// §1 step 2 on SQLite and Redis: an 8000-character principal id (one that does not compress)
/// is guarded like any other: it runs once and its retry is replayed.
#[tokio::test]
async fn s1_2_long_principals_are_guarded_on_sqlite_and_redis() {
    let (store, path) = common::sqlite("fsr-long").await;
    let sink = Sink::default();
    let addr = serve(principal_app(store, &sink)).await;
    principals_never_meet(addr, &sink, &long_cases(8000)).await;
    let _ = std::fs::remove_file(path);
    if let Some(store) = common::redis("fsr-long").await {
        let sink = Sink::default();
        let addr = serve(principal_app(store, &sink)).await;
        principals_never_meet(addr, &sink, &long_cases(8000)).await;
    }
}

/// §1 step 2 and §5 on PostgreSQL: principal ids up to 2 000 characters (ones that do not
/// compress) are guarded as on the other stores. Longer ones pass the limit PostgreSQL's index
/// puts on a row's scope and key (about 2 700 bytes, documented on `PostgresStore`): they are
/// refused, fail closed (503, nothing runs), on every attempt, never run unguarded.
#[tokio::test]
async fn s1_2_long_principals_are_guarded_on_postgres() {
    let Some(store) = common::postgres("tower_idempotency_fsr_long").await else {
        return;
    };
    let sink = Sink::default();
    let addr = serve(principal_app(store, &sink)).await;
    principals_never_meet(addr, &sink, &long_cases(2000)).await;
    let before = sink.count();
    for (user, key) in long_cases(3000) {
        for _ in 0..2 {
            let res = raw_post(
                addr,
                "/charge",
                &[("x-user", &user), ("idempotency-key", &key)],
                b"{}",
            )
            .await;
            assert_eq!(res.status, 503, "{:?}", res.text());
            assert!(res.text().contains("store-unavailable"), "{:?}", res.text());
        }
    }
    assert_eq!(sink.count(), before, "nothing ran past the store's limit");
}

/// §1 step 2 (header scope: "a header's value ... (one, not empty)"): tenants differing only in
/// case are two tenants; a tenant header sent twice, or empty, runs nothing (500); a single
/// line `acme, evil` is its own tenant, never `acme`.
#[tokio::test]
async fn s1_2_header_scope_values_are_exact_and_single() {
    let sink = Sink::default();
    let app = {
        let sink = sink.clone();
        Router::new()
            .route(
                "/charge",
                post(move |req: Request| {
                    let sink = sink.clone();
                    async move {
                        let tenant = req
                            .headers()
                            .get_all("x-tenant")
                            .iter()
                            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                            .collect::<Vec<_>>()
                            .join("|");
                        let n = sink.push(tenant.clone());
                        (StatusCode::CREATED, format!("run {n} for {tenant}"))
                    }
                }),
            )
            .layer(
                IdempotencyLayer::new(MemoryStore::new())
                    .scope_by_header(http::HeaderName::from_static("x-tenant")),
            )
    };
    let addr = serve(app).await;
    let key = fresh_key("tenant");
    let go = |tenants: Vec<&'static str>| {
        let key = key.clone();
        async move {
            let mut headers = vec![("idempotency-key", key.as_str())];
            for t in &tenants {
                headers.push(("x-tenant", *t));
            }
            raw_post(addr, "/charge", &headers, b"{}").await
        }
    };
    let acme = go(vec!["acme"]).await;
    assert_eq!(acme.status, 201);
    for tenants in [vec!["Acme"], vec!["acme, evil"], vec!["ACME"]] {
        let res = go(tenants.clone()).await;
        assert!(
            res.status == 201 && !res.replayed() && res.text().ends_with(tenants[0]),
            "{tenants:?}: {res:?}"
        );
    }
    let before = sink.count();
    for tenants in [
        vec!["acme", "acme"],
        vec!["acme", "evil"],
        vec!["evil", "acme"],
        vec![""],
    ] {
        let res = go(tenants.clone()).await;
        assert_eq!(res.status, 500, "{tenants:?}: {res:?}");
        assert!(!res.replayed());
    }
    assert_eq!(
        sink.count(),
        before,
        "nothing ran for a missing or doubled tenant"
    );
}

/// §1 step 2 ("an app that authenticates by ... API-key header must not fall into one shared
/// scope"; "Two principals using the same key can never see each other's ... responses"):
/// with `scope_by_credential_hash`, a request carrying two `Authorization` lines is scoped by
/// the first line only. Behind a gateway that prepends its own credential line, and an auth
/// layer that authenticates the caller by the last line, alice and bob shared one scope, and
/// bob was replayed alice's answer. Two lines are now refused, as `scope_by_header` refuses
/// them.
#[tokio::test]
async fn s1_2_credential_hash_scope_reads_every_authorization_line() {
    async fn last_line_auth(mut req: Request, next: Next) -> Response {
        let user = req
            .headers()
            .get_all("authorization")
            .iter()
            .next_back()
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer tok-"))
            .map(|u| User(u.to_owned()));
        match user {
            Some(user) => {
                req.extensions_mut().insert(user);
                next.run(req).await
            }
            None => StatusCode::UNAUTHORIZED.into_response(),
        }
    }
    let sink = Sink::default();
    let app = {
        let sink = sink.clone();
        Router::new()
            .route(
                "/charge",
                post(move |req: Request| {
                    let sink = sink.clone();
                    async move {
                        let who = req
                            .extensions()
                            .get::<User>()
                            .map_or("nobody".to_owned(), |u| u.0.clone());
                        let n = sink.push(who.clone());
                        (StatusCode::CREATED, format!("run {n}: charged {who}"))
                    }
                }),
            )
            .layer(IdempotencyLayer::new(MemoryStore::new()).scope_by_credential_hash())
            .layer(middleware::from_fn(last_line_auth))
    };
    let addr = serve(app).await;
    let key = fresh_key("cred");
    let as_user = |user: &'static str| {
        let key = key.clone();
        async move {
            let token = format!("Bearer tok-{user}");
            raw_post(
                addr,
                "/charge",
                &[
                    ("idempotency-key", key.as_str()),
                    ("authorization", "Bearer tok-gateway"),
                    ("authorization", token.as_str()),
                ],
                b"{}",
            )
            .await
        }
    };
    // Two lines are refused as a header scope's are (500 scope-missing, nothing runs): the
    // layer cannot know which line the app's auth reads.
    let alice = as_user("alice").await;
    assert_eq!(alice.status, 500, "{alice:?}");
    assert!(alice.text().contains("scope-missing"), "{alice:?}");
    let bob = as_user("bob").await;
    assert!(
        !(bob.replayed() || bob.text().contains("alice")),
        "bob was answered with alice's record: {:?}; runs {:?}",
        bob.text(),
        sink.runs()
    );
    assert!(sink.runs().is_empty(), "{:?}", sink.runs());
    // One line each: two scopes, each caller's own answer.
    for user in ["alice", "bob"] {
        let token = format!("Bearer tok-{user}");
        let res = raw_post(
            addr,
            "/charge",
            &[
                ("idempotency-key", key.as_str()),
                ("authorization", token.as_str()),
            ],
            b"{}",
        )
        .await;
        assert_eq!(res.status, 201, "{res:?}");
        assert!(!res.replayed() && res.text().contains(user), "{res:?}");
    }
}
