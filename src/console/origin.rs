//! Cross-site request forgery: writes come from the console's own pages, or not at all.

use axum::body::{Body, Bytes};
use axum::extract::Request;
use http::{HeaderMap, Response, StatusCode, header};

use super::respond::problem;

/// An origin as one text, to compare: `http` or `https` only, no user info, the host in
/// lower case, a default port left out (`Host: x:80` and `Origin: http://x` name one origin).
pub(super) fn origin_of(scheme: &str, authority: &str) -> Option<String> {
    let scheme = scheme.to_ascii_lowercase();
    let default_port = match scheme.as_str() {
        "http" => ":80",
        "https" => ":443",
        _ => return None,
    };
    if authority.is_empty() || authority.contains(['@', '/', '?', '#']) {
        return None;
    }
    let host = authority.strip_suffix(default_port).unwrap_or(authority);
    Some(format!("{scheme}://{}", host.to_ascii_lowercase()))
}

/// Whether a browser says `req` comes from the console's own origin.
///
/// With origins set ([`Console::origin`]), an `Origin` must be one of them, and without one
/// `Sec-Fetch-Site` must say `same-origin`. Otherwise: `Sec-Fetch-Site`, or without it an
/// `Origin` of the request's host. An origin is its scheme too: only `http` and `https`
/// pages can be the console's, and where the request names its scheme (HTTP/2, an absolute
/// URI) the origin's must be it. Over HTTP/1.1 the scheme is not sent, so a page of the same
/// host and port over the other scheme passes; `Sec-Fetch-Site`, which every current browser
/// sends, tells them apart.
pub(super) fn same_origin(req: &Request, origins: &[Option<String>]) -> bool {
    let headers = req.headers();
    let site = headers.get("sec-fetch-site");
    let origin = headers.get(header::ORIGIN).map(|o| {
        o.to_str()
            .ok()
            .and_then(|o| o.split_once("://"))
            .and_then(|(scheme, authority)| origin_of(scheme, authority))
    });
    if !origins.is_empty() {
        return match origin {
            Some(origin) => origin.is_some() && origins.contains(&origin),
            None => site.is_some_and(|site| site == "same-origin"),
        };
    }
    if let Some(site) = site {
        return site == "same-origin";
    }
    // The host as sent: its header, or (HTTP/2) the request's authority.
    let host = match headers.get(header::HOST) {
        Some(host) => host.to_str().ok(),
        None => req.uri().authority().map(|a| a.as_str()),
    };
    let (Some(Some(origin)), Some(host)) = (origin, host) else {
        return false;
    };
    let Some((scheme, _)) = origin.split_once("://") else {
        return false;
    };
    if req.uri().scheme_str().is_some_and(|sent| sent != scheme) {
        return false;
    }
    origin_of(scheme, host).is_some_and(|host| host == origin)
}

pub(super) fn forbidden() -> Response<Body> {
    problem(
        StatusCode::FORBIDDEN,
        "this write does not come from the console's own origin (Sec-Fetch-Site or Origin): \
         refused as a possible cross-site request",
    )
}

pub(super) async fn read_body(req: Request) -> Result<(HeaderMap, Bytes), Response<Body>> {
    let (parts, body) = req.into_parts();
    match axum::body::to_bytes(body, 1 << 20).await {
        Ok(bytes) => Ok((parts.headers, bytes)),
        Err(_) => Err(problem(
            StatusCode::PAYLOAD_TOO_LARGE,
            "the request body is over 1 MiB",
        )),
    }
}
