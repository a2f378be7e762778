//! gRPC-Web: gRPC for HTTP/1.1 and browsers, whose status travels inside the body.
//!
//! A gRPC-Web request is `application/grpc-web…` (binary) or `application/grpc-web-text…`
//! (the same bytes in base64, often as separately padded chunks). Its response body is the
//! message frames followed by one trailer frame (flag `0x80`) whose payload is the trailers as
//! HTTP/1 header lines; a trailers-only response has `grpc-status` in its headers instead.
//!
//! What is kept of an answer is its gRPC form: the message frames (decoded from base64) as the
//! body and the trailer frame as trailers. So its outcome is classified by its gRPC status like
//! any gRPC call's (a gRPC-Web UNAVAILABLE is not a definitive answer), its trailers pass the
//! deny list, one without a status is UNKNOWN, and a replay is framed for the retry's own
//! `Accept` (binary, or text when it asks for `application/grpc-web-text`), as tonic-web
//! frames a live answer. The middleware's own refusals are trailers-only responses of the
//! same content type. A body that is not well-formed gRPC-Web never passes for an answer: it
//! is recorded as UNKNOWN, without its bytes.
//!
//! gRPC-Web has no client streaming: a guarded request's body is read whole, within the
//! route's body limit, like an HTTP body.

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, header};

use crate::base64;

/// The flag of the frame that carries the trailers.
const TRAILERS: u8 = 0x80;
/// The largest trailer frame read from an answer too large to keep (its frames are held back
/// until it is recorded): past this, its status is not read, and the answer is UNKNOWN.
pub(crate) const STREAMED_TRAILERS_MAX: usize = 16 * 1024 * 1024;

/// Whether a message with this `Content-Type` ([`content_type`](super::content_type)) is
/// gRPC-Web (`application/grpc-web…`).
pub(crate) fn is_grpc_web(content_type: &[u8]) -> bool {
    super::grpc::starts_without_case(content_type, b"application/grpc-web")
}

/// Whether a request asks for its answer in text (base64): its `Accept` is exactly
/// `application/grpc-web-text` or `application/grpc-web-text+proto`, as tonic-web reads it
/// (anything else is answered in binary, live and in replays alike).
pub(crate) fn answers_text(request: &HeaderMap) -> bool {
    request.get(header::ACCEPT).is_some_and(|v| {
        matches!(
            v.as_bytes(),
            b"application/grpc-web-text" | b"application/grpc-web-text+proto"
        )
    })
}

/// Whether a message's body is the text variant, by its `Content-Type`.
pub(crate) fn is_text(headers: &HeaderMap) -> bool {
    headers.get(header::CONTENT_TYPE).is_some_and(|v| {
        super::grpc::starts_without_case(v.as_bytes(), b"application/grpc-web-text")
    })
}

/// The content type of an answer in `text` or binary.
pub(crate) fn content_type(text: bool) -> HeaderValue {
    HeaderValue::from_static(match text {
        true => "application/grpc-web-text+proto",
        false => "application/grpc-web+proto",
    })
}

/// A whole answer's body in its gRPC form: the message frames, and the trailers if the body
/// ends with a trailer frame. `None` if it is not well-formed gRPC-Web.
pub(crate) fn split(body: &Bytes, text: bool) -> Option<(Bytes, Option<HeaderMap>)> {
    let binary = match text {
        true => Bytes::from(base64::decode(body).ok()?),
        false => body.clone(),
    };
    // The whole body is within the response limit: its trailer frame is read whatever its size.
    let mut frames = Frames::new(false, usize::MAX);
    frames.feed_binary(&binary);
    let trailers = frames.finish()?;
    let messages = binary.slice(..frames.trailer_at.unwrap_or(binary.len()));
    Some((messages, trailers))
}

/// The body of a replay: the stored message frames, then the stored trailers as a trailer
/// frame, in base64 when the retry asked for `text`.
pub(crate) fn join(messages: &Bytes, trailers: Option<&HeaderMap>, text: bool) -> Bytes {
    let mut body = BytesMut::with_capacity(messages.len() + 64);
    body.put_slice(messages);
    if let Some(trailers) = trailers {
        let mut lines = Vec::new();
        for (name, value) in trailers {
            lines.extend_from_slice(name.as_str().as_bytes());
            lines.push(b':');
            lines.extend_from_slice(value.as_bytes());
            lines.extend_from_slice(b"\r\n");
        }
        body.put_u8(TRAILERS);
        body.put_u32(u32::try_from(lines.len()).unwrap_or(u32::MAX));
        body.put_slice(&lines);
    }
    match text {
        true => Bytes::from(base64::encode(&body, true)),
        false => body.freeze(),
    }
}

