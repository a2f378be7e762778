//! [`AnyStore`]: a backend chosen at run time from a URL.
// With no backend compiled in, the enum is empty and its methods ignore their arguments.
#![cfg_attr(
    not(any(
        feature = "memory",
        feature = "sqlite",
        feature = "postgres",
        feature = "redis"
    )),
    allow(unused_variables)
)]

use std::fmt;
use std::time::{Duration, SystemTime};

use super::{
    BoxError, Claim, ClaimRequest, FencingToken, Fingerprint, HistoryEvent, IdempotencyStore,
    InFlight, Milestone, Record, RecordStatus, Resolution, ScopedKey, StoreError, StoredResponse,
    UncertainCount, UncertainPage, UncertainQuery,
};

/// Any of the stores compiled into this build, picked from a URL at run time.
///
/// | URL | store | feature |
/// |---|---|---|
/// | `memory://` | [`MemoryStore`](super::MemoryStore) | `memory` |
/// | `sqlite://path/to/file.db` | `SqliteStore` | `sqlite` |
/// | `postgres://user@host/db` (or `postgresql://`) | `PostgresStore` | `postgres` |
/// | `redis://[:password@]host[:port][/db]` (or `rediss://`) | `RedisStore` | `redis` |
/// | `redis+cluster://host:port[,host:port…]` (any nodes of a Redis Cluster) | `RedisStore` | `redis` |
///
/// [`connect`](Self::connect) also creates the SQL stores' tables if they are missing.
///
/// ```
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_idempotency::IdempotencyLayer;
/// use tower_idempotency::store::AnyStore;
///
/// let url = std::env::var("IDEMPOTENCY_STORE").unwrap_or_else(|_| "memory://".into());
/// let layer = IdempotencyLayer::new(AnyStore::connect(&url).await?);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum AnyStore {
    /// The embedded store.
    #[cfg(feature = "memory")]
    Memory(super::MemoryStore),
    /// A SQLite file.
    #[cfg(feature = "sqlite")]
    Sqlite(super::SqliteStore),
    /// A PostgreSQL database.
    #[cfg(feature = "postgres")]
    Postgres(super::PostgresStore),
    /// A Redis or Valkey server, or a Redis Cluster.
    #[cfg(feature = "redis")]
    Redis(super::RedisStore),
}

/// Why [`AnyStore::connect`] failed. Its message names the store without its password
/// ([`AnyStore::redacted_url`]) and the cause.
#[derive(Debug)]
pub enum ConnectError {
    /// This build has no store for the URL's scheme.
    Unsupported {
        /// The scheme that was asked for.
        scheme: String,
    },
    /// The store could not be opened or migrated.
    Failed {
        /// The store's URL, its password replaced by `***`.
        store: String,
        /// What went wrong: refused, no such database, authentication, a file that cannot
        /// be opened.
        source: BoxError,
    },
}

impl fmt::Display for ConnectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unsupported { scheme } => write!(
                f,
                "no store for the URL scheme {scheme:?} in this build (available: {})",
                AnyStore::SCHEMES.join(", ")
            ),
            Self::Failed { store, source } => {
                write!(f, "could not open the store {store}: {source}")?;
                // The causes too: a bare "I/O error" says little without what is under it.
                let mut cause = source.source();
                while let Some(e) = cause {
                    write!(f, ": {e}")?;
                    cause = e.source();
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for ConnectError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Unsupported { .. } => None,
            Self::Failed { source, .. } => Some(source.as_ref()),
        }
    }
}

