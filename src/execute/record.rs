//! Step 8: the outcome recorded (or the key given back), fenced by the lease's token, and
//! retried in the background under the same lease until it lands.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, response::Parts};
use pin_project_lite::pin_project;
use tracing::Instrument;

use crate::bounded::bounded;
use crate::detached;
use crate::dialect::Recording;
use crate::dialect::jsonrpc::{self, Events};
use crate::observe::{self, Event};
use crate::policy::{CachePolicy, Outcome};
use crate::replay::restore;
use crate::store::{
    FencingToken, IdempotencyStore, RecordStatus, ScopedKey, StoreError, StoredResponse,
};
use crate::whose::{Whose, whose};

use super::Execution;
use super::give_back::{TakenOver, Until, give_back_paced, give_back_set_aside_paced, released};
use super::retry::Retry;
use super::room::Call;

impl<St: IdempotencyStore> Execution<St> {
    /// Records a response whose body was lost after its head: as completed without a body
    /// when the policy records the status its head carries, else gives the key back. A head
    /// that carries no outcome (a gRPC head before its messages, whose status was to come in
    /// the trailers; any JSON-RPC call's) is taken as done: the handler answered, and the
    /// key is never run again (DESIGN §3). Returns the key's state.
    pub(super) async fn record_lost(&self, parts: &Parts) -> &'static str {
        let done = !self.dialect.head_tells_outcome(&parts.headers);
        self.record_without_body(parts, None, done).await
    }

    /// Records a response without its body (too large to keep, or lost after its head),
    /// classified by its final status: the trailers' where it has them, UNKNOWN for a gRPC
    /// answer without one; or taken as `done` whatever it says. Returns the key's state.
    pub(super) async fn record_without_body(
        &self,
        parts: &Parts,
        trailers: Option<&HeaderMap>,
        done: bool,
    ) -> &'static str {
        self.record_copied(parts, None, trailers, done).await
    }

    /// Records `body` under a copy of the head (the rare paths: an answer too large, broken,
    /// or recorded in another form than it is sent, as gRPC-Web's), classified as
    /// [`record_without_body`](Self::record_without_body) says. Returns the key's state.
    async fn record_copied(
        &self,
        parts: &Parts,
        body: Option<Bytes>,
        trailers: Option<&HeaderMap>,
        done: bool,
    ) -> &'static str {
        let trailers = self.dialect.stored_trailers(
            &parts.headers,
            trailers,
            &self.config.denied_headers,
            true,
        );
        let records = done
            || self.route.cache_policy.records(&Outcome {
                status: parts.status,
                headers: &parts.headers,
                trailers: trailers.as_ref(),
                jsonrpc: None,
            });
        if !records {
            return self.release().await;
        }
        let mut headers = parts.headers.clone();
        self.dialect
            .withhold(&mut headers, &self.config.denied_headers, true);
        // Without its body, an answer keeps of its trailers only its outcome: a gRPC call's
        // status (the trailers may be why it was too large to keep).
        let trailers = match body {
            Some(_) => trailers,
            None => trailers.map(outcome_only),
        };
        let stored = StoredResponse {
            status: parts.status,
            headers,
            body,
            trailers,
        };
        self.complete(&stored).await;
        RecordStatus::Completed.as_str()
    }

    /// Records an answer whose status cannot be read from its body (a compressed gRPC-Web
    /// answer) as it was sent: by the status in its head if it has one, else taken as done
    /// (the handler answered; a status the layer cannot see never runs it again).
    async fn record_opaque(&self, parts: &Parts, body: Option<Bytes>) {
        let told = crate::dialect::grpc::has_status(&parts.headers, None);
        let records = !told
            || self.route.cache_policy.records(&Outcome {
                status: parts.status,
                headers: &parts.headers,
                trailers: None,
                jsonrpc: None,
            });
        if !records {
            self.release().await;
            return;
        }
        let mut headers = parts.headers.clone();
        self.dialect
            .withhold(&mut headers, &self.config.denied_headers, body.is_some());
        let stored = StoredResponse {
            status: parts.status,
            headers,
            body,
            trailers: None,
        };
        self.complete(&stored).await;
    }

    /// Step 8: records the outcome if the route's policy keeps it, else releases the key.
    /// Hands `body` back: it moves through the record rather than being shared with it. An
    /// answer that does not `fit` the limit with its head and trailers is recorded without
    /// them, by its final status, as any response too large to keep.
    ///
    /// Decided before the first await: the common path's future waits on the store with the
    /// record alone, and the rare paths' are boxed, so the futures that wait on this one stay
    /// small.
    pub(super) fn record<'a>(
        &'a self,
        parts: &'a mut Parts,
        body: Option<Bytes>,
        trailers: Option<&'a HeaderMap>,
        fits: bool,
    ) -> RecordFuture<'a, impl Future<Output = Option<Bytes>> + 'a> {
        match self.stored(parts, body, trailers, fits) {
            Stored::Record(stored, withheld) => RecordFuture::Store {
                store: async move {
                    self.complete(&stored).await;
                    parts.headers = stored.headers;
                    restore(&mut parts.headers, withheld);
                    stored.body
                },
            },
            Stored::Rare(rare, body) => RecordFuture::Rare {
                rare: Box::pin(self.record_rare(parts, rare, trailers)),
                body: Some(body),
            },
        }
    }

    /// Records an answer off the common path (see [`record`](Self::record)).
    async fn record_rare(&self, parts: &Parts, rare: Rare, trailers: Option<&HeaderMap>) {
        match rare {
            Rare::TooLarge => {
                self.record_without_body(parts, trailers, false).await;
            }
            Rare::Release => {
                self.release().await;
            }
            Rare::Web(messages, trailers) => {
                // Kept in its gRPC form; the client still gets the answer as it was sent.
                self.record_copied(parts, Some(messages), trailers.as_ref(), false)
                    .await;
            }
            Rare::Opaque(sent) => self.record_opaque(parts, sent).await,
            Rare::NotWeb => {
                // Not gRPC-Web: its status cannot be read, so it is UNKNOWN.
                tracing::warn!("a gRPC-Web answer is not well formed; recorded as UNKNOWN");
                self.record_without_body(parts, None, false).await;
            }
            Rare::Call(message) => {
                self.record_call(parts, message, trailers).await;
            }
            Rare::Unread => self.record_unread(parts).await,
        }
    }

    /// The record of an answer and the headers withheld from it meanwhile, or, off the common
    /// path, which rare path it takes and the body to hand back.
    fn stored(
        &self,
        parts: &mut Parts,
        body: Option<Bytes>,
        trailers: Option<&HeaderMap>,
        fits: bool,
    ) -> Stored {
        if !fits {
            return Stored::Rare(Rare::TooLarge, body);
        }
        let rare = match self.dialect.recording(&parts.headers, body.as_ref()) {
            Recording::AsIs => None,
            Recording::Web(Some((messages, trailers))) => Some(Rare::Web(messages, trailers)),
            Recording::Web(None) => Some(Rare::NotWeb),
            Recording::Opaque => Some(Rare::Opaque(body.clone())),
            Recording::Call(message) => Some(Rare::Call(message)),
            Recording::Interim => Some(Rare::Release),
            Recording::Unread => Some(Rare::Unread),
        };
        if let Some(rare) = rare {
            return Stored::Rare(rare, body);
        }
        // What of the trailers may be kept: the same deny list as the headers (credentials,
        // per-call ids and trace context never reach a retry nor the store). A gRPC answer
        // that never said how the call ended is UNKNOWN, not a success.
        let trailers = self.dialect.stored_trailers(
            &parts.headers,
            trailers,
            &self.config.denied_headers,
            body.is_some(),
        );
        let records = self.route.cache_policy.records(&Outcome {
            status: parts.status,
            headers: &parts.headers,
            trailers: trailers.as_ref(),
            jsonrpc: None,
        });
        if !records {
            return Stored::Rare(Rare::Release, body);
        }
        // The live headers are lent to the record, not copied; the ones never recorded step
        // aside meanwhile.
        let mut headers = std::mem::take(&mut parts.headers);
        // A whole body's length is recomputed by the server, as for replays; a body too large
        // to keep streams on with the length its handler gave.
        let withheld =
            self.dialect
                .withhold(&mut headers, &self.config.denied_headers, body.is_some());
        let stored = StoredResponse {
            status: parts.status,
            headers,
            body,
            trailers,
        };
        Stored::Record(stored, withheld)
    }

    /// Settles a call whose event stream ended, or broke, without its response: the key goes
    /// back where the stream said so (an interim result, or the server could not read the
    /// call); otherwise the server took the call and answers it elsewhere (a resumed stream),
    /// and it is recorded as [`record_unread`](Self::record_unread) says.
    pub(super) async fn record_unanswered(&self, parts: &Parts, events: &Events) {
        if events.gives_back() {
            self.release().await;
        } else {
            self.record_unread(parts).await;
        }
    }

    /// Records a call the server took whose response this layer could not read (its event
    /// stream ended, or broke, without it; or the answer came compressed): under a success
    /// status, done whatever the route's policy says, as any answer whose head arrived and
    /// told no outcome (DESIGN §3), so it never runs again. An error status is an outcome the
    /// policy classifies (a 503 stream from an overloaded proxy gives the key back under
    /// `DefinitiveOnly`).
    async fn record_unread(&self, parts: &Parts) {
        if parts.status.is_success() || self.keeps_unread(parts, None) {
            self.complete(&jsonrpc::stored_unread(parts)).await;
        } else {
            self.release().await;
        }
    }

    /// Whether the route's policy keeps a JSON-RPC answer whose message it cannot read (too
    /// large to keep, or an event stream without the call's response): under
    /// `DefinitiveOnly`, only under a success status, as an answer read whole (DESIGN §3), so
    /// that the limit never decides whether a call runs again.
    fn keeps_unread(&self, parts: &Parts, trailers: Option<&HeaderMap>) -> bool {
        match &self.route.cache_policy {
            CachePolicy::DefinitiveOnly => parts.status.is_success(),
            policy => policy.records(&Outcome {
                status: parts.status,
                headers: &parts.headers,
                trailers,
                jsonrpc: None,
            }),
        }
    }

    /// Records a call's final response (`None`: too large to keep), or releases the key when
    /// the policy does not record it.
    pub(super) async fn record_call(
        &self,
        parts: &Parts,
        message: Option<Bytes>,
        trailers: Option<&HeaderMap>,
    ) {
        let records = match message.as_deref() {
            Some(message) => self.route.cache_policy.records(&Outcome {
                status: parts.status,
                headers: &parts.headers,
                trailers,
                jsonrpc: Some(message),
            }),
            // Too large to read.
            None => self.keeps_unread(parts, trailers),
        };
        if records {
            self.complete(&jsonrpc::stored_call(message, parts.status))
                .await;
        } else {
            self.release().await;
        }
    }

    /// Records `stored`, fenced. When the store fails, the outcome is not dropped: the record
    /// is marked uncertain if the store takes that, and a task of its own keeps the lease
    /// renewed and retries the write with bounded backoff until it lands or is fenced (another
    /// holder's, or a resolved, outcome stands). Retries meanwhile get 409, never a second run.
    async fn complete(&self, stored: &StoredResponse) {
        let store = self.store();
        let mut retry = Retry::new(self.route.lease);
        let write = store.complete(&self.key, self.lease.token, stored, self.route.ttl);
        let result = retry.bounded(write).await;
        // Only a fenced write is final: another holder's, or a resolved, outcome stands (unless
        // the record says the store fenced by mistake). Any other failure (`Busy` included: a
        // store's row lock is let go) leaves the effect unrecorded, so it is kept and retried
        // like an outage.
        let error = match result {
            Ok(()) => return,
            Err(error) => error,
        };
        if matches!(error, StoreError::Fenced) {
            let (key, token) = (&self.key, self.lease.token);
            if !Box::pin(still_ours(&**store, key, token, retry.each())).await {
                return settle(Err(StoreError::Fenced), "record the outcome");
            }
        }
        observe::count(Event::StoreError);
        tracing::error!(
            %error,
            "could not record the outcome; keeping the lease and retrying until it lands"
        );
        // Should this process die before the write lands, the key stays "outcome unknown"
        // instead of running again when the lease expires.
        if bounded(
            retry.each(),
            store.mark_uncertain(&self.key, self.lease.token),
        )
        .await
        .is_ok()
        {
            observe::count(Event::MovedToReconciliation);
        }
        let recorder = Recorder {
            store: store.clone(),
            key: self.key.clone(),
            token: self.lease.token,
            stored: Arc::new(stored.clone()),
            ttl: self.route.ttl,
            retry,
        };
        self.held_while(recorder.run());
    }

    /// Gives the key back; the store keeps it for reconciliation instead if the effect had
    /// started. Returns the state the key is left in, for the client's answer.
    pub(super) async fn release(&self) -> &'static str {
        let (store, key, token) = (self.store(), &self.key, self.lease.token);
        let mut retry = Retry::new(self.route.lease);
        match retry.bounded(store.release(key, token)).await {
            Ok(status) => {
                released(status);
                status.as_str()
            }
            // Taken over, settled, or only set aside meanwhile: a task of its own gives it
            // back if it was only set aside (see `give_back_set_aside`).
            Err(StoreError::Fenced) => {
                self.give_back_set_aside_later(retry);
                "in_progress"
            }
            Err(error) => {
                settle(Err(error), "release the key");
                self.release_later(retry);
                "in_progress"
            }
        }
    }

    /// Tries a failed release again on a task of its own until it lands or is fenced, with the
    /// lease kept renewed meanwhile, as a failed record is (DESIGN §4): left to lapse, it
    /// would have the next claim decide, which on a route that reconciles sets the key aside
    /// though the handler's outcome said a retry may run it again. Retries meanwhile find the
    /// key in flight.
    fn release_later(&self, mut retry: Retry) {
        let (store, key, token) = (self.store().clone(), self.key.clone(), self.lease.token);
        self.held_while(async move {
            retry.pause(Duration::MAX).await;
            give_back_paced(&store, &key, token, retry, Until::Lands, "the key").await;
        });
    }

    /// After a fenced release: gives the key back on a task of its own if it was only set
    /// aside behind this holder (see [`give_back_set_aside`]). The lease is held meanwhile, in
    /// case the store fenced by mistake and the key is still this holder's: it is then given
    /// back as a failed release is, not left in flight.
    fn give_back_set_aside_later(&self, retry: Retry) {
        let (store, key, token) = (self.store().clone(), self.key.clone(), self.lease.token);
        self.held_while(async move {
            give_back_set_aside_paced(&store, &key, token, retry, TakenOver::Counted).await;
        });
    }

    /// Runs `work` (a write after the run, tried until it settles) on a task of its own, in
    /// this request's span, with the lease kept renewed until it ends. Without a runtime
    /// (shutting down) nothing runs: the lease runs out, and the record stays as the store has
    /// it.
    fn held_while(&self, work: impl Future<Output = ()> + Send + 'static) {
        // The run's hold may have renewed the lease last up to a third of a lease ago: this
        // one renews it at the keeper's next wake, so the write keeps the four tries before
        // the lease runs out that the run had. Counted from now, its first renewal would come
        // a third of a lease late, and three refusals would let the lease lapse under it.
        let hold = self
            .keeper
            .hold_at_once(&self.key, self.lease.token, self.route.lease);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let pending = observe::PendingWrite::begin();
            let held = async move {
                work.await;
                drop(hold);
                drop(pending);
            };
            detached::spawn(&runtime, held.in_current_span());
        }
    }
}

