//! Claims and completions that arrive while a statement is in flight go to the database
//! together, one statement (or transaction) per batch.
//!
//! There is no timer. An operation that finds a batch slot free and nothing queued goes at
//! once, alone, on its caller's own task: at low load nothing waits and nothing is spawned.
//! Operations that arrive while every slot is busy queue, and the first slot to free takes
//! the whole queue as its next batch, on a task of its own, so a caller that hangs up never
//! takes the other callers' answers with it. A batch holds each key at most once (a statement may
//! not write one row twice); a second operation on a key waits for the next batch, and sees
//! what the first did.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;

use super::{Claim, ClaimRequest, FencingToken, IdempotencyStore, ScopedKey, StoreError};

/// How a SQL store sends claims and completions in batches (see
/// [`PostgresStore::with_batching`](super::PostgresStore::with_batching) and
/// [`SqliteStore::with_batching`](super::SqliteStore::with_batching)).
///
/// Each request gets its own answer, with the same fencing, lease and TTL semantics as alone;
/// batching only changes how many round trips (and commits) the database sees under
/// concurrency. There is no timer: at low load each operation goes alone, at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batching {
    in_flight: usize,
    max: usize,
    max_bytes: usize,
}

impl Default for Batching {
    /// Two batches of each kind in flight, at most 64 operations and 16 MiB each.
    fn default() -> Self {
        Self {
            in_flight: 2,
            max: 64,
            max_bytes: 16 << 20,
        }
    }
}

impl Batching {
    /// How many batches of claims (and, apart, of completions) may be in flight at once
    /// (at least 1). Fewer make bigger batches under load; more let a slow batch hold up
    /// fewer operations.
    pub fn in_flight(mut self, batches: usize) -> Self {
        self.in_flight = batches.max(1);
        self
    }

    /// The most operations one batch carries (at least 1); the rest wait for the next.
    pub fn max_batch(mut self, operations: usize) -> Self {
        self.max = operations.max(1);
        self
    }

    /// The most bytes (keys and responses) one batch carries; an operation bigger than this
    /// goes alone. A statement past the database's message limit (1 GiB on PostgreSQL) would
    /// fail the whole batch where each operation alone succeeds.
    pub fn max_bytes(mut self, bytes: usize) -> Self {
        self.max_bytes = bytes.max(1);
        self
    }

    /// The most bytes per batch.
    pub fn get_max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// Batches of claims in flight at once.
    pub fn get_in_flight(&self) -> usize {
        self.in_flight
    }

    /// The most operations per batch.
    pub fn get_max_batch(&self) -> usize {
        self.max
    }
}

/// Whether a failed batch's operations go again, each on its own: the database refused the
/// statement (a lock wait ran out, a deadlock, a busy file), which an operation alone may not
/// meet. Any other failure (the connection, the pool) would fail each alone as it failed the
/// batch: the batch's operations then answer it, as they would have alone.
pub(crate) fn retry_alone(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(_))
}

/// A batch's failure, answered to each of its operations (as `Unavailable`, the source kept).
#[derive(Debug, Clone)]
pub(crate) struct BatchError(Arc<sqlx::Error>);

impl BatchError {
    pub(crate) fn new(error: sqlx::Error) -> Self {
        Self(Arc::new(error))
    }

    pub(crate) fn to_store(&self) -> StoreError {
        StoreError::unavailable(self.clone())
    }
}

impl std::fmt::Display for BatchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the batch carrying this operation failed")
    }
}

impl std::error::Error for BatchError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

/// Answers a claim's caller. A won claim whose caller left is given back, on a task of its
/// own, so no key stays in progress until its lease runs out and no batch slot waits for it.
pub(crate) fn answer_claim<S: IdempotencyStore + Clone>(
    store: &S,
    op: ClaimOp,
    outcome: Result<Claim, StoreError>,
) {
    if let Some((key, token)) = op.answer(outcome) {
        let store = store.clone();
        tokio::spawn(async move {
            if let Err(error) = store.release(&key, token).await {
                tracing::warn!(%error, "could not give back a claim whose caller left");
            }
        });
    }
}

/// A claim waiting for its batch, with the token it will hold if it wins.
pub(crate) struct ClaimOp {
    pub(crate) request: ClaimRequest,
    pub(crate) token: FencingToken,
    answer: oneshot::Sender<Result<Claim, StoreError>>,
}

