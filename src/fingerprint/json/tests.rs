use super::scan::*;
use super::verbatim::*;
use super::write::*;
use super::*;

fn canon(s: &str) -> Result<String, JsonError> {
    let mut out = Vec::new();
    canonicalize(s.as_bytes(), &mut out)?;
    Ok(String::from_utf8(out).expect("canonical JSON is UTF-8"))
}

proptest::proptest! {
    /// The word-at-a-time scan agrees with a byte-at-a-time one on any bytes: runs of
    /// every length, several special bytes, bytes above 0x7f that could fool a borrow.
    #[test]
    fn special_agrees_with_a_plain_scan(
        bytes in proptest::collection::vec(
            proptest::prop_oneof![
                4 => 0x20u8..0x7f,
                1 => proptest::prelude::Just(b'"'),
                1 => proptest::prelude::Just(b'\\'),
                1 => 0u8..0x20,
                2 => 0x80u8..=0xff,
            ],
            0..200,
        ),
    ) {
        let plain = bytes.iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20);
        proptest::prop_assert_eq!(special(&bytes), plain);
        let or_high = bytes.iter().position(|&b| b == b'"' || b == b'\\' || !(0x20..0x80).contains(&b));
        proptest::prop_assert_eq!(special_or_non_ascii(&bytes), or_high);
    }
}

/// Every pair of adjacent bytes at every position of a word pair (borrows run from a byte
/// into the next, and across the two words): the scans agree with a byte-at-a-time one.
#[test]
fn special_agrees_with_a_plain_scan_on_every_pair_of_bytes() {
    let plain = |v: &[u8]| v.iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20);
    let or_high = |v: &[u8]| {
        v.iter()
            .position(|&b| b == b'"' || b == b'\\' || !(0x20..0x80).contains(&b))
    };
    let mut v = [b'a'; 17];
    for at in 0..16 {
        for first in 0..=255u8 {
            for second in 0..=255u8 {
                v[at] = first;
                v[at + 1] = second;
                assert_eq!(special(&v), plain(&v), "{v:?}");
                assert_eq!(special_or_non_ascii(&v), or_high(&v), "{v:?}");
            }
        }
        v[at] = b'a';
        v[at + 1] = b'a';
    }
}

/// Every byte at every position of runs that span one, two and three blocks and a tail,
/// with a later hit behind it: the block test and the words agree with a plain scan.
#[test]
fn special_agrees_with_a_plain_scan_across_blocks() {
    let plain = |v: &[u8]| v.iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20);
    let or_high = |v: &[u8]| {
        v.iter()
            .position(|&b| b == b'"' || b == b'\\' || !(0x20..0x80).contains(&b))
    };
    for len in [BLOCK, BLOCK + 1, 2 * BLOCK + 15, 3 * BLOCK + 7] {
        let mut v = vec![b'a'; len];
        v[len - 1] = b'"';
        for at in 0..len {
            let kept = v[at];
            for byte in 0..=255u8 {
                v[at] = byte;
                assert_eq!(special(&v), plain(&v), "{len} {at} {byte}");
                assert_eq!(special_or_non_ascii(&v), or_high(&v), "{len} {at} {byte}");
            }
            v[at] = kept;
        }
    }
}

#[test]
fn special_finds_the_first_quote_backslash_or_control() {
    for (input, want) in [
        (&b""[..], None),
        (b"abcdefgh", None),
        (b"abcdefghijklmnop\"", Some(16)),
        (b"abc\\", Some(3)),
        (b"0123456789\x1f", Some(10)),
        (b"\x7f\x80\xffplain text\"", Some(13)),
        (b"x", None),
    ] {
        assert_eq!(special(input), want, "{input:?}");
    }
    // Every position, every special byte, in a longer run.
    for len in 0..40 {
        for b in [b'"', b'\\', 0x00, 0x1f] {
            let mut v = vec![b'a'; len + 1];
            v[len] = b;
            assert_eq!(special(&v), Some(len));
        }
    }
}

