//! The byte form of a [`StoredResponse`], for stores that keep it in one column or value, and
//! the fencing tokens durable stores hand out.

use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use bytes::{Buf, BufMut, Bytes};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

use super::{FencingToken, StoredResponse};

/// The format written: lengths as varints, and the header names of [`KNOWN`] as their index
/// (a zero length, then one byte). Stores keep what they wrote, so [`VARINT`] (every name
/// spelled out) and [`LEGACY`] (fixed-width lengths besides, 15 bytes more for a typical
/// response) still decode.
const MAGIC: &[u8; 4] = b"TIR3";
const VARINT: &[u8; 4] = b"TIR2";
const LEGACY: &[u8; 4] = b"TIR1";

/// Writes [`KNOWN`] and [`known`] from one list, so the table and its lookup cannot part.
macro_rules! known_names {
    ($($index:literal => $name:literal,)*) => {
        /// The header names written as one byte: what responses send most. Append only: a
        /// stored record names a header by its place here.
        static KNOWN: [HeaderName; [$($index),*].len()] = [$(HeaderName::from_static($name)),*];

        /// `name`'s place in [`KNOWN`], if it has one: one `match` on its text, not a search of
        /// the table.
        fn known(name: &HeaderName) -> Option<u8> {
            match name.as_str() {
                $($name => Some($index),)*
                _ => None,
            }
        }
    };
}

known_names! {
    0 => "content-type",
    1 => "content-encoding",
    2 => "cache-control",
    3 => "etag",
    4 => "last-modified",
    5 => "location",
    6 => "vary",
    7 => "content-language",
    8 => "content-disposition",
    9 => "expires",
    10 => "link",
    11 => "retry-after",
    12 => "server",
    13 => "access-control-allow-origin",
    14 => "content-location",
    15 => "age",
    16 => "allow",
    17 => "accept-ranges",
    18 => "content-range",
    19 => "x-content-type-options",
    20 => "strict-transport-security",
    21 => "grpc-status",
    22 => "grpc-message",
    23 => "grpc-status-details-bin",
}

/// Stored bytes that do not decode: written by something else, or damaged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorruptRecord(pub(crate) &'static str);

impl fmt::Display for CorruptRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stored response does not decode: {}", self.0)
    }
}

impl std::error::Error for CorruptRecord {}

/// What is wrong with a stored record as a store reads it (a SQL row by column, a Redis hash
/// by field): a record that cannot be read names what is at fault.
#[derive(Debug)]
pub(crate) struct RowError(pub(crate) String);

impl fmt::Display for RowError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stored record is corrupt: {}", self.0)
    }
}

impl std::error::Error for RowError {}

/// Whether `error` says the record is there but does not read (damaged, or written by
/// something else), not that the store failed: such a record is for an operator to look at
/// and remove, where a store that failed says nothing of the record.
#[cfg_attr(not(feature = "console"), allow(dead_code))]
pub(crate) fn is_corrupt(error: &super::StoreError) -> bool {
    let super::StoreError::Unavailable(error) = error else {
        return false;
    };
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error.as_ref());
    while let Some(error) = cause {
        if error.is::<CorruptRecord>() || error.is::<RowError>() {
            return true;
        }
        cause = error.source();
    }
    false
}

