//! The last test binary of a run (cargo runs a package's tests in name order): one line that
//! counts the tests this run skipped because a server was unreachable, so a skip is never
//! mistaken for a pass. Under `CI=true` nothing skips: those tests fail instead.

mod common;

fn main() {
    let skipped = common::skip_log::take();
    if skipped.is_empty() {
        println!("skipped tests: none");
        return;
    }
    println!();
    for line in &skipped {
        println!("  {line}");
    }
    println!(
        "skipped tests: {} (servers unreachable; run `bash .ci/run` or start them, CI=true makes these fail)",
        skipped.len()
    );
    // The skips themselves already failed under CI; this says it once more, as a failure.
    assert!(
        !common::under_ci(),
        "{} tests skipped under CI=true",
        skipped.len()
    );
}
