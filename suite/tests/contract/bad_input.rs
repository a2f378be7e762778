//! DESIGN §1 steps 1–4 on hostile input: every bad request gets a clear 4xx problem, no effect,
//! and no record claimed.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use common::{Effects, client, problem, problem_type, raw_status, serve};
use tower_idempotency::{IdempotencyLayer, MemoryStore};

const LIMIT: usize = 4096;

async fn app() -> (SocketAddr, Effects, MemoryStore) {
    let effects = Effects::default();
    let store = MemoryStore::new();
    let counter = effects.clone();
    let app = Router::new()
        .route(
            "/tools/create_ticket",
            post(move |body: axum::body::Bytes| async move {
                counter.hit();
                format!("{} bytes", body.len())
            }),
        )
        .layer(
            IdempotencyLayer::new(store.clone())
                .single_tenant()
                .body_limit(LIMIT),
        );
    (serve(app).await, effects, store)
}

async fn send(
    addr: SocketAddr,
    keys: &[&[u8]],
    content_type: &str,
    body: Vec<u8>,
) -> reqwest::Response {
    let mut request = client()
        .post(format!("http://{addr}/tools/create_ticket"))
        .header("content-type", content_type)
        .body(body);
    for key in keys {
        request = request.header(
            "idempotency-key",
            reqwest::header::HeaderValue::from_bytes(key).expect("a value reqwest can send"),
        );
    }
    request.send().await.expect("request")
}

async fn assert_refused(res: reqwest::Response, status: StatusCode, slug: &str) {
    assert_eq!(res.status(), status);
    let p = problem(res).await;
    assert_eq!(p["type"], problem_type(slug));
    assert_eq!(p["status"], status.as_u16());
    assert_eq!(p["state"], "none");
    assert_eq!(p["safe_new_key"], true);
    assert!(p["detail"].as_str().is_some_and(|d| !d.is_empty()));
}