/// Counts and logs a failed write after the claim. A fenced write means another holder took
/// the key over: its outcome, not ours, is the record.
fn settle(result: Result<(), StoreError>, what: &str) {
    match result {
        Ok(()) => {}
        Err(StoreError::Fenced) => {
            observe::count(Event::StaleWrite);
            tracing::warn!("could not {what}: the lease was taken over");
        }
        Err(error) => {
            observe::count(Event::StoreError);
            tracing::error!(%error, "could not {what}");
        }
    }
}

/// After a write was fenced: whether the record is, all the same, still this holder's to
/// record (in flight or set aside under its token; see [`crate::whose`]). A read that fails
/// says nothing: the write is tried again, and a fenced one read again.
async fn still_ours<St: IdempotencyStore>(
    store: &St,
    key: &ScopedKey,
    token: FencingToken,
    each: Duration,
) -> bool {
    whose(store, key, token, each)
        .await
        .map_or(true, Whose::ours)
}

/// Retries a failed record until it lands (run with the lease held: see
/// [`Execution::held_while`]).
struct Recorder<St> {
    store: Arc<St>,
    key: ScopedKey,
    token: FencingToken,
    stored: Arc<StoredResponse>,
    ttl: Duration,
    /// The tries so far, the first one included.
    retry: Retry,
}

