//! A key's hash as the memory store's shards keep it, and how their tables spread 32 bits.

/// A key's hash as its shard keeps it: 32 bits of the store's keyed hash, carried by its
/// record (in the four bytes its key's length took before it moved into the record's data),
/// so that growing the table re-places slots without hashing a key again. The table places
/// and tags slots by these bits spread over 64; the shard itself is chosen by other bits of the
/// keyed hash (see `MemoryStore::shard`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct KeyHash(u32);

impl KeyHash {
    /// The bits of the store's keyed hash `keyed` that a record keeps.
    pub(super) fn of(keyed: u64) -> Self {
        Self(keyed as u32)
    }

    /// The hash the table places and tags the key's slot by.
    pub(super) fn slot(self) -> u64 {
        spread(self.0)
    }
}

/// Spreads 32 bits over 64 for a table: a slab index for the polled set's, a key's hash for
/// the keys'. A multiplication by an odd constant: no two inputs collide, and the top bits
/// (the table's tags) depend on every bit of the input.
pub(super) fn spread(i: u32) -> u64 {
    u64::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}
