//! Where a record lives: its member (scope and key, length-prefixed), its bucket, and the
//! keys of its hash and of its bucket's reconciliation index, which share one hash slot (see
//! the [parent module](super)).

use super::RedisStore;
use crate::store::ScopedKey;

/// How many buckets the records of one prefix are spread over (see the [parent
/// module](super)).
pub(super) const BUCKETS: u64 = 64;

impl RedisStore {
    /// Where the record of `key` lives: its hash, its bucket's uncertain and pending sets (one
    /// hash slot), and its member in those sets.
    pub fn keys(&self, key: &ScopedKey) -> [Vec<u8>; 4] {
        let at = self.locate(key);
        [
            at.record,
            at.uncertain.into_bytes(),
            at.pending.into_bytes(),
            at.member,
        ]
    }

    /// The record's member (its scope and key, length-prefixed) and bucket tag.
    pub(super) fn locate(&self, key: &ScopedKey) -> Located {
        let member = member(key.scope().as_bytes(), key.key().as_bytes());
        let mut at = self.bucket(bucket_of(&member));
        at.record.extend_from_slice(&member);
        at.member = member;
        at
    }

    pub(super) fn record_prefix(&self, bucket: u64) -> String {
        format!("{}:{{{bucket}}}:r:", self.prefix)
    }

    /// The bucket's keys, for the listing scripts (and, with a member, a record's).
    pub(super) fn bucket(&self, bucket: u64) -> Located {
        Located {
            record: self.record_prefix(bucket).into_bytes(),
            uncertain: format!("{}:{{{bucket}}}:u", self.prefix),
            pending: format!("{}:{{{bucket}}}:p", self.prefix),
            member: Vec::new(),
        }
    }
}

/// Where a record lives.
pub(super) struct Located {
    pub(super) record: Vec<u8>,
    pub(super) uncertain: String,
    pub(super) pending: String,
    pub(super) member: Vec<u8>,
}

/// A scope and key as one binary-safe member: the scope's length, `:`, the scope, the key.
pub(super) fn member(scope: &[u8], key: &[u8]) -> Vec<u8> {
    let mut out = format!("{}:", scope.len()).into_bytes();
    out.extend_from_slice(scope);
    out.extend_from_slice(key);
    out
}

/// The scope and key of a member, if it is one.
pub(super) fn split_member(member: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    let colon = member.iter().position(|&b| b == b':')?;
    let len: usize = std::str::from_utf8(&member[..colon]).ok()?.parse().ok()?;
    let rest = &member[colon + 1..];
    (rest.len() >= len).then(|| (rest[..len].to_vec(), rest[len..].to_vec()))
}

/// The bucket of a member: FNV-1a, stable across processes and versions (it names keys).
fn bucket_of(member: &[u8]) -> u64 {
    let hash = member.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    hash % BUCKETS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_are_unambiguous_and_split_back() {
        let a = member(b"ab", b"c");
        let b = member(b"a", b"bc");
        assert_ne!(a, b);
        assert_eq!(split_member(&a), Some((b"ab".to_vec(), b"c".to_vec())));
        assert_eq!(
            split_member(&member(b"", b"k\0{x}")),
            Some((Vec::new(), b"k\0{x}".to_vec()))
        );
        assert_eq!(split_member(b"9:ab"), None);
        assert_eq!(split_member(b"x"), None);
    }

    #[test]
    fn buckets_are_stable_and_spread() {
        // The bucket names keys in a server: it must never change between versions.
        assert_eq!(bucket_of(b"0:order-1"), 47, "FNV-1a of the member, mod 64");
        let mut seen = std::collections::HashSet::new();
        for i in 0..2000 {
            seen.insert(bucket_of(&member(b"", format!("k-{i}").as_bytes())));
        }
        assert_eq!(seen.len(), BUCKETS as usize, "2000 keys reach every bucket");
    }
}
