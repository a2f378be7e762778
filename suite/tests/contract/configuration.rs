//! Issue 20 (first items): wiring mistakes are the server's, and configuration that cannot
//! work is cut to what works or refused when the layer is built, never a panic per request.

use crate::common;

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
        let postgres = PostgresStore::new(pool).with_table(table).expect("table");
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

/// Issue 20 §2: a table of the store's name that is not the one `migrate()` makes (by hand,
/// without a column the store reads and `migrate()` does not add; or with a required column the store never writes, as
/// another application's table may have) fails `check()` naming what is wrong, on SQLite and
/// PostgreSQL, where before it passed and every guarded request was answered 503.
#[tokio::test]
async fn s20_2_check_refuses_a_table_that_is_not_the_stores() {
    use tower_idempotency::store::{CheckError, PostgresStore, SqliteStore};
    /// A name, how the table's DDL is changed, and what `check()` says of it.
    type Edit = (&'static str, fn(&str) -> String, &'static str);
    let edits: [Edit; 2] = [
        (
            "missing downstream_id",
            |ddl| ddl.replacen("downstream_id", "downstream", 1),
            "missing columns: downstream_id",
        ),
        (
            "extra required column",
            |ddl| {
                ddl.replacen(
                    "resolution_note",
                    "tenant_id TEXT NOT NULL, resolution_note",
                    1,
                )
            },
            "never writes but a row must have: tenant_id",
        ),
    ];
    for (name, edit, says) in edits {
        let path = common::sqlite_path("misshapen");
        let sqlite = SqliteStore::connect(&format!("sqlite://{}", path.display()))
            .await
            .expect("open");
        let ddl = edit(&sqlite.migration_sql()[0]);
        sqlx::query(sqlx::AssertSqlSafe(ddl))
            .execute(sqlite.pool())
            .await
            .expect("the hand-made table");
        let _ = sqlite.migrate().await;
        let error = sqlite.check().await.expect_err(name);
        assert!(
            matches!(error, CheckError::Misshapen { .. }),
            "{name}: {error}"
        );
        assert!(error.to_string().contains(says), "{name}: {error}");
        let _ = std::fs::remove_file(&path);
        if let Some(pool) = common::postgres_pool().await {
            let table = "config_misshapen";
            sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
                .execute(&pool)
                .await
                .expect("drop");
            let postgres = PostgresStore::new(pool.clone())
                .with_table(table)
                .expect("table");
            let ddl = edit(&postgres.migration_sql()[1]);
            sqlx::query(sqlx::AssertSqlSafe(ddl))
                .execute(&pool)
                .await
                .expect("the hand-made table");
            postgres.migrate().await.expect("migrate adds what it adds");
            let error = postgres.check().await.expect_err(name);
            assert!(
                matches!(error, CheckError::Misshapen { .. }),
                "{name}: {error}"
            );
            assert!(error.to_string().contains(says), "{name}: {error}");
            sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
                .execute(&pool)
                .await
                .expect("drop");
        }
    }
}

/// Issue 20 §9: a store that cannot be opened says why at once (refused, no such database),
/// naming the store without its password, instead of "pool timed out" after 5 s.
#[tokio::test]
async fn s20_9_connect_failures_name_their_cause_and_hide_the_password() {
    use tower_idempotency::AnyStore;
    // A port nobody listens on: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let error = AnyStore::connect(&format!("postgres://app:s3cret@127.0.0.1:{port}/db"))
        .await
        .expect_err("nobody listens");
    let message = error.to_string();
    assert!(!message.contains("s3cret"), "{message}");
    assert!(message.contains("app:***@127.0.0.1"), "{message}");
    assert!(message.to_lowercase().contains("refused"), "{message}");
    // The refusal itself, not the pool's acquire time-out that used to hide it.
    assert!(!message.contains("timed out"), "{message}");

    if common::postgres_pool().await.is_some() {
        let url = common::postgres_url();
        let (server, _) = url.rsplit_once('/').expect("a database in the URL");
        let missing = format!("{server}/no_such_database_here?password=hunter2");
        let message = AnyStore::connect(&missing)
            .await
            .expect_err("no such database")
            .to_string();
        assert!(message.contains("no_such_database_here"), "{message}");
        assert!(message.contains("does not exist"), "{message}");
        assert!(
            message.contains("password=***") && !message.contains("hunter2"),
            "{message}"
        );
    }

    let dir = common::sqlite_path("no-such-dir");
    let message = AnyStore::connect(&format!("sqlite://{}/x.db", dir.display()))
        .await
        .expect_err("a directory that does not exist")
        .to_string();
    assert!(
        message.contains("unable to open database file"),
        "{message}"
    );
}

