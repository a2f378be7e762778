//! Helpers of the batched-store tests (issue 23 §4): keys unique to a run, a plain claim and
//! its answer, a store through the statement-counting proxy.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tower_idempotency::IdempotencyStore;
use tower_idempotency::store::{
    Claim, ClaimRequest, FencingToken, Fingerprint, LeaseExpiry, PostgresStore, ScopedKey,
    StoreError, StoredResponse,
};

use super::proxy::Proxy;

/// The lease and TTL of every claim here: longer than any test.
pub const LONG: Duration = Duration::from_secs(60);

/// `name` made unique to this run.
pub fn unique(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{name}-{nanos}")
}

/// `store` as it is, or batching its claims and completions (the default batching).
pub fn alone_or_batched(store: &PostgresStore, batched: bool) -> std::sync::Arc<PostgresStore> {
    std::sync::Arc::new(match batched {
        false => store.clone(),
        true => store
            .clone()
            .with_batching(tower_idempotency::store::Batching::default()),
    })
}

/// A claim of `key` under a long lease and TTL, one fingerprint for all.
pub fn claim(key: &ScopedKey) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        fingerprint: Fingerprint::from_bytes([7; 32]),
        lease: LONG,
        ttl: LONG,
        on_lease_expiry: LeaseExpiry::Reclaim,
    }
}

/// An answer that names its key, so a crossed answer shows.
pub fn answer(key: &ScopedKey) -> StoredResponse {
    StoredResponse {
        status: http::StatusCode::CREATED,
        headers: http::HeaderMap::new(),
        body: Some(bytes::Bytes::from(format!(
            "answer for {:?}/{:?}",
            key.scope(),
            key.key()
        ))),
        trailers: None,
    }
}

/// [`claim`] with its own lease, TTL and route's way with an expired lease.
pub fn claim_with(
    key: &ScopedKey,
    lease: Duration,
    ttl: Duration,
    on_lease_expiry: LeaseExpiry,
) -> ClaimRequest {
    ClaimRequest {
        lease,
        ttl,
        on_lease_expiry,
        ..claim(key)
    }
}

/// Claims a fresh `key`; its token.
pub async fn acquire<S: IdempotencyStore>(store: &S, key: &ScopedKey) -> FencingToken {
    acquired(store, &claim(key)).await
}

/// Makes `req`, which must win, and completes it with `response` kept for `ttl`: the token.
pub async fn recorded<S: IdempotencyStore>(
    store: &S,
    req: &ClaimRequest,
    response: &StoredResponse,
    ttl: Duration,
) -> FencingToken {
    let token = acquired(store, req).await;
    store
        .complete(&req.key, token, response, ttl)
        .await
        .expect("complete");
    token
}

/// Makes `req`, which must win; the token it holds.
pub async fn acquired<S: IdempotencyStore>(store: &S, req: &ClaimRequest) -> FencingToken {
    match store.claim(req).await {
        Ok(Claim::Acquired(lease)) => lease.token,
        other => panic!("{:?}: expected Acquired, got {other:?}", req.key),
    }
}

/// A store on a pool of `connections` through the statement-counting proxy, in `table`
/// (`None`, after saying so, without a server).
pub async fn through_proxy(table: &str, connections: u32) -> Option<(PostgresStore, Proxy)> {
    super::postgres_pool().await?;
    let options: PgConnectOptions = super::postgres_url().parse().expect("postgres url");
    let upstream = tokio::net::lookup_host((options.get_host(), options.get_port()))
        .await
        .expect("resolve")
        .next()
        .expect("an address");
    let proxy = Proxy::start(upstream).await;
    let pool = PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(options.host("127.0.0.1").port(proxy.addr.port()))
        .await
        .expect("connect through the proxy");
    let store = PostgresStore::new(pool).with_table(table).expect("table");
    store.migrate().await.expect("migrate");
    Some((store, proxy))
}

/// The claim of `key` on `store`, sent on a task of its own.
pub fn spawn_claim<S: IdempotencyStore + Clone>(
    store: &S,
    key: &ScopedKey,
) -> tokio::task::JoinHandle<Result<Claim, StoreError>> {
    let (store, req) = (store.clone(), claim(key));
    tokio::spawn(async move { store.claim(&req).await })
}

/// What `task` returned, within `guard`: a hang guard with wide slack, never a measurement.
pub async fn within<T>(guard: Duration, task: tokio::task::JoinHandle<T>) -> T {
    tokio::time::timeout(guard, task)
        .await
        .expect("hang guard")
        .expect("task")
}

/// Each of `reqs` claimed at once (the tasks released together by a barrier): their answers,
/// in order.
pub async fn claim_together<S: IdempotencyStore + 'static>(
    store: &std::sync::Arc<S>,
    reqs: Vec<ClaimRequest>,
) -> Vec<Result<Claim, StoreError>> {
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(reqs.len()));
    let tasks: Vec<_> = reqs
        .into_iter()
        .map(|req| {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                store.claim(&req).await
            })
        })
        .collect();
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.expect("claim task"));
    }
    out
}

/// Each key completed at once with its token and its own [`answer`] (the tasks released
/// together by a barrier): their answers, in order.
pub async fn complete_together<S: IdempotencyStore + 'static>(
    store: &std::sync::Arc<S>,
    work: &[(ScopedKey, FencingToken)],
) -> Vec<Result<(), StoreError>> {
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(work.len()));
    let tasks: Vec<_> = work
        .iter()
        .map(|(key, token)| {
            let (store, barrier, key, token) =
                (store.clone(), barrier.clone(), key.clone(), *token);
            tokio::spawn(async move {
                barrier.wait().await;
                store.complete(&key, token, &answer(&key), LONG).await
            })
        })
        .collect();
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.expect("complete task"));
    }
    out
}

/// Locks `key`'s row of `table` (`FOR UPDATE`) in the transaction `conn` is in, as a
/// handler's own transaction holds it: a claim that would change the record waits for it.
pub async fn hold_row(conn: &mut sqlx::PgConnection, table: &str, key: &ScopedKey) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM {table} WHERE scope = $1 AND key = $2 FOR UPDATE"
    )))
    .bind(key.scope().as_bytes())
    .bind(key.key().as_bytes())
    .execute(conn)
    .await
    .expect("hold the row");
}
