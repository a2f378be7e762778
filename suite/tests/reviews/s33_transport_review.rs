//! Session 33 red-team review: the HTTP transport as hostile clients and careless servers use
//! it, over real TCP with `axum::serve` (HTTP/1.1, and h2c by prior knowledge, which the
//! server's auto builder speaks). Effects are counted at the sink, never from responses.
//!
//! HTTP/2: RST_STREAM mid request body, after the body while the handler runs, during a
//! streamed response body; many streams of one key on one connection.
//! HTTP/1.1: `Expect: 100-continue`, a dripped body, a hang-up mid body, pipelined requests,
//! chunked bodies with trailers, a body longer than its `Content-Length`.
//! The response side: a body that ends short of its declared length, a body that stalls
//! for ever; HEAD on a guarded GET route.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Method, Request, StatusCode};
use axum::response::Response;
use axum::routing::{get, post};
use common::raw::{Raw, find, parse_raw, raw_post, unique};
use common::{Effects, client, guard, serve, until};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tower_idempotency::store::{RecordStatus, ScopedKey};
use tower_idempotency::{IdempotencyLayer, IdempotencyStore, MemoryStore};

// ---- shared pieces ----------------------------------------------------------------------------

/// The record of `key` under the single tenant, if any.
async fn record(store: &MemoryStore, key: &str) -> Option<RecordStatus> {
    store
        .lookup(&ScopedKey::new("", key))
        .await
        .expect("lookup")
        .map(|r| r.status)
}

/// `POST /op`: one effect per run, answered 201 with the run's number and the body it read.
fn echo_app(store: MemoryStore, effects: Effects) -> Router {
    Router::new().route(
        "/op",
        post(move |body: Bytes| async move {
            let n = effects.hit();
            (
                StatusCode::CREATED,
                format!("effect {n} of {}", String::from_utf8_lossy(&body)),
            )
        })
        .layer(IdempotencyLayer::new(store).single_tenant()),
    )
}

/// `POST /op` whose handler marks `started`, waits for `gate` to open, then makes its effect.
fn gated_app(
    store: MemoryStore,
    started: Effects,
    effects: Effects,
    gate: watch::Receiver<bool>,
) -> Router {
    Router::new().route(
        "/op",
        post(move |body: Bytes| async move {
            started.hit();
            let mut gate = gate.clone();
            let _ = gate.wait_for(|open| *open).await;
            let n = effects.hit();
            (
                StatusCode::CREATED,
                format!("effect {n} of {}", String::from_utf8_lossy(&body)),
            )
        })
        .layer(IdempotencyLayer::new(store).single_tenant()),
    )
}

fn problem_slug(body: &[u8]) -> String {
    let v: serde_json::Value = serde_json::from_slice(body)
        .unwrap_or_else(|_| panic!("a problem body, got {:?}", String::from_utf8_lossy(body)));
    v["type"]
        .as_str()
        .unwrap_or_default()
        .rsplit(':')
        .next()
        .unwrap_or_default()
        .to_owned()
}

// ---- HTTP/2 (h2c, prior knowledge) ------------------------------------------------------------

type ReqBody = UnsyncBoxBody<Bytes, std::io::Error>;
type H2 = hyper::client::conn::http2::SendRequest<ReqBody>;

