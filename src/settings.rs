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
    /// The same, by [`shape`], for the route axum matched.
    pub(crate) shapes: HashMap<String, Arc<RouteConfig>>,
    pub(crate) fingerprint: FingerprintOptions,
    /// The fingerprint schemes of this layer's routes: a record made under one of them was
    /// made by these settings (another route's), not by a replica configured otherwise.
    pub(crate) schemes: Vec<crate::fingerprint::Scheme>,
    pub(crate) denied_headers: Arc<crate::replay::DeniedHeaders>,
    /// The reads of requests woken together by one record's change, shared.
    pub(crate) woken: crate::woken::WokenReads,
}

impl Resolved {
    /// The settings for a request.
    ///
    /// Behind an axum `Router` (its `MatchedPath` is `matched`): a path given literally to
    /// `for_path`, else the route axum matched as it was given (parameter names aside), else,
    /// under a catch-all mount (`nest_service`, tonic's per-service routes), the rest of the
    /// path matched against the templates. Without axum (tonic alone, plain tower) the path is
    /// matched against the templates as axum would. Else the defaults.
    pub(crate) fn route(&self, path: &str, matched: Option<&str>) -> &Arc<RouteConfig> {
        if self.routes.is_empty() {
            return &self.default;
        }
        let by_templates = || {
            self.templates
                .at(path)
                .map_or(&self.default, |found| found.value)
        };
        let Some(matched) = matched else {
            return by_templates();
        };
        if let Some(route) = self.routes.get(path) {
            return route;
        }
        if let Some(route) = self.shapes.get(&shape(matched)) {
            return route;
        }
        let catch_all = matched
            .rsplit('/')
            .next()
            .is_some_and(|last| last.starts_with("{*"));
        if catch_all {
            return by_templates();
        }
        // axum chose another route than any given here: a template that would also match
        // this path (a `{id}` beside the app's literal route) is not its.
        &self.default
    }
}

/// A route template with its parameter names left out (`/a/{}/{*}`): two templates of one
/// shape match the same requests.
pub(crate) fn shape(template: &str) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let Some(close) = rest[open..].find('}') else {
            break;
        };
        let wildcard = rest[open + 1..].starts_with('*');
        out.push_str(if wildcard { "{*}" } else { "{}" });
        rest = &rest[open + close + 1..];
    }
    out.push_str(rest);
    out
}
