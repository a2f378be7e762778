//! One record as the memory store keeps it: compact, its key and response in one allocation,
//! its history written out only when it is more than a claim and one event.

use std::time::{Duration, SystemTime};

use bytes::Bytes;

use super::super::history::HISTORY_REFUSALS;
use super::super::{
    Claim, ClaimRequest, FencingToken, Fingerprint, HistoryEntry, HistoryEvent, LeaseExpiry,
    Record, RecordStatus, ScopedKey, StoreError, StoredResponse,
};
use super::hash::KeyHash;

/// The holder marked its effect started.
const EFFECT_STARTED: u8 = 1;
/// Claimed on a route that reconciles expired leases ([`LeaseExpiry::Reconcile`]): a dead
/// holder's record then awaits reconciliation instead of being taken over.
const RECONCILE_ON_EXPIRY: u8 = 2;
/// In its shard's polled set (see [`super::shard::Shard`]).
const POLLED: u8 = 4;
/// Named by a live entry of its shard's due index (at `queued_at`), at or before its expiry.
const QUEUED: u8 = 8;
/// The data's head is wide: the scope's length and the joined key's four bytes each, for a
/// key with a scope or a length past 16 bits; two bytes each otherwise (nearly every key).
const WIDE_HEAD: u8 = 16;
/// The fingerprint's hint: its request's body went into the hash as sent (see
/// [`Fingerprint`]). Kept here, since the fingerprint's own copy of it would cost the record
/// eight bytes of padding.
const BODY_AS_SENT: u8 = 32;

/// A record: times in milliseconds on the store's clock, no pointer it can do without. It
/// lives in its shard's slab, not in an allocation of its own, and weighs 112 bytes (checked by
/// a test): with the key and response in one allocation, the history implied while it is short,
/// and its flags in one byte.
pub(super) struct Entry {
    /// The scope's length and the joined key's (two bytes each, four for a wide head), scope
    /// and key, then the encoded response once there is one. Owned, not `Bytes`: no
    /// shared-count header, and a replay copies what it sends in one pass over bytes it then
    /// writes to the socket anyway.
    data: Box<[u8]>,
    /// The fingerprint's bytes; its hint is a flag ([`BODY_AS_SENT`]).
    fingerprint: [u8; 32],
    pub(super) lease_token: FencingToken,
    pub(super) lease_until: u64,
    pub(super) created_at: u64,
    updated_at: u64,
    pub(super) expires_at: u64,
    /// A downstream id, a resolution note, a history longer than a claim and one event: most
    /// records have none of them.
    extra: Option<Box<Extra>>,
    /// Its key's hash (see [`KeyHash`]): growing, shrinking and compacting the
    /// shard's table, and purging, never hash a key again, nor read it. Four bytes the record
    /// had to spare once the key's length went into its data's head, beside the scope's.
    hash: KeyHash,
    /// The tick of its one live entry in the due index, while [`QUEUED`].
    queued_at: u32,
    pub(super) attempts: u32,
    pub(super) status: RecordStatus,
    flags: u8,
    /// The one event after the first claim while the history is implied (see
    /// [`events`](Self::events)).
    tail: Option<HistoryEvent>,
}

#[derive(Default)]
struct Extra {
    downstream_id: Option<Box<str>>,
    /// The whole history, once it is written out; empty while it is implied.
    history: Vec<Event>,
    resolution_note: Option<Box<str>>,
}

/// One history entry, compactly.
#[derive(Clone, Copy)]
struct Event {
    at: u64,
    token: FencingToken,
    attempt: u32,
    event: HistoryEvent,
}