async fn h2(addr: SocketAddr) -> H2 {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let (send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .expect("an h2c handshake (prior knowledge)");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    send
}

fn full(body: impl Into<Bytes>) -> ReqBody {
    Full::new(body.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// A request body the test feeds frame by frame; an `Err` makes hyper reset the stream.
fn channel() -> (
    tokio::sync::mpsc::Sender<Result<Frame<Bytes>, std::io::Error>>,
    ReqBody,
) {
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    (tx, StreamBody::new(stream).boxed_unsync())
}

fn h2_request(addr: SocketAddr, key: &str, body: ReqBody) -> Request<ReqBody> {
    Request::builder()
        .method("POST")
        .uri(format!("http://{addr}/op"))
        .header("idempotency-key", key)
        .header("content-type", "text/plain")
        .body(body)
        .expect("request")
}

/// One whole exchange on a stream of `send`: status, headers, body.
async fn h2_send(send: &H2, req: Request<ReqBody>) -> (StatusCode, HeaderMap, Bytes) {
    let mut send = send.clone();
    guard("an h2 exchange", async move {
        send.ready().await.expect("ready");
        let res = send.send_request(req).await.expect("an h2 response");
        let (parts, body) = res.into_parts();
        let bytes = body.collect().await.expect("the h2 body").to_bytes();
        (parts.status, parts.headers, bytes)
    })
    .await
}

fn replayed(headers: &HeaderMap) -> bool {
    headers
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true")
}

/// Attacks: an h2 client that resets its stream (RST_STREAM) in the middle of the request
/// body. DESIGN §1 steps 3 and 5 (the body is read whole before anything is claimed): nothing
/// may be claimed nor run, the key must not be held, and the same request sent whole next
/// runs at once, exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_rst_stream_mid_request_body_claims_nothing() {
    let (store, effects) = (MemoryStore::new(), Effects::default());
    let addr = serve(echo_app(store.clone(), effects.clone())).await;
    let conn = h2(addr).await;
    let key = unique("h2-rst-mid-body");
    let (tx, body) = channel();
    let mut sender = conn.clone();
    let pending = tokio::spawn(async move {
        sender.ready().await.expect("ready");
        sender
            .send_request(h2_request(addr, &unique("unused"), full("")))
            .await
            .map(|_| ())
    });
    // (A first exchange so the connection is surely up before the half-sent one.)
    guard("warm-up", pending)
        .await
        .expect("join")
        .expect("warm-up answered");
    let mut sender = conn.clone();
    let req = h2_request(addr, &key, body);
    let res = tokio::spawn(async move {
        sender.ready().await.expect("ready");
        sender.send_request(req).await.map(|r| r.status())
    });
    tx.send(Ok(Frame::data(Bytes::from_static(b"hello "))))
        .await
        .expect("feed");
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(
        record(&store, &key).await,
        None,
        "a key was claimed before its request body was complete"
    );
    tx.send(Err(std::io::Error::other("the client gives up mid-body")))
        .await
        .expect("feed");
    let outcome = guard("the reset request", res).await.expect("join");
    assert!(outcome.is_err(), "hyper reset the stream: {outcome:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        record(&store, &key).await,
        None,
        "a reset mid-body left a record"
    );
    assert_eq!(
        effects.count(),
        1,
        "only the warm-up ran (a reset mid-body ran the handler)"
    );
    let (status, headers, bytes) =
        h2_send(&conn, h2_request(addr, &key, full("hello world"))).await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "the whole request runs at once: {bytes:?}"
    );
    assert!(!replayed(&headers));
    assert_eq!(&bytes[..], b"effect 2 of hello world");
    assert_eq!(effects.count(), 2);
}

/// Attacks: an h2 client that sends its whole body, then resets the stream while the handler
/// runs (hyper drops the service future on RST_STREAM). DESIGN §1 step 7 (the handler runs to
/// completion, detached), §1 step 6 (a retry meanwhile gets 409, nothing run) and step 8 (the
/// outcome is recorded and replayed to later retries, byte for byte).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_rst_stream_while_the_handler_runs_completes_detached() {
    let (store, started, effects) = (MemoryStore::new(), Effects::default(), Effects::default());
    let (open, gate) = watch::channel(false);
    let addr = serve(gated_app(
        store.clone(),
        started.clone(),
        effects.clone(),
        gate,
    ))
    .await;
    let conn = h2(addr).await;
    let key = unique("h2-rst-running");
    let mut sender = conn.clone();
    let req = h2_request(addr, &key, full("pay 10"));
    let first = tokio::spawn(async move {
        sender.ready().await.expect("ready");
        sender.send_request(req).await.map(|r| r.status())
    });
    until("the handler starts", || started.count() == 1).await;
    // Dropping the response future makes hyper send RST_STREAM(CANCEL).
    first.abort();
    let _ = first.await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, _, bytes) = h2_send(&conn, h2_request(addr, &key, full("pay 10"))).await;
    assert_eq!(status, StatusCode::CONFLICT, "mid-flight retry: {bytes:?}");
    assert_eq!(problem_slug(&bytes), "in-flight");
    open.send_replace(true);
    until("the detached handler makes its effect", || {
        effects.count() == 1
    })
    .await;
    let mut tries = 0;
    while record(&store, &key).await != Some(RecordStatus::Completed) {
        tries += 1;
        assert!(
            tries < 2000,
            "the outcome of a reset stream was never recorded"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (status, headers, bytes) = h2_send(&conn, h2_request(addr, &key, full("pay 10"))).await;
    assert_eq!(status, StatusCode::CREATED, "{bytes:?}");
    assert!(replayed(&headers));
    assert_eq!(&bytes[..], b"effect 1 of pay 10");
    assert_eq!(started.count(), 1, "the handler ran twice for one key");
    assert_eq!(effects.count(), 1);
}

/// Attacks: 16 concurrent streams on ONE h2 connection with the same key, half with another
/// body. DESIGN §1 step 5–6 and §7.3: exactly one execution; the others get 409 (same body)
/// or 422 (other body, mismatch reported before in-flight state); nobody else's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_many_streams_one_key_one_connection_run_once() {
    const N: usize = 16;
    let (store, started, effects) = (MemoryStore::new(), Effects::default(), Effects::default());
    let (open, gate) = watch::channel(false);
    let addr = serve(gated_app(
        store.clone(),
        started.clone(),
        effects.clone(),
        gate,
    ))
    .await;
    let conn = h2(addr).await;
    let key = unique("h2-streams");
    let (tx, mut rx) = tokio::sync::mpsc::channel(N);
    for i in 0..N {
        let body = if i % 2 == 0 { "even" } else { "odd" };
        let req = h2_request(addr, &key, full(body));
        let conn = conn.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let answer = h2_send(&conn, req).await;
            let _ = tx.send((body, answer)).await;
        });
    }
    let mut answers = Vec::new();
    for _ in 0..N - 1 {
        answers.push(
            guard("the losers' answers", rx.recv())
                .await
                .expect("an answer"),
        );
    }
    assert_eq!(effects.count(), 0, "nobody finished before the gate opened");
    open.send_replace(true);
    answers.push(
        guard("the winner's answer", rx.recv())
            .await
            .expect("an answer"),
    );
    let winners: Vec<_> = answers
        .iter()
        .filter(|(_, (s, _, _))| *s == StatusCode::CREATED)
        .collect();
    assert_eq!(winners.len(), 1, "one run answered: {answers:?}");
    let (won_body, (_, won_headers, won_bytes)) = winners[0];
    assert!(!replayed(won_headers));
    assert_eq!(won_bytes, &format!("effect 1 of {won_body}"));
    for (body, (status, _, bytes)) in &answers {
        if *status == StatusCode::CREATED {
            continue;
        }
        let expected = if body == won_body {
            (409, "in-flight")
        } else {
            (422, "fingerprint-mismatch")
        };
        assert_eq!(
            (status.as_u16(), problem_slug(bytes).as_str()),
            expected,
            "body {body} (winner {won_body})"
        );
    }
    let (status, headers, bytes) = h2_send(&conn, h2_request(addr, &key, full(*won_body))).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(replayed(&headers));
    assert_eq!(&bytes, won_bytes);
    assert_eq!(started.count(), 1, "the handler ran twice for one key");
    assert_eq!(effects.count(), 1);
}