impl ClaimOp {
    /// Answers the caller. A caller that is gone leaves a won claim behind: it is returned, for
    /// the batch to give back (see [`answer_claim`]).
    fn answer(self, out: Result<Claim, StoreError>) -> Option<(ScopedKey, FencingToken)> {
        match self.answer.send(out) {
            Ok(()) => None,
            Err(Ok(Claim::Acquired(lease))) => Some((self.request.key, lease.token)),
            Err(_) => None,
        }
    }
}

/// A completion waiting for its batch: the response already encoded as the store keeps it.
pub(crate) struct CompleteOp {
    pub(crate) key: ScopedKey,
    pub(crate) token: FencingToken,
    pub(crate) response: Vec<u8>,
    pub(crate) ttl: Duration,
    answer: oneshot::Sender<Result<(), StoreError>>,
}

impl CompleteOp {
    /// Answers the caller (if still there).
    pub(crate) fn answer(self, out: Result<(), StoreError>) {
        let _ = self.answer.send(out);
    }
}

/// An operation's key, for keeping each key once per batch, and what it puts on the wire.
pub(crate) trait Keyed {
    fn key(&self) -> &ScopedKey;

    /// About how many bytes the operation adds to its batch's statement.
    fn weight(&self) -> usize {
        let key = self.key();
        key.scope().len() + key.key().len()
    }
}

impl Keyed for ClaimOp {
    fn key(&self) -> &ScopedKey {
        &self.request.key
    }
}

impl Keyed for CompleteOp {
    fn key(&self) -> &ScopedKey {
        &self.key
    }

    fn weight(&self) -> usize {
        self.key.scope().len() + self.key.key().len() + self.response.len()
    }
}

/// A store's two queues: claims and completions batch apart (one statement each kind).
#[derive(Debug)]
pub(crate) struct Batches {
    claims: Batcher<ClaimOp>,
    completes: Batcher<CompleteOp>,
    settings: Batching,
}

impl Batches {
    pub(crate) fn new(settings: Batching) -> Arc<Self> {
        Arc::new(Self {
            claims: Batcher::new(settings),
            completes: Batcher::new(settings),
            settings,
        })
    }

    pub(crate) fn settings(&self) -> Batching {
        self.settings
    }

    /// Claims `request` in the next batch; `run` sends a batch (called on the batch's task).
    pub(crate) async fn claim<F, Fut>(
        &self,
        request: &ClaimRequest,
        token: FencingToken,
        run: F,
    ) -> Result<Claim, StoreError>
    where
        F: Fn(Vec<ClaimOp>) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (answer, answered) = oneshot::channel();
        let op = ClaimOp {
            request: request.clone(),
            token,
            answer,
        };
        self.claims.send(op, run).await?;
        answered.await.unwrap_or_else(|_| Err(lost()))
    }

    /// Completes `key` in the next batch; `run` sends a batch.
    pub(crate) async fn complete<F, Fut>(
        &self,
        key: &ScopedKey,
        token: FencingToken,
        response: Vec<u8>,
        ttl: Duration,
        run: F,
    ) -> Result<(), StoreError>
    where
        F: Fn(Vec<CompleteOp>) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (answer, answered) = oneshot::channel();
        let op = CompleteOp {
            key: key.clone(),
            token,
            response,
            ttl,
            answer,
        };
        self.completes.send(op, run).await?;
        answered.await.unwrap_or_else(|_| Err(lost()))
    }
}

/// A batch ended without answering (its task was stopped: the runtime shut down, or it
/// panicked): the operation may or may not have reached the database.
fn lost() -> StoreError {
    StoreError::unavailable("the batch carrying this operation ended without an answer")
}

/// One queue of operations and the batches draining it.
struct Batcher<T> {
    shared: Arc<Shared<T>>,
}

impl<T> std::fmt::Debug for Batcher<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.shared.lock();
        f.debug_struct("Batcher")
            .field("queued", &state.queue.len())
            .field("running", &state.running)
            .finish()
    }
}

struct Shared<T> {
    state: Mutex<State<T>>,
    settings: Batching,
}

