//! Review of 8c5442f (`observe::spans_heard`): the per-request `idempotency` span is only made
//! when a subscriber could take INFO (or `log` could). This file is its own process with ONE
//! test, because it sets a GLOBAL subscriber, and only after the layer was built and had served
//! requests with no dispatcher at all; the subscriber's `max_level_hint` then moves (WARN, INFO,
//! TRACE, back to WARN, INFO again; `rebuild_interest_cache` after each move), on a
//! multi-thread runtime, over real sockets.
//!
//! What must hold whenever INFO is enabled: every guarded request has its span, with `method`,
//! `path`, `outcome` (and `attempt` when it ran); the events inside the request (the handler's,
//! the layer's error events when the store fails, and those of an execution whose client hung
//! up, detached onto its own task) have that very request's span as their parent. When INFO is
//! not enabled, no span (as before the change).

mod common;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::Path;
use axum::routing::post;
use common::{Effects, FlakyStore, client, guard, serve, until};
use tokio::sync::Notify;
use tower_idempotency::IdempotencyLayer;
use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

type Fields = BTreeMap<String, String>;

struct Collect<'a>(&'a mut Fields);

impl Visit for Collect<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().to_owned(), value.to_string());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().to_owned(), value.to_string());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

/// An event as seen: its message, its level, and the fields of the `idempotency` span it is in
/// (the nearest one of its scope), if any.
#[derive(Debug, Clone)]
struct Seen {
    message: String,
    level: tracing::Level,
    in_span: Option<Fields>,
}

/// Records closed `idempotency` spans (their final fields) and every event with the
/// `idempotency` span it is in. Its `max_level_hint` (and what it enables) moves with `hint`.
#[derive(Clone, Default)]
struct Recorder {
    /// 0 OFF, 1 ERROR, 2 WARN, 3 INFO, 4 DEBUG, 5 TRACE.
    hint: Arc<AtomicUsize>,
    closed: Arc<Mutex<Vec<Fields>>>,
    events: Arc<Mutex<Vec<Seen>>>,
}

fn filter_of(hint: usize) -> LevelFilter {
    [
        LevelFilter::OFF,
        LevelFilter::ERROR,
        LevelFilter::WARN,
        LevelFilter::INFO,
        LevelFilter::DEBUG,
        LevelFilter::TRACE,
    ][hint]
}

impl Recorder {
    fn set(&self, filter: LevelFilter) {
        let hint = match filter {
            f if f == LevelFilter::OFF => 0,
            f if f == LevelFilter::ERROR => 1,
            f if f == LevelFilter::WARN => 2,
            f if f == LevelFilter::INFO => 3,
            f if f == LevelFilter::DEBUG => 4,
            _ => 5,
        };
        self.hint.store(hint, Ordering::SeqCst);
        tracing::callsite::rebuild_interest_cache();
        assert_eq!(
            LevelFilter::current(),
            filter,
            "tracing's max level follows the hint"
        );
    }

    fn take(&self) -> (Vec<Fields>, Vec<Seen>) {
        (
            std::mem::take(&mut *self.closed.lock().expect("lock")),
            std::mem::take(&mut *self.events.lock().expect("lock")),
        )
    }
}

