//! Issue 19 §3, attacked over plain HTTP: Accept-Encoding edge cases against a
//! handler that compresses whatever it is asked, on a real socket.

use crate::common;

use std::sync::{Arc, Mutex};

use common::{Effects, gzip};
use tower_idempotency::{IdempotencyLayer, MemoryStore};

#[tokio::test]
async fn s19_3_accept_encoding_edge_cases() {
    let effects = Effects::default();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let (sink, saw) = (effects.clone(), seen.clone());
    let app = axum::Router::new()
        .route(
            "/z",
            axum::routing::post(move |headers: http::HeaderMap| async move {
                sink.hit();
                saw.lock().expect("lock").push(
                    headers
                        .get_all("accept-encoding")
                        .iter()
                        .map(|v| v.to_str().unwrap_or("?").to_owned())
                        .collect::<Vec<_>>()
                        .join("|"),
                );
                (
                    [
                        ("content-encoding", "x-gzip"),
                        ("content-type", "text/plain"),
                    ],
                    gzip(b"done"),
                )
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = common::serve(app).await;
    let send = |accept: Option<&'static str>| {
        let mut req = common::client()
            .post(format!("http://{addr}/z"))
            .header("idempotency-key", "ae-1");
        if let Some(accept) = accept {
            req = req.header("accept-encoding", accept);
        }
        req.send()
    };
    let first = send(Some("gzip, deflate, br, zstd")).await.expect("first");
    assert_eq!(first.status(), 200);
    assert_eq!(seen.lock().expect("lock").as_slice(), &["identity"]);
    let mut wrong = Vec::new();
    for (accept, ok) in [
        ("GZIP", true),
        ("gzip;q=0.001", true),
        ("x-gzip", true),
        ("br, *;q=0.1", true),
        ("*", true),
        ("GZIP;Q=0", false),
        ("gzip;q=0.0", false),
        ("x-gzip;q=0", false),
        ("*;q=0", false),
        ("identity, *;q=0", false),
        ("identity", false),
        ("br", false),
        ("", false),
    ] {
        let res = send(Some(accept)).await.expect("retry");
        let status = res.status().as_u16();
        let replayed = status == 200;
        if replayed != ok || (status != 200 && status != 406) {
            wrong.push((accept, status));
        }
    }
    assert!(wrong.is_empty(), "{wrong:?}");
    assert_eq!(effects.count(), 1);
}