/// Issue 20 §9: a server that accepts the connection and never answers fails the connect in
/// bounded time, saying so, instead of hanging start-up.
#[tokio::test]
async fn s20_9_a_silent_server_fails_the_connect_in_bounded_time() {
    use tower_idempotency::AnyStore;
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = silent.local_addr().expect("addr");
    // Accepts, holds every connection open, says nothing.
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    let url = format!("postgres://app:pw@{addr}/db");
    let connect = AnyStore::connect(&url);
    // Far past the store's own 5 s bound: only "it ends, and says why" is asserted.
    let error = tokio::time::timeout(Duration::from_secs(30), connect)
        .await
        .expect("connect gives up on its own")
        .expect_err("nobody answers");
    let message = error.to_string();
    assert!(message.contains("did not answer"), "{message}");
    assert!(!message.contains("pw@"), "{message}");
}

/// Issue 20 §9: `redacted_url` hides every password form a store URL can carry.
#[test]
fn s20_9_redacted_urls_keep_everything_but_the_password() {
    use tower_idempotency::AnyStore;
    for (url, want) in [
        ("postgres://u:p@h/db", "postgres://u:***@h/db"),
        (
            "postgres://u:p%40ss@h:5432/db",
            "postgres://u:***@h:5432/db",
        ),
        ("postgres://u:a@b@h/db", "postgres://u:***@h/db"),
        ("postgres://u@h/db", "postgres://u@h/db"),
        (
            "postgres://h/db?user=u&PASSWORD=p",
            "postgres://h/db?user=u&PASSWORD=***",
        ),
        (
            "postgresql://u:p@h/db?sslmode=require",
            "postgresql://u:***@h/db?sslmode=require",
        ),
        ("sqlite://data/x.db", "sqlite://data/x.db"),
        ("sqlite::memory:", "sqlite::memory:"),
        // Generated passwords hold `/`, `?` and `@` unencoded.
        ("postgres://u:pa/ss@h/db", "postgres://u:***@h/db"),
        ("postgres://u:p?ss@h/db", "postgres://u:***@h/db"),
        (
            "postgres://u:a/b?c@d@h:5432/db?sslmode=require",
            "postgres://u:***@h:5432/db?sslmode=require",
        ),
        ("postgres://:pass@h/db", "postgres://:***@h/db"),
        (
            "postgres://h/db?pass%77ord=secret",
            "postgres://h/db?pass%77ord=***",
        ),
        ("memory://", "memory://"),
    ] {
        assert_eq!(AnyStore::redacted_url(url), want, "{url}");
    }
}

/// Issue 20 §9: `sqlite::memory:` keeps its database when the pool's connections close (sqlx
/// closes idle ones after 10 minutes; an in-memory database dies with its last connection).
#[tokio::test]
async fn s20_9_an_in_memory_sqlite_store_outlives_its_pool_connections() {
    use tower_idempotency::AnyStore;
    use tower_idempotency::store::SqliteStore;
    let store = SqliteStore::connect("sqlite::memory:").await.expect("open");
    store.migrate().await.expect("migrate");
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/t",
            post(move || async move { format!("effect {}", sink.hit()) }),
        )
        .route_layer(IdempotencyLayer::new(store.clone()).single_tenant());
    let addr = serve(app).await;
    assert_eq!(
        post_key(addr, "/t", Some("k")).await.status(),
        StatusCode::OK
    );
    // Close every connection the pool holds, as its idle reaper would.
    for _ in 0..store.pool().size() {
        let connection = store.pool().acquire().await.expect("acquire");
        sqlx::pool::PoolConnection::close(connection)
            .await
            .expect("close");
    }
    let replay = post_key(addr, "/t", Some("k")).await;
    assert_eq!(replay.status(), StatusCode::OK, "the table is still there");
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(effects.count(), 1);
    // And through AnyStore, as the quickstart opens it.
    assert!(matches!(
        AnyStore::connect("sqlite::memory:").await,
        Ok(AnyStore::Sqlite(_))
    ));
}

