//! `multipart/form-data` bodies, fingerprinted by their parts rather than their bytes.
//!
//! Clients draw a fresh random boundary for every request, retries included, so the raw bytes
//! of two identical submissions differ. Each part counts by its headers (names lower-cased,
//! values without the spaces and tabs around them, a `Content-Type` read as the request's is
//! but keeping a nested part's own `boundary`, sorted by name, repeated names in their order)
//! and its content, in order; preamble and epilogue do not count.
//!
//! What has no one reading is refused as malformed rather than read one way: a `Content-Type`
//! whose parameters do not read (a `;` inside a quoted value is data, not a separator), a
//! `boundary` given twice, a header line folded over two (obsolete, and read apart by
//! readers that unfold it and readers that do not), and anything but padding after the close
//! delimiter on its line.

use std::borrow::Cow;

use super::{MalformedBody, Sink};

pub(crate) fn canonicalize(
    content_type: &str,
    body: &[u8],
    out: &mut impl Sink,
) -> Result<(), MalformedBody> {
    let boundary = boundary(content_type)?;
    let parts = split(body, boundary.as_bytes()).ok_or(MalformedBody::new(
        "multipart body does not follow its boundary",
    ))?;
    super::put_len(out, parts.len());
    for part in parts {
        // A part that opens with an empty line has no headers, whatever its content looks
        // like (issue 16 §2: content that reads like headers must not pass for them).
        let (head, content) = if let Some(content) = part.strip_prefix(b"\r\n") {
            (&part[..0], content)
        } else {
            match find(part, b"\r\n\r\n") {
                Some(at) => (&part[..at], &part[at + 4..]),
                None => return Err(MalformedBody::new("multipart part without a header end")),
            }
        };
        let mut headers = Vec::new();
        // Header lines end in CRLF only: a bare LF stays inside its line's value, so two
        // different heads never read as one.
        for line in split_crlf(head) {
            if matches!(line.first(), Some(b' ' | b'\t')) {
                return Err(MalformedBody::new(
                    "multipart part header folded over lines (obsolete)",
                ));
            }
            let colon = line
                .iter()
                .position(|&b| b == b':')
                .ok_or(MalformedBody::new("multipart header line without a colon"))?;
            let name = line[..colon].to_ascii_lowercase();
            // Only spaces and tabs surround a value (RFC 5322's WSP): any other byte there is
            // part of what was sent.
            let value = trim_wsp(&line[colon + 1..]);
            // A part's media type reads as the request's does (type, parameter names and a
            // charset without case, parameters sorted).
            let value = match std::str::from_utf8(value) {
                Ok(text) if name == b"content-type" => {
                    let media = super::media_type(text);
                    Cow::Owned(
                        super::media_with_parameters(text, &media, false)
                            .into_owned()
                            .into(),
                    )
                }
                _ => Cow::Borrowed(value),
            };
            headers.push((name, value));
        }
        // By name only, and stable: a repeated header keeps its order, which a reader of the
        // part may take as meaning (the first `Content-Disposition` wins).
        headers.sort_by(|a, b| a.0.cmp(&b.0));
        super::put_len(out, headers.len());
        for (name, value) in &headers {
            super::put_field(out, name);
            super::put_field(out, value);
        }
        super::put_field(out, content);
    }
    Ok(())
}

/// The one `boundary` parameter of a `Content-Type` that reads strictly.
fn boundary(content_type: &str) -> Result<String, MalformedBody> {
    let parameters = super::media::parameters(content_type).ok_or(MalformedBody::new(
        "multipart Content-Type whose parameters do not read",
    ))?;
    let mut boundaries = parameters
        .into_iter()
        .filter(|(name, _)| name == "boundary")
        .map(|(_, value)| value);
    match (boundaries.next(), boundaries.next()) {
        (Some(boundary), None) if !boundary.is_empty() => Ok(boundary),
        (Some(_), Some(_)) => Err(MalformedBody::new(
            "multipart Content-Type with more than one boundary parameter",
        )),
        _ => Err(MalformedBody::new(
            "multipart body without a boundary parameter",
        )),
    }
}

fn trim_wsp(value: &[u8]) -> &[u8] {
    let wsp = |b: &u8| matches!(b, b' ' | b'\t');
    let start = value.iter().position(|b| !wsp(b)).unwrap_or(value.len());
    let end = value.iter().rposition(|b| !wsp(b)).map_or(start, |i| i + 1);
    &value[start..end]
}

