//! The processing windows as a JSON document, for callers to read before they call.

use std::convert::Infallible;
use std::fmt;
use std::future::{Ready, ready};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use serde_json::{Value, json};
use tower_service::Service;

use crate::layer::IdempotencyLayer;
use crate::window::ProcessingWindow;

/// Serves a layer's processing windows as one JSON document, `{"windows": [...]}` (each as
/// [`ProcessingWindow::to_json`]), for callers to read before they call: mount it where they
/// look, e.g. `/.well-known/idempotency`. `GET` and `HEAD` only; never cached for long, since
/// a window moves with its route.
///
/// ```
/// use axum::Router;
/// use tower_idempotency::{IdempotencyLayer, MemoryStore, WindowsService};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new()).single_tenant();
/// let app: Router = Router::new()
///     .route_service("/.well-known/idempotency", WindowsService::new(&layer))
///     .layer(layer);
/// ```
pub struct WindowsService<St, M> {
    layer: IdempotencyLayer<St, M>,
}

impl<St, M: Clone> Clone for WindowsService<St, M> {
    fn clone(&self) -> Self {
        Self {
            layer: self.layer.clone(),
        }
    }
}

impl<St, M> fmt::Debug for WindowsService<St, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WindowsService").finish_non_exhaustive()
    }
}

impl<St, M: Clone> WindowsService<St, M> {
    /// Serves the windows of `layer` (and of every service it makes: they share them).
    pub fn new(layer: &IdempotencyLayer<St, M>) -> Self {
        Self {
            layer: layer.clone(),
        }
    }
}

impl<St, M, B> Service<Request<B>> for WindowsService<St, M> {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let mut res = Response::new(Full::new(Bytes::new()));
        if req.method() != Method::GET && req.method() != Method::HEAD {
            *res.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
            res.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
            return ready(Ok(res));
        }
        let windows: Vec<Value> = self
            .layer
            .processing_windows()
            .iter()
            .map(ProcessingWindow::to_json)
            .collect();
        let document = json!({ "windows": windows }).to_string();
        let headers = res.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(
            header::CACHE_CONTROL,
            HeaderValue::from_static("max-age=10"),
        );
        if req.method() == Method::GET {
            *res.body_mut() = Full::new(Bytes::from(document));
        }
        ready(Ok(res))
    }
}
