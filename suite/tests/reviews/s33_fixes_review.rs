//! Session 33 red-team review of today's fixes (1bec5cb..fc718c6): cut response bodies
//! (`replay::capture`'s Content-Length check), keyed/unkeyed HEAD on guarded GET routes
//! (`service::head_of_guarded_get`), and the fingerprint's settings (exclude lists and
//! fingerprint header names now count). Effects are counted at the sink, never from answers.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderName, Method, StatusCode};
use axum::response::Response;
use axum::routing::{get, post};
use common::raw::{header_lines, unique};
use common::{Effects, client, guard, serve};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tower::ServiceBuilder;
use tower_idempotency::fingerprint::JsonFields;
use tower_idempotency::{IdempotencyLayer, MemoryStore};

// ---- shared pieces ----------------------------------------------------------------------------

/// What a raw HTTP/1.1 exchange came to: status (0: no answer), headers, and every byte after
/// the head as read to the connection's close (no Content-Length parsing, so a malformed
/// length cannot break the reading).
#[derive(Debug)]
struct Exchange {
    status: u16,
    headers: Vec<(String, String)>,
    after_head: Vec<u8>,
}

impl Exchange {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

async fn raw(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Exchange {
    guard("a raw exchange", async {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-length: {}\r\n",
            body.len()
        );
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes()).await.expect("write");
        stream.write_all(body).await.expect("write");
        let mut buf = Vec::new();
        // A server that keeps the connection open after a length it did not keep: read what
        // came within a short while.
        let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut buf)).await;
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            return Exchange {
                status: 0,
                headers: Vec::new(),
                after_head: buf,
            };
        };
        let head = &buf[..end];
        let line_end = head.windows(2).position(|w| w == b"\r\n").unwrap_or(head.len());
        let status = String::from_utf8_lossy(&head[..line_end])
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let headers = header_lines(&head[line_end..])
            .into_iter()
            .map(|(n, v)| (n, String::from_utf8_lossy(&v).into_owned()))
            .collect();
        Exchange {
            status,
            headers,
            after_head: buf[end + 4..].to_vec(),
        }
    })
    .await
}

/// A route whose runs are counted, guarded on a memory store that faults on demand, with
/// `body_limit`: the store to fault, the runs, the address.
async fn counted_on_faulty(
    body_limit: usize,
) -> (common::faulty::Faulty<MemoryStore>, Effects, SocketAddr) {
    let store = common::faulty::Faulty::new(MemoryStore::new());
    let effects = Effects::default();
    let e = effects.clone();
    let app = Router::new().route(
        "/op",
        post(move |_: Bytes| {
            let e = e.clone();
            async move {
                e.hit();
                StatusCode::CREATED
            }
        })
        .layer(
            IdempotencyLayer::new(store.clone())
                .single_tenant()
                .body_limit(body_limit),
        ),
    );
    (store, effects, serve(app).await)
}

/// The problem document of an answer.
fn problem(x: &Exchange) -> serde_json::Value {
    serde_json::from_slice(&x.after_head).expect("a problem document")
}

fn problem_slug(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v["type"]
                .as_str()
                .map(|t| t.rsplit(':').next().unwrap_or_default().to_owned())
        })
        .unwrap_or_else(|| format!("(not a problem: {:?})", String::from_utf8_lossy(body)))
}

// ---- 2: responses cut short of their Content-Length --------------------------------------------

