//! Review of two performance cuts (issue 23 §2), attacked against DESIGN §1 (steps 4–6), §3, §4
//! and §5:
//!
//! 1. the JSON string scan that now tests 64-byte blocks before falling back to words
//!    (`src/fingerprint/json.rs`: `find`, `special`, `special_or_non_ascii`), used by the
//!    canonical-form check (`verbatim`) and the canonicaliser: differential tests against an
//!    independent RFC 8785 implementation (`serde_json_canonicalizer`), with quotes, escapes,
//!    control characters, DEL and 2/3/4-byte UTF-8 (and invalid UTF-8) around 64-byte block
//!    boundaries, relative to the string's start and to the body's; through the public API and
//!    through the real layer over TCP;
//! 2. `IdempotencyStore::claim_now`, the claim answered at once (`MemoryStore`), which the layer
//!    asks first on a request's first claim round: concurrency over real sockets, a full store
//!    with expired and with live records, hang-ups right after the claim, waiting routes, a
//!    store that does not answer at once, and the conformance kit, which runs its checks
//!    through both.
//!
//! Effects are counted at the sink (inside the handler); every wait is guarded by a time-out.

use crate::common;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::routing::post;
use bytes::Bytes;
use common::{Effects, Rng, TestClock, guard, problem, problem_type, serve, until};
use futures_util::FutureExt;
use http::StatusCode;
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::{Barrier, Semaphore};
use tower_idempotency::fingerprint::canonical_json;
use tower_idempotency::store::{
    Claim, ClaimRequest, FencingToken, Fingerprint, HistoryEvent, InFlight, LeaseExpiry, Milestone,
    Record, RecordStatus, Resolution, ScopedKey, StoreError, StoredResponse, UncertainCount,
    UncertainPage, UncertainQuery, kit,
};
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, IdempotencyStore, MemoryStore};

/// A key no other test of this run uses.
fn unique(name: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!("{name}-{}", N.fetch_add(1, Ordering::Relaxed))
}

/// Proptest settings: no regression files written into the tree.
fn cases(n: u32) -> ProptestConfig {
    ProptestConfig {
        cases: n,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// =============================================================================================
// Part 1. DESIGN §1 step 4: the canonical JSON body, differentially.
// =============================================================================================

/// Characters that end a plain run, or must be escaped, or are multi-byte, or look special
/// but are not (`/`, DEL, U+2028).
const ATOMS: &[char] = &[
    '"',
    '\\',
    '/',
    '\u{0}',
    '\u{1}',
    '\u{8}',
    '\t',
    '\n',
    '\u{b}',
    '\u{c}',
    '\r',
    '\u{1f}',
    '\u{7f}',
    '\u{80}',
    'é',
    '\u{7ff}',
    '\u{800}',
    '€',
    '\u{2028}',
    '\u{e000}',
    '\u{ffff}',
    '\u{10000}',
    '😀',
    '\u{10ffff}',
    'A',
    ' ',
    '~',
];

/// The filler of plain runs: ASCII letters, never special.
fn filler(i: usize) -> char {
    (b'a' + (i % 26) as u8) as char
}

/// A string of plain runs with atoms between them.
fn build(pieces: &[(usize, usize)], tail: usize) -> String {
    let mut s = String::new();
    let mut n = 0;
    for &(gap, atom) in pieces {
        for _ in 0..gap {
            s.push(filler(n));
            n += 1;
        }
        s.push(ATOMS[atom % ATOMS.len()]);
    }
    for _ in 0..tail {
        s.push(filler(n));
        n += 1;
    }
    s
}

/// A document that puts `s` (and a name made of it) where the scan meets it, `pad` bytes
/// further into the body (the members sort `n…`, `p`, `s`, `t`, so `pad` shifts what follows).
fn document(pad: usize, s: &str) -> Value {
    let mut object = serde_json::Map::new();
    object.insert("p".into(), Value::String("x".repeat(pad)));
    object.insert("s".into(), Value::String(s.to_owned()));
    object.insert(
        "t".into(),
        json!([s, 1, true, null, 1.5, -0.25, 1e21, 1e-7, {"k": s, "kk": [s]}]),
    );
    object.insert(format!("n{s}"), json!("name"));
    Value::Object(object)
}

/// RFC 8785, by the independent implementation.
fn jcs(v: &Value) -> Vec<u8> {
    serde_json_canonicalizer::to_vec(v).expect("jcs")
}

/// The same document written differently: members in reverse order, whitespace, and
/// characters escaped as `\uXXXX` (upper- or lower-case, surrogate pairs for the astral
/// planes), `\/`, long forms for controls that have short ones.
fn scrambled(v: &Value, seed: u64) -> Vec<u8> {
    let mut out = String::new();
    write_value(v, &mut out, &mut Rng::new(seed));
    out.into_bytes()
}

fn ws(out: &mut String, rng: &mut Rng) {
    match rng.next(6) {
        0 => out.push(' '),
        1 => out.push_str("\n\t "),
        2 => out.push('\r'),
        _ => {}
    }
}

fn write_value(v: &Value, out: &mut String, rng: &mut Rng) {
    ws(out, rng);
    match v {
        Value::Null | Value::Bool(_) | Value::Number(_) => out.push_str(&v.to_string()),
        Value::String(s) => write_str(s, out, rng),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(item, out, rng);
            }
            ws(out, rng);
            out.push(']');
        }
        Value::Object(members) => {
            out.push('{');
            for (i, (name, value)) in members.iter().rev().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                ws(out, rng);
                write_str(name, out, rng);
                ws(out, rng);
                out.push(':');
                write_value(value, out, rng);
            }
            ws(out, rng);
            out.push('}');
        }
    }
    ws(out, rng);
}

fn unicode_escape(c: char, out: &mut String, upper: bool) {
    let mut units = [0u16; 2];
    for unit in c.encode_utf16(&mut units) {
        if upper {
            out.push_str(&format!("\\u{unit:04X}"));
        } else {
            out.push_str(&format!("\\u{unit:04x}"));
        }
    }
}

fn write_str(s: &str, out: &mut String, rng: &mut Rng) {
    out.push('"');
    for c in s.chars() {
        let r = rng.next(5);
        match c {
            '"' if r == 0 => unicode_escape(c, out, true),
            '"' => out.push_str("\\\""),
            '\\' if r == 0 => unicode_escape(c, out, false),
            '\\' => out.push_str("\\\\"),
            '/' if r < 2 => out.push_str("\\/"),
            c if (c as u32) < 0x20 => match (r, c) {
                (0, _) => unicode_escape(c, out, true),
                (1, _) => unicode_escape(c, out, false),
                (_, '\u{8}') => out.push_str("\\b"),
                (_, '\t') => out.push_str("\\t"),
                (_, '\n') => out.push_str("\\n"),
                (_, '\u{c}') => out.push_str("\\f"),
                (_, '\r') => out.push_str("\\r"),
                _ => unicode_escape(c, out, r.is_multiple_of(2)),
            },
            c if r == 0 => unicode_escape(c, out, rng.next(2) == 0),
            c => out.push(c),
        }
    }
    out.push('"');
}

fn json_parts() -> http::request::Parts {
    http::Request::builder()
        .method("POST")
        .uri("/json")
        .header("content-type", "application/json")
        .body(())
        .expect("request")
        .into_parts()
        .0
}

fn fp(body: &[u8]) -> Result<Fingerprint, String> {
    Fingerprint::of(&json_parts(), body).map_err(|e| e.to_string())
}

/// One generated case: where the string sits, what it holds, and a one-character change.
#[derive(Debug, Clone)]
struct Case {
    pad: usize,
    pieces: Vec<(usize, usize)>,
    tail: usize,
    seed: u64,
}

impl Case {
    fn text(&self) -> String {
        build(&self.pieces, self.tail)
    }

