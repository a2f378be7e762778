//! Claims and completions sent together under concurrency: one transaction per batch.

use sqlx::{AssertSqlSafe, Row};

use crate::store::batch::{ClaimOp, CompleteOp};
use crate::store::sql::{self, RawRecord, RowError, millis};
use crate::store::{Claim, LeaseExpiry, StoreError};

use super::statements::{CARRIED, chunks};
use super::{SqliteStore, fenced};

/// A record as the batch read gives it: a JSON array of its place and [`READ`]'s columns, as
/// [`CARRIED`] says.
pub(super) fn raw_of_json(v: &serde_json::Value) -> Result<RawRecord, StoreError> {
    let bad = |i: usize| {
        let column = CARRIED.get(i - 1).map_or("?", |&(column, _)| column);
        StoreError::unavailable(RowError(format!("column {column} does not read")))
    };
    let blob = |i: usize| -> Result<Vec<u8>, StoreError> {
        let hex = v[i].as_str().ok_or_else(|| bad(i))?;
        (0..hex.len())
            .step_by(2)
            .map(|j| {
                hex.get(j..j + 2)
                    .and_then(|b| u8::from_str_radix(b, 16).ok())
                    .ok_or_else(|| bad(i))
            })
            .collect()
    };
    let int = |i: usize| v[i].as_i64().ok_or_else(|| bad(i));
    let text = |i: usize| String::from_utf8(blob(i)?).map_err(|_| bad(i));
    let optional_text = |i: usize| match &v[i] {
        serde_json::Value::Null => Ok(None),
        _ => text(i).map(Some),
    };
    Ok(RawRecord {
        scope: blob(1)?,
        key: blob(2)?,
        fingerprint: blob(3)?,
        status: text(4)?,
        lease_token: int(5)?,
        lease_until_ms: int(6)?,
        attempts: int(7)?,
        effect_started: int(8)? != 0,
        downstream_id: optional_text(9)?,
        response: match &v[10] {
            serde_json::Value::Null => None,
            _ => Some(blob(10)?),
        },
        created_at_ms: int(11)?,
        updated_at: sql::from_ticks(int(12)?, SqliteStore::CURSOR_TICK),
        expires_at_ms: int(13)?,
        history: text(14)?,
        resolution_note: optional_text(15)?,
    })
}

impl SqliteStore {
    /// A batch of claims: one transaction, two statements for each chunk of it (the upserts,
    /// then the records as they stand). If it fails, its claims go alone, each on a task of
    /// its own (and its own transaction), holding neither the writer nor a batch slot.
    pub(super) async fn claim_batch(self, ops: Vec<ClaimOp>) {
        // The claims' share of the pool first, then the writer: a batch never holds the
        // writer (which holders' completions take too) while it waits for its turn.
        let outcomes = match self.reserve.claim().await {
            Ok(_turn) => {
                let _writer = self.writer.lock().await;
                match ops.as_slice() {
                    [op] => Ok(vec![Some(self.claim_in_turn(&op.request, op.token).await)]),
                    _ => self.claim_together(&ops).await,
                }
            }
            Err(error) => Err(error),
        };
        self.settle_claims(ops, outcomes);
    }