/// Reads a gRPC-Web body's frames as they pass, for its trailers: the message frames are
/// skipped, not kept. Used on answers too large to keep, whose status is at their very end.
#[derive(Debug)]
pub(crate) struct Frames {
    text: Option<base64::Decoder>,
    decoded: Vec<u8>,
    state: State,
    /// Bytes of the binary stream read so far.
    seen: usize,
    /// Where the trailer frame starts in the binary stream.
    trailer_at: Option<usize>,
    trailers: Vec<u8>,
    /// The largest trailer frame read.
    cap: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Reading a frame's 5-byte prefix; `have` bytes of it in `prefix`.
    Prefix { prefix: [u8; 5], have: usize },
    /// Inside a message frame, this many bytes left.
    Message(usize),
    /// Inside the trailer frame, this many bytes left.
    Trailers(usize),
    /// The trailer frame is whole: nothing may follow it.
    Done,
    /// Not gRPC-Web.
    Broken,
}

impl Frames {
    /// Frames of a body in base64 (`text`) or binary, whose trailer frame is read up to
    /// `cap` bytes.
    pub(crate) fn new(text: bool, cap: usize) -> Self {
        Self {
            text: text.then(base64::Decoder::default),
            decoded: Vec::new(),
            state: State::Prefix {
                prefix: [0; 5],
                have: 0,
            },
            seen: 0,
            trailer_at: None,
            trailers: Vec::new(),
            cap,
        }
    }

    /// Reads the next bytes of the body as sent.
    pub(crate) fn feed(&mut self, chunk: &[u8]) {
        let Some(decoder) = &mut self.text else {
            return self.feed_binary(chunk);
        };
        let mut decoded = std::mem::take(&mut self.decoded);
        decoded.clear();
        match decoder.feed(chunk, &mut decoded) {
            Ok(()) => self.feed_binary(&decoded),
            Err(base64::Invalid) => self.state = State::Broken,
        }
        self.decoded = decoded;
    }

    /// Whether the trailer frame has begun: what follows carries the call's status.
    pub(crate) fn in_trailers(&self) -> bool {
        self.trailer_at.is_some()
    }

    fn feed_binary(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let taken;
            match &mut self.state {
                State::Prefix { prefix, have } => {
                    taken = (5 - *have).min(bytes.len());
                    prefix[*have..*have + taken].copy_from_slice(&bytes[..taken]);
                    *have += taken;
                    if *have == 5 {
                        let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]])
                            as usize;
                        self.state = match prefix[0] {
                            0 | 1 => State::Message(len),
                            TRAILERS if len <= self.cap => {
                                self.trailer_at = Some(self.seen + taken - 5);
                                State::Trailers(len)
                            }
                            _ => State::Broken,
                        };
                        self.settle();
                    }
                }
                State::Message(left) => {
                    taken = (*left).min(bytes.len());
                    *left -= taken;
                    self.settle();
                }
                State::Trailers(left) => {
                    taken = (*left).min(bytes.len());
                    *left -= taken;
                    self.trailers.extend_from_slice(&bytes[..taken]);
                    self.settle();
                }
                State::Done | State::Broken => {
                    self.state = State::Broken;
                    return;
                }
            }
            self.seen += taken;
            bytes = &bytes[taken..];
        }
    }

    /// Moves past a frame whose bytes are all in.
    fn settle(&mut self) {
        self.state = match self.state {
            State::Message(0) => State::Prefix {
                prefix: [0; 5],
                have: 0,
            },
            State::Trailers(0) => State::Done,
            other => other,
        };
    }

    /// The trailers, once the body has ended: `Some(None)` for a body of message frames
    /// alone (a trailers-only answer tells its status in its headers), `None` for one that is
    /// not gRPC-Web (a frame cut short, an unknown flag, bytes after the trailers, trailer
    /// lines that are not headers).
    pub(crate) fn finish(&self) -> Option<Option<HeaderMap>> {
        if self.text.as_ref().is_some_and(|d| !d.finished()) {
            return None;
        }
        match self.state {
            State::Prefix { have: 0, .. } => Some(None),
            State::Done => parse_trailers(&self.trailers).map(Some),
            _ => None,
        }
    }
}

