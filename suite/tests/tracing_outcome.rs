//! DESIGN §6: each guarded request runs in an `idempotency` span that records its outcome.

mod common;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::routing::post;
use common::{client, serve};
use tower_idempotency::{IdempotencyLayer, MemoryStore};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// Keeps the `outcome` values recorded on `idempotency` spans, in order.
#[derive(Default)]
struct Outcomes {
    next_id: AtomicU64,
    seen: Arc<Mutex<Vec<String>>>,
}

struct OutcomeField<'a>(&'a Mutex<Vec<String>>);

impl Visit for OutcomeField<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "outcome" {
            self.0.lock().expect("lock").push(value.to_owned());
        }
    }

    fn record_debug(&mut self, _: &Field, _: &dyn fmt::Debug) {}
}

impl Subscriber for Outcomes {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(self.next_id.fetch_add(1, Ordering::SeqCst) + 1)
    }

    fn record(&self, _: &Id, values: &Record<'_>) {
        values.record(&mut OutcomeField(&self.seen));
    }

    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, _: &Event<'_>) {}
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

#[tokio::test]
async fn s6_span_records_each_outcome() {
    let subscriber = Outcomes::default();
    let seen = subscriber.seen.clone();
    // A current-thread runtime: server, handlers and client all run under this default.
    let _guard = tracing::subscriber::set_default(subscriber);

    let app = Router::new()
        .route("/t", post(|| async { "done" }))
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    let send = |key: Option<&'static str>, body: &'static str| {
        let mut req = client().post(format!("http://{addr}/t")).body(body);
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        req.send()
    };
    send(Some("a"), "1").await.expect("r");
    send(Some("a"), "1").await.expect("r");
    send(Some("a"), "2").await.expect("r");
    send(None, "1").await.expect("r");

    let seen = seen.lock().expect("lock").clone();
    assert_eq!(
        seen,
        [
            "executed",
            "replayed",
            "fingerprint-mismatch",
            "key-missing"
        ]
    );
}
