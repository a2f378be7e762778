//! Listing the records that await reconciliation, a page at a time.

use std::time::SystemTime;

use super::{Record, ScopedKey};

/// Where a listing of uncertain records ([`IdempotencyStore::list_uncertain`]) starts: just
/// past `after`, in the listing's order (oldest change first, then by key; or the reverse with
/// `newest_first`), at most `limit`.
///
/// [`IdempotencyStore::list_uncertain`]: super::IdempotencyStore::list_uncertain
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UncertainQuery {
    /// The last record of the previous page; `None` for the first page.
    pub after: Option<UncertainCursor>,
    /// The most records (readable or not) in the page.
    pub limit: usize,
    /// Newest change first (then by key, descending), for review; the sweeper goes oldest
    /// first.
    pub newest_first: bool,
}

impl UncertainQuery {
    /// The first page of at most `limit` records.
    pub fn first(limit: usize) -> Self {
        Self {
            after: None,
            limit,
            newest_first: false,
        }
    }

    /// The page after `cursor` (a previous page's [`next`](UncertainPage::next)).
    pub fn after(cursor: UncertainCursor, limit: usize) -> Self {
        Self {
            after: Some(cursor),
            limit,
            newest_first: false,
        }
    }

    /// The same page, in the reverse order: newest change first.
    pub fn newest_first(mut self) -> Self {
        self.newest_first = true;
        self
    }
}

/// A place in the listing of uncertain records: the last change of a record, and its key.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct UncertainCursor {
    /// When the record last changed, on the store's clock.
    pub updated_at: SystemTime,
    /// The record's key.
    pub key: ScopedKey,
    /// The key's bytes as stored, where they are not UTF-8 (a damaged row): `key` shows them
    /// with U+FFFD, so only these place the cursor exactly.
    pub(crate) raw: Option<std::sync::Arc<(Vec<u8>, Vec<u8>)>>,
}

impl UncertainCursor {
    /// A cursor just past the record of `key` last changed at `updated_at`.
    pub fn new(updated_at: SystemTime, key: ScopedKey) -> Self {
        Self {
            updated_at,
            key,
            raw: None,
        }
    }

    /// A cursor at a stored row whose scope and key are these bytes.
    #[cfg(any(
        feature = "postgres",
        feature = "sqlite",
        feature = "redis",
        feature = "console"
    ))]
    pub(crate) fn stored(updated_at: SystemTime, scope: Vec<u8>, key: Vec<u8>) -> Self {
        let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
        let utf8 = std::str::from_utf8(&scope).is_ok() && std::str::from_utf8(&key).is_ok();
        Self {
            updated_at,
            key: ScopedKey::new(text(&scope), text(&key)),
            raw: (!utf8).then(|| std::sync::Arc::new((scope, key))),
        }
    }

    /// The scope's and key's bytes as stored.
    #[cfg(any(
        feature = "postgres",
        feature = "sqlite",
        feature = "redis",
        feature = "console"
    ))]
    pub(crate) fn bytes(&self) -> (&[u8], &[u8]) {
        match &self.raw {
            Some(raw) => (&raw.0, &raw.1),
            None => (self.key.scope().as_bytes(), self.key.key().as_bytes()),
        }
    }
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
