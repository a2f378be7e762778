//! gRPC: the middleware's own answers as gRPC statuses, with `google.rpc` details.
//!
//! A request is gRPC when its `Content-Type` is `application/grpc` or `application/grpc+…`.
//! Its refusals are trailers-only responses (HTTP 200, `grpc-status` and `grpc-message` in the
//! headers, no body) that any gRPC client reads as a status. `grpc-status-details-bin` carries
//! a `google.rpc.Status` whose details are a `google.rpc.ErrorInfo` (domain
//! `tower-idempotency`, reason below, metadata `state` and `safe_new_key`) and, when a retry is
//! expected to help, a `google.rpc.RetryInfo` with the delay.
//!
//! | problem | gRPC code | ErrorInfo reason | RetryInfo |
//! |---|---|---|---|
//! | key missing / invalid | `INVALID_ARGUMENT` | `KEY_MISSING` / `KEY_INVALID` | — |
//! | message over the body limit | `RESOURCE_EXHAUSTED` | `BODY_TOO_LARGE` | — |
//! | key reused for another request | `FAILED_PRECONDITION` | `FINGERPRINT_MISMATCH` | — |
//! | first call still running | `ABORTED` | `IN_FLIGHT` | remaining lease |
//! | outcome unknown | `ABORTED` | `OUTCOME_UNKNOWN` | — |
//! | completed, response too large to keep | `FAILED_PRECONDITION` | `RESPONSE_NOT_STORED` | — |
//! | completed, response in a `grpc-encoding` the retry does not accept | `FAILED_PRECONDITION` | `ENCODING_NOT_ACCEPTED` | — |
//! | store unavailable | `UNAVAILABLE` | `STORE_UNAVAILABLE` | `Retry-After` |
//! | execution panicked | `INTERNAL` | `EXECUTION_FAILED` | — |
//!
//! A mismatch is `FAILED_PRECONDITION`, not `INVALID_ARGUMENT`: the message itself is valid;
//! what fails is the state the key is already bound to. Neither code is retried by gRPC's
//! default retry policies.
//!
//! The fingerprint of a gRPC call is its method path and its request body as sent: the
//! length-prefixed message frames (compression flag included). A client that re-encodes the
//! same message differently (another field order, explicit default values, compression switched
//! on) makes a different fingerprint and gets `FAILED_PRECONDITION`; clients that retry the
//! bytes they sent, as gRPC's own retries do, always match.
//!
//! A guarded call reaches its handler without `grpc-accept-encoding`, so its answer is recorded
//! uncompressed and every retry can read the replay; an answer compressed all the same is
//! replayed only to a retry that lists its `grpc-encoding`, and refused as
//! `ENCODING_NOT_ACCEPTED` to any other. gRPC-Web calls (`application/grpc-web…`) are classified
//! by the status in their body's trailer frame, recorded in gRPC form and replayed in the
//! framing (binary or text) each retry's `Accept` asks for; the refusals above reach them as
//! trailers-only answers of gRPC-Web's content type.

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Response, header};

use super::rpc_status::{any, bytes_field, string_field, varint_field};
use crate::body::ResponseBody;
use crate::problem::{Problem, ProblemKind};

pub use super::rpc_status::ERROR_DOMAIN;

/// Whether a request or response with this `Content-Type` ([`content_type`](super::content_type))
/// is gRPC (gRPC-Web included: see [`grpc_web`](super::grpc_web) for the one that is).
pub(crate) fn is_grpc(content_type: &[u8]) -> bool {
    starts_without_case(content_type, b"application/grpc")
}

/// Whether `text` begins with `prefix`, ASCII case aside: a media type's name has no case
/// (RFC 9110 §8.3.1), and tonic serves `Application/GRPC` as gRPC.
pub(crate) fn starts_without_case(text: &[u8], prefix: &[u8]) -> bool {
    text.get(..prefix.len())
        .is_some_and(|start| start.eq_ignore_ascii_case(prefix))
}

/// The trailer (or trailers-only header) that says how a call ended. Looked up on every
/// recorded response: a constant name is hashed, not parsed each time.
pub(crate) static STATUS: http::HeaderName = http::HeaderName::from_static("grpc-status");
/// Its message.
pub(crate) static MESSAGE: http::HeaderName = http::HeaderName::from_static("grpc-message");

/// Per-call binary metadata that describes this call, not the operation: trace context and
/// tags, server statistics. Never kept for a retry, wherever the answer carries it: in its
/// trailers, its initial metadata, or the one HEADERS frame of a trailers-only answer.
const PER_CALL: [HeaderName; 3] = [
    HeaderName::from_static("grpc-trace-bin"),
    HeaderName::from_static("grpc-tags-bin"),
    HeaderName::from_static("grpc-server-stats-bin"),
];

/// Removes the per-call metadata ([`PER_CALL`]) from headers or trailers to be kept.
pub(crate) fn withhold_per_call(headers: &mut HeaderMap) {
    for name in &PER_CALL {
        headers.remove(name);
    }
}

