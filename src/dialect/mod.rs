//! The protocols a guarded request can speak, behind the one interface the pipeline calls.
//!
//! Each protocol owns its whole dialect in a module of its own: where its key comes from,
//! what its fingerprint covers, how its outcomes are classified, how its refusals and replays
//! are framed ([`http`], [`grpc`], [`grpc_web`], [`jsonrpc`]); [`coding`] keeps what they
//! record readable by every retry. This module is the only place that picks one;
//! the pipeline asks a request's [`Dialect`] and never which protocol it is.

pub(crate) mod coding;
pub mod grpc;
pub(crate) mod grpc_web;
pub(crate) mod http;
pub mod jsonrpc;
pub(crate) mod rpc_status;

use std::sync::Arc;

use ::http::{HeaderMap, HeaderValue, Response, request::Parts};
use bytes::Bytes;

use self::http::{Admitted, Reading};
use self::jsonrpc::{Id, JsonRpc};
use crate::body::ResponseBody;
use crate::fingerprint::Fingerprint;
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
    /// gRPC-Web: the status in the body's trailer frame; answers in base64 when `text` (the
    /// request's `Accept` asks for `application/grpc-web-text`).
    GrpcWeb { text: bool },
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
    /// Whether the body is one message of a unary call (gRPC, gRPC-Web): read as such, a
    /// stream refused.
    pub(crate) fn reads_one_message(&self) -> bool {
        matches!(
            self,
            Self::Keyed(_, Dialect::Grpc | Dialect::GrpcWeb { .. })
        )
    }

    /// The key, where the head holds it (not a JSON-RPC call's, which its body holds).
    pub(crate) fn key(&self) -> Option<&ScopedKey> {
        match self {
            Self::Keyed(key, _) => Some(key),
            Self::Call => None,
        }
    }

    /// Whom a refusal while the body is read answers.
    pub(crate) fn dialect(&self) -> Dialect {
        match self {
            Self::Keyed(_, dialect) => dialect.clone(),
            // A JSON-RPC error object, as every refusal on the route is; its id is `null`, as
            // JSON-RPC 2.0 says where the request's id could not be read (DESIGN §8).
            Self::Call => Dialect::JsonRpc(Arc::new(Id::null())),
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
    trailers: Option<&HeaderMap>,
    bytes: &[u8],
    pending: Pending,
    recorded: Option<&Fingerprint>,
) -> Admitted<Dialect> {
    match (pending, settings) {
        (Pending::Keyed(key, dialect), _) => {
            match http::fingerprint(reading, parts, trailers, bytes, recorded) {
                Ok(fingerprint) => Admitted::Guard {
                    key,
                    fingerprint,
                    reply: dialect,
                },
                Err(refusal) => Admitted::RefuseKeyed(refusal.map_reply(|()| dialect), key),
            }
        }
        (Pending::Call, Some(settings)) => {
            match jsonrpc::admit(reading, settings, parts, trailers, bytes) {
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
                Admitted::RefuseKeyed(refusal, key) => {
                    Admitted::RefuseKeyed(refusal.map_reply(Dialect::JsonRpc), key)
                }
            }
        }
        // `head` reads a call's body only on a JSON-RPC route.
        (Pending::Call, None) => Admitted::PassThrough,
    }
}

/// A message's `Content-Type`, as bytes (empty without one): what tells the dialects apart.
pub(crate) fn content_type(headers: &HeaderMap) -> &[u8] {
    crate::lines::get(headers, &::http::header::CONTENT_TYPE)
        .map_or(&b""[..], HeaderValue::as_bytes)
}

impl Dialect {
    /// HTTP, gRPC or gRPC-Web, by the request's `Content-Type`.
    pub(crate) fn of(headers: &HeaderMap) -> Self {
        // One lookup for both: every request asks.
        let content_type = content_type(headers);
        if grpc_web::is_grpc_web(content_type) {
            return Self::GrpcWeb {
                text: grpc_web::answers_text(headers),
            };
        }
        match grpc::is_grpc(content_type) {
            true => Self::Grpc,
            false => Self::Http,
        }
    }

    /// Whether the call's outcome is a gRPC status (gRPC, gRPC-Web).
    fn has_grpc_status(&self) -> bool {
        matches!(self, Self::Grpc | Self::GrpcWeb { .. })
    }

    /// A refusal, framed as this dialect's clients read one.
    pub(crate) fn refuse<B>(&self, problem: &Problem) -> Response<ResponseBody<B>> {
        match self {
            Self::Http => http::problem_response(problem),
            Self::Grpc => {
                grpc::status_response(problem, HeaderValue::from_static("application/grpc"))
            }
            Self::GrpcWeb { text } => grpc::status_response(problem, grpc_web::content_type(*text)),
            Self::JsonRpc(id) => jsonrpc::error_response(problem, id),
        }
    }

    /// What a fingerprint mismatch tells the client its request differs in.
    pub(crate) fn covers(&self) -> &'static str {
        match self {
            Self::Http => http::COVERS,
            Self::Grpc | Self::GrpcWeb { .. } => grpc::COVERS,
            Self::JsonRpc(_) => jsonrpc::COVERS,
        }
    }

    /// Makes a guarded request ask for its answer uncompressed, so that what is recorded can
    /// be read by every retry (see [`coding`]).
    pub(crate) fn ask_identity(&self, headers: &mut HeaderMap) {
        match self {
            Self::Http | Self::JsonRpc(_) => coding::ask_identity_http(headers),
            Self::Grpc => coding::ask_identity_grpc(headers),
            Self::GrpcWeb { .. } => {
                coding::ask_identity_grpc(headers);
                coding::ask_identity_http(headers);
            }
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
        if let (Self::GrpcWeb { .. }, Some(body)) = (self, body) {
            if unreadable(headers) {
                return Recording::Opaque;
            }
            // Kept in its gRPC form: messages as the body, the trailer frame as trailers.
            return Recording::Web(grpc_web::split(body, grpc_web::is_text(headers)));
        }
        let Self::JsonRpc(id) = self else {
            return Recording::AsIs;
        };
        if unreadable(headers) {
            // Compressed all the same: the call's response cannot be read, but it was answered.
            return Recording::Unread;
        }
        match body {
            // The call's final response, whatever framing carried it.
            Some(bytes) => match jsonrpc::final_response(headers, bytes, id) {
                jsonrpc::Answer::Final(message) => Recording::Call(Some(message)),
                jsonrpc::Answer::NotFinal => Recording::Interim,
                jsonrpc::Answer::Unseen => Recording::Unread,
            },
            // Too large to keep: recorded without a body, like any oversized response.
            None => Recording::Call(None),
        }
    }

    /// Takes out of an answer's head what is never recorded, to be put back into the live
    /// answer with [`crate::replay::restore`]: what the deny list names (see
    /// [`crate::replay::withhold`]) and, for a gRPC answer, its per-call metadata, which a
    /// trailers-only answer carries in its head.
    pub(crate) fn withhold(
        &self,
        headers: &mut HeaderMap,
        denied: &crate::replay::DeniedHeaders,
        drop_length: bool,
    ) -> Vec<(::http::HeaderName, HeaderValue)> {
        let mut withheld = crate::replay::withhold(headers, denied, drop_length);
        if self.has_grpc_status() {
            grpc::lend_per_call(headers, &mut withheld);
        }
        withheld
    }

    /// The trailers of an answer as they are kept: without what the deny list names (as for
    /// headers); for a gRPC answer read to its end (`complete`), with `grpc-status: 2`
    /// (UNKNOWN) where it never said how the call ended, so the policy and every replay read
    /// it as the failure it is.
    pub(crate) fn stored_trailers(
        &self,
        headers: &HeaderMap,
        trailers: Option<&HeaderMap>,
        denied: &crate::replay::DeniedHeaders,
        complete: bool,
    ) -> Option<HeaderMap> {
        let mut kept = trailers.cloned();
        if let Some(kept) = &mut kept {
            crate::replay::withhold(kept, denied, false);
            grpc::withhold_per_call(kept);
        }
        if complete && self.has_grpc_status() && !grpc::has_status(headers, kept.as_ref()) {
            let unknown = kept.get_or_insert_with(HeaderMap::new);
            unknown.insert(grpc::STATUS.clone(), HeaderValue::from_static("2"));
            unknown.insert(
                grpc::MESSAGE.clone(),
                HeaderValue::from_static("the server ended the call without a grpc-status"),
            );
        }
        kept
    }

    /// Whether the status of an answer in this dialect cannot be read from its body: a
    /// gRPC-Web answer compressed as a whole (`Content-Encoding`). It is then taken as done by
    /// its head, never run again on a status the layer cannot see.
    pub(crate) fn opaque(&self, headers: &HeaderMap) -> bool {
        matches!(self, Self::GrpcWeb { .. }) && unreadable(headers)
    }

    /// Whether an answer's outcome is told at its end (a gRPC status in its trailers, or in
    /// gRPC-Web's trailer frame): one too large to keep is then read to its end before it is
    /// classified.
    pub(crate) fn outcome_in_trailers(&self) -> bool {
        self.has_grpc_status()
    }

    /// A reader of a gRPC-Web answer's frames as they pass, for its trailer frame.
    pub(crate) fn web_frames(&self, headers: &HeaderMap) -> Option<grpc_web::Frames> {
        match self {
            Self::GrpcWeb { .. } if !unreadable(headers) => Some(grpc_web::Frames::new(
                grpc_web::is_text(headers),
                grpc_web::STREAMED_TRAILERS_MAX,
            )),
            _ => None,
        }
    }

    /// Whether `head`, the head of an answer whose body was lost, says how it ended: an HTTP
    /// status does; a gRPC call's status travels in its trailers, so only a trailers-only head
    /// has one; a JSON-RPC call's outcome travels in the body. A head that says nothing is
    /// taken as done (DESIGN §3: once a head is returned, the key is never given back).
    pub(crate) fn head_tells_outcome(&self, head: &HeaderMap) -> bool {
        match self {
            Self::Http => true,
            Self::Grpc | Self::GrpcWeb { .. } => grpc::has_status(head, None),
            Self::JsonRpc(_) => false,
        }
    }

    /// A replay of `stored` to a retry whose head is `request`, as this dialect answers it:
    /// wrapped in the envelope where the route asks for one, a JSON-RPC replay addressed to
    /// the new call's `id` (and marked in its `_meta` where the route's `settings` say so), a
    /// gRPC-Web replay framed for the retry's `Accept`. Trailers pass the deny list
    /// (`denied`) again: a record may predate it. An outcome recorded without its response is
    /// refused as not stored, one in a coding the retry does not accept as such.
    pub(crate) fn replay<B>(
        &self,
        stored: StoredResponse,
        request: &HeaderMap,
        envelope: bool,
        settings: Option<&JsonRpc>,
        denied: &crate::replay::DeniedHeaders,
    ) -> Response<ResponseBody<B>> {
        let how = Presentation {
            replayed: true,
            mark: true,
            envelope: self.envelopes(envelope),
        };
        let StoredResponse {
            status,
            mut headers,
            body,
            mut trailers,
        } = stored;
        let Some(body) = body else {
            return self.not_stored(status, &headers, trailers.as_ref());
        };
        if let Some(coding) = self.unaccepted(request, &headers) {
            return self.answered(&not_accepted(&coding));
        }
        // A record written by a replica or a version that let them through may hold headers
        // this layer never replays.
        crate::replay::withhold(&mut headers, denied, false);
        if let Some(kept) = &mut trailers {
            crate::replay::withhold(kept, denied, false);
            grpc::withhold_per_call(kept);
        }
        // A record made before per-call metadata was kept out of heads may still hold some.
        if self.has_grpc_status() {
            grpc::withhold_per_call(&mut headers);
        }
        let body = match self {
            Self::JsonRpc(id) => {
                let mark = settings.is_some_and(|j| j.mark_replay_in_meta);
                match jsonrpc::readdress(&body, id, mark) {
                    Some(body) => body,
                    None => return self.not_stored(status, &headers, None),
                }
            }
            // Kept as sent: replayed as sent, to retries that accept its coding and ask for
            // its framing (a compressed body cannot be framed again).
            Self::GrpcWeb { text } if unreadable(&headers) => {
                let sent_text = grpc_web::is_text(&headers);
                if sent_text != *text {
                    let framing = match sent_text {
                        true => "application/grpc-web-text",
                        false => "application/grpc-web",
                    };
                    return self.answered(&framing_not_accepted(framing));
                }
                body
            }
            Self::GrpcWeb { text } => {
                headers.insert(::http::header::CONTENT_TYPE, grpc_web::content_type(*text));
                grpc_web::join(&body, trailers.take().as_ref(), *text)
            }
            Self::Http | Self::Grpc => body,
        };
        present(status, headers, body, trailers, how)
    }

    /// The coding of a recorded answer that a retry does not accept, if any.
    fn unaccepted(&self, request: &HeaderMap, stored: &HeaderMap) -> Option<String> {
        match self {
            Self::Http | Self::JsonRpc(_) => coding::unaccepted_http(request, stored),
            Self::Grpc => coding::unaccepted_grpc(request, stored),
            Self::GrpcWeb { .. } => coding::unaccepted_grpc(request, stored)
                .or_else(|| coding::unaccepted_http(request, stored)),
        }
    }

    fn not_stored<B>(
        &self,
        status: ::http::StatusCode,
        headers: &HeaderMap,
        trailers: Option<&HeaderMap>,
    ) -> Response<ResponseBody<B>> {
        if matches!(self, Self::JsonRpc(_))
            && let Some(detail) = jsonrpc::unread_detail(headers)
        {
            // The outcome is not known here: a new key would run the call again.
            let problem = Problem::new(ProblemKind::ResponseNotStored, detail)
                .state("completed")
                .keep_key();
            return self.answered(&problem);
        }
        // A gRPC call's outcome is its gRPC status, where the record has it.
        let grpc_status = trailers
            .and_then(|t| t.get(&grpc::STATUS))
            .and_then(|v| v.to_str().ok());
        let outcome = match grpc_status {
            Some(code) if self.has_grpc_status() => format!("gRPC status {code}"),
            _ => format!("status {}", status.as_u16()),
        };
        // A JSON-RPC answer may also be one this layer could not read as the call's response.
        let unread = match self {
            Self::JsonRpc(_) => ", it could not be read as the call's JSON-RPC response,",
            _ => "",
        };
        let problem = Problem::new(
            ProblemKind::ResponseNotStored,
            format!(
                "the operation completed with {outcome}, but its response was not recorded \
                 (it was larger than the limit for recorded responses{unread} or its body \
                 failed after the handler answered), so it cannot be replayed; it will not run \
                 again"
            ),
        )
        .state("completed");
        self.answered(&problem)
    }

    /// A refusal that answers about the recorded outcome: marked like any replay.
    fn answered<B>(&self, problem: &Problem) -> Response<ResponseBody<B>> {
        let mut res = self.refuse(problem);
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
    /// A gRPC-Web answer in its gRPC form, messages and trailers (`None`: not gRPC-Web).
    Web(Option<(Bytes, Option<HeaderMap>)>),
    /// A gRPC-Web answer whose body cannot be read (compressed as a whole): kept as it was
    /// sent, classified by its head, and taken as done where the head tells nothing.
    Opaque,
    /// A call's final response (`None`: too large to keep), stored as
    /// [`jsonrpc::stored_call`] frames it.
    Call(Option<Bytes>),
    /// An interim answer with no final response in it: nothing to record.
    Interim,
    /// A call the server took whose response cannot be read (it went elsewhere, or came
    /// compressed): taken as done, as [`jsonrpc::stored_unread`] frames it.
    Unread,
}

/// Whether a body is in a content coding (`Content-Encoding` other than identity), so that
/// its frames cannot be read without decoding it.
fn unreadable(headers: &HeaderMap) -> bool {
    coding(headers).is_some()
}

/// The content coding a body is in (`Content-Encoding` other than identity), if any.
fn coding(headers: &HeaderMap) -> Option<&HeaderValue> {
    headers
        .get_all(::http::header::CONTENT_ENCODING)
        .iter()
        .find(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"))
}

/// The answer to a retry that does not accept the recorded answer's `coding`.
fn not_accepted(coding: &str) -> Problem {
    Problem::new(
        ProblemKind::EncodingNotAccepted,
        format!(
            "the operation completed, but its recorded response is encoded as {coding:?}, \
             which this request does not accept; retry with the same key accepting {coding:?} \
             (Accept-Encoding, or grpc-accept-encoding for gRPC); it will not run again"
        ),
    )
    .state("completed")
}

/// A compressed gRPC-Web answer recorded in one framing, asked for in the other.
fn framing_not_accepted(framing: &str) -> Problem {
    Problem::new(
        ProblemKind::EncodingNotAccepted,
        format!(
            "the operation completed, but its recorded response is compressed in the {framing} \
             framing, which cannot be framed again and which this request does not ask for; \
             retry with the same key asking for it (Accept: {framing}); it will not run again"
        ),
    )
    .state("completed")
}

#[cfg(test)]
mod tests {
    use http::{HeaderMap, HeaderValue, StatusCode};

    use super::Dialect;
    use crate::replay::{DeniedHeaders, default_denied_headers, restore};
    use crate::store::StoredResponse;

    const PER_CALL: [&str; 3] = ["grpc-trace-bin", "grpc-tags-bin", "grpc-server-stats-bin"];

    /// A trailers-only gRPC answer: its status and its per-call metadata in one head.
    fn trailers_only_head() -> HeaderMap {
        let mut head = HeaderMap::new();
        head.insert("content-type", HeaderValue::from_static("application/grpc"));
        head.insert("grpc-status", HeaderValue::from_static("5"));
        head.insert("x-kept", HeaderValue::from_static("yes"));
        for name in PER_CALL {
            head.append(name, HeaderValue::from_static("CQE"));
            head.append(name, HeaderValue::from_static("CQM"));
        }
        head
    }

    /// DESIGN §1 (replays never carry per-request ids), gRPC: per-call metadata in an answer's
    /// head (a trailers-only answer, or initial metadata) is kept out of the record and
    /// given back to the live answer whole, both values of a repeated entry included; an HTTP
    /// answer's headers of those names are only headers, and kept.
    #[test]
    fn s1_per_call_metadata_in_a_grpc_head_is_lent_not_recorded() {
        let denied = DeniedHeaders::new(default_denied_headers());
        for dialect in [Dialect::Grpc, Dialect::GrpcWeb { text: false }] {
            let mut head = trailers_only_head();
            let withheld = dialect.withhold(&mut head, &denied, true);
            for name in PER_CALL {
                assert!(!head.contains_key(name), "{dialect:?} recorded {name}");
            }
            assert_eq!(head["grpc-status"], "5");
            assert_eq!(head["x-kept"], "yes");
            restore(&mut head, withheld);
            assert_eq!(
                head,
                trailers_only_head(),
                "{dialect:?}: the live answer, whole"
            );
        }
        let mut head = trailers_only_head();
        let withheld = Dialect::Http.withhold(&mut head, &denied, true);
        assert!(withheld.is_empty());
        assert_eq!(head, trailers_only_head());
    }

    /// A record that kept per-call metadata in its head (made before it was kept out) is
    /// replayed without it.
    #[test]
    fn s1_a_grpc_replay_drops_per_call_metadata_its_record_kept() {
        let denied = DeniedHeaders::new(default_denied_headers());
        let stored = StoredResponse {
            status: StatusCode::OK,
            headers: trailers_only_head(),
            body: Some(bytes::Bytes::new()),
            trailers: None,
        };
        let replay = Dialect::Grpc.replay::<http_body_util::Empty<bytes::Bytes>>(
            stored,
            &HeaderMap::new(),
            false,
            None,
            &denied,
        );
        for name in PER_CALL {
            assert!(!replay.headers().contains_key(name), "replayed {name}");
        }
        assert_eq!(replay.headers()["grpc-status"], "5");
        assert_eq!(replay.headers()["x-kept"], "yes");
    }
}