    /// The same string with one character replaced by a different one.
    fn changed(&self) -> String {
        let chars: Vec<char> = self.text().chars().collect();
        let mut rng = Rng::new(self.seed ^ 0x5eed);
        if chars.is_empty() {
            return ATOMS[rng.next(ATOMS.len() as u64) as usize].to_string();
        }
        let at = rng.next(chars.len() as u64) as usize;
        let mut replacement = ATOMS[rng.next(ATOMS.len() as u64) as usize];
        if replacement == chars[at] {
            replacement = 'Z';
        }
        let mut out = chars.clone();
        out[at] = replacement;
        out.into_iter().collect()
    }
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        0usize..70,
        prop::collection::vec((0usize..140, 0usize..ATOMS.len()), 0..5),
        0usize..140,
        any::<u64>(),
    )
        .prop_map(|(pad, pieces, tail, seed)| Case {
            pad,
            pieces,
            tail,
            seed,
        })
}

/// Every way of writing a document: its canonical form, serde's compact and pretty forms, a
/// scrambled one.
fn writings(v: &Value, seed: u64) -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("canonical", jcs(v)),
        ("compact", serde_json::to_vec(v).expect("ser")),
        ("pretty", serde_json::to_vec_pretty(v).expect("ser")),
        ("scrambled", scrambled(v, seed)),
        (
            "scrambled again",
            scrambled(v, seed.rotate_left(17) ^ 0xabcdef),
        ),
    ]
}

/// DESIGN §1 step 4 ("key order and whitespace do not matter, values do"): every writing of a
/// document canonicalises to exactly what an independent RFC 8785 implementation writes, and
/// fingerprints alike; a document one character away (anywhere, including at and around the
/// 64-byte block boundaries) fingerprints differently in every writing.
#[test]
fn s1_4_json_fingerprints_agree_with_an_independent_rfc_8785_around_block_boundaries() {
    let mut runner = TestRunner::new(cases(400));
    runner
        .run(&case_strategy(), |case| {
            let text = case.text();
            let v = document(case.pad, &text);
            let want = jcs(&v);
            let want_fp = fp(&want).map_err(TestCaseError::fail)?;
            for (how, body) in writings(&v, case.seed) {
                let canonical = canonical_json(&body)
                    .map_err(|e| TestCaseError::fail(format!("{how}: refused: {e}")))?;
                prop_assert_eq!(
                    canonical.as_deref().map(String::from_utf8_lossy),
                    Some(String::from_utf8_lossy(&want)),
                    "{} body: {:?}",
                    how,
                    String::from_utf8_lossy(&body)
                );
                prop_assert_eq!(
                    fp(&body).map_err(TestCaseError::fail)?,
                    want_fp,
                    "{} body: {:?}",
                    how,
                    String::from_utf8_lossy(&body)
                );
            }
            let other = document(case.pad, &case.changed());
            let other_want = jcs(&other);
            prop_assert_ne!(&other_want, &want, "the change changed nothing");
            let other_fp = fp(&other_want).map_err(TestCaseError::fail)?;
            prop_assert_ne!(other_fp, want_fp, "two documents share a fingerprint");
            for (how, body) in writings(&other, case.seed ^ 1) {
                prop_assert_eq!(
                    fp(&body).map_err(TestCaseError::fail)?,
                    other_fp,
                    "{} body: {:?}",
                    how,
                    String::from_utf8_lossy(&body)
                );
            }
            Ok(())
        })
        .unwrap();
}

/// Invalid byte sequences that may sit inside a JSON string: never UTF-8.
const NOT_UTF8: &[&[u8]] = &[
    &[0x80],
    &[0xbf],
    &[0xc3],
    &[0xc0, 0x80],
    &[0xc1, 0xbf],
    &[0xe2, 0x82],
    &[0xe0, 0x80, 0x80],
    &[0xed, 0xa0, 0x80],
    &[0xf0, 0x9f, 0x98],
    &[0xf0, 0x80, 0x80, 0x80],
    &[0xf4, 0x90, 0x80, 0x80],
    &[0xf5, 0x80, 0x80, 0x80],
    &[0xfe],
    &[0xff],
];

/// Positions near the block boundaries of a run of `len`, relative to the string's start.
fn boundary_positions(len: usize) -> Vec<usize> {
    let mut at: Vec<usize> = vec![0, 1, 2, 7, 8, 9, 15, 16, 17];
    for k in 1..=4usize {
        for d in 0..7usize {
            at.push((k * 64 + d).saturating_sub(3));
        }
    }
    at.extend([len.saturating_sub(2), len.saturating_sub(1), len]);
    at.retain(|&p| p <= len);
    at.sort_unstable();
    at.dedup();
    at
}

