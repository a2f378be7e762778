//! Fingerprint speed: our canonical JSON fingerprint against serde_json's parse alone and the
//! `serde_json_canonicalizer` reference (+ SHA-256), and the raw-bytes fingerprint against plain
//! SHA-256. Every row is a ratio against a baseline measured in the same run.
//!
//! `cargo bench -p suite --bench fingerprint`

use std::hint::black_box;
use std::time::{Duration, Instant};

use http::Request;
use sha2::{Digest, Sha256};
use tower_idempotency::fingerprint::Fingerprint;

/// Median nanoseconds per call over several timed batches.
fn measure(mut f: impl FnMut()) -> f64 {
    // Warm up, then size a batch to about 20 ms.
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < Duration::from_millis(50) {
        f();
        n += 1;
    }
    let batch = (n * 20 / 50).max(1);
    let mut samples: Vec<f64> = (0..15)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..batch {
                f();
            }
            t.elapsed().as_nanos() as f64 / batch as f64
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// A JSON document of roughly `size` bytes: nested objects, arrays, strings, numbers.
fn document(size: usize) -> Vec<u8> {
    let mut items = Vec::new();
    let mut i = 0u64;
    loop {
        let item = serde_json::json!({
            "id": i,
            "title": format!("ticket number {i} about the printer on floor {}", i % 7),
            "priority": (i % 5) as f64 / 2.0 + 0.1,
            "tags": ["ops", "printer", "urgent"],
            "assignee": { "name": "Zoë", "team": "ops", "active": i.is_multiple_of(2) },
        });
        items.push(item);
        let doc = serde_json::json!({ "tool": "create_ticket", "items": items });
        let bytes = serde_json::to_vec(&doc).expect("serialize");
        if bytes.len() >= size || size < 200 {
            return if size < 200 {
                serde_json::to_vec(&serde_json::json!({"tool": "create_ticket", "title": "printer on fire", "priority": 2, "ok": true, "requester": "ops@example.com"}))
                    .expect("serialize")
            } else {
                bytes
            };
        }
        i += 1;
    }
}

/// Compact JSON with every object's members in reverse order (as a client that does not sort
/// might send it).
fn write_reversed(value: &serde_json::Value, out: &mut Vec<u8>) {
    match value {
        serde_json::Value::Object(members) => {
            out.push(b'{');
            for (i, (name, member)) in members.iter().rev().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                serde_json::to_writer(&mut *out, name).expect("write");
                out.push(b':');
                write_reversed(member, out);
            }
            out.push(b'}');
        }
        serde_json::Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_reversed(item, out);
            }
            out.push(b']');
        }
        other => serde_json::to_writer(&mut *out, other).expect("write"),
    }
}

fn main() {
    let parts = |ct: &str| {
        Request::post("/tools/create_ticket")
            .header("content-type", ct)
            .body(())
            .expect("request")
            .into_parts()
            .0
    };
    let json_parts = parts("application/json");
    let raw_parts = parts("application/octet-stream");

    println!(
        "machine: {} cores; times are medians of 15 batches",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "\n{:<34} {:>10} {:>10} {:>10} {:>12} {:>12}",
        "JSON document", "ours µs", "parse µs", "ref+sha µs", "ours/parse", "ref/ours"
    );
    // Compact with sorted members is already canonical (the verbatim check, then one hash).
    // The same bytes with members in reverse order, and pretty-printed, take the full path
    // (parse, sort, write the canonical form, hash).
    let docs = [100, 1024, 64 * 1024].into_iter().flat_map(|size| {
        let compact = document(size);
        let value: serde_json::Value = serde_json::from_slice(&compact).expect("parse");
        let mut reversed = Vec::new();
        write_reversed(&value, &mut reversed);
        let pretty = serde_json::to_vec_pretty(&value).expect("serialize");
        [
            (size, "canonical", compact),
            (size, "unsorted", reversed),
            (size, "pretty", pretty),
        ]
    });
    let mut verdicts = Vec::new();
    for (size, form, doc) in docs {
        let ours = measure(|| {
            black_box(Fingerprint::of(&json_parts, black_box(&doc)).expect("fingerprint"));
        });
        let parse = measure(|| {
            black_box(serde_json::from_slice::<serde_json::Value>(black_box(&doc)).expect("parse"));
        });
        let reference = measure(|| {
            let canonical = serde_json_canonicalizer::to_vec(
                &serde_json::from_slice::<serde_json::Value>(black_box(&doc)).expect("parse"),
            )
            .expect("canonicalize");
            black_box(Sha256::digest(&canonical));
        });
        println!(
            "{:<34} {:>10.2} {:>10.2} {:>10.2} {:>11.2}x {:>11.2}x",
            format!("{} bytes, {form}", doc.len()),
            ours / 1e3,
            parse / 1e3,
            reference / 1e3,
            ours / parse,
            reference / ours
        );
        if size == 1024 {
            let met = ours <= 6e3 && reference / ours >= 3.0;
            verdicts.push(format!(
                "{form} {:.2} µs {:.1}x {}",
                ours / 1e3,
                reference / ours,
                if met { "met" } else { "missed" }
            ));
        }
    }
    println!(
        "target: 1 KiB in at most 6 µs and at least 3x the reference: {}",
        verdicts.join("; ")
    );

    println!(
        "\n{:<34} {:>10} {:>10} {:>12}",
        "raw body", "ours µs", "sha256 µs", "ours/sha256"
    );
    for size in [100, 1024, 64 * 1024] {
        let body = vec![0x5a; size];
        let ours = measure(|| {
            black_box(Fingerprint::of(&raw_parts, black_box(&body)).expect("fingerprint"));
        });
        let sha = measure(|| {
            black_box(Sha256::digest(black_box(&body)));
        });
        println!(
            "{:<34} {:>10.3} {:>10.3} {:>11.2}x",
            format!("{size} bytes"),
            ours / 1e3,
            sha / 1e3,
            ours / sha
        );
    }
}
