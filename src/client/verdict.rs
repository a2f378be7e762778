//! What an answer means for the caller, whatever its protocol: the verdict [`super::retry`]
//! (HTTP) and [`super::grpc`] reach, and the call acts on.

use std::time::Duration;

/// What to do after an attempt's answer.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// A definite answer: the operation's outcome (`replayed`: recorded earlier).
    Done { replayed: bool },
    /// The first request with this key is still running: wait, then ask again.
    InFlight { retry_after: Option<Duration> },
    /// Nothing definite, and asking again with the same key is safe: a store that was down,
    /// an outcome the server did not record.
    Retry { retry_after: Option<Duration> },
    /// The key was used for another request.
    KeyReused,
    /// Whether it took effect is unknown: a reconciliation settles it.
    OutcomeUnknown,
}
