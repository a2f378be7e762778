//! What a gRPC answer means for the caller: its status (from the trailers, or the headers of a
//! trailers-only answer, or gRPC-Web's trailer frame) and, for the middleware's own statuses,
//! the `google.rpc.ErrorInfo` reason and `RetryInfo` delay in `grpc-status-details-bin`.

use std::time::Duration;

use http::{HeaderMap, Response};

use super::body::CallBody;
use super::retry::Verdict;
use crate::dialect::grpc::{ERROR_DOMAIN, STATUS, is_definitive, parse_status};
use crate::dialect::grpc_web;

/// Whether `res` is a gRPC (or gRPC-Web) answer, to be judged by [`verdict`].
pub(super) fn is_grpc(res: &Response<CallBody>) -> bool {
    crate::dialect::grpc::is_grpc(res.headers())
}

/// The verdict on a gRPC answer.
pub(super) fn verdict(res: &Response<CallBody>, replayed: bool) -> Verdict {
    let web_trailers;
    let trailers = match grpc_web::is_grpc_web(res.headers()) {
        true => {
            let text = grpc_web::is_text(res.headers());
            web_trailers = grpc_web::split(&res.body().bytes(), text).and_then(|(_, t)| t);
            web_trailers.as_ref()
        }
        false => res.body().trailers(),
    };
    // A trailers-only answer says it in its headers; any other in its trailers.
    let ended = [trailers, Some(res.headers())]
        .into_iter()
        .flatten()
        .find(|h| h.contains_key(&STATUS));
    let Some(ended) = ended else {
        // A replay is the recorded answer, whether its status can be read here or not (a
        // compressed gRPC-Web body). A first answer that never said how it ended: the stream
        // was cut, and the call may have run; asking again under the same key reaches its
        // outcome. Anything else is the HTTP answer of something in between (a proxy's 503).
        return match !replayed && (res.status().is_success() || res.status().is_server_error()) {
            true => Verdict::Retry { retry_after: None },
            false => Verdict::Done { replayed },
        };
    };
    let code = ended.get(&STATUS).map_or(2, parse_status);
    let details = Details::of(ended);
    match details.reason.as_deref() {
        Some("FINGERPRINT_MISMATCH") => return Verdict::KeyReused,
        Some("OUTCOME_UNKNOWN") => return Verdict::OutcomeUnknown,
        Some("IN_FLIGHT") => {
            return Verdict::InFlight {
                retry_after: details.retry_delay,
            };
        }
        // Nothing ran, and nothing a retry changes: the message over the limit, a key or call
        // the middleware cannot guard, a server wired wrong, a completed answer it cannot give.
        Some(
            "BODY_TOO_LARGE"
            | "KEY_MISSING"
            | "KEY_INVALID"
            | "BODY_MALFORMED"
            | "CALL_UNGUARDABLE"
            | "HEADER_MISMATCH"
            | "SCOPE_MISSING"
            | "NOT_GUARDED"
            | "FINGERPRINT_FAILED"
            | "RESPONSE_NOT_STORED"
            | "ENCODING_NOT_ACCEPTED",
        ) => return Verdict::Done { replayed },
        _ => {}
    }
    match code {
        // A status the server gave the key back for (DESIGN §3): the same key may run again.
        code if !is_definitive(code) && !replayed => Verdict::Retry {
            retry_after: details.retry_delay,
        },
        _ => Verdict::Done { replayed },
    }
}

/// What `grpc-status-details-bin` says, as far as the caller needs it.
#[derive(Debug, Default, PartialEq, Eq)]
struct Details {
    /// The `ErrorInfo` reason, if its domain is the middleware's.
    reason: Option<String>,
    /// `RetryInfo.retry_delay`.
    retry_delay: Option<Duration>,
}

impl Details {
    /// Reads the details of `headers`; anything malformed reads as no details.
    fn of(headers: &HeaderMap) -> Self {
        let Some(value) = headers.get("grpc-status-details-bin") else {
            return Self::default();
        };
        match crate::base64::decode_unpadded(value.as_bytes()) {
            Ok(bytes) => Self::decode(&bytes).unwrap_or_default(),
            Err(_) => Self::default(),
        }
    }

