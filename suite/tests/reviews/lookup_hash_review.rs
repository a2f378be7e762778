//! Review of two hot-path changes, written to break them:
//!
//! - 443dea9 (`src/lines.rs`): header lookups scan a map's lines when it has at most eight
//!   names and hash above. Every reading that moved onto it (the key lines, Content-Type for the
//!   dialect and the fingerprint, Content-Length against the body limit, configured fingerprint
//!   headers, grpc-status in the cache policy, Content-Encoding/Accept-Encoding for replays)
//!   must answer the same whatever the size of the map. The HTTP tests run the same logical
//!   requests padded with 0..=20 harmless header lines (and responses padded around eight
//!   names) and require identical answers and effects at the handler; in-process and public-API
//!   tests do the same at exact map sizes.
//! - e5c7f21 (`src/store/memory/`): records carry 32 bits of their key's hash, the table is
//!   re-placed from it on growth, shrink, compaction and purge; the data head holds the scope's
//!   and the joined key's lengths in two u16 (two u32 past 65 535). Tens of thousands of keys
//!   through growth, removal, purge, compaction and reclaim, keys around the head's boundaries
//!   and the same bytes split differently: every live key replays exactly its own response,
//!   every removed or expired one is gone, the byte count returns to zero.

use crate::common;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use bytes::Bytes;
use common::memory::{Clock, acquire, ms, reconcile_req, req, response};
use common::{Effects, guard, raw_status, serve};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use tower::ServiceExt;
use tower_idempotency::store::{
    Claim, FencingToken, RecordStatus, Resolution, ScopedKey, StoredResponse, UncertainQuery, kit,
};
use tower_idempotency::{Fingerprint, IdempotencyLayer, IdempotencyStore, MemoryStore, Outcome};

/// The scan's size in `src/lines.rs`: maps of at most this many names are scanned.
const SCAN: usize = 8;
/// The body limit of every app here.
const LIMIT: usize = 64;
/// Padding lines added to a request sent over HTTP: with the request's own few names (host,
/// accept, content-length, the key, ...) the server-side map crosses eight names.
const REQUEST_PADS: [usize; 14] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 20];
/// The number of distinct names a guarded response is padded up to (0: not padded).
const RESPONSE_NAMES: [usize; 5] = [0, 7, 8, 9, 24];

// =============================================================================================
// Part 1 (443dea9): the same logical request or response, at every map size, over real HTTP.
// =============================================================================================

/// What a client sees of one answer: enough to tell a run from a replay, a refusal's kind and
/// its framing (HTTP problem, gRPC status).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Seen {
    status: u16,
    replayed: Option<String>,
    content_type: Option<String>,
    grpc_status: Option<String>,
    content_encoding: Vec<String>,
    /// The problem's type for a problem+json answer, else the body as text.
    body: String,
}

/// One request of a scenario: path and query, header lines (in order, names repeated for
/// repeated lines), body.
#[derive(Clone)]
struct Step {
    path: &'static str,
    lines: Vec<(&'static str, &'static str)>,
    body: Vec<u8>,
}

fn step(path: &'static str, lines: &[(&'static str, &'static str)], body: &[u8]) -> Step {
    Step {
        path,
        lines: lines.to_vec(),
        body: body.to_vec(),
    }
}

/// A served app: an outermost layer records how many distinct names each request's map has
/// when it reaches the idempotency layer (nothing sits between them).
struct Rig {
    addr: SocketAddr,
    effects: Effects,
    sizes: Arc<Mutex<Vec<usize>>>,
}

/// The handler's answer, from its query: `status`, `grpc` (a grpc-status line), `enc` (one
/// Content-Encoding line per `|`-separated item), `ct`; then padding names up to
/// `response_names` distinct names. The body says which run this is.
fn answer(effects: &Effects, uri: &http::Uri, response_names: usize) -> Response<Body> {
    let n = effects.hit();
    let mut status = StatusCode::CREATED;
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("text/plain"));
    for (name, value) in form_urlencoded::parse(uri.query().unwrap_or_default().as_bytes()) {
        match &*name {
            "status" => {
                status = StatusCode::from_u16(value.parse().expect("status")).expect("code")
            }
            "grpc" => {
                headers.append("grpc-status", HeaderValue::from_str(&value).expect("value"));
            }
            "near" => {
                // Names one byte off grpc-status and content-encoding: never read as them.
                for near in [
                    "grpc-statuz",
                    "grpc-statu",
                    "grpc-status-x",
                    "content-encodinh",
                ] {
                    headers.append(near, HeaderValue::from_str(&value).expect("value"));
                }
            }
            "enc" => {
                for coding in value.split('|') {
                    headers.append(
                        "content-encoding",
                        HeaderValue::from_str(coding).expect("value"),
                    );
                }
            }
            _ => {}
        }
    }
    let mut i = 0;
    while headers.keys_len() < response_names {
        headers.append(
            HeaderName::from_bytes(format!("x-rpad-{i}").as_bytes()).expect("name"),
            HeaderValue::from_static("p"),
        );
        i += 1;
    }
    let mut res = Response::new(Body::from(format!("run {n}")));
    *res.status_mut() = status;
    *res.headers_mut() = headers;
    res
}

async fn rig(response_names: usize) -> Rig {
    let effects = Effects::default();
    let sizes: Arc<Mutex<Vec<usize>>> = Arc::default();
    let sink = effects.clone();
    let seen = sizes.clone();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .single_tenant()
        .body_limit(LIMIT)
        .fingerprint_header(HeaderName::from_static("x-api-version"));
    let app = Router::new()
        .route(
            "/op",
            post(move |uri: http::Uri| {
                let sink = sink.clone();
                async move { answer(&sink, &uri, response_names) }
            }),
        )
        .layer(layer)
        .layer(tower::util::MapRequestLayer::new(
            move |request: Request<Body>| {
                seen.lock()
                    .expect("sizes")
                    .push(request.headers().keys_len());
                request
            },
        ));
    Rig {
        addr: serve(app).await,
        effects,
        sizes,
    }
}

async fn seen_of(res: reqwest::Response) -> Seen {
    let header = |name: &str| {
        res.headers()
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    };
    let content_type = header("content-type");
    let replayed = header("idempotency-replayed");
    let grpc_status = header("grpc-status");
    let content_encoding = res
        .headers()
        .get_all("content-encoding")
        .iter()
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .collect();
    let status = res.status().as_u16();
    let bytes = guard("a body", res.bytes()).await.expect("body");
    let body = if content_type.as_deref() == Some("application/problem+json") {
        let problem: serde_json::Value = serde_json::from_slice(&bytes).expect("problem json");
        problem["type"].as_str().unwrap_or("?").to_owned()
    } else {
        String::from_utf8_lossy(&bytes).into_owned()
    };
    Seen {
        status,
        replayed,
        content_type,
        grpc_status,
        content_encoding,
        body,
    }
}

