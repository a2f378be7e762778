//! A store call given at most so long, its timer armed only once it has to wait.
//!
//! Every write a holder makes after its run (the record, marking it uncertain, a give-back) is
//! bounded: a call stuck on a dead connection must not hold the lease, renewed, for ever (see
//! `execute::retry`). Most calls answer at their first poll (MemoryStore's always do); those
//! never read the clock nor arm a timer, so the bound costs the hot path nothing. (A try after a
//! write failed, on a task of its own, is off the hot path.)

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use pin_project_lite::pin_project;
use tokio::time::Sleep;

use crate::store::StoreError;

pin_project! {
    /// The future of [`bounded`].
    pub(crate) struct Bounded<F> {
        #[pin]
        call: F,
        limit: Duration,
        timer: Option<Pin<Box<Sleep>>>,
    }
}

/// `call`, failed as unavailable if it has not answered within `limit` of its first wait.
pub(crate) fn bounded<F>(limit: Duration, call: F) -> Bounded<F> {
    Bounded {
        call,
        limit,
        timer: None,
    }
}

impl<F, T> Future for Bounded<F>
where
    F: Future<Output = Result<T, StoreError>>,
{
    type Output = Result<T, StoreError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(answer) = this.call.poll(cx) {
            return Poll::Ready(answer);
        }
        let limit = *this.limit;
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        ready!(timer.as_mut().poll(cx));
        Poll::Ready(Err(StoreError::unavailable(
            "the store did not answer in time",
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_call_that_answers_is_passed_through() {
        let answer = bounded(Duration::from_millis(10), async { Ok::<_, StoreError>(7) }).await;
        assert_eq!(answer.ok(), Some(7));
        let waited = bounded(Duration::from_secs(30), async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok::<_, StoreError>(8)
        })
        .await;
        assert_eq!(waited.ok(), Some(8), "answered within the bound");
    }

    #[tokio::test]
    async fn a_call_that_hangs_fails_as_unavailable_at_the_bound() {
        let hung = bounded(
            Duration::from_millis(50),
            std::future::pending::<Result<(), StoreError>>(),
        );
        let answer = tokio::time::timeout(Duration::from_secs(20), hung)
            .await
            .expect("the bound ends the call");
        assert!(
            matches!(answer, Err(StoreError::Unavailable(_))),
            "{answer:?}"
        );
    }
}
