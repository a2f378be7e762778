//! Review of 093f083 (strict `Content-Type` reading, `fingerprint::media`; strict multipart
//! framing; the HTTP scheme's name moved to `v1/r2` while the hashed tag stays `v1`).
//!
//! DESIGN §1 step 4: "canonicalisation may only merge what is provably the same request". An
//! independent strict RFC 9110 §8.3.1 / §5.6.6 media-type reader, written here and sharing no
//! code with the crate, says what a `Content-Type` value means; two requests it reads apart
//! must never share a fingerprint (a MERGE: a retry of one is answered with the other's stored
//! response). What the crate deliberately treats as equal is modelled as equal: the case of
//! type, subtype and parameter names; the case of a `charset` value; a quoted value and the same
//! value unquoted; the order of parameters of different names; SP/HTAB around `;` and `=`; an
//! empty parameter (`;;`); a multipart request's own `boundary` (where its parts are what is
//! read); and JSON's `charset=utf-8` (where it is the charset the reader takes). A value that
//! does not read counts as sent, byte for byte.
//!
//! Also: real clients' multipart bodies and `Content-Type` values are accepted and a re-send
//! under another random boundary replays; a request recorded by the previous version replays
//! to its byte-identical retry (HTTP and JSON-RPC); a retry whose reading changed is never
//! told `safe_new_key: true`; hostile `Content-Type` values neither panic nor hang.
//!
//! Over HTTP everything goes through real TCP, and handler runs are counted at the handler,
//! per idempotency key.
//!
//! Found when written (six tests failed; all fixed since, in the commit after 093f083: a
//! `charset` or `boundary` is dropped only when it is the one of its name, the boundary only
//! where the parts are what is hashed; several `Content-Type` lines each count as sent, and an
//! empty one counts; a keyed request whose body is refused reads its key's record first):
//! - MERGE: JSON's `charset=utf-8` is dropped parameter by parameter, also beside another
//!   `charset`: `application/json;charset=utf-16;charset=utf-8` is `application/json;charset=utf-16`
//!   (request and part; both proptests on JSON types, the fixed inputs, and over TCP).
//! - MERGE: a multipart request's `boundary` is dropped even where the body is not read by its
//!   parts: a gzip-coded body (hashed as sent) or a body an application canonicaliser reads; the
//!   same bytes under another boundary are another form (amount 10 / 9999), replayed.
//! - MERGE: only the first of two `Content-Type` lines counts, and an empty `Content-Type` is
//!   no `Content-Type` at all.
//! - Across the upgrade: a request the previous version accepted and ran whose body the strict
//!   reading now refuses (an unquoted `=` in the boundary, junk after the close delimiter, a
//!   repeated boundary) is answered 400 `body-malformed` with `state: none` and
//!   `safe_new_key: true`, though its key is completed.

use crate::common;

use common::schemes::{cases, esc, field, old_response, plain_scheme, put_field, seeded};

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::routing::post;
use common::raw::{raw_post, raw_post_bytes, unique};
use common::{guard, serve};
use http_body_util::BodyExt;
use proptest::prelude::*;
use proptest::sample::Index;
use sha2::{Digest, Sha256};
use tower_idempotency::jsonrpc::JsonRpc;
use tower_idempotency::scope::SingleTenant;
use tower_idempotency::store::StoredResponse;
use tower_idempotency::{
    Fingerprint, IdempotencyLayer, IdempotencyStore, MalformedBody, MemoryStore, ScopedKey,
};

// ---- the strict reader (RFC 9110 §8.3.1, §5.6.6, §5.6.4) ---------------------------------------

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn is_ows(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

/// `qdtext`: HTAB / SP / %x21 / %x23-5B / %x5D-7E / obs-text.
fn is_qdtext(b: u8) -> bool {
    matches!(b, b'\t' | b' ' | 0x21 | 0x23..=0x5b | 0x5d..=0x7e | 0x80..=0xff)
}

/// What may follow `\` in a `quoted-pair`: HTAB / SP / VCHAR / obs-text.
fn is_pair_char(b: u8) -> bool {
    matches!(b, b'\t' | b' ' | 0x21..=0x7e | 0x80..=0xff)
}

/// `media-type = type "/" subtype parameters`, `parameters = *( OWS ";" OWS [ parameter ] )`,
/// `parameter = name "=" value` (OWS around `=` allowed, as MIME does), value a token or a
/// quoted-string. Returns the type/subtype as written and the parameters in order (name as
/// written, value unquoted), or `None`.
#[allow(clippy::type_complexity)]
fn strict_media(v: &[u8]) -> Option<(Vec<u8>, Vec<(Vec<u8>, Vec<u8>)>)> {
    let mut i = 0usize;
    let ows = |i: &mut usize| {
        while *i < v.len() && is_ows(v[*i]) {
            *i += 1;
        }
    };
    let token = |i: &mut usize| -> Option<Vec<u8>> {
        let start = *i;
        while *i < v.len() && is_tchar(v[*i]) {
            *i += 1;
        }
        (*i > start).then(|| v[start..*i].to_vec())
    };
    ows(&mut i);
    let mut essence = token(&mut i)?;
    if v.get(i) != Some(&b'/') {
        return None;
    }
    i += 1;
    essence.push(b'/');
    essence.extend(token(&mut i)?);
    let mut params = Vec::new();
    loop {
        ows(&mut i);
        if i == v.len() {
            return Some((essence, params));
        }
        if v[i] != b';' {
            return None;
        }
        i += 1;
        ows(&mut i);
        if i == v.len() || v[i] == b';' {
            continue;
        }
        let name = token(&mut i)?;
        ows(&mut i);
        if v.get(i) != Some(&b'=') {
            return None;
        }
        i += 1;
        ows(&mut i);
        let value = if v.get(i) == Some(&b'"') {
            i += 1;
            let mut out = Vec::new();
            loop {
                let b = *v.get(i)?;
                match b {
                    b'"' => {
                        i += 1;
                        break;
                    }
                    b'\\' => {
                        let e = *v.get(i + 1)?;
                        if !is_pair_char(e) {
                            return None;
                        }
                        out.push(e);
                        i += 2;
                    }
                    b if is_qdtext(b) => {
                        out.push(b);
                        i += 1;
                    }
                    _ => return None,
                }
            }
            out
        } else {
            // The crate's one documented leniency (session 38, after this review): an
            // unquoted value of any visible ASCII but `"`, `;` and `\` reads as its text
            // (`profile=https://example.com/v2`).
            let start = i;
            while i < v.len() && matches!(v[i], 0x21..=0x7e) && !matches!(v[i], b'"' | b';' | b'\\')
            {
                i += 1;
            }
            if i == start {
                return None;
            }
            v[start..i].to_vec()
        };
        params.push((name, value));
    }
}

/// What a `Content-Type` means to a strict reader, up to the equalities the crate documents.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Meaning {
    /// No `Content-Type` line at all.
    Absent,
    /// type/subtype lower-cased; parameters (lower-cased names, charset values lower-cased,
    /// unquoted) sorted by name, stable (a repeated name keeps its order).
    Read {
        essence: Vec<u8>,
        params: Vec<(Vec<u8>, Vec<u8>)>,
    },
    /// Does not read: counts as sent.
    AsSent(Vec<u8>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// The request's own value; `by_parts`: a multipart body is read by its parts (so its
    /// boundary, which only frames them, does not count).
    Request { by_parts: bool },
    /// A multipart part's value (SP/HTAB around it do not count).
    Part,
}

fn trim_wsp(mut v: &[u8]) -> &[u8] {
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

fn is_json_essence(essence: &[u8]) -> bool {
    essence == b"application/json" || essence.ends_with(b"+json")
}

fn meaning(value: Option<&[u8]>, role: Role) -> Meaning {
    let Some(v) = value else {
        return Meaning::Absent;
    };
    let v = if role == Role::Part { trim_wsp(v) } else { v };
    let Some((essence, params)) = strict_media(v) else {
        return Meaning::AsSent(v.to_vec());
    };
    let essence = essence.to_ascii_lowercase();
    let mut params: Vec<(Vec<u8>, Vec<u8>)> = params
        .into_iter()
        .map(|(name, mut value)| {
            let name = name.to_ascii_lowercase();
            if name == b"charset" {
                value.make_ascii_lowercase();
            }
            (name, value)
        })
        .collect();
    if role == (Role::Request { by_parts: true }) && essence == b"multipart/form-data" {
        params.retain(|(n, _)| n != b"boundary");
    }
    // JSON is UTF-8: a charset that says so changes nothing, where it is the charset a
    // reader takes (every charset given says utf-8).
    if is_json_essence(&essence)
        && params
            .iter()
            .filter(|(n, _)| n == b"charset")
            .all(|(_, v)| v == b"utf-8")
    {
        params.retain(|(n, _)| n != b"charset");
    }
    params.sort_by(|a, b| a.0.cmp(&b.0));
    Meaning::Read { essence, params }
}

#[test]
fn strict_media_reader_reads_rfc_9110_values() {
    let read = |v: &str| strict_media(v.as_bytes()).is_some();
    for ok in [
        "text/plain",
        "text/plain;charset=utf-8",
        "text/plain ; charset = \"UTF-8\" ;; format=flowed;",
        "application/json;",
        "multipart/form-data; boundary=----WebKitFormBoundaryX",
        "multipart/form-data;boundary=\"a b\"",
        "text/plain; a=\"x\\\"y\"",
    ] {
        assert!(read(ok), "{ok:?} reads");
    }
    for bad in [
        "",
        "text",
        "text/",
        "text plain",
        "text/plain; foo",
        "text/plain; =x",
        "text/plain; a=\"x",
        "text/plain; a=1 2",
        "text/plain; a=x;y\"",
        "text/plain, text/html",
        "\"text/plain\"",
        "text/plain; a=\u{a0}",
    ] {
        assert!(!read(bad), "{bad:?} does not read");
    }
    let m = |v: &str| meaning(Some(v.as_bytes()), Role::Request { by_parts: true });
    assert_eq!(
        m("Text/Plain; B=2; CHARSET=\"UTF-8\"; a=1"),
        m("text/plain;a=1;charset=utf-8 ; b = \"2\""),
    );
    assert_ne!(m("text/plain; a=1; a=2"), m("text/plain; a=2; a=1"));
    assert_ne!(m("text/plain; a=X"), m("text/plain; a=x"));
    assert_eq!(m("application/json; charset=UTF-8"), m("application/json"));
    assert_ne!(
        m("application/json; charset=utf-16; charset=utf-8"),
        m("application/json; charset=utf-16")
    );
    assert_eq!(
        m("multipart/form-data; boundary=a"),
        m("multipart/form-data; boundary=\"b\"")
    );
    assert_ne!(m("text/plain; foo"), m("text/plain; foo=\"\""));
    assert_ne!(meaning(None, Role::Request { by_parts: true }), m(""));
}

// ---- the crate, through its public API ----------------------------------------------------------

/// `Fingerprint::of` for `POST /op` with this `Content-Type` (or none) and body; `None` where
/// the value cannot be a header value (a test input no client can send).
fn fp(
    ct: Option<&[u8]>,
    extra: &[(&str, &[u8])],
    body: &[u8],
) -> Option<Result<Fingerprint, MalformedBody>> {
    let mut req = http::Request::builder().method("POST").uri("/op");
    if let Some(ct) = ct {
        req = req.header("content-type", http::HeaderValue::from_bytes(ct).ok()?);
    }
    for (name, value) in extra {
        req = req.header(*name, http::HeaderValue::from_bytes(value).ok()?);
    }
    let (parts, ()) = req.body(()).ok()?.into_parts();
    Some(Fingerprint::of(&parts, body))
}

fn same_fp(
    a: Option<Result<Fingerprint, MalformedBody>>,
    b: Option<Result<Fingerprint, MalformedBody>>,
) -> bool {
    matches!((a, b), (Some(Ok(a)), Some(Ok(b))) if a == b)
}

// ---- generated Content-Type values --------------------------------------------------------------

const JSON_TYPES: &[&str] = &[
    "application/json",
    "Application/JSON",
    "application/problem+json",
    "application/vnd.api+json",
];
const OTHER_TYPES: &[&str] = &[
    "text/plain",
    "Text/Plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data",
    "text/csv",
    "application/octet-stream",
];
const NAMES: &[&str] = &[
    "charset", "Charset", "CHARSET", "a", "A", "format", "boundary", "q",
];
const VALUES: &[&str] = &[
    "utf-8",
    "UTF-8",
    "utf-16",
    "latin1",
    "ISO-8859-1",
    "x",
    "X",
    "1",
    "B",
    "\"B\"",
    "\"x y\"",
    "\"a;b\"",
    "\"\\\"\"",
    "\"\"",
    "\"utf-8\"",
    "\"x\\y\"",
    "\"a=b\"",
    "flowed",
];
/// For JSON media types: charsets above all (JSON's `charset=utf-8` is the one parameter its
/// reading drops).
const JSON_NAMES: &[&str] = &["charset", "Charset", "CHARSET", "a"];
const JSON_VALUES: &[&str] = &[
    "utf-8",
    "UTF-8",
    "\"utf-8\"",
    "\"UTF-8\"",
    "utf-16",
    "latin1",
    "x",
    "\"x y\"",
    "\"\"",
];
const OWS: &[&str] = &["", "", "", " ", "\t", "  "];

/// What generated values are made of.
struct Pools {
    types: &'static [&'static str],
    names: &'static [&'static str],
    values: &'static [&'static str],
}