struct State<T> {
    queue: VecDeque<T>,
    /// Batch tasks running (each sends batches until the queue is empty).
    running: usize,
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // No code panics while holding it; a poisoned queue is still a consistent queue.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl<T: Keyed + Send + 'static> Batcher<T> {
    fn new(settings: Batching) -> Self {
        Self {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    queue: VecDeque::new(),
                    running: 0,
                }),
                settings,
            }),
        }
    }

    /// Sends `op`. With a batch slot free and nothing queued (low load), it goes at once on
    /// the caller's own task, alone: no task to spawn, no thread to wake. Otherwise it queues,
    /// and a batch task is started if a slot is free; its answer comes by its channel.
    async fn send<F, Fut>(&self, op: T, run: F) -> Result<(), StoreError>
    where
        F: Fn(Vec<T>) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        // Checked first: without a runtime no batch could run, and the op would wait forever.
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| StoreError::unavailable("a batched store needs a tokio runtime"))?;
        let alone = {
            let mut state = self.shared.lock();
            if state.running < self.shared.settings.in_flight {
                state.running += 1;
                if state.queue.is_empty() {
                    Some(op)
                } else {
                    state.queue.push_back(op);
                    None
                }
            } else {
                state.queue.push_back(op);
                return Ok(());
            }
        };
        match alone {
            Some(op) => {
                // The slot passes to a batch task for what queued meanwhile, even if this
                // caller leaves mid-statement.
                let slot = Handoff {
                    shared: self.shared.clone(),
                    run: Some(run),
                };
                if let Some(run) = &slot.run {
                    run(vec![op]).await;
                }
                drop(slot);
            }
            None => {
                runtime.spawn(drain(Slot(Some(self.shared.clone())), run));
            }
        }
        Ok(())
    }
}

/// The slot of an operation sent on its caller's task. Dropped (done, or left mid-statement
/// when its caller hung up), it is given back, or handed to a batch task if operations
/// queued behind it.
struct Handoff<T, F, Fut>
where
    T: Keyed + Send + 'static,
    F: Fn(Vec<T>) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    shared: Arc<Shared<T>>,
    run: Option<F>,
}

impl<T, F, Fut> Drop for Handoff<T, F, Fut>
where
    T: Keyed + Send + 'static,
    F: Fn(Vec<T>) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    fn drop(&mut self) {
        let shared = self.shared.clone();
        let queued = {
            let mut state = shared.lock();
            let queued = !state.queue.is_empty();
            if !queued {
                state.running -= 1;
            }
            queued
        };
        if !queued {
            return;
        }
        match (self.run.take(), tokio::runtime::Handle::try_current()) {
            (Some(run), Ok(runtime)) => {
                runtime.spawn(drain(Slot(Some(shared)), run));
            }
            // No runtime left to run them (shutting down): the slot is given back, and if it
            // was the last, the queued callers get an error.
            _ => drop(Slot(Some(shared))),
        }
    }
}

/// A batch task: sends batches while operations are queued.
///
/// It takes its slot as an argument, made before the task is spawned: a task dropped before
/// its first poll (spawned on a runtime that is shutting down) still gives the slot back.
async fn drain<T, F, Fut>(mut slot: Slot<T>, run: F)
where
    T: Keyed + Send + 'static,
    F: Fn(Vec<T>) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    loop {
        let Some(batch) = slot.next() else { return };
        run(batch).await;
    }
}

/// A running batch task's place. Dropped without finishing (its runtime shut down, or a batch
/// panicked), it gives its place back; if it was the last, the queue is dropped, so waiting
/// callers get an error rather than waiting for a task that will never come.
struct Slot<T: Keyed>(Option<Arc<Shared<T>>>);

impl<T: Keyed> Slot<T> {
    /// The next batch: up to `max` queued operations, each key once, in order of arrival.
    /// `None` when the queue is empty, and the task's place is given back under the same lock,
    /// so no operation is queued after the last task looked.
    fn next(&mut self) -> Option<Vec<T>> {
        let shared = self.0.as_ref()?;
        let mut state = shared.lock();
        if state.queue.is_empty() {
            state.running -= 1;
            drop(state);
            self.0 = None;
            return None;
        }
        let (max, max_bytes) = (shared.settings.max, shared.settings.max_bytes);
        let mut batch: Vec<T> = Vec::with_capacity(state.queue.len().min(max));
        let mut bytes = 0usize;
        let mut later = VecDeque::new();
        while let Some(op) = state.queue.pop_front() {
            if batch.len() == max {
                later.push_back(op);
                later.extend(state.queue.drain(..));
                break;
            }
            // The first operation always goes, however big: alone it is today's statement.
            let fits = batch.is_empty() || bytes.saturating_add(op.weight()) <= max_bytes;
            if !fits || batch.iter().any(|b| b.key() == op.key()) {
                later.push_back(op);
            } else {
                bytes = bytes.saturating_add(op.weight());
                batch.push(op);
            }
        }
        state.queue = later;
        Some(batch)
    }
}