/// Attacks: an h2 client that resets the stream while a response too large to record streams
/// to it. DESIGN §3 (over the limit: the key stays consumed, replays get a documented answer,
/// never a second run; a failure after the head never releases the key): the record is
/// completed (not in flight), a retry gets `response-not-stored`, nothing runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_rst_stream_during_a_streamed_response_body() {
    let (store, effects) = (MemoryStore::new(), Effects::default());
    let sink = effects.clone();
    let app = Router::new().route(
        "/op",
        post(move || async move {
            sink.hit();
            let endless = futures_util::stream::unfold(0u64, |i| async move {
                if i > 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let chunk = if i == 0 {
                    vec![b'x'; 4096]
                } else {
                    format!("chunk {i};").into_bytes()
                };
                Some((Ok::<_, std::io::Error>(Bytes::from(chunk)), i + 1))
            });
            (StatusCode::CREATED, Body::from_stream(endless))
        })
        .layer(
            IdempotencyLayer::new(store.clone())
                .single_tenant()
                .response_limit(1024)
                .lease(Duration::from_millis(300)),
        ),
    );
    let addr = serve(app).await;
    let conn = h2(addr).await;
    let key = unique("h2-rst-response");
    let mut sender = conn.clone();
    sender.ready().await.expect("ready");
    let res = guard(
        "the head",
        sender.send_request(h2_request(addr, &key, full("{}"))),
    )
    .await
    .expect("a head");
    assert_eq!(res.status(), StatusCode::CREATED);
    let mut body = res.into_body();
    let frame = guard("a first frame", body.frame())
        .await
        .expect("a frame")
        .expect("data");
    assert!(frame.is_data());
    // Dropping the body resets the stream (RST_STREAM CANCEL).
    drop(body);
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert_eq!(record(&store, &key).await, Some(RecordStatus::Completed));
    let (status, headers, bytes) = h2_send(&conn, h2_request(addr, &key, full("{}"))).await;
    assert_eq!(status, StatusCode::CONFLICT, "{bytes:?}");
    assert!(replayed(&headers));
    assert_eq!(problem_slug(&bytes), "response-not-stored");
    assert_eq!(
        effects.count(),
        1,
        "a reset during the response body ran it again"
    );
}

