//! The byte form of a [`StoredResponse`], for stores that keep it in one column or value, and
//! the fencing tokens durable stores hand out.

use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

use super::{FencingToken, StoredResponse};

const MAGIC: &[u8; 4] = b"TIR1";

/// Stored bytes that do not decode: written by something else, or damaged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorruptRecord(pub(crate) &'static str);

impl fmt::Display for CorruptRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stored response does not decode: {}", self.0)
    }
}

impl std::error::Error for CorruptRecord {}

impl StoredResponse {
    /// The response as bytes, exactly: status, every header (repeats and opaque bytes kept, in
    /// order), body, trailers.
    pub fn to_bytes(&self) -> Vec<u8> {
        // Sized exactly, so turning it into `Bytes` needs no second allocation.
        let headers_len = |h: &HeaderMap| {
            4 + h
                .iter()
                .map(|(n, v)| 8 + n.as_str().len() + v.len())
                .sum::<usize>()
        };
        let len = MAGIC.len()
            + 2
            + headers_len(&self.headers)
            + 1
            + self.body.as_ref().map_or(0, |b| 8 + b.len())
            + 1
            + self.trailers.as_ref().map_or(0, headers_len);
        let mut out = BytesMut::with_capacity(len);
        out.put_slice(MAGIC);
        out.put_u16(self.status.as_u16());
        put_headers(&mut out, &self.headers);
        match &self.body {
            Some(body) => {
                out.put_u8(1);
                out.put_u64(body.len() as u64);
                out.put_slice(body);
            }
            None => out.put_u8(0),
        }
        match &self.trailers {
            Some(trailers) => {
                out.put_u8(1);
                put_headers(&mut out, trailers);
            }
            None => out.put_u8(0),
        }
        Vec::from(out)
    }

    /// Decodes what [`to_bytes`](Self::to_bytes) wrote.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, CorruptRecord> {
        Self::decode(bytes, Bytes::copy_from_slice)
    }

    /// Decodes what [`to_bytes`](Self::to_bytes) wrote, sharing `bytes` for the body and the
    /// header values instead of copying them.
    pub fn from_shared(bytes: &Bytes) -> Result<Self, CorruptRecord> {
        Self::decode(bytes, |part| bytes.slice_ref(part))
    }

    fn decode(bytes: &[u8], share: impl Fn(&[u8]) -> Bytes) -> Result<Self, CorruptRecord> {
        let mut buf = bytes;
        if buf.len() < MAGIC.len() || &buf[..MAGIC.len()] != MAGIC {
            return Err(CorruptRecord("unknown format"));
        }
        buf.advance(MAGIC.len());
        let status = StatusCode::from_u16(get_u16(&mut buf)?)
            .map_err(|_| CorruptRecord("invalid status"))?;
        let headers = get_headers(&mut buf, &share)?;
        let body = match get_u8(&mut buf)? {
            0 => None,
            _ => {
                let len = usize::try_from(get_u64(&mut buf)?)
                    .map_err(|_| CorruptRecord("body length"))?;
                Some(share(take(&mut buf, len)?))
            }
        };
        let trailers = match get_u8(&mut buf)? {
            0 => None,
            _ => Some(get_headers(&mut buf, &share)?),
        };
        if !buf.is_empty() {
            return Err(CorruptRecord("trailing bytes"));
        }
        Ok(Self {
            status,
            headers,
            body,
            trailers,
        })
    }
}

fn put_headers(out: &mut BytesMut, headers: &HeaderMap) {
    out.put_u32(headers.len() as u32);
    for (name, value) in headers {
        out.put_u32(name.as_str().len() as u32);
        out.put_slice(name.as_str().as_bytes());
        out.put_u32(value.len() as u32);
        out.put_slice(value.as_bytes());
    }
}

