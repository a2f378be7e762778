//! The body of a call's answer: the bytes the server sent, and its trailers (where gRPC says
//! how a call ended), read whole before the answer was judged.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};

/// An answer's whole body as the server sent it, trailers included: a gRPC client (tonic over
/// the layer) reads its status from them as it would from the wire.
#[derive(Debug, Clone, Default)]
pub struct CallBody {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl CallBody {
    pub(super) fn new(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self {
            data: Some(data).filter(|d| !d.is_empty()),
            trailers,
        }
    }

    /// The body's bytes (not yet polled out).
    pub fn bytes(&self) -> Bytes {
        self.data.clone().unwrap_or_default()
    }

    /// The trailers the answer ended with, if any (not yet polled out).
    pub fn trailers(&self) -> Option<&HeaderMap> {
        self.trailers.as_ref()
    }
}

impl Body for CallBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(data) = self.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.data.as_ref().map_or(0, |d| d.len() as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn yields_its_bytes_then_its_trailers() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        let body = CallBody::new(Bytes::from_static(b"abc"), Some(trailers.clone()));
        assert_eq!(body.size_hint().exact(), Some(3));
        let collected = body.collect().await.expect("infallible");
        assert_eq!(collected.trailers(), Some(&trailers));
        assert_eq!(collected.to_bytes(), Bytes::from_static(b"abc"));
        let empty = CallBody::new(Bytes::new(), None);
        assert!(empty.is_end_stream());
    }
}
