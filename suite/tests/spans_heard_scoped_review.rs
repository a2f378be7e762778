//! Review of 8c5442f (`observe::spans_heard`) with thread-scoped subscribers
//! (`set_default`, `with_default`) from tracing-subscriber's `fmt`, per-layer filters, target
//! filters and levels WARN / INFO / TRACE, each set after the layer was built and had served a
//! request. Each test runs on a current-thread runtime: server, handler and client share the
//! thread's default. What `fmt` writes is what a user sees; the change must not alter it.

mod common;

use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::routing::post;
use common::{Effects, FlakyStore, client, serve};
use serde_json::json;
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::jsonrpc::JsonRpc;
use tracing::Level;
use tracing::level_filters::LevelFilter;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::fmt::format::FmtSpan;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::{Layer, fmt};

/// What `fmt` wrote, shared with the test.
#[derive(Clone, Default)]
struct Out(Arc<Mutex<Vec<u8>>>);

impl io::Write for Out {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Out {
    fn take(&self) -> String {
        String::from_utf8(std::mem::take(&mut *self.0.lock().expect("lock"))).expect("utf-8")
    }
    fn writer(&self) -> impl Fn() -> Out + Send + Sync + 'static {
        let out = self.clone();
        move || out.clone()
    }
}

/// A `fmt` subscriber writing plain text to `out`, up to `level`, with `events` of spans.
fn plain(
    out: &Out,
    level: Level,
    events: FmtSpan,
) -> impl tracing::Subscriber + Send + Sync + 'static {
    fmt()
        .with_writer(out.writer())
        .with_ansi(false)
        .with_max_level(level)
        .with_span_events(events)
        .finish()
}

struct App {
    addr: std::net::SocketAddr,
    store: FlakyStore,
    effects: Effects,
}

async fn app() -> App {
    let store = FlakyStore::default();
    let effects = Effects::default();
    let sink = effects.clone();
    let router = Router::new()
        .route(
            "/t",
            post(move || {
                let sink = sink.clone();
                async move {
                    tracing::info!("handler ran");
                    sink.hit();
                    "done"
                }
            }),
        )
        .layer(IdempotencyLayer::new(store.clone()).single_tenant());
    App {
        addr: serve(router).await,
        store,
        effects,
    }
}

async fn send(app: &App, key: &str) -> u16 {
    client()
        .post(format!("http://{}/t", app.addr))
        .header("idempotency-key", key)
        .body("1")
        .send()
        .await
        .expect("request")
        .status()
        .as_u16()
}

const SPAN: &str = "idempotency{method=POST path=\"/t\"";

/// An INFO `fmt` subscriber set (scoped) after the layer was built and served a request: the
/// next request's span is written with its fields and outcome, the handler's event inside it,
/// a replay's span says `replayed`.
///
/// Catches: a decision taken once per layer (at its build, at its first request) while nothing
/// listened on this thread; a `spans_heard` that only asks `log`.
#[tokio::test]
async fn fmt_info_set_after_the_layer_served_writes_the_span() {
    let app = app().await;
    assert_eq!(send(&app, "before").await, 200);
    let out = Out::default();
    let subscriber = plain(&out, Level::INFO, FmtSpan::CLOSE);
    let _default = tracing::subscriber::set_default(subscriber);
    assert_eq!(send(&app, "after").await, 200);
    let text = out.take();
    assert!(
        text.lines()
            .any(|l| l.contains(SPAN) && l.contains("handler ran")),
        "the handler's event inside the span: {text}"
    );
    assert!(
        text.lines()
            .any(|l| l.contains(SPAN) && l.contains("outcome=\"executed\"") && l.contains("close")),
        "the span's close with its outcome: {text}"
    );
    assert!(text.contains("attempt="), "the attempt: {text}");
    assert_eq!(send(&app, "after").await, 200);
    let text = out.take();
    assert!(
        text.lines()
            .any(|l| l.contains(SPAN) && l.contains("outcome=\"replayed\"")),
        "the replay's span: {text}"
    );
    assert_eq!(app.effects.count(), 2);
}