/// Attacks: `capture`'s new Content-Length check with a length written as a one-line list,
/// `Content-Length: 10, 10` (what a proxy folding two equal lines sends; RFC 9110 §8.6 lets a
/// recipient read it as 10, and hyper does: `headers::content_length_parse_all_values` splits
/// on commas). The handler's body ends cleanly after 3 of the 10 bytes. DESIGN §3 ("a failure
/// of the response body afterwards ... the record is kept as completed, response not
/// available") and the worst outcome "a truncated answer replayed": the retry must not be
/// given the 3 cut bytes as a whole 201; it gets `response-not-stored`, and nothing runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_length_written_as_a_list_still_catches_a_cut_body() {
    for declared in ["10, 10", "10,10"] {
        let (store, effects) = (MemoryStore::new(), Effects::default());
        let sink = effects.clone();
        let app = Router::new().route(
            "/op",
            post(move || async move {
                sink.hit();
                let chunks = vec![Ok::<_, std::io::Error>(Bytes::from_static(b"abc"))];
                Response::builder()
                    .status(StatusCode::CREATED)
                    .header("content-type", "application/octet-stream")
                    .header("content-length", declared)
                    .body(Body::from_stream(futures_util::stream::iter(chunks)))
                    .expect("response")
            })
            .layer(IdempotencyLayer::new(store).single_tenant()),
        );
        let addr = serve(app).await;
        let key = unique("cl-list");
        let headers = [
            ("idempotency-key", key.as_str()),
            ("content-type", "text/plain"),
        ];
        let first = raw(addr, "POST", "/op", &headers, b"x").await;
        let retry = raw(addr, "POST", "/op", &headers, b"x").await;
        assert_eq!(effects.count(), 1, "{declared:?}: never a second run");
        let cut_replayed_whole = retry.status == 201 && retry.after_head.ends_with(b"abc");
        assert!(
            !cut_replayed_whole,
            "Content-Length {declared:?} (hyper reads 10) with 3 bytes sent: the cut body was \
             recorded and replayed to the retry as a whole 201 (retry: {retry:?}; first: \
             {first:?}); replay::content_length parses the whole line with str::parse, gets no \
             number, and skips the check"
        );
        assert_eq!(
            retry.status,
            409,
            "{declared:?}: retry {retry:?} ({})",
            problem_slug(&retry.after_head)
        );
    }
}

/// Attacks: `capture`'s `declared_empty` exemption (a body whose `size_hint` is exactly 0)
/// with a HEAD the route guards (`.methods([GET, HEAD])`), where the layer wraps the whole
/// router (as layers that must run before routing do) and a `ResponseBodyTimeoutLayer` sits
/// between them. axum answers the HEAD with the GET handler, sets `Content-Length: 5` (the
/// GET body's) and an empty body; tower-http's `TimeoutBody` does not forward `size_hint`,
/// so the layer sees "5 declared, 0 sent". DESIGN §1 step 9 / §3: a legitimate response must
/// be answered live and recorded: the HEAD gets 200 (not an execution-failed answer), runs once,
/// and its retry replays 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarded_head_behind_a_body_wrapper_is_not_taken_for_a_cut_body() {
    let (store, effects) = (MemoryStore::new(), Effects::default());
    let sink = effects.clone();
    let inner = Router::new().route(
        "/r",
        get(move || async move {
            sink.hit();
            "hello"
        }),
    );
    let svc = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::new(store)
                .single_tenant()
                .methods([Method::GET, Method::HEAD]),
        )
        .layer(tower_http::timeout::ResponseBodyTimeoutLayer::new(
            Duration::from_secs(60),
        ))
        .service(inner);
    let addr = serve(Router::new().fallback_service(svc)).await;
    let url = format!("http://{addr}/r");
    let key = unique("head-wrapped");
    let mut answers = Vec::new();
    for _ in 0..2 {
        let res = client()
            .head(&url)
            .header("idempotency-key", &key)
            .send()
            .await
            .expect("head");
        answers.push((
            res.status(),
            res.headers().get("content-length").cloned(),
            res.headers().get("idempotency-problem").cloned(),
            res.headers().get("idempotency-replayed").cloned(),
        ));
    }
    assert_eq!(effects.count(), 1, "one run for the key: {answers:?}");
    assert!(
        answers.iter().all(|(status, ..)| *status == StatusCode::OK),
        "a legitimate HEAD answer (Content-Length 5, no body, as RFC 9110 §9.3.2 has it) was \
         taken for a cut body and refused: {answers:?}"
    );
}