/// Takes the per-call metadata ([`PER_CALL`]) out of a live answer's head into `withheld`, to
/// be put back once the rest is recorded (see [`crate::replay::withhold`]).
pub(crate) fn lend_per_call(
    headers: &mut HeaderMap,
    withheld: &mut Vec<(HeaderName, HeaderValue)>,
) {
    for name in &PER_CALL {
        if let header::Entry::Occupied(entry) = headers.entry(name) {
            let (name, values) = entry.remove_entry_mult();
            withheld.extend(values.map(|value| (name.clone(), value)));
        }
    }
}

/// A `grpc-status` value as gRPC clients read it (tonic's `Code::from_bytes`): one digit, or
/// `10`–`16`; anything else is UNKNOWN (2), never a code the policy would take as definitive.
pub(crate) fn parse_status(value: &HeaderValue) -> u16 {
    match value.as_bytes() {
        [d @ b'0'..=b'9'] => u16::from(d - b'0'),
        [b'1', d @ b'0'..=b'6'] => 10 + u16::from(d - b'0'),
        _ => 2,
    }
}

/// Whether a response said how its call ended: `grpc-status` in its trailers or, for a
/// trailers-only response, in its headers.
pub(crate) fn has_status(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> bool {
    headers.contains_key(&STATUS) || trailers.is_some_and(|t| t.contains_key(&STATUS))
}

/// How long a guarded call's request stream may stay open after its one message before it is
/// taken for a streaming call (a unary client ends its stream with its message).
pub(crate) const UNARY_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// The request body of a unary call: one length-prefixed message, then the end of the
/// stream. A second message, or a stream still open [`UNARY_GRACE`] after the first, is a
/// streaming call, refused before anything is claimed: buffering it to its end would hang a
/// client that waits for a reply before it sends more. A gRPC-Web call in `text` sends its
/// message in base64: its message is found in the decoded bytes; the bytes as sent are read.
pub(crate) async fn read_unary<B>(
    body: B,
    limit: usize,
    text: bool,
) -> Result<(Bytes, Option<Box<http::HeaderMap>>), Problem>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<crate::store::BoxError>,
{
    use http_body_util::BodyExt;
    let streaming = |how: &str| {
        Problem::new(
            ProblemKind::CallUnguardable,
            format!(
                "a guarded gRPC method must be unary, and this call's request stream {how}; \
                 nothing was run"
            ),
        )
    };
    let mut body = std::pin::pin!(body);
    let mut data = crate::body::Gathered::default();
    // In text, the bytes decoded so far (their messages are what counts).
    let mut decoded: Option<(crate::base64::Decoder, Vec<u8>)> =
        text.then(|| (crate::base64::Decoder::default(), Vec::new()));
    loop {
        let (framed, pending) = match &decoded {
            Some((decoder, bytes)) => (bytes.as_slice(), !decoder.finished()),
            None => (data.as_slice(), false),
        };
        // The first message's end, once its 5-byte prefix (flag, big-endian length) is in.
        let message_end = framed
            .get(1..5)
            .map(|len| 5 + u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize);
        if message_end.is_some_and(|end| framed.len() > end) {
            return Err(streaming("sent a second message"));
        }
        let one_message_in = message_end.is_some_and(|end| framed.len() == end) && !pending;
        let nothing_yet = data.len() == 0;
        let next = if one_message_in || nothing_yet {
            if body.is_end_stream() {
                break;
            }
            // A unary client sends its message with its headers and then ends its stream; a
            // bidi client may wait for the server to speak first, or for a reply.
            match tokio::time::timeout(UNARY_GRACE, body.frame()).await {
                Ok(next) => next,
                Err(_) if nothing_yet => return Err(streaming("sent no message")),
                Err(_) => return Err(streaming("stayed open after its first message")),
            }
        } else {
            body.frame().await
        };
        let Some(frame) = next else { break };
        let frame = frame.map_err(|e| super::http::unreadable(e.into()))?;
        // Trailers end a request stream, and reach the handler as sent (a gRPC-Web call over
        // HTTP/1.1 may send them).
        let chunk = match frame.into_data() {
            Ok(chunk) => chunk,
            Err(frame) => {
                let trailers = frame.into_trailers().ok().map(Box::new);
                return Ok((data.freeze(), trailers));
            }
        };
        if data.len() + chunk.len() > limit {
            return Err(super::http::too_large(limit));
        }
        if let Some((decoder, bytes)) = &mut decoded
            && decoder.feed(&chunk, bytes).is_err()
        {
            return Err(Problem::new(
                ProblemKind::BodyMalformed,
                "a gRPC-Web text request body is not base64; nothing was run",
            ));
        }
        data.push(chunk);
    }
    Ok((data.freeze(), None))
}

/// What a fingerprint mismatch tells the client its call differs in.
pub(crate) const COVERS: &str = "method or request message";

/// Whether a gRPC status is an answer about the operation rather than a failure a retry may
/// get past (DESIGN §3): OK, INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, PERMISSION_DENIED,
/// FAILED_PRECONDITION, OUT_OF_RANGE, UNIMPLEMENTED, UNAUTHENTICATED.
pub(crate) fn is_definitive(code: u16) -> bool {
    matches!(code, 0 | 3 | 5 | 6 | 7 | 9 | 11 | 12 | 16)
}

/// gRPC status codes, as numbers.
fn code(kind: ProblemKind) -> u32 {
    match kind {
        ProblemKind::KeyMissing
        | ProblemKind::KeyInvalid
        | ProblemKind::BodyMalformed
        | ProblemKind::BodyUnreadable
        | ProblemKind::CallUnguardable
        | ProblemKind::HeaderMismatch => 3, // INVALID_ARGUMENT
        ProblemKind::BodyTooLarge => 8, // RESOURCE_EXHAUSTED
        ProblemKind::FingerprintMismatch
        | ProblemKind::ResponseNotStored
        | ProblemKind::EncodingNotAccepted => 9, // FAILED_PRECONDITION
        ProblemKind::InFlight | ProblemKind::OutcomeUnknown => 10, // ABORTED
        ProblemKind::StoreUnavailable => 14, // UNAVAILABLE
        ProblemKind::ExecutionFailed
        | ProblemKind::ScopeMissing
        | ProblemKind::NotGuarded
        | ProblemKind::FingerprintFailed => 13, // INTERNAL
    }
}

/// The `ErrorInfo` reason: the problem's slug in upper snake case.
pub(crate) fn reason(kind: ProblemKind) -> String {
    kind.slug().replace('-', "_").to_ascii_uppercase()
}

/// A trailers-only gRPC response carrying `problem`, of the given content type (gRPC's, or
/// gRPC-Web's for a gRPC-Web call).
pub(crate) fn status_response<B>(
    problem: &Problem,
    content_type: HeaderValue,
) -> Response<ResponseBody<B>> {
    let mut res = Response::new(ResponseBody::full(Bytes::new(), None));
    let headers = res.headers_mut();
    headers.insert(header::CONTENT_TYPE, content_type);
    headers.insert("grpc-status", HeaderValue::from(code(problem.kind)));
    let message = percent_encoding::utf8_percent_encode(&problem.detail, GRPC_MESSAGE).to_string();
    if let Ok(value) = HeaderValue::from_str(&message) {
        headers.insert("grpc-message", value);
    }
    // Binary metadata is sent in base64 without padding.
    let details = crate::base64::encode(&status_details(problem), false);
    if let Ok(value) = HeaderValue::from_str(&details) {
        headers.insert("grpc-status-details-bin", value);
    }
    res
}

/// gRPC's percent-encoding of `grpc-message`: everything outside printable ASCII, and `%`.
const GRPC_MESSAGE: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS.add(b'%').add(0x7f);

/// An encoded `google.rpc.Status` with `ErrorInfo` and, if the problem has a delay,
/// `RetryInfo`.
fn status_details(problem: &Problem) -> Vec<u8> {
    let mut error_info = BytesMut::new();
    string_field(&mut error_info, 1, &reason(problem.kind));
    string_field(&mut error_info, 2, ERROR_DOMAIN);
    let safe = if problem.safe_new_key() {
        "true"
    } else {
        "false"
    };
    for (key, value) in [("state", problem.state), ("safe_new_key", safe)] {
        let mut entry = BytesMut::new();
        string_field(&mut entry, 1, key);
        string_field(&mut entry, 2, value);
        bytes_field(&mut error_info, 3, &entry);
    }

    let mut status = BytesMut::new();
    varint_field(&mut status, 1, u64::from(code(problem.kind)));
    string_field(&mut status, 2, &problem.detail);
    bytes_field(
        &mut status,
        3,
        &any("type.googleapis.com/google.rpc.ErrorInfo", &error_info),
    );
    if let Some(seconds) = problem.retry_after {
        let mut delay = BytesMut::new();
        varint_field(&mut delay, 1, seconds);
        let mut retry_info = BytesMut::new();
        bytes_field(&mut retry_info, 1, &delay);
        bytes_field(
            &mut status,
            3,
            &any("type.googleapis.com/google.rpc.RetryInfo", &retry_info),
        );
    }
    status.to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_read_as_clients_read_them() {
        for (value, code) in [
            ("0", 0),
            ("9", 9),
            ("10", 10),
            ("16", 16),
            ("14", 14),
            ("17", 2),
            ("00", 2),
            ("014", 2),
            ("+0", 2),
            (" 0", 2),
            ("0 ", 2),
            ("0x0", 2),
            ("abc", 2),
            ("", 2),
            ("2147483648", 2),
        ] {
            let value = HeaderValue::from_str(value).expect("value");
            assert_eq!(parse_status(&value), code, "{value:?}");
        }
    }
}
