//! The JSON-RPC mode's SSE tee, linear: a `tools/call` answered by a stream of N progress
//! events and then the final response, called in process behind the layer and read to its end.
//! Each event is read once as it completes, so 100 000 events cost ten times what 10 000 do
//! (issue 17 §4; before, the whole stream was re-read on every event: 4 000 events took 24 s).
//!
//! `cargo bench -p suite --bench stream`

use std::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::http::header;
use axum::response::Response;
use axum::routing::post;
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::jsonrpc::JsonRpc;
use tower_idempotency::{IdempotencyLayer, MemoryStore};

const PROGRESS: &str = "data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{\"progress\":1}}\n\n";

const DONE: &str = "data: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{\"content\":[]}}\n\n";

/// A tool answering with `events` progress events, one per chunk or (`whole`) all in one.
fn app(events: usize, whole: bool) -> Router {
    Router::new()
        .route(
            "/mcp",
            post(move || async move {
                let body = if whole {
                    Body::from(PROGRESS.repeat(events) + DONE)
                } else {
                    let chunks = std::iter::repeat_n(PROGRESS, events)
                        .chain([DONE])
                        .map(Ok::<_, std::io::Error>);
                    Body::from_stream(futures_util::stream::iter(chunks))
                };
                Response::builder()
                    .header(header::CONTENT_TYPE, "text/event-stream")
                    .body(body)
                    .expect("response")
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .response_limit(64 << 20)
                .jsonrpc(JsonRpc::new()),
        )
}

/// Seconds to stream `events` progress events and the answer through the layer.
async fn run(events: usize, whole: bool, key: &str) -> f64 {
    let request = http::Request::post("/mcp")
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("idempotency-key", key)
        .body(Body::from(
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t"}}"#,
        ))
        .expect("request");
    let start = Instant::now();
    let res = app(events, whole).oneshot(request).await.expect("response");
    let body = res.into_body().collect().await.expect("body").to_bytes();
    let seconds = start.elapsed().as_secs_f64();
    assert!(
        body.len() >= events * PROGRESS.len(),
        "the whole stream arrived"
    );
    seconds
}

#[tokio::main]
async fn main() {
    let mut met = true;
    for whole in [false, true] {
        let shape = if whole {
            "all in one chunk"
        } else {
            "one event per chunk"
        };
        println!("{shape}\nevents      seconds   µs/event");
        let mut per_event = Vec::new();
        for (i, events) in [10_000usize, 100_000].into_iter().enumerate() {
            // Best of three: the least disturbed run.
            let mut best = f64::MAX;
            for round in 0..3 {
                best = best.min(run(events, whole, &format!("k-{whole}-{i}-{round}")).await);
            }
            let micros = best * 1e6 / events as f64;
            println!("{events:>7}  {best:>10.3}  {micros:>9.3}");
            per_event.push(micros);
        }
        let ratio = per_event[1] / per_event[0];
        println!(
            "cost per event at 100 000 over at 10 000: {ratio:.2}x (1.0x is linear; quadratic would be 10x)\n"
        );
        met &= ratio < 2.0;
    }
    println!(
        "target (issue 17 §4): 100 000 events in O(n), however they are chunked: {}",
        if met { "met" } else { "missed" }
    );
}
