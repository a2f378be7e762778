//! The body types the middleware hands on: the buffered request, and a response that is either
//! the inner service's own body, bytes we hold (replays, problems), or both.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::store::BoxError;
use crate::window::Timing;

pin_project! {
    /// The request body the inner service receives: the buffered bytes of a guarded request, or
    /// the untouched body of one that passed through.
    pub struct RequestBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    /// The response body: a body we hold, the inner service's body, or (when a response was too
    /// large to record) the part we read followed by the rest of the inner body.
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Full { data: Option<Bytes>, trailers: Option<HeaderMap> },
        Inner { #[pin] body: B },
        Resumed {
            prefix: Option<Bytes>,
            rest: Pin<Box<B>>,
            // The execution's timing runs until the rest is sent (or abandoned).
            timing: Timing,
        },
        Channel { rx: tokio::sync::mpsc::Receiver<Result<Frame<Bytes>, BoxError>> },
        Enveloped {
            prefix: Option<Bytes>,
            rest: Pin<Box<B>>,
            mode: Embed,
            tail: Option<Bytes>,
            timing: Timing,
        },
    }
}

/// How the rest of an enveloped body is written into its envelope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Embed {
    /// JSON: its bytes as they are.
    Raw,
    /// Text: inside a JSON string, escaped byte by byte (UTF-8 passes through unchanged).
    Escaped,
    /// Anything else: read to its end, not written (the envelope says `null`).
    Dropped,
}

impl Embed {
    pub(crate) fn apply(self, data: Bytes) -> Bytes {
        match self {
            Embed::Raw => data,
            Embed::Dropped => Bytes::new(),
            Embed::Escaped => {
                let mut out = BytesMut::with_capacity(data.len() + 8);
                for &b in &data {
                    match b {
                        b'"' => out.extend_from_slice(b"\\\""),
                        b'\\' => out.extend_from_slice(b"\\\\"),
                        0x00..=0x1f => {
                            const HEX: &[u8; 16] = b"0123456789abcdef";
                            out.extend_from_slice(&[
                                b'\\',
                                b'u',
                                b'0',
                                b'0',
                                HEX[usize::from(b >> 4)],
                                HEX[usize::from(b & 15)],
                            ]);
                        }
                        _ => out.extend_from_slice(&[b]),
                    }
                }
                out.freeze()
            }
        }
    }
}

/// A body's bytes read so far. Most bodies arrive in one chunk, which is kept as it came; a
/// copy is made only once a second chunk arrives.
#[derive(Default)]
pub(crate) struct Gathered {
    one: Bytes,
    many: Option<BytesMut>,
}

