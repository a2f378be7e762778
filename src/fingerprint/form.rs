//! `application/x-www-form-urlencoded` bodies, fingerprinted as their sorted, decoded pairs.
//!
//! Two encodings of the same pairs (`a=1&b=2`, `b=2&a=1`, `a=%31&b=2`) are the same operation.
//! Sorting means the relative order of repeated names does not count either (`a=1&a=2` equals
//! `a=2&a=1`): a documented trade for clients whose encoders reorder fields.

use super::Sink;

pub(crate) fn canonicalize(body: &[u8], out: &mut impl Sink) {
    let mut pairs: Vec<_> = form_urlencoded::parse(body).collect();
    pairs.sort();
    super::put_len(out, pairs.len());
    for (name, value) in &pairs {
        super::put_field(out, name.as_bytes());
        super::put_field(out, value.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    fn canon(body: &str) -> Vec<u8> {
        let mut out = Vec::new();
        super::canonicalize(body.as_bytes(), &mut out);
        out
    }

    #[test]
    fn order_and_encoding_do_not_count_values_do() {
        assert_eq!(canon("a=1&b=x+y"), canon("b=x%20y&a=%31"));
        assert_ne!(canon("a=1&b=2"), canon("a=1&b=3"));
        assert_ne!(canon("a=1&b=2"), canon("a=1"));
        assert_ne!(canon("ab=&c="), canon("a=b&c="));
    }
}