/// Attacks: the same exemption with an explicit HEAD handler on a route guarding HEAD, whose
/// answer declares the GET's length (RFC 9110 §9.3.2) over an empty streamed body (its
/// `size_hint` is not exact). DESIGN §1 step 9 / §3: the live HEAD gets its 200, and its retry
/// the replay, never an execution-failed answer and a `response-not-stored` key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicit_head_handler_declaring_the_get_length_is_recorded() {
    let (store, effects) = (MemoryStore::new(), Effects::default());
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/r",
            get(|| async { "hello" }).head(move || async move {
                sink.hit();
                let empty = futures_util::stream::empty::<Result<Bytes, std::io::Error>>();
                Response::builder()
                    .header("content-length", "5")
                    .body(Body::from_stream(empty))
                    .expect("response")
            }),
        )
        .layer(
            IdempotencyLayer::new(store)
                .single_tenant()
                .methods([Method::GET, Method::HEAD]),
        );
    let addr = serve(app).await;
    let key = unique("head-explicit");
    let headers = [("idempotency-key", key.as_str())];
    let first = raw(addr, "HEAD", "/r", &headers, b"").await;
    let retry = raw(addr, "HEAD", "/r", &headers, b"").await;
    assert_eq!(effects.count(), 1, "one run: {first:?} {retry:?}");
    assert_eq!(
        (first.status, retry.status),
        (200, 200),
        "a HEAD answer declaring the GET's length over an empty body was taken for a cut body \
         (first: {first:?}, problem {:?}; retry: {retry:?}, problem {:?})",
        first.header("idempotency-problem"),
        retry.header("idempotency-problem"),
    );
}

// ---- 3: HEAD on a route that guards GET but not HEAD -------------------------------------------

/// Attacks: `head_of_guarded_get` with an explicit HEAD handler (`get(..).head(..)`) on a
/// route that guards GET only. axum answers HEAD with the HEAD handler here, not the GET's;
/// the layer cannot see which. Documented (`RouteConfig::methods`): on a route that requires a
/// key, an unkeyed HEAD is refused 400 `key-missing` as an unkeyed GET is (a HEAD usually runs
/// the GET handler, whose effect the route guards), and the explicit handler never runs; with
/// `require_key(false)` it passes through to the HEAD handler, untouched. DESIGN §1 step 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unkeyed_head_to_an_explicit_head_handler_passes_through() {
    for required in [true, false] {
        let (store, gets, heads) = (MemoryStore::new(), Effects::default(), Effects::default());
        let (get_sink, head_sink) = (gets.clone(), heads.clone());
        let app = Router::new()
            .route(
                "/r",
                get(move || async move { format!("effect {}", get_sink.hit()) }).head(
                    move || async move {
                        head_sink.hit();
                        StatusCode::NO_CONTENT
                    },
                ),
            )
            .layer(
                IdempotencyLayer::new(store)
                    .single_tenant()
                    .methods([Method::GET])
                    .require_key(required),
            );
        let addr = serve(app).await;
        let res = client()
            .head(format!("http://{addr}/r"))
            .send()
            .await
            .expect("head");
        let status = res.status();
        assert_eq!(
            gets.count(),
            0,
            "the GET handler never runs for a HEAD here"
        );
        let expected = match required {
            true => (StatusCode::BAD_REQUEST, 0),
            false => (StatusCode::NO_CONTENT, 1),
        };
        assert_eq!(
            (status, heads.count()),
            expected,
            "an unkeyed HEAD on a route guarding GET, a key required: {required}"
        );
    }
}

// ---- 4: fingerprints across configurations meant alike -----------------------------------------