impl<St: IdempotencyStore> Recorder<St> {
    async fn run(mut self) {
        loop {
            self.retry.pause(Duration::MAX).await;
            let (store, key, stored) = (self.store.clone(), self.key.clone(), self.stored.clone());
            let (token, ttl) = (self.token, self.ttl);
            let write = async move { store.complete(&key, token, &stored, ttl).await };
            // Each try on a task of its own: one given up on runs on (see `retry`).
            let whose = match self.retry.spawned(Call::Complete, write).await {
                Ok(()) => {
                    let tries = self.retry.tries();
                    tracing::info!(tries, "the outcome is recorded after the store recovered");
                    break;
                }
                Err(StoreError::Fenced) => {
                    self.retry.whose(&self.store, &self.key, self.token).await
                }
                Err(_) => {
                    observe::count(Event::StoreError);
                    continue;
                }
            };
            match whose {
                Ok(whose) if !whose.ours() => {
                    settle(Err(StoreError::Fenced), "record the outcome");
                    break;
                }
                // Still this holder's (fenced by mistake), or the read failed: tried again.
                _ => observe::count(Event::StoreError),
            }
        }
    }
}

/// An answer made ready for the store (see [`Execution::stored`]).
enum Stored {
    /// The record, and the headers withheld from it meanwhile.
    Record(StoredResponse, Vec<(http::HeaderName, http::HeaderValue)>),
    /// Off the common path: which one, and the body to hand back.
    Rare(Rare, Option<Bytes>),
}

