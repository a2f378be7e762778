//! DESIGN §7 over real sockets: an axum server on 127.0.0.1:0, a real HTTP client, effects
//! counted in the handler.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use common::{Effects, FlakyStore, TestClock, client, problem, problem_type, serve};
use serde_json::{Value, json};
use tokio::sync::{Barrier, Notify};
use tower_idempotency::store::{Claim, ClaimRequest, RecordStatus, ScopedKey};
use tower_idempotency::{
    IdempotencyContext, IdempotencyLayer, IdempotencyStore, LeaseExpiry, MalformedBody, MemoryStore,
};

/// A ticket endpoint: counts one effect per execution and answers 201 with the ticket number.
fn tickets(effects: Effects, delay: Duration) -> Router {
    Router::new().route(
        "/tickets",
        post(move |ctx: IdempotencyContext, body: String| async move {
            tokio::time::sleep(delay).await;
            let n = effects.hit();
            (
                StatusCode::CREATED,
                [("location", format!("/tickets/{n}"))],
                axum::Json(json!({ "ticket": n, "attempt": ctx.attempt(), "request": body })),
            )
        }),
    )
}

async fn post_ticket(addr: std::net::SocketAddr, key: &str, body: &str) -> reqwest::Response {
    client()
        .post(format!("http://{addr}/tickets"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .expect("request")
}

/// Retries until the key's outcome is recorded: every answer before is a 409, none a rerun.
async fn await_replay(
    addr: std::net::SocketAddr,
    path: &str,
    key: &str,
    body: &'static str,
) -> reqwest::Response {
    for _ in 0..250 {
        let res = client()
            .post(format!("http://{addr}{path}"))
            .header("idempotency-key", key)
            .body(body)
            .send()
            .await
            .expect("retry");
        if res.status() != StatusCode::CONFLICT {
            return res;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the outcome of {key} was never recorded");
}

#[tokio::test]
async fn s7_1_same_key_twice_runs_once_and_replays_identical_bytes() {
    let effects = Effects::default();
    let app = tickets(effects.clone(), Duration::ZERO)
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;

    let first = post_ticket(addr, "k-1", r#"{"title":"printer on fire"}"#).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(first.headers().get("idempotency-replayed").is_none());
    let first_body = first.bytes().await.expect("body");

    let second = post_ticket(addr, "k-1", r#"{"title":"printer on fire"}"#).await;
    assert_eq!(second.status(), StatusCode::CREATED);
    assert_eq!(second.headers()["idempotency-replayed"], "true");
    assert_eq!(second.headers()["location"], "/tickets/1");
    assert_eq!(second.bytes().await.expect("body"), first_body);

    assert_eq!(effects.count(), 1, "the business counter advanced once");
}

#[tokio::test]
async fn s7_2_changed_body_is_422_and_reordered_json_replays() {
    let effects = Effects::default();
    let app = tickets(effects.clone(), Duration::ZERO)
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;

    let first = post_ticket(addr, "k-2", r#"{"title":"a","priority":1}"#).await;
    assert_eq!(first.status(), StatusCode::CREATED);

    let changed = post_ticket(addr, "k-2", r#"{"title":"a","priority":2}"#).await;
    assert_eq!(changed.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let p = problem(changed).await;
    assert_eq!(p["type"], problem_type("fingerprint-mismatch"));
    assert_eq!(p["state"], "completed");
    assert_eq!(p["safe_new_key"], true);

    let reordered = post_ticket(addr, "k-2", "{ \"priority\" : 1,\n \"title\": \"a\" }").await;
    assert_eq!(reordered.status(), StatusCode::CREATED);
    assert_eq!(reordered.headers()["idempotency-replayed"], "true");

    assert_eq!(effects.count(), 1);
}

#[tokio::test]
async fn s7_3_concurrent_burst_on_separate_connections_has_one_effect() {
    const N: usize = 32;
    let effects = Effects::default();
    let app = tickets(effects.clone(), Duration::from_millis(200))
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;

    let barrier = Arc::new(Barrier::new(N));
    let mut tasks = Vec::new();
    for _ in 0..N {
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            let request = client()
                .post(format!("http://{addr}/tickets"))
                .header("idempotency-key", "burst")
                .header("content-type", "application/json")
                .body(r#"{"title":"burst"}"#);
            barrier.wait().await;
            let res = request.send().await.expect("request");
            let status = res.status();
            let replayed = res.headers().get("idempotency-replayed").is_some();
            let retry_after = res.headers().get("retry-after").is_some();
            (status, replayed, retry_after)
        }));
    }
    let mut executed = 0;
    let mut conflicts = 0;
    let mut replays = 0;
    for task in tasks {
        match task.await.expect("task") {
            (StatusCode::CREATED, false, _) => executed += 1,
            (StatusCode::CREATED, true, _) => replays += 1,
            (StatusCode::CONFLICT, _, true) => conflicts += 1,
            other => panic!("unexpected answer {other:?}"),
        }
    }
    assert_eq!(executed, 1, "exactly one request ran the handler");
    assert_eq!(executed + conflicts + replays, N);
    assert_eq!(effects.count(), 1, "exactly one effect at the sink");
}

#[tokio::test]
async fn s7_4_key_executes_again_after_ttl_or_deletion() {
    let effects = Effects::default();
    let clock = TestClock::default();
    let store = clock.store();
    let layer = IdempotencyLayer::new(store.clone())
        .single_tenant()
        .ttl(Duration::from_secs(60));
    let addr = serve(tickets(effects.clone(), Duration::ZERO).layer(layer)).await;

    assert_eq!(
        post_ticket(addr, "k-4", "{}").await.status(),
        StatusCode::CREATED
    );
    let replay = post_ticket(addr, "k-4", "{}").await;
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(effects.count(), 1);

    clock.advance(Duration::from_secs(61));
    let after_ttl = post_ticket(addr, "k-4", "{}").await;
    assert!(after_ttl.headers().get("idempotency-replayed").is_none());
    assert_eq!(effects.count(), 2, "an expired record counts as absent");
    // And the purge reclaims its memory: nothing is expired right now, then everything is.
    assert_eq!(store.purge_expired().await.expect("purge"), 0);
    clock.advance(Duration::from_secs(61));
    assert_eq!(store.purge_expired().await.expect("purge"), 1);
    assert!(store.is_empty());

    assert_eq!(
        post_ticket(addr, "k-4b", "{}").await.status(),
        StatusCode::CREATED
    );
    assert!(
        store
            .remove(&ScopedKey::new("", "k-4b"))
            .await
            .expect("remove")
    );
    let after_delete = post_ticket(addr, "k-4b", "{}").await;
    assert!(after_delete.headers().get("idempotency-replayed").is_none());
    assert_eq!(effects.count(), 4);
}

#[tokio::test]
async fn s7_5_retry_during_processing_gets_409_then_the_replay() {
    let effects = Effects::default();
    let release = Arc::new(Notify::new());
    let gate = release.clone();
    let counter = effects.clone();
    let app = Router::new()
        .route(
            "/charge",
            post(move || async move {
                gate.notified().await;
                format!("charge {}", counter.hit())
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;

    // The client gives up long before the handler is done.
    let timed_out = client()
        .post(format!("http://{addr}/charge"))
        .header("idempotency-key", "k-5")
        .timeout(Duration::from_millis(200))
        .body("amount=10")
        .send()
        .await;
    assert!(timed_out.is_err(), "the first call must time out");

    let retry = client()
        .post(format!("http://{addr}/charge"))
        .header("idempotency-key", "k-5")
        .body("amount=10")
        .send()
        .await
        .expect("retry");
    assert_eq!(retry.status(), StatusCode::CONFLICT);
    let seconds: u64 = retry.headers()["retry-after"]
        .to_str()
        .expect("ascii")
        .parse()
        .expect("seconds");
    assert!(
        (1..=30).contains(&seconds),
        "Retry-After is the remaining lease: {seconds}"
    );
    let p = problem(retry).await;
    assert_eq!(p["type"], problem_type("in-flight"));
    assert_eq!(p["safe_new_key"], false);
    assert_eq!(
        effects.count(),
        0,
        "nothing ran twice, nothing finished yet"
    );

    release.notify_one();
    // The handler finishes on its own; poll until its outcome is recorded.
    let replay = await_replay(addr, "/charge", "k-5", "amount=10").await;
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(replay.text().await.expect("body"), "charge 1");
    assert_eq!(effects.count(), 1);
}

#[tokio::test]
async fn client_disconnect_mid_handler_still_records_one_effect() {
    let effects = Effects::default();
    let started = Arc::new(Notify::new());
    let finish = Arc::new(Notify::new());
    let (s, f, counter) = (started.clone(), finish.clone(), effects.clone());
    let app = Router::new()
        .route(
            "/send_email",
            post(move || async move {
                s.notify_one();
                f.notified().await;
                format!("email {}", counter.hit())
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;

    let request = client()
        .post(format!("http://{addr}/send_email"))
        .header("idempotency-key", "k-disconnect")
        .body("to=a@example.com")
        .send();
    let hung_up = tokio::spawn(request);
    started.notified().await;
    hung_up.abort(); // the client hangs up while the handler runs
    assert!(hung_up.await.is_err());
    finish.notify_one();

    let res = await_replay(addr, "/send_email", "k-disconnect", "to=a@example.com").await;
    assert_eq!(res.headers()["idempotency-replayed"], "true");
    assert_eq!(res.text().await.expect("body"), "email 1");
    assert_eq!(effects.count(), 1);
}

#[tokio::test]
async fn s7_10_store_down_fails_closed_and_recovers() {
    let effects = Effects::default();
    let store = FlakyStore::default();
    let addr = serve(
        tickets(effects.clone(), Duration::ZERO)
            .layer(IdempotencyLayer::new(store.clone()).single_tenant()),
    )
    .await;

    store.down.store(true, Ordering::SeqCst);
    for _ in 0..3 {
        let res = post_ticket(addr, "k-10", "{}").await;
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(res.headers()["retry-after"], "1");
        let p = problem(res).await;
        assert_eq!(p["type"], problem_type("store-unavailable"));
        assert_eq!(p["safe_new_key"], false);
    }
    assert_eq!(effects.count(), 0, "nothing runs while the store is down");

    store.down.store(false, Ordering::SeqCst);
    assert_eq!(
        post_ticket(addr, "k-10", "{}").await.status(),
        StatusCode::CREATED
    );
    let again = post_ticket(addr, "k-10", "{}").await;
    assert_eq!(again.headers()["idempotency-replayed"], "true");
    assert_eq!(effects.count(), 1, "after recovery the key runs once");
}

#[tokio::test]
async fn response_write_failure_leaves_the_key_unknown_never_rerun() {
    let effects = Effects::default();
    let store = FlakyStore::default();
    store.fail_complete.store(true, Ordering::SeqCst);
    let addr = serve(
        tickets(effects.clone(), Duration::ZERO)
            .layer(IdempotencyLayer::new(store.clone()).single_tenant()),
    )
    .await;

    let first = post_ticket(addr, "k-7", "{}").await;
    assert_eq!(
        first.status(),
        StatusCode::CREATED,
        "the client still gets the real answer"
    );
    store.fail_complete.store(false, Ordering::SeqCst);
    let retry = post_ticket(addr, "k-7", "{}").await;
    assert_eq!(retry.status(), StatusCode::CONFLICT);
    let p = problem(retry).await;
    assert_eq!(p["type"], problem_type("outcome-unknown"));
    assert_eq!(p["state"], "needs_reconciliation");
    assert_eq!(p["safe_new_key"], false);
    assert!(p.get("retry_after").is_none(), "no automatic retry hint");
    assert_eq!(effects.count(), 1);
}

/// A handler answering 500 on its first call and `status` afterwards.
fn flaky_handler(effects: Effects, then: StatusCode) -> Router {
    Router::new().route(
        "/jobs",
        post(move || async move {
            let n = effects.hit();
            let status = if n == 1 {
                StatusCode::INTERNAL_SERVER_ERROR
            } else {
                then
            };
            (status, format!("run {n}"))
        }),
    )
}

async fn post_job(addr: std::net::SocketAddr, key: &str) -> reqwest::Response {
    client()
        .post(format!("http://{addr}/jobs"))
        .header("idempotency-key", key)
        .body("job")
        .send()
        .await
        .expect("request")
}

#[tokio::test]
async fn definitive_only_releases_500_and_records_422() {
    let effects = Effects::default();
    let addr = serve(
        flaky_handler(effects.clone(), StatusCode::UNPROCESSABLE_ENTITY)
            .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant()),
    )
    .await;

    let first = post_job(addr, "k-500").await;
    assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let second = post_job(addr, "k-500").await;
    assert_eq!(
        second.status(),
        StatusCode::UNPROCESSABLE_ENTITY,
        "the 500 was not cached"
    );
    assert!(second.headers().get("idempotency-replayed").is_none());
    let third = post_job(addr, "k-500").await;
    assert_eq!(third.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        third.headers()["idempotency-replayed"],
        "true",
        "the 422 was cached"
    );
    assert_eq!(third.text().await.expect("body"), "run 2");
    assert_eq!(effects.count(), 2);
}

#[tokio::test]
async fn everything_policy_replays_the_500() {
    let effects = Effects::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .single_tenant()
        .cache_policy(tower_idempotency::CachePolicy::Everything);
    let addr = serve(flaky_handler(effects.clone(), StatusCode::OK).layer(layer)).await;

    assert_eq!(
        post_job(addr, "k-e").await.status(),
        StatusCode::INTERNAL_SERVER_ERROR
    );
    let retry = post_job(addr, "k-e").await;
    assert_eq!(retry.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(retry.headers()["idempotency-replayed"], "true");
    assert_eq!(retry.text().await.expect("body"), "run 1");
    assert_eq!(effects.count(), 1);
}

#[tokio::test]
async fn replay_keeps_status_location_and_repeated_headers_but_never_cookies() {
    let effects = Effects::default();
    let counter = effects.clone();
    let app = Router::new()
        .route(
            "/orders",
            post(move || async move {
                let n = counter.hit();
                let mut headers = HeaderMap::new();
                headers.insert("location", format!("/orders/{n}").parse().expect("value"));
                headers.append("link", "</a>; rel=a".parse().expect("value"));
                headers.append("link", "</b>; rel=b".parse().expect("value"));
                headers.insert("set-cookie", "session=secret".parse().expect("value"));
                headers.insert("etag", "\"v1\"".parse().expect("value"));
                (StatusCode::CREATED, headers, "created")
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    let send = || {
        client()
            .post(format!("http://{addr}/orders"))
            .header("idempotency-key", "k-fidelity")
            .send()
    };

    let first = send().await.expect("first");
    assert_eq!(
        first.headers()["set-cookie"],
        "session=secret",
        "the live response keeps its cookie"
    );
    let replay = send().await.expect("replay");
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(replay.headers()["location"], "/orders/1");
    assert_eq!(replay.headers()["etag"], "\"v1\"");
    let links: Vec<_> = replay.headers().get_all("link").iter().collect();
    assert_eq!(links, ["</a>; rel=a", "</b>; rel=b"]);
    assert!(
        replay.headers().get("set-cookie").is_none(),
        "Set-Cookie is never replayed"
    );
    assert_eq!(replay.text().await.expect("body"), "created");
    assert_eq!(effects.count(), 1);
}

#[tokio::test]
async fn two_scopes_with_one_key_never_see_each_other() {
    let effects = Effects::default();
    let addr = serve(
        tickets(effects.clone(), Duration::ZERO)
            .layer(IdempotencyLayer::new(MemoryStore::new()).scope_by_credential_hash()),
    )
    .await;
    let send = |token: &'static str, body: &'static str| {
        client()
            .post(format!("http://{addr}/tickets"))
            .header("authorization", format!("Bearer {token}"))
            .header("idempotency-key", "shared-key")
            .header("content-type", "application/json")
            .body(body)
            .send()
    };

    let alice: Value = send("alice", r#"{"who":"alice"}"#)
        .await
        .expect("a")
        .json()
        .await
        .expect("json");
    // Bob uses the same key with another body: in his own scope it is new, not a mismatch.
    let bob = send("bob", r#"{"who":"bob"}"#).await.expect("b");
    assert_eq!(bob.status(), StatusCode::CREATED);
    assert!(bob.headers().get("idempotency-replayed").is_none());
    let bob: Value = bob.json().await.expect("json");
    assert_ne!(alice["ticket"], bob["ticket"]);

    let alice_again: Value = send("alice", r#"{"who":"alice"}"#)
        .await
        .expect("a")
        .json()
        .await
        .expect("json");
    assert_eq!(alice_again, alice);
    assert_eq!(effects.count(), 2);
}

#[tokio::test]
async fn per_route_settings_on_one_router() {
    let effects = Effects::default();
    let e1 = effects.clone();
    let e2 = effects.clone();
    let app = Router::new()
        .route(
            "/strict",
            post(
                move || async move { (StatusCode::INTERNAL_SERVER_ERROR, format!("{}", e1.hit())) },
            ),
        )
        .route(
            "/search",
            post(move || async move { format!("{}", e2.hit()) }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .for_path("/strict", |r| {
                    r.cache_policy(tower_idempotency::CachePolicy::Everything)
                })
                .for_path("/search", |r| r.require_key(false)),
        );
    let addr = serve(app).await;

    // /strict records its 500 (Everything) ...
    for _ in 0..2 {
        let res = client()
            .post(format!("http://{addr}/strict"))
            .header("idempotency-key", "k")
            .send()
            .await
            .expect("r");
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }
    assert_eq!(effects.count(), 1);
    // ... /search lets calls without a key through, each running.
    for _ in 0..2 {
        let res = client()
            .post(format!("http://{addr}/search"))
            .send()
            .await
            .expect("r");
        assert_eq!(res.status(), StatusCode::OK);
    }
    assert_eq!(effects.count(), 3);
    // ... and the defaults still apply elsewhere: a key is required on other paths.
    let res = client()
        .post(format!("http://{addr}/other"))
        .send()
        .await
        .expect("r");
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn per_route_layers_and_method_routers() {
    let effects = Effects::default();
    let (e1, e2, e3) = (effects.clone(), effects.clone(), effects.clone());
    let store = MemoryStore::new();
    // The router-wide layer guards the routes added before it; /a, added after, has its own.
    let app = Router::new()
        .route(
            "/b",
            post(move || async move { (StatusCode::SERVICE_UNAVAILABLE, format!("{}", e2.hit())) })
                .get(move || async move { format!("{}", e3.hit()) }),
        )
        .route_layer(IdempotencyLayer::new(store.clone()).single_tenant())
        .route(
            "/a",
            post(move || async move { (StatusCode::SERVICE_UNAVAILABLE, format!("{}", e1.hit())) })
                .layer(
                    IdempotencyLayer::new(store)
                        .single_tenant()
                        .cache_policy(tower_idempotency::CachePolicy::Everything),
                ),
        );
    let addr = serve(app).await;
    let post_to = |path: &'static str| {
        client()
            .post(format!("http://{addr}{path}"))
            .header("idempotency-key", "same")
            .send()
    };

    post_to("/a").await.expect("r");
    let a = post_to("/a").await.expect("r");
    assert_eq!(
        a.headers()["idempotency-replayed"],
        "true",
        "route /a records everything"
    );
    assert_eq!(effects.count(), 1);
    // /b is guarded by the router's DefinitiveOnly layer: its 503 is not recorded. (Both layers
    // share one store and one scope, so /b's key differs by path in the fingerprint: 422.)
    let b = post_to("/b").await.expect("r");
    assert_eq!(b.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let b = client()
        .post(format!("http://{addr}/b"))
        .header("idempotency-key", "b-key")
        .send()
        .await
        .expect("r");
    assert_eq!(b.status(), StatusCode::SERVICE_UNAVAILABLE);
    let b = client()
        .post(format!("http://{addr}/b"))
        .header("idempotency-key", "b-key")
        .send()
        .await
        .expect("r");
    assert!(
        b.headers().get("idempotency-replayed").is_none(),
        "503 released, ran again"
    );
    assert_eq!(effects.count(), 3);
    // GET passes through untouched, key or not.
    for _ in 0..2 {
        let res = client()
            .get(format!("http://{addr}/b"))
            .header("idempotency-key", "b-key")
            .send()
            .await
            .expect("r");
        assert_eq!(res.status(), StatusCode::OK);
        assert!(res.headers().get("idempotency-replayed").is_none());
    }
    assert_eq!(effects.count(), 5);
}

#[tokio::test]
async fn envelope_mode_wraps_first_response_and_replay() {
    let effects = Effects::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .single_tenant()
        .envelope(true);
    let addr = serve(tickets(effects.clone(), Duration::ZERO).layer(layer)).await;

    let first: Value = post_ticket(addr, "k-env", "{}")
        .await
        .json()
        .await
        .expect("json");
    assert_eq!(first["ok"], true);
    assert_eq!(first["idempotent_replay"], false);
    assert_eq!(first["original_response"]["ticket"], 1);
    let replay = post_ticket(addr, "k-env", "{}").await;
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["content-type"], "application/json");
    let replay: Value = replay.json().await.expect("json");
    assert_eq!(replay["idempotent_replay"], true);
    assert_eq!(replay["original_response"], first["original_response"]);
    assert_eq!(effects.count(), 1);
}

#[tokio::test]
async fn context_reports_attempts_and_first_responses_can_be_marked() {
    let effects = Effects::default();
    let counter = effects.clone();
    let app = Router::new()
        .route(
            "/attempts",
            post(move |ctx: IdempotencyContext| async move {
                let n = counter.hit();
                let status = if n == 1 {
                    StatusCode::BAD_GATEWAY
                } else {
                    StatusCode::OK
                };
                let body = json!({
                    "attempt": ctx.attempt(),
                    "key": ctx.key(),
                    "downstream": ctx.downstream_key(),
                    "attempt_id": ctx.attempt_id(),
                });
                (status, axum::Json(body)).into_response()
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .mark_first_response(true),
        );
    let addr = serve(app).await;
    let send = || {
        client()
            .post(format!("http://{addr}/attempts"))
            .header("idempotency-key", "k-ctx")
            .send()
    };

    let first = send().await.expect("r");
    assert_eq!(first.status(), StatusCode::BAD_GATEWAY);
    assert_eq!(first.headers()["idempotency-replayed"], "false");
    let first: Value = first.json().await.expect("json");
    let second = send().await.expect("r");
    assert_eq!(
        second.headers()["idempotency-replayed"],
        "false",
        "ran again after the release"
    );
    let second: Value = second.json().await.expect("json");
    assert_eq!(first["attempt"], 1);
    assert_eq!(second["attempt"], 2);
    assert_eq!(second["key"], "k-ctx");
    assert_eq!(
        first["downstream"], second["downstream"],
        "the downstream key is stable"
    );
    assert_ne!(first["attempt_id"], second["attempt_id"]);
    assert_eq!(effects.count(), 2);
}

#[tokio::test]
async fn oversized_response_keeps_the_key_consumed() {
    let effects = Effects::default();
    let counter = effects.clone();
    let app = Router::new()
        .route(
            "/export",
            post(move || async move {
                counter.hit();
                "x".repeat(10_000)
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .response_limit(1_000),
        );
    let addr = serve(app).await;
    let send = || {
        client()
            .post(format!("http://{addr}/export"))
            .header("idempotency-key", "k-big")
            .send()
    };

    let first = send().await.expect("r");
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(
        first.text().await.expect("body").len(),
        10_000,
        "the live response is whole"
    );
    let retry = send().await.expect("r");
    assert_eq!(retry.status(), StatusCode::CONFLICT);
    assert_eq!(retry.headers()["idempotency-replayed"], "true");
    let p = problem(retry).await;
    assert_eq!(p["type"], problem_type("response-not-stored"));
    assert_eq!(p["safe_new_key"], true);
    assert_eq!(effects.count(), 1, "never a second run");
}

#[tokio::test]
async fn handler_panic_releases_the_key() {
    let effects = Effects::default();
    let counter = effects.clone();
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/fragile",
            post(move || async move {
                if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                    panic!("injected panic before the effect");
                }
                format!("done {}", counter.hit())
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    let send = || {
        client()
            .post(format!("http://{addr}/fragile"))
            .header("idempotency-key", "k-panic")
            .send()
    };

    let first = send().await.expect("r");
    assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        problem(first).await["type"],
        problem_type("execution-failed")
    );
    let retry = send().await.expect("r");
    assert_eq!(retry.status(), StatusCode::OK);
    assert_eq!(retry.text().await.expect("body"), "done 1");
    assert_eq!(effects.count(), 1);
}

/// A service that panics in `call` itself, before any future exists (tower services may do
/// work there), is treated like a handler that panics: the key is released, never recorded.
#[tokio::test]
async fn a_panic_in_the_services_call_releases_the_key() {
    use http_body_util::{BodyExt, Full};
    use tower::{Layer, ServiceExt};

    let effects = Effects::default();
    let counter = effects.clone();
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let inner = tower::service_fn(move |_req: http::Request<_>| {
        if calls.fetch_add(1, Ordering::SeqCst) == 0 {
            panic!("injected panic in call");
        }
        let hit = counter.hit();
        async move {
            Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(bytes::Bytes::from(
                format!("done {hit}"),
            ))))
        }
    });
    let service = IdempotencyLayer::new(MemoryStore::new())
        .single_tenant()
        .layer(inner);
    let request = || {
        http::Request::post("/fragile")
            .header("idempotency-key", "k-call-panic")
            .body(Full::new(bytes::Bytes::new()))
            .expect("request")
    };

    let first = service.clone().oneshot(request()).await.expect("answer");
    assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let body = first.into_body().collect().await.expect("body").to_bytes();
    let p: Value = serde_json::from_slice(&body).expect("problem");
    assert_eq!(p["type"], problem_type("execution-failed"));
    let retry = service.oneshot(request()).await.expect("answer");
    assert_eq!(retry.status(), StatusCode::OK);
    let body = retry.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(&body[..], b"done 1");
    assert_eq!(effects.count(), 1);
}

#[tokio::test]
async fn a_live_handler_keeps_its_lease_past_the_lease_length() {
    let effects = Effects::default();
    // Renewed every 200 ms; a busy machine would have to stall it for 600 ms to lose it.
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .single_tenant()
        .lease(Duration::from_millis(600));
    let addr = serve(tickets(effects.clone(), Duration::from_millis(2_500)).layer(layer)).await;

    let first = tokio::spawn(post_ticket(addr, "k-renew", "{}"));
    // Twice the lease: without renewal this retry would take the key over and run again.
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    let retry = post_ticket(addr, "k-renew", "{}").await;
    assert_eq!(retry.status(), StatusCode::CONFLICT);
    assert_eq!(first.await.expect("first").status(), StatusCode::CREATED);
    assert_eq!(effects.count(), 1);
}

#[tokio::test]
async fn a_dead_holder_is_taken_over_or_sent_to_reconciliation() {
    use tower_idempotency::LeaseExpiry;
    use tower_idempotency::store::{Claim, ClaimRequest};

    let effects = Effects::default();
    let clock = TestClock::default();
    let store = clock.store();
    let app = tickets(effects.clone(), Duration::ZERO).layer(
        IdempotencyLayer::new(store.clone())
            .single_tenant()
            .for_path("/tickets", |r| r.on_lease_expiry(LeaseExpiry::Reclaim)),
    );
    let addr = serve(app).await;

    // A holder claims with the fingerprint of the request below, then dies.
    let body = "{}";
    assert_eq!(
        post_ticket(addr, "probe", body).await.status(),
        StatusCode::CREATED
    );
    let fingerprint = store
        .lookup(&ScopedKey::new("", "probe"))
        .await
        .expect("lookup")
        .expect("record")
        .fingerprint;
    let claim = ClaimRequest {
        key: ScopedKey::new("", "k-dead"),
        fingerprint,
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
        on_lease_expiry: LeaseExpiry::Reclaim,
    };
    assert!(matches!(
        store.claim(&claim).await.expect("claim"),
        Claim::Acquired(_)
    ));
    assert_eq!(
        post_ticket(addr, "k-dead", body).await.status(),
        StatusCode::CONFLICT,
        "live lease"
    );

    clock.advance(Duration::from_secs(31));
    let res = post_ticket(addr, "k-dead", body).await;
    assert_eq!(
        res.status(),
        StatusCode::CREATED,
        "taken over after the lease ran out"
    );
    let res: Value = res.json().await.expect("json");
    assert_eq!(res["attempt"], 2);

    // On a route that reconciles, the same situation is "outcome unknown", and nothing runs.
    let reconcile = ClaimRequest {
        key: ScopedKey::new("", "k-dead-2"),
        on_lease_expiry: LeaseExpiry::Reconcile,
        ..claim
    };
    assert!(matches!(
        store.claim(&reconcile).await.expect("claim"),
        Claim::Acquired(_)
    ));
    clock.advance(Duration::from_secs(31));
    assert!(matches!(
        store.claim(&reconcile).await.expect("claim"),
        Claim::Existing { .. }
    ));
    let res = post_ticket(addr, "k-dead-2", body).await;
    assert_eq!(res.status(), StatusCode::CONFLICT);
    assert_eq!(problem(res).await["type"], problem_type("outcome-unknown"));
    assert_eq!(effects.count(), 2, "the probe and the takeover");
}

#[tokio::test]
async fn s1_a_route_that_cancels_on_disconnect_releases_the_key() {
    let effects = Effects::default();
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = effects.clone();
    let app = Router::new()
        .route(
            "/search",
            post(move |ctx: IdempotencyContext| async move {
                // The first call outlives its client; the retry is quick.
                if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                    tokio::time::sleep(Duration::from_secs(10)).await;
                }
                format!("done {} (attempt {})", counter.hit(), ctx.attempt())
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .cancel_on_disconnect(true),
        );
    let addr = serve(app).await;

    let hung_up = client()
        .post(format!("http://{addr}/search"))
        .header("idempotency-key", "k-cancel")
        .timeout(Duration::from_millis(200))
        .send()
        .await;
    assert!(hung_up.is_err(), "the client gave up");
    // The cancelled execution released the key: the retry runs (attempt 2), no 409.
    let mut retry = None;
    for _ in 0..100 {
        let res = client()
            .post(format!("http://{addr}/search"))
            .header("idempotency-key", "k-cancel")
            .send()
            .await
            .expect("retry");
        if res.status() == StatusCode::OK {
            retry = Some(res.text().await.expect("body"));
            break;
        }
        assert_eq!(
            res.status(),
            StatusCode::CONFLICT,
            "only while the release lands"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        retry.expect("the key was released").as_str(),
        "done 1 (attempt 2)"
    );
    assert_eq!(
        effects.count(),
        1,
        "the cancelled handler never finished its effect"
    );
}

#[tokio::test]
async fn s1_a_route_that_waits_replays_the_first_outcome_instead_of_409() {
    let effects = Effects::default();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .single_tenant()
        .wait_for_in_flight(Duration::from_secs(10));
    let addr = serve(tickets(effects.clone(), Duration::from_millis(500)).layer(layer)).await;

    let first = tokio::spawn(post_ticket(addr, "k-wait", "{}"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let waiting = post_ticket(addr, "k-wait", "{}").await;
    assert_eq!(
        waiting.status(),
        StatusCode::CREATED,
        "waited for the first, no 409"
    );
    assert_eq!(waiting.headers()["idempotency-replayed"], "true");
    let first = first.await.expect("task");
    assert_eq!(
        waiting.bytes().await.expect("body"),
        first.bytes().await.expect("body")
    );
    assert_eq!(effects.count(), 1);

    // A wait shorter than the work still ends in 409.
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .single_tenant()
        .wait_for_in_flight(Duration::from_millis(100));
    let addr = serve(tickets(effects.clone(), Duration::from_millis(800)).layer(layer)).await;
    let first = tokio::spawn(post_ticket(addr, "k-short", "{}"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        post_ticket(addr, "k-short", "{}").await.status(),
        StatusCode::CONFLICT
    );
    assert_eq!(first.await.expect("task").status(), StatusCode::CREATED);
    assert_eq!(effects.count(), 2);
}

// ---- §2 / §4 across fingerprint schemes: a rolling deploy -------------------------------------

/// A replica of `/tickets` on `store`: with `other_settings`, a canonicaliser for a media type
/// these requests never have (its fingerprints name another scheme, over the same input, as a
/// replica of another version or configuration does). Its handler counts an effect and answers
/// `status`.
fn replica<St: IdempotencyStore>(
    store: St,
    other_settings: bool,
    expiry: LeaseExpiry,
    effects: Effects,
    status: StatusCode,
) -> Router {
    fn raw(body: &[u8]) -> Result<Vec<u8>, MalformedBody> {
        Ok(body.to_vec())
    }
    let mut layer = IdempotencyLayer::new(store)
        .single_tenant()
        .on_lease_expiry(expiry);
    if other_settings {
        layer = layer.canonicalize("application/x-never-sent", raw);
    }
    Router::new()
        .route(
            "/tickets",
            post(move || async move { (status, format!("effect {}", effects.hit())) }),
        )
        .layer(layer)
}

/// Replicas of two schemes on one store across a rolling deploy: the old one's fingerprints
/// name another scheme (a canonicaliser for a media type never sent), the new one's do not;
/// the input they hash is the same. Effects counted at each side's sink.
struct Deploy<St> {
    store: St,
    old_failing: std::net::SocketAddr,
    reclaiming: std::net::SocketAddr,
    reconciling: std::net::SocketAddr,
    old_effects: Effects,
    new_effects: Effects,
    /// The old replica's fingerprint of [`Deploy::BODY`], read from a record it completed.
    theirs: tower_idempotency::Fingerprint,
}

impl<St: IdempotencyStore + Clone> Deploy<St> {
    const BODY: &'static str = r#"{"amount":10}"#;

    async fn new(store: St) -> Self {
        let (old_effects, new_effects) = (Effects::default(), Effects::default());
        let old = |status| {
            serve(replica(
                store.clone(),
                true,
                LeaseExpiry::Reclaim,
                old_effects.clone(),
                status,
            ))
        };
        let (old_ok, old_failing) = (
            old(StatusCode::CREATED).await,
            old(StatusCode::SERVICE_UNAVAILABLE).await,
        );
        let new = |expiry| {
            serve(replica(
                store.clone(),
                false,
                expiry,
                new_effects.clone(),
                StatusCode::CREATED,
            ))
        };
        let (reclaiming, reconciling) = (
            new(LeaseExpiry::Reclaim).await,
            new(LeaseExpiry::Reconcile).await,
        );
        let seen = common::raw::unique("scheme-seen");
        assert_eq!(
            post_ticket(old_ok, &seen, Self::BODY).await.status(),
            StatusCode::CREATED
        );
        let theirs = store
            .lookup(&ScopedKey::new("", &seen))
            .await
            .expect("lookup")
            .expect("the record")
            .fingerprint;
        // The same request is replayed by the new replica (the fingerprints' input is the same).
        let replayed = post_ticket(reclaiming, &seen, Self::BODY).await;
        assert_eq!(replayed.status(), StatusCode::CREATED);
        assert_eq!(replayed.headers()["idempotency-replayed"], "true");
        Self {
            store,
            old_failing,
            reclaiming,
            reconciling,
            old_effects,
            new_effects,
            theirs,
        }
    }
}

/// DESIGN §2 (a released record is claimable again), across a rolling deploy: a key the old
/// replica released (its handler answered 503, which is not recorded) is run by the new one's
/// retry, once. A store compares all 32 bytes of a fingerprint; before the layer claimed again
/// with the record's bytes, every retry of such a key was answered 409 "in flight" until the
/// record expired (a day by default).
async fn another_schemes_released_record_is_claimed<St: IdempotencyStore + Clone>(store: St) {
    let d = Deploy::new(store).await;
    let body = Deploy::<St>::BODY;
    let released = common::raw::unique("scheme-released");
    let first = post_ticket(d.old_failing, &released, body).await;
    assert_eq!(first.status(), StatusCode::SERVICE_UNAVAILABLE);
    let record = d
        .store
        .lookup(&ScopedKey::new("", &released))
        .await
        .expect("lookup");
    assert!(
        record
            .as_ref()
            .is_none_or(|r| r.status == RecordStatus::Released),
        "released: {record:?}"
    );
    let retry = post_ticket(d.reclaiming, &released, body).await;
    assert_eq!(
        retry.status(),
        StatusCode::CREATED,
        "claimed again, run here"
    );
    assert!(
        retry.headers().get("idempotency-replayed").is_none(),
        "live"
    );
    assert_eq!(d.new_effects.count(), 1);
    let again = post_ticket(d.reclaiming, &released, body).await;
    assert_eq!(again.headers()["idempotency-replayed"], "true");
    assert_eq!(d.new_effects.count(), 1, "never twice");
    assert_eq!(d.old_effects.count(), 2, "the old replica's two runs");
}

/// DESIGN §4 (a lease run out is taken over, or set aside on a route that reconciles), across
/// a rolling deploy: a key held by an old replica that died (its lease runs out) is taken
/// over by the new one's retry where the route reclaims, and set aside where it reconciles;
/// never "in flight" until the record expires, as before the layer claimed again with the
/// record's bytes.
async fn another_schemes_lapsed_lease_is_taken_over_or_set_aside<St>(store: St)
where
    St: IdempotencyStore + Clone,
{
    let d = Deploy::new(store).await;
    for (addr, expiry) in [
        (d.reclaiming, LeaseExpiry::Reclaim),
        (d.reconciling, LeaseExpiry::Reconcile),
    ] {
        let key = common::raw::unique("scheme-lapsed");
        let claim = ClaimRequest {
            key: ScopedKey::new("", &key),
            fingerprint: d.theirs,
            lease: Duration::from_millis(300),
            ttl: Duration::from_secs(60),
            on_lease_expiry: expiry,
        };
        let claimed = d.store.claim(&claim).await.expect("claim");
        assert!(matches!(claimed, Claim::Acquired(_)), "{claimed:?}");
        tokio::time::sleep(Duration::from_millis(800)).await;
        let before = d.new_effects.count();
        let retry = post_ticket(addr, &key, Deploy::<St>::BODY).await;
        match expiry {
            LeaseExpiry::Reclaim => {
                assert_eq!(retry.status(), StatusCode::CREATED, "taken over, run here");
                assert_eq!(d.new_effects.count(), before + 1);
            }
            _ => {
                assert_eq!(retry.status(), StatusCode::CONFLICT);
                assert_eq!(
                    problem(retry).await["type"],
                    problem_type("outcome-unknown"),
                    "set aside, not in flight"
                );
                assert_eq!(d.new_effects.count(), before, "nothing run");
            }
        }
    }
    assert_eq!(d.old_effects.count(), 1, "the old replica's one run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_s4_another_schemes_released_record_is_claimed_on_memory() {
    another_schemes_released_record_is_claimed(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_s4_another_schemes_released_record_is_claimed_on_sqlite() {
    let (store, path) = common::sqlite("contract-schemes-released").await;
    another_schemes_released_record_is_claimed(store).await;
    let _ = std::fs::remove_file(path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_s4_another_schemes_released_record_is_claimed_on_postgres() {
    let Some(store) = common::postgres("contract_schemes_released").await else {
        return;
    };
    another_schemes_released_record_is_claimed(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_s4_another_schemes_released_record_is_claimed_on_redis() {
    let Some(store) = common::redis("contract-schemes-released").await else {
        return;
    };
    another_schemes_released_record_is_claimed(store).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_s4_another_schemes_lapsed_lease_is_taken_over_or_set_aside_on_memory() {
    another_schemes_lapsed_lease_is_taken_over_or_set_aside(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_s4_another_schemes_lapsed_lease_is_taken_over_or_set_aside_on_sqlite() {
    let (store, path) = common::sqlite("contract-schemes-lapsed").await;
    another_schemes_lapsed_lease_is_taken_over_or_set_aside(store).await;
    let _ = std::fs::remove_file(path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_s4_another_schemes_lapsed_lease_is_taken_over_or_set_aside_on_postgres() {
    let Some(store) = common::postgres("contract_schemes_lapsed").await else {
        return;
    };
    another_schemes_lapsed_lease_is_taken_over_or_set_aside(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_s4_another_schemes_lapsed_lease_is_taken_over_or_set_aside_on_redis() {
    let Some(store) = common::redis("contract-schemes-lapsed").await else {
        return;
    };
    another_schemes_lapsed_lease_is_taken_over_or_set_aside(store).await;
}