const JSON_POOLS: Pools = Pools {
    types: JSON_TYPES,
    names: JSON_NAMES,
    values: JSON_VALUES,
};
/// Respellings are sent with a JSON or a form body: no multipart type among them.
const RESPELL_POOLS: Pools = Pools {
    types: &[
        "text/plain",
        "application/x-www-form-urlencoded",
        "text/csv",
        "application/octet-stream",
    ],
    names: NAMES,
    values: VALUES,
};
const OTHER_POOLS: Pools = Pools {
    types: OTHER_TYPES,
    names: NAMES,
    values: VALUES,
};
/// Bytes a request header value may hold.
const HEADER_JUNK: &[u8] = b";=\"\\ \t,x/(@:Ab";
/// And what a part header value may hold besides (no CR or LF).
const PART_JUNK: &[u8] = b";=\"\\ \t,x/(@:Ab\x0b\x0c\x00\x7f\xa0\xe9\xc2";

#[derive(Debug, Clone)]
struct Param {
    name: String,
    value: String,
    /// Before `;`, after `;`, before `=`, after `=`.
    ows: [String; 4],
}

#[derive(Debug, Clone)]
struct Spec {
    ty: String,
    params: Vec<Param>,
}

fn render(s: &Spec) -> Vec<u8> {
    let mut out = s.ty.clone();
    for p in &s.params {
        out += &format!(
            "{};{}{}{}={}{}",
            p.ows[0], p.ows[1], p.name, p.ows[2], p.ows[3], p.value
        );
    }
    out.into_bytes()
}

fn pick(pool: &'static [&'static str]) -> impl Strategy<Value = String> {
    prop::sample::select(pool).prop_map(str::to_owned)
}

fn param(pools: &'static Pools) -> impl Strategy<Value = Param> {
    (
        pick(pools.names),
        pick(pools.values),
        [pick(OWS), pick(OWS), pick(OWS), pick(OWS)],
    )
        .prop_map(|(name, value, ows)| Param { name, value, ows })
}

fn spec(pools: &'static Pools) -> impl Strategy<Value = Spec> {
    (pick(pools.types), prop::collection::vec(param(pools), 0..4))
        .prop_map(|(ty, params)| Spec { ty, params })
}

fn flip_case(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_lowercase() {
                c.to_ascii_uppercase()
            } else {
                c.to_ascii_lowercase()
            }
        })
        .collect()
}

/// One change to a value: to its parameters (drop, repeat, swap, case, quoting, whitespace,
/// value, type) or to its bytes (insert, delete, replace).
fn mutate(
    s: &Spec,
    pools: &Pools,
    (kind, i, j, junk): (u8, Index, Index, Index),
    junk_pool: &[u8],
) -> Vec<u8> {
    let (names, values) = (pools.names, pools.values);
    let mut s = s.clone();
    let n = s.params.len();
    let at = (n > 0).then(|| i.index(n));
    match (kind, at) {
        (0, Some(at)) => {
            s.params.remove(at);
        }
        (1, Some(at)) => {
            let mut p = s.params[at].clone();
            p.value = values[j.index(values.len())].to_owned();
            s.params.insert(at + 1, p);
        }
        (2, Some(at)) if at + 1 < n => s.params.swap(at, at + 1),
        (3, Some(at)) => s.params[at].name = flip_case(&s.params[at].name),
        (4, Some(at)) => s.params[at].value = flip_case(&s.params[at].value),
        (5, Some(at)) => {
            let v = s.params[at].value.clone();
            s.params[at].value = match v.strip_prefix('"').and_then(|v| v.strip_suffix('"')) {
                Some(inner) => inner.to_owned(),
                None => format!("\"{v}\""),
            };
        }
        (6, Some(at)) => s.params[at].ows = [" ", "\t", " ", "\t"].map(str::to_owned),
        (7, _) => s.ty.push(';'),
        (8, _) => s.ty = flip_case(&s.ty),
        (9, Some(at)) => s.params[at].value = values[j.index(values.len())].to_owned(),
        // `a=x` as `a=`, and the value cut short (`text/plain; a`).
        (13, Some(at)) => s.params[at].value = String::new(),
        (14, _) => {
            let mut bytes = render(&s);
            bytes.truncate(j.index(bytes.len() + 1));
            return bytes;
        }
        (10, _) => {
            let mut bytes = render(&s);
            let at = j.index(bytes.len() + 1);
            bytes.insert(at, junk_pool[junk.index(junk_pool.len())]);
            return bytes;
        }
        (11, _) => {
            let mut bytes = render(&s);
            if !bytes.is_empty() {
                bytes.remove(j.index(bytes.len()));
            }
            return bytes;
        }
        (12, _) => {
            let mut bytes = render(&s);
            if !bytes.is_empty() {
                let at = j.index(bytes.len());
                bytes[at] = junk_pool[junk.index(junk_pool.len())];
            }
            return bytes;
        }
        _ => {
            // Another parameter appended.
            s.params.push(Param {
                name: names[i.index(names.len())].to_owned(),
                value: values[j.index(values.len())].to_owned(),
                ows: Default::default(),
            });
        }
    }
    render(&s)
}

/// A pair of values: one and a change to it, or two drawn apart.
fn ct_pair(
    pools: &'static Pools,
    junk_pool: &'static [u8],
) -> impl Strategy<Value = (Vec<u8>, Vec<u8>)> {
    (
        spec(pools),
        spec(pools),
        0u8..17,
        any::<Index>(),
        any::<Index>(),
        any::<Index>(),
        any::<bool>(),
    )
        .prop_map(move |(a, other, kind, i, j, junk, apart)| {
            let b = if apart {
                render(&other)
            } else {
                mutate(&a, pools, (kind, i, j, junk), junk_pool)
            };
            (render(&a), b)
        })
}

fn describe(a: &[u8], b: &[u8], role: Role) -> String {
    format!(
        "\n  A = {:?}\n  B = {:?}\n  strict reading of A: {:?}\n  strict reading of B: {:?}",
        esc(a),
        esc(b),
        show_meaning(&meaning(Some(a), role)),
        show_meaning(&meaning(Some(b), role)),
    )
}

fn show_meaning(m: &Meaning) -> String {
    match m {
        Meaning::Absent => "absent".into(),
        Meaning::AsSent(v) => format!("as sent {:?}", esc(v)),
        Meaning::Read { essence, params } => format!(
            "{} {:?}",
            esc(essence),
            params
                .iter()
                .map(|(n, v)| format!("{}={}", esc(n), esc(v)))
                .collect::<Vec<_>>()
        ),
    }
}