/// Sends `step` with `pads` harmless lines, half before its own lines and half after.
async fn send(rig: &Rig, step: &Step, pads: usize) -> Seen {
    let mut request = common::client().post(format!("http://{}{}", rig.addr, step.path));
    let before = pads / 2;
    for i in 0..before {
        request = request.header(format!("x-pad-{i}"), "p");
    }
    // reqwest appends: a name given twice is sent as two lines, in order.
    for (name, value) in &step.lines {
        request = request.header(*name, *value);
    }
    for i in before..pads {
        request = request.header(format!("x-pad-{i}"), "p");
    }
    let res = guard("a request", request.body(step.body.clone()).send())
        .await
        .expect("response");
    seen_of(res).await
}

/// Runs `steps` against a fresh app for every request padding and response size; every run
/// must see the same answers and the same number of effects. Returns them, and checks that
/// the request maps really were on both sides of the scan's size for every step.
async fn differential(what: &str, steps: &[Step]) -> (Vec<Seen>, usize) {
    let mut reference: Option<(Vec<Seen>, usize, usize, usize)> = None;
    let mut sizes_per_step: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); steps.len()];
    for response_names in RESPONSE_NAMES {
        for pads in REQUEST_PADS {
            let rig = rig(response_names).await;
            let mut seen = Vec::new();
            for step in steps {
                seen.push(send(&rig, step, pads).await);
            }
            let effects = rig.effects.count();
            let sizes = rig.sizes.lock().expect("sizes").clone();
            assert_eq!(sizes.len(), steps.len(), "{what}: one request per step");
            for (i, size) in sizes.into_iter().enumerate() {
                sizes_per_step[i].insert(size);
            }
            match &reference {
                None => reference = Some((seen, effects, pads, response_names)),
                Some((first, first_effects, p0, r0)) => {
                    for (i, (a, b)) in first.iter().zip(&seen).enumerate() {
                        assert_eq!(
                            a, b,
                            "{what}: step {i} answered differently with {pads} padding lines and \
                             {response_names} response names than with {p0} and {r0}"
                        );
                    }
                    assert_eq!(
                        *first_effects, effects,
                        "{what}: effects differ with {pads} padding lines and {response_names} \
                         response names than with {p0} and {r0}"
                    );
                }
            }
        }
    }
    for (i, sizes) in sizes_per_step.iter().enumerate() {
        assert!(
            sizes.iter().any(|&n| n <= SCAN) && sizes.iter().any(|&n| n > SCAN),
            "{what}: step {i} never straddled the scan's size: {sizes:?}"
        );
        // Each padding line adds a name: the sizes are contiguous, so both sides of the
        // boundary itself were taken.
        assert!(
            sizes.contains(&SCAN) && sizes.contains(&(SCAN + 1)),
            "{what}: step {i} missed the boundary: {sizes:?}"
        );
    }
    let (seen, effects, _, _) = reference.expect("at least one run");
    (seen, effects)
}

fn ran(seen: &Seen, body: &str) {
    assert!(
        (200..300).contains(&seen.status) && seen.replayed.as_deref() != Some("true"),
        "{seen:?}"
    );
    assert_eq!(seen.body, body, "{seen:?}");
}

fn replayed(seen: &Seen, body: &str) {
    assert_eq!(seen.replayed.as_deref(), Some("true"), "{seen:?}");
    assert_eq!(seen.body, body, "{seen:?}");
}

fn refused(seen: &Seen, status: u16, slug: &str) {
    assert_eq!(seen.status, status, "{seen:?}");
    assert_eq!(seen.body, common::problem_type(slug), "{seen:?}");
}

/// §1 step 1: two Idempotency-Key lines are refused 400 at every map size (equal values, one
/// empty, the key among repeated fillers); names one byte off the key's are no key; a single
/// line runs once and replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_lines_are_read_alike_at_every_map_size() {
    let near = [
        ("idempotency-ke", "n"),
        ("idempotency-keys", "n"),
        ("idempotency-kez", "n"),
        ("dempotency-key", "n"),
    ];
    let with_near = |lines: &[(&'static str, &'static str)]| {
        let mut all = near.to_vec();
        all.extend_from_slice(lines);
        all
    };
    let steps = vec![
        step(
            "/op",
            &[("idempotency-key", "a"), ("idempotency-key", "b")],
            b"x",
        ),
        step(
            "/op",
            &[("idempotency-key", "a"), ("idempotency-key", "a")],
            b"x",
        ),
        step(
            "/op",
            &[("idempotency-key", "a"), ("idempotency-key", "")],
            b"x",
        ),
        step(
            "/op",
            &[("idempotency-key", ""), ("idempotency-key", "a")],
            b"x",
        ),
        step("/op", &with_near(&[]), b"x"),
        step(
            "/op",
            &[
                ("idempotency-key", "a"),
                ("x-f", "1"),
                ("x-f", "2"),
                ("idempotency-key", "b"),
            ],
            b"x",
        ),
        step("/op", &with_near(&[("idempotency-key", "a")]), b"x"),
        step("/op", &[("idempotency-key", "a")], b"x"),
        // Still two lines once the key is recorded: refused, not replayed.
        step(
            "/op",
            &[("idempotency-key", "a"), ("idempotency-key", "a")],
            b"x",
        ),
    ];
    let (seen, effects) = differential("key lines", &steps).await;
    for s in &seen[..4] {
        refused(s, 400, "key-invalid");
    }
    refused(&seen[4], 400, "key-missing");
    refused(&seen[5], 400, "key-invalid");
    ran(&seen[6], "run 1");
    replayed(&seen[7], "run 1");
    refused(&seen[8], 400, "key-invalid");
    assert_eq!(effects, 1);
}

/// §1 step 3: a Content-Length over the limit is 413 and claims nothing, at every map size;
/// names one byte off Content-Length are not read as it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_limit_is_read_alike_at_every_map_size() {
    let over = vec![b'a'; LIMIT + 1];
    let at = vec![b'a'; LIMIT];
    let steps = vec![
        step("/op", &[("idempotency-key", "l1")], &over),
        // Nothing was claimed: the key runs now.
        step("/op", &[("idempotency-key", "l1")], &at),
        step("/op", &[("idempotency-key", "l1")], &at),
        step(
            "/op",
            &[
                ("idempotency-key", "l2"),
                ("content-lengtz", "1"),
                ("content-lengt", "1"),
            ],
            &over,
        ),
        step(
            "/op",
            &[
                ("idempotency-key", "l3"),
                ("content-lengtz", "999999"),
                ("content-lengths", "999999"),
                ("ontent-length", "999999"),
            ],
            b"small",
        ),
    ];
    let (seen, effects) = differential("body limit", &steps).await;
    refused(&seen[0], 413, "body-too-large");
    ran(&seen[1], "run 1");
    replayed(&seen[2], "run 1");
    refused(&seen[3], 413, "body-too-large");
    ran(&seen[4], "run 2");
    assert_eq!(effects, 2);
}

