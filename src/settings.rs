//! The settings a service runs with: the layer's configuration, resolved once.

use std::collections::HashMap;
use std::sync::Arc;

use http::HeaderName;

use crate::fingerprint::FingerprintOptions;
use crate::route::RouteConfig;

/// The configuration a service runs with, resolved once per `Layer::layer`.
#[derive(Debug)]
pub(crate) struct Resolved {
    pub(crate) header: HeaderName,
    pub(crate) default: Arc<RouteConfig>,
    /// Every `for_path`, by the text it was given (a path or a template).
    pub(crate) routes: HashMap<String, Arc<RouteConfig>>,
    /// The same, matched as axum matches routes (`{id}`, `{*rest}`), for requests that come
    /// without axum's `MatchedPath`.
    pub(crate) templates: matchit::Router<Arc<RouteConfig>>,
    pub(crate) fingerprint: FingerprintOptions,
    pub(crate) denied_headers: Arc<[HeaderName]>,
}

impl Resolved {
    /// The settings for a request: those given for the route axum matched (its template, as
    /// in `Router::route`), else for this exact path; without axum's `MatchedPath` (tonic, a
    /// plain tower stack), the path is matched against the templates as axum would; else the
    /// defaults.
    pub(crate) fn route(&self, path: &str, matched: Option<&str>) -> &Arc<RouteConfig> {
        if self.routes.is_empty() {
            return &self.default;
        }
        if let Some(matched) = matched {
            // axum chose the route: another template that would also match this path (a
            // `{id}` where the app has a literal route) must not apply.
            return self
                .routes
                .get(matched)
                .or_else(|| self.routes.get(path))
                .unwrap_or(&self.default);
        }
        match self.templates.at(path) {
            Ok(found) => found.value,
            Err(_) => &self.default,
        }
    }
}