/// Issue 20 §9: a custom canonicaliser that panics is the server's bug: 500
/// `fingerprint-failed` (as a panicking handler is answered), the handler never runs, the key
/// is not taken, and the server keeps serving; other media types are unaffected.
#[tokio::test]
async fn s20_9_a_panicking_canonicaliser_answers_500_and_runs_nothing() {
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/t",
            post(move || async move { format!("effect {}", sink.hit()) }),
        )
        .route_layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .canonicalize("application/cbor", |_: &[u8]| -> Result<Vec<u8>, _> {
                    panic!("a bug in the application's canonicaliser")
                }),
        );
    let addr = serve(app).await;
    let client = client();
    let send = |ct: &'static str, key: &'static str| {
        client
            .post(format!("http://{addr}/t"))
            .header("content-type", ct)
            .header("idempotency-key", key)
            .body("\u{a1}")
            .send()
    };
    for _ in 0..2 {
        let res = send("application/cbor", "k")
            .await
            .expect("an answer, not a dropped connection");
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = problem(res).await;
        assert_eq!(body["type"], problem_type("fingerprint-failed"));
        assert_eq!(
            body["safe_new_key"], true,
            "nothing ran, nothing was claimed"
        );
    }
    assert_eq!(effects.count(), 0);
    // The server still serves, and the same key is free for a request it can fingerprint.
    let res = send("application/octet-stream", "k").await.expect("answer");
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(effects.count(), 1);
}

/// Issue 20 §5: `for_path` takes axum's route templates. Behind a Router a request gets the
/// settings of the route axum matched (a literal route beside a `{id}` template keeps the
/// defaults); in a nested router the template is the full one.
#[tokio::test]
async fn s20_5_for_path_matches_the_route_axum_matched() {
    let effects = Effects::default();
    let handler = |sink: Effects| post(move || async move { format!("effect {}", sink.hit()) });
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .single_tenant()
        .require_key(false)
        .for_path("/accounts/{id}/charge", |r| r.require_key(true))
        .for_path("/eu/orders/{*rest}", |r| r.require_key(true));
    let app = Router::new()
        .route("/accounts/{id}/charge", handler(effects.clone()))
        .route("/accounts/special/charge", handler(effects.clone()))
        .nest(
            "/eu",
            Router::new().route("/orders/{*rest}", handler(effects.clone())),
        )
        .layer(layer);
    let addr = serve(app).await;
    for path in [
        "/accounts/42/charge",
        "/accounts/x-7/charge",
        "/eu/orders/1/lines",
    ] {
        let res = post_key(addr, path, None).await;
        assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{path}");
        assert_eq!(
            problem(res).await["type"],
            problem_type("key-missing"),
            "{path}"
        );
    }
    assert_eq!(effects.count(), 0);
    // axum routed this one to its own literal route: the template's settings do not apply.
    let res = post_key(addr, "/accounts/special/charge", None).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(effects.count(), 1);
    // And a keyed call to a template route is guarded as usual.
    for _ in 0..2 {
        let res = post_key(addr, "/accounts/42/charge", Some("k")).await;
        assert_eq!(res.status(), StatusCode::OK);
    }
    assert_eq!(effects.count(), 2);
}