/// §1 step 4 and the dialects: the first Content-Type line is the one read (as
/// `HeaderMap::get` reads it) for the body's canonical form and for telling HTTP from gRPC and
/// gRPC-Web, at every map size; since session 38 every line also counts as sent (a handler may
/// read any of them), so the retries below send the same lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_type_lines_are_read_alike_at_every_map_size() {
    let json = br#"{"a":1,"b":2}"#;
    let reordered = br#"{ "b": 2, "a": 1 }"#;
    let steps = vec![
        step(
            "/op",
            &[
                ("idempotency-key", "c1"),
                ("content-type", "application/json"),
                ("content-type", "text/plain"),
            ],
            json,
        ),
        // The first line is JSON: canonicalised, a reordered body is the same request.
        step(
            "/op",
            &[
                ("idempotency-key", "c1"),
                ("content-type", "application/json"),
                ("content-type", "text/plain"),
            ],
            reordered,
        ),
        // The first line is text/plain now: another request.
        step(
            "/op",
            &[
                ("idempotency-key", "c1"),
                ("content-type", "text/plain"),
                ("content-type", "application/json"),
            ],
            json,
        ),
        // A name one byte off Content-Type does not count.
        step(
            "/op",
            &[
                ("idempotency-key", "c1"),
                ("content-typf", "text/plain"),
                ("content-typ", "text/plain"),
                ("content-type", "application/json"),
                ("content-type", "text/plain"),
            ],
            reordered,
        ),
        // Dialects: the first line decides how a refusal is framed.
        step(
            "/op",
            &[
                ("content-type", "application/grpc"),
                ("content-type", "application/json"),
            ],
            b"",
        ),
        step(
            "/op",
            &[
                ("content-type", "application/json"),
                ("content-type", "application/grpc"),
            ],
            b"",
        ),
        step(
            "/op",
            &[("content-type", "application/grpc-web+proto")],
            b"",
        ),
        step(
            "/op",
            &[
                ("content-typf", "application/grpc"),
                ("content-type", "application/json"),
            ],
            b"",
        ),
    ];
    let (seen, effects) = differential("content-type lines", &steps).await;
    ran(&seen[0], "run 1");
    replayed(&seen[1], "run 1");
    refused(&seen[2], 422, "fingerprint-mismatch");
    replayed(&seen[3], "run 1");
    assert!(
        seen[4]
            .content_type
            .as_deref()
            .is_some_and(|ct| ct.starts_with("application/grpc"))
            && seen[4].grpc_status.is_some(),
        "a gRPC call is refused as gRPC: {:?}",
        seen[4]
    );
    refused(&seen[5], 400, "key-missing");
    assert!(
        seen[6]
            .content_type
            .as_deref()
            .is_some_and(|ct| ct.starts_with("application/grpc-web"))
            && seen[6].grpc_status.is_some(),
        "a gRPC-Web call is refused as gRPC-Web: {:?}",
        seen[6]
    );
    refused(&seen[7], 400, "key-missing");
    assert_eq!(effects, 1);
}

/// §1 step 4 (fingerprint headers as HTTP field values): lines joined by commas, order
/// counts, empty elements and a missing header count the same, names one byte off are not the
/// header; at every map size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fingerprint_header_lines_are_read_alike_at_every_map_size() {
    let key = ("idempotency-key", "f1");
    let steps = vec![
        step(
            "/op",
            &[key, ("x-api-version", "v1"), ("x-api-version", "v2")],
            b"b",
        ),
        step("/op", &[key, ("x-api-version", "v1, v2")], b"b"),
        step(
            "/op",
            &[key, ("x-api-version", "v1,v2"), ("x-api-version", "")],
            b"b",
        ),
        step(
            "/op",
            &[key, ("x-api-version", "v1"), ("x-api-version", " , v2")],
            b"b",
        ),
        step(
            "/op",
            &[key, ("x-api-version", "v2"), ("x-api-version", "v1")],
            b"b",
        ),
        step("/op", &[key, ("x-api-version", "v1")], b"b"),
        step("/op", &[key], b"b"),
        step(
            "/op",
            &[
                key,
                ("x-api-version", "v1"),
                ("x-api-version", "v2"),
                ("x-api-version", "v3"),
            ],
            b"b",
        ),
        step(
            "/op",
            &[
                key,
                ("x-api-versio", "v3"),
                ("x-api-version", "v1"),
                ("x-api-versions", "v3"),
                ("x-api-version", "v2"),
                ("x-api-versiom", "v3"),
            ],
            b"b",
        ),
        // Missing and empty are the same header.
        step("/op", &[("idempotency-key", "f2")], b"b"),
        step(
            "/op",
            &[("idempotency-key", "f2"), ("x-api-version", "")],
            b"b",
        ),
        step(
            "/op",
            &[
                ("idempotency-key", "f2"),
                ("x-api-version", ","),
                ("x-api-version", " "),
            ],
            b"b",
        ),
        step(
            "/op",
            &[("idempotency-key", "f2"), ("x-api-version", "v1")],
            b"b",
        ),
    ];
    let (seen, effects) = differential("fingerprint header lines", &steps).await;
    ran(&seen[0], "run 1");
    replayed(&seen[1], "run 1");
    replayed(&seen[2], "run 1");
    replayed(&seen[3], "run 1");
    for s in &seen[4..8] {
        refused(s, 422, "fingerprint-mismatch");
    }
    replayed(&seen[8], "run 1");
    ran(&seen[9], "run 2");
    replayed(&seen[10], "run 2");
    replayed(&seen[11], "run 2");
    refused(&seen[12], 422, "fingerprint-mismatch");
    assert_eq!(effects, 2);
}

/// §3 (a replay never carries a coding the retry did not accept): a recorded answer whose
/// Content-Encoding is split over two lines, or one line, or follows an identity line, is
/// replayed only to retries accepting every coding, whatever the size of the response's map
/// and of the retry's; names one byte off are not codings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_encoding_lines_are_read_alike_at_every_map_size() {
    let mut steps = Vec::new();
    for (key, path) in [
        ("e1", "/op?enc=gzip|br"),
        ("e2", "/op?enc=gzip,%20br"),
        ("e3", "/op?enc=identity|gzip|br&near=zstd"),
    ] {
        let k = ("idempotency-key", key);
        steps.extend([
            step(path, &[k], b"e"),
            step(path, &[k, ("accept-encoding", "gzip")], b"e"),
            step(path, &[k, ("accept-encoding", "br")], b"e"),
            step(path, &[k, ("accept-encoding", "gzip, br")], b"e"),
            step(
                path,
                &[k, ("accept-encoding", "br"), ("accept-encoding", "gzip")],
                b"e",
            ),
            step(
                path,
                &[
                    k,
                    ("accept-encoding", "br"),
                    ("accept-encoding", "gzip;q=0"),
                ],
                b"e",
            ),
            step(path, &[k, ("accept-encoding", "*")], b"e"),
            step(
                path,
                &[k, ("accept-encoding", "*"), ("accept-encoding", "br;q=0")],
                b"e",
            ),
            step(
                path,
                &[
                    k,
                    ("accept-encodinh", "gzip, br"),
                    ("accept-encoding", "gzip"),
                ],
                b"e",
            ),
            step(path, &[k], b"e"),
        ]);
    }
    let (seen, effects) = differential("content-encoding lines", &steps).await;
    for (block, run) in seen.chunks(10).zip(["run 1", "run 2", "run 3"]) {
        ran(&block[0], run);
        refused(&block[1], 406, "encoding-not-accepted");
        refused(&block[2], 406, "encoding-not-accepted");
        replayed(&block[3], run);
        replayed(&block[4], run);
        refused(&block[5], 406, "encoding-not-accepted");
        replayed(&block[6], run);
        refused(&block[7], 406, "encoding-not-accepted");
        refused(&block[8], 406, "encoding-not-accepted");
        replayed(&block[9], run);
    }
    assert_eq!(effects, 3);
}