/// POST /op on one "instance": one effect per run, 201 naming the instance and run.
fn instance(
    layer: IdempotencyLayer<MemoryStore, tower_idempotency::scope::SingleTenant>,
    name: &'static str,
    effects: Effects,
) -> Router {
    Router::new().route(
        "/op",
        post(move || async move { (StatusCode::CREATED, format!("{name} run {}", effects.hit())) })
            .layer(layer),
    )
}

/// Sends the one request both instances get.
async fn pay(addr: SocketAddr, key: &str) -> (StatusCode, serde_json::Value, String) {
    let res = client()
        .post(format!("http://{addr}/op"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .header("x-a", "1")
        .header("x-b", "2")
        .body(r#"{"amount":10,"currency":"EUR","note":"n"}"#)
        .send()
        .await
        .expect("post");
    let status = res.status();
    let text = res.text().await.expect("body");
    let json = serde_json::from_str(&text).unwrap_or(serde_json::Value::Null);
    (status, json, text)
}

/// Attacks: the fingerprint's settings as two replicas sharing one store may write the same
/// configuration (a rolling deploy, or config assembled in another order): an include list
/// in another order, fingerprint headers added in another order, a fingerprint header added
/// twice. Exclude lists were made order- and duplicate-free first; include lists and the
/// header list were not (answered 422: without the scheme check, `safe_new_key: true`, so a
/// client following it ran the operation a second time; with it, a key stuck until its TTL).
/// Now all are sets. DESIGN §1 step 4 (fingerprint = what the request is) and §1 step 6: the
/// same request retried on the other replica is a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equal_fingerprint_settings_in_another_order_read_one_request_alike() {
    let base = |store: &MemoryStore| IdempotencyLayer::new(store.clone()).single_tenant();
    type L = IdempotencyLayer<MemoryStore, tower_idempotency::scope::SingleTenant>;
    type Case = (&'static str, fn(L) -> L, fn(L) -> L);
    let cases: Vec<Case> = vec![
        (
            "control: exclude [/note, /x] vs [/x, /note]",
            |l| {
                l.defaults(|r| r.fingerprint_json(JsonFields::exclude(["/note", "/x"]).expect("p")))
            },
            |l| {
                l.defaults(|r| r.fingerprint_json(JsonFields::exclude(["/x", "/note"]).expect("p")))
            },
        ),
        (
            "include [/amount, /currency] vs [/currency, /amount]",
            |l| {
                l.defaults(|r| {
                    r.fingerprint_json(JsonFields::include(["/amount", "/currency"]).expect("p"))
                })
            },
            |l| {
                l.defaults(|r| {
                    r.fingerprint_json(JsonFields::include(["/currency", "/amount"]).expect("p"))
                })
            },
        ),
        (
            "include [/amount, /currency] vs [/amount, /currency, /amount]",
            |l| {
                l.defaults(|r| {
                    r.fingerprint_json(JsonFields::include(["/amount", "/currency"]).expect("p"))
                })
            },
            |l| {
                l.defaults(|r| {
                    r.fingerprint_json(
                        JsonFields::include(["/amount", "/currency", "/amount"]).expect("p"),
                    )
                })
            },
        ),
        (
            "fingerprint_header x-a, x-b vs x-b, x-a",
            |l| {
                l.fingerprint_header(HeaderName::from_static("x-a"))
                    .fingerprint_header(HeaderName::from_static("x-b"))
            },
            |l| {
                l.fingerprint_header(HeaderName::from_static("x-b"))
                    .fingerprint_header(HeaderName::from_static("x-a"))
            },
        ),
        (
            "fingerprint_header x-a vs x-a, x-a",
            |l| l.fingerprint_header(HeaderName::from_static("x-a")),
            |l| {
                l.fingerprint_header(HeaderName::from_static("x-a"))
                    .fingerprint_header(HeaderName::from_static("x-a"))
            },
        ),
    ];
    let mut broken = Vec::new();
    for (name, one, other) in cases {
        let store = MemoryStore::new();
        let effects = Effects::default();
        let a = serve(instance(one(base(&store)), "A", effects.clone())).await;
        let b = serve(instance(other(base(&store)), "B", effects.clone())).await;
        let key = unique("settings");
        let (first, _, first_text) = pay(a, &key).await;
        assert_eq!(first, StatusCode::CREATED, "{name}: {first_text}");
        let (retry, problem, retry_text) = pay(b, &key).await;
        if retry != StatusCode::CREATED {
            // The client does what the answer says.
            if problem["safe_new_key"] == serde_json::Value::Bool(true) {
                let _ = pay(b, &unique("settings-new")).await;
            }
            broken.push(format!(
                "{name}: the same request on the other replica got {retry} {retry_text}; \
                 following safe_new_key, the sink counts {} runs",
                effects.count()
            ));
        }
    }
    assert!(
        broken.is_empty(),
        "settings that mean the same read one request as two:\n{}",
        broken.join("\n")
    );
}

// ---- a handler's informational status -----------------------------------------------------------

/// Attacks: a handler that answers an informational status (`103 Early Hints`, `100 Continue`)
/// as its final answer. hyper sends the client a bare 500 for it, and a record of it could not
/// be read back (the codec refuses a stored 1xx: every retry would get 503 for the key's
/// TTL). DESIGN §3: it is taken as the 500 the client got, its body as broken: under
/// `DefinitiveOnly` the key is given back (a retry runs, never a 503); under `Everything` it
/// is completed without its response (a retry gets `response-not-stored`, never a run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_informational_final_status_is_the_500_the_client_got() {
    for (policy, runs_again) in [
        (tower_idempotency::CachePolicy::DefinitiveOnly, true),
        (tower_idempotency::CachePolicy::Everything, false),
    ] {
        for status in [
            StatusCode::CONTINUE,
            StatusCode::from_u16(103).expect("103"),
        ] {
            let effects = Effects::default();
            let sink = effects.clone();
            let app = Router::new().route(
                "/op",
                post(move || async move {
                    sink.hit();
                    status
                })
                .layer(
                    IdempotencyLayer::new(MemoryStore::new())
                        .single_tenant()
                        .cache_policy(policy.clone()),
                ),
            );
            let addr = serve(app).await;
            let key = unique("informational");
            let url = format!("http://{addr}/op");
            let send = || {
                client()
                    .post(&url)
                    .header("idempotency-key", &key)
                    .header("content-type", "text/plain")
                    .body("x")
                    .send()
            };
            let first = send().await.expect("first");
            assert_eq!(
                first.status(),
                StatusCode::INTERNAL_SERVER_ERROR,
                "{policy:?} {status}"
            );
            let retry = send().await.expect("retry");
            let retried = retry.status();
            let body = retry.text().await.expect("body");
            assert_ne!(
                retried,
                StatusCode::SERVICE_UNAVAILABLE,
                "{policy:?} {status}: {body}"
            );
            match runs_again {
                true => assert_eq!(effects.count(), 2, "{policy:?} {status}: released"),
                false => {
                    assert_eq!(retried, StatusCode::CONFLICT, "{policy:?} {status}: {body}");
                    assert!(body.contains("response-not-stored"), "{body}");
                    assert_eq!(effects.count(), 1, "{policy:?} {status}: never run again");
                }
            }
        }
    }
}

/// DESIGN §1 (`safe_new_key` says whether a new key is safe) and §1.6: a body refused 413
/// before the claim reads its key's record to frame the refusal. A store that cannot be read
/// then answers `state: "unknown"` and `safe_new_key: false` with a Retry-After (a client must
/// not take a new key for an operation that may have run); with
/// the store up and nothing recorded, the same refusal says nothing ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_6_a_413_whose_record_cannot_be_read_keeps_the_key() {
    use std::sync::atomic::Ordering;
    let (store, effects, addr) = counted_on_faulty(64).await;
    let big = vec![b'x'; 200];
    let up = raw(
        addr,
        "POST",
        "/op",
        &[
            ("idempotency-key", &unique("413-up")),
            ("content-type", "text/plain"),
        ],
        &big,
    )
    .await;
    assert_eq!(up.status, 413, "{up:?}");
    assert_eq!(problem(&up)["safe_new_key"], true, "{up:?}");
    store.down.store(true, Ordering::SeqCst);
    let down = raw(
        addr,
        "POST",
        "/op",
        &[
            ("idempotency-key", &unique("413-down")),
            ("content-type", "text/plain"),
        ],
        &big,
    )
    .await;
    store.down.store(false, Ordering::SeqCst);
    assert_eq!(down.status, 413, "{down:?}");
    let body = problem(&down);
    assert_eq!(body["state"], "unknown", "{body}");
    assert_eq!(body["safe_new_key"], false, "{body}");
    assert!(down.header("retry-after").is_some(), "{down:?}");
    assert_eq!(effects.count(), 0, "nothing runs on a refused body");
}

/// DESIGN §1 (`safe_new_key`) and §1.4: a keyed body refused at its fingerprint (here a
/// multipart body under two boundaries, 400) reads its key's record first, as a body refused
/// while buffering does. When that read fails, the key may have run (a retry of a completed
/// request sent in a form this version refuses), so the refusal says "unknown", keeps the key
/// and asks to retry later; nothing runs. With the store readable, a fresh key refused alike
/// is safe to leave, and the completed one is told completed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_4_a_body_refused_at_its_fingerprint_whose_record_cannot_be_read_keeps_the_key() {
    use std::sync::atomic::Ordering;
    let (store, effects, addr) = counted_on_faulty(1 << 20).await;
    let form = b"--a\r\nContent-Disposition: form-data; name=\"amount\"\r\n\r\n10\r\n--a--\r\n";
    let ran = unique("refused-ran");
    let first = raw(
        addr,
        "POST",
        "/op",
        &[
            ("idempotency-key", &ran),
            ("content-type", "multipart/form-data; boundary=a"),
        ],
        form,
    )
    .await;
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(effects.count(), 1);
    // The retry, in a form that cannot be fingerprinted: two boundaries.
    let refused = |key: String| async move {
        raw(
            addr,
            "POST",
            "/op",
            &[
                ("idempotency-key", &key),
                (
                    "content-type",
                    "multipart/form-data; boundary=a; boundary=b",
                ),
            ],
            form,
        )
        .await
    };
    store.fail_lookup.store(true, Ordering::SeqCst);
    let down_ran = refused(ran.clone()).await;
    let down_fresh = refused(unique("refused-fresh")).await;
    store.fail_lookup.store(false, Ordering::SeqCst);
    for (what, x) in [("the run key", &down_ran), ("a fresh key", &down_fresh)] {
        assert_eq!(x.status, 400, "{what}: {x:?}");
        let body = problem(x);
        assert_eq!(body["state"], "unknown", "{what}: {body}");
        assert_eq!(body["safe_new_key"], false, "{what}: {body}");
        assert!(x.header("retry-after").is_some(), "{what}: {x:?}");
    }
    let up_ran = refused(ran).await;
    assert_eq!(up_ran.status, 400, "{up_ran:?}");
    assert_eq!(problem(&up_ran)["state"], "completed", "{up_ran:?}");
    assert_eq!(problem(&up_ran)["safe_new_key"], false, "{up_ran:?}");
    let up_fresh = refused(unique("refused-fresh")).await;
    assert_eq!(up_fresh.status, 400, "{up_fresh:?}");
    assert_eq!(problem(&up_fresh)["safe_new_key"], true, "{up_fresh:?}");
    assert_eq!(effects.count(), 1, "a refused body never runs");
}
