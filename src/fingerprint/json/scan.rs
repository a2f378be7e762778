//! The scan for the bytes that end a plain run inside a JSON string.

/// The index of the first byte that ends a plain run inside a JSON string: `"`, `\\` or a
/// control character. A block of 64 bytes at a time, then sixteen (SWAR on two words, one
/// branch), since strings are most of most bodies.
pub(super) fn special(bytes: &[u8]) -> Option<usize> {
    find::<false>(bytes)
}

/// [`special`], or the first byte past ASCII: a string scan that checks UTF-8 only where
/// there is something to check.
pub(super) fn special_or_non_ascii(bytes: &[u8]) -> Option<usize> {
    find::<true>(bytes)
}

/// The scan behind [`special`] and (`NON_ASCII`) [`special_or_non_ascii`]: long runs a block of
/// 64 bytes at a time, then the words where the first hit (or the end) is.
fn find<const NON_ASCII: bool>(bytes: &[u8]) -> Option<usize> {
    let ends_run = |b: u8| (b == b'"') | (b == b'\\') | (b < 0x20) | (NON_ASCII & (b >= 0x80));
    let mut blocks = bytes.chunks_exact(BLOCK);
    let mut at = 0;
    for block in &mut blocks {
        // No early exit inside a block, so LLVM compiles the test to vector compares and one
        // branch (SSE2, the x86-64 baseline): half the instructions of the words' scan.
        if block.iter().fold(false, |hit, &b| hit | ends_run(b)) {
            break;
        }
        at += BLOCK;
    }
    find_in_words::<NON_ASCII>(&bytes[at..]).map(|i| at + i)
}

/// The bytes [`find`] tests at once.
pub(super) const BLOCK: usize = 64;

/// [`find`] on a short run, or inside the block that holds the first hit.
fn find_in_words<const NON_ASCII: bool>(bytes: &[u8]) -> Option<usize> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    // The high bit of each byte of `v` that is zero / below `n` (n <= 128). A borrow can also
    // flag bytes above a true hit, never below one, so the lowest flag is exact.
    let zero = |v: u64| v.wrapping_sub(ONES) & !v & HIGH;
    let below = |v: u64, n: u64| v.wrapping_sub(ONES * n) & !v & HIGH;
    let hits = |chunk: &[u8]| {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let x = u64::from_le_bytes(word);
        let high = if NON_ASCII { x & HIGH } else { 0 };
        zero(x ^ (ONES * u64::from(b'"')))
            | zero(x ^ (ONES * u64::from(b'\\')))
            | below(x, 0x20)
            | high
    };
    let first = |hits: u64| (hits.trailing_zeros() / 8) as usize;
    let mut pairs = bytes.chunks_exact(16);
    let mut at = 0;
    for pair in &mut pairs {
        let (low, high) = (hits(&pair[..8]), hits(&pair[8..]));
        if low | high != 0 {
            return Some(
                at + if low != 0 {
                    first(low)
                } else {
                    8 + first(high)
                },
            );
        }
        at += 16;
    }
    let mut rest = pairs.remainder();
    if rest.len() >= 8 {
        let h = hits(&rest[..8]);
        if h != 0 {
            return Some(at + first(h));
        }
        rest = &rest[8..];
        at += 8;
    }
    rest.iter()
        .position(|&b| b == b'"' || b == b'\\' || b < 0x20 || (NON_ASCII && b >= 0x80))
        .map(|i| at + i)
}