/// §3 (cache policy): a grpc-status line on a response decides its policy as
/// `HeaderMap::get` reads it, at every size of the response's map: UNAVAILABLE (14) releases
/// a 200, OK (0) records a 500; names one byte off grpc-status are not read; a plain 500
/// releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_status_on_http_responses_is_read_alike_at_every_map_size() {
    let steps = vec![
        step("/op?status=200&grpc=14", &[("idempotency-key", "g1")], b"g"),
        step("/op?status=200&grpc=14", &[("idempotency-key", "g1")], b"g"),
        step("/op?status=500&grpc=0", &[("idempotency-key", "g2")], b"g"),
        step("/op?status=500&grpc=0", &[("idempotency-key", "g2")], b"g"),
        step("/op?status=200&near=14", &[("idempotency-key", "g3")], b"g"),
        step("/op?status=200&near=14", &[("idempotency-key", "g3")], b"g"),
        step("/op?status=500&near=0", &[("idempotency-key", "g4")], b"g"),
        step("/op?status=500&near=0", &[("idempotency-key", "g4")], b"g"),
        // Two lines: the first is the status read.
        step(
            "/op?status=200&grpc=0&grpc=14",
            &[("idempotency-key", "g5")],
            b"g",
        ),
        step(
            "/op?status=200&grpc=0&grpc=14",
            &[("idempotency-key", "g5")],
            b"g",
        ),
        step(
            "/op?status=200&grpc=14&grpc=0",
            &[("idempotency-key", "g6")],
            b"g",
        ),
        step(
            "/op?status=200&grpc=14&grpc=0",
            &[("idempotency-key", "g6")],
            b"g",
        ),
    ];
    let (seen, effects) = differential("grpc-status on HTTP", &steps).await;
    ran(&seen[0], "run 1");
    ran(&seen[1], "run 2");
    assert_eq!(seen[2].status, 500);
    assert_eq!(
        (seen[3].status, seen[3].replayed.as_deref()),
        (500, Some("true"))
    );
    assert_eq!(seen[3].body, seen[2].body);
    ran(&seen[4], "run 4");
    replayed(&seen[5], "run 4");
    assert_eq!(seen[6].status, 500);
    assert_eq!((seen[7].status, seen[7].replayed.as_deref()), (500, None));
    assert_eq!(seen[7].body, "run 6");
    ran(&seen[8], "run 7");
    replayed(&seen[9], "run 7");
    ran(&seen[10], "run 8");
    ran(&seen[11], "run 9");
    assert_eq!(effects, 9);
}

/// §1 step 3 over raw TCP, the map's size exact: a head declaring a body over the limit is
/// answered 413 without the body ever being sent (the declared length is read, not the
/// stream), however many lines the head has and wherever Content-Length sits; nothing is
/// claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_length_over_the_limit_is_refused_before_the_body_at_every_map_size() {
    let rig = rig(0).await;
    for names in 3..=20usize {
        for content_length_last in [false, true] {
            // host, the key and content-length, then fillers up to `names` distinct names.
            let mut head = format!(
                "POST /op HTTP/1.1\r\nhost: x\r\nidempotency-key: raw-{names}-{content_length_last}\r\n"
            );
            if !content_length_last {
                head.push_str(&format!("content-length: {}\r\n", LIMIT + 1000));
            }
            for i in 0..names - 3 {
                let name = match i % 3 {
                    // One byte off Content-Length (same length), then ones differing in length.
                    0 if i == 0 => "content-lengtz".to_owned(),
                    0 => format!("content-lengtz{i}"),
                    1 => format!("x-pad-{i}"),
                    _ => format!("ontent-length{i}"),
                };
                head.push_str(&format!("{name}: 7\r\n"));
            }
            if content_length_last {
                head.push_str(&format!("content-length: {}\r\n", LIMIT + 1000));
            }
            head.push_str("\r\n");
            let status = guard(
                "a refusal before the body",
                raw_status(rig.addr, head.as_bytes()),
            )
            .await;
            assert_eq!(
                status, 413,
                "{names} names, Content-Length last: {content_length_last}"
            );
        }
    }
    let sizes = rig.sizes.lock().expect("sizes").clone();
    assert_eq!(
        sizes,
        (3..=20).flat_map(|n| [n, n]).collect::<Vec<_>>(),
        "the heads' maps have exactly the sizes meant"
    );
    // Nothing was claimed: every key runs now, once.
    for names in 3..=20usize {
        let res = guard(
            "a request",
            common::client()
                .post(format!("http://{}/op", rig.addr))
                .header("idempotency-key", format!("raw-{names}-false"))
                .body("ok")
                .send(),
        )
        .await
        .expect("response");
        let seen = seen_of(res).await;
        ran(&seen, &format!("run {}", names - 2));
    }
    assert_eq!(rig.effects.count(), 18);
}

// =============================================================================================
// Part 1, in process: maps of exact sizes.
// =============================================================================================

/// `n` filler names (some one byte off the names read, some repeated).
fn fillers(n: usize) -> Vec<(HeaderName, HeaderValue)> {
    let mut out = Vec::new();
    for i in 0..n {
        let name = match i % 4 {
            0 => format!("idempotency-ke{i}"),
            1 => format!("content-typ{i}"),
            2 => format!("x-api-versio{i}"),
            _ => format!("x-filler-{i}"),
        };
        let name = HeaderName::from_bytes(name.as_bytes()).expect("name");
        out.push((name.clone(), HeaderValue::from_static("f")));
        if i % 3 == 0 {
            out.push((name, HeaderValue::from_static("g")));
        }
    }
    out
}

/// A map of `lines`, with fillers up to `names` distinct names, put before (`front`) or after
/// them; the map has exactly `names` names when `lines` have fewer.
fn padded(lines: &[(HeaderName, HeaderValue)], names: usize, front: bool) -> HeaderMap {
    let own: HashSet<&HeaderName> = lines.iter().map(|(n, _)| n).collect();
    let extra = names.saturating_sub(own.len());
    let mut all: Vec<(HeaderName, HeaderValue)> = Vec::new();
    if front {
        all.extend(fillers(extra));
        all.extend(lines.iter().cloned());
    } else {
        all.extend(lines.iter().cloned());
        all.extend(fillers(extra));
    }
    let mut map = HeaderMap::new();
    for (name, value) in all {
        map.append(name, value);
    }
    assert_eq!(map.keys_len(), names.max(own.len()));
    map
}

fn line(name: &'static str, value: &'static str) -> (HeaderName, HeaderValue) {
    (
        HeaderName::from_static(name),
        HeaderValue::from_static(value),
    )
}

