//! The effect sink the process-level reviews count at: a file every process appends to.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

/// One effect of `key`: one line appended with one `write` (atomic under `O_APPEND`), before
/// the handler answers; a SIGKILL after it keeps it (the page cache outlives the process).
pub fn effect(sink: &Path, key: &str) {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(sink)
        .expect("sink");
    file.write_all(format!("{key}\n").as_bytes())
        .expect("write the effect");
}

/// Each key's effects, counted.
pub fn effects(sink: &Path) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for line in std::fs::read_to_string(sink).unwrap_or_default().lines() {
        *counts.entry(line.to_owned()).or_insert(0) += 1;
    }
    counts
}

/// `key`'s effects, counted.
pub fn effects_of(sink: &Path, key: &str) -> usize {
    effects(sink).get(key).copied().unwrap_or(0)
}