impl Entry {
    /// A record just claimed by `req`'s first attempt.
    pub(super) fn claimed(
        req: &ClaimRequest,
        hash: KeyHash,
        token: FencingToken,
        now: u64,
        lease_until: u64,
    ) -> Self {
        let (joined, split) = req.key.joined();
        let mut flags = match req.on_lease_expiry {
            LeaseExpiry::Reconcile => RECONCILE_ON_EXPIRY,
            _ => 0,
        };
        if req.fingerprint.body_as_sent() {
            flags |= BODY_AS_SENT;
        }
        let mut head = [0u8; 8];
        let head = match (u16::try_from(split), u16::try_from(joined.len())) {
            (Ok(split), Ok(len)) => {
                head[..2].copy_from_slice(&split.to_le_bytes());
                head[2..4].copy_from_slice(&len.to_le_bytes());
                &head[..4]
            }
            _ => {
                flags |= WIDE_HEAD;
                // A key longer than 4 GiB does not reach a store: the request carrying it
                // would not have been buffered.
                let split = u32::try_from(split).unwrap_or(u32::MAX);
                let len = u32::try_from(joined.len()).unwrap_or(u32::MAX);
                head[..4].copy_from_slice(&split.to_le_bytes());
                head[4..].copy_from_slice(&len.to_le_bytes());
                &head[..]
            }
        };
        // Exactly as long as it is written: a boxed slice made from spare capacity would be
        // reallocated.
        let mut data = Vec::with_capacity(head.len() + joined.len());
        data.extend_from_slice(head);
        data.extend_from_slice(joined.as_bytes());
        Entry {
            data: data.into_boxed_slice(),
            fingerprint: *req.fingerprint.as_bytes(),
            lease_token: token,
            lease_until,
            created_at: now,
            updated_at: now,
            expires_at: (now + span(req.ttl)).max(lease_until),
            extra: None,
            hash,
            queued_at: 0,
            attempts: 1,
            status: RecordStatus::InProgress,
            flags,
            tail: None,
        }
    }

    /// Whether this is `key`'s record.
    pub(super) fn is(&self, key: &ScopedKey) -> bool {
        let (joined, split) = key.joined();
        let (own_split, at) = self.head();
        own_split == split && self.data.get(at) == Some(joined.as_bytes())
    }

    /// The scope's length, and where scope and key lie in the data.
    fn head(&self) -> (usize, std::ops::Range<usize>) {
        if self.flags & WIDE_HEAD == 0 {
            let at = self.data.first_chunk::<4>().copied().unwrap_or_default();
            let (split, len) = ([at[0], at[1]], [at[2], at[3]]);
            let (split, len) = (u16::from_le_bytes(split), u16::from_le_bytes(len));
            return (usize::from(split), 4..4 + usize::from(len));
        }
        let length = |n: usize| {
            let at = self.data.get(n * 4..).and_then(|d| d.first_chunk::<4>());
            u32::from_le_bytes(at.copied().unwrap_or_default()) as usize
        };
        (length(0), 8..8 + length(1))
    }

    /// Where the key ends and the response begins in the data.
    fn key_end(&self) -> usize {
        self.head().1.end
    }

    /// The key's hash, as it was claimed.
    pub(super) fn key_hash(&self) -> KeyHash {
        self.hash
    }

    /// The encoded response, if one is recorded.
    pub(super) fn response(&self) -> Option<&[u8]> {
        self.data.get(self.key_end()..).filter(|r| !r.is_empty())
    }

    pub(super) fn set_response(&mut self, response: &StoredResponse) {
        let key = self.data.get(..self.key_end()).unwrap_or_default();
        self.data = response.to_bytes_after(key).into_boxed_slice();
    }

    pub(super) fn effect_started(&self) -> bool {
        self.flags & EFFECT_STARTED != 0
    }

    pub(super) fn start_effect(&mut self) {
        self.flags |= EFFECT_STARTED;
    }

    pub(super) fn clear_effect(&mut self) {
        self.flags &= !EFFECT_STARTED;
    }

    pub(super) fn reconcile_on_expiry(&self) -> bool {
        self.flags & RECONCILE_ON_EXPIRY != 0
    }

    pub(super) fn set_reconcile_on_expiry(&mut self, on: LeaseExpiry) {
        match on {
            LeaseExpiry::Reconcile => self.flags |= RECONCILE_ON_EXPIRY,
            _ => self.flags &= !RECONCILE_ON_EXPIRY,
        }
    }

    /// The fingerprint, with its hint.
    pub(super) fn fingerprint(&self) -> Fingerprint {
        Fingerprint::from_bytes(self.fingerprint).with_body_as_sent(self.flags & BODY_AS_SENT != 0)
    }