impl Gathered {
    pub(crate) fn push(&mut self, chunk: Bytes) {
        match &mut self.many {
            Some(buf) => buf.extend_from_slice(&chunk),
            None if self.one.is_empty() => self.one = chunk,
            None => {
                let mut buf = BytesMut::with_capacity(self.one.len() + chunk.len());
                buf.extend_from_slice(&self.one);
                buf.extend_from_slice(&chunk);
                self.many = Some(buf);
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.many.as_ref().map_or(self.one.len(), BytesMut::len)
    }

    /// What is gathered so far, in one piece.
    pub(crate) fn as_slice(&self) -> &[u8] {
        self.many.as_deref().unwrap_or(&self.one)
    }

    pub(crate) fn freeze(self) -> Bytes {
        self.many.map_or(self.one, BytesMut::freeze)
    }
}

impl<B> RequestBody<B> {
    /// The bytes read, and the trailers that ended them if the client sent any.
    pub(crate) fn buffered(data: Bytes, trailers: Option<Box<HeaderMap>>) -> Self {
        Self {
            kind: Kind::full(data, trailers.map(|t| *t)),
        }
    }

    pub(crate) fn passthrough(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn full(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self {
            kind: Kind::full(data, trailers),
        }
    }

    pub(crate) fn passthrough(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }

    pub(crate) fn resumed(prefix: Bytes, rest: Pin<Box<B>>, timing: Timing) -> Self {
        Self {
            kind: Kind::Resumed {
                prefix: (!prefix.is_empty()).then_some(prefix),
                rest,
                timing,
            },
        }
    }
}

impl<B> ResponseBody<B> {
    /// `prefix`, then `rest` written into it as `mode` says, then `tail`: an envelope around a
    /// body too large to hold.
    pub(crate) fn enveloped(
        prefix: Bytes,
        rest: Pin<Box<B>>,
        mode: Embed,
        tail: Bytes,
        timing: Timing,
    ) -> Self {
        Self {
            kind: Kind::Enveloped {
                prefix: Some(prefix),
                rest,
                mode,
                tail: Some(tail),
                timing,
            },
        }
    }

    /// Frames forwarded from a task that reads the inner body (a stream being teed).
    pub(crate) fn channel(rx: tokio::sync::mpsc::Receiver<Result<Frame<Bytes>, BoxError>>) -> Self {
        Self {
            kind: Kind::Channel { rx },
        }
    }
}

impl<B> Kind<B> {
    fn full(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Kind::Full {
            data: (!data.is_empty()).then_some(data),
            trailers,
        }
    }
}

impl<B> Body for Kind<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project() {
            KindProj::Full { data, trailers } => Poll::Ready(match data.take() {
                Some(data) => Some(Ok(Frame::data(data))),
                None => trailers.take().map(|t| Ok(Frame::trailers(t))),
            }),
            KindProj::Inner { body } => body.poll_frame(cx).map_err(Into::into),
            KindProj::Resumed { prefix, rest, .. } => match prefix.take() {
                Some(data) => Poll::Ready(Some(Ok(Frame::data(data)))),
                None => rest.as_mut().poll_frame(cx).map_err(Into::into),
            },
            KindProj::Channel { rx } => rx.poll_recv(cx),
            KindProj::Enveloped {
                prefix,
                rest,
                mode,
                tail,
                ..
            } => {
                if let Some(data) = prefix.take() {
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                loop {
                    match std::task::ready!(rest.as_mut().poll_frame(cx)) {
                        // Trailers of the wrapped body describe it, not the envelope.
                        Some(Ok(frame)) => {
                            if let Ok(data) = frame.into_data() {
                                let data = mode.apply(data);
                                if !data.is_empty() {
                                    return Poll::Ready(Some(Ok(Frame::data(data))));
                                }
                            }
                        }
                        Some(Err(error)) => return Poll::Ready(Some(Err(error.into()))),
                        None => return Poll::Ready(tail.take().map(|t| Ok(Frame::data(t)))),
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Kind::Full { data, trailers } => data.is_none() && trailers.is_none(),
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Resumed { prefix, rest, .. } => prefix.is_none() && rest.is_end_stream(),
            Kind::Channel { .. } => false,
            Kind::Enveloped { prefix, tail, .. } => prefix.is_none() && tail.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Kind::Full { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Inner { body } => body.size_hint(),
            Kind::Resumed { prefix, rest, .. } => {
                let extra = prefix.as_ref().map_or(0, |d| d.len() as u64);
                let rest = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower() + extra);
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper + extra);
                }
                hint
            }
            Kind::Channel { .. } | Kind::Enveloped { .. } => SizeHint::new(),
        }
    }
}

macro_rules! delegate_body {
    ($ty:ident) => {
        impl<B> Body for $ty<B>
        where
            B: Body<Data = Bytes>,
            B::Error: Into<BoxError>,
        {
            type Data = Bytes;
            type Error = BoxError;

            fn poll_frame(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
            ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
                self.project().kind.poll_frame(cx)
            }

            fn is_end_stream(&self) -> bool {
                self.kind.is_end_stream()
            }

            fn size_hint(&self) -> SizeHint {
                self.kind.size_hint()
            }
        }

        impl<B> fmt::Debug for $ty<B> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                let kind = match &self.kind {
                    Kind::Full { .. } => "Full",
                    Kind::Inner { .. } => "Inner",
                    Kind::Resumed { .. } => "Resumed",
                    Kind::Channel { .. } => "Channel",
                    Kind::Enveloped { .. } => "Enveloped",
                };
                f.debug_struct(stringify!($ty))
                    .field("kind", &kind)
                    .finish()
            }
        }
    };
}

delegate_body!(RequestBody);
delegate_body!(ResponseBody);

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};

    #[tokio::test]
    async fn full_body_reports_its_end_exactly() {
        let body: ResponseBody<Full<Bytes>> = ResponseBody::full(Bytes::new(), None);
        assert!(body.is_end_stream());
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", "0".parse().expect("value"));
        let body: ResponseBody<Full<Bytes>> =
            ResponseBody::full(Bytes::from_static(b"abc"), Some(trailers.clone()));
        assert!(!body.is_end_stream());
        assert_eq!(body.size_hint().exact(), Some(3));
        let collected = body.collect().await.expect("collect");
        assert_eq!(collected.trailers(), Some(&trailers));
        assert_eq!(collected.to_bytes(), Bytes::from_static(b"abc"));
    }

    #[tokio::test]
    async fn resumed_body_yields_prefix_then_rest() {
        let body = ResponseBody::resumed(
            Bytes::from_static(b"ab"),
            Box::pin(Full::new(Bytes::from_static(b"cd"))),
            Timing::start(std::sync::Arc::default()),
        );
        assert_eq!(body.size_hint().exact(), Some(4));
        assert_eq!(
            body.collect().await.expect("collect").to_bytes(),
            Bytes::from_static(b"abcd")
        );
    }
}
