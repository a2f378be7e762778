//! `google.rpc.Status` in `grpc-status-details-bin`, with the `ErrorInfo` and `RetryInfo`
//! details the middleware's gRPC refusals carry: written here for the server's answers
//! ([`super::grpc`]), and read here for the client layer, so that both sides speak one format.
//! Only the protobuf wire format these messages need: varints and length-delimited fields.

#[cfg(any(feature = "client", test))]
use std::time::Duration;

use bytes::{BufMut, BytesMut};
#[cfg(any(feature = "client", test))]
use http::HeaderMap;

/// The `ErrorInfo` domain of every status the middleware answers.
pub const ERROR_DOMAIN: &str = "tower-idempotency";

pub(super) fn any(type_url: &str, value: &[u8]) -> BytesMut {
    let mut any = BytesMut::new();
    string_field(&mut any, 1, type_url);
    bytes_field(&mut any, 2, value);
    any
}

fn varint(out: &mut BytesMut, mut v: u64) {
    while v >= 0x80 {
        out.put_u8((v as u8) | 0x80);
        v >>= 7;
    }
    out.put_u8(v as u8);
}

pub(super) fn varint_field(out: &mut BytesMut, field: u32, v: u64) {
    varint(out, u64::from(field) << 3);
    varint(out, v);
}

pub(super) fn bytes_field(out: &mut BytesMut, field: u32, bytes: &[u8]) {
    varint(out, (u64::from(field) << 3) | 2);
    varint(out, bytes.len() as u64);
    out.put_slice(bytes);
}

pub(super) fn string_field(out: &mut BytesMut, field: u32, s: &str) {
    bytes_field(out, field, s.as_bytes());
}

/// What `grpc-status-details-bin` says, as far as the caller needs it.
#[cfg(any(feature = "client", test))]
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Details {
    /// The `ErrorInfo` reason, if its domain is the middleware's.
    pub(crate) reason: Option<String>,
    /// `RetryInfo.retry_delay`.
    pub(crate) retry_delay: Option<Duration>,
}

#[cfg(any(feature = "client", test))]
impl Details {
    /// Reads the details of `headers`; anything malformed reads as no details.
    pub(crate) fn of(headers: &HeaderMap) -> Self {
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
                        // A delay out of range (negative, absurd) is dropped on its own: the
                        // reason beside it still says what the status means.
                        if let (1, Value::Bytes(delay)) = field? {
                            out.retry_delay = duration(delay);
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
#[cfg(any(feature = "client", test))]
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
#[cfg(any(feature = "client", test))]
enum Value<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Fixed,
}

/// The fields of an encoded message; a malformed one ends it with `None`.
#[cfg(any(feature = "client", test))]
struct Fields<'a>(&'a [u8]);

#[cfg(any(feature = "client", test))]
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

#[cfg(any(feature = "client", test))]
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

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("grpc-status", http::HeaderValue::from_static(code));
        h
    }

    #[test]
    fn varints_encode_like_protobuf() {
        let mut out = BytesMut::new();
        varint(&mut out, 300);
        assert_eq!(&out[..], &[0xac, 0x02]);
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

    proptest::proptest! {
        /// What the writer writes, the reader reads back, whatever the reason and delay; a
        /// reason of another domain is not the middleware's.
        #[test]
        fn details_round_trip(
            reason in "[A-Z_]{1,40}",
            ours in proptest::bool::ANY,
            seconds in 0u64..315_576_000_000,
            nanos in 0u64..1_000_000_000,
        ) {
            let mut info = BytesMut::new();
            string_field(&mut info, 1, &reason);
            string_field(&mut info, 2, if ours { ERROR_DOMAIN } else { "elsewhere" });
            let mut delay = BytesMut::new();
            varint_field(&mut delay, 1, seconds);
            varint_field(&mut delay, 2, nanos);
            let mut retry = BytesMut::new();
            bytes_field(&mut retry, 1, &delay);
            let mut status = BytesMut::new();
            varint_field(&mut status, 1, 10);
            bytes_field(&mut status, 3, &any("type.googleapis.com/google.rpc.ErrorInfo", &info));
            bytes_field(&mut status, 3, &any("type.googleapis.com/google.rpc.RetryInfo", &retry));
            let read = Details::decode(&status).expect("well-formed");
            proptest::prop_assert_eq!(read.reason, ours.then_some(reason));
            proptest::prop_assert_eq!(
                read.retry_delay,
                Some(Duration::new(seconds, u32::try_from(nanos).expect("nanos")))
            );
        }

        /// Hostile bytes never panic the reader.
        #[test]
        fn any_bytes_read_without_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
            let _ = Details::decode(&bytes);
        }
    }
}
