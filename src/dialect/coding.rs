//! Content codings: a recorded answer is kept in the identity coding, and a replay never
//! reaches a client in a coding it did not accept.
//!
//! Compression is negotiated per call (`Accept-Encoding`; gRPC's `grpc-accept-encoding`), but a
//! recorded answer is replayed to every retry, whatever each one accepts. So a guarded request
//! reaches its handler asking for the identity coding only, and the answer is recorded
//! uncompressed: every client can read it. Compression belongs outside this layer (a
//! compression layer wrapping it compresses live answers and replays alike, per call).
//!
//! An answer that is compressed all the same (a handler that sets `Content-Encoding` itself, or
//! a record kept before this rule) is replayed only to a retry that accepts its coding; any
//! other retry gets `encoding-not-accepted` (406, or gRPC `FAILED_PRECONDITION`), which names
//! the coding to accept. The operation is not run again.

use http::{HeaderMap, HeaderName, HeaderValue, header};

/// gRPC's per-call list of the message codings a client can read.
static GRPC_ACCEPT_ENCODING: HeaderName = HeaderName::from_static("grpc-accept-encoding");
/// The coding of a gRPC answer's messages.
static GRPC_ENCODING: HeaderName = HeaderName::from_static("grpc-encoding");

/// Makes an HTTP request ask for its answer in the identity coding.
pub(crate) fn ask_identity_http(headers: &mut HeaderMap) {
    headers.insert(
        header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
}

/// Makes a gRPC call ask for uncompressed messages: without `grpc-accept-encoding` a server
/// may only send identity.
pub(crate) fn ask_identity_grpc(headers: &mut HeaderMap) {
    headers.remove(&GRPC_ACCEPT_ENCODING);
}

/// The comma-separated items of every value of `name`, trimmed, empty ones skipped.
fn items<'a>(headers: &'a HeaderMap, name: &HeaderName) -> impl Iterator<Item = &'a str> {
    crate::lines::get_all(headers, name)
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(str::trim)
        .filter(|item| !item.is_empty())
}

/// The first coding of a recorded HTTP answer (`Content-Encoding`) that a retry's
/// `Accept-Encoding` does not accept (RFC 9110 §12.5.3: no header accepts everything; a
/// coding is accepted when it is listed, or `*` is, with a weight above zero).
pub(crate) fn unaccepted_http(request: &HeaderMap, stored: &HeaderMap) -> Option<String> {
    let mut codings = items(stored, &header::CONTENT_ENCODING)
        .filter(|coding| !coding.eq_ignore_ascii_case("identity"))
        .peekable();
    codings.peek()?;
    if !request.contains_key(header::ACCEPT_ENCODING) {
        return None;
    }
    // The weight the retry gives a coding: its own entry's, else `*`'s, else none.
    let weight = |coding: &str| {
        let mut star = None;
        for item in items(request, &header::ACCEPT_ENCODING) {
            let mut parts = item.split(';');
            let name = parts.next().unwrap_or_default().trim();
            let positive = parts
                .filter_map(|p| p.trim().strip_prefix("q=").or(p.trim().strip_prefix("Q=")))
                .all(|q| q.trim().parse::<f32>().map_or(true, |q| q > 0.0));
            if same_coding(name, coding) {
                return positive;
            }
            if name == "*" {
                star = Some(positive);
            }
        }
        star.unwrap_or(false)
    };
    codings.find(|coding| !weight(coding)).map(str::to_owned)
}

/// Coding names compare without case; `x-gzip` is `gzip` (RFC 9110 §8.4.1.3).
fn same_coding(a: &str, b: &str) -> bool {
    let plain = |c: &str| {
        let c = c.strip_prefix("x-").or(c.strip_prefix("X-")).unwrap_or(c);
        c.eq_ignore_ascii_case("gzip").then_some("gzip")
    };
    a.eq_ignore_ascii_case(b) || (plain(a).is_some() && plain(a) == plain(b))
}

