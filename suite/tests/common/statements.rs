//! Statements sqlx ran, read from its own `sqlx::query` log. SQLite runs each connection on a
//! thread of its own, so the log is read by a process-wide subscriber: how many statements a
//! batch took, told apart by the table they name.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt};

/// The statements that named each watched table, as sqlx logged them.
fn log() -> &'static Mutex<HashMap<String, Vec<String>>> {
    static LOG: OnceLock<Mutex<HashMap<String, Vec<String>>>> = OnceLock::new();
    LOG.get_or_init(Mutex::default)
}

struct Statement(String);

impl Visit for Statement {
    fn record_str(&mut self, _: &Field, value: &str) {
        self.0.push_str(value);
        self.0.push('\n');
    }

    fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
}

struct Logged;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Logged {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        if event.metadata().target() != "sqlx::query" {
            return;
        }
        let mut statement = Statement(String::new());
        event.record(&mut statement);
        let mut log = log().lock().expect("statement log");
        for (table, statements) in log.iter_mut() {
            if statement.0.contains(&format!("\"{table}\"")) {
                statements.push(statement.0.clone());
            }
        }
    }
}

/// Starts keeping the statements that name `table` (quoted, as the stores write it).
pub fn watch(table: &str) {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        let subscriber = tracing_subscriber::registry().with(Logged).with(
            tracing_subscriber::filter::Targets::new()
                .with_target("sqlx::query", tracing::Level::DEBUG),
        );
        tracing::subscriber::set_global_default(subscriber).expect("one global subscriber");
    });
    log()
        .lock()
        .expect("statement log")
        .insert(table.to_owned(), Vec::new());
}

/// How many statements naming `table` and containing `marker` ran since [`watch`] (`""`: all).
pub fn count(table: &str, marker: &str) -> usize {
    log()
        .lock()
        .expect("statement log")
        .get(table)
        .map_or(0, |statements| {
            statements.iter().filter(|s| s.contains(marker)).count()
        })
}