impl StoredResponse {
    /// The response as bytes, exactly: status, every header (repeats and opaque bytes kept, in
    /// order), body, trailers.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.to_bytes_after(&[])
    }

    /// `prefix`, then the response as [`to_bytes`](Self::to_bytes) writes it, in one
    /// allocation of exactly that size (a store that keeps the key beside the response).
    #[cfg_attr(not(feature = "memory"), allow(dead_code))]
    pub(crate) fn to_bytes_after(&self, prefix: &[u8]) -> Vec<u8> {
        // Sized exactly, so turning it into `Bytes` or a boxed slice needs no second
        // allocation.
        let headers_len = |h: &HeaderMap| {
            varint_len(h.len())
                + h.iter()
                    .map(|(n, v)| {
                        let n = match known(n) {
                            Some(_) => 2,
                            None => varint_len(n.as_str().len()) + n.as_str().len(),
                        };
                        n + varint_len(v.len()) + v.len()
                    })
                    .sum::<usize>()
        };
        let len = prefix.len()
            + MAGIC.len()
            + 2
            + headers_len(&self.headers)
            + 1
            + self
                .body
                .as_ref()
                .map_or(0, |b| varint_len(b.len()) + b.len())
            + 1
            + self.trailers.as_ref().map_or(0, headers_len);
        let mut out = Vec::with_capacity(len);
        out.put_slice(prefix);
        out.put_slice(MAGIC);
        out.put_u16(self.status.as_u16());
        put_headers(&mut out, &self.headers);
        match &self.body {
            Some(body) => {
                out.put_u8(1);
                put_varint(&mut out, body.len());
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
        debug_assert_eq!(out.len(), len);
        out
    }

    /// Decodes what [`to_bytes`](Self::to_bytes) wrote, in this version or an earlier one.
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
        let (lengths, names) = match buf.get(..MAGIC.len()) {
            Some(m) if m == MAGIC => (Lengths::Varint, Names::Indexed),
            Some(m) if m == VARINT => (Lengths::Varint, Names::Spelled),
            Some(m) if m == LEGACY => (Lengths::Fixed, Names::Spelled),
            _ => return Err(CorruptRecord("unknown format")),
        };
        let format = Format { lengths, names };
        buf.advance(MAGIC.len());
        // A final answer: an informational status is not one (replayed, hyper would turn it
        // into a bare 500).
        let status = StatusCode::from_u16(get_u16(&mut buf)?)
            .ok()
            .filter(|status| !status.is_informational())
            .ok_or(CorruptRecord("invalid status"))?;
        let headers = get_headers(&mut buf, format, &share)?;
        let body = match get_u8(&mut buf)? {
            0 => None,
            _ => {
                let len = format.lengths.get(&mut buf, 8)?;
                Some(share(take(&mut buf, len)?))
            }
        };
        let trailers = match get_u8(&mut buf)? {
            0 => None,
            _ => Some(get_headers(&mut buf, format, &share)?),
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

/// How a format writes lengths and header names.
#[derive(Clone, Copy)]
struct Format {
    lengths: Lengths,
    names: Names,
}

/// How a format writes header names.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Names {
    /// Every name spelled out (`TIR1`, `TIR2`).
    Spelled,
    /// The names of [`KNOWN`] as a zero length and their index (`TIR3`).
    Indexed,
}

/// How a format writes counts and lengths.
#[derive(Clone, Copy)]
enum Lengths {
    /// `TIR1`: big-endian, 4 bytes wide (8 for the body's length).
    Fixed,
    /// `TIR2`: LEB128, seven bits a byte, low bits first; one byte below 128.
    Varint,
}

impl Lengths {
    /// Reads one length; `width` is its fixed width in the legacy format.
    fn get(self, buf: &mut &[u8], width: usize) -> Result<usize, CorruptRecord> {
        let n = match self {
            Lengths::Fixed => take(buf, width)?
                .iter()
                .fold(0u64, |n, &b| n << 8 | u64::from(b)),
            Lengths::Varint => get_varint(buf)?,
        };
        usize::try_from(n).map_err(|_| CorruptRecord("length"))
    }
}

fn put_varint(out: &mut Vec<u8>, n: usize) {
    let mut n = n as u64;
    while n >= 0x80 {
        out.put_u8(n as u8 | 0x80);
        n >>= 7;
    }
    out.put_u8(n as u8);
}

fn varint_len(n: usize) -> usize {
    // Bits needed (at least one), seven to a byte.
    (usize::BITS - (n | 1).leading_zeros()).div_ceil(7) as usize
}

fn get_varint(buf: &mut &[u8]) -> Result<u64, CorruptRecord> {
    let mut n = 0u64;
    for shift in (0..64).step_by(7) {
        let b = get_u8(buf)?;
        let bits = u64::from(b & 0x7f);
        // The tenth byte holds the 64th bit only; a final zero byte would be a longer
        // spelling of a shorter number: neither is something `to_bytes` writes.
        if (shift == 63 && bits > 1) || (b == 0 && shift > 0) {
            return Err(CorruptRecord("length"));
        }
        n |= bits << shift;
        if b & 0x80 == 0 {
            return Ok(n);
        }
    }
    Err(CorruptRecord("length"))
}

fn put_headers(out: &mut Vec<u8>, headers: &HeaderMap) {
    put_varint(out, headers.len());
    for (name, value) in headers {
        match known(name) {
            // A name is never empty: a zero length says an index follows.
            Some(i) => out.put_slice(&[0, i]),
            None => {
                put_varint(out, name.as_str().len());
                out.put_slice(name.as_str().as_bytes());
            }
        }
        put_varint(out, value.len());
        out.put_slice(value.as_bytes());
    }
}

fn get_headers(
    buf: &mut &[u8],
    format: Format,
    share: &impl Fn(&[u8]) -> Bytes,
) -> Result<HeaderMap, CorruptRecord> {
    let lengths = format.lengths;
    let count = lengths.get(buf, 4)?;
    // Room for what a replay adds (its mark), and never less than a map's first allocation
    // (six entries): hyper keeps a response's map for the next request's headers, and a
    // smaller one would be grown there, while the allocator's thread caches are busiest.
    let mut headers = HeaderMap::with_capacity((count.min(64) + 1).max(6));
    for _ in 0..count {
        let len = lengths.get(buf, 4)?;
        let name = match (len, format.names) {
            (0, Names::Indexed) => KNOWN
                .get(usize::from(get_u8(buf)?))
                .cloned()
                .ok_or(CorruptRecord("unknown header index"))?,
            _ => HeaderName::from_bytes(take(buf, len)?)
                .map_err(|_| CorruptRecord("invalid header name"))?,
        };
        let len = lengths.get(buf, 4)?;
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

    fn json(body: Option<Bytes>, trailers: Option<HeaderMap>) -> StoredResponse {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        StoredResponse {
            status: StatusCode::CREATED,
            headers,
            body,
            trailers,
        }
    }

    /// Records written before lengths became varints still replay (SQL stores keep them).
    #[test]
    fn decodes_the_legacy_fixed_width_format() {
        // As 0.1 wrote it: status 201, one header, body "{}", one trailer.
        let v1 = [
            &b"TIR1\x00\xc9\x00\x00\x00\x01"[..],
            b"\x00\x00\x00\x0ccontent-type\x00\x00\x00\x10application/json",
            b"\x01\x00\x00\x00\x00\x00\x00\x00\x02{}",
            b"\x01\x00\x00\x00\x01\x00\x00\x00\x0bgrpc-status\x00\x00\x00\x010",
        ]
        .concat();
        decodes_as_the_json_reply(v1);
    }

    /// The reply both earlier formats' tests wrote (201, JSON, body `{}`, `grpc-status: 0`
    /// as a trailer), decoded from `stored` by copy and by sharing; returned for more checks.
    fn decodes_as_the_json_reply(stored: Vec<u8>) -> StoredResponse {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        let expected = json(Some(Bytes::from_static(b"{}")), Some(trailers));
        assert_eq!(StoredResponse::from_bytes(&stored), Ok(expected.clone()));
        assert_eq!(
            StoredResponse::from_shared(&Bytes::from(stored)),
            Ok(expected.clone())
        );
        expected
    }

    /// The memory bound per record (issue 5) counts on this size: a JSON response of 200 B
    /// takes 12 bytes of framing beside its status, header value and body, and its header's
    /// name none (it took 26 bytes of framing, then 11 and the name's 12 in `TIR2`).
    #[test]
    fn a_typical_response_takes_twelve_bytes_of_framing_and_no_name() {
        let response = json(Some(Bytes::from(vec![b'x'; 200])), None);
        assert_eq!(response.to_bytes().len(), 2 + 16 + 200 + 12);
    }

    /// Records written before header names had indexes still replay (SQL stores keep them).
    #[test]
    fn decodes_the_spelled_out_varint_format() {
        // As `TIR2` wrote it: status 201, one header, body "{}", one trailer.
        let v2 = [
            &b"TIR2\x00\xc9\x01"[..],
            b"\x0ccontent-type\x10application/json",
            b"\x01\x02{}",
            b"\x01\x01\x0bgrpc-status\x010",
        ]
        .concat();
        let expected = decodes_as_the_json_reply(v2);
        // Written today, the same response names both headers by index.
        assert_eq!(
            expected.to_bytes(),
            [
                &b"TIR3\x00\xc9\x01"[..],
                b"\x00\x00\x10application/json",
                b"\x01\x02{}",
                b"\x01\x01\x00\x15\x010",
            ]
            .concat()
        );
    }

    /// Every name of the table is found by the lookup at its own place (one list writes both),
    /// round trips, and takes two bytes.
    #[test]
    fn every_known_name_is_written_as_its_index() {
        for (i, name) in KNOWN.iter().enumerate() {
            assert_eq!(known(name), Some(i as u8), "{name}");
            let mut headers = HeaderMap::new();
            headers.insert(name.clone(), HeaderValue::from_static("v"));
            let response = StoredResponse {
                status: StatusCode::OK,
                headers,
                body: None,
                trailers: None,
            };
            let bytes = response.to_bytes();
            assert_eq!(&bytes[7..9], &[0, i as u8], "{name}");
            assert_eq!(StoredResponse::from_bytes(&bytes), Ok(response), "{name}");
        }
        assert_eq!(known(&HeaderName::from_static("x-content-type")), None);
        assert_eq!(known(&HeaderName::from_static("content-typ")), None);
    }

    /// An index past the table, or an index in a format that has none, is corrupt.
    #[test]
    fn unknown_indexes_are_corrupt() {
        let past = [
            &b"TIR3\x00\xc8\x01\x00"[..],
            &[KNOWN.len() as u8],
            b"\x01v\x00\x00",
        ]
        .concat();
        assert_eq!(
            StoredResponse::from_bytes(&past),
            Err(CorruptRecord("unknown header index"))
        );
        let spelled = b"TIR2\x00\xc8\x01\x00\x00\x01v\x00\x00";
        assert_eq!(
            StoredResponse::from_bytes(spelled),
            Err(CorruptRecord("invalid header name"))
        );
    }

    /// §3: a stored status that is not a final answer (1xx, or outside 100–999) is corrupt,
    /// never replayed (hyper would send an informational status as a bare 500).
    #[test]
    fn statuses_that_are_not_final_answers_are_corrupt() {
        let with_status = |status: u16| {
            let mut bytes = StoredResponse {
                status: StatusCode::OK,
                headers: HeaderMap::new(),
                body: None,
                trailers: None,
            }
            .to_bytes();
            bytes[MAGIC.len()..MAGIC.len() + 2].copy_from_slice(&status.to_be_bytes());
            bytes
        };
        for status in [0, 99, 100, 101, 103, 199, 1000] {
            assert_eq!(
                StoredResponse::from_bytes(&with_status(status)),
                Err(CorruptRecord("invalid status")),
                "status {status}"
            );
        }
        for status in [200, 204, 409, 599, 999] {
            assert_eq!(
                StoredResponse::from_bytes(&with_status(status)).map(|r| r.status.as_u16()),
                Ok(status),
                "status {status}"
            );
        }
    }

    #[test]
    fn lengths_round_trip_across_varint_widths() {
        for len in [0, 1, 127, 128, 129, 16_383, 16_384, 2_097_152] {
            let mut headers = HeaderMap::new();
            for i in 0..(len.min(300)) {
                headers.append("x-n", HeaderValue::from(i));
            }
            let response = StoredResponse {
                status: StatusCode::OK,
                headers,
                body: Some(Bytes::from(vec![7; len])),
                trailers: None,
            };
            let bytes = response.to_bytes();
            assert_eq!(bytes.len(), bytes.capacity(), "length {len}");
            assert_eq!(
                StoredResponse::from_bytes(&bytes),
                Ok(response),
                "length {len}"
            );
        }
    }

    #[test]
    fn malformed_varints_are_corrupt() {
        for (varint, error) in [
            // Overlong: zero, and one, spelled longer than needed.
            (&[0x80, 0x00][..], "length"),
            (&[0x81, 0x80, 0x00], "length"),
            // Past 64 bits; never ending; cut short.
            (
                &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02],
                "length",
            ),
            (&[0x80; 11], "length"),
            (&[0x80], "truncated"),
        ] {
            let mut bytes = b"TIR3\x00\xc8".to_vec();
            bytes.extend_from_slice(varint);
            assert_eq!(
                StoredResponse::from_bytes(&bytes),
                Err(CorruptRecord(error)),
                "{varint:x?}"
            );
        }
        // The largest length decodes, and then is more than the bytes there are.
        let mut bytes = b"TIR2\x00\xc8".to_vec();
        bytes.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]);
        assert_eq!(
            StoredResponse::from_bytes(&bytes),
            Err(CorruptRecord("truncated"))
        );
    }

    proptest::proptest! {
        #[test]
        fn any_response_round_trips_exactly(
            status in 200u16..1000,
            headers in proptest::collection::vec(
                (
                    proptest::prop_oneof![
                        "[a-z][a-z0-9-]{0,20}",
                        proptest::sample::select(
                            KNOWN.iter().map(|n| n.as_str().to_owned()).collect::<Vec<_>>()
                        ),
                    ],
                    proptest::collection::vec(0x20u8..0x7f, 0..300),
                ),
                0..8,
            ),
            body in proptest::option::of(proptest::collection::vec(proptest::num::u8::ANY, 0..600)),
            trailer in proptest::option::of("[a-z]{1,10}"),
        ) {
            let mut map = HeaderMap::new();
            for (name, value) in &headers {
                map.append(
                    HeaderName::from_bytes(name.as_bytes()).expect("name"),
                    HeaderValue::from_bytes(value).expect("value"),
                );
            }
            let trailers = trailer.map(|t| {
                let mut m = HeaderMap::new();
                m.insert("grpc-message", HeaderValue::from_str(&t).expect("value"));
                m
            });
            let response = StoredResponse {
                status: StatusCode::from_u16(status).expect("status"),
                headers: map,
                body: body.map(Bytes::from),
                trailers,
            };
            let bytes = response.to_bytes();
            proptest::prop_assert_eq!(bytes.len(), bytes.capacity());
            proptest::prop_assert_eq!(StoredResponse::from_bytes(&bytes), Ok(response.clone()));
            proptest::prop_assert_eq!(
                StoredResponse::from_shared(&Bytes::from(bytes)),
                Ok(response)
            );
        }
    }

    #[test]
    fn tokens_differ() {
        let tokens: std::collections::HashSet<_> = (0..10_000).map(|_| fresh_token()).collect();
        assert_eq!(tokens.len(), 10_000);
        assert!(tokens.iter().all(|t| i64::try_from(t.get()).is_ok()));
    }
}
