//! DESIGN §6: every outcome is counted under its own metric name.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use common::{Effects, FlakyStore, client, serve};
use metrics::{
    Counter, CounterFn, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};
use tower_idempotency::IdempotencyLayer;

#[derive(Default, Clone)]
struct Counts(Arc<Mutex<HashMap<String, Arc<AtomicU64>>>>);

struct Cell(Arc<AtomicU64>);

impl CounterFn for Cell {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::SeqCst);
    }

    fn absolute(&self, value: u64) {
        self.0.store(value, Ordering::SeqCst);
    }
}

impl Counts {
    fn get(&self, name: &str) -> u64 {
        let map = self.0.lock().expect("lock");
        map.get(name).map_or(0, |c| c.load(Ordering::SeqCst))
    }
}

impl Recorder for Counts {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let mut map = self.0.lock().expect("lock");
        let cell = map.entry(key.name().to_owned()).or_default().clone();
        Counter::from_arc(Arc::new(Cell(cell)))
    }

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }

    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

#[tokio::test]
async fn s6_each_outcome_has_its_own_counter() {
    let counts = Counts::default();
    metrics::set_global_recorder(counts.clone()).expect("the only recorder in this binary");

    let effects = Effects::default();
    let counter = effects.clone();
    let store = FlakyStore::default();
    let app = Router::new()
        .route(
            "/pay",
            post(move |body: String| async move {
                counter.hit();
                if body == "fail" {
                    (StatusCode::INTERNAL_SERVER_ERROR, "no")
                } else {
                    (StatusCode::OK, "paid")
                }
            }),
        )
        .layer(IdempotencyLayer::new(store.clone()));
    let addr = serve(app).await;
    let pay = |key: Option<&'static str>, body: &'static str| {
        let mut req = client().post(format!("http://{addr}/pay")).body(body);
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        req.send()
    };

    assert_eq!(
        pay(Some("a"), "10").await.expect("r").status(),
        StatusCode::OK
    );
    assert_eq!(
        pay(Some("a"), "10").await.expect("r").status(),
        StatusCode::OK
    );
    assert_eq!(
        pay(Some("a"), "11").await.expect("r").status(),
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(
        pay(None, "10").await.expect("r").status(),
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        pay(Some("b"), "fail").await.expect("r").status(),
        StatusCode::INTERNAL_SERVER_ERROR
    );
    store.down.store(true, Ordering::SeqCst);
    assert_eq!(
        pay(Some("c"), "10").await.expect("r").status(),
        StatusCode::SERVICE_UNAVAILABLE
    );

    assert_eq!(counts.get("idempotency_attempts_total"), 5);
    assert_eq!(counts.get("idempotency_executions_total"), 2);
    assert_eq!(counts.get("idempotency_replays_total"), 1);
    assert_eq!(counts.get("idempotency_mismatches_total"), 1);
    assert_eq!(counts.get("idempotency_key_rejections_total"), 1);
    assert_eq!(counts.get("idempotency_releases_total"), 1);
    assert_eq!(counts.get("idempotency_store_errors_total"), 1);
    assert_eq!(counts.get("idempotency_conflicts_total"), 0);
    assert_eq!(
        effects.count() as u64,
        counts.get("idempotency_executions_total")
    );
}
