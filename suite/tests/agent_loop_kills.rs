//! Issue 22's proof with a PostgreSQL store and server processes killed mid-request: the agent
//! loop of `examples/agent_loop` (one implementation), with 300 steps per client. Ours must make
//! every step's effect exactly once, counted at the sink, and end every step with its answer,
//! the outcome-unknown ones after a reconciliation. The naive client with a new key per attempt
//! must show duplicates: if it did not, the faults would not be biting and the run would prove
//! nothing.
//!
//! Without a test harness: the binary is both the loop and the server it kills.

mod common;

use common::faulty;

#[path = "../examples/agent_loop/demo.rs"]
mod demo;

fn main() {
    if demo::serve_if_asked() {
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let size = demo::Size {
        operations: 300,
        concurrency: 8,
        kill_every: 100,
    };
    let outcome = match runtime.block_on(demo::run(size)) {
        Ok(outcome) => outcome,
        Err(e) if e.contains("unreachable") => {
            common::unreachable("PostgreSQL", &e);
            return;
        }
        Err(e) => panic!("the loop could not run: {e}"),
    };
    print!("{}", outcome.table());
    assert!(outcome.failures.is_empty(), "{:?}", outcome.failures);
    assert!(outcome.ours_exact(), "ours: every step once, each answered");
    assert!(
        outcome.kills >= 3,
        "a kill per marked step: {}",
        outcome.kills
    );
    assert!(
        outcome.settled >= 1,
        "a killed step's outcome was settled by reconciliation"
    );
    assert!(outcome.lost >= 1, "replies were lost");
    let (_, _, _, newkey_duplicates, _) = outcome.clients[1];
    assert!(
        newkey_duplicates > 0,
        "the faults make a new key per attempt duplicate effects"
    );
    println!("agent_loop_kills: ok");
}
