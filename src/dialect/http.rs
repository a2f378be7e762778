//! Plain HTTP: the key in a header, the fingerprint over method, path, query, media type and
//! body, outcomes classified by status, refusals as `application/problem+json`.
//!
//! gRPC requests are read the same way (the key in a header, the body as sent); only their
//! outcomes and refusals speak gRPC ([`super::grpc`]).

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode, header, request::Parts};
use http_body::Body;
use http_body_util::BodyExt;

use crate::body::{Gathered, ResponseBody};
use crate::fingerprint::{Fingerprint, FingerprintOptions, JsonFields, fingerprint_fields};
use crate::key::{KeyError, ScopedKey, parse_key};
use crate::observe::{self, Event};
use crate::problem::{Problem, ProblemKind};
use crate::scope::{MakeScope, MissingScope};
use crate::store::BoxError;

/// What a fingerprint mismatch tells the client its request differs in.
pub(crate) const COVERS: &str = "method, path, query, content type or body";

/// What reading a request needs from its route and its layer.
pub(crate) struct Reading<'a, M> {
    pub(crate) header: &'a HeaderName,
    pub(crate) require_key: bool,
    pub(crate) json_fields: Option<&'a JsonFields>,
    pub(crate) fingerprint: &'a FingerprintOptions,
    /// The route's fingerprint scheme (computed when the layer was built).
    pub(crate) scheme: crate::fingerprint::Scheme,
    pub(crate) make_scope: &'a M,
}

/// A refusal before anything was claimed: the problem, whom it answers (`R`, as the dialect
/// knows it) and the counter it adds to.
pub(crate) struct Refusal<R> {
    pub(crate) problem: Problem,
    pub(crate) reply: R,
    pub(crate) counted: Option<Event>,
}

impl<R> Refusal<R> {
    pub(crate) fn map_reply<T>(self, f: impl FnOnce(R) -> T) -> Refusal<T> {
        Refusal {
            problem: self.problem,
            reply: f(self.reply),
            counted: self.counted,
        }
    }
}

/// What steps 1–4 made of a request, once its body is read.
pub(crate) enum Admitted<R> {
    /// Guard it under this key and fingerprint.
    Guard {
        key: ScopedKey,
        fingerprint: Fingerprint,
        reply: R,
    },
    /// Not asked to be guarded: hand the (read) body on.
    PassThrough,
    Refuse(Refusal<R>),
    /// Refused once its key was read (its body could not be fingerprinted): the key may have
    /// run already (under another version or replica that read the body), so what became of
    /// it is read before the answer.
    RefuseKeyed(Refusal<R>, ScopedKey),
}

/// Steps 1–2 for a request whose key is in a header (HTTP and gRPC): its scoped key, or `None`
/// when it has none and the route lets it through.
pub(crate) fn key<M: MakeScope>(
    reading: &Reading<'_, M>,
    parts: &Parts,
) -> Result<Option<ScopedKey>, Refusal<()>> {
    let key = match parse_key(&parts.headers, reading.header) {
        Ok(Some(key)) => key,
        Ok(None) if !reading.require_key => return Ok(None),
        Ok(None) => return Err(refuse_key(&KeyError::Missing, ())),
        Err(error) => return Err(refuse_key(&error, ())),
    };
    observe::count(Event::Attempt);
    match reading.make_scope.make_scope(parts) {
        Ok(scope) => Ok(Some(ScopedKey::new(scope, key))),
        Err(missing) => Err(refuse_scope(&missing, ())),
    }
}

/// Step 4 for HTTP and gRPC, once step 3 read the body.
pub(crate) fn fingerprint<M>(
    reading: &Reading<'_, M>,
    parts: &Parts,
    trailers: Option<&HeaderMap>,
    bytes: &[u8],
    recorded: Option<&Fingerprint>,
) -> Result<Fingerprint, Refusal<()>> {
    let (options, fields, scheme) = (reading.fingerprint, reading.json_fields, reading.scheme);
    fingerprint_fields(parts, trailers, bytes, options, fields, recorded, scheme).map_err(|error| {
        // The application's canonicaliser panicked: the server's fault, not the body's.
        let kind = match error.panicked() {
            true => ProblemKind::FingerprintFailed,
            false => ProblemKind::BodyMalformed,
        };
        refuse_body(Problem::new(kind, error.to_string()), ())
    })
}

pub(crate) fn refuse_key<R>(error: &KeyError, reply: R) -> Refusal<R> {
    let kind = match error {
        KeyError::Missing => ProblemKind::KeyMissing,
        _ => ProblemKind::KeyInvalid,
    };
    Refusal {
        problem: Problem::new(kind, error.to_string()),
        reply,
        counted: Some(Event::KeyRejected),
    }
}

/// The app is wired wrong: the server's fault, logged as such, and nothing runs.
pub(crate) fn refuse_scope<R>(missing: &MissingScope, reply: R) -> Refusal<R> {
    tracing::error!(%missing, "misconfiguration: the request has no scope");
    Refusal {
        problem: Problem::new(ProblemKind::ScopeMissing, missing.to_string()),
        reply,
        counted: None,
    }
}

pub(crate) fn refuse_body<R>(problem: Problem, reply: R) -> Refusal<R> {
    Refusal {
        problem,
        reply,
        counted: Some(Event::BodyRejected),
    }
}