impl<S> tracing_subscriber::Layer<S> for Recorder
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn register_callsite(&self, _: &'static Metadata<'static>) -> tracing::subscriber::Interest {
        tracing::subscriber::Interest::sometimes()
    }

    fn enabled(&self, metadata: &Metadata<'_>, _: Context<'_, S>) -> bool {
        *metadata.level() <= filter_of(self.hint.load(Ordering::SeqCst))
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(filter_of(self.hint.load(Ordering::SeqCst)))
    }

    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if attrs.metadata().name() != "idempotency" {
            return;
        }
        let mut fields = Fields::new();
        attrs.record(&mut Collect(&mut fields));
        ctx.span(id).expect("span").extensions_mut().insert(fields);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let span = ctx.span(id).expect("span");
        let mut ext = span.extensions_mut();
        if let Some(fields) = ext.get_mut::<Fields>() {
            values.record(&mut Collect(fields));
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Fields::new();
        event.record(&mut Collect(&mut fields));
        let in_span = ctx.event_scope(event).and_then(|scope| {
            scope
                .into_iter()
                .find(|span| span.name() == "idempotency")
                .and_then(|span| span.extensions().get::<Fields>().cloned())
        });
        self.events.lock().expect("lock").push(Seen {
            message: fields.remove("message").unwrap_or_default(),
            level: *event.metadata().level(),
            in_span,
        });
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let span = ctx.span(&id).expect("span");
        if let Some(fields) = span.extensions().get::<Fields>() {
            self.closed.lock().expect("lock").push(fields.clone());
        }
    }
}

struct App {
    addr: std::net::SocketAddr,
    store: FlakyStore,
    effects: Effects,
    started: Effects,
    go: Arc<Notify>,
}

async fn app() -> App {
    let store = FlakyStore::default();
    let (effects, started, go) = (
        Effects::default(),
        Effects::default(),
        Arc::new(Notify::new()),
    );
    let router = Router::new()
        .route(
            "/t/{n}",
            post({
                let effects = effects.clone();
                move |Path(n): Path<u64>| {
                    let effects = effects.clone();
                    async move {
                        // Away from the thread that polled the request so far, now and then.
                        tokio::task::yield_now().await;
                        tracing::info!(n, "handler ran {n}");
                        effects.hit();
                        "done"
                    }
                }
            }),
        )
        .route(
            "/hold",
            post({
                let (effects, started, go) = (effects.clone(), started.clone(), go.clone());
                move || {
                    let (effects, started, go) = (effects.clone(), started.clone(), go.clone());
                    async move {
                        tracing::info!("hold started");
                        started.hit();
                        go.notified().await;
                        tracing::info!("hold finished");
                        effects.hit();
                        "held"
                    }
                }
            }),
        )
        .layer(IdempotencyLayer::new(store.clone()).single_tenant());
    App {
        addr: serve(router).await,
        store,
        effects,
        started,
        go,
    }
}

async fn post_n(app: &App, n: u64, key: &str) -> reqwest::Response {
    guard(
        "a request",
        client()
            .post(format!("http://{}/t/{n}", app.addr))
            .header("idempotency-key", key)
            .body("1")
            .send(),
    )
    .await
    .expect("request")
}

/// `count` concurrent requests to /t/{first..first+count}, each with its own key.
async fn burst(app: &App, first: u64, count: u64, tag: &str) {
    let tasks: Vec<_> = (first..first + count)
        .map(|n| {
            let (addr, key) = (app.addr, format!("{tag}-{n}"));
            tokio::spawn(async move {
                client()
                    .post(format!("http://{addr}/t/{n}"))
                    .header("idempotency-key", key)
                    .body("1")
                    .send()
                    .await
                    .expect("request")
                    .status()
            })
        })
        .collect();
    for task in tasks {
        assert_eq!(guard("a burst", task).await.expect("task"), 200);
    }
}