    /// Whether `fingerprint` is this record's (by its bytes; the hint does not count).
    pub(super) fn fingerprinted(&self, fingerprint: &Fingerprint) -> bool {
        self.fingerprint == *fingerprint.as_bytes()
    }

    /// The hint of the request now running under this record (a takeover: the same bytes,
    /// perhaps sent differently).
    pub(super) fn set_body_as_sent(&mut self, fingerprint: &Fingerprint) {
        match fingerprint.body_as_sent() {
            true => self.flags |= BODY_AS_SENT,
            false => self.flags &= !BODY_AS_SENT,
        }
    }

    pub(super) fn polled(&self) -> bool {
        self.flags & POLLED != 0
    }

    pub(super) fn set_polled(&mut self, polled: bool) {
        match polled {
            true => self.flags |= POLLED,
            false => self.flags &= !POLLED,
        }
    }

    /// The tick of its live due entry, if it has one.
    pub(super) fn queued(&self) -> Option<u32> {
        (self.flags & QUEUED != 0).then_some(self.queued_at)
    }

    /// Records its live due entry's tick (`None`: it has none).
    pub(super) fn set_queued(&mut self, at: Option<u32>) {
        match at {
            Some(at) => {
                self.flags |= QUEUED;
                self.queued_at = at;
            }
            None => self.flags &= !QUEUED,
        }
    }

    pub(super) fn updated_at(&self) -> u64 {
        self.updated_at
    }

    /// Marks the record changed at `now`. An implied event is dated by the last change, so it
    /// is written out first.
    pub(super) fn touch(&mut self, now: u64) {
        if self.tail.is_some() && now != self.updated_at {
            self.write_out_history();
        }
        self.updated_at = now;
    }

    /// Hands the record to another token. An implied history is dated and signed by the
    /// token, so it is written out first.
    pub(super) fn set_token(&mut self, token: FencingToken) {
        if self.lease_token != token {
            self.write_out_history();
        }
        self.lease_token = token;
    }

    /// What this record counts toward the byte bound: its own size, its key and response, and
    /// what it keeps beside them (history, downstream id, resolution note).
    pub(super) fn weight(&self) -> usize {
        size_of::<Self>()
            + self.data.len()
            + self.extra.as_ref().map_or(0, |e| {
                size_of::<Extra>()
                    + e.history.capacity() * size_of::<Event>()
                    + e.downstream_id.as_ref().map_or(0, |d| d.len())
                    + e.resolution_note.as_ref().map_or(0, |n| n.len())
            })
    }

    fn implied(&self) -> bool {
        self.extra.as_ref().is_none_or(|e| e.history.is_empty())
    }

    fn write_out_history(&mut self) {
        if self.implied() {
            let history: Vec<Event> = self.events().collect();
            self.extra.get_or_insert_default().history = history;
        }
    }

    /// Appends `event`, as the current attempt's, while the history holds fewer than `cap`
    /// entries.
    pub(super) fn log(&mut self, now: u64, event: HistoryEvent, cap: usize) {
        // The first event after the claim, by the first attempt, at this change: implied by
        // the record's own fields, so nothing is stored but the event.
        if self.implied() && self.tail.is_none() && self.attempts == 1 && now == self.updated_at {
            self.tail = Some(event);
            return;
        }
        self.write_out_history();
        let entry = Event {
            at: now,
            token: self.lease_token,
            attempt: self.attempts,
            event,
        };
        let history = &mut self.extra.get_or_insert_default().history;
        if history.len() >= cap {
            // A refusal note is dropped; any other event takes the last entry's place, so the
            // history keeps its first attempts and always its latest event.
            if cap != HISTORY_REFUSALS
                && let Some(last) = history.last_mut()
            {
                *last = entry;
            }
            return;
        }
        history.push(entry);
    }