    /// A `google.rpc.Status`'s details: `ErrorInfo` and `RetryInfo` among its `Any`s.
    fn decode(status: &[u8]) -> Option<Self> {
        let mut out = Self::default();
        for field in Fields(status) {
            let (3, Value::Bytes(any)) = field? else {
                continue;
            };
            let (mut type_url, mut value) = (&[][..], &[][..]);
            for field in Fields(any) {
                match field? {
                    (1, Value::Bytes(b)) => type_url = b,
                    (2, Value::Bytes(b)) => value = b,
                    _ => {}
                }
            }
            match type_url {
                b"type.googleapis.com/google.rpc.ErrorInfo" => {
                    let (mut reason, mut domain) = (None, None);
                    for field in Fields(value) {
                        match field? {
                            (1, Value::Bytes(b)) => reason = std::str::from_utf8(b).ok(),
                            (2, Value::Bytes(b)) => domain = Some(b),
                            _ => {}
                        }
                    }
                    // Another service's reasons are not the middleware's to act on.
                    if domain == Some(ERROR_DOMAIN.as_bytes()) {
                        out.reason = reason.map(str::to_owned);
                    }
                }
                b"type.googleapis.com/google.rpc.RetryInfo" => {
                    for field in Fields(value) {
                        if let (1, Value::Bytes(delay)) = field? {
                            out.retry_delay = Some(duration(delay)?);
                        }
                    }
                }
                _ => {}
            }
        }
        Some(out)
    }
}

/// A `google.protobuf.Duration`; negative or out-of-range parts read as malformed.
fn duration(bytes: &[u8]) -> Option<Duration> {
    let (mut seconds, mut nanos) = (0u64, 0u64);
    for field in Fields(bytes) {
        match field? {
            (1, Value::Varint(s)) => seconds = s,
            (2, Value::Varint(n)) => nanos = n,
            _ => {}
        }
    }
    // int64 seconds and int32 nanos: a negative one is a huge varint.
    if seconds > 315_576_000_000 || nanos >= 1_000_000_000 {
        return None;
    }
    Some(Duration::new(seconds, u32::try_from(nanos).ok()?))
}

/// One protobuf field's value, as far as these messages need.
#[derive(Debug)]
enum Value<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Fixed,
}

/// The fields of an encoded message; a malformed one ends it with `None`.
struct Fields<'a>(&'a [u8]);

impl<'a> Iterator for Fields<'a> {
    type Item = Option<(u64, Value<'a>)>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.is_empty() {
            return None;
        }
        let field = self.field();
        if field.is_none() {
            // Nothing after a malformed field can be read.
            self.0 = &[];
        }
        Some(field)
    }
}

impl<'a> Fields<'a> {
    fn field(&mut self) -> Option<(u64, Value<'a>)> {
        let tag = self.varint()?;
        let value = match tag & 7 {
            0 => Value::Varint(self.varint()?),
            1 => self.skip(8)?,
            2 => {
                let len = usize::try_from(self.varint()?).ok()?;
                let (bytes, rest) = self.0.split_at_checked(len)?;
                self.0 = rest;
                Value::Bytes(bytes)
            }
            5 => self.skip(4)?,
            _ => return None,
        };
        Some((tag >> 3, value))
    }

    fn skip(&mut self, n: usize) -> Option<Value<'a>> {
        self.0 = self.0.get(n..)?;
        Some(Value::Fixed)
    }

    fn varint(&mut self) -> Option<u64> {
        let mut v = 0u64;
        for i in 0..10 {
            let (&b, rest) = self.0.split_first()?;
            self.0 = rest;
            v |= u64::from(b & 0x7f) << (7 * i);
            if b < 0x80 {
                return Some(v);
            }
        }
        None
    }
}

