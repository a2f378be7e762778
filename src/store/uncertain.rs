//! Listing the records that await reconciliation, a page at a time.

use std::time::SystemTime;
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "console"))]
use std::time::{Duration, UNIX_EPOCH};

use super::{Record, ScopedKey};

/// Where a listing of uncertain records ([`IdempotencyStore::list_uncertain`]) starts: just
/// past `after`, in the listing's order (oldest change first, then by key in the store's
/// order of keys; or the reverse with `newest_first`), at most `limit`.
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
    /// A cursor just past the record of `key` last changed at `updated_at`, as the store gave
    /// it: a record's [`Record::updated_at`], listed, looked up or answered by a claim. Every
    /// store reads a record's last change where its listing places it (PostgreSQL to the
    /// microsecond), so the cursor lists neither that record again nor skips a neighbour.
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
    /// Where the next page starts; `None` when this page reached the end of the listing. A
    /// page may hold fewer records than asked, even none, and still go on: records settled
    /// while it was read are left out of it.
    pub next: Option<UncertainCursor>,
}

impl UncertainPage {
    /// A page of `records` and `unreadable` ones, read in one step (one statement, one
    /// script), out of a listing asked for `limit`: the next page starts after `last` when
    /// this one is full.
    pub fn new(
        records: Vec<Record>,
        unreadable: Vec<Unreadable>,
        last: Option<UncertainCursor>,
        limit: usize,
    ) -> Self {
        let found = records.len() + unreadable.len();
        Self::scanned(found, records, unreadable, last, limit)
    }

    /// A page read in two steps, as a store that scans an index and then reads each entry it
    /// found does: the scan found `found` entries, the last at `last`, for a listing asked
    /// for `limit`; `records` and `unreadable` are what the reads gave. A record settled
    /// between the two is left out, and so is one changed since (it is listed at its new
    /// place; kept here, its new time would break the page's order). The listing still goes
    /// on after `last` when the scan filled the page: counted by what is left, a page whose
    /// records were all settled meanwhile would end the listing early, and every later
    /// record would go unlisted.
    pub fn scanned(
        found: usize,
        records: Vec<Record>,
        unreadable: Vec<Unreadable>,
        last: Option<UncertainCursor>,
        limit: usize,
    ) -> Self {
        Self {
            records,
            unreadable,
            next: last.filter(|_| found >= limit),
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

/// `at` as a whole number of `tick`s from the Unix epoch (negative before it, rounded down),
/// for a listing cursor: the inverse of [`from_ticks`], saturating past `i64`.
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "console"))]
pub(crate) fn ticks(at: SystemTime, tick: Duration) -> i64 {
    let tick = tick.as_nanos().max(1);
    let n = match at.duration_since(UNIX_EPOCH) {
        Ok(after) => i128::try_from(after.as_nanos() / tick).unwrap_or(i128::MAX),
        Err(before) => {
            -i128::try_from(before.duration().as_nanos().div_ceil(tick)).unwrap_or(i128::MAX)
        }
    };
    i64::try_from(n).unwrap_or(if n < 0 { i64::MIN } else { i64::MAX })
}

/// The time `ticks` whole `tick`s from the Unix epoch (before it when negative), exactly: a
/// listing's next cursor must name the place of the record it ends on, however far from
/// today a time written by hand puts it, or the next page repeats or skips records.
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "console"))]
pub(crate) fn from_ticks(ticks: i64, tick: Duration) -> SystemTime {
    const NANOS: u128 = 1_000_000_000;
    let nanos = u128::from(ticks.unsigned_abs()) * tick.as_nanos();
    let span = Duration::new(
        u64::try_from(nanos / NANOS).unwrap_or(u64::MAX),
        u32::try_from(nanos % NANOS).unwrap_or(0),
    );
    let at = match ticks < 0 {
        true => UNIX_EPOCH.checked_sub(span),
        false => UNIX_EPOCH.checked_add(span),
    };
    // Every `i64` of milliseconds or microseconds fits the platform's time; nothing coarser
    // is asked for.
    at.unwrap_or(UNIX_EPOCH)
}

#[cfg(all(
    test,
    any(feature = "postgres", feature = "sqlite", feature = "console")
))]
mod tests {
    use super::*;

    /// §18.2: a page scanned full goes on even when every record it found was settled before
    /// it was read; a page read in one step goes on only when it holds `limit` entries.
    #[test]
    fn a_page_scanned_full_goes_on_whatever_is_left_of_it() {
        let last = UncertainCursor::new(SystemTime::UNIX_EPOCH, ScopedKey::new("tenant", "k"));
        let emptied = UncertainPage::scanned(2, Vec::new(), Vec::new(), Some(last.clone()), 2);
        assert_eq!(emptied.next, Some(last.clone()), "scanned full: goes on");
        let short = UncertainPage::scanned(1, Vec::new(), Vec::new(), Some(last.clone()), 2);
        assert_eq!(short.next, None, "the scan found less than asked: the end");
        let unreadable = vec![
            Unreadable {
                key: ScopedKey::new("tenant", "j"),
                error: "corrupt".to_owned(),
            };
            2
        ];
        let held = UncertainPage::new(Vec::new(), unreadable, Some(last.clone()), 2);
        assert_eq!(
            held.next,
            Some(last.clone()),
            "unreadable entries fill a page"
        );
        let one_step = UncertainPage::new(Vec::new(), Vec::new(), Some(last), 2);
        assert_eq!(
            one_step.next, None,
            "read in one step, an empty page is the end"
        );
    }

    /// A cursor's time comes back as the place it was read from, for every place a store can
    /// give (times written by hand included: far future, before the epoch, the sentinels):
    /// a lossy round trip made the next page repeat or skip records.
    #[test]
    fn ticks_round_trip_exactly() {
        for tick in [Duration::from_micros(1), Duration::from_millis(1)] {
            for n in [
                0,
                1,
                -1,
                1_700_000_000_000,
                -2_000_000_000_000,
                18_446_744_073_709_552,
                9_000_000_000_000_000_000,
                9_200_000_000_000_000_000,
                -210_000_000_000_000_000,
                i64::MAX,
                i64::MIN,
            ] {
                assert_eq!(ticks(from_ticks(n, tick), tick), n, "{n} of {tick:?}");
            }
        }
        let far = UNIX_EPOCH + Duration::from_micros(u64::MAX);
        assert_eq!(ticks(far, Duration::from_micros(1)), i64::MAX, "saturates");
        let before = UNIX_EPOCH - Duration::from_nanos(1_500);
        assert_eq!(ticks(before, Duration::from_micros(1)), -2, "rounded down");
    }
}