/// Per-layer filters: one `fmt` layer takes only `tower_idempotency` at INFO, another takes
/// everything at WARN. The first writes the span, and the layer's ERROR event when the store
/// fails inside it; the second writes the ERROR event without the span (it never enabled it),
/// and neither writes the handler's INFO event (its target is this test's).
///
/// Catches: a `spans_heard` that asks the current dispatcher's `enabled` for some other
/// metadata, or a level test tighter than INFO (the registry's hint is INFO here, the max of
/// the layers').
#[tokio::test]
async fn per_layer_filters_see_the_span_only_where_enabled() {
    let app = app().await;
    assert_eq!(send(&app, "before").await, 200);
    let (mine, all) = (Out::default(), Out::default());
    let subscriber = tracing_subscriber::registry()
        .with(
            fmt::layer()
                .with_writer(mine.writer())
                .with_ansi(false)
                .with_span_events(FmtSpan::CLOSE)
                .with_filter(Targets::new().with_target("tower_idempotency", Level::INFO)),
        )
        .with(
            fmt::layer()
                .with_writer(all.writer())
                .with_ansi(false)
                .with_filter(LevelFilter::WARN),
        );
    let _default = tracing::subscriber::set_default(subscriber);
    assert_eq!(send(&app, "a").await, 200);
    let (text, warn) = (mine.take(), all.take());
    assert!(
        text.lines()
            .any(|l| l.contains(SPAN) && l.contains("outcome=\"executed\"")),
        "{text}"
    );
    assert!(!text.contains("handler ran"), "{text}");
    assert!(warn.is_empty(), "{warn}");

    app.store.down.store(true, Ordering::SeqCst);
    assert_eq!(send(&app, "b").await, 503);
    app.store.down.store(false, Ordering::SeqCst);
    let (text, warn) = (mine.take(), all.take());
    assert!(
        text.lines()
            .any(|l| l.contains(SPAN) && l.contains("claim failed")),
        "the store's failure inside the span: {text}"
    );
    assert!(
        text.lines()
            .any(|l| l.contains(SPAN) && l.contains("outcome=\"store_unavailable\"")),
        "{text}"
    );
    let line = warn
        .lines()
        .find(|l| l.contains("claim failed"))
        .unwrap_or_else(|| panic!("the WARN layer sees the ERROR event: {warn}"));
    assert!(!line.contains("idempotency{"), "{line}");
    assert_eq!(app.effects.count(), 2);
}

