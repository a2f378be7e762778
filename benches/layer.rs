//! The layer's own cost, without sockets: an axum router called in-process with 1 KiB JSON
//! bodies, bare and behind the layer (unique keys, replays). Reported as microseconds per
//! request and as the layer's added cost, measured in the same run.
//!
//! `cargo bench --bench layer`

use std::hint::black_box;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use bytes::Bytes;
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, MemoryStore};

fn app() -> Router {
    Router::new().route(
        "/tools/create_ticket",
        post(|body: Bytes| async move {
            axum::Json(serde_json::json!({ "ticket": 1, "received": body.len() }))
        }),
    )
}

fn body() -> Bytes {
    let title = "x".repeat(1024 - 60);
    Bytes::from(
        serde_json::to_vec(&serde_json::json!({ "title": title, "priority": 2 })).expect("json"),
    )
}

async fn per_request(router: Router, key: impl Fn(u64) -> Option<String>) -> f64 {
    let body = body();
    let run = |n: u64| {
        let (router, body) = (router.clone(), body.clone());
        let key = key(n);
        async move {
            let mut request = http::Request::post("/tools/create_ticket")
                .header("content-type", "application/json");
            if let Some(key) = key {
                request = request.header("idempotency-key", key);
            }
            let res = router
                .oneshot(request.body(Body::from(body)).expect("request"))
                .await
                .expect("infallible");
            black_box(res.into_body().collect().await.expect("body"));
        }
    };
    let mut n = 0;
    let warm = Instant::now();
    while warm.elapsed() < Duration::from_millis(300) {
        run(n).await;
        n += 1;
    }
    let mut samples = Vec::new();
    for _ in 0..9 {
        let start = Instant::now();
        let count = 5_000;
        for _ in 0..count {
            run(n).await;
            n += 1;
        }
        samples.push(start.elapsed().as_secs_f64() * 1e6 / count as f64);
    }
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn main() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let bare = per_request(app(), |_| None).await;
        let unique = per_request(
            app().layer(IdempotencyLayer::new(MemoryStore::new())),
            |n| Some(format!("k-{n}")),
        )
        .await;
        let replay = per_request(
            app().layer(IdempotencyLayer::new(MemoryStore::new())),
            |_| Some("same".to_owned()),
        )
        .await;
        println!(
            "{:<34} {:>10} {:>12}",
            "in-process, 1 KiB JSON", "µs/request", "layer adds"
        );
        println!("{:<34} {:>10.2} {:>12}", "bare router", bare, "");
        println!(
            "{:<34} {:>10.2} {:>10.2} µs",
            "layer + MemoryStore, unique keys",
            unique,
            unique - bare
        );
        println!(
            "{:<34} {:>10.2} {:>10.2} µs",
            "layer + MemoryStore, replays",
            replay,
            replay - bare
        );
    });
}
