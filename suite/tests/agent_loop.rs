//! Issue 22, the proof in small (the full 10 000 operations are for the example): an
//! orchestrator runs workflow steps through `IdempotentClientLayer` against a real server on
//! loopback, with faults on both sides: handler latency with a tail past a naive client's
//! timeout, replies lost after the server processed the request (a proxy that cuts them),
//! and store outages (503). Effects are counted per operation at the sink. Beside it a naive
//! client (a new key per attempt, a short timeout) runs the same operations, and its
//! duplicates are counted too.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use bytes::Bytes;
use common::faulty::Faulty;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower::ServiceExt;
use tower_idempotency::client::{ClientError, IdempotentClientLayer, OperationKey};
use tower_idempotency::{IdempotencyLayer, MemoryStore};

const OPERATIONS: usize = 240;
const CONCURRENCY: usize = 12;

/// Effects per operation, counted where they happen.
#[derive(Clone, Default)]
struct Sink(Arc<Mutex<HashMap<String, usize>>>);

impl Sink {
    fn hit(&self, op: &str) {
        *self
            .0
            .lock()
            .expect("lock")
            .entry(op.to_owned())
            .or_default() += 1;
    }

    /// Operations with an effect, and effects beyond the first of each.
    fn tally(&self) -> (usize, usize) {
        let effects = self.0.lock().expect("lock");
        let done = effects.len();
        let duplicates = effects.values().map(|n| n - 1).sum();
        (done, duplicates)
    }
}

/// A deterministic stream of numbers: the faults are the same in every run.
fn noise(i: usize) -> u64 {
    let mut x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^ (x >> 29)
}

/// The tool server: a step's effect after 10-60 ms, or 500-700 ms for one in eight (the tail).
fn server(store: Faulty<MemoryStore>, sink: Sink) -> Router {
    Router::new()
        .route(
            "/steps",
            post(move |body: Bytes| {
                let sink = sink.clone();
                async move {
                    let op = String::from_utf8_lossy(&body).into_owned();
                    let n = op
                        .rsplit('-')
                        .next()
                        .and_then(|n| n.parse().ok())
                        .unwrap_or(0);
                    let r = noise(n);
                    let ms = if r.is_multiple_of(8) {
                        500 + r % 200
                    } else {
                        10 + r % 50
                    };
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    sink.hit(&op);
                    (StatusCode::CREATED, format!("done {op}"))
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(store)
                .single_tenant()
                .lease(Duration::from_secs(5)),
        )
}

/// A proxy that loses the reply of every seventh connection once the server has started to
/// answer: the request was processed, the caller never hears.
async fn lossy_proxy(upstream: SocketAddr) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let count = Arc::new(AtomicUsize::new(0));
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let lossy = count.fetch_add(1, Ordering::Relaxed) % 7 == 3;
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    return;
                };
                let (mut client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                let up = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
                });
                let mut buf = vec![0u8; 16 * 1024];
                while let Ok(n) = server_read.read(&mut buf).await {
                    if n == 0 || lossy {
                        // Processed, and the answer dropped on the floor.
                        break;
                    }
                    if client_write.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                up.abort();
            });
        }
    });
    addr
}

type Http = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

fn step(addr: SocketAddr, op: &str) -> http::Request<Full<Bytes>> {
    http::Request::post(format!("http://{addr}/steps"))
        .body(Full::new(Bytes::from(op.to_owned())))
        .expect("request")
}

/// Runs every operation through `run_one`, `CONCURRENCY` at a time.
async fn orchestrate<F, Fut>(run_one: F) -> Vec<Result<(), String>>
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<(), String>> + Send,
{
    let next = Arc::new(AtomicUsize::new(0));
    let results = Arc::new(Mutex::new(Vec::new()));
    let workers: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let (next, results, run_one) = (next.clone(), results.clone(), run_one.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= OPERATIONS {
                        return;
                    }
                    let result = run_one(i).await;
                    results.lock().expect("lock").push(result);
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.expect("worker");
    }
    Arc::try_unwrap(results)
        .map(|m| m.into_inner().expect("lock"))
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s22_an_agent_loop_makes_every_effect_once_where_a_naive_one_duplicates() {
    let store = Faulty::new(MemoryStore::new());
    let sink = Sink::default();
    let server_addr = serve_on(server(store.clone(), sink.clone())).await;
    let proxy = lossy_proxy(server_addr).await;
    // The store goes down for 150 ms in every second: 503s while it is.
    let outages = {
        let store = store.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(850)).await;
                store.down_for(Duration::from_millis(150));
            }
        })
    };

    // Ours: one key per step, attempts that outlast the window, typed stops.
    let layer = IdempotentClientLayer::new()
        .attempt_timeout(Duration::from_secs(2))
        .deadline(Duration::from_secs(60))
        .backoff(Duration::from_millis(20), Duration::from_millis(500));
    let http: Http = Client::builder(TokioExecutor::new()).build_http();
    let run = format!("run-{}", std::process::id());
    let results = orchestrate({
        let (layer, http, run) = (layer.clone(), http.clone(), run.clone());
        move |i| {
            let client = tower::ServiceBuilder::new()
                .layer(layer.clone())
                .service(http.clone());
            let key = OperationKey::step(&run, &format!("op-{i}")).expect("key");
            let op = format!("ours-{i}");
            async move {
                let mut req = step(proxy, &op);
                req.extensions_mut().insert(key);
                match client.oneshot(req).await {
                    Ok(res) if res.status() == StatusCode::CREATED => Ok(()),
                    Ok(res) => Err(format!("{op}: {}", res.status())),
                    Err(ClientError::OutcomeUnknown { key }) => Err(format!("{key}: unknown")),
                    Err(error) => Err(format!("{op}: {error}")),
                }
            }
        }
    })
    .await;
    let failures: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(
        failures.is_empty(),
        "every step ends with its answer: {failures:?}"
    );
    let ours = {
        let effects = sink.0.lock().expect("lock");
        let mine: Vec<_> = effects
            .iter()
            .filter(|(op, _)| op.starts_with("ours-"))
            .collect();
        (mine.len(), mine.iter().map(|(_, n)| **n - 1).sum::<usize>())
    };
    assert_eq!(
        ours,
        (OPERATIONS, 0),
        "every operation once, zero duplicates"
    );

    // Naive: a new key per attempt, a timeout shorter than the slow steps, retried blindly.
    let naive = orchestrate({
        let http = http.clone();
        move |i| {
            let http = http.clone();
            let op = format!("naive-{i}");
            async move {
                for attempt in 0..6 {
                    let mut req = step(proxy, &op);
                    let key = format!("naive-{i}-{attempt}-{}", std::process::id());
                    req.headers_mut()
                        .insert("idempotency-key", key.parse().expect("ascii"));
                    let sent =
                        tokio::time::timeout(Duration::from_millis(300), http.request(req)).await;
                    if let Ok(Ok(res)) = sent
                        && res.status() == StatusCode::CREATED
                    {
                        return Ok(());
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(format!("{op}: gave up"))
            }
        }
    })
    .await;
    outages.abort();
    let (all, duplicates) = sink.tally();
    let naive_duplicates = duplicates - ours.1;
    println!(
        "{OPERATIONS} operations each: ours made {} effects with 0 duplicates; the naive client \
         made {naive_duplicates} duplicates ({} of its steps gave up)",
        ours.0,
        naive.iter().filter(|r| r.is_err()).count()
    );
    assert!(all >= OPERATIONS);
}

async fn serve_on(app: Router) -> SocketAddr {
    common::serve(app).await
}