/// `{"p":"<pad>","s":"<lead><filler with `insert` at `at`>"}` as bytes.
fn raw_body(pad: usize, lead: &str, len: usize, at: usize, insert: &[u8]) -> Vec<u8> {
    let mut body = format!(r#"{{"p":"{}","s":"{lead}"#, "x".repeat(pad)).into_bytes();
    for i in 0..len {
        if i == at {
            body.extend_from_slice(insert);
        }
        body.push(filler(i) as u8);
    }
    if at == len {
        body.extend_from_slice(insert);
    }
    body.extend_from_slice(br#""}"#);
    body
}

/// DESIGN §1 step 4 and the 400 of a body that claims JSON and is not: a raw control
/// character, an unescaped quote or backslash, or any invalid UTF-8 sequence at (or just
/// before or after) a 64-byte block boundary of a long string is refused, whether the body
/// was all ASCII before it or not (the check that proves UTF-8 once); the valid characters at
/// the same places (DEL, 2/3/4-byte UTF-8) are accepted and hash as their canonical form.
#[test]
fn s1_4_invalid_bytes_at_block_boundaries_are_refused_and_valid_ones_are_not() {
    let mut refused = 0usize;
    let mut accepted = 0usize;
    for len in [63usize, 64, 65, 127, 128, 129, 200, 257] {
        for pad in [0usize, 1, 51] {
            for lead in ["", "é", "😀"] {
                for at in boundary_positions(len) {
                    // Refused: controls, an unescaped quote (ends the string early) and a lone
                    // backslash before a letter that is not an escape, invalid UTF-8.
                    let mut bad: Vec<Vec<u8>> = (0u8..0x20).map(|b| vec![b]).collect();
                    bad.extend(NOT_UTF8.iter().map(|b| b.to_vec()));
                    bad.push(b"\\x".to_vec());
                    bad.push(b"\\u12g".to_vec());
                    bad.push(b"\"".to_vec());
                    for insert in &bad {
                        let body = raw_body(pad, lead, len, at, insert);
                        assert!(
                            serde_json::from_slice::<Value>(&body).is_err(),
                            "the reference accepts {:?}",
                            String::from_utf8_lossy(&body)
                        );
                        assert!(
                            fp(&body).is_err(),
                            "fingerprinted an invalid body: {len} {pad} {lead:?} {at} {insert:?}"
                        );
                        assert!(
                            canonical_json(&body).is_err(),
                            "canonicalised an invalid body: {len} {pad} {lead:?} {at} {insert:?}"
                        );
                        refused += 1;
                    }
                    // Lone surrogate escapes: valid JSON with no canonical form (DESIGN §1.4,
                    // "an undecodable escape"), hashed as sent, never merged with another body.
                    for lone in [&b"\\ud800"[..], b"\\udc00"] {
                        let body = raw_body(pad, lead, len, at, lone);
                        assert_eq!(
                            canonical_json(&body),
                            Ok(None),
                            "{len} {pad} {lead:?} {at} {lone:?}"
                        );
                        let mut other = body.clone();
                        let last = other.len() - 3;
                        other[last] ^= 1;
                        assert_ne!(
                            fp(&body).expect("hashed as sent"),
                            fp(&other).expect("hashed as sent"),
                            "{len} {pad} {lead:?} {at} {lone:?}"
                        );
                    }
                    // Accepted, and hashed as their canonical form.
                    for c in [
                        '\u{7f}',
                        '\u{80}',
                        'é',
                        '\u{7ff}',
                        '\u{800}',
                        '€',
                        '\u{ffff}',
                        '😀',
                        '\u{10ffff}',
                        '/',
                        '~',
                    ] {
                        let mut buf = [0u8; 4];
                        let body = raw_body(pad, lead, len, at, c.encode_utf8(&mut buf).as_bytes());
                        let value: Value = serde_json::from_slice(&body).expect("reference");
                        let want = jcs(&value);
                        assert_eq!(
                            canonical_json(&body).expect("valid").as_deref(),
                            Some(&want[..]),
                            "{len} {pad} {lead:?} {at} {c:?}"
                        );
                        assert_eq!(
                            fp(&body).expect("valid"),
                            fp(&want).expect("valid"),
                            "{len} {pad} {lead:?} {at} {c:?}"
                        );
                        accepted += 1;
                    }
                    // Escaped, in every form: the same canonical text as the raw character.
                    for (escape, c) in [
                        (&b"\\u007f"[..], '\u{7f}'),
                        (b"\\u007F", '\u{7f}'),
                        (b"\\u001f", '\u{1f}'),
                        (b"\\u001F", '\u{1f}'),
                        (b"\\u0022", '"'),
                        (b"\\\"", '"'),
                        (b"\\\\", '\\'),
                        (b"\\u005c", '\\'),
                        (b"\\/", '/'),
                        (b"\\ud83d\\ude00", '😀'),
                        (b"\\uD83D\\uDE00", '😀'),
                        (b"\\u00e9", 'é'),
                        (b"\\b", '\u{8}'),
                        (b"\\u0008", '\u{8}'),
                    ] {
                        let body = raw_body(pad, lead, len, at, escape);
                        let plain: Value = {
                            let mut s = lead.to_owned();
                            for i in 0..len {
                                if i == at {
                                    s.push(c);
                                }
                                s.push(filler(i));
                            }
                            if at == len {
                                s.push(c);
                            }
                            json!({"p": "x".repeat(pad), "s": s})
                        };
                        let want = jcs(&plain);
                        assert_eq!(
                            canonical_json(&body).expect("valid").as_deref(),
                            Some(&want[..]),
                            "{len} {pad} {lead:?} {at} {:?}",
                            String::from_utf8_lossy(escape)
                        );
                        assert_eq!(
                            fp(&body).expect("valid"),
                            fp(&want).expect("valid"),
                            "{len} {pad} {lead:?} {at} {:?}",
                            String::from_utf8_lossy(escape)
                        );
                    }
                }
            }
        }
    }
    assert!(refused > 10_000 && accepted > 1_000, "{refused} {accepted}");
}

/// DESIGN §1 step 4: strings that differ only in what an escape stands for never merge, at any
/// place relative to the blocks: a literal backslash followed by `u0041` is not `A`, an
/// escaped quote is not the end of the string, `\u0000` is not the empty string.
#[test]
fn s1_4_escapes_and_their_look_alikes_never_share_a_fingerprint() {
    for len in [60usize, 64, 70, 128, 140] {
        for at in boundary_positions(len) {
            let mut fps = std::collections::HashMap::new();
            for insert in [
                &br"\\u0041"[..],
                b"A",
                b"\\u0041",
                b"\\\"",
                b"\\\\\\\"",
                b"\\u0000",
                b"",
                b"\\u0000\\u0000",
                b"\\\\",
                b"\\/",
                b"\\\\/",
                b"\x7f",
                b"\\u007f\\u007f",
            ] {
                let body = raw_body(3, "", len, at, insert);
                let value: Value = serde_json::from_slice(&body).expect("reference");
                let canonical = jcs(&value);
                let got = fp(&body).expect("valid");
                assert_eq!(got, fp(&canonical).expect("valid"));
                if let Some(earlier) = fps.insert(canonical.clone(), got) {
                    assert_eq!(earlier, got);
                }
            }
            // Distinct canonical forms, distinct fingerprints.
            let distinct: std::collections::HashSet<_> = fps.values().collect();
            assert_eq!(distinct.len(), fps.len(), "{len} {at}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The same, through the real layer over TCP.
// ---------------------------------------------------------------------------------------------

/// A JSON route that counts its effects at the sink and answers with the count.
fn json_app(effects: Effects) -> Router {
    Router::new()
        .route(
            "/json",
            post(move |_body: Bytes| async move { format!("effect {}", effects.hit()) }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant())
}

async fn post_json(
    client: &reqwest::Client,
    addr: SocketAddr,
    key: &str,
    body: Vec<u8>,
) -> reqwest::Response {
    guard(
        "a request",
        client
            .post(format!("http://{addr}/json"))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body)
            .send(),
    )
    .await
    .expect("send")
}

/// DESIGN §1 steps 4–6, §7.1/§7.2 over a real socket: a retry written differently (member
/// order, whitespace, escapes) replays the one effect; a retry one character away anywhere in
/// a long string is refused 422 and runs nothing. Effects are counted in the handler.
#[test]
fn s7_2_through_the_layer_equal_canonical_forms_replay_and_different_ones_are_refused() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let effects = Effects::default();
    let addr = rt.block_on(serve(json_app(effects.clone())));
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client");
    let mut runner = TestRunner::new(cases(48));
    let strategy = (case_strategy(), any::<bool>(), 0usize..5, 0usize..5);
    runner
        .run(&strategy, |(case, same, first_way, second_way)| {
            rt.block_on(async {
                let key = unique("layer-json");
                let v = document(case.pad, &case.text());
                let first = writings(&v, case.seed).swap_remove(first_way).1;
                let second_value = if same {
                    v.clone()
                } else {
                    document(case.pad, &case.changed())
                };
                let second = writings(&second_value, case.seed ^ 7)
                    .swap_remove(second_way)
                    .1;
                let before = effects.count();
                let res = post_json(&client, addr, &key, first).await;
                prop_assert_eq!(res.status(), StatusCode::OK);
                let original = res.text().await.expect("body");
                prop_assert_eq!(effects.count(), before + 1, "the first request runs");
                let res = post_json(&client, addr, &key, second).await;
                if same {
                    prop_assert_eq!(res.status(), StatusCode::OK, "a rewritten retry replays");
                    prop_assert_eq!(
                        res.headers()
                            .get("idempotency-replayed")
                            .map(|v| v.as_bytes().to_vec()),
                        Some(b"true".to_vec())
                    );
                    prop_assert_eq!(res.text().await.expect("body"), original);
                } else {
                    prop_assert_eq!(
                        res.status(),
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "a different request with the same key"
                    );
                    let p = problem(res).await;
                    prop_assert_eq!(&p["type"], &json!(problem_type("fingerprint-mismatch")));
                }
                prop_assert_eq!(effects.count(), before + 1, "the retry ran nothing");
                Ok(())
            })
        })
        .unwrap();
}

/// DESIGN §1 step 4 ("a body that claims JSON and is not one ... is refused with 400"): over a
/// real socket, invalid UTF-8 and raw control characters at block boundaries get a typed
/// problem+json 400, nothing claimed (the same key then runs a valid body), nothing run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_4_through_the_layer_malformed_json_at_block_boundaries_is_a_typed_400() {
    let effects = Effects::default();
    let addr = serve(json_app(effects.clone())).await;
    let client = reqwest::Client::new();
    for (len, at, insert) in [
        (200usize, 61usize, &[0xffu8][..]),
        (200, 64, &[0xc3]),
        (200, 127, &[0xed, 0xa0, 0x80]),
        (200, 128, &[0xf0, 0x9f, 0x98]),
        (200, 129, &[0x00]),
        (200, 192, &[0x1f]),
        (257, 256, b"\n"),
        (130, 64, &[0x80]),
    ] {
        for lead in ["", "é"] {
            let key = unique("malformed");
            let body = raw_body(5, lead, len, at, insert);
            let res = post_json(&client, addr, &key, body).await;
            assert_eq!(
                res.status(),
                StatusCode::BAD_REQUEST,
                "{len} {at} {insert:?}"
            );
            let p = problem(res).await;
            assert_eq!(p["type"], problem_type("body-malformed"));
            // Nothing was claimed: the key runs a valid body.
            let res = post_json(&client, addr, &key, raw_body(5, lead, len, at, b"")).await;
            assert_eq!(res.status(), StatusCode::OK);
        }
    }
    assert_eq!(effects.count(), 16, "only the valid bodies ran");
}

// =============================================================================================
// Part 2. DESIGN §1 steps 5–6, §4, §5: claims answered at once.
// =============================================================================================

fn request(key: &ScopedKey, fp: u8, lease: Duration, ttl: Duration) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        fingerprint: Fingerprint::from_bytes([fp; 32]),
        lease,
        ttl,
        on_lease_expiry: LeaseExpiry::Reclaim,
    }
}

/// Every operation but the claims, handed to `self.inner`.
macro_rules! forward_the_rest {
    () => {
        async fn renew(
            &self,
            key: &ScopedKey,
            token: FencingToken,
            lease: Duration,
        ) -> Result<SystemTime, StoreError> {
            self.inner.renew(key, token, lease).await
        }

        async fn complete(
            &self,
            key: &ScopedKey,
            token: FencingToken,
            response: &StoredResponse,
            ttl: Duration,
        ) -> Result<(), StoreError> {
            self.inner.complete(key, token, response, ttl).await
        }

        async fn release(
            &self,
            key: &ScopedKey,
            token: FencingToken,
        ) -> Result<RecordStatus, StoreError> {
            self.inner.release(key, token).await
        }

        async fn mark_uncertain(
            &self,
            key: &ScopedKey,
            token: FencingToken,
        ) -> Result<(), StoreError> {
            self.inner.mark_uncertain(key, token).await
        }

        async fn lookup(&self, key: &ScopedKey) -> Result<Option<Record>, StoreError> {
            self.inner.lookup(key).await
        }

        async fn remove(&self, key: &ScopedKey) -> Result<bool, StoreError> {
            self.inner.remove(key).await
        }

        async fn purge_expired(&self) -> Result<u64, StoreError> {
            self.inner.purge_expired().await
        }

        async fn record_milestone(
            &self,
            key: &ScopedKey,
            token: FencingToken,
            milestone: &Milestone,
        ) -> Result<(), StoreError> {
            self.inner.record_milestone(key, token, milestone).await
        }

        async fn list_uncertain(
            &self,
            query: &UncertainQuery,
        ) -> Result<UncertainPage, StoreError> {
            self.inner.list_uncertain(query).await
        }

        async fn count_uncertain(&self) -> Result<UncertainCount, StoreError> {
            self.inner.count_uncertain().await
        }

        async fn resolve(
            &self,
            key: &ScopedKey,
            token: FencingToken,
            resolution: &Resolution,
            ttl: Duration,
            note: Option<&str>,
        ) -> Result<(), StoreError> {
            self.inner.resolve(key, token, resolution, ttl, note).await
        }

        async fn append_history(
            &self,
            key: &ScopedKey,
            event: HistoryEvent,
        ) -> Result<(), StoreError> {
            self.inner.append_history(key, event).await
        }

        async fn wait_for_change(
            &self,
            key: &ScopedKey,
            seen: &InFlight,
            round: u32,
            within: Duration,
        ) {
            self.inner.wait_for_change(key, seen, round, within).await
        }
    };
}

/// A third-party store written before `claim_now` existed: it never overrides it. Counts its
/// claims.
#[derive(Clone)]
struct Awaited<S> {
    inner: S,
    claims: Arc<AtomicUsize>,
}

impl<S> Awaited<S> {
    fn new(inner: S) -> Self {
        Self {
            inner,
            claims: Arc::default(),
        }
    }
}

impl<S: IdempotencyStore> IdempotencyStore for Awaited<S> {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        self.inner.claim(request).await
    }

    forward_the_rest!();
}

/// How a [`Probe`]'s `claim_now` departs from its `claim` (deliberately broken stores).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Lie {
    /// Answers as `claim` would.
    None,
    /// Reports the requester's fingerprint as the record's, in progress and completed alike.
    IgnoresFingerprint,
    /// Reports the requester's fingerprint only for a completed record.
    CompletedFingerprint,
    /// Takes a released key over whatever fingerprint the new request has (rule 2 of the
    /// trait's claim order skipped for released records).
    TakesOverReleasedOfAnotherRequest,
    /// Fails: the store cannot be reached (nothing claimed).
    Unavailable,
    /// Fails: the record is locked elsewhere (nothing claimed).
    Busy,
}