// ---- HTTP/1.1 over raw TCP --------------------------------------------------------------------

/// Reads from `stream` until `buf` holds a blank line (a whole head); returns what was read.
async fn read_head(stream: &mut TcpStream, buf: &mut Vec<u8>) {
    let mut chunk = [0u8; 4096];
    while find(buf, b"\r\n\r\n").is_none() {
        let n = guard("a head", stream.read(&mut chunk))
            .await
            .expect("read");
        assert!(
            n > 0,
            "closed before a head: {:?}",
            String::from_utf8_lossy(buf)
        );
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Splits a read-to-close byte stream into its responses (bodies by `Content-Length`).
fn split_responses(mut buf: &[u8]) -> Vec<Raw> {
    let mut out = Vec::new();
    while let Some(end) = find(buf, b"\r\n\r\n") {
        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map_or(0, |v| v.trim().parse().expect("a length"));
        let total = (end + 4 + len).min(buf.len());
        out.push(parse_raw(&buf[..total]));
        buf = &buf[total..];
    }
    out
}

fn head_of(key: &str, len: usize, extra: &str) -> String {
    format!(
        "POST /op HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\ncontent-type: text/plain\r\n\
         content-length: {len}\r\n{extra}\r\n"
    )
}

/// Attacks: `Expect: 100-continue`. DESIGN §1 steps 3–5: the server asks for the body (hyper
/// sends `100 Continue` once the layer polls it) but nothing is claimed until it is whole; a
/// client that then walks away leaves no record; one that sends runs once, and its retry
/// (also with `Expect`) is a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h1_expect_100_continue_claims_only_a_whole_body() {
    let (store, effects) = (MemoryStore::new(), Effects::default());
    let addr = serve(echo_app(store.clone(), effects.clone())).await;
    let body = b"pay 10";
    // 1. Continue, then hang up without a body.
    let walked = unique("expect-walk");
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(head_of(&walked, body.len(), "expect: 100-continue\r\n").as_bytes())
        .await
        .expect("write");
    let mut buf = Vec::new();
    read_head(&mut s, &mut buf).await;
    assert!(
        buf.starts_with(b"HTTP/1.1 100"),
        "{:?}",
        String::from_utf8_lossy(&buf)
    );
    assert_eq!(
        record(&store, &walked).await,
        None,
        "claimed before the body was sent"
    );
    drop(s);
    // 2. Continue, then the body.
    let key = unique("expect");
    let mut answers = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(
            head_of(
                &key,
                body.len(),
                "expect: 100-continue\r\nconnection: close\r\n",
            )
            .as_bytes(),
        )
        .await
        .expect("write");
        let mut buf = Vec::new();
        read_head(&mut s, &mut buf).await;
        assert!(
            buf.starts_with(b"HTTP/1.1 100"),
            "{:?}",
            String::from_utf8_lossy(&buf)
        );
        s.write_all(body).await.expect("write");
        let mut rest = Vec::new();
        guard("the answer", s.read_to_end(&mut rest))
            .await
            .expect("read");
        let end = find(&buf, b"\r\n\r\n").expect("head") + 4;
        let mut all = buf[end..].to_vec();
        all.extend(rest);
        answers.push(parse_raw(&all));
    }
    assert_eq!(answers[0].status, 201, "{:?}", answers[0]);
    assert_eq!(answers[0].text(), "effect 1 of pay 10");
    assert_eq!(answers[1].status, 201, "{:?}", answers[1]);
    assert!(answers[1].replayed());
    assert_eq!(answers[1].body, answers[0].body);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        record(&store, &walked).await,
        None,
        "the walked-away request left a record"
    );
    assert_eq!(effects.count(), 1);
}

