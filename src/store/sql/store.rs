//! The store both sqlx databases implement from one macro.

/// Implements everything of a sqlx store except its claim (`claim_one`, which each database
/// does its own way): the fenced writes, the reads and the history appends run the same
/// statements, prepared in the store's `Statements`, on any database.
macro_rules! sql_store {
    ($store:ident, $db:ty, $conn:ty, $row:ty) => {
impl $store {
    /// One claim with `token`, in a batch when batching is on.
    async fn claim_with(
        &self,
        req: &ClaimRequest,
        token: FencingToken,
    ) -> Result<Claim, StoreError> {
        match &self.batches {
            Some(batches) => {
                let store = self.clone();
                batches
                    .claim(req, token, move |ops| store.clone().claim_batch(ops))
                    .await
            }
            None => self.claim_one(req, token).await,
        }
    }

    async fn settle(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        status: RecordStatus,
    ) -> Result<(), StoreError> {
        let done = sqlx::query(AssertSqlSafe(self.sql.settle.clone()))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(sql::token(token))
            .bind(status.as_str())
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
        fenced(done.rows_affected())
    }

    /// Records a milestone on `connection`, typically inside the handler's own transaction, so
    /// the business write and the milestone commit or roll back together:
    ///
    /// ```no_run
    #[doc = concat!(" # async fn handler(store: tower_idempotency::store::", stringify!($store), ", ctx: tower_idempotency::IdempotencyContext)")]
    /// # -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::store::Milestone;
    ///
    /// let mut tx = store.pool().begin().await?;
    /// sqlx::query("INSERT INTO orders (id) VALUES (1)").execute(&mut *tx).await?;
    /// store
    ///     .record_milestone_in(&mut tx, ctx.scoped_key(), ctx.fencing_token(), &Milestone::EffectStarted)
    ///     .await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// The transaction holds the record's row until it ends, so the lease cannot be renewed
    /// meanwhile: the milestone holds it (and the record) for ten minutes from when it is
    /// written. A transaction held longer than that after its milestone loses the lease; a
    /// holder gone after its commit holds the key until then.
    pub async fn record_milestone_in(
        &self,
        connection: &mut $conn,
        key: &ScopedKey,
        token: FencingToken,
        milestone: &Milestone,
    ) -> Result<(), StoreError> {
        self.milestone_on(&mut *connection, key, token, milestone, true)
            .await
    }

    /// Records the outcome on `connection`, typically inside the handler's own transaction, so
    /// the business write and the recorded response commit or roll back together. The layer
    /// records the live response again afterwards, with the same token; that is allowed.
    pub async fn complete_in(
        &self,
        connection: &mut $conn,
        key: &ScopedKey,
        token: FencingToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.complete_on(connection, key, token, response, ttl)
            .await
    }

    async fn complete_on<'c, E>(
        &self,
        executor: E,
        key: &ScopedKey,
        token: FencingToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError>
    where
        E: sqlx::Executor<'c, Database = $db>,
    {
        self.complete_bytes(executor, key, token, &response.to_bytes(), ttl)
            .await
    }

    /// Sends claims and completions that arrive while others are in flight together (see the
    /// store's documentation for what a batch is on its database), each request answered as
    /// it would be alone: the same fencing, leases and TTLs. No timer: at low load each
    /// operation goes alone, at once, as today's statement.
    ///
    /// ```no_run
    #[doc = concat!(" # async fn run(store: tower_idempotency::store::", stringify!($store), ") {")]
    /// use tower_idempotency::store::Batching;
    ///
    /// let store = store.with_batching(Batching::default());
    /// # }
    /// ```
    pub fn with_batching(mut self, batching: super::Batching) -> Self {
        self.batches = Some(super::batch::Batches::new(batching));
        self
    }

    /// How claims and completions are batched, if they are.
    pub fn batching(&self) -> Option<super::Batching> {
        self.batches.as_ref().map(|b| b.settings())
    }

    /// Keeps `n` of the pool's connections for the requests holding leases: claims (with the reads
    /// of requests waiting for a key in flight, and refusals' notes) take at most the rest at once,
    /// so a holder's renewal or completion queues for a connection behind other holders' and at
    /// worst one claim's statement, never behind a crowd of duplicates and retries (queued past the
    /// lease's end, it would let a duplicate take over a run still going). By default a quarter of
    /// the pool, at least one; none of a pool of one connection. At most all but one: claims always
    /// have one. A `PostgresStore`'s `LISTEN` (started by the first request that waits for a key in
    /// flight) takes none of them: it runs on a connection of its own, beside the pool. A claim
    /// waits for its share at most the pool's acquire time-out, then fails as the pool does (503,
    /// nothing runs); its wait for a connection comes after, so a claim may wait up to twice that
    /// time in all.
    ///
    /// Set it when building the store, before it serves requests: clones made before keep
    /// the share they were made with.
    ///
    /// Only the store's own statements are shared out so. The application's use of the same
    /// pool (a handler's own transaction, another store on it) is not: size the pool for
    /// both, or give the store a pool of its own.
    ///
    /// ```no_run
    #[doc = concat!(" # async fn run(store: tower_idempotency::store::", stringify!($store), ") {")]
    /// let store = store.with_holder_connections(2);
    /// assert_eq!(store.holder_connections(), 2);
    /// # }
    /// ```
    pub fn with_holder_connections(mut self, n: u32) -> Self {
        self.reserve = Self::reserve_of(&self.pool, |_| n);
        self
    }

    /// The claims' share of `pool`, keeping `kept(max_connections)` connections for holders.
    fn reserve_of(
        pool: &sqlx::Pool<$db>,
        kept: impl FnOnce(u32) -> u32,
    ) -> std::sync::Arc<super::reserve::Reserve> {
        let options = pool.options();
        let max = options.get_max_connections();
        std::sync::Arc::new(super::reserve::Reserve::new(
            max,
            kept(max),
            options.get_acquire_timeout(),
        ))
    }

    /// How many of the pool's connections are kept for lease holders (see
    /// [`with_holder_connections`](Self::with_holder_connections)).
    pub fn holder_connections(&self) -> u32 {
        self.reserve.kept()
    }

    /// What a batch of claims came to. Each claim is answered, or sent again alone on a task
    /// of its own (holding no batch slot): a claim whose row the statement could not see, and
    /// every claim of a batch the database refused (a lock wait ran out, a deadlock, a busy
    /// file). Any other failure (the connection, the pool) is answered to all, as each alone
    /// would have met it.
    fn settle_claims(
        &self,
        ops: Vec<super::batch::ClaimOp>,
        outcome: Result<Vec<Option<Result<Claim, StoreError>>>, sqlx::Error>,
    ) {
        use super::batch;
        match outcome {
            Ok(found) => {
                for (op, outcome) in ops.into_iter().zip(found) {
                    match outcome {
                        Some(outcome) => batch::answer_claim(self, op, outcome),
                        None => self.claim_alone(op),
                    }
                }
            }
            Err(error) if batch::retry_alone(&error) => {
                tracing::debug!(%error, "a batch of claims failed; each goes alone");
                ops.into_iter().for_each(|op| self.claim_alone(op));
            }
            Err(error) => {
                let error = batch::BatchError::new(error);
                for op in ops {
                    batch::answer_claim(self, op, Err(error.to_store()));
                }
            }
        }
    }

    /// `op` claimed on its own, on a task of its own.
    fn claim_alone(&self, op: super::batch::ClaimOp) {
        let store = self.clone();
        tokio::spawn(async move {
            let outcome = store.claim_one(&op.request, op.token).await;
            super::batch::answer_claim(&store, op, outcome);
        });
    }

    /// What a batch of completions came to, as [`settle_claims`](Self::settle_claims): each
    /// sent again alone (with today's statement, which waits for its row as long as the
    /// session allows) when the database refused the batch.
    fn settle_completes(
        &self,
        ops: Vec<super::batch::CompleteOp>,
        outcome: Result<Vec<Result<(), StoreError>>, sqlx::Error>,
    ) {
        match outcome {
            Ok(outcomes) => {
                for (op, outcome) in ops.into_iter().zip(outcomes) {
                    op.answer(outcome);
                }
            }
            Err(error) if super::batch::retry_alone(&error) => {
                tracing::debug!(%error, "a batch of completions failed; each goes alone");
                for op in ops {
                    let store = self.clone();
                    tokio::spawn(async move {
                        let outcome = store.complete_encoded(&op).await;
                        op.answer(outcome);
                    });
                }
            }
            Err(error) => {
                let error = super::batch::BatchError::new(error);
                for op in ops {
                    op.answer(Err(error.to_store()));
                }
            }
        }
    }

    /// A completion of a batch, sent on its own (a batch of one, or a failed batch's).
    async fn complete_encoded(&self, op: &super::batch::CompleteOp) -> Result<(), StoreError> {
        self.complete_bytes(&self.pool, &op.key, op.token, &op.response, op.ttl)
            .await
    }

    async fn complete_bytes<'c, E>(
        &self,
        executor: E,
        key: &ScopedKey,
        token: FencingToken,
        response: &[u8],
        ttl: Duration,
    ) -> Result<(), StoreError>
    where
        E: sqlx::Executor<'c, Database = $db>,
    {
        let rows = self
            .complete_rows(executor, &self.sql.complete, key, token, response, ttl)
            .await
            .map_err(unavailable)?;
        fenced(rows)
    }

    /// Runs a completion `statement` (today's, or one bounded in its lock wait): the rows it
    /// wrote, 0 when fenced off.
    async fn complete_rows<'c, E>(
        &self,
        executor: E,
        statement: &Arc<str>,
        key: &ScopedKey,
        token: FencingToken,
        response: &[u8],
        ttl: Duration,
    ) -> Result<u64, sqlx::Error>
    where
        E: sqlx::Executor<'c, Database = $db>,
    {
        let done = sqlx::query(AssertSqlSafe(statement.clone()))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(sql::token(token))
            .bind(response)
            .bind(millis(ttl))
            .execute(executor)
            .await?;
        Ok(done.rows_affected())
    }

    async fn milestone_on<'c, E>(
        &self,
        executor: E,
        key: &ScopedKey,
        token: FencingToken,
        milestone: &Milestone,
        held: bool,
    ) -> Result<(), StoreError>
    where
        E: sqlx::Executor<'c, Database = $db>,
    {
        let statement = match (milestone, held) {
            (Milestone::EffectStarted, false) => &self.sql.effect_started,
            (Milestone::EffectStarted, true) => &self.sql.effect_started_held,
            (Milestone::DownstreamId(_), false) => &self.sql.downstream_id,
            (Milestone::DownstreamId(_), true) => &self.sql.downstream_id_held,
        };
        let query = sqlx::query(AssertSqlSafe(statement.clone()));
        let mut query = query
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(sql::token(token));
        if let Milestone::DownstreamId(id) = milestone {
            query = query.bind(id.as_str());
        }
        let done = query.execute(executor).await.map_err(unavailable)?;
        fenced(done.rows_affected())
    }
}

