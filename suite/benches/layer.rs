//! The layer's own cost, without sockets: an axum router called in-process with 1 KiB JSON
//! bodies, bare, behind the layer (unique keys, replays) and behind the floor (the least an
//! idempotency middleware can do, `support/floor.rs`), hashed and unhashed. Reported as
//! microseconds per request, allocations per request, and the added cost, measured in the same
//! run.
//!
//! `cargo bench -p suite --bench layer`; `BENCH_ONLY=bare|bare-unique|bare-same|unique|replay|
//! floor-unique|floor-replay|unhashed-unique|unhashed-replay BENCH_REQUESTS=N` runs N requests of
//! one scenario and nothing else, for `valgrind --tool=callgrind`. The layer's added instructions
//! are counted against the bare router sent the same keys: `unique` against `bare-unique`,
//! `replay` against `bare-same`.

#[path = "support/floor.rs"]
mod floor;

use std::alloc::System;
use std::hint::black_box;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use bytes::Bytes;
use floor::FloorLayer;
use http_body_util::BodyExt;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, MemoryStore};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Microseconds and heap allocations per request.
struct Cost {
    micros: f64,
    allocations: f64,
}

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

async fn per_request(router: Router, key: impl Fn(u64) -> Option<String>) -> Cost {
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
    // Under callgrind (`BENCH_REQUESTS=N`): run N requests and nothing else, so instruction
    // counts per request are repeatable.
    if let Some(count) = std::env::var("BENCH_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        let start = Instant::now();
        for _ in 0..count {
            run(n).await;
            n += 1;
        }
        return Cost {
            micros: start.elapsed().as_secs_f64() * 1e6 / count as f64,
            allocations: 0.0,
        };
    }
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
    let count = 1_000;
    let region = Region::new(GLOBAL);
    for _ in 0..count {
        run(n).await;
        n += 1;
    }
    Cost {
        micros: samples[samples.len() / 2],
        allocations: region.change().allocations as f64 / count as f64,
    }
}

/// Each request's key: none, a new one, or always the same (every request after the first
/// replays).
fn no_key(_: u64) -> Option<String> {
    None
}

fn unique_key(n: u64) -> Option<String> {
    Some(format!("k-{n}"))
}

fn same_key(_: u64) -> Option<String> {
    Some("same".to_owned())
}

/// One way of serving the requests.
struct Scenario {
    /// Its `BENCH_ONLY` name.
    only: &'static str,
    /// Its row in the table.
    name: &'static str,
    router: Router,
    key: fn(u64) -> Option<String>,
}

/// The scenarios, the bare router first.
fn scenarios() -> Vec<Scenario> {
    // Each router is finished as `axum::serve` finishes it (`into_make_service` calls
    // `with_state`), so that its handlers become routes once, not on every request.
    let scenario = |only, name, router: Router, key| Scenario {
        only,
        name,
        router: router.with_state(()),
        key,
    };
    let layer = || IdempotencyLayer::new(MemoryStore::new()).single_tenant();
    vec![
        scenario("bare", "bare router", app(), no_key),
        // The layer's rows send a key, which the bare router ignores: these two send the same
        // keys, so that what the client spends building them is not counted as the layer's.
        scenario(
            "bare-unique",
            "bare router, unique keys sent",
            app(),
            unique_key,
        ),
        scenario("bare-same", "bare router, one key sent", app(), same_key),
        scenario(
            "unique",
            "layer + MemoryStore, unique keys",
            app().layer(layer()),
            unique_key,
        ),
        scenario(
            "replay",
            "layer + MemoryStore, replays",
            app().layer(layer()),
            same_key,
        ),
        scenario(
            "floor-unique",
            "floor, unique keys",
            app().layer(FloorLayer::new()),
            unique_key,
        ),
        scenario(
            "floor-replay",
            "floor, replays",
            app().layer(FloorLayer::new()),
            same_key,
        ),
        scenario(
            "unhashed-unique",
            "floor unhashed, unique keys",
            app().layer(FloorLayer::unhashed()),
            unique_key,
        ),
        scenario(
            "unhashed-replay",
            "floor unhashed, replays",
            app().layer(FloorLayer::unhashed()),
            same_key,
        ),
    ]
}

fn main() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        // `BENCH_ONLY=<scenario>` runs one scenario (for profiling).
        if let Ok(only) = std::env::var("BENCH_ONLY") {
            let Some(scenario) = scenarios().into_iter().find(|s| s.only == only) else {
                panic!("BENCH_ONLY: no scenario {only:?}");
            };
            let cost = per_request(scenario.router, scenario.key).await;
            println!(
                "{only}: {:.2} µs/request, {:.1} allocations/request",
                cost.micros, cost.allocations
            );
            return;
        }
        let mut costs = Vec::new();
        for scenario in scenarios() {
            costs.push((
                scenario.name,
                per_request(scenario.router, scenario.key).await,
            ));
        }
        let bare = costs[0].1.micros;
        println!(
            "{:<34} {:>10} {:>12} {:>12}",
            "in-process, 1 KiB JSON", "µs/request", "adds", "allocations"
        );
        for (i, (name, cost)) in costs.iter().enumerate() {
            let adds = if i == 0 {
                String::new()
            } else {
                format!("{:.2} µs", cost.micros - bare)
            };
            println!(
                "{name:<34} {:>10.2} {adds:>12} {:>12.1}",
                cost.micros, cost.allocations
            );
        }
    });
}
