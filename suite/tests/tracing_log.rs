//! DESIGN §6: the `idempotency` span reaches `log` when no `tracing` subscriber is set (this
//! suite's `sqlx` turns on `tracing`'s `log` feature), exactly as far as `log` lets `INFO`
//! through. The layer skips a span nobody can see (`observe::spans_heard`); this proves it
//! still builds one that `log` can. Its own binary: no test here sets a `tracing` dispatcher,
//! and `log`'s logger is global.

mod common;

use std::sync::Mutex;

use axum::Router;
use axum::routing::post;
use common::{Effects, client, serve};
use tower_idempotency::{IdempotencyLayer, MemoryStore};

/// Every record `log` let through, as `target: message`.
static SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Keep;

impl log::Log for Keep {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        let line = format!("{}: {}", record.target(), record.args());
        SEEN.lock().expect("lock").push(line);
    }

    fn flush(&self) {}
}

static KEEP: Keep = Keep;

/// The records about the layer's span since the last call.
fn span_records() -> Vec<String> {
    std::mem::take(&mut *SEEN.lock().expect("lock"))
        .into_iter()
        .filter(|line| line.contains("idempotency"))
        .collect()
}

#[tokio::test]
async fn s6_the_span_reaches_log_as_far_as_log_lets_info_through() {
    assert!(
        !tracing::dispatcher::has_been_set(),
        "this test needs a process without a tracing dispatcher"
    );
    log::set_logger(&KEEP).expect("the only logger");
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/t",
            post(move || {
                let sink = sink.clone();
                async move {
                    sink.hit();
                    "done"
                }
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    let send = |key: &'static str| {
        client()
            .post(format!("http://{addr}/t"))
            .header("idempotency-key", key)
            .body("1")
            .send()
    };

    // `log` off (its default): nothing of the span is written.
    assert_eq!(send("a").await.expect("r").status(), 200);
    assert_eq!(span_records(), Vec::<String>::new());

    // `log` at INFO: the span's fields and its outcome.
    log::set_max_level(log::LevelFilter::Info);
    assert_eq!(send("b").await.expect("r").status(), 200);
    let seen = span_records();
    assert!(
        seen.iter()
            .any(|l| l.contains("method=POST") && l.contains("path=\"/t\"")),
        "the span's fields: {seen:?}"
    );
    assert!(
        seen.iter().any(|l| l.contains("outcome=\"executed\"")),
        "the span's outcome: {seen:?}"
    );
    // A replay is recorded on its span too.
    assert_eq!(send("b").await.expect("r").status(), 200);
    let seen = span_records();
    assert!(
        seen.iter().any(|l| l.contains("outcome=\"replayed\"")),
        "the replay's outcome: {seen:?}"
    );

    // `log` at WARN: an INFO span writes nothing, as before.
    log::set_max_level(log::LevelFilter::Warn);
    assert_eq!(send("c").await.expect("r").status(), 200);
    assert_eq!(span_records(), Vec::<String>::new());
    assert_eq!(effects.count(), 3, "a, b and c ran once each");
}
