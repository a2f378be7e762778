//! Fingerprinting part of a JSON body, chosen by RFC 6901 JSON Pointers.
//!
//! A route may count only some fields of its JSON body ([`JsonFields::include`]) or all but
//! some ([`JsonFields::exclude`]: a client-side timestamp, a trace id the client puts in the
//! body). What counts is canonicalised exactly as a whole body is (RFC 8785 where exact, raw
//! bytes where not), from the body's own text, so no number passes through a lossy form.
//!
//! The risk is yours to weigh: a field left out that changes the outcome makes two different
//! operations look like one, and the second gets the first one's answer.
//!
//! A body sent with a `Content-Encoding` is hashed whole, as sent: its fields cannot be read
//! without decoding it, so a compressed retry whose left-out field changed is a mismatch
//! (422), never a merge. A member whose name is no Unicode text (a lone surrogate escape)
//! matches no pointer.

use std::fmt;

use super::{MalformedBody, Sink, put_field, put_len};
use crate::json_text::children;

/// Which fields of a JSON body a route's fingerprint counts.
#[derive(Clone, PartialEq, Eq)]
pub struct JsonFields {
    mode: Mode,
    pointers: Vec<Pointer>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Include,
    Exclude,
}

/// An RFC 6901 pointer, as its decoded reference tokens.
#[derive(Clone, PartialEq, Eq)]
struct Pointer {
    text: String,
    tokens: Vec<String>,
}

/// A JSON Pointer that is not RFC 6901 syntax.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidPointer(String);

impl fmt::Display for InvalidPointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} is not an RFC 6901 JSON Pointer: it must be empty or start with '/', and '~' \
             must be followed by 0 or 1",
            self.0
        )
    }
}

impl std::error::Error for InvalidPointer {}

impl fmt::Debug for JsonFields {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JsonFields")
            .field("mode", &self.mode)
            .field(
                "pointers",
                &self.pointers.iter().map(|p| &p.text).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl JsonFields {
    /// Counts only the values at these pointers (a missing one counts as missing): for
    /// example `["/amount", "/currency", "/customer/id"]`.
    pub fn include<I, S>(pointers: I) -> Result<Self, InvalidPointer>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Self::new(Mode::Include, pointers)
    }

    /// Counts everything but the values at these pointers: for example
    /// `["/client_timestamp", "/trace/id"]`.
    pub fn exclude<I, S>(pointers: I) -> Result<Self, InvalidPointer>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Self::new(Mode::Exclude, pointers)
    }

    fn new<I, S>(mode: Mode, pointers: I) -> Result<Self, InvalidPointer>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut pointers: Vec<Pointer> = pointers
            .into_iter()
            .map(|p| parse(p.as_ref()))
            .collect::<Result<_, _>>()?;
        // A set: in any order, once each, it counts the same (replicas listing the same fields
        // in another order read one request alike).
        pointers.sort_unstable_by(|a, b| a.text.cmp(&b.text));
        pointers.dedup_by(|a, b| a.text == b.text);
        // Excluding the whole document would leave nothing to tell two requests apart.
        if mode == Mode::Exclude
            && let Some(whole) = pointers.iter().find(|p| p.tokens.is_empty())
        {
            return Err(InvalidPointer(whole.text.clone()));
        }
        Ok(Self { mode, pointers })
    }

    /// Feeds what these settings are to `eat` (the fingerprint's scheme): the mode and the
    /// pointers.
    pub(crate) fn name_into(&self, eat: &mut impl FnMut(&[u8])) {
        eat(match self.mode {
            Mode::Include => b"include",
            Mode::Exclude => b"exclude",
        });
        for pointer in &self.pointers {
            eat(pointer.text.as_bytes());
        }
    }

    /// Writes what counts of `body` (already known to be valid JSON) into `out`.
    pub(crate) fn canonicalize(
        &self,
        body: &str,
        out: &mut impl Sink,
    ) -> Result<(), MalformedBody> {
        put_field(
            out,
            if self.mode == Mode::Include {
                b"include"
            } else {
                b"exclude"
            },
        );
        match self.mode {
            Mode::Include => {
                put_len(out, self.pointers.len());
                for pointer in &self.pointers {
                    put_field(out, pointer.text.as_bytes());
                    match find(body, &pointer.tokens) {
                        Found::Value(text) => {
                            put_field(out, b"value");
                            exact(text, out)?;
                        }
                        Found::Missing => put_field(out, b"missing"),
                        // A name twice on the way: which value counts is not defined.
                        Found::Ambiguous => {
                            put_field(out, b"ambiguous");
                            put_field(out, body.as_bytes());
                        }
                    }
                }
            }
            Mode::Exclude => {
                // What was left out counts too (as include's list does): two instances that
                // exclude different fields never read two different requests as one.
                put_len(out, self.pointers.len());
                for pointer in &self.pointers {
                    put_field(out, pointer.text.as_bytes());
                }
                let tokens: Vec<&[String]> = self.pointers.iter().map(|p| &p.tokens[..]).collect();
                let kept = without(body, &tokens);
                exact(&kept, out)?;
            }
        }
        Ok(())
    }
}

