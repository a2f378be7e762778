//! The PostgreSQL rig of the server-fault reviews: a table of the test's own, pools whose
//! backends carry the test's `application_name` (so a test terminates or watches only its own),
//! a migrated store, and a sink counting effects per key.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use tower_idempotency::store::PostgresStore;

/// A table name of its own for one test run (`{prefix}_{name}_{nanos}`; keep it under 63 bytes).
pub fn table(prefix: &str, name: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{prefix}_{name}_{}", nanos % 1_000_000_000_000)
}

/// The test server's options with `application_name` set, and any session settings.
pub fn options(app: &str, settings: &[(&str, &str)]) -> PgConnectOptions {
    let options: PgConnectOptions = super::postgres_url().parse().expect("a PostgreSQL URL");
    options
        .application_name(app)
        .options(settings.iter().copied())
}

/// A pool of at most `max` connections named `app` (3 s to acquire one).
pub async fn pool(app: &str, max: u32, settings: &[(&str, &str)]) -> PgPool {
    pool_with(app, max, Duration::from_secs(3), settings).await
}

/// A pool of at most `max` connections named `app`, `acquire` to acquire one.
pub async fn pool_with(
    app: &str,
    max: u32,
    acquire: Duration,
    settings: &[(&str, &str)],
) -> PgPool {
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(acquire)
        .connect_with(options(app, settings))
        .await
        .expect("pool")
}

/// The one parameter of a count that [`count_until`] reads, if it has one.
#[derive(Clone, Copy)]
pub enum Bind<'a> {
    None,
    Int(i32),
    Text(&'a str),
    Bytes(&'a [u8]),
    ManyBytes(&'a [Vec<u8>]),
}

/// Reads `count` (an SQL count, its parameter `bind`) on `admin` every `every` until `done`
/// says it will do; the count then. Bound it with the test's own guard.
pub async fn count_until(
    admin: &PgPool,
    count: &str,
    bind: Bind<'_>,
    every: Duration,
    done: impl Fn(i64) -> bool,
) -> i64 {
    loop {
        let query = sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(count.to_owned()));
        let query = match bind {
            Bind::None => query,
            Bind::Int(int) => query.bind(int),
            Bind::Text(text) => query.bind(text),
            Bind::Bytes(bytes) => query.bind(bytes),
            Bind::ManyBytes(many) => query.bind(many),
        };
        let n = query.fetch_one(admin).await.expect("read a count");
        if done(n) {
            return n;
        }
        tokio::time::sleep(every).await;
    }
}

/// A migrated store in `table` on `pool`. Migrated on a pool of the server's defaults: a
/// test's own session settings (a 1 ms lock timeout) fail the migration lock whenever another
/// test of the binary migrates at the same moment. That pool is closed once it has migrated
/// (each call opens one: left to drop, its connection lingered while the test ran).
pub async fn store(pool: PgPool, table: &str) -> PostgresStore {
    let plain = super::postgres_pool().await.expect("a PostgreSQL pool");
    let migrating = PostgresStore::new(plain.clone())
        .with_table(table)
        .expect("table");
    migrating.migrate().await.expect("migrate");
    plain.close().await;
    PostgresStore::new(pool).with_table(table).expect("table")
}

/// Effects per key, counted where they happen.
#[derive(Clone, Default)]
pub struct Sink(Arc<Mutex<HashMap<String, usize>>>);

impl Sink {
    /// Counts one effect of `key`: how many it has now.
    pub fn hit(&self, key: &str) -> usize {
        let mut map = self.0.lock().expect("lock");
        let n = map.entry(key.to_owned()).or_default();
        *n += 1;
        *n
    }

    /// The effects of `key`.
    pub fn of(&self, key: &str) -> usize {
        self.0.lock().expect("lock").get(key).copied().unwrap_or(0)
    }

    /// The effects of every key.
    pub fn total(&self) -> usize {
        self.0.lock().expect("lock").values().sum()
    }

    /// The keys with more than one effect, and how many each had.
    pub fn twice(&self) -> Vec<(String, usize)> {
        self.0
            .lock()
            .expect("lock")
            .iter()
            .filter(|(_, n)| **n > 1)
            .map(|(k, n)| (k.clone(), *n))
            .collect()
    }
}
