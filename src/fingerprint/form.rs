//! `application/x-www-form-urlencoded` bodies, fingerprinted as their sorted, decoded pairs.
//!
//! Two encodings of the same pairs (`a=1&b=2`, `b=2&a=1`, `a=%31&b=2`) are the same operation:
//! pairs are sorted by name. The values of a repeated name keep their order, which frameworks
//! read as a list: `to=alice&to=bob` is not `to=bob&to=alice`.
//!
//! Names and values are decoded to bytes, never to text: escapes that are not UTF-8 (`%E9`,
//! `%FF`) stay the bytes they name, so two different bodies never decode to the same pairs.
//! Decoding follows the WHATWG `application/x-www-form-urlencoded` parser (`+` is a space, a `%`
//! not followed by two hex digits is itself), without its lossy UTF-8 step.

use std::borrow::Cow;

use super::Sink;

/// A decoded name and value.
type Pair<'a> = (Cow<'a, [u8]>, Cow<'a, [u8]>);

pub(crate) fn canonicalize(body: &[u8], out: &mut impl Sink) {
    let mut pairs: Vec<Pair<'_>> = body
        .split(|&b| b == b'&')
        .filter(|piece| !piece.is_empty())
        .map(|piece| match piece.iter().position(|&b| b == b'=') {
            Some(at) => (decode(&piece[..at]), decode(&piece[at + 1..])),
            None => (decode(piece), Cow::Borrowed(&[][..])),
        })
        .collect();
    // By name only, and stable: the order of a repeated name's values is data
    // (`to=alice&to=bob` is not `to=bob&to=alice`); the order of different names is not.
    pairs.sort_by(|a, b| a.0.cmp(&b.0));
    super::put_len(out, pairs.len());
    for (name, value) in &pairs {
        super::put_field(out, name);
        super::put_field(out, value);
    }
}

/// `+` as a space and percent escapes as the bytes they name; borrowed when there are none.
fn decode(raw: &[u8]) -> Cow<'_, [u8]> {
    if !raw.iter().any(|&b| b == b'+' || b == b'%') {
        return Cow::Borrowed(raw);
    }
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        match raw[i] {
            b'+' => out.push(b' '),
            b'%' => match (raw.get(i + 1).and_then(hex), raw.get(i + 2).and_then(hex)) {
                (Some(high), Some(low)) => {
                    out.push(high << 4 | low);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    Cow::Owned(out)
}

fn hex(b: &u8) -> Option<u8> {
    (*b as char).to_digit(16).map(|d| d as u8)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    fn canon(body: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        super::canonicalize(body, &mut out);
        out
    }

    #[test]
    fn order_and_encoding_do_not_count_values_do() {
        assert_eq!(canon(b"a=1&b=x+y"), canon(b"b=x%20y&a=%31"));
        assert_ne!(canon(b"a=1&b=2"), canon(b"a=1&b=3"));
        assert_ne!(canon(b"a=1&b=2"), canon(b"a=1"));
        assert_ne!(canon(b"ab=&c="), canon(b"a=b&c="));
        assert_ne!(
            canon(b"to=alice&to=bob"),
            canon(b"to=bob&to=alice"),
            "a list's order is data"
        );
        assert_eq!(canon(b"to=alice&x=1&to=bob"), canon(b"x=1&to=alice&to=bob"));
    }

    /// Issue 16 §2: escapes that are not UTF-8 are different bytes, never one replacement
    /// character.
    #[test]
    fn escapes_that_are_not_utf8_stay_apart() {
        let e9 = canon(b"name=caf%E9");
        assert_ne!(e9, canon(b"name=caf%E8"));
        assert_ne!(e9, canon(b"name=caf%FF"));
        assert_ne!(canon(b"%FF=1"), canon(b"%FE=1"));
        assert_eq!(e9, canon(b"name=caf%e9"), "hex case is encoding, not data");
        assert_eq!(
            canon(b"a=%2"),
            canon(b"a=%252"),
            "a lone % is itself, as %25 is"
        );
        assert_ne!(canon(b"a=%2"), canon(b"a=%2F"));
    }

    /// A strict, independent decoder: the WHATWG steps on bytes, written plainly.
    fn strict(body: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
        let decode = |s: &[u8]| -> Vec<u8> {
            let text: Vec<u8> = s
                .iter()
                .map(|&b| if b == b'+' { b' ' } else { b })
                .collect();
            percent_encoding::percent_decode(&text).collect()
        };
        let mut pairs: Vec<_> = body
            .split(|&b| b == b'&')
            .filter(|p| !p.is_empty())
            .map(|p| {
                let mut it = p.splitn(2, |&b| b == b'=');
                let name = it.next().unwrap_or_default();
                let value = it.next().unwrap_or_default();
                (decode(name), decode(value))
            })
            .collect();
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
        pairs
    }

    proptest! {
        /// Differential: whenever two bodies canonicalise alike, the strict decoder sees the
        /// same pairs.
        #[test]
        fn equal_canonical_forms_mean_equal_pairs(
            a in prop::collection::vec(prop::sample::select(b"ab=&+%2EeF9\xe9\xff".to_vec()), 0..12),
            b in prop::collection::vec(prop::sample::select(b"ab=&+%2EeF9\xe9\xff".to_vec()), 0..12),
        ) {
            if canon(&a) == canon(&b) {
                prop_assert_eq!(strict(&a), strict(&b));
            }
            prop_assert_eq!(canon(&a) == canon(&b), strict(&a) == strict(&b));
        }
    }
}