/// The parts between `--boundary` delimiters (RFC 2046 §5.1.1), or `None` if malformed.
fn split<'a>(body: &'a [u8], boundary: &[u8]) -> Option<Vec<&'a [u8]>> {
    let mut delimiter = b"\r\n--".to_vec();
    delimiter.extend_from_slice(boundary);
    // The first delimiter may open the body, without the CRLF before it.
    let mut at = if body.starts_with(&delimiter[2..]) {
        delimiter.len() - 2
    } else {
        find(body, &delimiter)? + delimiter.len()
    };
    let mut parts = Vec::new();
    loop {
        let rest = &body[at..];
        // Transport padding, then the CRLF that ends the delimiter line (or, after the close
        // delimiter, the body's end).
        let padded = |line: &'a [u8]| {
            let pad = line
                .iter()
                .take_while(|&&b| b == b' ' || b == b'\t')
                .count();
            &line[pad..]
        };
        if let Some(after) = rest.strip_prefix(b"--") {
            let after = padded(after);
            return (after.is_empty() || after.starts_with(b"\r\n")).then_some(parts);
        }
        let rest = padded(rest).strip_prefix(b"\r\n")?;
        let end = find(rest, &delimiter)?;
        parts.push(&rest[..end]);
        at = body.len() - rest.len() + end + delimiter.len();
    }
}

