//! Issue 20 (first items): wiring mistakes are the server's, and configuration that cannot
//! work is cut to what works or refused when the layer is built, never a panic per request.

mod common;

use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use common::{Effects, FlakyStore, client, problem, problem_type, serve};
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, IdempotencyStore, MemoryStore};

async fn post_key(addr: std::net::SocketAddr, path: &str, key: Option<&str>) -> reqwest::Response {
    let mut req = client().post(format!("http://{addr}{path}")).body("{}");
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    req.send().await.expect("request")
}

/// A handler that needs the context on a request the layer did not guard (an optional key
/// not sent) is wired wrong: 500 naming it, not a 400 that blames the client.
/// `Option<IdempotencyContext>` is how such a handler reads it.
#[tokio::test]
async fn s20_3_a_context_on_an_unguarded_request_is_a_server_error() {
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/needs",
            post(|ctx: IdempotencyContext| async move { ctx.key().to_owned() }),
        )
        .route(
            "/optional",
            post(move |ctx: Option<IdempotencyContext>| async move {
                sink.hit();
                ctx.map_or("unguarded".to_owned(), |c| c.key().to_owned())
            }),
        )
        .route_layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .require_key(false),
        );
    let addr = serve(app).await;
    let res = post_key(addr, "/needs", None).await;
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let p = problem(res).await;
    assert_eq!(p["type"], problem_type("not-guarded"));
    assert!(
        p["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("Option<IdempotencyContext>")
    );
    let res = post_key(addr, "/optional", None).await;
    assert_eq!(res.text().await.expect("body"), "unguarded");
    let res = post_key(addr, "/optional", Some("k")).await;
    assert_eq!(res.text().await.expect("body"), "k");
    assert_eq!(effects.count(), 2);
}

/// Durations no store or clock can hold are cut to `LONGEST`: a wait, a retry hint and a TTL
/// of `Duration::MAX` work instead of panicking or failing every request.
#[tokio::test]
async fn s20_9_durations_beyond_any_clock_are_cut_not_fatal() {
    let effects = Effects::default();
    let sink = effects.clone();
    let store = FlakyStore::default();
    let app = Router::new()
        .route(
            "/slow",
            post(move || async move {
                tokio::time::sleep(Duration::from_millis(200)).await;
                format!("effect {}", sink.hit())
            }),
        )
        .route_layer(
            IdempotencyLayer::new(store.clone())
                .single_tenant()
                .wait_for_in_flight(Duration::MAX)
                .unavailable_retry_after(Duration::MAX)
                .ttl(Duration::MAX)
                .lease(Duration::MAX),
        );
    let addr = serve(app).await;
    let first = tokio::spawn(async move { post_key(addr, "/slow", Some("k-max")).await.status() });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let waited = post_key(addr, "/slow", Some("k-max")).await;
    assert_eq!(
        waited.headers()["idempotency-replayed"],
        "true",
        "waited, then replayed"
    );
    assert_eq!(first.await.expect("first"), StatusCode::OK);
    store.down.store(true, std::sync::atomic::Ordering::SeqCst);
    let down = post_key(addr, "/slow", Some("k-down")).await;
    assert_eq!(down.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(down.headers().get("retry-after").is_some());
    assert_eq!(effects.count(), 1);
}

/// The same TTL and lease on the SQL stores: represented, not an overflow and a 503.
#[tokio::test]
async fn s20_9_a_maximal_ttl_works_on_the_sql_stores() {
    let (sqlite, _path) = common::sqlite("max-ttl").await;
    run_max_ttl(sqlite).await;
    if let Some(postgres) = common::postgres("config_max_ttl").await {
        run_max_ttl(postgres).await;
    }
}

async fn run_max_ttl<St: IdempotencyStore>(store: St) {
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/t",
            post(move || async move { format!("effect {}", sink.hit()) }),
        )
        .route_layer(
            IdempotencyLayer::new(store)
                .single_tenant()
                .ttl(Duration::MAX)
                .lease(Duration::MAX),
        );
    let addr = serve(app).await;
    let key = format!(
        "k-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    assert_eq!(
        post_key(addr, "/t", Some(&key)).await.status(),
        StatusCode::OK
    );
    let replay = post_key(addr, "/t", Some(&key)).await;
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(effects.count(), 1);
}

/// A second `for_path` for the same path would silently replace the first: refused when the
/// layer is built.
#[test]
#[should_panic(expected = "is given twice")]
fn s20_9_the_same_path_configured_twice_is_refused() {
    let _ = IdempotencyLayer::new(MemoryStore::new())
        .for_path("/charge", |r| r.require_key(false))
        .for_path("/charge", |r| r.require_key(true));
}

/// Issue 20 §2: a store whose table is missing says so at start-up, naming the fix, instead of
/// answering every request 503 in silence.
#[tokio::test]
async fn s20_2_a_store_without_its_table_says_to_migrate() {
    use tower_idempotency::store::{CheckError, PostgresStore, SqliteStore};
    let path = common::sqlite_path("unmigrated");
    let sqlite = SqliteStore::connect(&format!("sqlite://{}", path.display()))
        .await
        .expect("open");
    let error = sqlite.check().await.expect_err("no table yet");
    assert!(matches!(error, CheckError::NotMigrated { .. }));
    assert!(error.to_string().contains("migrate()"), "{error}");
    sqlite.migrate().await.expect("migrate");
    sqlite.check().await.expect("migrated");
    if let Some(pool) = common::postgres_pool().await {
        let table = "config_never_migrated";
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
            .execute(&pool)
            .await
            .expect("drop");
        let postgres = PostgresStore::new(pool)
            .with_table("public", table)
            .expect("table");
        let error = postgres.check().await.expect_err("no table yet");
        assert!(
            error.to_string().contains("public.config_never_migrated"),
            "{error}"
        );
        assert!(error.to_string().contains("migrate()"), "{error}");
        postgres.migrate().await.expect("migrate");
        postgres.check().await.expect("migrated");
    }
}