impl AnyStore {
    /// The URL schemes this build serves.
    pub const SCHEMES: &'static [&'static str] = &[
        #[cfg(feature = "memory")]
        "memory",
        #[cfg(feature = "sqlite")]
        "sqlite",
        #[cfg(feature = "postgres")]
        "postgres",
        #[cfg(feature = "postgres")]
        "postgresql",
        #[cfg(feature = "redis")]
        "redis",
        #[cfg(feature = "redis")]
        "rediss",
        #[cfg(feature = "redis")]
        "redis+cluster",
    ];

    /// `url` with its password (the user-info's, or a `password=` parameter) replaced by
    /// `***`: for logs and error messages.
    ///
    /// ```
    /// use tower_idempotency::AnyStore;
    ///
    /// assert_eq!(
    ///     AnyStore::redacted_url("postgres://app:s3cret@db/prod?password=x&sslmode=require"),
    ///     "postgres://app:***@db/prod?password=***&sslmode=require"
    /// );
    /// ```
    pub fn redacted_url(url: &str) -> String {
        let Some((scheme, rest)) = url.split_once("://") else {
            return redact_query(url);
        };
        // The user-info ends at the last `@`: a password may hold `/`, `?` or `@` unencoded
        // (generated ones often do). An `@` further on (in a query) only hides more.
        match rest.rfind('@') {
            Some(at) => {
                let (user_info, after) = (&rest[..at], &rest[at + 1..]);
                let user = user_info.split_once(':').map_or(user_info, |(u, _)| u);
                let hidden = if user_info.contains(':') { ":***" } else { "" };
                format!("{scheme}://{user}{hidden}@{}", redact_query(after))
            }
            None => format!("{scheme}://{}", redact_query(rest)),
        }
    }

    /// Batches the claims and completions of a SQL store (see
    /// [`PostgresStore::with_batching`](super::PostgresStore::with_batching)); the memory and
    /// Redis stores, one round trip or none per operation already, are left as they are.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::{AnyStore, store::Batching};
    ///
    /// let store = AnyStore::connect("postgres://postgres@127.0.0.1/app")
    ///     .await?
    ///     .with_batching(Batching::default());
    /// # Ok(()) }
    /// ```
    #[cfg(any(feature = "sqlite", feature = "postgres"))]
    pub fn with_batching(self, batching: super::Batching) -> Self {
        match self {
            #[cfg(feature = "sqlite")]
            Self::Sqlite(store) => Self::Sqlite(store.with_batching(batching)),
            #[cfg(feature = "postgres")]
            Self::Postgres(store) => Self::Postgres(store.with_batching(batching)),
            #[allow(unreachable_patterns)]
            other => other,
        }
    }

    /// Opens the store `url` names, creating SQL tables if missing. An error names the store
    /// (without its password) and the cause.
    pub async fn connect(url: &str) -> Result<Self, ConnectError> {
        let scheme = url.split_once(':').map_or(url, |(scheme, _)| scheme);
        #[cfg(any(feature = "sqlite", feature = "postgres"))]
        let failed = |e: sqlx::Error| ConnectError::Failed {
            store: Self::redacted_url(url),
            source: e.into(),
        };
        match scheme.to_ascii_lowercase().as_str() {
            #[cfg(feature = "memory")]
            "memory" => Ok(Self::Memory(super::MemoryStore::new())),
            #[cfg(feature = "sqlite")]
            "sqlite" => {
                let store = super::SqliteStore::connect(url).await.map_err(failed)?;
                store.migrate().await.map_err(failed)?;
                Ok(Self::Sqlite(store))
            }
            #[cfg(feature = "postgres")]
            "postgres" | "postgresql" => {
                let store = super::PostgresStore::connect(url).await.map_err(failed)?;
                store.migrate().await.map_err(failed)?;
                Ok(Self::Postgres(store))
            }
            #[cfg(feature = "redis")]
            "redis" | "rediss" => super::RedisStore::connect(url)
                .await
                .map(Self::Redis)
                .map_err(|e| ConnectError::Failed {
                    store: Self::redacted_url(url),
                    source: e.into(),
                }),
            #[cfg(feature = "redis")]
            "redis+cluster" => {
                // Each node as redis-rs reads one: `redis://host:port`, with the user-info.
                let rest = url.split_once("://").map_or("", |(_, rest)| rest);
                let (user_info, hosts) = match rest.rsplit_once('@') {
                    Some((user_info, hosts)) => (format!("{user_info}@"), hosts),
                    None => (String::new(), rest),
                };
                let nodes: Vec<String> = hosts
                    .trim_end_matches('/')
                    .split(',')
                    .map(|host| format!("redis://{user_info}{host}"))
                    .collect();
                let nodes: Vec<&str> = nodes.iter().map(String::as_str).collect();
                super::RedisStore::connect_cluster(&nodes)
                    .await
                    .map(Self::Redis)
                    .map_err(|e| ConnectError::Failed {
                        store: Self::redacted_url(url),
                        source: e.into(),
                    })
            }
            _ => Err(ConnectError::Unsupported {
                scheme: scheme.to_owned(),
            }),
        }
    }
}