/// An answer's recording off the common path (see [`Execution::record`]).
enum Rare {
    /// Too large to keep with its head and trailers: recorded without them.
    TooLarge,
    /// Nothing to record (the route's policy keeps no such answer, or an interim one): the key
    /// is given back.
    Release,
    /// A gRPC-Web answer, kept in its gRPC form: messages and trailers.
    Web(Bytes, Option<HeaderMap>),
    /// Not well-formed gRPC-Web: its status cannot be read.
    NotWeb,
    /// A gRPC-Web answer that cannot be read (compressed whole), kept as it was sent.
    Opaque(Option<Bytes>),
    /// A JSON-RPC call's final response (`None`: too large to keep).
    Call(Option<Bytes>),
    /// A JSON-RPC call the server took whose response could not be read.
    Unread,
}

pin_project! {
    /// The future of [`Execution::record`]: the common path's, or a rare path's, boxed.
    #[project = RecordProj]
    pub(crate) enum RecordFuture<'a, F> {
        Store { #[pin] store: F },
        Rare {
            rare: Pin<Box<dyn Future<Output = ()> + Send + 'a>>,
            body: Option<Option<Bytes>>,
        },
    }
}

impl<F: Future<Output = Option<Bytes>>> Future for RecordFuture<'_, F> {
    type Output = Option<Bytes>;

    fn poll(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        match self.project() {
            RecordProj::Store { store } => store.poll(cx),
            RecordProj::Rare { rare, body } => {
                std::task::ready!(rare.as_mut().poll(cx));
                std::task::Poll::Ready(body.take().flatten())
            }
        }
    }
}

/// Of a record's trailers, what tells its outcome: the gRPC status, and its message where it
/// is short.
fn outcome_only(trailers: HeaderMap) -> HeaderMap {
    let mut kept = HeaderMap::new();
    if let Some(status) = trailers.get(&crate::dialect::grpc::STATUS) {
        kept.insert(crate::dialect::grpc::STATUS.clone(), status.clone());
    }
    if let Some(message) = trailers
        .get(&crate::dialect::grpc::MESSAGE)
        .filter(|m| m.len() <= 1024)
    {
        kept.insert(crate::dialect::grpc::MESSAGE.clone(), message.clone());
    }
    kept
}
