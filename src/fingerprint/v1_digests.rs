//! Digests as this version of the crate makes them, written down: a retry across an upgrade
//! replays only if its request hashes as it did (DESIGN §1.4), so a change to how the bytes
//! reach the hasher (gathered, split, reordered) must leave every digest here unchanged.

use http::{HeaderMap, HeaderName, HeaderValue, Request, request::Parts};

use std::sync::Arc;

use super::{
    Canonicalize, FingerprintOptions, JsonFields, MalformedBody, fingerprint_fields, jsonrpc,
    scheme,
};
use crate::key::hex;

fn parts(method: &str, uri: &str, headers: &[(&str, &str)]) -> Parts {
    let mut req = Request::builder().method(method).uri(uri);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    req.body(()).expect("request").into_parts().0
}

/// One request of each kind the hasher is fed, through every path to it; each digest as hex.
fn digests() -> Vec<(&'static str, String)> {
    let plain = FingerprintOptions::default();
    let headed = FingerprintOptions {
        headers: vec![
            HeaderName::from_static("x-api-version"),
            HeaderName::from_static("x-tenant-region"),
        ],
        custom: Vec::new(),
    };
    let json = [("content-type", "application/json")];
    let long_path = format!("/{}", "p".repeat(300));
    let big = format!(r#"{{"title":"{}","priority":2}}"#, "x".repeat(964));
    let fields = JsonFields::exclude(["/sent_at"]).expect("pointer");
    let mut trailers = HeaderMap::new();
    trailers.append("x-checksum", HeaderValue::from_static("abc"));
    trailers.append("x-a", HeaderValue::from_static("1"));
    trailers.append("x-checksum", HeaderValue::from_static("def"));

    let http = |name, parts: Parts, body: &[u8], options: &FingerprintOptions| {
        let fields = None;
        let scheme = scheme(options, fields, false);
        let fp = fingerprint_fields(&parts, None, body, options, fields, None, scheme)
            .expect("fingerprint");
        (name, hex(fp.as_bytes()))
    };
    let mut out = vec![
        http(
            "canonical json",
            parts("POST", "/tools/create_ticket", &json),
            br#"{"a":1,"b":[true,null,"x"]}"#,
            &plain,
        ),
        http(
            "json to canonicalise",
            parts("POST", "/tools/create_ticket", &json),
            br#"{ "b": [true, null, "x"], "a": 1.0 }"#,
            &plain,
        ),
        http(
            "the bench's json (989 bytes)",
            parts("POST", "/tools/create_ticket", &json),
            big.as_bytes(),
            &plain,
        ),
        http("empty body", parts("DELETE", "/t/1", &[]), b"", &plain),
        http(
            "query",
            parts("PUT", "/t?b=2&a=1", &[("content-type", "text/plain")]),
            b"hello",
            &plain,
        ),
        http("empty query", parts("PUT", "/t?", &[]), b"hello", &plain),
        http(
            "long path",
            parts("POST", &long_path, &json),
            br#"{"a":1}"#,
            &plain,
        ),
        http(
            "media parameters",
            parts(
                "POST",
                "/t",
                &[("content-type", "Text/Plain; Charset=UTF-8; format=flowed")],
            ),
            b"hi",
            &plain,
        ),
        http(
            "two content-type lines",
            parts(
                "POST",
                "/t",
                &[
                    ("content-type", "text/plain"),
                    ("content-type", "text/html"),
                ],
            ),
            b"hi",
            &plain,
        ),
        http(
            "fingerprint headers",
            parts(
                "POST",
                "/t",
                &[
                    ("content-type", "application/json"),
                    ("x-api-version", "2, 3"),
                    ("x-api-version", " 4 "),
                ],
            ),
            br#"{"a":1}"#,
            &headed,
        ),
        http(
            "coded body",
            parts(
                "POST",
                "/t",
                &[
                    ("content-type", "application/json"),
                    ("content-encoding", "GZip, identity, br"),
                ],
            ),
            b"\x1f\x8b\x08\x00",
            &plain,
        ),
        http(
            "form",
            parts(
                "POST",
                "/t",
                &[("content-type", "application/x-www-form-urlencoded")],
            ),
            b"b=2&a=1&a=%20",
            &plain,
        ),
        http(
            "multipart",
            parts(
                "POST",
                "/t",
                &[("content-type", "multipart/form-data; boundary=XyZ")],
            ),
            b"--XyZ\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n1\r\n--XyZ--\r\n",
            &plain,
        ),
        http(
            "not canonical json",
            parts("POST", "/t", &json),
            br#"{"a":1,"a":2}"#,
            &plain,
        ),
    ];

    let with_fields = {
        let parts = parts("POST", "/t", &json);
        let scheme = scheme(&plain, Some(&fields), false);
        let fp = fingerprint_fields(
            &parts,
            None,
            br#"{"b":1,"sent_at":"now","a":[1,2]}"#,
            &plain,
            Some(&fields),
            None,
            scheme,
        )
        .expect("fingerprint");
        ("json fields", hex(fp.as_bytes()))
    };
    let with_custom = {
        let lowered: Arc<dyn Canonicalize> =
            Arc::new(|body: &[u8]| -> Result<Vec<u8>, MalformedBody> {
                Ok(body.to_ascii_lowercase())
            });
        let options = FingerprintOptions {
            headers: Vec::new(),
            custom: vec![("text/csv".to_owned(), lowered)],
        };
        let parts = parts("POST", "/t", &[("content-type", "text/csv")]);
        let scheme = scheme(&options, None, false);
        let fp = fingerprint_fields(&parts, None, b"A,B\n1,2", &options, None, None, scheme)
            .expect("fingerprint");
        ("custom canonicaliser", hex(fp.as_bytes()))
    };
    let with_trailers = {
        let parts = parts("POST", "/t", &[("content-type", "text/plain")]);
        let scheme = scheme(&plain, None, false);
        let fp = fingerprint_fields(&parts, Some(&trailers), b"x", &plain, None, None, scheme)
            .expect("fingerprint");
        ("trailers", hex(fp.as_bytes()))
    };
    let call = {
        let parts = parts("POST", "/mcp", &json);
        let scheme = scheme(&headed, None, true);
        let fp = jsonrpc(
            &parts,
            None,
            "tools/call",
            Some(r#"{"name":"create_ticket","arguments":{"b":1,"a":2},"_meta":{"k":1}}"#),
            &["_meta"],
            &headed,
            scheme,
        )
        .expect("fingerprint");
        ("json-rpc call", hex(fp.as_bytes()))
    };
    let bare_call = {
        let parts = parts("POST", "/mcp", &[("content-type", "application/json")]);
        let fp = jsonrpc(
            &parts,
            None,
            "ping",
            None,
            &[],
            &plain,
            scheme(&plain, None, true),
        )
        .expect("fingerprint");
        ("json-rpc call without params", hex(fp.as_bytes()))
    };
    out.extend([with_fields, with_custom, with_trailers, call, bare_call]);
    out
}

/// What this version made of each request in [`digests`], written down on 2026-12-06.
const V1: [(&str, &str); 19] = [
    (
        "canonical json",
        "c8cc4fb0eab2b476af11720d43eabbf6cf7d79fadc5d5407f37b8e0a173acb27",
    ),
    (
        "json to canonicalise",
        "c8cc4fb0eab2b476af11720d43eabbf6cf7d79fadc5d5407f37b8e0a173acb27",
    ),
    (
        "the bench's json (989 bytes)",
        "c8cc4fb0ab6fd82903e36c142fd95d3e5a84d4ef44dfe0f4516a915dc60facd1",
    ),
    (
        "empty body",
        "c8cc4fb0aada2a6d8b0fcbbde83f38cfea2440d552be8cfb07e82b09279b0a52",
    ),
    (
        "query",
        "c8cc4fb0120166e8bafe2e8afec071f8e41cf53ca4b80652125515902190519d",
    ),
    (
        "empty query",
        "c8cc4fb0a2f5c6e89e05eb7c153734209f44d7c24ba10219bd26e384498636fd",
    ),
    (
        "long path",
        "c8cc4fb094cdba4946b9b05c6942ab2a4039fad564d604678191cf375e31e897",
    ),
    (
        "media parameters",
        "c8cc4fb0120dff3b95c2b674b9e572d3c5535f973e6700d0539c401e24374aee",
    ),
    (
        "two content-type lines",
        "c8cc4fb0a45f6844e5f66eb5552f0ffb852e32fc93aa1c41667961d3c76ef183",
    ),
    (
        "fingerprint headers",
        "9178722e9cdd741daa26c9d7c34cbaec672386a53045f55a5730e8398112e7a1",
    ),
    (
        "coded body",
        "c8cc4fb0f7ece2abc4edc5337de5eb92dffd65178d890b8cc634a92657dbec97",
    ),
    (
        "form",
        "c8cc4fb0c8e37ef737f5cd103a7e983c7501a40169d4c1c3d23c2149b168a930",
    ),
    (
        "multipart",
        "c8cc4fb0a07a568c4305a285dd3159fcdd9bef5002bb3a13509a0bc28b9fce05",
    ),
    (
        "not canonical json",
        "c8cc4fb05afddc584d798b61ded61e4b2b9d6cfcb7c94e0d6fdcb39c724313df",
    ),
    (
        "json fields",
        "7c0ce8b396cbf52fb9ad55a3867da5b02cd0c6b0b370a540c40a261d1c2f9704",
    ),
    (
        "custom canonicaliser",
        "9aedb6689bcf3de8073632941e56d142192ac5cbfa2a8db993f766781f7deee8",
    ),
    (
        "trailers",
        "c8cc4fb0ac4a1d3b7fc1c8731f00a85f67bd7c35131ada3272b2781ee81a583e",
    ),
    (
        "json-rpc call",
        "586b8578024f053640c2a8fa5a07bf80b6544c7f7ffc5b69deb6a922baedb82c",
    ),
    (
        "json-rpc call without params",
        "71d8414a4c0f04ee8482bce0177a8227f9a888432dc913f9d54670f5ef1dfbba",
    ),
];

/// DESIGN §1.4: the digests of this version, unchanged by how the bytes reach the hasher.
#[test]
fn digests_are_as_this_version_made_them() {
    let made = digests();
    assert_eq!(
        made.len(),
        V1.len(),
        "a case without its digest written down"
    );
    for ((name, digest), (v1_name, v1)) in made.iter().zip(V1) {
        assert_eq!(*name, v1_name);
        assert_eq!(digest, v1, "{name}: hashed otherwise than this version did");
    }
}