/// Issue 20 §5: without axum's `MatchedPath` (tonic, plain tower) templates match by axum's
/// rules: a literal segment before a parameter, a parameter before a wildcard.
#[tokio::test]
async fn s20_5_templates_match_plain_tower_services_by_axums_rules() {
    use tower::{Layer, ServiceExt};
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .single_tenant()
        .require_key(false)
        .for_path("/a/{id}", |r| r.require_key(true))
        .for_path("/a/free", |r| r.require_key(false))
        .for_path("/files/{*path}", |r| r.require_key(true));
    let service = layer.layer(tower::service_fn(|_req: http::Request<_>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::from("ran")))
    }));
    let status = |path: &'static str| {
        let service = service.clone();
        async move {
            let req = http::Request::post(path)
                .body(axum::body::Body::from("{}"))
                .expect("request");
            service.oneshot(req).await.expect("infallible").status()
        }
    };
    assert_eq!(status("/a/1").await, StatusCode::BAD_REQUEST);
    assert_eq!(status("/a/free").await, StatusCode::OK);
    assert_eq!(
        status("/a/1/more").await,
        StatusCode::OK,
        "a parameter is one segment"
    );
    assert_eq!(status("/files/x/y/z").await, StatusCode::BAD_REQUEST);
    assert_eq!(status("/other").await, StatusCode::OK);
}

/// Issue 20 §5: a `for_path` that could never match a request is refused while the layer is
/// built, saying why, as axum refuses a bad route.
#[test]
fn s20_5_a_path_that_can_never_match_is_refused() {
    let cases: [(&[&str], &str); 8] = [
        (&["tools/search"], "always starts with '/'"),
        (&["/t/café"], "percent-encoded"),
        (&["/a/{id}/{id}"], "appears twice"),
        (&["/charge?currency=eur"], "no query"),
        (&["/charge "], "no spaces"),
        (&["/a/{id"], "not a route axum could match"),
        (&["/a/{x}", "/a/{y}"], "not a route axum could match"),
        (&["/a/{*rest}/b"], "not a route axum could match"),
    ];
    for (paths, why) in cases {
        let built = std::panic::catch_unwind(|| {
            paths
                .iter()
                .fold(IdempotencyLayer::new(MemoryStore::new()), |layer, path| {
                    layer.for_path(*path, |r| r)
                })
        });
        let message = built
            .err()
            .and_then(|p| p.downcast::<String>().ok())
            .unwrap_or_else(|| panic!("{paths:?} was accepted"));
        assert!(message.contains(why), "{paths:?}: {message}");
        assert!(message.contains(paths[paths.len() - 1]), "{message}");
    }
}

/// Issue 20 §5, as a reviewer broke it: behind a Router the route axum matched picks the
/// settings whatever its parameters are called; a literal `for_path` beats a template; under a
/// catch-all mount (tonic's `/{Service}/{*rest}`, `nest_service`) the rest of the path is
/// matched against the templates.
#[tokio::test]
async fn s20_5_the_route_axum_matched_picks_settings_by_shape_literal_first() {
    let effects = Effects::default();
    let handler = |sink: Effects| post(move || async move { format!("effect {}", sink.hit()) });
    let guarded_service = |sink: Effects| {
        tower::ServiceBuilder::new()
            .layer(
                IdempotencyLayer::new(MemoryStore::new())
                    .single_tenant()
                    .require_key(false)
                    .for_path("/tickets.Tickets/{method}", |r| r.require_key(true)),
            )
            .service(handler(sink))
    };
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .single_tenant()
        .require_key(false)
        // Another name than the app's `{id}`: the same route.
        .for_path("/accounts/{account}/charge", |r| r.require_key(true))
        // A literal beside a template: the literal is more specific.
        .for_path("/orders/{id}", |r| r.require_key(true))
        .for_path("/orders/7", |r| r.require_key(false));
    let app = Router::new()
        .route("/accounts/{id}/charge", handler(effects.clone()))
        .route("/orders/{id}", handler(effects.clone()))
        .layer(layer)
        // A per-service mount, as tonic registers each service.
        .route_service("/tickets.Tickets/{*rest}", guarded_service(effects.clone()));
    let addr = serve(app).await;
    for (path, want) in [
        ("/accounts/42/charge", StatusCode::BAD_REQUEST),
        ("/orders/8", StatusCode::BAD_REQUEST),
        ("/orders/7", StatusCode::OK),
        ("/tickets.Tickets/CreateTicket", StatusCode::BAD_REQUEST),
    ] {
        assert_eq!(post_key(addr, path, None).await.status(), want, "{path}");
    }
}