/// A MemoryStore whose `claim_now` is counted (and, by `lie`, broken); `claim` is the inner
/// store's, counted.
#[derive(Clone)]
struct Probe {
    inner: MemoryStore,
    lie: Lie,
    claims: Arc<AtomicUsize>,
    claims_now: Arc<AtomicUsize>,
}

impl Probe {
    fn new(inner: MemoryStore, lie: Lie) -> Self {
        Self {
            inner,
            lie,
            claims: Arc::default(),
            claims_now: Arc::default(),
        }
    }
}

impl IdempotencyStore for Probe {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        self.inner.claim(request).await
    }

    fn claim_now(&self, request: &ClaimRequest) -> Option<Result<Claim, StoreError>> {
        self.claims_now.fetch_add(1, Ordering::SeqCst);
        match self.lie {
            Lie::Unavailable => return Some(Err(StoreError::unavailable("the store is down"))),
            Lie::Busy => return Some(Err(StoreError::Busy)),
            _ => {}
        }
        let made = self.inner.claim_now(request)?;
        Some(match (self.lie, made) {
            (Lie::IgnoresFingerprint, Ok(Claim::Existing { mut record, now })) => {
                record.fingerprint = request.fingerprint;
                Ok(Claim::Existing { record, now })
            }
            (
                Lie::IgnoresFingerprint | Lie::CompletedFingerprint,
                Ok(Claim::Completed { response, .. }),
            ) => Ok(Claim::Completed {
                fingerprint: request.fingerprint,
                response,
            }),
            (Lie::TakesOverReleasedOfAnotherRequest, Ok(Claim::Existing { record, .. }))
                if record.status == RecordStatus::Released
                    && record.fingerprint != request.fingerprint =>
            {
                // The memory store's removal needs no I/O: it is done when first polled.
                let removed = self.inner.remove(&request.key).now_or_never();
                assert!(matches!(removed, Some(Ok(true))), "removed at once");
                self.inner.claim_now(request)?
            }
            (_, other) => other,
        })
    }

    forward_the_rest!();
}

/// DESIGN §7.3 over real sockets: many concurrent requests with one key, released through a
/// barrier on separate connections, against the memory store (claims answered at once): the
/// handler runs exactly once per key; every other answer is a replay of it or a 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_3_concurrent_requests_with_one_key_run_the_handler_once() {
    let effects = Effects::default();
    let counter = effects.clone();
    let app = Router::new()
        .route(
            "/order",
            post(move |ctx: IdempotencyContext| async move {
                tokio::time::sleep(Duration::from_millis(30)).await;
                format!("order {} for {}", counter.hit(), ctx.key())
            }),
        )
        .layer(IdempotencyLayer::new(MemoryStore::new()).single_tenant());
    let addr = serve(app).await;
    const N: usize = 32;
    for round in 0..4 {
        let key = unique("together");
        let barrier = Arc::new(Barrier::new(N));
        let tasks: Vec<_> = (0..N)
            .map(|_| {
                let (barrier, key) = (barrier.clone(), key.clone());
                tokio::spawn(async move {
                    let client = common::client();
                    barrier.wait().await;
                    let res = client
                        .post(format!("http://{addr}/order"))
                        .header("idempotency-key", key)
                        .body("{}")
                        .send()
                        .await
                        .expect("send");
                    let status = res.status();
                    let replayed = res.headers().get("idempotency-replayed").cloned();
                    (status, replayed, res.bytes().await.expect("body"))
                })
            })
            .collect();
        let mut originals = Vec::new();
        let mut replays = Vec::new();
        for task in tasks {
            let (status, replayed, body) = guard("a racing request", task).await.expect("task");
            match status {
                StatusCode::OK if replayed.as_ref().is_some_and(|v| v == "true") => {
                    replays.push(body)
                }
                StatusCode::OK => originals.push(body),
                StatusCode::CONFLICT => {}
                other => panic!("round {round}: unexpected {other}: {body:?}"),
            }
        }
        assert_eq!(originals.len(), 1, "round {round}: one request ran");
        assert!(
            replays.iter().all(|r| *r == originals[0]),
            "replays are the original"
        );
        assert_eq!(effects.count(), round + 1, "one effect per key at the sink");
    }
}

