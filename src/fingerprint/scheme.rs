//! Schemes: four bytes naming how a fingerprint was made, in place of the digest's first four.

use super::{FingerprintOptions, JsonFields};

/// Hashing's versions, which name the schemes: bumped whenever what a fingerprint counts
/// changes, even for a few requests, so that a retry of one recorded under the old reading is
/// told "read another way", never "another request, use a new key". `r2`: `Content-Type`
/// values and multipart bodies read strictly (a value that does not read counts as sent).
const HTTP_SCHEME: &[u8] = b"tower-idempotency/fingerprint/v1/r2";
const JSONRPC_SCHEME: &[u8] = b"tower-idempotency/jsonrpc/v2/r2";

/// How a fingerprint was made: the hashing's version and the settings that decide what counts.
pub(crate) type Scheme = [u8; 4];

/// The scheme of a route's fingerprints: the hashing's version and the settings that decide
/// what counts (fingerprint headers by name, the media types with canonicalisers of their own,
/// the JSON fields the route counts; in the JSON-RPC mode, the headers alone). Four bytes take
/// the place of the digest's first four, so replicas configured differently, or running
/// different versions, tell "another request" apart from "a request read another way", where
/// a client told to use a new key could run an operation a second time. Two schemes share
/// their bytes one time in four billion; a canonicaliser's code cannot be named, only its
/// media type.
pub(crate) fn scheme(
    options: &FingerprintOptions,
    fields: Option<&JsonFields>,
    jsonrpc: bool,
) -> Scheme {
    let (version, custom, fields) = match jsonrpc {
        true => (JSONRPC_SCHEME, &[][..], None),
        false => (HTTP_SCHEME, &options.custom[..], fields),
    };
    // Nearly every route counts no headers, fields or media types of its own: a constant.
    if options.headers.is_empty() && custom.is_empty() && fields.is_none() {
        return match jsonrpc {
            true => PLAIN_JSONRPC,
            false => PLAIN_HTTP,
        };
    }
    let mut hash = fnv(FNV_BASIS, version);
    for name in &options.headers {
        hash = fnv(hash, name.as_str().as_bytes());
    }
    hash = fnv(hash, b"custom");
    for (media, _) in custom {
        hash = fnv(hash, media.as_bytes());
    }
    if let Some(fields) = fields {
        hash = fnv(hash, b"fields");
        fields.name_into(&mut |bytes| hash = fnv(hash, bytes));
    }
    hash.to_be_bytes()
}

/// The scheme of a plain HTTP route that counts nothing of its own (a route's until the layer
/// is built).
pub(crate) const PLAIN_HTTP: Scheme = fnv(fnv(FNV_BASIS, HTTP_SCHEME), b"custom").to_be_bytes();
pub(super) const PLAIN_JSONRPC: Scheme =
    fnv(fnv(FNV_BASIS, JSONRPC_SCHEME), b"custom").to_be_bytes();
const FNV_BASIS: u32 = 0x811c_9dc5;

/// FNV-1a over `bytes`' length and `bytes`: stable across processes and versions (it names
/// stored records).
const fn fnv(mut hash: u32, bytes: &[u8]) -> u32 {
    let len = (bytes.len() as u64).to_le_bytes();
    let mut i = 0;
    while i < len.len() {
        hash = (hash ^ len[i] as u32).wrapping_mul(0x0100_0193);
        i += 1;
    }
    let mut i = 0;
    while i < bytes.len() {
        hash = (hash ^ bytes[i] as u32).wrapping_mul(0x0100_0193);
        i += 1;
    }
    hash
}
