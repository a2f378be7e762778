//! Claims and completions sent together under concurrency: one statement per batch.

use sqlx::{AssertSqlSafe, Row};

use crate::store::batch::{ClaimOp, CompleteOp};
use crate::store::sql::{self, millis};
use crate::store::{Claim, LeaseExpiry, StoreError};

use super::claim::claim_answer;
use super::{PostgresStore, fenced};

impl PostgresStore {
    /// A batch of claims: one statement. A batch of one (all there is at low load) goes as
    /// today's single statement, which PostgreSQL plans and runs faster than the batch's.
    pub(super) async fn claim_batch(self, ops: Vec<ClaimOp>) {
        let outcome = match ops.as_slice() {
            [op] => Ok(vec![Some(self.claim_one(&op.request, op.token).await)]),
            _ => self.claim_together(&ops).await,
        };
        self.settle_claims(ops, outcome);
    }

    /// Each claim in the one statement; `None` for a claim whose row it could not see.
    pub(super) async fn claim_together(
        &self,
        ops: &[ClaimOp],
    ) -> Result<Vec<Option<Result<Claim, StoreError>>>, sqlx::Error> {
        let _turn = self.reserve.claim().await?;
        let column = |f: fn(&ClaimOp) -> &[u8]| ops.iter().map(f).collect::<Vec<_>>();
        let rows = sqlx::query(AssertSqlSafe(self.sql.claim_batch.clone()))
            .bind(column(|op| op.request.key.scope().as_bytes()))
            .bind(column(|op| op.request.key.key().as_bytes()))
            .bind(column(|op| op.request.fingerprint.as_bytes().as_slice()))
            .bind(
                ops.iter()
                    .map(|op| sql::token(op.token))
                    .collect::<Vec<_>>(),
            )
            .bind(
                ops.iter()
                    .map(|op| millis(op.request.lease))
                    .collect::<Vec<_>>(),
            )
            .bind(
                ops.iter()
                    .map(|op| op.request.on_lease_expiry == LeaseExpiry::Reclaim)
                    .collect::<Vec<_>>(),
            )
            .bind(
                ops.iter()
                    .map(|op| millis(op.request.ttl))
                    .collect::<Vec<_>>(),
            )
            .fetch_all(&self.pool)
            .await?;
        let mut found: Vec<Option<Result<Claim, StoreError>>> = ops.iter().map(|_| None).collect();
        for row in rows {
            // `n` counts from 1, in the order of `ops`.
            let n: i64 = row.try_get(16)?;
            let Some(i) = usize::try_from(n - 1).ok().filter(|&i| i < ops.len()) else {
                continue;
            };
            // A row that does not read fails its own claim, not the batch's others.
            found[i] = Some(claim_answer(&row, ops[i].token));
        }
        Ok(found)
    }

    /// A batch of completions: one statement, its row locks waited for at most 100 ms. The
    /// completions of a batch that gives up go alone, each on a task of its own with today's
    /// statement (which waits as long as the session allows), holding no batch slot: a row
    /// held elsewhere delays its own completion, never another's.
    pub(super) async fn complete_batch(self, ops: Vec<CompleteOp>) {
        let outcome = match ops.as_slice() {
            [op] => self.complete_bounded(op).await.map(|done| vec![done]),
            _ => self.complete_together(&ops).await,
        };
        self.settle_completes(ops, outcome);
    }

    /// One completion, waiting at most 100 ms for its row.
    pub(super) async fn complete_bounded(
        &self,
        op: &CompleteOp,
    ) -> Result<Result<(), StoreError>, sqlx::Error> {
        let rows = self
            .complete_rows(
                &self.pool,
                &self.sql.complete_bounded,
                &op.key,
                op.token,
                &op.response,
                op.ttl,
            )
            .await?;
        Ok(fenced(rows))
    }

    /// The completions in one statement: each not written was fenced off.
    pub(super) async fn complete_together(
        &self,
        ops: &[CompleteOp],
    ) -> Result<Vec<Result<(), StoreError>>, sqlx::Error> {
        let written: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(self.sql.complete_batch.clone()))
            .bind(
                ops.iter()
                    .map(|op| op.key.scope().as_bytes())
                    .collect::<Vec<_>>(),
            )
            .bind(
                ops.iter()
                    .map(|op| op.key.key().as_bytes())
                    .collect::<Vec<_>>(),
            )
            .bind(
                ops.iter()
                    .map(|op| sql::token(op.token))
                    .collect::<Vec<_>>(),
            )
            .bind(
                ops.iter()
                    .map(|op| op.response.as_slice())
                    .collect::<Vec<_>>(),
            )
            .bind(ops.iter().map(|op| millis(op.ttl)).collect::<Vec<_>>())
            .fetch_all(&self.pool)
            .await?;
        let mut outcomes: Vec<Result<(), StoreError>> =
            ops.iter().map(|_| Err(StoreError::Fenced)).collect();
        for n in written {
            if let Some(outcome) = usize::try_from(n - 1)
                .ok()
                .and_then(|i| outcomes.get_mut(i))
            {
                *outcome = Ok(());
            }
        }
        Ok(outcomes)
    }
}