/// Attacks: a body dripped a few bytes at a time, then (on a second key) a connection closed
/// mid-body. DESIGN §1 steps 3 and 5: no claim while the body is incomplete; a hang-up
/// mid-body runs nothing and holds nothing (the whole request sent next runs at once, not 409).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h1_dripped_body_and_hang_up_mid_body() {
    let (store, effects) = (MemoryStore::new(), Effects::default());
    let addr = serve(echo_app(store.clone(), effects.clone())).await;
    let body = b"abcdefghijklmnopqrstuvwxyz0123456789";
    for hang_up in [false, true] {
        let key = unique(if hang_up { "hang-up-mid-body" } else { "drip" });
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(head_of(&key, body.len(), "connection: close\r\n").as_bytes())
            .await
            .expect("write");
        for piece in body[..30].chunks(6) {
            s.write_all(piece).await.expect("write");
            tokio::time::sleep(Duration::from_millis(40)).await;
            assert_eq!(
                record(&store, &key).await,
                None,
                "claimed mid-body (hang_up {hang_up})"
            );
        }
        assert_eq!(effects.count(), usize::from(hang_up), "ran mid-body");
        if hang_up {
            drop(s);
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert_eq!(
                record(&store, &key).await,
                None,
                "a hang-up mid-body left the key held"
            );
            let retry = raw_post(
                addr,
                "/op",
                &[("idempotency-key", &key), ("content-type", "text/plain")],
                body,
            )
            .await;
            assert_eq!(
                retry.status, 201,
                "the whole request runs at once: {retry:?}"
            );
            assert!(!retry.replayed());
            assert_eq!(
                retry.text(),
                format!("effect 2 of {}", String::from_utf8_lossy(body))
            );
        } else {
            s.write_all(&body[30..]).await.expect("write");
            let mut all = Vec::new();
            guard("the answer", s.read_to_end(&mut all))
                .await
                .expect("read");
            let res = parse_raw(&all);
            assert_eq!(res.status, 201, "{res:?}");
            assert_eq!(
                res.text(),
                format!("effect 1 of {}", String::from_utf8_lossy(body))
            );
        }
    }
    assert_eq!(effects.count(), 2);
}

/// Attacks: three requests with one key pipelined on one connection in a single write (the
/// same body twice, then another body), and a body longer than its `Content-Length` whose
/// excess is a smuggled request. DESIGN §1 steps 4–6: one run; the second is a replay of the
/// first's bytes; the third is 422, never the first's answer; the excess bytes are not part
/// of the first request's fingerprint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h1_pipelined_requests_with_one_key() {
    let (store, effects) = (MemoryStore::new(), Effects::default());
    let addr = serve(echo_app(store.clone(), effects.clone())).await;
    let key = unique("pipelined");
    let mut wire = Vec::new();
    wire.extend(head_of(&key, 6, "").as_bytes());
    wire.extend(b"pay 10");
    wire.extend(head_of(&key, 6, "").as_bytes());
    wire.extend(b"pay 10");
    wire.extend(head_of(&key, 6, "connection: close\r\n").as_bytes());
    wire.extend(b"pay 99");
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(&wire).await.expect("write");
    let mut all = Vec::new();
    guard("the answers", s.read_to_end(&mut all))
        .await
        .expect("read");
    let answers = split_responses(&all);
    assert_eq!(answers.len(), 3, "{answers:?}");
    assert_eq!(answers[0].status, 201);
    assert_eq!(answers[0].text(), "effect 1 of pay 10");
    assert!(answers[1].replayed(), "{:?}", answers[1]);
    assert_eq!(answers[1].body, answers[0].body);
    assert_eq!(answers[2].status, 422, "{:?}", answers[2]);
    assert_eq!(problem_slug(&answers[2].body), "fingerprint-mismatch");

    // Content-Length 6, then the excess: a second request with the same key, another body.
    let key = unique("over-length");
    let mut wire = Vec::new();
    wire.extend(head_of(&key, 6, "").as_bytes());
    wire.extend(b"pay 10");
    wire.extend(head_of(&key, 7, "connection: close\r\n").as_bytes());
    wire.extend(b"pay 100");
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(&wire).await.expect("write");
    let mut all = Vec::new();
    guard("the answers", s.read_to_end(&mut all))
        .await
        .expect("read");
    let answers = split_responses(&all);
    assert_eq!(answers.len(), 2, "{answers:?}");
    assert_eq!(answers[0].text(), "effect 2 of pay 10");
    assert_eq!(
        answers[1].status, 422,
        "the excess is another request: {:?}",
        answers[1]
    );
    let again = raw_post(
        addr,
        "/op",
        &[("idempotency-key", &key), ("content-type", "text/plain")],
        b"pay 10",
    )
    .await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.text(), "effect 2 of pay 10");
    assert_eq!(effects.count(), 2);
}