/// A request's header lines, and its body.
type Case = (Vec<(HeaderName, HeaderValue)>, &'static [u8]);

/// Public API (`Fingerprint::of`): the fingerprint of a request with filler lines is the one
/// without them, at every map size from 0 to 20 names, and two Content-Type lines do not
/// fingerprint as their first line alone (each counts, session 38).
#[test]
fn fingerprints_do_not_depend_on_the_size_of_the_map() {
    let cases: Vec<Case> = vec![
        (vec![], b"raw"),
        (
            vec![line("content-type", "application/json")],
            br#"{"b":1,"a":2}"#,
        ),
        (
            vec![
                line("content-type", "application/json"),
                line("content-type", "text/plain"),
            ],
            br#"{"b":1,"a":2}"#,
        ),
        (
            vec![
                line("content-type", "text/plain"),
                line("content-type", "application/json"),
            ],
            br#"{"b":1,"a":2}"#,
        ),
        (
            vec![line("content-type", "application/x-www-form-urlencoded")],
            b"b=1&a=2",
        ),
    ];
    let fp = |headers: HeaderMap, body: &[u8]| {
        let mut request = Request::post("/orders?q=1").body(()).expect("request");
        *request.headers_mut() = headers;
        let (parts, ()) = request.into_parts();
        Fingerprint::of(&parts, body).expect("a fingerprint")
    };
    for (lines, body) in &cases {
        let alone = fp(padded(lines, 0, false), body);
        // Two Content-Type lines each count (session 38): not the first alone.
        let first_only: Vec<_> = lines.iter().take(1).cloned().collect();
        assert_eq!(
            fp(padded(&first_only, 0, false), body) == alone,
            lines.len() < 2,
            "{lines:?}"
        );
        for names in 0..=20 {
            for front in [false, true] {
                assert_eq!(
                    fp(padded(lines, names, front), body),
                    alone,
                    "{lines:?} with {names} names (fillers first: {front})"
                );
            }
        }
    }
    // JSON is canonicalised at every size: a reordered body is the same request.
    let json = vec![line("content-type", "application/json")];
    for names in 0..=20 {
        assert_eq!(
            fp(padded(&json, names, true), br#"{"a":2,"b":1}"#),
            fp(padded(&json, 0, true), br#"{ "b": 1, "a": 2 }"#),
            "{names} names"
        );
    }
}

/// Public API (`Outcome`): the grpc-status read from headers, else trailers, and whether the
/// outcome is definitive, do not depend on the size of either map.
#[test]
fn outcomes_do_not_depend_on_the_size_of_the_map() {
    let cases: Vec<Vec<(HeaderName, HeaderValue)>> = vec![
        vec![],
        vec![line("grpc-status", "0")],
        vec![line("grpc-status", "14")],
        vec![line("grpc-status", "0"), line("grpc-status", "14")],
        vec![line("grpc-status", "14"), line("grpc-status", "0")],
        vec![line("grpc-statuz", "14"), line("grpc-statu", "14")],
        vec![
            line("grpc-status-details-bin", "AA"),
            line("grpc-status", "5"),
        ],
        vec![line("grpc-status", "00")],
    ];
    let read = |headers: &HeaderMap, trailers: Option<&HeaderMap>, status: u16| {
        let outcome = Outcome {
            status: StatusCode::from_u16(status).expect("status"),
            headers,
            trailers,
            jsonrpc: None,
        };
        (outcome.grpc_status(), outcome.is_definitive())
    };
    for lines in &cases {
        for status in [200u16, 500] {
            let alone = padded(lines, 0, false);
            let expected_headers = read(&alone, None, status);
            let empty = HeaderMap::new();
            let expected_trailers = read(&empty, Some(&alone), status);
            // The reading HeaderMap::get gives: the first grpc-status line.
            let first = alone.get("grpc-status").cloned();
            assert_eq!(
                expected_headers.0.is_some(),
                first.is_some(),
                "{lines:?}: a status is read exactly when a grpc-status line exists"
            );
            for names in 0..=20 {
                for front in [false, true] {
                    let map = padded(lines, names, front);
                    assert_eq!(
                        read(&map, None, status),
                        expected_headers,
                        "{lines:?} {names}"
                    );
                    assert_eq!(
                        read(&empty, Some(&map), status),
                        expected_trailers,
                        "{lines:?} {names} (trailers)"
                    );
                }
            }
        }
    }
}

/// The whole body of an in-process response.
async fn body_of(res: Response<Body>) -> Bytes {
    guard("a body", axum::body::to_bytes(res.into_body(), usize::MAX))
        .await
        .expect("body")
}

/// In process, the map's size exact (0 to 16 names, fillers before or after): the key lines,
/// the declared length (with a body that never ends: only the header can answer) and a single
/// key that runs once.
#[tokio::test]
async fn key_and_declared_length_at_exact_map_sizes() {
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/k",
            post(move || {
                let sink = sink.clone();
                async move { format!("run {}", sink.hit()) }
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .body_limit(LIMIT),
        );
    let call = |headers: HeaderMap, body: Body| {
        let mut request = Request::post("/k").body(body).expect("request");
        *request.headers_mut() = headers;
        let app = app.clone();
        async move {
            guard("an in-process request", app.oneshot(request))
                .await
                .expect("infallible")
        }
    };
    let mut runs = 0;
    for names in 0..=16usize {
        for front in [false, true] {
            let tag = format!("{names}-{front}");
            let key = HeaderValue::from_str(&tag).expect("key");
            let key_line = (HeaderName::from_static("idempotency-key"), key.clone());
            // Two lines, the same value: refused.
            let two = padded(&[key_line.clone(), key_line.clone()], names, front);
            let res = call(two, Body::from("x")).await;
            assert_eq!(
                res.status(),
                StatusCode::BAD_REQUEST,
                "{tag}: two key lines"
            );
            // No key line (names one byte off only): missing.
            let none = padded(&[], names.max(1), front);
            let res = call(none, Body::from("x")).await;
            assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{tag}: no key");
            // A declared length over the limit, the body never ending: 413 from the header.
            let declared = padded(
                &[
                    key_line.clone(),
                    (
                        http::header::CONTENT_LENGTH,
                        HeaderValue::from(LIMIT as u64 + 1),
                    ),
                ],
                names,
                front,
            );
            let never =
                Body::from_stream(futures_util::stream::pending::<Result<Bytes, std::io::Error>>());
            let res = call(declared, never).await;
            assert_eq!(
                res.status(),
                StatusCode::PAYLOAD_TOO_LARGE,
                "{tag}: declared length"
            );
            // The key was not claimed: it runs once, then replays.
            let one = padded(std::slice::from_ref(&key_line), names, front);
            let res = call(one.clone(), Body::from("x")).await;
            assert_eq!(res.status(), StatusCode::OK, "{tag}");
            runs += 1;
            assert_eq!(body_of(res).await, format!("run {runs}"), "{tag}");
            let res = call(one, Body::from("x")).await;
            assert_eq!(res.headers()["idempotency-replayed"], "true", "{tag}");
            assert_eq!(body_of(res).await, format!("run {runs}"), "{tag}");
        }
    }
    assert_eq!(effects.count(), runs);
    assert_eq!(runs, 34);
}

// =============================================================================================
// Part 2 (e5c7f21): MemoryStore records carrying their key's hash, and the data head.
// =============================================================================================

const HOUR: u64 = 3_600_000;

/// A response unique to `tag`: its body and a header say which.
fn own_response(tag: &str) -> StoredResponse {
    let mut r = response(format!("body of {tag}"));
    r.headers.insert(
        "x-tag",
        HeaderValue::from_str(&tag.chars().take(40).collect::<String>()).expect("tag"),
    );
    r
}

async fn complete(store: &MemoryStore, key: &ScopedKey, token: FencingToken, tag: &str, ttl: u64) {
    store
        .complete(key, token, &own_response(tag), ms(ttl))
        .await
        .unwrap_or_else(|e| panic!("complete {tag}: {e}"));
}

/// Checks that `key` replays exactly `tag`'s response, by claim and by lookup.
async fn replays_own(store: &MemoryStore, key: &ScopedKey, tag: &str) {
    match store.claim(&req(key, 1_000, HOUR)).await {
        Ok(Claim::Completed { response, .. }) => {
            assert_eq!(
                *response,
                own_response(tag),
                "{tag}: another record's response"
            )
        }
        other => panic!("{tag}: expected a replay, got {other:?}"),
    }
    let record = store
        .lookup(key)
        .await
        .expect("lookup")
        .unwrap_or_else(|| panic!("{tag}: lookup lost the record"));
    assert_eq!(record.status, RecordStatus::Completed, "{tag}");
    assert_eq!(record.response, Some(own_response(tag)), "{tag}");
}

async fn gone(store: &MemoryStore, key: &ScopedKey, what: &str) {
    assert!(
        store.lookup(key).await.expect("lookup").is_none(),
        "{what}: still found"
    );
}

/// Which of the three lifetimes key `i` gets.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Life {
    Short,
    Medium,
    Long,
}

fn life(i: usize) -> Life {
    match i % 20 {
        0..=16 => Life::Short,
        17 | 18 => Life::Medium,
        _ => Life::Long,
    }
}

/// Tens of thousands of keys (scopes of several lengths, keys that are prefixes of others:
/// `k1`, `k12`, `k123`) through growth of every shard's table, `remove`, a purge of 85% of them
/// (which compacts the shards and moves records), a reclaim of expired records in place, a
/// second purge of moved records, and removal of the rest: every live key replays exactly its
/// own response, every removed or expired key is gone, and the counts return to zero.
#[tokio::test]
async fn many_keys_through_growth_removal_purge_compaction_and_reclaim() {
    const N: usize = 50_000;
    let clock = Clock::new();
    let store = clock.store();
    let key = |i: usize| ScopedKey::new(format!("tenant-{}", "t".repeat(i % 13)), format!("k{i}"));
    let ttl = |i: usize| match life(i) {
        Life::Short => 1_000,
        Life::Medium => 60_000,
        Life::Long => 10 * HOUR,
    };
    for i in 0..N {
        let k = key(i);
        let t = acquire(&store, &req(&k, 1_000, ttl(i))).await;
        complete(&store, &k, t, &format!("first {i}"), ttl(i)).await;
    }
    assert_eq!(store.len(), N);
    for i in 0..N {
        replays_own(&store, &key(i), &format!("first {i}")).await;
    }

    // remove(): every seventh key, whatever its lifetime.
    let removed = |i: usize| i % 7 == 3;
    for i in (0..N).filter(|&i| removed(i)) {
        assert!(store.remove(&key(i)).await.expect("remove"), "remove {i}");
        assert!(
            !store.remove(&key(i)).await.expect("remove"),
            "remove {i} twice"
        );
    }
    let n_removed = (0..N).filter(|&i| removed(i)).count();
    assert_eq!(store.len(), N - n_removed);
    for i in 0..N {
        if removed(i) {
            gone(&store, &key(i), &format!("removed {i}")).await;
        } else if i % 11 == 0 {
            replays_own(&store, &key(i), &format!("first {i}")).await;
        }
    }

    // The short-lived records expire and are purged: most of every shard, so shards compact.
    clock.advance(2_000);
    let short_live = (0..N)
        .filter(|&i| !removed(i) && life(i) == Life::Short)
        .count();
    let purged = store.purge_expired().await.expect("purge");
    assert_eq!(
        purged as usize, short_live,
        "every short-lived record purged, none else"
    );
    assert_eq!(store.len(), N - n_removed - short_live);
    for i in 0..N {
        match (removed(i), life(i)) {
            (true, _) | (false, Life::Short) => gone(&store, &key(i), &format!("{i}")).await,
            _ => replays_own(&store, &key(i), &format!("first {i}")).await,
        }
    }

    // The medium ones expire; half are claimed again before any purge (the expired record's
    // slot takes the new claim), the others left for the purge.
    clock.advance(60_000);
    let mut reclaimed = HashSet::new();
    for i in (0..N).filter(|&i| !removed(i) && life(i) == Life::Medium && i % 2 == 0) {
        let k = key(i);
        match store.claim(&req(&k, 1_000, 10 * HOUR)).await {
            Ok(Claim::Acquired(lease)) => {
                assert_eq!(lease.attempt, 1, "an expired record counts as absent");
                complete(&store, &k, lease.token, &format!("again {i}"), 10 * HOUR).await;
            }
            other => panic!("expired {i}: {other:?}"),
        }
        reclaimed.insert(i);
    }
    // Short ones purged earlier come back as new records, in the slots freed.
    for i in (0..N).filter(|&i| !removed(i) && life(i) == Life::Short && i % 5 == 0) {
        let k = key(i);
        let t = acquire(&store, &req(&k, 1_000, 10 * HOUR)).await;
        complete(&store, &k, t, &format!("back {i}"), 10 * HOUR).await;
    }
    let medium_left = (0..N)
        .filter(|&i| !removed(i) && life(i) == Life::Medium && !reclaimed.contains(&i))
        .count();
    // Claims purge a few expired records of their shard as they go: the purge takes the rest.
    let purged = store.purge_expired().await.expect("purge");
    assert!(purged as usize <= medium_left, "{purged} > {medium_left}");
    let mut live = Vec::new();
    for i in 0..N {
        let tag = match (removed(i), life(i)) {
            (true, _) => None,
            (false, Life::Short) if i % 5 == 0 => Some(format!("back {i}")),
            (false, Life::Short) => None,
            (false, Life::Medium) if reclaimed.contains(&i) => Some(format!("again {i}")),
            (false, Life::Medium) => None,
            (false, Life::Long) => Some(format!("first {i}")),
        };
        match tag {
            Some(tag) => {
                replays_own(&store, &key(i), &tag).await;
                live.push(i);
            }
            None => gone(&store, &key(i), &format!("{i}")).await,
        }
    }
    assert_eq!(store.len(), live.len());
    // Nothing expired is left for a purge.
    assert_eq!(store.purge_expired().await.expect("purge"), 0);

    // remove() of every moved, reclaimed and re-added record finds it.
    for &i in &live {
        assert!(
            store.remove(&key(i)).await.expect("remove"),
            "remove live {i}"
        );
    }
    assert_eq!(store.len(), 0);
    assert_eq!(store.bytes(), 0, "the weight of every record came off");
    for i in (0..N).step_by(97) {
        gone(&store, &key(i), &format!("{i} at the end")).await;
    }
}

/// A string of `n` bytes whose every prefix differs from every other of the same length.
fn pattern(n: usize) -> String {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from(b'a' + (x % 26) as u8)
        })
        .collect()
}

/// The keys around the data head's boundaries: scope and joined lengths at 0, 1, 255, 256,
/// 65 535, 65 536 and beyond, each the same bytes split at many places (another record each)
/// and prefixes of one another.
fn boundary_keys() -> Vec<ScopedKey> {
    let base = pattern(70_001);
    let totals = [
        0usize, 1, 2, 254, 255, 256, 257, 65_279, 65_534, 65_535, 65_536, 65_537, 65_790, 65_791,
        70_000,
    ];
    let mut keys = Vec::new();
    let mut seen = HashSet::new();
    for total in totals {
        let splits = [
            0usize,
            1,
            2,
            254,
            255,
            256,
            total / 2,
            65_279,
            65_280,
            65_534,
            65_535,
            65_536,
            65_537,
            total.saturating_sub(256),
            total.saturating_sub(255),
            total.saturating_sub(1),
            total,
        ];
        for split in splits {
            if split > total || !seen.insert((total, split)) {
                continue;
            }
            keys.push(ScopedKey::new(&base[..split], &base[split..total]));
        }
    }
    keys
}

/// Every key of [`boundary_keys`] is its own record (a claim of each is new), replays exactly
/// its own response, is found by lookup; removing half leaves the others; an expired one is
/// reclaimed in place with its new response; a purge takes the rest; the counts return to zero.
#[tokio::test]
async fn keys_around_the_heads_boundaries_are_each_their_own_record() {
    let clock = Clock::new();
    let store = clock.store();
    let keys = boundary_keys();
    assert!(keys.len() > 120, "{}", keys.len());
    let tag = |n: usize, what: &str| {
        format!(
            "{what} {n} ({}+{})",
            keys[n].scope().len(),
            keys[n].key().len()
        )
    };
    for (n, key) in keys.iter().enumerate() {
        match store.claim(&req(key, 1_000, HOUR)).await {
            Ok(Claim::Acquired(lease)) => {
                complete(&store, key, lease.token, &tag(n, "first"), HOUR).await
            }
            other => panic!(
                "{}: not a new record (taken for another key?): {other:?}",
                tag(n, "key")
            ),
        }
    }
    assert_eq!(store.len(), keys.len());
    for (n, key) in keys.iter().enumerate() {
        replays_own(&store, key, &tag(n, "first")).await;
    }
    // Remove every other key: the neighbours (same bytes split one further, a prefix) stay.
    for (n, key) in keys.iter().enumerate().filter(|(n, _)| n % 2 == 1) {
        assert!(
            store.remove(key).await.expect("remove"),
            "{}",
            tag(n, "remove")
        );
    }
    for (n, key) in keys.iter().enumerate() {
        if n % 2 == 1 {
            gone(&store, key, &tag(n, "removed")).await;
        } else {
            replays_own(&store, key, &tag(n, "first")).await;
        }
    }
    // Expired: every fourth key is claimed again in place, its new response its own.
    clock.advance(HOUR as i64 + 1_000);
    for (n, key) in keys.iter().enumerate().filter(|(n, _)| n % 4 == 0) {
        match store.claim(&req(key, 1_000, HOUR)).await {
            Ok(Claim::Acquired(lease)) => {
                assert_eq!(lease.attempt, 1);
                complete(&store, key, lease.token, &tag(n, "again"), HOUR).await;
            }
            other => panic!("{}: {other:?}", tag(n, "expired")),
        }
    }
    // Claims purge a few expired records as they go: the purge takes the rest.
    let expected_purged = keys.iter().enumerate().filter(|(n, _)| n % 4 == 2).count();
    assert!(store.purge_expired().await.expect("purge") as usize <= expected_purged);
    assert_eq!(store.len(), keys.len().div_ceil(4));
    for (n, key) in keys.iter().enumerate() {
        if n % 4 == 0 {
            replays_own(&store, key, &tag(n, "again")).await;
        } else {
            gone(&store, key, &tag(n, "expired or removed")).await;
        }
    }
    clock.advance(HOUR as i64 + 1_000);
    let left = keys.len().div_ceil(4);
    assert_eq!(store.purge_expired().await.expect("purge") as usize, left);
    assert_eq!(store.len(), 0);
    assert_eq!(store.bytes(), 0);
}

/// Keys past the narrow head (scope or scope+key over 65 535 bytes) among 40 000 small ones
/// that expire: the purge compacts every shard, moving records; the wide ones (and their
/// narrow twins, the same bytes split otherwise) replay exactly their own response, stay
/// removable, and the counts return to zero.
#[tokio::test]
async fn wide_keys_survive_compaction_among_many_small_ones() {
    let clock = Clock::new();
    let store = clock.store();
    let base = pattern(66_000);
    let mut wide = Vec::new();
    for i in 0..24usize {
        let total = 65_530 + i * 3;
        wide.push(ScopedKey::new(
            &base[..total - 10],
            &base[total - 10..total],
        ));
        wide.push(ScopedKey::new(&base[..i], &base[i..total]));
        wide.push(ScopedKey::new(&base[..total], ""));
    }
    let mut small = 0usize;
    for i in 0..40_000usize {
        let k = ScopedKey::new(format!("s{}", i % 5), format!("{i}"));
        let t = acquire(&store, &req(&k, 500, 500)).await;
        complete(&store, &k, t, "small", 500).await;
        small += 1;
        if i % 1_500 == 0 {
            let n = i / 1_500;
            if let Some(w) = wide.get(n * 3..n * 3 + 3) {
                for (j, w) in w.iter().enumerate() {
                    let t = acquire(&store, &req(w, 500, HOUR)).await;
                    complete(&store, w, t, &format!("wide {}", n * 3 + j), HOUR).await;
                }
            }
        }
    }
    let placed = wide.len().min(40_000usize.div_ceil(1_500) * 3);
    assert_eq!(store.len(), small + placed);
    clock.advance(1_000);
    assert_eq!(store.purge_expired().await.expect("purge") as usize, small);
    assert_eq!(store.len(), placed);
    for (n, w) in wide.iter().enumerate().take(placed) {
        replays_own(&store, w, &format!("wide {n}")).await;
    }
    for w in wide.iter().take(placed) {
        assert!(store.remove(w).await.expect("remove"));
    }
    assert_eq!(store.len(), 0);
    assert_eq!(store.bytes(), 0);
}

/// Records awaiting reconciliation among 50 000 others, found through the hash their keys
/// carry by `list_uncertain` and `count_uncertain`, before and after a purge that compacts the
/// shards around them; each resolved record replays exactly its resolution.
#[tokio::test]
async fn uncertain_records_among_many_are_listed_counted_and_resolved() {
    // About 780 records a shard: two slab chunks each, so the purge compacts every shard.
    const N: usize = 50_000;
    let clock = Clock::new();
    let store = clock.store();
    let key = |i: usize| ScopedKey::new(format!("u{}", i % 9), format!("key-{i}"));
    let uncertain = |i: usize| i % 40 == 7;
    for i in 0..N {
        let k = key(i);
        if uncertain(i) {
            let t = acquire(&store, &reconcile_req(&k, 60_000, 500)).await;
            store.mark_uncertain(&k, t).await.expect("mark uncertain");
        } else {
            let t = acquire(&store, &req(&k, 500, 500)).await;
            complete(&store, &k, t, "other", 500).await;
        }
    }
    let expected: BTreeSet<String> = (0..N)
        .filter(|&i| uncertain(i))
        .map(|i| format!("{:?}", key(i)))
        .collect();
    async fn listed(store: &MemoryStore) -> (Vec<String>, HashMap<String, FencingToken>) {
        let mut keys = Vec::new();
        let mut tokens = HashMap::new();
        let mut query = UncertainQuery::first(37);
        loop {
            let page = store.list_uncertain(&query).await.expect("list");
            assert!(page.unreadable.is_empty());
            for record in &page.records {
                assert_eq!(record.status, RecordStatus::NeedsReconciliation);
                keys.push(format!("{:?}", record.key));
                tokens.insert(format!("{:?}", record.key), record.lease_token);
            }
            match page.next {
                Some(next) => query = UncertainQuery::after(next, 37),
                None => break,
            }
        }
        (keys, tokens)
    }
    let (keys, _) = listed(&store).await;
    assert_eq!(keys.len(), expected.len(), "each listed once");
    assert_eq!(keys.iter().cloned().collect::<BTreeSet<_>>(), expected);
    assert_eq!(
        store.count_uncertain().await.expect("count").count as usize,
        expected.len()
    );

    // The others expire and are purged; the shards compact around the uncertain records.
    clock.advance(120_000);
    assert_eq!(
        store.purge_expired().await.expect("purge") as usize,
        N - expected.len()
    );
    let (keys, tokens) = listed(&store).await;
    assert_eq!(
        keys.len(),
        expected.len(),
        "each listed once after compaction"
    );
    assert_eq!(keys.iter().cloned().collect::<BTreeSet<_>>(), expected);
    assert_eq!(
        store.count_uncertain().await.expect("count").count as usize,
        expected.len()
    );

    for i in (0..N).filter(|&i| uncertain(i)) {
        let k = key(i);
        let token = tokens[&format!("{k:?}")];
        let resolution = Resolution::Applied(Box::new(own_response(&format!("resolved {i}"))));
        store
            .resolve(&k, token, &resolution, ms(HOUR), Some("review"))
            .await
            .expect("resolve");
    }
    assert_eq!(store.count_uncertain().await.expect("count").count, 0);
    for i in (0..N).filter(|&i| uncertain(i)) {
        replays_own(&store, &key(i), &format!("resolved {i}")).await;
    }
}

/// The public conformance kit passes on a store already holding 30 000 records (every shard's
/// table grown), and those records still replay their own responses after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_conformance_kit_passes_on_a_grown_store() {
    let store = MemoryStore::new();
    let key = |i: usize| ScopedKey::new("kit-neighbours", format!("n{i}"));
    for i in 0..30_000 {
        let k = key(i);
        let t = acquire(&store, &req(&k, 60_000, 10 * HOUR)).await;
        complete(&store, &k, t, &format!("n {i}"), 10 * HOUR).await;
    }
    tokio::time::timeout(
        Duration::from_secs(600),
        kit::run_all(Arc::new(store.clone())),
    )
    .await
    .expect("the conformance kit hung");
    for i in 0..30_000 {
        replays_own(&store, &key(i), &format!("n {i}")).await;
    }
}