#[test]
fn verbatim_accepts_exactly_the_canonical_form() {
    // Each of these is its own RFC 8785 form.
    for canonical in [
        "{}",
        "[]",
        "0",
        "-1",
        "123456789012345",
        "1234567890123456",
        "1e+21",
        "5e-324",
        "-1.5",
        "0.000001",
        "0.1",
        "-0.5",
        "123456789.012345",
        "1e-7",
        r#""""#,
        r#""\"\\\b\f\n\r\t\u0000\u001f""#,
        "\"\u{e9}\u{2028}\u{1f600}\"",
        r#"{"a":[null,true,false],"b":{"":1,"x":"y"}}"#,
        "{\"\\r\":4,\"a\":3,\"\u{1f600}\":2,\"\u{fb33}\":1}",
    ] {
        let canon = canon(canonical).expect(canonical);
        // Names with escapes are left to the full path; everything else here is accepted.
        let want = !canonical.starts_with("{\"\\r");
        assert_eq!(verbatim(canonical.as_bytes()), want, "{canonical}");
        assert_eq!(canon, canonical, "the full path agrees: {canonical}");
    }
    // Each of these differs from its canonical form, or is not JSON at all.
    for other in [
        " {}",
        "{} ",
        "[1, 2]",
        "{\"a\" :1}",
        r#"{"b":1,"a":2}"#,
        r#"{"a":1,"a":1}"#,
        "-0",
        "1.0",
        "1e21",
        "1E+21",
        "01",
        "1.",
        "9007199254740993",
        "0.1e1",
        "0.10",
        "0.0000001",
        "1234567890.12345678",
        "00.5",
        "-.5",
        r#""\/""#,
        r#""\u001F""#,
        r#""\u000a""#,
        r#""\u00e9""#,
        r#""\u007f""#,
        "\"\u{1f600}\"x",
        "{\"\u{fb33}\":1,\"\u{1f600}\":2}",
        "[1-2]",
        "nul",
        "\"a\u{1}\"",
        "",
        "[",
    ] {
        assert!(!verbatim(other.as_bytes()), "{other:?}");
        if let Ok(canon) = canon(other) {
            assert_ne!(canon, other, "the full path rewrites it");
        }
    }
    let deep = "[".repeat(129) + &"]".repeat(129);
    assert!(!verbatim(deep.as_bytes()));
    let deep = "[".repeat(128) + &"]".repeat(128);
    assert!(verbatim(deep.as_bytes()));
}

#[test]
fn verbatim_accepts_only_utf8() {
    let long = "x".repeat(40);
    for (body, utf8) in [
        (
            format!("[\"{long}\u{e9}{long}\",\"\u{1f600}\"]").into_bytes(),
            true,
        ),
        (b"[\"\xff\"]".to_vec(), false),
        // Overlong, a surrogate, beyond U+10FFFF, cut short at the end.
        (b"[\"\xc0\xaf\"]".to_vec(), false),
        (b"[\"\xed\xa0\x80\"]".to_vec(), false),
        (b"[\"\xf4\x90\x80\x80\"]".to_vec(), false),
        (b"[\"\xc3".to_vec(), false),
        // Valid where the first byte past ASCII is, not further on.
        (
            [&b"[\"\xc3\xa9\",\""[..], long.as_bytes(), b"\xe9\"]"].concat(),
            false,
        ),
        // Outside strings, no byte past ASCII passes.
        (b"[1,\xc3\xa9]".to_vec(), false),
    ] {
        assert_eq!(verbatim(&body), utf8, "{}", String::from_utf8_lossy(&body));
        assert_eq!(
            std::str::from_utf8(&body).is_ok(),
            utf8 || body.starts_with(b"[1,")
        );
    }
}

#[test]
fn utf16_order_agrees_with_encode_utf16() {
    let chars = [
        'a',
        '~',
        '\u{7f}',
        '\u{80}',
        '\u{7ff}',
        '\u{800}',
        '\u{d7ff}',
        '\u{e000}',
        '\u{fb33}',
        '\u{ffff}',
        '\u{10000}',
        '\u{1f600}',
        '\u{10ffff}',
    ];
    let texts: Vec<String> = chars
        .iter()
        .flat_map(|&c| {
            chars
                .iter()
                .map(move |&d| format!("{c}{d}"))
                .chain([c.to_string(), format!("x{c}")])
        })
        .collect();
    for a in &texts {
        for b in &texts {
            assert_eq!(
                utf16_cmp(a, b),
                a.encode_utf16().cmp(b.encode_utf16()),
                "{a:?} vs {b:?}"
            );
        }
    }
}

#[test]
fn rfc8785_example() {
    // RFC 8785 §3.2.2 sample input and output, but for its first number: 333333333.33333329
    // is not a double, so RFC 8785 would merge it with 333333333.3333333 (issue 16 §2).
    let input = r#"{
      "numbers": [333333333.3333333, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
      "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
      "literals": [null, true, false]
    }"#;
    assert_eq!(
        canon(input).expect("valid"),
        r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#
    );
    assert_eq!(
        canon(&input.replace("333333333.3333333", "333333333.33333329")),
        Err(JsonError::NotCanonical)
    );
}

