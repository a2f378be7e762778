//! A redis-server of a test's own (a free port, its own directory, killed by a Drop guard), so
//! that killing connections, sleeping, evicting and reconfiguring touch no other test; and an
//! app whose handler is held at gates, its effects counted at a sink.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use tokio::sync::Semaphore;
use tower_idempotency::store::RedisStore;
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, IdempotencyStore};

use super::{Effects, guard};

// ==== a redis-server of the test's own ==========================================================

/// A redis-server on a free port, without persistence unless `extra` turns it on, killed (and
/// its directory removed) on drop, even when the test fails.
pub struct OwnRedis {
    pub port: u16,
    pub dir: std::path::PathBuf,
    pub child: Option<std::process::Child>,
    /// What it was started with, to start it again on the same port and directory.
    args: Vec<String>,
}

impl OwnRedis {
    /// Starts one with `extra` config arguments; `None` (after `super::unreachable`, which
    /// panics under CI=true) when redis-server cannot be started.
    pub fn start(extra: &[&str]) -> Option<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .ok()?
            .local_addr()
            .ok()?
            .port();
        let dir = std::env::temp_dir().join(unique("own-redis"));
        if let Err(e) = std::fs::create_dir_all(&dir) {
            super::unreachable("a private redis-server (temp dir)", &e);
            return None;
        }
        let mut args: Vec<String> = [
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            dir.to_str().unwrap_or("/tmp"),
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let mut me = Self {
            port,
            dir,
            child: None,
            args,
        };
        me.run().then_some(me)
    }