/// A multipart body framed by `B` whose only part has a `Content-Type` of `value`, with
/// `lead`/`trail` SP/HTAB around it.
fn part_body(value: &[u8], lead: &str, trail: &str) -> Vec<u8> {
    let mut body = b"--B\r\nContent-Disposition: form-data; name=\"f\"\r\nContent-Type:".to_vec();
    body.extend_from_slice(lead.as_bytes());
    body.extend_from_slice(value);
    body.extend_from_slice(trail.as_bytes());
    body.extend_from_slice(b"\r\n\r\nsame content\r\n--B--\r\n");
    body
}

const PART_CT: &[u8] = b"multipart/form-data; boundary=B";

proptest! {
    #![proptest_config(cases(2000))]

    /// The request's own `Content-Type`, JSON media types, a JSON body: one fingerprint only
    /// for values the strict reader reads alike.
    #[test]
    fn strict_media_prop_request_json_content_type_never_merges(
        (a, b) in ct_pair(&JSON_POOLS, HEADER_JUNK),
    ) {
        let body = br#"{"amount":10}"#;
        if same_fp(fp(Some(&a), &[], body), fp(Some(&b), &[], body)) {
            let role = Role::Request { by_parts: true };
            prop_assert!(
                meaning(Some(&a), role) == meaning(Some(&b), role),
                "MERGE: one fingerprint for two JSON requests read apart:{}", describe(&a, &b, role)
            );
        }
    }

    /// The request's own `Content-Type`, other media types, with text, form, empty and
    /// multipart bodies (a multipart value then carries `boundary=B` somewhere, the body being
    /// framed by it).
    #[test]
    fn strict_media_prop_request_other_content_type_never_merges(
        (a, b) in ct_pair(&OTHER_POOLS, HEADER_JUNK),
        kind in 0u8..4,
        boundary_at in any::<Index>(),
        boundary_spelling in prop::sample::select(&["boundary=B", "Boundary=\"B\"", "BOUNDARY = B", "boundary=\"\\B\""][..]),
    ) {
        let with_boundary = |v: &[u8]| -> Vec<u8> {
            // `multipart/form-data[; p...]`: the boundary goes in at a parameter's place.
            let text = String::from_utf8_lossy(v).into_owned();
            let mut pieces: Vec<&str> = text.split(';').collect();
            let at = 1 + boundary_at.index(pieces.len());
            pieces.insert(at.min(pieces.len()), boundary_spelling);
            pieces.join(";").into_bytes()
        };
        let (a, b, body): (Vec<u8>, Vec<u8>, &[u8]) = match kind {
            0 => (a, b, b"pay 10 EUR"),
            1 => (a, b, b"amount=10&currency=EUR"),
            2 => (a, b, b""),
            _ => {
                let mp = |v: Vec<u8>| {
                    let t = String::from_utf8_lossy(&v).into_owned();
                    let rest = t.find(';').map_or("", |i| &t[i..]).to_owned();
                    with_boundary(format!("multipart/form-data{rest}").as_bytes())
                };
                (mp(a), mp(b), b"--B\r\nContent-Disposition: form-data; name=\"amount\"\r\n\r\n10\r\n--B--\r\n")
            }
        };
        if same_fp(fp(Some(&a), &[], body), fp(Some(&b), &[], body)) {
            // A multipart request's own boundary does not count, whatever its body (documented).
            let role = Role::Request { by_parts: true };
            prop_assert!(
                meaning(Some(&a), role) == meaning(Some(&b), role),
                "MERGE: one fingerprint for two requests read apart (body {:?}):{}",
                esc(body), describe(&a, &b, role)
            );
        }
    }

    /// A multipart part's `Content-Type` (not JSON): one fingerprint only for values the strict
    /// reader reads alike (SP/HTAB around the value do not count).
    #[test]
    fn strict_media_prop_part_other_content_type_never_merges(
        (a, b) in ct_pair(&OTHER_POOLS, PART_JUNK),
        lead in pick(OWS), trail in pick(OWS),
    ) {
        let fa = fp(Some(PART_CT), &[], &part_body(&a, &lead, &trail));
        let fb = fp(Some(PART_CT), &[], &part_body(&b, " ", ""));
        if same_fp(fa, fb) {
            prop_assert!(
                meaning(Some(&a), Role::Part) == meaning(Some(&b), Role::Part),
                "MERGE: one fingerprint for two parts read apart:{}", describe(&a, &b, Role::Part)
            );
        }
    }

    /// A multipart part's `Content-Type`, JSON media types.
    #[test]
    fn strict_media_prop_part_json_content_type_never_merges(
        (a, b) in ct_pair(&JSON_POOLS, PART_JUNK),
    ) {
        let fa = fp(Some(PART_CT), &[], &part_body(&a, " ", ""));
        let fb = fp(Some(PART_CT), &[], &part_body(&b, " ", ""));
        if same_fp(fa, fb) {
            prop_assert!(
                meaning(Some(&a), Role::Part) == meaning(Some(&b), Role::Part),
                "MERGE: one fingerprint for two JSON parts read apart:{}", describe(&a, &b, Role::Part)
            );
        }
    }

    /// The lesser fault: a value written another way that the crate documents as the same
    /// (case, quoting, order of different names, whitespace, empty parameters, JSON's lone
    /// charset=utf-8) fingerprints the same, as the request's and as a part's.
    #[test]
    fn strict_media_prop_respellings_share_a_fingerprint(
        s in prop_oneof![spec(&JSON_POOLS), spec(&RESPELL_POOLS)],
        flip_type in any::<bool>(),
        flip_names in any::<bool>(),
        requote in any::<bool>(),
        reorder in any::<bool>(),
        empties in any::<bool>(),
        add_utf8 in any::<bool>(),
    ) {
        let a = render(&s);
        prop_assume!(strict_media(&a).is_some());
        let mut r = s.clone();
        if flip_type { r.ty = flip_case(&r.ty); }
        for p in &mut r.params {
            if flip_names { p.name = flip_case(&p.name); }
            if p.name.eq_ignore_ascii_case("charset") { p.value = flip_case(&p.value); }
            if requote {
                p.value = match p.value.strip_prefix('"').and_then(|v| v.strip_suffix('"')) {
                    Some(inner) if !inner.is_empty() && inner.bytes().all(is_tchar) => inner.to_owned(),
                    Some(_) => p.value.clone(),
                    None => format!("\"{}\"", p.value),
                };
            }
            p.ows = [" ", "  ", "\t", " "].map(str::to_owned);
        }
        if reorder {
            // Different names in another order; a repeated name keeps its own order.
            r.params.sort_by_key(|p| std::cmp::Reverse(p.name.to_ascii_lowercase()));
        }
        let json = is_json_essence(s.ty.to_ascii_lowercase().as_bytes());
        if add_utf8 && json && !s.params.iter().any(|p| p.name.eq_ignore_ascii_case("charset")) {
            r.params.push(Param { name: "charset".into(), value: "UTF-8".into(), ows: Default::default() });
        }
        let mut b = render(&r);
        if empties { b.extend_from_slice(b" ;; ;"); }
        let role = Role::Request { by_parts: true };
        prop_assert!(meaning(Some(&a), role) == meaning(Some(&b), role), "test's own respelling:{}", describe(&a, &b, role));
        let body: &[u8] = if json { br#"{"a":1}"# } else { b"a=1" };
        let (fa, fb) = (fp(Some(&a), &[], body), fp(Some(&b), &[], body));
        prop_assert!(
            same_fp(fa.clone(), fb.clone()),
            "SPLIT: the same request read two ways: {:?} / {:?} -> {:?} / {:?}", esc(&a), esc(&b), fa, fb
        );
        let (pa, pb) = (fp(Some(PART_CT), &[], &part_body(&a, " ", "")), fp(Some(PART_CT), &[], &part_body(&b, "\t", " ")));
        prop_assert!(
            same_fp(pa.clone(), pb.clone()),
            "SPLIT: the same part read two ways: {:?} / {:?} -> {:?} / {:?}", esc(&a), esc(&b), pa, pb
        );
    }
}

// ---- hand-written merges, shown at the fingerprint ---------------------------------------------

/// A body read as one form under `first` and as another under `second`: the first boundary's
/// close delimiter ends its body (what follows is its epilogue), and the second's delimiters
/// begin after its preamble (which is the first's form).
fn polyglot(first: &str, first_amount: &str, second: &str, second_amount: &str) -> Vec<u8> {
    format!(
        "--{first}\r\nContent-Disposition: form-data; name=\"amount\"\r\n\r\n{first_amount}\r\n--{first}--\r\n\
         --{second}\r\nContent-Disposition: form-data; name=\"amount\"\r\n\r\n{second_amount}\r\n--{second}--\r\n"
    )
    .into_bytes()
}

/// The first part's content of a multipart `body` framed by `boundary`, as a strict reader
/// finds it (for the handler to say what it read).
fn first_part(body: &[u8], boundary: &[u8]) -> Option<Vec<u8>> {
    let mut open = b"--".to_vec();
    open.extend_from_slice(boundary);
    let start = if body.starts_with(&open) {
        0
    } else {
        let mut d = b"\r\n".to_vec();
        d.extend_from_slice(&open);
        find(body, &d)? + 2
    };
    let rest = &body[start + open.len()..];
    let rest = rest.strip_prefix(b"\r\n")?;
    let head_end = find(rest, b"\r\n\r\n")?;
    let content = &rest[head_end + 4..];
    let mut close = b"\r\n".to_vec();
    close.extend_from_slice(&open);
    Some(content[..find(content, &close)?].to_vec())
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// A request as `fp` takes it: its `Content-Type` (if any), other headers, body.
type Sent<'a> = (Option<&'a [u8]>, &'a [(&'a str, &'a [u8])], &'a [u8]);

/// The merges the strict reader finds in fixed inputs, each named; empty when none.
fn fixed_merges() -> Vec<String> {
    let mut merges = Vec::new();
    let mut check = |name: &str, a: Sent<'_>, b: Sent<'_>, apart: bool| {
        if apart && same_fp(fp(a.0, a.1, a.2), fp(b.0, b.1, b.2)) {
            merges.push(format!(
                "[{name}] A: ct {:?} {:?} body {:?}\n      B: ct {:?} {:?} body {:?}",
                a.0.map(esc),
                a.1.iter()
                    .map(|(n, v)| format!("{n}: {}", esc(v)))
                    .collect::<Vec<_>>(),
                esc(a.2),
                b.0.map(esc),
                b.1.iter()
                    .map(|(n, v)| format!("{n}: {}", esc(v)))
                    .collect::<Vec<_>>(),
                esc(b.2)
            ));
        }
    };
    let json = br#"{"amount":10}"#.as_slice();
    let req = Role::Request { by_parts: true };
    for (a, b) in [
        (
            "application/json; charset=utf-16; charset=utf-8",
            "application/json; charset=utf-16",
        ),
        (
            "application/json; charset=utf-8; charset=latin1",
            "application/json; charset=latin1",
        ),
        (
            "application/problem+json; charset=\"UTF-8\"; charset=utf-16",
            "application/problem+json; charset=utf-16",
        ),
    ] {
        let apart = meaning(Some(a.as_bytes()), req) != meaning(Some(b.as_bytes()), req);
        check(
            "JSON: a charset=utf-8 beside another charset is dropped",
            (Some(a.as_bytes()), &[], json),
            (Some(b.as_bytes()), &[], json),
            apart,
        );
        // The same in a part.
        let part_apart =
            meaning(Some(a.as_bytes()), Role::Part) != meaning(Some(b.as_bytes()), Role::Part);
        check(
            "a part's JSON: a charset=utf-8 beside another charset is dropped",
            (Some(PART_CT), &[], &part_body(a.as_bytes(), " ", "")),
            (Some(PART_CT), &[], &part_body(b.as_bytes(), " ", "")),
            part_apart,
        );
    }
    // A multipart body the crate does not read by its parts (it is gzip-coded, so hashed as
    // sent): its boundary is all that says how it is framed, and it is dropped.
    let gz = common::gzip(&polyglot("AAA", "10", "BBB", "9999"));
    let coded: &[(&str, &[u8])] = &[("content-encoding", b"gzip")];
    check(
        "a gzip-coded multipart body: the boundary is dropped, the body hashed as sent",
        (Some(b"multipart/form-data; boundary=AAA"), coded, &gz),
        (Some(b"multipart/form-data; boundary=BBB"), coded, &gz),
        true,
    );
    // No `Content-Type` line, and one with an empty value (which does not read).
    check(
        "an empty Content-Type value and none at all",
        (Some(b""), &[], b"pay 10"),
        (None, &[], b"pay 10"),
        meaning(Some(b""), req) != meaning(None, req),
    );
    merges
}

/// Merges in fixed inputs the generators may not reach: a JSON `charset=utf-8` dropped beside
/// another `charset` (request and part), a gzip-coded multipart body whose boundary is dropped
/// though the body is hashed as sent, and an empty `Content-Type` merged with none.
#[test]
fn strict_media_fixed_inputs_never_merge() {
    let merges = fixed_merges();
    assert!(
        merges.is_empty(),
        "{} MERGE(S) of requests a strict reader reads apart:\n{}",
        merges.len(),
        merges.join("\n")
    );
}

// ---- over real TCP ------------------------------------------------------------------------------

/// Every run of a handler, per idempotency key, with what it read.
#[derive(Clone, Default)]
struct Runs(Arc<Mutex<HashMap<String, Vec<String>>>>);

impl Runs {
    fn of(&self, key: &str) -> Vec<String> {
        self.0
            .lock()
            .expect("runs")
            .get(key)
            .cloned()
            .unwrap_or_default()
    }

    fn push(&self, key: String, what: String) -> usize {
        let mut runs = self.0.lock().expect("runs");
        let runs = runs.entry(key).or_default();
        runs.push(what);
        runs.len()
    }
}

/// What the handler read: every `Content-Type` line, the coding, and, for a multipart body, its
/// first part's content under the first line's boundary (decoded first if gzip).
fn what_was_read(headers: &http::HeaderMap, body: &[u8]) -> String {
    let cts: Vec<String> = headers
        .get_all("content-type")
        .iter()
        .map(|v| esc(v.as_bytes()))
        .collect();
    let coded = headers
        .get("content-encoding")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"gzip"));
    let body = if coded {
        common::gunzip(body)
    } else {
        body.to_vec()
    };
    let part = headers
        .get("content-type")
        .and_then(|v| strict_media(v.as_bytes()))
        .and_then(|(_, params)| {
            params
                .into_iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(b"boundary"))
        })
        .and_then(|(_, b)| first_part(&body, &b));
    format!(
        "content-type lines {cts:?}, first part {:?}, {} body bytes",
        part.map(|p| esc(&p)),
        body.len()
    )
}