/// A handler that says it entered, waits for a permit of the gate, then counts its effect.
fn gated(entered: Effects, effects: Effects, gate: Arc<Semaphore>) -> Router {
    Router::new().route(
        "/gated",
        post(move |ctx: IdempotencyContext| async move {
            entered.hit();
            gate.acquire().await.expect("gate").forget();
            format!("done {} (attempt {})", effects.hit(), ctx.attempt())
        }),
    )
}

/// DESIGN §1 step 6 (a route that waits for in-flight keys replays the first outcome) with a
/// store that claims at once: every waiter replays the one outcome, the handler runs once,
/// and each request asks `claim_now` exactly once: its waiting rounds go through `claim` (or
/// the shared read), never through `claim_now` again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_6_waiting_requests_replay_the_one_outcome_and_ask_claim_now_once_each() {
    let (entered, effects, gate) = (
        Effects::default(),
        Effects::default(),
        Arc::new(Semaphore::new(0)),
    );
    let store = Probe::new(MemoryStore::new(), Lie::None);
    let app = gated(entered.clone(), effects.clone(), gate.clone()).layer(
        IdempotencyLayer::new(store.clone())
            .single_tenant()
            .wait_for_in_flight(Duration::from_secs(30)),
    );
    let addr = serve(app).await;
    let key = unique("waiting");
    let send = move |key: String| async move {
        let res = common::client()
            .post(format!("http://{addr}/gated"))
            .header("idempotency-key", key)
            .send()
            .await
            .expect("send");
        let replayed = res
            .headers()
            .get("idempotency-replayed")
            .is_some_and(|v| v == "true");
        (res.status(), replayed, res.text().await.expect("body"))
    };
    let first = tokio::spawn(send(key.clone()));
    until("the first request enters", || entered.count() == 1).await;
    const WAITERS: usize = 12;
    let waiters: Vec<_> = (0..WAITERS)
        .map(|_| tokio::spawn(send(key.clone())))
        .collect();
    until("every waiter has claimed once", || {
        store.claims_now.load(Ordering::SeqCst) == WAITERS + 1
    })
    .await;
    gate.add_permits(1);
    let (status, replayed, body) = guard("the first", first).await.expect("task");
    assert_eq!((status, replayed), (StatusCode::OK, false));
    assert_eq!(body, "done 1 (attempt 1)");
    for waiter in waiters {
        let answer = guard("a waiter", waiter).await.expect("task");
        assert_eq!(
            answer,
            (StatusCode::OK, true, body.clone()),
            "a waiter replays"
        );
    }
    assert_eq!(effects.count(), 1, "one effect at the sink");
    assert_eq!(entered.count(), 1, "the handler was entered once");
    assert_eq!(
        store.claims_now.load(Ordering::SeqCst),
        WAITERS + 1,
        "claim_now is asked on each request's first round only"
    );
}

/// DESIGN §5 ("full -> 503, never evicting live or completed records early") and the sweep a
/// claim at once makes: a store at `max_records` whose records all expired sweeps them (in
/// every shard) and claims at once, through the layer and directly; one whose records are
/// live (in flight or completed within their TTL) refuses with a typed 503, nothing run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_a_full_store_sweeps_expired_records_and_refuses_live_ones() {
    const MAX: usize = 6;
    let clock = TestClock::default();
    let store = clock.store().max_records(MAX);
    let effects = Effects::default();
    let counter = effects.clone();
    let app = Router::new()
        .route(
            "/t",
            post(move || async move { format!("effect {}", counter.hit()) }),
        )
        .layer(
            IdempotencyLayer::new(store.clone())
                .single_tenant()
                .ttl(Duration::from_secs(5)),
        );
    let addr = serve(app).await;
    let client = common::client();
    let post_key = |key: String| {
        let client = client.clone();
        async move {
            guard(
                "a request",
                client
                    .post(format!("http://{addr}/t"))
                    .header("idempotency-key", key)
                    .send(),
            )
            .await
            .expect("send")
        }
    };
    for generation in 0..3 {
        // Fill the store with completed records.
        for i in 0..MAX {
            let res = post_key(format!("g{generation}-{i}")).await;
            assert_eq!(
                res.status(),
                StatusCode::OK,
                "generation {generation}, key {i}"
            );
        }
        assert_eq!(effects.count(), (generation + 1) * MAX);
        // Live and completed records are never evicted: a new key is refused, typed.
        let res = post_key(format!("g{generation}-over")).await;
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(res.headers().contains_key("retry-after"));
        let p = problem(res).await;
        assert_eq!(p["type"], problem_type("store-unavailable"));
        assert_eq!(effects.count(), (generation + 1) * MAX, "nothing ran");
        // Directly: the memory store answers at once, and says full.
        let key = ScopedKey::new("", format!("direct-{generation}"));
        let req = request(&key, 1, Duration::from_secs(5), Duration::from_secs(5));
        assert!(
            matches!(store.claim_now(&req), Some(Err(StoreError::Full))),
            "a full store answers Full at once"
        );
        // The completed records replay still.
        let res = post_key(format!("g{generation}-0")).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.headers()["idempotency-replayed"], "true");
        // Past their TTL, they make room: the next generation's claims all succeed.
        clock.advance(Duration::from_secs(6));
    }
    // Directly, once more: past the TTL of every record, a claim at once sweeps and wins.
    let key = ScopedKey::new("", "direct-after");
    let req = request(&key, 1, Duration::from_secs(5), Duration::from_secs(5));
    match store.claim_now(&req) {
        Some(Ok(Claim::Acquired(lease))) => assert_eq!(lease.attempt, 1),
        other => panic!("a store of expired records claims at once, got {other:?}"),
    }
    assert!(store.len() <= MAX, "bounded: {} records", store.len());
}

/// DESIGN §5 with records in flight: a store full of live leases refuses a new key (503) and
/// runs nothing, at once; as each holder finishes, its completed record still counts (no
/// eviction); only past the TTL does a new key run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_a_store_full_of_live_leases_refuses_new_keys_and_runs_nothing() {
    let clock = TestClock::default();
    let store = clock.store().max_records(2);
    let (entered, effects, gate) = (
        Effects::default(),
        Effects::default(),
        Arc::new(Semaphore::new(0)),
    );
    let app = gated(entered.clone(), effects.clone(), gate.clone()).layer(
        IdempotencyLayer::new(store.clone())
            .single_tenant()
            .ttl(Duration::from_secs(5)),
    );
    let addr = serve(app).await;
    let send = move |key: &'static str| async move {
        common::client()
            .post(format!("http://{addr}/gated"))
            .header("idempotency-key", key)
            .send()
            .await
            .expect("send")
    };
    let a = tokio::spawn(send("live-a"));
    let b = tokio::spawn(send("live-b"));
    until("both holders enter", || entered.count() == 2).await;
    let res = guard("a third key", send("live-c")).await;
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        problem(res).await["type"],
        problem_type("store-unavailable")
    );
    assert_eq!(entered.count(), 2, "the third key ran nothing");
    gate.add_permits(1);
    gate.add_permits(1);
    for holder in [a, b] {
        assert_eq!(
            guard("a holder", holder).await.expect("task").status(),
            StatusCode::OK
        );
    }
    let res = guard("a third key again", send("live-c")).await;
    assert_eq!(
        res.status(),
        StatusCode::SERVICE_UNAVAILABLE,
        "completed records stay"
    );
    assert_eq!(entered.count(), 2);
    clock.advance(Duration::from_secs(6));
    let third = tokio::spawn(send("live-c"));
    until("the third key runs once there is room", || {
        entered.count() == 3
    })
    .await;
    gate.add_permits(1);
    let res = guard("the third key", third).await.expect("task");
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.text().await.expect("body"), "done 3 (attempt 1)");
    assert_eq!(effects.count(), 3);
}

/// Writes a POST with `key` on a raw connection and returns it (to be dropped: a hang-up).
async fn raw_post(addr: SocketAddr, path: &str, key: &str) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: t\r\nidempotency-key: {key}\r\ncontent-length: 2\r\n\r\n{{}}"
    );
    stream.write_all(head.as_bytes()).await.expect("write");
    stream
}

async fn post_gated(addr: SocketAddr, key: &str) -> reqwest::Response {
    guard(
        "a request",
        common::client()
            .post(format!("http://{addr}/gated"))
            .header("idempotency-key", key)
            .body("{}")
            .send(),
    )
    .await
    .expect("send")
}

