//! One claim in a write transaction, and the answer its row gives.

use sqlx::AssertSqlSafe;
use sqlx::sqlite::{SqliteConnection, SqliteRow};

use crate::store::sql::{self, millis, unavailable};
use crate::store::{Claim, ClaimRequest, FencingToken, LeaseExpiry, ScopedKey, StoreError};

use super::{SqliteStore, raw};

/// What a claim with `token` came to, from its record's `row`. A row that does not read fails
/// this claim alone, not the transaction: in a batch, the other keys' claims go on.
pub(super) fn claimed(row: &SqliteRow, token: FencingToken) -> Result<Claim, StoreError> {
    raw(row).map_err(unavailable).and_then(|(raw, now)| {
        raw.into_record()
            .map(|record| sql::claim_outcome(record, now, token))
    })
}

impl SqliteStore {
    /// Claims `req` with `token` on `connection`, inside a write transaction the caller
    /// commits. The outer error is the database's (the transaction is lost); the inner one is
    /// this record's own (it does not decode).
    pub(super) async fn claim_in(
        &self,
        connection: &mut SqliteConnection,
        req: &ClaimRequest,
        token: FencingToken,
    ) -> Result<Result<Claim, StoreError>, sqlx::Error> {
        let (scope, key) = (req.key.scope().as_bytes(), req.key.key().as_bytes());
        // The upsert takes the write lock; the read that may follow runs under it.
        let written = sqlx::query(AssertSqlSafe(self.sql.upsert.clone()))
            .bind(scope)
            .bind(key)
            .bind(req.fingerprint.as_bytes().as_slice())
            .bind(sql::token(token))
            .bind(millis(req.lease))
            .bind(req.on_lease_expiry == LeaseExpiry::Reclaim)
            .bind(millis(req.ttl))
            .fetch_optional(&mut *connection)
            .await?;
        match written {
            Some(row) => Ok(claimed(&row, token)),
            None => self.read_claimed(connection, &req.key, token).await,
        }
    }

    /// What a claim with `token` came to, read from `key`'s record on `connection` (inside
    /// the claim's transaction).
    pub(super) async fn read_claimed(
        &self,
        connection: &mut SqliteConnection,
        key: &ScopedKey,
        token: FencingToken,
    ) -> Result<Result<Claim, StoreError>, sqlx::Error> {
        let row = sqlx::query(AssertSqlSafe(self.sql.current.clone()))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .fetch_one(&mut *connection)
            .await?;
        Ok(claimed(&row, token))
    }

    /// One claim in a transaction of its own.
    pub(super) async fn claim_one(
        &self,
        req: &ClaimRequest,
        token: FencingToken,
    ) -> Result<Claim, StoreError> {
        let _turn = self.reserve.claim().await.map_err(unavailable)?;
        self.claim_in_turn(req, token).await
    }

    /// [`claim_one`](Self::claim_one) in the claims' share, taken by the caller.
    pub(super) async fn claim_in_turn(
        &self,
        req: &ClaimRequest,
        token: FencingToken,
    ) -> Result<Claim, StoreError> {
        let mut tx = self.pool.begin().await.map_err(unavailable)?;
        let outcome = self
            .claim_in(&mut tx, req, token)
            .await
            .map_err(unavailable)?;
        tx.commit().await.map_err(unavailable)?;
        outcome
    }
}