/// The trailer frame's payload: `name: value` lines, each ended by CRLF (the last one may
/// go without), read as tonic-web's client reads them: whitespace trimmed before a value, not
/// after it. Of the status and its message given twice, the last value, which is the one that
/// client acts on; any other name given twice keeps every line, in order, for the replay.
fn parse_trailers(payload: &[u8]) -> Option<HeaderMap> {
    let mut trailers = HeaderMap::new();
    let mut rest = payload;
    while !rest.is_empty() {
        let (line, next) = match rest.windows(2).position(|w| w == b"\r\n") {
            Some(end) => (&rest[..end], &rest[end + 2..]),
            None => (rest, &[][..]),
        };
        // A bare CR or LF is not a line end: not a header block.
        if line.iter().any(|&b| b == b'\r' || b == b'\n') {
            return None;
        }
        let colon = line.iter().position(|&b| b == b':')?;
        let name = HeaderName::from_bytes(&line[..colon]).ok()?;
        let value = line[colon + 1..].trim_ascii_start();
        let value = HeaderValue::from_bytes(value).ok()?;
        if name == super::grpc::STATUS || name == super::grpc::MESSAGE {
            trailers.insert(name, value);
        } else {
            trailers.append(name, value);
        }
        rest = next;
    }
    Some(trailers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn frame(flag: u8, payload: &[u8]) -> Vec<u8> {
        let mut out = vec![flag];
        out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    #[test]
    fn a_body_splits_into_its_messages_and_its_trailers() {
        let mut body = frame(0, b"hello");
        body.extend(frame(1, b"zipped"));
        let messages = Bytes::from(body.clone());
        body.extend(frame(
            TRAILERS,
            b"grpc-status:0\r\ngrpc-status:14\r\ngrpc-message: down\r\nx-b: 1\r\nx-b: 2\r\n",
        ));
        let (kept, trailers) = split(&Bytes::from(body.clone()), false).expect("gRPC-Web");
        assert_eq!(kept, messages);
        let trailers = trailers.expect("trailers");
        assert_eq!(
            trailers.get_all("grpc-status").iter().collect::<Vec<_>>(),
            ["14"],
            "of the status given twice, the last, as the client reads it"
        );
        assert_eq!(trailers["grpc-message"], "down");
        assert_eq!(
            trailers.get_all("x-b").iter().collect::<Vec<_>>(),
            ["1", "2"],
            "another name given twice keeps both lines, in order"
        );

        // The same in text, as separately padded chunks.
        let text: String = body.chunks(7).map(|c| base64::encode(c, true)).collect();
        let (kept_text, trailers_text) = split(&Bytes::from(text), true).expect("gRPC-Web text");
        assert_eq!(kept_text, messages);
        assert_eq!(trailers_text.expect("trailers")["grpc-status"], "14");

        // And back: a replay's body splits into what was kept.
        let joined = join(&kept, Some(&trailers), true);
        let (again, again_trailers) = split(&joined, true).expect("a replay is gRPC-Web");
        assert_eq!(again, messages);
        assert_eq!(again_trailers, Some(trailers));
    }

    #[test]
    fn what_is_not_grpc_web_never_passes_for_an_answer() {
        let status = frame(TRAILERS, b"grpc-status:0\r\n");
        let cases: Vec<(&str, Vec<u8>, bool)> = vec![
            ("a frame cut short", frame(0, b"hello")[..7].to_vec(), false),
            ("a prefix cut short", vec![0, 0, 0], false),
            ("an unknown flag", frame(2, b"x"), false),
            (
                "bytes after the trailers",
                [status.clone(), frame(0, b"")].concat(),
                false,
            ),
            (
                "a trailer line without a colon",
                frame(TRAILERS, b"grpc-status 0\r\n"),
                false,
            ),
            (
                "a bare LF",
                frame(TRAILERS, b"grpc-status:0\nx:1\r\n"),
                false,
            ),
            ("text that is not base64", b"AAAA!AAA".to_vec(), true),
            ("text cut mid-group", b"AAAAAAA".to_vec(), true),
        ];
        for (what, body, text) in cases {
            assert_eq!(split(&Bytes::from(body), text), None, "{what}");
        }
        assert_eq!(split(&Bytes::new(), false), Some((Bytes::new(), None)));
    }

    proptest! {
        /// Differential: the frames read as they pass, in chunks cut anywhere, find what
        /// `split` finds in the whole body.
        #[test]
        fn frames_read_in_chunks_find_the_trailers(
            messages in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 0..4),
            status in 0u16..17,
            cut in proptest::collection::vec(1usize..30, 1..8),
            text: bool,
        ) {
            let mut binary: Vec<u8> = messages.iter().flat_map(|m| frame(0, m)).collect();
            binary.extend(frame(TRAILERS, format!("grpc-status:{status}\r\n").as_bytes()));
            let body = match text {
                true => base64::encode(&binary, true).into_bytes(),
                false => binary,
            };
            let mut frames = Frames::new(text, STREAMED_TRAILERS_MAX);
            let mut rest = &body[..];
            for n in cut.iter().cycle() {
                if rest.is_empty() { break; }
                let n = (*n).min(rest.len());
                frames.feed(&rest[..n]);
                rest = &rest[n..];
            }
            prop_assert!(frames.in_trailers());
            let found = frames.finish().flatten().expect("trailers");
            prop_assert_eq!(found["grpc-status"].to_str().expect("ascii"), status.to_string());
            let whole = split(&Bytes::from(body), text).expect("gRPC-Web");
            prop_assert_eq!(whole.1, Some(found));
        }
    }
}