/// DESIGN §4 (a store that fails refuses, never runs) on the claim made at once: a store whose
/// `claim_now` answers an error runs nothing. Unreachable: 503 `store-unavailable` with a
/// `Retry-After`; its record locked elsewhere: 409 in flight. Counted at the sink, and no claim
/// went through `claim` behind the error's back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_claim_made_at_once_that_fails_runs_nothing() {
    for (lie, status, slug) in [
        (
            Lie::Unavailable,
            StatusCode::SERVICE_UNAVAILABLE,
            "store-unavailable",
        ),
        (Lie::Busy, StatusCode::CONFLICT, "in-flight"),
    ] {
        let (entered, effects, gate) = (
            Effects::default(),
            Effects::default(),
            Arc::new(Semaphore::new(0)),
        );
        gate.add_permits(10);
        let store = Probe::new(MemoryStore::new(), lie);
        let app = gated(entered.clone(), effects.clone(), gate.clone())
            .layer(IdempotencyLayer::new(store.clone()).single_tenant());
        let addr = serve(app).await;
        let key = unique("claim-now-fails");
        for attempt in 0..3 {
            let res = post_gated(addr, &key).await;
            assert_eq!(res.status(), status, "{lie:?}, attempt {attempt}");
            assert!(
                res.headers().contains_key("retry-after"),
                "{lie:?}: a delay to retry after"
            );
            assert_eq!(problem(res).await["type"], problem_type(slug), "{lie:?}");
        }
        assert_eq!(
            (entered.count(), effects.count()),
            (0, 0),
            "{lie:?}: nothing ran"
        );
        assert_eq!(store.claims_now.load(Ordering::SeqCst), 3, "{lie:?}");
        assert_eq!(store.claims.load(Ordering::SeqCst), 0, "{lie:?}");
    }
}

/// DESIGN §1 step 7 and §4 with a claim made at once: a client that hangs up right after its
/// claim (its handler entered) neither leaves the key stuck in progress nor runs it twice:
/// the retry meanwhile gets 409, the handler finishes once, the retry then replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_hang_up_right_after_the_claim_neither_sticks_nor_runs_twice() {
    let (entered, effects, gate) = (
        Effects::default(),
        Effects::default(),
        Arc::new(Semaphore::new(0)),
    );
    let store = MemoryStore::new();
    let app = gated(entered.clone(), effects.clone(), gate.clone())
        .layer(IdempotencyLayer::new(store.clone()).single_tenant());
    let addr = serve(app).await;
    let key = unique("hang-up");
    let stream = raw_post(addr, "/gated", &key).await;
    until("the handler enters", || entered.count() == 1).await;
    drop(stream);
    let res = post_gated(addr, &key).await;
    assert_eq!(
        res.status(),
        StatusCode::CONFLICT,
        "in flight, not run again"
    );
    assert_eq!(problem(res).await["type"], problem_type("in-flight"));
    gate.add_permits(1);
    until("the detached handler finishes", || effects.count() == 1).await;
    // The outcome is recorded (the detached execution records it): the retry replays it.
    let mut replay = None;
    for _ in 0..200 {
        let res = post_gated(addr, &key).await;
        if res.status() == StatusCode::OK {
            assert_eq!(res.headers()["idempotency-replayed"], "true");
            replay = Some(res.text().await.expect("body"));
            break;
        }
        assert_eq!(
            res.status(),
            StatusCode::CONFLICT,
            "only until it is recorded"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(replay.as_deref(), Some("done 1 (attempt 1)"));
    assert_eq!((entered.count(), effects.count()), (1, 1));
    let record = store
        .lookup(&ScopedKey::new("", &key))
        .await
        .expect("lookup")
        .expect("record");
    assert_eq!(record.status, RecordStatus::Completed);
}

/// DESIGN §3 ("dropped futures") on a route that cancels on disconnect, with a claim made at
/// once: the hang-up gives the key back (not stuck), and the retry runs as attempt 2; the
/// cancelled handler never reached its effect, so the sink counts one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_a_cancelled_request_gives_its_key_back_and_the_retry_runs_once() {
    let (entered, effects) = (Effects::default(), Effects::default());
    let (e, f) = (entered.clone(), effects.clone());
    let app = Router::new()
        .route(
            "/gated",
            post(move |ctx: IdempotencyContext| async move {
                if e.hit() == 1 {
                    std::future::pending::<()>().await;
                }
                format!("done {} (attempt {})", f.hit(), ctx.attempt())
            }),
        )
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .single_tenant()
                .cancel_on_disconnect(true),
        );
    let addr = serve(app).await;
    let key = unique("cancelled");
    let stream = raw_post(addr, "/gated", &key).await;
    until("the handler enters", || entered.count() == 1).await;
    drop(stream);
    let mut answer = None;
    for _ in 0..400 {
        let res = post_gated(addr, &key).await;
        if res.status() == StatusCode::OK {
            answer = Some(res.text().await.expect("body"));
            break;
        }
        assert_eq!(
            res.status(),
            StatusCode::CONFLICT,
            "only until the release lands"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        answer.as_deref(),
        Some("done 1 (attempt 2)"),
        "the key was given back"
    );
    let res = post_gated(addr, &key).await;
    assert_eq!(res.headers()["idempotency-replayed"], "true");
    assert_eq!((entered.count(), effects.count()), (2, 1));
}

/// DESIGN §1 step 6 on a waiting route: waiters whose clients give up (their futures dropped
/// while they wait, after a claim made at once) leave nothing behind: the holder finishes
/// once, its outcome is recorded, and a later retry replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_6_waiters_that_hang_up_leave_the_one_outcome_intact() {
    let (entered, effects, gate) = (
        Effects::default(),
        Effects::default(),
        Arc::new(Semaphore::new(0)),
    );
    let store = Probe::new(MemoryStore::new(), Lie::None);
    let app = gated(entered.clone(), effects.clone(), gate.clone()).layer(
        IdempotencyLayer::new(store.clone())
            .single_tenant()
            .wait_for_in_flight(Duration::from_secs(30)),
    );
    let addr = serve(app).await;
    let key = unique("waiters-leave");
    let first = tokio::spawn({
        let key = key.clone();
        async move { post_gated(addr, &key).await }
    });
    until("the holder enters", || entered.count() == 1).await;
    let mut streams = Vec::new();
    for _ in 0..6 {
        streams.push(raw_post(addr, "/gated", &key).await);
    }
    until("the waiters have claimed", || {
        store.claims_now.load(Ordering::SeqCst) == 7
    })
    .await;
    drop(streams);
    // Let the server see the hang-ups before the holder finishes.
    tokio::time::sleep(Duration::from_millis(50)).await;
    gate.add_permits(1);
    let res = guard("the holder", first).await.expect("task");
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.text().await.expect("body"), "done 1 (attempt 1)");
    let res = post_gated(addr, &key).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["idempotency-replayed"], "true");
    assert_eq!(res.text().await.expect("body"), "done 1 (attempt 1)");
    assert_eq!((entered.count(), effects.count()), (1, 1));
}

