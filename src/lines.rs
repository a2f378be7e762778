//! Reading a header from a message's few lines.
//!
//! A request or response carries a handful of header lines, and every guarded request looks
//! several names up (`Content-Type` for the dialect and the fingerprint, `Content-Length`, the
//! key, `grpc-status`, `Content-Encoding`). `HeaderMap` hashes the name each time (a custom
//! name byte by byte); comparing a few names one by one costs less. A map with more names than
//! [`SCAN`] is searched by hash. Either way the answer is `HeaderMap::get`'s and `get_all`'s.

use http::{HeaderMap, HeaderName, HeaderValue};

/// Up to this many names, a map is scanned rather than hashed into.
const SCAN: usize = 8;

/// The first value of `name`, as [`HeaderMap::get`] gives it.
#[inline]
pub(crate) fn get<'h>(headers: &'h HeaderMap, name: &HeaderName) -> Option<&'h HeaderValue> {
    if headers.keys_len() <= SCAN {
        return headers.iter().find_map(|(n, v)| (n == name).then_some(v));
    }
    headers.get(name)
}

/// Every value of `name`, in order, as [`HeaderMap::get_all`] gives them.
#[inline]
pub(crate) fn get_all<'h, 'n>(headers: &'h HeaderMap, name: &'n HeaderName) -> Values<'h, 'n> {
    if headers.keys_len() <= SCAN {
        return Values::Scan(headers.iter(), name);
    }
    Values::Hashed(headers.get_all(name).iter())
}

/// The values of one name (see [`get_all`]).
pub(crate) enum Values<'h, 'n> {
    /// A small map's lines, compared one by one.
    Scan(http::header::Iter<'h, HeaderValue>, &'n HeaderName),
    /// A large map's values of the name, found by hash.
    Hashed(http::header::ValueIter<'h, HeaderValue>),
}

impl<'h> Iterator for Values<'h, '_> {
    type Item = &'h HeaderValue;

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        match self {
            Self::Scan(lines, name) => lines.find_map(|(n, v)| (n == *name).then_some(v)),
            Self::Hashed(values) => values.next(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool of names: standard ones (compared by tag), custom ones (compared by bytes,
    /// some of equal length), as a request and a response carry them.
    fn name(i: usize) -> HeaderName {
        match i {
            0 => http::header::CONTENT_TYPE,
            1 => http::header::CONTENT_LENGTH,
            2 => http::header::CONTENT_ENCODING,
            3 => HeaderName::from_static("idempotency-key"),
            4 => HeaderName::from_static("grpc-status"),
            5 => HeaderName::from_static("grpc-statuz"),
            i => HeaderName::from_bytes(format!("x-h{i}").as_bytes()).expect("name"),
        }
    }

    proptest::proptest! {
        /// Issue 23 §2: the scan answers what the hashed lookup answers, on maps below, at and
        /// above its size, with repeated names and names absent.
        #[test]
        fn lines_read_what_the_map_reads(
            lines in proptest::collection::vec((0usize..24, 0u16..4), 0..40),
            wanted in 0usize..26,
        ) {
            let mut headers = HeaderMap::new();
            for (i, v) in &lines {
                headers.append(name(*i), HeaderValue::from(*v));
            }
            let wanted = name(wanted);
            proptest::prop_assert_eq!(get(&headers, &wanted), headers.get(&wanted));
            let all: Vec<_> = get_all(&headers, &wanted).collect();
            let expected: Vec<_> = headers.get_all(&wanted).iter().collect();
            proptest::prop_assert_eq!(all, expected);
        }
    }

    #[test]
    fn both_ways_of_reading_are_taken() {
        let mut headers = HeaderMap::new();
        headers.append(http::header::CONTENT_TYPE, HeaderValue::from_static("a"));
        headers.append(http::header::CONTENT_TYPE, HeaderValue::from_static("b"));
        assert!(matches!(
            get_all(&headers, &http::header::CONTENT_TYPE),
            Values::Scan(..)
        ));
        let values: Vec<_> = get_all(&headers, &http::header::CONTENT_TYPE).collect();
        assert_eq!(values, ["a", "b"]);
        for i in 6..6 + SCAN {
            headers.append(name(i), HeaderValue::from_static("x"));
        }
        assert!(matches!(
            get_all(&headers, &http::header::CONTENT_TYPE),
            Values::Hashed(..)
        ));
        assert_eq!(
            get(&headers, &http::header::CONTENT_TYPE).map(HeaderValue::as_bytes),
            Some(&b"a"[..])
        );
    }
}