fn split_crlf(head: &[u8]) -> impl Iterator<Item = &[u8]> {
    // An empty head has no lines, not one empty line.
    let mut rest = (!head.is_empty()).then_some(head);
    std::iter::from_fn(move || {
        let current = rest?;
        match find(current, b"\r\n") {
            Some(at) => {
                rest = Some(&current[at + 2..]);
                Some(&current[..at])
            }
            None => {
                rest = None;
                Some(current)
            }
        }
    })
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(boundary: &str, preamble: &str) -> (String, Vec<u8>) {
        let body = format!(
            "{preamble}--{boundary}\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nvalue a\r\n\
             --{boundary}\r\ncontent-disposition:   form-data; name=\"f\"; filename=\"x.bin\"\r\n\
             Content-Type: application/octet-stream\r\n\r\n\x00\x01--\r\n--{boundary}--\r\nepilogue"
        );
        (
            format!("multipart/form-data; boundary=\"{boundary}\""),
            body.into_bytes(),
        )
    }

    fn canon(ct: &str, body: &[u8]) -> Result<Vec<u8>, MalformedBody> {
        let mut out = Vec::new();
        canonicalize(ct, body, &mut out).map(|()| out)
    }

    /// A part's `Content-Type` counts as the request's does: type, parameter names and a
    /// charset's value without case, parameters in any order; other values as they are.
    #[test]
    fn a_parts_media_type_reads_as_the_requests() {
        let ct = "multipart/form-data; boundary=b";
        let part = |content_type: &str| {
            let body = format!(
                "--b\r\nContent-Disposition: form-data; name=\"a\"\r\nContent-Type: {content_type}\r\n\r\nv\r\n--b--"
            );
            canon(ct, body.as_bytes()).expect("valid")
        };
        let plain = part("text/plain; charset=utf-8; format=flowed");
        for same in [
            "Text/Plain; charset=UTF-8; format=flowed",
            "text/plain;format=flowed;Charset=\"utf-8\"",
        ] {
            assert_eq!(part(same), plain, "{same}");
        }
        for other in [
            "text/plain; charset=utf-8; format=Flowed",
            "text/plain; charset=latin1; format=flowed",
            "text/plain; format=flowed",
            "text/csv; charset=utf-8; format=flowed",
        ] {
            assert_ne!(part(other), plain, "{other}");
        }
    }

    /// DESIGN §1.4: a part's repeated header lines keep their order (a reader takes the
    /// first), and a nested multipart part's `boundary` counts: its content is read by it.
    #[test]
    fn repeated_part_headers_keep_their_order_and_a_nested_boundary_counts() {
        let ct = "multipart/form-data; boundary=b";
        let part = |head: &str| {
            let body = format!("--b\r\n{head}\r\n\r\nv\r\n--b--");
            canon(ct, body.as_bytes()).expect("valid")
        };
        let to_cc = part(
            "Content-Disposition: form-data; name=\"to\"\r\nContent-Disposition: form-data; name=\"cc\"",
        );
        let cc_to = part(
            "Content-Disposition: form-data; name=\"cc\"\r\nContent-Disposition: form-data; name=\"to\"",
        );
        assert_ne!(to_cc, cc_to);
        // Different names still sort: their order never counted.
        assert_eq!(
            part("X-A: 1\r\nContent-Disposition: form-data; name=\"a\""),
            part("Content-Disposition: form-data; name=\"a\"\r\nX-A: 1")
        );
        let nested = |boundary: &str| {
            part(&format!(
                "Content-Disposition: form-data; name=\"n\"\r\nContent-Type: multipart/form-data; boundary={boundary}"
            ))
        };
        assert_ne!(nested("X"), nested("Y"));
        assert_eq!(nested("X"), nested("\"X\""));
    }

    #[test]
    fn boundary_preamble_and_header_case_do_not_count() {
        let (ct1, b1) = form("XyZ123", "");
        let (ct2, b2) = form("other-boundary-9", "preamble text\r\n");
        assert_eq!(
            canon(&ct1, &b1).expect("valid"),
            canon(&ct2, &b2).expect("valid")
        );
        let changed = String::from_utf8_lossy(&b1).replace("value a", "value b");
        assert_ne!(
            canon(&ct1, &b1).expect("valid"),
            canon(&ct1, changed.as_bytes()).expect("valid")
        );
    }

    /// Issue 16 §2: a part without headers whose content reads like a header block is not the
    /// part with that header.
    #[test]
    fn a_headerless_part_never_frames_a_real_field() {
        let ct = "multipart/form-data; boundary=b";
        let headerless = b"--b\r\n\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nv\r\n--b--";
        let field = b"--b\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nv\r\n--b--";
        assert_ne!(
            canon(ct, headerless).expect("valid"),
            canon(ct, field).expect("valid")
        );
        let folded = b"--b\r\nA: 1\nB: 2\r\n\r\nv\r\n--b--";
        let two = b"--b\r\nA: 1\r\nB: 2\r\n\r\nv\r\n--b--";
        assert_ne!(
            canon(ct, folded).expect("valid"),
            canon(ct, two).expect("valid")
        );
    }

    /// One generated part: headers (name, value) and content.
    type Part = (Vec<(String, String)>, Vec<u8>);

    /// Writes `parts` under `boundary`, with header names in the given case and optional
    /// whitespace around values: what two encoders of the same form may send.
    fn body(parts: &[Part], boundary: &str, upper: bool, pad: bool) -> Vec<u8> {
        let mut out = Vec::new();
        for (headers, content) in parts {
            out.extend_from_slice(format!("--{boundary}\r\n").as_bytes());
            for (name, value) in headers {
                let name = if upper {
                    name.to_ascii_uppercase()
                } else {
                    name.clone()
                };
                let sp = if pad { "  " } else { "" };
                out.extend_from_slice(format!("{name}:{sp}{value}{sp}\r\n").as_bytes());
            }
            out.extend_from_slice(b"\r\n");
            out.extend_from_slice(content);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
        out
    }

    fn parts() -> impl proptest::strategy::Strategy<Value = Vec<Part>> {
        use proptest::prelude::*;
        let header = (
            prop::sample::select(vec!["content-disposition", "content-type", "x-a"]),
            "[a-z=; \"]{0,6}",
        )
            .prop_map(|(n, v)| (n.to_owned(), v.trim().to_owned()));
        let content = prop::collection::vec(prop::sample::select(b"abx:\r\n -".to_vec()), 0..12);
        prop::collection::vec((prop::collection::vec(header, 0..3), content), 0..4)
    }

    proptest::proptest! {
        /// Issue 16 §2, differential: two bodies canonicalise alike only when the parts they
        /// were built from are the same (header names in any case, values without the spaces
        /// around them, headers in any order), whatever the boundary.
        #[test]
        fn equal_canonical_forms_mean_equal_parts(
            a in parts(),
            b in parts(),
            upper in proptest::prelude::any::<bool>(),
            pad in proptest::prelude::any::<bool>(),
        ) {
            let ct = |b: &str| format!("multipart/form-data; boundary={b}");
            let (x, y) = (body(&a, "XyZ0", false, false), body(&b, "qQ9-8", upper, pad));
            let normal = |parts: &[Part]| -> Vec<Part> {
                parts.iter().map(|(h, c)| {
                    let mut h = h.clone();
                    h.sort();
                    (h, c.clone())
                }).collect()
            };
            // Content that reads as a delimiter makes a body malformed: refused, never merged.
            if let (Ok(cx), Ok(cy)) = (canon(&ct("XyZ0"), &x), canon(&ct("qQ9-8"), &y)) {
                proptest::prop_assert_eq!(cx == cy, normal(&a) == normal(&b));
            }
        }
    }

    /// DESIGN §1.4, found by a differential review against a strict RFC 2046 reader: what
    /// one reader takes one way and another reader another is refused, never merged.
    #[test]
    fn what_has_no_one_reading_is_refused() {
        let field = |value: &str| {
            format!(
                "--REAL\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n{value}\r\n--REAL--\r\n"
            )
        };
        // A `;` inside a quoted parameter is data: the boundary is REAL, not EVIL.
        let hidden = "multipart/form-data; x=\"; boundary=EVIL; y=\"; boundary=REAL";
        let decoy = |value: &str| {
            format!(
                "--EVIL\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\npay 1\r\n--EVIL--\r\n{}",
                field(value)
            )
        };
        assert_ne!(
            canon(hidden, decoy("pay 100").as_bytes()).expect("reads by REAL"),
            canon(hidden, decoy("pay 999").as_bytes()).expect("reads by REAL"),
        );
        assert_eq!(
            canon(hidden, decoy("pay 100").as_bytes()).expect("reads by REAL"),
            canon(
                "multipart/form-data; boundary=REAL",
                field("pay 100").as_bytes()
            )
            .expect("valid"),
            "the decoy is the preamble"
        );
        for ct in [
            "multipart/form-data; boundary=REAL; boundary=REAL",
            "multipart/form-data; boundary=\"REAL",
            "multipart/form-data; boundary",
            "multipart/form-data; boundary=\"\"",
        ] {
            assert!(canon(ct, field("v").as_bytes()).is_err(), "{ct}");
        }
        let ct = "multipart/form-data; boundary=b";
        for body in [
            // Folded header lines.
            &b"--b\r\nContent-Disposition: form-data;\r\n name=\"a\"\r\n\r\nv\r\n--b--"[..],
            b"--b\r\n\tX: 1\r\n\r\nv\r\n--b--",
            // More than padding after the close delimiter.
            b"--b\r\n\r\nv\r\n--b--x",
            b"--b\r\n\r\nv\r\n--b-- x\r\n",
        ] {
            assert!(
                canon(ct, body).is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        for body in [
            &b"--b\r\n\r\nv\r\n--b-- \t"[..],
            b"--b\r\n\r\nv\r\n--b--\t\r\nend",
        ] {
            assert_eq!(
                canon(ct, body).expect("padding and an epilogue"),
                canon(ct, b"--b\r\n\r\nv\r\n--b--").expect("valid")
            );
        }
    }

    /// DESIGN §1.4: a header value loses only the spaces and tabs around it; any other byte
    /// there, or in a part's `Content-Type` that does not read, counts.
    #[test]
    fn only_spaces_and_tabs_around_a_header_value_do_not_count() {
        let ct = "multipart/form-data; boundary=b";
        let part = |head: &[u8]| {
            let mut body = b"--b\r\n".to_vec();
            body.extend_from_slice(head);
            body.extend_from_slice(b"\r\n\r\nv\r\n--b--");
            canon(ct, &body).expect("valid")
        };
        let plain = part(b"Content-Disposition: form-data; name=\"a\"");
        assert_eq!(
            plain,
            part(b"Content-Disposition: \t form-data; name=\"a\" \t")
        );
        for other in [
            &b"Content-Disposition: form-data; name=\"a\"\x0c"[..],
            b"Content-Disposition:\x0cform-data; name=\"a\"",
            b"Content-Disposition: form-data; name=\"a\"\n",
            b"Content-Disposition: form-data; name=\"a\"\r",
        ] {
            assert_ne!(part(other), plain, "{}", String::from_utf8_lossy(other));
        }
        let typed = part(b"Content-Disposition: form-data; name=\"a\"\r\nContent-Type: text/plain");
        for other in [
            &b"Content-Type: text/plain\x0b"[..],
            "Content-Type: text/plain\u{a0}".as_bytes(),
            "Content-Type: \u{3000}text/plain".as_bytes(),
        ] {
            let mut head = b"Content-Disposition: form-data; name=\"a\"\r\n".to_vec();
            head.extend_from_slice(other);
            assert_ne!(part(&head), typed, "{}", String::from_utf8_lossy(other));
        }
    }

    #[test]
    fn malformed_multipart_is_refused() {
        let (ct, body) = form("XyZ123", "");
        assert!(canon("multipart/form-data", &body).is_err());
        assert!(canon(&ct, b"no delimiter at all").is_err());
        assert!(canon(&ct, &body[..body.len() - 20]).is_err());
    }
}
