//! Review: the fingerprint of `multipart/form-data` bodies (DESIGN §1 step 4: "multipart/form-data
//! by its parts, not its random boundary"; "canonicalisation may only merge what is provably the
//! same request"), attacked differentially.
//!
//! An independent strict multipart reader (RFC 2046 §5.1.1, RFC 7578, header fields as RFC 5322
//! reads them), written here and sharing no code with the crate, says what each body is: its
//! parts in order, each part's header lines (names without case, values unfolded and without the
//! optional whitespace around them) and content bytes. Two requests the strict reader reads
//! differently (or one of which it refuses while it reads the other) must never share a
//! fingerprint: a retry of one would be answered with the other's stored response (a MERGE).
//! The lesser fault, the same submission under another boundary (or header-name case, transport
//! padding, preamble, epilogue) fingerprinting differently, is checked too.
//!
//! What the strict reader counts as the same: header names in any case; header lines of
//! different names in any order (lines of one name keep theirs); SP/HTAB around a value; a
//! part's `Content-Type` read as a media type (type, subtype, parameter names and a charset's
//! value without case, parameters of different names in any order, a quoted value as its
//! content); a `Content-Transfer-Encoding` token without case; the outer boundary, preamble and
//! epilogue not at all. Everything else counts.
//!
//! Fingerprints come from the public `Fingerprint::of`; the merges found are then shown over
//! real TCP with the crate's layer in front of a handler that counts its effects per key.
//!
//! Ten tests failed when written (session 38), on six causes, all merges, all fixed since:
//! the boundary read from a `Content-Type` split at every `;` (a `boundary=` inside a quoted
//! parameter framed the body, and a repeated `boundary` took the first); part header values
//! trimmed of form feeds, CR, LF and (in a part's `Content-Type`) vertical tabs and Unicode
//! spaces; folded header lines read as headers of their own and sorted away from the line
//! they continue; anything after the close delimiter ignored; and `Content-Type` parameters
//! that do not parse (`; foo`, `; =x`, a stray quote) read as some that do. `Content-Type`
//! values are now read strictly (`fingerprint::media`; one that does not read counts as
//! sent), values lose only spaces and tabs, and a body with two boundaries, folded headers
//! or more than padding after its close delimiter is refused. The fingerprint scheme's name
//! moved to `v1/r2` (the hashed tag stays `v1`), so a retry across the upgrade whose reading
//! changed is never told to use a new key (the last two tests).

use crate::common;

use common::schemes::{cases, esc, field, old_response, plain_scheme, seeded};

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::routing::post;
use common::raw::{raw_post, unique};
use common::serve;
use http_body_util::BodyExt;
use proptest::prelude::*;
use proptest::sample::Index;
use tower_idempotency::{Fingerprint, IdempotencyLayer, MemoryStore};

const CRLF: &[u8] = b"\r\n";

// ---- the strict reader ----------------------------------------------------------------------

fn is_ows(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

fn trim_ows(mut v: &[u8]) -> &[u8] {
    while let [first, rest @ ..] = v {
        if !is_ows(*first) {
            break;
        }
        v = rest;
    }
    while let [rest @ .., last] = v {
        if !is_ows(*last) {
            break;
        }
        v = rest;
    }
    v
}

/// RFC 2045 `token`: visible US-ASCII except tspecials.
fn is_token(b: u8) -> bool {
    (0x21..0x7f).contains(&b) && !b"()<>@,;:\\\"/[]?=".contains(&b)
}

/// RFC 2046 `bchars`.
fn is_bchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"'()+_,-./:=? ".contains(&b)
}

fn find_from(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    hay.get(from..)?
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|at| at + from)
}

/// A media type: `type/subtype` lower-cased, parameters in order as (lower-cased name, value
/// unquoted; a charset's value lower-cased).
#[derive(Clone, Debug, PartialEq, Eq)]
struct MediaType {
    essence: Vec<u8>,
    params: Vec<(Vec<u8>, Vec<u8>)>,
}

/// RFC 2045 §5.1: `type "/" subtype *(OWS ";" OWS name OWS "=" OWS value)`, a value a token
/// or a quoted-string; anything else is refused.
fn parse_media(value: &[u8]) -> Result<MediaType, String> {
    let v = trim_ows(value);
    let mut i = 0;
    let token = |i: &mut usize| -> Result<Vec<u8>, String> {
        let start = *i;
        while *i < v.len() && is_token(v[*i]) {
            *i += 1;
        }
        if *i == start {
            return Err(format!("a token expected at byte {start}"));
        }
        Ok(v[start..*i].to_vec())
    };
    let kind = token(&mut i)?;
    if v.get(i) != Some(&b'/') {
        return Err("no '/' in the media type".into());
    }
    i += 1;
    let sub = token(&mut i)?;
    let mut essence = kind.to_ascii_lowercase();
    essence.push(b'/');
    essence.extend(sub.to_ascii_lowercase());
    let mut params = Vec::new();
    loop {
        while i < v.len() && is_ows(v[i]) {
            i += 1;
        }
        if i == v.len() {
            break;
        }
        if v[i] != b';' {
            return Err(format!("';' expected at byte {i}"));
        }
        i += 1;
        while i < v.len() && is_ows(v[i]) {
            i += 1;
        }
        let name = token(&mut i)?.to_ascii_lowercase();
        // RFC 2045 reads a structured field as RFC 822 tokens: whitespace may surround '='.
        while i < v.len() && is_ows(v[i]) {
            i += 1;
        }
        if v.get(i) != Some(&b'=') {
            return Err("a parameter without '='".into());
        }
        i += 1;
        while i < v.len() && is_ows(v[i]) {
            i += 1;
        }
        let mut value = if v.get(i) == Some(&b'"') {
            i += 1;
            let mut out = Vec::new();
            loop {
                match v.get(i) {
                    None => return Err("an unterminated quoted-string".into()),
                    Some(b'"') => {
                        i += 1;
                        break;
                    }
                    Some(b'\\') => {
                        let c = *v.get(i + 1).ok_or("a quoted-pair cut short")?;
                        if !(c == b'\t' || (0x20..=0x7e).contains(&c) || c >= 0x80) {
                            return Err("an invalid quoted-pair".into());
                        }
                        out.push(c);
                        i += 2;
                    }
                    Some(&c)
                        if c == b'\t'
                            || c == b' '
                            || c == 0x21
                            || (0x23..=0x5b).contains(&c)
                            || (0x5d..=0x7e).contains(&c)
                            || c >= 0x80 =>
                    {
                        out.push(c);
                        i += 1;
                    }
                    Some(_) => return Err("an invalid byte in a quoted-string".into()),
                }
            }
            out
        } else {
            token(&mut i)?
        };
        if name == b"charset" {
            value.make_ascii_lowercase();
        }
        params.push((name, value));
    }
    Ok(MediaType { essence, params })
}

/// Parameters as (name, value) bytes.
type Params = Vec<(Vec<u8>, Vec<u8>)>;

/// The request's own `Content-Type`: its boundary (RFC 2046 §5.1.1: 1 to 70 bchars, not ending
/// in a space) and its other parameters, sorted. A repeated parameter is refused: which one a
/// reader takes is not defined.
fn strict_content_type(ct: &str) -> Result<(Vec<u8>, Params), String> {
    let media = parse_media(ct.as_bytes())?;
    if media.essence != b"multipart/form-data" {
        return Err("not multipart/form-data".into());
    }
    let mut names: Vec<&Vec<u8>> = media.params.iter().map(|(n, _)| n).collect();
    names.sort();
    if names.windows(2).any(|w| w[0] == w[1]) {
        return Err("a repeated media-type parameter".into());
    }
    let boundary = media
        .params
        .iter()
        .find(|(n, _)| n == b"boundary")
        .map(|(_, v)| v.clone())
        .ok_or("no boundary parameter")?;
    if boundary.is_empty()
        || boundary.len() > 70
        || !boundary.iter().all(|&b| is_bchar(b))
        || boundary.ends_with(b" ")
    {
        return Err(format!("an invalid boundary {:?}", esc(&boundary)));
    }
    let mut rest: Vec<_> = media
        .params
        .into_iter()
        .filter(|(n, _)| n != b"boundary")
        .collect();
    rest.sort();
    Ok((boundary, rest))
}

/// One part as the strict reader reads it: header lines in order (lower-cased name, value
/// unfolded and without SP/HTAB around it) and the content bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
struct StrictPart {
    headers: Vec<(Vec<u8>, Vec<u8>)>,
    content: Vec<u8>,
}

