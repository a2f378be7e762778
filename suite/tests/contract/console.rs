//! Issue 18, the operator console: over HTTP (list, inspect, resolve, remove, purge, the JSON
//! API, cross-site refusals, escaping) and in a real headless Chromium driven over WebDriver
//! (list, inspect, resolve; the resolved key then replays).

use crate::common;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::post;
use common::{Effects, client, serve};
use serde_json::{Value, json};
use tower_idempotency::console::Console;
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, IdempotencyStore, MemoryStore};

const COOKIE: &str = "ops-session=let-me-in";

/// A stand-in for the application's auth: the console answers only with the operator's
/// session cookie.
async fn operators_only(req: Request, next: Next) -> Result<Response, StatusCode> {
    let signed_in = req
        .headers()
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.split(';').any(|c| c.trim() == COOKIE));
    if signed_in {
        Ok(next.run(req).await)
    } else {
        Err(StatusCode::UNAUTHORIZED)
    }
}

/// A payments route whose handler starts its effect and then fails: every new key ends up
/// awaiting reconciliation. `<b>` in a title comes back in the answer, for the escaping checks.
async fn app(store: MemoryStore, effects: Effects) -> SocketAddr {
    let sink = effects.clone();
    let charge = post(move |ctx: IdempotencyContext, body: String| {
        let sink = sink.clone();
        async move {
            ctx.effect_started().await.expect("milestone");
            sink.hit();
            (
                StatusCode::BAD_GATEWAY,
                format!("provider timed out on {body}"),
            )
        }
    });
    let app = Router::new()
        .route("/", axum::routing::get(|| async { "the payments app" }))
        .route("/charge", charge)
        .route_layer(IdempotencyLayer::new(store.clone()).single_tenant())
        .nest(
            "/ops/idempotency",
            Console::new(store)
                .router()
                .layer(middleware::from_fn(operators_only)),
        );
    serve(app).await
}

async fn charge(addr: SocketAddr, key: &str, body: &str) -> reqwest::Response {
    client()
        .post(format!("http://{addr}/charge"))
        .header("idempotency-key", key)
        .body(body.to_owned())
        .send()
        .await
        .expect("charge")
}

fn ops(addr: SocketAddr, path: &str) -> String {
    format!("http://{addr}/ops/idempotency{path}")
}

