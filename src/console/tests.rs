use std::time::{Duration, SystemTime};

use crate::store::{ScopedKey, UncertainCursor};

use super::settle::{bytes_ref, key_ref, parse_bytes_ref, parse_ref};
use super::{cursor_text, parse_cursor};

/// Keys and cursors survive their text form whatever their bytes: `~`, `+`, `%`, NUL, CR,
/// quotes, non-UTF-8 (a damaged row's key, in a cursor).
#[test]
fn key_references_and_cursors_round_trip_any_bytes() {
    let hostile: [&[u8]; 7] = [
        b"",
        b"a~b",
        b"+ %2B%",
        b"\0tools/call\r\n",
        b"\"'<&>",
        "caf\u{e9}".as_bytes(),
        b"k\xff\x80",
    ];
    for scope in hostile {
        for key in hostile {
            let text = bytes_ref(scope, key);
            assert!(text.is_ascii() && text.matches('~').count() == 1, "{text}");
            assert_eq!(parse_bytes_ref(&text), Some((scope.to_vec(), key.to_vec())));
            let at = SystemTime::UNIX_EPOCH + Duration::from_micros(1_700_000_000_123_456);
            let cursor = UncertainCursor::stored(at, scope.to_vec(), key.to_vec());
            let parsed = parse_cursor(&cursor_text(&cursor)).expect("a cursor");
            assert_eq!(parsed, cursor);
            if let (Ok(s), Ok(k)) = (std::str::from_utf8(scope), std::str::from_utf8(key))
                && !k.is_empty()
            {
                assert_eq!(
                    parse_ref(&key_ref(&ScopedKey::new(s, k))),
                    Some(ScopedKey::new(s, k))
                );
            }
        }
    }
}