/// RFC 2046 §5.1.1. Every line that begins with `--boundary` (at the body's start or right after
/// a CRLF) is a boundary line (the RFC's note to implementors; the grammar forbids such lines
/// inside a part): `--boundary` then transport padding then CRLF opens a part, `--boundary--`
/// then padding then CRLF or the end closes the body; any other such line is an error. Lines
/// before the first delimiter are the preamble, everything after the close delimiter is the
/// epilogue. A part is the bytes between its delimiter line and the CRLF before the next one;
/// at least one part, and the close delimiter, are required.
fn strict_parts(boundary: &[u8], body: &[u8]) -> Result<Vec<StrictPart>, String> {
    let dash: Vec<u8> = [b"--".as_slice(), boundary].concat();
    let mut starts = vec![0usize];
    starts.extend(
        body.windows(2)
            .enumerate()
            .filter(|(_, w)| *w == CRLF)
            .map(|(i, _)| i + 2),
    );
    // (start, end after the line's CRLF, close)
    let mut lines: Vec<(usize, usize, bool)> = Vec::new();
    for s in starts {
        if lines.last().is_some_and(|l| l.2) {
            break;
        }
        if !body[s..].starts_with(&dash) {
            continue;
        }
        let mut j = s + dash.len();
        let close = body[j..].starts_with(b"--");
        if close {
            j += 2;
        }
        while j < body.len() && is_ows(body[j]) {
            j += 1;
        }
        let end = if body[j..].starts_with(CRLF) {
            j + 2
        } else if close && j == body.len() {
            j
        } else if close {
            return Err(format!("junk after the close delimiter at byte {s}"));
        } else {
            return Err(format!(
                "the line at byte {s} begins with the boundary but is no delimiter"
            ));
        };
        lines.push((s, end, close));
    }
    let first = lines.first().ok_or("no delimiter line")?;
    if first.2 {
        return Err("a close delimiter before any part".into());
    }
    if !lines.last().is_some_and(|l| l.2) {
        return Err("no close delimiter".into());
    }
    let mut parts = Vec::new();
    for w in lines.windows(2) {
        let ((_, end, _), (next, _, _)) = (w[0], w[1]);
        if next < end + 2 {
            return Err("a part without the CRLF before the next delimiter".into());
        }
        parts.push(strict_part(&body[end..next - 2])?);
    }
    Ok(parts)
}

/// A part: header lines ending in CRLF (a line that starts with SP/HTAB continues the one
/// before it, RFC 5322 §2.2.3), an empty line, the content. A bare CR or LF in a header line, a
/// line without a colon or with an invalid name, or a header line without its CRLF is refused.
fn strict_part(bytes: &[u8]) -> Result<StrictPart, String> {
    let mut headers: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    let mut i = 0;
    let content = loop {
        if i >= bytes.len() {
            break Vec::new();
        }
        let Some(eol) = find_from(bytes, CRLF, i) else {
            return Err("a header line without its CRLF".into());
        };
        let line = &bytes[i..eol];
        if line.is_empty() {
            break bytes[eol + 2..].to_vec();
        }
        if line.iter().any(|&b| b == b'\r' || b == b'\n') {
            return Err("a bare CR or LF in a header line".into());
        }
        if is_ows(line[0]) {
            let last = headers
                .last_mut()
                .ok_or("a continuation line before any header")?;
            last.1.extend_from_slice(line);
        } else {
            let colon = line
                .iter()
                .position(|&b| b == b':')
                .ok_or("a header line without a colon")?;
            let name = &line[..colon];
            if name.is_empty() || !name.iter().all(|&b| (33..=126).contains(&b)) {
                return Err("an invalid header name".into());
            }
            headers.push((name.to_ascii_lowercase(), line[colon + 1..].to_vec()));
        }
        i = eol + 2;
    };
    for header in &mut headers {
        header.1 = trim_ows(&header.1).to_vec();
    }
    Ok(StrictPart { headers, content })
}

/// The strict reading of a request: its parts in order, or why it is not multipart.
fn strict_read(ct: &str, body: &[u8]) -> Result<Vec<StrictPart>, String> {
    let (boundary, _) = strict_content_type(ct)?;
    strict_parts(&boundary, body)
}

/// What a header value means.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Value {
    Media(MediaType),
    Token(Vec<u8>),
    Text(Vec<u8>),
}

fn value_meaning(name: &[u8], value: &[u8]) -> Value {
    match name {
        b"content-type" => match parse_media(value) {
            Ok(mut media) => {
                media.params.sort_by(|a, b| a.0.cmp(&b.0));
                Value::Media(media)
            }
            Err(_) => Value::Text(value.to_vec()),
        },
        b"content-transfer-encoding" if !value.is_empty() && value.iter().all(|&b| is_token(b)) => {
            Value::Token(value.to_ascii_lowercase())
        }
        _ => Value::Text(value.to_vec()),
    }
}

type PartMeaning = (Vec<(Vec<u8>, Value)>, Vec<u8>);

/// What a request means to the strict reader: the outer media type's parameters other than
/// the boundary, and the parts (header lines sorted by name, stable).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Meaning {
    params: Vec<(Vec<u8>, Vec<u8>)>,
    parts: Vec<PartMeaning>,
}

fn meaning(ct: &str, body: &[u8]) -> Result<Meaning, String> {
    let (boundary, params) = strict_content_type(ct)?;
    let parts = strict_parts(&boundary, body)?
        .into_iter()
        .map(|part| {
            let mut headers: Vec<(Vec<u8>, Value)> = part
                .headers
                .iter()
                .map(|(n, v)| (n.clone(), value_meaning(n, v)))
                .collect();
            headers.sort_by(|a, b| a.0.cmp(&b.0));
            (headers, part.content)
        })
        .collect();
    Ok(Meaning { params, parts })
}

fn show(ct: &str, body: &[u8]) -> String {
    match strict_read(ct, body) {
        Err(e) => format!("malformed ({e})"),
        Ok(parts) => parts
            .iter()
            .map(|p| {
                let heads: Vec<String> = p
                    .headers
                    .iter()
                    .map(|(n, v)| format!("{}: {}", esc(n), esc(v)))
                    .collect();
                format!("{{[{}] \"{}\"}}", heads.join(" | "), esc(&p.content))
            })
            .collect::<Vec<_>>()
            .join(", "),
    }
}

// ---- the crate, through its public API -------------------------------------------------------

fn fp(ct: &str, body: &[u8]) -> Result<Fingerprint, String> {
    let (parts, ()) = http::Request::post("/op")
        .header("content-type", ct)
        .body(())
        .expect("request")
        .into_parts();
    Fingerprint::of(&parts, body).map_err(|e| e.to_string())
}

/// Whether the strict reader reads the two requests differently (or refuses exactly one).
fn strictly_differ(ct_a: &str, a: &[u8], ct_b: &str, b: &[u8]) -> bool {
    match (meaning(ct_a, a), meaning(ct_b, b)) {
        (Ok(x), Ok(y)) => x != y,
        (Err(_), Err(_)) => false,
        _ => true,
    }
}

fn describe_pair(ct_a: &str, a: &[u8], ct_b: &str, b: &[u8]) -> String {
    format!(
        "\n    A: content-type {ct_a:?}\n       body \"{}\"\n       strict: {}\n       crate: {:?}\
         \n    B: content-type {ct_b:?}\n       body \"{}\"\n       strict: {}\n       crate: {:?}",
        esc(a),
        show(ct_a, a),
        fp(ct_a, a),
        esc(b),
        show(ct_b, b),
        fp(ct_b, b),
    )
}

/// A MERGE: the strict reader reads the requests differently, the crate gives both one
/// fingerprint. `None` when there is none.
fn merge(ct_a: &str, a: &[u8], ct_b: &str, b: &[u8]) -> Option<String> {
    if !strictly_differ(ct_a, a, ct_b, b) {
        return None;
    }
    match (fp(ct_a, a), fp(ct_b, b)) {
        (Ok(x), Ok(y)) if x == y => Some(format!(
            "MERGE: different requests, one fingerprint{}",
            describe_pair(ct_a, a, ct_b, b)
        )),
        _ => None,
    }
}

/// The lesser fault: the strict reader reads both as the same submission, the crate gives them
/// different fingerprints (or refuses exactly one).
fn split_apart(ct_a: &str, a: &[u8], ct_b: &str, b: &[u8]) -> Option<String> {
    let (Ok(x), Ok(y)) = (meaning(ct_a, a), meaning(ct_b, b)) else {
        return None;
    };
    if x != y {
        return None;
    }
    // Refusing both (400, nothing run) splits nothing apart.
    match (fp(ct_a, a), fp(ct_b, b)) {
        (Ok(x), Ok(y)) if x == y => None,
        (Err(_), Err(_)) => None,
        _ => Some(format!(
            "SPLIT: one submission, two fingerprints (or one refused){}",
            describe_pair(ct_a, a, ct_b, b)
        )),
    }
}

// ---- hand-written pairs ----------------------------------------------------------------------

struct Case {
    name: &'static str,
    ct_a: String,
    a: Vec<u8>,
    ct_b: String,
    b: Vec<u8>,
}

fn case(name: &'static str, ct_a: &str, a: &[u8], ct_b: &str, b: &[u8]) -> Case {
    Case {
        name,
        ct_a: ct_a.to_owned(),
        a: a.to_vec(),
        ct_b: ct_b.to_owned(),
        b: b.to_vec(),
    }
}

