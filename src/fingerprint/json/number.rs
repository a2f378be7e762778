//! Numbers: which print as written, their ECMAScript text, and whether two texts name one value.

use super::Sink;

/// The length of the number at the start of `s` if ECMAScript prints it exactly as written,
/// by construction: a plain integer of at most 15 digits without leading zeros (never `-0`),
/// or a decimal with at most 15 significant digits (so no other decimal that short is the
/// same double, and the text is the shortest form), no trailing zero, no exponent and a value
/// of at least 1e-6 (smaller ones print in exponent form). `None` says only "not proven".
pub(super) fn short_number(s: &[u8]) -> Option<usize> {
    let negative = s.first() == Some(&b'-');
    let digits = usize::from(negative);
    let mut i = digits;
    while let Some(b'0'..=b'9') = s.get(i) {
        i += 1;
    }
    let int = &s[digits..i];
    if int.is_empty() || (int[0] == b'0' && int.len() > 1) {
        return None;
    }
    match s.get(i) {
        Some(b'.') => {}
        Some(b'e' | b'E') => return None,
        _ => return (int.len() <= 15 && !(negative && int == b"0")).then_some(i),
    }
    let start = i + 1;
    let mut end = start;
    while let Some(b'0'..=b'9') = s.get(end) {
        end += 1;
    }
    let frac = &s[start..end];
    if frac.last().is_none_or(|&d| d == b'0') || matches!(s.get(end), Some(b'e' | b'E')) {
        return None;
    }
    let significant = if int == b"0" {
        let zeros = frac.iter().take_while(|&&d| d == b'0').count();
        if zeros > 5 {
            return None;
        }
        frac.len() - zeros
    } else {
        int.len() + frac.len()
    };
    (significant <= 15).then_some(end)
}

/// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`, the whole of `text`.
pub(super) fn json_number_grammar(text: &str) -> bool {
    let mut s = text.as_bytes();
    let digits = |s: &mut &[u8]| {
        let n = s.iter().take_while(|b| b.is_ascii_digit()).count();
        *s = &s[n..];
        n
    };
    if let [b'-', rest @ ..] = s {
        s = rest;
    }
    if digits(&mut s) == 0 {
        return false;
    }
    if let [b'.', rest @ ..] = s {
        s = rest;
        if digits(&mut s) == 0 {
            return false;
        }
    }
    if let [b'e' | b'E', rest @ ..] = s {
        s = rest;
        if let [b'+' | b'-', rest @ ..] = s {
            s = rest;
        }
        if digits(&mut s) == 0 {
            return false;
        }
    }
    s.is_empty()
}

/// The canonical text of a finite number (see [`write_number`]).
pub(super) fn canonical_number(n: f64) -> String {
    if n == 0.0 {
        return "0".to_owned();
    }
    ryu_js::Buffer::new().format_finite(n).to_owned()
}

/// A decimal number's exact value: its sign, its significant digits (no leading or trailing
/// zeros) and the power of ten of its last digit; `None` for zero, whatever its sign.
#[derive(PartialEq, Eq)]
struct Decimal<'a> {
    negative: bool,
    digits: Vec<&'a u8>,
    exponent: i128,
}

/// Whether two number texts (JSON grammar, or ECMAScript's form) name exactly the same value.
/// An exponent too large to read is never the same as anything.
pub(super) fn same_decimal(a: &str, b: &str) -> bool {
    match (decimal(a), decimal(b)) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

/// `Some(None)` for zero, `Some(Some(value))` otherwise, `None` when the exponent overflows.
fn decimal(text: &str) -> Option<Option<Decimal<'_>>> {
    let (negative, unsigned) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exponent) = match unsigned.find(['e', 'E']) {
        Some(at) => (&unsigned[..at], unsigned[at + 1..].parse::<i128>().ok()?),
        None => (unsigned, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let all: Vec<&u8> = int.as_bytes().iter().chain(frac.as_bytes()).collect();
    let first = all.iter().position(|&&d| d != b'0');
    let Some(first) = first else {
        return Some(None);
    };
    let last = all.iter().rposition(|&&d| d != b'0').unwrap_or(first);
    let trailing = (all.len() - 1 - last) as i128;
    Some(Some(Decimal {
        negative,
        digits: all[first..=last].to_vec(),
        exponent: exponent
            .checked_sub(frac.len() as i128)?
            .checked_add(trailing)?,
    }))
}

/// ECMAScript `Number.prototype.toString`, which RFC 8785 §3.2.2.3 adopts.
pub(super) fn write_number(n: f64, out: &mut impl Sink) {
    if n == 0.0 {
        // Both zeros print as "0".
        out.put(b"0");
        return;
    }
    let mut buf = ryu_js::Buffer::new();
    out.put(buf.format_finite(n).as_bytes());
}
