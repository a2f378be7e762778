//! Buffers a thread reuses from one request to the next, so that a hot path allocates once per
//! thread rather than once per call (the joined key, the canonical body, the parsed JSON).
//!
//! A buffer is taken out of its thread-local while in use and given back after, never borrowed
//! across the call: a call made where the thread's buffers are gone (from a thread-local's
//! destructor, after this one's ran) or already in use (a nested call) works on a fresh buffer
//! instead of panicking, as `LocalKey::with_borrow_mut` would.

use std::cell::RefCell;
use std::thread::LocalKey;

/// Runs `f` on this thread's buffer in `key`, or on a fresh one where that cannot be had, and
/// keeps the buffer for the next call when `keep` says it is not too large to hold on to.
/// `f` finds the buffer as the last call left it: it clears what it needs cleared.
pub(crate) fn with<T: Default, R>(
    key: &'static LocalKey<RefCell<T>>,
    keep: impl FnOnce(&T) -> bool,
    f: impl FnOnce(&mut T) -> R,
) -> R {
    let mut buffer = key
        .try_with(|cell| {
            cell.try_borrow_mut()
                .ok()
                .map(|mut held| std::mem::take(&mut *held))
        })
        .ok()
        .flatten()
        .unwrap_or_default();
    let result = f(&mut buffer);
    if keep(&buffer) {
        // Gone or in use: this buffer is dropped, and the next call starts a fresh one.
        let _ = key.try_with(|cell| {
            if let Ok(mut held) = cell.try_borrow_mut() {
                *held = buffer;
            }
        });
    }
    result
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use http::Request;

    use crate::fingerprint::{Fingerprint, canonical_json};
    use crate::store::ScopedKey;

    /// What a thread-local's destructor computed with the crate's reused buffers, after those
    /// buffers' own destructors ran; `Err` if it panicked.
    type Seen = (
        bool,
        Result<(String, String, Fingerprint, Option<Vec<u8>>), String>,
    );

    fn json_post() -> http::request::Parts {
        Request::post("/orders")
            .header("content-type", "application/json")
            .body(())
            .expect("request")
            .into_parts()
            .0
    }

    struct LateUser(Option<mpsc::Sender<Seen>>);

    impl Drop for LateUser {
        fn drop(&mut self) {
            // Checked before anything here could make them again: the case under test is
            // reached only if the crate's buffers are already gone.
            let gone = crate::key::buffer_gone() && crate::fingerprint::buffers_gone();
            let made = std::panic::catch_unwind(|| {
                let key = ScopedKey::new("tenant-b", "late-key");
                let parts = json_post();
                let fingerprint =
                    Fingerprint::of(&parts, br#"{"b":1,"a":[true,null]}"#).expect("fingerprint");
                let canonical = canonical_json(br#"{ "z": 1, "a": 2 }"#).expect("canonical");
                (
                    key.scope().to_owned(),
                    key.key().to_owned(),
                    fingerprint,
                    canonical,
                )
            })
            .map_err(|panic| {
                panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_default()
            });
            if let Some(tx) = self.0.take() {
                let _ = tx.send((gone, made));
            }
        }
    }

    thread_local! {
        static LATE: std::cell::RefCell<LateUser> = const { std::cell::RefCell::new(LateUser(None)) };
    }

    /// A key made and a body fingerprinted from a thread-local's destructor, after the crate's
    /// own thread-locals were destroyed (destructors run in the reverse order of first use:
    /// `LATE` is used first, so it is destroyed last), answer as they do anywhere else: no
    /// panic, which in a destructor aborts the process.
    #[test]
    fn keys_and_fingerprints_work_after_the_threads_buffers_are_gone() {
        let parts = json_post();
        let expected_fingerprint =
            Fingerprint::of(&parts, br#"{"a":[true,null],"b":1}"#).expect("fingerprint");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            LATE.with_borrow_mut(|late| late.0 = Some(tx));
            // The crate's buffers are first used after `LATE`: destroyed before it.
            let _ = ScopedKey::new("tenant-a", "early-key");
            let _ = Fingerprint::of(&parts, br#"{"b":1,"a":[true,null]}"#);
            let _ = canonical_json(br#"{ "z": 1, "a": 2 }"#);
        })
        .join()
        .expect("the thread ends");
        let (gone, made) = rx.recv().expect("the destructor ran and reported");
        assert!(
            gone,
            "the crate's buffers were destroyed before the late destructor ran"
        );
        let (scope, key, fingerprint, canonical) = made.expect("no panic in the destructor");
        assert_eq!((scope.as_str(), key.as_str()), ("tenant-b", "late-key"));
        assert_eq!(fingerprint, expected_fingerprint);
        assert_eq!(canonical.as_deref(), Some(&br#"{"a":2,"z":1}"#[..]));
    }

    thread_local! {
        static NESTED: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// A call made while the thread's buffer is in use gets a fresh one, and both see only their
    /// own bytes.
    #[test]
    fn a_nested_call_gets_its_own_buffer() {
        let (outer, inner) = super::with(
            &NESTED,
            |_| true,
            |outer| {
                outer.clear();
                outer.extend_from_slice(b"outer");
                let inner = super::with(
                    &NESTED,
                    |_| true,
                    |inner| {
                        inner.clear();
                        inner.extend_from_slice(b"inner");
                        inner.clone()
                    },
                );
                (outer.clone(), inner)
            },
        );
        assert_eq!(outer, b"outer");
        assert_eq!(inner, b"inner");
        // The buffer is kept for the next call, and not when it grew too large.
        super::with(&NESTED, |_| true, |buffer| buffer.reserve(4096));
        assert!(NESTED.with_borrow(|kept| kept.capacity() >= 4096));
        super::with(
            &NESTED,
            |buffer| buffer.capacity() < 1024,
            |buffer| buffer.reserve(8192),
        );
        assert_eq!(NESTED.with_borrow(Vec::capacity), 0);
    }
}