/// DESIGN §5 ("one trait, one behaviour"): a store that does not override `claim_now` (the
/// default, `None`) still guards every route: the layer falls back to `claim`. Replay, 422,
/// 409 and a concurrent burst, counted at the sink.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_a_store_without_claim_now_falls_back_to_claim() {
    let store = Awaited::new(MemoryStore::new());
    let (entered, effects, gate) = (
        Effects::default(),
        Effects::default(),
        Arc::new(Semaphore::new(0)),
    );
    let app = gated(entered.clone(), effects.clone(), gate.clone())
        .layer(IdempotencyLayer::new(store.clone()).single_tenant());
    let addr = serve(app).await;
    let send = move |key: String, body: &'static str| async move {
        common::client()
            .post(format!("http://{addr}/gated"))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("send")
    };
    let key = unique("awaited");
    let burst: Vec<_> = (0..16)
        .map(|_| tokio::spawn(send(key.clone(), r#"{"a":1,"b":2}"#)))
        .collect();
    until("one request enters", || entered.count() == 1).await;
    // Everyone else has been answered 409 by now, or will be when it claims.
    let res = guard("an in-flight retry", send(key.clone(), r#"{"b":2,"a":1}"#)).await;
    assert_eq!(res.status(), StatusCode::CONFLICT);
    gate.add_permits(1);
    let mut ran = 0;
    for task in burst {
        let res = guard("a burst request", task).await.expect("task");
        let replayed = res
            .headers()
            .get("idempotency-replayed")
            .is_some_and(|v| v == "true");
        match res.status() {
            StatusCode::OK if replayed => {}
            StatusCode::OK => ran += 1,
            StatusCode::CONFLICT => {}
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(ran, 1, "one of the burst ran");
    let res = guard(
        "a rewritten retry",
        send(key.clone(), "{ \"b\" : 2 , \"a\" : 1 }"),
    )
    .await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["idempotency-replayed"], "true");
    let res = guard("a different request", send(key.clone(), r#"{"a":1,"b":3}"#)).await;
    assert_eq!(res.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!((entered.count(), effects.count()), (1, 1));
    assert!(
        store.claims.load(Ordering::SeqCst) >= 19,
        "every request claimed through claim: {}",
        store.claims.load(Ordering::SeqCst)
    );
}

/// DESIGN §1 step 6 ("any state, different fingerprint -> 422") and §3 (a technical failure
/// releases the key): with claims made at once, a released key refuses a different request
/// (422, nothing run), runs the same request again (attempt 2), then replays it; for the
/// memory store and for one chosen by URL (`AnyStore`, which hands `claim_now` on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_6_a_released_key_refuses_a_different_request_and_reruns_the_same() {
    async fn check<St: IdempotencyStore>(store: St, tag: &str) {
        let key = ScopedKey::new("", "probe");
        assert!(
            store
                .claim_now(&request(
                    &key,
                    9,
                    Duration::from_secs(1),
                    Duration::from_secs(1)
                ))
                .is_some(),
            "{tag}: an in-process store claims at once"
        );
        let calls = Effects::default();
        let counter = calls.clone();
        let app = Router::new()
            .route(
                "/pay",
                post(move |ctx: IdempotencyContext, _body: Bytes| async move {
                    let n = counter.hit();
                    let status = if n == 1 {
                        StatusCode::INTERNAL_SERVER_ERROR
                    } else {
                        StatusCode::OK
                    };
                    (status, format!("call {n} (attempt {})", ctx.attempt()))
                }),
            )
            .layer(IdempotencyLayer::new(store).single_tenant());
        let addr = serve(app).await;
        let client = common::client();
        let send = |body: &'static str| {
            let client = client.clone();
            async move {
                let res = guard(
                    "a request",
                    client
                        .post(format!("http://{addr}/pay"))
                        .header("idempotency-key", "released-key")
                        .header("content-type", "application/json")
                        .body(body)
                        .send(),
                )
                .await
                .expect("send");
                let replayed = res
                    .headers()
                    .get("idempotency-replayed")
                    .is_some_and(|v| v == "true");
                (res.status(), replayed, res.bytes().await.expect("body"))
            }
        };
        let a = r#"{"amount":100,"memo":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\u00e9"}"#;
        let a_again = r#"{ "memo" : "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaé", "amount" : 1e2 }"#;
        let b = r#"{"amount":100,"memo":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\u00e8"}"#;
        let (status, _, _) = send(a).await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{tag}");
        let (status, _, _) = send(b).await;
        assert_eq!(
            status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{tag}: released, another request"
        );
        assert_eq!(calls.count(), 1, "{tag}: nothing ran for the other request");
        let (status, replayed, body) = send(a_again).await;
        assert_eq!((status, replayed), (StatusCode::OK, false), "{tag}");
        assert_eq!(body, "call 2 (attempt 2)", "{tag}");
        let (status, replayed, again) = send(a).await;
        assert_eq!(
            (status, replayed, again),
            (StatusCode::OK, true, body),
            "{tag}"
        );
        let (status, _, _) = send(b).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{tag}");
        assert_eq!(calls.count(), 2, "{tag}: two calls at the sink");
    }
    check(MemoryStore::new(), "memory").await;
    let any = tower_idempotency::AnyStore::connect("memory://")
        .await
        .expect("memory://");
    check(any, "memory://").await;
}

/// DESIGN §5: `claim_now` "decides exactly as `claim` would". Two memory stores on clocks that
/// move together are driven through the same random operations, one claiming only at once,
/// one only through `claim`: every answer has the same shape (variant, attempt, status,
/// fingerprint, response), including expiry, takeover, reconciliation and full stores.
#[test]
fn s5_claim_now_and_claim_decide_alike_step_by_step() {
    #[derive(Debug, Clone)]
    enum Op {
        Claim {
            key: u8,
            fp: u8,
            lease_ms: u64,
            ttl_ms: u64,
            reconcile: bool,
        },
        Complete {
            key: u8,
            ttl_ms: u64,
        },
        Release {
            key: u8,
        },
        EffectStarted {
            key: u8,
        },
        Advance {
            ms: u64,
        },
    }
    let op = prop_oneof![
        4 => (0u8..6, 0u8..3, 1u64..400, 1u64..800, any::<bool>()).prop_map(
            |(key, fp, lease_ms, ttl_ms, reconcile)| Op::Claim { key, fp, lease_ms, ttl_ms, reconcile }
        ),
        2 => (0u8..6, 1u64..800).prop_map(|(key, ttl_ms)| Op::Complete { key, ttl_ms }),
        1 => (0u8..6).prop_map(|key| Op::Release { key }),
        1 => (0u8..6).prop_map(|key| Op::EffectStarted { key }),
        2 => (1u64..500).prop_map(|ms| Op::Advance { ms }),
    ];
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut runner = TestRunner::new(cases(256));
    runner
        .run(&prop::collection::vec(op, 1..60), |ops| {
            rt.block_on(async {
                let offset = Arc::new(AtomicU64::new(0));
                let base = SystemTime::now();
                let clock = |offset: Arc<AtomicU64>| {
                    move || base + Duration::from_millis(offset.load(Ordering::SeqCst))
                };
                let now_store = MemoryStore::with_clock(clock(offset.clone())).max_records(4);
                let awaited = MemoryStore::with_clock(clock(offset.clone())).max_records(4);
                let mut tokens: [std::collections::HashMap<u8, FencingToken>; 2] =
                    Default::default();
                let shape = |c: &Result<Claim, StoreError>| -> String {
                    match c {
                        Ok(Claim::Acquired(lease)) => format!("acquired {}", lease.attempt),
                        Ok(Claim::Completed {
                            fingerprint,
                            response,
                        }) => {
                            format!("completed {fingerprint:?} {:?}", response.body)
                        }
                        Ok(Claim::Existing { record, .. }) => format!(
                            "existing {:?} {:?} {} {}",
                            record.status,
                            record.fingerprint,
                            record.attempts,
                            record.effect_started
                        ),
                        Err(e) => format!("error {e}"),
                    }
                };
                for (step, op) in ops.iter().enumerate() {
                    match *op {
                        Op::Claim {
                            key,
                            fp,
                            lease_ms,
                            ttl_ms,
                            reconcile,
                        } => {
                            let k = ScopedKey::new("", format!("k{key}"));
                            let mut req = request(
                                &k,
                                fp,
                                Duration::from_millis(lease_ms),
                                Duration::from_millis(ttl_ms),
                            );
                            if reconcile {
                                req.on_lease_expiry = LeaseExpiry::Reconcile;
                            }
                            let a = now_store
                                .claim_now(&req)
                                .expect("a memory store claims at once");
                            let b = awaited.claim(&req).await;
                            prop_assert_eq!(shape(&a), shape(&b), "step {}: {:?}", step, op);
                            if let Ok(Claim::Acquired(lease)) = a {
                                tokens[0].insert(key, lease.token);
                            }
                            if let Ok(Claim::Acquired(lease)) = b {
                                tokens[1].insert(key, lease.token);
                            }
                        }
                        Op::Complete { key, .. }
                        | Op::Release { key }
                        | Op::EffectStarted { key } => {
                            let k = ScopedKey::new("", format!("k{key}"));
                            // Only records that have not expired: an expired one may or may
                            // not have been purged yet (shards differ between the stores).
                            let seen = |r: Option<Record>| {
                                r.map(|r| (r.status, r.attempts, r.fingerprint))
                            };
                            let a = seen(now_store.lookup(&k).await.expect("lookup"));
                            let b = seen(awaited.lookup(&k).await.expect("lookup"));
                            prop_assert_eq!(a, b, "step {}: lookup before {:?}", step, op);
                            if a.is_none() {
                                continue;
                            }
                            let mut outs = Vec::new();
                            for (i, store) in [&now_store, &awaited].into_iter().enumerate() {
                                let Some(&t) = tokens[i].get(&key) else {
                                    outs.push("no token".to_owned());
                                    continue;
                                };
                                let out = match *op {
                                    Op::Complete { ttl_ms, .. } => format!(
                                        "{:?}",
                                        store
                                            .complete(
                                                &k,
                                                t,
                                                &common::memory::response(b"r"),
                                                Duration::from_millis(ttl_ms)
                                            )
                                            .await
                                            .map_err(|e| e.to_string())
                                    ),
                                    Op::Release { .. } => format!(
                                        "{:?}",
                                        store.release(&k, t).await.map_err(|e| e.to_string())
                                    ),
                                    _ => format!(
                                        "{:?}",
                                        store
                                            .record_milestone(&k, t, &Milestone::EffectStarted)
                                            .await
                                            .map_err(|e| e.to_string())
                                    ),
                                };
                                outs.push(out);
                            }
                            prop_assert_eq!(&outs[0], &outs[1], "step {}: {:?}", step, op);
                        }
                        Op::Advance { ms } => {
                            offset.fetch_add(ms, Ordering::SeqCst);
                        }
                    }
                }
                Ok(())
            })
        })
        .unwrap();
}

// ---------------------------------------------------------------------------------------------
// The conformance kit (DESIGN §5), which runs its checks through `claim` and, for a store that
// answers it, again through `claim_now`. The tests that use it here run one at a time.
// ---------------------------------------------------------------------------------------------

static KIT: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs one kit check against `store` on a task of its own: whether it panicked.
async fn kit_panics<S, F, Fut>(store: Arc<S>, check: F) -> bool
where
    S: IdempotencyStore,
    F: FnOnce(Arc<S>) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let task = tokio::spawn(check(store));
    match tokio::time::timeout(Duration::from_secs(120), task).await {
        Ok(Ok(())) => false,
        Ok(Err(e)) if e.is_panic() => true,
        Ok(Err(e)) => panic!("the kit's task failed: {e}"),
        Err(_) => panic!("the kit hung"),
    }
}

/// DESIGN §5: the whole kit passes for the memory store, which answers claims at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_the_kit_passes_for_the_memory_store() {
    let _one_at_a_time = KIT.lock().await;
    let store = Arc::new(MemoryStore::new());
    let failed = kit_panics(store, |store| async move { kit::run_all(store).await }).await;
    assert!(!failed, "the memory store fails its own kit");
}

/// DESIGN §5: the kit's claim checks pass for a store that never answers at once (the kit
/// falls back to `claim` whenever `claim_now` says `None`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_the_kit_passes_for_a_store_without_claim_now() {
    let _one_at_a_time = KIT.lock().await;
    let store = Arc::new(Awaited::new(MemoryStore::new()));
    let failed = kit_panics(store.clone(), |store| async move {
        kit::claim_then_existing(&*store).await;
        kit::claim_race_has_one_winner(&store).await;
        kit::fingerprint_mismatch_is_reported(&*store).await;
        kit::complete_then_replay_exactly(&*store).await;
        kit::release_lets_the_next_claim_take_over(&*store).await;
        kit::mark_uncertain_blocks_claims(&*store).await;
        kit::concurrent_operations_each_get_their_own_answer(&store).await;
    })
    .await;
    assert!(!failed, "a store without claim_now fails the kit");
    assert!(
        store.claims.load(Ordering::SeqCst) > 40,
        "the kit claimed through claim"
    );
}

/// DESIGN §5 and §1 step 6 (a different fingerprint is never replayed): the kit catches a
/// store whose `claim_now` ignores fingerprints (reports the requester's as the record's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_the_kit_catches_a_claim_now_that_ignores_fingerprints() {
    let _one_at_a_time = KIT.lock().await;
    for run in 0..2 {
        let store = Arc::new(Probe::new(MemoryStore::new(), Lie::IgnoresFingerprint));
        let caught = kit_panics(store.clone(), |store| async move {
            kit::claiming_at_once(kit::fingerprint_mismatch_is_reported(&*store)).await;
        })
        .await;
        assert!(
            store.claims_now.load(Ordering::SeqCst) > 0,
            "the kit asked claim_now"
        );
        assert!(
            caught,
            "run {run}: the kit passed a claim_now that ignores fingerprints"
        );
    }
}

/// DESIGN §5 (one conformance kit, both ways of claiming held to every rule): a store whose
/// `claim_now` breaks one rule, reporting the requester's fingerprint for a completed record (a
/// wrong replay through the layer), fails the check of that rule every time it runs in the
/// kit's pass that claims at once, not every other time. (Found by this review: the kit first
/// picked `claim_now` or `claim` by the parity of a process-wide counter, so the broken store
/// passed on every other run.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_the_kit_catches_a_claim_now_that_lies_about_a_completed_record_on_every_run() {
    let _one_at_a_time = KIT.lock().await;
    let mut caught = Vec::new();
    for _ in 0..2 {
        let store = Arc::new(Probe::new(MemoryStore::new(), Lie::CompletedFingerprint));
        caught.push(
            kit_panics(store, |store| async move {
                kit::claiming_at_once(kit::fingerprint_mismatch_is_reported(&*store)).await;
            })
            .await,
        );
    }
    assert_eq!(
        caught,
        [true, true],
        "the check of rule 2 passed a broken claim_now on some runs"
    );
}

/// DESIGN §1 step 6 ("any state, different fingerprint -> 422") and the trait's claim rule 2
/// (a record with another fingerprint is answered, not taken over): the kit catches a
/// `claim_now` that takes a released key over for a different request.
///
/// (Found by this review: no check claimed a `released` or `needs_reconciliation` record with
/// another fingerprint, so rule 2 went unchecked there, for `claim` and `claim_now` alike. The
/// kit's `another_request_never_takes_over_a_released_or_uncertain_key` checks it now.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_the_kit_catches_a_claim_now_that_takes_over_a_released_key_of_another_request() {
    let _one_at_a_time = KIT.lock().await;
    // First, that the broken store is broken where it matters: through the layer, a
    // different request with the key of a released one runs instead of being refused.
    let store = Probe::new(MemoryStore::new(), Lie::TakesOverReleasedOfAnotherRequest);
    let key = ScopedKey::new("", "released");
    let lease = match store.claim_now(&request(
        &key,
        1,
        Duration::from_secs(60),
        Duration::from_secs(60),
    )) {
        Some(Ok(Claim::Acquired(lease))) => lease,
        other => panic!("{other:?}"),
    };
    store.release(&key, lease.token).await.expect("release");
    let other = request(&key, 2, Duration::from_secs(60), Duration::from_secs(60));
    assert!(
        matches!(store.claim_now(&other), Some(Ok(Claim::Acquired(_)))),
        "the broken store takes the key over"
    );
    let honest = MemoryStore::new();
    let lease = match honest.claim_now(&request(
        &key,
        1,
        Duration::from_secs(60),
        Duration::from_secs(60),
    )) {
        Some(Ok(Claim::Acquired(lease))) => lease,
        other => panic!("{other:?}"),
    };
    honest.release(&key, lease.token).await.expect("release");
    assert!(
        matches!(honest.claim_now(&other), Some(Ok(Claim::Existing { .. }))),
        "the memory store answers a released record of another request as it stands"
    );

    let store = Arc::new(Probe::new(
        MemoryStore::new(),
        Lie::TakesOverReleasedOfAnotherRequest,
    ));
    let caught = kit_panics(store, |store| async move { kit::run_all(store).await }).await;
    assert!(
        caught,
        "the whole kit passed a claim_now that takes over a released key for another request"
    );
}