/// Claims, completions and removals of distinct keys from four tasks at once, across every
/// shard's growth: each key replays exactly its own response, each removed key is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_across_growth_keep_their_own_records() {
    const PER_TASK: usize = 8_000;
    let store = MemoryStore::new()
        .max_records(usize::MAX)
        .max_bytes(usize::MAX);
    let key = |t: usize, i: usize| ScopedKey::new(format!("w{t}"), format!("{i}"));
    let mut tasks = Vec::new();
    for t in 0..4usize {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..PER_TASK {
                let k = key(t, i);
                let token = acquire(&store, &req(&k, 60_000, 10 * HOUR)).await;
                complete(&store, &k, token, &format!("w{t} {i}"), 10 * HOUR).await;
                // Remove an earlier one now and then, so slots are freed and reused.
                if i % 5 == 4 {
                    assert!(store.remove(&key(t, i - 2)).await.expect("remove"));
                }
            }
        }));
    }
    for task in tasks {
        guard("a writer", task).await.expect("writer");
    }
    for t in 0..4 {
        for i in 0..PER_TASK {
            let k = key(t, i);
            if i % 5 == 2 {
                gone(&store, &k, &format!("w{t} {i}")).await;
            } else {
                replays_own(&store, &k, &format!("w{t} {i}")).await;
            }
        }
    }
    assert_eq!(store.len(), 4 * (PER_TASK - PER_TASK / 5));
}