/// An object's text without its members named `names` (top level only); any other value as
/// it is. Member order and every other byte are kept.
pub(crate) fn without_members(text: &str, names: &[&str]) -> String {
    let tokens: Vec<[String; 1]> = names.iter().map(|n| [(*n).to_owned()]).collect();
    let pointers: Vec<&[String]> = tokens.iter().map(|t| &t[..]).collect();
    if text.trim_start().starts_with('{') {
        without(text, &pointers)
    } else {
        text.trim().to_owned()
    }
}

/// The canonical form of a JSON text where it is exact, else its raw bytes, each in its own
/// domain (see the module docs of `fingerprint`).
pub(crate) fn exact(text: &str, out: &mut impl Sink) -> Result<(), MalformedBody> {
    match super::canonical_json(text.as_bytes())? {
        Some(canonical) => {
            put_field(out, b"json");
            put_field(out, &canonical);
        }
        None => {
            put_field(out, b"json-raw");
            put_field(out, text.as_bytes());
        }
    }
    Ok(())
}

fn parse(text: &str) -> Result<Pointer, InvalidPointer> {
    if text.is_empty() {
        return Ok(Pointer {
            text: String::new(),
            tokens: Vec::new(),
        });
    }
    let rest = text
        .strip_prefix('/')
        .ok_or_else(|| InvalidPointer(text.to_owned()))?;
    let tokens = rest
        .split('/')
        .map(|token| {
            let mut out = String::with_capacity(token.len());
            let mut chars = token.chars();
            while let Some(c) = chars.next() {
                match (c, c == '~') {
                    (_, true) => match chars.next() {
                        Some('0') => out.push('~'),
                        Some('1') => out.push('/'),
                        _ => return Err(InvalidPointer(text.to_owned())),
                    },
                    (c, false) => out.push(c),
                }
            }
            Ok(out)
        })
        .collect::<Result<_, _>>()?;
    Ok(Pointer {
        text: text.to_owned(),
        tokens,
    })
}

enum Found<'a> {
    Value(&'a str),
    Missing,
    Ambiguous,
}

/// The text of the value at `tokens` in the valid JSON `text`.
fn find<'a>(text: &'a str, tokens: &[String]) -> Found<'a> {
    let value = text.trim();
    let Some((token, rest)) = tokens.split_first() else {
        return Found::Value(value);
    };
    let children = children(value);
    let mut matches = children.iter().filter(|c| c.is(token));
    match (matches.next(), matches.next()) {
        (Some(child), None) => find(child.value, rest),
        (Some(_), Some(_)) => Found::Ambiguous,
        (None, _) => Found::Missing,
    }
}