/// `text` with the value of every `password` parameter of its query replaced by `***` (names
/// compared as sqlx reads them: percent-decoded, any case).
fn redact_query(text: &str) -> String {
    let Some((base, query)) = text.split_once('?') else {
        return text.to_owned();
    };
    let pairs = query.split('&').map(|pair| match pair.split_once('=') {
        Some((name, _))
            if percent_encoding::percent_decode_str(name)
                .decode_utf8_lossy()
                .eq_ignore_ascii_case("password") =>
        {
            format!("{name}=***")
        }
        _ => pair.to_owned(),
    });
    format!("{base}?{}", pairs.collect::<Vec<_>>().join("&"))
}

/// Forwards a call to whichever store this is.
macro_rules! each {
    ($self:ident, $store:ident => $call:expr) => {
        match *$self {
            #[cfg(feature = "memory")]
            AnyStore::Memory(ref $store) => $call,
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(ref $store) => $call,
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(ref $store) => $call,
            #[cfg(feature = "redis")]
            AnyStore::Redis(ref $store) => $call,
        }
    };
}

impl IdempotencyStore for AnyStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        each!(self, s => s.claim(request).await)
    }

    fn claim_now(&self, request: &ClaimRequest) -> Option<Result<Claim, StoreError>> {
        each!(self, s => s.claim_now(request))
    }

    fn recorded_fingerprint_now(&self, key: &ScopedKey) -> Option<Fingerprint> {
        each!(self, s => s.recorded_fingerprint_now(key))
    }

    fn completed_now(&self, key: &ScopedKey) -> Option<Result<Claim, StoreError>> {
        each!(self, s => s.completed_now(key))
    }

    async fn renew(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<SystemTime, StoreError> {
        each!(self, s => s.renew(key, token, lease).await)
    }

    async fn complete(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        each!(self, s => s.complete(key, token, response, ttl).await)
    }

    async fn release(
        &self,
        key: &ScopedKey,
        token: FencingToken,
    ) -> Result<RecordStatus, StoreError> {
        each!(self, s => s.release(key, token).await)
    }

    async fn mark_uncertain(&self, key: &ScopedKey, token: FencingToken) -> Result<(), StoreError> {
        each!(self, s => s.mark_uncertain(key, token).await)
    }

    async fn lookup(&self, key: &ScopedKey) -> Result<Option<Record>, StoreError> {
        each!(self, s => s.lookup(key).await)
    }

    async fn remove(&self, key: &ScopedKey) -> Result<bool, StoreError> {
        each!(self, s => s.remove(key).await)
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        each!(self, s => s.purge_expired().await)
    }

    async fn record_milestone(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        milestone: &Milestone,
    ) -> Result<(), StoreError> {
        each!(self, s => s.record_milestone(key, token, milestone).await)
    }

    async fn list_uncertain(&self, query: &UncertainQuery) -> Result<UncertainPage, StoreError> {
        each!(self, s => s.list_uncertain(query).await)
    }

    async fn count_uncertain(&self) -> Result<UncertainCount, StoreError> {
        each!(self, s => s.count_uncertain().await)
    }

    async fn resolve(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        resolution: &Resolution,
        ttl: Duration,
        note: Option<&str>,
    ) -> Result<(), StoreError> {
        each!(self, s => s.resolve(key, token, resolution, ttl, note).await)
    }

    async fn append_history(&self, key: &ScopedKey, event: HistoryEvent) -> Result<(), StoreError> {
        each!(self, s => s.append_history(key, event).await)
    }

    async fn wait_for_change(
        &self,
        key: &ScopedKey,
        seen: &InFlight,
        round: u32,
        within: Duration,
    ) {
        each!(self, s => s.wait_for_change(key, seen, round, within).await)
    }
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use super::*;

    #[tokio::test]
    async fn picks_a_store_by_scheme() {
        assert!(matches!(
            AnyStore::connect("memory://").await,
            Ok(AnyStore::Memory(_))
        ));
        assert!(matches!(
            AnyStore::connect("MEMORY://x").await,
            Ok(AnyStore::Memory(_))
        ));
        let err = AnyStore::connect("mongodb://db")
            .await
            .expect_err("unsupported");
        assert!(err.to_string().contains("mongodb"), "{err}");
    }
}