/// Step 3: the whole body, and its trailers if any (the inner service gets them as sent, and
/// they count in the fingerprint), or why not.
pub(crate) async fn buffer<B>(
    parts: &Parts,
    body: B,
    limit: usize,
) -> Result<(Bytes, Option<Box<HeaderMap>>), Problem>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let declared = crate::lines::get(&parts.headers, &header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(too_large(limit));
    }
    let mut body = std::pin::pin!(body);
    let mut data = Gathered::default();
    let mut trailers: Option<Box<HeaderMap>> = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| unreadable(error.into()))?;
        match frame.into_data() {
            Ok(chunk) => {
                if data.len() + chunk.len() > limit {
                    return Err(too_large(limit));
                }
                data.push(chunk);
            }
            // More than one trailers frame: kept together, in order.
            Err(frame) => match (frame.into_trailers(), &mut trailers) {
                (Ok(more), Some(kept)) => {
                    for (name, value) in &more {
                        kept.append(name.clone(), value.clone());
                    }
                }
                (Ok(first), None) => trailers = Some(Box::new(first)),
                (Err(_unknown), _) => {}
            },
        }
    }
    Ok((data.freeze(), trailers))
}

/// A request body over the route's `limit`.
pub(crate) fn too_large(limit: usize) -> Problem {
    Problem::new(
        ProblemKind::BodyTooLarge,
        format!("the request body is larger than this endpoint's limit of {limit} bytes"),
    )
}

/// A request body whose stream failed; one cut by a length limit set before this layer
/// (tower-http's `RequestBodyLimitLayer`, axum's `DefaultBodyLimit`: `http_body_util::Limited`
/// under both) is too large, as the app answers it without the layer.
pub(crate) fn unreadable(error: BoxError) -> Problem {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error.as_ref());
    while let Some(error) = cause {
        if error.is::<http_body_util::LengthLimitError>() {
            return Problem::new(
                ProblemKind::BodyTooLarge,
                "the request body is larger than a limit this endpoint sets before reading it",
            );
        }
        cause = error.source();
    }
    Problem::new(
        ProblemKind::BodyUnreadable,
        format!("the request body could not be read: {error}"),
    )
}

/// Whether an HTTP status is an answer about the operation rather than a failure a retry may
/// get past (DESIGN §3).
pub(crate) fn is_definitive(status: StatusCode) -> bool {
    let s = status.as_u16();
    // A POST answered 303 See Other (post/redirect/get), 302 or 301 did its work. Not so
    // 307 and 308 (send the same request again, there), 300, 304 or 305.
    (200..300).contains(&s)
        || matches!(s, 301..=303)
        || ((400..500).contains(&s) && !matches!(s, 408 | 409 | 425 | 429))
}

/// A refusal as `application/problem+json` (RFC 9457), with `Retry-After` where a retry helps.
pub(crate) fn problem_response<B>(problem: &Problem) -> Response<ResponseBody<B>> {
    let body = Bytes::from(problem.to_json().to_string());
    let mut res = Response::new(ResponseBody::full(body, None));
    *res.status_mut() = problem.kind.status();
    let headers = res.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    if let Some(seconds) = problem.retry_after {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    res
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use http_body::Frame;

    use super::*;

    /// A body that yields the frames it is given, in order (hyper never sends two trailer
    /// frames; another body may).
    struct Frames(VecDeque<Frame<Bytes>>);

    impl Body for Frames {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Ready(self.0.pop_front().map(Ok))
        }
    }

    fn trailers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(name, value)| {
                (
                    HeaderName::from_static(name),
                    HeaderValue::from_static(value),
                )
            })
            .collect()
    }

    /// DESIGN §1 step 3: the buffered body keeps its trailers, every frame of them in order
    /// (a name in two frames keeps both values), and data after them still counts.
    #[tokio::test]
    async fn every_trailers_frame_is_kept_in_order() {
        let (parts, ()) = http::Request::new(()).into_parts();
        let body = Frames(VecDeque::from([
            Frame::data(Bytes::from_static(b"ab")),
            Frame::trailers(trailers(&[("x-sum", "1"), ("x-a", "a")])),
            Frame::trailers(trailers(&[("x-sum", "2")])),
            Frame::data(Bytes::from_static(b"c")),
        ]));
        let (data, kept) = buffer(&parts, body, 16).await.expect("buffered");
        assert_eq!(&data[..], b"abc");
        let kept = kept.expect("trailers");
        let sums: Vec<_> = kept.get_all("x-sum").iter().collect();
        assert_eq!(sums, ["1", "2"]);
        assert_eq!(kept["x-a"], "a");

        let body = Frames(VecDeque::from([Frame::data(Bytes::from_static(b"ab"))]));
        let (data, kept) = buffer(&parts, body, 16).await.expect("buffered");
        assert_eq!((&data[..], kept), (&b"ab"[..], None));
    }

    /// A body cut by a length limit set before the layer is too large, not unreadable (as the
    /// error, or as the source of a framework's own); any other failure is unreadable.
    #[tokio::test]
    async fn a_length_limit_before_the_layer_is_too_large() {
        #[derive(Debug)]
        struct Wrapped(BoxError);
        impl std::fmt::Display for Wrapped {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("the body failed")
            }
        }
        impl std::error::Error for Wrapped {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&*self.0)
            }
        }
        let limited = || async {
            let body = http_body_util::Full::new(Bytes::from_static(b"abc"));
            let limited = http_body_util::Limited::new(body, 1);
            limited.collect().await.expect_err("over the limit")
        };
        assert_eq!(unreadable(limited().await).kind, ProblemKind::BodyTooLarge);
        let wrapped: BoxError = Box::new(Wrapped(limited().await));
        assert_eq!(unreadable(wrapped).kind, ProblemKind::BodyTooLarge);
        let other: BoxError = "length limit exceeded".into();
        assert_eq!(unreadable(other).kind, ProblemKind::BodyUnreadable);
    }
}
