//! What a gRPC answer means for the caller: its status (from the trailers, or the headers of a
//! trailers-only answer, or gRPC-Web's trailer frame) and, for the middleware's own statuses,
//! the `google.rpc.ErrorInfo` reason and `RetryInfo` delay in `grpc-status-details-bin`.

use http::Response;

use super::body::CallBody;
use super::verdict::Verdict;
use crate::dialect::grpc::{STATUS, is_definitive, parse_status};
use crate::dialect::grpc_web;
use crate::dialect::rpc_status::Details;

/// Whether `res` is a gRPC (or gRPC-Web) answer, to be judged by [`verdict`].
pub(super) fn is_grpc(res: &Response<CallBody>) -> bool {
    crate::dialect::grpc::is_grpc(crate::dialect::content_type(res.headers()))
}

/// The `grpc-timeout` a gRPC call was sent with (gRPC over HTTP/2: at most 8 digits, then
/// `H`, `M`, `S`, `m`, `u` or `n`), if it has a valid one.
pub(super) fn timeout_of(headers: &http::HeaderMap) -> Option<std::time::Duration> {
    use std::time::Duration;
    let value = headers.get("grpc-timeout")?.as_bytes();
    let (unit, digits) = value.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match unit {
        b'H' => Duration::from_secs(n * 3600),
        b'M' => Duration::from_secs(n * 60),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

/// `left` as a `grpc-timeout` value: milliseconds (rounded up, so a time left is never sent as
/// none) while they fit in 8 digits, whole seconds (rounded down) beyond.
pub(super) fn timeout_value(left: std::time::Duration) -> http::HeaderValue {
    let ms = left.as_nanos().div_ceil(1_000_000);
    let text = match ms <= 99_999_999 {
        true => format!("{ms}m"),
        false => format!("{}S", left.as_secs().min(99_999_999)),
    };
    http::HeaderValue::from_str(&text).unwrap_or(http::HeaderValue::from_static("0m"))
}

/// Whether `res`, a gRPC answer whose body was not read, went on past its head: a success
/// whose headers carry no status (a trailers-only answer would).
pub(super) fn answered_past_its_head(res: &Response<CallBody>) -> bool {
    is_grpc(res) && res.status().is_success() && !res.headers().contains_key(&STATUS)
}

/// The verdict on a gRPC answer.
pub(super) fn verdict(res: &Response<CallBody>, replayed: bool) -> Verdict {
    let web_trailers;
    let trailers = match grpc_web::is_grpc_web(crate::dialect::content_type(res.headers())) {
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
        // Never a replay from the layer itself: one recorded is an answer (see `retry`).
        Some("IN_FLIGHT") if !replayed => {
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

/// The trailers-only headers the middleware answers a refused gRPC call with (tests).
#[cfg(test)]
fn refusal(kind: crate::problem::ProblemKind, retry_after: Option<u64>) -> http::HeaderMap {
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
    use http::HeaderMap;
    use std::time::Duration;

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

    /// gRPC over HTTP/2's `grpc-timeout`: every unit read, anything else (more than 8 digits,
    /// no digits, a sign, an unknown unit, non-ASCII) is no timeout; what is sent back is
    /// never more than was given, in at most 8 digits.
    #[test]
    fn grpc_timeouts_are_read_and_written_as_the_spec_says() {
        let read = |value: &[u8]| {
            let mut headers = HeaderMap::new();
            headers.insert(
                "grpc-timeout",
                http::HeaderValue::from_bytes(value).expect("value"),
            );
            timeout_of(&headers)
        };
        assert_eq!(read(b"2H"), Some(Duration::from_secs(7200)));
        assert_eq!(read(b"3M"), Some(Duration::from_secs(180)));
        assert_eq!(read(b"4S"), Some(Duration::from_secs(4)));
        assert_eq!(read(b"250m"), Some(Duration::from_millis(250)));
        assert_eq!(read(b"7u"), Some(Duration::from_micros(7)));
        assert_eq!(read(b"99999999n"), Some(Duration::from_nanos(99_999_999)));
        assert_eq!(
            read(b"99999999H"),
            Some(Duration::from_secs(99_999_999 * 3600))
        );
        for bad in [
            &b"123456789m"[..],
            b"m",
            b"-1S",
            b"+1S",
            b"1.5S",
            b"10s",
            b"10",
            b"\xff1S",
        ] {
            assert_eq!(read(bad), None, "{bad:?}");
        }
        assert_eq!(timeout_value(Duration::from_millis(1_500)), "1500m");
        assert_eq!(timeout_value(Duration::from_micros(999)), "1m");
        assert_eq!(timeout_value(Duration::from_micros(1_001)), "2m");
        assert_eq!(timeout_value(Duration::ZERO), "0m");
        assert_eq!(
            timeout_value(Duration::from_millis(99_999_999)),
            "99999999m"
        );
        assert_eq!(timeout_value(Duration::from_millis(100_000_000)), "100000S");
        assert_eq!(timeout_value(Duration::MAX), "99999999S");
    }

    /// DESIGN §9 (a recorded answer is the answer): the layer's own `IN_FLIGHT` is waited on,
    /// but one marked as a replay was recorded (a gateway behind the layer passed it on, under
    /// a policy that records everything): waiting would get it again until the deadline.
    #[test]
    fn a_replayed_in_flight_is_the_answer() {
        let in_flight = refusal(ProblemKind::InFlight, Some(2));
        assert_eq!(
            answer(in_flight.clone(), None, false),
            Verdict::InFlight {
                retry_after: Some(Duration::from_secs(2))
            }
        );
        assert_eq!(
            answer(in_flight, None, true),
            Verdict::Done { replayed: true }
        );
    }
}