async fn app_with(layer: IdempotencyLayer<MemoryStore, SingleTenant>, runs: &Runs) -> SocketAddr {
    let handler = {
        let runs = runs.clone();
        move |req: Request| {
            let runs = runs.clone();
            async move {
                let (parts, body) = req.into_parts();
                let bytes = body.collect().await.expect("body").to_bytes();
                let key = parts
                    .headers
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                let read = what_was_read(&parts.headers, &bytes);
                let n = runs.push(key, read.clone());
                (StatusCode::CREATED, format!("run {n}: {read}"))
            }
        }
    };
    serve(Router::new().route("/op", post(handler)).layer(layer)).await
}

async fn app(runs: &Runs) -> SocketAddr {
    app_with(
        IdempotencyLayer::new(MemoryStore::new()).single_tenant(),
        runs,
    )
    .await
}

/// A then B under one key: B must be refused (422) and never replayed; the handler ran once.
/// `None` when that holds, else what happened.
async fn refused_second(
    addr: SocketAddr,
    runs: &Runs,
    name: &str,
    a: &[(&str, &[u8])],
    a_body: &[u8],
    b: &[(&str, &[u8])],
    b_body: &[u8],
) -> Option<String> {
    let key = unique("strict-media");
    let with_key = |h: &[(&str, &[u8])]| -> Vec<(String, Vec<u8>)> {
        let mut all = vec![("idempotency-key".to_owned(), key.clone().into_bytes())];
        all.extend(h.iter().map(|(n, v)| ((*n).to_owned(), v.to_vec())));
        all
    };
    let (ha, hb) = (with_key(a), with_key(b));
    let ha: Vec<(&str, &[u8])> = ha.iter().map(|(n, v)| (n.as_str(), v.as_slice())).collect();
    let hb: Vec<(&str, &[u8])> = hb.iter().map(|(n, v)| (n.as_str(), v.as_slice())).collect();
    let first = raw_post_bytes(addr, "/op", &ha, a_body).await;
    let second = raw_post_bytes(addr, "/op", &hb, b_body).await;
    let ran = runs.of(&key);
    (first.status != 201 || second.status != 422 || second.replayed() || ran.len() != 1).then(
        || {
            format!(
                "[{name}] A answered {}, B answered {} (replayed: {}, body {:?}); the handler ran {} \
                 time(s) for the key: {:?}\n      A headers {:?}\n      B headers {:?}",
                first.status,
                second.status,
                second.replayed(),
                second.text(),
                ran.len(),
                ran,
                a.iter().map(|(n, v)| format!("{n}: {}", esc(v))).collect::<Vec<_>>(),
                b.iter().map(|(n, v)| format!("{n}: {}", esc(v))).collect::<Vec<_>>(),
            )
        },
    )
}

/// Header lines of a request: (name, value).
type Headers<'a> = Vec<(&'a str, &'a [u8])>;

/// A named pair of requests: A's headers and body, then B's.
type PairCase<'a> = (&'a str, Headers<'a>, &'a [u8], Headers<'a>, &'a [u8]);

