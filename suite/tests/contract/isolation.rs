//! Issue 16: scope by principal, fingerprints that never merge two different requests, the
//! request as the client sent it, outcomes classified right. Over real sockets, effects counted
//! at the sink.

use crate::common;

use std::net::SocketAddr;

use axum::Router;
use axum::extract::Request;
use axum::http::{HeaderName, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::{Effects, client, problem, problem_type, serve};
use tower_idempotency::{IdempotencyLayer, MemoryStore};

/// The caller, as an app's auth layer knows it.
#[derive(Clone)]
struct User(String);

/// A route that makes one effect per run and says whose it was.
fn charge(effects: &Effects) -> Router {
    let effects = effects.clone();
    Router::new().route(
        "/charge",
        post(move |req: Request| async move {
            let who = req
                .extensions()
                .get::<User>()
                .map_or("nobody".to_owned(), |u| u.0.clone());
            let n = effects.hit();
            (StatusCode::CREATED, format!("charge {n} for {who}"))
        }),
    )
}

async fn send(
    addr: SocketAddr,
    path: &str,
    key: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> reqwest::Response {
    let mut req = client()
        .post(format!("http://{addr}{path}"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned());
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    req.send().await.expect("request")
}

// ---- 1. The scope is the caller's identity ----------------------------------------------------

/// A cookie-session app: the session cookie names the user.
async fn session_auth(mut req: Request, next: Next) -> Response {
    let user = req
        .headers()
        .get("cookie")
        .and_then(|v| v.to_str().ok())
        .and_then(|c| c.strip_prefix("session="))
        .map(|s| User(format!("user-of-{s}")));
    match user {
        Some(user) => {
            req.extensions_mut().insert(user);
            next.run(req).await
        }
        None => StatusCode::UNAUTHORIZED.into_response(),
    }
}

#[tokio::test]
async fn s16_1_a_cookie_session_app_never_replays_across_callers() {
    let effects = Effects::default();
    let app = charge(&effects)
        .route_layer(
            IdempotencyLayer::new(MemoryStore::new()).scope_by_principal(|u: &User| u.0.clone()),
        )
        .route_layer(middleware::from_fn(session_auth));
    let addr = serve(app).await;
    let alice = send(addr, "/charge", "k", &[("cookie", "session=alice")], "{}").await;
    let alice = alice.text().await.expect("body");
    let bob = send(addr, "/charge", "k", &[("cookie", "session=bob")], "{}").await;
    assert!(bob.headers().get("idempotency-replayed").is_none());
    assert_eq!(bob.text().await.expect("body"), "charge 2 for user-of-bob");
    let again = send(addr, "/charge", "k", &[("cookie", "session=alice")], "{}").await;
    assert_eq!(again.headers()["idempotency-replayed"], "true");
    assert_eq!(again.text().await.expect("body"), alice);
    assert_eq!(effects.count(), 2, "one charge per caller");
}

#[tokio::test]
async fn s16_1_an_api_key_app_never_replays_across_callers() {
    let effects = Effects::default();
    let app = charge(&effects).route_layer(
        IdempotencyLayer::new(MemoryStore::new())
            .scope_by_header(HeaderName::from_static("x-api-key")),
    );
    let addr = serve(app).await;
    let first = send(addr, "/charge", "k", &[("x-api-key", "key-a")], "{}").await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let other = send(addr, "/charge", "k", &[("x-api-key", "key-b")], "{}").await;
    assert!(other.headers().get("idempotency-replayed").is_none());
    assert_eq!(other.status(), StatusCode::CREATED);
    let again = send(addr, "/charge", "k", &[("x-api-key", "key-a")], "{}").await;
    assert_eq!(again.headers()["idempotency-replayed"], "true");
    assert_eq!(effects.count(), 2);
    // Without the header the app is wired wrong (its key check did not run): 500, nothing runs.
    let missing = send(addr, "/charge", "k", &[], "{}").await;
    assert_eq!(missing.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        problem(missing).await["type"],
        problem_type("scope-missing")
    );
    assert_eq!(effects.count(), 2);
}

/// Tokens rotate; the principal they authenticate does not.
async fn bearer_auth(mut req: Request, next: Next) -> Response {
    let token = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let user = match token {
        "Bearer monday-token" | "Bearer tuesday-token" => User("alice".into()),
        _ => return StatusCode::UNAUTHORIZED.into_response(),
    };
    req.extensions_mut().insert(user);
    next.run(req).await
}

#[tokio::test]
async fn s16_1_a_rotated_bearer_token_still_replays_with_principal_scope() {
    let effects = Effects::default();
    let app = charge(&effects)
        .route_layer(
            IdempotencyLayer::new(MemoryStore::new()).scope_by_principal(|u: &User| u.0.clone()),
        )
        .route_layer(middleware::from_fn(bearer_auth));
    let addr = serve(app).await;
    let monday = [("authorization", "Bearer monday-token")];
    let tuesday = [("authorization", "Bearer tuesday-token")];
    let first = send(addr, "/charge", "k", &monday, "{}").await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let retry = send(addr, "/charge", "k", &tuesday, "{}").await;
    assert_eq!(retry.headers()["idempotency-replayed"], "true");
    assert_eq!(effects.count(), 1, "the refreshed token is the same caller");
}

#[tokio::test]
async fn s16_1_a_credential_hash_scope_runs_again_on_rotation_as_documented() {
    let effects = Effects::default();
    let app = charge(&effects)
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).scope_by_credential_hash());
    let addr = serve(app).await;
    send(addr, "/charge", "k", &[("authorization", "Bearer a")], "{}").await;
    let rotated = send(addr, "/charge", "k", &[("authorization", "Bearer b")], "{}").await;
    assert!(rotated.headers().get("idempotency-replayed").is_none());
    assert_eq!(
        effects.count(),
        2,
        "why the principal scope is the one to use"
    );
    let none = send(addr, "/charge", "k", &[], "{}").await;
    assert_eq!(
        none.status(),
        StatusCode::INTERNAL_SERVER_ERROR,
        "never a shared empty scope"
    );
}

/// The auth layer was forgotten (or runs after the idempotency layer): the server's fault.
#[tokio::test]
async fn s16_1_a_missing_principal_is_a_server_error_and_nothing_runs() {
    let effects = Effects::default();
    let app = charge(&effects).route_layer(
        IdempotencyLayer::new(MemoryStore::new()).scope_by_principal(|u: &User| u.0.clone()),
    );
    let addr = serve(app).await;
    let res = send(addr, "/charge", "k", &[], "{}").await;
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let p = problem(res).await;
    assert_eq!(p["type"], problem_type("scope-missing"));
    assert!(
        p["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("authenticated principal"),
        "{p}"
    );
    assert_eq!(effects.count(), 0);
}

// ---- 2. Two different requests never share a fingerprint -------------------------------------

/// Each pair: the same key with two bodies that differ as data. The second must be refused 422,
/// never answered with the first one's replay.
#[tokio::test]
async fn s16_2_bodies_that_differ_as_data_never_replay_each_other() {
    let effects = Effects::default();
    let app =
        charge(&effects).route_layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    let cases: [(&str, &str, &str); 7] = [
        (
            "application/x-www-form-urlencoded",
            "name=caf%E9",
            "name=caf%E8",
        ),
        ("application/x-www-form-urlencoded", "name=%FF", "name=%FE"),
        (
            "application/json",
            r#"{"amount":9007199254740993}"#,
            r#"{"amount":9007199254740992}"#,
        ),
        (
            "application/json",
            r#"{"amount":18446744073709551616}"#,
            r#"{"amount":18446744073709551617}"#,
        ),
        (
            "application/json",
            r#"{"amount":1e-400}"#,
            r#"{"amount":0}"#,
        ),
        ("text/plain; charset=latin1", "caf\u{e9}", "caf\u{e9}"),
        ("text/csv; header=present", "a,b", "a,b"),
    ];
    for (i, (content_type, first, second)) in cases.into_iter().enumerate() {
        let key = format!("exact-{i}");
        let res = client()
            .post(format!("http://{addr}/charge"))
            .header("idempotency-key", &key)
            .header("content-type", content_type)
            .body(first)
            .send()
            .await
            .expect("first");
        assert_eq!(res.status(), StatusCode::CREATED, "{content_type} {first}");
        // The same body under another content type, for the media-parameter cases.
        let second_type = if content_type.starts_with("text/") {
            content_type.split(';').next().unwrap_or_default()
        } else {
            content_type
        };
        let res = client()
            .post(format!("http://{addr}/charge"))
            .header("idempotency-key", &key)
            .header("content-type", second_type)
            .body(second)
            .send()
            .await
            .expect("second");
        assert_eq!(
            res.status(),
            StatusCode::UNPROCESSABLE_ENTITY,
            "{content_type} {first} vs {second_type} {second}"
        );
    }
    assert_eq!(effects.count(), 7);
}

#[tokio::test]
async fn s16_2_a_key_list_is_two_keys() {
    let effects = Effects::default();
    let app =
        charge(&effects).route_layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    for key in ["a,b", "a, b", r#""a", "b""#] {
        let res = send(addr, "/charge", key, &[], "{}").await;
        assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{key}");
        assert_eq!(problem(res).await["type"], problem_type("key-invalid"));
    }
    assert_eq!(effects.count(), 0);
}

// ---- 3. The request is the one the client sent ------------------------------------------------

#[tokio::test]
async fn s16_3_nested_routers_fingerprint_and_configure_the_full_path() {
    let effects = Effects::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .single_tenant()
        .for_path("/eu/charge", |route| route.require_key(false));
    let inner = charge(&effects).route_layer(layer);
    let app = Router::new()
        .nest("/eu", inner.clone())
        .nest("/us", inner.clone())
        .nest("/tenants/{tenant}", inner);
    let addr = serve(app).await;
    let eu = send(addr, "/eu/charge", "k", &[], "{}").await;
    assert_eq!(eu.status(), StatusCode::CREATED);
    let us = send(addr, "/us/charge", "k", &[], "{}").await;
    assert!(
        us.headers().get("idempotency-replayed").is_none(),
        "the US call runs"
    );
    assert_eq!(
        us.status(),
        StatusCode::UNPROCESSABLE_ENTITY,
        "or is refused, never replayed EU's"
    );
    let a = send(addr, "/tenants/a/charge", "t", &[], "{}").await;
    assert_eq!(a.status(), StatusCode::CREATED);
    let b = send(addr, "/tenants/b/charge", "t", &[], "{}").await;
    assert_ne!(
        b.headers()
            .get("idempotency-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    // `for_path` sees the full path: /eu/charge lets a keyless request through, /us does not.
    let keyless = |path: &'static str| async move {
        client()
            .post(format!("http://{addr}{path}"))
            .body("{}")
            .send()
            .await
            .expect("request")
            .status()
    };
    assert_eq!(keyless("/eu/charge").await, StatusCode::CREATED);
    assert_eq!(keyless("/us/charge").await, StatusCode::BAD_REQUEST);
    assert_eq!(
        effects.count(),
        3,
        "EU once, tenant a once, the keyless EU call once"
    );
}

#[tokio::test]
async fn s16_3_fingerprint_headers_are_compared_as_field_values() {
    let effects = Effects::default();
    let app = charge(&effects).route_layer(
        IdempotencyLayer::new(MemoryStore::new())
            .single_tenant()
            .fingerprint_header(HeaderName::from_static("x-features")),
    );
    let addr = serve(app).await;
    let first = send(addr, "/charge", "k", &[("x-features", "a, b")], "{}").await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let split = send(
        addr,
        "/charge",
        "k",
        &[("x-features", "a"), ("x-features", "b")],
        "{}",
    )
    .await;
    assert_eq!(
        split.headers()["idempotency-replayed"],
        "true",
        "not a false 422"
    );
    let tight = send(addr, "/charge", "k", &[("x-features", "a,b")], "{}").await;
    assert_eq!(tight.headers()["idempotency-replayed"], "true");
    let other = send(addr, "/charge", "k", &[("x-features", "a, c")], "{}").await;
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(effects.count(), 1);
}

// ---- 4. Outcomes classified right -------------------------------------------------------------

#[tokio::test]
async fn s16_4_a_redirect_is_definitive_and_replayed() {
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/orders",
            post(move || async move {
                let n = sink.hit();
                (
                    StatusCode::SEE_OTHER,
                    [("location", format!("/orders/{n}"))],
                )
            }),
        )
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    let no_redirects = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client");
    for i in 0..3 {
        let res = no_redirects
            .post(format!("http://{addr}/orders"))
            .header("idempotency-key", "order-1")
            .body("{}")
            .send()
            .await
            .expect("request");
        assert_eq!(res.status(), StatusCode::SEE_OTHER);
        assert_eq!(res.headers()["location"], "/orders/1");
        assert_eq!(res.headers().get("idempotency-replayed").is_some(), i > 0);
    }
    assert_eq!(effects.count(), 1, "one order for one key");
}

#[tokio::test]
async fn s16_4_hop_by_hop_headers_are_never_replayed() {
    let effects = Effects::default();
    let sink = effects.clone();
    let app = Router::new()
        .route(
            "/hop",
            post(move || async move {
                sink.hit();
                (
                    [
                        ("connection", "x-hop"),
                        ("x-hop", "for this connection only"),
                        ("x-kept", "yes"),
                    ],
                    "ok",
                )
            }),
        )
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    let first = send(addr, "/hop", "h", &[], "{}").await;
    assert_eq!(first.status(), StatusCode::OK);
    let replay = send(addr, "/hop", "h", &[], "{}").await;
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(replay.headers()["x-kept"], "yes");
    assert!(
        replay.headers().get("x-hop").is_none(),
        "named in Connection: this hop only"
    );
    assert_eq!(effects.count(), 1);
}

/// The most requested fingerprint feature: a route counts all of its JSON body but a client
/// timestamp. Retries whose timestamp changed replay; a changed amount is another operation.
#[tokio::test]
async fn s16_2_a_route_may_leave_a_json_field_out_of_its_fingerprint() {
    let effects = Effects::default();
    let fields = tower_idempotency::fingerprint::JsonFields::exclude(["/client_ts"])
        .expect("RFC 6901 pointers");
    let app = charge(&effects).route_layer(
        IdempotencyLayer::new(MemoryStore::new())
            .single_tenant()
            .defaults(|route| route.fingerprint_json(fields)),
    );
    let addr = serve(app).await;
    let first = send(addr, "/charge", "k", &[], r#"{"amount":10,"client_ts":1}"#).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let retry = send(
        addr,
        "/charge",
        "k",
        &[],
        r#"{"client_ts":2,"amount":10.0}"#,
    )
    .await;
    assert_eq!(retry.headers()["idempotency-replayed"], "true");
    let other = send(addr, "/charge", "k", &[], r#"{"amount":11,"client_ts":1}"#).await;
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let exact = send(addr, "/charge", "x", &[], r#"{"amount":9007199254740993}"#).await;
    assert_eq!(exact.status(), StatusCode::CREATED);
    let near = send(addr, "/charge", "x", &[], r#"{"amount":9007199254740992}"#).await;
    assert_eq!(
        near.status(),
        StatusCode::UNPROCESSABLE_ENTITY,
        "exact, as a whole body is"
    );
    assert_eq!(effects.count(), 2);
}

/// Issue 16 §4: 307 and 308 ask the client to send the same request again elsewhere: nothing
/// was done here, so the key is released, not answered with the redirect forever. The request
/// at the new URI is another request: under the same key it is refused (422), as any other
/// reuse of a key is.
#[tokio::test]
async fn s16_4_a_307_is_not_recorded() {
    let effects = Effects::default();
    let (moved, sink) = (effects.clone(), effects.clone());
    let app = Router::new()
        .route(
            "/v1/charge",
            post(move || async move {
                moved.hit();
                (StatusCode::TEMPORARY_REDIRECT, [("location", "/v2/charge")])
            }),
        )
        .route(
            "/v2/charge",
            post(move || async move {
                sink.hit();
                StatusCode::CREATED
            }),
        )
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    let no_redirects = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client");
    for _ in 0..2 {
        let res = no_redirects
            .post(format!("http://{addr}/v1/charge"))
            .header("idempotency-key", "k-307")
            .body("{}")
            .send()
            .await
            .expect("request");
        assert_eq!(res.status(), StatusCode::TEMPORARY_REDIRECT);
        assert!(
            res.headers().get("idempotency-replayed").is_none(),
            "released, not replayed"
        );
    }
    assert_eq!(
        effects.count(),
        2,
        "each retry of the redirecting request ran"
    );
    let moved = send(addr, "/v2/charge", "k-307", &[], "{}").await;
    assert_eq!(
        moved.status(),
        StatusCode::UNPROCESSABLE_ENTITY,
        "another request, another key"
    );
    assert_eq!(effects.count(), 2);
}

/// DESIGN §1 step 2 (callers must never fall into one shared scope): a `scope_with` closure
/// that falls back to `""` when the request lacks what it reads (a tenant header, read with
/// `unwrap_or_default()`) gives no scope, as an empty principal id does: 500 `scope-missing`,
/// nothing runs. Before, every such caller shared the scope `custom:`, and the second was
/// replayed the first's answer. A closure returning `Some("")` is refused alike; a tenant that
/// is there still runs once and replays its own.
#[tokio::test]
async fn s16_1_an_empty_scope_from_a_closure_is_no_scope() {
    let effects = Effects::default();
    let by_tenant = |parts: &http::request::Parts| {
        parts
            .headers
            .get("x-tenant")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let optional = |parts: &http::request::Parts| {
        Some(
            parts
                .headers
                .get("x-tenant")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned(),
        )
    };
    let app = charge(&effects)
        .layer(IdempotencyLayer::new(MemoryStore::new()).scope_with(by_tenant))
        .merge(
            Router::new()
                .nest("/opt", charge(&effects))
                .layer(IdempotencyLayer::new(MemoryStore::new()).scope_with(optional)),
        );
    let addr = serve(app).await;
    for path in ["/charge", "/opt/charge"] {
        for _caller in ["a", "b"] {
            let res = send(addr, path, "shared-key", &[], r#"{"amount":1}"#).await;
            assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR, "{path}");
            let body = problem(res).await;
            assert_eq!(body["type"], problem_type("scope-missing"), "{path}");
        }
        let tenant = [("x-tenant", "t1")];
        let first = send(addr, path, "shared-key", &tenant, r#"{"amount":1}"#).await;
        assert_eq!(first.status(), StatusCode::CREATED, "{path}");
        let again = send(addr, path, "shared-key", &tenant, r#"{"amount":1}"#).await;
        assert_eq!(again.headers()["idempotency-replayed"], "true", "{path}");
    }
    assert_eq!(
        effects.count(),
        2,
        "one run per route, for the tenant that is there"
    );
}
