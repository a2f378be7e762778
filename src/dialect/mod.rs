//! The protocols a guarded request can speak, behind the one interface the pipeline calls.
//!
//! Each protocol owns its whole dialect in a module of its own: where its key comes from,
//! what its fingerprint covers, how its outcomes are classified, how its refusals and replays
//! are framed ([`http`], [`grpc`], [`jsonrpc`]). This module is the only place that picks one;
//! the pipeline asks a request's [`Dialect`] and never which protocol it is.

pub mod grpc;
pub(crate) mod http;
pub mod jsonrpc;

use std::sync::Arc;

use ::http::{HeaderMap, HeaderValue, Response, request::Parts};
use bytes::Bytes;

use self::http::{Admitted, Reading};
use self::jsonrpc::{Id, JsonRpc};
use crate::body::ResponseBody;
use crate::key::ScopedKey;
use crate::problem::{Problem, ProblemKind};
use crate::replay::{IDEMPOTENCY_REPLAYED, Presentation, present};
use crate::scope::MakeScope;
use crate::store::StoredResponse;

/// How a guarded request speaks, and so how it is answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Dialect {
    /// Plain HTTP: refusals as `application/problem+json`.
    Http,
    /// gRPC: refusals as trailers-only statuses.
    Grpc,
    /// A JSON-RPC call (MCP `tools/call`): every answer addressed to this call's `id`.
    JsonRpc(Arc<Id>),
}

/// A refusal before anything was claimed, framed in the request's dialect.
pub(crate) type Refusal = http::Refusal<Dialect>;

/// What a request's head says (steps 1–2), before its body is read.
pub(crate) enum Head {
    /// Read the body (step 3), then [`admit`] the request.
    Read(Pending),
    /// Not asked to be guarded: hand it on, its body unread.
    PassThrough,
    Refuse(Refusal),
}

/// What is known of a request while its body is read.
pub(crate) enum Pending {
    /// Its scoped key, from a header (HTTP, gRPC).
    Keyed(ScopedKey, Dialect),
    /// A JSON-RPC call: the body says what it is and holds its key.
    Call,
}

impl Pending {
    /// Whether the body is one message of a unary call (gRPC): read as such, a stream refused.
    pub(crate) fn reads_one_message(&self) -> bool {
        matches!(self, Self::Keyed(_, Dialect::Grpc))
    }

    /// Whom a refusal while the body is read answers.
    pub(crate) fn dialect(&self) -> Dialect {
        match self {
            Self::Keyed(_, dialect) => dialect.clone(),
            // No call to address yet: a plain HTTP problem.
            Self::Call => Dialect::Http,
        }
    }
}

/// Steps 1–2 for a request, read the way its route's dialect reads them: JSON-RPC where the
/// route has its `settings`, else HTTP or gRPC by the request's `Content-Type`.
pub(crate) fn head<M: MakeScope>(
    reading: &Reading<'_, M>,
    settings: Option<&JsonRpc>,
    parts: &Parts,
) -> Head {
    if let Some(settings) = settings {
        return match jsonrpc::reads_body(reading, settings, parts) {
            true => Head::Read(Pending::Call),
            false => Head::PassThrough,
        };
    }
    let dialect = Dialect::of(&parts.headers);
    match http::key(reading, parts) {
        Ok(Some(key)) => Head::Read(Pending::Keyed(key, dialect)),
        Ok(None) => Head::PassThrough,
        Err(refusal) => Head::Refuse(refusal.map_reply(|()| dialect)),
    }
}

/// Steps 1–4 once the body (`bytes`) is read: guard, pass on or refuse the request.
pub(crate) fn admit<M: MakeScope>(
    reading: &Reading<'_, M>,
    settings: Option<&JsonRpc>,
    parts: &Parts,
    bytes: &[u8],
    pending: Pending,
) -> Admitted<Dialect> {
    match (pending, settings) {
        (Pending::Keyed(key, dialect), _) => match http::fingerprint(reading, parts, bytes) {
            Ok(fingerprint) => Admitted::Guard {
                key,
                fingerprint,
                reply: dialect,
            },
            Err(refusal) => Admitted::Refuse(refusal.map_reply(|()| dialect)),
        },
        (Pending::Call, Some(settings)) => match jsonrpc::admit(reading, settings, parts, bytes) {
            Admitted::Guard {
                key,
                fingerprint,
                reply,
            } => Admitted::Guard {
                key,
                fingerprint,
                reply: Dialect::JsonRpc(reply),
            },
            Admitted::PassThrough => Admitted::PassThrough,
            Admitted::Refuse(refusal) => Admitted::Refuse(refusal.map_reply(Dialect::JsonRpc)),
        },
        // `head` reads a call's body only on a JSON-RPC route.
        (Pending::Call, None) => Admitted::PassThrough,
    }
}

impl Dialect {
    /// HTTP or gRPC, by the request's `Content-Type`.
    fn of(headers: &HeaderMap) -> Self {
        match grpc::is_grpc(headers) {
            true => Self::Grpc,
            false => Self::Http,
        }
    }

    /// A refusal, framed as this dialect's clients read one.
    pub(crate) fn refuse<B>(&self, problem: &Problem) -> Response<ResponseBody<B>> {
        match self {
            Self::Http => http::problem_response(problem),
            Self::Grpc => grpc::status_response(problem),
            Self::JsonRpc(id) => jsonrpc::error_response(problem, id),
        }
    }

