//! DESIGN §6 with §4's run to completion: an execution whose client hung up runs on in a task of
//! its own, and what it traces is still inside the request's `idempotency` span, as it was
//! while the client waited. The span is entered by the response future, and by the task the
//! execution is handed to, not by a wrapper inside it.

mod common;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use common::{Effects, guard, serve, until};
use tokio::sync::Notify;
use tower_idempotency::{IdempotencyLayer, MemoryStore};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// Each event's message, with the name of the span it was emitted in.
type Seen = Arc<Mutex<Vec<(String, Option<&'static str>)>>>;

/// Spans by id, the entered stack (one thread: a current-thread runtime), and each event's
/// message with the span it was emitted in.
#[derive(Default)]
struct Spans {
    next_id: AtomicU64,
    names: Mutex<Vec<&'static str>>,
    stack: Mutex<Vec<u64>>,
    events: Seen,
}

struct Message<'a>(&'a mut String);

impl Visit for Message<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            *self.0 = format!("{value:?}");
        }
    }
}

impl Subscriber for Spans {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, attributes: &Attributes<'_>) -> Id {
        let mut names = self.names.lock().expect("lock");
        names.push(attributes.metadata().name());
        self.next_id.fetch_add(1, Ordering::SeqCst);
        Id::from_u64(names.len() as u64)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let mut message = String::new();
        event.record(&mut Message(&mut message));
        let names = self.names.lock().expect("lock");
        let current = self
            .stack
            .lock()
            .expect("lock")
            .last()
            .map(|id| names[(*id - 1) as usize]);
        self.events.lock().expect("lock").push((message, current));
    }

    fn enter(&self, id: &Id) {
        self.stack.lock().expect("lock").push(id.into_u64());
    }

    fn exit(&self, id: &Id) {
        let mut stack = self.stack.lock().expect("lock");
        if let Some(at) = stack.iter().rposition(|entered| *entered == id.into_u64()) {
            stack.remove(at);
        }
    }
}

#[tokio::test]
async fn s6_an_execution_whose_client_hung_up_is_traced_in_its_span() {
    let subscriber = Spans::default();
    let events = subscriber.events.clone();
    // A current-thread runtime: server, handler, detached task and client share this default.
    let _default = tracing::subscriber::set_default(subscriber);

    let (effects, go) = (Effects::default(), Arc::new(Notify::new()));
    let started = Effects::default();
    let app = {
        let (effects, go, started) = (effects.clone(), go.clone(), started.clone());
        Router::new()
            .route(
                "/op",
                post(move || {
                    let (effects, go, started) = (effects.clone(), go.clone(), started.clone());
                    async move {
                        tracing::info!("handler started");
                        started.hit();
                        go.notified().await;
                        // The client is gone by now: this runs in the detached execution.
                        tracing::info!("handler finished");
                        effects.hit();
                        "done"
                    }
                }),
            )
            .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant())
    };
    let addr = serve(app).await;

    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("client");
    let request = client
        .post(format!("http://{addr}/op"))
        .header("idempotency-key", "detached")
        .body("{}")
        .send();
    // The client hangs up once the handler is running.
    let hung_up = tokio::select! {
        _ = request => false,
        () = until("the handler to start", || started.count() == 1) => true,
    };
    assert!(hung_up, "the handler answered before it was told to");
    // Let the server see the hang-up before the handler goes on.
    tokio::time::sleep(Duration::from_millis(50)).await;
    go.notify_one();
    until("the detached execution to finish", || effects.count() == 1).await;

    let seen = events.lock().expect("lock").clone();
    let span_of = |message: &str| {
        seen.iter()
            .find(|(m, _)| m == message)
            .unwrap_or_else(|| panic!("no event {message:?} in {seen:?}"))
            .1
    };
    assert_eq!(span_of("handler started"), Some("idempotency"), "{seen:?}");
    assert_eq!(span_of("handler finished"), Some("idempotency"), "{seen:?}");
    assert_eq!(effects.count(), 1);

    // The retry replays what the detached execution recorded, and runs nothing.
    let replay = guard(
        "the retry",
        client
            .post(format!("http://{addr}/op"))
            .header("idempotency-key", "detached")
            .body("{}")
            .send(),
    )
    .await
    .expect("retry");
    assert_eq!(
        replay
            .headers()
            .get("idempotency-replayed")
            .and_then(|v| v.to_str().ok()),
        Some("true")
    );
    assert_eq!(replay.text().await.expect("body"), "done");
    assert_eq!(effects.count(), 1);
}
