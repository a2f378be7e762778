//! The floor: the least an idempotency middleware can do for a request, written as plainly as
//! tower allows, to measure how far below the bare handler any such middleware must sit.
//!
//! It buffers the body, hashes method, path and body with SHA-256, claims the key in a sharded
//! `HashMap` under a mutex, runs the handler, buffers its response and keeps status, content
//! type and body for replays. Nothing else: no expiry, no leases or fencing, no policy, no
//! problem documents, no replay mark, no metrics or tracing, no canonical JSON, no protocol
//! detection. It is a measuring stick, not something to deploy.
//!
//! [`FloorLayer::unhashed`] is the same floor with fingerprinting made (nearly) free: it keeps
//! a copy of the request's method, path and body and compares them on a retry, as a middleware
//! could that spends a kilobyte of memory per record instead of SHA-256. It shows which targets
//! hashing alone puts out of reach.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::BodyExt;
use sha2::{Digest, Sha256};
use tower::{Layer, Service, ServiceExt};

const SHARDS: usize = 64;

/// What a retry is compared with.
enum Print {
    Sha256([u8; 32]),
    Request(http::Method, Box<str>, Bytes),
}

impl Print {
    fn of(sha: Option<[u8; 32]>, parts: &http::request::Parts, body: &Bytes) -> Self {
        match sha {
            Some(sha) => Self::Sha256(sha),
            // Copies: the body and the URI share the connection's read buffer, which a record
            // must not pin.
            None => Self::Request(
                parts.method.clone(),
                parts.uri.path().into(),
                Bytes::copy_from_slice(body),
            ),
        }
    }

    fn matches(&self, sha: Option<&[u8; 32]>, parts: &http::request::Parts, body: &[u8]) -> bool {
        match (self, sha) {
            (Self::Sha256(kept), Some(sha)) => kept == sha,
            (Self::Request(method, path, kept), None) => {
                *method == parts.method && **path == *parts.uri.path() && kept[..] == *body
            }
            _ => false,
        }
    }
}

enum Slot {
    Running,
    Done {
        fingerprint: Print,
        status: StatusCode,
        content_type: Option<HeaderValue>,
        body: Bytes,
    },
}

struct Table {
    hasher: RandomState,
    shards: Vec<Mutex<HashMap<Arc<str>, Slot>>>,
    /// SHA-256 fingerprints, or copies of the requests ([`FloorLayer::unhashed`]).
    hash: bool,
}

impl Table {
    fn shard(&self, key: &str) -> &Mutex<HashMap<Arc<str>, Slot>> {
        &self.shards[(self.hasher.hash_one(key) >> 40) as usize % SHARDS]
    }
}

/// The floor middleware's layer.
#[derive(Clone)]
pub(crate) struct FloorLayer {
    table: Arc<Table>,
}

impl FloorLayer {
    /// The floor: requests fingerprinted with SHA-256.
    pub(crate) fn new() -> Self {
        Self::with(true)
    }

    /// The floor without hashing: each record keeps a copy of its request to compare retries
    /// with.
    pub(crate) fn unhashed() -> Self {
        Self::with(false)
    }

    fn with(hash: bool) -> Self {
        Self {
            table: Arc::new(Table {
                hasher: RandomState::new(),
                shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
                hash,
            }),
        }
    }
}

impl<S> Layer<S> for FloorLayer {
    type Service = Floor<S>;

    fn layer(&self, inner: S) -> Floor<S> {
        Floor {
            inner,
            table: self.table.clone(),
        }
    }
}

/// The floor middleware.
#[derive(Clone)]
pub(crate) struct Floor<S> {
    inner: S,
    table: Arc<Table>,
}

fn status(status: StatusCode) -> Response<Body> {
    let mut response = Response::new(Body::empty());
    *response.status_mut() = status;
    response
}

impl<S> Service<Request<Body>> for Floor<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // The ready clone serves this call (tower's usual swap).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let table = self.table.clone();
        Box::pin(async move {
            let Some(key) = request
                .headers()
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .map(Arc::<str>::from)
            else {
                return inner.oneshot(request).await;
            };
            let (parts, body) = request.into_parts();
            let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
                return Ok(status(StatusCode::BAD_REQUEST));
            };
            let sha = table.hash.then(|| {
                let mut sha = Sha256::new();
                sha.update(parts.method.as_str());
                sha.update(parts.uri.path());
                sha.update(&body);
                sha.finalize().into()
            });
            let shard = table.shard(&key);
            {
                let mut map = shard.lock().expect("shard");
                match map.get(&key) {
                    Some(Slot::Running) => return Ok(status(StatusCode::CONFLICT)),
                    Some(Slot::Done { fingerprint, .. })
                        if !fingerprint.matches(sha.as_ref(), &parts, &body) =>
                    {
                        return Ok(status(StatusCode::UNPROCESSABLE_ENTITY));
                    }
                    Some(Slot::Done {
                        status,
                        content_type,
                        body,
                        ..
                    }) => {
                        let mut response = Response::new(Body::from(body.clone()));
                        *response.status_mut() = *status;
                        if let Some(value) = content_type {
                            response
                                .headers_mut()
                                .insert(header::CONTENT_TYPE, value.clone());
                        }
                        return Ok(response);
                    }
                    None => {
                        map.insert(key.clone(), Slot::Running);
                    }
                }
            }
            let fingerprint = Print::of(sha, &parts, &body);
            let response = inner
                .oneshot(Request::from_parts(parts, Body::from(body)))
                .await?;
            let (parts, body) = response.into_parts();
            let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
                shard.lock().expect("shard").remove(&key);
                return Ok(status(StatusCode::INTERNAL_SERVER_ERROR));
            };
            shard.lock().expect("shard").insert(
                key,
                Slot::Done {
                    fingerprint,
                    status: parts.status,
                    content_type: parts.headers.get(header::CONTENT_TYPE).cloned(),
                    body: body.clone(),
                },
            );
            Ok(Response::from_parts(parts, Body::from(body)))
        })
    }
}
