//! RFC 8785 (JSON Canonicalization Scheme) for fingerprints.
//!
//! A body already in canonical form is recognised in one pass ([`verbatim`]) and hashed as it
//! is. Any other is parsed once into a flat tree (nodes in preorder, strings as ranges of the
//! body, buffers reused per thread) and written out in canonical form: object members sorted
//! by their UTF-16 code units, no whitespace, numbers in ECMAScript's shortest form, strings
//! with the minimal escapes. Nesting is capped at [`MAX_DEPTH`] so hostile input cannot
//! exhaust the stack.

mod number;
mod parse;
mod scan;
#[cfg(test)]
mod tests;
mod verbatim;
mod write;

use std::cell::RefCell;

use super::Sink;
use parse::Parser;
pub(crate) use verbatim::verbatim;
use write::Writer;

/// The deepest nesting of arrays and objects accepted.
pub(crate) const MAX_DEPTH: usize = 128;

/// Why a JSON body has no canonical form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum JsonError {
    /// Not JSON, or not UTF-8: the request is malformed.
    Malformed(&'static str),
    /// Valid JSON that RFC 8785 cannot canonicalise without losing information (duplicate
    /// member names, numbers beyond IEEE 754 double range). Hashed as raw bytes instead, so
    /// such documents are never merged into another document's fingerprint.
    NotCanonical,
}

/// One node of a parsed document, in preorder. Ranges are byte offsets (bodies past 4 GiB are
/// hashed raw).
#[derive(Clone, Copy)]
enum Node {
    Null,
    True,
    False,
    /// A number to print in ECMAScript form.
    Number(f64),
    /// A number whose text in the body is already its ECMAScript form.
    Raw {
        start: u32,
        end: u32,
    },
    /// A string with no escape in the body: its contents are already canonical.
    Plain {
        start: u32,
        end: u32,
    },
    /// A string with escapes, decoded into the tree's text.
    Decoded {
        start: u32,
        end: u32,
    },
    /// `len` items follow; `next` is the index after the last of them.
    Array {
        len: u32,
        next: u32,
    },
    /// `len` members follow, each a name node then its value; `next` as for arrays.
    Object {
        len: u32,
        next: u32,
    },
}

/// A parsed document, reused by each thread: once its buffers have grown to the documents a
/// thread sees, canonicalising allocates nothing.
#[derive(Default)]
struct Tree {
    nodes: Vec<Node>,
    /// The decoded text of strings with escapes.
    decoded: String,
    /// Members being sorted, one object's run above the next's.
    order: Vec<Member>,
}

/// An object member while its object is written: where its name is, and its name node.
#[derive(Clone, Copy)]
struct Member {
    start: u32,
    end: u32,
    /// Whether the name is in the decoded text rather than the body.
    decoded: bool,
    node: u32,
}

/// Whether this thread's parse tree is destroyed (see [`super::buffers_gone`]).
#[cfg(test)]
pub(super) fn tree_gone() -> bool {
    TREE.try_with(|_| ()).is_err()
}

thread_local! {
    static TREE: RefCell<Tree> = const {
        RefCell::new(Tree {
            nodes: Vec::new(),
            decoded: String::new(),
            order: Vec::new(),
        })
    };
}

/// The most nodes a thread keeps room for between documents.
const KEEP_NODES: usize = 16 * 1024;

/// Writes the RFC 8785 form of `body` into `out`.
pub(crate) fn canonicalize(body: &[u8], out: &mut impl Sink) -> Result<(), JsonError> {
    let text = std::str::from_utf8(body).map_err(|_| JsonError::Malformed(NOT_UTF8))?;
    canonicalize_text(text, out)
}

/// Why a JSON body that is not UTF-8 is refused.
pub(crate) const NOT_UTF8: &str = "body is not UTF-8";

/// [`canonicalize`] for a body already checked to be UTF-8.
pub(crate) fn canonicalize_text(text: &str, out: &mut impl Sink) -> Result<(), JsonError> {
    if u32::try_from(text.len()).is_err() {
        return Err(JsonError::NotCanonical);
    }
    crate::reuse::with(
        &TREE,
        |tree| tree.nodes.capacity() <= KEEP_NODES,
        |tree| {
            tree.nodes.clear();
            tree.decoded.clear();
            tree.order.clear();
            canonicalize_into(text, tree, out)
        },
    )
}

fn canonicalize_into(text: &str, tree: &mut Tree, out: &mut impl Sink) -> Result<(), JsonError> {
    let Tree {
        nodes,
        decoded,
        order,
    } = tree;
    let mut parser = Parser {
        s: text.as_bytes(),
        text,
        i: 0,
        nodes,
        decoded,
        inexact: false,
    };
    parser.skip_ws();
    parser.value(0)?;
    parser.skip_ws();
    if parser.i != parser.s.len() {
        return Err(JsonError::Malformed(
            "trailing characters after the JSON document",
        ));
    }
    // Read to its end first: a document with no canonical form is still refused if it is
    // not JSON further on.
    if parser.inexact {
        return Err(JsonError::NotCanonical);
    }
    let mut writer = Writer {
        nodes,
        body: text,
        decoded,
        order,
    };
    writer.write(0, out).map(|_| ())
}