/// The message coding of a recorded gRPC answer (`grpc-encoding`) when the retry does not
/// list it in `grpc-accept-encoding` (without it, a client reads identity alone).
pub(crate) fn unaccepted_grpc(request: &HeaderMap, stored: &HeaderMap) -> Option<String> {
    let coding = stored.get(&GRPC_ENCODING)?.to_str().unwrap_or("?").trim();
    if coding.eq_ignore_ascii_case("identity")
        || items(request, &GRPC_ACCEPT_ENCODING).any(|c| c.eq_ignore_ascii_case(coding))
    {
        return None;
    }
    Some(coding.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_static(value));
        }
        map
    }

    #[test]
    fn an_http_retry_gets_a_coding_it_accepts_and_no_other() {
        let gzip = headers(&[("content-encoding", "gzip")]);
        let cases: &[(&[(&str, &str)], bool)] = &[
            (&[], true),
            (&[("accept-encoding", "gzip")], true),
            (&[("accept-encoding", "br, GZIP;q=0.5")], true),
            (&[("accept-encoding", "x-gzip")], true),
            (&[("accept-encoding", "*")], true),
            (
                &[("accept-encoding", "br"), ("accept-encoding", "gzip")],
                true,
            ),
            (&[("accept-encoding", "")], false),
            (&[("accept-encoding", "identity")], false),
            (&[("accept-encoding", "br, deflate")], false),
            (&[("accept-encoding", "gzip;q=0")], false),
            (&[("accept-encoding", "gzip; q=0.000")], false),
            (&[("accept-encoding", "*, gzip;q=0")], false),
            (&[("accept-encoding", "*;q=0")], false),
        ];
        for (request, accepted) in cases {
            let mut map = HeaderMap::new();
            for (name, value) in request.iter() {
                map.append(*name, HeaderValue::from_str(value).expect("value"));
            }
            let refused = unaccepted_http(&map, &gzip);
            assert_eq!(refused.is_none(), *accepted, "{request:?}");
            if !accepted {
                assert_eq!(refused.as_deref(), Some("gzip"));
            }
        }
        // Identity, or no coding at all, reaches anyone.
        let strict = headers(&[("accept-encoding", "br;q=0")]);
        assert_eq!(unaccepted_http(&strict, &HeaderMap::new()), None);
        assert_eq!(
            unaccepted_http(&strict, &headers(&[("content-encoding", "identity")])),
            None
        );
        // Every coding of a list must be accepted.
        let both = headers(&[("content-encoding", "gzip, br")]);
        assert_eq!(
            unaccepted_http(&headers(&[("accept-encoding", "gzip")]), &both).as_deref(),
            Some("br")
        );
    }

    #[test]
    fn a_grpc_retry_gets_a_message_coding_it_lists_and_no_other() {
        let gzip = headers(&[("grpc-encoding", "gzip")]);
        assert_eq!(
            unaccepted_grpc(&HeaderMap::new(), &gzip).as_deref(),
            Some("gzip")
        );
        let zstd = headers(&[("grpc-accept-encoding", "zstd")]);
        assert_eq!(unaccepted_grpc(&zstd, &gzip).as_deref(), Some("gzip"));
        let listed = headers(&[("grpc-accept-encoding", "zstd,gzip")]);
        assert_eq!(unaccepted_grpc(&listed, &gzip), None);
        let identity = headers(&[("grpc-encoding", "identity")]);
        assert_eq!(unaccepted_grpc(&HeaderMap::new(), &identity), None);
        assert_eq!(unaccepted_grpc(&HeaderMap::new(), &HeaderMap::new()), None);
    }

    #[test]
    fn a_guarded_call_asks_for_identity() {
        let mut http = headers(&[("accept-encoding", "gzip, br")]);
        ask_identity_http(&mut http);
        assert_eq!(http.get_all("accept-encoding").iter().count(), 1);
        assert_eq!(http["accept-encoding"], "identity");
        let mut grpc = headers(&[("grpc-accept-encoding", "gzip")]);
        ask_identity_grpc(&mut grpc);
        assert!(!grpc.contains_key("grpc-accept-encoding"));
    }
}
