//! Standard base64 (RFC 4648 §4), as gRPC speaks it: unpadded in binary metadata, padded in
//! gRPC-Web's text mode, where a body is a run of separately padded chunks.

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// `bytes` in standard base64, with `=` padding or without.
pub(crate) fn encode(bytes: &[u8], pad: bool) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | (u32::from(b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
        if pad {
            for _ in chunk.len()..3 {
                out.push('=');
            }
        }
    }
    out
}

fn value(c: u8) -> Option<u32> {
    Some(u32::from(match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => return None,
    }))
}

/// Decodes padded base64 as it arrives, in groups of four characters. Padding may end any
/// group, not only the last: gRPC-Web servers encode each chunk on its own.
#[derive(Debug, Default)]
pub(crate) struct Decoder {
    group: [u8; 4],
    have: usize,
}

/// Bytes that are not padded standard base64.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Invalid;

impl Decoder {
    /// Appends what `text` decodes to onto `out`.
    pub(crate) fn feed(&mut self, text: &[u8], out: &mut Vec<u8>) -> Result<(), Invalid> {
        for &c in text {
            self.group[self.have] = c;
            self.have += 1;
            if self.have == 4 {
                self.have = 0;
                decode_group(self.group, out)?;
            }
        }
        Ok(())
    }

    /// Whether the text so far ended on a whole group.
    pub(crate) fn finished(&self) -> bool {
        self.have == 0
    }
}

/// One group of four characters: two or three ending in `=` stand for one or two bytes.
fn decode_group(group: [u8; 4], out: &mut Vec<u8>) -> Result<(), Invalid> {
    let pads = group.iter().rev().take_while(|&&c| c == b'=').count();
    if pads > 2 {
        return Err(Invalid);
    }
    let mut n = 0u32;
    for &c in &group[..4 - pads] {
        n = (n << 6) | value(c).ok_or(Invalid)?;
    }
    n <<= 6 * pads as u32;
    let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
    // Bits a padded group leaves over must be zero: one text per byte string.
    let kept = 3 - pads;
    if bytes[kept..].iter().any(|&b| b != 0) {
        return Err(Invalid);
    }
    out.extend_from_slice(&bytes[..kept]);
    Ok(())
}

/// Binary metadata as gRPC sends it, unpadded (or padded, as some servers do).
#[cfg(any(feature = "client", test))]
pub(crate) fn decode_unpadded(text: &[u8]) -> Result<Vec<u8>, Invalid> {
    let mut padded = text.to_vec();
    while !padded.len().is_multiple_of(4) {
        padded.push(b'=');
    }
    decode(&padded)
}

/// All of `text`, decoded: whole padded groups only.
pub(crate) fn decode(text: &[u8]) -> Result<Vec<u8>, Invalid> {
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    let mut decoder = Decoder::default();
    decoder.feed(text, &mut out)?;
    match decoder.finished() {
        true => Ok(out),
        false => Err(Invalid),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn encodes_like_rfc_4648() {
        for (plain, padded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(encode(plain.as_bytes(), true), padded);
            assert_eq!(
                encode(plain.as_bytes(), false),
                padded.trim_end_matches('=')
            );
            assert_eq!(decode(padded.as_bytes()), Ok(plain.as_bytes().to_vec()));
        }
        assert_eq!(encode(&[0xff, 0xfe, 0x00], false), "//4A");
    }

    #[test]
    fn padding_may_end_any_group_and_nothing_else_passes() {
        assert_eq!(decode(b"Zg==Zm8=Zm9v"), Ok(b"ffofoo".to_vec()));
        for bad in [
            &b"Zg="[..],
            b"Z===",
            b"Zh==",
            b"Zm9=",
            b"Zm 9v",
            b"Zm9v\n",
            b"Zm-v",
            b"=Zm9",
        ] {
            assert_eq!(
                decode(bad),
                Err(Invalid),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    proptest! {
        /// Differential: chunks encoded one by one, fed split anywhere, give back the bytes.
        #[test]
        fn chunked_text_decodes_to_its_bytes(
            chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..20), 0..6),
            cut in 0usize..200,
        ) {
            let text: String = chunks.iter().map(|c| encode(c, true)).collect();
            let plain: Vec<u8> = chunks.concat();
            let cut = cut.min(text.len());
            let mut decoder = Decoder::default();
            let mut out = Vec::new();
            decoder.feed(&text.as_bytes()[..cut], &mut out).expect("base64");
            decoder.feed(&text.as_bytes()[cut..], &mut out).expect("base64");
            prop_assert!(decoder.finished());
            prop_assert_eq!(out, plain);
        }
    }
}