/// Every request of /t/{first..first+count} has a closed span with its method, its path, the
/// outcome `executed`, an attempt; and the handler's event is inside its own request's span.
fn each_request_traced(closed: &[Fields], events: &[Seen], first: u64, count: u64, what: &str) {
    for n in first..first + count {
        let path = format!("/t/{n}");
        let spans: Vec<&Fields> = closed
            .iter()
            .filter(|f| f.get("path") == Some(&path))
            .collect();
        assert_eq!(spans.len(), 1, "{what}: one span for {path}: {closed:?}");
        let span = spans[0];
        assert_eq!(
            span.get("method").map(String::as_str),
            Some("POST"),
            "{what}: {span:?}"
        );
        assert_eq!(
            span.get("outcome").map(String::as_str),
            Some("executed"),
            "{what}: {span:?}"
        );
        assert!(span.contains_key("attempt"), "{what}: no attempt: {span:?}");
        let message = format!("handler ran {n}");
        let event = events
            .iter()
            .find(|e| e.message == message)
            .unwrap_or_else(|| panic!("{what}: no event {message:?}"));
        assert_eq!(
            event.in_span.as_ref().and_then(|f| f.get("path")),
            Some(&path),
            "{what}: the handler's event of {path} is inside its request's span: {event:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn spans_follow_a_global_subscriber_set_late_and_its_moving_level() {
    assert!(
        !tracing::dispatcher::has_been_set(),
        "this test needs a process where no dispatcher was ever set"
    );
    // 0. The layer built and serving before any subscriber exists.
    let app = app().await;
    for n in 0..4 {
        assert_eq!(post_n(&app, n, &format!("pre-{n}")).await.status(), 200);
    }
    assert_eq!(app.effects.count(), 4);

    // 1. A global subscriber, set now, that takes WARN and above: no span (INFO), as before;
    //    the layer's ERROR event when the store fails still arrives, outside any span.
    let recorder = Recorder::default();
    recorder.hint.store(2, Ordering::SeqCst);
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(recorder.clone()))
        .expect("the only global subscriber");
    assert_eq!(LevelFilter::current(), LevelFilter::WARN);
    burst(&app, 100, 8, "warn").await;
    app.store.down.store(true, Ordering::SeqCst);
    assert_eq!(post_n(&app, 199, "warn-down").await.status(), 503);
    app.store.down.store(false, Ordering::SeqCst);
    let (closed, events) = recorder.take();
    assert!(
        closed.is_empty(),
        "no INFO span under a WARN subscriber: {closed:?}"
    );
    let failed: Vec<&Seen> = events
        .iter()
        .filter(|e| e.message.contains("claim failed"))
        .collect();
    assert_eq!(
        failed.len(),
        1,
        "the claim's failure is still an event: {events:?}"
    );
    assert_eq!(failed[0].level, tracing::Level::ERROR);
    assert!(failed[0].in_span.is_none(), "{failed:?}");
    assert!(
        events.iter().all(|e| e.level <= tracing::Level::WARN),
        "{events:?}"
    );

    // 2. The same subscriber now takes INFO: sixteen concurrent requests, each in its span, and
    //    each handler's event in its own request's span. A decision made once (at the layer's
    //    build, at its first request, at the subscriber's arrival) fails here.
    recorder.set(LevelFilter::INFO);
    burst(&app, 200, 16, "info").await;
    let (closed, events) = recorder.take();
    each_request_traced(&closed, &events, 200, 16, "INFO");
    assert_eq!(closed.len(), 16, "{closed:?}");
    // A replay's span says so, and has no attempt.
    assert_eq!(post_n(&app, 200, "info-200").await.status(), 200);
    let (closed, _) = recorder.take();
    assert_eq!(closed.len(), 1, "{closed:?}");
    assert_eq!(
        closed[0].get("outcome").map(String::as_str),
        Some("replayed")
    );
    assert_eq!(closed[0].get("path").map(String::as_str), Some("/t/200"));
    assert!(!closed[0].contains_key("attempt"), "{closed:?}");

    // 3. The store fails: the layer's ERROR event is inside the request's span, whose outcome
    //    says so.
    app.store.down.store(true, Ordering::SeqCst);
    assert_eq!(post_n(&app, 299, "info-down").await.status(), 503);
    app.store.down.store(false, Ordering::SeqCst);
    let (closed, events) = recorder.take();
    let failed = events
        .iter()
        .find(|e| e.message.contains("claim failed"))
        .unwrap_or_else(|| panic!("no claim failure event: {events:?}"));
    assert_eq!(
        failed
            .in_span
            .as_ref()
            .and_then(|f| f.get("path"))
            .map(String::as_str),
        Some("/t/299"),
        "{failed:?}"
    );
    assert_eq!(closed.len(), 1, "{closed:?}");
    assert_eq!(
        closed[0].get("outcome").map(String::as_str),
        Some("store_unavailable"),
        "{closed:?}"
    );
    // The outcome's write fails once: the layer's ERROR event about it is in the span too.
    app.store
        .fail_complete_once
        .lock()
        .expect("lock")
        .insert("info-complete".to_owned());
    let res = post_n(&app, 298, "info-complete").await;
    assert!(
        res.status().is_success() || res.status().is_server_error(),
        "{}",
        res.status()
    );
    until("the outcome to land", || {
        recorder
            .closed
            .lock()
            .expect("lock")
            .iter()
            .any(|f| f.get("path").map(String::as_str) == Some("/t/298"))
    })
    .await;
    let (_, events) = recorder.take();
    let record_failed = events
        .iter()
        .find(|e| e.message.contains("could not record the outcome"))
        .unwrap_or_else(|| panic!("no event about the failed write: {events:?}"));
    assert_eq!(
        record_failed
            .in_span
            .as_ref()
            .and_then(|f| f.get("path"))
            .map(String::as_str),
        Some("/t/298"),
        "the failed write's event is in its request's span: {record_failed:?}"
    );

    // 4. A client hangs up while its execution runs: the rest runs detached, in the span.
    let request = client()
        .post(format!("http://{}/hold", app.addr))
        .header("idempotency-key", "hold-1")
        .body("1")
        .send();
    let hung_up = tokio::select! {
        _ = request => false,
        () = until("the handler to start", || app.started.count() == 1) => true,
    };
    assert!(hung_up, "the handler answered before it was told to");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let before = app.effects.count();
    app.go.notify_one();
    until("the detached execution to finish", || {
        app.effects.count() == before + 1
    })
    .await;
    until("its span to close", || {
        recorder
            .closed
            .lock()
            .expect("lock")
            .iter()
            .any(|f| f.get("path").map(String::as_str) == Some("/hold"))
    })
    .await;
    let (closed, events) = recorder.take();
    for message in ["hold started", "hold finished"] {
        let e = events
            .iter()
            .find(|e| e.message == message)
            .unwrap_or_else(|| panic!("no {message:?}: {events:?}"));
        assert_eq!(
            e.in_span
                .as_ref()
                .and_then(|f| f.get("path"))
                .map(String::as_str),
            Some("/hold"),
            "{message}: {e:?}"
        );
    }
    assert_eq!(closed.len(), 1, "{closed:?}");
    assert_eq!(
        closed[0].get("outcome").map(String::as_str),
        Some("executed")
    );

    // 5. TRACE: still there.
    recorder.set(LevelFilter::TRACE);
    burst(&app, 500, 8, "trace").await;
    let (closed, events) = recorder.take();
    each_request_traced(&closed, &events, 500, 8, "TRACE");

    // 6. Back to WARN: no span; then INFO again: spans again (a decision cached after a
    //    request under WARN fails here).
    recorder.set(LevelFilter::WARN);
    burst(&app, 600, 8, "warn-again").await;
    let (closed, events) = recorder.take();
    assert!(closed.is_empty(), "{closed:?}");
    assert!(
        events.iter().all(|e| e.level <= tracing::Level::WARN),
        "{events:?}"
    );
    recorder.set(LevelFilter::INFO);
    burst(&app, 700, 8, "info-again").await;
    let (closed, events) = recorder.take();
    each_request_traced(&closed, &events, 700, 8, "INFO again");

    // Every handler ran once per key.
    assert_eq!(
        app.effects.count(),
        4 + 8 + 16 + 1 + 1 + 8 + 8 + 8,
        "pre, warn, info, complete, hold, trace, warn-again, info-again"
    );
}