/// The merges over TCP: each B is another request than A to a strict reader and to the
/// handler, which says what it read. A JSON `charset=utf-8` beside another charset; a gzip-coded
/// multipart body whose boundary is dropped (the handler reads amount 10 under one boundary,
/// 9999 under the other); two `Content-Type` lines (a handler that reads them all, or the last,
/// sees another request) against the first alone; an empty `Content-Type` against none.
/// Control first: another spelling of one request is replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_media_http_requests_read_apart_are_never_replayed() {
    let runs = Runs::default();
    let addr = app(&runs).await;
    let json = br#"{"amount":10}"#.as_slice();

    // Control: the rig sees a replay where there must be one.
    let key = unique("strict-media-control");
    let a = raw_post(
        addr,
        "/op",
        &[
            ("idempotency-key", &key),
            ("content-type", "application/json; charset=UTF-8"),
        ],
        json,
    )
    .await;
    let b = raw_post(
        addr,
        "/op",
        &[
            ("idempotency-key", &key),
            ("content-type", "Application/JSON"),
        ],
        json,
    )
    .await;
    assert_eq!(a.status, 201, "{a:?}");
    assert!(
        b.replayed() && b.body == a.body && runs.of(&key).len() == 1,
        "control: one request spelt two ways was not replayed: {b:?}"
    );

    let gz = common::gzip(&polyglot("AAA", "10", "BBB", "9999"));
    let mp_a = polyglot("AAA", "10", "BBB", "9999");
    let cases: Vec<PairCase<'_>> = vec![
        (
            "JSON charset=utf-8 beside charset=utf-16",
            vec![(
                "content-type",
                b"application/json; charset=utf-16; charset=utf-8",
            )],
            json,
            vec![("content-type", b"application/json; charset=utf-16")],
            json,
        ),
        (
            "gzip-coded multipart under another boundary",
            vec![
                ("content-type", b"multipart/form-data; boundary=AAA"),
                ("content-encoding", b"gzip"),
            ],
            &gz,
            vec![
                ("content-type", b"multipart/form-data; boundary=BBB"),
                ("content-encoding", b"gzip"),
            ],
            &gz,
        ),
        (
            "two Content-Type lines against the first alone",
            vec![
                ("content-type", b"multipart/form-data; boundary=AAA"),
                ("content-type", b"multipart/form-data; boundary=BBB"),
            ],
            &mp_a,
            vec![("content-type", b"multipart/form-data; boundary=AAA")],
            &mp_a,
        ),
        (
            "two Content-Type lines (text) against the first alone",
            vec![
                ("content-type", b"text/plain; charset=utf-8"),
                ("content-type", b"text/plain; charset=latin1"),
            ],
            b"caf\xe9",
            vec![("content-type", b"text/plain; charset=utf-8")],
            b"caf\xe9",
        ),
        (
            "an empty Content-Type against none",
            vec![("content-type", b"")],
            b"pay 10",
            vec![],
            b"pay 10",
        ),
    ];
    let mut failures = Vec::new();
    for (name, a, a_body, b, b_body) in &cases {
        if let Some(f) = refused_second(addr, &runs, name, a, a_body, b, b_body).await {
            failures.push(f);
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} requests read apart were answered with another request's response (MERGE):\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// A canonicaliser of the application's own for `multipart/form-data` (here: the body as
/// sent): the boundary is still dropped from the `Content-Type`, so the same bytes under
/// another boundary (another form, to the handler) are one request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_media_http_custom_multipart_canonicaliser_keeps_the_boundary() {
    let runs = Runs::default();
    let as_sent = |body: &[u8]| -> Result<Vec<u8>, MalformedBody> { Ok(body.to_vec()) };
    let addr = app_with(
        IdempotencyLayer::new(MemoryStore::new())
            .canonicalize("multipart/form-data", as_sent)
            .single_tenant(),
        &runs,
    )
    .await;
    let body = polyglot("AAA", "10", "BBB", "9999");
    let failure = refused_second(
        addr,
        &runs,
        "custom multipart canonicaliser, another boundary",
        &[("content-type", b"multipart/form-data; boundary=AAA")],
        &body,
        &[("content-type", b"multipart/form-data; boundary=BBB")],
        &body,
    )
    .await;
    assert!(failure.is_none(), "MERGE: {}", failure.unwrap_or_default());
}

// ---- real clients -------------------------------------------------------------------------------

/// A multipart body: `preamble`, then each part (`head`: header lines each ending in CRLF),
/// the close delimiter and `after` (CRLF, nothing, or an epilogue).
fn form(boundary: &str, preamble: &[u8], parts: &[(&[u8], &[u8])], after: &[u8]) -> Vec<u8> {
    let mut body = preamble.to_vec();
    for (head, content) in parts {
        body.extend_from_slice(format!("--{boundary}\r\n").as_bytes());
        body.extend_from_slice(head);
        body.extend_from_slice(b"\r\n");
        body.extend_from_slice(content);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--").as_bytes());
    body.extend_from_slice(after);
    body
}

const TITLE: &[u8] = b"Content-Disposition: form-data; name=\"title\"\r\n";
const FILE_TEXT: &[u8] =
    b"Content-Disposition: form-data; name=\"file\"; filename=\"a.txt\"\r\nContent-Type: text/plain\r\n";
const FILE_BIN: &[u8] = b"Content-Disposition: form-data; name=\"file\"; filename=\"a.bin\"\r\nContent-Type: application/octet-stream\r\n";
const TEXT: &[u8] = b"line 1\r\nline 2\n--not a boundary\r\n";
const BIN: &[u8] = b"\x00\x01\xff\r\n\r\n--\x89PNG";

struct Client {
    name: &'static str,
    /// Two random boundaries the client might draw for two sends of one form.
    boundaries: [&'static str; 2],
    quoted: bool,
    /// The content type as the client writes it, `{}` for the boundary.
    ct: &'static str,
    parts: Vec<(&'static [u8], &'static [u8])>,
    preamble: [&'static [u8]; 2],
    after: [&'static [u8]; 2],
}

fn clients() -> Vec<Client> {
    let text_form = vec![(TITLE, &b"hello world"[..]), (FILE_TEXT, TEXT)];
    let bin_form = vec![(TITLE, &b"hello world"[..]), (FILE_BIN, BIN)];
    vec![
        Client {
            name: "Chrome/WebKit",
            boundaries: [
                "----WebKitFormBoundary7MA4YWxkTrZu0gW",
                "----WebKitFormBoundaryQz3Kp9TmN2xYb8Rc",
            ],
            quoted: false,
            ct: "multipart/form-data; boundary={}",
            parts: text_form.clone(),
            preamble: [b"", b""],
            after: [b"\r\n", b"\r\n"],
        },
        Client {
            name: "Firefox (gecko)",
            boundaries: [
                "----geckoformboundary9f1e6a7b3c2d4e5f60718293a4b5c6d7",
                "----geckoformboundary0a1b2c3d4e5f60718293a4b5c6d7e8f9",
            ],
            quoted: false,
            ct: "multipart/form-data; boundary={}",
            parts: text_form.clone(),
            preamble: [b"", b""],
            after: [b"\r\n", b"\r\n"],
        },
        Client {
            name: "Firefox (older)",
            boundaries: [
                "---------------------------974767299852498929531610575",
                "---------------------------11307264561818931652263553040",
            ],
            quoted: false,
            ct: "multipart/form-data; boundary={}",
            parts: text_form.clone(),
            preamble: [b"", b""],
            after: [b"\r\n", b"\r\n"],
        },
        Client {
            name: "curl -F",
            boundaries: [
                "------------------------d74496d66958873e",
                "------------------------0f1c2a3b4d5e6f70",
            ],
            quoted: false,
            ct: "multipart/form-data; boundary={}",
            parts: bin_form.clone(),
            preamble: [b"", b""],
            after: [b"\r\n", b"\r\n"],
        },
        Client {
            name: "Python requests/urllib3 (close delimiter with and without its CRLF)",
            boundaries: [
                "3c4f1e0b2a9d8c7b6a5f4e3d2c1b0a99",
                "a5e0f7d3c91b4826b0f3e9d2c1a7b605",
            ],
            quoted: false,
            ct: "multipart/form-data; boundary={}",
            parts: bin_form.clone(),
            preamble: [b"", b""],
            after: [b"", b"\r\n"],
        },
        Client {
            name: "Go mime/multipart",
            boundaries: [
                "0d4c5b2a1f9e8d7c6b5a49382716f5e4d3c2b1a09f8e7d6c5b4a39281706",
                "f1e2d3c4b5a69788796a5b4c3d2e1f00112233445566778899aabbccddee",
            ],
            quoted: false,
            ct: "multipart/form-data; boundary={}",
            parts: bin_form.clone(),
            preamble: [b"", b""],
            after: [b"\r\n", b"\r\n"],
        },
        Client {
            name: "reqwest/hyper",
            boundaries: [
                "2f6f0f2d8a3b4c5d-1e2f3a4b5c6d7e8f-0a1b2c3d4e5f6a7b-8c9d0e1f2a3b4c5d",
                "9a8b7c6d5e4f3a2b-1c0d9e8f7a6b5c4d-3e2f1a0b9c8d7e6f-5a4b3c2d1e0f9a8b",
            ],
            quoted: false,
            ct: "multipart/form-data; boundary={}",
            parts: text_form.clone(),
            preamble: [b"", b""],
            after: [b"\r\n", b"\r\n"],
        },
        Client {
            name: "Node form-data",
            boundaries: [
                "--------------------------515890814546601021194782",
                "--------------------------883726154099827361520034",
            ],
            quoted: false,
            ct: "multipart/form-data; boundary={}",
            parts: bin_form.clone(),
            preamble: [b"", b""],
            after: [b"\r\n", b"\r\n"],
        },
        Client {
            name: ".NET HttpClient (quoted boundary, part Content-Type first)",
            boundaries: [
                "6b1c0bd1-2f7e-4a43-9b39-2c6a8e0f4d11",
                "e3a4f9c2-7d10-4b5e-8f26-91c0d3b7a855",
            ],
            quoted: true,
            ct: "multipart/form-data; boundary={}",
            parts: vec![
                (
                    b"Content-Type: text/plain; charset=utf-8\r\nContent-Disposition: form-data; name=title\r\n",
                    b"hello world",
                ),
            ],
            preamble: [b"", b""],
            after: [b"\r\n", b"\r\n"],
        },
        Client {
            name: "preamble and epilogue (RFC 2046) against none",
            boundaries: ["simple-boundary", "other-boundary"],
            quoted: false,
            ct: "multipart/form-data;boundary={}",
            parts: text_form.clone(),
            preamble: [b"This is the preamble.\r\nIt is to be ignored.\r\n", b""],
            after: [b"\r\nThis is the epilogue.\r\n", b"\r\n"],
        },
        Client {
            name: "Content-Type with a quoted boundary and a WebKit one",
            boundaries: ["quoted", "----WebKitFormBoundaryX"],
            quoted: false,
            ct: "multipart/form-data;boundary=\"{}\"",
            parts: text_form,
            preamble: [b"", b""],
            after: [b"\r\n", b"\r\n"],
        },
    ]
}

/// DESIGN §1.4 ("multipart/form-data by its parts, not its random boundary"): bodies as real
/// clients frame them are accepted (201, never 400), and the same form sent again under another
/// random boundary replays (never 422), the handler having run once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_media_http_real_clients_multipart_is_accepted_and_replayed() {
    let runs = Runs::default();
    let addr = app(&runs).await;
    let mut failures = Vec::new();
    let clients = clients();
    for c in &clients {
        let key = unique("strict-media-client");
        let mut answers = Vec::new();
        for i in 0..2 {
            let b = c.boundaries[i];
            let value = if c.quoted {
                format!("\"{b}\"")
            } else {
                b.to_owned()
            };
            let ct = c.ct.replace("{}", &value);
            let body = form(b, c.preamble[i], &c.parts, c.after[i]);
            let raw = raw_post(
                addr,
                "/op",
                &[("idempotency-key", &key), ("content-type", &ct)],
                &body,
            )
            .await;
            answers.push((ct, body, raw));
        }
        let ran = runs.of(&key);
        let (first, second) = (&answers[0].2, &answers[1].2);
        if first.status != 201 || !second.replayed() || second.body != first.body || ran.len() != 1
        {
            failures.push(format!(
                "[{}] first send {} {:?}, second send {} (replayed {}) {:?}; the handler ran {} time(s)\n      \
                 first: ct {:?} body {:?}\n      second: ct {:?} body {:?}",
                c.name,
                first.status,
                first.text(),
                second.status,
                second.replayed(),
                second.text(),
                ran.len(),
                answers[0].0,
                esc(&answers[0].1),
                answers[1].0,
                esc(&answers[1].1),
            ));
        }
    }
    // Across clients: one form from Chrome and from Firefox is one submission.
    let key = unique("strict-media-across");
    let (b1, b2) = (
        "----WebKitFormBoundaryAcross1",
        "----geckoformboundaryacross2",
    );
    let parts = vec![(TITLE, &b"hello world"[..]), (FILE_TEXT, TEXT)];
    let one = raw_post(
        addr,
        "/op",
        &[
            ("idempotency-key", &key),
            (
                "content-type",
                &format!("multipart/form-data; boundary={b1}"),
            ),
        ],
        &form(b1, b"", &parts, b"\r\n"),
    )
    .await;
    let two = raw_post(
        addr,
        "/op",
        &[
            ("idempotency-key", &key),
            (
                "content-type",
                &format!("multipart/form-data; boundary={b2}"),
            ),
        ],
        &form(b2, b"", &parts, b"\r\n"),
    )
    .await;
    if one.status != 201 || !two.replayed() || runs.of(&key).len() != 1 {
        failures.push(format!(
            "[Chrome then Firefox] {} / {} replayed {}",
            one.status,
            two.status,
            two.replayed()
        ));
    }
    assert!(
        failures.is_empty(),
        "{} of {} real-client forms were refused or not replayed:\n{}",
        failures.len(),
        clients.len() + 1,
        failures.join("\n")
    );
}

/// `Content-Type` values real clients send are accepted, and each is one request with the
/// spelling the crate documents as the same (replayed, the handler having run once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_media_http_real_client_content_types_are_accepted() {
    let runs = Runs::default();
    let addr = app(&runs).await;
    let json = br#"{"amount":10,"currency":"EUR"}"#.as_slice();
    let cases: &[(&str, &str, &[u8])] = &[
        ("application/json; charset=UTF-8", "application/json", json),
        ("application/json;", "application/json", json),
        (
            "application/json;charset=utf-8",
            "application/json; charset=\"UTF-8\"",
            json,
        ),
        (
            "application/x-www-form-urlencoded;charset=UTF-8",
            "application/x-www-form-urlencoded; charset=utf-8",
            b"amount=10&currency=EUR",
        ),
        (
            "text/plain;charset=utf-8",
            "text/plain; charset=\"UTF-8\"",
            b"pay 10 EUR",
        ),
        (
            "text/plain; charset=ISO-8859-1",
            "TEXT/PLAIN;charset=iso-8859-1",
            b"pay 10 \xa4",
        ),
    ];
    let mut failures = Vec::new();
    for (a, b, body) in cases {
        let key = unique("strict-media-ct");
        let first = raw_post(
            addr,
            "/op",
            &[("idempotency-key", &key), ("content-type", a)],
            body,
        )
        .await;
        let second = raw_post(
            addr,
            "/op",
            &[("idempotency-key", &key), ("content-type", b)],
            body,
        )
        .await;
        let ran = runs.of(&key).len();
        if first.status != 201 || !second.replayed() || ran != 1 {
            failures.push(format!(
                "{a:?} then {b:?}: {} {:?} / {} replayed {} {:?}; ran {ran}",
                first.status,
                first.text(),
                second.status,
                second.replayed(),
                second.text()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---- across the upgrade -------------------------------------------------------------------------

/// What the previous version hashed for a part's `Content-Type` (its documented reading,
/// written out per value used here).
fn old_part_ct(value: &[u8]) -> Vec<u8> {
    match value {
        b"text/plain" => b"text/plain".to_vec(),
        b"application/octet-stream" => b"application/octet-stream".to_vec(),
        b"text/plain; charset=UTF-8" | b"text/plain; charset=utf-8" => {
            b"text/plain;7:charset=5:utf-8".to_vec()
        }
        other => panic!("no old reading written for {:?}", esc(other)),
    }
}

/// The previous version's multipart canonical form of a well-framed body: parts in order,
/// header lines (lower-cased names, values trimmed, a `Content-Type` read) sorted by name,
/// content. Everything after the close delimiter was ignored.
fn old_multipart(body: &[u8], boundary: &str) -> Vec<u8> {
    let open = format!("--{boundary}");
    let delimiter = format!("\r\n--{boundary}");
    let mut at = if body.starts_with(open.as_bytes()) {
        open.len()
    } else {
        find(body, delimiter.as_bytes()).expect("first delimiter") + delimiter.len()
    };
    let mut parts = Vec::new();
    loop {
        let rest = &body[at..];
        if rest.starts_with(b"--") {
            break;
        }
        let rest = rest.strip_prefix(b"\r\n").expect("CRLF after a delimiter");
        let end = find(rest, delimiter.as_bytes()).expect("next delimiter");
        parts.push(&rest[..end]);
        at = body.len() - rest.len() + end + delimiter.len();
    }
    let mut out = Vec::new();
    out.extend_from_slice(&(parts.len() as u64).to_le_bytes());
    for part in parts {
        let split = find(part, b"\r\n\r\n").expect("head end");
        let (head, content) = (&part[..split], &part[split + 4..]);
        let mut headers: Vec<(Vec<u8>, Vec<u8>)> = head
            .split(|&b| b == b'\n')
            .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
            .map(|line| {
                let colon = line.iter().position(|&b| b == b':').expect("colon");
                let name = line[..colon].to_ascii_lowercase();
                let value = line[colon + 1..].trim_ascii();
                let value = if name == b"content-type" {
                    old_part_ct(value)
                } else {
                    value.to_vec()
                };
                (name, value)
            })
            .collect();
        headers.sort_by(|a, b| a.0.cmp(&b.0));
        out.extend_from_slice(&(headers.len() as u64).to_le_bytes());
        for (n, v) in &headers {
            put_field(&mut out, n);
            put_field(&mut out, v);
        }
        put_field(&mut out, content);
    }
    out
}

#[derive(Clone, Copy)]
enum OldBody<'a> {
    Raw,
    Json,
    Form,
    Multipart(&'a str),
}

/// The fingerprint the previous version recorded for `POST /op` (no query), its `Content-Type`
/// read as `media` (the documented layout, written out per case), the body as `kind`: under
/// the tag `v1` and the scheme named `v1`.
fn old_http_fp(media: &[u8], body: &[u8], kind: OldBody<'_>) -> [u8; 32] {
    let mut h = Sha256::new();
    field(&mut h, b"tower-idempotency/fingerprint/v1");
    field(&mut h, b"POST");
    field(&mut h, b"/op");
    field(&mut h, b"");
    field(&mut h, media);
    match kind {
        _ if body.is_empty() => {
            field(&mut h, b"raw");
            field(&mut h, body);
        }
        OldBody::Raw => {
            field(&mut h, b"raw");
            field(&mut h, body);
        }
        OldBody::Json => {
            let value: serde_json::Value = serde_json::from_slice(body).expect("json");
            field(&mut h, b"json");
            field(
                &mut h,
                &serde_json_canonicalizer::to_vec(&value).expect("canonical"),
            );
        }
        OldBody::Form => {
            field(&mut h, b"form");
            let mut pairs: Vec<(Vec<u8>, Vec<u8>)> = form_urlencoded::parse(body)
                .map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec()))
                .collect();
            pairs.sort_by(|a, b| a.0.cmp(&b.0));
            h.update((pairs.len() as u64).to_le_bytes());
            for (n, v) in &pairs {
                field(&mut h, n);
                field(&mut h, v);
            }
        }
        OldBody::Multipart(boundary) => {
            field(&mut h, b"multipart");
            field(&mut h, &old_multipart(body, boundary));
        }
    }
    let mut out: [u8; 32] = h.finalize().into();
    out[..4].copy_from_slice(&plain_scheme(b"tower-idempotency/fingerprint/v1"));
    out
}

/// An ordinary request the previous version recorded: `(name, Content-Type, its old reading,
/// body, body kind)`.
type Ordinary = (&'static str, String, Vec<u8>, Vec<u8>, OldBody<'static>);

/// Ordinary requests the previous version recorded.
fn ordinary() -> Vec<Ordinary> {
    let chrome = "----WebKitFormBoundary7MA4YWxkTrZu0gW";
    let curl = "------------------------d74496d66958873e";
    vec![
        (
            "JSON, charset=UTF-8",
            "application/json; charset=UTF-8".into(),
            b"application/json".to_vec(),
            br#"{"amount":12,"currency":"EUR"}"#.to_vec(),
            OldBody::Json,
        ),
        (
            "JSON, trailing ';'",
            "application/json;".into(),
            b"application/json".to_vec(),
            br#"{"currency":"EUR", "amount": 12}"#.to_vec(),
            OldBody::Json,
        ),
        (
            "problem+json, charset=utf-8",
            "application/problem+json; charset=utf-8".into(),
            b"application/problem+json".to_vec(),
            br#"{"a":[1,2]}"#.to_vec(),
            OldBody::Json,
        ),
        (
            "form, charset=UTF-8",
            "application/x-www-form-urlencoded;charset=UTF-8".into(),
            b"application/x-www-form-urlencoded;7:charset=5:utf-8".to_vec(),
            b"currency=EUR&amount=12".to_vec(),
            OldBody::Form,
        ),
        (
            "text, charset and format",
            "text/plain; format=flowed; charset=\"ISO-8859-1\"".into(),
            b"text/plain;7:charset=10:iso-8859-1;6:format=6:flowed".to_vec(),
            b"pay 12 EUR".to_vec(),
            OldBody::Raw,
        ),
        (
            "text, charset=utf-8",
            "text/plain;charset=utf-8".into(),
            b"text/plain;7:charset=5:utf-8".to_vec(),
            b"pay 12 EUR".to_vec(),
            OldBody::Raw,
        ),
        (
            "octet-stream, empty body",
            "application/octet-stream".into(),
            b"application/octet-stream".to_vec(),
            Vec::new(),
            OldBody::Raw,
        ),
        (
            "multipart (Chrome)",
            format!("multipart/form-data; boundary={chrome}"),
            b"multipart/form-data".to_vec(),
            form(chrome, b"", &[(TITLE, b"hello"), (FILE_TEXT, TEXT)], b"\r\n"),
            OldBody::Multipart(chrome),
        ),
        (
            "multipart (curl, octet-stream file, epilogue)",
            format!("multipart/form-data; boundary={curl}"),
            b"multipart/form-data".to_vec(),
            form(curl, b"", &[(TITLE, b"hello"), (FILE_BIN, BIN)], b"\r\nbye\r\n"),
            OldBody::Multipart(curl),
        ),
        (
            "multipart (quoted boundary, part charset)",
            "multipart/form-data;boundary=\"quoted\"".into(),
            b"multipart/form-data".to_vec(),
            form(
                "quoted",
                b"",
                &[(
                    b"Content-Disposition: form-data; name=\"t\"\r\nContent-Type: text/plain; charset=UTF-8\r\n",
                    b"v",
                )],
                b"",
            ),
            OldBody::Multipart("quoted"),
        ),
    ]
}

/// DESIGN §1.4 across the upgrade: ordinary requests (JSON, form, text, multipart, with
/// parameters) the previous version recorded hash as they did (the 28 digest bytes after the
/// scheme are the old layout's), and their byte-identical retry is replayed, the handler not
/// running again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_media_upgrade_ordinary_requests_replay() {
    let runs = Runs::default();
    let mut failures = Vec::new();
    for (name, ct, old_media, body, kind) in ordinary() {
        let old = old_http_fp(&old_media, &body, kind);
        let now = fp(Some(ct.as_bytes()), &[], &body)
            .expect("a header value")
            .expect("fingerprint");
        if now.as_bytes()[4..] != old[4..] {
            failures.push(format!(
                "[{name}] {ct:?} hashes otherwise than before the upgrade"
            ));
        }
        let key = unique("strict-media-upgrade");
        let store = seeded(&ScopedKey::new("", &key), old, old_response()).await;
        let addr = app_with(IdempotencyLayer::new(store).single_tenant(), &runs).await;
        let retry = raw_post(
            addr,
            "/op",
            &[("idempotency-key", &key), ("content-type", &ct)],
            &body,
        )
        .await;
        let ran = runs.of(&key);
        if !retry.replayed() || retry.body != b"the previous version's run" || !ran.is_empty() {
            failures.push(format!(
                "[{name}] {ct:?}: retry answered {} replayed {} {:?}; the handler ran {} time(s)",
                retry.status,
                retry.replayed(),
                retry.text(),
                ran.len()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A named request whose reading changed: Content-Type, its old reading, body, body kind.
type Changed<'a> = (&'a str, &'a str, Vec<u8>, Vec<u8>, OldBody<'a>);

/// DESIGN §1 (`safe_new_key` only where the outcome is definite) across the upgrade: requests
/// the previous version accepted and ran, whose reading the strict one changed. Their
/// byte-identical retry must run nothing and must not tell the client a new key is safe (the
/// operation ran; a client that takes the advice, or "fixes" its request, runs it twice).
/// Read another way (422) and refused as malformed (400) alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_media_upgrade_changed_reading_never_advises_a_new_key() {
    let runs = Runs::default();
    let field_part: &[(&[u8], &[u8])] = &[(TITLE, b"hello")];
    let cases: Vec<Changed<'_>> = vec![
        (
            "a parameter without a value (old: foo=\"\")",
            "text/plain; foo",
            b"text/plain;3:foo=0:".to_vec(),
            b"pay 12".to_vec(),
            OldBody::Raw,
        ),
        (
            "a boundary with '=' unquoted (reads as before, so replayed)",
            "multipart/form-data; boundary=----=_Part_0_1.2",
            b"multipart/form-data".to_vec(),
            form("----=_Part_0_1.2", b"", field_part, b"\r\n"),
            OldBody::Multipart("----=_Part_0_1.2"),
        ),
        (
            "junk after the close delimiter (old: ignored; now 400)",
            "multipart/form-data; boundary=b",
            b"multipart/form-data".to_vec(),
            form("b", b"", field_part, b"junk\r\n"),
            OldBody::Multipart("b"),
        ),
        (
            "a repeated boundary (old: the first; now 400)",
            "multipart/form-data; boundary=b; boundary=b",
            b"multipart/form-data".to_vec(),
            form("b", b"", field_part, b"\r\n"),
            OldBody::Multipart("b"),
        ),
    ];
    let mut failures = Vec::new();
    for (name, ct, old_media, body, kind) in cases {
        let old = old_http_fp(&old_media, &body, kind);
        let key = unique("strict-media-changed");
        let store = seeded(&ScopedKey::new("", &key), old, old_response()).await;
        let addr = app_with(IdempotencyLayer::new(store).single_tenant(), &runs).await;
        let retry = raw_post(
            addr,
            "/op",
            &[("idempotency-key", &key), ("content-type", ct)],
            &body,
        )
        .await;
        let ran = runs.of(&key);
        let problem: serde_json::Value = serde_json::from_slice(&retry.body).unwrap_or_default();
        // Replayed (where the reading did not change after all) or refused keeping the key.
        let refused_keeping_the_key = (retry.status == 422 || retry.status == 400)
            && problem["safe_new_key"] == serde_json::Value::Bool(false);
        let replayed = retry.replayed() && name.contains("replayed");
        if !ran.is_empty() || !(replayed || refused_keeping_the_key) {
            failures.push(format!(
                "[{name}] {ct:?}: retry answered {} (replayed {}), problem {problem}; the handler \
                 ran {} time(s)",
                retry.status,
                retry.replayed(),
                ran.len()
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} retr(ies) across the upgrade of an operation that ran were told a new key is safe:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// A tool server at `/mcp`: one run per call, counted per idempotency key.
fn tools(runs: &Runs) -> Router {
    let runs = runs.clone();
    Router::new().route(
        "/mcp",
        post(move |req: Request| {
            let runs = runs.clone();
            async move {
                let key = req
                    .headers()
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                let bytes = req.into_body().collect().await.expect("body").to_bytes();
                let call: serde_json::Value = serde_json::from_slice(&bytes).expect("a call");
                let n = runs.push(key, "run".into());
                let answer = serde_json::json!({
                    "jsonrpc": "2.0", "id": call["id"],
                    "result": {"content": [{"type": "text", "text": format!("run {n}")}]}
                });
                (
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    answer.to_string(),
                )
            }
        }),
    )
}

fn tool_call(id: u32) -> String {
    serde_json::json!({
        "jsonrpc": "2.0", "id": id, "method": "tools/call",
        "params": {"name": "charge", "arguments": {"amount": 8, "memo": "m"}}
    })
    .to_string()
}

/// The previous version's JSON-RPC fingerprint of a `tools/call` at `/mcp` (no query), its
/// `Content-Type` read as `media`: tag `jsonrpc/v2`, scheme named `jsonrpc/v2`.
fn old_jsonrpc_fp(media: &[u8], params: &serde_json::Value) -> [u8; 32] {
    let mut h = Sha256::new();
    field(&mut h, b"tower-idempotency/jsonrpc/v2");
    field(&mut h, b"/mcp");
    field(&mut h, b"");
    field(&mut h, media);
    field(&mut h, b"tools/call");
    let mut buf = Vec::new();
    put_field(&mut buf, b"json");
    put_field(
        &mut buf,
        &serde_json_canonicalizer::to_vec(params).expect("canonical"),
    );
    field(&mut h, b"params");
    field(&mut h, &buf);
    let mut out: [u8; 32] = h.finalize().into();
    out[..4].copy_from_slice(&plain_scheme(b"tower-idempotency/jsonrpc/v2"));
    out
}

/// DESIGN §1.4 across the upgrade in the JSON-RPC mode (scheme name `jsonrpc/v2/r2`, tag
/// `jsonrpc/v2`): a `tools/call` the previous version recorded is replayed to its retry (a new
/// `id`, as every retry carries), the tool not running again; with `application/json` and with
/// `application/json; charset=utf-8`. The test's old layout is checked first against a record
/// the current version writes (the 28 digest bytes must agree).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_media_upgrade_jsonrpc_tools_call_replays() {
    let runs = Runs::default();
    let call: serde_json::Value = serde_json::from_str(&tool_call(1)).expect("call");
    let params = call["params"].clone();
    let mut failures = Vec::new();
    for ct in ["application/json", "application/json; charset=utf-8"] {
        let old = old_jsonrpc_fp(b"application/json", &params);
        // The layout, against what the current version records for the call.
        let store = MemoryStore::new();
        let addr = serve(
            tools(&runs).layer(
                IdempotencyLayer::new(store.clone())
                    .jsonrpc(JsonRpc::new())
                    .single_tenant(),
            ),
        )
        .await;
        let key = unique("strict-media-rpc-now");
        let live = raw_post(
            addr,
            "/mcp",
            &[("idempotency-key", &key), ("content-type", ct)],
            tool_call(1).as_bytes(),
        )
        .await;
        assert_eq!(live.status, 200, "{live:?}");
        assert_eq!(runs.of(&key).len(), 1);
        let record = store
            .lookup(&ScopedKey::new("\u{0}tools/call", &key))
            .await
            .expect("lookup")
            .expect("the call's record, filed under its method");
        if record.fingerprint.as_bytes()[4..] != old[4..] {
            failures.push(format!(
                "[{ct}] a tools/call hashes otherwise than the previous version's layout"
            ));
        }
        // The previous version's record, and the retry.
        let key = unique("strict-media-rpc-old");
        let scoped = ScopedKey::new("\u{0}tools/call", &key);
        let mut headers = http::HeaderMap::new();
        headers.insert(
            "content-type",
            http::HeaderValue::from_static("application/json"),
        );
        let response = StoredResponse {
            status: StatusCode::OK,
            headers,
            body: Some(bytes::Bytes::from(
                serde_json::json!({
                    "jsonrpc": "2.0", "id": 1,
                    "result": {"content": [{"type": "text", "text": "the previous version's run"}]}
                })
                .to_string(),
            )),
            trailers: None,
        };
        let store = seeded(&scoped, old, response).await;
        let addr = serve(
            tools(&runs).layer(
                IdempotencyLayer::new(store)
                    .jsonrpc(JsonRpc::new())
                    .single_tenant(),
            ),
        )
        .await;
        let retry = raw_post(
            addr,
            "/mcp",
            &[("idempotency-key", &key), ("content-type", ct)],
            tool_call(2).as_bytes(),
        )
        .await;
        let ran = runs.of(&key);
        if !ran.is_empty() || !retry.text().contains("the previous version's run") {
            failures.push(format!(
                "[{ct}] the retry of a tools/call recorded before the upgrade: {} {:?}; the tool ran \
                 {} time(s)",
                retry.status,
                retry.text(),
                ran.len()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---- hostile values -----------------------------------------------------------------------------

/// Hostile `Content-Type` values at the fingerprint (no header-size limit in the way): very
/// long, many `;`, deep escapes, unterminated quotes, many parameters, a long boundary over a
/// large body. Each is answered (no panic; a hang fails the guard), and two that differ in one
/// byte the strict reader reads apart never share a fingerprint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_media_hostile_values_at_the_fingerprint() {
    let results = guard(
        "fingerprinting hostile values",
        tokio::task::spawn_blocking(|| {
            let n = 200_000;
            let long_boundary = "b".repeat(5_000);
            let mut mp_body = Vec::new();
            // Many near-delimiters, then the real form.
            for _ in 0..100 {
                mp_body.extend_from_slice(format!("\r\n--{}x", &long_boundary[..4_999]).as_bytes());
            }
            mp_body.extend_from_slice(&form(&long_boundary, b"", &[(TITLE, b"v")], b"\r\n"));
            let mut many_parts = Vec::new();
            for i in 0..20_000 {
                many_parts.extend_from_slice(
                    format!("--B\r\nContent-Disposition: form-data; name=\"f{i}\"\r\nContent-Type: text/plain;{}\r\n\r\nv\r\n", ";".repeat(20)).as_bytes(),
                );
            }
            many_parts.extend_from_slice(b"--B--\r\n");
            let values: Vec<(String, Vec<u8>)> = vec![
                (format!("text/plain{}", ";".repeat(n)), b"x".to_vec()),
                (format!("text/plain; a=\"{}\"", "\\\"".repeat(n)), b"x".to_vec()),
                (format!("text/plain; a=\"{}", "x".repeat(n)), b"x".to_vec()),
                (format!("text/plain{}", "; a=1".repeat(n / 5)), b"x".to_vec()),
                ("\"".repeat(n), b"x".to_vec()),
                (format!("multipart/form-data; boundary=\"{}\"", "\\\\".repeat(n)), b"--x".to_vec()),
                (format!("multipart/form-data{}; boundary=B", "; a=1".repeat(n / 5)), form("B", b"", &[(TITLE, b"v")], b"")),
                (format!("multipart/form-data; boundary={long_boundary}"), mp_body),
                ("multipart/form-data; boundary=B".to_owned(), many_parts),
            ];
            let mut out = Vec::new();
            for (ct, body) in &values {
                let a = fp(Some(ct.as_bytes()), &[], body);
                // One byte more at the end of the value: read apart (or one of them refused).
                let longer = format!("{ct}x");
                let b = fp(Some(longer.as_bytes()), &[], body);
                let merged = same_fp(a.clone(), b)
                    && meaning(Some(ct.as_bytes()), Role::Request { by_parts: true })
                        != meaning(Some(longer.as_bytes()), Role::Request { by_parts: true });
                out.push((ct.chars().take(60).collect::<String>(), a.map(|r| r.is_ok()), merged));
            }
            out
        }),
    )
    .await
    .expect("no panic while fingerprinting");
    assert_eq!(results.len(), 9);
    let merged: Vec<_> = results.iter().filter(|r| r.2).collect();
    assert!(merged.is_empty(), "hostile values merged: {merged:?}");
    // The long-boundary and many-parts forms are read (not refused).
    assert_eq!(results[7].1, Some(true), "{:?}", results[7]);
    assert_eq!(results[8].1, Some(true), "{:?}", results[8]);
}

/// Hostile `Content-Type` values over TCP, raw bytes included (obs-text, which no `&str`
/// carries): each is answered (never a dropped connection nor a 500), and two that differ
/// are never one request (the second is not replayed; the handler ran at most once per key).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_media_hostile_values_over_tcp() {
    let runs = Runs::default();
    let addr = app(&runs).await;
    let n = 20_000;
    let pairs: Vec<(Vec<u8>, Vec<u8>, Vec<u8>)> = vec![
        (
            b"text/plain; a=\"caf\xe9\"".to_vec(),
            b"text/plain; a=\"caf\xe8\"".to_vec(),
            b"x".to_vec(),
        ),
        (
            b"text/plain\xff".to_vec(),
            b"text/plain\xfe".to_vec(),
            b"x".to_vec(),
        ),
        (
            format!("text/plain; a=\"{}", "x".repeat(n)).into_bytes(),
            format!("text/plain; a=\"{}y", "x".repeat(n)).into_bytes(),
            b"x".to_vec(),
        ),
        (
            format!("text/plain; a=\"{}\"", "\\\"".repeat(n)).into_bytes(),
            format!("text/plain; a=\"{}\\\\\"", "\\\"".repeat(n)).into_bytes(),
            b"x".to_vec(),
        ),
        (
            format!("text/plain{}; a=1", ";".repeat(n)).into_bytes(),
            format!("text/plain{}; a=2", ";".repeat(n)).into_bytes(),
            b"x".to_vec(),
        ),
        (
            "\"".repeat(n).into_bytes(),
            "\"".repeat(n + 1).into_bytes(),
            b"x".to_vec(),
        ),
        (
            format!("multipart/form-data{}; boundary=B", "; a=1".repeat(n / 5)).into_bytes(),
            format!("multipart/form-data{}; boundary=B", "; a=2".repeat(n / 5)).into_bytes(),
            form("B", b"", &[(TITLE, b"v")], b"\r\n"),
        ),
        (
            b"multipart/form-data; boundary=\"caf\xe9\"".to_vec(),
            b"multipart/form-data; boundary=\"caf\xe8\"".to_vec(),
            b"--caf\xe9\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nv\r\n--caf\xe9--\r\n"
                .to_vec(),
        ),
    ];
    let mut failures = Vec::new();
    let mut statuses = Vec::new();
    for (a, b, body) in &pairs {
        let key = unique("strict-media-hostile");
        let key_bytes = key.clone().into_bytes();
        let first = raw_post_bytes(
            addr,
            "/op",
            &[("idempotency-key", &key_bytes), ("content-type", a)],
            body,
        )
        .await;
        let second = raw_post_bytes(
            addr,
            "/op",
            &[("idempotency-key", &key_bytes), ("content-type", b)],
            body,
        )
        .await;
        let ran = runs.of(&key).len();
        statuses.push((esc(&a[..a.len().min(40)]), first.status, second.status));
        if first.status == 0
            || second.status == 0
            || first.status >= 500
            || second.status >= 500
            || second.replayed()
            || ran > 1
        {
            failures.push(format!(
                "{:?}.. / {:?}..: {} / {} (replayed {}), ran {ran}: {:?}",
                esc(&a[..a.len().min(60)]),
                esc(&b[..b.len().min(60)]),
                first.status,
                second.status,
                second.replayed(),
                second.text()
            ));
        }
    }
    println!("hostile Content-Type statuses (value prefix, A, B): {statuses:?}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// After the fix, the JSON-RPC branch of `RefuseKeyed` (DESIGN §8 and §1: `safe_new_key` only
/// where the outcome is definite): a keyed `tools/call` whose fingerprint cannot be made once
/// its key was read (a `Content-Type` holding a byte that is not visible ASCII, sent raw) reads
/// its key's record before it answers. A call already completed under the key is refused with
/// -31005 echoing the new id, and `error.data` never advises a new key; the tool does not run
/// again, counted at the tool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_media_jsonrpc_call_refused_at_its_fingerprint_reads_its_key_first() {
    let runs = Runs::default();
    let addr = serve(
        tools(&runs).layer(
            IdempotencyLayer::new(MemoryStore::new())
                .jsonrpc(JsonRpc::new())
                .single_tenant(),
        ),
    )
    .await;
    let key = unique("strict-media-rpc-refused");
    let first = raw_post(
        addr,
        "/mcp",
        &[
            ("idempotency-key", &key),
            ("content-type", "application/json"),
        ],
        tool_call(1).as_bytes(),
    )
    .await;
    assert_eq!(first.status, 200, "{first:?}");
    assert_eq!(runs.of(&key).len(), 1);
    let key_bytes = key.clone().into_bytes();
    let retry = raw_post_bytes(
        addr,
        "/mcp",
        &[
            ("idempotency-key", &key_bytes),
            ("content-type", b"application/json; a=\"caf\xe9\""),
        ],
        tool_call(2).as_bytes(),
    )
    .await;
    assert_eq!(runs.of(&key).len(), 1, "the tool ran again: {retry:?}");
    let answer = retry.json();
    assert_eq!(answer["id"], 2, "{}", retry.text());
    assert_eq!(answer["error"]["code"], -31005, "{}", retry.text());
    assert_eq!(
        answer["error"]["data"]["safe_new_key"],
        serde_json::Value::Bool(false),
        "a call completed under the key is left for a new key: {}",
        retry.text()
    );
}