/// `text` without the values at `pointers` (object members and array elements).
fn without(text: &str, pointers: &[&[String]]) -> String {
    let value = text.trim();
    if pointers.is_empty() {
        return value.to_owned();
    }
    let is_object = value.starts_with('{');
    if !is_object && !value.starts_with('[') {
        return value.to_owned();
    }
    let mut out = String::with_capacity(value.len());
    out.push(if is_object { '{' } else { '[' });
    let mut first = true;
    for child in children(value) {
        let deeper: Vec<&[String]> = pointers
            .iter()
            .filter_map(|p| match p.split_first() {
                Some((token, rest)) if child.is(token) => Some(rest),
                _ => None,
            })
            .collect();
        if deeper.iter().any(|rest| rest.is_empty()) {
            continue;
        }
        if !first {
            out.push(',');
        }
        first = false;
        if let Some(name) = child.raw_name {
            out.push_str(name);
            out.push(':');
        }
        out.push_str(&without(child.value, &deeper));
    }
    out.push(if is_object { '}' } else { ']' });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(fields: &JsonFields, body: &str) -> Vec<u8> {
        let mut out = Vec::new();
        fields.canonicalize(body, &mut out).expect("valid");
        out
    }

    #[test]
    fn pointers_follow_rfc_6901() {
        assert!(JsonFields::include(["/a/b", "", "/~0x/~1y", "/0"]).is_ok());
        assert!(JsonFields::include(["a"]).is_err());
        assert!(
            JsonFields::exclude([""]).is_err(),
            "the whole document cannot be left out"
        );
        assert!(JsonFields::include(["/~2"]).is_err());
        let f = JsonFields::include(["/a~1b"]).expect("valid");
        assert_eq!(canon(&f, r#"{"a/b":1}"#), canon(&f, r#"{"a/b":1.0,"x":2}"#));
        assert_ne!(canon(&f, r#"{"a/b":1}"#), canon(&f, r#"{"a/b":2}"#));
    }

    #[test]
    fn included_fields_count_and_nothing_else() {
        let f = JsonFields::include(["/amount", "/customer/id"]).expect("valid");
        let a = canon(
            &f,
            r#"{"amount":10,"customer":{"id":"c1","name":"A"},"ts":1}"#,
        );
        assert_eq!(
            a,
            canon(
                &f,
                r#"{ "ts":2, "customer":{"name":"B","id":"c1"}, "amount":10.0 }"#
            )
        );
        assert_ne!(a, canon(&f, r#"{"amount":11,"customer":{"id":"c1"}}"#));
        assert_ne!(a, canon(&f, r#"{"amount":10,"customer":{"id":"c2"}}"#));
        assert_ne!(
            a,
            canon(&f, r#"{"customer":{"id":"c1"}}"#),
            "missing is not equal"
        );
        assert_ne!(
            canon(&f, r#"{"amount":9007199254740993,"customer":{"id":"c1"}}"#),
            canon(&f, r#"{"amount":9007199254740992,"customer":{"id":"c1"}}"#),
            "exact numbers"
        );
        assert_ne!(
            canon(&f, r#"{"amount":1,"amount":2,"customer":{"id":"c1"}}"#),
            canon(&f, r#"{"amount":2,"customer":{"id":"c1"}}"#),
            "a duplicate name is never resolved by guessing"
        );
    }

    #[test]
    fn excluded_fields_do_not_count_the_rest_does() {
        let f = JsonFields::exclude(["/ts", "/trace/id", "/items/1"]).expect("valid");
        let a = canon(
            &f,
            r#"{"amount":10,"ts":1,"trace":{"id":"x","keep":1},"items":[1,2,3]}"#,
        );
        assert_eq!(
            a,
            canon(
                &f,
                r#"{"items":[1,9,3],"trace":{"keep":1,"id":"y"},"amount":10,"ts":2}"#
            )
        );
        assert_eq!(
            a,
            canon(&f, r#"{"amount":10,"trace":{"keep":1},"items":[1,0,3]}"#)
        );
        assert_ne!(
            a,
            canon(
                &f,
                r#"{"amount":11,"ts":1,"trace":{"id":"x","keep":1},"items":[1,2,3]}"#
            )
        );
        assert_ne!(
            a,
            canon(
                &f,
                r#"{"amount":10,"trace":{"id":"x","keep":2},"items":[1,2,3]}"#
            )
        );
        assert_ne!(
            canon(&f, r#"{"amount":1e-400}"#),
            canon(&f, r#"{"amount":0}"#),
            "exact numbers"
        );
    }
}