/// A record completed twice (a resolution after an uncertain outcome rewrites the data after
/// the key) and one whose response is larger than its key keep the key readable: found,
/// refused to another fingerprint, replaying the last response, on both sides of the head's
/// 16-bit boundary.
#[tokio::test]
async fn rewriting_the_response_keeps_the_key_on_both_sides_of_the_boundary() {
    let store = Clock::new().store();
    let base = pattern(65_600);
    for (scope, key) in [
        (10usize, 20usize),
        (65_535, 0),
        (65_500, 35),
        (65_500, 36),
        (65_536, 1),
        (0, 65_536),
    ] {
        let k = ScopedKey::new(&base[..scope], &base[scope..scope + key]);
        let what = format!("{scope}+{key}");
        let t = acquire(&store, &reconcile_req(&k, 60_000, HOUR)).await;
        store.mark_uncertain(&k, t).await.expect("mark");
        let record = store.lookup(&k).await.expect("lookup").expect("record");
        let big = "r".repeat(70_000);
        store
            .resolve(
                &k,
                record.lease_token,
                &Resolution::Applied(Box::new(own_response(&big))),
                ms(HOUR),
                None,
            )
            .await
            .expect("resolve");
        replays_own(&store, &k, &big).await;
        let mut other = req(&k, 1_000, HOUR);
        other.fingerprint = Fingerprint::from_bytes([9; 32]);
        match store.claim(&other).await {
            Ok(Claim::Completed { fingerprint, .. }) => {
                assert_ne!(fingerprint, other.fingerprint, "{what}")
            }
            other => panic!("{what}: {other:?}"),
        }
        assert!(store.remove(&k).await.expect("remove"), "{what}");
        gone(&store, &k, &what).await;
    }
    assert_eq!(store.len(), 0);
    assert_eq!(store.bytes(), 0);
}