impl<T: Keyed> Drop for Slot<T> {
    fn drop(&mut self) {
        let Some(shared) = self.0.take() else { return };
        let orphaned = {
            let mut state = shared.lock();
            state.running -= 1;
            if state.running == 0 {
                std::mem::take(&mut state.queue)
            } else {
                VecDeque::new()
            }
        };
        // Dropped outside the lock: each drop answers a caller with an error.
        drop(orphaned);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Op(ScopedKey, oneshot::Sender<usize>);

    impl Keyed for Op {
        fn key(&self) -> &ScopedKey {
            &self.0
        }
    }

    fn op(key: &str) -> (Op, oneshot::Receiver<usize>) {
        let (tx, rx) = oneshot::channel();
        (Op(ScopedKey::new("s", key), tx), rx)
    }

    /// §4: at low load an operation goes at once, alone, on its caller's task; while it is in
    /// flight the next arrivals queue and go together, each key once per batch.
    #[tokio::test]
    async fn s4_operations_queued_behind_a_batch_go_together_each_key_once() {
        let batcher = Arc::new(Batcher::new(Batching::default().in_flight(1)));
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let (gate_tx, gate_rx) = tokio::sync::watch::channel(false);
        let run = {
            let sizes = sizes.clone();
            move |batch: Vec<Op>| {
                let sizes = sizes.clone();
                let mut gate = gate_rx.clone();
                async move {
                    sizes.lock().expect("sizes").push(batch.len());
                    // The first batch is held until the others have queued behind it.
                    let _ = gate.wait_for(|open| *open).await;
                    for (i, Op(_, tx)) in batch.into_iter().enumerate() {
                        let _ = tx.send(i);
                    }
                }
            }
        };
        let (first, first_rx) = op("a");
        let alone = {
            let (batcher, run) = (batcher.clone(), run.clone());
            tokio::spawn(async move { batcher.send(first, run).await })
        };
        tokio::task::yield_now().await;
        let mut answers = vec![first_rx];
        for key in ["b", "c", "b", "d"] {
            let (o, rx) = op(key);
            // Queued: it returns at once, and its answer comes by its channel.
            batcher.send(o, run.clone()).await.expect("send");
            answers.push(rx);
        }
        assert_eq!(
            batcher.shared.lock().queue.len(),
            4,
            "queued behind the first"
        );
        gate_tx.send(true).expect("open");
        alone.await.expect("task").expect("send");
        for rx in answers {
            rx.await.expect("every operation is answered");
        }
        // "a" alone, then b, c, d together, then the second "b" in a batch of its own.
        assert_eq!(*sizes.lock().expect("sizes"), vec![1, 3, 1]);
        assert_eq!(batcher.shared.lock().running, 0, "every slot given back");
    }

    /// A batch that dies (here: panics, on its caller's task and then on a batch task) answers
    /// every queued caller with an error, never leaves one waiting, and gives its slots back.
    #[tokio::test]
    async fn s4_a_dead_batch_leaves_no_caller_waiting() {
        let batcher = Arc::new(Batcher::new(Batching::default().in_flight(1)));
        let calls = Arc::new(AtomicUsize::new(0));
        let run = {
            let calls = calls.clone();
            move |batch: Vec<Op>| {
                let calls = calls.clone();
                async move {
                    let _held = batch;
                    calls.fetch_add(1, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    panic!("a batch that dies");
                }
            }
        };
        let (first, first_rx) = op("a");
        let alone = {
            let (batcher, run) = (batcher.clone(), run.clone());
            tokio::spawn(async move { batcher.send(first, run).await })
        };
        tokio::task::yield_now().await;
        let mut answers = vec![first_rx];
        for key in ["b", "c"] {
            let (o, rx) = op(key);
            batcher.send(o, run.clone()).await.expect("send");
            answers.push(rx);
        }
        assert!(alone.await.is_err(), "the first caller's task panicked");
        for rx in answers {
            assert!(rx.await.is_err(), "a dead batch answers with an error");
        }
        assert_eq!(
            calls.load(Ordering::SeqCst),
            2,
            "alone, then b and c together"
        );
        assert_eq!(batcher.shared.lock().running, 0);
        // The batcher still works afterwards.
        let ok = move |batch: Vec<Op>| async move {
            for Op(_, tx) in batch {
                let _ = tx.send(7);
            }
        };
        let (o, rx) = op("e");
        batcher.send(o, ok).await.expect("send");
        assert_eq!(rx.await.expect("answered"), 7);
    }
}