fn get_headers(
    buf: &mut &[u8],
    share: &impl Fn(&[u8]) -> Bytes,
) -> Result<HeaderMap, CorruptRecord> {
    let count = get_u32(buf)? as usize;
    // Room for what a replay adds (its mark), and never less than a map's first allocation
    // (six entries): hyper keeps a response's map for the next request's headers, and a
    // smaller one would be grown there, while the allocator's thread caches are busiest.
    let mut headers = HeaderMap::with_capacity((count.min(64) + 1).max(6));
    for _ in 0..count {
        let len = get_u32(buf)? as usize;
        let name = HeaderName::from_bytes(take(buf, len)?)
            .map_err(|_| CorruptRecord("invalid header name"))?;
        let len = get_u32(buf)? as usize;
        let value = HeaderValue::from_maybe_shared(share(take(buf, len)?))
            .map_err(|_| CorruptRecord("invalid header value"))?;
        headers.append(name, value);
    }
    Ok(headers)
}

fn take<'a>(buf: &mut &'a [u8], len: usize) -> Result<&'a [u8], CorruptRecord> {
    if buf.len() < len {
        return Err(CorruptRecord("truncated"));
    }
    let (head, rest) = buf.split_at(len);
    *buf = rest;
    Ok(head)
}

fn get_u8(buf: &mut &[u8]) -> Result<u8, CorruptRecord> {
    Ok(take(buf, 1)?[0])
}

fn get_u16(buf: &mut &[u8]) -> Result<u16, CorruptRecord> {
    let b = take(buf, 2)?;
    Ok(u16::from_be_bytes([b[0], b[1]]))
}

fn get_u32(buf: &mut &[u8]) -> Result<u32, CorruptRecord> {
    let mut b = take(buf, 4)?;
    Ok(b.get_u32())
}

fn get_u64(buf: &mut &[u8]) -> Result<u64, CorruptRecord> {
    let mut b = take(buf, 8)?;
    Ok(b.get_u64())
}

/// A fencing token no other claim is expected to draw: 63 random-seeded bits (positive, so it
/// fits a signed 64-bit column).
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
pub(crate) fn fresh_token() -> FencingToken {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    // RandomState is seeded from the OS once per thread and stepped per instance.
    let hash = RandomState::new().hash_one((nanos, COUNTER.fetch_add(1, Ordering::Relaxed)));
    FencingToken::new(hash >> 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_part_exactly() {
        let mut headers = HeaderMap::new();
        headers.append("link", HeaderValue::from_static("</a>"));
        headers.append("link", HeaderValue::from_static("</b>"));
        headers.insert(
            "x-bin",
            HeaderValue::from_bytes(b"\x80\xff").expect("value"),
        );
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        for (body, trailers) in [
            (
                Some(Bytes::from((0..=255u8).collect::<Vec<_>>())),
                Some(trailers),
            ),
            (Some(Bytes::new()), None),
            (None, None),
        ] {
            let response = StoredResponse {
                status: StatusCode::CREATED,
                headers: headers.clone(),
                body,
                trailers,
            };
            let bytes = response.to_bytes();
            // Sized exactly: it becomes `Bytes` without a second allocation.
            assert_eq!(bytes.len(), bytes.capacity());
            assert_eq!(StoredResponse::from_bytes(&bytes), Ok(response.clone()));
            assert_eq!(
                StoredResponse::from_shared(&Bytes::from(bytes.clone())),
                Ok(response)
            );
            for cut in [0, 3, 5, bytes.len() - 1] {
                assert!(
                    StoredResponse::from_bytes(&bytes[..cut]).is_err(),
                    "cut at {cut}"
                );
            }
        }
    }

    #[test]
    fn tokens_differ() {
        let tokens: std::collections::HashSet<_> = (0..10_000).map(|_| fresh_token()).collect();
        assert_eq!(tokens.len(), 10_000);
        assert!(tokens.iter().all(|t| i64::try_from(t.get()).is_ok()));
    }
}