    /// Each claim of the batch (in the claims' share, taken by the caller), every one answered here
    /// (never `None`, which would send it alone: claimed again, after this commit).
    pub(super) async fn claim_together(
        &self,
        ops: &[ClaimOp],
    ) -> Result<Vec<Option<Result<Claim, StoreError>>>, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let mut outcomes: Vec<Option<Result<Claim, StoreError>>> =
            ops.iter().map(|_| None).collect();
        for range in chunks(ops.len()) {
            let size = range.len();
            let (chunk, found) = (&ops[range.clone()], &mut outcomes[range]);
            if let [op] = chunk {
                found[0] = Some(self.claim_in(&mut tx, &op.request, op.token).await?);
                continue;
            }
            let mut upsert = sqlx::query(AssertSqlSafe(self.sql.batch.claims(size)));
            for op in chunk {
                let req = &op.request;
                upsert = upsert
                    .bind(req.key.scope().as_bytes())
                    .bind(req.key.key().as_bytes())
                    .bind(req.fingerprint.as_bytes().as_slice())
                    .bind(sql::token(op.token))
                    .bind(millis(req.lease))
                    .bind(req.on_lease_expiry == LeaseExpiry::Reclaim)
                    .bind(millis(req.ttl));
            }
            upsert.execute(&mut *tx).await?;
            // Whether a claim won is read from its record, as alone: its own token in progress.
            let mut current = sqlx::query(AssertSqlSafe(self.sql.batch.current(size)));
            for op in chunk {
                current = current
                    .bind(op.request.key.scope().as_bytes())
                    .bind(op.request.key.key().as_bytes());
            }
            let row = current.fetch_one(&mut *tx).await?;
            let read = row
                .try_get::<String, _>(0)
                .ok()
                .and_then(|records| serde_json::from_str::<Vec<serde_json::Value>>(&records).ok());
            if let (Some(records), Ok(now)) = (read, row.try_get::<i64, _>(1)) {
                let now = sql::from_millis(now);
                for record in records {
                    let Some(i) = record[0]
                        .as_u64()
                        .and_then(|i| usize::try_from(i).ok())
                        .filter(|&i| i < size)
                    else {
                        continue;
                    };
                    // A response too big to read back here: read below.
                    if record[10].is_number() {
                        continue;
                    }
                    // A record that does not read fails its own claim, not the batch's others.
                    found[i] = Some(raw_of_json(&record).and_then(|raw| {
                        raw.into_record()
                            .map(|record| sql::claim_outcome(record, now, chunk[i].token))
                    }));
                }
            }
            // What the one row did not give (a response too big for it), read one by one in
            // this transaction: never claimed again, which a lease run out meanwhile would turn
            // into a takeover of the claim's own key.
            for (op, found) in chunk.iter().zip(found.iter_mut()) {
                if found.is_none() {
                    *found = Some(
                        self.read_claimed(&mut tx, &op.request.key, op.token)
                            .await?,
                    );
                }
            }
        }
        tx.commit().await?;
        Ok(outcomes)
    }

    /// A batch of completions: one transaction; if it fails, each goes alone, as claims do.
    pub(super) async fn complete_batch(self, ops: Vec<CompleteOp>) {
        let writer = self.writer.lock().await;
        let outcomes = match ops.as_slice() {
            [op] => Ok(vec![self.complete_encoded(op).await]),
            _ => self.complete_together(&ops).await,
        };
        drop(writer);
        self.settle_completes(ops, outcomes);
    }

    /// The completions of a batch, one statement for each chunk of it: each not written was
    /// fenced off.
    pub(super) async fn complete_together(
        &self,
        ops: &[CompleteOp],
    ) -> Result<Vec<Result<(), StoreError>>, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let mut outcomes: Vec<Result<(), StoreError>> =
            ops.iter().map(|_| Err(StoreError::Fenced)).collect();
        for range in chunks(ops.len()) {
            let size = range.len();
            let (chunk, done) = (&ops[range.clone()], &mut outcomes[range]);
            if let [op] = chunk {
                let rows = self
                    .complete_rows(
                        &mut *tx,
                        &self.sql.complete,
                        &op.key,
                        op.token,
                        &op.response,
                        op.ttl,
                    )
                    .await?;
                done[0] = fenced(rows);
                continue;
            }
            let mut complete = sqlx::query(AssertSqlSafe(self.sql.batch.completions(size)));
            for op in chunk {
                complete = complete
                    .bind(op.key.scope().as_bytes())
                    .bind(op.key.key().as_bytes())
                    .bind(sql::token(op.token))
                    .bind(op.response.as_slice())
                    .bind(millis(op.ttl));
            }
            let written = complete.execute(&mut *tx).await?.rows_affected();
            if written == size as u64 {
                done.iter_mut().for_each(|d| *d = Ok(()));
                continue;
            }
            // Some were fenced off: which, read record by record (rare).
            for (op, d) in chunk.iter().zip(done.iter_mut()) {
                let row = sqlx::query(AssertSqlSafe(self.sql.current.clone()))
                    .bind(op.key.scope().as_bytes())
                    .bind(op.key.key().as_bytes())
                    .fetch_optional(&mut *tx)
                    .await?;
                // Only the status and the token: a holder's completion of a row whose other
                // columns do not read was written all the same.
                let mine = row.is_some_and(|row| {
                    row.try_get::<i64, _>(4).ok() == Some(sql::token(op.token))
                        && row.try_get::<&str, _>(3).ok() == Some("completed")
                });
                if mine {
                    *d = Ok(());
                }
            }
        }
        tx.commit().await?;
        Ok(outcomes)
    }
}
