//! The request as the client sent it, wherever the layer sits.
//!
//! axum strips a `nest` prefix before the nested router's layers see a request, so a layer
//! inside `/eu` sees `/charge` for `/eu/charge`. Fingerprints and per-path settings must use the
//! path the client sent, or `/eu/charge` and `/us/charge` would share records; axum keeps it in
//! the `OriginalUri` extension, which every axum `Router` sets.
//!
//! Reading it needs this crate's `axum` feature (on by default). Built without it, a layer
//! inside a nested axum router sees only the shortened path: keep the feature on in axum apps,
//! or put the layer on the outer router.

use http::{Extensions, Uri};

/// The URI the client sent: axum's `OriginalUri` where a router set it, else `uri`.
pub(crate) fn sent<'a>(extensions: &'a Extensions, uri: &'a Uri) -> &'a Uri {
    #[cfg(feature = "axum")]
    if let Some(original) = extensions.get::<axum::extract::OriginalUri>() {
        return &original.0;
    }
    #[cfg(not(feature = "axum"))]
    let _ = extensions;
    uri
}

/// The route template axum matched the request to (`MatchedPath`), where a router set it.
pub(crate) fn matched(extensions: &Extensions) -> Option<&str> {
    #[cfg(feature = "axum")]
    if let Some(matched) = extensions.get::<axum::extract::MatchedPath>() {
        return Some(matched.as_str());
    }
    #[cfg(not(feature = "axum"))]
    let _ = extensions;
    None
}
