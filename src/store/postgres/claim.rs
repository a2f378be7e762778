//! One claim in one statement, and what a claim that gave up waiting for a lock answers.

use sqlx::AssertSqlSafe;
use sqlx::postgres::PgRow;

use crate::store::sql::{self, millis, unavailable};
use crate::store::{Claim, ClaimRequest, FencingToken, LeaseExpiry, StoreError};

use super::{PostgresStore, raw};

impl PostgresStore {
    /// A claim whose statement failed with `error`. One that gave up waiting for the row's
    /// lock (queued behind a crowd of duplicates, or a handler's transaction) reads what is
    /// committed: if the claim would leave that record as it is, the read answers it (no lock
    /// needed); otherwise the key is in flight.
    pub(super) async fn claim_gave_up(
        &self,
        req: &ClaimRequest,
        token: FencingToken,
        error: sqlx::Error,
    ) -> Result<Claim, StoreError> {
        if !lock_not_available(&error) {
            return Err(unavailable(error));
        }
        let row = sqlx::query(AssertSqlSafe(self.sql.unchanged.clone()))
            .bind(req.key.scope().as_bytes())
            .bind(req.key.key().as_bytes())
            .bind(req.fingerprint.as_bytes().as_slice())
            .fetch_optional(&self.pool)
            .await
            .map_err(unavailable)?;
        row.map_or(Err(StoreError::Busy), |row| claim_answer(&row, token))
    }

    pub(super) async fn claim_one(
        &self,
        req: &ClaimRequest,
        token: FencingToken,
    ) -> Result<Claim, StoreError> {
        // The claims' share of the pool, for the statement and the read that may follow.
        let _turn = self.reserve.claim().await.map_err(unavailable)?;
        // A second attempt only when a concurrent claim committed between our snapshot and
        // our conflict check (a new row, or a change to the one the snapshot holds); a third
        // would mean that happened twice in between.
        for _ in 0..3 {
            let row = match sqlx::query(AssertSqlSafe(self.sql.claim.clone()))
                .bind(req.key.scope().as_bytes())
                .bind(req.key.key().as_bytes())
                .bind(req.fingerprint.as_bytes().as_slice())
                .bind(sql::token(token))
                .bind(millis(req.lease))
                .bind(req.on_lease_expiry == LeaseExpiry::Reclaim)
                .bind(millis(req.ttl))
                .fetch_optional(&self.pool)
                .await
            {
                Ok(row) => row,
                Err(error) => return self.claim_gave_up(req, token, error).await,
            };
            let Some(row) = row else { continue };
            return claim_answer(&row, token);
        }
        Err(StoreError::unavailable(
            "claim kept racing with concurrent deletes",
        ))
    }
}

/// What a claim with `token` answers, from the record row it returned.
pub(super) fn claim_answer(row: &PgRow, token: FencingToken) -> Result<Claim, StoreError> {
    let (raw, now) = raw(row).map_err(unavailable)?;
    Ok(sql::claim_outcome(raw.into_record()?, now, token))
}

/// Whether a statement gave up waiting for a lock (`lock_timeout`).
pub(super) fn lock_not_available(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|e| e.code())
        .is_some_and(|code| code == "55P03")
}