/// Attacks: chunked request bodies with trailers (a checksum). DESIGN §1 steps 3–4: the
/// handler gets the trailers as sent, they count in the fingerprint: the same body with
/// another trailer value is another request (422), never a replay of the first's answer; the
/// same body and trailers replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h1_chunked_body_with_trailers() {
    let (store, effects) = (MemoryStore::new(), Effects::default());
    let sink = effects.clone();
    let app = Router::new().route(
        "/op",
        post(move |req: Request<Body>| async move {
            let collected = req.into_body().collect().await.expect("body");
            let sum = collected
                .trailers()
                .and_then(|t| t.get("x-checksum"))
                .map(|v| v.to_str().unwrap_or_default().to_owned())
                .unwrap_or_else(|| "none".to_owned());
            let body = collected.to_bytes();
            let n = sink.hit();
            (
                StatusCode::CREATED,
                format!("effect {n} of {} sum {sum}", String::from_utf8_lossy(&body)),
            )
        })
        .layer(IdempotencyLayer::new(store.clone()).single_tenant()),
    );
    let addr = serve(app).await;
    let key = unique("trailers");
    let send = |sum: &'static str| {
        let key = key.clone();
        async move {
            let req = format!(
                "POST /op HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\ncontent-type: text/plain\r\n\
                 transfer-encoding: chunked\r\ntrailer: x-checksum\r\nconnection: close\r\n\r\n\
                 4\r\npay \r\n2\r\n10\r\n0\r\nx-checksum: {sum}\r\n\r\n"
            );
            let mut s = TcpStream::connect(addr).await.expect("connect");
            s.write_all(req.as_bytes()).await.expect("write");
            let mut all = Vec::new();
            guard("the answer", s.read_to_end(&mut all))
                .await
                .expect("read");
            parse_raw(&all)
        }
    };
    let first = send("aaa").await;
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(
        first.text(),
        "effect 1 of pay 10 sum aaa",
        "the handler gets the trailers"
    );
    let same = send("aaa").await;
    assert!(same.replayed(), "{same:?}");
    assert_eq!(same.body, first.body);
    let other = send("bbb").await;
    assert_eq!(
        other.status, 422,
        "another trailer is another request, got {other:?}"
    );
    assert_eq!(effects.count(), 1);
}

// ---- the response side -----------------------------------------------------------------------

/// Attacks: a careless handler whose response declares a `Content-Length` its body stream
/// does not keep: 100 declared and 10 sent, then ended cleanly (a proxied upstream cut short),
/// 5 declared and 10 sent, 10 declared and none sent. Without the layer hyper refuses to end
/// such a message and the client sees a broken answer. DESIGN §3 (a body that fails after the
/// head: "completed, response not available", never a truncated answer) and the worst outcome
/// "a truncated body replayed as if complete": the retry gets `response-not-stored`, not the
/// cut bytes as a complete 201. A body that keeps its length is recorded and replayed whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_body_shorter_than_its_content_length_is_not_replayed_as_complete() {
    for (declared, sent, kept) in [
        (100, &b"0123456789"[..], false),
        (5, b"0123456789", false),
        (10, b"", false),
        (10, b"0123456789", true),
    ] {
        let (store, effects) = (MemoryStore::new(), Effects::default());
        let sink = effects.clone();
        let app = Router::new().route(
            "/op",
            post(move || async move {
                sink.hit();
                let chunks = vec![Ok::<_, std::io::Error>(Bytes::from_static(sent))];
                Response::builder()
                    .status(StatusCode::CREATED)
                    .header("content-type", "application/octet-stream")
                    .header("content-length", declared.to_string())
                    .body(Body::from_stream(futures_util::stream::iter(chunks)))
                    .expect("response")
            })
            .layer(IdempotencyLayer::new(store.clone()).single_tenant()),
        );
        let addr = serve(app).await;
        let key = unique("short-body");
        let headers = [
            ("idempotency-key", key.as_str()),
            ("content-type", "text/plain"),
        ];
        let first = raw_post(addr, "/op", &headers, b"x").await;
        let retry = raw_post(addr, "/op", &headers, b"x").await;
        let case = format!("{declared} declared, {} sent", sent.len());
        assert_eq!(effects.count(), 1, "{case}: never a second run");
        if kept {
            assert_eq!(
                (first.status, &first.body[..]),
                (201, sent),
                "{case}: {first:?}"
            );
            assert_eq!(
                (retry.status, &retry.body[..]),
                (201, sent),
                "{case}: {retry:?}"
            );
            continue;
        }
        assert_eq!(
            retry.status, 409,
            "{case}: a body that broke its declared length was recorded and replayed: {retry:?} \
             (first: {first:?})"
        );
        assert!(
            String::from_utf8_lossy(&retry.body).contains("response-not-stored"),
            "{case}: {retry:?}"
        );
        assert_ne!(
            first.status, 201,
            "{case}: the cut answer was sent as whole: {first:?}"
        );
    }
}

