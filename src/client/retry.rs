//! What an answer means for the caller: done, retry (after how long), or stop.

use std::hash::{BuildHasher, RandomState};
use std::time::Duration;

use http::{Response, StatusCode, header};

use super::body::CallBody;
pub(super) use super::verdict::Verdict;

/// The verdict on `res`, read from its status, its `Idempotency-Replayed` header and, for the
/// middleware's own answers, its problem `type` (gRPC: see [`super::grpc`]).
pub(super) fn verdict(res: &Response<CallBody>) -> Verdict {
    let replayed = res
        .headers()
        .get(&crate::replay::IDEMPOTENCY_REPLAYED)
        .is_some_and(|v| v == "true");
    if super::grpc::is_grpc(res) {
        return super::grpc::verdict(res, replayed);
    }
    let retry_after = res
        .headers()
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    let problem = problem_of(res);
    let (slug, state) = match &problem {
        Some((slug, state)) => (Some(slug.as_str()), state.as_deref()),
        None => (None, None),
    };
    match (res.status(), slug) {
        (_, Some("fingerprint-mismatch")) => Verdict::KeyReused,
        (_, Some("outcome-unknown")) => Verdict::OutcomeUnknown,
        // The layer's own "in flight" is never a replay: one recorded (a gateway behind the
        // layer that passed a downstream's on, under a policy that records everything) is an
        // answer, which waiting would only get again until the deadline.
        (StatusCode::CONFLICT, Some("in-flight")) if !replayed => Verdict::InFlight { retry_after },
        // A 409 whose body is encoded (a compression layer outside the server's idempotency
        // layer) cannot say whether it is the layer's "in flight" or the application's own
        // answer. The layer's always says when to ask again (`Retry-After`, at least 1 s); an
        // application's rarely does, and asked again it would run again (a 409 is not a
        // definitive outcome, so the server gave its key back): without one, it is the answer
        // (an `outcome-unknown` encoded alike is too: the caller reads its body).
        (StatusCode::CONFLICT, None) if !replayed && encoded(res) && retry_after.is_some() => {
            Verdict::InFlight { retry_after }
        }
        // The server recorded this failure as the key's outcome ("it will not run again"):
        // asking again would only replay it.
        (_, Some("execution-failed")) if state == Some("completed") => Verdict::Done { replayed },
        // The server is wired wrong: every retry would get the same answer.
        (_, Some("scope-missing" | "not-guarded" | "fingerprint-failed")) => {
            Verdict::Done { replayed }
        }
        // Recorded (a replay of a failure, under a policy that records everything): definite.
        (status, _) if status.is_server_error() && !replayed => Verdict::Retry { retry_after },
        (StatusCode::TOO_MANY_REQUESTS | StatusCode::REQUEST_TIMEOUT, _) if !replayed => {
            Verdict::Retry { retry_after }
        }
        _ => Verdict::Done { replayed },
    }
}

/// Whether the answer's body is in a content coding other than `identity`.
fn encoded(res: &Response<CallBody>) -> bool {
    res.headers()
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .any(|v| {
            v.to_str()
                .map_or(true, |v| !v.trim().eq_ignore_ascii_case("identity"))
        })
}

/// The last segment of the `type` (`urn:tower-idempotency:problem:<slug>`) of the middleware's
/// own answers, and the key's `state` they state: a problem document, or a JSON-RPC error with
/// the problem in `error.data` (the layer's JSON-RPC mode).
fn problem_of(res: &Response<CallBody>) -> Option<(String, Option<String>)> {
    let content_type = res.headers().get(header::CONTENT_TYPE)?.to_str().ok()?;
    let essence = content_type.split(';').next()?.trim();
    let problem = essence.eq_ignore_ascii_case("application/problem+json");
    if !problem && !essence.eq_ignore_ascii_case("application/json") {
        return None;
    }
    let mut body: serde_json::Value = serde_json::from_slice(&res.body().bytes()).ok()?;
    let document = match problem {
        true => body,
        false => body["error"]["data"].take(),
    };
    let slug = document["type"]
        .as_str()?
        .strip_prefix("urn:tower-idempotency:problem:")?
        .to_owned();
    Some((slug, document["state"].as_str().map(str::to_owned)))
}