#[tokio::test]
async fn s18_console_needs_the_apps_auth() {
    let addr = app(MemoryStore::new(), Effects::default()).await;
    let res = client().get(ops(addr, "")).send().await.expect("get");
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn s18_console_lists_inspects_and_resolves_over_http() {
    let store = MemoryStore::new();
    let effects = Effects::default();
    let addr = app(store.clone(), effects.clone()).await;
    for key in ["k-1", "k-2", "k-3"] {
        assert_eq!(
            charge(addr, key, "<b>5 EUR</b>").await.status(),
            StatusCode::BAD_GATEWAY
        );
    }
    // Awaiting reconciliation: retries are refused, nothing runs again.
    assert_eq!(
        charge(addr, "k-1", "<b>5 EUR</b>").await.status(),
        StatusCode::CONFLICT
    );
    assert_eq!(effects.count(), 3);

    let get = |path: String| async move {
        client()
            .get(path)
            .header("cookie", COOKIE)
            .send()
            .await
            .expect("get")
    };
    // The JSON API: the true count, pages with a cursor, both orders.
    let page: Value = get(ops(addr, "/api/uncertain?limit=2"))
        .await
        .json()
        .await
        .expect("json");
    assert_eq!(page["count"], 3);
    assert_eq!(page["records"].as_array().map(Vec::len), Some(2));
    let next = page["next"].as_str().expect("a next page");
    let rest: Value = get(ops(
        addr,
        &format!("/api/uncertain?limit=2&after={}", enc(next)),
    ))
    .await
    .json()
    .await
    .expect("json");
    let keys = |v: &Value| -> Vec<String> {
        v["records"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| r["key"].as_str().unwrap_or_default().to_owned())
            .collect()
    };
    let mut oldest_first = keys(&page);
    oldest_first.extend(keys(&rest));
    assert_eq!(oldest_first, ["k-1", "k-2", "k-3"]);
    let newest: Value = get(ops(addr, "/api/uncertain?order=newest"))
        .await
        .json()
        .await
        .expect("json");
    assert_eq!(keys(&newest), ["k-3", "k-2", "k-1"]);
    let first = &page["records"][0];
    assert_eq!(first["attempts"], 1);
    assert_eq!(first["effect_started"], true);
    assert_eq!(first["last_event"], "needs_reconciliation");
    let scope = first["scope"].as_str().expect("scope").to_owned();

    // The HTML list and the record page.
    let list = get(ops(addr, "")).await.text().await.expect("html");
    assert!(
        list.contains("k-1") && list.contains("id=\"count\">3<"),
        "{list}"
    );
    let record = get(ops(addr, &format!("/record?scope={}&key=k-2", enc(&scope))))
        .await
        .text()
        .await
        .expect("html");
    assert!(record.contains("needs_reconciliation"), "{record}");
    assert!(record.contains("resolve-applied"), "{record}");

    // Writes refused unless they come from the console's own origin.
    let form = |fields: &[(&str, &str)]| {
        form_urlencoded::Serializer::new(String::new())
            .extend_pairs(fields)
            .finish()
    };
    let resolve_fields = [
        ("scope", scope.as_str()),
        ("key", "k-2"),
        ("outcome", "applied"),
        ("status", "201"),
        ("content_type", "text/html"),
        ("body", "<script>alert(1)</script>charged"),
        ("reason", "provider dashboard shows charge ch_2"),
    ];
    let post_form = |origin: Option<&'static str>, body: String| async move {
        let mut req = client()
            .post(ops(addr, "/resolve"))
            .header("cookie", COOKIE)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body);
        if let Some(origin) = origin {
            req = req.header("origin", origin);
        }
        req.send().await.expect("post")
    };
    assert_eq!(
        post_form(None, form(&resolve_fields)).await.status(),
        StatusCode::FORBIDDEN,
        "no origin"
    );
    assert_eq!(
        post_form(Some("http://evil.example"), form(&resolve_fields))
            .await
            .status(),
        StatusCode::FORBIDDEN,
        "another origin"
    );
    let same_origin: &'static str = Box::leak(format!("http://{addr}").into_boxed_str());
    // A reason is required.
    let no_reason: Vec<_> = resolve_fields
        .iter()
        .filter(|(n, _)| *n != "reason")
        .copied()
        .collect();
    assert_eq!(
        post_form(Some(same_origin), form(&no_reason))
            .await
            .status(),
        StatusCode::BAD_REQUEST
    );
    let done = post_form(Some(same_origin), form(&resolve_fields)).await;
    assert_eq!(
        done.status(),
        StatusCode::OK,
        "followed the 303 to the record page"
    );
    let page = done.text().await.expect("html");
    assert!(page.contains("completed"), "{page}");
    assert!(
        page.contains("provider dashboard shows charge ch_2"),
        "{page}"
    );
    assert!(
        page.contains("&lt;script&gt;alert(1)&lt;/script&gt;charged") && !page.contains("<script>"),
        "stored bytes are escaped: {page}"
    );
    // The key now replays what the operator recorded; the handler never runs again.
    let replay = charge(addr, "k-2", "<b>5 EUR</b>").await;
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(
        replay.text().await.expect("body"),
        "<script>alert(1)</script>charged"
    );
    assert_eq!(effects.count(), 3);

    // The JSON API: not applied, with its own checks.
    let api = |body: Value, content_type: &'static str, origin: Option<&'static str>| async move {
        let mut req = client()
            .post(ops(addr, "/api/resolve"))
            .header("cookie", COOKIE)
            .header("content-type", content_type)
            .body(body.to_string());
        if let Some(origin) = origin {
            req = req.header("origin", origin);
        }
        req.send().await.expect("post")
    };
    let not_applied = json!({
        "scope": scope, "key": "k-3", "outcome": "not_applied", "reason": "no charge at the provider",
    });
    assert_eq!(
        api(not_applied.clone(), "text/plain", None).await.status(),
        StatusCode::UNSUPPORTED_MEDIA_TYPE
    );
    assert_eq!(
        api(
            not_applied.clone(),
            "application/json",
            Some("http://evil.example")
        )
        .await
        .status(),
        StatusCode::FORBIDDEN
    );
    let res = api(not_applied, "application/json", None).await;
    assert_eq!(res.status(), StatusCode::OK);
    let settled: Value = res.json().await.expect("json");
    assert_eq!(settled["status"], "released");
    assert_eq!(settled["resolution_note"], "no charge at the provider");
    // The reason is shown with the history entry of the resolution.
    let resolved = settled["history"]
        .as_array()
        .and_then(|h| h.iter().find(|e| e["event"] == "reconciled_not_applied"))
        .expect("the resolution in the history");
    assert_eq!(resolved["note"], "no charge at the provider");
    assert_eq!(
        charge(addr, "k-3", "<b>5 EUR</b>").await.status(),
        StatusCode::BAD_GATEWAY
    );
    assert_eq!(effects.count(), 4, "not applied: the retry runs it");

    // Remove.
    let removed = client()
        .post(ops(addr, "/api/remove"))
        .header("cookie", COOKIE)
        .header("content-type", "application/json")
        .body(json!({"scope": scope, "key": "k-1", "reason": "test data"}).to_string())
        .send()
        .await
        .expect("post");
    assert_eq!(
        removed.json::<Value>().await.expect("json")["removed"],
        true
    );
    assert!(
        store
            .lookup(&tower_idempotency::ScopedKey::new(&scope, "k-1"))
            .await
            .expect("lookup")
            .is_none()
    );
}