/// A subscriber at INFO for another target only (this test's events): nothing of the
/// layer, the handler's event written outside any span, as before the change.
///
/// Catches: a span made by other means than the macro (`Span::new` with the callsite's
/// metadata, bypassing the subscriber's interest).
#[tokio::test]
async fn a_subscriber_for_other_targets_writes_no_span() {
    let app = app().await;
    let out = Out::default();
    let subscriber = fmt()
        .with_writer(out.writer())
        .with_ansi(false)
        .with_span_events(FmtSpan::FULL)
        .finish()
        .with(Targets::new().with_target("spans_heard_scoped_review", Level::TRACE));
    let _default = tracing::subscriber::set_default(subscriber);
    assert_eq!(send(&app, "a").await, 200);
    let text = out.take();
    let line = text
        .lines()
        .find(|l| l.contains("handler ran"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(!text.contains("idempotency"), "{text}");
    assert!(!line.contains('{'), "{line}");
    assert_eq!(app.effects.count(), 1);
}

/// WARN only: the layer's ERROR event when the store fails, outside any span; then, on the same
/// layer, an INFO subscriber: the span is back (a "nobody listens" decision cached after a
/// request under WARN fails here).
#[tokio::test]
async fn warn_then_info_on_one_layer() {
    let app = app().await;
    let out = Out::default();
    {
        let subscriber = plain(&out, Level::WARN, FmtSpan::FULL);
        let _default = tracing::subscriber::set_default(subscriber);
        assert_eq!(send(&app, "a").await, 200);
        app.store.down.store(true, Ordering::SeqCst);
        assert_eq!(send(&app, "b").await, 503);
        app.store.down.store(false, Ordering::SeqCst);
        let text = out.take();
        let line = text
            .lines()
            .find(|l| l.contains("claim failed"))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(line.contains("ERROR"), "{line}");
        assert!(!text.contains("idempotency{"), "{text}");
    }
    let subscriber = plain(&out, Level::INFO, FmtSpan::CLOSE);
    let _default = tracing::subscriber::set_default(subscriber);
    assert_eq!(send(&app, "c").await, 200);
    let text = out.take();
    assert!(
        text.lines()
            .any(|l| l.contains(SPAN) && l.contains("outcome=\"executed\"")),
        "{text}"
    );
    assert_eq!(app.effects.count(), 2);
}

/// `with_default` at TRACE around a runtime of its own: the span is created once per request
/// and entered (FmtSpan::FULL writes new, enter, exit, close), the handler's event inside it.
///
/// Catches: a reversed level comparison (`INFO >= LevelFilter::current()`: false at TRACE).
#[test]
fn with_default_at_trace_writes_the_span_s_whole_life() {
    let out = Out::default();
    let subscriber = plain(&out, Level::TRACE, FmtSpan::FULL);
    let effects = tracing::subscriber::with_default(subscriber, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(async {
                let app = app().await;
                assert_eq!(send(&app, "a").await, 200);
                app.effects.count()
            })
    });
    assert_eq!(effects, 1);
    let text = out.take();
    let span_lines: Vec<&str> = text.lines().filter(|l| l.contains(SPAN)).collect();
    let count = |what: &str| {
        span_lines
            .iter()
            .filter(|l| l.ends_with(what) || l.contains(&format!(": {what}")))
            .count()
    };
    assert_eq!(count("new"), 1, "{text}");
    assert!(count("enter") >= 1, "{text}");
    assert!(count("close") == 1, "{text}");
    assert!(
        span_lines.iter().any(|l| l.contains("handler ran")),
        "{text}"
    );
}

/// A JSON-RPC (MCP `tools/call`) route: its span is written with the POST's path and outcome.
#[tokio::test]
async fn a_jsonrpc_call_is_traced() {
    let effects = Effects::default();
    let sink = effects.clone();
    let router = Router::new()
        .route(
            "/mcp",
            post(move |body: bytes::Bytes| {
                let sink = sink.clone();
                async move {
                    let message: serde_json::Value = serde_json::from_slice(&body).expect("json");
                    tracing::info!("tool ran");
                    sink.hit();
                    axum::Json(
                        json!({"jsonrpc": "2.0", "id": message["id"], "result": {"ok": true}}),
                    )
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(tower_idempotency::MemoryStore::new())
                .single_tenant()
                .jsonrpc(JsonRpc::new()),
        );
    let addr = serve(router).await;
    let out = Out::default();
    let subscriber = plain(&out, Level::INFO, FmtSpan::CLOSE);
    let _default = tracing::subscriber::set_default(subscriber);
    let call = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": "t", "arguments": {}}});
    for _ in 0..2 {
        let res = client()
            .post(format!("http://{addr}/mcp"))
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .header("idempotency-key", "j-1")
            .body(call.to_string())
            .send()
            .await
            .expect("request");
        assert_eq!(res.status(), 200);
    }
    let text = out.take();
    let span = "idempotency{method=POST path=\"/mcp\"";
    assert!(
        text.lines()
            .any(|l| l.contains(span) && l.contains("tool ran")),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.contains(span) && l.contains("outcome=\"executed\"")),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.contains(span) && l.contains("outcome=\"replayed\"")),
        "{text}"
    );
    assert_eq!(effects.count(), 1);
}