/// Both under one content type.
fn pair(name: &'static str, ct: &str, a: &[u8], b: &[u8]) -> Case {
    case(name, ct, a, ct, b)
}

fn mp(boundary: &str) -> String {
    format!("multipart/form-data; boundary={boundary}")
}

/// A body of these parts (head: header lines each ending in CRLF; "" for none) under `b`.
fn body(b: &str, parts: &[(&[u8], &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (head, content) in parts {
        out.extend(format!("--{b}\r\n").as_bytes());
        out.extend_from_slice(head);
        out.extend_from_slice(CRLF);
        out.extend_from_slice(content);
        out.extend_from_slice(CRLF);
    }
    out.extend(format!("--{b}--\r\n").as_bytes());
    out
}

fn one(b: &str, head: &[u8], content: &[u8]) -> Vec<u8> {
    body(b, &[(head, content)])
}

const CD_A: &[u8] = b"Content-Disposition: form-data; name=\"a\"\r\n";
const CD_B: &[u8] = b"Content-Disposition: form-data; name=\"b\"\r\n";

/// Asserts every case is read differently by the strict reader (a check on the case itself),
/// then that the crate never gives both one fingerprint.
fn expect_no_merge(cases: Vec<Case>) {
    let mut failures = Vec::new();
    for c in &cases {
        assert!(
            strictly_differ(&c.ct_a, &c.a, &c.ct_b, &c.b),
            "test case {:?}: the strict reader reads both alike{}",
            c.name,
            describe_pair(&c.ct_a, &c.a, &c.ct_b, &c.b)
        );
        if let Some(m) = merge(&c.ct_a, &c.a, &c.ct_b, &c.b) {
            failures.push(format!("[{}] {m}", c.name));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} pairs merged:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

fn content_cases() -> Vec<Case> {
    let ct = mp("b");
    let with = |content: &[u8]| one("b", CD_A, content);
    vec![
        pair("another byte", &ct, &with(b"v"), &with(b"w")),
        pair(
            "boundary text mid-line in content",
            &ct,
            &with(b"v--b"),
            &with(b"v"),
        ),
        pair("content '--'", &ct, &with(b"--"), &with(b"")),
        pair(
            "content '--b--' mid-line",
            &ct,
            &with(b"x--b--"),
            &with(b"x"),
        ),
        pair("a bare CR at the end", &ct, &with(b"v\r"), &with(b"v")),
        pair("a bare LF at the end", &ct, &with(b"v\n"), &with(b"v")),
        pair("a bare CR at the start", &ct, &with(b"\rv"), &with(b"v")),
        pair("a bare LF at the start", &ct, &with(b"\nv"), &with(b"v")),
        pair("trailing space", &ct, &with(b"v "), &with(b"v")),
        pair("trailing tab", &ct, &with(b"v\t"), &with(b"v")),
        pair("trailing form feed", &ct, &with(b"v\x0c"), &with(b"v")),
        pair("content CRLF vs empty", &ct, &with(b"\r\n"), &with(b"")),
        pair(
            "a line that begins with the boundary in content",
            &ct,
            &with(b"v\r\n--bX"),
            &with(b"v"),
        ),
        pair("a NUL", &ct, &with(b"v\0"), &with(b"v")),
    ]
}

fn structure_cases() -> Vec<Case> {
    let ct = mp("b");
    vec![
        pair(
            "an extra empty part without headers",
            &ct,
            &body("b", &[(CD_A, b"v"), (b"", b"")]),
            &body("b", &[(CD_A, b"v")]),
        ),
        pair(
            "parts in another order",
            &ct,
            &body("b", &[(CD_A, b"1"), (CD_B, b"2")]),
            &body("b", &[(CD_B, b"2"), (CD_A, b"1")]),
        ),
        pair(
            "a headerless part whose content reads like headers",
            &ct,
            &one(
                "b",
                b"",
                b"Content-Disposition: form-data; name=\"a\"\r\n\r\nv",
            ),
            &one("b", CD_A, b"v"),
        ),
        pair(
            "a part without headers vs one with",
            &ct,
            &one("b", b"", b"v"),
            &one("b", CD_A, b"v"),
        ),
        pair(
            "a part twice vs once",
            &ct,
            &body("b", &[(CD_A, b"v"), (CD_A, b"v")]),
            &body("b", &[(CD_A, b"v")]),
        ),
        pair(
            "content split into two parts at a delimiter",
            &ct,
            &body("b", &[(CD_A, b"v\r\n--b\r\n\r\nw")]),
            &body("b", &[(CD_A, b"v\r\n\r\nw")]),
        ),
    ]
}

fn whitespace_and_case_cases() -> Vec<Case> {
    let ct = mp("b");
    let head = |h: &[u8]| one("b", h, b"v");
    let cd = |v: &[u8]| head(&[b"Content-Disposition: ", v, b"\r\n"].concat());
    let cdt =
        |v: &[u8]| head(&[CD_A, b"Content-Type: ".as_slice(), v, b"\r\n".as_slice()].concat());
    vec![
        pair(
            "name case in a value",
            &ct,
            &cd(b"form-data; name=\"a\""),
            &cd(b"form-data; name=\"A\""),
        ),
        pair(
            "whitespace inside a value",
            &ct,
            &cd(b"form-data;name=\"a\""),
            &cd(b"form-data; name=\"a\""),
        ),
        pair(
            "Content-Disposition with a trailing form feed",
            &ct,
            &cd(b"form-data; name=\"a\"\x0c"),
            &cd(b"form-data; name=\"a\""),
        ),
        pair(
            "Content-Disposition with a leading form feed",
            &ct,
            &cd(b"\x0cform-data; name=\"a\""),
            &cd(b"form-data; name=\"a\""),
        ),
        pair(
            "Content-Type with a trailing vertical tab",
            &ct,
            &cdt(b"text/plain\x0b"),
            &cdt(b"text/plain"),
        ),
        pair(
            "Content-Type with a trailing no-break space",
            &ct,
            &cdt("text/plain\u{a0}".as_bytes()),
            &cdt(b"text/plain"),
        ),
        pair(
            "Content-Type with a leading ideographic space",
            &ct,
            &cdt("\u{3000}text/plain".as_bytes()),
            &cdt(b"text/plain"),
        ),
        pair(
            "a charset value with a trailing no-break space",
            &ct,
            &cdt("text/plain; charset=utf-8\u{a0}".as_bytes()),
            &cdt(b"text/plain; charset=utf-8"),
        ),
        pair(
            "a parameter name with a leading em space",
            &ct,
            &cdt("text/plain;\u{2003}charset=utf-8".as_bytes()),
            &cdt(b"text/plain; charset=utf-8"),
        ),
        pair(
            "Content-Transfer-Encoding with a trailing form feed",
            &ct,
            &head(
                &[
                    CD_A,
                    b"Content-Transfer-Encoding: base64\x0c\r\n".as_slice(),
                ]
                .concat(),
            ),
            &head(&[CD_A, b"Content-Transfer-Encoding: base64\r\n".as_slice()].concat()),
        ),
        pair(
            "Content-Transfer-Encoding base64 vs binary",
            &ct,
            &head(&[CD_A, b"Content-Transfer-Encoding: base64\r\n".as_slice()].concat()),
            &head(&[CD_A, b"Content-Transfer-Encoding: binary\r\n".as_slice()].concat()),
        ),
    ]
}

fn bare_cr_lf_cases() -> Vec<Case> {
    let ct = mp("b");
    let head = |h: &[u8]| one("b", h, b"v");
    vec![
        pair(
            "a bare LF ending a header value",
            &ct,
            &head(b"Content-Disposition: form-data; name=\"a\"\n\r\n"),
            &head(CD_A),
        ),
        pair(
            "a bare CR ending a header value",
            &ct,
            &head(b"Content-Disposition: form-data; name=\"a\"\r\r\n"),
            &head(CD_A),
        ),
        pair(
            "a bare LF opening a header value",
            &ct,
            &head(b"Content-Disposition:\nform-data; name=\"a\"\r\n"),
            &head(CD_A),
        ),
        pair(
            "a bare LF inside a header value",
            &ct,
            &head(b"Content-Disposition: form-data;\nname=\"a\"\r\n"),
            &head(CD_A),
        ),
    ]
}

fn folding_cases() -> Vec<Case> {
    let ct = mp("b");
    let head = |h: &[u8]| one("b", h, b"v");
    vec![
        pair(
            "a folded line continues another header",
            &ct,
            &head(b"Content-Disposition: form-data; name=\"a\"\r\n x: 1\r\nContent-Type: text/plain\r\n"),
            &head(b"Content-Disposition: form-data; name=\"a\"\r\nContent-Type: text/plain\r\n x: 1\r\n"),
        ),
        pair(
            "a folded line in another case",
            &ct,
            &head(b"Content-Disposition: form-data; name=\"a\"\r\n x: 1\r\n"),
            &head(b"Content-Disposition: form-data; name=\"a\"\r\n X: 1\r\n"),
        ),
        pair(
            "a folded line before any header",
            &ct,
            &head(b" x: 1\r\nContent-Disposition: form-data; name=\"a\"\r\n"),
            &head(b"Content-Disposition: form-data; name=\"a\"\r\n x: 1\r\n"),
        ),
        pair(
            "a folded filename",
            &ct,
            &head(b"Content-Disposition: form-data; name=\"a\";\r\n filename:\"x.txt\"\r\n"),
            &head(b"Content-Disposition: form-data; name=\"a\";\r\n filename: \"x.txt\"\r\n"),
        ),
    ]
}

fn duplicate_header_cases() -> Vec<Case> {
    let ct = mp("b");
    let head = |h: &[u8]| one("b", h, b"v");
    vec![
        pair(
            "repeated Content-Disposition in another order",
            &ct,
            &head(&[CD_A, CD_B].concat()),
            &head(&[CD_B, CD_A].concat()),
        ),
        pair(
            "a repeated header vs a single one",
            &ct,
            &head(&[CD_A, CD_A].concat()),
            &head(CD_A),
        ),
        pair(
            "Content-Type twice vs once",
            &ct,
            &head(
                &[
                    CD_A,
                    b"Content-Type: text/plain\r\nContent-Type: text/plain\r\n".as_slice(),
                ]
                .concat(),
            ),
            &head(&[CD_A, b"Content-Type: text/plain\r\n".as_slice()].concat()),
        ),
        pair(
            "another header name",
            &ct,
            &head(&[CD_A, b"Content-Type: text/plain\r\n".as_slice()].concat()),
            &head(&[CD_A, b"Content-Typo: text/plain\r\n".as_slice()].concat()),
        ),
    ]
}

fn framing_cases() -> Vec<Case> {
    let ct = mp("b");
    let good = one("b", CD_A, b"v");
    let part = b"--b\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nv\r\n";
    vec![
        pair(
            "no close delimiter",
            &ct,
            &[part.as_slice(), b"--b\r\n"].concat(),
            &good,
        ),
        pair("body cut after the last part", &ct, part, &good),
        pair(
            "junk right after the close delimiter",
            &ct,
            &[part.as_slice(), b"--b--x"].concat(),
            &good,
        ),
        pair(
            "junk after the close delimiter, then another part",
            &ct,
            &[
                part.as_slice(),
                b"--b--x\r\n--b\r\nContent-Disposition: form-data; name=\"b\"\r\n\r\nw\r\n--b--\r\n",
            ]
            .concat(),
            &good,
        ),
        pair(
            "padding then junk after the close delimiter",
            &ct,
            &[part.as_slice(), b"--b-- x\r\n"].concat(),
            &good,
        ),
        pair(
            "a close delimiter opening the body",
            &ct,
            &[b"--b--\r\n".as_slice(), &good].concat(),
            &good,
        ),
        pair(
            "junk after a delimiter's padding",
            &ct,
            b"--b x\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nv\r\n--b--\r\n",
            &good,
        ),
    ]
}

/// The body read as parts under `first` by a reader that takes the first boundary it finds
/// and as other parts under `second`.
fn polyglot(first: &str, a: &[u8], second: &str, b: &[u8]) -> Vec<u8> {
    let mut out = one(first, CD_A, a);
    out.extend(one(second, CD_A, b));
    out
}

fn outer_content_type_cases() -> Vec<Case> {
    let hidden = "multipart/form-data; x=\"; boundary=EVIL; y=\"; boundary=REAL";
    vec![
        pair(
            "a boundary hidden inside a quoted parameter",
            hidden,
            &polyglot("EVIL", b"pay 1", "REAL", b"pay 100"),
            &polyglot("EVIL", b"pay 1", "REAL", b"pay 999"),
        ),
        case(
            "a repeated boundary parameter",
            "multipart/form-data; boundary=a; boundary=b",
            &polyglot("a", b"pay 1", "b", b"pay 100"),
            "multipart/form-data; boundary=a",
            &polyglot("a", b"pay 1", "b", b"pay 100"),
        ),
        case(
            "a quoted boundary holding ';'",
            "multipart/form-data; boundary=\"a;b\"",
            &one("\"a", CD_A, b"v"),
            "multipart/form-data; boundary=a",
            &one("a", CD_A, b"v"),
        ),
        case(
            "another media-type parameter",
            "multipart/form-data; boundary=b; charset=utf-8",
            &one("b", CD_A, b"v"),
            "multipart/form-data; boundary=b",
            &one("b", CD_A, b"v"),
        ),
    ]
}

fn part_media_parameter_cases() -> Vec<Case> {
    let ct = mp("b");
    let cdt = |v: &[u8]| {
        one(
            "b",
            &[CD_A, b"Content-Type: ".as_slice(), v, b"\r\n".as_slice()].concat(),
            b"v",
        )
    };
    vec![
        pair(
            "a parameter without '=' vs an empty quoted one",
            &ct,
            &cdt(b"text/plain; foo"),
            &cdt(b"text/plain; foo=\"\""),
        ),
        pair(
            "a parameter without a name vs none",
            &ct,
            &cdt(b"text/plain; =x"),
            &cdt(b"text/plain"),
        ),
        pair(
            "parameters after a stray quote",
            &ct,
            &cdt(b"text/plain\"; charset=utf-8\""),
            &cdt(b"text/plain\"; charset=latin1\""),
        ),
        pair(
            "another charset",
            &ct,
            &cdt(b"text/plain; charset=utf-8"),
            &cdt(b"text/plain; charset=latin1"),
        ),
        pair(
            "a nested boundary in another case",
            &ct,
            &cdt(b"multipart/mixed; boundary=Inner"),
            &cdt(b"multipart/mixed; boundary=inner"),
        ),
    ]
}

fn nested_cases() -> Vec<Case> {
    let ct = mp("outer");
    let nested = |inner: &[u8]| {
        one(
            "outer",
            b"Content-Disposition: form-data; name=\"files\"\r\nContent-Type: multipart/mixed; boundary=inner\r\n",
            inner,
        )
    };
    let file = |name: &str, data: &[u8]| {
        [
            format!(
                "Content-Disposition: file; filename=\"{name}\"\r\nContent-Type: text/plain\r\n"
            )
            .as_bytes(),
            data,
        ]
        .concat()
    };
    let inner = |files: &[(&str, &[u8])]| {
        let mut out = Vec::new();
        for (name, data) in files {
            out.extend(b"--inner\r\n");
            let f = file(name, b"");
            out.extend(&f);
            out.extend(CRLF);
            out.extend_from_slice(data);
            out.extend(CRLF);
        }
        out.extend(b"--inner--");
        out
    };
    vec![
        pair(
            "a nested file's content",
            &ct,
            &nested(&inner(&[("f1.txt", b"one")])),
            &nested(&inner(&[("f1.txt", b"two")])),
        ),
        pair(
            "nested files in another order",
            &ct,
            &nested(&inner(&[("f1.txt", b"1"), ("f2.txt", b"2")])),
            &nested(&inner(&[("f2.txt", b"2"), ("f1.txt", b"1")])),
        ),
        pair(
            "nested multipart vs the same bytes as text",
            &ct,
            &nested(&inner(&[("f1.txt", b"1")])),
            &one(
                "outer",
                b"Content-Disposition: form-data; name=\"files\"\r\nContent-Type: text/plain\r\n",
                &inner(&[("f1.txt", b"1")]),
            ),
        ),
        pair(
            "a nested body without its close delimiter",
            &ct,
            &nested(b"--inner\r\n\r\nx\r\n--inner"),
            &nested(b"--inner\r\n\r\nx\r\n--inner--"),
        ),
    ]
}

/// The same submission written differently: the strict reader reads each pair alike.
fn same_submission_cases() -> Vec<Case> {
    let two = |b: &str| body(b, &[(CD_A, b"v"), (CD_B, b"x--b y--XyZ-9 \r\n-- ")]);
    let upper = |b: &str| {
        body(
            b,
            &[
                (b"CONTENT-DISPOSITION: form-data; name=\"a\"\r\n", b"v"),
                (
                    b"content-disposition: form-data; name=\"b\"\r\n",
                    b"x--b y--XyZ-9 \r\n-- ",
                ),
            ],
        )
    };
    let padded = b"--b \t\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nv\r\n--b\t\r\n\
                   Content-Disposition: form-data; name=\"b\"\r\n\r\nx--b y--XyZ-9 \r\n-- \r\n--b--  \r\n";
    let framed = [
        b"preamble: Content-Disposition: form-data; name=\"z\"\r\n\r\nz\r\nx--b\r\n".as_slice(),
        &two("b"),
        b"--b\r\nContent-Disposition: form-data; name=\"z\"\r\n\r\nz\r\n--b--\r\n",
    ]
    .concat();
    let lf_preamble =
        |x: &[u8]| [b"x\n--b\n\n".as_slice(), x, b"\n--b--\n\r\n", &two("b")].concat();
    let ows = body(
        "b",
        &[
            (b"Content-Disposition:form-data; name=\"a\" \t\r\n", b"v"),
            (
                b"Content-Disposition:\t form-data; name=\"b\"\r\n",
                b"x--b y--XyZ-9 \r\n-- ",
            ),
        ],
    );
    let ordered = |swap: bool| {
        let (x, y): (&[u8], &[u8]) = (CD_A, b"Content-Type: text/plain\r\n");
        let head = if swap {
            [y, x].concat()
        } else {
            [x, y].concat()
        };
        one("b", &head, b"v")
    };
    let typed = |t: &[u8]| {
        one(
            "b",
            &[CD_A, b"Content-Type: ".as_slice(), t, b"\r\n".as_slice()].concat(),
            b"v",
        )
    };
    vec![
        case(
            "another boundary",
            &mp("b"),
            &two("b"),
            &mp("XyZ-9"),
            &two("XyZ-9"),
        ),
        case(
            "a quoted boundary",
            &mp("b"),
            &two("b"),
            "multipart/form-data; boundary=\"b\"",
            &two("b"),
        ),
        case(
            "a boundary with bchars, quoted",
            &mp("b"),
            &two("b"),
            "multipart/form-data; boundary=\"'()+_,-./:=? x\"",
            &two("'()+_,-./:=? x"),
        ),
        case(
            "the boundary parameter's name in another case",
            &mp("b"),
            &two("b"),
            "multipart/form-data; BOUNDARY=b",
            &two("b"),
        ),
        case(
            "the media type in another case",
            &mp("b"),
            &two("b"),
            "Multipart/Form-Data; boundary=b",
            &two("b"),
        ),
        pair(
            "header names in another case",
            &mp("b"),
            &two("b"),
            &upper("b"),
        ),
        pair("transport padding", &mp("b"), &two("b"), padded),
        pair(
            "preamble and epilogue that look like parts",
            &mp("b"),
            &two("b"),
            &framed,
        ),
        pair(
            "a preamble that is a part read with LF line ends",
            &mp("b"),
            &lf_preamble(b"X"),
            &lf_preamble(b"Y"),
        ),
        pair("whitespace around header values", &mp("b"), &two("b"), &ows),
        pair(
            "header lines of different names in another order",
            &mp("b"),
            &ordered(false),
            &ordered(true),
        ),
        pair(
            "a part's media type in another case, quoting and order",
            &mp("b"),
            &typed(b"Text/Plain; Charset=\"UTF-8\"; format=flowed"),
            &typed(b"text/plain; format=flowed; charset=utf-8"),
        ),
    ]
}

#[test]
fn multipart_differential_strict_reader_reads_rfc_2046_bodies() {
    // A self-check of the independent reader, so that its verdicts can be trusted.
    let ct = "multipart/form-data; boundary=\"simple boundary\"";
    let text = b"This is the preamble.\r\n--simple boundary\r\n\r\nplain text, no headers\r\n\
                 --simple boundary \t\r\nContent-type: text/plain; charset=us-ascii\r\n\
                 X-Long: a\r\n  b\r\n\r\nexplicitly typed.\r\n\r\n--simple boundary--\r\nepilogue";
    let parts = strict_read(ct, text).expect("RFC 2046 §5.1.1's example");
    assert_eq!(parts.len(), 2);
    assert!(parts[0].headers.is_empty());
    assert_eq!(parts[0].content, b"plain text, no headers");
    assert_eq!(
        parts[1].headers,
        vec![
            (
                b"content-type".to_vec(),
                b"text/plain; charset=us-ascii".to_vec()
            ),
            (b"x-long".to_vec(), b"a  b".to_vec()),
        ]
    );
    assert_eq!(parts[1].content, b"explicitly typed.\r\n");
    // The boundary, its quoting and the preamble do not change the meaning.
    let other = String::from_utf8_lossy(text)
        .replace("simple boundary", "zz")
        .into_bytes();
    assert!(!other.is_empty());
    assert_eq!(
        meaning("multipart/form-data; boundary=zz", &other),
        meaning(ct, text)
    );
    // Refusals.
    for (what, ct, body) in [
        ("no boundary", "multipart/form-data", text.as_slice()),
        (
            "repeated boundary",
            "multipart/form-data; boundary=a; boundary=b",
            b"--a\r\n\r\nv\r\n--a--",
        ),
        (
            "boundary with ';'",
            "multipart/form-data; boundary=\"a;b\"",
            b"--a;b\r\n\r\nv\r\n--a;b--",
        ),
        (
            "no close",
            "multipart/form-data; boundary=a",
            b"--a\r\n\r\nv\r\n--a\r\n",
        ),
        ("no parts", "multipart/form-data; boundary=a", b"--a--\r\n"),
        (
            "junk after close",
            "multipart/form-data; boundary=a",
            b"--a\r\n\r\nv\r\n--a--x",
        ),
        (
            "boundary line in content",
            "multipart/form-data; boundary=a",
            b"--a\r\n\r\nv\r\n--ab\r\n--a--",
        ),
        (
            "bare LF in a header",
            "multipart/form-data; boundary=a",
            b"--a\r\nX: 1\n\r\n\r\nv\r\n--a--",
        ),
        (
            "continuation first",
            "multipart/form-data; boundary=a",
            b"--a\r\n X: 1\r\n\r\nv\r\n--a--",
        ),
        (
            "no colon",
            "multipart/form-data; boundary=a",
            b"--a\r\nX 1\r\n\r\nv\r\n--a--",
        ),
    ] {
        assert!(strict_read(ct, body).is_err(), "{what}: {}", show(ct, body));
    }
    // Accepted edge cases.
    let parts =
        strict_read(mp("a").as_str(), b"--a\r\n\r\n--a\r\n\r\n\r\n--a--").expect("empty parts");
    assert_eq!(parts.len(), 2);
    assert!(
        parts
            .iter()
            .all(|p| p.headers.is_empty() && p.content.is_empty())
    );
    assert_eq!(
        strict_read(mp("a").as_str(), b"--a\r\n\r\nx--a y\r\n--a-- ").expect("mid-line")[0].content,
        b"x--a y"
    );
    assert_eq!(
        value_meaning(b"content-type", b"Text/Plain; Charset=\"UTF-8\""),
        value_meaning(b"content-type", b"text/plain;charset=utf-8")
    );
    assert_ne!(
        value_meaning(b"content-type", b"text/plain\x0b"),
        value_meaning(b"content-type", b"text/plain")
    );
}

#[test]
fn multipart_differential_same_submission_shares_a_fingerprint() {
    let cases = same_submission_cases();
    let mut failures = Vec::new();
    for c in &cases {
        assert!(
            !strictly_differ(&c.ct_a, &c.a, &c.ct_b, &c.b) && meaning(&c.ct_a, &c.a).is_ok(),
            "test case {:?}: the strict reader does not read both as one submission{}",
            c.name,
            describe_pair(&c.ct_a, &c.a, &c.ct_b, &c.b)
        );
        if let Some(m) = split_apart(&c.ct_a, &c.a, &c.ct_b, &c.b) {
            failures.push(format!("[{}] {m}", c.name));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn multipart_differential_content_changes_are_not_merged() {
    expect_no_merge(content_cases());
}

#[test]
fn multipart_differential_part_structure_changes_are_not_merged() {
    expect_no_merge(structure_cases());
}

#[test]
fn multipart_differential_header_whitespace_and_case_are_not_merged() {
    expect_no_merge(whitespace_and_case_cases());
}

#[test]
fn multipart_differential_bare_cr_or_lf_in_headers_is_not_merged() {
    expect_no_merge(bare_cr_lf_cases());
}

#[test]
fn multipart_differential_folded_header_lines_are_not_merged() {
    expect_no_merge(folding_cases());
}

#[test]
fn multipart_differential_repeated_and_renamed_headers_are_not_merged() {
    expect_no_merge(duplicate_header_cases());
}

#[test]
fn multipart_differential_framing_changes_are_not_merged() {
    expect_no_merge(framing_cases());
}

#[test]
fn multipart_differential_outer_content_type_tricks_are_not_merged() {
    expect_no_merge(outer_content_type_cases());
}

#[test]
fn multipart_differential_part_media_type_parameters_are_not_merged() {
    expect_no_merge(part_media_parameter_cases());
}

#[test]
fn multipart_differential_nested_multipart_parts_are_not_merged() {
    expect_no_merge(nested_cases());
}

// ---- generated pairs -------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct GenPart {
    headers: Vec<(String, Vec<u8>)>,
    content: Vec<u8>,
}

/// How one encoder writes a form.
#[derive(Clone, Debug)]
struct Enc {
    boundary: &'static str,
    quote: bool,
    param: &'static str,
    names: u8,
    ows: &'static str,
    padding: &'static str,
    preamble: &'static str,
    epilogue: &'static str,
}

const BOUNDARIES: &[&str] = &[
    "XyZ",
    "qQ9-8",
    "a",
    "----WebKitFormBoundary7MA4YWxkTrZu0gW",
    "b'()+_,-./:=?",
    "with space x",
];

fn content_type_of(e: &Enc) -> String {
    if e.quote || !e.boundary.bytes().all(is_token) {
        format!("multipart/form-data; {}=\"{}\"", e.param, e.boundary)
    } else {
        format!("multipart/form-data; {}={}", e.param, e.boundary)
    }
}

fn encode(parts: &[GenPart], e: &Enc) -> (String, Vec<u8>) {
    let mut out = Vec::new();
    if !e.preamble.is_empty() {
        out.extend(e.preamble.as_bytes());
        out.extend(CRLF);
    }
    for p in parts {
        out.extend(format!("--{}{}\r\n", e.boundary, e.padding).as_bytes());
        // Around a folded line no whitespace is added: it would be inside the unfolded value.
        let folded = |k: usize| p.headers.get(k).is_some_and(|h| h.0.starts_with(' '));
        for (k, (name, value)) in p.headers.iter().enumerate() {
            let name = match e.names {
                1 => name.to_ascii_uppercase(),
                2 => name.to_ascii_lowercase(),
                _ => name.clone(),
            };
            let ows = if folded(k) || folded(k + 1) {
                ""
            } else {
                e.ows
            };
            out.extend(name.as_bytes());
            out.push(b':');
            out.extend(ows.as_bytes());
            out.extend(value);
            out.extend(ows.as_bytes());
            out.extend(CRLF);
        }
        out.extend(CRLF);
        out.extend(&p.content);
        out.extend(CRLF);
    }
    out.extend(format!("--{}--{}", e.boundary, e.padding).as_bytes());
    if !e.epilogue.is_empty() {
        out.extend(CRLF);
        out.extend(e.epilogue.as_bytes());
    }
    (content_type_of(e), out)
}

fn enc() -> impl Strategy<Value = Enc> {
    (
        prop::sample::select(BOUNDARIES.to_vec()),
        any::<bool>(),
        prop::sample::select(vec!["boundary", "Boundary", "BOUNDARY"]),
        0u8..3,
        prop::sample::select(vec!["", " ", "\t", " \t "]),
        prop::sample::select(vec!["", " ", "\t", " \t"]),
        prop::sample::select(vec![
            "",
            "preamble",
            "two\r\nlines",
            "Content-Disposition: form-data; name=\"a\"\r\n\r\nfake",
        ]),
        prop::sample::select(vec![
            "",
            "epilogue",
            "--XyZ\r\nContent-Disposition: form-data; name=\"z\"\r\n\r\nz\r\n--XyZ--",
        ]),
    )
        .prop_map(
            |(boundary, quote, param, names, ows, padding, preamble, epilogue)| Enc {
                boundary,
                quote,
                param,
                names,
                ows,
                padding,
                preamble,
                epilogue,
            },
        )
}

const CD_VALUES: &[&str] = &[
    "form-data; name=\"a\"",
    "form-data; name=\"b\"",
    "form-data; name=\"a\"; filename=\"x.txt\"",
    "form-data; name=a",
    "form-data; name=\"a b\"",
];
const CT_VALUES: &[&str] = &[
    "text/plain",
    "Text/Plain",
    "text/plain; charset=UTF-8",
    "text/plain;charset=\"utf-8\"",
    "application/octet-stream",
    "multipart/mixed; boundary=inner",
];
const CTE_VALUES: &[&str] = &["binary", "base64", "8bit", "BASE64"];
const VALUE_ATOMS: &[&str] = &[
    "a",
    "Z",
    "0",
    " ",
    "\t",
    ";",
    "=",
    "\"",
    ":",
    "/",
    "-",
    "\u{b}",
    "\u{c}",
    "\u{a0}",
    "é",
    "form-data",
    "name=\"a\"",
];
const CONTENT_ATOMS: &[&str] = &[
    "a",
    "b",
    "-",
    "--",
    "\r",
    "\n",
    "\r\n",
    " ",
    "\t",
    ":",
    "XyZ",
    "--XyZ",
    "\r\n--XyZ",
    "\r\n--a ",
    "\0",
    "é",
    "\r\n\r\n",
    "Content-Disposition: form-data; name=\"a\"",
    "--XyZ--",
];

fn atoms(pool: &'static [&'static str], max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(prop::sample::select(pool.to_vec()), 0..max)
        .prop_map(|atoms| atoms.concat().into_bytes())
}

fn header(fold: bool) -> BoxedStrategy<(String, Vec<u8>)> {
    let named = |name: &'static str, values: &'static [&'static str]| {
        prop::sample::select(values.to_vec())
            .prop_map(move |v| (name.to_owned(), v.as_bytes().to_vec()))
    };
    let plain = prop_oneof![
        named("Content-Disposition", CD_VALUES),
        named("Content-Type", CT_VALUES),
        named("Content-Transfer-Encoding", CTE_VALUES),
        atoms(VALUE_ATOMS, 5).prop_map(|v| ("X-Note".to_owned(), v)),
    ];
    if fold {
        prop_oneof![
            4 => plain,
            1 => atoms(VALUE_ATOMS, 3).prop_map(|v| (" x-fold".to_owned(), v)),
        ]
        .boxed()
    } else {
        plain.boxed()
    }
}

fn parts(fold: bool) -> impl Strategy<Value = Vec<GenPart>> {
    prop::collection::vec(
        (
            prop::collection::vec(header(fold), 0..4),
            atoms(CONTENT_ATOMS, 6),
        )
            .prop_map(|(headers, content)| GenPart { headers, content }),
        1..4,
    )
}

const WS_ATOMS: &[&str] = &[
    " ", "\t", "\u{b}", "\u{c}", "\u{a0}", "\u{3000}", "\r", "\n", "\0",
];

/// One change to a form: to a part's content, the parts, or a part's header lines.
fn mutate_parts(parts: &[GenPart], kind: u8, i: Index, j: Index, k: Index) -> Vec<GenPart> {
    let mut p = parts.to_vec();
    let n = p.len();
    let pi = i.index(n);
    let default_header = || {
        (
            "Content-Disposition".to_owned(),
            b"form-data; name=\"a\"".to_vec(),
        )
    };
    // A header of part `pi` that is not a folded line, if any.
    let plain_header = |p: &GenPart| -> Option<usize> {
        let plain: Vec<usize> = (0..p.headers.len())
            .filter(|&h| !p.headers[h].0.starts_with(' '))
            .collect();
        (!plain.is_empty()).then(|| plain[j.index(plain.len())])
    };
    match kind {
        0 => {
            let c = &mut p[pi].content;
            if c.is_empty() {
                c.push(b'x');
            } else {
                let at = j.index(c.len());
                let pool = b"ab-\r\n \t:";
                let mut byte = pool[k.index(pool.len())];
                if byte == c[at] {
                    byte = byte.wrapping_add(1);
                }
                c[at] = byte;
            }
        }
        1 => {
            let atom = CONTENT_ATOMS[k.index(CONTENT_ATOMS.len())];
            p[pi].content.extend(atom.as_bytes());
        }
        2 => {
            let c = &mut p[pi].content;
            if c.is_empty() {
                c.push(b' ');
            } else {
                c.truncate(j.index(c.len()));
            }
        }
        3 => {
            let ws = [" ", "\t", "\r", "\n", "\r\n", "\u{c}"];
            p[pi].content.extend(ws[k.index(ws.len())].as_bytes());
        }
        4 => {
            let pj = j.index(n);
            p.swap(pi, pj);
        }
        5 => {
            if n > 1 {
                p.remove(pi);
            } else {
                p.push(p[0].clone());
            }
        }
        6 => {
            let copy = p[pi].clone();
            p.insert(pi, copy);
        }
        7 => {
            let at = j.index(n + 1);
            p.insert(
                at,
                GenPart {
                    headers: Vec::new(),
                    content: Vec::new(),
                },
            );
        }
        8 => {
            if p[pi].headers.is_empty() {
                p[pi].headers.push(default_header());
            } else {
                p[pi].headers.clear();
            }
        }
        9 => {
            let hs = &mut p[pi].headers;
            if hs.is_empty() {
                hs.push(default_header());
            } else {
                let h = hs[j.index(hs.len())].clone();
                hs.push(h);
            }
        }
        10 => {
            let hs = &mut p[pi].headers;
            if hs.len() < 2 {
                hs.push(default_header());
            } else {
                let at = j.index(hs.len() - 1);
                hs.swap(at, at + 1);
            }
        }
        11..=13 => {
            let ws = WS_ATOMS[k.index(WS_ATOMS.len())].as_bytes();
            match plain_header(&p[pi]) {
                None => p[pi].headers.push(default_header()),
                Some(h) => {
                    let v = &mut p[pi].headers[h].1;
                    let at = match kind {
                        11 => 0,
                        12 => v.len(),
                        _ => v.len() / 2,
                    };
                    v.splice(at..at, ws.iter().copied());
                }
            }
        }
        14 => match plain_header(&p[pi]) {
            None => p[pi].headers.push(default_header()),
            Some(h) => p[pi].headers[h].1.make_ascii_uppercase(),
        },
        15 => {
            let hs = &mut p[pi].headers;
            if hs.is_empty() {
                hs.push(default_header());
            } else {
                let at = j.index(hs.len());
                hs[at].0.make_ascii_uppercase();
            }
        }
        _ => {
            let hs = &mut p[pi].headers;
            if hs.is_empty() {
                hs.push(default_header());
            } else {
                let at = j.index(hs.len());
                hs[at].1.push(b'x');
            }
        }
    }
    p
}

/// One change to the bytes of a body written under `b`.
fn mutate_bytes(body: &[u8], b: &str, kind: u8, at: Index, len: Index, k: Index) -> Vec<u8> {
    let atoms = [
        format!("\r\n--{b}"),
        format!("--{b}"),
        format!("--{b}--"),
        format!("\r\n--{b}--"),
        "\r\n".to_owned(),
        "\r".to_owned(),
        "\n".to_owned(),
        " ".to_owned(),
        "\t".to_owned(),
        "\r\n ".to_owned(),
        "\u{c}".to_owned(),
        "--".to_owned(),
        "x".to_owned(),
        format!("\r\n--{b}x"),
        format!("\r\n--{b}--x"),
        format!("\r\n--{b}\r\n"),
    ];
    let atom = atoms[k.index(atoms.len())].as_bytes();
    let mut out = body.to_vec();
    match kind {
        0 => {
            let p = at.index(out.len() + 1);
            out.splice(p..p, atom.iter().copied());
        }
        1 => {
            let p = at.index(out.len());
            let end = (p + 1 + len.index(8)).min(out.len());
            out.drain(p..end);
        }
        2 => out.truncate(at.index(out.len())),
        3 => {
            let tails = [
                "x".to_owned(),
                " x".to_owned(),
                format!("\r\n--{b}\r\n\r\nz\r\n--{b}--"),
                format!(
                    "x\r\n--{b}\r\nContent-Disposition: form-data; name=\"z\"\r\n\r\nz\r\n--{b}--"
                ),
            ];
            out.extend(tails[k.index(tails.len())].as_bytes());
        }
        4 => {
            let close = format!("--{b}--");
            if let Some(p) = out
                .windows(close.len())
                .rposition(|w| w == close.as_bytes())
            {
                let more = format!(
                    "--{b}--x\r\n--{b}\r\nContent-Disposition: form-data; name=\"extra\"\r\n\r\nextra\r\n--{b}--"
                );
                out.splice(p..p + close.len(), more.bytes());
            }
        }
        5 => {
            let preambles = [
                format!("--{b}--\r\n"),
                "Content-Disposition: form-data; name=\"a\"\r\n\r\nv\r\n".to_owned(),
                format!("--{b}x\r\n"),
                "x\r\n".to_owned(),
                format!("--{b}\r\n\r\nfake\r\n"),
            ];
            let pre = preambles[k.index(preambles.len())].as_bytes();
            out.splice(0..0, pre.iter().copied());
        }
        6 | 7 => {
            let crlfs: Vec<usize> = out
                .windows(2)
                .enumerate()
                .filter(|(_, w)| *w == CRLF)
                .map(|(i, _)| i)
                .collect();
            if crlfs.is_empty() {
                out.push(b' ');
            } else {
                let p = crlfs[at.index(crlfs.len())];
                if kind == 6 {
                    // The next line becomes a continuation of this one.
                    out.insert(p + 2, b' ');
                } else if k.index(2) == 0 {
                    out.remove(p); // LF alone
                } else {
                    out.remove(p + 1); // CR alone
                }
            }
        }
        _ => {
            // A boundary text mid-line.
            let p = at.index(out.len() + 1);
            let mid = format!("x--{b}");
            out.splice(p..p, mid.bytes());
        }
    }
    out
}

proptest! {
    #![proptest_config(cases(512))]

    /// The same parts written by two encoders (boundary, its quoting and parameter-name case,
    /// header-name case, whitespace around values, transport padding, preamble, epilogue):
    /// alike to the strict reader, so alike to the crate (the lesser fault); and never a merge
    /// where the strict reader tells them apart (content that holds one boundary's text).
    #[test]
    fn multipart_differential_prop_same_parts_any_encoding(
        p in parts(false),
        e1 in enc(),
        e2 in enc(),
    ) {
        let (ct_a, a) = encode(&p, &e1);
        let (ct_b, b) = encode(&p, &e2);
        if let Some(m) = split_apart(&ct_a, &a, &ct_b, &b) {
            prop_assert!(false, "{}", m);
        }
        if let Some(m) = merge(&ct_a, &a, &ct_b, &b) {
            prop_assert!(false, "{}", m);
        }
    }

    /// A form and the form changed once (content bytes, trailing whitespace, CR or LF alone,
    /// part order, count, empty and headerless parts, repeated or reordered header lines,
    /// whitespace or case in values, folded lines), each under its own encoder.
    #[test]
    fn multipart_differential_prop_changed_parts_never_merge(
        p in parts(true),
        e1 in enc(),
        e2 in enc(),
        kind in 0u8..17,
        i in any::<Index>(),
        j in any::<Index>(),
        k in any::<Index>(),
    ) {
        let q = mutate_parts(&p, kind, i, j, k);
        let (ct_a, a) = encode(&p, &e1);
        let (ct_b, b) = encode(&q, &e2);
        if let Some(m) = merge(&ct_a, &a, &ct_b, &b) {
            prop_assert!(false, "mutation {}: {}", kind, m);
        }
    }

    /// A body and the same form's body (under another encoder) with its bytes changed once:
    /// boundary text inserted at or off a line start, CR or LF alone, a line folded, a range
    /// deleted, the body cut short, junk or parts after the close delimiter, a preamble that
    /// reads as a part or a delimiter.
    #[test]
    fn multipart_differential_prop_changed_bytes_never_merge(
        p in parts(false),
        e1 in enc(),
        e2 in enc(),
        kind in 0u8..9,
        at in any::<Index>(),
        len in any::<Index>(),
        k in any::<Index>(),
    ) {
        let (ct_a, a) = encode(&p, &e1);
        let (ct_b, b) = encode(&p, &e2);
        let b = mutate_bytes(&b, e2.boundary, kind, at, len, k);
        if let Some(m) = merge(&ct_a, &a, &ct_b, &b) {
            prop_assert!(false, "byte mutation {}: {}", kind, m);
        }
    }

    /// A form and the form changed once, both inside a body that is also a form under a
    /// second boundary, sent with a `Content-Type` whose real boundary follows a quoted
    /// parameter that holds `boundary=...` text (and, separately, with the boundary given
    /// twice).
    #[test]
    fn multipart_differential_prop_boundary_tricks_never_merge(
        decoy in parts(false),
        p in parts(false),
        kind in 0u8..17,
        i in any::<Index>(),
        j in any::<Index>(),
        k in any::<Index>(),
        twice in any::<bool>(),
    ) {
        let q = mutate_parts(&p, kind, i, j, k);
        let with = |boundary: &'static str| Enc {
            boundary,
            quote: false,
            param: "boundary",
            names: 0,
            ows: " ",
            padding: "",
            preamble: "",
            epilogue: "",
        };
        let (_, first) = encode(&decoy, &with("EVIL"));
        let body = |form: &[GenPart]| {
            let (_, second) = encode(form, &with("REAL"));
            [first.as_slice(), CRLF, &second].concat()
        };
        let (a, b) = (body(&p), body(&q));
        let ct = if twice {
            "multipart/form-data; boundary=EVIL; boundary=REAL"
        } else {
            "multipart/form-data; x=\"; boundary=EVIL; y=\"; boundary=REAL"
        };
        if let Some(m) = merge(ct, &a, ct, &b) {
            prop_assert!(false, "mutation {}: {}", kind, m);
        }
    }
}

// ---- over real TCP ---------------------------------------------------------------------------

/// Every run of the handler, per idempotency key, with what the strict reader read.
#[derive(Clone, Default)]
struct Sink(Arc<Mutex<HashMap<String, Vec<String>>>>);

impl Sink {
    fn runs(&self, key: &str) -> Vec<String> {
        self.0
            .lock()
            .expect("sink")
            .get(key)
            .cloned()
            .unwrap_or_default()
    }
}

async fn guarded_app(sink: &Sink) -> SocketAddr {
    let handler = {
        let sink = sink.clone();
        move |req: Request| {
            let sink = sink.clone();
            async move {
                let (parts, body) = req.into_parts();
                let bytes = body.collect().await.expect("body").to_bytes();
                let header = |name: &str| {
                    parts
                        .headers
                        .get(name)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_owned()
                };
                let key = header("idempotency-key");
                let read = show(&header("content-type"), &bytes);
                // The effect, counted where it happens.
                let n = {
                    let mut runs = sink.0.lock().expect("sink");
                    let runs = runs.entry(key).or_default();
                    runs.push(read.clone());
                    runs.len()
                };
                (StatusCode::CREATED, format!("run {n}: {read}"))
            }
        }
    };
    let app = Router::new()
        .route("/op", post(handler))
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    serve(app).await
}

/// Every hand-written pair the strict reader tells apart, A then B under one key over TCP: B
/// must be refused (422, or 400 where the crate finds B malformed), never replayed, and the
/// handler must have run once for the key. And a control: the same submission under another
/// boundary is replayed, the handler having run once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multipart_differential_http_different_requests_are_never_replayed() {
    let sink = Sink::default();
    let addr = guarded_app(&sink).await;

    // Control: the rig sees a replay where there must be one.
    let control = &same_submission_cases()[0];
    let key = unique("multipart-differential-control");
    let first = raw_post(
        addr,
        "/op",
        &[("idempotency-key", &key), ("content-type", &control.ct_a)],
        &control.a,
    )
    .await;
    let second = raw_post(
        addr,
        "/op",
        &[("idempotency-key", &key), ("content-type", &control.ct_b)],
        &control.b,
    )
    .await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(
        second.replayed() && second.body == first.body && sink.runs(&key).len() == 1,
        "control: the same submission was not replayed: {second:?}"
    );

    let all: Vec<Case> = [
        content_cases(),
        structure_cases(),
        whitespace_and_case_cases(),
        bare_cr_lf_cases(),
        folding_cases(),
        duplicate_header_cases(),
        framing_cases(),
        outer_content_type_cases(),
        part_media_parameter_cases(),
        nested_cases(),
    ]
    .into_iter()
    .flatten()
    .collect();
    let mut sent = 0;
    let mut failures = Vec::new();
    for c in &all {
        if !strictly_differ(&c.ct_a, &c.a, &c.ct_b, &c.b) || fp(&c.ct_a, &c.a).is_err() {
            continue;
        }
        sent += 1;
        let key = unique("multipart-differential");
        let a = raw_post(
            addr,
            "/op",
            &[("idempotency-key", &key), ("content-type", &c.ct_a)],
            &c.a,
        )
        .await;
        let b = raw_post(
            addr,
            "/op",
            &[("idempotency-key", &key), ("content-type", &c.ct_b)],
            &c.b,
        )
        .await;
        let runs = sink.runs(&key);
        let expected = if fp(&c.ct_b, &c.b).is_err() { 400 } else { 422 };
        if a.status != 201 || b.status != expected || b.replayed() || runs.len() != 1 {
            failures.push(format!(
                "[{}] A answered {}, B answered {} (replayed: {}, body {:?}); the handler ran {} time(s) for the key: {:?}{}",
                c.name,
                a.status,
                b.status,
                b.replayed(),
                b.text(),
                runs.len(),
                runs,
                describe_pair(&c.ct_a, &c.a, &c.ct_b, &c.b),
            ));
        }
    }
    assert!(sent >= 20, "only {sent} pairs sent");
    assert!(
        failures.is_empty(),
        "{} of {sent} different pairs were not refused over HTTP:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

// ---- after the fix: what hashes as before, and a retry across the upgrade -------------------

/// DESIGN §1.4 across an upgrade: a multipart request (quoted boundary, a part's media type
/// with parameters) and a request whose `Content-Type` has parameters read as before the
/// strict reading (the documented layout under the tag `v1`, written out here), so a retry
/// across the upgrade is the same input; only the scheme's name moved to `v1/r2`.
#[test]
fn multipart_differential_requests_that_read_hash_as_before() {
    use sha2::Digest;
    let expected = |media: &[u8], domain: &[u8], canonical: &[u8]| {
        let mut h = sha2::Sha256::new();
        field(&mut h, b"tower-idempotency/fingerprint/v1");
        field(&mut h, b"POST");
        field(&mut h, b"/op");
        field(&mut h, b"");
        field(&mut h, media);
        field(&mut h, domain);
        field(&mut h, canonical);
        let mut out: [u8; 32] = h.finalize().into();
        out[..4].copy_from_slice(&plain_scheme(b"tower-idempotency/fingerprint/v1/r2"));
        out
    };
    let ct = "multipart/form-data; boundary=\"x y\"";
    let body = b"--x y\r\nContent-Disposition: form-data; name=\"a\"\r\n\
        Content-Type: Text/Plain; charset=\"UTF-8\"; format=flowed\r\n\r\nv\r\n--x y--\r\n";
    let mut canonical = Vec::new();
    let len = |out: &mut Vec<u8>, n: usize| out.extend_from_slice(&(n as u64).to_le_bytes());
    let put = |out: &mut Vec<u8>, bytes: &[u8]| {
        out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        out.extend_from_slice(bytes);
    };
    len(&mut canonical, 1);
    len(&mut canonical, 2);
    put(&mut canonical, b"content-disposition");
    put(&mut canonical, b"form-data; name=\"a\"");
    put(&mut canonical, b"content-type");
    put(
        &mut canonical,
        b"text/plain;7:charset=5:utf-8;6:format=6:flowed",
    );
    put(&mut canonical, b"v");
    assert_eq!(
        fp(ct, body).expect("reads").as_bytes(),
        &expected(b"multipart/form-data", b"multipart", &canonical),
    );
    let text = "text/plain; Charset = \"LATIN1\" ;a=\"x;y\"";
    assert_eq!(
        fp(text, b"hi").expect("reads").as_bytes(),
        &expected(b"text/plain;1:a=3:x;y;7:charset=6:latin1", b"raw", b"hi"),
    );
}

/// A server whose store already holds `key` completed under `fingerprint` (as the previous
/// version recorded it), with a handler counting its runs.
async fn upgraded(key: &str, fingerprint: [u8; 32], sink: &Sink) -> SocketAddr {
    let store = seeded(
        &tower_idempotency::store::ScopedKey::new("", key),
        fingerprint,
        old_response(),
    )
    .await;
    let handler = {
        let sink = sink.clone();
        move |req: Request| {
            let sink = sink.clone();
            async move {
                let key = req
                    .headers()
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                sink.0
                    .lock()
                    .expect("sink")
                    .entry(key)
                    .or_default()
                    .push("run".to_owned());
                StatusCode::CREATED
            }
        }
    };
    serve(
        Router::new()
            .route("/op", post(handler))
            .layer(IdempotencyLayer::new(store).single_tenant()),
    )
    .await
}

/// DESIGN §1 (`safe_new_key` only where the outcome is definite) across this fix's upgrade.
/// The previous version recorded a request under the scheme `v1`. Its byte-identical retry
/// now: replayed when it reads as before; where the strict reading changed what counts (a
/// part header ending in a form feed, which the previous version trimmed), refused without
/// advising a new key (a client that took the advice would run the operation twice). Nothing
/// runs in either case, counted at the handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multipart_differential_a_retry_across_the_upgrade_never_advises_a_new_key() {
    let ct = "multipart/form-data; boundary=b";
    let old_scheme = plain_scheme(b"tower-idempotency/fingerprint/v1");
    let recorded_by_v1 = |hashed_as: &[u8]| {
        let mut bytes = *fp(ct, hashed_as).expect("reads").as_bytes();
        bytes[..4].copy_from_slice(&old_scheme);
        bytes
    };
    let plain = b"--b\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nv\r\n--b--\r\n";
    let fed = b"--b\r\nContent-Disposition: form-data; name=\"a\"\x0c\r\n\r\nv\r\n--b--\r\n";

    let sink = Sink::default();
    let same = unique("upgrade-same");
    let addr = upgraded(&same, recorded_by_v1(plain), &sink).await;
    let retry = raw_post(
        addr,
        "/op",
        &[("idempotency-key", &same), ("content-type", ct)],
        plain,
    )
    .await;
    assert!(
        retry.replayed() && retry.body == b"the previous version's run",
        "a retry that reads as before is not replayed across the upgrade: {} {}",
        retry.status,
        retry.text()
    );
    assert!(sink.runs(&same).is_empty(), "it ran again");

    // The previous version hashed `fed` as it hashed `plain` (it trimmed the form feed).
    let changed = unique("upgrade-changed");
    let addr = upgraded(&changed, recorded_by_v1(plain), &sink).await;
    let retry = raw_post(
        addr,
        "/op",
        &[("idempotency-key", &changed), ("content-type", ct)],
        fed,
    )
    .await;
    assert!(sink.runs(&changed).is_empty(), "it ran again: {retry:?}");
    assert_eq!(retry.status, 422, "{}", retry.text());
    assert!(!retry.replayed());
    assert_eq!(
        retry.json()["safe_new_key"],
        serde_json::Value::Bool(false),
        "a retry whose reading changed with the upgrade is told to use a new key: {}",
        retry.text()
    );
}