    /// What a fingerprint mismatch tells the client its request differs in.
    pub(crate) fn covers(&self) -> &'static str {
        match self {
            Self::Http => http::COVERS,
            Self::Grpc => grpc::COVERS,
            Self::JsonRpc(_) => jsonrpc::COVERS,
        }
    }

    /// Whether responses are wrapped in the JSON envelope when the route asks for it
    /// (`asked`): for plain JSON callers only; gRPC and JSON-RPC keep their own framing.
    pub(crate) fn envelopes(&self, asked: bool) -> bool {
        asked && *self == Self::Http
    }

    /// The call whose event stream is forwarded as it arrives and watched for its final
    /// response (JSON-RPC over SSE); other dialects' bodies are read whole.
    pub(crate) fn watches(&self) -> Option<Arc<Id>> {
        match self {
            Self::JsonRpc(id) => Some(id.clone()),
            _ => None,
        }
    }

    /// What of a handler's answer is its outcome, to record or not by the route's policy.
    pub(crate) fn recording(&self, headers: &HeaderMap, body: Option<&Bytes>) -> Recording {
        let Self::JsonRpc(id) = self else {
            return Recording::AsIs;
        };
        match body {
            // The call's final response, whatever framing carried it.
            Some(bytes) => match jsonrpc::final_response(headers, bytes, id) {
                Some(message) => Recording::Call(Some(message)),
                None => Recording::Interim,
            },
            // Too large to keep: recorded without a body, like any oversized response.
            None => Recording::Call(None),
        }
    }

    /// The trailers of an answer as they are kept: without what the deny list names (as for
    /// headers); for a gRPC answer read to its end (`complete`), with `grpc-status: 2`
    /// (UNKNOWN) where it never said how the call ended, so the policy and every replay read
    /// it as the failure it is.
    pub(crate) fn stored_trailers(
        &self,
        headers: &HeaderMap,
        trailers: Option<&HeaderMap>,
        denied: &[::http::HeaderName],
        complete: bool,
    ) -> Option<HeaderMap> {
        let mut kept = trailers.cloned();
        if let Some(kept) = &mut kept {
            crate::replay::withhold(kept, denied, false);
            grpc::withhold_per_call(kept);
        }
        // gRPC-Web tells its status in a frame of its body, not in trailers: not read here.
        if complete
            && *self == Self::Grpc
            && !grpc::is_grpc_web(headers)
            && !grpc::has_status(headers, kept.as_ref())
        {
            let unknown = kept.get_or_insert_with(HeaderMap::new);
            unknown.insert(grpc::STATUS.clone(), HeaderValue::from_static("2"));
            unknown.insert(
                grpc::MESSAGE.clone(),
                HeaderValue::from_static("the server ended the call without a grpc-status"),
            );
        }
        kept
    }

    /// Whether an answer's outcome is told at its end (a gRPC status in its trailers): one too
    /// large to keep is then read to its end before it is classified.
    pub(crate) fn outcome_in_trailers(&self) -> bool {
        *self == Self::Grpc
    }

    /// Whether the head of an answer whose body was lost says anything about its outcome: a
    /// JSON-RPC call's outcome travels in the body, so its head is taken as done.
    pub(crate) fn head_tells_outcome(&self) -> bool {
        !matches!(self, Self::JsonRpc(_))
    }

    /// A replay of `stored`, as this dialect answers it: wrapped in the envelope where the
    /// route asks for one, a JSON-RPC replay addressed to the new call's `id` (and marked in
    /// its `_meta` where the route's `settings` say so); an outcome recorded without its
    /// response is refused as not stored.
    pub(crate) fn replay<B>(
        &self,
        stored: StoredResponse,
        envelope: bool,
        settings: Option<&JsonRpc>,
    ) -> Response<ResponseBody<B>> {
        let how = Presentation {
            replayed: true,
            mark: true,
            envelope: self.envelopes(envelope),
        };
        let body = match (stored.body, self) {
            (Some(body), Self::JsonRpc(id)) => {
                let mark = settings.is_some_and(|j| j.mark_replay_in_meta);
                jsonrpc::readdress(&body, id, mark)
            }
            (body, _) => body,
        };
        let Some(body) = body else {
            return self.not_stored(stored.status);
        };
        present(stored.status, stored.headers, body, stored.trailers, how)
    }

    fn not_stored<B>(&self, status: ::http::StatusCode) -> Response<ResponseBody<B>> {
        let problem = Problem::new(
            ProblemKind::ResponseNotStored,
            format!(
                "the operation completed with status {}, but its response was not recorded \
                 (it was larger than the limit for recorded responses, or its body failed \
                 after the handler answered), so it cannot be replayed; it will not run again",
                status.as_u16()
            ),
        )
        .state("completed");
        let mut res = self.refuse(&problem);
        // An answer about the recorded outcome: marked like any replay.
        res.headers_mut().insert(
            IDEMPOTENCY_REPLAYED.clone(),
            HeaderValue::from_static("true"),
        );
        res
    }
}

/// What of a handler's answer becomes the key's record.
pub(crate) enum Recording {
    /// The response as it is (HTTP, gRPC).
    AsIs,
    /// A call's final response (`None`: too large to keep), stored as
    /// [`jsonrpc::stored_call`] frames it.
    Call(Option<Bytes>),
    /// An interim answer with no final response in it: nothing to record.
    Interim,
}