fn fenced(rows: u64) -> Result<(), StoreError> {
    if rows == 1 {
        Ok(())
    } else {
        Err(StoreError::Fenced)
    }
}

fn raw(row: &$row) -> Result<(RawRecord, SystemTime), sqlx::Error> {
    let record = RawRecord {
        scope: row.try_get(0)?,
        key: row.try_get(1)?,
        fingerprint: row.try_get(2)?,
        status: row.try_get(3)?,
        lease_token: row.try_get(4)?,
        lease_until_ms: row.try_get(5)?,
        attempts: row.try_get(6)?,
        effect_started: row.try_get(7)?,
        downstream_id: row.try_get(8)?,
        response: row.try_get(9)?,
        created_at_ms: row.try_get(10)?,
        updated_at: sql::from_ticks(row.try_get(11)?, $store::CURSOR_TICK),
        expires_at_ms: row.try_get(12)?,
        history: row.try_get(13)?,
        resolution_note: row.try_get(14)?,
    };
    // The store's clock at the cursor's tick too, or a claim's clock could read earlier
    // than the change it answers.
    Ok((record, sql::from_ticks(row.try_get(15)?, $store::CURSOR_TICK)))
}

impl IdempotencyStore for $store {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let token = super::codec::fresh_token();
        // A claim that failed may have landed all the same, its answer lost with the
        // connection: left so, it would hold the key for a request that ran nothing (and, on
        // a route with external effects, send it to reconciliation when the lease ends). Asked
        // again with the same token, it reads as this claim's own (`claim_outcome`).
        // Lost again, what may have landed is given back: the request is refused, nothing ran.
        match self.claim_with(req, token).await {
            Err(error) if sql::answer_lost(&error) => match self.claim_with(req, token).await {
                Err(error) if sql::answer_lost(&error) => {
                    super::unheard::give_back(self, &req.key, token, req.lease);
                    Err(error)
                }
                answered => answered,
            },
            answered => answered,
        }
    }

    async fn renew(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<SystemTime, StoreError> {
        let until: Option<i64> = sqlx::query_scalar(AssertSqlSafe(self.sql.renew.clone()))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(sql::token(token))
            .bind(millis(lease))
            .fetch_optional(&self.pool)
            .await
            .map_err(unavailable)?;
        until.map(sql::from_millis).ok_or(StoreError::Fenced)
    }

    async fn complete(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        match &self.batches {
            Some(batches) => {
                let store = self.clone();
                batches
                    .complete(key, token, response.to_bytes(), ttl, move |ops| {
                        store.clone().complete_batch(ops)
                    })
                    .await
            }
            None => {
                self.complete_on(&self.pool, key, token, response, ttl)
                    .await
            }
        }
    }

    async fn release(
        &self,
        key: &ScopedKey,
        token: FencingToken,
    ) -> Result<RecordStatus, StoreError> {
        let status: Option<String> = sqlx::query_scalar(AssertSqlSafe(self.sql.release.clone()))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(sql::token(token))
            .fetch_optional(&self.pool)
            .await
            .map_err(unavailable)?;
        match status.as_deref() {
            Some("needs_reconciliation") => Ok(RecordStatus::NeedsReconciliation),
            Some(_) => Ok(RecordStatus::Released),
            None => Err(StoreError::Fenced),
        }
    }

    async fn mark_uncertain(&self, key: &ScopedKey, token: FencingToken) -> Result<(), StoreError> {
        self.settle(key, token, RecordStatus::NeedsReconciliation)
            .await
    }

    async fn lookup(&self, key: &ScopedKey) -> Result<Option<Record>, StoreError> {
        let row = sqlx::query(AssertSqlSafe(self.sql.lookup.clone()))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .fetch_optional(&self.pool)
            .await
            .map_err(unavailable)?;
        match row {
            // A column that does not read as its type is a damaged row, as the listing says
            // (`RowError`), not a store that failed: an operator is shown it, to remove.
            Some(row) => Ok(Some(
                raw(&row).map_err(sql::RowError::column)?.0.into_record()?,
            )),
            None => Ok(None),
        }
    }

    async fn remove(&self, key: &ScopedKey) -> Result<bool, StoreError> {
        let done = sqlx::query(AssertSqlSafe(self.sql.remove.clone()))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
        Ok(done.rows_affected() > 0)
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let done = sqlx::query(AssertSqlSafe(self.sql.purge.clone()))
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
        Ok(done.rows_affected())
    }

    async fn record_milestone(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        milestone: &Milestone,
    ) -> Result<(), StoreError> {
        self.milestone_on(&self.pool, key, token, milestone, false)
            .await
    }

    async fn list_uncertain(&self, query: &UncertainQuery) -> Result<UncertainPage, StoreError> {
        let limit = i64::try_from(query.limit).unwrap_or(i64::MAX);
        let (first, after) = match query.newest_first {
            false => (&self.sql.list_uncertain, &self.sql.list_uncertain_after),
            true => (&self.sql.list_uncertain_desc, &self.sql.list_uncertain_after_desc),
        };
        let rows = match &query.after {
            None => sqlx::query(AssertSqlSafe(first.clone()))
                .bind(limit)
                .fetch_all(&self.pool)
                .await,
            Some(cursor) => sqlx::query(AssertSqlSafe(after.clone()))
                .bind(limit)
                .bind(sql::ticks(cursor.updated_at, Self::CURSOR_TICK))
                .bind(cursor.bytes().0)
                .bind(cursor.bytes().1)
                .fetch_all(&self.pool)
                .await,
        }
        .map_err(unavailable)?;
        let (mut records, mut unreadable, mut last) = (Vec::new(), Vec::new(), None);
        for row in &rows {
            // Where the row stands in the listing: read apart from the rest, so a row that
            // cannot be read is still stepped over, and reported.
            let scope: Vec<u8> = row.try_get(0).map_err(unavailable)?;
            let key: Vec<u8> = row.try_get(1).map_err(unavailable)?;
            let at: i64 = row.try_get(Self::PLACE_COLUMN).map_err(unavailable)?;
            let place = UncertainCursor::stored(sql::from_ticks(at, Self::CURSOR_TICK), scope, key);
            let key = place.key.clone();
            match raw(row).map_err(sql::RowError::column).and_then(|(raw, _)| raw.into_record()) {
                // Its last change is read at the cursor's tick (see `RawRecord::updated_at`):
                // a cursor made from it is just past it, never before it (listed again) or
                // past a neighbour in the same millisecond (skipped).
                Ok(record) => records.push(record),
                Err(error) => {
                    tracing::error!(?key, %error, "an uncertain record cannot be read; skipped");
                    // What is wrong with the row, without the store's "unavailable" framing.
                    let error = match error {
                        StoreError::Unavailable(inner) => inner.to_string(),
                        other => other.to_string(),
                    };
                    unreadable.push(Unreadable { key, error });
                }
            }
            last = Some(place);
        }
        Ok(UncertainPage::new(records, unreadable, last, query.limit))
    }

    async fn count_uncertain(&self) -> Result<UncertainCount, StoreError> {
        let row = sqlx::query(AssertSqlSafe(self.sql.count_uncertain.clone()))
            .fetch_one(&self.pool)
            .await
            .map_err(unavailable)?;
        let count: i64 = row.try_get(0).map_err(unavailable)?;
        let oldest: Option<i64> = row.try_get(1).map_err(unavailable)?;
        Ok(UncertainCount {
            count: u64::try_from(count).unwrap_or_default(),
            oldest: oldest
                .filter(|_| count > 0)
                .map(|at| sql::from_ticks(at, Self::CURSOR_TICK)),
        })
    }

    async fn resolve(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        resolution: &Resolution,
        ttl: Duration,
        note: Option<&str>,
    ) -> Result<(), StoreError> {
        let (status, response) = match resolution {
            Resolution::Applied(response) => (RecordStatus::Completed, Some(response.to_bytes())),
            Resolution::NotApplied => (RecordStatus::Released, None),
        };
        let done = sqlx::query(AssertSqlSafe(self.sql.resolve.clone()))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(sql::token(token))
            .bind(status.as_str())
            .bind(response)
            .bind(millis(ttl))
            // A resolution is final: a new token fences out the holder it overrules.
            .bind(sql::token(super::codec::fresh_token()))
            .bind(note)
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
        fenced(done.rows_affected())
    }

    async fn append_history(&self, key: &ScopedKey, event: HistoryEvent) -> Result<(), StoreError> {
        // A request's note (it may wait on the row), in the claims' share as its claim was.
        let _turn = self.reserve.claim().await.map_err(unavailable)?;
        sqlx::query(AssertSqlSafe(self.sql.append_history.clone()))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(event.as_str())
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn wait_for_change(
        &self,
        key: &ScopedKey,
        seen: &InFlight,
        round: u32,
        within: Duration,
    ) {
        self.wait_changed(key, seen, round, within).await
    }
}
    };
}

pub(crate) use sql_store;
