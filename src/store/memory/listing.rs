//! Listing and counting uncertain records: each shard's index merged in order, a page at a
//! time.

use std::ops::Bound::{Excluded, Unbounded};

use super::entry::time;
use super::{MemoryStore, SHARDS, lock, ms, uncertain};
use crate::store::{ScopedKey, UncertainCursor, UncertainPage, UncertainQuery, Unreadable};

/// Where the listing stands in one shard's index.
struct ShardHead {
    shard: usize,
    after: Option<(u64, ScopedKey)>,
    done: bool,
}

impl MemoryStore {
    /// Up to `n` of shard `i`'s uncertain records past `after`, in the index's order (or its
    /// reverse, `desc`).
    pub(super) fn uncertain_in(
        &self,
        i: usize,
        after: Option<&(u64, ScopedKey)>,
        n: usize,
        now: u64,
        desc: bool,
    ) -> Vec<(u64, ScopedKey)> {
        let shard = lock(&self.inner.shards[i]);
        let range = match (after, desc) {
            (Some(after), false) => shard.watch.range((Excluded(after.clone()), Unbounded)),
            (Some(after), true) => shard.watch.range((Unbounded, Excluded(after.clone()))),
            (None, _) => shard.watch.range::<(u64, ScopedKey), _>(..),
        };
        let is_uncertain = |(_, key): &&(u64, ScopedKey)| {
            shard
                .entry(self.key_hash(key), key)
                .is_some_and(|r| uncertain(r, now))
        };
        if desc {
            range.rev().filter(is_uncertain).take(n).cloned().collect()
        } else {
            range.filter(is_uncertain).take(n).cloned().collect()
        }
    }

    /// The index entries of the page `query` asks for: the first `query.limit` of all
    /// shards' uncertain records past its cursor, in the listing's order.
    pub(super) fn uncertain_found(
        &self,
        query: &UncertainQuery,
        now: u64,
    ) -> Vec<(u64, ScopedKey)> {
        let limit = query.limit;
        if limit == 0 {
            return Vec::new();
        }
        let from = query
            .after
            .as_ref()
            .map(|c| (ms(c.updated_at), c.key.clone()));
        // A merge of the shards' indexes, a few entries of each at a time: the page is the
        // first `limit` of all shards' uncertain records past the cursor, and a shard is asked
        // for more only while its last entry read could still be in the page. About
        // `limit + shards` index entries are read, whatever the store holds.
        let step = limit.div_ceil(SHARDS) + 1;
        let desc = query.newest_first;
        // In the listing's order: ascending, or descending for newest first.
        let before = |a: &(u64, ScopedKey), b: &(u64, ScopedKey)| if desc { a > b } else { a < b };
        let mut heads: Vec<ShardHead> = (0..SHARDS)
            .map(|shard| ShardHead {
                shard,
                after: from.clone(),
                done: false,
            })
            .collect();
        let mut found: Vec<(u64, ScopedKey)> = Vec::new();
        loop {
            let cutoff = found.get(limit.wrapping_sub(1)).cloned();
            let mut asked = false;
            for head in heads.iter_mut().filter(|h| !h.done) {
                let behind = match (&head.after, &cutoff) {
                    (Some(last), Some(cutoff)) => before(last, cutoff),
                    _ => true,
                };
                if !behind {
                    continue;
                }
                asked = true;
                let more = self.uncertain_in(head.shard, head.after.as_ref(), step, now, desc);
                head.done = more.len() < step;
                if let Some(last) = more.last() {
                    head.after = Some(last.clone());
                }
                found.extend(more);
            }
            found.sort_unstable();
            if desc {
                found.reverse();
            }
            found.truncate(limit);
            if !asked {
                break;
            }
        }
        found
    }

    /// The page of the index entries `found` for a listing asked for `limit`. A record
    /// settled since it was found is left out, but the listing still goes on past it: the
    /// next page follows from what was found, not from what is left, or a record settled
    /// meanwhile would end the listing early. A record changed since it was found is left
    /// out too: it is listed at its new place, and here its new time would break the page's
    /// order (a cursor made from it would step over the records between).
    pub(super) fn uncertain_page(
        &self,
        found: &[(u64, ScopedKey)],
        limit: usize,
        now: u64,
    ) -> UncertainPage {
        let mut records = Vec::with_capacity(found.len());
        let mut unreadable = Vec::new();
        for (at, key) in found {
            let (hash, shard) = self.shard(key);
            // Settled or moved since it was found: not part of this page any more.
            let Some(r) = shard
                .entry(hash, key)
                .filter(|r| uncertain(r, now) && r.updated_at() == *at)
            else {
                continue;
            };
            match r.to_record(key) {
                Ok(record) => records.push(record),
                Err(error) => unreadable.push(Unreadable {
                    key: key.clone(),
                    error: error.to_string(),
                }),
            }
        }
        let last = found
            .last()
            .map(|(at, key)| UncertainCursor::new(time(*at), key.clone()));
        UncertainPage::scanned(found.len(), records, unreadable, last, limit)
    }
}