#[tokio::test]
async fn s1_bad_keys_get_400_and_nothing_runs() {
    let (addr, effects, store) = app().await;
    let cases: Vec<(Vec<&[u8]>, &str)> = vec![
        (vec![], "key-missing"),
        (vec![&[b'k'; 256]], "key-invalid"),
        (vec![b"abc\tdef"], "key-invalid"),
        (vec!["caf\u{e9}".as_bytes()], "key-invalid"),
        (vec![b"\"unterminated"], "key-invalid"),
        (vec![b"\"\""], "key-invalid"),
        (vec![b"one", b"two"], "key-invalid"),
        (vec![b"same", b"same"], "key-invalid"),
    ];
    for (keys, slug) in cases {
        let res = send(addr, &keys, "text/plain", b"hello".to_vec()).await;
        assert_refused(res, StatusCode::BAD_REQUEST, slug).await;
    }
    // The boundary: 255 bytes, and an sf-string, are fine.
    assert_eq!(
        send(addr, &[&[b'k'; 255]], "text/plain", b"x".to_vec())
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(
        send(addr, &[b"\"quoted key\""], "text/plain", b"x".to_vec())
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(effects.count(), 2);
    assert_eq!(store.len(), 2, "only the two valid keys were claimed");
}

#[tokio::test]
async fn s1_body_over_the_limit_gets_413_by_length_or_by_stream() {
    let (addr, effects, store) = app().await;
    let res = send(addr, &[b"big"], "text/plain", vec![b'a'; LIMIT + 1]).await;
    assert_refused(res, StatusCode::PAYLOAD_TOO_LARGE, "body-too-large").await;

    // Chunked: no Content-Length to check up front; the stream outgrows the limit.
    let mut raw = b"POST /tools/create_ticket HTTP/1.1\r\nHost: test\r\nIdempotency-Key: big-chunked\r\n\
                    Content-Type: text/plain\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        .to_vec();
    for _ in 0..6 {
        raw.extend_from_slice(format!("{:x}\r\n", 1000).as_bytes());
        raw.extend_from_slice(&[b'a'; 1000]);
        raw.extend_from_slice(b"\r\n");
    }
    raw.extend_from_slice(b"0\r\n\r\n");
    assert_eq!(raw_status(addr, &raw).await, 413);

    // Exactly at the limit passes, chunked too.
    assert_eq!(
        send(addr, &[b"fits"], "text/plain", vec![b'a'; LIMIT])
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(effects.count(), 1);
    assert_eq!(store.len(), 1, "nothing was claimed for the refused bodies");
}

#[tokio::test]
async fn s4_malformed_json_gets_400_without_stack_overflow() {
    let (addr, effects, store) = app().await;
    // Deeper than the 128 levels the canonicaliser accepts, within this route's body limit.
    let deep = "[".repeat(2000) + &"]".repeat(2000);
    let res = send(addr, &[b"deep"], "application/json", deep.into_bytes()).await;
    assert_refused(res, StatusCode::BAD_REQUEST, "body-malformed").await;

    let res = send(
        addr,
        &[b"utf8"],
        "application/json",
        b"{\"a\":\"\xff\xfe\"}".to_vec(),
    )
    .await;
    assert_refused(res, StatusCode::BAD_REQUEST, "body-malformed").await;
    let res = send(addr, &[b"syntax"], "application/json", b"{\"a\":".to_vec()).await;
    assert_refused(res, StatusCode::BAD_REQUEST, "body-malformed").await;
    let res = send(
        addr,
        &[b"multipart"],
        "multipart/form-data; boundary=zz",
        b"garbage".to_vec(),
    )
    .await;
    assert_refused(res, StatusCode::BAD_REQUEST, "body-malformed").await;
    assert_eq!(effects.count(), 0);
    assert!(store.is_empty());
}

#[tokio::test]
async fn s4_json_nested_100k_levels_is_refused_not_a_crash() {
    let effects = Effects::default();
    let counter = effects.clone();
    let app = Router::new()
        .route(
            "/deep",
            post(move || async move {
                counter.hit();
                "ran"
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .body_limit(1 << 20),
        );
    let addr = serve(app).await;
    let deep = "[".repeat(100_000) + &"]".repeat(100_000);
    let res = client()
        .post(format!("http://{addr}/deep"))
        .header("idempotency-key", "deep")
        .header("content-type", "application/json")
        .body(deep.clone())
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .expect("request");
    assert_refused(res, StatusCode::BAD_REQUEST, "body-malformed").await;
    // The server is still alive and serving.
    let ok = client()
        .post(format!("http://{addr}/deep"))
        .header("idempotency-key", "shallow")
        .header("content-type", "application/json")
        .body("[[[]]]")
        .send()
        .await
        .expect("request");
    assert_eq!(ok.status(), StatusCode::OK);
    assert_eq!(effects.count(), 1);
}

#[tokio::test]
async fn s4_form_and_multipart_bodies_match_by_content() {
    let (addr, effects, _) = app().await;
    let form = |body: &str| {
        send(
            addr,
            &[b"form"],
            "application/x-www-form-urlencoded",
            body.as_bytes().to_vec(),
        )
    };
    assert_eq!(form("a=1&b=two+words").await.status(), StatusCode::OK);
    let replay = form("b=two%20words&a=%31").await;
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(
        form("a=1&b=other").await.status(),
        StatusCode::UNPROCESSABLE_ENTITY
    );

    let multipart = |boundary: &str, value: &str| {
        let body = format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"title\"\r\n\r\n{value}\r\n--{boundary}--\r\n"
        );
        let content_type = format!("multipart/form-data; boundary={boundary}");
        async move { send(addr, &[b"multi"], &content_type, body.into_bytes()).await }
    };
    assert_eq!(
        multipart("AaB03x", "printer").await.status(),
        StatusCode::OK
    );
    let replay = multipart("other-random-boundary", "printer").await;
    assert_eq!(
        replay.headers()["idempotency-replayed"],
        "true",
        "a new boundary is the same request"
    );
    assert_eq!(
        multipart("AaB03x", "scanner").await.status(),
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(effects.count(), 2);
}
