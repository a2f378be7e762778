//! Adversarial review of the day's fixes (7d7b478..HEAD): the console's configured origins,
//! the pending-writes gauge, the fingerprint's codings / empty query / lone surrogates / request
//! trailers, the claim asked again when its answer was lost (PostgreSQL, Redis), panicking
//! bodies and cache policies, gRPC media types without case, and downstream ids across
//! attempts. Real HTTP over TCP, real PostgreSQL and Redis; effects counted at the handler.
//! Each test names the DESIGN section it attacks.

use crate::common;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{StatusCode, header};
use axum::response::Response;
use axum::routing::post;
use bytes::Bytes;
use common::raw::{Raw, parse_raw, raw_post, unique};
use common::resp::parse_command;
use common::{Effects, grpc_frame, grpc_frame_flagged, guard, serve};
use http_body::Frame;
use http_body_util::BodyExt;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower_idempotency::console::Console;
use tower_idempotency::fingerprint::JsonFields;
use tower_idempotency::jsonrpc::JsonRpc;
use tower_idempotency::store::{
    Claim, ClaimRequest, Fingerprint, LeaseExpiry, Milestone, PostgresStore, RecordStatus,
    RedisStore, ScopedKey, StoredResponse,
};
use tower_idempotency::{CachePolicy, IdempotencyLayer, IdempotencyStore, MemoryStore};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

const LONG: Duration = Duration::from_secs(60);

fn claim_req(key: &ScopedKey, lease: Duration, expiry: LeaseExpiry) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        fingerprint: Fingerprint::from_bytes([42; 32]),
        lease,
        ttl: LONG,
        on_lease_expiry: expiry,
    }
}

fn stored(body: &str) -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: http::HeaderMap::new(),
        body: Some(Bytes::copy_from_slice(body.as_bytes())),
        trailers: None,
    }
}

/// A minimal base64 (standard alphabet, padded) for gRPC-Web text bodies.
fn b64(data: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        out.push(A[(n >> 18) as usize & 63] as char);
        out.push(A[(n >> 12) as usize & 63] as char);
        out.push(if chunk.len() > 1 {
            A[(n >> 6) as usize & 63] as char
        } else {
            '='
        });
        out.push(if chunk.len() > 2 {
            A[n as usize & 63] as char
        } else {
            '='
        });
    }
    out
}

fn unb64(text: &[u8]) -> Vec<u8> {
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0);
    for &c in text {
        let Some(v) = val(c) else { continue };
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

/// A raw HTTP/1.1 request (bytes as given) on a connection of its own, read to its close.
async fn raw_request(addr: SocketAddr, request: Vec<u8>) -> Raw {
    guard("a raw request", async {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream.write_all(&request).await.expect("write");
        let mut buf = Vec::new();
        let _ = stream.read_to_end(&mut buf).await;
        if buf.is_empty() {
            return Raw {
                status: 0,
                headers: Vec::new(),
                body: Vec::new(),
                trailers: Vec::new(),
            };
        }
        parse_raw(&buf)
    })
    .await
}

/// A response body that yields `chunks` then panics when polled for the next frame.
struct PanicBody {
    chunks: Vec<Bytes>,
}

impl http_body::Body for PanicBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.chunks.is_empty() {
            panic!("the response body panics mid-stream (test)");
        }
        let chunk = self.chunks.remove(0);
        Poll::Ready(Some(Ok(Frame::data(chunk))))
    }
}

// ================================================================================================
// §1.4 Fingerprint: codings, queries, lone surrogates, inexact numbers, request trailers
// ================================================================================================

fn parts(uri: &str, headers: &[(&str, &str)]) -> http::request::Parts {
    let mut req = http::Request::builder().method("POST").uri(uri);
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    req.body(()).expect("request").into_parts().0
}

fn field(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_le_bytes());
    h.update(bytes);
}

