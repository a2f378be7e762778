//! Listing the records that await reconciliation, a page at a time.

use std::time::SystemTime;

use super::{Record, ScopedKey};

/// Where a listing of uncertain records ([`IdempotencyStore::list_uncertain`]) starts: just
/// past `after`, in the listing's order (oldest change first, then by key), at most `limit`.
///
/// [`IdempotencyStore::list_uncertain`]: super::IdempotencyStore::list_uncertain
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UncertainQuery {
    /// The last record of the previous page; `None` for the first page.
    pub after: Option<UncertainCursor>,
    /// The most records (readable or not) in the page.
    pub limit: usize,
}

impl UncertainQuery {
    /// The first page of at most `limit` records.
    pub fn first(limit: usize) -> Self {
        Self { after: None, limit }
    }

    /// The page after `cursor` (a previous page's [`next`](UncertainPage::next)).
    pub fn after(cursor: UncertainCursor, limit: usize) -> Self {
        Self {
            after: Some(cursor),
            limit,
        }
    }
}

/// A place in the listing of uncertain records: the last change of a record, and its key.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct UncertainCursor {
    /// When the record last changed, on the store's clock.
    pub updated_at: SystemTime,
    /// The record's key.
    pub key: ScopedKey,
}

/// One page of records awaiting reconciliation.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct UncertainPage {
    /// The records, oldest change first.
    pub records: Vec<Record>,
    /// Records of the page that could not be read (a corrupt row): skipped here, kept in the
    /// store for an operator, each with what is wrong with it.
    pub unreadable: Vec<Unreadable>,
    /// Where the next page starts; `None` when this page reached the end of the listing.
    pub next: Option<UncertainCursor>,
}

impl UncertainPage {
    /// A page of `records` and `unreadable` ones, out of a listing asked for `limit`: the
    /// next page starts after `last` when this one is full.
    pub fn new(
        records: Vec<Record>,
        unreadable: Vec<Unreadable>,
        last: Option<UncertainCursor>,
        limit: usize,
    ) -> Self {
        let full = records.len() + unreadable.len() >= limit;
        Self {
            records,
            unreadable,
            next: last.filter(|_| full),
        }
    }
}

/// A record that cannot be read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unreadable {
    /// Its key (bytes that are not UTF-8 shown as U+FFFD).
    pub key: ScopedKey,
    /// What is wrong with it.
    pub error: String,
}

/// How many records await reconciliation, and since when the oldest has: what an operator
/// alerts on (`idempotency_awaiting_reconciliation`, `idempotency_oldest_uncertain_seconds`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UncertainCount {
    /// Records awaiting reconciliation.
    pub count: u64,
    /// The oldest last change among them.
    pub oldest: Option<SystemTime>,
}