    /// The history: written out, or implied by the record while it is the first claim and at
    /// most one event, both by the first attempt's token (the event at the last change).
    fn events(&self) -> Box<dyn Iterator<Item = Event> + '_> {
        match &self.extra {
            Some(extra) if !extra.history.is_empty() => Box::new(extra.history.iter().copied()),
            _ => {
                let claimed = Event {
                    at: self.created_at,
                    token: self.lease_token,
                    attempt: 1,
                    event: HistoryEvent::Claimed,
                };
                let tail = self.tail.map(|event| Event {
                    at: self.updated_at,
                    token: self.lease_token,
                    attempt: 1,
                    event,
                });
                Box::new(std::iter::once(claimed).chain(tail))
            }
        }
    }

    pub(super) fn set_downstream_id(&mut self, id: &str) {
        self.extra.get_or_insert_default().downstream_id = Some(id.into());
    }

    /// Forgets an earlier attempt's downstream id: a new attempt's effect is not that one.
    pub(super) fn clear_downstream_id(&mut self) {
        if let Some(extra) = &mut self.extra {
            extra.downstream_id = None;
        }
    }

    /// The note of the record's latest resolution: `None` clears an older one, which
    /// belongs to an earlier attempt's resolution.
    pub(super) fn set_resolution_note(&mut self, note: Option<&str>) {
        match note {
            Some(note) => self.extra.get_or_insert_default().resolution_note = Some(note.into()),
            None => {
                if let Some(extra) = &mut self.extra {
                    extra.resolution_note = None;
                }
            }
        }
    }

    /// What a claim that found this record answers: a completed record's fingerprint and
    /// response (decoded from one copy of its bytes, which the headers and body share), or
    /// the record without its history unless it is in flight (see
    /// [`Claim::Existing`](super::super::Claim::Existing)).
    pub(super) fn to_claim(&self, key: &ScopedKey, now: u64) -> Result<Claim, StoreError> {
        if self.status == RecordStatus::Completed
            && let Some(bytes) = self.response()
        {
            let response = StoredResponse::from_shared(&Bytes::copy_from_slice(bytes))
                .map_err(StoreError::unavailable)?;
            return Ok(Claim::Completed {
                fingerprint: self.fingerprint(),
                response: Box::new(response),
            });
        }
        let in_flight = matches!(
            self.status,
            RecordStatus::InProgress | RecordStatus::Released
        );
        Ok(Claim::Existing {
            record: Box::new(self.record(key, in_flight)?),
            now: time(now),
        })
    }

    /// The whole record; `key` is its key (the caller looked it up by it).
    pub(super) fn to_record(&self, key: &ScopedKey) -> Result<Record, StoreError> {
        self.record(key, true)
    }

    fn record(&self, key: &ScopedKey, with_history: bool) -> Result<Record, StoreError> {
        let response = match self.response() {
            Some(bytes) => {
                Some(StoredResponse::from_bytes(bytes).map_err(StoreError::unavailable)?)
            }
            None => None,
        };
        let extra = self.extra.as_deref();
        Ok(Record {
            key: key.clone(),
            fingerprint: self.fingerprint(),
            status: self.status,
            lease_token: self.lease_token,
            lease_until: time(self.lease_until),
            attempts: self.attempts,
            effect_started: self.effect_started(),
            downstream_id: extra
                .and_then(|e| e.downstream_id.as_deref())
                .map(str::to_owned),
            response,
            created_at: time(self.created_at),
            updated_at: time(self.updated_at),
            expires_at: time(self.expires_at),
            resolution_note: extra
                .and_then(|e| e.resolution_note.as_deref())
                .map(str::to_owned),
            history: match with_history {
                true => self
                    .events()
                    .map(|e| HistoryEntry {
                        attempt: e.attempt,
                        token: e.token,
                        at: time(e.at),
                        event: e.event,
                    })
                    .collect(),
                false => Vec::new(),
            },
        })
    }
}

pub(super) fn time(ms: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(ms)
}

pub(super) fn span(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX / 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 23 §3: a record weighs 112 bytes in its slab, with no allocator header: the
    /// key and response share one allocation, the history is implied while it is short, the
    /// flags share a byte.
    #[test]
    fn s3_a_record_is_112_bytes() {
        assert!(
            size_of::<Entry>() <= 112,
            "Entry is {} bytes",
            size_of::<Entry>()
        );
        assert_eq!(
            size_of::<Option<Entry>>(),
            size_of::<Entry>(),
            "a free slab slot costs no more than a record"
        );
    }
}