fn enc(text: &str) -> String {
    form_urlencoded::byte_serialize(text.as_bytes()).collect()
}

// ---------------------------------------------------------------------------------------------
// In a real browser, over WebDriver (chromedriver and Debian's Chromium).

/// A WebDriver session, spoken plainly over HTTP.
struct Browser {
    http: reqwest::Client,
    base: String,
    session: String,
    _driver: Driver,
}

struct Driver(Child, std::path::PathBuf);

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let _ = std::fs::remove_dir_all(&self.1);
    }
}

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

impl Browser {
    async fn start() -> Option<Self> {
        let driver_path = ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists());
        let (Some(driver_path), true) = (
            driver_path,
            std::path::Path::new("/usr/bin/chromium").exists(),
        ) else {
            common::unreachable(
                "Chromium and ChromeDriver (Debian: chromium, chromium-driver)",
                &"not installed",
            );
            return None;
        };
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = Command::new(driver_path)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts");
        let profile = std::env::temp_dir().join(format!("console-chromium-{}", std::process::id()));
        let driver = Driver(child, profile.clone());
        let http = client();
        let base = format!("http://127.0.0.1:{port}");
        for _ in 0..100 {
            if http.get(format!("{base}/status")).send().await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--disable-quic", "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    format!("--user-data-dir={}", profile.display()),
                ],
            },
        }}});
        let created: Value = http
            .post(format!("{base}/session"))
            .json(&capabilities)
            .send()
            .await
            .expect("new session")
            .json()
            .await
            .expect("json");
        let session = created["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("a session: {created}"))
            .to_owned();
        Some(Self {
            http,
            base,
            session,
            _driver: driver,
        })
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Value) -> Value {
        let url = format!("{}/session/{}{path}", self.base, self.session);
        let mut req = self.http.request(method.clone(), url);
        if method != reqwest::Method::GET {
            req = req.json(&body);
        }
        let res = req.send().await.expect("webdriver");
        let value: Value = res.json().await.expect("json");
        assert!(
            value["value"]["error"].is_null(),
            "webdriver {path}: {value}"
        );
        value["value"].clone()
    }

    async fn goto(&self, url: &str) {
        self.call(reqwest::Method::POST, "/url", json!({"url": url}))
            .await;
    }

    async fn find(&self, css: &str) -> String {
        let found = self
            .call(
                reqwest::Method::POST,
                "/element",
                json!({"using": "css selector", "value": css}),
            )
            .await;
        found[ELEMENT]
            .as_str()
            .or_else(|| found["ELEMENT"].as_str())
            .unwrap_or_else(|| panic!("an element for {css}: {found}"))
            .to_owned()
    }

    async fn click(&self, css: &str) {
        let id = self.find(css).await;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{id}/click"),
            json!({}),
        )
        .await;
    }

    async fn type_into(&self, css: &str, text: &str) {
        let id = self.find(css).await;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{id}/clear"),
            json!({}),
        )
        .await;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{id}/value"),
            json!({"text": text}),
        )
        .await;
    }

    /// Whether `css` finds an element now (navigation after a click may still be under way).
    async fn present(&self, css: &str) -> bool {
        let url = format!("{}/session/{}/elements", self.base, self.session);
        let found: Value = self
            .http
            .post(url)
            .json(&json!({"using": "css selector", "value": css}))
            .send()
            .await
            .expect("webdriver")
            .json()
            .await
            .expect("json");
        found["value"].as_array().is_some_and(|a| !a.is_empty())
    }

    async fn text(&self, css: &str) -> String {
        for _ in 0..100 {
            if self.present(css).await {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if !self.present(css).await {
            let url = self.call(reqwest::Method::GET, "/url", Value::Null).await;
            let source = self
                .call(reqwest::Method::GET, "/source", Value::Null)
                .await;
            panic!("no {css} on {url}: {source}");
        }
        let id = self.find(css).await;
        let value = self
            .call(
                reqwest::Method::GET,
                &format!("/element/{id}/text"),
                Value::Null,
            )
            .await;
        value.as_str().unwrap_or_default().to_owned()
    }

    /// Waits (up to 10 s) until `css` reads `want`: after a click the old page may still be
    /// there, or its elements gone stale.
    async fn wait_text(&self, css: &str, want: &str) {
        let mut seen = String::new();
        for _ in 0..200 {
            let url = format!("{}/session/{}/elements", self.base, self.session);
            let found: Value = match self
                .http
                .post(url)
                .json(&json!({"using": "css selector", "value": css}))
                .send()
                .await
            {
                Ok(res) => res.json().await.unwrap_or(Value::Null),
                Err(_) => Value::Null,
            };
            if let Some(id) = found["value"][0][ELEMENT].as_str() {
                let url = format!("{}/session/{}/element/{id}/text", self.base, self.session);
                if let Ok(res) = self.http.get(url).send().await {
                    let text: Value = res.json().await.unwrap_or(Value::Null);
                    if let Some(text) = text["value"].as_str() {
                        seen = text.to_owned();
                        if seen == want {
                            return;
                        }
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("{css} never read {want:?} (last: {seen:?})");
    }

    async fn set_cookie(&self, name: &str, value: &str) {
        self.call(
            reqwest::Method::POST,
            "/cookie",
            json!({"cookie": {"name": name, "value": value, "path": "/"}}),
        )
        .await;
    }

    async fn close(self) {
        let _ = self
            .http
            .delete(format!("{}/session/{}", self.base, self.session))
            .send()
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s18_console_in_a_real_browser_list_inspect_resolve_then_the_key_replays() {
    let store = MemoryStore::new();
    let effects = Effects::default();
    let addr = app(store.clone(), effects.clone()).await;
    assert_eq!(
        charge(addr, "browser-1", "10 EUR").await.status(),
        StatusCode::BAD_GATEWAY
    );
    let Some(browser) = Browser::start().await else {
        return;
    };
    // Signed in as an operator (the app's auth), then the list.
    browser.goto(&format!("http://{addr}/")).await;
    let (name, value) = COOKIE.split_once('=').expect("cookie");
    browser.set_cookie(name, value).await;
    browser.goto(&ops(addr, "")).await;
    assert_eq!(browser.text("#count").await, "1");
    assert_eq!(browser.text("a.record").await, "browser-1");
    // Inspect, and resolve as applied with a reason, through the page's own form.
    browser.click("a.record").await;
    browser.wait_text("#status", "needs_reconciliation").await;
    browser
        .type_into(
            "#resolve-applied textarea[name=body]",
            "{\"charge\":\"ch_9\"}",
        )
        .await;
    browser
        .type_into(
            "#resolve-applied input[name=reason]",
            "seen in the provider's dashboard",
        )
        .await;
    browser.click("#resolve-applied button").await;
    browser
        .wait_text("#note", "seen in the provider's dashboard")
        .await;
    assert_eq!(browser.text("#status").await, "completed");
    browser.close().await;
    // The resolved key replays what the operator recorded; nothing runs again.
    let replay = charge(addr, "browser-1", "10 EUR").await;
    assert_eq!(replay.status(), StatusCode::OK);
    assert_eq!(replay.headers()["idempotency-replayed"], "true");
    assert_eq!(replay.text().await.expect("body"), "{\"charge\":\"ch_9\"}");
    assert_eq!(effects.count(), 1);
}

async fn acquire(
    store: &MemoryStore,
    key: &tower_idempotency::ScopedKey,
) -> tower_idempotency::store::Lease {
    let claim = store
        .claim(&tower_idempotency::store::ClaimRequest {
            key: key.clone(),
            fingerprint: tower_idempotency::Fingerprint::from_bytes([1; 32]),
            lease: Duration::from_secs(60),
            ttl: Duration::from_secs(60),
            on_lease_expiry: tower_idempotency::LeaseExpiry::Reclaim,
        })
        .await
        .expect("claim");
    match claim {
        tower_idempotency::store::Claim::Acquired(lease) => lease,
        other => panic!("{other:?}"),
    }
}

/// The hidden inputs of a record page's forms, as a browser sends them back.
fn page_fields(page: &str) -> Vec<(String, String)> {
    ["ref", "token"]
        .iter()
        .map(|name| {
            let marker = format!("name=\"{name}\" value=\"");
            let start = page.find(&marker).expect("hidden input") + marker.len();
            let end = start + page[start..].find('"').expect("end of value");
            ((*name).to_owned(), page[start..end].replace("&amp;", "&"))
        })
        .collect()
}

/// Review findings: forms name their key by a reference a browser cannot alter (a JSON-RPC
/// record's scope holds NUL), and carry the attempt they were built for; a resolution's
/// status must be final; the JSON API refuses a browser's cross-site call however it says so;
/// a cursor the console never gave out is an error; nothing of the API is cached; removing
/// needs a reason and says when there was nothing.
#[tokio::test]
async fn s18_console_forms_and_api_hold_against_the_review() {
    let store = MemoryStore::new();
    let addr = app(store.clone(), Effects::default()).await;
    let same_origin: &'static str = Box::leak(format!("http://{addr}").into_boxed_str());
    let post_form = |path: &'static str, fields: Vec<(String, String)>| async move {
        let body = form_urlencoded::Serializer::new(String::new())
            .extend_pairs(fields)
            .finish();
        client()
            .post(ops(addr, path))
            .header("cookie", COOKIE)
            .header("origin", same_origin)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body)
            .send()
            .await
            .expect("post")
    };
    let get = |url: String| async move {
        client()
            .get(url)
            .header("cookie", COOKIE)
            .send()
            .await
            .expect("get")
    };
    // A record whose scope holds NUL and CR, as JSON-RPC scopes hold NUL.
    let key = tower_idempotency::ScopedKey::new("tenant\0tools/call\r", "mcp-1");
    let lease = acquire(&store, &key).await;
    store.mark_uncertain(&key, lease.token).await.expect("mark");
    let record_url = ops(
        addr,
        &format!("/record?scope={}&key=mcp-1", enc(key.scope())),
    );
    let page = get(record_url.clone()).await.text().await.expect("html");
    let fields = page_fields(&page);
    // Bad statuses, and a body on a bodiless answer, are refused.
    for (status, body) in [("999", ""), ("101", ""), ("204", "not empty")] {
        let mut bad = fields.clone();
        bad.extend([
            ("outcome".to_owned(), "applied".to_owned()),
            ("status".to_owned(), status.to_owned()),
            ("body".to_owned(), body.to_owned()),
            ("reason".to_owned(), "checked".to_owned()),
        ]);
        assert_eq!(
            post_form("/resolve", bad).await.status(),
            StatusCode::BAD_REQUEST,
            "{status}"
        );
    }
    let mut settle = fields.clone();
    settle.extend([
        ("outcome".to_owned(), "not_applied".to_owned()),
        ("reason".to_owned(), "nothing happened".to_owned()),
    ]);
    let stale = settle.clone();
    let done = post_form("/resolve", settle).await;
    assert_eq!(
        done.status(),
        StatusCode::OK,
        "resolved through the encoded key"
    );
    let record = store.lookup(&key).await.expect("lookup").expect("record");
    assert_eq!(
        record.status,
        tower_idempotency::store::RecordStatus::Released
    );
    // A new attempt on the key: the old page's form must not settle it.
    let again = acquire(&store, &key).await;
    store.mark_uncertain(&key, again.token).await.expect("mark");
    assert_eq!(
        post_form("/resolve", stale).await.status(),
        StatusCode::CONFLICT,
        "a page of the first attempt cannot settle the second"
    );
    // The JSON API.
    let api = |sec_fetch_site: Option<&'static str>, content_type: &'static str| async move {
        let mut req = client()
            .post(ops(addr, "/api/purge"))
            .header("cookie", COOKIE)
            .header("content-type", content_type)
            .body("{}");
        if let Some(site) = sec_fetch_site {
            req = req.header("sec-fetch-site", site);
        }
        req.send().await.expect("post")
    };
    assert_eq!(
        api(Some("cross-site"), "application/json").await.status(),
        StatusCode::FORBIDDEN
    );
    let ok = api(None, "Application/JSON; charset=utf-8").await;
    assert_eq!(ok.status(), StatusCode::OK);
    assert_eq!(ok.headers()["cache-control"], "no-store");
    assert_eq!(
        get(ops(addr, "/api/uncertain?after=not-a-cursor"))
            .await
            .status(),
        StatusCode::BAD_REQUEST
    );
    // Removing needs a reason, and says when there was nothing to remove.
    let mut remove = page_fields(&get(record_url).await.text().await.expect("html"));
    assert_eq!(
        post_form("/remove", remove.clone()).await.status(),
        StatusCode::BAD_REQUEST
    );
    remove.push(("reason".to_owned(), "test data".to_owned()));
    assert_eq!(
        post_form("/remove", remove.clone()).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        post_form("/remove", remove).await.status(),
        StatusCode::NOT_FOUND
    );
}

/// A console served behind a proxy, set with its public origins (`Console::origin`).
async fn console_at(origins: &[&'static str]) -> (SocketAddr, MemoryStore, Effects) {
    let store = MemoryStore::new();
    let effects = Effects::default();
    let sink = effects.clone();
    let charge = post(move |ctx: IdempotencyContext| {
        let sink = sink.clone();
        async move {
            ctx.effect_started().await.expect("milestone");
            sink.hit();
            StatusCode::BAD_GATEWAY
        }
    });
    let mut console = Console::new(store.clone());
    for origin in origins {
        console = console.origin(axum::http::Uri::from_static(origin));
    }
    let app = Router::new()
        .route("/charge", charge)
        .route_layer(IdempotencyLayer::new(store.clone()).single_tenant())
        .nest("/ops/idempotency", console.router());
    (serve(app).await, store, effects)
}

/// Sends a removal of `key` by the form or the JSON API with the given browser headers; the
/// answer's status, and whether the record is still there afterwards.
async fn remove_with(
    addr: SocketAddr,
    store: &MemoryStore,
    key: &str,
    api: bool,
    headers: &[(&str, &str)],
) -> (StatusCode, bool) {
    let listed: Value = client()
        .get(ops(addr, "/api/uncertain"))
        .send()
        .await
        .expect("get")
        .json()
        .await
        .expect("json");
    let scope = listed["records"][0]["scope"]
        .as_str()
        .expect("a record awaits")
        .to_owned();
    let fields = [("scope", scope.as_str()), ("key", key), ("reason", "test")];
    let mut req = if api {
        let body: serde_json::Map<String, Value> = fields
            .iter()
            .map(|(n, v)| ((*n).to_owned(), Value::from(*v)))
            .collect();
        client()
            .post(ops(addr, "/api/remove"))
            .header("content-type", "application/json")
            .body(Value::Object(body).to_string())
    } else {
        client()
            .post(ops(addr, "/remove"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(
                form_urlencoded::Serializer::new(String::new())
                    .extend_pairs(fields)
                    .finish(),
            )
    };
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let status = req.send().await.expect("post").status();
    let left = store
        .lookup(&tower_idempotency::ScopedKey::new(&scope, key))
        .await
        .expect("lookup")
        .is_some();
    (status, left)
}

/// §7 (issue 18's cross-site refusals): behind a proxy that ends TLS and speaks HTTP/1.1,
/// the request cannot say it came over `https`, and its `Host` may be the proxy's. With its
/// public origin set, the console takes writes from that origin only (its scheme included),
/// in any spelling a browser could send, and from nothing else: not the request's own host,
/// not the other scheme, not a look-alike. Each refused write leaves its record in place.
#[tokio::test]
async fn s18_console_behind_a_proxy_takes_writes_from_its_set_origin_only() {
    let (addr, store, effects) = console_at(&["https://ops.example.com/idempotency"]).await;
    let own_host: &'static str = Box::leak(format!("http://{addr}").into_boxed_str());
    for i in 0..12 {
        assert_eq!(
            charge(addr, &format!("p-{i}"), "x").await.status(),
            StatusCode::BAD_GATEWAY
        );
    }
    assert_eq!(effects.count(), 12);
    let refused: [&[(&str, &str)]; 8] = [
        &[("origin", "http://ops.example.com")],
        &[("origin", own_host)],
        &[("origin", own_host), ("sec-fetch-site", "same-origin")],
        &[("origin", "https://ops.example.com.evil.example")],
        &[("origin", "https://ops.example.com:8443")],
        &[("origin", "null"), ("sec-fetch-site", "same-origin")],
        &[("sec-fetch-site", "cross-site")],
        &[("origin", "https://ops.example.com/")],
    ];
    for (i, headers) in refused.iter().enumerate() {
        for api in [false, true] {
            assert_eq!(
                remove_with(addr, &store, &format!("p-{i}"), api, headers).await,
                (StatusCode::FORBIDDEN, true),
                "{headers:?}, api {api}"
            );
        }
    }
    // A form needs a browser's word; a script's API call (no browser headers) passes.
    assert_eq!(
        remove_with(addr, &store, "p-8", false, &[]).await,
        (StatusCode::FORBIDDEN, true)
    );
    type Headers<'a> = &'a [(&'a str, &'a str)];
    let allowed: [(&str, Headers, bool); 4] = [
        ("p-8", &[("origin", "https://ops.example.com")], false),
        ("p-9", &[("origin", "HTTPS://OPS.Example.COM:443")], true),
        ("p-10", &[("sec-fetch-site", "same-origin")], false),
        ("p-11", &[], true),
    ];
    for (key, headers, api) in allowed {
        let (status, left) = remove_with(addr, &store, key, api, headers).await;
        assert!(!left, "{key} {headers:?}: {status}");
        assert!(status.is_success() || status.is_redirection(), "{status}");
    }
    assert_eq!(effects.count(), 12, "the console never runs a handler");
}

/// `Console::origin` given a URI with no origin (no scheme, another scheme) fails closed:
/// no browser's write passes, not even one from the request's own host; a second origin
/// set beside it still works.
#[tokio::test]
async fn s18_console_origin_set_without_an_origin_refuses_every_browser_write() {
    let (addr, store, _) = console_at(&["/idempotency", "ftp://ops.example.com"]).await;
    let own_host: &'static str = Box::leak(format!("http://{addr}").into_boxed_str());
    for key in ["q-1", "q-2"] {
        assert_eq!(
            charge(addr, key, "x").await.status(),
            StatusCode::BAD_GATEWAY
        );
    }
    for headers in [
        &[("origin", own_host)][..],
        &[("origin", "ftp://ops.example.com")],
        &[("sec-fetch-site", "same-origin"), ("origin", own_host)],
    ] {
        assert_eq!(
            remove_with(addr, &store, "q-1", false, headers).await,
            (StatusCode::FORBIDDEN, true),
            "{headers:?}"
        );
    }

    let (addr, store, _) =
        console_at(&["ftp://ops.example.com", "http://ops.example.com:80"]).await;
    assert_eq!(
        charge(addr, "q-3", "x").await.status(),
        StatusCode::BAD_GATEWAY
    );
    let (status, left) = remove_with(
        addr,
        &store,
        "q-3",
        true,
        &[("origin", "http://ops.example.com")],
    )
    .await;
    assert!(!left && status.is_success(), "{status}");
}