/// DESIGN §1.4: an escape of half a UTF-16 pair is valid JSON with no canonical form
/// (hashed as sent, never merged with the replacement character or another half); a
/// document with one, or with an inexact number, is still read to its end and refused
/// if it is not JSON further on.
#[test]
fn lone_surrogates_have_no_canonical_form_and_the_rest_is_still_read() {
    for text in [
        r#""\ud800""#,
        r#""\udc00""#,
        r#"["\ud800\u0041"]"#,
        r#"{"a":"x\uDBFF\uDBFF\uDC00"}"#,
        r#""\ud800\ud800""#,
    ] {
        assert_eq!(canon(text), Err(JsonError::NotCanonical), "{text}");
    }
    assert_eq!(canon(r#""\ud83d\ude00""#).expect("a pair"), "\"\u{1f600}\"");
    assert_eq!(
        canon(r#""\uD83D\uDE00x""#).expect("a pair"),
        "\"\u{1f600}x\""
    );
    for bad in [
        r#"["\ud800", x]"#,
        r#"["\ud800""#,
        r#"[1e400, x]"#,
        r#"{"a":1e400,}"#,
        r#""\ud800\u12""#,
        r#""\ud800\u+c00""#,
    ] {
        assert!(matches!(canon(bad), Err(JsonError::Malformed(_))), "{bad}");
    }
}

/// Issue 16 §2: numbers merge only when their canonical form names exactly their value.
#[test]
fn numbers_a_double_cannot_hold_have_no_canonical_form() {
    for text in [
        "9007199254740993",
        "18446744073709551616",
        "123456789012345678901234567890",
        "1e-400",
        "-1e-400",
        "0.10000000000000001",
        "1e400",
    ] {
        assert_eq!(canon(text), Err(JsonError::NotCanonical), "{text}");
    }
    for (text, canonical) in [
        ("9007199254740992", "9007199254740992"),
        ("1.0", "1"),
        ("1E2", "100"),
        ("-0", "0"),
        ("0.000", "0"),
        ("100e-2", "1"),
        ("1.5e+300", "1.5e+300"),
    ] {
        assert_eq!(canon(text).as_deref(), Ok(canonical), "{text}");
    }
}

#[test]
fn sorts_by_utf16_code_units() {
    // RFC 8785 §3.2.3: U+1F600 (surrogates D83D DE00) sorts before U+FB33.
    let input = "{\"\u{fb33}\":1,\"\u{1f600}\":2,\"a\":3,\"\\r\":4}";
    assert_eq!(
        canon(input).expect("valid"),
        "{\"\\r\":4,\"a\":3,\"\u{1f600}\":2,\"\u{fb33}\":1}"
    );
}

#[test]
fn numbers_in_ecmascript_form() {
    for (input, want) in [
        ("-0", "0"),
        ("0.0", "0"),
        ("1e21", "1e+21"),
        ("1e20", "100000000000000000000"),
        ("5e-324", "5e-324"),
        ("1e-7", "1e-7"),
        ("0.000001", "0.000001"),
        ("123.0", "123"),
        ("-1.5E3", "-1500"),
        ("1.7976931348623157e308", "1.7976931348623157e+308"),
    ] {
        assert_eq!(canon(input).expect(input), want, "{input}");
    }
}

#[test]
fn refuses_what_it_cannot_canonicalise() {
    assert_eq!(canon(r#"{"a":1,"a":2}"#), Err(JsonError::NotCanonical));
    assert_eq!(canon("1e400"), Err(JsonError::NotCanonical));
    for bad in [
        "",
        "{",
        "[1,]",
        "01",
        "1.",
        "\"\\ud800",
        "\"a\u{1}\"",
        "nul",
        "{} x",
    ] {
        assert!(
            matches!(canon(bad), Err(JsonError::Malformed(_))),
            "{bad:?}"
        );
    }
    let deep = "[".repeat(100_000) + &"]".repeat(100_000);
    assert!(matches!(canon(&deep), Err(JsonError::Malformed(_))));
    let mut out = Vec::new();
    assert!(matches!(
        canonicalize(b"\"\xff\"", &mut out),
        Err(JsonError::Malformed(_))
    ));
}
