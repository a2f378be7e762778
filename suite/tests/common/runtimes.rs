//! Runtimes built by hand, as applications and their test suites build them, and a watchdog
//! on the wall clock (a paused tokio clock cannot guard itself).

use std::time::Duration;

/// Runs `f` on an OS thread of its own; fails the test if it has not returned within `limit`
/// of wall-clock time.
pub fn on_thread<T: Send + 'static>(
    what: &str,
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(what.to_owned())
        .spawn(move || {
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
            let _ = tx.send(out);
        })
        .expect("thread");
    match rx.recv_timeout(limit) {
        Ok(Ok(out)) => out,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("{what}: hung for {limit:?}"),
    }
}

/// What `#[tokio::test]` builds.
pub fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// What `#[tokio::test(start_paused = true)]` builds.
pub fn paused() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("runtime")
}

/// A multi-threaded runtime with `workers` worker threads.
pub fn multi_thread(workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("runtime")
}