    /// Starts the server with its arguments and waits for its PING; false (after
    /// `super::unreachable`) when it cannot be started or never answers.
    fn run(&mut self) -> bool {
        let child = match std::process::Command::new("redis-server")
            .args(&self.args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
        {
            Ok(child) => child,
            Err(e) => {
                super::unreachable("a private redis-server (redis-server binary)", &e);
                return false;
            }
        };
        self.child = Some(child);
        let port = self.port;
        for _ in 0..250 {
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                use std::io::{Read, Write};
                let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
                let mut buf = [0u8; 64];
                if s.write_all(b"PING\r\n").is_ok()
                    && s.read(&mut buf)
                        .is_ok_and(|n| buf[..n].starts_with(b"+PONG"))
                {
                    return true;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        super::unreachable("a private redis-server", &"it never answered PING");
        false
    }

    /// Kills the server (SIGKILL: no shutdown save, every connection dropped) and starts it
    /// again on the same port and directory: what it kept on disk (an append-only file) is
    /// all it has.
    pub fn restart(&mut self) {
        self.stop();
        self.start_again();
    }

    /// Kills the server (SIGKILL); [`start_again`](Self::start_again) brings it back.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the stopped server again on the same port and directory.
    pub fn start_again(&mut self) {
        assert!(self.run(), "the private redis-server started again");
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// One admin command on a connection of its own (on `db`), bounded.
    pub async fn cmd_on(&self, db: u8, args: &[&str]) -> redis::RedisResult<redis::Value> {
        let url = format!("{}/{db}", self.url());
        let work = async {
            let mut conn = redis::Client::open(url)?
                .get_multiplexed_async_connection()
                .await?;
            let mut c = redis::cmd(args[0]);
            for a in &args[1..] {
                c.arg(*a);
            }
            c.query_async(&mut conn).await
        };
        guard(&format!("admin {args:?}"), work).await
    }

    pub async fn cmd(&self, args: &[&str]) -> redis::RedisResult<redis::Value> {
        self.cmd_on(0, args).await
    }

    /// What an admin command answers as text (`INFO …`, `CLUSTER INFO`); empty when it fails,
    /// so a loop waiting for a line simply asks again.
    pub async fn text(&self, args: &[&str]) -> String {
        match self.cmd(args).await {
            Ok(redis::Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
            Ok(redis::Value::VerbatimString { text, .. }) => text,
            _ => String::new(),
        }
    }

    /// Kills every client connection of `kind` (`normal`, `pubsub`) but the admin's own: on
    /// this private server, those are the stores' connections only.
    pub async fn kill(&self, kind: &str) -> i64 {
        match self
            .cmd(&["CLIENT", "KILL", "TYPE", kind, "SKIPME", "yes"])
            .await
        {
            Ok(redis::Value::Int(n)) => n,
            other => panic!("CLIENT KILL TYPE {kind}: {other:?}"),
        }
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One section of `server`'s `INFO` (`replication`, `commandstats`).
pub async fn info(server: &OwnRedis, section: &str) -> String {
    server.text(&["INFO", section]).await
}

/// The value of `name` in `INFO` text (its `name:value` line), if there is one.
pub fn field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}

/// A count `INFO section` gives as `name` (`connected_clients`, `blocked_clients`...); 0
/// when it gives none.
pub async fn number(server: &OwnRedis, section: &str, name: &str) -> i64 {
    field(&info(server, section).await, name).map_or(0, |n| n.parse().expect("a count"))
}

/// How many times `command` (lower case) ran, read from `INFO commandstats` text; 0 when it
/// never ran.
pub fn calls(commandstats: &str, command: &str) -> u64 {
    commandstats
        .lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().expect("a count of calls"))
}

pub fn unique(name: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{name}-{}-{nanos}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

// ==== the app: a handler held at gates, effects counted at a sink ===============================

/// The handler's sink and gates. A run enters (`runs`), waits at gate A, marks its effect
/// started if `milestone`, waits at gate B, then does its effect (`effects`).
#[derive(Clone)]
pub struct Sink {
    pub tag: &'static str,
    pub runs: Effects,
    pub effects: Effects,
    pub gate_a: Arc<Semaphore>,
    pub gate_b: Arc<Semaphore>,
    pub milestone: bool,
    /// What `effect_started()` answered, in order.
    pub milestones: Arc<Mutex<Vec<String>>>,
}

impl Sink {
    pub fn new(tag: &'static str, milestone: bool) -> Self {
        Self {
            tag,
            runs: Effects::default(),
            effects: Effects::default(),
            gate_a: Arc::new(Semaphore::new(0)),
            gate_b: Arc::new(Semaphore::new(0)),
            milestone,
            milestones: Arc::default(),
        }
    }

    /// Gates left open.
    pub fn open(tag: &'static str, milestone: bool) -> Self {
        let s = Self::new(tag, milestone);
        s.gate_a.add_permits(10_000);
        s.gate_b.add_permits(10_000);
        s
    }
}

pub async fn pass(gate: &Semaphore) -> bool {
    match tokio::time::timeout(Duration::from_secs(40), gate.acquire()).await {
        Ok(Ok(permit)) => {
            permit.forget();
            true
        }
        _ => false,
    }
}

pub async fn handle(sink: Sink, ctx: IdempotencyContext) -> (axum::http::StatusCode, String) {
    use axum::http::StatusCode;
    let run = sink.runs.hit();
    if !pass(&sink.gate_a).await {
        return (StatusCode::INTERNAL_SERVER_ERROR, "gate a".into());
    }
    if sink.milestone {
        let r = ctx.effect_started().await;
        sink.milestones
            .lock()
            .expect("lock")
            .push(format!("run {run}: {r:?}"));
        if r.is_err() {
            // Nothing done: the effect needs its milestone first.
            return (StatusCode::SERVICE_UNAVAILABLE, "no milestone".into());
        }
    }
    if !pass(&sink.gate_b).await {
        return (StatusCode::INTERNAL_SERVER_ERROR, "gate b".into());
    }
    let n = sink.effects.hit();
    (
        StatusCode::CREATED,
        format!(
            "{} effect {n} run {run} attempt {}",
            sink.tag,
            ctx.attempt()
        ),
    )
}

#[derive(Clone)]
pub struct Knobs {
    pub lease: Duration,
    pub wait: Option<Duration>,
    pub external: bool,
}

impl Default for Knobs {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(5),
            wait: None,
            external: false,
        }
    }
}

pub fn app<St: IdempotencyStore>(store: St, sink: &Sink, knobs: &Knobs) -> Router {
    let sink = sink.clone();
    let mut layer = IdempotencyLayer::new(store)
        .single_tenant()
        .lease(knobs.lease)
        .external_effects(knobs.external);
    if let Some(wait) = knobs.wait {
        layer = layer.wait_for_in_flight(wait);
    }
    Router::new()
        .route(
            "/pay",
            post(move |ctx: IdempotencyContext| {
                let sink = sink.clone();
                async move { handle(sink, ctx).await }
            }),
        )
        .layer(layer)
}

#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub replayed: bool,
    pub body: String,
    pub problem: Option<String>,
}

impl Answer {
    pub fn live_201(&self) -> bool {
        self.status == 201 && !self.replayed
    }
    pub fn replay_201(&self) -> bool {
        self.status == 201 && self.replayed
    }
}

pub async fn send(addr: SocketAddr, key: &str) -> Answer {
    let res = super::client()
        .post(format!("http://{addr}/pay"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(r#"{"amount":10}"#)
        .send()
        .await
        .expect("request (the client gives up after 30 s: a hang)");
    let status = res.status().as_u16();
    let replayed = res
        .headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let is_problem = res
        .headers()
        .get("content-type")
        .is_some_and(|v| v == "application/problem+json");
    let body = res.text().await.unwrap_or_default();
    let problem = is_problem
        .then(|| {
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            v["type"].as_str().map(|t| {
                t.trim_start_matches("urn:tower-idempotency:problem:")
                    .to_owned()
            })
        })
        .flatten();
    Answer {
        status,
        replayed,
        body,
        problem,
    }
}

/// Sends `key` until it is answered with something other than 409 (at most 200 tries, 50 ms
/// apart), and returns that answer.
pub async fn settled(addr: SocketAddr, key: &str) -> Answer {
    settled_past(addr, key, &[409], |_| {}).await
}

/// Sends `key` until it is answered with a status not in `waits` (at most 200 tries, 50 ms
/// apart), every answer on the way checked by `seen`, and returns that answer.
pub async fn settled_past(
    addr: SocketAddr,
    key: &str,
    waits: &[u16],
    seen: impl Fn(&Answer),
) -> Answer {
    let mut last = None;
    for _ in 0..200 {
        let a = send(addr, key).await;
        seen(&a);
        if !waits.contains(&a.status) {
            return a;
        }
        last = Some(a);
        tokio::time::sleep(ms(50)).await;
    }
    panic!("{key} still answered {waits:?} after 200 tries: {last:?}");
}

pub async fn store_on(url: &str, prefix: Option<&str>) -> RedisStore {
    let store = guard("connect", RedisStore::connect(url))
        .await
        .expect("connect to the private redis-server");
    match prefix {
        Some(p) => store.with_prefix(p).expect("prefix"),
        None => store,
    }
}

pub async fn started(sink: &Sink, n: usize) {
    super::until("the handler started", || sink.runs.count() >= n).await;
}