/// Attacks: HEAD with a key on a route that guards GET (a legacy GET with an effect,
/// configured with `.methods([GET])`). axum answers HEAD with the GET handler. DESIGN §1
/// ("one operation key produces at most one execution of the handler"): a HEAD carrying a
/// key already used must not run the GET handler again unguarded; it is refused
/// (`call-unguardable`), and an unkeyed one where a key is required as a GET would be. A route
/// that names HEAD guards it as a request of its own (its fingerprint has its method).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_on_a_guarded_get_route_does_not_run_the_handler_again() {
    let (store, effects) = (MemoryStore::new(), Effects::default());
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/op",
            get(move || async move { format!("effect {}", sink.hit()) }),
        )
        .layer(
            IdempotencyLayer::new(store.clone())
                .single_tenant()
                .methods([Method::GET]),
        );
    let addr = serve(app).await;
    let key = unique("head");
    let url = format!("http://{addr}/op");
    let first = client()
        .get(&url)
        .header("idempotency-key", &key)
        .send()
        .await
        .expect("get");
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(first.text().await.expect("body"), "effect 1");
    let again = client()
        .get(&url)
        .header("idempotency-key", &key)
        .send()
        .await
        .expect("get");
    assert_eq!(again.headers()["idempotency-replayed"], "true");
    assert_eq!(effects.count(), 1);
    let slug = |res: &reqwest::Response| {
        res.headers()
            .get("idempotency-problem")
            .map(|v| v.to_str().unwrap_or_default().to_owned())
    };
    for keyed in [Some(key.as_str()), Some("a-fresh-key"), None] {
        let mut head = client().head(&url);
        if let Some(key) = keyed {
            head = head.header("idempotency-key", key);
        }
        let head = head.send().await.expect("head");
        let status = head.status();
        assert_eq!(
            effects.count(),
            1,
            "a HEAD ({keyed:?}) ran the guarded GET handler, unguarded (answered {status}, \
             replayed: {:?})",
            head.headers().get("idempotency-replayed")
        );
        assert_eq!(
            status,
            StatusCode::BAD_REQUEST,
            "{keyed:?}: {:?}",
            slug(&head)
        );
    }

    // A route that guards HEAD too: a HEAD is a request of its own, run once and replayed;
    // the GET with its key is another request (422), never a second run.
    let (store, effects) = (MemoryStore::new(), Effects::default());
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/op",
            get(move || async move { format!("effect {}", sink.hit()) }),
        )
        .layer(
            IdempotencyLayer::new(store.clone())
                .single_tenant()
                .methods([Method::GET, Method::HEAD]),
        );
    let addr = serve(app).await;
    let url = format!("http://{addr}/op");
    let key = unique("head-guarded");
    for n in 0..2 {
        let head = client()
            .head(&url)
            .header("idempotency-key", &key)
            .send()
            .await
            .expect("head");
        assert_eq!(head.status(), StatusCode::OK, "HEAD {n}");
        assert_eq!(
            head.headers().get("idempotency-replayed").is_some(),
            n == 1,
            "HEAD {n}"
        );
    }
    let get = client()
        .get(&url)
        .header("idempotency-key", &key)
        .send()
        .await
        .expect("get");
    assert_eq!(get.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        effects.count(),
        1,
        "one run for the key, HEAD and GET alike"
    );
}