/// The trailers-only headers the middleware answers a refused gRPC call with (tests).
#[cfg(test)]
fn refusal(kind: crate::problem::ProblemKind, retry_after: Option<u64>) -> HeaderMap {
    let mut problem = crate::problem::Problem::new(kind, "refused".to_owned());
    problem.retry_after = retry_after;
    let res = crate::dialect::grpc::status_response::<http_body_util::Empty<bytes::Bytes>>(
        &problem,
        http::HeaderValue::from_static("application/grpc"),
    );
    res.headers().clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::ProblemKind;
    use bytes::Bytes;

    fn answer(headers: HeaderMap, trailers: Option<HeaderMap>, replayed: bool) -> Verdict {
        let mut res = Response::new(CallBody::new(Bytes::new(), trailers));
        *res.headers_mut() = headers;
        verdict(&res, replayed)
    }

    fn status(code: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("grpc-status", http::HeaderValue::from_static(code));
        h
    }

    fn grpc() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc"),
        );
        h
    }

    #[test]
    fn the_middlewares_statuses_are_read_by_their_reason() {
        assert_eq!(
            answer(refusal(ProblemKind::InFlight, Some(3)), None, false),
            Verdict::InFlight {
                retry_after: Some(Duration::from_secs(3))
            }
        );
        assert_eq!(
            answer(refusal(ProblemKind::OutcomeUnknown, None), None, false),
            Verdict::OutcomeUnknown
        );
        assert_eq!(
            answer(refusal(ProblemKind::FingerprintMismatch, None), None, false),
            Verdict::KeyReused
        );
        assert_eq!(
            answer(refusal(ProblemKind::BodyTooLarge, None), None, false),
            Verdict::Done { replayed: false },
            "RESOURCE_EXHAUSTED, but the same message is always too large"
        );
        assert_eq!(
            answer(refusal(ProblemKind::ExecutionFailed, None), None, false),
            Verdict::Retry { retry_after: None },
            "the key was given back"
        );
        assert_eq!(
            answer(refusal(ProblemKind::StoreUnavailable, Some(1)), None, false),
            Verdict::Retry {
                retry_after: Some(Duration::from_secs(1))
            }
        );
    }

    #[test]
    fn statuses_are_read_from_the_trailers_and_judged_by_the_policy() {
        assert_eq!(
            answer(grpc(), Some(status("0")), false),
            Verdict::Done { replayed: false }
        );
        // Released by DefinitiveOnly: asked again under the same key.
        assert_eq!(
            answer(grpc(), Some(status("14")), false),
            Verdict::Retry { retry_after: None }
        );
        // Recorded: the operation's answer.
        assert_eq!(
            answer(grpc(), Some(status("13")), true),
            Verdict::Done { replayed: true }
        );
        assert_eq!(
            answer(grpc(), Some(status("5")), false),
            Verdict::Done { replayed: false }
        );
        // A stream cut before its status.
        assert_eq!(
            answer(grpc(), None, false),
            Verdict::Retry { retry_after: None }
        );
        // A replay whose status cannot be read here is still the recorded answer.
        assert_eq!(answer(grpc(), None, true), Verdict::Done { replayed: true });
    }

    #[test]
    fn another_domains_reasons_and_malformed_details_are_not_acted_on() {
        // ABORTED with an IN_FLIGHT reason of another service: a plain ABORTED.
        let mut info = Vec::new();
        info.extend_from_slice(&[0x0a, 9]);
        info.extend_from_slice(b"IN_FLIGHT");
        info.extend_from_slice(&[0x12, 5]);
        info.extend_from_slice(b"other");
        let url = b"type.googleapis.com/google.rpc.ErrorInfo";
        let mut any = vec![0x0a, url.len() as u8];
        any.extend_from_slice(url);
        any.push(0x12);
        any.push(info.len() as u8);
        any.extend_from_slice(&info);
        let mut status_msg = vec![0x08, 10, 0x1a, any.len() as u8];
        status_msg.extend_from_slice(&any);
        assert_eq!(
            Details::decode(&status_msg),
            Some(Details::default()),
            "another domain"
        );
        for hostile in [
            &[0x1a, 0xff][..],
            &[
                0x1a, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01,
            ],
            &[0x0f],
            &[0x1a, 5, 1, 2],
        ] {
            assert_eq!(Details::decode(hostile), None, "{hostile:?}");
        }
        let mut headers = status("10");
        headers.insert(
            "grpc-status-details-bin",
            http::HeaderValue::from_static("!!!"),
        );
        assert_eq!(Details::of(&headers), Details::default());
        // A negative delay (a ten-byte varint) is malformed, not a wait of centuries.
        assert_eq!(
            duration(&[
                0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01
            ]),
            None
        );
        assert_eq!(
            duration(&[0x08, 2, 0x10, 0x80, 0x89, 0x7a]),
            Some(Duration::new(2, 2_000_000))
        );
    }

    #[test]
    fn grpc_web_answers_are_read_from_their_trailer_frame() {
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc-web+proto"),
        );
        let body = grpc_web::join(&Bytes::new(), Some(&status("14")), false);
        let mut res = Response::new(CallBody::new(body, None));
        *res.headers_mut() = headers.clone();
        assert_eq!(verdict(&res, false), Verdict::Retry { retry_after: None });
        let body = grpc_web::join(&Bytes::new(), Some(&status("0")), false);
        let mut res = Response::new(CallBody::new(body, None));
        *res.headers_mut() = headers;
        assert_eq!(verdict(&res, false), Verdict::Done { replayed: false });
    }
}