/// `pause` with up to a quarter taken off or added at random, so that callers who failed
/// together do not retry together.
pub(super) fn jitter(pause: Duration) -> Duration {
    let quarter = pause / 4;
    // Saturating: a quarter of a server's `Retry-After` can pass half of `u64` nanoseconds.
    let spread = u64::try_from(quarter.as_nanos())
        .unwrap_or(u64::MAX)
        .saturating_mul(2);
    if spread == 0 {
        return pause;
    }
    let random = RandomState::new().hash_one(std::time::Instant::now());
    (pause - quarter) + Duration::from_nanos(random % spread)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, headers: &[(&str, &str)], body: &str) -> Response<CallBody> {
        let bytes = bytes::Bytes::copy_from_slice(body.as_bytes());
        let mut res = Response::new(CallBody::new(bytes, None));
        *res.status_mut() = StatusCode::from_u16(status).expect("status");
        for (name, value) in headers {
            res.headers_mut().insert(
                http::HeaderName::from_bytes(name.as_bytes()).expect("name"),
                value.parse().expect("value"),
            );
        }
        res
    }

    fn problem(status: u16, slug: &str, retry_after: Option<&str>) -> Response<CallBody> {
        let body = format!(r#"{{"type":"urn:tower-idempotency:problem:{slug}"}}"#);
        let mut headers = vec![("content-type", "application/problem+json")];
        if let Some(after) = retry_after {
            headers.push(("retry-after", after));
        }
        answer(status, &headers, &body)
    }

    #[test]
    fn answers_are_read_as_the_contract_says() {
        assert_eq!(
            verdict(&answer(201, &[], "{}")),
            Verdict::Done { replayed: false }
        );
        assert_eq!(
            verdict(&answer(201, &[("idempotency-replayed", "true")], "{}")),
            Verdict::Done { replayed: true }
        );
        assert_eq!(
            verdict(&problem(409, "in-flight", Some("2"))),
            Verdict::InFlight {
                retry_after: Some(Duration::from_secs(2))
            }
        );
        assert_eq!(
            verdict(&problem(409, "outcome-unknown", None)),
            Verdict::OutcomeUnknown
        );
        assert_eq!(
            verdict(&problem(422, "fingerprint-mismatch", None)),
            Verdict::KeyReused
        );
        assert_eq!(
            verdict(&problem(503, "store-unavailable", Some("1"))),
            Verdict::Retry {
                retry_after: Some(Duration::from_secs(1))
            }
        );
        // A 500 the server gave the key back for is retried; one it recorded is the answer.
        assert_eq!(
            verdict(&answer(500, &[], "boom")),
            Verdict::Retry { retry_after: None }
        );
        assert_eq!(
            verdict(&answer(500, &[("idempotency-replayed", "true")], "boom")),
            Verdict::Done { replayed: true }
        );
        // A recorded 503 is the answer, like any recorded failure.
        assert_eq!(
            verdict(&answer(503, &[("idempotency-replayed", "true")], "down")),
            Verdict::Done { replayed: true }
        );
        // The server wired wrong: a retry would get the same.
        assert_eq!(
            verdict(&problem(500, "scope-missing", None)),
            Verdict::Done { replayed: false }
        );
        assert_eq!(
            verdict(&problem(500, "execution-failed", None)),
            Verdict::Retry { retry_after: None }
        );
        // The JSON-RPC mode's refusals carry the problem in `error.data`.
        let jsonrpc = r#"{"jsonrpc":"2.0","id":1,"error":{"code":-31001,"message":"in flight",
            "data":{"type":"urn:tower-idempotency:problem:in-flight"}}}"#;
        assert_eq!(
            verdict(&answer(
                409,
                &[("content-type", "application/json"), ("retry-after", "1")],
                jsonrpc
            )),
            Verdict::InFlight {
                retry_after: Some(Duration::from_secs(1))
            }
        );
        // Media types are case-insensitive.
        assert_eq!(
            verdict(&answer(
                409,
                &[("content-type", "Application/Problem+JSON; charset=utf-8")],
                r#"{"type":"urn:tower-idempotency:problem:outcome-unknown"}"#
            )),
            Verdict::OutcomeUnknown
        );
        // A 409 of the application's own is its answer.
        assert_eq!(
            verdict(&answer(409, &[], "taken")),
            Verdict::Done { replayed: false }
        );
        // One whose body a compression layer encoded cannot say whose it is: asked again
        // (the application's comes back marked as a replay).
        let gzipped = [
            ("content-type", "application/problem+json"),
            ("content-encoding", "gzip"),
            ("retry-after", "1"),
        ];
        assert_eq!(
            verdict(&answer(409, &gzipped, "\u{1f}\u{8b}")),
            Verdict::InFlight {
                retry_after: Some(Duration::from_secs(1))
            }
        );
        // Without `Retry-After` it is not the layer's: the application's own, not asked again
        // (the server gave its key back, and it would run again).
        assert_eq!(
            verdict(&answer(409, &gzipped[..2], "\u{1f}\u{8b}")),
            Verdict::Done { replayed: false }
        );
        let replayed = [
            ("content-encoding", "gzip"),
            ("idempotency-replayed", "true"),
        ];
        assert_eq!(
            verdict(&answer(409, &replayed, "\u{1f}\u{8b}")),
            Verdict::Done { replayed: true }
        );
        // A failure the server recorded as the key's outcome is the answer.
        let recorded =
            r#"{"type":"urn:tower-idempotency:problem:execution-failed","state":"completed"}"#;
        assert_eq!(
            verdict(&answer(
                500,
                &[("content-type", "application/problem+json")],
                recorded
            )),
            Verdict::Done { replayed: false }
        );
        assert_eq!(
            verdict(&answer(400, &[], "bad")),
            Verdict::Done { replayed: false }
        );
    }

    #[test]
    fn jitter_stays_within_a_quarter() {
        for _ in 0..100 {
            let j = jitter(Duration::from_millis(400));
            assert!(
                j >= Duration::from_millis(300) && j < Duration::from_millis(500),
                "{j:?}"
            );
        }
        // Too short to spread: as it is, every time.
        for _ in 0..100 {
            assert_eq!(jitter(Duration::ZERO), Duration::ZERO);
            assert_eq!(jitter(Duration::from_nanos(3)), Duration::from_nanos(3));
        }
    }
}