/// DESIGN §1.4: "requests without them [trailers, codings] hash as before": an ordinary
/// text and JSON request (non-empty query, no coding, no trailers) still hashes to the
/// documented layout (version tag, method, path, query, media type, body domain and bytes),
/// and a coding list that only adds `identity` is the same coding list.
#[test]
fn s1_4_ordinary_requests_hash_as_documented_and_identity_codings_are_no_coding() {
    let expected = |media: &str, domain: &str, body: &[u8]| {
        let mut h = Sha256::new();
        field(&mut h, b"tower-idempotency/fingerprint/v1");
        field(&mut h, b"POST");
        field(&mut h, b"/op");
        field(&mut h, b"a=1");
        field(&mut h, media.as_bytes());
        field(&mut h, domain.as_bytes());
        field(&mut h, body);
        let mut out: [u8; 32] = h.finalize().into();
        // The first four bytes name the scheme (session 33): the defaults', FNV-1a over the
        // version's name (`v1/r2` since session 38's strict reading; the hashed tag stays
        // `v1`) and the empty list of canonicalisers, each length-prefixed.
        let fnv = |mut hash: u32, bytes: &[u8]| {
            for b in (bytes.len() as u64).to_le_bytes().iter().chain(bytes) {
                hash = (hash ^ u32::from(*b)).wrapping_mul(0x0100_0193);
            }
            hash
        };
        let scheme = fnv(
            fnv(0x811c_9dc5, b"tower-idempotency/fingerprint/v1/r2"),
            b"custom",
        );
        out[..4].copy_from_slice(&scheme.to_be_bytes());
        out
    };
    let text = Fingerprint::of(
        &parts("/op?a=1", &[("content-type", "text/plain")]),
        b"hello",
    )
    .expect("fp");
    assert_eq!(text.as_bytes(), &expected("text/plain", "raw", b"hello"));
    let json = Fingerprint::of(
        &parts("/op?a=1", &[("content-type", "application/json")]),
        br#"{ "b":1, "a":2 }"#,
    )
    .expect("fp");
    assert_eq!(
        json.as_bytes(),
        &expected("application/json", "json", br#"{"a":2,"b":1}"#)
    );
    // `identity` is no coding, wherever it stands in the list.
    let identity = Fingerprint::of(
        &parts(
            "/op?a=1",
            &[
                ("content-type", "application/json"),
                ("content-encoding", "identity"),
            ],
        ),
        br#"{"a":2,"b":1}"#,
    )
    .expect("fp");
    assert_eq!(identity, json);
    let coded = |ce: &[&str]| {
        let mut headers = vec![("content-type", "application/json")];
        for c in ce {
            headers.push(("content-encoding", c));
        }
        Fingerprint::of(&parts("/op", &headers), b"\x1f\x8b\x08\x00zz").expect("a coded body")
    };
    assert_eq!(coded(&["identity, gzip"]), coded(&["gzip"]));
    assert_eq!(coded(&["gzip, identity"]), coded(&["GZIP"]));
    assert_eq!(coded(&["gzip", "br"]), coded(&["gzip, br"]));
    assert_ne!(coded(&["gzip", "br"]), coded(&["br", "gzip"]));
    // `/op?` is not `/op`, and neither is `/op?=`.
    let q = |uri: &str| {
        Fingerprint::of(&parts(uri, &[("content-type", "text/plain")]), b"x").expect("fp")
    };
    assert_ne!(q("/op?"), q("/op"));
    assert_ne!(q("/op?"), q("/op?="));
}

/// DESIGN §1.4 ("Canonicalisation may only merge what is provably the same request"; a body
/// that claims a structured type and is not one is refused 400): a document with an inexact
/// number or a lone surrogate escape is read to its end, so malformed JSON after it is
/// still 400 with nothing run, over real HTTP; a valid one is guarded (hashed as sent: a
/// byte-identical retry replays, the other half of a surrogate pair is another request).
#[tokio::test]
async fn s1_4_inexact_and_lone_surrogate_documents_are_read_to_their_end() {
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/op",
            post(move |body: Bytes| {
                let sink = sink.clone();
                async move {
                    let n = sink.hit();
                    (
                        StatusCode::CREATED,
                        format!("run {n}: {}", String::from_utf8_lossy(&body)),
                    )
                }
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    let json = [("content-type", "application/json")];
    for (i, bad) in [
        r#"{"a":1e400,}"#,
        r#"[1e400, x]"#,
        r#"{"a":9007199254740993 "b":1}"#,
        r#"["\ud800", tru]"#,
        r#"{"a":"\udc00","a":}"#,
        r#"["\ud800\uZZZZ"]"#,
        r#"[-1e-400, 01]"#,
        "[\"\\ud800\"] x",
    ]
    .iter()
    .enumerate()
    {
        let key = unique(&format!("bad-{i}"));
        let got = raw_post(
            addr,
            "/op",
            &[("idempotency-key", &key), json[0]],
            bad.as_bytes(),
        )
        .await;
        assert_eq!(got.status, 400, "{bad}: {got:?}");
    }
    assert_eq!(effects.count(), 0, "nothing malformed ran");
    let key = unique("surrogate");
    let send = |body: &'static str| {
        let key = key.clone();
        async move {
            raw_post(
                addr,
                "/op",
                &[("idempotency-key", &key), json[0]],
                body.as_bytes(),
            )
            .await
        }
    };
    let first = send(r#"{"name":"\ud800","n":1e400}"#).await;
    assert_eq!(first.status, 201, "{first:?}");
    let again = send(r#"{"name":"\ud800","n":1e400}"#).await;
    assert!(again.replayed() && again.body == first.body, "{again:?}");
    let other = send(r#"{"name":"\ud801","n":1e400}"#).await;
    assert_eq!(
        other.status, 422,
        "another lone surrogate is another request: {other:?}"
    );
    assert_eq!(effects.count(), 1);
}

/// Random JSON-ish text: values with surrogate escapes (paired, lone, half-pairs), exact and
/// inexact numbers, duplicate names, whitespace; then, often, one corruption.
fn gen_doc(rng: &mut common::Rng) -> String {
    fn ws(rng: &mut common::Rng, out: &mut String) {
        for _ in 0..rng.next(3) {
            out.push([' ', '\n', '\t', '\r'][rng.next(4) as usize]);
        }
    }
    fn string(rng: &mut common::Rng, out: &mut String) {
        const PIECES: [&str; 16] = [
            "a",
            "Z",
            "\\u00e9",
            "\\ud800",
            "\\udc00",
            "\\ud83d\\ude00",
            "\\uD83D",
            "\\uDE00",
            "\\\"",
            "\\n",
            "é",
            "😀",
            "\\u0041",
            "\\ud800\\u0041",
            "\\udbff\\udfff",
            "\\/",
        ];
        out.push('"');
        for _ in 0..rng.next(4) {
            out.push_str(PIECES[rng.next(PIECES.len() as u64) as usize]);
        }
        out.push('"');
    }
    fn value(rng: &mut common::Rng, depth: u32, out: &mut String) {
        const NUMBERS: [&str; 16] = [
            "0",
            "-0",
            "1",
            "2.5",
            "1E+2",
            "1e400",
            "-1e400",
            "9007199254740993",
            "9007199254740992",
            "5e-324",
            "1e-400",
            "0.1",
            "123456789012345678901234567890",
            "1.0",
            "-12.50e1",
            "4.9e-324",
        ];
        let pick = if depth >= 4 { rng.next(3) } else { rng.next(5) };
        match pick {
            0 => out.push_str(["null", "true", "false"][rng.next(3) as usize]),
            1 => out.push_str(NUMBERS[rng.next(NUMBERS.len() as u64) as usize]),
            2 => string(rng, out),
            3 => {
                out.push('[');
                let n = rng.next(4);
                for i in 0..n {
                    if i > 0 {
                        out.push(',');
                    }
                    ws(rng, out);
                    value(rng, depth + 1, out);
                    ws(rng, out);
                }
                out.push(']');
            }
            _ => {
                out.push('{');
                let n = rng.next(4);
                for i in 0..n {
                    if i > 0 {
                        out.push(',');
                    }
                    ws(rng, out);
                    string(rng, out);
                    ws(rng, out);
                    out.push(':');
                    ws(rng, out);
                    value(rng, depth + 1, out);
                }
                out.push('}');
            }
        }
    }
    let mut out = String::new();
    ws(rng, &mut out);
    value(rng, 0, &mut out);
    ws(rng, &mut out);
    if rng.next(3) == 0 {
        let mut chars: Vec<char> = out.chars().collect();
        let at = rng.next(chars.len() as u64 + 1) as usize;
        match rng.next(3) {
            0 if at < chars.len() => {
                chars.remove(at);
            }
            1 => chars.insert(
                at,
                [',', ']', '}', ':', '"', '\\', 'x', '\u{1}'][rng.next(8) as usize],
            ),
            _ => chars.truncate(at),
        }
        out = chars.into_iter().collect();
    }
    out
}

/// DESIGN §1.4, differential against serde_json on random documents with surrogate escapes
/// and inexact numbers: `canonical_json` refuses exactly what is not JSON (serde_json's
/// reader, which takes lone surrogate escapes as JSON, agrees), never hashes a malformed
/// document raw, and where it gives a canonical form it is RFC 8785's (serde_json_canonicalizer)
/// of the same value, so two documents share one only when they are the same value.
#[test]
fn s1_4_canonical_json_agrees_with_serde_json_on_random_documents() {
    let mut rng = common::Rng::new(0x5eed_2026_1205);
    let mut seen_lone = 0;
    for _ in 0..40_000 {
        let doc = gen_doc(&mut rng);
        let ours = tower_idempotency::fingerprint::canonical_json(doc.as_bytes());
        let valid = serde_json::from_str::<Box<serde_json::value::RawValue>>(&doc).is_ok();
        assert_eq!(ours.is_ok(), valid, "validity differs on {doc:?}: {ours:?}");
        if let Ok(Some(canonical)) = ours {
            let value: serde_json::Value = serde_json::from_str(&doc).unwrap_or_else(|e| {
                panic!("a canonical form for {doc:?}, which serde_json reads as no text: {e}")
            });
            let theirs = serde_json_canonicalizer::to_vec(&value).expect("canonical");
            assert_eq!(
                String::from_utf8_lossy(&canonical),
                String::from_utf8_lossy(&theirs),
                "{doc:?}"
            );
        } else if valid && serde_json::from_str::<serde_json::Value>(&doc).is_err() {
            // Valid JSON serde_json cannot read as text: a lone surrogate or a number out
            // of range. It must be hashed raw (no canonical form), never merged.
            assert!(matches!(ours, Ok(None)), "{doc:?}: {ours:?}");
            seen_lone += 1;
        }
    }
    assert!(
        seen_lone > 100,
        "the generator reached lone surrogates: {seen_lone}"
    );
}

/// DESIGN §1.4 with a route that counts chosen JSON fields (`fingerprint_json`): lone
/// surrogate escapes are valid JSON now, so they reach the field selection. A member whose
/// name is a lone surrogate is not the member named `""`: with `include(["/"])` (the member
/// named by the empty token), `{"":1}` counts the value 1 and `{"\ud800":1}` has no such
/// member, so the two are different requests and the second must not get the first's
/// replay.
#[tokio::test]
async fn s1_4_json_fields_never_take_a_lone_surrogate_name_for_another_name() {
    let effects = Effects::default();
    let sink = effects.clone();
    let fields = JsonFields::include(["/"]).expect("pointer");
    let app = Router::new()
        .route(
            "/op",
            post(move |body: Bytes| {
                let sink = sink.clone();
                async move {
                    let n = sink.hit();
                    (
                        StatusCode::CREATED,
                        format!("run {n}: {}", String::from_utf8_lossy(&body)),
                    )
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .defaults(|r| r.fingerprint_json(fields)),
        );
    let addr = serve(app).await;
    let key = unique("fields-surrogate");
    let json = ("content-type", "application/json");
    let first = raw_post(
        addr,
        "/op",
        &[("idempotency-key", &key), json],
        br#"{"":1}"#,
    )
    .await;
    assert_eq!(first.status, 201, "{first:?}");
    let second = raw_post(
        addr,
        "/op",
        &[("idempotency-key", &key), json],
        br#"{"\ud800":1}"#,
    )
    .await;
    assert!(
        !second.replayed(),
        "a body without the counted member got the replay of one with it: {second:?}"
    );
}

/// A fake gRPC-Web service over HTTP/1.1 that notes the request trailers it saw.
fn grpc_web_app(seen: Arc<Mutex<Vec<String>>>, effects: Effects) -> Router {
    let handler = move |req: Request| {
        let (seen, effects) = (seen.clone(), effects.clone());
        async move {
            let collected = req.into_body().collect().await.expect("body");
            let trailers = collected
                .trailers()
                .map(|t| {
                    t.iter()
                        .map(|(n, v)| format!("{n}={}", String::from_utf8_lossy(v.as_bytes())))
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .unwrap_or_default();
            seen.lock().expect("seen").push(trailers);
            let n = effects.hit();
            let mut body = grpc_frame(format!("run {n}").as_bytes());
            body.extend(grpc_frame_flagged(0x80, b"grpc-status:0\r\n"));
            Response::builder()
                .header(header::CONTENT_TYPE, "application/grpc-web+proto")
                .body(Body::from(body))
                .expect("response")
        }
    };
    Router::new().route("/w.W/Call", post(handler))
}

/// DESIGN §1.3 ("The inner service receives an identical request"), as today's fix has it for
/// HTTP ("Request trailers were dropped: the inner service now receives them"): a gRPC-Web
/// call over HTTP/1.1 whose chunked body ends with trailer fields must reach the handler
/// with those trailers, as it does without the layer.
#[tokio::test]
async fn s1_3_grpc_web_request_trailers_reach_the_handler() {
    let (seen_plain, seen_guarded) = (
        Arc::new(Mutex::new(Vec::new())),
        Arc::new(Mutex::new(Vec::new())),
    );
    let guarded = grpc_web_app(seen_guarded.clone(), Effects::default())
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let app = Router::new().nest("/guarded", guarded).nest(
        "/plain",
        grpc_web_app(seen_plain.clone(), Effects::default()),
    );
    let addr = serve(app).await;
    let call = |path: &str, key: &str, sig: &str| {
        let frame = grpc_frame(b"\x0a\x03abc");
        let mut req = format!(
            "POST {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\nidempotency-key: {key}\r\n\
             content-type: application/grpc-web+proto\r\ntransfer-encoding: chunked\r\n\
             trailer: x-sig\r\n\r\n{:x}\r\n",
            frame.len()
        )
        .into_bytes();
        req.extend_from_slice(&frame);
        req.extend_from_slice(format!("\r\n0\r\nx-sig: {sig}\r\n\r\n").as_bytes());
        req
    };
    let key = unique("web-trailers");
    let plain = raw_request(addr, call("/plain/w.W/Call", &key, "sig-1")).await;
    assert_eq!(plain.status, 200, "{plain:?}");
    let guarded = raw_request(addr, call("/guarded/w.W/Call", &key, "sig-1")).await;
    assert_eq!(guarded.status, 200, "{guarded:?}");
    let plain_saw = seen_plain.lock().expect("seen")[0].clone();
    assert!(
        plain_saw.contains("sig-1"),
        "hyper passes request trailers: {plain_saw:?}"
    );
    let guarded_saw = seen_guarded.lock().expect("seen")[0].clone();
    assert_eq!(
        guarded_saw, plain_saw,
        "the handler behind the layer sees the request trailers it sees without it"
    );
}

// ================================================================================================
// §5 / §1.6: a claim whose answer was lost, asked again with its token
// ================================================================================================

/// A statement's text, and how long its reply is held back before it is lost.
type Armed = (&'static [u8], Duration);

/// A PostgreSQL proxy that, armed with a needle, lets the statement through and withholds its
/// reply for `delay` before closing the client's side: a write that landed, heard of late as a
/// broken connection.
#[derive(Clone)]
struct LateProxy {
    addr: SocketAddr,
    armed: Arc<Mutex<Option<Armed>>>,
    lost: Arc<AtomicU64>,
    /// Execute messages clients sent (statements run).
    executes: Arc<AtomicU64>,
}

impl LateProxy {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let proxy = Self {
            addr: listener.local_addr().expect("addr"),
            armed: Arc::default(),
            lost: Arc::default(),
            executes: Arc::default(),
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

    fn arm(&self, needle: &'static [u8], delay: Duration) {
        *self.armed.lock().expect("lock") = Some((needle, delay));
    }

    async fn relay(self, client: TcpStream, server: TcpStream) {
        let (mut client_r, mut client_w) = client.into_split();
        let (mut server_r, mut server_w) = server.into_split();
        let cut: Arc<Mutex<Option<Duration>>> = Arc::default();
        let cut_up = cut.clone();
        let (armed, executes) = (self.armed.clone(), self.executes.clone());
        let upstream = async move {
            let mut buf = vec![0u8; 16 * 1024];
            // Frontend messages, parsed so that the reply held back is the one to the claim's
            // Execute (not to its Parse/Describe: a statement prepared is not a statement run).
            let mut pending: Vec<u8> = Vec::new();
            let mut started = false;
            let mut parsed_claim = false;
            loop {
                let n = match client_r.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                pending.extend_from_slice(&buf[..n]);
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
                    if message[0] == b'E' {
                        executes.fetch_add(1, Ordering::SeqCst);
                    }
                    let mut armed = armed.lock().expect("lock");
                    if let Some((needle, delay)) = *armed {
                        if message[0] == b'P' && message.windows(needle.len()).any(|w| w == needle)
                        {
                            parsed_claim = true;
                        }
                        if message[0] == b'E' && parsed_claim {
                            *armed = None;
                            *cut_up.lock().expect("lock") = Some(delay);
                        }
                    }
                }
                if server_w.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        };
        let lost = self.lost.clone();
        let downstream = async move {
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                let n = match server_r.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                let delay = *cut.lock().expect("lock");
                if let Some(delay) = delay {
                    tokio::time::sleep(delay).await;
                    lost.fetch_add(1, Ordering::SeqCst);
                    let _ = client_w.shutdown().await;
                    return;
                }
                if client_w.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        };
        tokio::join!(upstream, downstream);
    }
}

const PG_TABLE: &str = "tower_idempotency_todays_review";

/// A PostgresStore through a [`LateProxy`] (a fresh pool: the claim not prepared yet) and one
/// straight to the server, on one table.
async fn pg_pair() -> Option<(PostgresStore, PostgresStore, LateProxy)> {
    let direct = common::postgres(PG_TABLE).await?;
    let options: sqlx::postgres::PgConnectOptions =
        common::postgres_url().parse().expect("postgres url");
    let upstream = tokio::net::lookup_host((options.get_host(), options.get_port()))
        .await
        .expect("resolve")
        .next()
        .expect("an address");
    let proxy = LateProxy::start(upstream).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(3))
        .connect_with(options.host("127.0.0.1").port(proxy.addr.port()))
        .await
        .expect("connect through the proxy");
    let through = PostgresStore::new(pool)
        .with_table(PG_TABLE)
        .expect("table");
    Some((through, direct, proxy))
}

const PG_CLAIM_TEXT: &[u8] = b"AS r (scope, key, fingerprint, status";

/// DESIGN §5 ("One trait, one behaviour") and §1.6, today's lost-reply fix: a claim that
/// landed but whose answer arrives as a broken connection only after the claim's own lease
/// ran out (a stalled link, a slow close) is asked again with its token. Nothing ran under
/// it. Redis answers it as won ("even past its lease: nothing ran under it"); PostgreSQL must
/// too, on a route that reconciles expired leases: not "outcome unknown" for a request that
/// never ran (the very failure the fix names).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_postgres_a_claim_heard_lost_after_its_lease_is_still_its_own() {
    let Some((through, direct, proxy)) = pg_pair().await else {
        return;
    };
    let key = ScopedKey::new(unique("pg-late"), "k");
    proxy.arm(PG_CLAIM_TEXT, ms(1200));
    let claimed = guard(
        "the claim",
        through.claim(&claim_req(&key, ms(300), LeaseExpiry::Reconcile)),
    )
    .await;
    assert_eq!(proxy.lost.load(Ordering::SeqCst), 1, "the reply was lost");
    let record = direct.lookup(&key).await.expect("lookup").expect("record");
    assert!(
        matches!(claimed, Ok(Claim::Acquired(_))),
        "a claim that ran nothing is refused as {:?} (record {:?}, attempts {})",
        claimed.as_ref().map(|c| match c {
            Claim::Acquired(_) => "acquired".to_owned(),
            Claim::Completed { .. } => "completed".to_owned(),
            Claim::Existing { record, .. } => format!("existing {:?}", record.status),
        }),
        record.status,
        record.attempts
    );
    assert_ne!(record.status, RecordStatus::NeedsReconciliation);
}

/// DESIGN §1.6 and §5, today's fix in its common case, with the reply lost to the claim's
/// *Execute* (the statement ran and committed), not to its Parse: asked again with its token on
/// a fresh connection, the live row of its own token reads as acquired (attempt 1), on a
/// route that reconciles. (The suite's own `Proxy::lose_reply_to(claim text)` cuts the reply
/// to the Parse/Describe round trip that prepares the claim: the statement never runs, so
/// that regression test passes without a landed claim; here two Executes prove one landed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_postgres_a_claim_whose_executed_reply_is_lost_is_its_own() {
    for batched in [false, true] {
        let Some((through, direct, proxy)) = pg_pair().await else {
            return;
        };
        let through = match batched {
            false => through,
            true => through.with_batching(tower_idempotency::store::Batching::default()),
        };
        let key = ScopedKey::new(unique("pg-executed"), "k");
        let before = proxy.executes.load(Ordering::SeqCst);
        proxy.arm(PG_CLAIM_TEXT, ms(50));
        let claimed = guard(
            "the claim",
            through.claim(&claim_req(&key, LONG, LeaseExpiry::Reconcile)),
        )
        .await;
        assert_eq!(
            proxy.lost.load(Ordering::SeqCst),
            1,
            "batched {batched}: lost"
        );
        assert_eq!(
            proxy.executes.load(Ordering::SeqCst) - before,
            2,
            "batched {batched}: the claim ran, then was asked again"
        );
        let Ok(Claim::Acquired(lease)) = claimed else {
            panic!("batched {batched}: {claimed:?}");
        };
        assert_eq!(lease.attempt, 1, "batched {batched}");
        direct
            .complete(&key, lease.token, &stored("own"), LONG)
            .await
            .expect("its holder records");
    }
}

/// The same late-heard claim on Redis (`RespLateProxy`): won, as its own (DESIGN §5, the
/// CLAIM script's same-token branch), and the record is in progress under its token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_redis_a_claim_heard_lost_after_its_lease_is_still_its_own() {
    let Some((through, direct, proxy)) = redis_pair("late").await else {
        return;
    };
    let key = ScopedKey::new(unique("redis-late"), "k");
    proxy.arm(through.claim_script(), ms(1200));
    let claimed = guard(
        "the claim",
        through.claim(&claim_req(&key, ms(300), LeaseExpiry::Reconcile)),
    )
    .await;
    assert_eq!(proxy.fired.load(Ordering::SeqCst), 1, "the reply was lost");
    let Ok(Claim::Acquired(lease)) = claimed else {
        panic!("{claimed:?}");
    };
    let record = direct.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(
        (record.status, record.lease_token),
        (RecordStatus::InProgress, lease.token)
    );
    direct
        .complete(&key, lease.token, &stored("own"), LONG)
        .await
        .expect("its holder records");
}

/// DESIGN §1 ("one operation key produces at most one execution"), §4 (fencing): the claim
/// whose reply is lost lands, its lease lapses while the reply is held back, and another
/// request (same operation) takes the key over meanwhile. When the first is asked again with
/// its old token it must NOT win: the key is the second's, in flight. The second's writes
/// still land. PostgreSQL and Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_a_retried_claim_never_takes_a_key_another_request_took_over() {
    // PostgreSQL.
    if let Some((through, direct, proxy)) = pg_pair().await {
        let key = ScopedKey::new(unique("pg-over"), "k");
        proxy.arm(PG_CLAIM_TEXT, ms(1500));
        let first = {
            let (through, key) = (through.clone(), key.clone());
            tokio::spawn(async move {
                through
                    .claim(&claim_req(&key, ms(300), LeaseExpiry::Reclaim))
                    .await
            })
        };
        tokio::time::sleep(ms(700)).await;
        let second = match direct
            .claim(&claim_req(&key, LONG, LeaseExpiry::Reclaim))
            .await
        {
            Ok(Claim::Acquired(lease)) => lease,
            other => panic!("the takeover: {other:?}"),
        };
        assert_eq!(
            second.attempt, 2,
            "postgres: the first claim landed, then lapsed"
        );
        let first = guard("the first claim", first).await.expect("task");
        assert_eq!(proxy.lost.load(Ordering::SeqCst), 1);
        assert!(
            !matches!(first, Ok(Claim::Acquired(_))),
            "postgres: two holders: the retried claim won a key taken over: {first:?}"
        );
        direct
            .complete(&key, second.token, &stored("second"), LONG)
            .await
            .expect("postgres: the holder's write lands");
    }
    // Redis.
    if let Some((through, direct, proxy)) = redis_pair("over").await {
        let key = ScopedKey::new(unique("redis-over"), "k");
        proxy.arm(through.claim_script(), ms(1500));
        let first = {
            let (through, key) = (through.clone(), key.clone());
            tokio::spawn(async move {
                through
                    .claim(&claim_req(&key, ms(300), LeaseExpiry::Reclaim))
                    .await
            })
        };
        tokio::time::sleep(ms(700)).await;
        let second = match direct
            .claim(&claim_req(&key, LONG, LeaseExpiry::Reclaim))
            .await
        {
            Ok(Claim::Acquired(lease)) => lease,
            other => panic!("the takeover: {other:?}"),
        };
        assert_eq!(
            second.attempt, 2,
            "redis: the first claim landed, then lapsed"
        );
        let first = guard("the first claim", first).await.expect("task");
        assert_eq!(proxy.fired.load(Ordering::SeqCst), 1);
        assert!(
            !matches!(first, Ok(Claim::Acquired(_))),
            "redis: two holders: the retried claim won a key taken over: {first:?}"
        );
        direct
            .complete(&key, second.token, &stored("second"), LONG)
            .await
            .expect("redis: the holder's write lands");
    }
}

// ---- a RESP proxy that loses one script's reply late ------------------------------------------

#[derive(Clone)]
struct RespLateProxy {
    addr: SocketAddr,
    armed: Arc<Mutex<Option<(String, Duration)>>>,
    fired: Arc<AtomicU64>,
}

impl RespLateProxy {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let proxy = Self {
            addr: listener.local_addr().expect("addr"),
            armed: Arc::default(),
            fired: Arc::default(),
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

    /// The next EVALSHA/EVAL of `source` runs on Redis; its reply is held for `delay`, then the
    /// connection is dropped.
    fn arm(&self, source: &str, delay: Duration) {
        let sha = redis::Script::new(source).get_hash().to_owned();
        *self.armed.lock().expect("lock") = Some((sha, delay));
    }

    async fn relay(self, client: TcpStream, server: TcpStream) {
        let (mut client_r, mut client_w) = client.into_split();
        let (mut server_r, mut server_w) = server.into_split();
        let swallow = Arc::new(AtomicBool::new(false));
        let swallowing = swallow.clone();
        let downstream = async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match server_r.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if swallowing.load(Ordering::SeqCst) {
                    continue;
                }
                if client_w.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        };
        let (armed, fired) = (self.armed.clone(), self.fired.clone());
        let upstream = async move {
            let mut pending = Vec::new();
            let mut chunk = vec![0u8; 64 * 1024];
            loop {
                let n = match client_r.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                pending.extend_from_slice(&chunk[..n]);
                while let Some((len, args)) = parse_command(&pending) {
                    let command: Vec<u8> = pending.drain(..len).collect();
                    let hit = {
                        let mut armed = armed.lock().expect("lock");
                        let hit = match (&*armed, args.first(), args.get(1)) {
                            (Some((sha, delay)), Some(name), Some(arg))
                                if name.eq_ignore_ascii_case(b"EVALSHA")
                                    && arg.eq_ignore_ascii_case(sha.as_bytes()) =>
                            {
                                Some(*delay)
                            }
                            _ => None,
                        };
                        if hit.is_some() {
                            *armed = None;
                        }
                        hit
                    };
                    if let Some(delay) = hit {
                        swallow.store(true, Ordering::SeqCst);
                        let _ = server_w.write_all(&command).await;
                        tokio::time::sleep(delay).await;
                        fired.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                    if server_w.write_all(&command).await.is_err() {
                        return;
                    }
                }
            }
        };
        tokio::select! {
            () = downstream => {}
            () = upstream => {}
        }
    }
}

fn redis_upstream() -> SocketAddr {
    use std::net::ToSocketAddrs;
    let url = common::redis_url();
    let host = url
        .trim_start_matches("redis://")
        .split('/')
        .next()
        .unwrap_or("127.0.0.1:6379")
        .to_owned();
    host.to_socket_addrs()
        .expect("resolve")
        .next()
        .expect("an address")
}

/// A store through a [`RespLateProxy`] and one straight to Redis, on one fresh prefix; the
/// scripts loaded first (so the proxied store sends EVALSHA).
async fn redis_pair(name: &str) -> Option<(RedisStore, RedisStore, RespLateProxy)> {
    let direct = common::redis(name).await?;
    let prefix = common::redis_prefix(name);
    let direct = direct.with_prefix(&prefix).expect("prefix");
    let warm = ScopedKey::new("", unique("warm"));
    let lease = match direct
        .claim(&claim_req(&warm, LONG, LeaseExpiry::Reclaim))
        .await
    {
        Ok(Claim::Acquired(lease)) => lease,
        other => panic!("warm: {other:?}"),
    };
    direct
        .complete(&warm, lease.token, &stored("warm"), ms(1000))
        .await
        .expect("warm");
    let proxy = RespLateProxy::start(redis_upstream()).await;
    let through = RedisStore::connect(&format!("redis://{}", proxy.addr))
        .await
        .expect("connect through the proxy")
        .with_prefix(&prefix)
        .expect("prefix");
    Some((through, direct, proxy))
}

// ================================================================================================
// §3: panicking bodies and policies after the handler answered
// ================================================================================================

/// DESIGN §3 ("Once the inner service has returned a response head, the effect is taken as
/// done: a failure of the response body afterwards never releases the key"): an HTTP answer
/// too large to keep, whose body panics mid-stream on the forwarding task, is recorded; the
/// key is not left in flight, and no retry runs the handler again, even past the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_a_large_http_answer_whose_body_panics_is_never_run_again() {
    let effects = Effects::default();
    let sink = effects.clone();
    let store = MemoryStore::new();
    let app = Router::new()
        .route(
            "/op",
            post(move || {
                let sink = sink.clone();
                async move {
                    sink.hit();
                    Response::builder()
                        .status(StatusCode::CREATED)
                        .header(header::CONTENT_TYPE, "text/plain")
                        .body(Body::new(PanicBody {
                            chunks: vec![Bytes::from(vec![b'a'; 40]), Bytes::from(vec![b'b'; 40])],
                        }))
                        .expect("response")
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(store.clone())
                .single_tenant()
                .lease(ms(300))
                .response_limit(16),
        );
    let addr = serve(app).await;
    let key = unique("panic-large");
    let send = || {
        let key = key.clone();
        async move { raw_post(addr, "/op", &[("idempotency-key", &key)], b"x").await }
    };
    // (The first answer breaks off mid-body: the connection may be reset before its head is
    // read, so only what follows is checked.)
    let _first = send().await;
    let scoped_status = || async {
        let page = store
            .list_uncertain(&tower_idempotency::store::UncertainQuery::first(100))
            .await
            .expect("list");
        page.records.len()
    };
    // Past the lease, retries settle: never a second run, never in flight for ever.
    tokio::time::sleep(ms(700)).await;
    let in_flight = |a: &Raw| a.text().contains("problem:in-flight");
    let mut last = send().await;
    for _ in 0..20 {
        if !in_flight(&last) {
            break;
        }
        tokio::time::sleep(ms(100)).await;
        last = send().await;
    }
    assert_eq!(
        effects.count(),
        1,
        "run again after its body panicked: {last:?}"
    );
    assert!(!in_flight(&last), "left in flight: {last:?}");
    assert!(last.text().contains("response-not-stored"), "{last:?}");
    assert_eq!(scoped_status().await, 0, "nothing set aside as unknown");
}

/// DESIGN §3 and §8 (SSE answers teed while they stream): a JSON-RPC tool call answered as an
/// event stream whose body panics after a progress event, before its final response, is
/// taken as done (the server answered): no retry runs the tool again, and the key is not
/// left in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_a_jsonrpc_event_stream_that_panics_is_never_run_again() {
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/mcp",
            post(move || {
                let sink = sink.clone();
                async move {
                    sink.hit();
                    let progress = "data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{\"progressToken\":\"p\",\"progress\":1}}\n\n";
                    Response::builder()
                        .header(header::CONTENT_TYPE, "text/event-stream")
                        .body(Body::new(PanicBody {
                            chunks: vec![Bytes::from(progress)],
                        }))
                        .expect("response")
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .lease(ms(300))
                .jsonrpc(JsonRpc::new()),
        );
    let addr = serve(app).await;
    let key = unique("sse-panic");
    let call = |id: u32| {
        let key = key.clone();
        async move {
            let body = format!(
                r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"t","arguments":{{"x":1}}}}}}"#
            );
            raw_post(
                addr,
                "/mcp",
                &[
                    ("idempotency-key", &key),
                    ("content-type", "application/json"),
                    ("accept", "application/json, text/event-stream"),
                ],
                body.as_bytes(),
            )
            .await
        }
    };
    let _first = call(1).await;
    tokio::time::sleep(ms(700)).await;
    let mut last = call(2).await;
    for i in 0..20 {
        if common::jsonrpc_code(&last.text()) != -31001 {
            break;
        }
        tokio::time::sleep(ms(100)).await;
        last = call(3 + i).await;
    }
    assert_eq!(effects.count(), 1, "the tool ran again: {last:?}");
    assert_ne!(
        common::jsonrpc_code(&last.text()),
        -31001,
        "left in flight: {last:?}"
    );
}

/// DESIGN §3 ("A custom classifier may be supplied"; the handler answered, so it never runs
/// again), today's fix for a panicking policy, on a gRPC-Web answer (recorded in its gRPC
/// form): the answer is recorded, the retry replays it in gRPC-Web, the handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_a_custom_policy_that_panics_on_a_grpc_web_answer_records_it() {
    let effects = Effects::default();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let app = grpc_web_app(seen, effects.clone()).layer(
        IdempotencyLayer::new(MemoryStore::new())
            .single_tenant()
            .cache_policy(CachePolicy::custom(|outcome| {
                if outcome.trailers.is_some() || outcome.status.is_success() {
                    panic!("a classifier bug (test)");
                }
                false
            })),
    );
    let addr = serve(app).await;
    let key = unique("policy-panic");
    let send = || {
        let key = key.clone();
        async move {
            raw_post(
                addr,
                "/w.W/Call",
                &[
                    ("idempotency-key", &key),
                    ("content-type", "application/grpc-web+proto"),
                ],
                &grpc_frame(b"\x0a\x01x"),
            )
            .await
        }
    };
    let first = send().await;
    assert_eq!(first.status, 200, "{first:?}");
    let retry = send().await;
    assert_eq!(effects.count(), 1, "run again: {retry:?}");
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body, "the same gRPC-Web answer");
}

// ================================================================================================
// §1.4 / gRPC: media types without case, repeated gRPC-Web trailer lines
// ================================================================================================

/// DESIGN §1.4 (gRPC fingerprints; gRPC refusals speak gRPC) and today's fix (media types
/// have no case): a gRPC-Web text call whose `Content-Type` is written
/// `Application/Grpc-Web-Text+proto` is read as gRPC-Web text (its base64 decoded), guarded,
/// replayed in text; the repeated trailer lines of its answer are replayed, in order, with one
/// `grpc-status`; another message under its key is refused in gRPC (a `grpc-status`), never
/// as an HTTP 422 a gRPC-Web client cannot read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_4_mixed_case_grpc_web_text_is_guarded_in_grpc_web() {
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/w.W/Text",
            post(move |body: Bytes| {
                let sink = sink.clone();
                async move {
                    let n = sink.hit();
                    let message = unb64(&body);
                    let mut out = grpc_frame(format!("run {n} got {}", message.len()).as_bytes());
                    out.extend(grpc_frame_flagged(
                        0x80,
                        b"x-b: 1\r\nx-b: 2\r\ngrpc-status:0\r\n",
                    ));
                    Response::builder()
                        .header(header::CONTENT_TYPE, "application/grpc-web-text+proto")
                        .body(Body::from(b64(&out)))
                        .expect("response")
                }
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    let key = unique("mixed-case");
    let send = |message: &'static [u8]| {
        let key = key.clone();
        async move {
            raw_post(
                addr,
                "/w.W/Text",
                &[
                    ("idempotency-key", &key),
                    ("content-type", "Application/Grpc-Web-Text+proto"),
                    ("accept", "application/grpc-web-text"),
                ],
                b64(&grpc_frame(message)).as_bytes(),
            )
            .await
        }
    };
    let first = send(b"\x0a\x03abc").await;
    assert_eq!(first.status, 200, "{first:?}");
    let retry = send(b"\x0a\x03abc").await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(effects.count(), 1);
    let decoded = String::from_utf8_lossy(&unb64(&retry.body)).into_owned();
    assert!(decoded.contains("run 1"), "{decoded:?}");
    let x_b: Vec<_> = decoded.match_indices("x-b").collect();
    assert_eq!(x_b.len(), 2, "both trailer lines replayed: {decoded:?}");
    assert!(
        decoded.find("x-b: 1").or(decoded.find("x-b:1"))
            < decoded.find("x-b: 2").or(decoded.find("x-b:2")),
        "in order: {decoded:?}"
    );
    assert_eq!(decoded.matches("grpc-status").count(), 1, "{decoded:?}");
    let other = send(b"\x0a\x03xyz").await;
    assert_eq!(effects.count(), 1, "another message never ran");
    let says_grpc = other.one("grpc-status").is_some()
        || String::from_utf8_lossy(&unb64(&other.body)).contains("grpc-status");
    assert!(
        other.status == 200 && says_grpc,
        "a gRPC-Web refusal: {other:?}"
    );
}

// ================================================================================================
// §4: downstream ids stay with the attempt that recorded them
// ================================================================================================

/// DESIGN §4 (a Reconciler looks the effect up "by key or downstream id") and today's change
/// ("a new attempt starts without the previous attempt's downstream_id"): the id must be
/// kept wherever the same attempt's record goes to reconciliation: its lease lapses on a
/// route that reconciles, or after its effect started; it releases after its effect started;
/// its outcome cannot be recorded (mark_uncertain); another request's claim (another
/// fingerprint) meets its lapsed lease. Only a new attempt clears it.
async fn downstream_ids_stay_with_their_attempt<S: IdempotencyStore>(store: S, name: &str) {
    let run = unique(&format!("did-{name}"));
    let key = |k: &str| ScopedKey::new(run.clone(), k);
    let acquire = |req: ClaimRequest| {
        let store = &store;
        async move {
            match store.claim(&req).await {
                Ok(Claim::Acquired(lease)) => lease,
                other => panic!("{name}: expected to acquire {:?}: {other:?}", req.key),
            }
        }
    };
    let id_of = |k: ScopedKey| {
        let store = &store;
        async move {
            let r = store.lookup(&k).await.expect("lookup").expect("record");
            (r.status, r.downstream_id)
        }
    };
    let did = |s: &str| Milestone::DownstreamId(s.to_owned());
    // (a) A route that reconciles: the lease lapses, the retry's claim sets it aside.
    let a = key("a");
    let lease = acquire(claim_req(&a, ms(200), LeaseExpiry::Reconcile)).await;
    store
        .record_milestone(&a, lease.token, &did("pay_a"))
        .await
        .expect("id");
    // (b) Effect started, on a route that takes over.
    let b = key("b");
    let lease_b = acquire(claim_req(&b, ms(200), LeaseExpiry::Reclaim)).await;
    store
        .record_milestone(&b, lease_b.token, &did("pay_b"))
        .await
        .expect("id");
    store
        .record_milestone(&b, lease_b.token, &Milestone::EffectStarted)
        .await
        .expect("started");
    // (e) Another request's claim meets a lapsed lease.
    let e = key("e");
    let lease_e = acquire(claim_req(&e, ms(200), LeaseExpiry::Reclaim)).await;
    store
        .record_milestone(&e, lease_e.token, &did("pay_e"))
        .await
        .expect("id");
    tokio::time::sleep(ms(500)).await;
    let retry = store
        .claim(&claim_req(&a, LONG, LeaseExpiry::Reconcile))
        .await;
    assert!(
        !matches!(retry, Ok(Claim::Acquired(_))),
        "{name}: {retry:?}"
    );
    assert_eq!(
        id_of(a.clone()).await,
        (RecordStatus::NeedsReconciliation, Some("pay_a".to_owned())),
        "{name}: set aside after a lapsed lease, the attempt keeps its id"
    );
    let retry = store
        .claim(&claim_req(&b, LONG, LeaseExpiry::Reclaim))
        .await;
    assert!(
        !matches!(retry, Ok(Claim::Acquired(_))),
        "{name}: {retry:?}"
    );
    assert_eq!(
        id_of(b.clone()).await,
        (RecordStatus::NeedsReconciliation, Some("pay_b".to_owned())),
        "{name}: an effect started: the id stays for its reconciliation"
    );
    let mut other = claim_req(&e, LONG, LeaseExpiry::Reclaim);
    other.fingerprint = Fingerprint::from_bytes([9; 32]);
    let refused = store.claim(&other).await;
    assert!(
        !matches!(refused, Ok(Claim::Acquired(_))),
        "{name}: {refused:?}"
    );
    assert_eq!(
        id_of(e.clone()).await.1,
        Some("pay_e".to_owned()),
        "{name}: another request's claim changes nothing"
    );
    // (c) A release after the effect started.
    let c = key("c");
    let lease = acquire(claim_req(&c, LONG, LeaseExpiry::Reclaim)).await;
    store
        .record_milestone(&c, lease.token, &did("pay_c"))
        .await
        .expect("id");
    store
        .record_milestone(&c, lease.token, &Milestone::EffectStarted)
        .await
        .expect("started");
    let ended = store.release(&c, lease.token).await.expect("release");
    assert_eq!(ended, RecordStatus::NeedsReconciliation, "{name}");
    let again = store
        .claim(&claim_req(&c, LONG, LeaseExpiry::Reclaim))
        .await;
    assert!(
        !matches!(again, Ok(Claim::Acquired(_))),
        "{name}: {again:?}"
    );
    assert_eq!(
        id_of(c.clone()).await.1,
        Some("pay_c".to_owned()),
        "{name}: released with an effect"
    );
    // (d) An outcome that could not be recorded.
    let d = key("d");
    let lease = acquire(claim_req(&d, LONG, LeaseExpiry::Reclaim)).await;
    store
        .record_milestone(&d, lease.token, &did("pay_d"))
        .await
        .expect("id");
    store
        .mark_uncertain(&d, lease.token)
        .await
        .expect("uncertain");
    let again = store
        .claim(&claim_req(&d, LONG, LeaseExpiry::Reclaim))
        .await;
    assert!(
        !matches!(again, Ok(Claim::Acquired(_))),
        "{name}: {again:?}"
    );
    assert_eq!(
        id_of(d.clone()).await,
        (RecordStatus::NeedsReconciliation, Some("pay_d".to_owned())),
        "{name}: marked uncertain"
    );
    // The listing a reconciler reads shows the ids of a, b, c, d.
    let mut ids: Vec<String> = Vec::new();
    let mut query = tower_idempotency::store::UncertainQuery::first(500);
    loop {
        let page = store.list_uncertain(&query).await.expect("list");
        for r in &page.records {
            if r.key.scope() == run {
                ids.push(
                    r.downstream_id
                        .clone()
                        .unwrap_or_else(|| format!("none for {}", r.key.key())),
                );
            }
        }
        match page.next {
            Some(next) => query.after = Some(next),
            None => break,
        }
    }
    ids.sort();
    assert_eq!(ids, ["pay_a", "pay_b", "pay_c", "pay_d"], "{name}");
}

common::on_every_store!(downstream_ids_stay_with_their_attempt);

// ================================================================================================
// §6: idempotency_pending_writes
// ================================================================================================

/// DESIGN §4 (a holder whose record fails keeps retrying it) and §6 (the gauge today adds):
/// while the outcome's write is being tried again the gauge `idempotency_pending_writes`
/// reads 1; once it lands, 0 again, and the record is completed with the handler run once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_pending_writes_rise_while_a_record_is_retried_and_fall_when_it_lands() {
    use common::rig::{Rig, Route, handler, server};
    let counts = common::counts::Counts::global();
    let rig = Rig::new(MemoryStore::new());
    let effects = Effects::default();
    let sink = effects.clone();
    let addr = server(
        &rig,
        Route::plain(ms(1000)),
        handler(move |_, _| {
            let sink = sink.clone();
            async move {
                sink.hit();
                (StatusCode::CREATED, "done".to_owned())
            }
        }),
    )
    .await;
    rig.fail_for("complete", Duration::from_secs(4));
    let key = unique("pending");
    let first = {
        let key = key.clone();
        tokio::spawn(async move { common::rig::send(addr, &key, Duration::from_secs(30)).await })
    };
    let mut peak = 0;
    for _ in 0..600 {
        peak = peak.max(counts.get("idempotency_pending_writes"));
        if peak >= 1 {
            break;
        }
        tokio::time::sleep(ms(5)).await;
    }
    assert_eq!(peak, 1, "a write being tried again shows in the gauge");
    let _ = first.await;
    let landed = common::rig::within(Duration::from_secs(20), async || {
        common::rig::status_of(&rig, &key).await == Some(RecordStatus::Completed)
            && counts.get("idempotency_pending_writes") == 0
    })
    .await;
    assert!(
        landed,
        "the write landed and the gauge fell: {:?}, gauge {}",
        common::rig::status_of(&rig, &key).await,
        counts.get("idempotency_pending_writes")
    );
    assert_eq!(effects.count(), 1);
}

// ================================================================================================
// §4 console: configured origins
// ================================================================================================

async fn console_app(origins: &[&'static str]) -> SocketAddr {
    let mut console = Console::new(MemoryStore::new());
    for origin in origins {
        console = console.origin(http::Uri::from_static(origin));
    }
    serve(Router::new().nest("/ops", console.router())).await
}

/// A JSON purge (a write that needs no record) with the given `Host` and browser headers.
async fn purge(addr: SocketAddr, host: &str, headers: &[(&str, &str)]) -> u16 {
    let mut req = format!(
        "POST /ops/api/purge HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: 2\r\n"
    );
    for (n, v) in headers {
        req.push_str(&format!("{n}: {v}\r\n"));
    }
    req.push_str("\r\n{}");
    raw_request(addr, req.into_bytes()).await.status
}

/// DESIGN §4 (the console behind the app's auth; writes only from its own pages) and
/// `Console::origin`'s docs ("writes must then come from its origin (scheme, host and port;
/// the path is not part of it)"; only a URI with "no http or https scheme, no host" has no
/// origin): a console URL that carries user info (`https://admin@ops.example.com/...`)
/// still has the origin `https://ops.example.com`, so a write from that page passes; a
/// look-alike does not.
#[tokio::test]
async fn s4_console_origin_with_user_info_is_its_host_origin() {
    let addr = console_app(&["https://admin@ops.example.com/idempotency"]).await;
    let host = addr.to_string();
    assert_eq!(
        purge(addr, &host, &[("origin", "https://evil.example")]).await,
        403
    );
    assert_eq!(
        purge(addr, &host, &[("origin", "https://ops.example.com")]).await,
        200,
        "a write from the console's own origin is refused"
    );
}

/// DESIGN §4 console, host-mode and configured origins, spelling edge cases a browser can
/// send: IPv6 hosts with ports, default ports, case; refused: another port, `null`, another
/// scheme, a configured origin's look-alike.
#[tokio::test]
async fn s4_console_origins_ipv6_default_ports_and_case() {
    // No origin set: the request's Host decides.
    let addr = console_app(&[]).await;
    let cases: [(&str, &str, u16); 7] = [
        ("[::1]:8080", "http://[::1]:8080", 200),
        ("[::1]:8080", "HTTP://[::1]:8080", 200),
        ("[::1]:80", "http://[::1]", 200),
        ("Ops.Example.com:443", "https://ops.example.com", 200),
        ("[::1]:8080", "http://[::1]:8081", 403),
        ("[::1]:8080", "null", 403),
        ("[::1]:8080", "ftp://[::1]:8080", 403),
    ];
    for (host, origin, want) in cases {
        assert_eq!(
            purge(addr, host, &[("origin", origin)]).await,
            want,
            "{host} {origin}"
        );
    }
    // Origins set: IPv6 with a port, and a default port written out.
    let addr = console_app(&["http://[::1]:8080/ops", "https://ops.example.com:443"]).await;
    let cases: [(&str, u16); 6] = [
        ("http://[::1]:8080", 200),
        ("https://ops.example.com", 200),
        ("https://OPS.example.com:443", 200),
        ("http://[::1]:8081", 403),
        ("http://ops.example.com", 403),
        ("https://ops.example.com.", 403),
    ];
    for (origin, want) in cases {
        assert_eq!(
            purge(addr, "internal:9000", &[("origin", origin)]).await,
            want,
            "{origin}"
        );
    }
}
