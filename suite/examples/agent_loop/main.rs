//! Why the caller's half of the contract matters: an agent loop of 10 000 workflow steps
//! against a tool server on PostgreSQL that is killed mid-request, loses replies, and answers
//! 409 and 503, run by three clients side by side. Effects are counted at the sink (a table
//! the handler inserts into), and the table shows each client's duplicates.
//!
//! ```text
//! cargo run -p suite --release --example agent_loop -- --demo [--operations N]
//! ```
//!
//! It needs PostgreSQL (`TOWER_IDEMPOTENCY_POSTGRES_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`). The test `agent_loop_kills` runs the same loop
//! with 300 steps. See `demo.rs` for the faults and the clients.

use std::process::ExitCode;

#[allow(dead_code)]
#[path = "../../tests/common/faulty.rs"]
mod faulty;

mod demo;

fn main() -> ExitCode {
    if demo::serve_if_asked() {
        return ExitCode::SUCCESS;
    }
    let args: Vec<String> = std::env::args().collect();
    if !args.iter().any(|a| a == "--demo") {
        eprintln!("usage: agent_loop --demo [--operations N]");
        return ExitCode::FAILURE;
    }
    let operations = args
        .iter()
        .position(|a| a == "--operations")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(10_000);
    let size = demo::Size {
        operations,
        concurrency: 16,
        kill_every: (operations / 10).max(2),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "{operations} workflow steps per client, 16 at a time; the server is killed about 10 \
         times mid-request..."
    );
    match runtime.block_on(demo::run(size)) {
        Ok(outcome) => {
            print!("{}", outcome.table());
            for failure in &outcome.failures {
                println!("ours failed: {failure}");
            }
            match outcome.ours_exact() {
                true => {
                    println!("ours: every step took effect once, each with its definite answer");
                    ExitCode::SUCCESS
                }
                false => ExitCode::FAILURE,
            }
        }
        Err(e) => {
            eprintln!("the demo could not run: {e}");
            ExitCode::FAILURE
        }
    }
}
